"""``all_gather_matmul(a, b) = all_gather(a, dim=0) @ b`` -- the column-parallel / sequence-parallel
input side of a tensor-parallel layer.

Shapes: ``a`` is this rank's shard ``[m, ..., K]`` (same shape on every rank), ``b`` is ``[K, N]``
(this rank's own weight); the result is ``[W*m, ..., N]`` with rank q's shard in rows q*m..(q+1)*m.

Methods
  * unfused: ``all_gather_single`` (all_gather_into_tensor) then one GEMM (the reference and baseline).
  * decomposed: a ring of W steps. At step s rank r holds the shard of rank (r - s) mod W; it posts
    send(that shard -> r+1) and recv(next shard <- r-1) as one batched p2p call and, while they are in
    flight, multiplies the shard it holds into its rows of the output. On NCCL the transfers run on
    NCCL's stream beside the GEMM on the compute stream; on gloo in gloo's threads.
  * fused: symmetric-memory kernels (``pyfused.ops._fused``), where built.

Autograd (the outputs of different ranks are different tensors, so their gradients add):
  grad_a = reduce_scatter(grad @ b^T)  -- ``matmul_reduce_scatter`` with the same method, overlapped;
  grad_b = all_gather(a)^T @ grad      -- reusing the gathered input the forward kept.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from . import _common, _fused, _hooks
from ._dispatch import dispatched
from .registry import OPS

OP = "all_gather_matmul"
_CODE = OPS[OP].code


def all_gather_matmul_ref(shards: Sequence[Tensor], b: Tensor) -> Tensor:
    """fp32 (fp64 for fp64 inputs) reference on one device: ``cat(shards, dim=0) @ b``."""
    dt = torch.promote_types(b.dtype, torch.float32)
    return torch.matmul(torch.cat([s.to(dt) for s in shards]), b.to(dt))


def _unfused(a: Tensor, b: Tensor, pg) -> Tuple[Tensor, Tensor]:
    w = comm.world_size(pg)
    if w == 1:
        return a @ b, a
    gathered = a.new_empty((w * a.shape[0], a.shape[1]))
    comm.all_gather_single(gathered, a.contiguous(), group=pg)
    return gathered @ b, gathered


def chunked_ring_all_gather_matmul(a: Tensor, b: Tensor, pg, keep_gathered: bool
                                   ) -> Tuple[Tensor, Optional[Tensor]]:
    """The decomposed schedule on 2-D ``a`` [m, K]; returns (out [W*m, N], gathered or None)."""
    w, r = comm.world_size(pg), comm.rank(pg)
    m, k = a.shape
    a = a.contiguous()
    out = a.new_empty((w * m, b.shape[1]))
    to_next = comm.global_rank(pg, (r + 1) % w)
    from_prev = comm.global_rank(pg, (r - 1) % w)
    if keep_gathered:
        gathered = a.new_empty((w * m, k))
        gathered[r * m:(r + 1) * m].copy_(a)
        slots = None
    else:
        gathered = None
        slots = [a.new_empty((m, k)), a.new_empty((m, k))]  # double buffer: recv into one, GEMM the other
    held = a
    for step in range(w):
        src = (r - step) % w
        pending = []
        if step < w - 1:
            incoming_src = (r - step - 1) % w
            incoming = (gathered[incoming_src * m:(incoming_src + 1) * m] if keep_gathered
                        else slots[step % 2])
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, held, to_next, pg),
                dist.P2POp(dist.irecv, incoming, from_prev, pg),
            ])
        torch.matmul(held, b, out=out[src * m:(src + 1) * m])
        for work in pending:
            work.wait()
        if step < w - 1:
            held = incoming
    return out, gathered


@comm.names_failures(OP)
def _run(a: Tensor, b: Tensor, pg, method: str, keep_gathered: bool
         ) -> Tuple[Tensor, Optional[Tensor]]:
    """2-D: (all_gather(a) @ b, all_gather(a) or None) by ``method``."""
    if method == "fused":
        return _fused.run(OP, a, b, pg, keep_gathered)
    if method == "decomposed" and comm.world_size(pg) > 1:
        return chunked_ring_all_gather_matmul(a, b, pg, keep_gathered)
    return _unfused(a, b, pg)


@torch.library.custom_op("pyfused::all_gather_matmul", mutates_args=(), **_common.OP_TAGS)
def _all_gather_matmul_op(a: Tensor, b: Tensor, group_name: str, method: str,
                          keep_gathered: bool) -> Tuple[Tensor, Tensor]:
    """2-D op: returns (all_gather(a) @ b, all_gather(a) if keep_gathered else an empty tensor).
    ``method`` as requested (validated here unless the functional wrapper just did)."""
    if _common.take_validated():
        pg = comm.group_from_name(group_name)
    else:
        pg, choice = _common.prepare_matmul(OP, a, b, comm.group_from_name(group_name), method)
        method = choice.method
    out, gathered = _run(a, b, pg, method, keep_gathered)
    if not keep_gathered:
        gathered = a.new_empty((0,))
    elif gathered is a:  # world size 1: an op output must not alias an input
        gathered = a.clone()
    return out, gathered


@_all_gather_matmul_op.register_fake
def _(a, b, group_name, method, keep_gathered):
    w = comm.world_size(comm.group_from_name(group_name))
    gathered = a.new_empty((w * a.shape[0], a.shape[1])) if keep_gathered else a.new_empty((0,))
    return a.new_empty((w * a.shape[0], b.shape[1])), gathered


def _setup_context(ctx, inputs, output):
    a, b, group_name, method, keep_gathered = inputs
    ctx.group_name = group_name
    ctx.method = method
    ctx.save_for_backward(b, output[1])


def _backward(ctx, grad_out, _grad_gathered):
    b, gathered = ctx.saved_tensors
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        method = _common.backward_method(ctx.method, "matmul_reduce_scatter")
        grad_a = torch.ops.pyfused.matmul_reduce_scatter(grad_out, b.t(), ctx.group_name, method)
    if ctx.needs_input_grad[1]:
        grad_b = _common.weight_grad(gathered, grad_out, b)
    return grad_a, grad_b, None, None, None


_all_gather_matmul_op.register_autograd(_backward, setup_context=_setup_context)


def _plan(group, method, a, b) -> _common.Plan:
    return _common.plan_matmul(OP, a, b, group, method)


def _local(group, method, a, b) -> Tensor:
    return torch.matmul(a, b)  # one rank, no autograd graph: the product is the whole op


def _direct(plan, group, method, a, b) -> Tensor:
    if a.dim() == 2:
        return _run(a, b, plan.pg, plan.method, False)[0]
    out, _ = _run(a.reshape(-1, a.shape[-1]), b, plan.pg, plan.method, False)
    return out.view(plan.world * a.shape[0], *a.shape[1:-1], b.shape[1])


def _registered(plan, group, method, a, b) -> Tensor:
    a2 = a if a.dim() == 2 else a.reshape(-1, a.shape[-1])
    keep = torch.is_grad_enabled() and b.requires_grad
    out, _ = _common.call_op(plan, torch.ops.pyfused.all_gather_matmul, a2, b, plan.group_name,
                             plan.method, keep)
    return out if a.dim() == 2 else out.view(plan.world * a.shape[0], *a.shape[1:-1], b.shape[1])


@dispatched(_CODE, _plan, _local, _direct, _registered)
def all_gather_matmul(a: Tensor, b: Tensor, group=None, *, method: str = "auto") -> Tensor:
    """``all_gather(a, dim=0) @ b`` over ``group``; see the module docstring."""


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use


def make_inputs(world, rows, n, k, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (a [rows, ..., k], its shard; b [k, n], its own weight)."""
    return _hooks.gemm_inputs(world, rows, n, k, dtype, device, seed, gathered=True)


