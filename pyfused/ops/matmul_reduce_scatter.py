"""``matmul_reduce_scatter(a, b) = reduce_scatter(a @ b, dim=0)`` (sum) -- the row-parallel /
sequence-parallel output side of a tensor-parallel layer.

Shapes: ``a`` is ``[M, ..., K]`` with M divisible by the world size W (same shape on every rank),
``b`` is ``[K, N]``; the result is ``[M/W, ..., N]``: rows r*M/W..(r+1)*M/W of sum_q a_q @ b_q.

Methods
  * unfused: one GEMM, then ``reduce_scatter_single`` (reduce_scatter_tensor).
  * decomposed: a ring of W steps. At step s rank r computes the partial product of chunk
    c = (r - s - 1) mod W, adds the running sum for c received from rank r-1, and sends it on to r+1;
    the GEMM of step s+1 runs while step s's send/recv are in flight. After W steps rank r holds the
    full sum of its own chunk c = r. Partial sums travel in the input dtype, as NCCL's do.
  * fused: symmetric-memory kernels (``pyfused.ops._fused``), where built.

Autograd: grad_a = all_gather(grad) @ b^T (``all_gather_matmul``, same method, overlapped);
grad_b = a^T @ all_gather(grad), reusing the gathered gradient of that call.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from . import _common, _fused, _hooks
from ._dispatch import dispatched
from .registry import OPS

OP = "matmul_reduce_scatter"
_CODE = OPS[OP].code


def matmul_reduce_scatter_ref(a_per_rank: Sequence[Tensor], b_per_rank: Sequence[Tensor],
                              rank: int) -> Tensor:
    """fp32 (fp64 for fp64 inputs) reference on one device: rank ``rank``'s chunk of sum_q a_q @ b_q."""
    dt = torch.promote_types(b_per_rank[0].dtype, torch.float32)
    total = sum(torch.matmul(a.to(dt), b.to(dt)) for a, b in zip(a_per_rank, b_per_rank))
    m = total.shape[0] // len(a_per_rank)
    return total[rank * m:(rank + 1) * m]


def _unfused(a: Tensor, b: Tensor, pg) -> Tensor:
    w = comm.world_size(pg)
    full = a @ b
    if w == 1:
        return full
    out = full.new_empty((full.shape[0] // w, full.shape[1]))
    comm.reduce_scatter_single(out, full, group=pg)
    return out


def chunked_ring_matmul_reduce_scatter(a: Tensor, b: Tensor, pg) -> Tensor:
    """The decomposed schedule on 2-D ``a`` [M, K]; returns this rank's [M/W, N] chunk of the sum."""
    w, r = comm.world_size(pg), comm.rank(pg)
    m = a.shape[0] // w
    to_next = comm.global_rank(pg, (r + 1) % w)
    from_prev = comm.global_rank(pg, (r - 1) % w)
    pending, incoming = [], None
    for step in range(w):
        c = (r - step - 1) % w
        partial = torch.matmul(a[c * m:(c + 1) * m], b)  # overlaps the previous step's transfers
        for work in pending:
            work.wait()
        if step > 0:
            partial.add_(incoming)
        pending = []
        if step < w - 1:
            incoming = torch.empty_like(partial)
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, partial, to_next, pg),
                dist.P2POp(dist.irecv, incoming, from_prev, pg),
            ])
    return partial


@comm.names_failures(OP)
def _run(a: Tensor, b: Tensor, pg, method: str) -> Tensor:
    """2-D: rows [r*M/W, (r+1)*M/W) of the sum over ranks of a @ b, by ``method``."""
    if method == "fused":
        return _fused.run(OP, a, b, pg)
    if method == "decomposed" and comm.world_size(pg) > 1:
        return chunked_ring_matmul_reduce_scatter(a, b, pg)
    return _unfused(a, b, pg)


@torch.library.custom_op("pyfused::matmul_reduce_scatter", mutates_args=(), **_common.OP_TAGS)
def _matmul_reduce_scatter_op(a: Tensor, b: Tensor, group_name: str, method: str) -> Tensor:
    """2-D op: rows [r*M/W, (r+1)*M/W) of the sum over ranks of a @ b. ``method`` as requested
    (validated here unless the functional wrapper just did)."""
    if _common.take_validated():
        return _run(a, b, comm.group_from_name(group_name), method)
    pg, choice = _common.prepare_matmul(OP, a, b, comm.group_from_name(group_name), method)
    return _run(a, b, pg, choice.method)


