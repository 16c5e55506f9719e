"""Zero-bubble orders built from measured F, B and W times (the zero-bubble paper's automatic
scheduling, Qi et al. 2024, section 3), within the fixed orders' activation memory.

The fixed orders (zero_bubble.py) are decided on a unit model, F = B = W. On a real model W is
cheaper than B, and the first and the last stage carry more (or less) than the middle ones, so a
rank waits where the unit model promised work. Given each stage's measured times ``costs[s] =
(F, B, W)`` (milliseconds) this module

  1. runs the same list scheduler with those durations under a grid of policies (zero_bubble.Policy):
     the fixed schedule's own policy, and the memory bound of the fixed order (its peak of
     stage-microbatches held from F until W, per rank) with W's either free to fill any gap or held
     for the drain; each with W's allowed into gaps of any length or only into gaps at least half
     or all of a W long (the paper's rule), and, on a V, with and without DualPipeV's F+B pairs
     (capping the warm-up forwards, which the paper also tries, never won on random costs here);
  2. where the step is tiny (``EXACT_MAX_ACTIONS``), searches every order exactly (branch and bound,
     below) for one shorter than the best of the grid;
  3. replays every candidate with the measured durations (zero_bubble.replay), drops any that holds
     more than the fixed order's peak on some rank, and ranks them by predicted step time, the fixed
     order included (it wins ties), so the result is never predicted slower than the fixed order.

Everything is a pure function of ``(schedule, p, v, m, costs, transfer)``: every rank computes the
same orders from the same agreed cost table (costs.py), then plan.choose_plan proves the transfer
plan of the first candidate that has one deadlock-free, exactly as for the fixed orders.

Exact search. An order set is fixed by its replay; sorting its actions by (start, rank) lists each
action after its input's producer (a producer ends before its consumer starts, and durations are
positive), so a depth-first search that appends, in non-decreasing (start, rank), any action whose
input exists reaches every order set exactly once. Microbatches run through each (stage, F|B|W) in
order, as in every fixed order. A branch is cut when some rank's earliest free time plus its
remaining work cannot beat the best step found; the search stops after ``EXACT_BUDGET`` nodes
(a count, so every rank stops at the same node) and keeps the best it found.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .actions import BACKWARD, FORWARD, SPLIT_BACKWARD, V_SHAPED, WEIGHT, Action, stage_rank
from .zero_bubble import (
    Cost,
    Policy,
    _dependency,
    bubble_of,
    fixed_policy,
    list_schedule,
    replay,
    zero_bubble_orders,
)

Costs = Tuple[Tuple[float, float, float], ...]  # per stage: F, B, W milliseconds
Orders = Dict[int, Tuple[Action, ...]]
OPS = (FORWARD, BACKWARD, WEIGHT)
EXACT_MAX_ACTIONS = 24  # p * v * m * 3 up to which the exact search runs (p = 2, m = 4)
EXACT_BUDGET = 20000    # search nodes; a few hundred ms of Python at most
W_GAPS = (0.0, 0.5, 1.0)


def check_costs(costs, num_stages: int) -> Optional[str]:
    """Why ``costs`` is not a cost table for ``num_stages`` stages, or None."""
    try:
        rows = [tuple(float(x) for x in row) for row in costs]
    except (TypeError, ValueError):
        return "costs must be a sequence of (F, B, W) milliseconds per stage"
    if len(rows) != num_stages or any(len(r) != 3 for r in rows):
        return f"costs must hold one (F, B, W) triple per stage ({num_stages} stages)"
    if not all(math.isfinite(x) and x > 0 for r in rows for x in r):
        return "costs must be positive finite milliseconds"
    return None


def as_costs(costs) -> Costs:
    return tuple(tuple(float(x) for x in row) for row in costs)


def cost_of(costs: Costs) -> Cost:
    return lambda a: costs[a.stage][OPS.index(a.op)]


def peak_live(order: Sequence[Action]) -> int:
    """The most stage-microbatches ``order`` holds at once, from F until W (its activations)."""
    live = peak = 0
    for a in order:
        live += {FORWARD: 1, WEIGHT: -1}.get(a.op, 0)
        peak = max(peak, live)
    return peak


def predicted(schedule: str, orders: Orders, p: int, v: int, costs: Costs,
              transfer: float = 0.0) -> Tuple[float, float]:
    """(step milliseconds, bubble) of ``orders`` replayed with ``costs``."""
    times = replay(orders, p, p * v, schedule in V_SHAPED, cost_of(costs), transfer)
    return max(end for _, end in times.values()), bubble_of(orders, times)


def _policies(schedule: str, base: Policy, peaks: Tuple[int, ...]) -> Iterator[Policy]:
    base = replace(base, reserve=True)
    styles = [base, replace(base, limit=peaks, until_w=True, w_cap=None)]
    if base.w_cap is not None:
        styles.append(replace(base, limit=peaks, until_w=True))
    pairs = (False, True) if schedule in V_SHAPED else (base.pair,)
    for style in styles:
        for gap in W_GAPS:
            for pair in pairs:
                yield replace(style, w_gap=gap, pair=pair)


@lru_cache(maxsize=64)
def measured_orders(schedule: str, p: int, v: int, m: int, costs: Costs,
                    transfer: float = 0.0) -> Tuple[Orders, ...]:
    """Candidate orders for ``costs``, best predicted first; the fixed order is among them (see the
    module docstring). Each holds at most the fixed order's peak activations on every rank."""
    if schedule not in SPLIT_BACKWARD:
        raise ValueError(f"{schedule} is not a split-backward schedule")
    v_shaped = schedule in V_SHAPED
    fixed = zero_bubble_orders(schedule, p, v, m, True)
    peaks = tuple(peak_live(fixed[r]) for r in range(p))
    cost = cost_of(costs)
    ranked: Dict[Orders, Tuple[float, int]] = {}

    def add(orders: Orders, index: int) -> None:
        key = tuple(sorted(orders.items()))
        if key in ranked or any(peak_live(orders[r]) > peaks[r] for r in range(p)):
            return
        span, _ = predicted(schedule, orders, p, v, costs, transfer)
        ranked[key] = (span, index)

    add(fixed, 0)
    for i, policy in enumerate(_policies(schedule, fixed_policy(schedule, p, v, m), peaks), start=1):
        try:
            add(list_schedule(p, v, m, v_shaped, True, policy, cost, transfer), i)
        except RuntimeError:  # this policy's memory bound leaves no move
            continue
    if p * v * m * 3 <= EXACT_MAX_ACTIONS:
        best = min(span for span, _ in ranked.values())
        exact = exact_orders(p, v, m, v_shaped, peaks, cost, transfer, best)
        if exact is not None:
            add(exact, -1)
    return tuple(dict(key) for key, _ in sorted(ranked.items(), key=lambda kv: kv[1]))


