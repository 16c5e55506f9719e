"""An RMSNorm over the full width of a column-parallel projection's output (OLMo 2's q_norm / k_norm).

OLMo 2 normalizes the whole query (and key) projection, ``[..., heads * head_dim]``, before splitting
it into heads; under TP each rank holds only its heads' columns. ``ColumnShardedRMSNorm`` keeps the
weight's matching slice and computes the exact mean square of the full row: each rank sums the
squares of its columns, the sums are all-reduced over the TP group (backward: the gradients summed
alike), and the total is divided by the full width. With KV heads replicated on ``replicas`` ranks
each head's columns are counted ``replicas`` times in the sum, so it is divided by ``replicas``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from .. import comm

# RMSNorm classes whose forward is ``(weight * (x.float() * rsqrt(mean(x^2) + eps))).to(x.dtype)``
KNOWN_RMS_NORMS = ("Olmo2RMSNorm",)


def is_known_rms_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__ in KNOWN_RMS_NORMS and isinstance(w, nn.Parameter) and w.dim() == 1
            and getattr(module, "bias", None) is None and hasattr(module, "variance_epsilon"))


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward sums the gradients over the group too (every rank's output
    depends on every rank's input)."""

    @staticmethod
    def forward(ctx, x: Tensor, pg):
        ctx.pg = pg
        x = x.clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.pg)
        return g, None


class ColumnShardedRMSNorm(nn.Module):
    def __init__(self, full_width: int, local_width: int, eps: float, *, group, replicas: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.pg = comm.resolve_group(group)
        self.full_width, self.replicas = full_width, replicas
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(local_width, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        squares = _SumOverGroup.apply(x.pow(2).sum(-1, keepdim=True), self.pg)
        variance = squares / (self.full_width * self.replicas)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * x).to(dtype)

    def extra_repr(self) -> str:
        return (f"local {self.weight.shape[0]} of {self.full_width}, eps={self.variance_epsilon}, "
                f"replicas={self.replicas}")
