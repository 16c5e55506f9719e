"""``ring_attention(q, k, v, group)`` -- attention over a sequence sharded across a context-parallel
group: each rank holds its rows of q [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D] in a
sequence layout (pyfused/ops/sequence_shards.py: ``zigzag`` by default, which balances causal
work), and gets its rows of the attention over the whole sequence, exactly as one device would
compute it: softmax(q k^T * scale [softcapped] [masked]) v.

Masks: ``causal`` (key k visible from query q iff k <= q, in global positions), a sliding
``window`` w on top of it (q - w < k <= q; Mistral, Gemma 2/3), or none. ``softcap``: scores
become softcap * tanh(score / softcap) (Gemma 2). Grouped-query attention: Hq a multiple of Hkv.

Methods (pyfused/ops/context_parallel.py): ``ring`` (K/V travel the ring, overlapped with the
attention), ``allgather`` (K/V gathered, overlapped with the local block), ``ulysses``
(all-to-all to head shards and back), ``auto`` (below). The attention itself is torch's: the CPU
flash-attention kernel with its log-sum-exp, or an explicit fp32 path for softcapping and other
devices (pyfused/ops/attention_blocks.py).

Bad input raises the same ``InputError`` on every rank before any collective of the op
(``_common.prepare``): local lengths or any shape differing across ranks, head counts that do
not divide (Hq by Hkv; both by W for ``ulysses``), an odd local length in the zigzag layout (pad
the global sequence to a multiple of 2 W: ``sequence_shards.padded_length``), a window without a
causal mask, a method, layout, window, softcap or scale that is not valid.

A call takes the path of every registry op (pyfused/ops/_dispatch.py): the plan cache, then the
computation alone (one rank, no gradient), the method's schedule (no gradient), or the registered
op ``pyfused::ring_attention`` returning (out, lse), whose backward runs the method's backward
schedule, exact against the single-device gradient. The registry hooks (``make_inputs``,
``reference_per_rank``, ``opcheck_args``, ``plain_torch``) are at the end.
"""
from __future__ import annotations

import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .. import comm
from .._logging import logger
from . import _common
from ._dispatch import dispatched
from .attention_blocks import Chunk, Mask, attend, math_dtype
from .context_parallel import BACKWARD, FORWARD
from .registry import OPS
from .sequence_shards import LAYOUTS

OP = "ring_attention"
INPUTS = ("q", "k", "v")
CP_METHODS = ("ring", "allgather", "ulysses", "auto")


def ring_attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                       window: Optional[int] = None, softcap: Optional[float] = None,
                       scale: Optional[float] = None) -> Tensor:
    """Single-device attention over whole sequences [B, H, S, D] in fp32 (fp64 for fp64 inputs),
    in plain differentiable torch ops: what every rank's rows must equal."""
    dt = math_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        pos = torch.arange(q.shape[2], device=q.device)
        allowed = pos[None, :] <= pos[:, None]
        if window:
            allowed &= pos[None, :] > pos[:, None] - window
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _mask_of(causal: bool, window: int, softcap: float, scale: float) -> Mask:
    return Mask(bool(causal), int(window), float(softcap), float(scale))


def _schedule(pg, method: str, q: Tensor, k: Tensor) -> str:
    """The schedule that runs: ``ring`` without a peer (its single step is the local attention),
    ``auto``'s choice (a pure function of the agreed shapes) for a call traced with ``auto``."""
    world = comm.world_size(pg)
    if world == 1:
        return "ring"
    return choose_method(world, tuple(q.shape), k.shape[1])[0] if method == "auto" else method


@comm.names_failures(OP)
def _forward(q: Tensor, k: Tensor, v: Tensor, pg, method: str, layout: str, mask: Mask
             ) -> Tuple[Tensor, Tensor]:
    return FORWARD[_schedule(pg, method, q, k)](q, k, v, pg, layout, mask)


