"""``moe_combine(y, topk_weights, topk_idx, layout, weight=None, group=None) -> out`` -- the second
half of an expert-parallel mixture-of-experts layer: with ``weight``, the local experts' last GEMM
runs on their rows; every row goes back to the rank its token came from, where each token's k
expert outputs are summed, weighted by ``topk_weights``:

    out[t] = sum_j topk_weights[t, j] * expert_{topk_idx[t, j]}(token t)

Shapes: ``y [R, N]`` the rows ``moe_dispatch`` returned on this rank (expert-major order), after
whatever the experts do in between (an activation); ``topk_weights [..., k]`` (any float dtype) and
``topk_idx [..., k]`` this rank's routing, as given to ``moe_dispatch``; ``layout [W, E/W]`` what
``moe_dispatch`` returned with ``y``; ``weight [E/W, N, H]`` this rank's experts' last projection
(``y_e @ weight[j]``). ``out`` is ``[..., H]`` in y's dtype; the weighted sum is taken in fp32 (fp64
for fp64 inputs). Without ``weight`` the rows are returned as they are (H = N).

Methods (docs/MOE.md)
  * unfused: one grouped GEMM, a permutation to source-major order, one ``all_to_all_single`` with
    split sizes, the weighted sum.
  * decomposed: every receive posted at once; the local experts compute the block of each
    destination rank in turn -- the other ranks' first, this rank's own last -- and each block is
    sent as soon as it is done, while the next one is computed.
  * fused (pyfused/fused/moe.py): one Triton grouped GEMM storing each tile into the buffer of the
    rank its rows return to and flagging each rank once its rows are stored; auto: as
    ``moe_dispatch`` decides from the same sizes (never fused).
Every method reads ``layout`` on the host (a host synchronization on a GPU; the fused one reads
its count exchange too) and trusts it: it must be the one ``moe_dispatch`` returned for this
``topk_idx`` on every rank. A ``y`` whose rows differ from its total is an error on that rank
alone; layouts that do not fit together across ranks are found only in validation mode "always"
(one all-gather of 2W counts per call, then the same error on every rank); otherwise the
transfers' sizes disagree, which gloo reports by aborting the process.

Autograd, with C the combine of the expert outputs G(y, weight) and P the returned outputs per
(token, choice) pair:
  grad_topk_weights[t, j] = <grad_out[t], P[t, j]>  (P kept by the forward);
  grad_y, grad_weight     = ``moe_dispatch`` of the rows topk_weights[t, j] * grad_out[t] (one per
                            pair) with the transposed weight, by the same method, and the received
                            rows' weight gradient y_e^T @ received_e.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import comm
from . import _common, _fused, moe_exchange
from ._dispatch import dispatched
from .moe_dispatch import (
    _ABSENT,
    EXPERTS_PER_RANK,
    TOPK,
    auto_preference,
    expert_major_pairs,
    expert_weights,
    routed_tokens,
    tokenless,
)
from .moe_exchange import Routing
from .moe_grouped_mm import grouped_mm
from .registry import OPS

OP = "moe_combine"
_CODE = OPS[OP].code
INPUTS = ("y", "topk_weights", "topk_idx", "layout", "weight")


def moe_combine_ref(y_per_rank: Sequence[Tensor], topk_weights_per_rank: Sequence[Tensor],
                    topk_idx_per_rank: Sequence[Tensor], weight_per_rank=None,
                    num_experts: int = 0) -> List[Tensor]:
    """fp32 (fp64 for fp64 inputs) reference on one device: every rank's out [..., H]."""
    world = len(y_per_rank)
    if not num_experts:
        num_experts = world * weight_per_rank[0].shape[0]
    dt = torch.promote_types(y_per_rank[0].dtype, torch.float32)
    k = topk_idx_per_rank[0].shape[-1]
    width = y_per_rank[0].shape[1] if weight_per_rank is None else weight_per_rank[0].shape[2]
    outs = [y_per_rank[0].new_zeros((w.reshape(-1, k).shape[0], width), dtype=dt)
            for w in topk_weights_per_rank]
    for dest, (rows, _) in enumerate(expert_major_pairs(topk_idx_per_rank, num_experts)):
        for i, (source, p, j) in enumerate(rows):
            row = y_per_rank[dest][i].to(dt)
            if weight_per_rank is not None:
                row = row @ weight_per_rank[dest][j].to(dt)
            scale = topk_weights_per_rank[source].reshape(-1)[p].to(dt)
            outs[source][p // k] += scale * row
    return [out.view(*w.shape[:-1], width) for out, w in zip(outs, topk_weights_per_rank)]


# ---------------------------------------------------------------------------------------------
# The methods

def combine_rows(op: str, y: Tensor, routing: Routing, weight: Optional[Tensor], pg,
                 method: str) -> Tensor:
    """Expert-major rows y [R, N] -> the expert outputs back on their source ranks, [P, H] in this
    rank's pair order."""
    counts = routing.expert_counts
    if routing.world == 1:
        return y if weight is None else grouped_mm(y, weight, counts)
    if method == "decomposed":
        return _decomposed(op, y, routing, weight, pg)
    done = y if weight is None else grouped_mm(y, weight, counts)
    return moe_exchange.exchange(op, routing.expert_to_source_major(done), routing.recv,
                                 routing.send, pg)


def _decomposed(op, y, routing, weight, pg):
    width = y.shape[1] if weight is None else weight.shape[2]
    returned = y.new_empty((sum(routing.send), width))
    staged = y.new_empty((sum(routing.recv), width))
    at, send_at = moe_exchange.offsets(routing.recv), moe_exchange.offsets(routing.send)
    transfers = moe_exchange.PeerTransfers(op, pg, returned, routing.send)
    index = routing.expert_index()
    order = moe_exchange.source_order(routing.world, routing.rank)
    for dest in order[1:] + order[:1]:  # the other ranks' blocks first, this rank's own last
        own = dest == routing.rank
        target = moe_exchange.block(returned, send_at, dest) if own else \
            moe_exchange.block(staged, at, dest)
        rows = moe_exchange.block(y, at, dest) if index is None else \
            y[moe_exchange.block(index, at, dest)]
        if weight is None:
            target.copy_(rows)
        else:
            grouped_mm(rows, weight, routing.counts[dest], out=target)
        if not own:
            transfers.send_to(dest, target)
    transfers.finish()
    return returned


def weighted_sum(returned: Tensor, routing: Routing, topk_weights: Optional[Tensor], tokens: int,
                 k: int) -> Tuple[Tensor, Tensor]:
    """(out [T, H]: each token's k rows summed, weighted; the rows per pair [T * k, H])."""
    start = moe_exchange.now()
    pairs = returned.index_select(0, moe_exchange.inverse_permutation(routing.order))
    dt = torch.promote_types(returned.dtype, torch.float32)
    by_token = pairs.view(tokens, k, pairs.shape[1]).to(dt)
    if topk_weights is None:
        out = by_token.sum(1)
    else:
        out = torch.bmm(topk_weights.reshape(tokens, 1, k).to(dt), by_token).squeeze(1)
    moe_exchange.note("sum", start)
    return out.to(returned.dtype), pairs


@comm.names_failures(OP)
def _run(y: Tensor, topk_weights: Optional[Tensor], topk_idx: Tensor, layout: Tensor,
         weight: Optional[Tensor], pg, method: str) -> Tuple[Tensor, Tensor]:
    """2-D topk_weights / topk_idx [T, k]: (out [T, H], the returned rows per pair [T * k, H])."""
    routing = moe_exchange.routing_from_layout(topk_idx, layout, pg)
    received = sum(routing.recv)
    if y.shape[0] != received:
        raise comm.InputError(f"pyfused.{OP}: y has {y.shape[0]} rows but layout says this rank "
                              f"received {received}: pass the layout moe_dispatch returned with y")
    if comm.validation_mode() == "always" and routing.world > 1:
        moe_exchange.check_layouts_fit(OP, routing, pg)
    if method == "fused":
        returned = _fused.run(OP, y, topk_idx, layout, weight, pg)
    else:
        returned = combine_rows(OP, y, routing, weight, pg, method)
    return weighted_sum(returned, routing, topk_weights, topk_idx.shape[0], topk_idx.shape[1])


# ---------------------------------------------------------------------------------------------
# The registered op

@torch.library.custom_op("pyfused::moe_combine", mutates_args=(), **_common.OP_TAGS)
def _moe_combine_op(y: Tensor, topk_weights: Optional[Tensor], topk_idx: Tensor, layout: Tensor,
                    weight: Optional[Tensor], group_name: str, method: str, keep_pairs: bool
                    ) -> Tuple[Tensor, Tensor]:
    """2-D op: (out [T, H], the returned rows per pair [T * k, H] if keep_pairs, else empty)."""
    pg = comm.group_from_name(group_name)
    if not _common.take_validated():
        pg, choice = prepare(y, topk_weights, topk_idx, layout, weight, pg, method)
        method = choice.method
    out, pairs = _run(y, topk_weights, topk_idx, layout, weight, pg, method)
    return out, (pairs if keep_pairs else y.new_empty((0,)))


@_moe_combine_op.register_fake
def _(y, topk_weights, topk_idx, layout, weight, group_name, method, keep_pairs):
    tokens, k = topk_idx.shape
    width = y.shape[1] if weight is None else weight.shape[2]
    pairs = y.new_empty((tokens * k, width)) if keep_pairs else y.new_empty((0,))
    return y.new_empty((tokens, width)), pairs


def _setup_context(ctx, inputs, output):
    y, topk_weights, topk_idx, layout, weight, group_name, method, _ = inputs
    ctx.group_name, ctx.method = group_name, method
    ctx.save_for_backward(y, topk_weights, topk_idx, layout, weight, output[1])


def _backward(ctx, grad_out, _grad_pairs):
    y, topk_weights, topk_idx, layout, weight, pairs = ctx.saved_tensors
    tokens, k = topk_idx.shape
    grad_y = grad_weights = grad_weight = None
    dt = torch.promote_types(grad_out.dtype, torch.float32)
    if ctx.needs_input_grad[1]:
        by_pair = pairs.view(tokens, k, grad_out.shape[1]).to(dt)
        grad_weights = (by_pair * grad_out.to(dt).unsqueeze(1)).sum(-1).to(topk_weights.dtype)
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[4]:
        if topk_weights is None:  # each token's gradient goes to all of its k experts
            rows, idx = grad_out, topk_idx
        else:  # one row per (token, choice): the choice's weight times the token's gradient
            rows = (topk_weights.to(dt).unsqueeze(-1) * grad_out.to(dt).unsqueeze(1))
            rows = rows.to(grad_out.dtype).reshape(tokens * k, grad_out.shape[1])
            idx = topk_idx.reshape(tokens * k, 1)
        world = layout.shape[0]
        back = None if weight is None else weight.transpose(1, 2)
        keep = ctx.needs_input_grad[4]
        grad_y, _, received = torch.ops.pyfused.moe_dispatch(
            rows, idx, back, world * layout.shape[1], ctx.group_name, ctx.method, keep, layout)
        if keep:
            grad_weight = torch.ops.pyfused.moe_expert_weight_grad(y, received, layout)
    return grad_y, grad_weights, None, None, grad_weight, None, None, None


_moe_combine_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Validation (every rank, before any collective of the op): _common.prepare with this contract

def check_inputs(sigs: List[_common.CallSignature], world: int,
                 allowed_devices: Tuple[str, ...]) -> Optional[str]:
    """The contract of y [R, N], topk_weights / topk_idx [..., k], layout [W, E/W], weight
    [E/W, N, H] or none (token dims dropped, ``moe_dispatch.tokenless``); pure."""
    for r, s in enumerate(sigs):
        problem = _rank_problem(s, world, allowed_devices)
        if problem:
            return problem + (f" (rank {r})" if len(sigs) > 1 else "")
    return (comm.differs(sigs, "y's width N", lambda s: s.tensors[0].shape[-1])
            or comm.differs(sigs, "y's dtype", lambda s: s.tensors[0].dtype)
            or comm.differs(sigs, "k (topk_idx's last dim)", lambda s: s.tensors[2].shape[-1])
            or comm.differs(sigs, "layout's shape", lambda s: s.tensors[3].shape)
            or comm.differs(sigs, "whether topk_weights are given", lambda s: s.options[0])
            or comm.differs(sigs, "whether a weight is given", lambda s: s.options[1])
            or comm.differs(sigs, "weight", lambda s: s.tensors[4] if s.options[1] else None,
                            lambda s: s.tensors[4].describe() if s.options[1] else "none"))


def _rank_problem(s: _common.CallSignature, world: int, allowed_devices) -> Optional[str]:
    y, weights, idx, layout, w = s.tensors
    has_weights, has_weight, shapes_ok = s.options
    if y.dtype not in _common.FLOAT_DTYPES or not shapes_ok:
        return (f"y must be 2-D [R, N] of a float dtype (as moe_dispatch returns it), topk_idx "
                f"[..., k] and topk_weights (if given) of topk_idx's shape; got y {y.describe()}")
    if idx.dtype not in moe_exchange.INDEX_DTYPES:
        return f"topk_idx must be int64 or int32; got topk_idx {idx.describe()}"
    if has_weights and weights.dtype not in _common.FLOAT_DTYPES:
        return f"topk_weights must be a float tensor; got topk_weights {weights.describe()}"
    if layout.dtype != torch.int64 or len(layout.shape) != 2 or layout.shape[0] != world \
            or layout.shape[1] < 1:
        return (f"layout must be int64 [W={world}, experts per rank], as moe_dispatch returns it; "
                f"got layout {layout.describe()}")
    devices = {y.device, idx.device, layout.device} | ({weights.device} if has_weights else set()) \
        | ({w.device} if has_weight else set())
    if len(devices) > 1:
        return "y, topk_weights, topk_idx, layout and weight must be on one device"
    if world > 1 and y.device not in allowed_devices:
        return (f"tensors on {y.device} cannot be communicated by this process group's backend "
                f"(it serves {', '.join(allowed_devices)})")
    if has_weight and (len(w.shape) != 3 or w.dtype != y.dtype or w.shape[1] != y.shape[1]
                       or w.shape[0] != layout.shape[1]):
        return (f"weight must be [experts per rank, N, H] in y's dtype with N = y's width; got y "
                f"{y.describe()}, layout {layout.describe()}, weight {w.describe()}")
    return None


def _options(y, topk_weights, topk_idx, weight) -> Tuple[int, int, int]:
    tensor = lambda t: isinstance(t, Tensor)  # noqa: E731
    shapes_ok = (tensor(y) and y.dim() == 2 and tensor(topk_idx) and topk_idx.dim() >= 2
                 and (topk_weights is None or tensor(topk_weights)
                      and topk_weights.shape == topk_idx.shape))
    return int(topk_weights is not None), int(weight is not None), int(shapes_ok)


def prepare(y, topk_weights, topk_idx, layout, weight, group, method):
    """Validate on every rank and choose the method; identical outcome everywhere."""
    tensors = (tokenless(y), _ABSENT if topk_weights is None else tokenless(topk_weights),
               tokenless(topk_idx), layout, _ABSENT if weight is None else weight)
    return _common.prepare(OP, INPUTS, tensors, group, method, check=check_inputs,
                           options=_options(y, topk_weights, topk_idx, weight),
                           auto=auto_preference)


# ---------------------------------------------------------------------------------------------
# The functional op, made by the shared dispatch path (pyfused/ops/_dispatch.py)

def _plan(group, method, y, topk_weights, topk_idx, layout, weight) -> _common.Plan:
    if torch.compiler.is_compiling():
        return _common.traced_plan(OP, group, method)
    pg, choice = prepare(y, topk_weights, topk_idx, layout, weight, group, method)
    return _common.new_plan(OP, pg, choice, 0, (y, topk_weights, weight),
                            (group, method, y, topk_weights, topk_idx, layout, weight))


def _flat(topk_weights, topk_idx):
    k = topk_idx.shape[-1]
    return (None if topk_weights is None else topk_weights.reshape(-1, k)), topk_idx.reshape(-1, k)


def _shaped(out: Tensor, topk_idx: Tensor) -> Tensor:
    return out if topk_idx.dim() == 2 else out.view(*topk_idx.shape[:-1], out.shape[-1])


def _local(group, method, y, topk_weights, topk_idx, layout, weight):
    return _shaped(_run(y, *_flat(topk_weights, topk_idx), layout, weight, None, "unfused")[0],
                   topk_idx)


def _direct(plan, group, method, y, topk_weights, topk_idx, layout, weight):
    out, _ = _run(y, *_flat(topk_weights, topk_idx), layout, weight, plan.pg, plan.method)
    return _shaped(out, topk_idx)


def _registered(plan, group, method, y, topk_weights, topk_idx, layout, weight):
    weights2, idx2 = _flat(topk_weights, topk_idx)
    keep = torch.is_grad_enabled() and topk_weights is not None and topk_weights.requires_grad
    out, _ = _common.call_op(plan, torch.ops.pyfused.moe_combine, y, weights2, idx2, layout, weight,
                             plan.group_name, plan.method, keep)
    return _shaped(out, topk_idx)


@dispatched(_CODE, _plan, _local, _direct, _registered)
def moe_combine(y: Tensor, topk_weights: Optional[Tensor], topk_idx: Tensor, layout: Tensor,
                weight: Optional[Tensor] = None, group=None, *, method: str = "auto") -> Tensor:
    """Each token's k expert outputs (``y`` times ``weight``, if given), back on this rank and
    summed with ``topk_weights`` (None: unweighted); see the module docstring."""


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use

def make_inputs(world, rows, n, k=0, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (y [R, k or n], topk_weights [rows..., TOPK], topk_idx, layout, weight
    [EXPERTS_PER_RANK, k or n, n]): the routing of ``moe_dispatch``'s hook inputs for seed 0 and
    rows of the size each rank's dispatch would return. The routing is the same for every seed,
    so that ranks which build their inputs from different seeds still hold layouts that fit
    together (a layout must come from the dispatch of the same routing on every rank)."""
    from ._hooks import randn

    width = k or n
    idx = [i for _, i in routed_tokens(world, rows, n, dtype, device, seed=0)]
    layouts = [layout for _, layout in expert_major_pairs(idx, EXPERTS_PER_RANK * world)]
    g = torch.Generator().manual_seed(seed + 1)
    weights = expert_weights(world, width, n, dtype, device, seed)
    inputs = []
    for rank in range(world):
        y = randn(g, (int(layouts[rank].sum()), width), dtype, device)
        gates = torch.rand(*idx[rank].shape, generator=g) + 0.1
        gates = (gates / gates.sum(-1, keepdim=True)).to(dtype).to(device)
        inputs.append((y, gates, idx[rank], layouts[rank].to(device), weights[rank]))
    return inputs


def reference_per_rank(inputs):
    """Every rank's out by ``moe_combine_ref``."""
    return moe_combine_ref([i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs],
                           [i[4] for i in inputs])


def opcheck_args(tensors, group_name: str) -> tuple:
    return (*tensors, group_name, "decomposed", True)


def plain_torch(tensors, pg):
    """What a torch user writes: one GEMM per local expert, the rows regrouped by source, an
    ``all_to_all_single`` with split sizes, then each token's weighted sum."""
    y, topk_weights, topk_idx, layout, weight = tensors
    flat = topk_idx.reshape(-1)
    k = topk_idx.shape[-1]
    world = comm.world_size(pg)
    local = weight.shape[0]

    def expert_loop_then_all_to_all():
        import torch.distributed as dist

        table = layout.tolist()
        per_expert = [sum(table[s][j] for s in range(world)) for j in range(local)]
        done = [rows @ weight[j] for j, rows in enumerate(y.split(per_expert))]
        pieces = [d.split([table[s][j] for s in range(world)]) for j, d in enumerate(done)]
        back = torch.cat([pieces[j][s] for s in range(world) for j in range(local)])
        send = torch.bincount(flat, minlength=local * world).view(world, local).sum(1).tolist()
        returned = back.new_empty((len(flat), back.shape[1]))
        if world > 1:
            dist.all_to_all_single(returned, back, send, [sum(row) for row in table], group=pg)
        else:
            returned = back
        pairs = torch.empty_like(returned)
        pairs[torch.argsort(flat, stable=True)] = returned
        by_token = pairs.view(-1, k, pairs.shape[1])
        return (by_token * topk_weights.reshape(-1, k, 1)).sum(1)
    return expert_loop_then_all_to_all


def virtual_cases():
    """The fused grouped GEMM -> combine on every rank's hook inputs, the weighted sum included,
    against the fp64 reference (tests/test_moe_fused.py checks the backward compositions)."""
    from ._hooks import case, in_fp64

    return {OP: case(make_inputs, fused_on_rank, _unfused_all_visible, in_fp64(reference_per_rank),
                     _flop, blocks_host=True)}


def fused_on_rank(pg, y, topk_weights, topk_idx, layout, weight, **kw) -> Tensor:
    """This rank's ``out`` by the fused implementation and the weighted sum of ``_run``."""
    weights2, idx2 = _flat(topk_weights, topk_idx)
    returned = OPS[OP].fused_function()(y, idx2, layout, weight, pg, **kw)
    routing = moe_exchange.routing_from_layout(idx2, layout, pg)
    out, _ = weighted_sum(returned, routing, weights2, idx2.shape[0], idx2.shape[1])
    return _shaped(out, topk_idx)


def _unfused_all_visible(inputs, rank: int) -> Tensor:
    return reference_per_rank(inputs)[rank].to(inputs[rank][0].dtype)


def _flop(world, rows, n, k) -> float:
    """One rank's GEMM FLOPs on average: rows * TOPK pairs of (k or n) x n."""
    return 2.0 * rows * TOPK * n * (k or n)
