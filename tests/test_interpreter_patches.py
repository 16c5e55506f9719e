"""The Triton interpreter's workarounds for concurrent launches (pyfused/testing/interpreter.py).

Each workaround has a test that fails without it: two launches overlap in two threads, held at
known points by flags the kernels poll (a kernel records that it started, the main thread releases
it), so the overlap is certain, not a matter of timing. Plus: the patches check the internals they
replace, everything is undone on exit, and the library never imports the test bed.
"""
import ast
import functools
import threading
import time
from pathlib import Path

import pytest
import torch

import pyfused

pytestmark = pytest.mark.interpreter
SPINS = 1_000_000  # polls before a probe kernel gives up: far more than any release takes
HOST_WAIT_S = 120.0


@functools.lru_cache(maxsize=None)
def _kernels():
    """Probe kernels, defined after conftest set TRITON_INTERPRET."""
    import triton
    import triton.language as tl

    @triton.jit
    def hold_then_record(started_ptr, go_ptr, out_ptr, spins):
        """Program 0 says it started, polls ``go`` (acquire) until it is set, then records its
        program id and the grid size as seen after the wait; every program records them."""
        pid = tl.program_id(0)
        if pid == 0:
            tl.atomic_xchg(started_ptr, 1, sem="release")
            seen = tl.atomic_add(go_ptr, 0, sem="acquire")
            n = 0
            while (seen == 0) & (n < spins):
                seen = tl.atomic_add(go_ptr, 0, sem="acquire")
                n += 1
        tl.store(out_ptr + 2 * pid, tl.program_id(0))
        tl.store(out_ptr + 2 * pid + 1, tl.num_programs(0))

    @triton.jit
    def bf16_dot(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    return hold_then_record, bf16_dot


class _Held:
    """A launch of ``hold_then_record`` in a thread of its own, held until ``release()``."""

    def __init__(self, grid: int):
        kernel, _ = _kernels()
        self.started = torch.zeros(1, dtype=torch.int32)
        self.go = torch.zeros(1, dtype=torch.int32)
        self.out = torch.full((2 * grid,), -1, dtype=torch.int32)
        self.error = None

        def body():
            try:
                kernel[(grid,)](self.started, self.go, self.out, SPINS)
            except BaseException as e:  # reported by join()
                self.error = e

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + HOST_WAIT_S
        while int(self.started) == 0:
            assert time.monotonic() < deadline and self.thread.is_alive(), self.error
            time.sleep(0.001)

    def release(self):
        self.go.fill_(1)
        self.thread.join(HOST_WAIT_S)
        assert not self.thread.is_alive()
        return self.error, self.out.tolist()


@pytest.fixture
def patched():
    from pyfused.testing.interpreter import thread_safe_interpreter

    with thread_safe_interpreter():
        yield


def test_program_ids_are_per_thread(patched):
    """Workaround 1: a launch of 5 programs that runs while another of 2 waits does not change the
    waiting one's program id or grid size (without it: [4, 5, 1, 5])."""
    kernel, _ = _kernels()
    held = _Held(grid=2)
    other = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(10, dtype=torch.int32)
    kernel[(5,)](other, torch.ones(1, dtype=torch.int32), out, SPINS)
    error, seen = held.release()
    assert error is None and seen == [0, 2, 1, 2], (error, seen)
    assert out.tolist() == [v for p in range(5) for v in (p, 5)]


def test_language_patch_outlives_an_overlapping_launch(patched):
    """Workaround 2: launch A starts, launch B starts, A ends (the stock interpreter then restores
    triton.language) and B keeps polling: it must still work (without it: B fails in the next
    tl.atomic_add). Once no launch runs, triton.language is restored."""
    import triton.language as tl

    builtin = tl.atomic_add
    first = _Held(grid=1)
    second = _Held(grid=1)
    assert first.release() == (None, [0, 1])
    assert second.release() == (None, [0, 1])
    assert tl.atomic_add is builtin


def test_bf16_dot_multiplies_values(patched):
    """Workaround 3: a bf16 tl.dot equals the fp32 product of the same bf16 values."""
    _, kernel = _kernels()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    out = torch.empty(16, 16)
    kernel[(1,)](a, b, out, 16, 16, 32)
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_the_installed_triton_still_multiplies_bf16_bit_patterns():
    """Why workaround 3 exists (and the launcher's fp32 copies of bf16 operands on CPU): without
    it, this Triton's bf16 dot is wrong. If this fails, Triton fixed it: drop the workaround."""
    from pyfused.kernels.gemm_launch import interpreter_bf16_dot_problem
    from pyfused.testing.interpreter import thread_safe_interpreter

    assert "instead of 16" in (interpreter_bf16_dot_problem() or "")
    with thread_safe_interpreter():
        assert interpreter_bf16_dot_problem() is None


def test_observed_spins_reports_polls_of_unset_flags_only():
    """The harness's observer (it holds a rank back until its peers spin): a wait on a set flag
    is no spin; each repeated poll of an unset one is."""
    from pyfused.testing.interpreter import observed_spins

    kernel, _ = _kernels()
    spins = []
    with observed_spins(lambda: spins.append(1)):
        kernel[(2,)](torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     torch.zeros(4, dtype=torch.int32), SPINS)
        assert not spins
        kernel[(1,)](torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                     torch.zeros(2, dtype=torch.int32), 5)
    assert len(spins) == 5


def _triton_state():
    import triton.language as tl
    import triton.runtime.interpreter as interp

    return ({name: getattr(tl, name) for name in dir(tl)},
            {name: getattr(tl.tensor, name) for name in dir(tl.tensor)},
            dict(vars(interp.InterpreterBuilder)), interp.GridExecutor.__call__, interp._patch_lang)


def test_everything_is_undone_on_exit():
    """After the block Triton is as it was and launches are serialized again; the block is not
    re-entrant."""
    from pyfused.kernels import reduce_launch
    from pyfused.testing.interpreter import thread_safe_interpreter

    before = _triton_state()
    with thread_safe_interpreter():
        assert reduce_launch.interpreter_launches_concurrent()
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with thread_safe_interpreter():
                pass
        kernel, _ = _kernels()
        kernel[(2,)](torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     torch.zeros(4, dtype=torch.int32), SPINS)
    assert _triton_state() == before
    assert not reduce_launch.interpreter_launches_concurrent()
    assert reduce_launch.serialized(torch.device("cpu")) is reduce_launch._INTERPRETER_LOCK


@pytest.mark.parametrize("workaround", ["program_ids", "language", "bf16_dot", "observer"])
def test_moved_internals_fail_loudly(monkeypatch, workaround):
    """Each patch checks what it replaces and names the Triton version when it moved."""
    import triton.runtime.interpreter as interp

    from pyfused.testing import interpreter as patches

    if workaround == "program_ids":
        monkeypatch.setattr(interp.InterpreterBuilder, "set_grid_idx", lambda self, x, y, z: None)
        enter = patches.thread_local_program_ids
    elif workaround == "language":
        monkeypatch.delattr(interp, "_patch_lang")
        enter = patches.shared_language_patch
    elif workaround == "bf16_dot":
        monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", lambda self, a, b, d: None)
        enter = patches.widened_bf16_dot
    else:
        monkeypatch.setattr(interp.InterpreterBuilder, "create_atomic_rmw", lambda self, op: None)
        enter = lambda: patches.observed_spins(lambda: None)  # noqa: E731
    with pytest.raises(patches.InterpreterInternalsMoved, match=r"triton \d+\.\d+"):
        with enter():
            pass


def test_bf16_waiting_gemm_refused_where_concurrent_writers_need_the_patch():
    """Under concurrent launches a waiting bf16 GEMM cannot copy a at launch (peers still write
    it): without workaround 3 the launcher refuses it rather than multiply bit patterns."""
    from pyfused.kernels.gemm_launch import gemm
    from pyfused.kernels.reduce_launch import concurrent_interpreter_launches

    a = torch.ones(4, 8, dtype=torch.bfloat16)
    with concurrent_interpreter_launches():
        with pytest.raises(RuntimeError, match="bf16 tl.dot computes"):
            gemm(a, a.t(), wait_flags=torch.ones(1, dtype=torch.int32))


def test_the_library_never_imports_the_test_bed():
    root = Path(pyfused.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if "testing" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            level = getattr(node, "level", 0)
            if any(n.startswith("pyfused.testing") or (level and n.startswith("testing"))
                   for n in names):
                offenders.append(str(path.relative_to(root)))
    assert not offenders, f"library modules import pyfused.testing: {offenders}"
