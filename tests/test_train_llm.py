"""examples/train_llm.py under torchrun (2 ranks, gloo).

One uninterrupted tp=2 run with a DCP checkpoint every 2 steps is the reference: its loss falls, it
follows the single-process run's losses, every checkpoint is marked complete. An elastic run
(``torchrun --max-restarts 2``) in which rank 1 SIGKILLs itself during a training step and, once
restarted, inside DCP's write of a checkpoint (its shards on disk, the checkpoint unfinished) is
restarted by torchrun twice, resumes each time from the newest *complete* checkpoint and finishes
with exactly the reference's losses. A run resumed from a tp=2 checkpoint at pp=2 (DCP reshards)
follows them too.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import long_test

pytest.importorskip("transformers", reason="examples/train_llm.py needs transformers (the 'models' extra)")

ROOT = Path(__file__).resolve().parents[1]
# Tiny on purpose (2-core CI box): a launch takes ~10 s, mostly imports.
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
        "--seq", "16", "--batch", "8", "--lr", "1e-2", "--log-every", "1"]
STEPS = 10


def torchrun(args, cwd, timeout=240, nproc=2, restarts=0, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), str(ROOT / "examples" / "train_llm.py"), *TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def complete(ckpt):
    """The checkpoint folders of ``ckpt`` (no staging folder left behind), those complete marked."""
    from pyfused.parallelize import checkpoint

    folders = sorted(ckpt.iterdir())
    assert all(d.name.startswith("step_") and d.name[5:].isdigit() for d in folders
               if d.is_dir()), [d.name for d in folders]
    return [d.name for d in folders if d.is_dir() and checkpoint.is_complete(d)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted tp=2 run: (its folder, its checkpoint folder, its per-step losses)."""
    cwd = tmp_path_factory.mktemp("reference")
    out = torchrun(["--tp", "2", "--steps", str(STEPS), "--save-every", "2", "--ckpt-dir", "ckpt",
                    "--metrics-file", "a.jsonl"], cwd)
    assert "mesh dp=1 x pp=1 x tp=2" in out and "starting at step 0" in out, out
    a = metrics(cwd / "a.jsonl")
    assert [m["step"] for m in a] == list(range(1, STEPS + 1))
    assert complete(cwd / "ckpt") == [f"step_{s:06d}" for s in range(2, STEPS + 1, 2)]
    return cwd, cwd / "ckpt", [m["loss"] for m in a]


def test_loss_falls_and_follows_the_single_process_run(reference):
    cwd, _, losses = reference
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first - 0.2, f"loss did not fall: {[round(v, 4) for v in losses]}"
    # the same training on one process: the parallel run is the same computation
    torchrun(["--steps", str(STEPS), "--metrics-file", "single.jsonl"], cwd, nproc=1)
    single = [m["loss"] for m in metrics(cwd / "single.jsonl")]
    for step, (lp, ls) in enumerate(zip(losses, single), 1):
        assert abs(lp - ls) <= 1e-3 * abs(ls), (step, lp, ls)


@long_test("the elastic restart after killed ranks (two torchrun restarts; the multi-host "
           "host-loss cases in tests/test_host_loss.py cover it across hosts)")
def test_elastic_run_survives_killed_ranks(reference, tmp_path):
    # rank 1 dies in step 3's training (the newest complete checkpoint is step 2's), then, restarted,
    # inside the write of step 6's checkpoint (its shards on disk): step 4's is the newest complete one
    _, _, losses = reference
    out = torchrun(["--tp", "2", "--steps", str(STEPS), "--save-every", "2", "--ckpt-dir", "ckpt",
                    "--metrics-file", "b.jsonl"], tmp_path, restarts=2,
                   env={"TRAIN_LLM_FAULT": "1:3:train,1:6:save"})
    for text in ("starting at step 0", "rank 1: killing itself (train, step 3)",
                 "resumed at step 2 from", "rank 1: killing itself (save, step 6)",
                 "resumed at step 4 from"):
        assert text in out, (text, out)
    steps = [m["step"] for m in metrics(tmp_path / "b.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6, *range(5, STEPS + 1)], steps
    for m in metrics(tmp_path / "b.jsonl"):
        assert m["loss"] == losses[m["step"] - 1], (m, losses)  # the same computation, bit for bit
    assert complete(tmp_path / "ckpt") == [f"step_{s:06d}" for s in range(2, STEPS + 1, 2)]


def test_resume_on_another_mesh(reference, tmp_path):
    _, ckpt, losses = reference
    out = torchrun(["--pp", "2", "--steps", str(STEPS), "--ckpt-dir", str(ckpt),
                    "--resume", "step_000006", "--metrics-file", "c.jsonl"], tmp_path)
    assert "mesh dp=1 x pp=2 x tp=1" in out and "resumed at step 6" in out, out
    c = metrics(tmp_path / "c.jsonl")
    assert [m["step"] for m in c] == list(range(7, STEPS + 1))
    for m in c:  # another mesh sums in another order: equal within rounding
        ref = losses[m["step"] - 1]
        assert abs(m["loss"] - ref) <= 1e-5 * abs(ref), (m, ref)
