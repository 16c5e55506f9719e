"""How each parameter of a parallelized model relates to the original model's tensor of the same name.

A ``ShardSpec`` maps the original (full) tensor to this rank's local one and back:

  * ``dim=None``: replicated, local == full;
  * ``dim=d``: the full tensor (after ``transpose`` -- GPT-2's ``Conv1D`` stores ``[in, out]``, our
    layers ``nn.Linear``'s ``[out, in]``) is cut along ``d`` into ``parts`` equal groups (3 for a fused
    q|k|v projection, 2 for a fused gate|up, else 1) -- or into groups of the given ``sections``
    sizes (a fused q|k|v of grouped-query attention: q wider than k and v) -- and rank r keeps chunk
    r of every group, concatenated. For a fused q|k|v that gives each rank its own heads of q, k and
    v, in that order, so the attention code's split of the local output still finds q, k, v;
  * ``replicas=k`` (KV heads replicated when TP > KV heads): the tensor is cut into ``world / k``
    chunks and rank r keeps chunk ``r // k``, so k consecutive ranks hold the same chunk;
  * ``padded=P`` (a vocabulary TP does not divide): before the cut the tensor is zero-padded along
    ``dim`` to P (a multiple of the world size); gathering drops the padding again;
  * ``group``: the group whose ranks hold the chunks when it is not the tensor-parallel one (an
    expert-parallel layer's experts, over the ep dim); None: the TP group ``gather`` is given.

``shard`` runs locally; ``gather`` is a collective over the TP group (every TP rank must call it for
the same parameters in the same order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .. import comm


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple
    dim: Optional[int] = None
    parts: int = 1
    transpose: bool = False
    world: int = 1
    rank: int = 0
    replicas: int = 1
    padded: int = 0  # size along dim after zero-padding (0: none)
    sections: tuple = ()  # full sizes of the groups along dim (unequal parts; default: ``parts`` equal)
    group: Any = None  # the group the chunks are spread over, if not the TP group (module docstring)

    @property
    def chunks(self) -> int:
        return self.world // self.replicas

    def shard(self, full: Tensor) -> Tensor:
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {list(self.full_shape)}, got {list(full.shape)}")
        t = full.t() if self.transpose else full
        if self.dim is None or self.world == 1:
            return t
        if self.padded > t.shape[self.dim]:
            pad = list(t.shape)
            pad[self.dim] = self.padded - t.shape[self.dim]
            t = torch.cat([t, t.new_zeros(pad)], dim=self.dim)
        groups = (t.split(list(self.sections), dim=self.dim) if self.sections
                  else t.chunk(self.parts, dim=self.dim))
        return torch.cat([g.chunk(self.chunks, dim=self.dim)[self.rank // self.replicas] for g in groups],
                         dim=self.dim)

    def gather(self, local: Tensor, pg) -> Tensor:
        pg = pg if self.group is None else self.group
        local = local.detach()
        if self.dim is None or self.world == 1:
            full = local.clone()
        else:
            stacked = local.new_empty((self.world * local.numel(),))
            comm.all_gather_single(stacked, local.contiguous().view(-1), group=pg)
            pieces = [p.view(local.shape) for p in stacked.chunk(self.world)]
            if self.sections:
                local_sections = [s // self.chunks for s in self.sections]
                split = [p.split(local_sections, dim=self.dim) for p in pieces]
            else:
                split = [p.chunk(self.parts, dim=self.dim) for p in pieces]
            holders = range(0, self.world, self.replicas)  # one rank per distinct chunk
            full = torch.cat([torch.cat([split[r][j] for r in holders], dim=self.dim)
                              for j in range(len(split[0]))], dim=self.dim)
            if self.padded:
                layout = self.full_shape[::-1] if self.transpose else self.full_shape
                full = full.narrow(self.dim, 0, layout[self.dim])
        return full.t().contiguous() if self.transpose else full


def sum_grad_over_replicas(param: torch.nn.Parameter, spec: ShardSpec, pg):
    """Sum ``param``'s gradient over the ranks that hold the same chunk (``spec.replicas`` > 1), as
    backward produces it: every TP rank all-gathers the gradients (the same hooks fire in the same
    order on every rank) and adds those of its chunk's holders. Returns the hook handle or None."""
    if spec.replicas == 1 or spec.world == 1:
        return None

    def hook(grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        every = grad.new_empty((spec.world * grad.numel(),))
        comm.all_gather_single(every, grad.view(-1), group=pg)
        mine = every.view(spec.chunks, spec.replicas, grad.numel())[spec.rank // spec.replicas]
        return mine.sum(0).view(grad.shape)

    return param.register_hook(hook)