@comm.names_failures(OP)
def _backward_run(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                  method: str, layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    return BACKWARD[_schedule(pg, method, q, k)](dout, q, k, v, out, lse, pg, layout, mask)


@torch.library.custom_op("pyfused::ring_attention", mutates_args=(), **_common.OP_TAGS)
def _ring_attention_op(q: Tensor, k: Tensor, v: Tensor, group_name: str, method: str, layout: str,
                       causal: bool, window: int, softcap: float, scale: float
                       ) -> Tuple[Tensor, Tensor]:
    """(out [B, Hq, S_local, D], lse [B, Hq, S_local] fp32). ``window`` 0 and ``softcap`` 0.0
    mean none. A call its wrapper did not validate (a compiled graph, ``torch.ops``) is checked
    across ranks here."""
    pg = comm.group_from_name(group_name)
    if not _common.take_validated():
        pg, method = prepare(q, k, v, pg, method, layout, causal, window or None, softcap or None,
                             scale)
    out, lse = _forward(q, k, v, pg, method, layout, _mask_of(causal, window, softcap, scale))
    return out.contiguous(), lse.contiguous()  # the kernel's lse is [B, S, H] in memory


@_ring_attention_op.register_fake
def _(q, k, v, group_name, method, layout, causal, window, softcap, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    ctx.call = inputs[3:]  # group_name, method, layout, causal, window, softcap, scale
    ctx.save_for_backward(*inputs[:3], *output)


@torch.library.custom_op("pyfused::ring_attention_backward", mutates_args=(), **_common.OP_TAGS)
def _ring_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                lse: Tensor, group_name: str, method: str, layout: str,
                                causal: bool, window: int, softcap: float, scale: float
                                ) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the forward's call: a registered op of its own, which a traced backward
    (AOT autograd) calls so that its graph holds one node rather than the schedule's sends and
    receives."""
    grads = _backward_run(dout, q, k, v, out, lse, comm.group_from_name(group_name), method,
                          layout, _mask_of(causal, window, softcap, scale))
    return tuple(g.contiguous() for g in grads)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, group_name, method, layout, causal, window, softcap, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, grad_out, grad_lse):
    """An eager backward runs the schedule itself (its buffers are then visible to memory tools
    such as MemTracker, and it skips an op dispatch); a traced one calls the registered op."""
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_out = grad_out.contiguous()
    if torch.compiler.is_compiling() or any(is_fake(t) for t in (grad_out, q, out)):
        dq, dk, dv = torch.ops.pyfused.ring_attention_backward(grad_out, q, k, v, out, lse,
                                                               *ctx.call)
    else:
        group_name, method, layout, causal, window, softcap, scale = ctx.call
        dq, dk, dv = _backward_run(grad_out, q, k, v, out, lse, comm.group_from_name(group_name),
                                   method, layout, _mask_of(causal, window, softcap, scale))
    return dq, dk, dv, None, None, None, None, None, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Validation (every rank, before any collective of the op)

def _float_code(value) -> Tuple[int, int]:
    """(bits of ``value`` as a float64, 1 if it is None or a finite number > 0 else 0)."""
    if value is None:
        return 0, 1
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0, 0
    value = float(value)
    return struct.unpack("<q", struct.pack("<d", value))[0], int(math.isfinite(value) and value > 0)


def _float_of(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _window_code(window) -> int:
    if window is None:
        return 0
    return window if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else -1


def _options(method, layout, causal, window, softcap, scale) -> Tuple[int, ...]:
    return (CP_METHODS.index(method) if method in CP_METHODS else -1,
            LAYOUTS.index(layout) if layout in LAYOUTS else -1,
            int(causal) if isinstance(causal, bool) else -1, _window_code(window),
            *_float_code(softcap), *_float_code(scale))


# indices in the options
_METHOD, _LAYOUT, _CAUSAL, _WINDOW, _SOFTCAP, _SOFTCAP_OK, _SCALE, _SCALE_OK = range(8)


def _option_error(o: Tuple[int, ...], where: str) -> Optional[str]:
    if o[_METHOD] < 0:
        return f"method must be one of {CP_METHODS}{where}"
    if o[_LAYOUT] < 0:
        return f"layout must be one of {LAYOUTS}{where}"
    if o[_CAUSAL] < 0:
        return f"causal must be True or False{where}"
    if o[_WINDOW] < 0:
        return f"window must be None or an int >= 1{where}"
    if not o[_SOFTCAP_OK] or not o[_SCALE_OK]:
        return f"softcap and scale must be None or finite numbers > 0{where}"
    if o[_WINDOW] and not o[_CAUSAL]:
        return (f"a sliding window needs causal=True: a window without a causal mask is not a mask "
                f"ring_attention supports{where}")
    return None


def _shape_error(s: _common.CallSignature, world: int, allowed: Tuple[str, ...], where: str
                 ) -> Optional[str]:
    q, k, v = s.tensors
    desc = f"q {q.describe()}, k {k.describe()}, v {v.describe()}"
    if any(t.dtype not in _common.FLOAT_DTYPES for t in s.tensors) or not q.dtype == k.dtype == v.dtype:
        return f"q, k and v must have one float dtype; got {desc}{where}"
    if not q.device == k.device == v.device:
        return f"q, k and v must be on one device; got {desc}{where}"
    if world > 1 and q.device not in allowed:
        return (f"tensors on {q.device} cannot be communicated by this process group's backend "
                f"(it serves {', '.join(allowed)}){where}")
    if len(q.shape) != 4 or len(k.shape) != 4 or k.shape != v.shape:
        return f"q must be [B, Hq, S_local, D] and k, v one shape [B, Hkv, S_local, D]; got {desc}{where}"
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]) or 0 in q.shape:
        return f"q, k and v must share B, S_local and D, none of them 0; got {desc}{where}"
    if q.shape[1] % k.shape[1]:
        return (f"the query heads ({q.shape[1]}) must be a multiple of the key/value heads "
                f"({k.shape[1]}); got {desc}{where}")
    return None


def check_inputs(sigs: List[_common.CallSignature], world: int, allowed: Tuple[str, ...]
                 ) -> Optional[str]:
    """The contract above, over every rank's signature; pure, so every rank reaches one verdict."""
    for r, s in enumerate(sigs):
        where = f" (rank {r})" if len(sigs) > 1 else ""
        error = _option_error(s.options, where) or _shape_error(s, world, allowed, where)
        if error:
            return error
    first = sigs[0]
    if any(s.tensors[0].shape != first.tensors[0].shape for s in sigs):
        return comm.differs(sigs, "q's shape [B, Hq, S_local, D] (every rank holds as many "
                                  "positions of the same batch)",
                            lambda s: s.tensors[0].shape, lambda s: s.tensors[0].describe())
    error = (comm.differs(sigs, "k", lambda s: s.tensors[1], lambda s: s.tensors[1].describe())
             or comm.differs(sigs, "q", lambda s: s.tensors[0], lambda s: s.tensors[0].describe())
             or _differing_option(sigs))
    if error:
        return error
    return _world_error(first, world)


def _differing_option(sigs) -> Optional[str]:
    shown = {_METHOD: ("method", lambda o: CP_METHODS[o[_METHOD]]),
             _LAYOUT: ("layout", lambda o: LAYOUTS[o[_LAYOUT]]),
             _CAUSAL: ("causal", lambda o: str(bool(o[_CAUSAL]))),
             _WINDOW: ("window", lambda o: str(o[_WINDOW] or None)),
             _SOFTCAP: ("softcap", lambda o: repr(_float_of(o[_SOFTCAP]) or None)),
             _SCALE: ("scale", lambda o: repr(_float_of(o[_SCALE]) or None))}
    for index, (name, show) in shown.items():
        error = comm.differs(sigs, name, lambda s: s.options[index], lambda s: show(s.options))
        if error:
            return error
    return None


def _world_error(sig: _common.CallSignature, world: int) -> Optional[str]:
    q, k = sig.tensors[0], sig.tensors[1]
    o = sig.options
    if world > 1 and LAYOUTS[o[_LAYOUT]] == "zigzag" and q.shape[2] % 2:
        return (f"the zigzag layout holds two equal chunks per rank, so S_local ({q.shape[2]}) must "
                f"be even: pad the global sequence to a multiple of 2 * {world} "
                f"(pyfused.ops.sequence_shards.padded_length)")
    if world > 1 and CP_METHODS[o[_METHOD]] == "ulysses" and (q.shape[1] % world or k.shape[1] % world):
        return (f"method='ulysses' shards heads: the query heads ({q.shape[1]}) and key/value heads "
                f"({k.shape[1]}) must both be divisible by the group size ({world})")
    return None


def choose_method(world: int, q_shape: Sequence[int], kv_heads: int) -> Tuple[str, str]:
    """``auto``'s choice from the agreed shapes (the same on every rank) and why."""
    if world == 1:
        return "ring", "world size 1: no peer to exchange with"
    return "ring", "ring is the default: its transfers overlap the attention and carry only K/V"


def prepare(q, k, v, group, method, layout, causal, window, softcap, scale) -> Tuple[object, str]:
    """Validate on every rank; (process group, concrete method), identical everywhere."""
    pg, _ = _common.prepare(OP, INPUTS, (q, k, v), group, "auto", check=check_inputs,
                            options=_options(method, layout, causal, window, softcap, scale))
    if method != "auto":
        return pg, method
    chosen, why = choose_method(comm.world_size(pg), tuple(q.shape), k.shape[1])
    logger.debug("pyfused.%s: method=auto chose %s (%s) for q %s world=%d", OP, chosen, why,
                 tuple(q.shape), comm.world_size(pg))
    return pg, chosen


# ---------------------------------------------------------------------------------------------
# The functional op: the plan cache, then the plan. The cache keys the method names of the
# registry's unfused / decomposed / fused kind and no strings among the scalars, so its method
# slot (``slot``) holds "auto" and this op's method and layout travel as their indices (-1: not a
# valid name, which ``prepare`` refuses on every rank and the cache never stores).

def _index(name, names: Tuple[str, ...]) -> int:
    return names.index(name) if isinstance(name, str) and name in names else -1


def _names(method_index: int, layout_index: int) -> Tuple[str, str]:
    return (CP_METHODS[method_index] if method_index >= 0 else "",
            LAYOUTS[layout_index] if layout_index >= 0 else "")


def _plan(group, slot, method_index, layout_index, causal, window, softcap, scale, q, k, v
          ) -> _common.Plan:
    method, layout = _names(method_index, layout_index)
    if torch.compiler.is_compiling():
        return _common.traced_plan(OP, group, method)
    pg, chosen = prepare(q, k, v, group, method, layout, causal, window, softcap, scale)
    return _common.new_plan(OP, pg, _common.Choice(chosen, 0, "ring_attention.prepare"), 0,
                            (q, k, v), (group, slot, method_index, layout_index, causal, window,
                                        softcap, scale, q, k, v))


def _arguments(causal, window, softcap, scale, q) -> tuple:
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    return causal, int(window or 0), float(softcap or 0.0), scale


def _local(group, slot, method_index, layout_index, causal, window, softcap, scale, q, k, v):
    if q.device.type == "cpu" and not window and not softcap:
        # The CPU flash-attention kernel that ``attend`` runs for these masks, called through
        # torch's own entry: the same result, without the blocks and the log-sum-exp a call
        # without a gradient does not need (tests/test_ring_attention.py checks it is equal).
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=bool(causal), enable_gqa=q.shape[1] != k.shape[1],
            scale=float(scale) if scale is not None else q.shape[-1] ** -0.5)
    whole = [Chunk(0, 0, q.shape[2])]
    out, lse = attend(q, k, v, whole, whole, _mask_of(*_arguments(causal, window, softcap, scale, q)))
    return out.to(q.dtype)


