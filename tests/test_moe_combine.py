"""pyfused.ops.moe_combine: alone against the fp64 reference, and dispatch -> GELU -> combine
against the dense single-process MoE MLP (forward; gradients of the tokens, the routing weights
and both experts' weights), at world sizes 1-4, for every routing case of tests/moe_checks.py;
bad input gives the same error on every rank."""
import pytest
import torch

from tests import moe_checks
from tests.utils import WORLD_SIZES

TIMEOUT = 300  # every routing case in one call; a loaded 2-core box runs world 4 slowly


# by default every world size with the method that reorders most there (decomposed from 2 ranks;
# unfused at 3 too, since its permutations differ); PYFUSED_FULL_MOE_MATRIX=1: every pair
@pytest.mark.parametrize("world,method", moe_checks.grid(
    [(w, m) for w in WORLD_SIZES for m in ("unfused", "decomposed", "auto")],
    [(1, "auto"), (2, "decomposed"), (3, "unfused"), (3, "decomposed"), (4, "decomposed")]))
def test_moe_mlp_matches_dense(ranks, world, method):
    assert all(ranks.run(world, moe_checks.check_moe_mlp, method, torch.float32,
                         moe_checks.ROUTES, 100 * world, timeout=TIMEOUT))


# bf16 at the odd world size only: the tolerance policy is per dtype, the schedules are not
@pytest.mark.parametrize("method", moe_checks.grid(["unfused", "decomposed"], ["unfused"]))
def test_bf16_moe_mlp_matches_dense(ranks, method):
    assert all(ranks.run(3, moe_checks.check_moe_mlp, method, torch.bfloat16, ("topk", "skewed"),
                         11, timeout=TIMEOUT))


# combine alone at worlds 2 and 3 (the MLP test above covers 1-4 through both ops)
@pytest.mark.parametrize("world,method", moe_checks.grid(
    [(w, m) for w in (2, 3) for m in ("unfused", "decomposed")], [(3, "decomposed")]))
def test_matches_reference(ranks, world, method):
    for with_weight, weighted in ((True, True), (False, True), (True, False)):
        assert all(ranks.run(world, moe_checks.check_combine, method, torch.float32,
                             moe_checks.ROUTES, 50 * world, with_weight, weighted,
                             timeout=TIMEOUT))


def _error(rank, world, case):
    """Call moe_combine with this rank's arguments for ``case``; the InputError's text or None."""
    from pyfused.comm import InputError, forget_seen
    from pyfused.ops import moe_combine, moe_dispatch

    forget_seen()  # see tests/op_checks.py error_of
    wrong = rank == 1
    torch.manual_seed(rank)
    x = torch.randn(5 + rank, 8)
    idx = torch.stack([torch.randperm(2 * world)[:2] for _ in range(5 + rank)])
    gates = torch.rand(5 + rank, 2)
    y, layout = moe_dispatch(x, idx, num_experts=2 * world)
    weight = torch.randn(2, 8, 8)
    if case == "layout's shape" and wrong:
        layout = torch.zeros(world, 3, dtype=torch.int64)
    if case == "topk_weights' shape" and wrong:
        gates = gates[:, :1]
    if case == "y's width" and wrong:
        y, weight = torch.randn(y.shape[0], 9), torch.randn(2, 9, 8)
    if case == "weight's experts" and wrong:
        weight = torch.randn(3, 8, 8)
    if case == "y's rows":  # every rank: each raises before any transfer
        y = y[:-1]
    try:
        moe_combine(y, gates, idx, layout, weight, method="decomposed")
    except InputError as e:
        return str(e)
    return None


