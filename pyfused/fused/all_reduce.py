"""Fused all-reduce through symmetric buffers: the custom all-reduce kernel
(``torch.ops.pyfused.all_reduce_rows``, csrc/allreduce_cuda.cu) and the two ops built on it.

  * ``all_reduce_rows(src, pg, ...)``: this rank's ``src`` [rows, cols] is copied into its symmetric
    buffer (or already written there), then one kernel reduces the W buffers (one-shot or two-shot,
    by size: pyfused/fused/config.py) with an optional residual-add + RMSNorm epilogue.
  * ``fused_matmul_all_reduce``: the GEMM writes straight into the symmetric buffer (no copy), then
    the kernel all-reduces it. No overlap of GEMM and communication: the gain is a one-launch,
    latency-bound all-reduce for the small and mid sizes where NCCL's ring is slowest.
  * ``fused_all_reduce_add_rmsnorm``: the epilogue runs in the all-reduce kernel itself, so h never
    makes an extra round trip through memory before the norm.

Why the epilogue is in the CUDA kernel rather than pyfused/kernels/reduce.py's Triton reduce: the
all-reduce needs barriers across ranks at its start (every x written) and end (nobody still reads
this buffer), which the Triton reduce does not have (it waits on per-chunk data flags that a
producer sets); one launch with both barriers and the epilogue is the lowest latency for the sizes
this op serves (decode/prefill activations, 8 KB - a few MB). The Triton reduce is used where
per-chunk flags exist: the owner side of GEMM + reduce-scatter (gemm_collectives.py).

Numerics (the same on every rank, and for both algorithms): h = round(sum_{p=0..W-1} x_p + residual)
with fp32 accumulation in rank order, then the norm over the rounded h -- see csrc/allreduce.cpp.
Every rank therefore returns bitwise-identical outputs (a replicated tensor), which NCCL's
all-reduce followed by a local norm also gives, with different roundings.

CPU: with ``backend="host-shm"`` (tests) the same calls run the op's CPU kernel, which executes the
same schedule over shared memory between processes.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..comm.group import resolve_group, world_size
from ..comm.symmetric import MAX_BLOCKS, SymmetricBuffer
from ..kernels import preload
from . import config


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def all_reduce_rows(src: Tensor, pg, *, out: Optional[Tensor] = None,
                    residual: Optional[Tensor] = None, residual_out: Optional[Tensor] = None,
                    weight: Optional[Tensor] = None, eps: float = 1e-6, algo: Optional[int] = None,
                    backend: Optional[str] = None) -> Tensor:
    """``out = epilogue(sum over ranks of src (+ residual))``; see the module docstring.

    src: [rows, cols] float32/float16/bfloat16, the same shape on every rank; it may already be the
    buffer's ``local_view`` (then nothing is copied). weight: [cols], used in fp32. Returns ``out``.
    """
    pg = resolve_group(pg)
    if src.dim() != 2:
        raise ValueError(f"src must be 2-D [rows, cols], got {tuple(src.shape)}")
    config.check_not_capturing(src.device, "pyfused all_reduce_rows")
    rows, cols = src.shape
    nbytes = rows * cols * _element_size(src.dtype)
    buf = SymmetricBuffer.get(pg, nbytes, src.device, backend)
    view = buf.local_view((rows, cols), src.dtype)
    _check_outside_buffer(buf, out=out, residual_out=residual_out)
    if src.data_ptr() != view.data_ptr():
        view.copy_(src)
    if out is None:
        out = torch.empty((rows, cols), dtype=src.dtype, device=src.device)
    if weight is not None:
        weight = weight.to(torch.float32).contiguous()
    if residual is not None:
        residual = residual.contiguous()
        if residual.data_ptr() % 16:
            # The kernel uses 16-byte accesses only if every local tensor is 16-byte aligned, and
            # that choice sets its block size and so the order of the norm's sum: an unaligned view
            # on one rank would give that rank other last bits than its peers.
            residual = residual.clone()
    if algo is None:
        algo = config.all_reduce_algo(nbytes, world_size(pg))
    epoch = buf.next_epoch()
    # The kernel's grid (at most 64 blocks) is capped by the SM budget of virtual ranks, the same on
    # every rank of the group.
    max_blocks = min(config.budget_in_force() or MAX_BLOCKS, MAX_BLOCKS)
    if preload.active():  # its kernel waits on the peers' flags (pyfused/kernels/preload.py)
        return out
    torch.ops.pyfused.all_reduce_rows(buf.buffer_ptrs_dev, buf.pad_ptrs_dev, out, residual,
                                      residual_out, weight, float(eps), buf.rank, epoch, int(algo),
                                      config.timeout_ms(), max_blocks)
    return out


def _check_outside_buffer(buf: SymmetricBuffer, **outputs: Optional[Tensor]) -> None:
    """Outputs must not live in this rank's symmetric buffer: peers read that memory during the
    kernel (one-shot: every row of it), so writing results there races with their reads."""
    lo = buf.buffer_ptrs[buf.rank]
    hi = lo + buf.data_bytes
    for name, t in outputs.items():
        if t is None or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if start < hi and lo < end:
            raise ValueError(f"all_reduce_rows: {name} overlaps this rank's symmetric buffer, which "
                             f"peers read during the all-reduce; pass a separate tensor")


def fused_matmul_all_reduce(a: Tensor, b: Tensor, pg, *, algo: Optional[int] = None,
                            backend: Optional[str] = None) -> Tensor:
    """``all_reduce(a @ b)``: the GEMM's output is this rank's symmetric buffer."""
    pg = resolve_group(pg)
    m, n = a.shape[0], b.shape[1]
    buf = SymmetricBuffer.get(pg, m * n * _element_size(a.dtype), a.device, backend)
    partial = buf.local_view((m, n), a.dtype)
    # Writing the buffer is safe: the previous call on it ended with the kernel's end barrier (no
    # peer still reads it), and this GEMM is stream-ordered after that kernel.
    torch.matmul(a, b, out=partial)
    return all_reduce_rows(partial, pg, algo=algo, backend=backend)


def fused_all_reduce_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, pg, *,
                                 algo: Optional[int] = None, backend: Optional[str] = None
                                 ) -> Tuple[Tensor, Tensor]:
    """(normed, new_residual) for 2-D ``x`` and ``residual`` [rows, hidden] and ``weight`` [hidden]."""
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    all_reduce_rows(x, pg, out=normed, residual=residual, residual_out=new_residual, weight=weight,
                    eps=eps, algo=algo, backend=backend)
    return normed, new_residual
