"""Fused all-gather + GEMM and GEMM + reduce-scatter over symmetric buffers.

Both schedules start with an *entry barrier* (``pyfused::symm_barrier``, channel CHAN_ENTRY, on the
compute stream): a rank arrives only after everything it queued earlier -- in particular its reads of
its own buffer in the previous call -- so once the barrier is passed nobody still reads a buffer
that this call is about to write into. Data flags then carry the call's epoch (one per chunk, in
the owner's pad: ``SymmetricBuffer.flags``); waits are for ">= epoch", so nothing is reset.

all-gather + GEMM (``fused_all_gather_matmul``), a: this rank's shard [m, K], out [W*m, N]
  1. own shard -> own buffer rows [r*m, (r+1)*m) and own flag r (compute stream);
  2. for each peer q (r+1, r+2, ...), on a side stream of its own (``streams.push_streams``, so the
     W-1 pushes run concurrently and each peer's chunk lands without waiting for the others): copy
     the shard into q's buffer rows [r*m, (r+1)*m) -- a device-to-device copy into mapped peer
     memory, i.e. the copy engine -- then ``signal_flag`` q's flag r (fence + release at system
     scope, after the copy in stream order);
  3. the persistent Triton GEMM (pyfused/kernels/gemm.py, WAIT mode) over the gathered buffer, chunk
     c = the shard of rank c, in the order r, r-1, r-2, ... -- local data first, then the peers'
     chunks in the order their pushes land (step i of every rank s pushes to s+i, so r receives r-i)
     -- each as soon as its flag says it landed (acquire at system scope in the kernel).
GEMM + reduce-scatter (``fused_matmul_reduce_scatter``), a [M, K], out [M/W, N]
  1. the persistent GEMM with chunk c = the rows rank c owns, computed in the order r+1, r+2, ...,
     r (own chunk last), SCATTER mode: chunk c is stored into slot r of rank c's buffer; SIGNAL mode
     counts the stored tiles of each chunk in a local counter (release at system scope);
  2. on the comm stream, beside the GEMM, for each peer's chunk c in the same order: ``wait_flag``
     until its counter is complete, then ``signal_flag`` flag r of rank c; the own flag r is set on
     the compute stream after the GEMM;
  3. the owner's multi-source reduce (pyfused/kernels/reduce.py) sums its W slots in rank order,
     waiting per slot on flag s (source s wrote it).
  The relay's one-thread kernels need an SM while this rank's GEMM and then its reduce spin on SMs:
  both are persistent and capped at ``config.grid_budget`` programs (the device's SMs less
  ``config.RELAY_SMS``, or the virtual rank's share), so spinning programs never hold every SM's
  room for a relay block. An uncapped reduce (one program per tile) could hold every SM's slots
  while a peer waits for this rank's relay, and the peer's owner for it: a cross-rank deadlock.

Every kernel's grid is capped at ``config.grid_budget`` programs: with virtual ranks
(pyfused/testing/virtual_ranks.py) each rank's kernels then fit beside the other ranks' on one GPU.

Waits in the Triton kernels are bounded in wall-clock time (``PYFUSED_FUSED_TIMEOUT_MS``, read
against ``%globaltimer``): one that gives up is reported by
``TIMEOUTS`` as ``WaitTimeout`` on a later fused call, without a host sync per call (see
``TimeoutWatch``); the waits in the CUDA kernels trap instead. Epochs are host-side state, so these
schedules are not CUDA-graph capturable.

One stream per group: the entry barrier orders only the work queued on the stream it runs on, so
consecutive fused calls on one group (and size class) must be issued on the same CUDA stream --
as an op called from a training step is. A call on another stream could push into a peer's buffer
while that peer's previous GEMM on the first stream still reads it.

CPU model (``backend="host-shm"``, Triton interpreter): the same buffers, copies, flags and kernels,
but a CPU wait cannot block (the interpreter runs programs one after another), so a host barrier
(channel CHAN_SYNC) after the data movement stands in for the in-kernel waits; the kernels still
check every flag they would have waited on. Where the ranks are threads whose interpreted launches
may overlap (``concurrent_interpreter_launches``: the threaded-rank tests), the kernels wait for
the peers' flags themselves and there is no host barrier (``_waits_block``).
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Deque, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..comm import streams
from ..comm.flags import signal_flag, wait_flag
from ..comm.group import rank as group_rank, resolve_group, world_size
from ..comm.symmetric import CHAN_ENTRY, CHAN_SYNC, SymmetricBuffer
from ..kernels import preload
from ..kernels.gemm_launch import describe_gemm_timeout, gemm, plan_gemm
from ..kernels.reduce_launch import (
    PointerTable,
    WaitTimeout,
    describe_reduce_timeout,
    interpreter_launches_concurrent,
    multi_source_reduce,
    new_status,
)
from . import config


class TimeoutWatch:
    """The Triton kernels' bounded waits, reported without a host sync. A wait that gives up writes
    a code into its launch's status word and the kernel goes on (pyfused/kernels/gemm.py "No hang");
    on CUDA the launcher cannot look without synchronizing. So each launch's status is copied to
    pinned host memory behind an event, and every later fused call checks -- without blocking --
    those whose event has completed, raising ``WaitTimeout`` for one that timed out (a late but loud
    error instead of a silently wrong result). ``check(sync=True)`` waits for all of them.

    The pinned words are slots of one ring, allocated at the first watch: allocating pinned memory
    waits for every kernel of the context (CUDA's implicit synchronization), so a per-call
    allocation could wait behind a peer's spinning kernel (virtual ranks share one context), and it
    costs host time on every call. A slot is reused once its entry has left ``pending``; with every
    slot pending, the oldest is waited for."""

    RING_SLOTS = 1024

    def __init__(self) -> None:
        self.pending: Deque[Tuple[torch.cuda.Event, Tensor, Callable[[int], str], str]] = deque()
        self.lock = threading.Lock()  # virtual ranks call from several threads
        self._ring: Optional[Tensor] = None
        self._next = 0

    def watch(self, status: Tensor, describe: Callable[[int], str], what: str) -> None:
        if status.device.type != "cuda":
            return  # the CPU launchers check their status themselves
        with self.lock:
            if self._ring is None:
                self._ring = torch.zeros(self.RING_SLOTS, dtype=torch.int32, pin_memory=True)
            if len(self.pending) >= self.RING_SLOTS:
                self.pending[0][0].synchronize()  # its slot is the one taken next
                self._report(*self.pending.popleft())
            slot = self._next % self.RING_SLOTS
            self._next += 1
            host = self._ring[slot:slot + 1]
            host.copy_(status, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((event, host, describe, what))

    def check(self, sync: bool = False) -> None:
        while True:
            with self.lock:
                if not self.pending or not (sync or self.pending[0][0].query()):
                    return
                event, host, describe, what = self.pending.popleft()
            event.synchronize()
            with self.lock:
                self._report(event, host, describe, what)

    def _report(self, event, host: Tensor, describe: Callable[[int], str], what: str) -> None:
        """Raise for a completed entry whose wait gave up (called with ``lock`` held)."""
        code = int(host[0])
        if code:
            self.pending.clear()
            raise WaitTimeout(f"{what}: gave up waiting on {describe(code)} (a peer never "
                              f"signalled); that call's output was wrong")


TIMEOUTS = TimeoutWatch()


def _waits_block(device: torch.device) -> bool:
    """Whether a kernel's wait can outlast the peer's flag write it waits for (GPU; interpreted
    launches that may overlap), or a host barrier must order them (see "CPU model")."""
    return device.type == "cuda" or interpreter_launches_concurrent()


def _barrier(buf: SymmetricBuffer, channel: int, epoch: int, timeout_ms: Optional[int] = None) -> None:
    """The ranks' barrier on ``channel`` (``timeout_ms``: the call's ``config.timeout_ms()``); in a
    preload pass (pyfused/kernels/preload.py) the ranks' threads meet on the host instead."""
    if buf.world > 1 and preload.active():
        preload.barrier(buf.device)
    elif buf.world > 1:
        timeout_ms = config.timeout_ms() if timeout_ms is None else timeout_ms
        torch.ops.pyfused.symm_barrier(buf.pad_ptrs_dev, buf.rank, channel, 0, epoch, timeout_ms)


