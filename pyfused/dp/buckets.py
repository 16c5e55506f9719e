"""Bucket layout: which gradients travel together, where each lies, and how buckets are padded.

Assignment (as torch DDP's ``_compute_bucket_assignment_by_size``): trainable parameters are taken
in *reverse* registration order -- roughly the order backward produces their gradients -- and
packed per dtype into buckets of at most ``cap_bytes`` (a bucket is closed once it reaches the cap;
one parameter larger than the cap gets a bucket of its own). The first bucket of each dtype is
capped at ``first_cap_bytes`` (1 MiB) so that the first reduction starts early in backward.

In-place reduction (``own_bytes``, the reducer's choice: pyfused/dp/reducer.py): a parameter of at
least ``own_bytes`` gets a bucket of its own, whose collective runs on the gradient itself -- no
copy into a bucket and back. The smaller parameters around it keep filling their open bucket.
Buckets are then ordered by their *last* member (the point in backward where a bucket becomes
ready), so that a bucket of small parameters collected across several large ones does not hold
back the large ones' reductions (buckets launch in index order). Without ``own_bytes`` the order
is torch's: by first member.

Padding: with a sharded optimizer a bucket is reduce-scattered into ``world`` equal shards, so its
length is rounded up to ``world * shard`` where ``shard = ceil(numel / world)`` rounded up to a
16-byte multiple (every shard starts aligned). With the host-aware all-reduce
(pyfused/dp/reduction.py) a bucket is split into one piece per rank of a host, so its length is
rounded up to a multiple of the ranks per host. The pad is zero in every buffer and stays zero
through the reductions (a sum of zeros), so it never reaches a parameter or a norm.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

FIRST_BUCKET_BYTES = 1024 * 1024
ALIGN_BYTES = 16


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its bucket."""

    param: int          # index among the module's parameters (registration order)
    offset: int         # first element in the bucket
    numel: int
    shape: torch.Size


@dataclass
class Bucket:
    index: int
    dtype: torch.dtype
    slots: List[Slot]
    numel: int          # elements holding gradients
    padded: int         # buffer length (== numel unless sharded)
    shard: int          # padded // world
    # runtime state, reset every synchronising backward
    pending: int = 0
    launched: bool = False
    work: Any = None
    comm_in: Optional[torch.Tensor] = None     # what the collective reads (kept alive until waited)
    extra: dict = field(default_factory=dict)  # buffers owned by the reducer / sharded state


def assign(params: Sequence[Tuple[int, torch.Tensor]], cap_bytes: int,
           first_cap_bytes: int = FIRST_BUCKET_BYTES,
           order: Optional[Sequence[int]] = None,
           own_bytes: Optional[int] = None) -> List[List[int]]:
    """Bucket assignment: lists of parameter indices, bucket 0 first. Parameters are taken in
    ``order`` (indices, the first to get its gradient first: the order a backward was observed to
    produce them) or, by default, in reverse registration order. ``own_bytes``: parameters at least
    this large get a bucket of their own (in-place reduction; module docstring)."""
    open_: dict = {}
    closed: List[Tuple[int, List[int]]] = []  # (sort position, members)
    last: dict = {}  # open bucket's dtype -> position of its last member
    sizes: dict = {}
    count: dict = {}
    if order is None:
        seq = list(reversed(list(params)))
    else:
        by_index = dict(params)
        seq = [(i, by_index[i]) for i in order]
    for pos, (idx, p) in enumerate(seq):
        key = p.dtype
        if own_bytes is not None and p.numel() * p.element_size() >= own_bytes:
            closed.append((pos, [idx]))
            count[key] = count.get(key, 0) + 1
            continue
        if key not in open_:
            open_[key] = (pos, [])
            sizes[key] = 0
        open_[key][1].append(idx)
        last[key] = pos
        sizes[key] += p.numel() * p.element_size()
        limit = first_cap_bytes if count.get(key, 0) == 0 else cap_bytes
        if sizes[key] >= limit:
            closed.append(_positioned(open_.pop(key), last[key], own_bytes))
            count[key] = count.get(key, 0) + 1
    closed.extend(_positioned(b, last[k], own_bytes) for k, b in open_.items())
    closed.sort(key=lambda c: c[0])
    return [members for _, members in closed]


def _positioned(bucket: Tuple[int, List[int]], last_pos: int,
                own_bytes: Optional[int]) -> Tuple[int, List[int]]:
    """``bucket`` (first position, members) keyed for sorting: by its first member (torch's order),
    or by its last with in-place reduction (module docstring)."""
    return bucket if own_bytes is None else (last_pos, bucket[1])


def build(params: Sequence[torch.Tensor], indices: List[List[int]], world: int,
          sharded: bool, multiple: int = 1) -> List[Bucket]:
    """Buckets of ``indices``' parameters; unsharded buffers padded to a multiple of ``multiple``."""
    buckets = []
    for b, members in enumerate(indices):
        slots, off = [], 0
        dtype = params[members[0]].dtype
        for i in members:
            p = params[i]
            slots.append(Slot(i, off, p.numel(), p.shape))
            off += p.numel()
        if sharded:
            align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            shard = -(-off // world)
            shard = -(-shard // align) * align
            padded = shard * world
        else:
            padded = -(-off // multiple) * multiple
            shard = padded
        buckets.append(Bucket(b, dtype, slots, off, padded, shard))
    return buckets
