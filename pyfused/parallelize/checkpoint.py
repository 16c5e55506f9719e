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

  * a TP shard (``ShardSpec`` ``dim``): one box per group of a fused projection (q|k|v
    ``sections``, gate|up ``parts``), each at its own offset; a ``Conv1D`` shard is handed over
    transposed (a view), in the original's ``[in, out]`` layout;
  * a padded vocabulary: the box stops at the real rows, the padding is never written;
  * KV heads replicated over TP ranks, DP replicas, the tied head's two pipeline copies: the same
    box from several ranks, which DCP's planner writes once;
  * pipeline stages: each stage holds its own keys; the stale copies of ``replicate`` modules on
    later stages (never trained) are left out.

  * a ZeRO-sharded optimizer (pyfused's ``DistributedDataParallel(shard_optimizer=True)``): each
    piece, a flat range of a parameter's elements, is staged in a tensor over the rows it spans
    and described as one box per run of rows (and per TP box);

Loading builds the same description on the new mesh and DCP reads, for every local box, the pieces
of the saved boxes that overlap it, straight into the parameters and optimizer state (ZeRO pieces
through their staging tensors). ``save`` / ``load`` also take a pyfused ``DistributedDataParallel``
or a plain module in place of a ``ParallelModel``. The result is an ordinary DCP checkpoint:
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into the original model's
state dict, and ``dcp.load`` fills a plain single-process model's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import comm
from . import checkpoint_folder
from .shard import ShardSpec

Box = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]  # local offset, global offset, size


class CheckpointError(RuntimeError):
    """A DCP save or load failed; the same message on every rank (DCP plans collectively and hands
    every rank every rank's failure)."""