def exact_orders(p: int, v: int, m: int, v_shaped: bool, limits: Sequence[int], cost: Cost,
                 transfer: float, bound: float, budget: int = EXACT_BUDGET) -> Optional[Orders]:
    """The shortest orders (within ``budget`` search nodes) holding at most ``limits[r]``
    stage-microbatches from F to W on rank ``r``, if one is shorter than ``bound``; else None."""
    num_stages = p * v
    rank_of = [stage_rank(s, p, v_shaped) for s in range(num_stages)]
    local = {r: [s for s in range(num_stages) if rank_of[s] == r] for r in range(p)}
    nxt = {op: [0] * num_stages for op in OPS}
    remaining = [sum(cost(Action(op, s, 0)) for s in local[r] for op in OPS) * m for r in range(p)]
    free_at = [0.0] * p
    live = [0] * p
    finish: Dict[Action, float] = {}
    orders: Dict[int, List[Action]] = {r: [] for r in range(p)}
    total = num_stages * m * 3
    best = {"span": bound - 1e-9 * abs(bound) if math.isfinite(bound) else bound, "orders": None}
    nodes = 0

    def moves(last_t: float, last_r: int):
        out = []
        for r in range(p):
            for s in local[r]:
                for prio, op in enumerate((BACKWARD, FORWARD, WEIGHT)):
                    mb = nxt[op][s]
                    if (op == FORWARD and (mb >= m or live[r] >= limits[r])
                            or op == BACKWARD and mb >= nxt[FORWARD][s]
                            or op == WEIGHT and mb >= nxt[BACKWARD][s]):
                        continue
                    a = Action(op, s, mb)
                    dep = _dependency(a, num_stages)
                    arrive = 0.0
                    if dep is not None:
                        if dep not in finish:
                            continue
                        arrive = finish[dep] + (transfer if rank_of[dep.stage] != r else 0.0)
                    start = max(free_at[r], arrive)
                    if (start, r) >= (last_t, last_r):
                        out.append((start, prio, r, a))
        return sorted(out, key=lambda x: (x[0], x[1], x[2]))

    def dfs(last_t: float, last_r: int, done: int) -> None:
        nonlocal nodes
        nodes += 1
        if done == total:
            span = max(free_at)
            if span < best["span"]:
                best["span"], best["orders"] = span, {r: tuple(o) for r, o in orders.items()}
            return
        lower = max(max(free_at[r], last_t) + remaining[r] if remaining[r] > 0 else free_at[r]
                    for r in range(p))
        if lower >= best["span"]:
            return
        for start, _, r, a in moves(last_t, last_r):
            if nodes >= budget:
                return
            saved = free_at[r]
            d = cost(a)
            free_at[r], finish[a] = start + d, start + d
            remaining[r] -= d
            nxt[a.op][a.stage] += 1
            live[r] += {FORWARD: 1, WEIGHT: -1}.get(a.op, 0)
            orders[r].append(a)
            dfs(start, r, done + 1)
            orders[r].pop()
            live[r] -= {FORWARD: 1, WEIGHT: -1}.get(a.op, 0)
            nxt[a.op][a.stage] -= 1
            remaining[r] += d
            del finish[a]
            free_at[r] = saved

    dfs(0.0, -1, 0)
    return best["orders"]
