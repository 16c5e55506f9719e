"""The pure parts of the pipeline: compute orders, transfer plans (checked by the simulator),
and the stage partitioner (checked against brute force). No ranks are spawned; all of this runs
in a few seconds.
"""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from pyfused.pipeline import bubble_theory, even_starts, partition, stage_sums
from pyfused.pipeline.plan import (
    ACT,
    BACKWARD,
    FORWARD,
    GRAD,
    SCHEDULES,
    Action,
    PlanError,
    Step,
    build_lockstep_plan,
    build_plan,
    check_counts,
    choose_plan,
    local_stages,
    needed,
    rank_order,
    simulate,
)

# Every valid (schedule, p, v, m) of the unsplit schedules up to p=5, v=3, m=12: ~600 plans, each
# simulated twice (the split-backward ones: tests/test_pipeline_zero_bubble.py).
GRID = [(s, p, v, m) for s in SCHEDULES[:3] for p in range(1, 6)
        for v in ([1] if s != "interleaved_1f1b" else [1, 2, 3]) for m in range(1, 13)
        if check_counts(s, p, v, m) is None]


@pytest.mark.parametrize("backward", [True, False])
def test_every_plan_is_matched_and_deadlock_free(backward):
    for schedule, p, v, m in GRID:
        orders, plans, look = choose_plan(schedule, p, v, m, backward, grouped=False)
        assert look == 2, "gloo-style completion never needs a shallower plan"
        _check_orders(orders, p, v, m, backward)
        # NCCL-style grouped completion: the lock-step plan, verified
        _, plans_g, look_g = choose_plan(schedule, p, v, m, backward, grouped=True)
        assert look_g is None
        simulate(orders, plans_g, p, p * v, grouped=True)
        simulate(orders, plans_g, p, p * v, grouped=False)


def _check_orders(orders, p, v, m, backward):
    for rank, order in orders.items():
        expected = {Action(op, s, i) for s in local_stages(rank, p, v) for i in range(m)
                    for op in ((FORWARD, BACKWARD) if backward else (FORWARD,))}
        assert sorted(order, key=str) == sorted(expected, key=str), (rank, order)
        seen = set()
        for a in order:
            if a.op == BACKWARD:
                assert Action(FORWARD, a.stage, a.mb) in seen
            seen.add(a)


def test_1f1b_keeps_at_most_p_minus_rank_microbatches_in_flight():
    p, m = 4, 9
    for rank in range(p):
        live, peak = 0, 0
        for a in rank_order("1f1b", rank, p, 1, m, True):
            live += 1 if a.op == FORWARD else -1
            peak = max(peak, live)
        assert peak == p - rank


def test_gpipe_order():
    assert [str(a) for a in rank_order("gpipe", 1, 3, 1, 2, True)] == ["F1.0", "F1.1", "B1.0", "B1.1"]


