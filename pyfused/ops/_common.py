"""What the three GEMM+collective ops share: method names, the input contract, method choice.

Every functional op does, on every rank and before any collective of its own:
  1. resolve the group,
  2. build a signature (shapes, dtypes, requested method, this rank's ``auto`` preference and whether
     the fused path is usable here) and exchange it (``pyfused.comm.agree``),
  3. run ``check_matmul_inputs`` over all ranks' signatures -> one identical ``InputError`` everywhere,
  4. pick the concrete method from the *gathered* signatures (rank 0's auto preference; fused only if
     every rank can run it), so every rank runs the same schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .._logging import logger

METHODS = ("unfused", "decomposed", "fused", "auto")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Below this many FLOPs per rank's GEMM the chunked schedule's extra launches and messages cost more
# than the overlap can save (a 2-rank gloo run at 256x1024x1024 is about break-even); ``auto``
# then keeps the unfused call. Tuned entries (pyfused.tune) override it per shape.
DECOMPOSE_MIN_FLOPS = {"cpu": 2 * 256 * 1024 * 1024, "cuda": 2 * 1024 * 4096 * 4096}


# Row pieces of the chunked all-reduce schedules when neither the caller nor a tuned entry says:
# at most DEFAULT_CHUNKS pieces, each with at least MIN_CHUNK_WORK of work (GEMM FLOPs, or bytes
# for a plain reduction), because every piece pays a collective's fixed latency. gloo's is
# ~0.3-0.5 ms, so on CPU few pieces pay off (2 gloo ranks, 512x256x512 fp32: 4 pieces 7.2 ms,
# 2 pieces 3.3 ms, unfused 4.1 ms, on an otherwise idle 2-core box); NCCL's is ~100x lower.
DEFAULT_CHUNKS = {"cpu": 2, "cuda": 4}
MIN_CHUNK_WORK = {  # (GEMM FLOPs, bytes reduced) per piece
    "cpu": (2 * 512 * 512 * 1024, 4 << 20),
    "cuda": (2 * 256 * 1024 * 1024, 1 << 20),
}


def default_chunks(device: torch.device, rows: int, flops: float = 0.0, nbytes: float = 0.0) -> int:
    """How many row pieces a chunked all-reduce schedule uses by default, given the whole op's GEMM
    ``flops`` (or, for a plain reduction, ``nbytes``); 1 means pieces would be too small to pay."""
    cap = DEFAULT_CHUNKS.get(device.type, 4)
    min_flops, min_bytes = MIN_CHUNK_WORK.get(device.type, MIN_CHUNK_WORK["cuda"])
    pieces = flops // min_flops if flops else nbytes // min_bytes
    return max(1, min(cap, rows, int(pieces)))


def _op_tags() -> dict:
    """Tags of the ops' ``torch.library.custom_op``: ``cudagraph_unsafe``, so torch.compile's CUDA
    graphs (mode="reduce-overhead") leave the ops out instead of capturing them. None of their
    methods replays correctly from a graph: the cross-rank input check reads its result on the host,
    and the fused method's epochs and flag values are host values baked into the launch (it also
    refuses capture itself: pyfused/fused/config.py ``check_not_capturing``)."""
    import inspect

    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None or "tags" not in inspect.signature(torch.library.custom_op).parameters:
        return {}
    return {"tags": (tag,)}


OP_TAGS = _op_tags()


class MethodUnavailable(RuntimeError):
    """``method=`` asked for a path that cannot run here; the message says why."""


def method_code(method: str) -> int:
    return METHODS.index(method)


def fused_status(op: str, device_type: str, dtype: Optional[torch.dtype] = None,
                 pg=None) -> Tuple[bool, str]:
    """Whether this rank can run ``op`` with ``method="fused"`` (no collective), and if not, why."""
    if device_type != "cuda":
        return False, (f"inputs are on {device_type}: the fused method needs CUDA tensors on GPUs "
                       f"with peer access (symmetric memory)")
    from .. import _ext

    if _ext.load() is None:
        return False, f"the CUDA extension pyfused._C is not available ({_ext.load_error()})"
    from . import _fused

    return _fused.status(op, dtype, pg)


def confirm_fused(op: str, pg, device: torch.device, method: str) -> Tuple[bool, str]:
    """Once every rank agreed on the fused method: can this group map symmetric buffers? A
    collective (``_fused.ensure_group``, cached per group) with the same answer on every rank.
    ``method="fused"`` raises ``MethodUnavailable`` with the reason; ``auto`` logs it and the caller
    takes the decomposed method."""
    from . import _fused

    ok, why = _fused.ensure_group(pg, device)
    if not ok and method == "fused":
        raise MethodUnavailable(f"pyfused.{op}: method='fused' is not available here because {why}")
    if not ok:
        logger.warning("pyfused.%s: method=auto chose fused, but %s; using decomposed", op, why)
    return ok, why


@dataclass(frozen=True)
class Choice:
    method: str
    chunks: int
    reason: str


def auto_preference(op: str, pg, a: torch.Tensor, b: torch.Tensor, fused_ok: bool) -> Choice:
    """This rank's pick for ``method="auto"``: a tuned entry if there is one, else a size rule."""
    from .. import tune

    w = comm.world_size(pg)
    rows = math.prod(a.shape[:-1])
    entry = tune.lookup(op, w, tuple(a.shape), tuple(b.shape), a.dtype, a.device)
    if entry is not None and (entry.method != "fused" or fused_ok):
        return Choice(entry.method, entry.chunks, f"tuned entry {tune.cache_path()}")
    if w == 1:
        return Choice("unfused", 0, "world size 1: no communication to overlap")
    flops = 2 * rows * a.shape[-1] * b.shape[-1]
    threshold = DECOMPOSE_MIN_FLOPS.get(a.device.type, DECOMPOSE_MIN_FLOPS["cuda"])
    if flops < threshold:
        return Choice("unfused", 0, f"GEMM of {flops:.3g} FLOP per rank is below the {threshold:.3g} "
                                    f"FLOP where chunking pays (untuned shape)")
    return Choice("decomposed", 0, "untuned shape above the chunking threshold "
                                   "(fused is chosen only where tuning measured it faster)")


