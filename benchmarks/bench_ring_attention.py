"""Benchmark of ``pyfused.ops.ring_attention`` alone (forward), per method, against the op's
``plain_torch`` hook (all-gather K/V, then torch's ``scaled_dot_product_attention`` on this rank's
rows with their causal mask) in the same run: time, tokens/s and the paired ratio to torch.

Inputs are the op's ``make_inputs`` hook: one sequence (B = 1) of ``LENGTHS`` tokens over the
suite's ranks, 2W query and W key/value heads, head dim 64, zigzag layout. Forward and backward
against single-device attention and torch's ``context_parallel``, with memory per rank, are the
``context_parallel`` suite (bench_context_parallel.py).
"""
from __future__ import annotations

from typing import Callable, Dict, List

from pyfused.bench.harness import BenchContext, op_row, time_interleaved
from pyfused.ops.registry import OPS

MULTI_RANK = True
OP = "ring_attention"
HEAD_DIM = 64
LENGTHS, QUICK_LENGTHS = (2048, 8192), (1024,)


def run(ctx: BenchContext) -> List[Dict]:
    spec = OPS[OP]
    rows = []
    for length in (QUICK_LENGTHS if ctx.quick else LENGTHS):
        s_local = length // ctx.world // 2 * 2  # even: two zigzag chunks per rank
        tensors = spec.make_inputs(ctx.world, 1, HEAD_DIM, s_local // 2, ctx.dtype, ctx.device,
                                   seed=0)[ctx.rank]
        steps: Dict[str, Callable[[], object]] = {"torch": spec.plain_torch(tensors, ctx.group)}
        for method in (*spec.methods, "auto"):
            steps[method] = (lambda m=method: spec.function(*tensors, group=ctx.group, method=m))
        times = time_interleaved(steps, ctx)
        tokens = s_local * ctx.world
        for method, ms in times.items():
            rows.append(op_row(ctx, shape=f"S={tokens} q {tuple(tensors[0].shape)}",
                               dtype=ctx.dtype, method=method, ms=ms,
                               transport=ctx.transport if ctx.world > 1 else "none",
                               t_baseline=times["torch"], op=OP, seq_len=tokens,
                               tokens_per_s=tokens / ms * 1e3))
    return rows
