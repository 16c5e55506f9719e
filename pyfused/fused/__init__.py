"""The fused (symmetric-memory) implementations of the ops' ``method="fused"``.

Importing this package has no side effect. ``pyfused.ops._fused`` calls ``register_all`` only after
its capability probe passed (CUDA, pyfused._C with the symmetric-memory kernels, Triton on a GPU,
a symmetric-memory backend), so ``IMPLS`` stays empty -- and ``method="fused"`` reports why --
wherever the kernels cannot run. Tests run the same functions on CPU through the "host-shm" backend
(pyfused/comm/symmetric.py) and the CPU kernels / Triton interpreter.

  all_reduce.py        custom all-reduce kernel (one-shot / two-shot), + residual + RMSNorm epilogue,
                       GEMM + all-reduce
  gemm_collectives.py  all-gather + GEMM (copy-engine pushes, per-chunk flags, Triton GEMM waits),
                       GEMM + reduce-scatter (GEMM scatters into owners' buffers, owners reduce)
  config.py            one-shot / two-shot crossover and other launch choices, as data
"""
from __future__ import annotations

from typing import Callable, Dict


def implementations() -> Dict[str, Callable]:
    """op name -> fused implementation, with the signature the op's custom op calls it with."""
    from .all_reduce import fused_all_reduce_add_rmsnorm, fused_matmul_all_reduce
    from .gemm_collectives import fused_all_gather_matmul, fused_matmul_reduce_scatter

    return {
        "all_gather_matmul": fused_all_gather_matmul,
        "matmul_reduce_scatter": fused_matmul_reduce_scatter,
        "matmul_all_reduce": fused_matmul_all_reduce,
        "all_reduce_add_rmsnorm": fused_all_reduce_add_rmsnorm,
    }


def register_all(registry: Dict[str, Callable]) -> None:
    registry.update(implementations())
