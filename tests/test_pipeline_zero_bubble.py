"""Split backward and the zero-bubble schedules (ZB-H1, interleaved zero bubble, ZBV, DualPipeV),
and uneven microbatches for every schedule.

Pure parts first (no ranks): B and W of single modules against one unsplit backward, each weight
gradient formed once and never in B; every split schedule's orders and transfer plans (simulated
for deadlock freedom) and the bubble each promises on the unit-time model. Then gloo ranks: three
SGD-with-momentum steps against single-process training, at world 2-4 with microbatch counts
below, equal to and above the stage count, and uneven last microbatches; and bad combinations
that must fail with the same error on every rank before any transfer.

Grid, cut for a 2-core machine: each schedule gets one case per world size 2, 3, 4 (3 catches
power-of-two assumptions), and the existing schedules one uneven case each.
"""
import copy

import pytest
import torch
import torch.nn as nn

from pyfused.pipeline import (
    PipelineSegment,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBH1,
    ScheduleZBVZeroBubble,
    even_starts,
    layer_units,
    split,
)
from pyfused.pipeline.plan import (
    BACKWARD,
    FORWARD,
    SPLIT_BACKWARD,
    V_SHAPED,
    WEIGHT,
    Action,
    bubble_theory,
    check_counts,
    choose_plan,
    local_stages,
    rank_order,
    simulate,
)
from pyfused.pipeline.split_backward import backward_input, backward_weight
from pyfused.pipeline.zero_bubble import (
    fixed_policy,
    list_schedule,
    unit_bubble,
    unit_cost,
    zero_bubble_orders,
)
from tests.test_pipeline import build_model
from tests.utils import assert_close

TIMEOUT = 90
ERROR_TIMEOUT = 30
STEPS = 3
SPLIT_V = {"zbh1": 1, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}


# --- split backward of one module --------------------------------------------------------------

