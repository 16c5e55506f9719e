"""The experts' grouped GEMM of ``moe_dispatch`` and ``moe_combine``: rows grouped by expert, one
weight matrix per expert.

    grouped_mm(rows [R, K], weight [E, K, N], counts)   -> out [R, N]
        out[rows of expert e] = rows[rows of expert e] @ weight[e]; expert e owns the ``counts[e]``
        rows after those of experts 0..e-1 (an expert with no rows is skipped);
    grouped_weight_grad(rows [R, K], grad [R, N], counts) -> [E, K, N]
        the gradient of ``weight``: rows_e^T @ grad_e, zeros for an expert with no rows.

``counts`` are host ints (the ops read them on the host for their transfers anyway). The GEMM runs
as ``torch._grouped_mm`` where torch has a kernel for the device and dtype (CUDA, bf16, compute
capability >= 9.0, row strides 16-byte aligned), else as a loop of one ``torch.matmul`` per expert
-- on CPU always, where torch's ``_grouped_mm`` needs 16-byte aligned strides and its backward fails
(torch 2.14). ``BACKEND`` forces one of them (tests run the ``_grouped_mm`` path on CPU with aligned
shapes, where it does work).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .moe_exchange import note, now

# None: by device and dtype (module docstring); "loop" or "grouped_mm" to force one
BACKEND: Optional[str] = None
_ALIGN_BYTES = 16


def _aligned(t: Tensor) -> bool:
    size = t.element_size()
    return all(s == 1 or (s * size) % _ALIGN_BYTES == 0 for s in t.stride()) and \
        t.data_ptr() % _ALIGN_BYTES == 0


def uses_grouped_mm(rows: Tensor, weight: Tensor) -> bool:
    """Whether ``grouped_mm`` runs ``torch._grouped_mm`` for these operands."""
    if not hasattr(torch, "_grouped_mm") or BACKEND == "loop":
        return False
    if BACKEND != "grouped_mm":
        if rows.device.type != "cuda" or rows.dtype != torch.bfloat16:
            return False
        if torch.cuda.get_device_capability(rows.device) < (9, 0):
            return False
    return rows.dtype == weight.dtype and _aligned(rows) and _aligned(weight)


def _offsets(counts: Sequence[int], device) -> Tensor:
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def grouped_mm(rows: Tensor, weight: Tensor, counts: Sequence[int],
               out: Optional[Tensor] = None) -> Tensor:
    """rows [R, K] grouped by expert (``counts`` rows each), weight [E, K, N] -> [R, N]."""
    total, n = rows.shape[0], weight.shape[-1]
    if out is None:
        out = rows.new_empty((total, n))
    if total == 0:
        return out
    began = now()
    if uses_grouped_mm(rows, weight):
        out.copy_(torch._grouped_mm(rows, weight, offs=_offsets(counts, rows.device)))
    else:
        start = 0
        for e, c in enumerate(counts):
            if c:
                torch.matmul(rows[start:start + c], weight[e], out=out[start:start + c])
            start += c
    note("gemm", began)
    return out


def grouped_weight_grad(rows: Tensor, grad: Tensor, counts: Sequence[int]) -> Tensor:
    """The gradient of ``grouped_mm``'s weight: [E, K, N] with rows_e^T @ grad_e per expert."""
    began = now()
    wgrad = rows.new_zeros((len(counts), rows.shape[1], grad.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.matmul(rows[start:start + c].t(), grad[start:start + c], out=wgrad[e])
        start += c
    note("gemm", began)
    return wgrad