def _direct(plan, group, slot, method_index, layout_index, causal, window, softcap, scale, q, k, v):
    layout = _names(method_index, layout_index)[1]
    mask = _mask_of(*_arguments(causal, window, softcap, scale, q))
    return _forward(q, k, v, plan.pg, plan.method, layout, mask)[0]


def _registered(plan, group, slot, method_index, layout_index, causal, window, softcap, scale,
                q, k, v):
    layout = _names(method_index, layout_index)[1]
    out, _ = _common.call_op(plan, torch.ops.pyfused.ring_attention, q, k, v, plan.group_name,
                             plan.method, layout, *_arguments(causal, window, softcap, scale, q))
    return out


@dispatched(OPS[OP].code, _plan, _local, _direct, _registered)
def _dispatch(group, slot, method_index, layout_index, causal, window, softcap, scale, q, k, v):
    """The dispatch path of a call, its method and layout as indices (above)."""


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *, method: str = "auto",
                   causal: bool = True, window: Optional[int] = None,
                   softcap: Optional[float] = None, scale: Optional[float] = None,
                   layout: str = "zigzag") -> Tensor:
    """This rank's rows of attention over the sequence sharded across ``group``; see the module
    docstring. ``scale`` defaults to D ** -0.5."""
    return _dispatch(group, "auto", _index(method, CP_METHODS), _index(layout, LAYOUTS), causal,
                     window, softcap, scale, q, k, v)


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use

