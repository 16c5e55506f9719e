"""The sharded optimizer's two collectives, in the form each backend runs fastest.

``reduce_scatter(shard_out, full, pg)``: ``shard_out`` <- this rank's ``shard``-long chunk of the sum
over ranks of ``full``. ``all_gather_in_place(full, shard, pg)``: every rank's chunk of ``full``
(chunk r = ``full[r * shard : (r + 1) * shard]``) <- rank r's chunk. Both are asynchronous and
return a handle with ``wait(timeout)`` and ``is_completed()``, as ``torch.distributed.Work``.

On CUDA tensors (NCCL) they are ``reduce_scatter_single`` and ``all_gather_single``. On CPU tensors
(gloo) they are an all-reduce of ``full`` in place, whose chunk is then copied into ``shard_out``,
and one broadcast per rank of its own chunk: gloo's ring all-reduce and broadcast beat its
reduce-scatter and all-gather by about 2x, wall and CPU time alike. The collectives alone on the
shared, loaded 2-core CPU host (gloo, 12 interleaved rounds, median wall ms / process CPU ms per
call; the step-level figures are in docs/PERF.md):

    world 2, 22 MB bucket: all-reduce 182 / 19.6, reduce_scatter_single 311 / 37.2;
                           all_gather_single 108 / 12.5, 2 broadcasts 64 / 7.4
    world 3, 34 MB bucket: all-reduce 276 / 30.2, reduce_scatter_single 564 / 67.3;
                           all_gather_single 367 / 45.3, 3 broadcasts 104 / 11.1

The all-reduce reads and writes ``full`` in place, so ``full`` must be a buffer the caller no longer
needs (the reducer's transient reduce-scatter input is). Every rank issues the same collectives in
the same order, so ranks that agree on the call agree on the collectives.
"""
from __future__ import annotations

import datetime
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm


class _Works:
    """Several works waited as one; ``then`` (a copy) runs once, after the last of them."""

    def __init__(self, works: List, then: Optional[tuple] = None):
        self.works = works
        self.then = then

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Wait for every work, each at most ``timeout`` (0: no timeout of the wait's own)."""
        for w in self.works:
            w.wait(timeout)
        if self.then is not None:
            dst, src = self.then
            self.then = None
            with torch.no_grad():
                dst.copy_(src)
        return True


def _by_all_reduce(t: Tensor) -> bool:
    return t.device.type == "cpu"


def reduce_scatter(shard_out: Tensor, full: Tensor, pg):
    """Start ``shard_out`` <- this rank's chunk of the sum of ``full`` over ``pg`` (module doc)."""
    if not _by_all_reduce(full):
        return comm.reduce_scatter_single(shard_out, full, group=pg, async_op=True)
    shard = shard_out.numel()
    lo = comm.rank(pg) * shard
    work = dist.all_reduce(full, group=pg, async_op=True)
    return _Works([work], (shard_out, full[lo:lo + shard]))


def all_gather_in_place(full: Tensor, shard: int, pg):
    """Start filling every rank's chunk of ``full`` with that rank's own chunk (module doc)."""
    rank = comm.rank(pg)
    mine = full[rank * shard:(rank + 1) * shard]
    if not _by_all_reduce(full):
        return comm.all_gather_single(full, mine, group=pg, async_op=True)
    works = [dist.broadcast(full[r * shard:(r + 1) * shard], src=comm.global_rank(pg, r),
                            group=pg, async_op=True)
             for r in range(comm.world_size(pg))]
    return _Works(works)
