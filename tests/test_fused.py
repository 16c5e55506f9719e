"""The fused method's kernels and schedules.

On CPU they run as CPU models across real processes: symmetric buffers in host shared memory
(backend "host-shm"), the CPU kernels of pyfused::all_reduce_rows / symm_barrier (the same grid,
row -> block map and barriers as the CUDA kernel, blocks run in order, so a block reading rows
another block wrote would read them too early), the signal-flag ops and the Triton interpreter. The
GPU tests of the same paths are in tests/test_fused_gpu.py.
"""
import os

import pytest
import torch

from tests.utils import assert_close, rank_tensors

TIMEOUT = 120
ONE_SHOT, TWO_SHOT = 0, 1
# (rows, cols): a single element; odd sizes; more rows than the 64 blocks (several rows per block,
# two-shot segments of 33 rows at world 4); fewer rows than ranks (empty two-shot segments).
ROW_SHAPES = [(1, 1), (7, 17), (130, 33), (3, 64)]
EPILOGUES = ["none", "residual", "residual+norm", "norm"]


def _expected_h(xs, residual, dtype):
    """h exactly as the kernels compute it: fp32 sum in rank order (+ residual), rounded once."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        acc += x.float()
    if residual is not None:
        acc += residual.float()
    return acc.to(dtype)


def _all_reduce_rows_cases(rank, world, dtypes):
    """Every (algo, dtype, shape, epilogue) on this rank; returns the outputs for cross-rank and
    cross-algorithm comparison in the parent."""
    from pyfused.comm.symmetric import free_all
    from pyfused.fused.all_reduce import all_reduce_rows

    results = {}
    for dtype in dtypes:
        for si, (rows, cols) in enumerate(ROW_SHAPES):
            xs = rank_tensors(100 + si, world, (rows, cols), dtype)
            residual = rank_tensors(200 + si, 1, (rows, cols), dtype)[0]
            weight = rank_tensors(300 + si, 1, (cols,), torch.float32)[0].abs() + 0.5
            for epi in EPILOGUES:
                res = residual if "residual" in epi else None
                w = weight if "norm" in epi else None
                h = _expected_h(xs, res, dtype)
                for algo in (ONE_SHOT, TWO_SHOT):
                    res_out = torch.full((rows, cols), float("nan"), dtype=dtype) if res is not None else None
                    out = all_reduce_rows(xs[rank], None, out=None, residual=res, residual_out=res_out,
                                          weight=w, eps=1e-5, algo=algo, backend="host-shm")
                    what = f"{dtype} {rows}x{cols} {epi} algo {algo} rank {rank}/{world}"
                    if res_out is not None:
                        assert torch.equal(res_out, h), f"{what}: residual_out is not the exact h"
                    if w is None:
                        assert torch.equal(out, h), f"{what}: out is not the exact h"
                    else:
                        hd = h.double()
                        ref = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
                        assert_close(out, ref, dtype, what)
                    results[(str(dtype), si, epi, algo)] = out
    assert free_all() >= 1
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce_rows_cpu_model(ranks, world):
    """One-shot and two-shot, every epilogue, odd shapes: exact h, norm within tolerance, and the
    same bits on every rank and for both algorithms."""
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if world in (1, 3) else [])
    per_rank = ranks.run(world, _all_reduce_rows_cases, dtypes, timeout=300)
    for key, out in per_rank[0].items():
        for r in range(1, world):
            assert torch.equal(per_rank[r][key], out), f"rank {r} differs from rank 0 at {key}"
        if key[3] == TWO_SHOT:
            assert torch.equal(per_rank[0][key[:3] + (ONE_SHOT,)], out), f"one-shot != two-shot at {key}"


def _fused_ops(rank, world, dtype):
    """The four fused implementations over host-shm, interleaved, twice on one set of buffers with
    two shapes of one size class (so buffers, their per-shape views, pointer tables and epochs are
    reused across calls and ops), then again once the buffers were freed."""
    from pyfused.comm.symmetric import free_all, live_buffers

    for it in range(2):
        _fused_round(rank, world, dtype, it)
    assert all(b.epoch >= 2 for b in live_buffers())
    free_all()
    _fused_round(rank, world, dtype, 2)
    free_all()
    return True


def _fused_round(rank, world, dtype, it):
    from pyfused.fused.all_reduce import fused_all_reduce_add_rmsnorm, fused_matmul_all_reduce
    from pyfused.fused.gemm_collectives import fused_all_gather_matmul, fused_matmul_reduce_scatter
    from pyfused.ops import (
        all_gather_matmul_ref,
        all_reduce_add_rmsnorm_ref,
        matmul_all_reduce_ref,
        matmul_reduce_scatter_ref,
    )

    kw = dict(backend="host-shm")
    seed, rows = 10 * it, 3 + 2 * (it % 2)
    a_all = rank_tensors(seed, world, (rows, 16), dtype)
    b_all = rank_tensors(seed + 1, world, (16, 8), dtype, scale=0.25)
    out, gathered = fused_all_gather_matmul(a_all[rank], b_all[rank], None, True, **kw)
    assert_close(out, all_gather_matmul_ref(a_all, b_all[rank]), dtype, f"all_gather_matmul it {it}")
    assert torch.equal(gathered, torch.cat(a_all)), "gathered input"

    m_all = rank_tensors(seed + 2, world, ((rows - 1) * world, 16), dtype)
    out = fused_matmul_reduce_scatter(m_all[rank], b_all[rank], None, **kw)
    assert_close(out, matmul_reduce_scatter_ref(m_all, b_all, rank), dtype,
                 f"matmul_reduce_scatter it {it}")

    out = fused_matmul_all_reduce(m_all[rank], b_all[rank], None, **kw)
    assert_close(out, matmul_all_reduce_ref(m_all, b_all), dtype, f"matmul_all_reduce it {it}")

    x_all = rank_tensors(seed + 3, world, (5, 24), dtype)
    res = rank_tensors(seed + 4, 1, (5, 24), dtype)[0]
    w = rank_tensors(seed + 5, 1, (24,), dtype)[0]
    normed, new_res = fused_all_reduce_add_rmsnorm(x_all[rank], res, w, 1e-6, None, **kw)
    ref_normed, ref_res = all_reduce_add_rmsnorm_ref(x_all, res, w, 1e-6)
    assert_close(new_res, ref_res, dtype, f"new_residual it {it}")
    assert_close(normed, ref_normed, dtype, f"normed it {it}")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_schedules_cpu_model(ranks, world, dtype):
    assert all(ranks.run(world, _fused_ops, dtype, timeout=300))


def _stale_epoch(rank, world):
    """Rank 1 runs the all-reduce with an older epoch than rank 0: both must fail, not hang."""
    from pyfused.comm.symmetric import SymmetricBuffer

    buf = SymmetricBuffer.get(None, 1 << 17, "cpu", backend="host-shm")
    out = torch.empty(2, 4)
    buf.local_view((2, 4), torch.float32).fill_(1.0)
    error = None
    try:
        torch.ops.pyfused.all_reduce_rows(buf.buffer_ptrs_dev, buf.pad_ptrs_dev, out, None, None, None,
                                          1e-6, rank, 5 if rank == 0 else 3, ONE_SHOT, 300)
    except RuntimeError as e:
        error = str(e)
    buf.free()
    return error


def test_fused_refuses_graph_capture_and_outputs_in_the_buffer(monkeypatch):
    """Hazards of the CUDA path, guarded here on CPU (world 1, host-shm):
    (1) a CUDA graph would replay one host-side epoch forever, so the fused schedules refuse to be
    captured (and the ops carry the cudagraph_unsafe tag, so torch.compile's graphs leave them out);
    (2) an output inside this rank's symmetric buffer races with the peers reading it."""
    from pyfused.comm.symmetric import SymmetricBuffer, free_all
    from pyfused.fused import config
    from pyfused.fused.all_reduce import all_reduce_rows
    from pyfused.fused.gemm_collectives import fused_all_gather_matmul, fused_matmul_reduce_scatter
    from pyfused.ops.registry import OPS

    for name in OPS:
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.pyfused, name).default.tags, name

    x, b = torch.randn(4, 8), torch.randn(8, 3)
    kw = dict(backend="host-shm")
    monkeypatch.setattr(config, "capturing", lambda device: True)
    for call in (lambda: all_reduce_rows(x, None, **kw),
                 lambda: fused_all_gather_matmul(x, b, None, False, **kw),
                 lambda: fused_matmul_reduce_scatter(x, b, None, **kw)):
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            call()
    monkeypatch.undo()

    try:
        buf = SymmetricBuffer.get(None, x.numel() * x.element_size(), x.device, "host-shm")
        inside = buf.local_view((4, 8), torch.float32)
        with pytest.raises(ValueError, match="out overlaps this rank's symmetric buffer"):
            all_reduce_rows(x, None, out=inside, **kw)
        with pytest.raises(ValueError, match="residual_out overlaps"):
            all_reduce_rows(x, None, residual=torch.zeros(4, 8), residual_out=inside, **kw)
        assert torch.equal(all_reduce_rows(x, None, **kw), x)  # world 1: the sum is x itself
    finally:
        free_all()

