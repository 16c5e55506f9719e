"""Benchmark of ``pyfused.ops.all_gather_matmul``:
all_gather(a, dim=0) @ b: the column-parallel input side of a TP layer with sequence parallelism.

Shapes: the Llama-3 layers this op runs (pyfused/bench/shapes.py), or ``--shapes``. Per shape: the GEMM
alone, the collective alone, and methods unfused | decomposed | fused | auto, with TFLOP/s, algbw /
busbw, speedup over unfused and overlap efficiency (pyfused/bench/gemm_collective.py).
"""
from pyfused.bench.gemm_collective import run_op_suite

from . import shapes

OP = "all_gather_matmul"
MULTI_RANK = True


def run(ctx):
    shape_list = shapes.parse(ctx.options.get("shapes"), OP, ctx.world, ctx.device.type, ctx.quick)
    return run_op_suite(ctx, OP, shape_list)
