"""The fused ops as cases for virtual ranks (pyfused/testing/virtual_ranks.py): inputs per rank, the
fused call, the same op's unfused composition on the same harness, and the fp64 reference.

Each op with a fused implementation says its cases in its own module (the registry hook
``virtual_cases``, pyfused/ops/registry.py): today the GEMM ops' forwards, the backward of the two
whose backward is the other fused op (the gradient of all-gather + GEMM w.r.t. ``a`` is GEMM +
reduce-scatter of ``grad @ b^T`` and vice versa; ``b^T`` is passed as a transposed view, as
autograd would), all_gather_matmul keeping the gathered input, and ``all_reduce_add_rmsnorm`` with
the one-shot and the two-shot kernel forced. ``cases(OPS.values())`` collects them (a caller may
pass more specs, such as a test's toy op). Shapes are chosen per case from (rows, n, k): ``rows``
is a rank's own rows (the gathered / scattered dimension is ``rows * W``).

The unfused composition runs on the same streams, SMs and memory: the collective is a copy from
the peers' tensors (what NCCL does over NVLink, one context here) and the math is torch's. A case's
output is a tensor or a tuple of tensors (compared element by element).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import Tensor

Inputs = List[Tuple[Tensor, ...]]  # one tuple per rank


@dataclass(frozen=True)
class Case:
    name: str
    op: str                               # the registered op whose fused implementation it runs
    make: Callable[..., Inputs]           # (world, rows, n, k, dtype, device, seed) -> Inputs
    fused: Callable[..., Tensor]          # (rank_handle, *inputs[r]) -> output of rank r
    unfused: Callable[[Inputs, int], Tensor]
    reference: Callable[[Inputs], List[Tensor]]
    flop: Callable[[int, int, int, int], float]  # (world, rows, n, k) -> one rank's FLOPs
    blocks_host: bool = False  # the fused call waits on the host for its peers (a count read):
    #                            its ranks must be launched from threads of their own


def cases(specs: Iterable) -> Dict[str, Case]:
    """Every case of the ops ``specs`` describe (``pyfused.ops.registry.OPS.values()``) that have a
    fused implementation, by name."""
    return {name: Case(name, spec.name, **parts)
            for spec in specs if spec.fused
            for name, parts in spec.virtual_cases().items()}


def run_unfused(group, case: Case, inputs: Inputs) -> List[Tensor]:
    """The unfused composition, rank by rank on each rank's stream and SM-free (torch's kernels),
    ordered as ``VirtualGroup.launch`` orders a call: every rank's stream after the current stream
    (where the inputs were made), the current stream after every rank's."""
    current = torch.cuda.current_stream(group.device) if group.device.type == "cuda" else None
    if current is not None:
        for stream in group.streams:
            stream.wait_stream(current)
    outs = []
    with group.torch_gemms_in_budget():
        for r in range(group.world):
            with group.rank_context(r):
                outs.append(case.unfused(inputs, r))
    if current is not None:
        for stream in group.streams:
            current.wait_stream(stream)
    return outs


def _tensors(out) -> Tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def max_rel_error(outs: Sequence, refs: Sequence) -> float:
    """The largest |out - ref| / max|ref| over ranks (and over the tensors of a tuple output),
    computed in fp64 on the reference's device (inf if any output is not finite)."""
    worst = 0.0
    for rank_out, rank_ref in zip(outs, refs):
        for out, ref in zip(_tensors(rank_out), _tensors(rank_ref)):
            out, ref = out.to(ref.device, torch.float64), ref.double()
            if not bool(torch.isfinite(out).all()):
                return float("inf")
            worst = max(worst, float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst
