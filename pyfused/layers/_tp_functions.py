"""Autograd pieces of the tensor-parallel layers that are not GEMM+collective ops themselves.

Conventions (Megatron-LM's): a *replicated* activation (the input of a column-parallel layer without
sequence parallelism, the output of a row-parallel one) holds the same value on every rank and a loss
computed from it is counted once, so gradients that flow into it from all ranks are summed.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .. import comm

_COLUMN_BACKWARD = "ColumnParallelLinear backward (input-gradient all-reduce)"


class ColumnLinearReplicatedInput(torch.autograd.Function):
    """``y = x @ w^T + bias`` where ``x`` is replicated and ``w`` is this rank's row shard.

    Backward: grad_x = all_reduce(g @ w) (every rank's output used x). With ``overlap`` other than
    "unfused" that all-reduce is launched asynchronously and runs while the weight gradient
    g^T @ x is computed (Megatron's async gradient all-reduce); "unfused" runs it synchronously.
    Both run inside the registered op ``pyfused::column_linear_backward``, which torch.compile
    keeps whole (it cannot trace an asynchronous collective).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias, group_name: str, overlap: str):
        ctx.group_name, ctx.overlap = group_name, overlap
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w = torch.ops.pyfused.column_linear_backward(
            g, x, weight, ctx.group_name, ctx.overlap, need_x, need_w)
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if (need_b and ctx.has_bias) else None
        return (grad_x if need_x else None), (grad_w if need_w else None), grad_b, None, None


@torch.library.custom_op("pyfused::column_linear_backward", mutates_args=())
@comm.names_failures(_COLUMN_BACKWARD)
def _column_linear_backward(g: Tensor, x: Tensor, weight: Tensor, group_name: str, overlap: str,
                            need_x: bool, need_w: bool) -> Tuple[Tensor, Tensor]:
    """(all_reduce(g @ weight), g^T @ x) of a column-parallel layer with a replicated input; an
    empty tensor for a gradient not needed."""
    pg = comm.group_from_name(group_name)
    work, grad_x = None, g.new_empty((0,))
    if need_x:
        grad_x = g @ weight
        if comm.world_size(pg) > 1:
            work = dist.all_reduce(grad_x, group=pg, async_op=overlap != "unfused")
    grad_w = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if need_w
              else g.new_empty((0,)))
    if work is not None and overlap != "unfused":
        work.wait()
    return grad_x, grad_w


@_column_linear_backward.register_fake
def _(g, x, weight, group_name, overlap, need_x, need_w):
    grad_x = g.new_empty((*g.shape[:-1], weight.shape[1])) if need_x else g.new_empty((0,))
    grad_w = g.new_empty((g.shape[-1], x.shape[-1])) if need_w else g.new_empty((0,))
    return grad_x, grad_w


class GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's tensor along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, pg):
        ctx.pg = pg
        w, r = comm.world_size(pg), comm.rank(pg)
        ctx.width, ctx.rank = x.shape[-1], r
        if w == 1:
            return x.clone()
        parts = x.new_empty((w * x.shape[0], *x.shape[1:]))  # gloo wants dim 0 stacked, not a new dim
        with comm.failures_named("tensor-parallel gather of the last dim", pg):
            comm.all_gather_single(parts, x.contiguous(), group=pg)
        return torch.cat(parts.view(w, *x.shape).unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


class ScatterLastDim(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, pg):
        ctx.pg = pg
        w, r = comm.world_size(pg), comm.rank(pg)
        width = x.shape[-1] // w
        return x[..., r * width:(r + 1) * width].contiguous()

    @staticmethod
    def backward(ctx, g: Tensor):
        return GatherLastDim.apply(g, ctx.pg), None


class AddSequenceParallelBias(torch.autograd.Function):
    """``y + bias`` for a bias replicated across ranks whose output is a sequence shard.

    Each rank's output covers only its own tokens, so each rank's bias gradient is a partial sum; the
    full model's gradient is the sum over the group, all-reduced here in backward so that every
    rank's bias gradient equals the single-device one (Megatron instead all-reduces such grads in its
    optimizer step).
    """

    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor, pg):
        ctx.pg = pg
        return y + bias

    @staticmethod
    def backward(ctx, g: Tensor):
        if not ctx.needs_input_grad[1]:
            return g, None, None
        grad_b = g.reshape(-1, g.shape[-1]).sum(0)
        if comm.world_size(ctx.pg) > 1:
            with comm.failures_named("tensor-parallel bias gradient all-reduce", ctx.pg):
                dist.all_reduce(grad_b, group=ctx.pg)
        return g, grad_b, None
