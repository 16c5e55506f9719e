"""Exit: let the process groups that ``destroy_process_group`` removed be destroyed while the
interpreter still runs.

A group's backend joins its worker threads when the group is destroyed, which happens when the
last Python reference to it goes. A group still referenced when the interpreter finalizes is
destroyed during finalization: a gloo worker that then drops a finished collective's last
reference to a Python tensor cannot take the GIL, and the process aborts ("terminate called
without an active exception") after a clean run. Under load (CI's two cores) that race is lost
now and then.

``release_destroyed_groups`` runs at exit, once torch holds no group (``destroy_process_group``
was called; while torch still holds groups they live until torch lets them go). It drops what
still refers to them:

* pyfused's records keyed by group: validation's seen calls and the plan cache, the host layouts'
  meshes;
* garbage cycles through dead modules and optimizers;
* torch's own: the default arguments of ``torch.distributed.nn.functional`` (``group=group.WORLD``,
  evaluated when the module is imported, which torch does lazily, e.g. at the first call of any
  ``torch.library`` op: with a default group alive by then, they keep it), and the caches of
  DTensor and the device mesh (sharding propagation, redistribution plans, mesh topology: their
  keys hold device meshes, a mesh its groups).
"""
from __future__ import annotations

import atexit
import functools
import gc
import sys
import types

import torch
import torch.distributed as dist

from .topology import forget_layouts
from .validate import forget_seen


def release_destroyed_groups() -> None:
    """Drop every reference pyfused and torch's caches hold to destroyed process groups and
    collect the garbage cycles that point at them (see the module docstring). Run at exit; a no-op
    while the default group exists."""
    if not dist.is_available() or dist.is_initialized():
        return
    forget_seen()
    forget_layouts()
    _release_torch_references()
    gc.collect()


def _release_torch_references() -> None:
    """In every loaded torch.distributed module: replace the process groups its functions hold as
    default arguments with ``None`` (which means the same, the default group) and clear its
    memoized functions (DTensor's redistribution plans, a mesh's topology: they hold device
    meshes); then DTensor's sharding-propagation and redistribution-planner caches."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            members = vars(value).values() if type(value) is type else ()
            for fn in (value, *members):
                fn = getattr(fn, "__func__", fn) if type(fn) in (staticmethod, classmethod) else fn
                if type(fn) is _LRU_CACHE:
                    fn.cache_clear()
                elif type(fn) is types.FunctionType and fn.__defaults__ and any(
                        isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
                    fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                            for d in fn.__defaults__)
    # DTensor's other caches, where DTensor was used (torch internals: skipped where this torch
    # lacks them; torch.distributed.tensor.debug clears the same but takes a second to import)
    api = sys.modules.get("torch.distributed.tensor._api")
    dispatcher = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    for clear in (getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None),
                  getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
                  if api is not None else None,
                  getattr(redistribute, "clear_redistribute_planner_cache", None)):
        if clear is not None:
            clear()


_LRU_CACHE = type(functools.lru_cache(None)(lambda: None))


atexit.register(release_destroyed_groups)
