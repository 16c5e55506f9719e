"""Benchmark of ``pyfused.ops.moe_dispatch`` alone (forward), per method, against the op's
``plain_torch`` hook (all_to_all_single with split sizes and a GEMM per expert) in the same run:
time, tokens/s and the paired ratio to torch (the body: ``bench_moe.op_suite``). The MoE block
with both ops, routing skew and the timeline are the ``moe`` suite (bench_moe.py)."""
from __future__ import annotations

from typing import Dict, List

from pyfused.bench.harness import BenchContext

from .bench_moe import op_suite

MULTI_RANK = True


def run(ctx: BenchContext) -> List[Dict]:
    return op_suite(ctx, "moe_dispatch")
