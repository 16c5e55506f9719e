"""The Triton interpreter made safe for launches from several threads at once.

The stock interpreter (``TRITON_INTERPRET=1``) assumes one launch at a time: pyfused's launchers
serialize CPU launches (``pyfused.kernels.reduce_launch.serialized``), so a kernel that waits on a
flag can only see flags set before it started. ``thread_safe_interpreter()`` applies three
workarounds and lets the launchers run concurrently
(``pyfused.kernels.reduce_launch.concurrent_interpreter_launches``), so W threads can each launch
the project's kernels while the others' set the flags they wait on -- the real cross-rank protocol
on CPU (``pyfused.testing.threaded_ranks``).

The workarounds are for ``triton/runtime/interpreter.py`` of triton 3.8.0 (installed in CI) and
3.6.0 (the GPU machines' version; the tests pass with it, torch 2.11 and numpy 2.3). Each checks
the attribute it replaces and raises ``InterpreterInternalsMoved`` if Triton's internals differ;
each has a test that fails without it (``tests/test_interpreter_patches.py``):

1. Program ids. The grid index and grid size of the running launch live in attributes of one
   module-level ``InterpreterBuilder`` (``interpreter_builder.grid_idx`` / ``grid_dim``), which
   ``tl.program_id`` / ``tl.num_programs`` read: another thread's launch moves them under a running
   one. Here they are per thread (class properties backed by a ``threading.local``).
2. The language patch. A launch swaps ``triton.language``'s builtins for interpreter versions on
   entry (``_patch_lang``) and swaps them back on exit (``_LangPatchScope.restore``), also while
   another thread's launch still runs, which then calls the compiled-mode builtins and fails. Here
   the swaps are serialized and undone only when the last running launch ends.
3. bf16 dots. bf16 values are stored as uint16 in the interpreter and ``InterpreterBuilder.
   create_dot`` hands them to ``np.matmul`` as integers, so a bf16 ``tl.dot`` multiplies raw bit
   patterns (results ~1e11). Here bf16 operands are widened to fp32 first (exact: the fp32 products
   of bf16 values are exact, and the sum is accumulated in fp32 as on tensor cores).

Not worked around, because the kernels do not need it: inline assembly does not run in the
interpreter, so waits there count polls (``WALL_CLOCK=False``, which the launchers choose on CPU).
Atomics with acquire/release semantics work as they are.

Besides the workarounds, ``observed_spins`` reports a kernel polling a flag that is not set yet
(the threaded-rank harness holds a rank back until its peers do).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Callable, Iterator, List

GRID_ATTRIBUTES = ("grid_idx", "grid_dim")
DOT_PARAMETERS = ["self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"]
ATOMIC_RMW_PARAMETERS = ["self", "rmwOp", "ptr", "val", "mask", "sem", "scope"]


class InterpreterInternalsMoved(RuntimeError):
    """This Triton's interpreter is not built the way the workarounds expect."""


def _interpreter():
    import triton.runtime.interpreter as interp

    return interp


def _moved(what: str) -> InterpreterInternalsMoved:
    import triton

    return InterpreterInternalsMoved(
        f"triton {triton.__version__}: {what}. pyfused/testing/interpreter.py patches "
        f"triton/runtime/interpreter.py as in triton 3.6 and 3.8; read this version's source and "
        f"adapt the workaround (or drop it if this Triton no longer needs it)")


def _require(obj, name: str, kind: str = "attribute"):
    if not hasattr(obj, name):
        raise _moved(f"{getattr(obj, '__name__', obj)!s} has no {kind} {name!r}")
    return getattr(obj, name)


# -- 1. program ids per thread ---------------------------------------------------------------------

class _Grid(threading.local):
    grid_idx = None
    grid_dim = None


def _check_grid_state(interp) -> None:
    builder_cls = _require(interp, "InterpreterBuilder")
    builder = _require(interp, "interpreter_builder")
    for method in ("set_grid_idx", "set_grid_dim", "create_get_program_id",
                   "create_get_num_programs"):
        src = inspect.getsource(_require(builder_cls, method, "method"))
        if not any(f"self.{attr}" in src for attr in GRID_ATTRIBUTES):
            raise _moved(f"InterpreterBuilder.{method} no longer keeps the grid in "
                         f"self.grid_idx / self.grid_dim")
    if not isinstance(builder, builder_cls):
        raise _moved("interpreter_builder is not an InterpreterBuilder")


@contextlib.contextmanager
def thread_local_program_ids() -> Iterator[None]:
    """Workaround 1 (module docstring): the builder's grid attributes, one copy per thread."""
    interp = _interpreter()
    _check_grid_state(interp)
    cls, builder = interp.InterpreterBuilder, interp.interpreter_builder
    grid = _Grid()
    saved = {a: builder.__dict__.pop(a) for a in GRID_ATTRIBUTES if a in builder.__dict__}
    for attr in GRID_ATTRIBUTES:
        setattr(cls, attr, property(lambda self, a=attr: getattr(grid, a),
                                    lambda self, value, a=attr: setattr(grid, a, value)))
    try:
        yield
    finally:
        for attr in GRID_ATTRIBUTES:
            delattr(cls, attr)
        builder.__dict__.update(saved)


# -- 2. one language patch while any launch runs ---------------------------------------------------

