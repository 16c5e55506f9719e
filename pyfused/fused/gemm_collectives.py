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
from typing import Callable, Deque, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..comm import streams
from ..comm.flags import signal_flag, wait_flag
from ..comm.group import rank as group_rank, resolve_group, world_size
from ..comm.symmetric import CHAN_ENTRY, CHAN_SYNC, SymmetricBuffer
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
    error instead of a silently wrong result). ``check(sync=True)`` waits for all of them."""

    def __init__(self) -> None:
        self.pending: Deque[Tuple[torch.cuda.Event, Tensor, Callable[[int], str], str]] = deque()
        self.lock = threading.Lock()  # virtual ranks call from several threads

    def watch(self, status: Tensor, describe: Callable[[int], str], what: str) -> None:
        if status.device.type != "cuda":
            return  # the CPU launchers check their status themselves
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(status, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        with self.lock:
            self.pending.append((event, host, describe, what))

    def check(self, sync: bool = False) -> None:
        while True:
            with self.lock:
                if not self.pending or not (sync or self.pending[0][0].query()):
                    return
                event, host, describe, what = self.pending.popleft()
            event.synchronize()
            code = int(host[0])
            if code:
                with self.lock:
                    self.pending.clear()
                raise WaitTimeout(f"{what}: gave up waiting on {describe(code)} (a peer never "
                                  f"signalled); that call's output was wrong")


TIMEOUTS = TimeoutWatch()


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _waits_block(device: torch.device) -> bool:
    """Whether a kernel's wait can outlast the peer's flag write it waits for (GPU; interpreted
    launches that may overlap), or a host barrier must order them (see "CPU model")."""
    return device.type == "cuda" or interpreter_launches_concurrent()


def _barrier(buf: SymmetricBuffer, channel: int, epoch: int) -> None:
    if buf.world > 1:
        torch.ops.pyfused.symm_barrier(buf.pad_ptrs_dev, buf.rank, channel, 0, epoch,
                                       config.timeout_ms())


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


def _table(buf: SymmetricBuffer, key, addrs: List[int], shape, dtype, device) -> PointerTable:
    """A pointer table built once per buffer and layout (no host-to-device copy per call)."""
    table = buf.extras.get(key)
    if table is None:
        table = buf.extras[key] = PointerTable.from_addresses(addrs, shape, (shape[1], 1), dtype, device)
    return table


def fused_all_gather_matmul(a: Tensor, b: Tensor, pg, keep_gathered: bool, *,
                            backend: Optional[str] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(all_gather(a) @ b, a copy of all_gather(a) if keep_gathered else None); 2-D a [m, K]."""
    pg = resolve_group(pg)
    config.check_not_capturing(a.device, "pyfused all_gather_matmul")
    TIMEOUTS.check()
    w, r = world_size(pg), group_rank(pg)
    m, k = a.shape
    dtype, device = a.dtype, a.device
    buf = SymmetricBuffer.get(pg, w * m * k * _element_size(dtype), device, backend)
    epoch = buf.next_epoch()
    gathered = buf.local_view((w * m, k), dtype)
    flags = buf.flags(count=w)
    _barrier(buf, CHAN_ENTRY, epoch)
    gathered[r * m:(r + 1) * m].copy_(a)
    signal_flag(flags, r, epoch)
    pushes = streams.push_streams(device, w - 1)
    for i, stream in enumerate(pushes, start=1):
        q = (r + i) % w
        with _on(stream, device):
            buf.peer(q, (w * m, k), dtype)[r * m:(r + 1) * m].copy_(a)
            signal_flag(buf.flags(q, count=w), r, epoch)
        streams.keep_alive(a, stream)
    if not _waits_block(device):
        _barrier(buf, CHAN_SYNC, epoch)
    # Chunks in the order they land: rank s pushes to s+1, s+2, ..., so rank r receives r-1 first,
    # then r-2, ...; the GEMM takes its own chunk, then r-1, r-2, ...
    order = [(r - i) % w for i in range(w)]
    # The persistent GEMM spins on SMs waiting for peers' chunks, while this rank's own signal
    # kernels (push streams) must still find an SM for the peers' GEMMs to progress: capped grid.
    status = new_status(device)
    out = gemm(gathered, b, num_chunks=w, chunk_order=order, wait_flags=flags, wait_expected=epoch,
               flag_scope="sys", status=status, num_programs=config.grid_budget(device),
               timeout_ms=config.timeout_ms())
    TIMEOUTS.watch(status, lambda code: f"{describe_gemm_timeout(code)}: flag {code - 1} of rank {r}, "
                   f"set by peer {code - 1}'s push", f"fused all_gather_matmul, rank {r}")
    streams.join_comm_stream(device, *pushes)
    return out, (gathered.clone() if keep_gathered else None)


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
    slot = mc * n * _element_size(dtype)
    buf = SymmetricBuffer.get(pg, w * slot, device, backend)
    epoch = buf.next_epoch()
    flags = buf.flags(count=w)
    targets = _table(buf, ("rs-targets", mc, n, dtype),
                     [buf.buffer_ptrs[c] + r * slot for c in range(w)], (mc, n), dtype, device)
    sources = _table(buf, ("rs-sources", mc, n, dtype),
                     [buf.buffer_ptrs[r] + s * slot for s in range(w)], (mc, n), dtype, device)
    order = [(r + 1 + i) % w for i in range(w)]
    _barrier(buf, CHAN_ENTRY, epoch)
    if device.type == "cuda":
        # The relay waits for the tile count of this rank's GEMM config, which depends on TF32:
        # the plan and the launch must see the same allow_tf32.
        tf32 = dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
        plan = plan_gemm(big_m, n, k, dtype, device, num_chunks=w, allow_tf32=tf32)
        counters = torch.zeros(w, dtype=torch.int32, device=device)
        relay = streams.comm_stream(device)
        relay.wait_stream(torch.cuda.current_stream(device))  # sees the barrier and the zeroed counters
        gemm(a, b, num_chunks=w, chunk_order=order, out_chunks=targets, signal_counters=counters,
             signal_scope="sys", num_programs=config.grid_budget(device), allow_tf32=tf32)
        # This rank's own slot is written by the GEMM just queued on this stream, so its flag is set
        # here, stream-ordered after it: the reduce below then never spins on a flag whose setter
        # (a relay kernel) would need an SM that the spinning reduce's programs may all hold.
        signal_flag(flags, r, epoch)
        with torch.cuda.stream(relay):
            for c in order:
                if c == r:
                    continue
                wait_flag(counters, c, plan.tiles_per_chunk, config.timeout_ms())
                signal_flag(buf.flags(c, count=w), r, epoch)
        streams.keep_alive(counters, relay)
        streams.keep_alive(a, relay)
    else:
        gemm(a, b, num_chunks=w, chunk_order=order, out_chunks=targets,
             num_programs=config.grid_budget(device))
        for c in order:
            signal_flag(buf.flags(c, count=w), r, epoch)
        if not _waits_block(device):
            _barrier(buf, CHAN_SYNC, epoch)
    status = new_status(device)
    out = multi_source_reduce(sources, wait_flags=flags.view(w, 1), wait_expected=epoch,
                              flag_scope="sys", status=status, timeout_ms=config.timeout_ms(),
                              num_programs=config.grid_budget(device))
    describe = describe_reduce_timeout(w, 1)
    TIMEOUTS.watch(status, lambda code: f"{describe(code)}: flag {code - 1} of rank {r}, set by peer "
                   f"{code - 1}'s relay", f"fused matmul_reduce_scatter, rank {r}")
    streams.join_comm_stream(device)
    return out
