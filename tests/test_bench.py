"""The benchmark harness's formulas, the shape lists, and the CLI end to end (2 gloo ranks)."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pyfused.bench import cli
from pyfused.bench.harness import (
    BenchContext,
    bandwidths,
    best_speedup,
    interleaved_samples,
    median_interval,
    op_row,
    overlap_efficiency,
    paired_interval,
    paired_speedup,
    speedup,
    tensor_bytes,
    tflops,
    write_results,
)
from pyfused.benchmarks import shapes
from pyfused.ops.registry import OPS

REPO = Path(__file__).resolve().parents[1]
META = ("device", "backend", "world", "torch", "commit", "time", "validate", "iters", "transport")
# The GEMM ops' suites (benchmarks/bench_<op>.py) and their collectives.
OP_SUITES = {name: spec.collective for name, spec in OPS.items() if spec.gemm}


def _ctx(world: int) -> BenchContext:
    return BenchContext(0, world, None, torch.device("cpu"), "gloo")


# ---- formulas, against numbers worked out by hand ---------------------------------------------

def test_tflops_and_speedup():
    # 2*M*N*K = 2 * 1024^3 = 2147483648 FLOP in 2 ms -> 1.073741824e12 FLOP/s
    assert tflops(2 * 1024 ** 3, 2.0) == pytest.approx(1.073741824)
    assert speedup(12.0, 8.0) == pytest.approx(1.5)
    assert math.isnan(speedup(None, 8.0)) and math.isnan(tflops(1.0, 0.0))


def test_bandwidths_follow_nccl_tests():
    # all_gather, W=4, S = 4 ranks * 256 x 1024 bf16 = 2 MiB in 0.5 ms
    s = tensor_bytes((4 * 256, 1024), torch.bfloat16)
    assert s == 2097152
    algbw, busbw = bandwidths("all_gather", s, 0.5, 4)
    assert algbw == pytest.approx(4.194304)            # 2097152 B / 0.5e-3 s / 1e9
    assert busbw == pytest.approx(4.194304 * 3 / 4)    # (n-1)/n
    assert bandwidths("all_reduce", 1e9, 1000.0, 4) == pytest.approx((1.0, 1.5))      # 2(n-1)/n
    assert bandwidths("reduce_scatter", 1e9, 1000.0, 2) == pytest.approx((1.0, 0.5))  # (n-1)/n


def test_median_interval_is_the_sign_tests():
    """The 95% interval of a median from order statistics, against the published table (n = 10:
    2nd and 9th; n = 30: 10th and 21st; n = 40: 14th and 27th), in any input order; fewer than 6
    values give the whole range."""
    for n, (j, k) in {10: (2, 9), 30: (10, 21), 40: (14, 27)}.items():
        values = [float(v) for v in range(n, 0, -1)]
        assert median_interval(values) == (j, k)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0, 6.0]) == (1.0, 6.0)
    assert all(math.isnan(v) for v in median_interval([]))
    # the interval of the per-round ratios, which paired_speedup takes the median of
    base = [float(v) for v in range(1, 11)]
    assert paired_interval(base, [1.0] * 10) == (2.0, 9.0)


def test_paired_and_best_speedup():
    # rounds: (10, 5) -> 2, (30, 10) -> 3, (12, 12) -> 1: median 2; the medians' ratio 12/10 = 1.2
    # would hide that the variant was faster in two rounds of three
    base, mine = [10.0, 30.0, 12.0], [5.0, 10.0, 12.0]
    assert paired_speedup(base, mine) == pytest.approx(2.0)
    assert best_speedup(base, mine) == pytest.approx(10.0 / 5.0)
    assert paired_speedup([4.0, 8.0], [8.0, 4.0]) == pytest.approx(1.25)  # mean of 0.5 and 2
    assert math.isnan(paired_speedup([], []))
    assert math.isnan(best_speedup([1.0], []))


def test_rounds_run_with_collection_between_them():
    """No automatic garbage collection inside a timed call; the young generations are collected
    before each round (the objects a round left in them are gone by the next); the collector's
    state comes back afterwards."""
    import gc
    import weakref

    class Cyclic:
        pass

    seen, left = [], []

    def call():
        seen.append(gc.isenabled())
        if left:  # last round's cycle: collected between the rounds
            assert left[-1]() is None
        obj = Cyclic()
        obj.me = obj
        left.append(weakref.ref(obj))

    ctx = _ctx(1)
    assert gc.isenabled()
    samples = interleaved_samples({"a": call, "b": lambda: seen.append(gc.isenabled())}, ctx,
                                  warmup=0, iters=4)
    assert len(samples["a"]) == len(samples["b"]) == 4
    assert seen == [False] * 8 and gc.isenabled()
    gc.disable()
    try:
        interleaved_samples({"a": lambda: None}, ctx, warmup=0, iters=1)
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def test_overlap_efficiency():
    # T_gemm = 10, T_comm = 4: serial 14 -> 0, perfect max(10, 4) = 10 -> 1, 11 -> 3/4, 16 -> -1/2
    assert overlap_efficiency(10, 4, 14) == pytest.approx(0.0)
    assert overlap_efficiency(10, 4, 10) == pytest.approx(1.0)
    assert overlap_efficiency(10, 4, 11) == pytest.approx(0.75)
    assert overlap_efficiency(10, 4, 16) == pytest.approx(-0.5)
    assert math.isnan(overlap_efficiency(10, None, 11))


def test_op_row_columns():
    # all_gather_matmul on W=2: whole GEMM M=8 (2 shards of 4), K=4, N=6, fp32, 1 us
    row = op_row(_ctx(2), shape="s", dtype=torch.float32, method="decomposed", transport="gloo",
                 ms=1e-3, flop=2 * 8 * 6 * 4, collective="all_gather",
                 nbytes=tensor_bytes((8, 4), torch.float32), t_baseline=2e-3, t_gemm=0.8e-3,
                 t_comm=0.6e-3, extra_col=7)
    assert row["tflops"] == pytest.approx(384 / 1e-6 / 1e12)
    assert row["algbw_GBps"] == pytest.approx(128 / 1e-6 / 1e9)   # 8*4*4 bytes
    assert row["busbw_GBps"] == pytest.approx(0.064)               # x (2-1)/2
    assert row["speedup"] == pytest.approx(2.0)
    assert row["overlap_eff"] == pytest.approx((1.4 - 1.0) / 0.6)
    assert row["dtype"] == "float32" and row["extra_col"] == 7 and row["status"] == "ok"
    gone = op_row(_ctx(2), shape="s", dtype=torch.float32, method="fused", transport="symm-mem",
                  ms=None, flop=1.0, collective="all_gather", nbytes=1.0, t_baseline=1.0,
                  status="unavailable: no GPU")
    assert all(math.isnan(gone[c]) for c in ("time_ms", "tflops", "algbw_GBps", "speedup"))
    one = op_row(_ctx(1), shape="s", dtype=torch.float32, method="unfused", transport="none",
                 ms=1.0, collective="all_reduce", nbytes=8.0)
    assert math.isnan(one["busbw_GBps"])  # no bus traffic on one rank


def test_write_results_nan_is_empty(tmp_path):
    rows = [{"a": 1.5, "b": float("nan")}, {"a": 2.0, "c": "x"}]
    csv_path, json_path = write_results(rows, tmp_path, "t")
    assert json.loads(json_path.read_text()) == [{"a": 1.5, "b": None}, {"a": 2.0, "c": "x"}]
    with csv_path.open() as f:
        got = list(csv.DictReader(f))
    assert got == [{"a": "1.5", "b": "", "c": ""}, {"a": "2.0", "b": "", "c": "x"}]


# ---- shapes: the scaling rule ------------------------------------------------------------------

def test_llama_shapes_scaled_and_sharded():
    s = shapes.layer_shape("matmul_reduce_scatter", "llama3-8b", "mlp.down", 2, shapes.CPU_SCALE)
    assert (s.a, s.b) == ((512, 896), (896, 512))          # F 14336/8 = 1792, /2 ranks; H 4096/8
    s = shapes.layer_shape("all_gather_matmul", "llama3-70b", "mlp.gate_up", 2, shapes.CPU_SCALE)
    assert (s.a, s.b) == ((256, 1024), (1024, 3584))       # S 512/2; 2F = 57344/8 = 7168, /2
    s = shapes.layer_shape("all_gather_matmul", "llama3-8b", "attn.qkv", 3, shapes.CPU_SCALE)
    assert (s.a, s.b) == ((171, 512), (512, 256))          # S 512 -> 513 = 3*171; qkv 6144/8 / 3
    s = shapes.layer_shape("matmul_all_reduce", "llama3-70b", "mlp.down", 8, shapes.GPU_SCALE)
    assert (s.a, s.b) == ((8192, 3584), (3584, 8192))      # full size on GPU
    assert [x.label for x in shapes.parse(None, "matmul_all_reduce", 2, "cpu", True)] == \
        ["llama3-8b/16 mlp.down S=128"]
    lit = shapes.parse("64x32x48", "all_gather_matmul", 2, "cpu", False)
    assert (lit[0].a, lit[0].b) == ((64, 32), (32, 48))
    with pytest.raises(ValueError, match="divisible"):
        shapes.parse("63x32x48", "matmul_reduce_scatter", 2, "cpu", False)
    with pytest.raises(ValueError, match="unknown item"):
        shapes.validate("llama3-9b")


def test_shapes_of_a_wider_tp_group():
    """``@tp8`` with 2 or 4 ranks: each rank's GEMM is a TP=8 rank's (Llama-3 70B, full size)."""
    for w in (2, 4, 3):
        ag = shapes.parse("llama3-70b.attn.qkv@tp8", "all_gather_matmul", w, "cuda", False)[0]
        s = w * math.ceil(8192 / w)
        assert (ag.a, ag.b) == ((s // w, 8192), (8192, 1280))   # qkv (64 + 16) * 128 / 8
        assert ag.gemm_mnk[1:] == (1280, 8192) and w * ag.a[0] == s
        rs = shapes.parse("llama3-70b.mlp.down@tp8", "matmul_reduce_scatter", w, "cuda", False)[0]
        assert (rs.a, rs.b) == ((s, 3584), (3584, 8192))        # F 28672 / 8
        assert rs.label == f"llama3-70b TP=8 mlp.down S={s}"
    both = shapes.parse("llama3-70b@tp8", "matmul_all_reduce", 2, "cuda", False)
    assert [x.label.split()[2] for x in both] == ["attn.out", "mlp.down"]
    with pytest.raises(ValueError, match="@tpN"):
        shapes.validate("llama3-70b@tp0")
    with pytest.raises(ValueError, match="@tpN"):
        shapes.validate("llama3-70b@8")


def test_unknown_suite_is_a_usage_error(capsys):
    assert cli.main(["--suites", "no_such_suite"]) == 2
    assert "no suite 'no_such_suite'" in capsys.readouterr().err


# ---- the CLI end to end ------------------------------------------------------------------------

def _run(cmd, tmp_path, extra_path=None, timeout=240):
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path or ""), str(REPO),
                                                    env.get("PYTHONPATH", "")) if p)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _by(rows, **match):
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def test_overhead_suite_covers_every_op_and_method(tmp_path):
    """The overhead suite: for every op of the registry, at world sizes 1 and 2, plain torch and
    every method, with the ratio computed from the times of the same run."""
    from pyfused.comm import plans

    out = tmp_path / "out"
    r = _run([sys.executable, "-m", "pyfused.bench", "--quick", "--world", "2", "--no-progress",
              "--suites", "overhead", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = json.loads((out / "overhead.json").read_text())
    seen = {(row["op"], row["world_size"], row["method"]) for row in rows}
    assert seen == {(op, w, m) for op, spec in OPS.items() for w in (1, 2)
                    for m in ("torch", *spec.methods, "auto", f"{spec.methods[0]}, validate=always")}
    for row in rows:
        if row["method"] == "fused":
            assert row["status"] == "unavailable" and row["time_ms"] is None
            continue
        assert row["status"] == "ok" and row["us_per_call"] > 0
        assert row["best_us"] <= row["us_per_call"]  # the best sample is at most the median
        assert row["overhead_x"] > 0 and row["best_x"] > 0
        assert row["overhead_x_lo"] <= row["overhead_x"] <= row["overhead_x_hi"]
        if row["method"] == "torch":  # each round's plain torch sample over itself
            assert row["overhead_x"] == 1 and row["best_x"] == 1
            assert row["overhead_x_lo"] == row["overhead_x_hi"] == 1
        assert row["transport"] == ("gloo" if row["world_size"] == 2 else "none")
        assert row["plan_cache"] == plans.IMPLEMENTATION
        assert row["validate"] == ("always" if row["method"].endswith("always") else "first")
        assert row["host_us"] == row["us_per_call"]  # on CPU the host time is the time
        assert row["host_over_torch_us"] == pytest.approx(row["us_per_call"] - row["torch_us"])


def test_cli_quick_end_to_end(tmp_path):
    """Self-spawned 2 gloo ranks, --quick: a table on stdout, CSV+JSON with the metadata columns,
    exactly one row per (shape, method), and columns that agree with the formulas."""
    out = tmp_path / "out"
    suites = list(OP_SUITES) + ["tp_mlp"]
    r = _run([sys.executable, "-m", "pyfused.bench", "--quick", "--world", "2", "--no-progress",
              "--suites", ",".join(suites), "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for title in ("all_gather_matmul", "tp_mlp", "TFLOP/s", "busbw GB/s", "overlap eff"):
        assert title in r.stdout
    rows = json.loads((out / "all.json").read_text())
    with (out / "all.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows)
    for suite in suites:
        assert (out / f"{suite}.csv").exists() and (out / f"{suite}.json").exists()
    for row in rows:
        for col in META:
            assert row.get(col) not in (None, ""), (col, row)
        assert row["world"] == 2 and row["backend"] == "gloo" and row["validate"] == "first"
        assert row["transport"] in ("gloo", "none", "symm-mem")

    for op, coll in OP_SUITES.items():
        mine = _by(rows, suite=op)
        methods = ["gemm alone", f"{coll} alone", "unfused", "decomposed", "fused", "auto"]
        expected = sorted((s.label, m) for s in shapes.parse(None, op, 2, "cpu", True)
                          for m in methods)
        assert sorted((r["shape"].split(" a=")[0], r["method"]) for r in mine) == expected
        for shape in {r["shape"] for r in mine}:
            point = {r["method"]: r for r in _by(mine, shape=shape)}
            assert point["fused"]["status"].startswith("unavailable:")
            assert point["fused"]["time_ms"] is None and point["fused"]["transport"] == "symm-mem"
            t_gemm = point["gemm alone"]["time_ms"]
            t_comm = point[f"{coll} alone"]["time_ms"]
            t_unf = point["unfused"]["time_ms"]
            for m in ("unfused", "decomposed", "auto"):
                row = point[m]
                t = row["time_ms"]
                assert row["status"] == "ok" and t > 0
                assert row["tflops"] == pytest.approx(2 * row["m"] * row["n"] * row["k"] / t / 1e9)
                assert row["speedup"] == pytest.approx(t_unf / t)
                assert row["overlap_eff"] == pytest.approx((t_gemm + t_comm - t) / min(t_gemm, t_comm))
                elem = 4  # float32
                s = (row["m"] * (row["k"] if OPS[op].gathers_dim0 else row["n"])) * elem
                factor = {"all_reduce": 1.0}.get(coll, 0.5)  # 2(n-1)/n or (n-1)/n at n=2
                assert row["algbw_GBps"] == pytest.approx(s / t / 1e6)
                assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)
            assert point["auto"]["note"].startswith("chose ")

    mlp = _by(rows, suite="tp_mlp")
    labels = {r["shape"] for r in mlp}
    assert labels and all(label.endswith((" TP", " SP")) for label in labels)
    for shape in labels:
        got = sorted(r["method"] for r in _by(mlp, shape=shape))
        assert got == sorted(["torch-tp", "unfused", "decomposed", "fused", "auto"])
        torch_tp = _by(mlp, shape=shape, method="torch-tp")[0]
        dec = _by(mlp, shape=shape, method="decomposed")[0]
        assert dec["speedup_vs_torch_tp"] == pytest.approx(torch_tp["time_ms"] / dec["time_ms"])


FAKE_SUITES = {
    "bench_ok.py": """
        import torch, torch.distributed as dist
        MULTI_RANK = True
        def run(ctx):
            t = torch.ones(1)
            dist.all_reduce(t, group=ctx.group)
            return [{"shape": "x", "method": "m", "time_ms": float(t.item()), "world_seen": ctx.world}]
    """,
    "bench_single.py": """
        MULTI_RANK = False
        def run(ctx):
            assert ctx.world == 1 and ctx.rank == 0
            return [{"shape": "y", "method": "single", "time_ms": 1.0}]
    """,
    "bench_raises.py": """
        MULTI_RANK = True
        def run(ctx):
            raise ValueError("boom on every rank")
    """,
    "bench_rank1.py": """
        import torch, torch.distributed as dist
        MULTI_RANK = True
        def run(ctx):
            if ctx.rank == 1:
                raise RuntimeError("boom on rank 1 only")
            dist.all_reduce(torch.ones(1), group=ctx.group)  # waits for rank 1: must time out
            return [{"shape": "z", "method": "m", "time_ms": 1.0}]
    """,
    "bench_nomulti.py": """
        def run(ctx):
            return []
    """,
}


def test_cli_survives_failing_suites_under_torchrun(tmp_path):
    """Under torchrun: suites that raise everywhere, on one rank only (the other rank's collective
    times out), or lack MULTI_RANK are failed rows; the suites after them still run, a single-device
    suite on rank 0 alone; exit != 0."""
    pkg = tmp_path / "fakesuites"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, src in FAKE_SUITES.items():
        (pkg / name).write_text(textwrap.dedent(src))
    order = ["raises", "rank1", "nomulti", "ok", "single"]
    out = tmp_path / "out"
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "pyfused.bench", "--no-progress", "--no-validate", "--timeout", "3",
              "--out", str(out),
              "--suites", ",".join(f"fakesuites.bench_{n}" for n in order)],
             tmp_path, extra_path=tmp_path, timeout=120)
    assert r.returncode != 0
    rows = {row["suite"]: row for row in json.loads((out / "all.json").read_text())}
    assert list(rows) == order
    assert rows["raises"]["status"] == "failed on rank(s) [0, 1]: ValueError: boom on every rank"
    assert rows["rank1"]["status"].startswith("failed on rank(s) [0, 1]")  # rank 0 timed out
    assert "MULTI_RANK" in rows["nomulti"]["status"]
    assert rows["ok"]["status"] == "ok" and rows["ok"]["time_ms"] == 2.0  # the sum over 2 ranks
    assert rows["ok"]["world_seen"] == 2 and rows["ok"]["transport"] == "gloo"
    assert rows["ok"]["validate"] == "off"  # --no-validate is recorded
    assert rows["single"]["status"] == "ok" and rows["single"]["transport"] == "none"
    assert rows["single"]["world"] == 1
    assert "boom on rank 1 only" in r.stderr and "2 suite(s) ok, 3 FAILED" in r.stdout


# ---- rows as they go ---------------------------------------------------------------------------

STREAMED_SUITES = {
    "bench_killed.py": """
        import os, signal, torch
        from pyfused.bench.harness import op_row, time_fn
        MULTI_RANK = False
        def _measure(point):
            if point == 3:  # the 4th point: the whole process group dies mid-measurement
                os.killpg(os.getpgid(0), signal.SIGKILL)
        def run(ctx):
            rows = []
            for point in range(5):
                ms = time_fn(lambda: _measure(point), ctx, warmup=0, iters=1)
                row = op_row(ctx, shape=f"p{point}", dtype=torch.float32, method="m",
                             transport="none", ms=ms + 1.0)
                row["added_after"] = point  # a column set after op_row, like bench_gemm's
                rows.append(row)
            return rows
    """,
    "bench_endless.py": """
        import time, torch
        from pyfused.bench.harness import op_row, time_fn
        MULTI_RANK = False
        def run(ctx):
            rows = []
            for point in range(10000):  # stopped by --suite-timeout long before the end
                ms = time_fn(lambda: time.sleep(0.05), ctx, warmup=0, iters=1)
                rows.append(op_row(ctx, shape=f"p{point}", dtype=torch.float32, method="m",
                                   transport="none", ms=ms))
            return rows
    """,
    "bench_after.py": """
        MULTI_RANK = False
        def run(ctx):
            return [{"shape": "after", "method": "m", "time_ms": 1.0}]
    """,
}


def _fake_suites(tmp_path, sources):
    pkg = tmp_path / "fakesuites"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, src in sources.items():
        (pkg / name).write_text(textwrap.dedent(src))


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_survive_a_killed_suite(tmp_path):
    """A suite killed (SIGKILL to its whole process group, as the device step's `timeout` does)
    during its 4th point leaves its first 3 rows, whole (CLI columns and those added after
    op_row), in <suite>.rows.jsonl; the 4th, unfinished, is not there."""
    _fake_suites(tmp_path, STREAMED_SUITES)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pyfused.bench", "--world", "1", "--no-progress", "--out", str(out),
           "--suites", "fakesuites.bench_killed"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tmp_path), str(REPO),
                                                       os.environ.get("PYTHONPATH", ""))))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                       start_new_session=True)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not (out / "all.json").exists()  # killed before the report
    rows = _jsonl(out / "killed.rows.jsonl")
    assert [row["shape"] for row in rows] == ["p0", "p1", "p2"], r.stderr[-3000:]
    assert [row["added_after"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["suite"] == "killed" and row["status"] == "ok" and row["time_ms"] >= 1.0
        assert all(row.get(col) not in (None, "") for col in META), row


def test_suite_timeout_stops_a_suite_and_keeps_its_rows(tmp_path):
    """--suite-timeout: no measurement starts after the budget; the suite is a failed row naming
    it, the rows it measured stay in its rows.jsonl, and the next suite runs; a suite that ends
    has its returned rows in its rows.jsonl."""
    _fake_suites(tmp_path, STREAMED_SUITES)
    out = tmp_path / "out"
    r = _run([sys.executable, "-m", "pyfused.bench", "--world", "1", "--no-progress",
              "--suite-timeout", "1", "--out", str(out),
              "--suites", "fakesuites.bench_endless,fakesuites.bench_after"], tmp_path,
             extra_path=tmp_path, timeout=240)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    final = {row["suite"]: row for row in json.loads((out / "all.json").read_text())}
    assert "SuiteTimeout" in final["endless"]["status"], final["endless"]
    assert "--suite-timeout" in final["endless"]["status"]
    measured = _jsonl(out / "endless.rows.jsonl")
    assert 1 <= len(measured) < 10000 and all(row["suite"] == "endless" for row in measured)
    assert final["after"]["status"] == "ok"
    assert [row["shape"] for row in _jsonl(out / "after.rows.jsonl")] == ["after"]


def test_every_suite_is_described_in_bench_md():
    """docs/BENCH.md's suite table names every suite `python -m pyfused.bench` can run."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "BENCH.md").read_text()
    table = text[text.index("## The suites"):]
    table = table[:table.index("\n\n", table.index("| suite |"))]
    suites = sorted(p.stem.removeprefix("bench_") for p in (root / "benchmarks").glob("bench_*.py"))
    missing = [s for s in suites if f"`{s}`" not in table]
    assert not missing, f"docs/BENCH.md's suite table does not describe {missing}"


def test_moe_block_shapes_from_the_environment(monkeypatch):
    """``PYFUSED_MOE_SHAPES`` replaces the moe suite's block points; a malformed one is refused
    with the expected form."""
    from pyfused.benchmarks import bench_moe

    ctx = _ctx(2)
    monkeypatch.delenv(bench_moe.SHAPES_ENV, raising=False)
    assert bench_moe.block_shapes(ctx) == bench_moe.BLOCK_SHAPES["cpu"]
    monkeypatch.setenv(bench_moe.SHAPES_ENV, "1024x1024x256, 7X9x5")
    assert bench_moe.block_shapes(ctx) == [(1024, 1024, 256), (7, 9, 5)]
    for bad in ("1024x1024", "axbxc", "0x4x4", ","):
        monkeypatch.setenv(bench_moe.SHAPES_ENV, bad)
        with pytest.raises(ValueError, match="expected TxHxF points"):
            bench_moe.block_shapes(ctx)


def test_rows_name_the_test_beds_link(monkeypatch):
    """On the multi-host test bed every row carries the link description the bed sets; elsewhere
    there is no ``link`` column."""
    from pyfused.bench.harness import LINK_ENV, metadata

    monkeypatch.delenv(LINK_ENV, raising=False)
    assert "link" not in metadata(_ctx(2))
    monkeypatch.setenv(LINK_ENV, "veth+bridge, tbf 1gbit")
    assert metadata(_ctx(2))["link"] == "veth+bridge, tbf 1gbit"


def _moe_model_rows(rank, world):
    import torch.distributed as dist

    from pyfused.benchmarks import moe_model_step

    pytest.importorskip("transformers")
    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=2)
    return moe_model_step.model_rows(ctx, ("unfused", "decomposed", "fused", "auto"),
                                     shapes=[(32, 48, 1, 2, 9)])