class SharedWeights(nn.Module):
    """One Linear applied twice, a parameter used on two paths and a second output that does not
    depend on the input: the cases where W's grouping and its start at an output matter."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        h = self.a(torch.tanh(self.a(x))) * self.scale
        return self.b(torch.relu(h)), self.scale.sum() * torch.ones(2)


MODULES = {
    "mlp": lambda: nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 6), nn.LayerNorm(6)),
    "shared": SharedWeights,
    "conv": lambda: nn.Sequential(nn.Unflatten(1, (1, 6)), nn.Conv1d(1, 3, 3), nn.Flatten(),
                                  nn.Linear(12, 4)),
}


@pytest.mark.parametrize("needs_input_grad", [True, False], ids=["middle", "first"])
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_split_backward_equals_unsplit(kind, needs_input_grad):
    torch.manual_seed(0)
    mod = MODULES[kind]()
    ref = copy.deepcopy(mod)
    x = torch.randn(5, 6)
    calls = {}
    for name, p in mod.named_parameters():  # counts every gradient formed for a parameter
        p.register_hook(lambda g, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    xi = x.clone().requires_grad_(needs_input_grad)
    outs = mod(xi)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    (gx,), work = backward_input(outs, grads, [xi], list(mod.parameters()))
    assert calls == {} and all(p.grad is None for p in mod.parameters()), "B formed a weight grad"
    # each W call forms the gradient of each of its parameters once; a parameter is in more than
    # one call only when independent paths reach it (their sum is its gradient)
    name_of = {id(p): n for n, p in mod.named_parameters()}
    per_call = {}
    for _, _, params, _, _ in work.calls:
        for p in params:
            per_call[name_of[id(p)]] = per_call.get(name_of[id(p)], 0) + 1
    assert set(per_call) == set(name_of.values())
    backward_weight(work)
    assert work.calls == []
    xr = x.clone().requires_grad_(needs_input_grad)
    ref_outs = ref(xr)
    torch.autograd.backward(ref_outs if isinstance(ref_outs, tuple) else (ref_outs,), grads)
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, name=f"{kind}: grad of {name}")
    assert calls == per_call
    assert sum(per_call.values()) <= len(per_call) + (1 if kind == "shared" else 0)
    if needs_input_grad:
        assert_close(gx, xr.grad, name=f"{kind}: input grad")
    else:
        assert gx is None


# --- orders, plans and promised bubbles --------------------------------------------------------

# p <= 4, m <= 9: microbatch counts below, equal to and above every stage count up to 8 (a wider
# grid, p <= 5 and m <= 12, was checked once and behaves the same; it costs 3x the time)
SPLIT_GRID = [(s, p, v, m) for s in SPLIT_BACKWARD for p in range(1, 5)
              for v in ([SPLIT_V[s]] if s != "interleaved_zb" else [1, 2, 3]) for m in range(1, 10)
              if check_counts(s, p, v, m) is None]


def test_split_orders_run_every_action_once_in_dependency_order():
    for schedule, p, v, m in SPLIT_GRID:
        v_shaped = schedule in V_SHAPED
        for backward in (True, False):
            orders = {r: rank_order(schedule, r, p, v, m, backward) for r in range(p)}
            for rank, order in orders.items():
                ops = (FORWARD, BACKWARD, WEIGHT) if backward else (FORWARD,)
                expected = {Action(op, s, i) for s in local_stages(rank, p, v, v_shaped)
                            for i in range(m) for op in ops}
                assert len(order) == len(expected) and set(order) == expected, (schedule, rank)


def test_split_plans_are_deadlock_free():
    """gloo: the full lookahead is always safe. NCCL-style grouped completion: the lock-step plan,
    which the simulator accepts for every order."""
    for schedule, p, v, m in SPLIT_GRID:
        v_shaped = schedule in V_SHAPED
        for backward in (True, False):
            orders, plans, look = choose_plan(schedule, p, v, m, backward, grouped=False)
            assert look == 2, (schedule, p, v, m)
            simulate(orders, plans, p, p * v, False, v_shaped)
            orders, plans, look = choose_plan(schedule, p, v, m, backward, grouped=True)
            assert look is None
            simulate(orders, plans, p, p * v, True, v_shaped)


def test_promised_bubbles():
    for p in (2, 3, 4):
        for m in (p, 2 * p, 8, 12):
            one_f_one_b = {r: rank_order("1f1b", r, p, 1, m, True) for r in range(p)}
            assert unit_bubble(one_f_one_b, p, p, False, False) == pytest.approx(bubble_theory(p, m))
            zbh1 = unit_bubble(zero_bubble_orders("zbh1", p, 1, m, True), p, p, False, True)
            assert zbh1 == pytest.approx((p - 1) / (3 * m + p - 1))  # the ZB-H1 paper's
            # bubble time (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W): a third
            assert zbh1 * (3 * m + p - 1) == pytest.approx(bubble_theory(p, m) * (m + p - 1))
            zbv = unit_bubble(zero_bubble_orders("zbv", p, 2, m, True), p, 2 * p, True, True)
            dual = unit_bubble(zero_bubble_orders("dualpipev", p, 2, m, True), p, 2 * p, True, True)
            izb = unit_bubble(zero_bubble_orders("interleaved_zb", p, 2, m, True), p, 2 * p, False,
                              True)
            assert zbv < zbh1 and dual <= zbv + 1e-9, (p, m, zbh1, zbv, dual)
            if m % p == 0:
                inter = {r: rank_order("interleaved_1f1b", r, p, 2, m, True) for r in range(p)}
                assert izb < unit_bubble(inter, p, 2 * p, False, False)


TORCH_CLASS = {"zbh1": "ScheduleInterleavedZeroBubble", "interleaved_zb":
               "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}


def _torch_order(schedule, rank, p, v, m):
    """torch's order of ``rank`` for ``schedule`` in pyfused's actions (ZB-H1: its
    ScheduleInterleavedZeroBubble with one stage per rank): a full backward is a B directly
    followed by its W, an overlapped pair its two actions in sequence."""
    from torch.distributed.pipelining import schedules as ts

    kinds = ts._ComputationType
    n_rounds = max(1, m // p)
    shell = type("Shell", (), {"pp_group_size": p, "_n_microbatches": m, "num_stages": p * v,
                               "n_local_stages": v, "number_of_rounds": n_rounds,
                               "microbatches_per_round": m // n_rounds})()
    out = []

    def add(a):
        if a.computation_type == kinds.OVERLAP_F_B:
            for sub in a.sub_actions:
                add(sub)
        elif a.computation_type == kinds.FULL_BACKWARD:
            out.extend([Action(BACKWARD, a.stage_index, a.microbatch_index),
                        Action(WEIGHT, a.stage_index, a.microbatch_index)])
        else:
            op = {kinds.FORWARD: FORWARD, kinds.BACKWARD_INPUT: BACKWARD,
                  kinds.BACKWARD_WEIGHT: WEIGHT}[a.computation_type]
            out.append(Action(op, a.stage_index, a.microbatch_index))

    cls = getattr(ts, TORCH_CLASS[schedule])
    for a in cls._calculate_single_rank_operations(shell, rank):
        if a is not None:
            add(a)
    return out


def _assert_torch_orders(schedule, p, v, m):
    """The fixed orders are torch's, and promise at most the unit bubble of the list scheduler's
    order for the same counts (DualPipeV: the same)."""
    ours = zero_bubble_orders(schedule, p, v, m, True)
    for rank in range(p):
        assert list(ours[rank]) == _torch_order(schedule, rank, p, v, m), (p, v, m, rank)
    v_shaped = schedule in V_SHAPED
    listed = list_schedule(p, v, m, v_shaped, True, fixed_policy(schedule, p, v, m), unit_cost)
    mine, theirs = (unit_bubble(o, p, p * v, v_shaped, True) for o in (ours, listed))
    assert mine <= theirs + 1e-12, (p, v, m)
    if schedule == "dualpipev":
        assert mine == pytest.approx(theirs), (p, m)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_orders_match_torch(schedule):
    """With m >= 2p the fixed ZBV and DualPipeV orders are torch's (uses a method of torch's
    classes, so a torch upgrade that changes them shows here); the list scheduler runs the smaller
    m."""
    for p in (1, 2, 3, 4):
        for m in (2 * p, 2 * p + 1, 12):
            _assert_torch_orders(schedule, p, 2, m)


def test_loop_orders_match_torch():
    """The fixed ZB-H1 and interleaved zero-bubble orders are torch's ScheduleInterleavedZeroBubble
    orders (ZB1P) at every count torch accepts (interleaved: m a multiple of the number of rounds),
    below, at and above the stage count; rank 0's backwards are whole."""
    for p in (1, 2, 3, 4):
        for v in (1, 2, 3):
            for m in range(1, 13):
                n_rounds = max(1, m // p)
                if v > 1 and m % n_rounds:
                    continue
                _assert_torch_orders("zbh1" if v == 1 else "interleaved_zb", p, v, m)
    order = zero_bubble_orders("zbh1", 3, 1, 6, True)[0]
    assert all(order[i + 1] == Action(WEIGHT, a.stage, a.mb) for i, a in enumerate(order)
               if a.op == BACKWARD)


def test_zbh1_memory_bound():
    p, m = 4, 12
    for rank in range(p):
        before_b = before_w = peak_b = peak_w = 0
        for a in rank_order("zbh1", rank, p, 1, m, True):
            before_b += {FORWARD: 1, BACKWARD: -1}.get(a.op, 0)
            before_w += {FORWARD: 1, WEIGHT: -1}.get(a.op, 0)
            peak_b, peak_w = max(peak_b, before_b), max(peak_w, before_w)
        assert peak_b <= p - rank and peak_w <= p - rank + p - 1


def test_v_placement_and_counts():
    assert local_stages(0, 3, 2, v_shaped=True) == [0, 5]
    assert local_stages(2, 3, 2, v_shaped=True) == [2, 3]
    assert "exactly 2 stages per rank" in check_counts("zbv", 2, 3, 4)
    assert "one stage per rank" in check_counts("zbh1", 2, 2, 4)


# --- training on gloo ranks --------------------------------------------------------------------

def make_schedule(kind, stages, m, loss_fn, costs=None):
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zbh1": ScheduleZBH1}
    multi = {"interleaved": ScheduleInterleaved1F1B, "interleaved_zb": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    extra = {"costs": costs} if costs is not None else {}
    if kind in single:
        return single[kind](stages[0], m, loss_fn, **extra)
    return multi[kind](stages, m, loss_fn, **extra)


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 12, generator=g), torch.randn(rows, 7, generator=g)


def train_and_compare(rank, world, schedule, v, m, rows, costs=None, lockstep=False):
    model = build_model("mlp")
    ref = copy.deepcopy(model)
    ref_chain = PipelineSegment(layer_units(ref))
    n_stages = world * v
    mine = sorted(local_stages(rank, world, v, schedule in ("zbv", "dualpipev")))
    mods, _ = split(model, n_stages, split_points=even_starts(len(layer_units(model)), n_stages))
    stages = [PipelineStage(mods[s], s, n_stages, "cpu") for s in mine]
    loss_fn = nn.MSELoss()
    sched = make_schedule(schedule, stages, m, loss_fn, costs)
    if lockstep:  # the plan NCCL gets (its batches complete as ordered groups)
        sched._grouped = True
    params = [p for s in mine for p in mods[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if params else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    used = []  # (costs, every rank's orders) of each step
    for step in range(STEPS):
        x, y = batch(step, rows)
        if opt:
            opt.zero_grad()
        ref_opt.zero_grad()
        losses = []
        out = sched.step(*((x,) if 0 in mine else ()), target=y if n_stages - 1 in mine else None,
                         losses=losses)
        ref_out = ref_chain(x)
        ref_loss = loss_fn(ref_out, y)
        ref_loss.backward()
        for p in params:
            assert_close(p.grad, ref.get_parameter(names[id(p)]).grad,
                         name=f"{schedule} step {step} grad of {names[id(p)]} on rank {rank}")
        if n_stages - 1 in mine:
            sizes = [len(c) for c in torch.tensor_split(y, m)]
            weighted = sum(loss * n for loss, n in zip(losses, sizes)) / rows
            assert_close(weighted, ref_loss.detach(), name=f"loss step {step}")
            assert_close(out, ref_out.detach(), name=f"output step {step}")
        if opt:
            opt.step()
        ref_opt.step()
        assert all(not st._state for st in stages), "a microbatch outlived its step"
        used.append((sched.stage_costs, sched.orders))
        if step == 1:
            allocated = sched._transport.pool.allocated
    # Receive buffers held from B to W return to the pool: the third step allocates none.
    assert sched._transport.pool.allocated == allocated
    for p in params:
        assert_close(p.detach(), ref.get_parameter(names[id(p)]).detach(), name="trained weights")
    x, y = batch(STEPS, rows)  # a forward-only step runs the same orders without B and W
    out = sched.eval(*((x,) if 0 in mine else ()), target=y if n_stages - 1 in mine else None)
    if n_stages - 1 in mine:
        assert_close(out, ref_chain(x).detach(), name="eval output")
    return used


CASES = [
    # (schedule, world, stages per rank, microbatches, batch rows): m against p*v stages
    ("zbh1", 2, 1, 4, 12),            # above
    ("zbh1", 3, 1, 3, 10),            # equal, uneven (4, 3, 3 rows)
    ("zbh1", 4, 1, 2, 6),             # below
    ("interleaved_zb", 2, 2, 3, 9),   # below
    ("interleaved_zb", 3, 2, 6, 13),  # equal, uneven
    ("interleaved_zb", 4, 2, 9, 18),  # above
    ("zbv", 2, 2, 5, 11),             # above, uneven
    ("zbv", 3, 2, 6, 12),             # equal
    ("zbv", 4, 2, 4, 8),              # below
    ("dualpipev", 2, 2, 6, 12),       # above
    ("dualpipev", 3, 2, 4, 9),        # below, uneven
    ("dualpipev", 4, 2, 8, 16),       # equal
    # uneven microbatches in the schedules without a split backward
    ("gpipe", 3, 1, 4, 10),
    ("1f1b", 2, 1, 3, 8),
    ("interleaved", 2, 2, 4, 10),
]


@pytest.mark.parametrize("schedule,world,v,m,rows", CASES,
                         ids=[f"{c[0]}-w{c[1]}-v{c[2]}-m{c[3]}-rows{c[4]}" for c in CASES])
def test_matches_unsplit_training(ranks, schedule, world, v, m, rows):
    assert all(ranks.run(world, train_and_compare, schedule, v, m, rows, timeout=TIMEOUT))


def count_split_backwards(rank, world, m, rows):
    """One DualPipeV step: how many B's ran split (B alone, W later), and how many the order has
    that are not directly followed by their own W."""
    from pyfused.pipeline import stage as stage_module

    model = build_model("mlp")
    n_stages = 2 * world
    mine = sorted(local_stages(rank, world, 2, True))
    mods, _ = split(model, n_stages, split_points=even_starts(len(layer_units(model)), n_stages))
    sched = ScheduleDualPipeV([PipelineStage(mods[s], s, n_stages, "cpu") for s in mine], m,
                              nn.MSELoss())
    calls = []
    split_b = stage_module.backward_input

    def counting(*args, **kwargs):
        calls.append(1)
        return split_b(*args, **kwargs)

    stage_module.backward_input = counting
    try:
        x, y = batch(0, rows)
        sched.step(*((x,) if 0 in mine else ()), target=y if n_stages - 1 in mine else None)
    finally:
        stage_module.backward_input = split_b
    order = sched.orders[rank]
    alone = sum(1 for a, nxt in zip(order, order[1:] + [None]) if a.op == BACKWARD
                and nxt != Action(WEIGHT, a.stage, a.mb))
    return len(calls), alone, sum(1 for a in order if a.op == BACKWARD)


def test_whole_backwards_run_as_one_pass(ranks):
    """A B directly followed by its own W (DualPipeV's steady state) runs as one unsplit
    backward: only the other B's go through the split (gradients: test_matches_unsplit_training)."""
    for split_calls, alone, total in ranks.run(2, count_split_backwards, 5, 10, timeout=TIMEOUT):
        assert split_calls == alone < total


LOCKSTEP_CASES = [("1f1b", 2, 1, 3, 8), ("interleaved", 2, 2, 4, 10), ("zbh1", 3, 1, 3, 10),
                  ("interleaved_zb", 3, 2, 6, 13), ("zbv", 2, 2, 5, 11), ("dualpipev", 3, 2, 4, 9),
                  ("dualpipev", 2, 2, 5, 11)]


@pytest.mark.parametrize("schedule,world,v,m,rows", LOCKSTEP_CASES,
                         ids=[f"{c[0]}-w{c[1]}-v{c[2]}-m{c[3]}" for c in LOCKSTEP_CASES])
def test_lockstep_plans_match_unsplit_training(ranks, schedule, world, v, m, rows):
    """The transfer plans of NCCL (lock-step batches, idle ticks that only transfer) run on gloo:
    the same training as the unsplit model."""
    assert all(ranks.run(world, train_and_compare, schedule, v, m, rows, lockstep=True,
                         timeout=TIMEOUT))


# W cheap against B, a first stage without B and a heavy last stage (the loss): orders unlike the
# fixed ones (each case checks that its order differs)
def skewed(n_stages):
    return [(1.0 + 1.5 * (s == n_stages - 1), 0.05 if s == 0 else 1.0, 1.6 if s == 0 else 0.4)
            for s in range(n_stages)]


# a slow middle stage and a heavy last W: the cost order is predicted 24.2 against the fixed 26.7
ZBH1_COSTS = [(0.5, 0.5, 0.5), (2.0, 1.5, 0.3), (0.3, 1.0, 2.0)]
# the fixed ZBV order of 3 ranks, 6 microbatches is the best for skewed costs; not with a slow B
# a heavy first W and a slow last stage: predicted 37.2 against the fixed interleaved order's 40.3
IZB_COSTS = [(2.0, 1.5, 3.0), (0.5, 0.5, 2.0), (0.5, 0.3, 0.5), (2.0, 2.0, 0.5)]
ZBV_COSTS = [(1.0, 0.05, 0.4)] + [(1.0, 2.0 if s == 3 else 1.0, 0.4) for s in range(1, 6)]
COST_CASES = [
    # (schedule, world, stages per rank, microbatches, batch rows, costs); grid cut for 2 cores:
    # each schedule once, world 2-4, m below, equal to and above the stage count
    ("zbh1", 2, 1, 4, 12, "measure"),
    ("zbh1", 3, 1, 6, 13, ZBH1_COSTS),
    ("interleaved_zb", 2, 2, 4, 8, IZB_COSTS),
    ("zbv", 3, 2, 6, 12, ZBV_COSTS),
    ("dualpipev", 2, 2, 3, 7, "measure"),
    ("dualpipev", 4, 2, 4, 10, "skewed"),
]
COST_TIMEOUT = 180  # ranks also build the cost orders (under a second each on an idle core)


@pytest.mark.parametrize("schedule,world,v,m,rows,costs", COST_CASES,
                         ids=[f"{c[0]}-w{c[1]}-m{c[3]}-{c[5] if isinstance(c[5], str) else 'table'}"
                              for c in COST_CASES])
def test_orders_from_costs_match_unsplit_training(ranks, schedule, world, v, m, rows, costs):
    """Orders built from given or measured costs train exactly as one process does; every rank
    uses the same costs and orders; measured costs take effect after the first step."""
    table = skewed(world * v) if costs == "skewed" else costs
    costs = "table" if isinstance(costs, list) else costs
    results = ranks.run(world, train_and_compare, schedule, v, m, rows, table,
                        timeout=COST_TIMEOUT)
    assert all(r == results[0] for r in results), "ranks used different costs or orders"
    fixed = {r: list(o) for r, o in zero_bubble_orders(schedule, world, v, m, True).items()}
    if costs == "measure":
        assert results[0][0][1] == fixed  # the first step runs the fixed order and measures
        measured = results[0][0][0]
        assert len(measured) == world * v and all(t > 0 for row in measured for t in row)
        assert all(c == measured for c, _ in results[0])
    else:
        assert all(c == tuple(map(tuple, table)) for c, _ in results[0])
        assert results[0][0][1] != fixed, "the skewed costs should change the order"


def error_case(rank, world, case):
    from pyfused.comm import InputError

    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    if case == "zbv_three_per_rank":
        stages = [PipelineStage(nn.Linear(6, 6), s, 3 * world, "cpu")
                  for s in local_stages(rank, world, 3)]
        sched, last = ScheduleZBVZeroBubble(stages, 4, nn.MSELoss()), 3 * world - 1
    elif case == "zbv_loop_placement":
        stages = [PipelineStage(nn.Linear(6, 6), s, 2 * world, "cpu")
                  for s in local_stages(rank, world, 2)]
        sched, last = ScheduleDualPipeV(stages, 4, nn.MSELoss()), 2 * world - 1
    elif case in ("costs_differ", "costs_wrong_length"):
        stages = [PipelineStage(nn.Linear(6, 6), s, 2 * world, "cpu")
                  for s in local_stages(rank, world, 2, v_shaped=True)]
        n = 2 * world - (case == "costs_wrong_length")
        costs = [(1.0, 1.0, 1.0 + (rank == 1 and case == "costs_differ"))] * n
        sched, last = ScheduleZBVZeroBubble(stages, 4, nn.MSELoss(), costs=costs), 0
    else:  # zbh1_two_per_rank: torch's single-stage schedule given a multi-stage model
        stage = PipelineStage(nn.Linear(6, 6), rank, 2 * world, "cpu")
        sched, last = ScheduleZBH1(stage, 4, nn.MSELoss()), 2 * world - 1
    mine = [s.stage_index for s in sched._stages]
    try:
        sched.step(*((x,) if 0 in mine else ()), target=y if last in mine else None)
    except InputError as e:
        outcome = str(e)
    else:
        outcome = None
    # the group still works: a correct ZB-H1 step on fresh stages
    good = ScheduleZBH1(PipelineStage(nn.Linear(6, 6) if rank == 0 else nn.Identity(), rank,
                                      world, "cpu"), 2, nn.MSELoss())
    good.step(*((torch.ones(4, 6),) if rank == 0 else ()),
              target=torch.zeros(4, 6) if rank == world - 1 else None)
    return outcome


ERRORS = {
    "zbv_three_per_rank": "exactly 2 stages per rank",
    "zbv_loop_placement": "torch's V placement",
    "zbh1_two_per_rank": "num_stages",
    "costs_differ": "costs (none, \"measure\", or the table's hash) differs between ranks",
    "costs_wrong_length": "costs must hold one (F, B, W) triple per stage (6 stages)",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_combinations_fail_on_every_rank(ranks, case):
    results = ranks.run(3, error_case, case, timeout=ERROR_TIMEOUT)
    assert results[0] is not None and ERRORS[case] in results[0], results
    assert all(r == results[0] for r in results), results
