"""Fixed orders built in the phases torch.distributed.pipelining's schedules use, in pyfused's
actions, so that a pyfused schedule and its torch namesake run the same compute in the same order.

A *whole* backward is a B directly followed by its own W: the executor runs the pair as one unsplit
backward, as torch runs its ``FULL_BACKWARD``. Which of these orders a schedule takes, and for which
microbatch counts, is zero_bubble.zero_bubble_orders's decision.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .actions import BACKWARD, FORWARD, WEIGHT, Action, rounds


class _Order:
    """One rank's order, built phase by phase from per-stage microbatch counters. A *whole*
    backward is a B directly followed by its own W; any other B leaves its W waiting."""

    def __init__(self, stages: Sequence[int]):
        self.forwards = {s: 0 for s in stages}
        self.backwards = {s: 0 for s in stages}
        self.waiting: List[Action] = []
        self.order: List[Action] = []

    def forward(self, stage: int) -> None:
        self.order.append(Action(FORWARD, stage, self.forwards[stage]))
        self.forwards[stage] += 1

    def backward(self, stage: int, whole: bool) -> None:
        mb = self.backwards[stage]
        self.backwards[stage] += 1
        self.order.append(Action(BACKWARD, stage, mb))
        (self.order if whole else self.waiting).append(Action(WEIGHT, stage, mb))

    def weight(self, stage: Optional[int] = None) -> None:
        """The oldest waiting W (of ``stage``, if given)."""
        i = next(i for i, w in enumerate(self.waiting) if stage is None or w.stage == stage)
        self.order.append(self.waiting.pop(i))

    def done(self) -> Tuple[Action, ...]:
        return tuple(self.order + self.waiting)


class _VOrder(_Order):
    """A rank's order on a V: ``down`` is stage ``rank``, ``up`` stage ``2p-1-rank``."""

    def __init__(self, rank: int, p: int):
        self.down, self.up = rank, 2 * p - 1 - rank
        super().__init__((self.down, self.up))


