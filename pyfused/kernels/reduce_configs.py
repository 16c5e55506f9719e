"""Launch configs of the multi-source reduce (reduce.py), as data.

A pure function of ``(rows, hidden, sources, dtype, arch)``, like the GEMM's (gemm_configs.py);
the reduce has no cross-rank contract (it signals nothing), but deterministic choices keep runs
comparable. Values are starting points for a bandwidth-bound row kernel (16-byte vectors, 8-16K
fp32 accumulators per program); none has been measured in this repository yet.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .gemm_configs import NOMINAL_SMS

# Elements a program holds per step (fp32 accumulators): big enough to keep P 16-byte loads per
# thread in flight, small enough not to spill. The interpreter prefers big steps (fewer of them).
# Sources of 4 bytes take half a GPU step: at 32 fp32 elements per thread ptxas spills a few bytes
# in multi-row tiles (4x2048, 2x4096 on sm_90a; docs/PERF_kernels.md), at 16 it does not.
_STEP_ELEMS = {"sm_90": 8192, "sm_80": 8192, "interpreter": 16384}
_MAX_BLOCK_N = {"sm_90": 4096, "sm_80": 4096, "interpreter": 4096}
# RMSNorm keeps a whole fp32 row in registers: 32768 elements are 32 per thread at 32 warps (1024
# threads, 64 registers each), which 16-bit sources fit and fp32 sources do not (ptxas spills); fp32
# rows stop at 16384 (16 warps, 32 per thread).
MAX_NORM_HIDDEN = 32768
MAX_NORM_HIDDEN_FP32 = 16384


def max_norm_hidden(dtype: torch.dtype) -> int:
    """The longest row the RMSNorm epilogue accepts for sources of ``dtype``."""
    return MAX_NORM_HIDDEN if dtype.itemsize <= 2 else MAX_NORM_HIDDEN_FP32


@dataclass(frozen=True)
class ReduceConfig:
    block_m: int        # rows per step
    block_n: int        # columns per tile (a whole row, padded to a power of two, with RMSNorm)
    rows_per_prog: int  # rows one program covers (it waits on its chunk's flags once)
    num_warps: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=1024)  # a pure function, asked on every launch
def choose_reduce_config(m: int, n: int, num_sources: int, dtype: torch.dtype, arch: str,
                         num_chunks: int = 1, rmsnorm: bool = False) -> ReduceConfig:
    if rmsnorm and n > max_norm_hidden(dtype):
        raise ValueError(f"RMSNorm epilogue supports rows of at most {max_norm_hidden(dtype)} "
                         f"{dtype} elements (the row is held in registers), got {n}")
    step = _STEP_ELEMS[arch]
    if arch != "interpreter" and dtype.itemsize > 2:
        step //= 2
    block_n = _next_pow2(n) if rmsnorm else min(_next_pow2(n), _MAX_BLOCK_N[arch])
    block_m = max(1, min(64, step // block_n))
    chunk_rows = -(-m // num_chunks)
    block_m = min(block_m, _next_pow2(chunk_rows))
    tiles_n = -(-n // block_n)
    # About 8 tiles per SM: enough to hide latency, few enough that each waits once for many rows.
    # The fused schedules cap the (persistent) grid lower, at one program per SM of their budget
    # (pyfused/fused/config.py grid_budget): each program then walks several tiles. Whether that
    # costs bandwidth against one program per tile is for a GPU run to measure.
    target = 8 * NOMINAL_SMS[arch]
    steps_per_chunk = -(-chunk_rows // block_m)
    steps_per_prog = max(1, -(-(num_chunks * steps_per_chunk * tiles_n) // target))
    rows_per_prog = min(steps_per_prog * block_m, -(-chunk_rows // block_m) * block_m)
    elems = block_m * block_n
    # 32 elements per thread at most: 32 warps (the most a program has) for a 32768-element row
    num_warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16 if elems <= 16384 else 32
    return ReduceConfig(block_m, block_n, rows_per_prog, num_warps)