def _peer_wait(flags: Tensor, index: int, value: int, timeout_ms: int) -> None:
    """``wait_flag`` on the current stream; nothing in a preload pass (its waits would spin on
    flags that nobody sets in that pass)."""
    if not preload.active():
        wait_flag(flags, index, value, timeout_ms)


@contextmanager
def _on(stream, device: torch.device) -> Iterator[None]:
    """Queue the body on ``stream``, after the work already queued on the current stream (CPU:
    runs it now)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


@dataclass
class _GatherLayout:
    """The views ``fused_all_gather_matmul`` takes of one buffer for one (m, K, dtype): built on the
    first call and kept in the buffer's ``extras`` (dropped when the buffer is freed)."""

    gathered: Tensor  # this rank's data area as [W*m, K]
    own_rows: Tensor  # its rows [r*m, (r+1)*m)
    flags: Tensor  # this rank's W chunk flags
    # step i = 1 .. W-1, to peer q = r+i: (q's rows [r*m, (r+1)*m), q's flags)
    pushes: List[Tuple[Tensor, Tensor]]
    order: List[int]  # the GEMM's chunk order: r, r-1, r-2, ...


def _gather_layout(buf: SymmetricBuffer, m: int, k: int, dtype: torch.dtype) -> _GatherLayout:
    key = ("ag", m, k, dtype)
    layout = buf.extras.get(key)
    if layout is None:
        w, r = buf.world, buf.rank
        gathered = buf.local_view((w * m, k), dtype)
        peers = [(r + i) % w for i in range(1, w)]
        pushes = [(buf.peer(q, (w * m, k), dtype)[r * m:(r + 1) * m], buf.flags(q, count=w))
                  for q in peers]
        # Chunks in the order they land: rank s pushes to s+1, s+2, ..., so rank r receives r-1
        # first, then r-2, ...; the GEMM takes its own chunk, then r-1, r-2, ...
        layout = buf.extras[key] = _GatherLayout(gathered, gathered[r * m:(r + 1) * m],
                                                 buf.flags(count=w), pushes,
                                                 [(r - i) % w for i in range(w)])
    return layout


