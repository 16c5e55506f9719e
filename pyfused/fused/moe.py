"""Fused expert parallelism over symmetric buffers: dispatch -> grouped GEMM, grouped GEMM -> combine.

Terms as in pyfused/ops/moe_exchange.py: W ranks, E experts, E_l = E / W per rank, pair p = t * k + j
(token t's j-th choice); pair order sorts a rank's pairs by expert (stably), so the rows for rank
d's experts are one block, grouped by expert; ``layout [W, E_l]`` on a destination counts the rows
from each source for each local expert.

Counts (both schedules). Every rank writes its per-expert pair counts (and its number of
out-of-range ``topk_idx`` values) into row r of every rank's count header, then a host barrier
(``symm_barrier``, channel CHAN_SYNC): every rank then holds the whole [W, E + 1] count matrix and
reads it on the host -- the one host synchronization of each schedule. From it every rank derives
the same buffer size (the largest block any rank receives) and every offset below; an
out-of-range value raises the same ``InputError`` on every rank before any row moves.

dispatch -> grouped GEMM (``fused_moe_dispatch``), rank r
  1. entry barrier of the row buffer (CHAN_ENTRY): nobody still reads the rows of the last call;
  2. the rows in pair order; the block for rank q is copied into q's row area at source slot r
     (rows ``sum_{s<r} recv_q[s] ...``: q's area is source-major), on a push stream per peer, then
     q's flag r is set (``signal_flag``: fence + release at system scope, after the copy);
  3. the grouped GEMM (pyfused/kernels/grouped_gemm.py, WAIT mode) over this rank's area, one
     segment per (source, local expert), sources in the order r, r-1, ... (own rows first, then the
     peers' in the order their pushes land); a tile of source s reads its rows once flag s says
     they landed, and writes them to their expert-major rows of ``out``. The segment table is
     built on the device from ``layout`` (no host read).
grouped GEMM -> combine (``fused_moe_combine``), rank r holding y [R, N] in expert-major order
  1. entry barrier, as above;
  2. the grouped GEMM (SIGNAL + SCATTER) with one segment per (source s, local expert), sources in
     the order r-1, r-2, ..., r (the others first, own last): a tile's rows go straight into
     source s's return area at the rows its pair order gives them (``sum_{d<r} sent_s[d] + ...``),
     and the tile that completes source s's rows sets s's flag r (release, system scope);
  3. every rank waits for its W flags (a stream wait per flag on a GPU) and reads its returned
     rows in pair order; the ops layer sums each token's k rows.
  Without a weight the rows pass through an identity GEMM (exact: each product is one term).

CPU model (``backend="host-shm"`` or virtual ranks, Triton interpreter): the same buffers, copies,
flags and kernels; a CPU wait cannot block, so a host barrier (CHAN_SYNC) after the data movement
stands in for the in-kernel waits, which still check every flag (pyfused/fused/gemm_collectives.py
"CPU model"). Where interpreted launches may overlap (the threaded tests) the dispatch's GEMM waits
for the flags itself; the combine keeps its host barrier (its end-of-call flag waits are host
waits, which cannot block on CPU). Epochs, streams and the one-stream-per-group rule are those of
gemm_collectives.py.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..comm import streams
from ..comm.flags import signal_flag
from ..comm.group import rank as group_rank, resolve_group, world_size
from ..comm.symmetric import CHAN_ENTRY, CHAN_SYNC, FLAG_OFFSET, SymmetricBuffer
from ..comm.validate import InputError
from ..kernels.grouped_gemm_launch import SegmentTable, describe_grouped_timeout, grouped_gemm
from ..kernels.reduce_launch import PointerTable, new_status
from . import config
from .gemm_collectives import TIMEOUTS, _barrier, _on, _peer_wait, _waits_block

_ALIGN = 256  # the row area starts this many bytes into the buffer, past the count header


def _header_bytes(world: int, num_experts: int) -> int:
    raw = world * (num_experts + 1) * 8
    return -(-raw // _ALIGN) * _ALIGN


def _pair_counts(topk_idx: Tensor, num_experts: int) -> Tensor:
    """int64 [E + 1]: this rank's pairs per expert, then its out-of-range count."""
    flat = topk_idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    return torch.bincount(torch.where(valid, flat, num_experts), minlength=num_experts + 1)


