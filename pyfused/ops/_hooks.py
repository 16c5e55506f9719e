"""What the ops' registry hooks share (pyfused/ops/registry.py, ``HOOKS``): inputs built from one
seed, fp64 references and the parts of a virtual-rank case. Nothing here runs in an op's call."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor

Inputs = List[Tuple[Tensor, ...]]  # one tuple per rank
Rows = Union[int, Sequence[int]]


def randn(g: torch.Generator, shape, dtype, device) -> Tensor:
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def leading_dims(rows: Rows) -> Tuple[int, ...]:
    return (rows,) if isinstance(rows, int) else tuple(rows)


def gemm_inputs(world: int, rows: Rows, n: int, k: int, dtype, device, seed: int,
                gathered: bool) -> Inputs:
    """Every rank's (a, b) of a GEMM op: a [rows, ..., k] (this rank's shard, for an op that
    gathers it) or [rows * W, ..., k]; b [k, n], scaled by k^-1/2 so the product stays O(1)."""
    lead = leading_dims(rows)
    a_shape = (lead[0] * (1 if gathered else world), *lead[1:], k)
    g = torch.Generator().manual_seed(seed)
    return [(randn(g, a_shape, dtype, device), randn(g, (k, n), dtype, device) / k ** 0.5)
            for _ in range(world)]


def transposed(inputs: Inputs) -> Inputs:
    """(a, b) -> (a, the same b stored as the transpose of a contiguous [n, k] weight): the operand
    ``weight^T`` of a backward's GEMM, a view with strides (1, k), as autograd passes it."""
    return [(a, b.t().contiguous().t()) for a, b in inputs]


def in_fp64(reference_per_rank: Callable[[Inputs], list]) -> Callable[[Inputs], List[Tensor]]:
    """``reference_per_rank`` on fp64 copies of the inputs (on their device), each rank's first
    output only: the reference of a virtual-rank case."""
    def reference(inputs: Inputs) -> List[Tensor]:
        outs = reference_per_rank([tuple(t.double() for t in rank) for rank in inputs])
        return [out[0] if isinstance(out, tuple) else out for out in outs]
    return reference


def gemm_flop(world: int, rows: int, n: int, k: int) -> float:
    """One rank's GEMM FLOPs in a virtual-rank case: W * rows rows of k x n."""
    return 2.0 * world * rows * n * k


def case(make, fused, unfused, reference, flop, blocks_host: bool = False) -> Dict[str, Callable]:
    """The parts of a virtual-rank case (pyfused/testing/virtual_cases.py, ``Case``): ``make`` as
    ``make_inputs``; ``fused(rank_handle, *inputs_of_rank, **kw)`` -> that rank's output;
    ``unfused(inputs, rank)`` the same op composed of torch ops with all inputs visible;
    ``reference(inputs)`` -> fp64 outputs per rank; ``flop(world, rows, n, k)``; ``blocks_host``:
    the fused call waits on the host for its peers."""
    return dict(make=make, fused=fused, unfused=unfused, reference=reference, flop=flop,
                blocks_host=blocks_host)


def backward_case(spec) -> Dict[str, Callable]:
    """The virtual-rank case of a GEMM op's backward w.r.t. a that runs the GEMM op ``spec`` (its
    ``OpSpec``) on grad and b^T: that op's case (its module's ``make_inputs``, ``fused_on_rank``,
    ``unfused_all_visible``, ``reference_per_rank``) on transposed weights."""
    return case(lambda *args: transposed(spec.make_inputs(*args)), spec.hook("fused_on_rank"),
                spec.hook("unfused_all_visible"), in_fp64(spec.reference_per_rank), gemm_flop)
