"""benchmarks/gpu_check.sh without a GPU: the dry run's plan fits the device tool's limits and the
session's 15 device-minutes with start-ups (the worst case it prints, recomputed here), every test
file and bench suite it names exists, a real call's plumbing works with stand-ins, a call's steps
stop at its deadline and `pack` still runs, a carried Triton cache is hit after the checkout moves,
and `install` takes the extension built for the device's Python (and builds when none is carried)."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEP = re.compile(r"^  (\w+) +(\d+)s  (.*)$")

# The device tool: at most 600 s a command, 15 minutes of device time a session; a fresh machine's
# start costs 1 to 2 minutes (the upper figure taken); the plan gives the machine back after each
# call (no 30 s held idle) and keeps 20 s spare.
TOOL_MAX_S, BUDGET_S, STARTUP_S, SPARE_S = 600, 900, 120, 20
MAX_FILES = 8


def _dry_run(*args):
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def _plan(text):
    calls, current = {}, None
    for line in text.splitlines():
        if line.startswith("call "):
            current = calls.setdefault(int(line.split()[1].rstrip(":")), {"steps": [], "returns": []})
        elif STEP.match(line):
            name, limit, cmd = STEP.match(line).groups()
            current["steps"].append((name, int(limit), cmd))
        elif line.startswith("  returns"):
            current["returns"] = line.split(": ", 1)[1].split()
        elif line.startswith("  run("):
            current["invocation"] = line.strip()
            current["timeout_s"] = int(re.search(r"timeout_s=(\d+)", line).group(1))
        elif line.startswith("  steps:"):
            limits, deadline, timeout, reserve = map(int, re.search(
                r"(\d+)s of limits, each capped by what is left of (\d+)s \(timeout_s=(\d+)s less "
                r"(\d+)s kept", line).groups())
            current.update(printed_limits=limits, deadline=deadline, reserve=reserve)
    return calls


def test_dry_run_worst_case_fits_the_device_budget():
    """Per call: timeout_s is at most the tool's 600 s and its steps' deadline keeps a reserve for
    `pack`, the last step; over the calls, start-up + timeout_s come to at most 15 minutes less the
    spare, and the dry run prints that sum."""
    rc, text = _dry_run()
    assert rc == 0, text
    calls = _plan(text)
    assert sorted(calls) == [1, 2], text
    worst = 0
    for n, call in calls.items():
        limits = [limit for _, limit, _ in call["steps"]]
        assert call["printed_limits"] == sum(limits), (n, text)
        assert call["timeout_s"] <= TOOL_MAX_S and call["deadline"] == call["timeout_s"] - call["reserve"]
        pack = call["steps"][-1]
        assert pack[0] == "pack" and pack[1] + 5 + 5 <= call["reserve"], call["steps"]
        assert f'--call {n}"' in call["invocation"] and 'carry=[".gpu_carry"]' in call["invocation"]
        assert 1 <= len(call["returns"]) <= MAX_FILES and "summary.txt" in call["returns"]
        assert "results.tar.gz" in call["returns"]
        worst += STARTUP_S + call["timeout_s"]
    assert worst <= BUDGET_S - SPARE_S, f"worst case {worst} s > {BUDGET_S - SPARE_S} s"
    assert f"worst case: {worst}s of device time" in text and "fits" in text.splitlines()[-1]
    assert f"start-up assumed {STARTUP_S}s" in text
    rc, one = _dry_run("--call", "2")
    assert rc == 0 and sorted(_plan(one)) == [2]


def _suites(cmd):
    return [s for m in re.findall(r"--suites (\S+)", cmd) for s in m.split(",")]


def test_plan_order_and_bench_bounds():
    """The most valuable steps first (install, single-rank tests, virtual ranks, then the figures),
    a call returns the build and the cache, call 2 installs and unpacks the cache before anything
    uses them; a bench step's suites stop (--suite-timeout) and its collectives give up (--timeout)
    well inside the step's limit."""
    calls = _plan(_dry_run()[1])
    one = [s[0] for s in calls[1]["steps"]]
    assert one.index("install") < one.index("tests_kernels") < one.index("virtual") < one.index("bench_1gpu")
    assert one[-1] == "pack"
    returns = calls[1]["returns"]
    assert any(f.endswith(".so") for f in returns) and "triton_cache.tar.gz" in returns
    two = [s[0] for s in calls[2]["steps"]]
    assert "build" not in two and two[:3] == ["env", "install", "cache"] and two[-1] == "pack"
    for call in calls.values():
        for name, limit, cmd in call["steps"]:
            if "$BENCH" not in cmd:
                continue
            suite_timeout = float(re.search(r"--suite-timeout (\S+)", cmd).group(1))
            assert len(_suites(cmd)) * suite_timeout + 30 <= limit, (name, limit, cmd)
            assert float(re.search(r"--timeout (\S+)", cmd).group(1)) < limit, (name, cmd)