def _backend_device_types(pg) -> Tuple[str, ...]:
    if pg is None:
        return ("cpu", "cuda", "other")
    backend = str(dist.get_backend(pg)).lower()
    types = []
    if "gloo" in backend or "cpu" in backend:
        types.append("cpu")
    if "nccl" in backend or "cuda" in backend:
        types.append("cuda")
    return tuple(types) or ("cpu", "cuda", "other")


def check_matmul_inputs(sigs: List[comm.Signature], world: int, allowed_devices: Tuple[str, ...],
                        scatter_dim0: bool) -> Optional[str]:
    """The contract of a: [d0, ..., K] and b: [K, N], identical across ranks. Pure in ``sigs``."""
    for r, s in enumerate(sigs):
        a, b = s.tensors[0], s.tensors[1]
        where = f" (rank {r})" if len(sigs) > 1 else ""
        if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
            return (f"a and b must be float32, float16, bfloat16 or float64; got a {a.describe()}, "
                    f"b {b.describe()}{where}")
        if a.dtype != b.dtype:
            return f"a and b must have the same dtype; got a {a.describe()}, b {b.describe()}{where}"
        if a.device != b.device:
            return f"a and b must be on the same device; got a {a.describe()}, b {b.describe()}{where}"
        if world > 1 and a.device not in allowed_devices:
            return (f"tensors on {a.device} cannot be communicated by this process group's backend "
                    f"(it serves {', '.join(allowed_devices)}){where}")
        if len(b.shape) != 2:
            return f"b must be 2-D [K, N]; got b {b.describe()}{where}"
        if not 2 <= len(a.shape) <= 8:
            return f"a must have 2 to 8 dims [d0, ..., K]; got a {a.describe()}{where}"
        if a.shape[-1] != b.shape[0]:
            return (f"a's last dim must equal b's first (K): got a {a.describe()}, "
                    f"b {b.describe()}{where}")
        if 0 in a.shape or 0 in b.shape:
            return f"empty inputs are not supported: a {a.describe()}, b {b.describe()}{where}"
        if scatter_dim0 and a.shape[0] % world != 0:
            return (f"a's dim 0 ({a.shape[0]}) must be divisible by the world size ({world}) to "
                    f"reduce-scatter it; got a {a.describe()}{where}")
    return (comm.differs(sigs, "a", lambda s: s.tensors[0], lambda s: s.tensors[0].describe())
            or comm.differs(sigs, "b", lambda s: s.tensors[1], lambda s: s.tensors[1].describe())
            or comm.differs(sigs, "method", lambda s: s.ints[0], lambda s: METHODS[s.ints[0]]))


