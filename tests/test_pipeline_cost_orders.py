"""Zero-bubble orders built from F, B, W costs (pyfused/pipeline/cost_orders.py); pure, no ranks.

A property test over random costs, schedules, rank and microbatch counts checks every order the
cost scheduler offers: each action once, F before B before W of every (stage, microbatch) on its
rank, a deadlock-free transfer plan from the same builder and simulator as the fixed orders, no
more activations held than the fixed order on any rank, and never predicted slower than the fixed
order. Then the exact search against brute force on tiny steps, and the cases the fixed orders'
own policy cannot schedule with real durations.
"""
import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from pyfused.pipeline.actions import BACKWARD, FORWARD, V_SHAPED, WEIGHT, Action, local_stages
from pyfused.pipeline.cost_orders import (
    check_costs,
    cost_of,
    exact_orders,
    measured_orders,
    peak_live,
    predicted,
)
from pyfused.pipeline.plan import build_plan, check_counts, choose_plan, simulate
from pyfused.pipeline.zero_bubble import fixed_policy, list_schedule, replay, unit_bubble, zero_bubble_orders

SPLIT_V = {"zbh1": 1, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}


def _check_orders(schedule, p, v, m, orders, fixed):
    v_shaped = schedule in V_SHAPED
    for rank, order in orders.items():
        expected = {Action(op, s, i) for s in local_stages(rank, p, v, v_shaped)
                    for i in range(m) for op in (FORWARD, BACKWARD, WEIGHT)}
        assert len(order) == len(expected) and set(order) == expected, (schedule, rank)
        at = {a: i for i, a in enumerate(order)}
        for a in order:
            if a.op == FORWARD:
                assert at[a] < at[Action(BACKWARD, a.stage, a.mb)] < at[Action(WEIGHT, a.stage, a.mb)]
        assert peak_live(order) <= peak_live(fixed[rank]), (schedule, rank, "memory")
    plans = build_plan({r: list(o) for r, o in orders.items()}, p, p * v, 2, v_shaped)
    simulate(orders, plans, p, p * v, False, v_shaped)  # gloo: raises PlanError on a deadlock


costs_of = st.floats(min_value=0.05, max_value=3.0, allow_nan=False)


@settings(max_examples=25, deadline=None)  # about 2 s per example on a loaded 2-core machine
@given(schedule=st.sampled_from(sorted(SPLIT_V)), p=st.integers(1, 4), m=st.integers(1, 7),
       data=st.data())
def test_every_order_from_costs_is_valid_and_no_slower_than_the_fixed(schedule, p, m, data):
    v = SPLIT_V[schedule]
    if check_counts(schedule, p, v, m):
        return
    costs = tuple(tuple(data.draw(costs_of) for _ in range(3)) for _ in range(p * v))
    fixed = zero_bubble_orders(schedule, p, v, m, True)
    candidates = measured_orders(schedule, p, v, m, costs)
    assert fixed in candidates
    for orders in candidates:
        _check_orders(schedule, p, v, m, orders, fixed)
    spans = [predicted(schedule, o, p, v, costs)[0] for o in candidates]
    assert spans == sorted(spans) and spans[0] <= predicted(schedule, fixed, p, v, costs)[0]
    # the plan the schedules run: the best candidate with a plan, for both completion models
    orders, plans, look = choose_plan(schedule, p, v, m, True, False, 2, costs)
    assert look == 2 and orders == {r: list(o) for r, o in candidates[0].items()}
    orders, plans, look = choose_plan(schedule, p, v, m, True, True, 2, costs)
    assert look is None and orders == {r: list(o) for r, o in candidates[0].items()}
    simulate(orders, plans, p, p * v, True, schedule in V_SHAPED)


def _rank_orders(stages, m, limit):
    """Every order of one rank's F, B, W actions: microbatches in order per (stage, op), F before
    B before W, at most ``limit`` stage-microbatches from F to W."""
    nxt = {(op, s): 0 for op in (FORWARD, BACKWARD, WEIGHT) for s in stages}
    out, order = [], []

    def rec(live):
        if len(order) == 3 * m * len(stages):
            out.append(tuple(order))
            return
        for s in stages:
            for op, before in ((FORWARD, None), (BACKWARD, FORWARD), (WEIGHT, BACKWARD)):
                i = nxt[op, s]
                if i >= m or (before and i >= nxt[before, s]) or (op == FORWARD and live >= limit):
                    continue
                nxt[op, s] += 1
                order.append(Action(op, s, i))
                rec(live + {FORWARD: 1, WEIGHT: -1}.get(op, 0))
                order.pop()
                nxt[op, s] -= 1

    rec(0)
    return out


def test_lockstep_plan_of_measured_orders_is_simulated_to_its_end():
    """Interleaved ZB at p = 3, m = 6 with these costs: in the NCCL model a batch of rank 1 can
    complete only after rank 2's earlier batches have, which completes only after rank 1's; the
    simulator must complete batches over all ranks to a fixpoint, or it reports a deadlock that the
    lock-step plan does not have."""
    draws = [1.0, 1.0, 1.0, 1.0, 2.1875, 2.0, 1.5, 2.0, 1.0, 0.875, 2.0, 3.0, 1.0, 1.0, 3.0, 2.0,
             2.625, 2.0]
    costs = tuple(tuple(draws[3 * i:3 * i + 3]) for i in range(6))
    candidates = measured_orders("interleaved_zb", 3, 2, 6, costs)
    orders, plans, look = choose_plan("interleaved_zb", 3, 2, 6, True, True, 2, costs)
    assert look is None and orders == {r: list(o) for r, o in candidates[0].items()}
    simulate(orders, plans, 3, 6, True)


