"""The persistent Triton GEMM (pyfused/kernels/gemm.py via pyfused.kernels.gemm_launch).

On CPU the kernel runs in the Triton interpreter (conftest sets TRITON_INTERPRET=1): fp32 and fp16,
flags pre-set (programs run one after another, nothing could set a flag during the launch). bf16
(the interpreter's bf16 dot is wrong), late flags and timing are GPU tests. tests/test_hopper_compile.py
compiles the GPU variants for sm_90a (and sm_80) on any machine and checks the instructions the
docstring's memory-ordering argument relies on.

Grid sizes: the interpreter needs ~0.3-1 s per launch at these shapes, so the option matrix runs on
one odd shape with a small K, and the large odd shape only on the plain path and one all-options case.
"""
import itertools

import pytest
import torch

from pyfused.kernels.gemm_configs import NOMINAL_SMS, GemmConfig, choose_gemm_config
from pyfused.kernels.gemm_launch import gemm, gemm_ref, plan_gemm
from pyfused.kernels.reduce_launch import PointerTable, WaitTimeout
from tests.utils import assert_close

CPU_DTYPES = (torch.float32, torch.float16)
# A small tile so the odd shapes below have several row tiles per chunk, partial tiles in M, N and
# K, and GROUP_M groups cut short at a chunk's end.
SMALL = GemmConfig(16, 32, 32, group_m=2)


