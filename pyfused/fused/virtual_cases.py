"""The fused ops as cases for virtual ranks (pyfused/fused/virtual_ranks.py): inputs per rank, the
fused call, the same op's unfused composition on the same harness, and the fp32 reference.

Cases (``CASES``): the three GEMM ops, the backward of the two whose backward is the other fused op
(the gradient of all-gather + GEMM w.r.t. ``a`` is GEMM + reduce-scatter of ``grad @ b^T`` and vice
versa; ``b^T`` is passed as a transposed view, as autograd would), and ``all_reduce_add_rmsnorm``
with the one-shot and the two-shot kernel forced. Shapes are chosen per case from (rows, n, k):
``rows`` is a rank's own rows (the gathered / scattered dimension is ``rows * W``).

The unfused composition runs on the same streams, SMs and memory: the collective is a copy from
the peers' tensors (what NCCL does over NVLink, one context here) and the math is torch's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from .config import ONE_SHOT, TWO_SHOT

EPS = 1e-6
Inputs = List[Tuple[Tensor, ...]]  # one tuple per rank


def _randn(g: torch.Generator, shape, dtype, device) -> Tensor:
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _gemm_inputs(world, rows, n, k, dtype, device, seed, gathered_a: bool) -> Inputs:
    """a_r [rows, k] (all-gather) or [rows * W, k] (reduce-scatter / all-reduce); b_r [k, n]."""
    g = torch.Generator().manual_seed(seed)
    m = rows if gathered_a else rows * world
    return [(_randn(g, (m, k), dtype, device), _randn(g, (k, n), dtype, device) / k ** 0.5)
            for _ in range(world)]


def _transposed(inputs: Inputs) -> Inputs:
    """(grad, b) -> (grad, the same b stored as the transpose of a contiguous [n, k] weight): the
    backward's GEMM operand ``weight^T``, a view with strides (1, k), as autograd passes it."""
    return [(a, b.t().contiguous().t()) for a, b in inputs]


# References in fp64 on the inputs' device (a GPU's fp64 GEMMs take milliseconds, the CPU's seconds).

def _ag_ref(inputs: Inputs) -> List[Tensor]:
    full = torch.cat([a.double() for a, _ in inputs])
    return [full @ b.double() for _, b in inputs]


def _rs_ref(inputs: Inputs) -> List[Tensor]:
    total = sum(a.double() @ b.double() for a, b in inputs)
    return list(total.chunk(len(inputs)))


def _ar_ref(inputs: Inputs) -> List[Tensor]:
    total = sum(a.double() @ b.double() for a, b in inputs)
    return [total] * len(inputs)


def _arn_inputs(world, rows, n, k, dtype, device, seed) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    residual = _randn(g, (rows, n), dtype, device)
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    return [(_randn(g, (rows, n), dtype, device), residual, weight) for _ in range(world)]


def _arn_ref(inputs: Inputs) -> List[Tensor]:
    h = sum(x.double() for x, _, _ in inputs) + inputs[0][1].double()
    w = inputs[0][2].double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w
    return [normed] * len(inputs)


# -- the fused calls: fn(rank_handle, *inputs_of_rank) -> output --------------------------------

def _fused_ag(pg, a, b):
    from .gemm_collectives import fused_all_gather_matmul

    return fused_all_gather_matmul(a, b, pg, False)[0]


def _fused_rs(pg, a, b):
    from .gemm_collectives import fused_matmul_reduce_scatter

    return fused_matmul_reduce_scatter(a, b, pg)


def _fused_ar(pg, a, b):
    from .all_reduce import fused_matmul_all_reduce

    return fused_matmul_all_reduce(a, b, pg)


def _fused_arn(algo):
    def call(pg, x, residual, weight):
        from .all_reduce import fused_all_reduce_add_rmsnorm

        return fused_all_reduce_add_rmsnorm(x, residual, weight, EPS, pg, algo=algo)[0]
    return call


# -- the unfused compositions: fn(inputs, rank) -> output, all inputs visible ------------------

