"""The multi-source reduce with residual / RMSNorm epilogues (pyfused/kernels/reduce.py via
pyfused.kernels.reduce_launch).

On CPU the kernel runs in the Triton interpreter with sources given as a pointer table of CPU
tensors (the interpreter dereferences the raw host addresses; ``test_pointer_table_*`` pins that
down) and flags pre-set. bf16, late flags and timing are GPU tests; tests/test_hopper_compile.py
compiles the GPU variants for sm_90a (and sm_80) on any machine.

Grid sizes: each launch takes ~0.1-0.5 s in the interpreter; the epilogue matrix runs on one odd
shape (97 x 1025) with P in {1, 3}, the wait/order matrix on a smaller one.
"""
import pytest
import torch

from pyfused.kernels.reduce_configs import (
    MAX_NORM_HIDDEN,
    MAX_NORM_HIDDEN_FP32,
    ReduceConfig,
    choose_reduce_config,
)
from pyfused.kernels.reduce_launch import PointerTable, WaitTimeout, multi_source_reduce, reduce_ref
from tests.utils import assert_close

CPU_DTYPES = (torch.float32, torch.float16)


def _rows(p, m, n, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, n, generator=g).to(dtype).to(device) for _ in range(p)]


def _weight(n, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).to(device)


EPILOGUES = ["sum", "residual", "residual_rmsnorm", "residual_rmsnorm_inplace", "rmsnorm"]


@pytest.mark.interpreter
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("p", [1, 3])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_epilogues(epilogue, p, dtype):
    m, n = 97, 1025
    srcs = _rows(p, m, n, dtype, seed=p)
    residual = _rows(1, m, n, dtype, seed=10 + p)[0] if "residual" in epilogue else None
    weight = _weight(n, dtype, seed=20) if "rmsnorm" in epilogue else None
    ref_out, ref_h = reduce_ref(srcs, residual, weight, eps=1e-5)
    if epilogue == "residual_rmsnorm_inplace":
        residual = residual_out = residual.clone()  # the updated residual overwrites the old one
    else:
        residual_out = torch.empty(m, n, dtype=dtype) if residual is not None else None
    out = multi_source_reduce(srcs, residual=residual, residual_out=residual_out, weight=weight,
                              eps=1e-5)
    assert_close(out, ref_out, dtype, name="out")
    if residual_out is not None:
        assert_close(residual_out, ref_h, dtype, name="residual_out")


@pytest.mark.interpreter
@pytest.mark.parametrize("per_source_flags", [False, True], ids=["flag_per_chunk", "flag_per_source"])
@pytest.mark.parametrize("order", [None, [2, 0, 3, 1]], ids=["order_id", "order_2031"])
def test_wait_and_chunk_order(per_source_flags, order):
    """Flags pre-set; 4 uneven chunks of 18, 18, 18, 16 rows; a config that gives several programs
    per chunk and several steps per program."""
    p, m, n = 3, 70, 300
    srcs = _rows(p, m, n, torch.float16, seed=5)
    residual, weight = _rows(1, m, n, torch.float16, seed=6)[0], _weight(n, torch.float16, seed=7)
    flags = torch.full((p, 4) if per_source_flags else (4,), 3, dtype=torch.int32)
    res_out = torch.empty_like(residual)
    cfg = ReduceConfig(block_m=4, block_n=512, rows_per_prog=8, num_warps=4)
    out = multi_source_reduce(srcs, residual=residual, residual_out=res_out, weight=weight,
                              num_chunks=4, chunk_order=order, wait_flags=flags, wait_expected=3,
                              config=cfg)
    ref_out, ref_h = reduce_ref(srcs, residual, weight)
    assert_close(out, ref_out, torch.float16)
    assert_close(res_out, ref_h, torch.float16)


@pytest.mark.interpreter
def test_column_tiles_without_norm():
    """Without RMSNorm a row is cut into several column tiles (block_n < N)."""
    srcs = _rows(2, 33, 1000, torch.float32, seed=8)
    cfg = ReduceConfig(block_m=8, block_n=128, rows_per_prog=16, num_warps=4)
    out = multi_source_reduce(srcs, num_chunks=2, config=cfg)
    assert_close(out, reduce_ref(srcs)[0], torch.float32)


