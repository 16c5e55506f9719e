"""Distributed checkpoints of a ``ParallelModel`` and its optimizer with torch.distributed.checkpoint.

    from pyfused.parallelize import checkpoint
    checkpoint.save("ckpt/step_100", pm, opt, extra={"step": 100})   # every rank, its own shards
    extra = checkpoint.load("ckpt/step_100", pm, opt)                 # any mesh: DCP reshards

No rank gathers the model. Every entry is keyed by the original model's state-dict key (the optimizer
state by the original parameter name, in the layout of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), and each rank hands DCP its
local tensors as ``CheckpointableTensor``s: plain local tensors that carry, for every rectangular
piece of the original tensor they hold, the piece's offset in the original and in the local tensor.
So a checkpoint describes the original model, whatever the mesh that wrote it:

  * a TP shard (``ShardSpec`` ``dim``): one box per group of a fused q|k|v projection (``parts``),
    each at its own offset; a ``Conv1D`` shard is handed over transposed (a view), in the original's
    ``[in, out]`` layout;
  * a padded vocabulary: the box stops at the real rows, the padding is never written;
  * KV heads replicated over TP ranks, DP replicas, the tied head's two pipeline copies: the same
    box from several ranks, which DCP's planner writes once;
  * pipeline stages: each stage holds its own keys; the stale copies of ``replicate`` modules on
    later stages (never trained) are left out.

Loading builds the same description on the new mesh and DCP reads, for every local box, the pieces
of the saved boxes that overlap it, straight into the parameters and optimizer state. The result is
an ordinary DCP checkpoint: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it
into the original model's state dict, and ``dcp.load`` fills a plain single-process model's.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from .shard import ShardSpec

Box = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]  # local offset, global offset, size


def spec_boxes(spec: ShardSpec, local_shape: Tuple[int, ...]) -> List[Box]:
    """The rectangular pieces of the original tensor a local shard holds, in the shard's own layout
    (``[out, in]`` for a transposed ``Conv1D``): (offset in the shard, offset in the original, size).
    Padding rows are in no box."""
    layout = tuple(spec.full_shape[::-1]) if spec.transpose else tuple(spec.full_shape)
    zero = (0,) * len(local_shape)
    if spec.dim is None or spec.world == 1:
        return [(zero, zero, layout)]
    d = spec.dim
    total = spec.padded or layout[d]
    group = total // spec.parts
    chunk = group // spec.chunks
    boxes = []
    for j in range(spec.parts):
        start = j * group + (spec.rank // spec.replicas) * chunk
        real = max(0, min(chunk, layout[d] - start))
        if real:
            lo = list(zero)
            lo[d] = j * chunk
            go = list(zero)
            go[d] = start
            size = list(layout)
            size[d] = real
            boxes.append((tuple(lo), tuple(go), tuple(size)))
    return boxes


def _checkpointable(local: Tensor, boxes: List[Box], full_shape, transpose: bool) -> Tensor:
    """A view of ``local`` (in the original's layout) that DCP saves and loads as the given pieces
    of a tensor of ``full_shape`` (torch.distributed.checkpoint.CheckpointableTensor)."""
    view = local.detach()
    if transpose:
        view = view.t()
        boxes = [(lo[::-1], go[::-1], size[::-1]) for lo, go, size in boxes]
    view.global_shape = tuple(full_shape)
    view.local_offsets = tuple(lo for lo, _, _ in boxes)
    view.global_offsets = tuple(go for _, go, _ in boxes)
    view.local_sizes = tuple(size for _, _, size in boxes)
    return view


class _Layout:
    """How each of this rank's tensors maps onto the original model's, and which to leave out."""

    def __init__(self, pm):
        self.pm = pm
        self.stale = set()
        stage = pm._stage
        if stage is not None:
            self.stale = set(stage.duplicate_params())
            if stage.tied is not None and stage.is_last:  # kept equal to the embedding: same box
                self.stale.discard(id(stage.top.get_submodule(stage.tied[1]).weight))

    def entry(self, key: str, t: Tensor, like: Optional[Tensor] = None) -> Optional[Tensor]:
        """``t`` (a parameter, buffer, or optimizer state shaped like the parameter ``like``) as DCP
        should see it; None if this rank holds none of the original tensor."""
        spec = self.pm._spec_of(key, like if like is not None else t)
        if spec.dim is None or spec.world == 1:
            return t.detach()
        boxes = spec_boxes(spec, tuple(t.shape))
        if not boxes:
            return None
        return _checkpointable(t, boxes, spec.full_shape, spec.transpose)


def model_state_dict(pm) -> Dict[str, Tensor]:
    """This rank's part of the original model's state dict, described for DCP (views of the
    parameters and buffers: ``dcp.load`` into it loads the model in place)."""
    layout = _Layout(pm)
    out = {}
    for key, t in pm.module.state_dict(keep_vars=True).items():
        if id(t) in layout.stale:
            continue
        v = layout.entry(key, t)
        if v is not None:
            out[key] = v
    return out


def _param_names(pm) -> Dict[int, str]:
    names = {}
    for name, p in pm.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (so that DCP can load into them): one step with zero
    gradients and a learning rate of 0, which leaves the parameters as they are."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None


def optimizer_state_dict(pm, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """This rank's part of the optimizer state, keyed by the original parameter names:
    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}`` (the layout of
    ``get_optimizer_state_dict``). State tensors shaped like their parameter are described like it;
    ``param_groups`` list every stage's parameters (a collective over the pipeline group)."""
    _init_optimizer_state(optimizer)
    layout, names = _Layout(pm), _param_names(pm)
    state: Dict[str, Dict[str, Any]] = {}
    groups = []
    for g in optimizer.param_groups:
        members = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError("pyfused checkpoint: the optimizer holds a tensor that is not a "
                                 "parameter of the parallelized model; build it from pm.parameters()")
            members.append(name)
            if id(p) in layout.stale or p not in optimizer.state:
                continue
            entries = {}
            for k, v in optimizer.state[p].items():
                if isinstance(v, Tensor) and v.shape == p.shape and v.dim() > 0:
                    v = layout.entry(name, v, like=p)
                entries[k] = v
            if all(v is not None for v in entries.values()):
                state[name] = entries
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": members})
    stage = pm._stage
    if stage is not None and stage.pp > 1:
        every: List[Optional[list]] = [None] * stage.pp
        dist.all_gather_object(every, [g["params"] for g in groups], group=stage.pg)
        for i, g in enumerate(groups):
            merged = []
            for lists in every:
                merged += [n for n in lists[i] if n not in merged]
            g["params"] = merged
    return {"state": state, "param_groups": groups}


