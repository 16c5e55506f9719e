"""``pyfused.clip_grad_norm_``: torch's ``clip_grad_norm_``, correct for sharded gradients too.

    total_norm = pyfused.clip_grad_norm_(model_or_params, max_norm, norm_type=2.0,
                                         error_if_nonfinite=False, foreach=None)

``model_or_params`` is a module (a pyfused ``DistributedDataParallel`` or anything else), an iterable
of parameters, or one tensor. Parameters of a ``DistributedDataParallel(..., shard_optimizer=True)``
hold, after backward, only this rank's shard of the averaged gradient; for those the norm is

    ||g||_p = ( sum over ranks of sum over this rank's gradient pieces ||piece||_p^p )^(1/p)

(max / min over ranks for p = +-inf, the count of non-zeros for p = 0): one all-reduce of a scalar
over the module's process group, so **every rank of that group must call it** (as with FSDP's). The
pieces are then multiplied by ``min(1, max_norm / (total + 1e-6))``, the coefficient torch uses.
Without sharded parameters this is ``torch.nn.utils.clip_grad_norm_`` itself (gradients are
identical on every rank after the all-reduce, so no communication is needed).
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, Iterable, List, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _params_of(x) -> List[Tensor]:
    if isinstance(x, nn.Module):
        return list(x.parameters())
    if isinstance(x, Tensor):
        return [x]
    return list(x)


def clip_grad_norm_(parameters: Union[nn.Module, Tensor, Iterable[Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool = None) -> Tensor:
    params = _params_of(parameters)
    owners: Dict[int, tuple] = {}  # id(owner) -> (owner, set of param indices), in first-seen order
    plain: List[Tensor] = []
    for p in params:
        owner = getattr(p, "_pyfused_shard_owner", None)
        if isinstance(owner, weakref.ref):  # DDP's sharded state: it holds its parameters
            owner = owner()
        if owner is None:
            plain.append(p)
            continue
        entry = owners.setdefault(id(owner), (owner, set()))
        entry[1].add(owner.index[id(p)])
    if not owners:
        return torch.nn.utils.clip_grad_norm_(plain, max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    norm_type = float(norm_type)
    plain_grads = [p.grad for p in plain if p.grad is not None]
    groups = [plain_grads] + [owner.shard_grads(indices) for owner, indices in owners.values()]
    device = next((g.device for grads in groups for g in grads), None)
    if device is None:
        device = next(iter(owners.values()))[0].device
    partials = [_partial(plain_grads, norm_type, device)]
    for owner, indices in owners.values():
        part = _partial(owner.shard_grads(indices), norm_type, device)
        if owner.pg is not None and owner.world > 1:
            part = part.to(_comm_device(owner.pg, device))
            dist.all_reduce(part, op=_REDUCE_OP[_kind(norm_type)], group=owner.pg)
            part = part.to(device)
        partials.append(part)
    total = _combine(partials, norm_type)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    all_grads = [g for grads in groups for g in grads]
    if all_grads:
        by_dtype: Dict[torch.dtype, List[Tensor]] = {}
        for g in all_grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, gs in by_dtype.items():
            torch._foreach_mul_(gs, coef.to(gs[0].device, dtype))
    return total


def _kind(norm_type: float) -> str:
    if math.isinf(norm_type):
        return "max" if norm_type > 0 else "min"
    return "count" if norm_type == 0 else "pow"


_REDUCE_OP = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "count": dist.ReduceOp.SUM,
              "pow": dist.ReduceOp.SUM}


def _partial(grads: List[Tensor], norm_type: float, device) -> Tensor:
    """This rank's contribution, in fp32: sum of ||g||^p, or max / min / count."""
    kind = _kind(norm_type)
    if not grads:
        return torch.tensor(math.inf if kind == "min" else 0.0, dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device)
                         for g in grads])
    if kind == "max":
        return norms.max()
    if kind == "min":
        return norms.min()
    if kind == "count":
        return norms.sum()
    return norms.pow(norm_type).sum()


def _combine(partials: List[Tensor], norm_type: float) -> Tensor:
    kind = _kind(norm_type)
    stacked = torch.stack(partials)
    if kind == "max":
        return stacked.max()
    if kind == "min":
        return stacked.min()
    if kind == "count":
        return stacked.sum()
    return stacked.sum().pow(1.0 / norm_type)


def _comm_device(pg, device):
    from . import comm

    return comm.comm_device(pg) if device.type == "cuda" else torch.device("cpu")
