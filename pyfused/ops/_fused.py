"""The fused (symmetric-memory) implementations of the ops, behind capability probes.

``IMPLS`` is filled from the op registry (pyfused/ops/registry.py: each op's ``fused`` names its
implementation in ``pyfused.fused``) only once ``local_probe`` has passed in this process:
CUDA is usable, pyfused._C is loaded and has the symmetric-memory kernels, the GPU is sm_80 or newer,
Triton compiles for it (not the interpreter), and a symmetric-memory backend serves the device.
``status(op, dtype)`` is that probe plus "this op has a fused kernel for this dtype"; it needs no
collective and is what every rank puts into the validation exchange (``_common.prepare``).

Whether the *group* can map its buffers is a collective question, answered on every rank at the
same point (after the ranks agreed on the method), the same way everywhere, and cached per group:
  * ``host_span`` first: a group whose ranks are on several hosts (pyfused.comm.host_layout: one
    gather of host names the first time) cannot share memory, whatever its devices; the reason
    names the hosts. It comes before the local probe's reason, so a group that spans hosts is
    refused for that on every machine, GPU or not;
  * ``ensure_group`` then sets up the smallest symmetric buffer (peer access, the rendezvous
    working, at most MAX_WORLD ranks; pyfused/comm/symmetric.py agrees on every failure), once
    per (group, device), so a group that failed reports the same reason on later calls.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Tuple

import torch

from ._signature import MethodUnavailable
from .registry import FUSED_OPS, OPS

IMPLS: Dict[str, Callable] = {}
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)

_local: Optional[Tuple[bool, str]] = None
_groups: Dict[Tuple[str, str], Tuple[bool, str]] = {}


def _probe() -> Tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    from .. import _ext

    if _ext.load() is None:
        return False, f"the CUDA extension pyfused._C is not available ({_ext.load_error()})"
    if not hasattr(torch.ops.pyfused, "all_reduce_rows"):
        return False, ("pyfused._C was built without the symmetric-memory kernels (csrc/allreduce*.cpp/.cu); "
                       f"rebuild with `{_ext.REBUILD_HINT}`")
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return False, f"the GPU is sm_{cap[0]}{cap[1]}; the fused kernels need sm_80 or newer"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False, "TRITON_INTERPRET is set: the fused GEMMs need Triton compiling for the GPU"
    try:
        import triton  # noqa: F401  (is it installed?)
    except ImportError as e:
        return False, f"Triton is not importable ({e})"
    from ..comm.symmetric import check_layout, symmetric_status

    ok, why = symmetric_status(torch.device("cuda", torch.cuda.current_device()))
    if not ok:
        return False, f"symmetric memory is unavailable: {why}"
    try:
        check_layout()
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def local_probe() -> Tuple[bool, str]:
    """(ok, reason) for this process, probed once; on success the implementations are registered."""
    global _local
    if _local is None:
        _local = _probe()
        if _local[0]:
            IMPLS.update({name: OPS[name].fused_function() for name in FUSED_OPS})
    return _local


def status(op: str, dtype: Optional[torch.dtype] = None, pg=None) -> Tuple[bool, str]:
    """Whether ``op`` can run fused in this process (no collective), and if not, why."""
    if op not in FUSED_OPS:
        return False, f"pyfused has no fused kernel for {op}"
    ok, why = local_probe()
    if not ok:
        return False, why
    if op not in IMPLS:
        return False, f"this build of pyfused has no fused kernel for {op}"
    if dtype is not None and dtype not in FUSED_DTYPES:
        return False, f"the fused kernels serve float32, float16 and bfloat16, not {dtype}"
    if pg is not None:
        cached = _groups.get(_group_key(pg, None))
        if cached is not None and not cached[0]:
            return cached
    return True, ""


def _group_key(pg, device) -> Tuple[str, str]:
    from ..comm import group_name

    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    return group_name(pg), str(torch.device(dev))


def ensure_group(pg, device, backend: Optional[str] = None) -> Tuple[bool, str]:
    """Collective: can ``pg`` map symmetric buffers on ``device``? Cached per (group, device).
    Every rank of ``pg`` must call it at the same point; all get the same answer."""
    key = _group_key(pg, device)
    if key not in _groups:
        from ..comm.symmetric import MIN_SIZE_CLASS, SymmetricBuffer, SymmetricUnavailable

        try:
            SymmetricBuffer.get(pg, MIN_SIZE_CLASS, device, backend)
            _groups[key] = (True, "")
        except SymmetricUnavailable as e:
            _groups[key] = (False, f"this group cannot map symmetric buffers: {e}")
    return _groups[key]


def host_span(pg) -> Tuple[bool, str]:
    """Collective over ``pg`` the first time (every rank of it, at the same point): (True, "") if
    its ranks share one host, else (False, why) naming the hosts; the same on every rank."""
    from ..comm import host_layout

    layout = host_layout(pg)
    if not layout.spans_hosts:
        return True, ""
    return False, (f"the group spans {layout.describe()}; symmetric memory maps memory within one "
                   f"host only")


def run(op: str, *args, **kwargs):
    """The fused implementation of ``op``, run with the inputs' GPU as the current device (the
    Triton launches and the comm stream follow the current device, not the tensors)."""
    if op not in IMPLS:
        raise MethodUnavailable(status(op)[1])
    device = args[0].device
    if device.type == "cuda":
        with torch.cuda.device(device):
            return IMPLS[op](*args, **kwargs)
    return IMPLS[op](*args, **kwargs)
