"""``all_reduce_add_rmsnorm(x, residual, weight, eps) -> (normed, new_residual)`` -- the end of a
tensor-parallel attention or MLP block: the row-parallel partial sums are all-reduced, added to the
residual stream, and the sum is RMS-normalized for the next sub-layer:

    new_residual = all_reduce(x) + residual
    normed       = new_residual * rsqrt(mean(new_residual^2, dim=-1) + eps) * weight

Shapes: ``x`` and ``residual`` are ``[..., H]`` (the same on every rank; the residual stream is
replicated, as in Megatron's TP without sequence parallelism), ``weight`` is ``[H]``. Both outputs
have x's shape and dtype. Math in fp32 (fp64 for fp64 inputs); the norm is taken over
``new_residual`` rounded to x's dtype (what the next layer reads back), in every method, so the
methods differ only in how the all-reduce rounds its partial sums.

Methods
  * unfused: ``all_reduce`` (NCCL / gloo, in x's dtype), then add + RMSNorm.
  * decomposed: the rows are cut into ``chunks`` pieces whose all-reduces are all launched
    asynchronously; as soon as piece i has arrived its add + RMSNorm runs, while pieces i+1, ... are
    still being reduced.
  * fused: one custom all-reduce kernel over symmetric buffers with the add + RMSNorm in its
    epilogue (pyfused/fused/all_reduce.py), one-shot or two-shot by size. GPUs only.
  * auto: a tuned entry (pyfused.tune) if there is one; otherwise unfused (the decomposed schedule
    can only hide the epilogue, which is cheap next to the all-reduce).

Autograd follows the tensor-parallel convention of ``matmul_all_reduce``: the outputs are
replicated, so the gradient arriving on every rank is the same and flows back through the all-reduce
as the identity. With h = new_residual, r = rsqrt(mean(h^2) + eps), xhat = h * r, g = grad(normed):
    grad_h        = grad(new_residual) + r * (g*w - xhat * mean(g*w*xhat, dim=-1))
    grad_x        = grad_residual = grad_h
    grad_weight   = sum over rows of g * xhat
No communication in the backward.
"""
from __future__ import annotations

import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .. import comm
from . import _common, _fused, _hooks
from ._dispatch import dispatched
from .registry import OPS

OP = "all_reduce_add_rmsnorm"
_CODE = OPS[OP].code
INPUTS = ("x", "residual", "weight")


def all_reduce_add_rmsnorm_ref(x_per_rank: Sequence[Tensor], residual: Tensor, weight: Tensor,
                               eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """fp32 (fp64 for fp64 inputs) reference on one device: (normed, new_residual) of
    h = sum_q x_q + residual."""
    dt = torch.promote_types(x_per_rank[0].dtype, torch.float32)
    h = sum(x.to(dt) for x in x_per_rank) + residual.to(dt)
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return h * rstd * weight.to(dt), h


def add_rmsnorm_rows(reduced: Tensor, residual: Tensor, weight: Tensor, eps: float,
                     normed_out: Tensor, residual_out: Tensor) -> None:
    """The epilogue on rows of an all-reduced ``reduced``: residual_out = reduced + residual and
    normed_out = RMSNorm(residual_out) * weight, in fp32 (fp64 for fp64 inputs), the norm over the
    rounded residual_out."""
    normed, new_residual = add_rmsnorm(reduced, residual, weight, eps)
    residual_out.copy_(new_residual)
    normed_out.copy_(normed)


_WIDE = (torch.float32, torch.float64)


def add_rmsnorm(reduced: Tensor, residual: Tensor, weight: Tensor, eps: float
                ) -> Tuple[Tensor, Tensor]:
    """(normed, new_residual) of all-reduced ``reduced``: new_residual = reduced + residual in
    reduced's dtype, normed = RMSNorm(new_residual) * weight computed in fp32 (fp64 for fp64)."""
    if reduced.dtype in _WIDE and residual.dtype == weight.dtype == reduced.dtype:
        new_residual = reduced + residual  # already the math dtype: no conversions to pay for
        return F.rms_norm(new_residual, (new_residual.shape[-1],), weight, eps), new_residual
    dt = torch.promote_types(reduced.dtype, torch.float32)
    new_residual = (reduced.to(dt) + residual.to(dt)).to(reduced.dtype)
    normed = F.rms_norm(new_residual.to(dt), (new_residual.shape[-1],), weight.to(dt), eps)
    return normed.to(reduced.dtype), new_residual


def _unfused(x: Tensor, residual: Tensor, weight: Tensor, eps: float, pg) -> Tuple[Tensor, Tensor]:
    if comm.world_size(pg) == 1:  # nothing to reduce in place: x itself is the sum
        return add_rmsnorm(x, residual, weight, eps)
    reduced = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, group=pg)
    return add_rmsnorm(reduced, residual, weight, eps)


