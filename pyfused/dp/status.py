"""The per-iteration status exchange of the reducer: errors and "used" flags, agreed by every rank.

Once the last bucket is launched every parameter is ready, so the iteration's status is complete:
how many gradients never arrived (an error without ``find_unused_parameters``), how many arrived
twice, and -- with ``find_unused_parameters`` -- which parameters were used. ``launch`` starts its
all-reduce then, asynchronously behind the last bucket, so its latency hides behind the buckets
still in flight; ``read`` (end of backward) waits for it, at most the group's timeout on a CPU
backend (``comm.faults.transfer_timeout``: gloo would start the all-reduce's own clock only once
its worker threads are done with the buckets queued before it). Only when something is wrong does a
second, synchronous agreement (``comm.agree_on``) name the parameters and ranks, so that every
rank raises the same message. Without ``find_unused_parameters`` and with validation off
(``pyfused.comm.set_validation(False)``) nothing is exchanged and errors stay local, as in torch.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm


class StatusExchange:
    def __init__(self, pg, names: Sequence[str], find_unused: bool):
        self.pg = pg
        self.world = comm.world_size(pg)
        self.rank = comm.rank(pg)
        self.names = list(names)
        self.find_unused = find_unused
        self._pending = None

    def launch(self, missing: List[int], dups: List[int], used: Optional[bytearray]) -> None:
        vec = [len(missing), len(dups)] + (list(used) if used is not None else [])
        self._sent = (list(missing), list(dups))
        reduce_it = (self.pg is not None and self.world > 1
                     and (self.find_unused or comm.validation_enabled()))
        t = torch.tensor(vec, dtype=torch.int64)
        work = None
        if reduce_it:
            dev = comm.comm_device(self.pg)
            with comm.on_comm_stream(dev):
                if dev.type == "cuda":  # pinned + non_blocking: no stall of the backward stream
                    t = t.pin_memory().to(dev, non_blocking=True)
                work = dist.all_reduce(t, group=self.pg, async_op=True)
        self._pending = (t, work)

    def read(self, dups_now: List[int], timeout: datetime.timedelta
             ) -> Tuple[Optional[List[int]], Optional[str]]:
        """(per-parameter count of ranks that used it, or None; error message or None), the same
        on every rank -- except for a gradient that arrived twice after ``launch`` (a reentrant
        backward), which only its own rank can know. ``timeout``: what bounds the wait for the
        all-reduce (``comm.faults.transfer_timeout``; 0: no bound of the wait's own)."""
        n = len(self.names)
        t, work = self._pending
        self._pending = None
        if work is not None:
            work.wait(timeout)
        vec = t.cpu().tolist()
        status, used_counts = vec[:2], (vec[2:] if self.find_unused else None)
        missing, dups = self._sent
        if len(dups_now) > len(dups):
            return used_counts, (f"pyfused.DistributedDataParallel: the gradient of "
                                 f"{self.names[dups_now[-1]]!r} arrived twice in one backward, "
                                 f"after its bucket was reduced (a reentrant backward?), on this "
                                 f"rank; not supported")
        if not any(status):
            return used_counts, None
        flags = [0] * (2 * n + self.world)
        for i in missing:
            flags[i] = 1
        for i in dups:
            flags[n + i] = 1
        flags[2 * n + self.rank] = len(missing) + len(dups)
        rows = comm.agree_on(self.pg, "DistributedDataParallel status exchange", flags,
                             width=len(flags), detail="naming the parameters and ranks")
        return used_counts, self._message([sum(column) for column in zip(*rows)], n)

    def _message(self, flags: List[int], n: int) -> str:
        missing = [self.names[i] for i in range(n) if flags[i]]
        dups = [self.names[i] for i in range(n) if flags[n + i]]
        ranks = [r for r in range(self.world) if flags[2 * n + r]]
        where = f" on rank(s) {ranks}" if self.world > 1 else ""
        if missing:
            shown = ", ".join(repr(m) for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
            return (f"pyfused.DistributedDataParallel: {len(missing)} parameter(s) received no gradient "
                    f"in this backward{where}: {shown}. The module has parameters that were not used "
                    f"in producing the loss. Pass find_unused_parameters=True to "
                    f"DistributedDataParallel, and make sure every forward output takes part in the "
                    f"loss. (Their gradients were averaged as zeros so the ranks stay in step.)")
        shown = ", ".join(repr(d) for d in dups[:8])
        return (f"pyfused.DistributedDataParallel: the gradient of {shown} was marked ready twice in "
                f"one backward{where} (a parameter used in several reentrant backward passes, e.g. "
                f"activation checkpointing with use_reentrant=True, or two backward calls through one "
                f"forward); this is not supported")