def _apply_param_groups(optimizer: torch.optim.Optimizer, saved: List[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"pyfused checkpoint: the checkpoint has {len(saved)} optimizer parameter "
                         f"groups, this optimizer {len(optimizer.param_groups)}")
    for g, s in zip(optimizer.param_groups, saved):
        for k, v in s.items():
            if k != "params":
                g[k] = v


def state_dict(pm, optimizer: Optional[torch.optim.Optimizer] = None,
               extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``{"model": ..., "optim": ..., "extra": ...}`` for ``dcp.save`` / ``dcp.load``."""
    out: Dict[str, Any] = {"model": model_state_dict(pm)}
    if optimizer is not None:
        out["optim"] = optimizer_state_dict(pm, optimizer)
    if extra is not None:
        out["extra"] = dict(extra)
    return out


def save(checkpoint_id, pm, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, **dcp_options) -> None:
    """Write ``pm`` (and ``optimizer``; ``extra``: small picklable values such as the step, the same
    on every rank) to the DCP checkpoint ``checkpoint_id`` (a directory). A collective: every rank
    of the mesh calls it."""
    _synchronize(pm)
    dcp.save(state_dict(pm, optimizer, extra), checkpoint_id=checkpoint_id, **dcp_options)


def load(checkpoint_id, pm, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, **dcp_options) -> Dict[str, Any]:
    """Load a checkpoint written by ``save`` on any mesh into ``pm`` (and ``optimizer``), in place.
    ``extra``: the keys (with example values) to read back; returns them. A collective."""
    _synchronize(pm)
    state = state_dict(pm, optimizer, extra)
    dcp.load(state, checkpoint_id=checkpoint_id, **dcp_options)
    if optimizer is not None:
        _apply_param_groups(optimizer, state["optim"]["param_groups"])
    _after_load(pm)
    return state.get("extra", {})


def _ddp_modules(pm):
    runner = pm._runner if pm._stage is None else pm._stage.ddp
    return [runner] if runner is not None and hasattr(runner, "synchronize_params") else []


def _synchronize(pm) -> None:
    for ddp in _ddp_modules(pm):
        ddp.synchronize_params()


def _after_load(pm) -> None:
    for ddp in _ddp_modules(pm):
        sharded = getattr(ddp, "_sharded", None)
        if sharded is not None:
            sharded.refresh_masters()
