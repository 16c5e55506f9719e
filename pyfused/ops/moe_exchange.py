"""Routing and row transfers shared by ``moe_dispatch`` and ``moe_combine`` (expert parallelism).

Terms. A group of W ranks holds E experts, E_l = E / W on each rank: expert e lives on rank
e // E_l as its local expert e % E_l. On a source rank, T tokens each chose k experts
(``topk_idx [T, k]``); *pair* p = t * k + j is token t's j-th choice. Rows are kept in three orders:

  * pair order, on the source: the pairs sorted by expert (a stable sort: by pair within an
    expert). The rows for rank d's experts are then one contiguous block, grouped by its experts;
  * source-major, on the destination: one block per source rank, each grouped by local expert --
    what an all-to-all delivers;
  * expert-major, on the destination: grouped by local expert, within an expert by source rank,
    within a source in pair order -- what ``moe_dispatch`` returns and ``moe_combine`` takes, so
    that each expert's rows are one slice for its GEMM.

``layout [W, E_l]`` (int64, on the tokens' device) describes what a destination received:
``layout[s, j]`` rows from source s for local expert j. ``route`` builds it with one fixed-size
all-to-all of the per-expert counts (each rank also sends the number of its ``topk_idx`` values out
of range, so that every rank raises the same error before any row moves), then reads the counts on
the host: the one host synchronization of ``moe_dispatch`` (on a GPU; none on CPU). ``route``
remembers the routing by the ``layout`` tensor it returns (``known_routing``), so that
``moe_combine`` and both backward passes, given that layout and the same ``topk_idx``, take the
routing -- the host counts included -- without reading the device again; a layout they did not get
from ``route`` in this process (or one changed in place since) is read on the host, one
synchronization on a GPU.

Transfers: ``exchange`` runs one ``all_to_all_single`` with split sizes (the unfused methods);
``PeerTransfers`` posts one send and one receive per peer with rows to move and lets the caller wait
for each source's block in turn, computing on the blocks that arrived while the others travel (the
decomposed methods). A pair of ranks with nothing to move posts nothing (both sides know the size).

``recording()`` makes the ops note, while it is active in this process, when each count exchange,
transfer wait, grouped GEMM and weighted sum starts and ends (host times; the bench's timeline);
otherwise noting is one comparison.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import comm
from ..comm.faults import fault_point, transfer_timeout

INDEX_DTYPES = (torch.int64, torch.int32)

Event = Tuple[str, float, float]  # (what, start, end): host times (time.perf_counter)
_events: Optional[List[Event]] = None


@contextlib.contextmanager
def recording() -> Iterator[List[Event]]:
    """Within the block the MoE ops of this process append their events (``Event``) to the list
    this yields: "counts" (the count exchange), "all_to_all", "wait" (a decomposed method blocked on
    a peer's block), "gemm", "sum" (the weighted sum of combine)."""
    global _events
    _events = []
    try:
        yield _events
    finally:
        _events = None


def note(what: str, start: float) -> None:
    """Record ``what`` from ``start`` until now, while ``recording``."""
    if _events is not None:
        _events.append((what, start, time.perf_counter()))


now = time.perf_counter


@dataclass
class Routing:
    """One exchange's routing as this rank sees it, on the host and on the device."""

    world: int
    rank: int
    order: Tensor                # [P] pair indices in pair order (sorted by expert)
    send: List[int]              # rows this rank sends to each rank (blocks of the pair order)
    layout: Tensor               # [W, E_l] rows received from each source for each local expert
    counts: List[List[int]]      # ``layout`` on the host

    @property
    def local_experts(self) -> int:
        return len(self.counts[0])

    @property
    def recv(self) -> List[int]:
        """Rows received from each source rank."""
        return [sum(row) for row in self.counts]

    @property
    def expert_counts(self) -> List[int]:
        """Rows received for each local expert (from every source)."""
        return [sum(col) for col in zip(*self.counts)]

    def source_to_expert_major(self, rows: Tensor) -> Tensor:
        """Source-major rows (as an exchange delivers them) -> expert-major order: one copy of
        the (source, expert) blocks, no index (the rows themselves where the orders agree)."""
        if self.world == 1 or self.local_experts == 1:
            return rows
        w, el = self.world, self.local_experts
        blocks = rows.split([c for row in self.counts for c in row])
        return torch.cat([blocks[s * el + j] for j in range(el) for s in range(w)])

    def expert_to_source_major(self, rows: Tensor) -> Tensor:
        """Expert-major rows -> source-major order (the inverse of ``source_to_expert_major``)."""
        if self.world == 1 or self.local_experts == 1:
            return rows
        w, el = self.world, self.local_experts
        blocks = rows.split([self.counts[s][j] for j in range(el) for s in range(w)])
        return torch.cat([blocks[j * w + s] for s in range(w) for j in range(el)])

    def expert_index(self) -> Optional[Tensor]:
        """[R]: the expert-major position of each source-major row; None where the two orders are
        the same (one rank, or one expert per rank)."""
        if self.world == 1 or self.local_experts == 1:
            return None
        return expert_major_index(self.layout, sum(self.recv))


def expert_major_index(layout: Tensor, total: int) -> Tensor:
    """[total]: the expert-major position of each of the ``total`` source-major rows that
    ``layout [W, E_l]`` describes (computed on the layout's device)."""
    w, el = layout.shape
    flat = layout.reshape(-1)
    by_expert = layout.t().reshape(-1)
    expert_start = (by_expert.cumsum(0) - by_expert).view(el, w).t().reshape(-1)
    # every row of a (source, expert) block moves by the same distance: its block's start in
    # expert-major order less its start in source-major order
    shift = expert_start - (flat.cumsum(0) - flat)
    return (torch.repeat_interleave(shift, flat, output_size=total)
            + torch.arange(total, device=flat.device))


def to_expert_major(rows: Tensor, layout: Tensor) -> Tensor:
    """Source-major rows (as an exchange delivers them) -> expert-major order."""
    index = expert_major_index(layout, rows.shape[0])
    return rows.index_select(0, inverse_permutation(index))


def offsets(sizes: List[int]) -> List[int]:
    """[0, sizes[0], sizes[0] + sizes[1], ...]: where each block starts, and the total."""
    out, total = [0], 0
    for s in sizes:
        total += s
        out.append(total)
    return out


def pair_order(flat_idx: Tensor) -> Tensor:
    """The pairs sorted by expert, stably (pair p = t * k + j; ``flat_idx``: topk_idx flattened)."""
    return torch.argsort(flat_idx, stable=True)


def inverse_permutation(order: Tensor) -> Tensor:
    """``position`` with ``position[order[i]] = i``: ``rows.index_select(0, position)`` puts row i
    at ``order[i]``, as ``index_copy_(0, order, rows)`` would. Gathering by the inverse of a
    permutation of integers runs 2-4x faster than scattering the rows on a CPU core."""
    return torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device, dtype=order.dtype))