class _DeferredScope:
    """What a launch gets back from ``_patch_lang``: its ``restore`` waits for the last launch."""

    def restore(self) -> None:
        pass


@contextlib.contextmanager
def shared_language_patch() -> Iterator[None]:
    """Workaround 2 (module docstring): patch ``triton.language`` one launch at a time, and undo
    every patch, newest first, when no launch runs any more."""
    interp = _interpreter()
    executor = _require(interp, "GridExecutor")
    call = _require(executor, "__call__", "method")
    patch_lang = _require(interp, "_patch_lang", "function")
    scope_cls = _require(interp, "_LangPatchScope")
    _require(scope_cls, "restore", "method")
    if "patch_scope.restore()" not in inspect.getsource(call) or \
            "_patch_lang(" not in inspect.getsource(call):
        raise _moved("GridExecutor.__call__ no longer patches the language through _patch_lang "
                     "and restores it with patch_scope.restore()")
    lock = threading.Lock()
    scopes: List[object] = []  # in the order they patched
    running = [0]

    def serialized_patch(fn):
        with lock:  # one patcher at a time: each scope's originals are what the previous one left
            scopes.append(patch_lang(fn))
        return _DeferredScope()

    def counted_call(self, *args, **kwargs):
        with lock:
            running[0] += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1
                if running[0] == 0:
                    while scopes:
                        scopes.pop().restore()

    interp._patch_lang = serialized_patch
    executor.__call__ = counted_call
    try:
        yield
    finally:
        executor.__call__ = call
        interp._patch_lang = patch_lang
        while scopes:  # a launch still running when the harness ends: leave Triton as it was
            scopes.pop().restore()


# -- 3. bf16 dots in fp32 --------------------------------------------------------------------------

@contextlib.contextmanager
def widened_bf16_dot() -> Iterator[None]:
    """Workaround 3 (module docstring): ``tl.dot`` of bf16 operands computed from their fp32
    values."""
    import triton.language as tl

    interp = _interpreter()
    cls = interp.InterpreterBuilder
    dot = _require(cls, "create_dot", "method")
    _require(cls, "create_fp_ext", "method")
    if list(inspect.signature(dot).parameters) != DOT_PARAMETERS:
        raise _moved(f"InterpreterBuilder.create_dot{inspect.signature(dot)} changed its "
                     f"parameters (expected {DOT_PARAMETERS})")

    def widen(builder, handle):
        if handle.dtype == tl.bfloat16:
            return builder.create_fp_ext(handle, tl.float32)
        return handle

    def dot_of_fp32_values(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(self, a), widen(self, b), d, input_precision,
                   max_num_imprecise_acc)

    cls.create_dot = dot_of_fp32_values
    try:
        yield
    finally:
        cls.create_dot = dot


# -- an observer: kernels spinning on a flag -------------------------------------------------------

@contextlib.contextmanager
def observed_spins(on_spin: Callable[[], None]) -> Iterator[None]:
    """Inside the block, ``on_spin()`` runs in the launching thread whenever one of its kernels
    makes two atomics in a row on one address, both with acquire semantics: a poll of a flag that
    was not set at the previous poll. (Each wait of pyfused/kernels/gemm.py's ``wait_flag`` starts
    with a relaxed read of the status word, so consecutive waits on one flag that is set do not
    count.)"""
    interp = _interpreter()
    cls = _require(interp, "InterpreterBuilder")
    rmw = _require(cls, "create_atomic_rmw", "method")
    acquire = _require(_require(_require(interp, "_ir", "module"), "MEM_SEMANTIC"), "ACQUIRE")
    if list(inspect.signature(rmw).parameters) != ATOMIC_RMW_PARAMETERS:
        raise _moved(f"InterpreterBuilder.create_atomic_rmw{inspect.signature(rmw)} changed its "
                     f"parameters (expected {ATOMIC_RMW_PARAMETERS})")
    last = threading.local()

    def observed(self, rmwOp, ptr, val, mask, sem, scope):
        key = ptr.data.tobytes() if sem == acquire else None
        if key is not None and getattr(last, "key", None) == key:
            on_spin()
        last.key = key
        return rmw(self, rmwOp, ptr, val, mask, sem, scope)

    cls.create_atomic_rmw = observed
    try:
        yield
    finally:
        cls.create_atomic_rmw = rmw


# -- all three -------------------------------------------------------------------------------------

WORKAROUNDS: List[Callable[[], contextlib.AbstractContextManager]] = [
    thread_local_program_ids, shared_language_patch, widened_bf16_dot,
]
_active = threading.Lock()


@contextlib.contextmanager
def thread_safe_interpreter() -> Iterator[None]:
    """Inside the block, interpreted launches may run from several threads at once (all three
    workarounds applied, the launchers' serialization lifted); everything is undone on exit. Not
    re-entrant: one harness at a time."""
    from pyfused.kernels.reduce_launch import concurrent_interpreter_launches

    if not _active.acquire(blocking=False):
        raise RuntimeError("thread_safe_interpreter() is already active (it is not re-entrant)")
    try:
        with contextlib.ExitStack() as stack:
            for workaround in WORKAROUNDS:
                stack.enter_context(workaround())
            stack.enter_context(concurrent_interpreter_launches())
            yield
    finally:
        _active.release()
