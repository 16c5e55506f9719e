"""The fused MoE schedules (pyfused/fused/moe.py) on virtual ranks: every rank a thread of this
process, the grouped GEMM in the Triton interpreter on CPU tensors.

Each rank runs the MoE MLP -- fused dispatch -> grouped GEMM, GELU, fused grouped GEMM -> combine
-- forward, and its backward by the same fused schedules, as the ops' autograd composes them
(grad x: a combine with the transposed W1; grad y: a dispatch of the weighted output gradient
with the transposed W2; the experts' weight gradients one GEMM per expert over the kept rows).
Everything is compared with the dense single-process MoE MLP in fp64 (tests/moe_checks.py), at
world sizes 1-4, for the routing cases: top-2, top-1, whole ranks receiving nothing, every token
to one expert, a rank without tokens; odd token counts and widths.

With the interpreted launches running at once (pyfused/testing/interpreter.py), one rank's rows
held back: the other ranks' grouped GEMMs wait for them on the flag, in the kernel; and the
combine's kernels storing into each other's buffers at once, one rank late.

Cut grid: every world size and every routing case once (~4 interpreted launches per rank and
case); PYFUSED_LONG_TESTS=1 runs every routing at every world size. On CPU the op itself refuses
``method="fused"`` with the reason, on every rank alike.
"""
import pytest
import torch
import torch.nn.functional as F

from tests import moe_checks
from tests.utils import assert_close, long_test

pytestmark = pytest.mark.interpreter

CASES = [(1, "topk"), (2, "one_expert"), (2, "idle_rank"), (3, "skewed"), (4, "top1")]
LONG = [(w, r) for w in (2, 3, 4) for r in moe_checks.ROUTES if (w, r) not in CASES]


def _fused_mlp(pg, x, idx, gates, w1, w2, grad_out):
    """(out, grad x, grad gates, grad W1, grad W2) of this rank by the fused schedules."""
    from pyfused.fused.moe import fused_moe_combine, fused_moe_dispatch
    from pyfused.ops.moe_combine import weighted_sum
    from pyfused.ops.moe_exchange import routing_from_layout, to_expert_major
    from pyfused.ops.moe_grouped_mm import grouped_weight_grad

    world = pg.world
    experts = world * w1.shape[0]
    tokens, k = idx.shape
    h, layout, kept = fused_moe_dispatch(x, idx, w1, experts, pg, True)
    received = to_expert_major(kept, layout)
    h_leaf = h.detach().requires_grad_()
    act = F.gelu(h_leaf)
    routing = routing_from_layout(idx, layout, pg)
    returned = fused_moe_combine(act.detach(), idx, layout, w2, pg)
    out, pairs = weighted_sum(returned, routing, gates, tokens, k)

    width = grad_out.shape[1]
    by_pair = pairs.view(tokens, k, width)
    grad_gates = (by_pair * grad_out.unsqueeze(1)).sum(-1)
    rows = (gates.unsqueeze(-1) * grad_out.unsqueeze(1)).reshape(tokens * k, width)
    grad_act, _, kept2 = fused_moe_dispatch(rows, idx.reshape(-1, 1), w2.transpose(1, 2),
                                            experts, pg, True)
    counts = layout.sum(0).tolist()
    grad_w2 = grouped_weight_grad(act.detach(), to_expert_major(kept2, layout), counts)
    (grad_h,) = torch.autograd.grad(act, h_leaf, grad_act)
    grad_x_pairs = fused_moe_combine(grad_h, idx, layout, w1.transpose(1, 2), pg)
    grad_x, _ = weighted_sum(grad_x_pairs, routing, None, tokens, k)
    grad_w1 = grouped_weight_grad(received, grad_h, counts)
    return out, grad_x, grad_gates, grad_w1, grad_w2


def _check(world, route, seed):
    from pyfused.testing.virtual_ranks import VirtualGroup

    xs, routed, w1, w2 = moe_checks.make_case(world, route, seed)
    el = w1.shape[0] // world
    x64 = [x.double().requires_grad_() for x in xs]
    gates64 = [g.double().requires_grad_() for _, g in routed]
    w1_64, w2_64 = w1.double().requires_grad_(), w2.double().requires_grad_()
    refs = [moe_checks.dense_moe(x64[s], routed[s][0], gates64[s], w1_64, w2_64)
            for s in range(world)]
    grads = [torch.randn(r.shape, generator=torch.Generator().manual_seed(seed + s))
             for s, r in enumerate(refs)]
    loss = sum((ref * g.double()).sum() for ref, g in zip(refs, grads))
    if loss.requires_grad:  # no token anywhere: nothing to differentiate
        loss.backward()
    args = [(xs[r], routed[r][0], routed[r][1], w1[r * el:(r + 1) * el],
             w2[r * el:(r + 1) * el], grads[r]) for r in range(world)]
    group = VirtualGroup(world, "cpu")
    try:
        results = group.run(_fused_mlp, args)
    finally:
        group.free()
    for r, (out, gx, gg, g1, g2) in enumerate(results):
        what = f"fused moe mlp {route} world {world} rank {r}"
        mine = slice(r * el, (r + 1) * el)
        assert_close(out, refs[r], torch.float32, f"{what} out")
        assert_close(gx, moe_checks.grad_of(x64[r]), torch.float32, f"{what} grad x")
        assert_close(gg, moe_checks.grad_of(gates64[r]), torch.float32, f"{what} grad gates")
        assert_close(g1, moe_checks.grad_of(w1_64)[mine], torch.float32, f"{what} grad W1")
        assert_close(g2, moe_checks.grad_of(w2_64)[mine], torch.float32, f"{what} grad W2")


