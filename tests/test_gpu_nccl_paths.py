"""benchmarks/gpu_nccl_paths.py under torchrun (2 ranks, gloo): every path passes against its
single-process reference; in one run, a perturbed path is reported as FAIL with a non-zero exit
status, a path failing on one rank only (planted, the other rank waiting in a collective) ends at
the group's timeout as FAIL, and the path after it as not run.

This is how CI knows the script the device runs over NCCL works. Cost on the 2-core box: ~20 s for
all paths (mostly imports and parallelize's Llama), ~15 s for the run of the failing ones.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.nccl_path_checks import PATHS

pytest.importorskip("transformers", reason="the parallelize and moe paths need transformers")

ROOT = Path(__file__).resolve().parents[1]


# A path that fails on rank 1 only, while rank 0 waits in a collective for it.
PLANTED = """
import sys
import torch
import torch.distributed as dist
from benchmarks import gpu_nccl_paths, nccl_path_checks

def one_rank_fails(cmp, rank, world, device):
    if rank == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.all_reduce(torch.ones(1))

nccl_path_checks.PATHS["one_rank_fails"] = one_rank_fails
sys.exit(gpu_nccl_paths.main())
"""


def run_script(out: Path, *args: str, script: Path | None = None, group_timeout: int = 60,
               timeout: float = 240) -> subprocess.CompletedProcess:
    script = script or ROOT / "benchmarks" / "gpu_nccl_paths.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--device", "cpu", "--backend", "gloo", "--out", str(out),
           "--group-timeout", str(group_timeout), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def verdicts(stdout: str) -> dict:
    """``{path: "PASS" | "FAIL"}`` from rank 0's result lines."""
    found = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and not line.startswith(" ") and parts[1] in ("PASS", "FAIL"):
            found[parts[0]] = parts[1]
    return found


def rows(out: Path) -> list:
    return [json.loads(line) for line in (out / "nccl_paths.jsonl").read_text().splitlines()]


def test_every_path_passes(tmp_path):
    proc = run_script(tmp_path)
    log = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert verdicts(proc.stdout) == {p: "PASS" for p in PATHS}, log
    got = rows(tmp_path)
    assert [r["path"] for r in got] == list(PATHS)
    assert all(r["passed"] and r["world"] == 2 and r["max_abs_diff"] < 1e-3 for r in got), got


def test_failures_are_reported_and_bounded(tmp_path):
    """One run: a perturbed path is FAIL while the group stays whole; a path failing on one rank
    only ends at the group timeout as FAIL; the path after it is reported as not run."""
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    out = tmp_path / "out"
    proc = run_script(out, "--paths", "ddp,one_rank_fails,ring_attention", "--perturb", "ddp",
                      script=script, group_timeout=5)
    log = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0, log
    assert verdicts(proc.stdout) == {"ddp": "FAIL", "one_rank_fails": "FAIL",
                                     "ring_attention": "FAIL"}, log
    ddp, failed, after = rows(out)
    assert not ddp["passed"] and not ddp["group_broken"] and ddp["n_failures"] > 0, ddp
    assert ddp["max_abs_diff"] > 1e-3 and not ddp["errors"], ddp
    assert failed["group_broken"] and any("could not agree" in e for e in failed["errors"]), failed
    assert after["errors"] == ["not run: the process group broke in one_rank_fails"], after


def test_unknown_path_is_refused(tmp_path):
    from benchmarks.gpu_nccl_paths import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), "--paths", "ddp,nope"])