@pytest.mark.interpreter
def test_wait_timeout_names_source_and_chunk():
    """Source 1's chunk 2 never arrives: a bounded spin, then WaitTimeout naming it."""
    p, chunks = 3, 3
    srcs = _rows(p, 30, 64, torch.float32, seed=9)
    flags = torch.ones(p, chunks, dtype=torch.int32)
    flags[1, 2] = 0
    status = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(WaitTimeout, match="source 1, chunk 2"):
        multi_source_reduce(srcs, num_chunks=chunks, wait_flags=flags, spin_limit=4, status=status)
    assert status.item() == 1 + 1 * chunks + 2
    with pytest.raises(ValueError, match="must be >= expected"):  # the default limit is refused
        multi_source_reduce(srcs, num_chunks=chunks, wait_flags=flags)


@pytest.mark.interpreter
def test_pointer_table_of_stacked_strided_sources():
    """Sources as row-strided views into one stacked buffer (stride 80 > N = 64), through a raw
    address table: the interpreter follows int64 host addresses loaded from the table."""
    stacked = torch.randn(4, 20, 80)
    views = [stacked[i, :, :64] for i in range(4)]
    table = PointerTable.from_addresses([v.data_ptr() for v in views], (20, 64), (80, 1),
                                        torch.float32, torch.device("cpu"))
    assert not table.aligned or all(v.data_ptr() % 16 == 0 for v in views)
    out = multi_source_reduce(table)
    assert_close(out, stacked[:, :, :64].sum(0), torch.float32)


@pytest.mark.interpreter
def test_pointer_table_reads_the_live_buffers():
    """The table holds addresses, not copies: writing a source after building the table changes
    the next result."""
    srcs = _rows(2, 8, 16, torch.float32, seed=11)
    table = PointerTable.of(srcs)
    first = multi_source_reduce(table).clone()
    srcs[1].add_(1.0)
    assert_close(multi_source_reduce(table), first + 1.0, torch.float32)


