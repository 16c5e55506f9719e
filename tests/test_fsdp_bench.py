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


def test_bench_fsdp_quick_with_hsdp_rows(ranks):
    # 4 ranks on one host: the FSDP rows over all 4, the HSDP rows on a 2 x 2 mesh
    rows = ranks.run(4, _run_suite, timeout=300)[0]
    assert [(r["method"], r["mesh"]) for r in rows] == [
        ("compute alone", "1"), ("comm alone", "4"), ("torch-fsdp2", "4"), ("pyfused", "4"),
        ("comm alone hsdp", "2x2"), ("torch-fsdp2 hsdp", "2x2"), ("pyfused hsdp", "2x2")]
    # the root and 3 blocks: 4 + 3 gathers, 4 reduce-scatters, 4 all-reduces across replicas
    assert "15 collectives" in rows[4]["note"], rows[4]
    torch_row, pyfused_row = rows[5:]
    for r in (torch_row, pyfused_row):
        assert r["status"] == "ok" and 0 < r["time_ms"] <= r["median_ms"], r
        assert r["state_MB"] > 0 and r["peak_MB"] > r["state_MB"], r
    assert torch_row["speedup"] == 1.0, torch_row
    assert pyfused_row["speedup"] == torch_row["time_ms"] / pyfused_row["time_ms"], pyfused_row
