"""benchmarks/profile_fused_host.py, the fused path's host time by component, runs on CPU: its stubs
replace the launches it means to replace (the launch component is the stub's), and the compiled
launch path it times with a stand-in driver still binds the persistent GEMM's arguments."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "profile_fused_host.py")


def _run(*args, interpret: bool):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.interpreter
def test_profile_splits_each_fused_op_by_component():
    out = _run("--rounds", "1", "--calls", "3", "--profile", interpret=True)
    lines = {line.split(":")[0]: line for line in out.splitlines() if "us per call" in line}
    # every Triton launch of the schedule went to the stub: the GEMM, and for reduce-scatter the reduce
    assert "1 stubbed launches per call" in lines["all_gather_matmul 16x256x256, world 1"], out
    assert "2 stubbed launches per call" in lines["matmul_reduce_scatter 16x256x256, world 1"], out
    assert out.count("launch (stub)") == 2 and out.count("symmetric buffer") == 2, out


def test_profile_times_the_compiled_launch_path():
    out = _run("--jit-launch", "--rounds", "1", "--calls", "3", interpret=False)
    assert "through JITFunction.run" in out, out
