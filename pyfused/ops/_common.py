"""What the ops and the tensor-parallel layers share: method names, the input contract, ``prepare``.

Every op and layer call runs ``prepare`` on every rank before any collective of its own:
  1. resolve the group (a rank that is not a member of the group it passed takes part through the
     default group, so the others hear of it),
  2. with validation mode ``"first"`` (pyfused/comm/validate.py): if this rank has seen this exact
     call (group, op, tensors' shapes/dtypes/devices/requires_grad, method, chunks, options) pass
     before, return the outcome agreed then -- one dictionary lookup, no collective, no host sync,
  3. otherwise build a ``CallSignature`` (named fields: everything that could make a rank refuse the
     call, and whatever decides whether backward runs collectives) and exchange it
     (``pyfused.comm.agree``),
  4. check all ranks' signatures with one pure function -> one identical ``InputError`` everywhere,
  5. pick the concrete method from the *gathered* signatures (rank 0's auto preference; fused only if
     every rank can run it), so every rank runs the same schedule, and remember it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .._logging import logger
from ..comm import validate
from .registry import OPS

METHODS = ("unfused", "decomposed", "fused", "auto")
NOT_A_METHOD = len(METHODS)
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


def method_code(method: Any) -> int:
    return METHODS.index(method) if isinstance(method, str) and method in METHODS else NOT_A_METHOD


def fused_status(op: str, device_type: str, dtype: Optional[torch.dtype] = None,
                 pg=None) -> Tuple[bool, str]:
    """Whether this rank can run ``op`` with ``method="fused"`` (no collective), and if not, why."""
    if op not in OPS or OPS[op].fused is None:
        return False, f"pyfused has no fused kernel for {op}"
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


@dataclass(frozen=True)
class CallSignature:
    """What one rank asks of an op or layer call, as the ranks exchange it."""

    name: str                                # op or layer name
    tensors: Tuple[comm.TensorMeta, ...]     # the tensor arguments (absent: not a tensor)
    method: int = 0                          # index in METHODS; NOT_A_METHOD: not a method
    needs_grad: int = 0                      # bit i: tensor i needs a gradient (backward collectives)
    chunks: int = 0                          # -1: not an int >= 0
    in_group: bool = True                    # False: this rank is not in the group it passed
    fused_ok: bool = False                   # this rank can run the fused method
    auto_method: int = 0                     # this rank's preference for method="auto"
    auto_chunks: int = 0
    options: Tuple[int, ...] = ()            # op or layer specific (eps bits, flags, features)

    def to_wire(self) -> comm.Signature:
        ints = (self.method, self.needs_grad, self.chunks, int(self.in_group), int(self.fused_ok),
                self.auto_method, self.auto_chunks, *self.options)
        return comm.Signature(comm.op_code(self.name), ints, self.tensors)

    @staticmethod
    def from_wire(sig: comm.Signature) -> "CallSignature":
        i = sig.ints
        return CallSignature(sig.name, sig.tensors, i[0], i[1], i[2], bool(i[3]), bool(i[4]), i[5],
                             i[6], tuple(i[7:]))

    def grad_names(self, names: Sequence[str]) -> str:
        need = [n for i, n in enumerate(names) if self.needs_grad >> i & 1]
        return ", ".join(need) if need else "none"


def _meta(t) -> comm.TensorMeta:
    return comm.TensorMeta.of(t) if isinstance(t, torch.Tensor) else comm.TensorMeta(None, None, None)


def int_code(value) -> int:
    """``value`` as an int for a signature; -1 for anything that is not an int (a bool is 0/1)."""
    return int(value) if isinstance(value, int) else -1


def _chunk_code(chunks) -> int:
    return chunks if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 0 else -1


_MEMBER: dict = {}  # group -> whether this rank is a member


def _resolve(group) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup], bool]:
    """(the group to run on, the group to exchange over, whether this rank is a member). A rank
    outside the group it passed exchanges over the default group, where the others can hear it."""
    try:
        pg = comm.resolve_group(group)
    except comm.GroupError:
        pg, in_group = None, False
    else:
        in_group = _MEMBER.get(pg)
        if in_group is None:
            in_group = _MEMBER[pg] = pg is None or dist.get_rank(pg) >= 0
    if in_group:
        return pg, pg, True
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return None, world, False


def call_key(name: str, method, chunks, options: tuple, tensors: Sequence[Any]):
    """The key a repeated call is recognised by; None when an argument cannot be keyed (a bad one:
    such a call always takes the exchange)."""
    metas = []
    for t in tensors:
        if t is None:
            metas.append(None)
        elif isinstance(t, torch.Tensor):
            metas.append((t.shape, t.dtype, t.device, t.requires_grad))
        else:
            return None
    key = (name, method, chunks, options, torch.is_grad_enabled(), *metas)
    try:
        hash(key)
    except TypeError:  # e.g. an unhashable method= argument
        return None
    return key


def common_refusal(sigs: List[CallSignature], names: Sequence[str],
                   method_arg: str = "method") -> Optional[str]:
    """What makes any rank refuse a call, whatever the op: a pure function of ``sigs``."""
    for r, s in enumerate(sigs):
        where = f" (rank {r})" if len(sigs) > 1 else ""
        if not s.in_group:
            return (f"the group passed is not a process group this rank belongs to (a group it is "
                    f"not a member of, or not a 1-D group){where}")
        if s.method == NOT_A_METHOD:
            return f"{method_arg} must be one of {METHODS}{where}"
        if s.chunks < 0:
            return f"chunks must be an int >= 0 (0: tuned or default){where}"
        for name, t in zip(names, s.tensors):
            if t.shape is None:
                return f"{name} must be a tensor{where}"
    return None


def agreement(sigs: List[CallSignature], names: Sequence[str], method_arg: str = "method"
              ) -> Optional[str]:
    """What must be the same on every rank, whatever the op."""
    return (comm.differs(sigs, method_arg, lambda s: s.method, lambda s: METHODS[s.method])
            or comm.differs(sigs, "chunks", lambda s: s.chunks)
            or comm.differs(sigs, "which inputs need a gradient (whether backward runs collectives)",
                            lambda s: s.needs_grad, lambda s: s.grad_names(names))
            or comm.differs(sigs, "the options", lambda s: s.options))


Check = Callable[[List[CallSignature], int, Tuple[str, ...]], Optional[str]]


def prepare(name: str, names: Sequence[str], tensors: Sequence[Any], group, method: Any, *,
            check: Check, chunks: Any = 0, options: tuple = (),
            auto: Optional[Callable[[Any, Sequence[torch.Tensor], bool], Choice]] = None,
            method_arg: str = "method") -> Tuple[Optional[dist.ProcessGroup], Choice]:
    """Validate one call across ranks and choose its method; the same outcome on every rank.

    ``names``/``tensors``: the tensor arguments (a non-tensor is refused on every rank). ``check``:
    the op's or layer's contract over all ranks' signatures (pure). ``auto``: this rank's preference
    for ``method="auto"`` (None: the call has no method to choose). ``options``: ints the ranks must
    agree on (``int_code`` turns a bad value into -1). In validation mode ``"first"``
    or ``"off"`` a call seen before returns its remembered outcome at once (module docstring)."""
    pg, xpg, in_group = _resolve(group)
    key = call_key(name, method, chunks, options, tensors) if in_group else None
    if key is not None:
        hit = validate.seen(pg, key)
        if hit is not None:
            return pg, hit
    choice = _prepare_uncached(name, names, tensors, pg, xpg, in_group, method, check, chunks,
                               options, auto, method_arg)
    if key is not None:
        validate.remember(pg, key, choice)
    return pg, choice


def _local_signature(name, names, tensors, pg, in_group, method, chunks, options, auto
                     ) -> Tuple[CallSignature, Optional[Choice], str]:
    metas = tuple(_meta(t) for t in tensors)
    grad_on = torch.is_grad_enabled()
    needs_grad = sum(1 << i for i, t in enumerate(tensors)
                     if grad_on and isinstance(t, torch.Tensor) and t.requires_grad)
    sig = CallSignature(name, metas, method_code(method), needs_grad, _chunk_code(chunks), in_group,
                        options=tuple(int(o) for o in options))
    if auto is None or common_refusal([sig], names) is not None:
        return sig, None, "no fused method for a refused call"
    first = tensors[0]
    fused_ok, fused_why = fused_status(name, first.device.type, first.dtype, pg)
    pref = auto(pg, tensors, fused_ok) if method == "auto" else Choice(method, 0, "requested")
    return (CallSignature(name, metas, sig.method, needs_grad, sig.chunks, in_group, fused_ok,
                          method_code(pref.method), pref.chunks, sig.options), pref, fused_why)


def _prepare_uncached(name, names, tensors, pg, xpg, in_group, method, check, chunks, options,
                      auto, method_arg) -> Choice:
    sig, pref, fused_why = _local_signature(name, names, tensors, pg, in_group, method, chunks,
                                            options, auto)
    world = comm.world_size(xpg)
    allowed = _backend_device_types(xpg)

    def check_all(wire: List[comm.Signature]) -> Optional[str]:
        sigs = [CallSignature.from_wire(w) for w in wire]
        return (common_refusal(sigs, names, method_arg) or check(sigs, world, allowed)
                or agreement(sigs, names, method_arg))

    sigs = [CallSignature.from_wire(w) for w in comm.agree(xpg, sig.to_wire(), check_all)]
    if auto is None:
        return Choice(method, 0, "requested")
    return _choose(name, pg, tensors[0].device, method, sigs, pref, fused_why)


def _choose(name, pg, device, method, sigs: List[CallSignature], pref: Choice, fused_why: str
            ) -> Choice:
    fused_everywhere = all(s.fused_ok for s in sigs)
    if method == "fused" and not fused_everywhere:
        missing = [r for r, s in enumerate(sigs) if not s.fused_ok]
        raise MethodUnavailable(f"pyfused.{name}: method='fused' is not available here because "
                                f"{fused_why}" + (f" (ranks without it: {missing})"
                                                  if len(sigs) > 1 else ""))
    if method != "auto":
        if method == "fused":
            confirm_fused(name, pg, device, method)
        return Choice(method, 0, "requested")
    chosen, chunks = METHODS[sigs[0].auto_method], sigs[0].auto_chunks
    reason = pref.reason if comm.rank(pg) == 0 else "rank 0's choice"
    if chosen == "fused" and not fused_everywhere:
        chosen, reason = "decomposed", f"fused is not available on every rank ({fused_why})"
    elif chosen == "fused":
        ok, why = confirm_fused(name, pg, device, method)
        if not ok:
            chosen, reason = "decomposed", why
    logger.debug("pyfused.%s: method=auto chose %s (%s) for %s world=%d", name, chosen, reason,
                 [tuple(s.shape) for s in sigs[0].tensors], len(sigs))
    return Choice(chosen, chunks, reason)


def auto_preference(op: str, pg, tensors: Sequence[torch.Tensor], fused_ok: bool) -> Choice:
    """This rank's pick for ``method="auto"``: a tuned entry if there is one, else a size rule."""
    from . import tuned as tune

    spec = OPS[op]
    w = comm.world_size(pg)
    first, second = (tensors[i] for i in spec.tune_shape_inputs)
    entry = tune.lookup(op, w, tuple(first.shape), tuple(second.shape), first.dtype, first.device)
    if entry is not None and (entry.method != "fused" or fused_ok):
        return Choice(entry.method, entry.chunks, f"tuned entry {tune.cache_path()}")
    if w == 1:
        return Choice("unfused", 0, "world size 1: no communication to overlap")
    if not spec.gemm:
        return Choice("unfused", 0, "untuned shape: the decomposed schedule only hides the cheap "
                                    "epilogue; fused is chosen only where tuning measured it faster")
    a, b = tensors[0], tensors[1]
    flops = 2 * math.prod(a.shape[:-1]) * a.shape[-1] * b.shape[-1]
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