@pytest.mark.interpreter
def test_invalid_arguments():
    srcs = _rows(2, 10, 16, torch.float32, seed=12)
    with pytest.raises(ValueError, match="share a shape"):
        multi_source_reduce([srcs[0], srcs[1][:5]])
    with pytest.raises(ValueError, match="weight"):
        multi_source_reduce(srcs, weight=torch.ones(15))
    with pytest.raises(ValueError, match="residual"):
        multi_source_reduce(srcs, residual=torch.ones(10, 15))
    with pytest.raises(ValueError, match="shape \\(2, 3\\)"):
        multi_source_reduce(srcs, num_chunks=3, wait_flags=torch.ones(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-empty chunks"):
        multi_source_reduce(srcs, num_chunks=6)  # 10 rows -> 2, 2, 2, 2, 2, 0
    with pytest.raises(ValueError, match="at most"):
        big = [torch.empty(1, MAX_NORM_HIDDEN + 1, dtype=torch.float16)]
        multi_source_reduce(big, weight=torch.ones(MAX_NORM_HIDDEN + 1, dtype=torch.float16))
    with pytest.raises(ValueError, match=f"at most {MAX_NORM_HIDDEN_FP32} torch.float32"):
        big = [torch.empty(1, MAX_NORM_HIDDEN_FP32 + 1)]
        multi_source_reduce(big, weight=torch.ones(MAX_NORM_HIDDEN_FP32 + 1))
    with pytest.raises(TypeError, match="sequence of tensors"):
        multi_source_reduce(torch.stack(srcs))



@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs CPU tensors")
def test_broken_interpreter_is_named_not_hit(monkeypatch):
    """The interpreter probe passes here (else every CPU kernel test would fail with it), and a
    broken one (triton 3.6 + numpy >= 2.4, seen on the device's versions) stops a launch with the
    probe's reason instead of a TypeError from deep inside the interpreter."""
    from pyfused.kernels import reduce_launch as reduce_mod

    assert reduce_mod.interpreter_problem() is None
    monkeypatch.setattr(reduce_mod, "interpreter_problem", lambda: "interpreter is broken: probe")
    with pytest.raises(RuntimeError, match="multi_source_reduce: interpreter is broken"):
        multi_source_reduce(_rows(2, 10, 16, torch.float32, seed=3))


def test_interpreter_tests_are_skipped_where_it_cannot_run(monkeypatch):
    """Tests marked ``interpreter`` are skipped, with the reason, on a machine with CUDA (no
    TRITON_INTERPRET) and where the probe fails (the device's triton 3.6 + numpy 2.5)."""
    from pyfused.kernels import reduce_launch as reduce_mod
    from tests.conftest import _interpreter_problem

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" in _interpreter_problem()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(reduce_mod, "interpreter_problem", lambda: "triton 3.6 with numpy >= 2.4")
    assert _interpreter_problem() == "triton 3.6 with numpy >= 2.4; CI runs it"
    monkeypatch.setattr(reduce_mod, "interpreter_problem", lambda: None)
    assert _interpreter_problem() is None


@pytest.mark.interpreter
@pytest.mark.parametrize("programs", [1, 3])
def test_persistent_grid_covers_every_tile(programs):
    """The reduce's grid is capped (``num_programs``, a rank's SM budget) below its tile count: each
    program walks several tiles, across chunks and their waits, and every row is still reduced."""
    m, n, chunks = 40, 24, 4
    srcs = _rows(3, m, n, torch.float32, seed=7)
    flags = torch.ones(chunks, dtype=torch.int32)
    out = multi_source_reduce(srcs, num_chunks=chunks, chunk_order=[3, 1, 0, 2], wait_flags=flags,
                              num_programs=programs)
    assert_close(out, reduce_ref(srcs)[0], torch.float32)
    with pytest.raises(ValueError, match="num_programs"):
        multi_source_reduce(srcs, num_programs=0)

def test_config_choice():
    """The chooser's rules (pyfused/kernels/reduce_configs.py): a whole row per tile with RMSNorm,
    fp32 sources take half a step on a GPU, at most 32 elements per thread (32 warps for 32768), and
    the longest row depends on the sources' element size."""
    def cfg(n, dtype, arch="sm_90", rmsnorm=True):
        return choose_reduce_config(8192, n, 8, dtype, arch, 8, rmsnorm=rmsnorm)

    assert (cfg(4096, torch.bfloat16).block_m, cfg(4096, torch.bfloat16).block_n) == (2, 4096)
    assert (cfg(4096, torch.float32).block_m, cfg(4096, torch.float32).block_n) == (1, 4096)
    assert cfg(4096, torch.float32, arch="interpreter").block_m == 4
    assert cfg(MAX_NORM_HIDDEN, torch.bfloat16).num_warps == 32
    assert cfg(MAX_NORM_HIDDEN_FP32, torch.float32).num_warps == 16
    assert cfg(8192, torch.bfloat16, rmsnorm=False).block_n == 4096
    with pytest.raises(ValueError, match="at most"):
        cfg(MAX_NORM_HIDDEN_FP32 + 1, torch.float32)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_residual_rmsnorm(p, dtype):
    for m, n in [(97, 1025), (1024, 8192)]:
        srcs = _rows(p, m, n, dtype, seed=p, device="cuda")
        residual = _rows(1, m, n, dtype, seed=99, device="cuda")[0]
        weight = _weight(n, dtype, seed=3, device="cuda")
        ref_out, ref_h = reduce_ref(srcs, residual, weight)
        out = multi_source_reduce(srcs, residual=residual, residual_out=residual, weight=weight)
        assert_close(out, ref_out, dtype, name="out")
        assert_close(residual, ref_h, dtype, name="residual_out (in place)")


@pytest.mark.gpu
def test_gpu_wait_for_late_sources():
    """Each source's chunks land late through the copy engine (no SM needed) from another stream,
    each followed by its (source, chunk) flag; sources start as NaN, so an early read shows."""
    p, m, n, chunks = 4, 4096, 8192, 4
    host = [s.pin_memory() for s in _rows(p, m, n, torch.bfloat16, seed=21)]
    srcs = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(p)]
    flags = torch.zeros(p, chunks, dtype=torch.int32, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    one = torch.ones(1, dtype=torch.int32).pin_memory()
    rows = m // chunks
    launch = dict(num_chunks=chunks, chunk_order=[1, 0, 3, 2], wait_flags=flags, status=status)
    flags.fill_(1)
    multi_source_reduce(srcs, **launch)  # compile first: the real launch must be instant
    flags.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the only kernel on this stream: the rest are copies
        for c in (1, 0, 3, 2):
            for q in range(p):
                srcs[q][c * rows:(c + 1) * rows].copy_(host[q][c * rows:(c + 1) * rows], non_blocking=True)
                flags[q, c:c + 1].copy_(one, non_blocking=True)
    out = multi_source_reduce(srcs, **launch)
    assert not side.query(), "the sources had landed before the kernel was queued: nothing was tested"
    torch.cuda.synchronize()
    assert status.item() == 0
    assert_close(out, reduce_ref(host)[0], torch.bfloat16)


@pytest.mark.gpu
def test_gpu_wait_timeout_does_not_hang():
    srcs = _rows(2, 64, 256, torch.float16, seed=22, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    flags = torch.ones(2, 2, dtype=torch.int32, device="cuda")
    flags[0, 1] = 0
    multi_source_reduce(srcs, num_chunks=2, wait_flags=flags, timeout_ms=50, status=status)
    torch.cuda.synchronize()
    assert status.item() == 1 + 0 * 2 + 1