def _run(what: str, checkpoint_id, fn, *args, **kwargs):
    """``fn`` (dcp.save / dcp.load), its ``CheckpointException`` -- a BaseException, which
    ``except Exception`` does not catch -- raised as a CheckpointError naming the first failure."""
    if not hasattr(dcp, "CheckpointableTensor"):  # older DCP would take every shard for a whole tensor
        raise CheckpointError(f"pyfused checkpoint: torch {torch.__version__}'s "
                              "torch.distributed.checkpoint has no CheckpointableTensor protocol, "
                              "which describes each rank's shards; it needs a newer torch (2.14 has it)")
    try:
        return fn(*args, checkpoint_id=checkpoint_id, **kwargs)
    except dcp.CheckpointException as e:
        ranks = sorted(e.failures)
        first = e.failures[ranks[0]]
        first = first[0] if isinstance(first, tuple) else first
        raise CheckpointError(f"pyfused checkpoint: {what} {checkpoint_id} failed on ranks {ranks}; "
                              f"rank {ranks[0]}: {type(first).__name__}: {first}") from e


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
    # the groups along d (q|k|v or gate|up sections, else `parts` equal ones); the rank keeps one
    # chunk of each, concatenated in group order
    groups = list(spec.sections) or [total // spec.parts] * spec.parts
    boxes = []
    group_start, local_start = 0, 0
    for group in groups:
        chunk = group // spec.chunks
        start = group_start + (spec.rank // spec.replicas) * chunk
        real = max(0, min(chunk, layout[d] - start))
        if real:
            lo = list(zero)
            lo[d] = local_start
            go = list(zero)
            go[d] = start
            size = list(layout)
            size[d] = real
            boxes.append((tuple(lo), tuple(go), tuple(size)))
        group_start += group
        local_start += chunk
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
            return t.detach()  # a fully_shard DTensor is described by its own placements
        boxes = spec_boxes(spec, tuple(t.shape))
        if isinstance(t, DTensor):  # fully_shard rows of a TP shard: the boxes of those rows
            t, boxes = _rows_of_dtensor(t, boxes)
        if not boxes:
            return None
        return _checkpointable(t, boxes, spec.full_shape, spec.transpose)


def _rows_of_dtensor(t: "DTensor", boxes: List[Box]) -> Tuple[Tensor, List[Box]]:
    """This rank's local rows of a dim-0 sharded DTensor (``fully_shard`` on the dp dim, over a
    tensor-parallel shard; HSDP's is replicated over its first mesh dim) and the parts of ``boxes``
    (in the DTensor's global coordinates) that fall in them, re-based on the local tensor."""
    from torch.distributed.tensor import Replicate, Shard

    *replicated, sharded = t.placements
    if sharded != Shard(0) or any(p != Replicate() for p in replicated):
        raise CheckpointError(f"pyfused checkpoint: a DTensor placed as {t.placements} on a "
                              f"tensor-parallel shard is not supported (only fully_shard's Shard(0) "
                              f"and HSDP's (Replicate(), Shard(0)))")
    local = t.to_local()
    dim = t.device_mesh.ndim - 1
    rows, n = t.shape[0], t.device_mesh.size(dim)
    first = t.device_mesh.get_local_rank(dim) * -(-rows // n)  # torch.chunk's cut, as Shard(0)'s
    last = first + local.shape[0]
    kept = []
    for lo, go, size in boxes:
        a, b = max(lo[0], first), min(lo[0] + size[0], last)
        if a < b:
            kept.append(((a - first, *lo[1:]), (go[0] + a - lo[0], *go[1:]), (b - a, *size[1:])))
    return local, kept


def model_state_dict(pm) -> Dict[str, Tensor]:
    """This rank's part of the original model's state dict, described for DCP (views of the
    parameters and buffers: ``dcp.load`` into it loads the model in place)."""
    pm = _as_parallel(pm)
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
    """``{id(parameter): its name in the original model}``; a parameter shared by several modules
    (a tied LM head) is named as the original's ``named_parameters()`` names it, also on the last
    pipeline stage, whose head is a copy of the first stage's embedding."""
    names = {}
    for name, p in pm.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    stage = pm._stage
    if stage is not None and stage.tied is not None and stage.is_last:
        head = stage.top.get_submodule(stage.tied[1]).weight
        names[id(head)] = f"{stage.tied[0]}.weight"
    return names


def _init_optimizer_state(pm, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (so that DCP can load into them): one step with zero
    gradients and a learning rate of 0, which leaves the parameters as they are. A ZeRO optimizer's
    step gathers the parameters over the dp group, so there the ranks agree first (a rank whose
    shard holds no piece has no state even after training)."""
    needed = not optimizer.state
    zero = [d._sharded for d in _ddp_modules(pm) if getattr(d, "_sharded", None) is not None]
    if zero:
        needed = any(row[0] for row in comm.agree_on(
            zero[0].pg, "checkpoint.load", [int(needed)], width=1,
            detail="whether the optimizer state must be created"))
    if not needed:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:  # ZeRO pieces too (views of a master shard, requires_grad False)
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
    return _optimizer_state_dict(_as_parallel(pm), optimizer, None)


def _optimizer_state_dict(pm, optimizer, copy_back: Optional[list]) -> Dict[str, Any]:
    """``copy_back``: None to save; a list to load into (the state is created first, and the ZeRO
    staging tensors to copy back after DCP filled them are appended)."""
    if copy_back is not None:
        _init_optimizer_state(pm, optimizer)
    layout, names = _Layout(pm), _param_names(pm)
    pieces = zero_pieces(pm)
    state: Dict[str, Dict[str, Any]] = {}
    groups = []
    for g in optimizer.param_groups:
        members = []
        for p in g["params"]:
            piece = pieces.get(id(p))
            owner = piece[0] if piece is not None else p
            name = names.get(id(owner))
            if name is None:
                raise ValueError("pyfused checkpoint: the optimizer holds a tensor that is not a "
                                 "parameter of the parallelized model; build it from pm.parameters()")
            members.append(name)
            if id(owner) in layout.stale or p not in optimizer.state:
                continue
            entries = {}
            for k, v in optimizer.state[p].items():
                if isinstance(v, Tensor) and v.shape == p.shape and v.dim() > 0:
                    v = (layout.entry(name, v, like=p) if piece is None
                         else zero_entry(pm, name, owner, piece[1], v,
                                         [] if copy_back is None else copy_back))
                entries[k] = v
            if all(v is not None for v in entries.values()):
                state[name] = entries
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": members})
    stage = pm._stage
    if stage is not None and stage.pp > 1:
        every = comm.agree_on(stage.pg, "checkpoint", [g["params"] for g in groups],
                              detail="every stage's optimizer parameter names")
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
    """``{"model": ..., "optim": ..., "extra": ...}`` as ``save`` hands it to ``dcp.save`` (to add
    entries of your own, or another storage writer). Load with ``load``: it creates the optimizer
    state first and copies ZeRO pieces back from their staging tensors."""
    return _state_dict(_as_parallel(pm), optimizer, extra, None)


def _state_dict(pm, optimizer, extra, copy_back: Optional[list]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"model": model_state_dict(pm)}
    if optimizer is not None:
        out["optim"] = _optimizer_state_dict(pm, optimizer, copy_back)
    if extra is not None:
        out["extra"] = dict(extra)
    return out


def save(checkpoint_id, pm, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, **dcp_options) -> None:
    """Write ``pm`` (and ``optimizer``; ``extra``: small picklable values such as the step, the same
    on every rank) to the DCP checkpoint ``checkpoint_id`` (a directory). A collective: every rank
    of the mesh calls it.

    Atomic (checkpoint_folder.py): the ranks write into ``<checkpoint_id>.partial``, which becomes
    ``checkpoint_id``, marked complete, only after every rank's write returned; a save interrupted
    before that leaves an earlier checkpoint of that name as it was. A rank that dies or freezes
    meanwhile makes the others raise ``PeerFailure`` naming ``checkpoint.save``."""
    pm = _as_parallel(pm)
    pg = _group(dcp_options)
    final = Path(checkpoint_id)
    with comm.failures_named("checkpoint.save", pg):
        _synchronize(pm)
        state = _state_dict(pm, optimizer, extra, None)
        staged, world = checkpoint_folder.staging_folder(final), comm.world_size(pg)
        coordinator = _is_coordinator(pg)  # DCP's: it prepares and commits the folder
        comm.agree_on_local_work(pg, f"checkpoint.save: preparing {staged}",
                                 lambda: checkpoint_folder.prepare(final) if coordinator else None)
        _run("saving", staged, dcp.save, state, **dcp_options)
        comm.agree_on_local_work(pg, f"checkpoint.save: committing {final}",
                                 lambda: checkpoint_folder.commit(final, world) if coordinator else None)


def load(checkpoint_id, pm, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, *, allow_incomplete: bool = False,
         **dcp_options) -> Dict[str, Any]:
    """Load a checkpoint written by ``save`` on any mesh into ``pm`` (and ``optimizer``), in place.
    ``extra``: the keys (with example values) to read back; returns them. A collective. A checkpoint
    of another model (a missing key, another shape), or one whose save did not finish (no
    ``COMPLETE`` marker; ``allow_incomplete=True`` loads such a folder, e.g. one written by a plain
    ``dcp.save``), raises CheckpointError on every rank."""
    pm = _as_parallel(pm)
    pg = _group(dcp_options)
    with comm.failures_named("checkpoint.load", pg):
        if not allow_incomplete:
            _require_complete(pg, checkpoint_id)
        _synchronize(pm)
        copy_back: list = []
        state = _state_dict(pm, optimizer, extra, copy_back)
        _run("loading", checkpoint_id, dcp.load, state, **dcp_options)
    with torch.no_grad():
        for staged, target in copy_back:
            target.copy_(staged)
    if optimizer is not None:
        _apply_param_groups(optimizer, state["optim"]["param_groups"])
    _after_load(pm)
    return state.get("extra", {})


def is_complete(checkpoint_id) -> bool:
    """Whether ``checkpoint_id`` is a checkpoint whose ``save`` finished on every rank (local)."""
    return checkpoint_folder.is_complete(checkpoint_id)


def _require_complete(pg, checkpoint_id) -> None:
    """The same CheckpointError on every rank unless every rank sees a complete checkpoint."""
    def check():
        reason = checkpoint_folder.incomplete_reason(checkpoint_id)
        if reason is not None:
            raise CheckpointError(reason)

    try:
        comm.agree_on_local_work(pg, f"checkpoint.load: checking {checkpoint_id}", check)
    except comm.LocalWorkError as e:
        raise CheckpointError(f"pyfused checkpoint: {e}") from None


def _group(dcp_options) -> Optional[dist.ProcessGroup]:
    """DCP's group: its ``process_group`` option, else the default group (None without one)."""
    pg = dcp_options.get("process_group")
    if pg is None and dist.is_available() and dist.is_initialized():
        pg = dist.group.WORLD
    return pg


def _is_coordinator(pg) -> bool:
    """Whether this rank is DCP's coordinator: rank 0 of its group."""
    return pg is None or dist.get_rank(pg) == 0


def _ddp_modules(pm):
    runner = pm._runner if pm._stage is None else pm._stage.ddp
    return [runner] if runner is not None and hasattr(runner, "synchronize_params") else []


# ---- models that are not a ParallelModel: pyfused's DistributedDataParallel, a plain module ----------
class _Unsharded:
    """A model without tensor or pipeline parallelism, seen as a ParallelModel: every tensor is the
    original's (a DistributedDataParallel replica, or the plain module itself)."""

    _stage = None

    def __init__(self, model: torch.nn.Module):
        self._runner = model
        self.module = getattr(model, "module", model) if hasattr(model, "synchronize_params") else model

    def _spec_of(self, key: str, t: Tensor) -> ShardSpec:
        return ShardSpec(tuple(t.shape))


def _as_parallel(model):
    from .api import ParallelModel

    return model if isinstance(model, (ParallelModel, _Unsharded)) else _Unsharded(model)


# ---- ZeRO: optimizer state of a DistributedDataParallel(shard_optimizer=True) -------------------------
def zero_pieces(pm) -> Dict[int, Tuple[Tensor, int]]:
    """``{id(piece): (its parameter, first element)}`` for the ZeRO pieces this rank's optimizer
    steps: a piece is a flat range of its parameter's (local) elements (pyfused/dp/sharded.py)."""
    out = {}
    for ddp in _ddp_modules(pm):
        sharded = getattr(ddp, "_sharded", None)
        if sharded is not None:
            for pc in sharded.pieces_of():
                out[id(pc.tensor)] = (sharded.params[pc.param], pc.p_lo)
    return out


def _flat_range_boxes(shape: Tuple[int, ...], first: int, n: int) -> Tuple[int, List[Box]]:
    """Elements [first, first + n) of a row-major tensor of ``shape`` (1-D or 2-D) as boxes of a
    staging tensor holding the rows they span: (its first row, [(offset in the staging tensor,
    offset in the tensor, size)])."""
    if len(shape) == 1:  # the staging tensor is the piece itself
        return 0, [((0,), (first,), (n,))]
    if len(shape) != 2:
        raise ValueError(f"pyfused checkpoint: ZeRO optimizer state of a {len(shape)}-D parameter "
                         "is not supported (1-D and 2-D are)")
    cols = shape[1]
    row0, end = first // cols, first + n
    boxes, at = [], first
    while at < end:
        row, col = divmod(at, cols)
        if col == 0 and end - at >= cols:  # whole rows
            rows = (end - at) // cols
            boxes.append(((row - row0, 0), (row, 0), (rows, cols)))
            at += rows * cols
        else:
            width = min(cols - col, end - at)
            boxes.append(((row - row0, col), (row, col), (1, width)))
            at += width
    return row0, boxes


def _intersect(box: Box, shard: Box) -> Optional[Box]:
    """The part of ``box`` (staging offset, offset in the local tensor, size) inside the TP box
    ``shard`` (offset in the local tensor, offset in the original, size), with its offset in the
    original instead of the local one."""
    s_lo, l_lo, size = box
    t_lo, g_lo, t_size = shard
    lo = [max(a, b) for a, b in zip(l_lo, t_lo)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(l_lo, size, t_lo, t_size)]
    if any(h <= x for x, h in zip(lo, hi)):
        return None
    return (tuple(s + x - a for s, x, a in zip(s_lo, lo, l_lo)),
            tuple(g + x - t for g, x, t in zip(g_lo, lo, t_lo)),
            tuple(h - x for x, h in zip(lo, hi)))


def zero_entry(pm, name: str, param: Tensor, first: int, value: Tensor,
               copy_back: list) -> Optional[Tensor]:
    """A ZeRO piece's state tensor ``value`` (elements [first, first + n) of ``param``, flattened)
    as DCP should see it: a staging tensor over the rows the piece spans, with one box per row run
    (and per TP box). ``copy_back`` gets (staging, value) so that a load can copy it back."""
    spec = pm._spec_of(name, param)
    shape = tuple(param.shape)
    row0, boxes = _flat_range_boxes(shape, first, value.numel())
    if len(shape) == 1:
        staged = value
    else:
        rows = boxes[-1][0][0] + boxes[-1][2][0]
        staged = value.new_zeros((rows, shape[1]))
        start = first - row0 * shape[1]
        staged.view(-1)[start:start + value.numel()].copy_(value.detach())
        copy_back.append((staged.view(-1)[start:start + value.numel()], value))
    tp_boxes = spec_boxes(spec, shape)
    mapped = [m for b in boxes for t in tp_boxes for m in [_intersect(b, t)] if m is not None]
    if not mapped:
        return None
    return _checkpointable(staged, mapped, spec.full_shape, spec.transpose)


def _synchronize(pm) -> None:
    for ddp in _ddp_modules(pm):
        ddp.synchronize_params()


def _after_load(pm) -> None:
    for ddp in _ddp_modules(pm):
        sharded = getattr(ddp, "_sharded", None)
        if sharded is not None:
            sharded.refresh_masters()