def route(op: str, topk_idx: Tensor, num_experts: int, pg) -> Routing:
    """Sort this rank's pairs and exchange the per-expert counts with every rank (one fixed-size
    all-to-all); raise the same ``InputError`` on every rank if any rank's ``topk_idx`` holds a
    value outside [0, num_experts)."""
    w, r = comm.world_size(pg), comm.rank(pg)
    el = num_experts // w
    flat = topk_idx.reshape(-1)
    # one bincount: each expert's pairs, then in bucket E the values outside [0, E) (clamped to
    # -1 or E, both of which the remainder by E + 1 takes to E)
    counts = torch.bincount(flat.clamp(-1, num_experts).remainder(num_experts + 1),
                            minlength=num_experts + 1)
    if w == 1:
        host = counts.tolist()
        send, received, layout = [sum(host[:el])], [host], counts[:el].view(1, el)
    else:
        outgoing = counts.take(_count_rows(w, el, counts.device))
        incoming = torch.empty_like(outgoing)
        fault_point(f"{op}.counts:before")
        start = now()
        dist.all_to_all_single(incoming, outgoing, group=pg)
        note("counts", start)
        host = torch.cat([outgoing, incoming]).tolist()
        send, received = [sum(row[:el]) for row in host[:w]], host[w:]
        layout = incoming.narrow(1, 0, el).contiguous()
    bad = {s: row[el] for s, row in enumerate(received) if row[el]}
    if bad:
        where = ", ".join(f"rank {s}: {n}" for s, n in bad.items())
        raise comm.InputError(f"pyfused.{op}: topk_idx holds values outside [0, {num_experts}) "
                              f"(num_experts={num_experts}; {where})")
    routing = Routing(w, r, pair_order(flat), send, layout, [row[:el] for row in received])
    _remember(routing, topk_idx)
    return routing


@functools.lru_cache(maxsize=None)
def _count_rows(world: int, local: int, device: torch.device) -> Tensor:
    """[W, E_l + 1]: where in the counts [E + 1] each entry of the count exchange's rows comes
    from -- row d: rank d's experts, then the values out of range (bucket E), which every rank
    is sent. Depends on the group's shape alone, so it is made once."""
    experts = torch.arange(world * local).view(world, local)
    out_of_range = torch.full((world, 1), world * local)
    return torch.cat([experts, out_of_range], dim=1).to(device)


# route's routings, by the layout tensor each returned: (its topk_idx, the versions of the two
# tensors then, the routing). The entry keeps that topk_idx alive, so a later topk_idx at the same
# address with the same version is the same data; it goes with the layout.
_routings: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _remember(routing: Routing, topk_idx: Tensor) -> None:
    _routings[routing.layout] = (topk_idx, topk_idx._version, routing.layout._version, routing)


def known_routing(topk_idx: Optional[Tensor], layout: Tensor) -> Optional[Routing]:
    """The routing ``route`` returned with ``layout``, if neither tensor changed since and
    ``topk_idx`` holds the same indices (the same memory, any shape: the backward passes view it
    as [T * k, 1]); ``topk_idx`` None: the layout alone (its counts). Else None."""
    entry = _routings.get(layout)
    if entry is None:
        return None
    idx, idx_version, layout_version, routing = entry
    if layout._version != layout_version:
        return None
    if topk_idx is not None and not (topk_idx.data_ptr() == idx.data_ptr()
                                      and topk_idx.numel() == idx.numel()
                                      and topk_idx.dtype == idx.dtype
                                      and topk_idx._version == idx_version
                                      and topk_idx.is_contiguous() and idx.is_contiguous()):
        return None
    return routing


