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

The orders are static (every rank computes all of them from ``(schedule, p, v, m)``); the unit model
only decides them. ``plan.simulate`` then proves the transfer plan deadlock-free, and
``unit_bubble`` replays any order on the unit model to give the bubble it promises (the tests compare
it with the closed forms above).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from .actions import (
    BACKWARD, FORWARD, SPLIT_BACKWARD, V_SHAPED, WEIGHT, Action, rounds, stage_rank,
)

UNIT = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}
UNSPLIT = {FORWARD: 1.0, BACKWARD: 2.0}  # a full backward: input and weight gradients


def memory_limit(schedule: str, rank: int, p: int, v: int, m: int) -> int:
    if schedule == "zbh1":
        return p - rank
    if schedule == "interleaved_zb":
        _, mpr = rounds(p, m)
        return (v - 1) * mpr + 2 * (p - 1 - rank) + 1
    if schedule == "zbv":
        return 2 * p
    return 2 * p + 1  # dualpipev


def _dependency(a: Action, num_stages: int) -> Optional[Action]:
    """The action whose result ``a`` consumes (None: the step's input)."""
    if a.op == FORWARD:
        return Action(FORWARD, a.stage - 1, a.mb) if a.stage > 0 else None
    if a.op == BACKWARD:
        return (Action(BACKWARD, a.stage + 1, a.mb) if a.stage < num_stages - 1
                else Action(FORWARD, a.stage, a.mb))
    return Action(BACKWARD, a.stage, a.mb)


@lru_cache(maxsize=256)
def zero_bubble_orders(schedule: str, p: int, v: int, m: int, backward: bool
                       ) -> Dict[int, Tuple[Action, ...]]:
    """Every rank's order for one of ``SPLIT_BACKWARD`` (see the module docstring)."""
    if schedule not in SPLIT_BACKWARD:
        raise ValueError(f"{schedule} is not a split-backward schedule")
    v_shaped = schedule in V_SHAPED
    num_stages = p * v
    local = {r: sorted((s for s in range(num_stages) if stage_rank(s, p, v_shaped) == r),
                       reverse=True) for r in range(p)}
    limit = {r: memory_limit(schedule, r, p, v, m) for r in range(p)}
    until_w = schedule != "zbh1"          # what the limit counts: until W, or until B
    w_cap = p - 1 if schedule == "zbh1" else None
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    pending_w: Dict[int, List[Action]] = {r: [] for r in range(p)}
    live = {r: 0 for r in range(p)}
    finish: Dict[Action, float] = {}
    free_at = {r: 0.0 for r in range(p)}
    orders: Dict[int, List[Action]] = {r: [] for r in range(p)}
    total = p * v * m * (3 if backward else 1)

    def ready(a: Action) -> Optional[float]:
        dep = _dependency(a, num_stages)
        if dep is None:
            return 0.0
        return finish.get(dep)

    def candidates(r: int):
        out = []  # (priority, ready time, action)
        for s in local[r]:
            if backward and next_b[s] < next_f[s]:
                a = Action(BACKWARD, s, next_b[s])
                t = ready(a)
                if t is not None:
                    out.append((0, t, a))
            if next_f[s] < m and (not backward or live[r] < limit[r]):
                a = Action(FORWARD, s, next_f[s])
                t = ready(a)
                if t is not None:
                    out.append((2, t, a))
        if pending_w[r]:
            w = pending_w[r][0]
            if w_cap is None:
                out.append((3, finish[Action(BACKWARD, w.stage, w.mb)], w))
            elif len(pending_w[r]) > w_cap or all(next_f[s] == m for s in local[r]):
                out.append((1 if len(pending_w[r]) > w_cap else 3,
                            finish[Action(BACKWARD, w.stage, w.mb)], w))
        return out

    def run(r: int, a: Action, start: float) -> float:
        end = start + UNIT[a.op]
        finish[a] = end
        orders[r].append(a)
        if a.op == FORWARD:
            next_f[a.stage] += 1
            live[r] += 1
        elif a.op == BACKWARD:
            next_b[a.stage] += 1
            pending_w[r].append(Action(WEIGHT, a.stage, a.mb))
            live[r] -= 0 if until_w else 1
        else:
            pending_w[r].pop(0)
            live[r] -= 1 if until_w else 0
        return end

    while len(finish) < total:
        best = None
        for r in range(p):
            cands = candidates(r)
            if cands:
                start = max(free_at[r], min(t for _, t, _ in cands))
                if best is None or start < best[0]:
                    best = (start, r, cands)
        if best is None:
            raise RuntimeError(f"{schedule}: the list scheduler is stuck (p={p}, v={v}, m={m})")
        start, r, cands = best
        now = [c for c in cands if c[1] <= start]
        prio, _, a = min(now, key=lambda c: (c[0], -c[2].stage, c[2].mb))
        end = run(r, a, start)
        if schedule == "dualpipev" and a.op == FORWARD:
            # pair this forward with a backward ready by now: the pair's transfers travel together
            pair = [c for c in candidates(r) if c[2].op == BACKWARD and c[1] <= start]
            if pair:
                end = run(r, min(pair, key=lambda c: (-c[2].stage, c[2].mb))[2], end)
        free_at[r] = end
    return {r: tuple(o) for r, o in orders.items()}


def unit_bubble(orders: Dict[int, List[Action]], p: int, num_stages: int, v_shaped: bool,
                split: bool) -> float:
    """Replay static ``orders`` on the unit model (each rank runs its order in sequence, an action
    starts when its input exists); return the idle fraction of the step, averaged over ranks."""
    cost = UNIT if split else UNSPLIT
    finish: Dict[Action, float] = {}
    pc = {r: 0 for r in orders}
    free_at = {r: 0.0 for r in orders}
    progress = True
    while progress:
        progress = False
        for r, order in orders.items():
            while pc[r] < len(order):
                a = order[pc[r]]
                dep = _dependency(a, num_stages)
                if dep is not None and dep not in finish:
                    break
                start = max(free_at[r], finish[dep] if dep is not None else 0.0)
                finish[a] = free_at[r] = start + cost[a.op]
                pc[r] += 1
                progress = True
    if any(pc[r] < len(o) for r, o in orders.items()):
        raise RuntimeError("the orders cannot complete (a dependency never runs)")
    span = max(free_at.values())
    work = sum(cost[a.op] for o in orders.values() for a in o)
    return 1 - work / (len(orders) * span)