def check_matmul_inputs(sigs: List[CallSignature], world: int, allowed_devices: Tuple[str, ...],
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
            or comm.differs(sigs, "b", lambda s: s.tensors[1], lambda s: s.tensors[1].describe()))


def _matmul_hooks(op: str) -> Tuple[Check, Callable]:
    """The check and ``auto`` preference of a GEMM op, made once per op (they are per-call
    arguments of ``prepare``, and a call that hits the seen set should build nothing)."""
    hooks = _MATMUL_HOOKS.get(op)
    if hooks is None:
        scatter = OPS[op].scatters_dim0
        hooks = _MATMUL_HOOKS[op] = (
            lambda sigs, world, allowed: check_matmul_inputs(sigs, world, allowed, scatter),
            lambda pg, ts, fused_ok: auto_preference(op, pg, ts, fused_ok))
    return hooks


_MATMUL_HOOKS: dict = {}


def prepare_matmul(op: str, a, b, group, method, chunks=0) -> Tuple[Optional[dist.ProcessGroup], Choice]:
    """``prepare`` for the three GEMM + collective ops (a [d0, ..., K], b [K, N])."""
    check, auto = _matmul_hooks(op)
    return prepare(op, ("a", "b"), (a, b), group, method, chunks=chunks, check=check, auto=auto)


def eager_direct(*tensors) -> bool:
    """Whether a call may run its implementation directly instead of through its registered op:
    eager (not being traced by torch.compile) and no autograd graph to record. The registered op
    costs tens of microseconds of dispatch per call, more than a latency-bound op's own work."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


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