@dataclass
class _ScatterLayout:
    """What ``fused_matmul_reduce_scatter`` takes of one buffer for one (M/W, N, dtype), built once
    like ``_GatherLayout``. Pointer tables are built once per buffer and layout: no host-to-device
    copy per call."""

    targets: PointerTable  # chunk c -> slot r of rank c's buffer
    sources: PointerTable  # slot s of this rank's buffer, s = 0 .. W-1
    flags: Tensor  # this rank's W chunk flags
    peer_flags: List[Tuple[int, Tensor]]  # the GEMM's chunk order without r: (c, rank c's flags)
    order: List[int]  # the GEMM's chunk order: r+1, r+2, ..., r


def _scatter_layout(buf: SymmetricBuffer, mc: int, n: int, dtype: torch.dtype) -> _ScatterLayout:
    key = ("rs", mc, n, dtype)
    layout = buf.extras.get(key)
    if layout is None:
        w, r, device = buf.world, buf.rank, buf.device
        slot = mc * n * dtype.itemsize
        targets = PointerTable.from_addresses([buf.buffer_ptrs[c] + r * slot for c in range(w)],
                                              (mc, n), (n, 1), dtype, device)
        sources = PointerTable.from_addresses([buf.buffer_ptrs[r] + s * slot for s in range(w)],
                                              (mc, n), (n, 1), dtype, device)
        order = [(r + 1 + i) % w for i in range(w)]
        layout = buf.extras[key] = _ScatterLayout(
            targets, sources, buf.flags(count=w),
            [(c, buf.flags(c, count=w)) for c in order if c != r], order)
    return layout


