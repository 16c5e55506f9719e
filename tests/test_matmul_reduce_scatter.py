import pytest

from tests.op_checks import check_against_reference
from tests.utils import DTYPES, WORLD_SIZES

# dim 0 = 3*W keeps it divisible at every world size while each rank's chunk is odd-sized.
SHAPES = [(lambda w: (3 * w, 2, 33), 19), (lambda w: (5 * w, 65), 97)]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("method", ["unfused", "decomposed", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(ranks, world, method, dtype):
    for i, (a_shape, n) in enumerate(SHAPES):
        assert all(ranks.run(world, check_against_reference, "matmul_reduce_scatter", method, dtype,
                             a_shape(world), n, seed=20 * world + i))