def loop_zb_order(rank: int, p: int, v: int, m: int) -> Tuple[Action, ...]:
    """ZB-H1 (``v = 1``) and interleaved zero bubble on the loop placement, in the phases torch's
    ``ScheduleInterleavedZeroBubble`` uses (the paper's ZB1P; ``m`` a multiple of the number of
    rounds when ``v > 1``). Local stages take turns, ``mpr`` microbatches each (``rounds``), as in
    interleaved 1F1B:

      1. ``(v-1) * mpr + p-1-r`` forwards (one per hop to the last rank, where interleaved 1F1B
         takes two);
      2. the steady state, until every forward has run: a forward, a B (stages in reverse turn);
      3. the remaining B's;
      4. the waiting W's.
    In phases 2 and 3 every B from the ``r+1``-th on is followed by the oldest waiting W, so rank
    ``r`` keeps ``r`` W's back to fill its wait in the drain, and rank 0's backwards are whole.
    With unit costs its bubble is at most the list scheduler's order's (tested)."""
    _, mpr = rounds(p, m)
    total = v * m
    warmup = min(total, (v - 1) * mpr + p - 1 - rank)

    def stage(k: int, reverse: bool) -> int:
        turn = (k // mpr) % v
        return ((v - 1 - turn) if reverse else turn) * p + rank

    o = _Order([j * p + rank for j in range(v)])
    for k in range(warmup):
        o.forward(stage(k, False))
    for k in range(total):
        if warmup + k < total:
            o.forward(stage(warmup + k, False))
        o.backward(stage(k, True), False)
        if k >= rank:
            o.weight()
    return o.done()


def zbv_order(rank: int, p: int, m: int) -> Tuple[Action, ...]:
    """ZB-V (Qi et al. 2024) in the phases torch's ``ScheduleZBVZeroBubble`` uses (``m >= 2p``):

      1. ``2(p-r)-1`` forwards of ``down``;
      2. ``r`` times: F ``up``, F ``down``;
      3. ``p-r`` times: F ``up``, a whole backward of ``up``;
      4. the steady state, until every forward has run: F ``down`` (while any is left), a whole
         backward of ``down``, F ``up``, a whole backward of ``up``;
      5. ``r`` times: a B of ``down``, a B of ``up`` (their W's wait);
      6. ``p-r`` times: a B of ``down``, the oldest waiting W of ``down``;
      7. the waiting W's of ``up``, then of ``down``.
    With unit costs its bubble is at most the list scheduler's ZBV order's (tested)."""
    o = _VOrder(rank, p)
    for _ in range(2 * (p - rank) - 1):
        o.forward(o.down)
    for _ in range(rank):
        o.forward(o.up)
        o.forward(o.down)
    for _ in range(p - rank):
        o.forward(o.up)
        o.backward(o.up, True)
    while o.forwards[o.up] < o.forwards[o.down] or o.forwards[o.down] < m:
        if o.forwards[o.down] < m:
            o.forward(o.down)
        o.backward(o.down, True)
        o.forward(o.up)
        o.backward(o.up, True)
    for _ in range(rank):
        o.backward(o.down, False)
        o.backward(o.up, False)
    for _ in range(p - rank):
        o.backward(o.down, False)
        o.weight(o.down)
    o.waiting.sort(key=lambda w: w.stage != o.up)
    return o.done()


def dualpipev_order(rank: int, p: int, m: int) -> Tuple[Action, ...]:
    """DeepSeek-V3's DualPipe folded onto a V, in the phases torch's ``ScheduleDualPipeV`` uses
    (``m >= 2p``); W's are deferred only where they fill the drain:

      1. ``2(p-1-r)`` forwards of ``down``;
      2. ``r+1`` times: a forward of ``down``, a forward of ``up``;
      3. ``p-1-r`` times: a whole backward of ``up``, a forward of ``up``;
      4. the steady state, ``m-2p+r+1`` times: F ``down`` + whole backward ``up``, then
         F ``up`` + whole backward ``down`` (DualPipe's overlapped forward-backward pairs);
      5. ``p-1-r`` times: a whole backward of ``up``, F ``up``, a whole backward of ``down``;
      6. ``r+1`` times: a backward of ``up``, a backward of ``down``; the first ``r+1`` of these
         backwards whole, the rest B only (their W's wait);
      7. ``p-1-r`` times: the oldest waiting W, a B of ``down``;
      8. the waiting W's.
    With unit costs its bubble equals the list scheduler's DualPipeV order (tested)."""
    o = _VOrder(rank, p)
    for _ in range(2 * (p - 1 - rank)):
        o.forward(o.down)
    for _ in range(rank + 1):
        o.forward(o.down)
        o.forward(o.up)
    for _ in range(p - 1 - rank):
        o.backward(o.up, True)
        o.forward(o.up)
    for _ in range(m - 2 * p + rank + 1):
        o.forward(o.down)
        o.backward(o.up, True)
        o.forward(o.up)
        o.backward(o.down, True)
    for _ in range(p - 1 - rank):
        o.backward(o.up, True)
        o.forward(o.up)
        o.backward(o.down, True)
    for i in range(2 * (rank + 1)):
        o.backward(o.up if i % 2 == 0 else o.down, i < rank + 1)
    for _ in range(p - 1 - rank):
        o.weight()
        o.backward(o.down, False)
    return o.done()


def torch_phase_orders(schedule: str, p: int, v: int, m: int
                       ) -> Optional[Dict[int, Tuple[Action, ...]]]:
    """Every rank's training order in torch's phases, or None where the list scheduler builds it:
    ZBV and DualPipeV below ``m = 2p``, and interleaved zero bubble with ``m`` not a multiple of
    the number of rounds (torch refuses that count)."""
    if schedule in ("zbv", "dualpipev"):
        if m < 2 * p:
            return None
        build = zbv_order if schedule == "zbv" else dualpipev_order
        return {r: build(r, p, m) for r in range(p)}
    if schedule in ("zbh1", "interleaved_zb"):
        n_rounds, _ = rounds(p, m)
        if v > 1 and m % n_rounds:
            return None
        return {r: loop_zb_order(r, p, v, m) for r in range(p)}
    return None