def reference_per_rank(inputs):
    """Every rank's shard gathered, times that rank's own weight."""
    shards = [a for a, _ in inputs]
    return [all_gather_matmul_ref(shards, b) for _, b in inputs]


def opcheck_args(tensors, group_name: str) -> tuple:
    a, b = tensors
    return (a, b, group_name, "decomposed", True)


def plain_torch(tensors, pg):
    """torch.distributed's all-gather (none on one rank), then the GEMM."""
    a, b = tensors
    world = comm.world_size(pg)

    def all_gather_then_matmul():
        if world == 1:
            return a @ b
        gathered = a.new_empty((world * a.shape[0], a.shape[1]))
        comm.all_gather_single(gathered, a, group=pg)
        return gathered @ b
    return all_gather_then_matmul


def virtual_cases():
    """The forward; the forward keeping the gathered input (what autograd needs for b's gradient);
    and the backward w.r.t. a, which is matmul_reduce_scatter's kernel on grad and b^T."""
    reference = _hooks.in_fp64(reference_per_rank)
    return {
        OP: _hooks.case(make_inputs, fused_on_rank, unfused_all_visible, reference,
                        _hooks.gemm_flop),
        f"{OP}.keep_gathered": _hooks.case(make_inputs, _fused_keeping_gathered,
                                           _unfused_keeping_gathered, _with_gathered(reference),
                                           _hooks.gemm_flop),
        f"{OP}.bwd": _hooks.backward_case(OPS["matmul_reduce_scatter"]),
    }


def fused_on_rank(pg, a, b, **kw) -> Tensor:
    return OPS[OP].fused_function()(a, b, pg, False, **kw)[0]


def unfused_all_visible(inputs, rank: int) -> Tensor:
    return torch.cat([a for a, _ in inputs]) @ inputs[rank][1]


def _fused_keeping_gathered(pg, a, b, **kw) -> Tuple[Tensor, Tensor]:
    return OPS[OP].fused_function()(a, b, pg, True, **kw)


def _unfused_keeping_gathered(inputs, rank: int) -> Tuple[Tensor, Tensor]:
    gathered = torch.cat([a for a, _ in inputs])
    return gathered @ inputs[rank][1], gathered


def _with_gathered(reference):
    def both(inputs):
        gathered = torch.cat([a.double() for a, _ in inputs])
        return [(out, gathered) for out in reference(inputs)]
    return both