def expert_row_counts(layout: Tensor) -> List[int]:
    """Rows received for each local expert, from the remembered routing if there is one (no host
    read of the device), else from ``layout`` on the host."""
    routing = known_routing(None, layout)
    return routing.expert_counts if routing is not None else layout.sum(0).tolist()


def routing_from_layout(topk_idx: Tensor, layout: Tensor, pg) -> Routing:
    """The routing of an earlier dispatch, from its ``layout`` and this rank's ``topk_idx``: no
    exchange (``moe_combine`` and the backward passes); the remembered one where ``route`` made
    it (``known_routing``)."""
    w, r = comm.world_size(pg), comm.rank(pg)
    known = known_routing(topk_idx, layout)
    if known is not None and (known.world, known.rank) == (w, r):
        return known
    el = layout.shape[1]
    flat = topk_idx.reshape(-1)
    experts = torch.bincount(flat.clamp(0, w * el - 1), minlength=w * el)
    host = torch.cat([experts, layout.reshape(-1)]).tolist()
    send = [sum(host[d * el:(d + 1) * el]) for d in range(w)]
    counts = [host[(w + s) * el:(w + s + 1) * el] for s in range(w)]
    return Routing(w, r, pair_order(flat), send, layout, counts)


def check_layouts_fit(op: str, routing: Routing, pg) -> None:
    """Whether every rank's layout fits every other rank's routing: the rows rank s received from
    rank d (its layout) are the rows rank d sent to s (d's ``topk_idx``). One all-gather of 2W
    counts; the same ``InputError`` on every rank when they do not fit."""
    w = routing.world
    mine = torch.tensor(routing.recv + routing.send, dtype=torch.int64,
                        device=comm.comm_device(pg))
    every = mine.new_empty((w * 2 * w,))
    comm.all_gather_single(every, mine, group=pg)
    table = every.view(w, 2 * w).tolist()
    for dest in range(w):
        for source in range(w):
            got, sent = table[dest][source], table[source][w + dest]
            if got != sent:
                raise comm.InputError(
                    f"pyfused.{op}: the layouts do not fit the routing: rank {dest}'s layout says "
                    f"it received {got} rows from rank {source}, whose topk_idx sends it {sent}; "
                    f"pass every rank the layout moe_dispatch returned for the same topk_idx")


def exchange(op: str, rows: Tensor, send: List[int], recv: List[int], pg) -> Tensor:
    """One all_to_all_single of ``rows`` (blocks of ``send`` rows to each rank) -> the blocks of
    ``recv`` rows from each rank."""
    start = now()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    fault_point(f"{op}.transfer:before")
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=pg)
    note("all_to_all", start)
    return out


class PeerTransfers:
    """The transfers of one exchange between this rank and each peer: every receive posted at
    construction (one per peer with rows to send here), each send posted by ``send_to`` as soon as
    its rows are ready; the caller waits for each source's block with ``wait_from`` and ends with
    ``finish``. Waits are bounded by the group's timeout (``transfer_timeout``)."""

    def __init__(self, op: str, pg, out: Tensor, recv: List[int]):
        self.op, self.pg = op, pg
        self.timeout = transfer_timeout(pg, out.device)
        w, r = comm.world_size(pg), comm.rank(pg)
        at = offsets(recv)
        self.incoming: Dict[int, object] = {}
        self.outgoing: List[object] = []
        fault_point(f"{op}.transfer:before")
        for step in range(1, w):
            source = (r - step) % w
            if recv[source]:
                self.incoming[source] = dist.irecv(block(out, at, source),
                                                   comm.global_rank(self.pg, source), group=pg)

    def send_to(self, dest: int, rows: Tensor) -> None:
        if rows.shape[0]:
            self.outgoing.append(dist.isend(rows, comm.global_rank(self.pg, dest), group=self.pg))

    def wait_from(self, source: int) -> None:
        work = self.incoming.pop(source, None)
        if work is not None:
            start = now()
            with comm.failures_named(self.op, self.pg, "decomposed", peer=source):
                work.wait(self.timeout)
            note("wait", start)

    def finish(self) -> None:
        for source in list(self.incoming):
            self.wait_from(source)
        for work in self.outgoing:
            with comm.failures_named(self.op, self.pg, "decomposed"):
                work.wait(self.timeout)
        self.outgoing = []


def source_order(world: int, rank: int) -> List[int]:
    """This rank, then the others around the ring: the order in which the decomposed dispatch takes
    the blocks of the source ranks (its own needs no transfer), and, reversed, the order in which
    the decomposed combine computes the blocks it sends back (its own last)."""
    return [(rank - step) % world for step in range(world)]


def block(t: Tensor, at: List[int], i: int) -> Tensor:
    return t[at[i]:at[i + 1]]