def fused_all_gather_matmul(a: Tensor, b: Tensor, pg, keep_gathered: bool, *,
                            backend: Optional[str] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(all_gather(a) @ b, a copy of all_gather(a) if keep_gathered else None); 2-D a [m, K]."""
    pg = resolve_group(pg)
    config.check_not_capturing(a.device, "pyfused all_gather_matmul")
    TIMEOUTS.check()
    w, r = world_size(pg), group_rank(pg)
    m, k = a.shape
    dtype, device = a.dtype, a.device
    buf = SymmetricBuffer.get(pg, w * m * k * dtype.itemsize, device, backend)
    layout = _gather_layout(buf, m, k, dtype)
    epoch = buf.next_epoch()
    timeout = config.timeout_ms()
    _barrier(buf, CHAN_ENTRY, epoch, timeout)
    layout.own_rows.copy_(a)
    signal_flag(layout.flags, r, epoch)
    pushes = streams.push_streams(device, w - 1)
    for stream, (rows, flags) in zip(pushes, layout.pushes):
        with _on(stream, device):
            rows.copy_(a)
            signal_flag(flags, r, epoch)
        streams.keep_alive(a, stream)
    if not _waits_block(device):
        _barrier(buf, CHAN_SYNC, epoch, timeout)
    # The persistent GEMM spins on SMs waiting for peers' chunks, while this rank's own signal
    # kernels (push streams) must still find an SM for the peers' GEMMs to progress: capped grid.
    status = new_status(device)
    out = gemm(layout.gathered, b, num_chunks=w, chunk_order=layout.order, wait_flags=layout.flags,
               wait_expected=epoch, flag_scope="sys", status=status,
               num_programs=config.grid_budget(device), timeout_ms=timeout)
    TIMEOUTS.watch(status, lambda code: f"{describe_gemm_timeout(code)}: flag {code - 1} of rank {r}, "
                   f"set by peer {code - 1}'s push", f"fused all_gather_matmul, rank {r}")
    streams.join_comm_stream(device, *pushes)
    return out, (layout.gathered.clone() if keep_gathered else None)


def fused_matmul_reduce_scatter(a: Tensor, b: Tensor, pg, *, backend: Optional[str] = None) -> Tensor:
    """This rank's [M/W, N] chunk of the sum over ranks of a @ b; 2-D a [M, K], M % W == 0."""
    pg = resolve_group(pg)
    config.check_not_capturing(a.device, "pyfused matmul_reduce_scatter")
    TIMEOUTS.check()
    w, r = world_size(pg), group_rank(pg)
    big_m, k = a.shape
    n = b.shape[1]
    mc = big_m // w
    dtype, device = a.dtype, a.device
    buf = SymmetricBuffer.get(pg, w * mc * n * dtype.itemsize, device, backend)
    layout = _scatter_layout(buf, mc, n, dtype)
    epoch = buf.next_epoch()
    timeout = config.timeout_ms()
    budget = config.grid_budget(device)
    _barrier(buf, CHAN_ENTRY, epoch, timeout)
    if device.type == "cuda":
        # The relay waits for the tile count of this rank's GEMM config, which depends on TF32:
        # the plan and the launch must see the same allow_tf32.
        tf32 = dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
        plan = plan_gemm(big_m, n, k, dtype, device, num_chunks=w, allow_tf32=tf32)
        counters = torch.zeros(w, dtype=torch.int32, device=device)
        relay = streams.comm_stream(device)
        relay.wait_stream(torch.cuda.current_stream(device))  # sees the barrier and the zeroed counters
        gemm(a, b, num_chunks=w, chunk_order=layout.order, out_chunks=layout.targets,
             signal_counters=counters, signal_scope="sys", num_programs=budget, allow_tf32=tf32)
        # This rank's own slot is written by the GEMM just queued on this stream, so its flag is set
        # here, stream-ordered after it: the reduce below then never spins on a flag whose setter
        # (a relay kernel) would need an SM that the spinning reduce's programs may all hold.
        signal_flag(layout.flags, r, epoch)
        with torch.cuda.stream(relay):
            for c, peer_flags in layout.peer_flags:
                _peer_wait(counters, c, plan.tiles_per_chunk, timeout)
                signal_flag(peer_flags, r, epoch)
        streams.keep_alive(counters, relay)
        streams.keep_alive(a, relay)
    else:
        gemm(a, b, num_chunks=w, chunk_order=layout.order, out_chunks=layout.targets,
             num_programs=budget)
        for c, peer_flags in layout.peer_flags:
            signal_flag(peer_flags, r, epoch)
        signal_flag(layout.flags, r, epoch)
        if not _waits_block(device):
            _barrier(buf, CHAN_SYNC, epoch, timeout)
    status = new_status(device)
    out = multi_source_reduce(layout.sources, wait_flags=layout.flags.view(w, 1), wait_expected=epoch,
                              flag_scope="sys", status=status, timeout_ms=timeout,
                              num_programs=budget)
    describe = describe_reduce_timeout(w, 1)
    TIMEOUTS.watch(status, lambda code: f"{describe(code)}: flag {code - 1} of rank {r}, set by peer "
                   f"{code - 1}'s relay", f"fused matmul_reduce_scatter, rank {r}")
    streams.join_comm_stream(device)
    return out
