"""Sequence parallelism for batch-first models: where the layout changes, and the autograd of each change.

Layout choice. transformers models run batch-first ``[b, s, h]``; pyfused's ops gather and scatter
dim 0 (Megatron's sequence-first convention). Inside the decoder blocks -- the sequence-parallel
region -- the residual stream is kept **sequence-first and sharded**: rank r of the TP group holds
``[s/W, b, h]``, positions ``r*s/W .. (r+1)*s/W`` of every sample, contiguous. Then

  * a column-parallel layer runs ``all_gather_matmul`` on that shard directly (no copy) and returns
    ``[s, b, out/W]`` seen through ``transpose(0, 1)`` as the ``[b, s, out/W]`` the attention / MLP
    code expects (a view, no copy; the head reshapes only split the last dim, which stays contiguous);
  * a row-parallel layer takes the batch-first ``[b, s, in/W]`` the module produced, views it as
    ``[s, b, in/W]`` and reduce-scatters dim 0 (``matmul_reduce_scatter``): out comes the next
    ``[s/W, b, h]`` shard. For the MLP the view is already contiguous (elementwise ops keep the
    sequence-first memory order of their inputs); for attention it costs one copy of ``[b, s, h/W]``;
  * norms, dropout and residual adds are per token and run on the shard unchanged.

We did not choose a flattened-token view (``[b*s, h]`` split in W chunks): it is zero-copy too, but
its shards carry no batch/sequence shape, so every column layer would need the ``(b, s)`` of the
current call from side state (and a PP microbatch changes ``b``); the sequence-first shard is
self-describing (``b`` is dim 1, ``s`` is W times dim 0) and is Megatron's layout.

The model's own code outside the blocks (embedding, position ids, masks, rotary tables, final norm,
LM head) reads ``input.shape[1]`` as the sequence length, so the region is entered at the first block
(``scatter_to_sequence_shard``: split, backward all-gather) and left after the last one
(``gather_from_sequence_shard``: all-gather, backward keep own slice -- the gathered tensor is
replicated and its consumers' column layers all-reduce their input gradients, Megatron's rule).

Attention modules that read their *input's* shape (transformers' LlamaAttention does
``hidden_states.shape[:-1]``) cannot take a shard: for them the plan style ``attention`` gathers the
input once at the module's entry (``gather_for_local_columns``: all-gather, backward one
reduce-scatter) and their q/k/v projections are plain local GEMMs on that gathered input
(``LocalInputColumn``): autograd sums the three projections' input gradients on each rank, and the
one reduce-scatter both adds them over the group and returns this rank's slice -- Megatron's
sequence-parallel rule, instead of one all-reduce per projection; GPT2Attention takes all shapes
from its fused ``c_attn`` output, so its projection gathers the shard itself, overlapped with the
GEMM.

Parameters replicated across the TP group that see only the local shard's tokens (the norms inside
the blocks) get partial gradients; ``sum_grad_over_group`` adds a hook that all-reduces them, so
every rank holds the full model's gradient after ``backward()`` (as the row-parallel bias does).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from ..layers import ColumnParallelLinear, RowParallelLinear


def _check_divisible(seq: int, world: int) -> None:
    if seq % world != 0:
        raise ValueError(
            f"pyfused.parallelize: sequence length {seq} is not divisible by the tensor-parallel size "
            f"{world}; sequence parallelism shards the sequence: pad the batch to a multiple of "
            f"{world} or parallelize with sequence_parallel=False")


def _all_gather_dim0(x: Tensor, pg) -> Tensor:
    w = comm.world_size(pg)
    if w == 1:
        return x
    out = x.new_empty((w * x.shape[0], *x.shape[1:]))
    comm.all_gather_single(out, x.contiguous(), group=pg)
    return out


class _ScatterToSequenceShard(torch.autograd.Function):
    """``[b, s, h]`` replicated -> this rank's ``[s/W, b, h]``. Backward: all-gather the shards' grads."""

    @staticmethod
    def forward(ctx, x: Tensor, pg):
        ctx.pg = pg
        w, r = comm.world_size(pg), comm.rank(pg)
        _check_divisible(x.shape[1], w)
        n = x.shape[1] // w
        return x.transpose(0, 1)[r * n:(r + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, g: Tensor):
        return _all_gather_dim0(g, ctx.pg).transpose(0, 1), None


class _GatherFromSequenceShard(torch.autograd.Function):
    """``[s/W, b, h]`` shard -> replicated ``[b, s, h]``. Backward: keep this rank's slice (the consumers
    of a replicated tensor already summed their gradients over the group)."""

    @staticmethod
    def forward(ctx, x: Tensor, pg):
        ctx.pg = pg
        ctx.rank, ctx.n = comm.rank(pg), x.shape[0]
        return _all_gather_dim0(x, pg).transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, g: Tensor):
        r, n = ctx.rank, ctx.n
        return g.transpose(0, 1)[r * n:(r + 1) * n].contiguous(), None


class _GatherForLocalColumns(torch.autograd.Function):
    """``[s/W, b, h]`` shard -> ``[b, s, h]`` for consumers that are all local column shards
    (``LocalInputColumn``). Their input gradients are per-rank partial sums, so backward
    reduce-scatters them: sum over the group, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, pg):
        ctx.pg = pg
        return _all_gather_dim0(x, pg).transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.transpose(0, 1).contiguous()
        w = comm.world_size(ctx.pg)
        if w == 1:
            return g, None
        out = g.new_empty((g.shape[0] // w, *g.shape[1:]))
        comm.reduce_scatter_single(out, g, group=ctx.pg)
        return out, None


def gather_for_local_columns(x: Tensor, pg) -> Tensor:
    return _GatherForLocalColumns.apply(x, pg)


def scatter_to_sequence_shard(x: Tensor, pg) -> Tensor:
    return _ScatterToSequenceShard.apply(x, pg)


def gather_from_sequence_shard(x: Tensor, pg) -> Tensor:
    return _GatherFromSequenceShard.apply(x, pg)


class SequenceParallelColumn(ColumnParallelLinear):
    """ColumnParallelLinear(sequence_parallel=True) between a sequence-first shard and batch-first code:
    ``[s/W, b, in]`` -> ``[b, s, out/W]`` (a transposed view of the gathered GEMM's output)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected a [s/W, b, in] sequence shard, got "
                             f"{tuple(x.shape)}")
        return super().forward(x).transpose(0, 1)


class LocalInputColumn(ColumnParallelLinear):
    """A column shard applied to an input that ``gather_for_local_columns`` produced: a plain local
    GEMM, no communication (that gather's backward reduce-scatters the input gradient)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class SequenceParallelRow(RowParallelLinear):
    """RowParallelLinear(sequence_parallel=True) from batch-first code back to the sequence shard:
    ``[b, s, in/W]`` -> ``[s/W, b, out]``."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected a batch-first [b, s, in/W] input, got "
                             f"{tuple(x.shape)}")
        _check_divisible(x.shape[1], self.world_size)
        return super().forward(x.transpose(0, 1))


def sum_grad_over_group(param: torch.nn.Parameter, pg) -> Optional[torch.utils.hooks.RemovableHandle]:
    """All-reduce (sum) ``param``'s gradient over ``pg`` as backward produces it (every TP rank runs the
    same graph, so the hooks fire in the same order everywhere)."""
    if comm.world_size(pg) == 1:
        return None

    def hook(grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=pg)
        return grad

    return param.register_hook(hook)
