"""Benchmark of the fused ops with W virtual ranks on one GPU (pyfused/testing/virtual_ranks.py).

Each fused op at W = 2, 4, 8 against the same op's unfused composition on the same harness: the same
streams, the same SM share per rank (SMs // W for the fused kernels and, through cuBLASLt's SM
count target, for torch's GEMMs: ``VirtualGroup.torch_gemms_in_budget``; torch's other kernels are
not capped), the same memory. Every row's transport is ``virtual-ranks (1 GPU)``: the "peers" are
streams of one context, so the collective moves bytes at the GPU's copy bandwidth, not a link's.
What the rows show is the schedules' cost and overlap with truly concurrent ranks, not a speed on
a multi-GPU node. ``speedup`` = the unfused time / the fused time, both measured in this run, as
device time (a call's host time, W ranks from one thread, exceeds its device time at these shapes;
``device_samples``), or wall-clock time for the cases that read counts on the host (MoE).

Shapes: a Llama-3 70B TP=8 rank's GEMM (rows per rank 512, N 1280, K 8192: the QKV projection) and
its hidden size 8192 for all_reduce_add_rmsnorm (512 rows); ``--quick``: 128 rows. bf16 by default.
On CPU the fused kernels would run in the interpreter: the suite emits ``skipped`` rows.

``PYFUSED_VR_WORLDS=8`` (comma-separated) measures only those W (a device call short of time).

``python benchmarks/bench_virtual_ranks.py --warm`` runs every case once at every W in bf16 and fp16
at the test and benchmark shapes: it fills the Triton cache that benchmarks/gpu_check.sh carries.
"""
from __future__ import annotations

import os
import statistics
import sys
from typing import Dict, List

import torch

from pyfused.bench.harness import BenchContext, device_samples, op_row, time_interleaved
from pyfused.ops.registry import OPS

MULTI_RANK = False

TRANSPORT = "virtual-ranks (1 GPU)"
WORLDS = (2, 4, 8)
GEMM_SHAPE = dict(rows=512, n=1280, k=8192)
NORM_SHAPE = dict(rows=512, n=8192, k=0)
QUICK_ROWS = 128
DEVICE_ROUNDS = 7  # device-time rounds per method (pyfused.bench.harness.device_samples)
DEVICE_CALLS = 8
SKIP_STATUS = "skipped: needs a CUDA GPU (virtual ranks are CUDA streams of one context)"


def _cases():
    """Every virtual-rank case of the registered ops (pyfused/testing/virtual_cases.py)."""
    from pyfused.testing.virtual_cases import cases

    return cases(OPS.values())


def _worlds() -> List[int]:
    """The W to measure: ``PYFUSED_VR_WORLDS`` (e.g. "8" or "4,8"), else every one of WORLDS."""
    text = os.environ.get("PYFUSED_VR_WORLDS", "").strip()
    if not text:
        return list(WORLDS)
    worlds = [int(w) for w in text.split(",")]
    if not set(worlds) <= set(WORLDS):
        raise ValueError(f"PYFUSED_VR_WORLDS={text!r}: each W must be one of {WORLDS}")
    return worlds


def _shape(case, quick: bool) -> Dict[str, int]:
    shape = dict(GEMM_SHAPE if OPS[case.op].gemm else NORM_SHAPE)
    if quick:
        shape["rows"] = QUICK_ROWS
    return shape


def _bench_case(ctx: BenchContext, group, name: str, case) -> List[dict]:
    from pyfused.testing.virtual_cases import max_rel_error, run_unfused

    shape = _shape(case, ctx.quick)
    inputs = case.make(group.world, shape["rows"], shape["n"], shape["k"], ctx.dtype, group.device, 0)
    label = f"W={group.world} rows={shape['rows']} n={shape['n']}"
    label += f" k={shape['k']}" if shape["k"] else ""
    common = dict(shape=label, dtype=ctx.dtype, transport=TRANSPORT, world=group.world, case=name,
                  sm_budget=group.sm_budget)
    fused = group.run(case.fused, inputs)  # first call: builds the tables, checks the timeouts
    unfused = run_unfused(group, case, inputs)
    torch.cuda.synchronize()
    err = max_rel_error(fused, unfused)
    fns = {"unfused": lambda: run_unfused(group, case, inputs),
           "fused": lambda: group.launch(case.fused, inputs, threads=case.blocks_host)}
    if case.blocks_host:  # a host read inside the call: it cannot be queued behind a sleep
        times, timing = time_interleaved(fns, ctx), "wall-clock (the call reads counts on the host)"
    else:
        samples = device_samples(fns, min(ctx.iters, DEVICE_ROUNDS), DEVICE_CALLS)
        times = {k: statistics.median(s[0] for s in v) for k, v in samples.items()}
        bound = sum(s[2] for s in samples["fused"])
        timing = "device time" + (f", host-bound in {bound} rounds" if bound else "")
    group.run(case.fused, inputs)  # the timed calls' wait timeouts, if any, raise here
    flop = case.flop(group.world, shape["rows"], shape["n"], shape["k"])
    return [op_row(ctx, **common, method="unfused", ms=times["unfused"], flop=flop,
                   t_baseline=times["unfused"]),
            op_row(ctx, **common, method="fused", ms=times["fused"], flop=flop,
                   t_baseline=times["unfused"],
                   note=f"{timing}; max rel. diff vs unfused {err:.2e}")]


def run(ctx: BenchContext) -> List[dict]:
    from pyfused.testing.virtual_ranks import VirtualGroup

    CASES = _cases()
    if ctx.device.type != "cuda":
        return [op_row(ctx, shape=f"W={w}", dtype=ctx.dtype, method=m, transport=TRANSPORT, ms=None,
                       status=SKIP_STATUS, case=name, world=w)
                for name in CASES for w in WORLDS for m in ("unfused", "fused")]
    rows = []
    for w in _worlds():
        group = VirtualGroup(w, ctx.device)
        try:
            for name, case in CASES.items():
                rows += _bench_case(ctx, group, name, case)
        finally:
            group.free()
    return rows


def warm(dtypes=(torch.bfloat16, torch.float16)) -> None:
    """Run every case once per W and dtype at the shapes the tests and this suite use (compiles
    every Triton variant they need into the cache)."""
    from pyfused.testing.virtual_ranks import VirtualGroup

    CASES = _cases()
    test_shape = dict(rows=384, n=1280, k=1024)  # tests/test_virtual_ranks.py GPU_SHAPE
    for dtype in dtypes:  # bf16 first: the benchmark's dtype, in case the step runs out of time
        for w in WORLDS:
            group = VirtualGroup(w, "cuda")
            for name, case in CASES.items():
                for shape in (test_shape, _shape(case, False)):
                    shape = dict(shape, k=shape["k"] or 1)
                    group.run(case.fused, case.make(w, shape["rows"], shape["n"], shape["k"], dtype,
                                                    group.device, 0))
                print(f"warm: W={w} {dtype} {name}", flush=True)
            group.free()


if __name__ == "__main__" and "--warm" in sys.argv:
    warm()
