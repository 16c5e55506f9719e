"""Orders of the split-backward schedules, and the bubble any order promises.

With the backward split into B (input gradients, on the critical path: the previous stage waits for
them) and W (weight gradients, needed by nobody until the optimizer step), W can fill the time a
rank would otherwise wait (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

The orders come from one list scheduler run on a unit-time model (F = B = W = 1, free transfers):
every rank, whenever it is free, starts the highest-priority action whose inputs exist --

  1. a B whose output gradient has arrived (it unblocks the previous stage),
  2. a W, if more than ``w_cap`` are pending (ZB-H1 only),
  3. an F whose activation has arrived, unless the rank already holds ``limit`` microbatch-stages
     (counted until their W, or for ZB-H1 until their B): the activation memory bound,
  4. the oldest pending W (ZB-H1: only once the rank has no forward left, so that up to
     ``w_cap`` W's are saved for the drain, where they fill the wait for the last gradients),

and among several stages the later one first (depth first). The four schedules differ in placement,
memory bound and pairing:

  ============== ========== ============================================ ==========================
  schedule       placement  memory bound per rank (stage-microbatches)   bubble, unit model
  ============== ========== ============================================ ==========================
  ZB-H1          loop, v=1  ``p - rank`` before B (1F1B's), and up to    (p-1) / (3m + p-1) for
                            ``w_cap = p - 1`` more waiting for W         m >= p (1F1B: (p-1)/(m+p-1))
  interleaved ZB loop, v    interleaved 1F1B's warm-up + 1, until W      below interleaved 1F1B's
  ZBV            V, v=2     ``2p`` until W (1F1B's, in half-stages)      below ZB-H1's
  DualPipeV      V, v=2     ``2p + 1`` until W; an F and a B ready       at most ZBV's
                            together run as one pair
  ============== ========== ============================================ ==========================

Where torch's schedule of the same name accepts the counts, the fixed training orders are torch's
instead (torch_orders.py): ZB-H1 and interleaved ZB at every count torch accepts (interleaved: ``m``
a multiple of the number of rounds), ZBV and DualPipeV with ``m >= 2p``. They run whole backwards
where a rank has no wait to fill (rank 0 of the loop schedules, the steady state of the V ones) and
defer W's only for the drain; their unit-model bubbles are at most the list scheduler's (tested).
The list scheduler builds the other counts, the forward-only orders, and, with measured durations,
the cost orders (cost_orders.py).

The orders are static (every rank computes all of them from ``(schedule, p, v, m)``); the unit model
only decides them. ``plan.simulate`` then proves the transfer plan deadlock-free, and
``unit_bubble`` replays any order on the unit model to give the bubble it promises (the tests compare
it with the closed forms above).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .actions import BACKWARD, FORWARD, SPLIT_BACKWARD, V_SHAPED, WEIGHT, Action, rounds, stage_rank
from .torch_orders import torch_phase_orders

UNIT = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}
UNSPLIT = {FORWARD: 1.0, BACKWARD: 2.0}  # a full backward: input and weight gradients
# The duration of an action, and the delay a result takes to reach a stage on another rank.
Cost = Callable[[Action], float]


@dataclass(frozen=True)
class Policy:
    """The knobs of the list scheduler, per rank where a tuple.

    ``limit``: stage-microbatches a rank may hold, counted from F until W (``until_w``) or until B;
    ``w_cap``: hold W's back until the rank has no forward left, unless more than this many wait
    (None: a W runs whenever nothing else is ready); ``pair``: run a B ready at a forward's start
    right after it (DualPipeV); ``w_gap``: a W fills an idle gap only if the next F or B is known to
    become ready at least ``w_gap`` times the W's duration later (0: whenever nothing is ready);
    ``reserve``: a microbatch enters a rank (the F of its first local stage) only if ``limit``
    leaves room for its forwards through every local stage, which then run regardless of the
    limit -- without it, durations other than the unit ones can fill a rank of
    a V or a loop with first-stage forwards that no B can ever free."""
    limit: Tuple[int, ...]
    until_w: bool = True
    w_cap: Optional[int] = None
    pair: bool = False
    w_gap: float = 0.0
    reserve: bool = False


def memory_limit(schedule: str, rank: int, p: int, v: int, m: int) -> int:
    if schedule == "zbh1":
        return p - rank
    if schedule == "interleaved_zb":
        _, mpr = rounds(p, m)
        return (v - 1) * mpr + 2 * (p - 1 - rank) + 1
    if schedule == "zbv":
        return 2 * p
    return 2 * p + 1  # dualpipev


def fixed_policy(schedule: str, p: int, v: int, m: int) -> Policy:
    """The policy of the fixed orders (the table in the module docstring)."""
    if schedule not in SPLIT_BACKWARD:
        raise ValueError(f"{schedule} is not a split-backward schedule")
    return Policy(limit=tuple(memory_limit(schedule, r, p, v, m) for r in range(p)),
                  until_w=schedule != "zbh1", w_cap=p - 1 if schedule == "zbh1" else None,
                  pair=schedule == "dualpipev")


def _dependency(a: Action, num_stages: int) -> Optional[Action]:
    """The action whose result ``a`` consumes (None: the step's input)."""
    if a.op == FORWARD:
        return Action(FORWARD, a.stage - 1, a.mb) if a.stage > 0 else None
    if a.op == BACKWARD:
        return (Action(BACKWARD, a.stage + 1, a.mb) if a.stage < num_stages - 1
                else Action(FORWARD, a.stage, a.mb))
    return Action(BACKWARD, a.stage, a.mb)


def unit_cost(a: Action) -> float:
    return UNIT[a.op]


@lru_cache(maxsize=256)
def zero_bubble_orders(schedule: str, p: int, v: int, m: int, backward: bool
                       ) -> Dict[int, Tuple[Action, ...]]:
    """Every rank's fixed order for one of ``SPLIT_BACKWARD`` (see the module docstring)."""
    torch_orders = torch_phase_orders(schedule, p, v, m) if backward else None
    if torch_orders is not None:
        return torch_orders
    policy = fixed_policy(schedule, p, v, m)
    return list_schedule(p, v, m, schedule in V_SHAPED, backward, policy, unit_cost)


def list_schedule(p: int, v: int, m: int, v_shaped: bool, backward: bool, policy: Policy,
                  cost: Cost, transfer: float = 0.0) -> Dict[int, Tuple[Action, ...]]:
    """Every rank's order from the list scheduler with durations ``cost`` and a ``transfer`` delay
    between ranks. Raises ``RuntimeError`` when the policy leaves every rank without a move."""
    num_stages = p * v
    local = {r: sorted((s for s in range(num_stages) if stage_rank(s, p, v_shaped) == r),
                       reverse=True) for r in range(p)}
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    pending_w: Dict[int, List[Action]] = {r: [] for r in range(p)}
    live = {r: 0 for r in range(p)}
    entry = {r: min(local[r]) for r in range(p)}
    later = {s: sum(1 for t in local[stage_rank(s, p, v_shaped)] if t > s) for s in range(num_stages)}
    reserved = {r: 0 for r in range(p)}  # forwards that admitted microbatches still need here
    finish: Dict[Action, float] = {}
    free_at = {r: 0.0 for r in range(p)}
    orders: Dict[int, List[Action]] = {r: [] for r in range(p)}
    total = p * v * m * (3 if backward else 1)

    def ready(a: Action, r: int) -> Optional[float]:
        dep = _dependency(a, num_stages)
        if dep is None:
            return 0.0
        done = finish.get(dep)
        if done is None or stage_rank(dep.stage, p, v_shaped) == r:
            return done
        return done + transfer

    def may_forward(r: int, s: int) -> bool:
        if not backward:
            return True
        if policy.reserve and s != entry[r]:
            return True  # admitted with room for this forward
        return live[r] + (reserved[r] + 1 + later[s] if policy.reserve else 1) <= policy.limit[r]

    def candidates(r: int):
        out = []  # (priority, ready time, action)
        for s in local[r]:
            if backward and next_b[s] < next_f[s]:
                a = Action(BACKWARD, s, next_b[s])
                t = ready(a, r)
                if t is not None:
                    out.append((0, t, a))
            if next_f[s] < m and may_forward(r, s):
                a = Action(FORWARD, s, next_f[s])
                t = ready(a, r)
                if t is not None:
                    out.append((2, t, a))
        if pending_w[r]:
            w = pending_w[r][0]
            if policy.w_cap is None:
                out.append((3, finish[Action(BACKWARD, w.stage, w.mb)], w))
            elif len(pending_w[r]) > policy.w_cap or all(next_f[s] == m for s in local[r]):
                out.append((1 if len(pending_w[r]) > policy.w_cap else 3,
                            finish[Action(BACKWARD, w.stage, w.mb)], w))
        return out

    def first(cands, start: float):
        now = [c for c in cands if c[1] <= start]
        return min(now, key=lambda c: (c[0], -c[2].stage, c[2].mb))

    def propose(r: int):
        """(start, action) of the rank's next move, or None."""
        cands = candidates(r)
        if not cands:
            return None
        start = max(free_at[r], min(t for _, t, _ in cands))
        prio, _, a = first(cands, start)
        if prio == 3 and policy.w_gap > 0:  # a W filling a gap: only if the gap is long enough
            others = [t for _, t, c in cands if c.op != WEIGHT]
            if others and min(others) - start < policy.w_gap * cost(a):
                start = max(start, min(others))
                prio, _, a = first(cands, start)
        return start, a

    def run(r: int, a: Action, start: float) -> float:
        end = start + cost(a)
        finish[a] = end
        orders[r].append(a)
        if a.op == FORWARD:
            next_f[a.stage] += 1
            live[r] += 1
            if policy.reserve:
                reserved[r] += later[a.stage] if a.stage == entry[r] else -1
        elif a.op == BACKWARD:
            next_b[a.stage] += 1
            pending_w[r].append(Action(WEIGHT, a.stage, a.mb))
            live[r] -= 0 if policy.until_w else 1
        else:
            pending_w[r].pop(0)
            live[r] -= 1 if policy.until_w else 0
        return end

    while len(finish) < total:
        best = None
        for r in range(p):
            move = propose(r)
            if move is not None and (best is None or move[0] < best[0]):
                best = (move[0], r, move[1])
        if best is None:
            raise RuntimeError(f"the list scheduler is stuck (p={p}, v={v}, m={m}, {policy})")
        start, r, a = best
        end = run(r, a, start)
        if policy.pair and a.op == FORWARD:
            # pair this forward with a backward ready by now: the pair's transfers travel together
            pair = [c for c in candidates(r) if c[2].op == BACKWARD and c[1] <= start]
            if pair:
                end = run(r, min(pair, key=lambda c: (-c[2].stage, c[2].mb))[2], end)
        free_at[r] = end
    return {r: tuple(o) for r, o in orders.items()}


def replay(orders: Dict[int, Sequence[Action]], p: int, num_stages: int, v_shaped: bool,
           cost: Cost, transfer: float = 0.0) -> Dict[Action, Tuple[float, float]]:
    """Run static ``orders`` (each rank its order in sequence, an action as soon as its input
    exists): every action's (start, end). Raises ``RuntimeError`` if the orders cannot complete."""
    times: Dict[Action, Tuple[float, float]] = {}
    pc = {r: 0 for r in orders}
    free_at = {r: 0.0 for r in orders}
    progress = True
    while progress:
        progress = False
        for r, order in orders.items():
            while pc[r] < len(order):
                a = order[pc[r]]
                dep = _dependency(a, num_stages)
                if dep is not None and dep not in times:
                    break
                arrive = 0.0
                if dep is not None:
                    arrive = times[dep][1]
                    if stage_rank(dep.stage, p, v_shaped) != r:
                        arrive += transfer
                start = max(free_at[r], arrive)
                free_at[r] = start + cost(a)
                times[a] = (start, free_at[r])
                pc[r] += 1
                progress = True
    if any(pc[r] < len(o) for r, o in orders.items()):
        raise RuntimeError("the orders cannot complete (a dependency never runs)")
    return times


def bubble_of(orders: Dict[int, Sequence[Action]], times: Dict[Action, Tuple[float, float]]
              ) -> float:
    """The idle fraction of the step, averaged over ranks (as ``timeline.bubble`` measures it)."""
    span = max((end for _, end in times.values()), default=0.0)
    if span <= 0:
        return 0.0
    busy = sum(end - start for start, end in times.values())
    return 1 - busy / (len(orders) * span)


def unit_bubble(orders: Dict[int, List[Action]], p: int, num_stages: int, v_shaped: bool,
                split: bool) -> float:
    """Replay static ``orders`` on the unit model; return the idle fraction of the step, averaged
    over ranks."""
    table = UNIT if split else UNSPLIT
    times = replay(orders, p, num_stages, v_shaped, lambda a: table[a.op])
    return bubble_of(orders, times)
