import pytest
import torch

from tests.op_checks import check_against_reference
from tests.utils import DTYPES, WORLD_SIZES

# Odd sizes on purpose (no power-of-two tiles); a 3-D case checks that leading dims follow dim 0.
SHAPES = [((5, 3, 33), 17), ((7, 65), 97)]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("method", ["unfused", "decomposed", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(ranks, world, method, dtype):
    for i, (a_shape, n) in enumerate(SHAPES):
        assert all(ranks.run(world, check_against_reference, "all_gather_matmul", method, dtype,
                             a_shape, n, seed=10 * world + i))


def test_input_grad_only(ranks):
    """Backward through a frozen weight must not need (or keep) the gathered input."""
    assert all(ranks.run(3, _input_grad_only))


def _input_grad_only(rank, world):
    from pyfused.ops import all_gather_matmul, all_gather_matmul_ref
    from tests.utils import assert_close, rank_tensors

    a_all = rank_tensors(0, world, (4, 9), torch.float32)
    b = rank_tensors(1, 1, (9, 5), torch.float32)[0]
    a = a_all[rank].clone().requires_grad_()
    y = all_gather_matmul(a, b, method="decomposed")
    y.sum().backward()
    ref = [t.clone().requires_grad_() for t in a_all]
    # every rank's output is the same gathered product (b is shared), so the loss counts it W times
    total = world * all_gather_matmul_ref(ref, b).sum()
    total.backward()
    assert_close(a.grad, ref[rank].grad)
    return True
