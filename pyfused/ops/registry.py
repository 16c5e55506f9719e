"""The one description of every fused op: everything else that lists the ops derives from ``OPS``.

The functional ops (``pyfused.ops``), the fused-implementation table (``pyfused.ops._fused``), the
tuner (``pyfused.tune``), the tuning and benchmark shapes (``pyfused.tune.shapes``), the bench suites
(``benchmarks/bench_<op>.py``, the ``overhead`` suite) and the tests' op lists read this table.
Adding an op is one entry here plus its own files (docs/ARCHITECTURE.md, "Adding an op").

Importing this module imports no op, kernel or fused implementation: the ``module`` and ``fused``
fields name them, and ``OpSpec.function`` / ``reference`` / ``fused_function`` import on demand.
"""
from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: Tuple[str, ...]   # the tensor arguments, in call order
    collective: str           # "all_gather" | "reduce_scatter" | "all_reduce"
    scatters_dim0: bool       # the result is this rank's rows of dim 0 (dim 0 divisible by W)
    chunked: bool             # the decomposed method takes ``chunks=`` (row pieces)
    gemm: bool                # a @ b with a [d0, ..., K], b [K, N]; else x [..., H] + weight [H]
    shape_rule: str           # the output shape, for the docs
    fused: Optional[str]      # "module:function" of the fused implementation, None if there is none
    kernels: Tuple[str, ...]  # files of the kernels the fused implementation launches

    @property
    def code(self) -> int:
        """The op's number in the plan cache's keys (pyfused/comm/plans.py)."""
        return zlib.crc32(self.name.encode()) & 0x3FFFFFFF

    @property
    def module(self) -> str:
        return f"pyfused.ops.{self.name}"

    @property
    def function(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.name)

    @property
    def reference(self) -> Callable:
        """The fp32 (fp64 for fp64 inputs) reference the tests and benchmarks compare with."""
        return getattr(importlib.import_module(self.module), f"{self.name}_ref")

    def fused_function(self) -> Callable:
        module, _, attr = self.fused.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def tune_shape_inputs(self) -> Tuple[int, int]:
        """Which two inputs' shapes key a tuned entry (a and b; x and weight)."""
        return (0, 1) if self.gemm else (0, 2)


OPS: Dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("all_gather_matmul", ("a", "b"), "all_gather", False, False, True,
           "a [m, ..., K], b [K, N] -> [W*m, ..., N]",
           "pyfused.fused.gemm_collectives:fused_all_gather_matmul",
           ("kernels/gemm.py",)),
    OpSpec("matmul_reduce_scatter", ("a", "b"), "reduce_scatter", True, False, True,
           "a [M, ..., K], b [K, N] -> [M/W, ..., N]",
           "pyfused.fused.gemm_collectives:fused_matmul_reduce_scatter",
           ("kernels/gemm.py", "kernels/reduce.py")),
    OpSpec("matmul_all_reduce", ("a", "b"), "all_reduce", False, True, True,
           "a [d0, ..., K], b [K, N] -> [d0, ..., N]",
           "pyfused.fused.all_reduce:fused_matmul_all_reduce",
           ("kernels/gemm.py", "csrc/allreduce_cuda.cu")),
    OpSpec("all_reduce_add_rmsnorm", ("x", "residual", "weight"), "all_reduce", False, True, False,
           "x [..., H], residual [..., H], weight [H] -> (normed, new_residual) [..., H]",
           "pyfused.fused.all_reduce:fused_all_reduce_add_rmsnorm",
           ("csrc/allreduce_cuda.cu",)),
)}

GEMM_OPS = tuple(n for n, s in OPS.items() if s.gemm)
CHUNKED_OPS = tuple(n for n, s in OPS.items() if s.chunked)
FUSED_OPS = tuple(n for n, s in OPS.items() if s.fused)
