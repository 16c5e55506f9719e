"""Expert parallelism in ``parallelize``: the ``ep`` mesh dim.

The ranks along ``ep`` are data-parallel ranks that share the experts out (torchtitan's layout):
each feeds its own batch, every experts module of the plan (style ``experts``) becomes an
``ExpertParallelExperts`` over the ep group holding E/ep of the experts, and every other
parameter is the same on every ep rank (whole, or sharded by fully_shard). Gradients then average
over the ep ranks as data parallelism averages them over dp: an expert's gradient already sums
every ep rank's tokens routed to it and is divided by ep (a hook per parameter); a replicated
parameter's gradient is averaged over the ep ranks by

  * dp="ddp": a hook per parameter that all-reduces it over ep and divides by ep, as backward
    produces it; DDP on a dp dim then averages everything over dp on top (the experts are the same
    on every dp rank of an ep group);
  * dp="fsdp": fully_shard, whose units over every data rank (dp x ep, ``data_mesh``) average it
    in their reduce-scatter; each experts layer is a unit of its own over the dp dim
    (``shard_experts``: the ranks that hold the same experts), averaging over dp.

So the step is the full batch's. Composes with tp: attention shards over tp as usual, the MoE
block runs on each tp rank's tokens (its sequence shard under sequence parallelism) and the
all-to-all runs among the ranks of the same tp coordinate.

``check`` (local, no communication): the plan has experts when ep > 1, each divisible by ep; no
HSDP with ep > 1; with a pipeline (pp > 1, where ``pipeline.py`` applies the same steps to its
stage, dp="ddp" or "fsdp") no ``output_router_logits`` (the pipeline's loss has no auxiliary term).
``apply`` replaces the modules and records each expert parameter's ``ShardSpec`` (dim 0 over the
ep group), so that ``full_state_dict``, ``clip_grad_norm_`` and DCP checkpoints see the original
tensors; ``average_gradients`` installs the hooks, after tensor parallelism
replaced its modules.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import comm
from ..fsdp import fully_shard
from ..layers.moe import ExpertParallelExperts
from .plans import ResolvedPlan
from .shard import ShardSpec


def _experts(model: nn.Module, resolved: ResolvedPlan) -> List[str]:
    modules = dict(model.named_modules())
    return [n for n, s in resolved.styles.items() if s == "experts" and n in modules]


def check(model: nn.Module, resolved: ResolvedPlan, ep: int, pp: int, dp: str) -> Optional[str]:
    """The first reason expert parallelism of size ``ep`` cannot apply, or None."""
    names = _experts(model, resolved)
    if ep == 1:
        return None
    if not names:
        return (f"the mesh has an ep dim of size {ep}, but the plan names no experts module "
                f"(style 'experts'): the model has no mixture-of-experts layer pyfused can shard")
    if pp > 1 and getattr(getattr(model, "config", None), "output_router_logits", False):
        return ("expert parallelism with pipeline parallelism (pp > 1): the config sets "
                "output_router_logits, whose auxiliary loss the pipeline's loss (the language-"
                "model loss of the last stage) would leave out; set it False")
    if dp not in ("ddp", "fsdp"):
        return (f"expert parallelism (ep > 1) with dp={dp!r} is not supported; use dp='ddp' or "
                f"dp='fsdp'")
    modules = dict(model.named_modules())
    for name in names:
        count = modules[name].gate_up_proj.shape[0]
        if count % ep:
            return (f"{name}: its {count} experts are not divisible by the expert-parallel size "
                    f"{ep}")
    return None


def apply(model: nn.Module, resolved: ResolvedPlan, pg, ep: int, rank: int, overlap: str,
          specs: Dict[int, ShardSpec]) -> None:
    """Replace every experts module by an ``ExpertParallelExperts`` over ``pg`` (the ep group) and
    record its parameters' specs in ``specs``; nothing at ep = 1."""
    if ep == 1:
        return
    for name in _experts(model, resolved):
        module = model.get_submodule(name)
        layer = ExpertParallelExperts(module, pg, method=overlap)
        for attr in layer.variant.parameters:  # the weights, and gpt-oss's biases
            full = tuple(getattr(module, attr).shape)
            specs[id(getattr(layer, attr))] = ShardSpec(full, dim=0, world=ep, rank=rank, group=pg)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)


def average_gradients(model: nn.Module, pg, ep: int, replicated_by_fsdp: bool) -> None:
    """Average every gradient over the ep ranks' batches (module docstring), by one hook per
    parameter (fully_shard runs them on its gathered parameters), firing in the same order on every
    rank (they run the same graph): an expert's gradient divided by ep; a replicated one all-reduced
    over ep and divided by ep -- unless ``replicated_by_fsdp``: fully_shard over every data rank
    averages it (``shard_experts``)."""
    if ep == 1:
        return
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelExperts)
               for p in m.parameters()}
    for p in model.parameters():
        if id(p) in experts:
            p.register_hook(_scaled(ep))
        elif not replicated_by_fsdp:
            p.register_hook(_averaged(pg, ep))


def _scaled(ep: int):
    def hook(grad):
        return grad / ep
    return hook


def _averaged(pg, ep: int):
    def hook(grad):
        grad = grad.contiguous().clone()
        with comm.failures_named("parallelize expert-parallel gradient average", pg):
            dist.all_reduce(grad, group=pg)
        return grad.div_(ep)
    return hook


def data_mesh(mesh, dp: int):
    """The 1-D mesh of every data rank of a mesh with an ep dim, dp x ep (the two dims flattened in
    the mesh's order), over which fully_shard shards the parameters outside the experts."""
    if dp == 1:
        return mesh["ep"]
    return mesh[tuple(d for d in mesh.mesh_dim_names if d in ("dp", "ep"))]._flatten()


def experts_mesh(mesh):
    """The mesh of the ranks that hold the same experts as this one: the dp dim, or without one
    this rank alone (a group of one, made by this rank only)."""
    if "dp" in (mesh.mesh_dim_names or ()):
        return mesh["dp"]
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return DeviceMesh.from_group(alone, mesh.device_type)


def shard_experts(model: nn.Module, dp_mesh, specs: Dict[int, ShardSpec]) -> None:
    """fully_shard every experts layer as its own unit over ``dp_mesh`` (``experts_mesh``), its
    ``ShardSpec`` following its parameters to their shards. Then the rest shards over every data
    rank (``data_mesh``), averaging the replicated gradients over dp x ep, while the experts' average
    over dp and are divided by ep, as torchtitan shards them. Without a dp dim the experts are
    units of one rank: the units over ``data_mesh`` must not take them for replicated ones."""
    for layer in [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]:
        before = {n: specs[id(p)] for n, p in layer.named_parameters() if id(p) in specs}
        fully_shard(layer, mesh=dp_mesh)
        for n, p in layer.named_parameters():
            if n in before:
                specs[id(p)] = before[n]
