"""examples/train_llm.py under torchrun (2 ranks, gloo): the loss falls, it follows the single-process
run's losses, and a run resumed from a checkpoint continues from the saved step with exactly the
losses of the uninterrupted run (same batches, restored model shards and optimizer state)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="examples/train_llm.py needs transformers (the 'models' extra)")

ROOT = Path(__file__).resolve().parents[1]
# Tiny on purpose (2-core CI box): the two launches of one mesh take ~30 s, mostly imports.
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
        "--seq", "16", "--batch", "8", "--lr", "1e-2", "--log-every", "1"]


def torchrun(args, tmp_path, timeout=240, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "examples" / "train_llm.py"), *TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("mesh", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_train_loss_falls_and_resume_continues(tmp_path, mesh):
    ckpt = tmp_path / "ckpt"
    out = torchrun([*mesh, "--steps", "12", "--save-every", "6", "--ckpt-dir", str(ckpt),
                    "--metrics-file", "a.jsonl"], tmp_path)
    assert "mesh dp=1 x pp=" in out and "tokens/s" in out, out
    a = metrics(tmp_path / "a.jsonl")
    assert [m["step"] for m in a] == list(range(1, 13))
    first, last = sum(m["loss"] for m in a[:2]) / 2, sum(m["loss"] for m in a[-2:]) / 2
    assert last < first - 0.2, f"loss did not fall: {[round(m['loss'], 4) for m in a]}"
    assert (ckpt / "latest").read_text() == "step_000012"

    # the same training on one process: the parallel run is the same computation
    torchrun(["--steps", "12", "--metrics-file", "single.jsonl"], tmp_path, nproc=1)
    single = metrics(tmp_path / "single.jsonl")
    for ma, ms in zip(a, single):
        assert abs(ma["loss"] - ms["loss"]) <= 1e-3 * abs(ms["loss"]), (ma, ms)

    out = torchrun([*mesh, "--steps", "12", "--save-every", "6", "--ckpt-dir", str(ckpt),
                    "--resume", "step_000006", "--metrics-file", "b.jsonl"], tmp_path)
    assert "resumed at step 6" in out, out
    b = metrics(tmp_path / "b.jsonl")
    assert [m["step"] for m in b] == list(range(7, 13))
    for ma, mb in zip(a[6:], b):
        assert abs(ma["loss"] - mb["loss"]) <= 1e-5 * abs(ma["loss"]), (ma, mb)
