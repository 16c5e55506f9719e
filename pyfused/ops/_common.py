"""What the ops and the tensor-parallel layers share: method names, the input contract, ``prepare``,
and the ``Plan`` a validated op call leaves in the plan cache (pyfused/comm/plans.py), where every
repeat of the call finds it without running ``prepare`` again.

Every layer call, and every op call the plan cache does not hold, runs ``prepare`` on every rank
before any collective of its own:
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
     every rank can run it and the group's ranks share one host), so every rank runs the same
     schedule, and remember it.
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .._logging import logger
from ..comm import plans, validate
from ._signature import (  # noqa: F401  (part of this module's interface)
    FLOAT_DTYPES,
    METHODS,
    NOT_A_METHOD,
    CallSignature,
    MethodUnavailable,
    _chunk_code,
    _meta,
    agreement,
    call_key,
    check_matmul_inputs,
    common_refusal,
    int_code,
    method_code,
)
from .registry import OPS

# Below this many FLOPs of a rank's GEMM (all_gather_matmul's: its gathered rows) the decomposed
# schedule's extra launches and messages cost more than the overlap can save; ``auto`` then keeps
# the unfused call. Per device type and collective: the ring of all_gather_matmul /
# matmul_reduce_scatter (W - 1 point-to-point steps) pays off at smaller GEMMs than the chunked
# all-reduce of matmul_all_reduce (one collective per piece). On 2 gloo ranks of a 2-core CPU box
# (a tensor-parallel MLP step, forward and backward, docs/PERF.md) the rings won by 4-13% at
# 2x512x512x896 and 2x512x1024x1792 FLOP and broke even at 2x512x256x448; the chunked all-reduce
# was within 4% of the unfused call either way at 2x512x896x512 and 2x512x1792x1024, and a
# 2-rank gloo run at 2x256x1024x1024 is about its break-even. Tuned entries (pyfused.tune) override
# it per shape.
DECOMPOSE_MIN_FLOPS = {
    "cpu": {"all_gather": 2 * 512 * 512 * 512, "reduce_scatter": 2 * 512 * 512 * 512,
            "all_reduce": 2 * 256 * 1024 * 1024},
    "cuda": {"all_gather": 2 * 1024 * 4096 * 4096, "reduce_scatter": 2 * 1024 * 4096 * 4096,
             "all_reduce": 2 * 1024 * 4096 * 4096},
}


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


def _resolve(group) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup], bool]:
    """(the group to run on, the group to exchange over, whether this rank is a member). A rank
    outside the group it passed exchanges over the default group, where the others can hear it."""
    if group is None:  # the default group (or none): every rank is a member
        pg = comm.resolve_group(None)
        return pg, pg, True
    try:
        pg = comm.resolve_group(group)
    except comm.GroupError:
        pg, in_group = None, False
    else:
        in_group = pg is None or comm.rank(pg) >= 0
    if in_group:
        return pg, pg, True
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return None, world, False


Check = Callable[[List[CallSignature], int, Tuple[str, ...]], Optional[str]]

# Callbacks that see every call's method choice (``observe_methods``); empty in normal use, so a
# call pays one truth test for them.
_METHOD_OBSERVERS: List[Callable[[str, "Choice"], None]] = []


@contextlib.contextmanager
def observe_methods(callback: Callable[[str, "Choice"], None]):
    """Within the block, ``callback(op_name, choice)`` runs for every op call this process prepares,
    first calls and remembered ones alike: ``choice.method`` is the method the call runs (never
    "auto") and ``choice.reason`` says why. For tools that report which methods fire on a model."""
    _METHOD_OBSERVERS.append(callback)
    try:
        with plans.observe_hits(lambda plan: callback(plan.op, plan.choice)):
            yield
    finally:
        _METHOD_OBSERVERS.remove(callback)


def _observed(name: str, choice: "Choice") -> "Choice":
    for callback in _METHOD_OBSERVERS:
        callback(name, choice)
    return choice


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
            return pg, (_observed(name, hit) if _METHOD_OBSERVERS else hit)
    choice = _prepare_uncached(name, names, tensors, pg, xpg, in_group, method, check, chunks,
                               options, auto, method_arg)
    if key is not None:
        validate.remember(pg, key, choice)
    return pg, (_observed(name, choice) if _METHOD_OBSERVERS else choice)


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
    if method == "fused":
        _refuse_across_hosts(name, pg)
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
    one_host, why = _fused_one_host(pg) if chosen == "fused" else (True, "")
    if not one_host:
        chosen, reason = "decomposed", f"fused is not available: {why}"
        logger.warning("pyfused.%s: method=auto would choose fused, but %s; using decomposed",
                       name, why)
    elif chosen == "fused" and not fused_everywhere:
        chosen, reason = "decomposed", f"fused is not available on every rank ({fused_why})"
    elif chosen == "fused":
        ok, why = confirm_fused(name, pg, device, method)
        if not ok:
            chosen, reason = "decomposed", why
    logger.debug("pyfused.%s: method=auto chose %s (%s) for %s world=%d", name, chosen, reason,
                 [tuple(s.shape) for s in sigs[0].tensors], len(sigs))
    return Choice(chosen, chunks, reason)


def _fused_one_host(pg) -> Tuple[bool, str]:
    from . import _fused

    return _fused.host_span(pg)


def _refuse_across_hosts(name: str, pg) -> None:
    """``method="fused"`` on a group that spans hosts: the same ``MethodUnavailable`` on every rank,
    naming the hosts (decided from the gathered host layout, before any local reason)."""
    ok, why = _fused_one_host(pg)
    if not ok:
        raise MethodUnavailable(f"pyfused.{name}: method='fused' is not available here because {why}")


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
    rows = math.prod(a.shape[:-1]) * (w if spec.collective == "all_gather" else 1)
    flops = 2 * rows * a.shape[-1] * b.shape[-1]
    threshold = DECOMPOSE_MIN_FLOPS.get(a.device.type, DECOMPOSE_MIN_FLOPS["cuda"])[spec.collective]
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


@dataclass(frozen=True)
class Plan:
    """How every call like one validated call runs: decided once by ``prepare``, then found by
    ``comm.plans.lookup`` (one C++ call) for each repeat of the call."""
    op: str
    pg: Optional[dist.ProcessGroup]
    group_name: str
    world: int        # the group's size
    method: str       # the concrete method (never "auto"), or as asked when ``traced``
    chunks: int
    choice: Choice
    direct: bool      # no autograd graph to record: run the implementation, not the registered op
    local: bool       # direct, world size 1 and not fused: the op is its computation alone
    traced: bool = False  # under torch.compile: the registered op validates when it runs


def traced_plan(op: str, group, method: str, chunks: int = 0) -> Plan:
    """The plan of a call Dynamo traces: the registered op, with the method as asked."""
    pg = comm.resolve_group(group)
    return Plan(op, pg, comm.group_name(pg), comm.world_size(pg), method, chunks,
                Choice(method, chunks, "traced"), direct=False, local=False, traced=True)


def new_plan(op: str, pg, choice: Choice, chunks: int, tensors: Sequence[Optional[torch.Tensor]],
             key: tuple, code: Optional[int] = None) -> Plan:
    """The plan of a call ``prepare`` just accepted, stored in the plan cache under ``code`` (the
    op's, by default) and ``key`` = (group as passed, method as passed, *the arguments the call is
    keyed on), unless validation mode is "always" (every call is then checked again)."""
    direct = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    world = comm.world_size(pg)
    plan = Plan(op, pg, comm.group_name(pg), world, choice.method, chunks or choice.chunks, choice,
                direct, local=direct and world == 1 and choice.method != "fused")
    if validate.validation_mode() != "always":
        plans.store(plan, OPS[op].code if code is None else code, *key)
    return plan


def plan_matmul(op: str, a, b, group, method, chunks: int = 0) -> Plan:
    """The plan of a GEMM op's call that the plan cache did not hold."""
    if torch.compiler.is_compiling():
        return traced_plan(op, group, method, chunks)
    pg, choice = prepare_matmul(op, a, b, group, method, chunks)
    key = (group, method, chunks, a, b) if OPS[op].chunked else (group, method, a, b)
    return new_plan(op, pg, choice, chunks, (a, b), key)


