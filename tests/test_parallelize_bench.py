"""benchmarks/bench_parallelize.py runs on 2 gloo ranks: one row per family and variant, the same loss
for torch's DTensor TP and pyfused's TP / TP+SP (the suite refuses to time a wrong result), finite
timings."""
import math

import pytest

pytest.importorskip("transformers", reason="bench_parallelize needs transformers (the 'models' extra)")


def _run_suite(rank, world):
    import torch
    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_parallelize

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1)
    return bench_parallelize.run(ctx)


def test_bench_parallelize_quick(ranks):
    rows = ranks.run(2, _run_suite, timeout=180)[0]
    variants = ["torch-tp", "pyfused-tp", "pyfused-tp+sp"]
    assert [(r["family"], r["method"]) for r in rows] == [
        (f, v) for f in ("llama", "phi3", "gemma2") for v in variants]
    for r in rows:
        assert r["status"] == "ok" and r["time_ms"] > 0 and math.isfinite(r["tokens_per_s"]), r
        assert r["tp"] == 2 and r["transport"] == "gloo", r
