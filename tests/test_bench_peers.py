"""The op suites' torch symmetric-memory rows (pyfused/bench/peers.py), over 2 gloo ranks.

torch's symm-mem ops run only on CUDA, so here gloo stand-ins take their place (same signatures and
results). What is tested is the suite's plumbing, which a run on a GPU relies on: every part is
checked against the unfused output before it is timed; a part that fails or is wrong on *one* rank
is dropped on every rank, with its reason; the rows carry transport "symm-mem"; and a method that
runs on symmetric memory gets its speedup and overlap efficiency from the symm-mem rows, not from
the process group's transport.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from pyfused.bench import gemm_collective, peers
from pyfused.bench.harness import BenchContext
from pyfused.benchmarks.shapes import OpShape


def _gather(t):
    out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous())
    return out


def _reduce_scatter(t):
    out = t.new_empty((t.shape[0] // dist.get_world_size(), *t.shape[1:]))
    dist.reduce_scatter_tensor(out, t.contiguous())
    return out


def _all_reduce(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _stand_ins(rank: int, broken: str):
    """gloo versions of the torch.ops.symm_mem ops the suite calls; ``broken`` names one to break on
    rank 1 only ("raise") or on every rank ("wrong")."""
    def maybe(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)  # its communication first: a failure *before* a collective
            if broken == f"{name}:raise" and rank == 1:  # on one rank hangs any scheme
                raise RuntimeError(f"{name} stand-in fails on rank 1")
            return out + 1.0 if broken == f"{name}:wrong" else out
        return call

    def two_shot(t, op, gn):
        dist.all_reduce(t)
        return t + 1.0 if broken == "two_shot_all_reduce_:wrong" else t

    return types.SimpleNamespace(
        _low_contention_all_gather=maybe("_low_contention_all_gather", lambda t, gn: _gather(t)),
        _low_contention_reduce_scatter=maybe("_low_contention_reduce_scatter",
                                             lambda t, op, gn: _reduce_scatter(t)),
        one_shot_all_reduce=maybe("one_shot_all_reduce", lambda t, op, gn: _all_reduce(t)),
        two_shot_all_reduce_=two_shot,
        fused_all_gather_matmul=maybe("fused_all_gather_matmul",
                                      lambda a, bs, d, gn, return_A: (None, [_gather(a) @ bs[0]])),
        fused_matmul_reduce_scatter=maybe("fused_matmul_reduce_scatter",
                                          lambda a, b, op, d, gn: _reduce_scatter(a @ b)),
    )


def _suite_rows(rank, world, op, broken, symm_method):
    """One shape of ``op`` through the suite with the stand-ins; ``symm_method`` is a method made
    to look as if it ran on symmetric memory (the fused method cannot run on CPU)."""
    # The rank processes are reused by later tests: every patch is undone below.
    real = gemm_collective.method_transport
    patches = [
        (peers, "status", lambda ctx: None),
        (peers, "symm_ops", lambda: _stand_ins(rank, broken)),
        (peers, "_symm_tensor", lambda shape, dtype, device, group: torch.zeros(shape, dtype=dtype)),
        (gemm_collective, "method_transport",
         lambda m, ctx: peers.TRANSPORT if m == symm_method else real(m, ctx)),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, value in patches:
        setattr(mod, name, value)
    try:
        ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo",
                           warmup=0, iters=3)
        shape = {"all_gather_matmul": OpShape("t", op, (24, 40), (40, 56)),
                 "matmul_reduce_scatter": OpShape("t", op, (48, 20), (20, 56)),
                 "matmul_all_reduce": OpShape("t", op, (48, 20), (20, 56))}[op]
        return gemm_collective.bench_shape(ctx, shape)
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


CASES = {  # op -> (collective, the symm-mem labels expected)
    "all_gather_matmul": ("all_gather", ["all_gather alone", "unfused (torch symm-mem)",
                                         "torch fused_all_gather_matmul"]),
    "matmul_reduce_scatter": ("reduce_scatter", ["reduce_scatter alone", "unfused (torch symm-mem)",
                                                 "torch fused_matmul_reduce_scatter"]),
    "matmul_all_reduce": ("all_reduce", [
        "all_reduce alone [one-shot]", "all_reduce alone [two-shot]",
        "unfused (torch symm-mem) [one-shot]", "unfused (torch symm-mem) [two-shot]"]),
}


@pytest.mark.parametrize("op", list(CASES))
def test_symm_rows_and_same_transport_baseline(ranks, op):
    coll, labels = CASES[op]
    per_rank = ranks.run(2, _suite_rows, op, "", "decomposed", timeout=120)
    for rows in per_rank:
        symm = {r["method"]: r for r in rows if r["transport"] == "symm-mem"}
        assert set(labels) <= set(symm), sorted(symm)
        assert all(symm[label]["status"] == "ok" and symm[label]["time_ms"] > 0 for label in labels)
        alone = [symm[label]["time_ms"] for label in labels if " alone" in label]
        base = [symm[label]["time_ms"] for label in labels if label.startswith("unfused (torch")]
        t_gemm = next(r["time_ms"] for r in rows if r["method"] == "gemm alone")
        # The method on symm-mem: speedup vs the faster symm GEMM-then-collective, overlap vs the
        # faster symm collective alone; never the gloo rows'.
        dec = symm["decomposed"]
        assert dec["speedup"] == pytest.approx(min(base) / dec["time_ms"])
        c = min(alone)
        assert dec["overlap_eff"] == pytest.approx((t_gemm + c - dec["time_ms"]) / min(t_gemm, c))
        assert "same transport" in dec["note"]
        # The process group's own rows are untouched: unfused is the baseline of the gloo rows.
        unf = next(r for r in rows if r["method"] == "unfused")
        assert unf["transport"] == "gloo" and unf["speedup"] == pytest.approx(1.0)
    # Every rank produced the same rows (labels and statuses).
    assert ([(r["method"], r["status"]) for r in per_rank[0]]
            == [(r["method"], r["status"]) for r in per_rank[1]])


@pytest.mark.parametrize("op,broken,label", [
    ("all_gather_matmul", "fused_all_gather_matmul:raise", "torch fused_all_gather_matmul"),
    ("matmul_reduce_scatter", "fused_matmul_reduce_scatter:wrong",
     "torch fused_matmul_reduce_scatter"),
    ("matmul_all_reduce", "two_shot_all_reduce_:wrong", "unfused (torch symm-mem) [two-shot]"),
])
def test_a_failing_or_wrong_part_is_dropped_on_every_rank(ranks, op, broken, label):
    per_rank = ranks.run(2, _suite_rows, op, broken, "decomposed", timeout=120)
    for rank, rows in enumerate(per_rank):
        row = next(r for r in rows if r["method"] == label)
        assert row["status"].startswith("unavailable:") and row["time_ms"] != row["time_ms"]
        if broken.endswith(":wrong"):
            assert "differs from method='unfused'" in row["status"]
        elif rank == 1:
            assert "fails on rank 1" in row["status"]
        else:
            assert "failed on another rank" in row["status"]
        # The other parts still ran.
        assert any(r["transport"] == "symm-mem" and r["status"] == "ok" and " alone" in r["method"]
                   for r in rows)


def test_no_symm_rows_off_cuda():
    ctx = BenchContext(0, 2, None, torch.device("cpu"), "gloo")
    assert "CUDA" in peers.status(ctx)
    assert "one rank" in peers.status(BenchContext(0, 1, None, torch.device("cpu"), "gloo"))
