"""The grouped GEMM over row segments (pyfused/kernels/grouped_gemm.py) in the Triton interpreter,
against one torch matmul per expert (``grouped_gemm_ref``).

Routings with an empty expert, an expert with every row, and odd row counts; a small tile
(16 x 16 x 16) so that one segment spans several row and column tiles and K is cut unevenly;
segments whose input and output places differ (the source-major -> expert-major of the fused
dispatch); the wait mode with every flag set; the signal mode scattering into two buffers and
setting each chunk's word once its rows are stored, a chunk with no rows included. Each launch
costs ~0.5-2 s in the interpreter, so the grid is a few launches.
"""
import pytest
import torch

from pyfused.kernels.gemm_configs import GemmConfig
from pyfused.kernels.grouped_gemm_launch import (
    SegmentTable,
    grouped_gemm,
    grouped_gemm_ref,
    segments_of_counts,
)
from pyfused.kernels.reduce_launch import PointerTable
from tests.utils import assert_close

pytestmark = pytest.mark.interpreter
SMALL = GemmConfig(16, 16, 16, 1, 4, 1)  # several tiles per segment at these sizes


def _operands(rows, experts, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(experts, k, n, generator=g) / k ** 0.5).to(dtype)
    return a, w


def _loop(a, w, counts):
    """The per-expert loop in fp64: what the kernel must equal."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(a[start:start + c].double() @ w[e].double())
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("counts,dtype,config", [
    ([5, 0, 17, 3], torch.float32, SMALL),       # an empty expert, odd counts
    ([0, 0, 41, 0], torch.float16, SMALL),       # every row to one expert
    ([7, 13, 0], torch.bfloat16, None),          # the interpreter's own tile
], ids=["empty_expert", "one_expert", "bf16_default_tile"])
def test_grouped_by_expert_equals_the_loop(counts, dtype, config):
    a, w = _operands(sum(counts), len(counts), 37, 29, dtype, sum(counts))
    segments = segments_of_counts(torch.tensor(counts))
    out = grouped_gemm(a, w, segments, config=config)
    assert out.dtype == dtype
    assert_close(out, _loop(a, w, counts), dtype, "grouped GEMM")
    assert_close(out, grouped_gemm_ref(a, w, segments, a.shape[0]), dtype, "reference")


def test_segments_move_rows_and_wait_on_set_flags():
    """Source-major input, expert-major output (2 sources x 2 experts), a transposed weight view,
    the wait mode with every flag already set (the interpreter's CPU contract)."""
    layout = torch.tensor([[3, 0], [5, 9]])        # [source, expert]
    a, w = _operands(17, 2, 24, 19, torch.float32, 3)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)   # strides as autograd passes W^T
    a_start = torch.tensor([0, 3, 3, 8])            # source-major: (0,0) (0,1) (1,0) (1,1)
    c_start = torch.tensor([0, 8, 3, 8])            # expert-major: expert 0 = 3 + 5 rows
    segments = SegmentTable.of(a_start, c_start, layout.reshape(-1), torch.tensor([0, 1, 0, 1]),
                               torch.tensor([0, 0, 1, 1]), 2)
    flags = torch.tensor([4, 7], dtype=torch.int32)
    out = grouped_gemm(a, w_t, segments, out_rows=17, wait_flags=flags, wait_expected=4,
                       config=SMALL)
    expect = torch.cat([a[0:3] @ w[0], a[3:8] @ w[0], a[8:17] @ w[1]]).double()
    assert_close(out, expect, torch.float32, "expert-major rows")


def test_signal_scatters_each_chunk_and_sets_its_word():
    """Two chunks scattered into two buffers; chunk 1's rows are all empty, so its word is set by
    program 0 before any tile; chunk 0's by the program storing its last tile."""
    a, w = _operands(17, 2, 20, 18, torch.float32, 5)
    targets = [torch.zeros(24, 18), torch.zeros(24, 18)]
    table = PointerTable.of(targets)
    words = torch.zeros(2, dtype=torch.int32)
    word_addrs = torch.tensor([words.data_ptr(), words.data_ptr() + 4], dtype=torch.int64)
    segments = SegmentTable.of(torch.tensor([0, 6, 0]), torch.tensor([2, 8, 0]),
                               torch.tensor([6, 11, 0]), torch.tensor([0, 1, 1]),
                               torch.tensor([0, 0, 1]), 2)
    grouped_gemm(a, w, segments, out_chunks=table, signal_words=word_addrs, signal_value=9,
                 config=SMALL)
    assert words.tolist() == [9, 9]
    expect = torch.zeros(24, 18, dtype=torch.float64)
    expect[2:8], expect[8:19] = a[:6].double() @ w[0].double(), a[6:].double() @ w[1].double()
    assert_close(targets[0], expect, torch.float32, "chunk 0's buffer")
    assert not targets[1].any(), "chunk 1 has no rows: its buffer stays untouched"


def test_argument_checks():
    a, w = _operands(4, 2, 8, 8, torch.float32, 0)
    bad = SegmentTable(torch.zeros(4, 2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="int32 \\[5, S\\]"):
        grouped_gemm(a, w, bad)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_gemm(a.double(), w, segments_of_counts(torch.tensor([4, 0])))
