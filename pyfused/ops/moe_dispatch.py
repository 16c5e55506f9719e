"""``moe_dispatch(x, topk_idx, weight=None, group=None) -> (out, layout)`` -- the first half of an
expert-parallel mixture-of-experts layer: every token goes to the ranks that own the experts it
chose and, with ``weight``, those experts' first GEMM runs on what arrived.

Shapes: ``x [..., H]`` this rank's tokens (the token count may differ between ranks), ``topk_idx
[..., k]`` (int64 or int32) the experts each token chose among ``num_experts`` = E, divisible by the
group size W (with ``weight`` it defaults to W * weight.shape[0]), ``weight [E/W, H, N]`` this
rank's experts' first projection (``x @ weight[j]``). Returns ``out [R, N]`` -- one row for every
(token, choice) pair of every rank whose expert lives here, in expert-major order (by local expert,
then source rank, then pair; pyfused/ops/moe_exchange.py) -- and ``layout [W, E/W]`` (int64):
``layout[s, j]`` rows came from rank s for local expert j, so ``layout.sum(0)`` are the rows of each
local expert. Without ``weight``, ``out`` is the received tokens themselves ``[R, H]``.

Methods (docs/MOE.md)
  * unfused: the count exchange, one ``all_to_all_single`` with split sizes, a permutation to
    expert-major order, one grouped GEMM (``moe_grouped_mm``: ``torch._grouped_mm`` where torch has
    it for the device and dtype, one GEMM per expert otherwise).
  * decomposed: the count exchange, then every peer's block posted at once (isend / irecv); the
    local experts multiply this rank's own block first and each source's block as it arrives,
    while the later ones travel.
  * fused (pyfused/fused/moe.py, where symmetric memory is): the counts through symmetric
    memory, each block copied into its destination's buffer and flagged, one Triton grouped GEMM
    whose tiles wait on their source rank's flag.
  * auto: unfused on one rank or without a weight, else decomposed from ``DECOMPOSE_MIN_WEIGHT``.
Every method reads the exchanged counts on the host once (a host synchronization on a GPU).

Autograd, with D the dispatch (a linear map of x) and G the grouped GEMM, out = G(D(x), weight):
  grad_x      = D^T(grad_out @ weight^T): ``moe_combine`` with unit weights and the transposed
                weight, by the same method (the decomposed one overlapped again);
  grad_weight = D(x)_e^T @ grad_out_e per local expert, from the received rows the forward kept.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import comm
from . import _common, _fused, moe_exchange
from ._dispatch import dispatched
from .moe_exchange import Routing
from .moe_grouped_mm import grouped_mm, grouped_weight_grad
from .registry import OPS

OP = "moe_dispatch"
_CODE = OPS[OP].code
INPUTS = ("x", "topk_idx", "weight")
_ABSENT = torch.empty(0)  # stands for an absent weight in the call's signature (options say so)

# Below this many elements in each expert's weight (H x N) the per-peer messages of the
# decomposed method cost more than the overlap saves; ``auto`` keeps unfused there. The CPU value
# rests on the moe suite's runs on one host and across two (docs/PERF.md, "Mixture of experts"):
# experts of 256 x 512 and 256 x 1024 lost with decomposed on both, 512 x 1024 and up tied or won.
DECOMPOSE_MIN_WEIGHT = {"cpu": 512 * 1024, "cuda": 2048 * 4096}


# ---------------------------------------------------------------------------------------------
# The fp32 reference (independent of the implementation: loops over experts and sources)

def expert_major_pairs(topk_idx_per_rank: Sequence[Tensor], num_experts: int
                       ) -> List[Tuple[List[Tuple[int, int, int]], Tensor]]:
    """Per destination rank: its received (source, pair, local expert) in expert-major order, and
    its layout [W, E/W]."""
    world = len(topk_idx_per_rank)
    local = num_experts // world
    flat = [t.reshape(-1) for t in topk_idx_per_rank]
    result = []
    for dest in range(world):
        rows, layout = [], torch.zeros(world, local, dtype=torch.int64)
        for j in range(local):
            for source in range(world):
                pairs = (flat[source] == dest * local + j).nonzero().flatten().tolist()
                rows += [(source, p, j) for p in pairs]
                layout[source, j] = len(pairs)
        result.append((rows, layout))
    return result


def moe_dispatch_ref(x_per_rank: Sequence[Tensor], topk_idx_per_rank: Sequence[Tensor],
                     weight_per_rank: Optional[Sequence[Tensor]] = None, num_experts: int = 0
                     ) -> List[Tuple[Tensor, Tensor]]:
    """fp32 (fp64 for fp64 inputs) reference on one device: every rank's (out, layout)."""
    world = len(x_per_rank)
    if not num_experts:
        num_experts = world * weight_per_rank[0].shape[0]
    dt = torch.promote_types(x_per_rank[0].dtype, torch.float32)
    k = topk_idx_per_rank[0].shape[-1]
    tokens = [x.reshape(-1, x.shape[-1]).to(dt) for x in x_per_rank]
    results = []
    for dest, (rows, layout) in enumerate(expert_major_pairs(topk_idx_per_rank, num_experts)):
        width = tokens[0].shape[1] if weight_per_rank is None else weight_per_rank[dest].shape[2]
        outs = []
        for s, p, j in rows:
            row = tokens[s][p // k]
            outs.append(row if weight_per_rank is None else row @ weight_per_rank[dest][j].to(dt))
        out = torch.stack(outs) if outs else tokens[0].new_zeros((0, width))
        results.append((out, layout))
    return results


# ---------------------------------------------------------------------------------------------
# The methods

def dispatch_rows(op: str, rows: Tensor, routing: Routing, weight: Optional[Tensor], pg,
                  method: str, keep_received: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Rows in pair order [P, H] -> (out [R, N] expert-major, the received rows [R, H] when kept or
    when there is no weight)."""
    counts = routing.expert_counts
    if routing.world == 1:  # pair order is expert-major order
        return (rows if weight is None else grouped_mm(rows, weight, counts)), rows
    if method == "decomposed":
        return _decomposed(op, rows, routing, weight, pg, keep_received)
    moved = moe_exchange.exchange(op, rows, routing.send, routing.recv, pg)
    received = routing.source_to_expert_major(moved)
    if weight is None:
        return received, received
    return grouped_mm(received, weight, counts), received


def _decomposed(op, rows, routing, weight, pg, keep_received):
    recv = routing.recv
    moved = rows.new_empty((sum(recv), rows.shape[1]))
    at, send_at = moe_exchange.offsets(recv), moe_exchange.offsets(routing.send)
    transfers = moe_exchange.PeerTransfers(op, pg, moved, recv)
    # rank r + 1 waits for this rank's block first, r + 2 second, ...: send in that order
    for dest in reversed(moe_exchange.source_order(routing.world, routing.rank)[1:]):
        transfers.send_to(dest, moe_exchange.block(rows, send_at, dest))
    own = moe_exchange.block(rows, send_at, routing.rank)
    index = routing.expert_index()
    width = rows.shape[1] if weight is None else weight.shape[2]
    out = rows.new_empty((moved.shape[0], width))
    received = moved.new_empty(moved.shape) if keep_received and weight is not None else None
    for source in moe_exchange.source_order(routing.world, routing.rank):
        transfers.wait_from(source)
        block = own if source == routing.rank else moe_exchange.block(moved, at, source)
        result = block if weight is None else grouped_mm(block, weight, routing.counts[source])
        where = None if index is None else moe_exchange.block(index, at, source)
        _place(out, where, at, source, result)
        if received is not None:
            _place(received, where, at, source, block)
    transfers.finish()
    return out, (out if weight is None else received)


def _place(dest: Tensor, where: Optional[Tensor], at: List[int], source: int, rows: Tensor) -> None:
    """Write a source's block to its expert-major rows (``where``; None: in place, same order)."""
    if where is None:
        moe_exchange.block(dest, at, source).copy_(rows)
    else:
        dest.index_copy_(0, where, rows)


@comm.names_failures(OP)
def _run(x: Tensor, topk_idx: Tensor, weight: Optional[Tensor], num_experts: int, pg, method: str,
         keep_received: bool, layout: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """2-D x [T, H], topk_idx [T, k]: (out, layout, received rows or an empty tensor).
    ``layout``: the routing is already known (an earlier dispatch of the same ``topk_idx`` on
    every rank returned it), so the counts are not exchanged again; the fused method, which
    sizes its buffers from every rank's counts, exchanges them regardless."""
    if method == "fused":
        return _fused_rows(x, topk_idx, weight, num_experts, pg, keep_received)
    routing = (moe_exchange.route(OP, topk_idx, num_experts, pg) if layout is None
               else moe_exchange.routing_from_layout(topk_idx, layout, pg))
    k = topk_idx.shape[1]
    rows = x.index_select(0, routing.order // k if k > 1 else routing.order)
    out, received = dispatch_rows(OP, rows, routing, weight, pg, method, keep_received)
    kept = received if keep_received and weight is not None else x.new_empty((0,))
    return out, routing.layout, kept


def _fused_rows(x, topk_idx, weight, num_experts, pg, keep_received):
    """The fused method (pyfused/fused/moe.py): its source-major received rows, when it returns
    them, put in expert-major order here."""
    out, layout, received = _fused.run(OP, x, topk_idx, weight, num_experts, pg, keep_received)
    if received is not None:
        received = moe_exchange.to_expert_major(received, layout)
    if weight is None:
        return received, layout, x.new_empty((0,))
    return out, layout, (received if keep_received else x.new_empty((0,)))


# ---------------------------------------------------------------------------------------------
# The registered op

@torch.library.custom_op("pyfused::moe_dispatch", mutates_args=(), **_common.OP_TAGS)
def _moe_dispatch_op(x: Tensor, topk_idx: Tensor, weight: Optional[Tensor], num_experts: int,
                     group_name: str, method: str, keep_received: bool,
                     known_layout: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """2-D op: (out, layout, the received rows if keep_received and weight, else empty).
    ``known_layout``: the layout an earlier dispatch of this ``topk_idx`` returned (moe_combine's
    backward), which saves the count exchange; None to exchange the counts."""
    pg = comm.group_from_name(group_name)
    if not _common.take_validated():
        pg, choice = prepare(x, topk_idx, weight, num_experts, pg, method)
        method = choice.method
    out, layout, received = _run(x, topk_idx, weight, num_experts, pg, method, keep_received,
                                 known_layout)
    # an op's output may not alias its input: a known layout comes back as a (tiny) copy
    return out, (layout.clone() if layout is known_layout else layout), received


@_moe_dispatch_op.register_fake
def _(x, topk_idx, weight, num_experts, group_name, method, keep_received, known_layout=None):
    world = comm.world_size(comm.group_from_name(group_name))
    rows = torch.library.get_ctx().new_dynamic_size()
    width = x.shape[1] if weight is None else weight.shape[2]
    received = x.new_empty((rows, x.shape[1])) if keep_received and weight is not None \
        else x.new_empty((0,))
    layout = x.new_empty((world, num_experts // world), dtype=torch.int64)
    return x.new_empty((rows, width)), layout, received


def _setup_context(ctx, inputs, output):
    x, topk_idx, weight, num_experts, group_name, method, _, _ = inputs
    ctx.group_name, ctx.method, ctx.num_experts = group_name, method, num_experts
    ctx.save_for_backward(topk_idx, weight, output[1], output[2])


def _backward(ctx, grad_out, _grad_layout, _grad_received):
    topk_idx, weight, layout, received = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        back = None if weight is None else weight.transpose(1, 2)
        grad_x = torch.ops.pyfused.moe_combine(grad_out, None, topk_idx, layout, back,
                                               ctx.group_name, ctx.method, False)[0]
    if ctx.needs_input_grad[2]:
        grad_weight = torch.ops.pyfused.moe_expert_weight_grad(received, grad_out, layout)
    return grad_x, None, grad_weight, None, None, None, None, None


_moe_dispatch_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("pyfused::moe_expert_weight_grad", mutates_args=())
def _expert_weight_grad_op(rows: Tensor, grad: Tensor, layout: Tensor) -> Tensor:
    """[E_l, K, N]: rows_e^T @ grad_e per local expert (rows expert-major, ``layout`` counts):
    the experts' weight gradient of both MoE ops (its counts are read on the host)."""
    return grouped_weight_grad(rows, grad, moe_exchange.expert_row_counts(layout))


@_expert_weight_grad_op.register_fake
def _(rows, grad, layout):
    return rows.new_empty((layout.shape[1], rows.shape[1], grad.shape[1]))


# ---------------------------------------------------------------------------------------------
# Validation (every rank, before any collective of the op): _common.prepare with this contract

def tokenless(t):
    """A tensor argument as the call's signature describes it: its token dims dropped (a view
    [0, last dim]; anything else as it is). Token counts differ between ranks and between calls,
    so they are neither checked across ranks nor part of the record of seen calls: a rank whose
    token count changes does not exchange signatures while the others do not."""
    if isinstance(t, Tensor) and t.dim() >= 1:
        return t.reshape(-1, t.shape[-1])[:0]
    return t


def _options(x, topk_idx, weight, num_experts) -> Tuple[int, int, int]:
    leading_ok = (isinstance(x, Tensor) and isinstance(topk_idx, Tensor) and x.dim() >= 2
                  and topk_idx.shape[:-1] == x.shape[:-1])
    return int(weight is not None), _common.int_code(num_experts), int(leading_ok)


def check_inputs(sigs: List[_common.CallSignature], world: int,
                 allowed_devices: Tuple[str, ...]) -> Optional[str]:
    """The contract of x [..., H], topk_idx [..., k], weight [E/W, H, N] or none (token dims
    dropped, ``tokenless``); pure."""
    for r, s in enumerate(sigs):
        x, idx, w = s.tensors
        has_weight, _, leading_ok = s.options
        num_experts = _resolved_experts(s, world)
        where = f" (rank {r})" if len(sigs) > 1 else ""
        if x.dtype not in _common.FLOAT_DTYPES:
            return f"x must be float32, float16, bfloat16 or float64; got x {x.describe()}{where}"
        if idx.dtype not in moe_exchange.INDEX_DTYPES:
            return f"topk_idx must be int64 or int32; got topk_idx {idx.describe()}{where}"
        if x.device != idx.device or (has_weight and w.device != x.device):
            return f"x, topk_idx and weight must be on one device{where}"
        if world > 1 and x.device not in allowed_devices:
            return (f"tensors on {x.device} cannot be communicated by this process group's backend "
                    f"(it serves {', '.join(allowed_devices)}){where}")
        if not leading_ok or x.shape[-1] < 1 or idx.shape[-1] < 1:
            return (f"x must be [..., H] and topk_idx [..., k] with the same leading (token) dims, "
                    f"H >= 1 and k >= 1{where}")
        if has_weight:
            problem = _weight_problem(x, w, num_experts, world)
            if problem:
                return problem + where
        if num_experts < 1 or num_experts % world:
            return (f"num_experts ({num_experts}) must be a positive multiple of the group size "
                    f"({world}): each rank holds num_experts / {world} experts{where}")
        if idx.shape[-1] > num_experts:
            return f"k ({idx.shape[-1]}) cannot exceed num_experts ({num_experts}){where}"
    return (comm.differs(sigs, "the hidden size H (x's last dim)", lambda s: s.tensors[0].shape[-1])
            or comm.differs(sigs, "x's dtype", lambda s: s.tensors[0].dtype)
            or comm.differs(sigs, "k (topk_idx's last dim)", lambda s: s.tensors[1].shape[-1])
            or comm.differs(sigs, "whether a weight is given", lambda s: s.options[0])
            or comm.differs(sigs, "num_experts", lambda s: _resolved_experts(s, world))
            or comm.differs(sigs, "weight", lambda s: s.tensors[2] if s.options[0] else None,
                            lambda s: s.tensors[2].describe() if s.options[0] else "none"))


def _resolved_experts(sig: _common.CallSignature, world: int) -> int:
    """num_experts as given, or (0 with a weight) W times the weight's experts."""
    has_weight, num_experts = sig.options[:2]
    if num_experts == 0 and has_weight and len(sig.tensors[2].shape) == 3:
        return sig.tensors[2].shape[0] * world
    return num_experts


def _weight_problem(x, w, num_experts, world) -> Optional[str]:
    if len(w.shape) != 3 or w.dtype != x.dtype:
        return (f"weight must be [num_experts / W, H, N] in x's dtype; got x {x.describe()}, "
                f"weight {w.describe()}")
    if w.shape[1] != x.shape[-1]:
        return (f"weight's dim 1 must be x's hidden size {x.shape[-1]}; got weight {w.describe()}")
    if w.shape[0] * world != num_experts:
        return (f"weight holds {w.shape[0]} experts per rank, but num_experts={num_experts} over "
                f"{world} ranks needs {num_experts // world if num_experts % world == 0 else '?'}")
    return None


def prepare(x, topk_idx, weight, num_experts, group, method):
    """Validate on every rank and choose the method; identical outcome everywhere."""
    tensors = (tokenless(x), tokenless(topk_idx), _ABSENT if weight is None else weight)
    return _common.prepare(OP, INPUTS, tensors, group, method, check=check_inputs,
                           options=_options(x, topk_idx, weight, num_experts), auto=auto_preference)


def auto_preference(pg, tensors, fused_ok: bool) -> _common.Choice:
    """Decomposed on more than one rank when each expert's weight (the GEMM every arriving row
    meets) has at least ``DECOMPOSE_MIN_WEIGHT`` elements; else unfused. Token counts are not
    part of the choice: it is made once per signature, whose token dims are dropped."""
    weight = tensors[-1]
    if comm.world_size(pg) == 1 or weight is _ABSENT:
        return _common.Choice("unfused", 0, "nothing to overlap (one rank, or no expert GEMM)")
    size = weight.shape[-2] * weight.shape[-1]
    threshold = DECOMPOSE_MIN_WEIGHT.get(weight.device.type, DECOMPOSE_MIN_WEIGHT["cuda"])
    if size < threshold:
        return _common.Choice("unfused", 0, f"expert weights of {size} elements are below the "
                                            f"{threshold} where overlapping pays")
    return _common.Choice("decomposed", 0, f"expert weights of {size} >= {threshold} elements")


# ---------------------------------------------------------------------------------------------
# The functional op, made by the shared dispatch path (pyfused/ops/_dispatch.py)

def _experts(num_experts: int, weight: Optional[Tensor], world: int) -> int:
    return num_experts or (0 if weight is None else weight.shape[0] * world)


def _plan(group, method, num_experts, x, topk_idx, weight) -> _common.Plan:
    if torch.compiler.is_compiling():
        return _common.traced_plan(OP, group, method)
    pg, choice = prepare(x, topk_idx, weight, num_experts, group, method)
    return _common.new_plan(OP, pg, choice, 0, (x, topk_idx, weight),
                            (group, method, num_experts, x, topk_idx, weight))


def _flat(x, topk_idx):
    if x.dim() == 2:
        return x, topk_idx
    return x.reshape(-1, x.shape[-1]), topk_idx.reshape(-1, topk_idx.shape[-1])


def _local(group, method, num_experts, x, topk_idx, weight):
    x2, idx2 = _flat(x, topk_idx)
    experts = _experts(num_experts, weight, 1)
    out, layout, _ = _run(x2, idx2, weight, experts, None, "unfused", False)
    return out, layout


def _direct(plan, group, method, num_experts, x, topk_idx, weight):
    x2, idx2 = _flat(x, topk_idx)
    out, layout, _ = _run(x2, idx2, weight, _experts(num_experts, weight, plan.world), plan.pg,
                          plan.method, False)
    return out, layout


def _registered(plan, group, method, num_experts, x, topk_idx, weight):
    x2, idx2 = _flat(x, topk_idx)
    experts = _experts(num_experts, weight, plan.world)
    keep = torch.is_grad_enabled() and weight is not None and weight.requires_grad
    out, layout, _ = _common.call_op(plan, torch.ops.pyfused.moe_dispatch, x2, idx2, weight,
                                     experts, plan.group_name, plan.method, keep, None)
    return out, layout


@dispatched(_CODE, _plan, _local, _direct, _registered)
def moe_dispatch(x: Tensor, topk_idx: Tensor, weight: Optional[Tensor] = None, group=None, *,
                 num_experts: int = 0, method: str = "auto") -> Tuple[Tensor, Tensor]:
    """(out, layout): the tokens each local expert received (times ``weight``, if given), in
    expert-major order, and where they came from; see the module docstring."""


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use

TOPK = 2               # the hooks' experts per token
EXPERTS_PER_RANK = 2   # the hooks' experts on each rank


def routed_tokens(world, rows, n, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (x [rows..., n], topk_idx [rows..., TOPK]): random tokens, each choosing
    TOPK distinct experts among EXPERTS_PER_RANK * world."""
    from ._hooks import leading_dims, randn

    lead = leading_dims(rows)
    tokens = 1
    for d in lead:
        tokens *= d
    g = torch.Generator().manual_seed(seed)
    experts = EXPERTS_PER_RANK * world
    out = []
    for _ in range(world):
        x = randn(g, (*lead, n), dtype, device)
        scores = torch.rand(tokens, experts, generator=g)
        out.append((x, scores.topk(TOPK, dim=1).indices.view(*lead, TOPK).to(device)))
    return out


def expert_weights(world, k_in, k_out, dtype, device, seed):
    """Every rank's experts' weights [EXPERTS_PER_RANK, k_in, k_out], scaled by k_in^-1/2."""
    from ._hooks import randn

    g = torch.Generator().manual_seed(seed + 7919)
    return [randn(g, (EXPERTS_PER_RANK, k_in, k_out), dtype, device) / k_in ** 0.5
            for _ in range(world)]


def make_inputs(world, rows, n, k=0, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (x [rows..., n], topk_idx [rows..., TOPK], weight [EXPERTS_PER_RANK, n,
    k or n])."""
    weights = expert_weights(world, n, k or n, dtype, device, seed)
    return [(x, idx, w) for (x, idx), w in zip(routed_tokens(world, rows, n, dtype, device, seed),
                                               weights)]


def reference_per_rank(inputs):
    """Every rank's (out, layout) by ``moe_dispatch_ref``."""
    return moe_dispatch_ref([x for x, _, _ in inputs], [i for _, i, _ in inputs],
                            [w for _, _, w in inputs])


def opcheck_args(tensors, group_name: str) -> tuple:
    x, topk_idx, weight = tensors
    world = comm.world_size(comm.group_from_name(group_name))
    return (x, topk_idx, weight, weight.shape[0] * world, group_name, "decomposed", True)


def plain_torch(tensors, pg):
    """What a torch user writes: the counts, then ``all_to_all_single`` with split sizes, then one
    GEMM per local expert over its rows from every source."""
    x, topk_idx, weight = tensors
    x2 = x.reshape(-1, x.shape[-1])
    flat = topk_idx.reshape(-1)
    k = topk_idx.shape[-1]
    world = comm.world_size(pg)
    local = weight.shape[0]

    def all_to_all_then_expert_loop():
        import torch.distributed as dist

        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=local * world)
        received = torch.empty_like(counts)
        if world > 1:
            dist.all_to_all_single(received, counts, group=pg)
        else:
            received = counts
        send = counts.view(world, local).sum(1).tolist()
        table = received.view(world, local).tolist()
        rows = x2[order // k]
        moved = rows.new_empty((sum(map(sum, table)), rows.shape[1]))
        if world > 1:
            dist.all_to_all_single(moved, rows, [sum(t) for t in table], send, group=pg)
        else:
            moved = rows
        blocks = moved.split([c for row in table for c in row])
        return torch.cat([torch.cat([blocks[s * local + j] for s in range(world)]) @ weight[j]
                          for j in range(local)])
    return all_to_all_then_expert_loop


def virtual_cases():
    """The fused dispatch -> grouped GEMM on every rank's hook inputs, against the fp64 reference
    (tests/test_moe_fused.py checks the backward compositions and the routing edge cases)."""
    from ._hooks import case, in_fp64

    return {OP: case(make_inputs, fused_on_rank, _unfused_all_visible, in_fp64(reference_per_rank),
                     _flop, blocks_host=True)}


def fused_on_rank(pg, x, topk_idx, weight, **kw) -> Tensor:
    """This rank's ``out`` by the fused implementation (``pg``: a group or a virtual rank)."""
    x2, idx2 = _flat(x, topk_idx)
    experts = comm.world_size(pg) * weight.shape[0]
    return OPS[OP].fused_function()(x2, idx2, weight, experts, pg, False, **kw)[0]


def _unfused_all_visible(inputs, rank: int) -> Tensor:
    return reference_per_rank(inputs)[rank][0].to(inputs[rank][0].dtype)


def _flop(world, rows, n, k) -> float:
    """One rank's GEMM FLOPs on average: rows * TOPK pairs of n x k."""
    return 2.0 * rows * TOPK * n * (k or n)