def _batch(rows) -> int:
    return rows if isinstance(rows, int) else math.prod(rows)


def make_inputs(world, rows, n, k=0, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (q [B, 2W, S_local, D], k, v [B, W, S_local, D]) in the zigzag layout: one
    global sequence of W * S_local positions, B = ``rows`` (the product of leading dims),
    D = ``n``, S_local = 2 * max(``k``, 1). Hq = 2 Hkv (grouped-query) and both divisible by W, so
    every method takes them."""
    from .sequence_shards import shard_sequence

    g = torch.Generator().manual_seed(seed)
    b, length = _batch(rows), world * 2 * max(k, 1)
    q = torch.randn(b, 2 * world, length, n, generator=g)
    key, value = (torch.randn(b, world, length, n, generator=g) for _ in range(2))
    return [tuple(shard_sequence(t, 2, r, world).to(device, dtype) for t in (q, key, value))
            for r in range(world)]


def reference_per_rank(inputs):
    """Every rank's rows of causal attention over the whole sequence, by ``ring_attention_ref``."""
    from .sequence_shards import shard_sequence, unshard_sequence

    world = len(inputs)
    whole = [unshard_sequence([t[i] for t in inputs], 2) for i in range(3)]
    out = ring_attention_ref(*whole)
    return [shard_sequence(out, 2, r, world) for r in range(world)]


def opcheck_args(tensors, group_name: str) -> tuple:
    q, k, v = tensors
    return (q, k, v, group_name, "ring", "zigzag", True, 0, 0.0, q.shape[-1] ** -0.5)


def plain_torch(tensors, pg):
    """What a torch user writes: all-gather K and V, put the sequence in global order, and run
    ``scaled_dot_product_attention`` on this rank's rows with the causal mask of their global
    positions."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from .sequence_shards import shard_positions, unshard_sequence

    q, k, v = tensors
    world, rank, s = comm.world_size(pg), max(comm.rank(pg), 0), q.shape[2]
    rows = shard_positions(rank, world, s, "zigzag", q.device)
    allowed = torch.arange(world * s, device=q.device)[None, :] <= rows[:, None]

    def all_gather_then_sdpa():
        if world > 1:
            parts = [[torch.empty_like(t) for _ in range(world)] for t in (k, v)]
            dist.all_gather(parts[0], k.contiguous(), group=pg)
            dist.all_gather(parts[1], v.contiguous(), group=pg)
            whole_k, whole_v = (unshard_sequence(p, 2) for p in parts)
        else:
            whole_k, whole_v = k, v
        return F.scaled_dot_product_attention(q, whole_k, whole_v, attn_mask=allowed,
                                              enable_gqa=True)
    return all_gather_then_sdpa