def _unfused_ag(inputs: Inputs, r: int) -> Tensor:
    return torch.cat([a for a, _ in inputs]) @ inputs[r][1]


def _unfused_rs(inputs: Inputs, r: int) -> Tensor:
    w = len(inputs)
    rows = inputs[0][0].shape[0] // w
    parts = [a[r * rows:(r + 1) * rows] @ b for a, b in inputs]
    out = parts[0].float()
    for p in parts[1:]:
        out += p.float()
    return out.to(parts[0].dtype)


def _unfused_ar(inputs: Inputs, r: int) -> Tensor:
    out = (inputs[0][0] @ inputs[0][1]).float()
    for a, b in inputs[1:]:
        out += (a @ b).float()
    return out.to(inputs[0][0].dtype)


def _unfused_arn(inputs: Inputs, r: int) -> Tensor:
    h = inputs[0][1].float()
    for x, _, _ in inputs:
        h += x.float()
    h = h.to(inputs[0][0].dtype)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), inputs[0][2], EPS)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[..., Inputs]           # (world, rows, n, k, dtype, device, seed) -> Inputs
    fused: Callable[..., Tensor]          # (rank_handle, *inputs[r]) -> output of rank r
    unfused: Callable[[Inputs, int], Tensor]
    reference: Callable[[Inputs], List[Tensor]]
    flop: Callable[[int, int, int, int], float]  # (world, rows, n, k) -> one rank's FLOPs


def _gemm_case(name, fused, unfused, ref, gathered_a, transpose=False, flop=None) -> Case:
    def make(world, rows, n, k, dtype, device, seed):
        inputs = _gemm_inputs(world, rows, n, k, dtype, device, seed, gathered_a)
        return _transposed(inputs) if transpose else inputs
    return Case(name, make, fused, unfused, ref, flop or (lambda w, rows, n, k: 2.0 * w * rows * n * k))


CASES: Dict[str, Case] = {c.name: c for c in (
    _gemm_case("all_gather_matmul", _fused_ag, _unfused_ag, _ag_ref, gathered_a=True),
    _gemm_case("matmul_reduce_scatter", _fused_rs, _unfused_rs, _rs_ref, gathered_a=False),
    _gemm_case("matmul_all_reduce", _fused_ar, _unfused_ar, _ar_ref, gathered_a=False),
    # Backward w.r.t. a: all_gather_matmul's is reduce-scatter(grad @ b^T), and vice versa.
    _gemm_case("all_gather_matmul.bwd", _fused_rs, _unfused_rs, _rs_ref, gathered_a=False,
               transpose=True),
    _gemm_case("matmul_reduce_scatter.bwd", _fused_ag, _unfused_ag, _ag_ref, gathered_a=True,
               transpose=True),
    Case("all_reduce_add_rmsnorm.one_shot", _arn_inputs, _fused_arn(ONE_SHOT), _unfused_arn,
         _arn_ref, lambda w, rows, n, k: 0.0),
    Case("all_reduce_add_rmsnorm.two_shot", _arn_inputs, _fused_arn(TWO_SHOT), _unfused_arn,
         _arn_ref, lambda w, rows, n, k: 0.0),
)}


def run_unfused(group, case: Case, inputs: Inputs) -> List[Tensor]:
    """The unfused composition, rank by rank on each rank's stream and SM-free (torch's kernels)."""
    outs = []
    for r in range(group.world):
        with group.rank_context(r):
            outs.append(case.unfused(inputs, r))
    return outs


def max_rel_error(outs: Sequence[Tensor], refs: Sequence[Tensor]) -> float:
    """The largest |out - ref| / max|ref| over ranks, computed in fp64 on the reference's device
    (inf if any output is not finite)."""
    worst = 0.0
    for out, ref in zip(outs, refs):
        out, ref = out.to(ref.device, torch.float64), ref.double()
        if not bool(torch.isfinite(out).all()):
            return float("inf")
        worst = max(worst, float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst
