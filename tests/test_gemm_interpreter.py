"""The GEMM launcher (pyfused/kernels/gemm_launch.py) on 16-bit CPU tensors, in the Triton
interpreter.

The interpreter's bf16 ``tl.dot`` multiplies raw bit patterns (values around 1e11); the launcher
hands bf16 operands to the kernel as fp32 copies there. These tests compare bf16 and fp16 GEMMs with
the fp32 reference on odd shapes (partial tiles in M, N and K), through the options the fused ops
use; tests/test_gemm.py covers fp32 / fp16 and the GPU.

Grid: each launch costs 0.1-1 s in the interpreter, so the layouts, bias and strided operands are
combined in a few calls rather than crossed.
"""
import pytest
import torch

from pyfused.kernels.gemm_launch import gemm, gemm_ref, plan_gemm
from tests.utils import assert_close

pytestmark = pytest.mark.interpreter
DTYPES = (torch.bfloat16, torch.float16)


def _randn(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,b_layout,bias",
                         [(97, 45, 131, "kn", False), (70, 129, 29, "nk", True)])
def test_plain(dtype, m, n, k, b_layout, bias):
    g = torch.Generator().manual_seed(m)
    a = _randn(g, m, k, dtype=dtype)
    b = _randn(g, *((k, n) if b_layout == "kn" else (n, k)), dtype=dtype)
    c = _randn(g, n, dtype=dtype) if bias else None
    out = gemm(a, b, c, b_layout=b_layout)
    assert out.dtype == dtype
    assert_close(out, gemm_ref(a, b, c, b_layout), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_operands_and_fp32_out(dtype):
    """a a column slice of a wider tensor, b a transposed view, an fp32 output."""
    g = torch.Generator().manual_seed(1)
    a = _randn(g, 53, 90, dtype=dtype)[:, 3:70]
    b = _randn(g, 37, 67, dtype=dtype).t()
    out = gemm(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, gemm_ref(a, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_wait_signal_scatter(dtype):
    """The fused ops' options on one call: chunks in a chosen order, waits on (set) flags, tile
    counters, and each chunk scattered into its own buffer."""
    g = torch.Generator().manual_seed(2)
    m, n, k, chunks = 67, 33, 41, 3
    a, b = _randn(g, m, k, dtype=dtype), _randn(g, k, n, dtype=dtype)
    plan = plan_gemm(m, n, k, dtype, torch.device("cpu"), num_chunks=chunks)
    bufs = [torch.full((plan.chunk_rows, n), float("nan"), dtype=dtype) for _ in range(chunks)]
    counters = torch.zeros(chunks, dtype=torch.int32)
    gemm(a, b, num_chunks=chunks, chunk_order=[2, 0, 1], wait_flags=torch.full((chunks,), 5,
         dtype=torch.int32), wait_expected=5, signal_counters=counters, out_chunks=bufs)
    ref = gemm_ref(a, b)
    for c, buf in enumerate(bufs):
        lo, hi = plan.chunk_bounds(c)
        assert_close(buf[:hi - lo], ref[lo:hi], dtype, name=f"chunk {c}")
    assert counters.tolist() == [plan.tiles_per_chunk] * chunks


def test_compiled_launches_keep_bf16_operands(monkeypatch):
    """Only interpreted launches get fp32 copies: a launch of CPU tensors that is compiled for a
    GPU target instead (benchmarks/hopper_compile.py records them) stays bf16."""
    import pyfused.kernels.gemm as kernels
    import pyfused.kernels.gemm_launch as launcher

    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(a=args[0].dtype, b=args[1].dtype, precision=kwargs["INPUT_PRECISION"])
            return launch

    monkeypatch.setattr(kernels, "persistent_gemm_kernel", Recorder())
    monkeypatch.setattr(launcher, "check_backend", lambda *args: False)
    a = torch.ones(8, 8, dtype=torch.bfloat16)
    gemm(a, a)
    assert seen == dict(a=torch.bfloat16, b=torch.bfloat16, precision="tf32")