def exchange_counts(op: str, topk_idx: Tensor, num_experts: int, pg, backend: Optional[str]
                    ) -> Tuple[Tensor, List[List[int]]]:
    """Every rank's pair counts per expert ([W, E + 1], on the device and on the host), through the
    count headers of a symmetric buffer; the same ``InputError`` on every rank for a ``topk_idx``
    value outside [0, E)."""
    w, r = world_size(pg), group_rank(pg)
    device = topk_idx.device
    mine = _pair_counts(topk_idx, num_experts)
    buf = SymmetricBuffer.get(pg, _header_bytes(w, num_experts), device, backend)
    epoch = buf.next_epoch()
    _barrier(buf, CHAN_ENTRY, epoch)
    for q in range(w):
        buf.peer(q, (w, num_experts + 1), torch.int64)[r].copy_(mine)
    _barrier(buf, CHAN_SYNC, epoch)
    every = buf.local_view((w, num_experts + 1), torch.int64).clone()
    host = every.tolist()
    bad = {s: row[num_experts] for s, row in enumerate(host) if row[num_experts]}
    if bad:
        where = ", ".join(f"rank {s}: {n}" for s, n in bad.items())
        raise InputError(f"pyfused.{op}: topk_idx holds values outside [0, {num_experts}) "
                         f"(num_experts={num_experts}; {where})")
    return every[:, :num_experts], [row[:num_experts] for row in host]


def _received(counts: List[List[int]], dest: int, local: int) -> List[int]:
    """Rows rank ``dest`` receives from each source."""
    return [sum(row[dest * local:(dest + 1) * local]) for row in counts]


def _starts(sizes: Tensor) -> Tensor:
    return sizes.cumsum(0) - sizes


def _source_order(world: int, rank: int) -> List[int]:
    return [(rank - step) % world for step in range(world)]


def _segments(layout: Tensor, sources: List[int], a_start: Tensor, c_start: Tensor) -> SegmentTable:
    """One segment per (source in ``sources`` order, local expert): [W, E_l] starts -> the table."""
    world, local = layout.shape
    pick = torch.tensor(sources, dtype=torch.int64, device=layout.device)
    experts = torch.arange(local, device=layout.device).repeat(len(sources))
    chunk = pick.repeat_interleave(local)
    return SegmentTable.of(a_start[pick].reshape(-1), c_start[pick].reshape(-1),
                           layout[pick].reshape(-1), experts, chunk, world)


def _expert_major_starts(layout: Tensor) -> Tensor:
    """[W, E_l]: where source s's rows of local expert j start in expert-major order."""
    world, local = layout.shape
    return _starts(layout.t().reshape(-1)).view(local, world).t()


