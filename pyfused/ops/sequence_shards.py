"""Which global sequence positions each rank of a context-parallel group holds.

``zigzag`` (head-tail; the default): the sequence is cut into 2 * W equal chunks and rank r holds
chunks r and 2W - 1 - r, one after the other. Under a causal mask every rank then does the same
attention work: the early chunk sees few keys, the late one many. ``contiguous``: rank r holds
the r-th of W equal pieces (balanced only without a causal mask).

``shard_sequence`` cuts a global tensor into this rank's rows, ``unshard_sequence`` puts every
rank's rows back in global order, ``local_chunks`` says where a rank's rows sit globally (what
pyfused/ops/attention_blocks.py masks by) and ``shard_positions`` gives their global positions
(rotary embeddings must use these, not 0..S/W - 1).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from .attention_blocks import Chunk

LAYOUTS = ("zigzag", "contiguous")


def pieces_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def local_chunks(rank: int, world: int, local_len: int, layout: str) -> List[Chunk]:
    """The chunks of rank ``rank``'s ``local_len`` rows, in storage order."""
    if layout == "contiguous" or world == 1:
        return [Chunk(0, rank * local_len, local_len)]
    c = local_len // 2
    return [Chunk(0, rank * c, c), Chunk(c, (2 * world - 1 - rank) * c, c)]


def shard_positions(rank: int, world: int, local_len: int, layout: str, device=None) -> Tensor:
    """The global positions of rank ``rank``'s rows, in storage order (int64)."""
    return torch.cat([torch.arange(c.start, c.end, device=device)
                      for c in local_chunks(rank, world, local_len, layout)])


def divisor(world: int, layout: str) -> int:
    """What the global sequence length must be a multiple of."""
    return world * (pieces_per_rank(layout) if world > 1 else 1)


def shard_sequence(x: Tensor, dim: int, rank: int, world: int, layout: str = "zigzag") -> Tensor:
    """Rank ``rank``'s rows of global ``x`` along ``dim`` (a copy). The length must be a multiple
    of ``divisor(world, layout)``: pad it first (``pad_to_shards``) otherwise."""
    length = x.shape[dim]
    if length % divisor(world, layout):
        raise ValueError(f"shard_sequence: length {length} along dim {dim} is not a multiple of "
                         f"{divisor(world, layout)} ({layout} layout over {world} ranks); pad it")
    local = length // world
    return torch.cat([x.narrow(dim, c.start, c.length)
                      for c in local_chunks(rank, world, local, layout)], dim=dim)


def unshard_sequence(shards: Sequence[Tensor], dim: int, layout: str = "zigzag") -> Tensor:
    """The global tensor from every rank's rows (``shards`` in rank order)."""
    world = len(shards)
    local = shards[0].shape[dim]
    pieces = {}
    for r, shard in enumerate(shards):
        for c in local_chunks(r, world, local, layout):
            pieces[c.start] = shard.narrow(dim, c.offset, c.length)
    return torch.cat([pieces[s] for s in sorted(pieces)], dim=dim)


def padded_length(length: int, world: int, layout: str = "zigzag") -> int:
    """The smallest multiple of ``divisor(world, layout)`` >= ``length``."""
    d = divisor(world, layout)
    return -(-length // d) * d