def matmul_call_plan(op: str, a, b, group, method) -> Plan:
    """The plan that ``op``'s public function runs for ``(a, b, group, method)``: the cached one,
    or a new one, validated, as the public function would make it. For code that runs a GEMM op's
    registered op itself and needs the concrete method (a layer's autograd function)."""
    plan = None if torch.compiler.is_dynamo_compiling() else plans.lookup(OPS[op].code, group,
                                                                          method, a, b)
    return plan if plan is not None else plan_matmul(op, a, b, group, method)


def call_op(plan: Plan, op, *args):
    """``op(*args)`` for a call that goes through its registered op (autograd, or a trace): an
    eager call was validated when its plan was made, so the op's body does not check it again."""
    return op(*args) if plan.traced else call_validated(op, *args)


# Set while a functional wrapper calls its registered op for a call it has just validated (per
# thread: virtual ranks launch from threads of one process).
_WRAPPER_CALL = threading.local()


def call_validated(op, *args):
    """Call the registered ``op`` for a call the functional wrapper has just validated and resolved
    (concrete method and chunks), so that the op's body does not exchange signatures again."""
    _WRAPPER_CALL.validated = True
    try:
        return op(*args)
    finally:
        _WRAPPER_CALL.validated = False


def take_validated() -> bool:
    """In a registered op's body: whether its wrapper validated this call. Consumed, so ops called
    from inside (a backward's op) validate themselves; False for calls from a compiled graph or
    ``torch.ops`` directly, which the op then checks across ranks itself."""
    if getattr(_WRAPPER_CALL, "validated", False):
        _WRAPPER_CALL.validated = False
        return True
    return False


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


def weight_grad(a: torch.Tensor, grad: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T @ grad``, the gradient of ``b`` in ``a @ b``, laid out as ``b`` is. A layer passes
    its [N, K] weight as ``b = weight.t()``, a column-major view; a row-major gradient of that view
    would reach the weight as a transposed, non-contiguous tensor, which autograd then copies
    whole into ``weight.grad``. Computed as ``(grad^T @ a)^T`` it arrives contiguous, as torch's
    own ``mm`` backward lays it out; one GEMM either way."""
    if b.dim() == 2 and b.stride(0) == 1 and b.stride(1) == b.shape[0] and b.shape[1] > 1:
        return (grad.t() @ a).t()
    return a.t() @ grad
