import pytest
import torch

from tests.op_checks import check_against_reference
from tests.utils import DTYPES, WORLD_SIZES

SHAPES = [((5, 3, 33), 17), ((7, 65), 97)]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("method", ["unfused", "decomposed", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(ranks, world, method, dtype):
    for i, (a_shape, n) in enumerate(SHAPES):
        assert all(ranks.run(world, check_against_reference, "matmul_all_reduce", method, dtype,
                             a_shape, n, seed=30 * world + i))


@pytest.mark.parametrize("chunks", [1, 2, 5, 64])
def test_chunk_counts(ranks, chunks):
    """Any chunk count, including more chunks than rows (7), gives the same sum."""
    assert all(ranks.run(3, _chunked, chunks))


def _chunked(rank, world, chunks):
    from pyfused.ops import matmul_all_reduce, matmul_all_reduce_ref
    from tests.utils import assert_close, rank_tensors

    a_all = rank_tensors(5, world, (7, 11), torch.float32)
    b_all = rank_tensors(6, world, (11, 13), torch.float32)
    y = matmul_all_reduce(a_all[rank], b_all[rank], method="decomposed", chunks=chunks)
    assert_close(y, matmul_all_reduce_ref(a_all, b_all))
    return True


def test_default_chunks_keep_pieces_worth_their_latency():
    from pyfused.ops._common import MIN_CHUNK_WORK, default_chunks

    cpu, cuda = torch.device("cpu"), torch.device("meta")  # meta: any non-CPU device uses the GPU rule
    min_flops = MIN_CHUNK_WORK["cpu"][0]
    assert default_chunks(cpu, 512, flops=min_flops - 1) == 1          # too small to split at all
    assert default_chunks(cpu, 512, flops=2 * min_flops) == 2
    assert default_chunks(cpu, 512, flops=100 * min_flops) == 2        # CPU cap: gloo latency
    assert default_chunks(cuda, 512, flops=100 * MIN_CHUNK_WORK["cuda"][0]) == 4
    assert default_chunks(cuda, 3, flops=100 * MIN_CHUNK_WORK["cuda"][0]) == 3  # never more than rows
    assert default_chunks(cpu, 64, nbytes=64 << 20) == 2 and default_chunks(cpu, 64, nbytes=1024) == 1
