"""Benchmark of ``pyfused.ops.all_reduce_add_rmsnorm``: all_reduce(x) + residual, then RMSNorm --
the end of every tensor-parallel attention / MLP block.

Message sizes (bytes of x on one rank, nccl-tests' S) from 8 KB to 64 MB on GPU (hidden 4096,
bf16: 1 to 8192 rows), 8 KB to 4 MB on CPU (hidden 1024, fp32); ``--quick``: 8 KB and 512 KB.
Per size, in one run and on the same inputs:
  * "all_reduce alone" (NCCL / gloo) and "add+rmsnorm alone" (the epilogue in torch): the parts;
  * methods unfused (the baseline: the NCCL / gloo all-reduce, then add + RMSNorm), decomposed,
    fused (one custom all-reduce kernel with the epilogue; "unavailable: <why>" where it cannot run)
    and auto (its note says what it chose);
  * where fused runs, "fused.one_shot" / "fused.two_shot": the kernel with each algorithm forced,
    the data for the crossover in pyfused/fused/config.py.
algbw / busbw follow nccl-tests' all-reduce definitions over S; ``speedup`` is unfused time / time.
Every method's output is first checked against the unfused one on every rank.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from pyfused import ops
from pyfused.bench import shapes
from pyfused.bench.gemm_collective import agree_close, method_transport
from pyfused.bench.harness import BenchContext, op_row, time_fn
from pyfused.ops import _common
from pyfused.ops.all_reduce_add_rmsnorm import add_rmsnorm_rows, prepare

MULTI_RANK = True

OP = "all_reduce_add_rmsnorm"
EPS = 1e-6
HIDDEN = shapes.NORM_HIDDEN
METHODS = ("unfused", "decomposed", "fused", "auto")


def sizes(ctx: BenchContext) -> List[int]:
    return shapes.norm_sizes(ctx.device.type, ctx.quick)


def _forced_algo_rows(ctx, x, res, w, common, t_unfused, ref) -> List[Dict]:
    """The fused kernel with one-shot and with two-shot forced (only where fused runs)."""
    from pyfused.fused.all_reduce import all_reduce_rows
    from pyfused.fused.config import ONE_SHOT, TWO_SHOT

    rows = []
    for name, algo in (("fused.one_shot", ONE_SHOT), ("fused.two_shot", TWO_SHOT)):
        normed = torch.empty_like(x)
        new_res = torch.empty_like(x)

        def step():
            all_reduce_rows(x, ctx.group, out=normed, residual=res, residual_out=new_res, weight=w,
                            eps=EPS, algo=algo)

        step()
        agree_close(normed, ref, f"{OP}[{name}]", ctx)
        ms = time_fn(step, ctx)
        rows.append(op_row(ctx, **common, method=name, transport="symm-mem", ms=ms, t_baseline=t_unfused))
    return rows


def bench_size(ctx: BenchContext, nbytes: int) -> List[Dict]:
    dtype, dev = ctx.dtype, ctx.device
    hidden = HIDDEN[dev.type]
    esize = torch.empty((), dtype=dtype).element_size()
    m = max(1, nbytes // (hidden * esize))
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    x = torch.randn((m, hidden), generator=gen).to(dev, dtype)
    shared = torch.Generator().manual_seed(11)  # residual and weight are replicated
    res = torch.randn((m, hidden), generator=shared).to(dev, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(dev, dtype)
    size = m * hidden * esize
    common = dict(shape=f"{m}x{hidden} ({size >> 10} KiB)", dtype=dtype, collective="all_reduce",
                  nbytes=size, m=m, n=hidden, op=OP)

    rows = []
    if ctx.world > 1:
        import torch.distributed as dist

        buf = torch.zeros_like(x)  # zeros: repeated sums stay finite
        t_comm = time_fn(lambda: dist.all_reduce(buf, group=ctx.group), ctx)
        rows.append(op_row(ctx, **common, method="all_reduce alone", transport=ctx.transport, ms=t_comm))
    normed, new_res = torch.empty_like(x), torch.empty_like(x)
    t_epi = time_fn(lambda: add_rmsnorm_rows(x, res, w, EPS, normed, new_res), ctx)
    rows.append(op_row(ctx, **{**common, "collective": None}, method="add+rmsnorm alone",
                       transport="none", ms=t_epi))

    ref = ops.all_reduce_add_rmsnorm(x, res, w, EPS, ctx.group, method="unfused")[0]
    t_unfused = None
    fused_ran = False
    for method in METHODS:
        note = ""
        try:
            out = ops.all_reduce_add_rmsnorm(x, res, w, EPS, ctx.group, method=method)[0]
        except _common.MethodUnavailable as e:  # raised on every rank alike
            rows.append(op_row(ctx, **common, method=method, transport=method_transport(method, ctx),
                               ms=None, status=f"unavailable: {e}"))
            continue
        agree_close(out, ref, f"{OP}[{method}] at {m}x{hidden}", ctx)
        transport = method_transport(method, ctx)
        if method == "auto":
            choice = prepare(x, res, w, EPS, ctx.group, "auto", 0)[1]
            transport = method_transport(choice.method, ctx)
            note = f"chose {choice.method}: {choice.reason}"
        ms = time_fn(lambda: ops.all_reduce_add_rmsnorm(x, res, w, EPS, ctx.group, method=method), ctx)
        if method == "unfused":
            t_unfused = ms
        fused_ran |= method == "fused"
        rows.append(op_row(ctx, **common, method=method, transport=transport, ms=ms, t_baseline=t_unfused,
                           note=note))
    if fused_ran:
        rows += _forced_algo_rows(ctx, x, res, w, common, t_unfused, ref)
    return rows


def run(ctx: BenchContext) -> List[Dict]:
    rows: List[Dict] = []
    for nbytes in sizes(ctx):
        rows += bench_size(ctx, nbytes)
    return rows