@_matmul_reduce_scatter_op.register_fake
def _(a, b, group_name, method):
    w = comm.world_size(comm.group_from_name(group_name))
    return a.new_empty((a.shape[0] // w, b.shape[1]))


def _setup_context(ctx, inputs, output):
    a, b, group_name, method = inputs
    ctx.group_name = group_name
    ctx.method = method
    ctx.save_for_backward(a, b)


def backward_from_gathered(grad_out: Tensor, a: Tensor, b: Tensor, group_name: str, method: str,
                           need_a: bool, need_b: bool, keep_gathered: bool = False):
    """(grad_a, grad_b, gathered) of the 2-D op: one ``all_gather_matmul`` of ``grad_out`` gives
    grad_a and the gathered gradient, which grad_b's GEMM reuses. ``gathered`` is None unless
    grad_b or ``keep_gathered`` (a caller with more to take from it: a layer's bias) asked for it."""
    method = _common.backward_method(method, "all_gather_matmul")
    grad_a, gathered = torch.ops.pyfused.all_gather_matmul(grad_out, b.t(), group_name, method,
                                                           need_b or keep_gathered)
    grad_b = _common.weight_grad(a, gathered, b) if need_b else None
    return (grad_a if need_a else None), grad_b, (gathered if need_b or keep_gathered else None)


def _backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    grad_a, grad_b, _ = backward_from_gathered(grad_out, a, b, ctx.group_name, ctx.method,
                                               ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    return grad_a, grad_b, None, None


_matmul_reduce_scatter_op.register_autograd(_backward, setup_context=_setup_context)


def _plan(group, method, a, b) -> _common.Plan:
    return _common.plan_matmul(OP, a, b, group, method)


def _local(group, method, a, b) -> Tensor:
    return torch.matmul(a, b)  # one rank, no autograd graph: the product is the whole op


def _direct(plan, group, method, a, b) -> Tensor:
    if a.dim() == 2:
        return _run(a, b, plan.pg, plan.method)
    out = _run(a.reshape(-1, a.shape[-1]), b, plan.pg, plan.method)
    return out.view(a.shape[0] // plan.world, *a.shape[1:-1], b.shape[1])


def _registered(plan, group, method, a, b) -> Tensor:
    a2 = a if a.dim() == 2 else a.reshape(-1, a.shape[-1])
    out = _common.call_op(plan, torch.ops.pyfused.matmul_reduce_scatter, a2, b, plan.group_name,
                          plan.method)
    return out if a.dim() == 2 else out.view(a.shape[0] // plan.world, *a.shape[1:-1], b.shape[1])


@dispatched(_CODE, _plan, _local, _direct, _registered)
def matmul_reduce_scatter(a: Tensor, b: Tensor, group=None, *, method: str = "auto") -> Tensor:
    """``reduce_scatter(a @ b, dim=0)`` (sum) over ``group``; see the module docstring."""


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use


def make_inputs(world, rows, n, k, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (a [rows * W, ..., k], b [k, n]); rank r's result is rows r*rows..(r+1)*rows."""
    return _hooks.gemm_inputs(world, rows, n, k, dtype, device, seed, gathered=False)


def reference_per_rank(inputs):
    """Rank r's rows of the sum of every rank's a @ b, for each rank r."""
    a_all, b_all = [a for a, _ in inputs], [b for _, b in inputs]
    return [matmul_reduce_scatter_ref(a_all, b_all, r) for r in range(len(inputs))]


def opcheck_args(tensors, group_name: str) -> tuple:
    a, b = tensors
    return (a, b, group_name, "decomposed")


def plain_torch(tensors, pg):
    """The GEMM, then torch.distributed's reduce-scatter (none on one rank)."""
    a, b = tensors
    world = comm.world_size(pg)

    def matmul_then_reduce_scatter():
        y = a @ b
        if world == 1:
            return y
        out = y.new_empty((y.shape[0] // world, y.shape[1]))
        comm.reduce_scatter_single(out, y, group=pg)
        return out
    return matmul_then_reduce_scatter


def virtual_cases():
    """The forward, and the backward w.r.t. a: all_gather_matmul's kernel on grad and b^T."""
    forward = _hooks.case(make_inputs, fused_on_rank, unfused_all_visible,
                          _hooks.in_fp64(reference_per_rank), _hooks.gemm_flop)
    return {OP: forward, f"{OP}.bwd": _hooks.backward_case(OPS["all_gather_matmul"])}


def fused_on_rank(pg, a, b, **kw) -> Tensor:
    return OPS[OP].fused_function()(a, b, pg, **kw)


def unfused_all_visible(inputs, rank: int) -> Tensor:
    """Rank ``rank``'s rows of every rank's product, summed in fp32, in the input dtype."""
    m = inputs[0][0].shape[0] // len(inputs)
    parts = [a[rank * m:(rank + 1) * m] @ b for a, b in inputs]
    out = parts[0].float()
    for p in parts[1:]:
        out += p.float()
    return out.to(parts[0].dtype)