def test_moe_model_step_rows(ranks):
    """The ``moe`` suite's model rows: one per variant, each method checked against the torch
    reference's logits before it is timed, its paired ratio a number; a method that cannot run
    is a row saying why."""
    rows = ranks.run(2, _moe_model_rows, timeout=300)[0]
    assert [r["method"] for r in rows] == ["torch", "unfused", "decomposed", "fused", "auto"]
    for row in rows:
        assert row["suite_part"] == "model" and row["shape"].startswith("Mixtral step")
        if row["status"] == "ok":
            assert row["tokens_per_s"] > 0 and math.isfinite(row["vs_torch"]), row
        else:
            assert row["status"] == "unavailable" and row["note"], row
    assert all(r["status"] == "ok" for r in rows if r["method"] != "fused")


def test_reduce_suite_takes_the_faster_copy_as_the_bandwidth_reference():
    """The reduce suite times two copies of the same bytes (the copy engines' memcpy, an SM kernel)
    and refers every bandwidth share to the faster: one slow copy path is never the ceiling."""
    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_reduce

    ctx = BenchContext(0, 1, None, torch.device("cpu"), "local", quick=True, warmup=1, iters=2)
    rows, best = bench_reduce._copy_rows(ctx, torch.float32)
    assert [r["method"] for r in rows] == ["torch.copy_", "torch.add"]
    assert best == max(r["gbps"] for r in rows) > 0
    assert sorted(r["pct_copy_bw"] for r in rows)[-1] == 1.0
    assert all(0 < r["pct_copy_bw"] <= 1.0 for r in rows)
