"""``parallelize(model, mesh, dp="fsdp")``: fully_shard on the mesh's dp dim after tensor parallelism.

Each transformer block becomes a unit, then the whole model (embeddings, final norm, LM head).
Parameters are then DTensors over the dp dim holding rows of the TP-local tensors; the helpers
below let the parallel model's state-dict and gradient-norm code read and write them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .fully_shard import fully_shard


def shard_model(model: nn.Module, block_list: Optional[str], dp_mesh, specs) -> None:
    """Shard ``model`` over ``dp_mesh`` (blocks of ``model.<block_list>`` first, then the root);
    ``specs`` (id(parameter) -> tensor-parallel spec) follows the parameters to their shards."""
    by_name = {k: specs[id(t)] for k, t in model.state_dict(keep_vars=True).items() if id(t) in specs}
    if block_list is not None:
        for block in model.get_submodule(block_list):
            fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for k, t in model.state_dict(keep_vars=True).items():
        if k in by_name:
            specs[id(t)] = by_name[k]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (``t`` itself unless it is a DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """All of ``t``: a collective over its mesh for a DTensor (every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def copy_full_into(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t.copy_(value)``; for a dim-0-sharded DTensor only this rank's rows are copied (no
    communication)."""
    if not isinstance(t, DTensor):
        t.copy_(value)
        return
    mesh = t.device_mesh
    world, rank, rows = mesh.size(), mesh.get_local_rank(), value.shape[0]
    chunk = -(-rows // world)
    lo = min(rank * chunk, rows)
    t._local_tensor.copy_(value[lo:min(lo + chunk, rows)])
