"""``parallelize(model, mesh, dp="fsdp")``: fully_shard on the mesh's dp dim after tensor parallelism.

Each transformer block becomes a unit, then the root: the whole model (embeddings, final norm, LM
head) or, with pipeline parallelism, this rank's stage module (its blocks' units and the embedding
or head it owns). Parameters are then DTensors over the dp dim holding rows of the TP-local
tensors; the helpers below let the parallel model's state-dict and gradient-norm code read and
write them.

A pipeline step (``FullyShardedStage``) accumulates over its microbatches, as torch FSDP2 under
``torch.distributed.pipelining`` does: gradient sync is off from the step's first forward, so the
stage is gathered once and stays gathered (no per-microbatch re-gather, like FSDP2's
``reshard_after_forward=False`` that torch recommends with PP) and every backward adds to the
unsharded gradients; the last microbatch's backward -- the step's last backward on every stage of
a GPipe, 1F1B or interleaved 1F1B schedule -- turns sync on as it starts, so each unit
reduce-scatters the step's sum once, overlapped with the rest of that backward, and reshards.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..pipeline.accumulation import AccumulatingStage, before_backward
from .fully_shard import FSDPModule, fully_shard


def shard_model(model: nn.Module, block_list: Optional[str], dp_mesh, specs,
                root: Optional[nn.Module] = None,
                blocks: Optional[Iterable[nn.Module]] = None) -> None:
    """Shard over ``dp_mesh`` the blocks (``model.<block_list>``, or ``blocks``), then ``root``
    (default: ``model``); ``specs`` (id(parameter) -> tensor-parallel spec) follows the parameters
    to their shards, found again by their keys in ``model.state_dict()``."""
    by_name = {k: specs[id(t)] for k, t in model.state_dict(keep_vars=True).items() if id(t) in specs}
    if blocks is None:
        blocks = model.get_submodule(block_list) if block_list is not None else ()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model if root is None else root, mesh=dp_mesh)
    for k, t in model.state_dict(keep_vars=True).items():
        if k in by_name:
            specs[id(t)] = by_name[k]


class FullyShardedStage(AccumulatingStage):
    """A fully sharded pipeline stage (``root``, an ``FSDPModule``) run in microbatched steps of
    ``n_microbatches`` by a GPipe, 1F1B or interleaved 1F1B schedule of ``pyfused.pipeline``
    (module docstring): pass it as the ``PipelineStage``'s module. ``begin_step`` (called by the
    stage at every step) resets the microbatch count; the schedules check it with
    ``pyfused.pipeline.accumulation.stage_module_problem``."""

    def __init__(self, root: nn.Module, n_microbatches: int):
        super().__init__()
        if not isinstance(root, FSDPModule):
            raise TypeError("FullyShardedStage needs a fully_shard-ed module")
        self.root = root
        self.n_microbatches = n_microbatches
        self.count = 0

    def begin_step(self) -> None:
        self.count = 0

    def forward(self, *inputs):
        if not torch.is_grad_enabled():  # eval steps, the schedule's shape pass: nothing to reduce
            return self.root(*inputs)
        self.count += 1
        if self.count == 1:
            self.root.set_requires_gradient_sync(False)
        out = self.root(*inputs)
        if self.count == self.n_microbatches:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # the step's last backward on this stage turns gradient sync on as it starts
                out = before_backward(out, lambda: self.root.set_requires_gradient_sync(True))
            else:  # no backward will reach this stage's units: nothing to accumulate or reduce
                self.root.set_requires_gradient_sync(True)
        return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (``t`` itself unless it is a DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """All of ``t``: a collective over its mesh for a DTensor (every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def copy_full_into(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t.copy_(value)``; for a dim-0-sharded DTensor (FSDP's, or HSDP's replicated over its
    first mesh dim) only this rank's rows are copied (no communication)."""
    if not isinstance(t, DTensor):
        t.copy_(value)
        return
    mesh, dim = t.device_mesh, t.device_mesh.ndim - 1  # the shard dim: the last
    world, rank, rows = mesh.size(dim), mesh.get_local_rank(dim), value.shape[0]
    chunk = -(-rows // world)
    lo = min(rank * chunk, rows)
    t._local_tensor.copy_(value[lo:min(lo + chunk, rows)])
