"""The transfer engine of a schedule: batched posting, lazy send completion, reused buffers.

``Transport.post`` issues one ``dist.batch_isend_irecv`` per plan step (see plan.py for what goes in
it). Receive works are kept per message and waited right before the compute that needs them; send
works are kept in a queue and dropped when they have completed (polled at every step), waited only
when more than ``MAX_OPEN_SENDS`` are open or at the end of the step.

Every wait is given the group's timeout (``pyfused.comm.faults.transfer_timeout``): without one,
gloo bounds a p2p wait by the timeout the group was created with, not by one set later
(``torch.distributed.set_timeout``, which ``parallelize`` uses on its mesh's groups). The moments
``pipeline.post``, ``pipeline.recv`` and ``pipeline.finish`` (``:before`` / ``:after``) are fault
points (``pyfused.comm.faults.fault_point``) for the fault tests.

Receive buffers come from a pool keyed by (shape, dtype) and go back to it when the consumer is
done (a received activation after its microbatch's backward, a gradient after the backward that
used it), so a steady-state step allocates no communication memory.

On CUDA the batch is issued from pyfused's comm stream (``pyfused.comm.on_comm_stream``), which first
waits for the compute stream so that a sent activation is complete; NCCL runs the transfers on its
own stream, ``work.wait()`` makes the compute stream wait for a receive, and ``keep_alive`` tells
the caching allocator that the comm stream uses the tensors. On CPU all of that is a no-op.
(Written for GPUs, exercised only on gloo/CPU so far.)
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..comm.faults import fault_point
from .plan import Message

MAX_OPEN_SENDS = 64
# What a failed transfer is reported as (pyfused.comm.faults), with the message and its peer.
TRANSFER = "pipeline schedule step"


def completes_as_group(pg: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether this backend coalesces a batch (NCCL: it completes as one ordered group)."""
    if pg is None:
        return False
    try:
        backend = pg._get_backend(device)
    except RuntimeError:
        return False
    return bool(getattr(backend, "supports_coalescing", False))


class BufferPool:
    """Free receive buffers by (shape, dtype); allocation happens only when none is free."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: Dict[Tuple, List[torch.Tensor]] = defaultdict(list)
        self.allocated = 0

    def acquire(self, meta: comm.TensorMeta) -> torch.Tensor:
        free = self._free[meta.shape, meta.dtype]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def release(self, buf: torch.Tensor) -> None:
        self._free[tuple(buf.shape), buf.dtype].append(buf)

    def clear(self) -> None:
        self._free.clear()


class Transport:
    def __init__(self, pg: Optional[dist.ProcessGroup], device: torch.device):
        self.pg = pg
        self.device = device
        self.pool = BufferPool(device)
        # (works, tensors, peer) per message; sends also keep their message, for errors
        self._recvs: Dict[Message, Tuple[List, Tuple[torch.Tensor, ...], int]] = {}
        self._sends: Deque[Tuple[List, Tuple[torch.Tensor, ...], Message, int]] = deque()
        self.recorder = None  # a timeline.Recorder while one step is being recorded
        self.timeout = comm.faults.transfer_timeout(pg, device)  # read again by reset()

    def post(self, sends: Sequence[Tuple[Message, int, Tuple[torch.Tensor, ...]]],
             recvs: Sequence[Tuple[Message, int, Tuple[torch.Tensor, ...]]]) -> None:
        """One batched call for all of a step's sends and receives ((message, group peer, tensors))."""
        ops, owners = [], []
        for msg, peer, tensors in sends:
            for t in tensors:
                ops.append(dist.P2POp(dist.isend, t, group=self.pg, group_peer=peer))
                owners.append(("send", msg))
        for msg, peer, tensors in recvs:
            for t in tensors:
                ops.append(dist.P2POp(dist.irecv, t, group=self.pg, group_peer=peer))
                owners.append(("recv", msg))
        if not ops:
            return
        t0 = time.perf_counter()
        fault_point("pipeline.post:before")
        with comm.on_comm_stream(self.device) as stream, comm.failures_named(
                TRANSFER, self.pg, ("posting", len(ops), "transfers")):
            works = dist.batch_isend_irecv(ops)
        fault_point("pipeline.post:after")
        for op in ops:
            comm.keep_alive(op.tensor, stream)
        if len(works) != len(ops):  # coalesced: the batch's works stand for every op in it
            per_op = [list(works)] * len(ops)
        else:
            per_op = [[w] for w in works]
        send_works: Dict[Message, List] = defaultdict(list)
        recv_works: Dict[Message, List] = defaultdict(list)
        for (kind, msg), w in zip(owners, per_op):
            (send_works if kind == "send" else recv_works)[msg].extend(w)
        for msg, peer, tensors in sends:
            self._sends.append((send_works[msg], tensors, msg, peer))
        for msg, peer, tensors in recvs:
            self._recvs[msg] = (recv_works[msg], tensors, peer)
        if self.recorder is not None:
            self.recorder.post(t0, time.perf_counter(), [m for m, _, _ in sends],
                               [m for m, _, _ in recvs])
        self._reap()

    def reset(self) -> None:
        """Start a step: forget works of a step that ended with an exception (its group is then
        suspect anyway) and read the group's timeout again (``set_timeout`` may have changed it)."""
        self._recvs.clear()
        self._sends.clear()
        self.timeout = comm.faults.transfer_timeout(self.pg, self.device)

    def wait_recv(self, msg: Message) -> Tuple[torch.Tensor, ...]:
        works, tensors, peer = self._recvs.pop(msg)
        t0 = time.perf_counter()
        fault_point("pipeline.recv:before")
        with comm.failures_named(TRANSFER, self.pg, ("receiving", msg), peer):
            for w in works:
                w.wait(self.timeout)
        fault_point("pipeline.recv:after")
        if self.recorder is not None:
            self.recorder.wait(msg, t0, time.perf_counter())
        return tensors

    def _reap(self) -> None:
        """Forget completed sends (oldest first); wait if too many are still open."""
        while self._sends and all(w.is_completed() for w in self._sends[0][0]):
            self._sends.popleft()
        while len(self._sends) > MAX_OPEN_SENDS:
            self._wait_send(self._sends.popleft())

    def _wait_send(self, entry) -> None:
        works, _, msg, peer = entry
        with comm.failures_named(TRANSFER, self.pg, ("sending", msg), peer):
            for w in works:
                w.wait(self.timeout)

    def finish(self) -> None:
        """Complete every open send (end of a step); receives must all have been consumed."""
        fault_point("pipeline.finish:before")
        while self._sends:
            self._wait_send(self._sends.popleft())
        fault_point("pipeline.finish:after")
        if self._recvs:
            left = ", ".join(map(str, self._recvs))
            self._recvs.clear()
            raise RuntimeError(f"pyfused.pipeline: receives posted but never used: {left}")