def test_interleaved_order_matches_torch():
    """Same compute order per rank as torch.distributed.pipelining's ScheduleInterleaved1F1B
    (uses two of torch's module-level helpers, so a torch upgrade that changes them shows here)."""
    from torch.distributed.pipelining import schedules as ts

    for p, v, m in [(2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 12), (3, 2, 9), (4, 2, 6)]:
        rounds = max(1, m // p)
        mpr = m // rounds
        for rank in range(p):
            warmup = ts._get_warmup_ops(rank, v, mpr, p, m, multiply_factor=2)
            fwd_bwd = v * m - warmup

            def fwd_stage(step, rank=rank):
                return ((step // mpr) % v) * p + rank

            def bwd_stage(step, rank=rank, warmup=warmup):
                return (v - 1 - ((step - warmup) // mpr) % v) * p + rank

            theirs = ts._get_1f1b_rank_ops(v, p, warmup, fwd_bwd, v * m - fwd_bwd, rank,
                                           fwd_stage, bwd_stage)
            theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index)
                      for a in theirs if a is not None]
            ours = [("F" if a.op == FORWARD else "B", a.stage, a.mb)
                    for a in rank_order("interleaved_1f1b", rank, p, v, m, True)]
            assert ours == theirs, (p, v, m, rank)


def test_steady_1f1b_batches_mix_forward_and_backward_and_post_receives_ahead():
    p, m = 3, 8
    orders, plans, _ = choose_plan("1f1b", p, 1, m, True, grouped=False)
    steps = plans[1]  # a middle stage: it receives and sends in both directions
    order = orders[1]
    warmup = p - 1 - 1
    last_forward = max(k for k, a in enumerate(order) if a.op == FORWARD)
    # step k sends what action k-1 produced and receives for action k+2 (the other kind)
    steady = range(warmup + 2, last_forward - 1)
    assert len(steady) >= 8
    for k in steady:
        kinds = {msg.kind for msg in steps[k].sends} | {msg.kind for msg in steps[k].recvs}
        assert kinds == {ACT, GRAD}, (k, steps[k])  # one batched call, both directions
    posted_at = {msg: k for k, s in enumerate(steps) for msg in s.recvs}
    for k, a in enumerate(order):
        nxt = [b for b in order[k + 1:] if b.op == a.op]
        if nxt and needed(nxt[0], p) is not None:
            # the next microbatch's receive of the same kind is posted before this compute
            assert posted_at[needed(nxt[0], p)] <= k, (k, a)


def test_simulator_catches_bad_plans():
    p, m = 2, 4
    orders = {r: rank_order("gpipe", r, p, 1, m, True) for r in range(p)}
    plans = build_plan(orders, p, p)
    simulate(orders, plans, p, p, grouped=False)
    # rank 1 posts its first receives (act 0, 1, 2) in another order than rank 0 sends them
    first = plans[1][0]
    assert [msg.mb for msg in first.recvs] == [0, 1, 2]
    swapped = Step(first.sends, (first.recvs[1], first.recvs[0], first.recvs[2]), first.waits,
                   first.action)
    with pytest.raises(PlanError, match="partner"):
        simulate(orders, {0: plans[0], 1: [swapped, *plans[1][1:]]}, p, p, grouped=False)
    # a wait for a receive that was never posted
    no_recv = Step(first.sends, (), first.waits, first.action)
    with pytest.raises(PlanError, match="before posting"):
        simulate(orders, {0: plans[0], 1: [no_recv, *plans[1][1:]]}, p, p, grouped=False)
    # a middle rank that posts a backward receive together with its first forward's receive
    # deadlocks when a batch completes as a group
    orders3 = {r: rank_order("gpipe", r, 3, 1, 1, True) for r in range(3)}
    with pytest.raises(PlanError, match="deadlock"):
        simulate(orders3, build_plan(orders3, 3, 3, lookahead=2), 3, 3, grouped=True)


def test_receive_posted_ahead_stalls_nccl():
    """What stalled 2-stage 1F1B over NCCL on a GPU: rank 0's first batch receives the gradient of
    microbatch 0 while rank 1's first batch receives the activations of microbatches 0 and 1, which
    rank 0 sends in its next batches, queued behind the first on its one NCCL stream. Per-operation
    completion accepts the plan; NCCL's does not, at any lookahead but 0, and the lock-step plan
    pairs each batch with the peer's."""
    orders = {r: rank_order("1f1b", r, 2, 1, 4, True) for r in range(2)}
    for look in (2, 1):
        plans = build_plan(orders, 2, 2, lookahead=look)
        simulate(orders, plans, 2, 2, grouped=False)
        with pytest.raises(PlanError, match=r"deadlock \(grouped.*rank 0 at B0\.0 waiting for "
                                            r"grad\[1->0, mb 0\]"):
            simulate(orders, plans, 2, 2, grouped=True)
    lockstep = build_lockstep_plan(orders, 2, 2)
    simulate(orders, lockstep, 2, 2, grouped=True)
    batches = {r: [(st.sends, st.recvs) for st in steps if st.sends or st.recvs]
               for r, steps in lockstep.items()}
    # every batch of rank 0 is the mirror of rank 1's batch of the same tick
    assert [(set(s), set(r)) for s, r in batches[0]] == [(set(r), set(s)) for s, r in batches[1]]


def test_lockstep_idle_ticks_only_transfer():
    """Interleaved 1F1B at p=2, v=2 has no deadlock-free lookahead plan under NCCL's completion;
    its lock-step plan has ticks where a rank only posts transfers (action None before the end)."""
    orders = {r: rank_order("interleaved_1f1b", r, 2, 2, 4, True) for r in range(2)}
    for look in (2, 1, 0):
        with pytest.raises(PlanError, match="deadlock"):
            simulate(orders, build_plan(orders, 2, 4, lookahead=look), 2, 4, grouped=True)
    plans = build_lockstep_plan(orders, 2, 4)
    simulate(orders, plans, 2, 4, grouped=True)
    assert any(st.action is None and (st.sends or st.recvs)
               for steps in plans.values() for st in steps[:-1])
    assert all(steps[-1].action is None for steps in plans.values())
    assert [[st.action for st in steps if st.action] for steps in plans.values()] == \
        [orders[0], orders[1]]


def test_lockstep_refuses_orders_that_wait_on_each_other():
    F = FORWARD
    orders = {0: [Action(F, 2, 0), Action(F, 0, 0)], 1: [Action(F, 1, 0), Action(F, 3, 0)]}
    with pytest.raises(PlanError, match="no lock-step plan: the orders cannot complete"):
        build_lockstep_plan(orders, 2, 4)


def test_receives_follow_the_senders_order():
    """Rank 1 consumes rank 0's messages in another order than rank 0 sends them (F3.0 needs
    act 2->3 of microbatch 0 before F1.1 needs act 0->1 of microbatch 1): the plan must post the
    receives in the sender's order, or the k-th send pairs with the wrong receive."""
    F = FORWARD
    orders = {0: [Action(F, 0, 0), Action(F, 0, 1), Action(F, 2, 0), Action(F, 2, 1)],
              1: [Action(F, 1, 0), Action(F, 3, 0), Action(F, 1, 1), Action(F, 3, 1)]}
    for look in (0, 1, 2):
        plans = build_plan(orders, 2, 4, lookahead=look)
        simulate(orders, plans, 2, 4, grouped=False)
        posted = [msg for step in plans[1] for msg in step.recvs]
        assert [(msg.src_stage, msg.mb) for msg in posted] == [(0, 0), (0, 1), (2, 0), (2, 1)]


def test_builtin_schedules_consume_in_production_order():
    """Why torch's schedules get away without the reordering above: for every built-in order each
    rank pair's messages are consumed in the order they are produced."""
    for schedule, p, v, m in GRID:
        orders = {r: rank_order(schedule, r, p, v, m, True) for r in range(p)}
        plans = build_plan(orders, p, p * v, lookahead=0)
        for rank, steps in plans.items():
            assert [msg for st in steps for msg in st.recvs] == \
                [msg for st in steps for msg in st.waits]


def test_counts_are_checked():
    assert "multiple of the number of rounds" in check_counts("interleaved_1f1b", 4, 2, 9)
    assert "one stage per rank" in check_counts("1f1b", 2, 2, 4)
    with pytest.raises(ValueError):
        rank_order("gpipe", 0, 2, 1, 0, True)


def test_bubble_theory():
    assert bubble_theory(4, 16) == pytest.approx(3 / 19)
    assert bubble_theory(4, 8, v=2) == pytest.approx(3 / 19)
    assert bubble_theory(1, 5) == 0


# --- partitioning --------------------------------------------------------------------------

def brute_force(costs, k):
    n = len(costs)
    return min(max(stage_sums(costs, cut)) for cut in itertools.combinations(range(1, n), k - 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_partition_is_optimal_integers(costs, data):
    k = data.draw(st.integers(1, len(costs)))
    starts = partition(costs, k)
    assert len(starts) == k - 1
    best = max(stage_sums(costs, starts))
    assert best == brute_force(costs, k)
    assert best <= max(stage_sums(costs, even_starts(len(costs), k)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=8), st.data())
def test_partition_is_optimal_floats(costs, data):
    k = data.draw(st.integers(1, len(costs)))
    best = max(stage_sums(costs, partition(costs, k)))
    assert best == pytest.approx(brute_force(costs, k), rel=1e-9, abs=1e-9)
    assert best <= max(stage_sums(costs, even_starts(len(costs), k))) * (1 + 1e-9) + 1e-9


def test_partition_examples_and_errors():
    assert partition([1, 1, 1, 10], 2) == (3,)
    assert partition([5, 1, 1, 1, 1, 1], 2) == (1,)
    assert even_starts(7, 3) == (3, 5)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        partition([1, -2], 1)