def chunked_all_reduce_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, pg,
                                   chunks: int) -> Tuple[Tensor, Tensor]:
    """The decomposed schedule on 2-D ``x``: every row piece's all-reduce in flight at once, each
    piece's epilogue as soon as it has arrived."""
    reduced = x.clone(memory_format=torch.contiguous_format)
    normed, new_residual = torch.empty_like(reduced), torch.empty_like(reduced)
    pieces = [p for p in zip(*(torch.tensor_split(t, chunks) for t in
                               (reduced, residual, normed, new_residual))) if p[0].shape[0] > 0]
    pending = [dist.all_reduce(p[0], group=pg, async_op=True) for p in pieces]
    for work, (red, res, out, res_out) in zip(pending, pieces):
        work.wait()
        add_rmsnorm_rows(red, res, weight, eps, out, res_out)
    return normed, new_residual


@comm.names_failures(OP)
def _run(x: Tensor, residual: Tensor, weight: Tensor, eps: float, pg, method: str,
         chunks: int) -> Tuple[Tensor, Tensor]:
    """2-D: (RMSNorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual) by ``method``."""
    if method == "fused":
        return _fused.run(OP, x, residual, weight, eps, pg)
    if method == "decomposed" and comm.world_size(pg) > 1:
        n = chunks or _common.default_chunks(x.device, x.shape[0], nbytes=x.numel() * x.element_size())
        n = max(1, min(n, x.shape[0]))
        return chunked_all_reduce_add_rmsnorm(x, residual, weight, eps, pg, n)
    return _unfused(x, residual, weight, eps, pg)


@torch.library.custom_op("pyfused::all_reduce_add_rmsnorm", mutates_args=(), **_common.OP_TAGS)
def _all_reduce_add_rmsnorm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                               group_name: str, method: str, chunks: int) -> Tuple[Tensor, Tensor]:
    """2-D op: (RMSNorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual). ``method``
    as requested (validated here unless the functional wrapper just did)."""
    if _common.take_validated():
        return _run(x, residual, weight, eps, comm.group_from_name(group_name), method, chunks)
    pg, choice = prepare(x, residual, weight, eps, comm.group_from_name(group_name), method, chunks)
    return _run(x, residual, weight, eps, pg, choice.method, chunks or choice.chunks)


@_all_reduce_add_rmsnorm_op.register_fake
def _(x, residual, weight, eps, group_name, method, chunks):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps = inputs[:4]
    ctx.eps = eps
    ctx.dtypes = (x.dtype, residual.dtype, weight.dtype)
    ctx.save_for_backward(output[1], weight)


def _backward(ctx, grad_normed, grad_new_residual):
    h, weight = ctx.saved_tensors
    dt = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(dt)
    grad_h = torch.zeros_like(hf) if grad_new_residual is None else grad_new_residual.to(dt)
    grad_weight = None
    if grad_normed is not None:
        rstd = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + ctx.eps)
        xhat = hf * rstd
        g = grad_normed.to(dt)
        gw = g * weight.to(dt)
        grad_h = grad_h + rstd * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
        if ctx.needs_input_grad[2]:
            grad_weight = (g * xhat).sum(dim=0).to(ctx.dtypes[2])
    grad_x = grad_h.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
    grad_residual = grad_h.to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
    return grad_x, grad_residual, grad_weight, None, None, None, None


_all_reduce_add_rmsnorm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Validation (every rank, before any collective of the op): _common.prepare with this contract


def _eps_code(eps) -> Tuple[int, int]:
    """(bits of eps as a float64, 1 if eps is a finite number >= 0 else 0); remembered for a float
    eps, since a model passes the same one on every call."""
    if type(eps) is not float or eps == 0.0:  # 0.0 == -0.0, but their bits differ
        return _eps_code_of(eps)
    code = _EPS_CODES.get(eps)
    if code is None:
        code = _eps_code_of(eps)
        if len(_EPS_CODES) < 64:
            _EPS_CODES[eps] = code
    return code


