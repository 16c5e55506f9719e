"""The fused ops' GPU schedules as threaded CPU ranks (pyfused/testing/threaded_ranks.py), with the
real Triton kernels through their launchers; side streams become side threads.

  all_gather_matmul       own shard -> own buffer, flag r; a side thread pushes the shard into
                          every peer's buffer and sets the peer's flag r; the GEMM (WAIT) reads
                          chunk c once flag c is set: own chunk first, then r-1, r-2, ...
  matmul_reduce_scatter   the GEMM (SCATTER, SIGNAL) stores chunk c into slot r of rank c's buffer
                          and counts its tiles; a relay thread waits until chunk c's count is
                          complete and sets flag r of rank c; the owner's reduce sums its W slots,
                          waiting on each (pyfused/fused/gemm_collectives.py, GPU path).
  matmul_all_reduce       one-shot: the GEMM (SIGNAL) writes this rank's partial sum into its own
                          buffer; the relay sets flag (r, c) on every rank once chunk c is complete;
                          the reduce sums the W buffers chunk by chunk, waiting per source and
                          chunk.
  all_reduce_add_rmsnorm  one-shot: as above with the input copied in, and the reduce's residual +
                          RMSNorm epilogue. Two-shot: rank r reduces (+ residual, RMSNorm) row chunk
                          r from all W buffers, pushes the normalized rows into every rank's gather
                          area and sets flag W + r there; the reduce kernel with one source then
                          copies the gathered rows out, waiting per chunk.

The library's ``matmul_all_reduce`` and ``all_reduce_add_rmsnorm`` run the CUDA all-reduce kernel
(csrc/allreduce_cuda.cu), which has no Triton twin: the two all-reduce schedules here exercise the
Triton reduce's waits and epilogue in the same roles, not that kernel.

Inputs and fp64 references are the virtual-rank cases' (pyfused/testing/virtual_cases.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor

from ..comm.symmetric import SymmetricBuffer
from ..fused import config
from ..kernels.gemm_launch import gemm, plan_gemm
from ..kernels.reduce_launch import PointerTable, chunk_rows_of, multi_source_reduce
from ..ops.all_reduce_add_rmsnorm import SAMPLE_EPS as EPS  # the cases' eps
from ..ops.registry import OPS
from .threaded_ranks import NO_FAULTS, Faults, RankView, run_ranks
from .virtual_cases import Inputs, cases

CPU = torch.device("cpu")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _table(addrs: Sequence[int], shape, dtype) -> PointerTable:
    return PointerTable.from_addresses(addrs, shape, (shape[1], 1), dtype, CPU)


def _own_first(me: RankView) -> List[int]:
    return [(me.rank + i) % me.world for i in range(me.world)]


def all_gather_matmul(me: RankView, a: Tensor, b: Tensor) -> Tensor:
    w, r = me.world, me.rank
    m, k = a.shape
    buf = SymmetricBuffer.get(me.pg, w * m * k * _element_size(a.dtype), CPU)
    epoch = buf.next_epoch()
    buf.local_view((w * m, k), a.dtype)[r * m:(r + 1) * m].copy_(a)
    me.signal(buf, r, r, epoch, w)

    def push():
        for q in _own_first(me)[1:]:
            buf.peer(q, (w * m, k), a.dtype)[r * m:(r + 1) * m].copy_(a)
            me.signal(buf, q, r, epoch, w)

    me.spawn(push)
    return me.waited(
        lambda status: gemm(buf.local_view((w * m, k), a.dtype), b, num_chunks=w,
                            chunk_order=[(r - i) % w for i in range(w)],
                            wait_flags=buf.flags(count=w), wait_expected=epoch, status=status,
                            spin_limit=me.faults.spin_limit, config=me.faults.gemm_config,
                            num_programs=config.grid_budget(CPU)),
        lambda code: (code - 1, code - 1, "after pushing its shard"))


def matmul_reduce_scatter(me: RankView, a: Tensor, b: Tensor) -> Tensor:
    w, r = me.world, me.rank
    k, n, mc = a.shape[1], b.shape[1], a.shape[0] // w
    slot = mc * n * _element_size(a.dtype)
    buf = SymmetricBuffer.get(me.pg, w * slot, CPU)
    epoch = buf.next_epoch()
    plan = plan_gemm(w * mc, n, k, a.dtype, CPU, num_chunks=w, config=me.faults.gemm_config)
    counters = torch.zeros(w, dtype=torch.int32)
    order = _own_first(me)[1:] + [r]

    def relay():
        for c in order[:-1]:
            me.await_tiles(counters, c, plan.tiles_per_chunk)
            me.signal(buf, c, r, epoch, w)

    me.spawn(relay)
    targets = _table([buf.buffer_ptrs[c] + r * slot for c in range(w)], (mc, n), a.dtype)
    gemm(a, b, num_chunks=w, chunk_order=order, out_chunks=targets, signal_counters=counters,
         config=plan.config, num_programs=config.grid_budget(CPU))
    me.signal(buf, r, r, epoch, w)  # own slot: written by this thread's GEMM, which returned
    sources = _table([buf.buffer_ptrs[r] + s * slot for s in range(w)], (mc, n), a.dtype)
    return me.waited(
        lambda status: multi_source_reduce(sources, wait_flags=buf.flags(count=w).view(w, 1),
                                           wait_expected=epoch, status=status,
                                           spin_limit=me.faults.spin_limit,
                                           num_programs=config.grid_budget(CPU)),
        lambda code: (code - 1, code - 1, "once its GEMM stored this rank's chunk (relay)"))


def _one_shot_reduce(me: RankView, buf: SymmetricBuffer, rows: int, n: int, dtype, epoch: int,
                     **epilogue) -> Tensor:
    """Sum the W ranks' buffers [rows, n] chunk by chunk, own chunk first; chunk c of source p once
    flag ``p * W + c`` is set."""
    w = me.world
    return me.waited(
        lambda status: multi_source_reduce(
            _table(buf.buffer_ptrs, (rows, n), dtype), num_chunks=w, chunk_order=_own_first(me),
            wait_flags=buf.flags(count=w * w).view(w, w), wait_expected=epoch, status=status,
            spin_limit=me.faults.spin_limit, num_programs=config.grid_budget(CPU), **epilogue),
        lambda code: (code - 1, (code - 1) // w, f"once its chunk {(code - 1) % w} is in place"))


def _publish_chunks(me: RankView, buf: SymmetricBuffer, chunk: int, epoch: int) -> None:
    """Flag (r, chunk) on every rank, own first."""
    for q in _own_first(me):
        me.signal(buf, q, me.rank * me.world + chunk, epoch, me.world * me.world)


def matmul_all_reduce(me: RankView, a: Tensor, b: Tensor) -> Tensor:
    w = me.world
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    buf = SymmetricBuffer.get(me.pg, m * n * _element_size(a.dtype), CPU)
    epoch = buf.next_epoch()
    plan = plan_gemm(m, n, k, a.dtype, CPU, num_chunks=w, config=me.faults.gemm_config)
    counters = torch.zeros(w, dtype=torch.int32)

    def relay():
        for c in range(w):
            me.await_tiles(counters, c, plan.tiles_per_chunk)
            _publish_chunks(me, buf, c, epoch)

    me.spawn(relay)
    gemm(a, b, out=buf.local_view((m, n), a.dtype), num_chunks=w, signal_counters=counters,
         config=plan.config, num_programs=config.grid_budget(CPU))
    return _one_shot_reduce(me, buf, m, n, a.dtype, epoch)


def all_reduce_add_rmsnorm_one_shot(me: RankView, x: Tensor, residual: Tensor,
                                    weight: Tensor) -> Tensor:
    rows, n = x.shape
    buf = SymmetricBuffer.get(me.pg, rows * n * _element_size(x.dtype), CPU)
    epoch = buf.next_epoch()
    buf.local_view((rows, n), x.dtype).copy_(x)

    def publish():
        for c in range(me.world):
            _publish_chunks(me, buf, c, epoch)

    me.spawn(publish)
    return _one_shot_reduce(me, buf, rows, n, x.dtype, epoch, residual=residual, weight=weight,
                            eps=EPS)


def all_reduce_add_rmsnorm_two_shot(me: RankView, x: Tensor, residual: Tensor,
                                    weight: Tensor) -> Tensor:
    """Flags 0..W-1: source p's input is in place; W..2W-1: row chunk c of the result is
    gathered. The gather area follows the input in each rank's buffer."""
    w, r = me.world, me.rank
    rows, n = x.shape
    es = _element_size(x.dtype)
    size = rows * n * es
    buf = SymmetricBuffer.get(me.pg, 2 * size, CPU)
    epoch = buf.next_epoch()
    buf.local_view((rows, n), x.dtype).copy_(x)

    def publish():
        for q in _own_first(me):
            me.signal(buf, q, r, epoch, 2 * w)

    me.spawn(publish)
    chunk = chunk_rows_of(rows, w)
    lo, hi = r * chunk, min(rows, (r + 1) * chunk)
    normed = me.waited(
        lambda status: multi_source_reduce(
            _table([p + lo * n * es for p in buf.buffer_ptrs], (hi - lo, n), x.dtype),
            residual=residual[lo:hi], weight=weight, eps=EPS,
            wait_flags=buf.flags(count=2 * w)[:w].view(w, 1), wait_expected=epoch, status=status,
            spin_limit=me.faults.spin_limit, num_programs=config.grid_budget(CPU)),
        lambda code: (code - 1, code - 1, "once its input is in place"))

    def gather():
        for q in _own_first(me):
            buf.peer(q, (rows, n), x.dtype, offset=size)[lo:hi].copy_(normed)
            me.signal(buf, q, w + r, epoch, 2 * w)

    me.spawn(gather)
    return me.waited(
        lambda status: multi_source_reduce(
            _table([buf.buffer_ptrs[r] + size], (rows, n), x.dtype), num_chunks=w,
            chunk_order=_own_first(me), wait_flags=buf.flags(count=2 * w)[w:].view(1, w),
            wait_expected=epoch, status=status, spin_limit=me.faults.spin_limit,
            num_programs=config.grid_budget(CPU)),
        lambda code: (w + code - 1, code - 1, "once it pushed its normalized rows"))


@dataclass(frozen=True)
class Protocol:
    name: str
    run: Callable[..., Tensor]                     # (RankView, *inputs of the rank) -> output
    make: Callable[..., Inputs]                    # (world, rows, n, k, dtype, device, seed)
    reference: Callable[[Inputs], List[Tensor]]   # fp64, one per rank


_CASES = cases(OPS.values())
PROTOCOLS: Dict[str, Protocol] = {name: Protocol(name, run, _CASES[name].make, _CASES[name].reference)
                                  for name, run in (
    ("all_gather_matmul", all_gather_matmul),
    ("matmul_reduce_scatter", matmul_reduce_scatter),
    ("matmul_all_reduce", matmul_all_reduce),
    ("all_reduce_add_rmsnorm.one_shot", all_reduce_add_rmsnorm_one_shot),
    ("all_reduce_add_rmsnorm.two_shot", all_reduce_add_rmsnorm_two_shot),
)}


def run_protocol(group, name: str, inputs: Inputs, faults: Faults = NO_FAULTS) -> List[Tensor]:
    """Protocol ``name`` on every rank of the CPU ``VirtualGroup`` ``group``, inside
    ``thread_safe_interpreter()``."""
    return run_ranks(group, PROTOCOLS[name].run, inputs, faults)
