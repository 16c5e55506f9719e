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
from ..ops import _common
from ..ops.matmul_reduce_scatter import backward_from_gathered

_ROW_OP = "matmul_reduce_scatter"

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


class RowLinearToSequenceShard(torch.autograd.Function):
    """``reduce_scatter(x @ w^T, dim 0) + bias``: a row-parallel layer with a bias whose output is
    a sequence shard (``x`` [M, ..., in/W] -> [M/W, ..., out]), run by ``matmul_reduce_scatter``.

    The bias is added to this rank's shard, so the gradient summed over this rank's rows alone is a
    partial one, which would need an all-reduce of its own. Backward instead gathers the output
    gradient once, as ``matmul_reduce_scatter``'s own backward does for the input's and the weight's
    gradients, and sums the gathered rows: the full model's bias gradient, the same on every rank,
    with no extra collective (torch's DTensor gets there by adding the bias to the partial sums).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, pg, overlap: str):
        wt = weight.t()
        x2 = x.reshape(-1, x.shape[-1])
        plan = _common.matmul_call_plan(_ROW_OP, x2, wt, pg, overlap)
        y = _common.call_op(plan, torch.ops.pyfused.matmul_reduce_scatter, x2, wt,
                            plan.group_name, plan.method)
        ctx.save_for_backward(x2, weight)
        ctx.group_name, ctx.method, ctx.x_shape = plan.group_name, plan.method, x.shape
        return (y + bias).view(x.shape[0] // plan.world, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, g: Tensor):
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_wt, gathered = backward_from_gathered(
            g.reshape(-1, g.shape[-1]).contiguous(), x2, weight.t(), ctx.group_name, ctx.method,
            need_x, need_w, keep_gathered=need_b)
        return (grad_x.view(ctx.x_shape) if need_x else None,
                grad_wt.t() if need_w else None,  # the gradient of weight.t(), laid out as weight
                gathered.sum(0) if need_b else None, None, None)