_EPS_CODES: dict = {}


def _eps_code_of(eps) -> Tuple[int, int]:
    if isinstance(eps, bool):
        return 0, 0
    try:
        value = float(eps)
    except (TypeError, ValueError):
        return 0, 0
    return struct.unpack("<q", struct.pack("<d", value))[0], int(math.isfinite(value) and value >= 0)


def _eps_of(sig: _common.CallSignature) -> str:
    return repr(struct.unpack("<d", struct.pack("<q", sig.options[0]))[0])


def check_inputs(sigs: List[_common.CallSignature], world: int,
                 allowed_devices: Tuple[str, ...]) -> Optional[str]:
    """The contract of x [..., H], residual [..., H], weight [H], identical across ranks; pure."""
    for r, s in enumerate(sigs):
        x, res, w = s.tensors
        where = f" (rank {r})" if len(sigs) > 1 else ""
        if x.dtype not in _common.FLOAT_DTYPES or w.dtype not in _common.FLOAT_DTYPES:
            return (f"x and weight must be float32, float16, bfloat16 or float64; got x "
                    f"{x.describe()}, weight {w.describe()}{where}")
        if res.dtype != x.dtype:
            return f"residual must have x's dtype; got x {x.describe()}, residual {res.describe()}{where}"
        if not x.device == res.device == w.device:
            return (f"x, residual and weight must be on one device; got x {x.describe()}, residual "
                    f"{res.describe()}, weight {w.describe()}{where}")
        if world > 1 and x.device not in allowed_devices:
            return (f"tensors on {x.device} cannot be communicated by this process group's backend "
                    f"(it serves {', '.join(allowed_devices)}){where}")
        if not 1 <= len(x.shape) <= comm.validate.MAX_DIMS:
            return f"x must have 1 to {comm.validate.MAX_DIMS} dims [..., H]; got x {x.describe()}{where}"
        if res.shape != x.shape:
            return f"residual must have x's shape; got x {x.describe()}, residual {res.describe()}{where}"
        if len(w.shape) != 1 or w.shape[0] != x.shape[-1]:
            return (f"weight must be 1-D of x's last dim ({x.shape[-1]}); got weight {w.describe()}"
                    f"{where}")
        if 0 in x.shape:
            return f"empty inputs are not supported: x {x.describe()}{where}"
        if not s.options[1]:
            return f"eps must be a finite number >= 0{where}"
    return (comm.differs(sigs, "x", lambda s: s.tensors[0], lambda s: s.tensors[0].describe())
            or comm.differs(sigs, "residual", lambda s: s.tensors[1], lambda s: s.tensors[1].describe())
            or comm.differs(sigs, "weight", lambda s: s.tensors[2], lambda s: s.tensors[2].describe())
            or comm.differs(sigs, "eps", lambda s: s.options[0], _eps_of))


def prepare(x, residual, weight, eps, group, method, chunks):
    """Validate on every rank and choose the method; identical outcome everywhere."""
    return _common.prepare(OP, INPUTS, (x, residual, weight), group, method, chunks=chunks,
                           options=_eps_code(eps), check=check_inputs, auto=_auto_preference)


def _auto_preference(pg, tensors, fused_ok: bool) -> _common.Choice:
    return _common.auto_preference(OP, pg, tensors, fused_ok)


def _plan(group, method, chunks, eps, x, residual, weight) -> _common.Plan:
    """The plan of a call that the plan cache did not hold."""
    if torch.compiler.is_compiling():
        return _common.traced_plan(OP, group, method, chunks)
    pg, choice = prepare(x, residual, weight, eps, group, method, chunks)
    return _common.new_plan(OP, pg, choice, chunks, (x, residual, weight),
                            (group, method, chunks, eps, x, residual, weight))


def _local(group, method, chunks, eps, x, residual, weight) -> Tuple[Tensor, Tensor]:
    return add_rmsnorm(x, residual, weight, float(eps))  # one rank, no autograd: x is the sum