def test_a_peer_with_another_epoch_fails_instead_of_hanging(ranks):
    errors = ranks.run(2, _stale_epoch, timeout=TIMEOUT)
    assert all(e is not None and "did not reach the barrier" in e for e in errors), errors
    assert "expected >= 5" in errors[0] and "expected >= 3" in errors[1], errors


def _lonely_barrier(rank, world):
    from pyfused.comm.symmetric import CHAN_ENTRY, SymmetricBuffer

    buf = SymmetricBuffer.get(None, 1 << 17, "cpu", backend="host-shm")
    error = None
    if rank == 0:
        try:
            torch.ops.pyfused.symm_barrier(buf.pad_ptrs_dev, 0, CHAN_ENTRY, 0, 1, 200)
        except RuntimeError as e:
            error = str(e)
    buf.free()
    return error


def test_barrier_times_out_with_the_missing_rank(ranks):
    errors = ranks.run(2, _lonely_barrier, timeout=TIMEOUT)
    assert errors[1] is None and errors[0] is not None, errors
    assert "rank 0 waited" in errors[0] and "for rank 1 at channel 3 block 0" in errors[0]


def test_kernel_argument_checks_and_meta():
    """The checks every backend shares (CPU and Meta here), with messages that say what is wrong."""
    ext = pytest.importorskip("pyfused._C")
    del ext
    op = torch.ops.pyfused.all_reduce_rows
    ptrs = torch.zeros(2, dtype=torch.int64)
    out = torch.empty(4, 8)
    cases = [
        ((ptrs, ptrs, out.double(), None, None, None, 1e-6, 0, 1, 0), "must be float32, float16 or bfloat16"),
        ((ptrs, ptrs, out, None, None, None, 1e-6, 2, 1, 0), "rank 2 is not in [0, 2)"),
        ((ptrs, ptrs[:1], out, None, None, None, 1e-6, 0, 1, 0), "one entry per rank"),
        ((torch.zeros(9, dtype=torch.int64),) * 2 + (out, None, None, None, 1e-6, 0, 1, 0),
         "1 to 8 addresses"),
        ((ptrs, ptrs, out, torch.empty(4, 7), None, None, 1e-6, 0, 1, 0), "residual must be a contiguous"),
        ((ptrs, ptrs, out, None, None, torch.empty(8, dtype=torch.float16), 1e-6, 0, 1, 0), "weight must be"),
        ((ptrs, ptrs, out, None, None, None, 1e-6, 0, 1, 2), "algo must be 0"),
        ((ptrs, ptrs, out, None, None, None, 1e-6, 0, 0, 0), "epoch must be in [1, 2^31)"),
    ]
    for args, text in cases:
        for device in ("cpu", "meta"):
            moved = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
            with pytest.raises(RuntimeError, match=__import__("re").escape(text)):
                op(*moved)
    # a valid call on meta tensors checks and returns (nothing to compute)
    op(ptrs.to("meta"), ptrs.to("meta"), out.to("meta"), None, out.to("meta"), torch.empty(8, device="meta"),
       1e-6, 1, 1, 1)
    with pytest.raises(RuntimeError, match="channel must be in"):
        torch.ops.pyfused.symm_barrier(ptrs, 0, 9, 0, 1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            torch.ops.pyfused.ipc_alloc(1024, 0)


def test_timeout_watch_reports_a_wait_that_gave_up():
    """The deferred check of the Triton kernels' status words (CUDA-only in use; stub events here)."""
    from pyfused.fused.gemm_collectives import TimeoutWatch
    from pyfused.kernels.reduce_launch import WaitTimeout

    class Done:
        def query(self):
            return True

        def synchronize(self):
            pass

    class Running(Done):
        def query(self):
            return False

    watch = TimeoutWatch()
    watch.pending.append((Done(), torch.tensor([0], dtype=torch.int32), str, "ok call"))
    watch.pending.append((Running(), torch.tensor([3], dtype=torch.int32), lambda c: f"chunk {c - 1}",
                          "late call"))
    watch.check()  # the first is fine, the second has not finished: nothing raised, nothing waited for
    assert len(watch.pending) == 1
    with pytest.raises(WaitTimeout, match="late call: gave up waiting on chunk 2"):
        watch.check(sync=True)
    assert not watch.pending
    watch.watch(torch.zeros(1, dtype=torch.int32), str, "cpu")  # CPU launchers check themselves
    assert not watch.pending


def test_registry_stays_empty_where_fused_cannot_run():
    from pyfused.ops import _common, _fused
    from pyfused.ops.registry import OPS

    assert all(callable(OPS[name].fused_function()) for name in _fused.FUSED_OPS)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CPU verdict does not apply")
    ok, why = _fused.status("matmul_all_reduce", torch.float32)
    assert not ok and why == "no CUDA device is visible to torch"
    assert _fused.IMPLS == {}
    ok, why = _common.fused_status("all_reduce_add_rmsnorm", "cpu")
    assert not ok and "inputs are on cpu" in why
    assert _fused.status("nonexistent")[1] == "pyfused has no fused kernel for nonexistent"


# --- GPU -----------------------------------------------------------------------------------------

@pytest.mark.interpreter
def test_sanitizer_driver_runs_on_cpu():
    """benchmarks/sanitize_fused.py (run under compute-sanitizer by gpu_check.sh) checked here on
    CPU: every fused kernel on its shapes, 2 processes, exit status 0 and its success line."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "sanitize_fused.py"), "--cpu",
                          "--world", "2", "--iters", "1"], capture_output=True, text=True, timeout=300,
                         cwd=repo)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all kernels ran and matched" in out.stdout
    assert "Traceback" not in out.stderr, out.stderr


def test_fused_timeout_is_wall_clock(monkeypatch):
    """PYFUSED_FUSED_TIMEOUT_MS bounds every fused wait in milliseconds (the Triton kernels get it in
    ns, read against %globaltimer), 0 = forever, capped at 10^9 ms."""
    from pyfused.fused import config
    from pyfused.kernels.reduce_launch import timeout_ns

    monkeypatch.setenv("PYFUSED_FUSED_TIMEOUT_MS", "30000")
    assert timeout_ns(config.timeout_ms()) == 30 * 10**9
    monkeypatch.setenv("PYFUSED_FUSED_TIMEOUT_MS", "0")
    assert timeout_ns(config.timeout_ms()) == 2**62
    monkeypatch.setenv("PYFUSED_FUSED_TIMEOUT_MS", str(10**12))
    assert config.timeout_ms() == 10**9
    monkeypatch.delenv("PYFUSED_FUSED_TIMEOUT_MS")
    assert config.timeout_ms() == 60000
    with pytest.raises(ValueError, match="timeout_ms"):
        timeout_ns(-1)