@pytest.mark.parametrize("world,route", CASES)
def test_fused_mlp_matches_dense(world, route):
    _check(world, route, 31 * world)


@long_test("every routing case of the fused schedules at world sizes 2-4")
@pytest.mark.parametrize("world,route", LONG)
def test_fused_mlp_matches_dense_every_routing(world, route):
    _check(world, route, 31 * world)


def test_out_of_range_index_is_the_same_error_on_every_rank():
    """The count exchange finds a value outside [0, E) on one rank and every rank raises."""
    from pyfused.fused.moe import fused_moe_dispatch
    from pyfused.testing.virtual_ranks import VirtualGroup

    world = 3
    idx = [torch.tensor([[0, 1], [2, 5]]) for _ in range(world)]
    idx[1][0, 0] = 6  # num_experts = 6
    group = VirtualGroup(world, "cpu")
    errors = []

    def one(pg, ids):
        try:
            fused_moe_dispatch(torch.randn(2, 8), ids, torch.randn(2, 8, 4), 6, pg, False)
        except Exception as e:  # noqa: BLE001 -- the message is what is compared
            errors.append(str(e))
    try:
        group.run(one, [(i,) for i in idx])
    finally:
        group.free()
    assert len(errors) == world and len(set(errors)) == 1, errors
    assert "outside [0, 6)" in errors[0] and "rank 1: 1" in errors[0]


def _refused(rank, world):
    from pyfused.ops import MethodUnavailable, moe_combine, moe_dispatch

    idx = torch.tensor([[0, 1], [1, 0]]) % (2 * world)
    try:
        moe_dispatch(torch.randn(2, 8), idx, torch.randn(2, 8, 4), method="fused")
    except MethodUnavailable as e:
        dispatch = str(e)
    layout = torch.zeros(world, 2, dtype=torch.int64)
    try:
        moe_combine(torch.randn(0, 4), None, idx[:0], layout, None, method="fused")
    except MethodUnavailable as e:
        combine = str(e)
    return dispatch, combine


def test_op_refuses_fused_on_cpu_with_the_reason(ranks):
    """Where the fused kernels cannot run (CPU tensors, gloo), both ops raise MethodUnavailable
    saying why, on every rank alike."""
    results = ranks.run(2, _refused)
    assert results[0] == results[1]
    for message in results[0]:
        assert "method='fused' is not available" in message and "cpu" in message, message


def test_dispatch_gemm_waits_for_a_late_source(monkeypatch):
    """With the ranks' interpreted launches running at once, each rank's grouped GEMM starts before
    the last rank's rows have landed and waits on its flag in the kernel: that rank's pushes and
    flags are held back 0.3 s, and every rank's out still equals the fp64 reference."""
    import time

    from pyfused.fused import moe
    from pyfused.ops.moe_dispatch import fused_on_rank, make_inputs, moe_dispatch_ref
    from pyfused.testing.interpreter import thread_safe_interpreter
    from pyfused.testing.virtual_ranks import VirtualGroup

    world, late = 3, 2
    real_signal = moe.signal_flag

    def late_signal(flags, index, value):
        if index == late:
            time.sleep(0.3)
        real_signal(flags, index, value)

    monkeypatch.setattr(moe, "signal_flag", late_signal)
    inputs = make_inputs(world, 9, 12, 10, seed=4)
    refs = moe_dispatch_ref(*(list(t) for t in zip(*[(x.double(), i, w.double())
                                                     for x, i, w in inputs])))
    group = VirtualGroup(world, "cpu")
    try:
        with thread_safe_interpreter():
            outs = group.run(fused_on_rank, inputs)
    finally:
        group.free()
    for r in range(world):
        assert_close(outs[r], refs[r][0], torch.float32, f"rank {r} out")


def test_combine_with_a_late_rank_and_concurrent_launches(monkeypatch):
    """The combine's kernels of all ranks run at once and store into each other's buffers, rank 2's
    0.3 s late; each chunk's word is set by the tile that completes it, and every rank's out still
    equals the fp64 reference."""
    import threading
    import time

    from pyfused.fused import moe
    from pyfused.ops.moe_combine import fused_on_rank, make_inputs, reference_per_rank
    from pyfused.testing.interpreter import thread_safe_interpreter
    from pyfused.testing.virtual_ranks import VirtualGroup

    world = 3
    real_gemm = moe.grouped_gemm

    def late_gemm(*args, **kw):
        if threading.current_thread().name.endswith("-rank2"):
            time.sleep(0.3)
        return real_gemm(*args, **kw)

    monkeypatch.setattr(moe, "grouped_gemm", late_gemm)
    inputs = make_inputs(world, 9, 12, 10, seed=4)
    refs = reference_per_rank([tuple(t.double() if t.is_floating_point() else t for t in rank)
                               for rank in inputs])
    group = VirtualGroup(world, "cpu")
    try:
        with thread_safe_interpreter():
            outs = group.run(fused_on_rank, inputs)
    finally:
        group.free()
    for r in range(world):
        assert_close(outs[r], refs[r], torch.float32, f"rank {r} out")
