"""Moving gradients into and out of a bucket: the Triton kernel on CUDA, the torch path elsewhere.

``flatten_scale(srcs, flat, scale, plan)`` writes ``flat[offset_s : offset_s + numel_s] = src_s *
scale`` (cast to ``flat``'s dtype) for the bucket's segments, which lie back to back from offset 0;
``unflatten_scale(flat, dsts, scale, plan)`` is the reverse. On CUDA each is one launch of
``kernels/bucket.py``'s ``segment_copy_scale_kernel``; on CPU (and wherever the kernel cannot run,
which is logged) the torch reference below runs: one multiply (flatten) or one ``copy_``
(unflatten) per segment, each a single pass over its data. The references are what the kernel is
tested against (tests/test_ddp_kernels.py).
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._logging import logger

# PYFUSED_DDP_KERNEL: "auto" (default; the kernel on CUDA), "off" (torch path everywhere; logged),
# "interpret" (also on CPU tensors, through the Triton interpreter: for tests, slow).
_MODES = {"1": "auto", "auto": "auto", "0": "off", "off": "off", "false": "off",
          "interpret": "interpret"}
_mode = _MODES.get(os.environ.get("PYFUSED_DDP_KERNEL", "auto").strip().lower(), "auto")
_warned = set()


def set_kernel_mode(mode: str) -> None:
    """"auto", "off" or "interpret" (see PYFUSED_DDP_KERNEL); affects modules built afterwards."""
    global _mode
    if mode not in ("auto", "off", "interpret"):
        raise ValueError(f"kernel mode must be auto, off or interpret; got {mode!r}")
    _mode = mode


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float64: tl.float64}[dtype]


def kernel_available(device: torch.device, dtypes: Sequence[torch.dtype]) -> Tuple[bool, str]:
    """Whether the bucket kernel serves these tensors, and if not, why (for the log)."""
    if _mode == "off":
        return False, "PYFUSED_DDP_KERNEL=off"
    if device.type != "cuda" and not (_mode == "interpret" and device.type == "cpu"):
        return False, f"tensors on {device.type} take the torch path"
    if any(d not in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for d in dtypes):
        return False, f"dtypes {dtypes} are not handled by the kernel"
    try:
        from ..kernels import bucket  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no kernel"; say which
        return False, f"kernels/bucket.py could not be imported ({type(e).__name__}: {e})"
    return True, "interpret" if device.type == "cpu" else ""


class CopyPlan:
    """The static launch data of one bucket's copies: segment sizes and block tables, on device.

    ``interpret=True`` builds it for the Triton interpreter (CPU tensors; tests only)."""

    def __init__(self, numels: Sequence[int], device: torch.device, elem_size: int,
                 interpret: bool = False):
        from ..kernels.bucket import choose_config

        self.device = torch.device(device)
        self.numels = [int(n) for n in numels]
        self.offsets = [0] * len(self.numels)
        for i in range(1, len(self.numels)):
            self.offsets[i] = self.offsets[i - 1] + self.numels[i - 1]
        self.config = choose_config("interpreter" if interpret else "cuda", elem_size)
        seg, start = [], []
        for s, n in enumerate(self.numels):
            for st in range(0, n, self.config.block):
                seg.append(s)
                start.append(st)
        self.num_blocks = len(seg)
        # Every segment's length is a multiple of this (0 for no segments): the kernel's 16-byte
        # vector form needs a multiple of 16 bytes of the narrower dtype (see ``alignment``).
        self.numel_gcd = math.gcd(*self.numels)
        self.numel_t = _to_device(self.numels, self.device)
        self.blk_seg = _to_device(seg, self.device, torch.int32)
        self.blk_start = _to_device(start, self.device)
        # Address tables by role, reused while the addresses repeat (the caching allocator usually
        # hands gradients the same blocks every step, so this saves an H2D copy per launch), with
        # whether every address in them is 16-byte aligned.
        self._tables: Dict[str, Tuple[Tuple[int, ...], Tensor, bool]] = {}

    def table(self, role: str, addrs: Sequence[int]) -> Tuple[Tensor, bool]:
        """The device table of ``addrs`` and whether all of them are 16-byte aligned."""
        key = tuple(addrs)
        cached = self._tables.get(role)
        if cached is None or cached[0] != key:
            cached = (key, _to_device(key, self.device), all(a % 16 == 0 for a in key))
            self._tables[role] = cached
        return cached[1], cached[2]

    def alignment(self, src_dtype: torch.dtype, dst_dtype: torch.dtype, addresses_aligned: bool) -> int:
        """The kernel's ALIGN: the elements in 16 bytes of the narrower dtype when every address is
        16-byte aligned and every segment's length is a multiple of that count (16-byte vector
        accesses are then exact), else 1 (element-wise accesses)."""
        vec = 16 // min(src_dtype.itemsize, dst_dtype.itemsize)
        return vec if addresses_aligned and self.numel_gcd % vec == 0 else 1


def _to_device(values: Sequence[int], device: torch.device, dtype=torch.int64) -> Tensor:
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cuda":
        # pinned + non_blocking: no host sync, so the launch does not stall the backward
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _launch(plan: CopyPlan, role: str, src_addrs: List[int], dst_addrs: List[int], src_dtype,
            dst_dtype, scale: float) -> None:
    from ..kernels.bucket import segment_copy_scale_kernel

    if plan.num_blocks == 0:
        return
    # One cache entry per (direction, side): flatten runs on the comm stream and unflatten on the
    # compute stream, so each table is only ever allocated and read on one stream.
    src_t, src_aligned = plan.table(role + ".src", src_addrs)
    dst_t, dst_aligned = plan.table(role + ".dst", dst_addrs)
    segment_copy_scale_kernel[(plan.num_blocks,)](
        src_t, dst_t, plan.numel_t, plan.blk_seg, plan.blk_start, float(scale),
        SRC_T=_tl_dtype(src_dtype), DST_T=_tl_dtype(dst_dtype), BLOCK=plan.config.block,
        ALIGN=plan.alignment(src_dtype, dst_dtype, src_aligned and dst_aligned),
        num_warps=plan.config.num_warps)


def _contiguous_all(ts: Sequence[Tensor]) -> bool:
    return all(t.is_contiguous() for t in ts)


def flatten_scale(srcs: Sequence[Tensor], flat: Tensor, scale: float,
                  plan: Optional[CopyPlan] = None) -> None:
    """``flat[off_s : off_s + n_s] = cast(src_s * scale)``; segments back to back from 0."""
    if plan is not None and _contiguous_all(srcs):
        es = flat.element_size()
        base = flat.data_ptr()
        _launch(plan, "flatten", [s.data_ptr() for s in srcs],
                [base + o * es for o in plan.offsets], srcs[0].dtype, flat.dtype, scale)
        return
    if plan is not None:
        _log_once("non-contiguous gradient", "pyfused DDP: a gradient is not contiguous; its bucket "
                  "is flattened by the torch path this time")
    flatten_scale_ref(srcs, flat, scale)


def unflatten_scale(flat: Tensor, dsts: Sequence[Tensor], scale: float = 1.0,
                    plan: Optional[CopyPlan] = None) -> None:
    """``dst_s = cast(flat[off_s : off_s + n_s] * scale)``; segments back to back from 0."""
    if plan is not None and _contiguous_all(dsts):
        es = flat.element_size()
        base = flat.data_ptr()
        _launch(plan, "unflatten", [base + o * es for o in plan.offsets],
                [d.data_ptr() for d in dsts], flat.dtype, dsts[0].dtype, scale)
        return
    if plan is not None:
        _log_once("non-contiguous dst", "pyfused DDP: a gradient is not contiguous; its bucket is "
                  "unflattened by the torch path this time")
    unflatten_scale_ref(flat, dsts, scale)


def flatten_scale_ref(srcs: Sequence[Tensor], flat: Tensor, scale: float) -> None:
    """The torch path and reference: one multiply per segment straight into the bucket (one pass
    over the data, as torch DDP's reducer copies; the multiply also casts, rounding once)."""
    off = 0
    for s in srcs:
        out = flat[off:off + s.numel()].view(s.shape)
        if s.dtype != flat.dtype:
            s = s.to(torch.promote_types(s.dtype, flat.dtype))
        torch.mul(s, scale, out=out)
        off += s.numel()


def unflatten_scale_ref(flat: Tensor, dsts: Sequence[Tensor], scale: float = 1.0) -> None:
    off = 0
    for d in dsts:
        src = flat[off:off + d.numel()].view(d.shape)
        if scale != 1.0:
            src = src.to(torch.promote_types(src.dtype, d.dtype)) * scale
        d.copy_(src)
        off += d.numel()


def _log_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.info(msg)