def _direct(plan, group, method, chunks, eps, x, residual, weight) -> Tuple[Tensor, Tensor]:
    if x.dim() == 2:
        return _run(x, residual, weight, float(eps), plan.pg, plan.method, plan.chunks)
    h = x.shape[-1]
    normed, new_residual = _run(x.reshape(-1, h), residual.reshape(-1, h), weight, float(eps),
                                plan.pg, plan.method, plan.chunks)
    return normed.view(x.shape), new_residual.view(x.shape)


def _registered(plan, group, method, chunks, eps, x, residual, weight) -> Tuple[Tensor, Tensor]:
    flat = x.dim() == 2
    h = x.shape[-1]
    args = (x, residual) if flat else (x.reshape(-1, h), residual.reshape(-1, h))
    normed, new_residual = _common.call_op(plan, torch.ops.pyfused.all_reduce_add_rmsnorm, *args,
                                           weight, float(eps), plan.group_name, plan.method,
                                           plan.chunks)
    return (normed, new_residual) if flat else (normed.view(x.shape), new_residual.view(x.shape))


@dispatched(_CODE, _plan, _local, _direct, _registered)
def all_reduce_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, group=None,
                           *, method: str = "auto", chunks: int = 0) -> Tuple[Tensor, Tensor]:
    """``(RMSNorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual)`` over ``group``;
    see the module docstring. ``chunks``: row pieces of the decomposed method (0: tuned/default)."""


# ---------------------------------------------------------------------------------------------
# Registry hooks (pyfused/ops/registry.py): what tests, benchmarks and virtual ranks use

SAMPLE_EPS = 1e-6  # the eps of the hooks' calls: the op's default


def make_inputs(world, rows, n, k=0, dtype=torch.float32, device="cpu", seed=0):
    """Every rank's (x [rows, ..., n], residual, weight [n]); the residual stream and the weight
    are replicated, as in a tensor-parallel model. ``k`` is unused (no GEMM)."""
    lead = _hooks.leading_dims(rows)
    g = torch.Generator().manual_seed(seed)
    residual = _hooks.randn(g, (*lead, n), dtype, device)
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    return [(_hooks.randn(g, (*lead, n), dtype, device), residual, weight) for _ in range(world)]


def reference_per_rank(inputs):
    """(normed, new_residual) of the sum of every rank's x plus the residual, on every rank."""
    ref = all_reduce_add_rmsnorm_ref([x for x, _, _ in inputs], inputs[0][1], inputs[0][2],
                                     SAMPLE_EPS)
    return [ref] * len(inputs)


def opcheck_args(tensors, group_name: str) -> tuple:
    x, residual, weight = tensors
    return (x, residual, weight, SAMPLE_EPS, group_name, "decomposed", 2)


def plain_torch(tensors, pg):
    """torch.distributed's all_reduce (none on one rank), ``+`` and F.rms_norm."""
    x, residual, weight = tensors
    world = comm.world_size(pg)

    def all_reduce_add_rms_norm():
        h = x.clone()
        if world > 1:
            dist.all_reduce(h, group=pg)
        h = h + residual
        return F.rms_norm(h, (h.shape[-1],), weight, SAMPLE_EPS), h
    return all_reduce_add_rms_norm


def virtual_cases():
    """The fused kernel with each all-reduce algorithm forced (one-shot, two-shot)."""
    from ..fused.config import ONE_SHOT, TWO_SHOT

    reference = _hooks.in_fp64(reference_per_rank)
    return {f"{OP}.{name}": _hooks.case(make_inputs, _fused_with(algo), unfused_all_visible,
                                        reference, lambda w, rows, n, k: 0.0)
            for name, algo in (("one_shot", ONE_SHOT), ("two_shot", TWO_SHOT))}


def _fused_with(algo: int):
    def fused_on_rank(pg, x, residual, weight, **kw) -> Tensor:
        return OPS[OP].fused_function()(x, residual, weight, SAMPLE_EPS, pg, algo=algo, **kw)[0]
    return fused_on_rank


def unfused_all_visible(inputs, rank: int) -> Tensor:
    """The normed output of the sum of every rank's x (fp32 accumulation) plus the residual."""
    h = inputs[0][1].float()
    for x, _, _ in inputs:
        h += x.float()
    h = h.to(inputs[0][0].dtype)
    return F.rms_norm(h, (h.shape[-1],), inputs[0][2], SAMPLE_EPS)
