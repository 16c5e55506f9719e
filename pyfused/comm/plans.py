"""The plan cache: the steady-state lookup of an op call.

An op call that passed the cross-rank check (pyfused/comm/validate.py) leaves its *plan* here: the
group it runs on, the agreed method and whatever else the call decided. A later call with the same
op, group, method, scalar arguments and tensor metadata (shape, dtype, layout, device,
requires_grad, and whether grad mode is on) finds that plan with ``lookup`` and runs it: no
signature, no exchange, no method choice.

``lookup(op_code, group, method, *arguments)`` is one C++ call where ``pyfused._C`` is built
(csrc/plan_cache.cpp), so that a repeated call costs 1-2 microseconds of host time; without
``_C`` the same lookup is written in Python (a tuple key and a dictionary: a few microseconds).
Callers skip it under torch.compile: Dynamo cannot trace a C function.
``group=None`` is resolved to the default group at every lookup, so a re-initialised default group
never finds the plans of the old one.

The cache accelerates validation's own record of seen calls and never decides more than it: a plan
is stored only after ``validate`` accepted and remembered the call, the key is at least as fine as
validate's, and ``validate`` clears both together (a mode change, ``forget_seen``). Entries may be
dropped at any time (the C++ table starts over when full): a miss only takes the slower path.
Calls with arguments the key cannot describe (a tensor subclass such as DTensor, an unhashable or
unusual scalar) always take that path; so does, in C++, which keys a group by identity, a group
that is a new object at every call (a ``(mesh, dim)`` tuple built in the call).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Hashable, List, Optional

import torch
import torch.distributed as dist

# The methods a key may name; any other ``method=`` is never cached (it is refused anyway).
CACHEABLE_METHODS = ("auto", "unfused", "decomposed", "fused")
_MAX_ENTRIES = 4096

_table: Dict[Hashable, Any] = {}  # the Python implementation's entries


def _default_group():
    return dist.group.WORLD if dist.is_available() else None


def _argument_key(arg) -> Optional[tuple]:
    if arg is None:
        return (None,)
    kind = type(arg)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return (arg.shape, arg.dtype, arg.layout, arg.device, arg.requires_grad)
    if kind is bool or kind is int and -(1 << 63) <= arg < 1 << 63:  # C++ keys hold int64
        return (kind, arg)
    if kind is float:
        return (float, arg.hex()) if arg == 0.0 else (float, arg)  # -0.0 and 0.0 differ
    return None


def _python_key(op_code: int, group, method, arguments) -> Optional[tuple]:
    if type(op_code) is not int or method not in CACHEABLE_METHODS:
        return None
    key = [op_code, _default_group() if group is None else group, method, torch.is_grad_enabled()]
    for arg in arguments:
        part = _argument_key(arg)
        if part is None:
            return None
        key += part
    return tuple(key)


def _python_lookup(op_code: int, group, method, *arguments):
    key = _python_key(op_code, group, method, arguments)
    try:
        return None if key is None else _table.get(key)
    except TypeError:  # an unhashable group
        return None


def _python_store(plan, op_code: int, group, method, *arguments) -> bool:
    key = _python_key(op_code, group, method, arguments)
    if key is None:
        return False
    if len(_table) >= _MAX_ENTRIES:
        _table.clear()
    try:
        _table[key] = plan
    except TypeError:
        return False
    return True


def _python_clear() -> None:
    _table.clear()


def _python_count() -> int:
    return len(_table)


def _bind():
    """The C++ functions where ``pyfused._C`` loads, else the Python ones; and their name."""
    from .. import _ext

    ext = _ext.load()
    if ext is not None and hasattr(ext, "plan_lookup"):
        ext.plan_configure(dist.group if dist.is_available() else None)
        return ext.plan_lookup, ext.plan_store, ext.plan_clear, ext.plan_count, "C++ (pyfused._C)"
    return _python_lookup, _python_store, _python_clear, _python_count, "Python (pyfused._C not built)"


_found, store, clear, count, IMPLEMENTATION = _bind()
lookup = _found  # what the ops call: ``_found`` itself, or a wrapper while hits are observed
_hit_callbacks: List[Callable[[Any], None]] = []


def _observed_lookup(op_code: int, group, method, *arguments):
    plan = _found(op_code, group, method, *arguments)
    if plan is not None:
        for callback in tuple(_hit_callbacks):
            callback(plan)
    return plan


@contextlib.contextmanager
def observe_hits(callback: Callable[[Any], None]):
    """Within the block, ``callback(plan)`` runs for every plan ``lookup`` finds. Outside such
    blocks ``lookup`` is the bare lookup: observing costs nothing when unused."""
    global lookup
    _hit_callbacks.append(callback)
    lookup = _observed_lookup
    try:
        yield
    finally:
        _hit_callbacks.remove(callback)
        if not _hit_callbacks:
            lookup = _found


def use_python_implementation(python: bool = True) -> None:
    """Switch to the Python implementation (``python=True``) or back to the best one: for tests and
    for measuring what the C++ lookup saves. Forgets every plan."""
    global _found, lookup, store, clear, count, IMPLEMENTATION
    clear()
    if python:
        _found, store, clear, count = _python_lookup, _python_store, _python_clear, _python_count
        IMPLEMENTATION = "Python (selected)"
    else:
        _found, store, clear, count, IMPLEMENTATION = _bind()
    lookup = _observed_lookup if _hit_callbacks else _found