def _inputs(m, k, n, dtype, seed, device="cpu", weight=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype).to(device)
    b = torch.randn(*((n, k) if weight else (k, n)), generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    return a, b, bias


def _flags(n, value=1, device="cpu"):
    return torch.full((n,), value, dtype=torch.int32, device=device)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("b_layout", ["kn", "nk"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_plain_odd_shape(dtype, b_layout, with_bias):
    """97 x 1025 x 259 (M x N x K): no dimension is a multiple of any tile."""
    a, b, bias = _inputs(97, 259, 1025, dtype, seed=1, weight=b_layout == "nk")
    bias = bias if with_bias else None
    assert_close(gemm(a, b, bias, b_layout=b_layout), gemm_ref(a, b, bias, b_layout), dtype)


@pytest.mark.interpreter
def test_strided_inputs_and_out_dtype():
    """a and b as transposed views (no copy), fp16 inputs into an fp32 output."""
    a_t, b_t, bias = _inputs(70, 45, 33, torch.float16, seed=2)
    a, b = a_t.t().contiguous().t(), b_t.t().contiguous().t()  # column-major storage
    assert a.stride() == (1, 70) and b.stride() == (1, 45)
    out = gemm(a, b, bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    # fp16 products are exact in fp32; only the fp32 sums round, as in the reference
    assert_close(out, gemm_ref(a_t, b_t, bias), torch.float32)


OPTIONS = list(itertools.product([False, True], repeat=3))  # (wait, signal, scatter)


@pytest.mark.parametrize("wait,signal,scatter", OPTIONS,
                         ids=[f"wait{int(w)}-signal{int(s)}-scatter{int(x)}" for w, s, x in OPTIONS])
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_options(wait, signal, scatter, dtype):
    """Every option alone and combined; 97 rows in 3 chunks of 33, 33, 31; chunk order 2, 0, 1."""
    m, k, n, chunks = 97, 67, 75, 3
    a, w, bias = _inputs(m, k, n, dtype, seed=3, weight=True)
    ref = gemm_ref(a, w, bias, "nk")
    plan = plan_gemm(m, n, k, dtype, a.device, num_chunks=chunks, config=SMALL)
    assert plan.chunk_rows == 33 and plan.tiles_per_chunk == 3 * 3
    counters = _flags(chunks, 5) if signal else None  # a non-zero base: the kernel only adds
    kwargs = dict(b_layout="nk", num_chunks=chunks, chunk_order=[2, 0, 1], config=SMALL,
                  num_programs=3, wait_flags=_flags(chunks, 2) if wait else None, wait_expected=2,
                  signal_counters=counters)
    if scatter:
        # each chunk's buffer has 2 spare rows that must stay untouched
        bufs = [torch.full((plan.chunk_rows + 2, n), 7.0, dtype=dtype) for _ in range(chunks)]
        assert gemm(a, w, bias, out_chunks=bufs, **kwargs) is bufs
        for c, buf in enumerate(bufs):
            lo, hi = plan.chunk_bounds(c)
            assert_close(buf[:hi - lo], ref[lo:hi], dtype, name=f"chunk {c}")
            assert bool((buf[hi - lo:] == 7.0).all()), f"chunk {c}: rows past the chunk were written"
    else:
        assert_close(gemm(a, w, bias, **kwargs), ref, dtype)
    if signal:
        assert counters.tolist() == [5 + plan.tiles_per_chunk] * chunks


@pytest.mark.interpreter
def test_all_options_odd_shape_fp32():
    """All options at once on the large odd shape, B as [K, N], 4 uneven chunks (25, 25, 25, 22)."""
    m, k, n, chunks = 97, 1025, 259, 4
    a, b, bias = _inputs(m, k, n, torch.float32, seed=4)
    plan = plan_gemm(m, n, k, torch.float32, a.device, num_chunks=chunks)
    bufs = [torch.empty(plan.chunk_rows, n) for _ in range(chunks)]
    counters = _flags(chunks, 0)
    gemm(a, b, bias, num_chunks=chunks, chunk_order=[3, 1, 0, 2], wait_flags=_flags(chunks),
         signal_counters=counters, out_chunks=PointerTable.of(bufs))
    out = torch.cat([buf[:plan.chunk_bounds(c)[1] - plan.chunk_bounds(c)[0]]
                     for c, buf in enumerate(bufs)])
    assert_close(out, gemm_ref(a, b, bias), torch.float32)
    assert counters.tolist() == [plan.tiles_per_chunk] * chunks


@pytest.mark.interpreter
def test_chunk_order_is_the_schedule():
    """The first tile computed belongs to chunk_order[0]: with no flag set, that chunk's wait is the
    one that times out (bounded spin, no hang), and the error names it."""
    a, b, _ = _inputs(40, 16, 8, torch.float32, seed=5)
    for order in ([0, 1, 2, 3], [2, 3, 0, 1], [3, 0, 1, 2]):
        status = torch.zeros(1, dtype=torch.int32)
        with pytest.raises(WaitTimeout, match=f"chunk {order[0]}"):
            gemm(a, b, num_chunks=4, chunk_order=order, wait_flags=_flags(4, 0), spin_limit=5,
                 status=status, config=SMALL, num_programs=2)
        assert status.item() == order[0] + 1


@pytest.mark.interpreter
def test_wait_timeout_computes_the_rest():
    """Only chunk 1's flag is missing: the timeout is reported, and the chunks whose flags were set
    (all of them hold valid data here) are still computed."""
    a, b, _ = _inputs(30, 16, 8, torch.float16, seed=6)
    out = torch.zeros(30, 8, dtype=torch.float16)
    with pytest.raises(WaitTimeout, match="chunk 1"):
        gemm(a, b, out=out, num_chunks=3, wait_flags=torch.tensor([1, 0, 1], dtype=torch.int32),
             spin_limit=3, config=SMALL)
    assert_close(out, gemm_ref(a, b), torch.float16)


@pytest.mark.interpreter
def test_raw_address_table_and_expected_epoch():
    """Scatter through a table of raw addresses (as for peers' buffers); flags compared with >=."""
    m, k, n = 12, 20, 9
    a, b, _ = _inputs(m, k, n, torch.float32, seed=7)
    store = torch.zeros(2, 6, n)
    table = PointerTable.from_addresses([store[0].data_ptr(), store[1].data_ptr()], (6, n), (n, 1),
                                        torch.float32, torch.device("cpu"))
    gemm(a, b, num_chunks=2, out_chunks=table, wait_flags=torch.tensor([7, 9], dtype=torch.int32),
         wait_expected=7, config=SMALL)
    assert_close(store.reshape(m, n), gemm_ref(a, b), torch.float32)


@pytest.mark.interpreter
def test_invalid_arguments():
    a, b, _ = _inputs(9, 8, 4, torch.float32, seed=8)
    cases = [
        (dict(num_chunks=4), "non-empty chunks"),  # 9 rows -> 3, 3, 3, 0
        (dict(num_chunks=3, chunk_order=[0, 0, 1]), "permutation"),
        (dict(wait_flags=torch.ones(2, dtype=torch.int64), num_chunks=2), "int32"),
        (dict(wait_flags=_flags(3), num_chunks=2), "shape"),
        (dict(wait_flags=_flags(2, 0), num_chunks=2), "must be >= expected"),
        (dict(signal_counters=_flags(2), autotune=True, num_chunks=2), "autotune"),
        (dict(flag_scope="cta", wait_flags=_flags(1)), "flag_scope"),
        (dict(b_layout="nk"), "K mismatch"),
        (dict(out_chunks=[torch.empty(2, 4)] * 3, num_chunks=3), "out_chunks\\[0\\]"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            gemm(a, b, **kwargs)
    with pytest.raises(ValueError, match="same dtype|share a dtype"):
        gemm(a, b.half())


def test_config_choice_is_a_pure_function_of_shape_dtype_arch():
    """Ranks must agree on tiles: the choice uses only (shape, dtype, arch) and nominal SM counts."""
    h100_large = choose_gemm_config(8192, 8192, 1024, torch.bfloat16, "sm_90", num_chunks=8)
    assert (h100_large.block_m, h100_large.block_n) == (128, 256)
    # 4096 x 1280 (QKV of Llama-3 70B at TP=8): 160 large tiles fill 2 waves of 132 SMs at 61%;
    # the medium tile's 320 fill 3 waves at 81%, so the medium tile is chosen.
    qkv = choose_gemm_config(4096, 1280, 8192, torch.bfloat16, "sm_90")
    assert (qkv.block_m, qkv.block_n) == (128, 128)
    assert choose_gemm_config(64, 8192, 8192, torch.float16, "sm_80").block_m == 64
    # K or N not a multiple of 16: element-wise loads, the small unaligned tile (below the register cap)
    unaligned = choose_gemm_config(4096, 1280, 8191, torch.bfloat16, "sm_90")
    assert (unaligned.block_m, unaligned.block_n, unaligned.block_k) == (64, 64, 16)
    assert choose_gemm_config(4096, 1025, 8192, torch.float32, "sm_90") == unaligned
    assert choose_gemm_config(4096, 1280, 8208, torch.bfloat16, "sm_90").block_k == 64
    assert NOMINAL_SMS["sm_90"] == 132
    assert plan_gemm(4096, 1280, 8192, torch.bfloat16, "cpu", num_chunks=8).num_tiles > 0


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

LLAMA70B_TP8 = [(1280, 8192), (8192, 1024), (3584, 8192), (8192, 3584)]  # (N, K) per rank


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("b_layout", ["kn", "nk"])
def test_gpu_correctness(dtype, b_layout):
    for m, (n, k) in [(97, (1025, 259)), (512, LLAMA70B_TP8[0]), (1024, LLAMA70B_TP8[3])]:
        a, b, bias = _inputs(m, k, n, dtype, seed=m, device="cuda", weight=b_layout == "nk")
        assert_close(gemm(a, b, bias, b_layout=b_layout), gemm_ref(a, b, bias, b_layout), dtype)


@pytest.mark.gpu
def test_gpu_all_options_bf16():
    m, k, n, chunks = 1000, 8192, 1280, 8
    a, w, bias = _inputs(m, k, n, torch.bfloat16, seed=11, device="cuda", weight=True)
    plan = plan_gemm(m, n, k, torch.bfloat16, a.device, num_chunks=chunks)
    bufs = [torch.empty(plan.chunk_rows, n, dtype=torch.bfloat16, device="cuda") for _ in range(chunks)]
    counters, status = _flags(chunks, 0, "cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    order = [(3 + i) % chunks for i in range(chunks)]
    gemm(a, w, bias, b_layout="nk", num_chunks=chunks, chunk_order=order,
         wait_flags=_flags(chunks, 1, "cuda"), signal_counters=counters, out_chunks=bufs, status=status)
    torch.cuda.synchronize()
    ref = gemm_ref(a, w, bias, "nk")
    for c, buf in enumerate(bufs):
        lo, hi = plan.chunk_bounds(c)
        assert_close(buf[:hi - lo], ref[lo:hi], torch.bfloat16, name=f"chunk {c}")
    assert counters.tolist() == [plan.tiles_per_chunk] * chunks and status.item() == 0


@pytest.mark.gpu
def test_gpu_autotune_plain():
    a, b, bias = _inputs(2048, 1024, 3584, torch.bfloat16, seed=12, device="cuda")
    assert_close(gemm(a, b, bias, autotune=True), gemm_ref(a, b, bias), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("arrival", [[0, 1, 2, 3], [2, 3, 0, 1]])
def test_gpu_wait_for_late_chunks(arrival):
    """A's chunks arrive late, one by one, from another stream through the copy engine (host ->
    device copies need no SM, which the spinning kernel holds), each followed by its flag; the
    kernel, launched first, must read every chunk only after its flag. A starts as NaN, so a tile
    that read too early shows up as a non-finite output."""
    m, k, n, chunks = 2048, 1024, 1024, 4
    a_host, b, _ = _inputs(m, k, n, torch.bfloat16, seed=13, device="cpu")
    b = b.cuda()
    a_host = a_host.pin_memory()
    one = torch.ones(1, dtype=torch.int32).pin_memory()
    a = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    flags, status = _flags(chunks, 0, "cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = m // chunks
    launch = dict(num_chunks=chunks, chunk_order=arrival, wait_flags=flags, status=status)
    flags.fill_(1)
    gemm(a, b, **launch)  # compile and fill the launcher's caches first: the real launch is instant
    flags.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # One sleep (~25 ms) so the kernel is surely spinning before the first chunk lands; no kernel
        # after it on this stream, so nothing here needs an SM the spinning kernel may hold.
        torch.cuda._sleep(50_000_000)
        for c in arrival:
            a[c * rows:(c + 1) * rows].copy_(a_host[c * rows:(c + 1) * rows], non_blocking=True)
            flags[c:c + 1].copy_(one, non_blocking=True)
    out = gemm(a, b, **launch)
    assert not side.query(), "the chunks had landed before the kernel was queued: nothing was tested"
    torch.cuda.synchronize()
    assert status.item() == 0
    assert flags.tolist() == [1] * chunks
    assert_close(out, gemm_ref(a_host, b.cpu()), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("missing", [0, 1])
def test_gpu_wait_timeout_does_not_hang(missing):
    """Exactly one chunk's flag never comes, so the code recorded is that chunk's whichever program
    times out first (with both flags missing, two programs would race to record theirs). The wait is
    bounded in wall-clock time: the launch takes at least the timeout, and not much more."""
    a, b, _ = _inputs(256, 64, 64, torch.float16, seed=14, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    flags = _flags(2, 1, "cuda")
    flags[missing] = 0
    launch = dict(num_chunks=2, chunk_order=[1, 0], wait_flags=flags, status=status, timeout_ms=200)
    gemm(a, b, **launch)  # compile first: the timed launch below is the kernel alone
    torch.cuda.synchronize()
    status.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    gemm(a, b, **launch)
    end.record()
    torch.cuda.synchronize()
    assert status.item() == missing + 1
    assert 200 <= start.elapsed_time(end) < 2000
