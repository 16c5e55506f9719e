"""benchmarks/bench_fsdp.py runs on 2 gloo ranks: its rows, finite timings (the best sample and the
median, and their speedups) and memory columns (the suite refuses to time pyfused if one step does
not give torch FSDP2's model)."""
import math


def _run_suite(rank, world):
    import torch
    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_fsdp

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=3)
    return bench_fsdp.run(ctx)


def test_bench_fsdp_quick(ranks):
    rows = ranks.run(2, _run_suite, timeout=300)[0]
    assert [r["method"] for r in rows] == ["compute alone", "comm alone", "torch-fsdp2", "pyfused"]
    for r in rows:
        assert r["status"] == "ok" and 0 < r["time_ms"] <= r["median_ms"], r  # best <= median
    for r in rows[2:]:
        assert r["transport"] == "gloo" and math.isfinite(r["comm_hidden"]), r
        assert r["state_MB"] > 0 and r["peak_MB"] > r["state_MB"], r
        assert r["speedup"] > 0 and r["median_speedup"] > 0 and r["samples"] == 3, r
    torch_row, pyfused_row = rows[2:]
    assert torch_row["speedup"] == 1.0 and torch_row["median_speedup"] == 1.0, torch_row
    # the suite's estimator: time_ms is the fastest of the samples, median_ms their median
    assert pyfused_row["speedup"] == torch_row["time_ms"] / pyfused_row["time_ms"], pyfused_row
