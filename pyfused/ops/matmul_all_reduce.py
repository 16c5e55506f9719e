"""``matmul_all_reduce(a, b) = all_reduce(a @ b)`` (sum) -- a row-parallel layer without sequence
parallelism.

Shapes: ``a`` is ``[d0, ..., K]``, ``b`` is ``[K, N]`` (same shapes on every rank); the result is
``[d0, ..., N]``, the same tensor on every rank.

Methods
  * unfused: one GEMM, then ``all_reduce``.
  * decomposed: the rows are cut into ``chunks`` pieces; as soon as piece i's GEMM is queued its
    all-reduce is launched asynchronously, so it runs while piece i+1 is multiplied. The all-reduces
    are joined at the end. By default (``chunks=0``, no tuned entry) pieces are kept large enough
    to hide a collective's fixed latency (``_common.default_chunks``): a small GEMM on CPU gets one
    piece, i.e. GEMM then an async all-reduce -- the unfused cost, never more.
  * fused: symmetric-memory kernels (``pyfused.ops._fused``), where built.

Autograd follows the tensor-parallel convention (Megatron's row-parallel layer): the output is
*replicated*, a loss computed from it is counted once, so its gradient arrives identical on every
rank and flows back without communication: grad_a = grad @ b^T, grad_b = a^T @ grad.
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

OP = "matmul_all_reduce"
_CODE = OPS[OP].code


def matmul_all_reduce_ref(a_per_rank: Sequence[Tensor], b_per_rank: Sequence[Tensor]) -> Tensor:
    """fp32 (fp64 for fp64 inputs) reference on one device: sum_q a_q @ b_q."""
    dt = torch.promote_types(b_per_rank[0].dtype, torch.float32)
    return sum(torch.matmul(a.to(dt), b.to(dt)) for a, b in zip(a_per_rank, b_per_rank))


def _unfused(a: Tensor, b: Tensor, pg) -> Tensor:
    out = a @ b
    if comm.world_size(pg) > 1:
        dist.all_reduce(out, group=pg)
    return out


def chunked_matmul_all_reduce(a: Tensor, b: Tensor, pg, chunks: int) -> Tensor:
    """The decomposed schedule on 2-D ``a``: GEMM row piece i while piece i-1 is all-reduced."""
    out = a.new_empty((a.shape[0], b.shape[1]))
    pending = []
    for a_piece, out_piece in zip(torch.tensor_split(a, chunks), torch.tensor_split(out, chunks)):
        if a_piece.shape[0] == 0:
            continue
        torch.matmul(a_piece, b, out=out_piece)
        pending.append(dist.all_reduce(out_piece, group=pg, async_op=True))
    for work in pending:
        work.wait()
    return out


@comm.names_failures(OP)
def _run(a: Tensor, b: Tensor, pg, method: str, chunks: int) -> Tensor:
    """2-D: sum over ranks of a @ b, on every rank, by ``method``."""
    if method == "fused":
        return _fused.run(OP, a, b, pg)
    if method == "decomposed" and comm.world_size(pg) > 1:
        n = chunks or _common.default_chunks(a.device, a.shape[0],
                                             flops=2.0 * a.shape[0] * a.shape[1] * b.shape[1])
        return chunked_matmul_all_reduce(a, b, pg, max(1, min(n, a.shape[0])))
    return _unfused(a, b, pg)


@torch.library.custom_op("pyfused::matmul_all_reduce", mutates_args=(), **_common.OP_TAGS)
def _matmul_all_reduce_op(a: Tensor, b: Tensor, group_name: str, method: str, chunks: int) -> Tensor:
    """2-D op: sum over ranks of a @ b, on every rank. ``method`` as requested (validated here
    unless the functional wrapper just did)."""
    if _common.take_validated():
        return _run(a, b, comm.group_from_name(group_name), method, chunks)
    pg, choice = _common.prepare_matmul(OP, a, b, comm.group_from_name(group_name), method, chunks)
    return _run(a, b, pg, choice.method, chunks or choice.chunks)


@_matmul_all_reduce_op.register_fake
def _(a, b, group_name, method, chunks):
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_context(ctx, inputs, output):
    a, b = inputs[0], inputs[1]
    ctx.save_for_backward(a, b)


def _backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    grad_a = grad_out @ b.t() if ctx.needs_input_grad[0] else None
    grad_b = _common.weight_grad(a, grad_out, b) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None, None


_matmul_all_reduce_op.register_autograd(_backward, setup_context=_setup_context)


def _plan(group, method, chunks, a, b) -> _common.Plan:
    return _common.plan_matmul(OP, a, b, group, method, chunks)


def _local(group, method, chunks, a, b) -> Tensor:
    return torch.matmul(a, b)  # one rank, no autograd graph: the product is the whole op


def _direct(plan, group, method, chunks, a, b) -> Tensor:
    if a.dim() == 2:
        return _run(a, b, plan.pg, plan.method, plan.chunks)
    out = _run(a.reshape(-1, a.shape[-1]), b, plan.pg, plan.method, plan.chunks)
    return out.view(*a.shape[:-1], b.shape[1])


def _registered(plan, group, method, chunks, a, b) -> Tensor:
    a2 = a if a.dim() == 2 else a.reshape(-1, a.shape[-1])
    out = _common.call_op(plan, torch.ops.pyfused.matmul_all_reduce, a2, b, plan.group_name,
                          plan.method, plan.chunks)
    return out if a.dim() == 2 else out.view(*a.shape[:-1], b.shape[1])


@dispatched(_CODE, _plan, _local, _direct, _registered)
def matmul_all_reduce(a: Tensor, b: Tensor, group=None, *, method: str = "auto",
                      chunks: int = 0) -> Tensor:
    """``all_reduce(a @ b)`` (sum) over ``group``; ``chunks`` (decomposed only, 0 = tuned/default)
    sets how many row pieces overlap their all-reduce with the next GEMM."""


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use


def make_inputs(world, rows, n, k, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (a [rows * W, ..., k], b [k, n])."""
    return _hooks.gemm_inputs(world, rows, n, k, dtype, device, seed, gathered=False)


def reference_per_rank(inputs):
    """The sum of every rank's a @ b, on every rank."""
    total = matmul_all_reduce_ref([a for a, _ in inputs], [b for _, b in inputs])
    return [total] * len(inputs)


def opcheck_args(tensors, group_name: str) -> tuple:
    a, b = tensors
    return (a, b, group_name, "decomposed", 2)


def plain_torch(tensors, pg):
    """The GEMM, then torch.distributed's all_reduce (none on one rank)."""
    a, b = tensors
    world = comm.world_size(pg)

    def matmul_then_all_reduce():
        y = a @ b
        if world > 1:
            dist.all_reduce(y, group=pg)
        return y
    return matmul_then_all_reduce


def virtual_cases():
    return {OP: _hooks.case(make_inputs, fused_on_rank, unfused_all_visible,
                            _hooks.in_fp64(reference_per_rank), _hooks.gemm_flop)}


def fused_on_rank(pg, a, b, **kw) -> Tensor:
    return OPS[OP].fused_function()(a, b, pg, **kw)


def unfused_all_visible(inputs, rank: int) -> Tensor:
    """The all-reduce as a sum of every rank's product (fp32 accumulation, the input dtype out)."""
    out = (inputs[0][0] @ inputs[0][1]).float()
    for a, b in inputs[1:]:
        out += (a @ b).float()
    return out.to(inputs[0][0].dtype)
