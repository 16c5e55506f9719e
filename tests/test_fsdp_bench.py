"""benchmarks/bench_fsdp.py runs on 2 gloo ranks: its rows, finite timings and memory columns (the
suite refuses to time pyfused if one step does not give torch FSDP2's model)."""
import math


def _run_suite(rank, world):
    import torch
    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_fsdp

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1)
    return bench_fsdp.run(ctx)


def test_bench_fsdp_quick(ranks):
    rows = ranks.run(2, _run_suite, timeout=300)[0]
    assert [r["method"] for r in rows] == ["compute alone", "comm alone", "torch-fsdp2", "pyfused"]
    for r in rows:
        assert r["status"] == "ok" and r["time_ms"] > 0, r
    for r in rows[2:]:
        assert r["transport"] == "gloo" and math.isfinite(r["comm_hidden"]), r
        assert r["state_MB"] > 0 and r["peak_MB"] > r["state_MB"], r