@pytest.mark.parametrize("schedule,p,m", [("zbh1", 2, 2), ("zbh1", 2, 3), ("zbh1", 3, 2),
                                          ("zbv", 2, 1)])
def test_exact_search_finds_the_brute_force_optimum(schedule, p, m):
    v = SPLIT_V[schedule]
    v_shaped = schedule in V_SHAPED
    fixed = zero_bubble_orders(schedule, p, v, m, True)
    limits = [peak_live(fixed[r]) for r in range(p)]
    for costs in (((1.0, 0.1, 1.7), (2.0, 1.1, 0.4), (0.7, 1.3, 0.9), (1.2, 0.6, 0.5))[:p * v],
                  ((1.0, 1.0, 1.0),) * (p * v)):
        cost = cost_of(costs)
        per_rank = [_rank_orders(sorted(local_stages(r, p, v, v_shaped)), m, limits[r])
                    for r in range(p)]
        best = math.inf
        for combo in itertools.product(*per_rank):
            try:
                times = replay(dict(enumerate(combo)), p, p * v, v_shaped, cost)
            except RuntimeError:  # these orders wait on each other
                continue
            best = min(best, max(end for _, end in times.values()))
        found = exact_orders(p, v, m, v_shaped, limits, cost, 0.0, math.inf)
        span, _ = predicted(schedule, found, p, v, costs)
        assert span == pytest.approx(best), (costs, span, best)
        assert exact_orders(p, v, m, v_shaped, limits, cost, 0.0, best) is None  # nothing shorter


def test_reserving_room_keeps_the_scheduler_moving():
    """With these durations the fixed DualPipeV policy fills rank 0 with stage-0 forwards that no
    B can free (every slot taken before stage 3's first forward); reserving room for a
    microbatch's forwards through all local stages avoids it."""
    costs = ((0.7, 1.3, 1.2), (0.9, 0.8, 0.8), (1.5, 1.2, 0.3), (0.5, 1.3, 0.8))
    policy = fixed_policy("dualpipev", 2, 2, 8)
    with pytest.raises(RuntimeError, match="stuck"):
        list_schedule(2, 2, 8, True, True, policy, cost_of(costs))
    orders = list_schedule(2, 2, 8, True, True, dataclasses.replace(policy, reserve=True),
                           cost_of(costs))
    _check_orders("dualpipev", 2, 2, 8, orders, zero_bubble_orders("dualpipev", 2, 2, 8, True))


def test_unequal_costs_shorten_the_v_schedules():
    """The fixed ZBV and DualPipeV orders, whose steady states run whole backwards, are already as
    short as any candidate when W is cheap against B, the first stage has no B and the last is
    heavy; a heavy third stage (its W above all) leaves them room. There the cost orders are
    predicted shorter than the fixed ones, and equal costs keep the fixed order's unit bubble."""
    costs = ((1.6, 0.2, 0.4), (0.2, 0.05, 1.6), (0.4, 1.6, 2.5), (1.6, 0.2, 0.4))
    for schedule in ("zbv", "dualpipev"):
        fixed = zero_bubble_orders(schedule, 2, 2, 8, True)
        best = measured_orders(schedule, 2, 2, 8, costs)[0]
        assert predicted(schedule, best, 2, 2, costs)[0] < predicted(schedule, fixed, 2, 2, costs)[0]
        unit = measured_orders(schedule, 2, 2, 8, ((1.0, 1.0, 1.0),) * 4)[0]
        assert predicted(schedule, unit, 2, 2, ((1.0, 1.0, 1.0),) * 4)[1] <= unit_bubble(
            fixed, 2, 4, True, True) + 1e-12


def test_cost_tables_are_checked():
    assert check_costs([(1, 2, 3)] * 4, 4) is None
    assert "one (F, B, W) triple per stage" in check_costs([(1, 2, 3)] * 3, 4)
    assert "one (F, B, W) triple per stage" in check_costs([(1, 2)] * 4, 4)
    assert "positive finite" in check_costs([(1, 0, 3)] * 4, 4)
    assert "positive finite" in check_costs([(1, float("nan"), 3)] * 4, 4)
    assert "sequence" in check_costs("fast", 4)


def test_timeline_draws_the_predicted_order(tmp_path):
    """The bench's PNG: a recorded step above the same order replayed with the costs."""
    pytest.importorskip("matplotlib")
    from pyfused.pipeline import timeline
    from pyfused.pipeline.actions import stage_rank

    costs = ((1.0, 0.05, 1.6), (1.0, 1.0, 0.4), (1.0, 1.0, 0.4), (2.5, 1.0, 0.4))
    orders = measured_orders("zbv", 2, 2, 4, costs)[0]
    times = replay(orders, 2, 4, True, cost_of(costs))
    events = timeline.planned(times, lambda s: stage_rank(s, 2, True), 2)
    assert [len(e) for e in events] == [len(orders[0]), len(orders[1])]
    assert all(e["end"] * 1e3 == pytest.approx(times[Action(e["op"], e["stage"], e["mb"])][1])
               for evs in events for e in evs)
    png = tmp_path / "t.png"
    timeline.draw(events, png, "recorded", predicted=events, predicted_title="predicted")
    assert png.stat().st_size > 0
