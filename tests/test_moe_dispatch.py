"""pyfused.ops.moe_dispatch: forward and backward against the fp64 reference at world sizes 1-4
(every routing case of tests/moe_checks.py, with and without the experts' GEMM); bad input gives
the same error on every rank before any row moves; the grouped GEMM's two backends agree."""
import pytest
import torch

from tests import moe_checks
from tests.utils import WORLD_SIZES

TIMEOUT = 240  # every routing case in one call; a loaded 2-core box runs world 4 slowly


# by default one method per world size (the MLP test of tests/test_moe_combine.py runs both ops at
# every world size again); PYFUSED_FULL_MOE_MATRIX=1: every pair
@pytest.mark.parametrize("world,method", moe_checks.grid(
    [(w, m) for w in WORLD_SIZES for m in ("unfused", "decomposed", "auto")],
    [(1, "unfused"), (2, "decomposed"), (3, "decomposed"), (4, "unfused")]))
def test_matches_reference(ranks, world, method):
    for with_weight in (True, False):
        assert all(ranks.run(world, moe_checks.check_dispatch, method, torch.float32,
                             moe_checks.ROUTES, 100 * world, with_weight, timeout=TIMEOUT))


# bf16 at the odd world size only: the tolerance policy is per dtype, the schedules are not
@pytest.mark.parametrize("method", moe_checks.grid(["unfused", "decomposed"], ["decomposed"]))
def test_bf16_matches_reference(ranks, method):
    assert all(ranks.run(3, moe_checks.check_dispatch, method, torch.bfloat16,
                         ("topk", "skewed"), 7, True, timeout=TIMEOUT))


def _error(rank, world, case):
    """Call moe_dispatch with this rank's arguments for ``case``; the InputError's text or None."""
    from pyfused.comm import InputError, forget_seen
    from pyfused.ops import moe_dispatch

    forget_seen()  # see tests/op_checks.py error_of
    wrong = rank == 1
    hidden = 14 if case == "hidden differs" and wrong else 8
    x = torch.randn(5 + rank, hidden)
    k = 3 if case == "k differs" and wrong else 2
    idx = torch.stack([torch.randperm(2 * world)[:k] for _ in range(5 + rank)])
    weight = torch.randn(2, hidden, 6)
    kwargs = {}
    if case == "out of range" and wrong:
        idx[0, 0] = 2 * world
    if case == "negative index" and rank == world - 1:
        idx[-1, -1] = -1
    if case == "float index" and wrong:
        idx = idx.float()
    if case == "experts not divisible":
        weight, kwargs = None, {"num_experts": 2 * world + 1}
    if case == "weight's experts":  # num_experts given: rank 1's weight holds too many
        kwargs = {"num_experts": 2 * world}
        weight = torch.randn(3 if wrong else 2, hidden, 6)
    if case == "weight's hidden size":
        weight = torch.randn(2, hidden + 1, 6)
    if case == "token dims" and wrong:
        idx = idx[:-1]
    try:
        moe_dispatch(x, idx, weight, method="decomposed", **kwargs)
    except InputError as e:
        return str(e)
    return None


BAD_INPUT = {  # case: text the message must contain
    "out of range": "outside [0, 6)",
    "negative index": "outside [0, 6)",
    "float index": "topk_idx must be int64 or int32",
    "k differs": "k (topk_idx's last dim) differs",
    "hidden differs": "hidden size H",
    "experts not divisible": "must be a positive multiple of the group size",
    "weight's experts": "experts per rank",
    "weight's hidden size": "weight's dim 1 must be x's hidden size",
    "token dims": "same leading (token) dims",
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_same_error_everywhere(ranks, case):
    errors = ranks.run(3, _error, case, timeout=60)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert errors[0].startswith("pyfused.moe_dispatch: ") and BAD_INPUT[case] in errors[0], errors


def _one_rank_out_of_range(rank, world):
    """Values below 0 and from num_experts up are counted alike on one rank (no exchange)."""
    from pyfused.comm import InputError
    from pyfused.ops import moe_dispatch

    idx = torch.tensor([[0, 3], [-1, 4], [2, -7], [1, 9]])
    try:
        moe_dispatch(torch.randn(4, 8), idx, torch.randn(4, 8, 6))
    except InputError as e:
        return str(e)
    return None


def test_one_rank_counts_every_index_out_of_range(ranks):
    error = ranks.run(1, _one_rank_out_of_range, timeout=60)[0]
    assert error is not None and "outside [0, 4)" in error and "rank 0: 4" in error, error


def test_grouped_mm_backends_agree(monkeypatch):
    """torch._grouped_mm (forced on CPU, where it runs for 16-byte aligned fp32 rows) and the
    per-expert loop give the same product, empty experts included."""
    import importlib

    moe_grouped_mm = importlib.import_module("pyfused.ops.moe_grouped_mm")

    rows, weight = torch.randn(21, 16), torch.randn(4, 16, 8)
    counts = [5, 0, 16, 0]
    monkeypatch.setattr(moe_grouped_mm, "BACKEND", "loop")
    looped = moe_grouped_mm.grouped_mm(rows, weight, counts)
    monkeypatch.setattr(moe_grouped_mm, "BACKEND", "grouped_mm")
    assert moe_grouped_mm.uses_grouped_mm(rows, weight)
    torch.testing.assert_close(moe_grouped_mm.grouped_mm(rows, weight, counts), looped)
    expected = torch.cat([rows[:5] @ weight[0], rows[5:] @ weight[2]])
    torch.testing.assert_close(looped, expected)


def test_auto_overlaps_large_experts_only(monkeypatch):
    """auto: unfused for small experts, without a weight or on one rank; decomposed from
    DECOMPOSE_MIN_WEIGHT up (decided from the weight alone: token counts are not in the choice)."""
    import importlib

    module = importlib.import_module("pyfused.ops.moe_dispatch")  # the module, not the function
    small, big = torch.empty(2, 256, 1024), torch.empty(2, 512, 1024)
    assert module.auto_preference(None, (None, None, big), False).method == "unfused"  # one rank
    two_ranks = object()
    monkeypatch.setattr(module.comm, "world_size", lambda pg: 2 if pg is two_ranks else 1)
    for weight, method in ((small, "unfused"), (big, "decomposed"), (module._ABSENT, "unfused")):
        assert module.auto_preference(two_ranks, (None, None, weight), False).method == method