def test_plan_names_only_what_exists():
    """Every test file, script and bench suite the plan runs is in the repository."""
    _, text = _dry_run()
    cmds = " ".join(cmd for call in _plan(text).values() for _, _, cmd in call["steps"])
    paths = set(re.findall(r"\b(?:tests|benchmarks)/[\w/]+\.py\b", cmds))
    assert paths and all((ROOT / p).exists() for p in paths), paths
    suites = _suites(cmds)
    assert suites and all((ROOT / "benchmarks" / f"bench_{s}.py").exists() for s in suites), suites
    functions = set(re.findall(r"^(gpu_\w+)\(\)", SCRIPT.read_text(), re.M))
    used = {cmd.split()[0] for call in _plan(text).values() for _, _, cmd in call["steps"]
            if cmd.startswith("gpu_")}
    assert used and used <= functions, used - functions


def _call(checkout, *args, tmp_path, tag, **env_extra):
    """``gpu_check.sh ARGS`` run from the checkout ``checkout``; its $OUT and results folders."""
    out, res = tmp_path / f"out_{tag}", tmp_path / f"res_{tag}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(out), GPU_CHECK_RESULTS=str(res), **env_extra)
    proc = subprocess.run(["bash", str(checkout / "benchmarks" / "gpu_check.sh"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc, out, res


def _log(res, name):
    logs = list(res.glob(f"*/call*/{name}.log"))
    assert len(logs) == 1, logs
    return logs[0].read_text()


def test_a_call_records_every_step_and_returns_files(tmp_path):
    """Call 2 with stand-ins (PYTHON=true: every Python step passes at once; the sanitizer is
    missing and `install` cannot ask this Python for its extension's name, so those steps fail):
    every step is in summary.txt with its rc, $OUT holds the summary, env.txt and the results
    tarball, and the call's status is 1."""
    proc, out, _ = _call(ROOT, "--call", "2", tmp_path=tmp_path, tag="c2", PYTHON="true",
                         PATH="/usr/bin:/bin", TMPDIR=str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    rcs = dict(re.findall(r"^(\w+) +rc=(\d+)", summary, re.M))
    assert set(rcs) == {"env", "install", "cache", "overhead_w1", "bench_vr8", "virtual_fp16", "symm_probe",
                        "symm_w2", "memcheck_w2", "pack"}, summary
    assert rcs["install"] != "0" and rcs["memcheck_w2"] != "0", summary
    # the cache step unpacks what this checkout carries, if it carries one
    carried = (ROOT / ".gpu_carry" / "triton_cache.tar.gz").exists()
    assert (rcs["cache"] == "0") == carried, summary
    assert rcs["overhead_w1"] == "0" and rcs["symm_w2"] == "0", summary
    with tarfile.open(out / "results.tar.gz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {"install.log", "overhead_w1.log", "summary.txt"} <= logs, logs
    assert (out / "env.txt").exists()


WARM_STANDIN = '''
"""Stand-in for a step that runs a kernel: compiles a kernel for sm_90 (no GPU needed) into TRITON_CACHE_DIR
and says whether the cache had it (no cache file written) or it compiled."""
import os
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)


def cache_files():
    root = Path(os.environ["TRITON_CACHE_DIR"])
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


before = cache_files() if Path(os.environ["TRITON_CACHE_DIR"]).exists() else {}
sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
triton.compile(ASTSource(fn=scale_kernel, signature=sig, constexprs={"BLOCK": 256}),
               target=GPUTarget("cuda", 90, 32))
print("warm:", "cache hit" if cache_files() == before else "compiled")
'''


def _checkout(path, files):
    """A stand-in checkout: the real gpu_check.sh, and ``files`` (relative path -> text)."""
    (path / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, path / "benchmarks" / "gpu_check.sh")
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


def test_carried_triton_cache_is_hit_after_the_checkout_moves(tmp_path):
    """Call 1's warm step compiles (sm_90, into the script's TRITON_CACHE_DIR) and `pack` returns
    the cache; then, as on the next machine, nothing of call 1 is left but the returned tarball
    and the checkout sits at another path: call 2's `cache` step unpacks it, and the same kernel
    compiled there is a cache hit (Triton's group files hold absolute paths: a cache unpacked
    anywhere but where it was made is never hit)."""
    checkout = _checkout(tmp_path / "a", {"benchmarks/probe_symm_mem.py": WARM_STANDIN})
    machine = tmp_path / "machine"  # the device's TMPDIR: what a fresh machine does not keep
    machine.mkdir()
    env = dict(PYTHON=sys.executable, TMPDIR=str(machine))
    proc, out, res = _call(checkout, "--call", "1", "--only", "symm_probe,pack", tmp_path=tmp_path,
                           tag="call1", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warm: compiled" in _log(res, "symm_probe")
    tarball = out / "triton_cache.tar.gz"
    assert tarball.exists()

    shutil.rmtree(machine)
    machine.mkdir()
    moved = tmp_path / "elsewhere" / "b"
    moved.parent.mkdir()
    checkout.rename(moved)
    shutil.rmtree(moved / ".gpu_carry", ignore_errors=True)  # it holds what is carried, no more
    (moved / ".gpu_carry").mkdir()
    shutil.copy(tarball, moved / ".gpu_carry")
    proc, _, res = _call(moved, "--call", "2", "--only", "cache", tmp_path=tmp_path, tag="unpack",
                         **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr + _log(res, "cache")
    proc, _, res = _call(moved, "--call", "2", "--only", "symm_probe", tmp_path=tmp_path,
                         tag="again", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warm: cache hit" in _log(res, "symm_probe"), _log(res, "symm_probe")


PIP_STANDIN = """#!/bin/sh
# this Python for the extension-suffix query; every other call (pip, the import check) succeeds
case "$*" in *sysconfig*) exec {python} "$@" ;; esac
echo "stand-in: $*"
"""


def test_install_takes_the_extension_of_the_device_python(tmp_path):
    """With a build for another Python in .gpu_carry (sorting first), `install` copies the one
    whose tag is this Python's and installs with it; with none for this Python, it says which file
    it looked for and builds (here the stand-in build makes no extension, so the step fails)."""
    right = "_C" + sysconfig.get_config_var("EXT_SUFFIX")
    major, minor = sys.version_info[:2]
    stale = right.replace(f"-{major}{minor}-", f"-{major}{minor - 1}-")
    assert stale != right and sorted([right, stale])[0] == stale  # what `ls | head -1` would take
    checkout = _checkout(tmp_path / "c", {f".gpu_carry/{stale}": "stale build",
                                          f".gpu_carry/{right}": "this Python's build",
                                          "pyfused/__init__.py": ""})
    python = tmp_path / "python"
    python.write_text(PIP_STANDIN.format(python=sys.executable))
    python.chmod(0o755)
    proc, _, res = _call(checkout, "--call", "2", "--only", "install", tmp_path=tmp_path, tag="ok",
                         PYTHON=str(python))
    log = _log(res, "install")
    assert proc.returncode == 0 and f"carried extension: .gpu_carry/{right}" in log, log
    assert "SKIP_CUDA_BUILD" not in log and "building" not in log, log
    assert (checkout / "pyfused" / right).read_text() == "this Python's build"
    assert not (checkout / "pyfused" / stale).exists()

    (checkout / ".gpu_carry" / right).unlink()
    (checkout / "pyfused" / right).unlink()
    proc, _, res = _call(checkout, "--call", "2", "--only", "install", tmp_path=tmp_path,
                         tag="missing", PYTHON=str(python))
    log = _log(res, "install")
    assert proc.returncode == 1 and f"no .gpu_carry/{right}" in log and stale in log, log
    assert "building" in log and "stand-in: -m pip install" in log.split("building", 1)[1], log
    assert not list((checkout / "pyfused").glob("_C*"))


SLOW_BENCH_PYTHON = """#!/bin/sh
# a stand-in Python whose benchmark runs never end; everything else returns at once
case "$*" in *pyfused.bench*) exec sleep 60 ;; esac
"""


def test_steps_stop_at_the_call_deadline_and_pack_still_runs(tmp_path):
    """With a call's timeout_s of 42 s (deadline 17 s) and a bench step that would run 60 s: the
    bench step is cut at the deadline instead of its own 100 s, the steps after it are recorded as
    not run, and `pack` runs; the call ends well inside its timeout_s and fails."""
    slow = tmp_path / "slow_python"
    slow.write_text(SLOW_BENCH_PYTHON)
    slow.chmod(0o755)
    proc, out, _ = _call(ROOT, "--call", "2", "--timeout", "42", "--only",
                         "env,overhead_w1,symm_w2,memcheck_w2,pack", tmp_path=tmp_path, tag="late",
                         PYTHON=str(slow), TMPDIR=str(tmp_path))
    summary = (out / "summary.txt").read_text()
    rcs = dict(re.findall(r"^(\w+) +rc=(\S+)", summary, re.M))
    assert proc.returncode == 1, summary
    assert rcs["overhead_w1"] == "124", summary
    assert rcs["symm_w2"] == "-" and rcs["memcheck_w2"] == "-" and "pack" in rcs, summary
    limit = int(re.search(r"^overhead_w1 +rc=124 +\d+s of +(\d+)s", summary, re.M).group(1))
    assert 15 <= limit <= 17, summary