BAD_INPUT = {  # case: text the message must contain
    "layout's shape": "layout [3, 3] int64",
    "topk_weights' shape": "topk_weights (if given) of topk_idx's shape",
    "y's width": "y's width N differs",
    "weight's experts": "weight must be [experts per rank, N, H]",
    "y's rows": "but layout says this rank received",
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_same_error_everywhere(ranks, case):
    errors = ranks.run(3, _error, case, timeout=60)
    assert all(e is not None for e in errors), errors
    if case != "y's rows":  # each rank names its own row counts there
        assert len(set(errors)) == 1, errors
    assert all(e.startswith("pyfused.moe_combine: ") and BAD_INPUT[case] in e
               for e in errors), errors


def _misfit(rank, world, mode):
    """Rank 1 passes a layout of other routing (a zero row moved from source 0 to source 2)."""
    from pyfused import comm
    from pyfused.ops import moe_combine, moe_dispatch

    comm.set_validation(mode)
    try:
        torch.manual_seed(rank)
        idx = torch.stack([torch.randperm(2 * world)[:2] for _ in range(6)])
        x = torch.randn(6, 8)
        y, layout = moe_dispatch(x, idx, num_experts=2 * world)
        if rank == 1:
            layout = layout.clone()
            layout[0, 0] -= 1
            layout[2, 0] += 1
        try:
            moe_combine(y, torch.rand(6, 2), idx, layout, method="unfused")
        except comm.InputError as e:
            return str(e)
        return None
    finally:
        comm.set_validation("first")


def test_layouts_that_do_not_fit_are_refused_in_mode_always(ranks):
    """Validation mode "always": layouts that do not fit the routing across ranks raise the same
    error on every rank before any row moves (in the other modes the transfer sizes would
    disagree)."""
    errors = ranks.run(3, _misfit, "always", timeout=60)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert "the layouts do not fit the routing" in errors[0], errors


def _count_exchanges_of_a_step(rank, world, method):
    """One forward and backward of dispatch -> SiLU -> combine: how many count exchanges this
    rank recorded, how many routings it sorted and how many tensors it read on the host, and its
    gradients' finiteness."""
    from unittest import mock

    from pyfused.ops import moe_combine, moe_dispatch, moe_exchange

    sorts, reads = [], []
    pair_order, tolist = moe_exchange.pair_order, torch.Tensor.tolist

    def counted_sort(flat):
        sorts.append(1)
        return pair_order(flat)

    def counted_read(t):
        reads.append(1)
        return tolist(t)

    torch.manual_seed(rank)
    tokens = 7 + 2 * rank
    x = torch.randn(tokens, 8, requires_grad=True)
    idx = torch.stack([torch.randperm(2 * world)[:2] for _ in range(tokens)])
    gates = torch.rand(tokens, 2, requires_grad=True)
    up = torch.randn(2, 8, 6, requires_grad=True)
    down = torch.randn(2, 6, 8, requires_grad=True)
    step = 0
    for step in range(2):  # the first call of each op validates (its own host reads)
        sorts.clear(), reads.clear()
        with moe_exchange.recording() as events, \
                mock.patch.object(moe_exchange, "pair_order", counted_sort), \
                mock.patch.object(torch.Tensor, "tolist", counted_read):
            h, layout = moe_dispatch(x, idx, up, method=method)
            out = moe_combine(torch.nn.functional.silu(h), gates, idx, layout, down,
                              method=method)
            out.sum().backward()
    counts = sum(1 for what, _, _ in events if what == "counts")
    return counts, len(sorts), len(reads), all(t.grad.isfinite().all().item()
                                               for t in (x, gates, up, down))


@pytest.mark.parametrize("method", ["unfused", "decomposed"])
def test_a_training_step_exchanges_the_counts_once(ranks, method):
    """The routing the forward dispatch exchanged serves the rest of the step: combine, its
    backward (a dispatch of the gradients along the same routing) and the dispatch's backward take
    it from the layout, so a training step has one count exchange, one sort of the pairs and one
    host read (the exchanged counts: one synchronization on a GPU) per MoE layer. The gradients
    themselves are checked by the tests above."""
    for counts, sorts, reads, finite in ranks.run(3, _count_exchanges_of_a_step, method,
                                                  timeout=TIMEOUT):
        assert (counts, sorts, reads, finite) == (1, 1, 1, True)