def fused_moe_dispatch(x: Tensor, topk_idx: Tensor, weight: Optional[Tensor], num_experts: int,
                       pg, keep_received: bool, *, backend: Optional[str] = None
                       ) -> Tuple[Optional[Tensor], Tensor, Optional[Tensor]]:
    """2-D x [T, H], topk_idx [T, k], weight [E_l, H, N] or None -> (out [R, N] expert-major, or
    None without a weight; layout [W, E_l]; the received rows [R, H] in source-major order when
    kept or without a weight, else None)."""
    pg = resolve_group(pg)
    config.check_not_capturing(x.device, "pyfused moe_dispatch")
    TIMEOUTS.check()
    w, r = world_size(pg), group_rank(pg)
    local = num_experts // w
    device, hidden, k = x.device, x.shape[1], topk_idx.shape[1]
    every, counts = exchange_counts("moe_dispatch", topk_idx, num_experts, pg, backend)
    layout = every[:, r * local:(r + 1) * local].contiguous()
    received = [_received(counts, d, local) for d in range(w)]
    most = max(sum(rows) for rows in received)
    mine = sum(received[r])
    out = None if weight is None else x.new_empty((mine, weight.shape[2]))
    if most == 0:
        return out, layout, x.new_empty((0, hidden))
    header = _header_bytes(w, num_experts)
    buf = SymmetricBuffer.get(pg, header + most * hidden * x.element_size(), device, backend)
    epoch = buf.next_epoch()
    flags = buf.flags(count=w)
    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    rows = x[order // k] if k > 1 else x[order]
    sent = [sum(counts[r][d * local:(d + 1) * local]) for d in range(w)]
    sent_at = [sum(sent[:d]) for d in range(w + 1)]
    _barrier(buf, CHAN_ENTRY, epoch)
    area = buf.local_view((most, hidden), x.dtype, offset=header)
    slot = sum(received[r][:r])
    area[slot:slot + sent[r]].copy_(rows[sent_at[r]:sent_at[r + 1]])
    signal_flag(flags, r, epoch)
    pushes = streams.push_streams(device, w - 1)
    for i, stream in enumerate(pushes, start=1):
        q = (r + i) % w
        slot = sum(received[q][:r])
        with _on(stream, device):
            buf.peer(q, (most, hidden), x.dtype, offset=header)[slot:slot + sent[q]].copy_(
                rows[sent_at[q]:sent_at[q + 1]])
            signal_flag(buf.flags(q, count=w), r, epoch)
        streams.keep_alive(rows, stream)
    if not _waits_block(device):
        _barrier(buf, CHAN_SYNC, epoch)
    if weight is not None and mine:
        a_start = _starts(layout.reshape(-1)).view(w, local)
        segments = _segments(layout, _source_order(w, r), a_start, _expert_major_starts(layout))
        status = new_status(device)
        grouped_gemm(area, weight, segments, out=out, wait_flags=flags, wait_expected=epoch,
                     status=status, num_programs=config.grid_budget(device),
                     timeout_ms=config.timeout_ms())
        TIMEOUTS.watch(status, lambda code: f"{describe_grouped_timeout(code)}: flag {code - 1} "
                       f"of rank {r}, set by peer {code - 1}'s push", f"fused moe_dispatch, rank {r}")
    elif weight is None:
        for q in range(w):
            _peer_wait(flags, q, epoch, config.timeout_ms())
    streams.join_comm_stream(device, *pushes)
    kept = area[:mine].clone() if keep_received or weight is None else None
    return out, layout, kept


def _return_words(buf: SymmetricBuffer, rank: int) -> Tensor:
    """int64 [W]: the address of flag ``rank`` in every rank's pad (built once per buffer)."""
    key = ("moe-return-words", rank)
    words = buf.extras.get(key)
    if words is None:
        addrs = [p + (FLAG_OFFSET + rank) * 4 for p in buf.pad_ptrs]
        words = buf.extras[key] = torch.tensor(addrs, dtype=torch.int64).to(buf.device)
    return words


def _return_areas(buf: SymmetricBuffer, header: int, rows: int, width: int, dtype) -> PointerTable:
    """Every rank's return area [rows, width] (built once per buffer and shape)."""
    key = ("moe-return-areas", header, rows, width, dtype)
    table = buf.extras.get(key)
    if table is None:
        table = buf.extras[key] = PointerTable.from_addresses(
            [p + header for p in buf.buffer_ptrs], (rows, width), (width, 1), dtype, buf.device)
    return table


def fused_moe_combine(y: Tensor, topk_idx: Tensor, layout: Tensor, weight: Optional[Tensor], pg,
                      *, backend: Optional[str] = None) -> Tensor:
    """y [R, N] expert-major (as dispatch returned it), topk_idx [T, k] this rank's routing,
    layout [W, E_l], weight [E_l, N, H] or None -> this rank's returned rows [T * k, H] in pair
    order (``y_e @ weight[e]`` of each pair's expert)."""
    pg = resolve_group(pg)
    config.check_not_capturing(y.device, "pyfused moe_combine")
    TIMEOUTS.check()
    w, r = world_size(pg), group_rank(pg)
    local = layout.shape[1]
    num_experts = w * local
    device = y.device
    identity = weight is None  # an identity GEMM: exact, each output element is one product by 1
    if identity:
        weight = torch.eye(y.shape[1], dtype=y.dtype, device=device).expand(local, -1, -1)
    width = weight.shape[2]
    every, counts = exchange_counts("moe_combine", topk_idx, num_experts, pg, backend)
    pairs = [sum(row) for row in counts]
    most = max(pairs)
    if most == 0:
        return y.new_empty((0, width))
    header = _header_bytes(w, num_experts)
    buf = SymmetricBuffer.get(pg, header + most * width * y.element_size(), device, backend)
    epoch = buf.next_epoch()
    flags = buf.flags(count=w)
    # sent[s, d]: pairs rank s sends to rank d; rank r's rows for source s start at sum_{d<r}
    # sent[s, d] in s's pair order, then by local expert
    sent = every.view(w, w, local).sum(2)
    to_me = sent[:, :r].sum(1, keepdim=True) + (layout.cumsum(1) - layout)
    sources = _source_order(w, r)
    segments = _segments(layout, sources[1:] + sources[:1], _expert_major_starts(layout), to_me)
    _barrier(buf, CHAN_ENTRY, epoch)
    grouped_gemm(y, weight, segments, out_chunks=_return_areas(buf, header, most, width, y.dtype),
                 signal_words=_return_words(buf, r), signal_value=epoch,
                 num_programs=config.grid_budget(device), allow_tf32=False if identity else None)
    if device.type != "cuda":  # a CPU wait cannot block: every rank's kernel (its flag writes)
        _barrier(buf, CHAN_SYNC, epoch)  # ends before the barrier, even with concurrent launches
    for q in range(w):
        _peer_wait(flags, q, epoch, config.timeout_ms())
    return buf.local_view((most, width), y.dtype, offset=header)[:pairs[r]].clone()