def prepare(op: str, a: torch.Tensor, b: torch.Tensor, group, method: str,
            scatter_dim0: bool) -> Tuple[Optional[dist.ProcessGroup], Choice]:
    """Validate across ranks and choose the method; identical outcome on every rank."""
    if method not in METHODS:
        raise ValueError(f"pyfused.{op}: method must be one of {METHODS}, got {method!r}")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"pyfused.{op}: a and b must be tensors")
    pg = comm.resolve_group(group)
    world = comm.world_size(pg)
    fused_ok, fused_why = fused_status(op, a.device.type, a.dtype, pg)
    pref = auto_preference(op, pg, a, b, fused_ok) if method == "auto" else Choice(method, 0, "requested")
    # all_gather_matmul's backward runs a reduce-scatter only where a needs a gradient: every rank
    # must agree on that, or the ranks that need it would wait in backward for the others forever.
    grad_a = int(op == "all_gather_matmul" and torch.is_grad_enabled() and a.requires_grad)
    sig = comm.Signature(
        comm.op_code(op),
        (method_code(method), method_code(pref.method), pref.chunks, int(fused_ok), grad_a),
        (comm.TensorMeta.of(a), comm.TensorMeta.of(b)),
    )
    allowed = _backend_device_types(pg)

    def check(ss):
        return (check_matmul_inputs(ss, world, allowed, scatter_dim0)
                or comm.differs(ss, "whether a needs a gradient (its backward is a collective)",
                                lambda s: s.ints[4], lambda s: "yes" if s.ints[4] else "no"))

    sigs = comm.agree(pg, sig, check)
    fused_everywhere = all(s.ints[3] for s in sigs)
    if method == "fused" and not fused_everywhere:
        missing = [r for r, s in enumerate(sigs) if not s.ints[3]]
        raise MethodUnavailable(f"pyfused.{op}: method='fused' is not available here because {fused_why}"
                                + (f" (ranks without it: {missing})" if len(sigs) > 1 else ""))
    if method != "auto":
        if method == "fused":
            confirm_fused(op, pg, a.device, method)
        return pg, Choice(method, 0, "requested")
    chosen = METHODS[sigs[0].ints[1]]
    chunks = sigs[0].ints[2]
    reason = pref.reason if comm.rank(pg) == 0 else "rank 0's choice"
    if chosen == "fused" and not fused_everywhere:
        chosen, reason = "decomposed", f"fused is not available on every rank ({fused_why})"
    elif chosen == "fused":
        ok, why = confirm_fused(op, pg, a.device, method)
        if not ok:
            chosen, reason = "decomposed", why
    choice = Choice(chosen, chunks, reason)
    logger.debug("pyfused.%s: method=auto chose %s (%s) for a=%s b=%s dtype=%s world=%d",
                 op, choice.method, choice.reason, tuple(a.shape), tuple(b.shape), a.dtype, world)
    return pg, choice


def backward_method(forward_method: str, backward_op: str) -> str:
    """The method the backward's op runs with: the forward's, unless that is fused and the backward op
    has no fused kernel in this build (the same on every rank, so the ranks stay in step)."""
    if forward_method == "fused" and not _fused_kernel_exists(backward_op):
        logger.debug("pyfused: backward %s has no fused kernel; using decomposed", backward_op)
        return "decomposed"
    return forward_method


def _fused_kernel_exists(op: str) -> bool:
    from . import _fused

    return _fused.status(op)[0]
