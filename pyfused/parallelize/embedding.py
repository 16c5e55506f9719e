"""Vocabulary-parallel embedding (Megatron's VocabParallelEmbedding).

Rank r of the TP group holds rows ``r*V/W .. (r+1)*V/W`` of the ``[V, h]`` table -- the same rows a
vocab-parallel LM head (``ColumnParallelLinear`` over V) holds, so a tied LM head shares this very
Parameter. Each rank looks up the ids that fall in its range, writes zeros for the others, and the
partial outputs are all-reduced: every rank gets the full ``[..., h]`` embedding (replicated; the
model's own code then reads its batch-first shape). Backward is the identity: each rank's table shard
gets the gradient of exactly the rows it owns.

A vocabulary V the TP size W does not divide (GPT-2's 50257) is padded to ``padded_vocab(V, W)``
rows, the padding on the last ranks: no id reaches those rows, so they get no gradient; the LM head
(``VocabParallelHead``) computes logits for them too and cuts the gathered logits back to V, so the
model's outputs and loss are the unpadded model's.

A scaled word embedding (Gemma's ``GemmaTextScaledWordEmbedding`` and its Gemma2/3 twins: an
``nn.Embedding`` whose forward multiplies the rows by a non-persistent ``embed_scale`` buffer,
sqrt(hidden)) keeps its scale: ``embed_scale`` becomes the same buffer of the vocab-parallel one.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import comm
from ..layers import ColumnParallelLinear


def padded_vocab(vocab: int, world: int) -> int:
    """The smallest multiple of ``world`` that holds ``vocab`` rows."""
    return -(-vocab // world) * world


def embedding_scale(module: nn.Module) -> Optional[Tensor]:
    """The ``embed_scale`` of a known scaled word embedding (forward: ``embedding(ids) *
    embed_scale.to(weight.dtype)``; transformers' ``*ScaledWordEmbedding`` classes), else None."""
    scale = getattr(module, "embed_scale", None)
    if (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and isinstance(scale, Tensor) and scale.dim() == 0):
        return scale
    return None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, pg):
        if comm.world_size(pg) > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, *,
                 group=None, device=None, dtype=None, embed_scale: Optional[Tensor] = None):
        super().__init__()
        self.pg = comm.resolve_group(group)
        self.world_size, self.rank = comm.world_size(self.pg), comm.rank(self.pg)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.local_rows = padded_vocab(num_embeddings, self.world_size) // self.world_size
        self.start = self.rank * self.local_rows
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, device=device, dtype=dtype))
        # a scaled word embedding's scale, under the original's (non-persistent) buffer name
        self.embed_scale = (None if embed_scale is None else
                            nn.Buffer(embed_scale.detach().clone().to(device), persistent=False))
        nn.init.normal_(self.weight)
        with torch.no_grad():  # padding rows (past the vocabulary): never looked up, kept zero
            self.weight[max(0, min(self.local_rows, num_embeddings - self.start)):].zero_()

    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is None:
            return None
        pad = self.padding_idx % self.num_embeddings
        return pad - self.start if self.start <= pad < self.start + self.local_rows else None

    def forward(self, ids: Tensor) -> Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            # the same ids reach every TP rank, so every rank raises here, before the all-reduce
            raise IndexError(f"VocabParallelEmbedding: token ids must lie in [0, {self.num_embeddings}); "
                             f"got min {int(ids.min())}, max {int(ids.max())}")
        outside = (ids < self.start) | (ids >= self.start + self.local_rows)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx())
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = _ReduceFromGroup.apply(out, self.pg)
        return out if self.embed_scale is None else out * self.embed_scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.start}.."
                f"{self.start + self.local_rows - 1}), padding_idx={self.padding_idx}, "
                f"world={self.world_size}" + ("" if self.embed_scale is None else
                                              f", embed_scale={float(self.embed_scale):.4g}"))


class VocabParallelHead(ColumnParallelLinear):
    """The LM head over a vocabulary padded to a multiple of the TP size (``padded_vocab``): a
    ``ColumnParallelLinear(gather_output=True)`` whose gathered logits are cut back to ``vocab``
    columns (the padded columns get no gradient)."""

    def __init__(self, in_features: int, vocab: int, bias: bool = True, *, group=None, **kwargs):
        world = comm.world_size(comm.resolve_group(group))
        super().__init__(in_features, padded_vocab(vocab, world), bias, group=group, gather_output=True,
                         **kwargs)
        self.vocab = vocab

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return y[..., :self.vocab] if y.shape[-1] != self.vocab else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab={self.vocab} (padded to {self.out_features})"
