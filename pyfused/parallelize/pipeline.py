"""Pipeline parallelism of a transformers decoder model with pyfused.pipeline.

The chain. A transformers model's forward is not a chain of its children (the blocks take masks,
rotary tables and position ids that the forward computes from the input's shape), so pyfused cuts a
chain of N+2 units out of it and lets ``pyfused.pipeline.split`` balance them:

  ``Embed``   input_ids -> the hidden states entering block 0;
  ``Block i`` hidden -> block i's output, called with the side inputs the model's forward passes it;
  ``Head``    hidden -> logits (final norm and LM head).

Every unit runs the model's own forward code (pipeline_units.py), so masks, rotary tables and
position embeddings come from transformers itself, for any Llama-family or GPT-2 variant.

Ownership. Modules registered before the block list (embeddings) belong to the first unit, those
after it (final norm, LM head) to the last; a stage keeps only its units' modules (the others are
replaced by ``NotOnThisStage``), except small ``replicate`` modules the forward calls on every stage
(GPT-2's position embedding), whose copies on later stages get no gradient and are not gathered. A
tied LM head on the last stage starts as a copy of the embedding's shard; the two copies' gradients
are summed over the pipeline group after each step (Megatron's embedding group), so they stay equal.

A call. ``model(input_ids, labels=...)`` with gradients enabled runs one schedule step -- forward and
backward of every microbatch -- and returns the causal-LM output on every rank: logits on the ranks
of the last stage (None elsewhere) and the loss broadcast from the last stage. Its backward already
ran, so ``ParallelModel.backward(loss)`` is a no-op here (it is ``loss.backward()`` without PP).
Without labels, under no_grad or in eval mode, the call is a forward-only step (logits, and the
loss when labels are given).

DP inside a stage: DDP's hooks reduce on the backward of a forward run outside ``no_sync``, but in a
1F1B step the last forward precedes earlier microbatches' backwards; so every microbatch runs under
``no_sync`` and the last one's backward -- the last backward of the step on every stage -- arms the
reducer as it starts (``pyfused.pipeline.accumulation.before_backward``), reducing the accumulated
gradients. Expert parallelism (ep > 1, dp="ddp") replaces the stage's experts modules and
averages its gradients over ep as it does without a pipeline (moe.py); the ep ranks of a stage run
the same schedule, so their all-to-alls and gradient hooks meet. With
``dp="fsdp"`` the stage is fully sharded over its dp group instead (its blocks, then the stage
module) and run by ``pyfused.fsdp.compose.FullyShardedStage``: gathered once per step, gradients
accumulated unsharded and reduce-scattered once, as the last microbatch's backward starts. With
``dp="hsdp"`` the same on HSDP's 2-D (dp_replicate, dp_shard) mesh: each unit's reduce-scatter over
dp_shard is followed by its all-reduce over dp_replicate, once per step; the tied head's and the
norm's sums then treat dp_shard as FSDP's dp (the replicas hold the same rows).

Context parallelism (cp > 1, context.py): every rank of a cp group runs the same stage on its zigzag
rows of the sequence (padded at the end to a multiple of 2 cp), with the global positions of those
rows (``ModelParts.positions``) and attention through ring_attention over the cp group. The labels
are shifted over the whole sequence before the cut, and a microbatch's loss is its rows' cross-
entropy sum over the whole batch's label count, times cp: DDP (or fully_shard) over dp x cp then
averages the dp batches and sums the parts of one sequence. The returned loss, summed over the
last stage's cp group, is the whole sequence's mean cross-entropy.
"""
from __future__ import annotations

import typing
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import comm
from .._logging import logger
from ..fsdp import compose as fsdp_compose
from ..layers import DistributedDataParallel
from ..pipeline import PipelineSegment, PipelineStage, Schedule1F1B, ScheduleGPipe, even_starts, split
from ..pipeline.accumulation import before_backward
from . import moe as ep_mod
from .pipeline_units import (
    Block,
    Embed,
    Head,
    ModelParts,
    NotOnThisStage,
    outer_modules,
    replace_with_placeholder,
)

PIPELINE_OPTIONS = ("n_microbatches", "schedule", "balance", "split_points", "example_input_ids")
SCHEDULE_NAMES = ("1f1b", "gpipe")


def check(model: nn.Module, resolved, pp: int, options: Dict) -> Optional[str]:
    unknown = [k for k in options if k not in PIPELINE_OPTIONS]
    if unknown:
        return f"unknown pipeline option(s) {unknown}; known: {PIPELINE_OPTIONS}"
    if not resolved.blocks:
        return "pipeline parallelism needs a 'blocks' entry in the plan (the list the splitter cuts)"
    if options.get("schedule", "1f1b") not in SCHEDULE_NAMES:
        return f"schedule must be one of {SCHEDULE_NAMES}, got {options['schedule']!r}"
    n_units = len(model.get_submodule(resolved.blocks[0])) + 2
    if pp > n_units:
        return f"pp={pp} stages but the model has only {n_units} pipeline units (embedding, blocks, head)"
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        return f"{type(model).__name__} has no LM head: pipeline parallelism supports causal LMs"
    return None


def _return_type(model: nn.Module):
    try:
        hint = typing.get_type_hints(type(model).forward).get("return")
    except Exception:  # unresolvable annotations: fall back to the generic causal-LM output
        hint = None
    if isinstance(hint, type):
        return hint
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``param``: a DTensor of the same layout for a fully_shard one."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


class _DataParallelStage(nn.Module):
    """A stage module under DDP for microbatched steps: every microbatch runs under ``no_sync``; the
    last one's backward -- the last backward of a GPipe or 1F1B step on every stage -- reduces."""

    def __init__(self, ddp, n_microbatches: int):
        super().__init__()
        self.ddp = ddp
        self.n_microbatches = n_microbatches
        self.count = 0

    def forward(self, *inputs):
        if not torch.is_grad_enabled():  # eval steps and the schedule's shape pass: nothing to reduce
            return self.ddp.module(*inputs)
        self.count += 1
        with self.ddp.no_sync():
            out = self.ddp(*inputs)
        if self.count == self.n_microbatches:
            # arm DDP's reducer: the gradients accumulated under no_sync and this microbatch's
            # are reduced as this backward finishes
            out = before_backward(out, lambda: self.ddp.reducer.prepare_for_backward(()))
        return out


class PipelinedModel:
    """This rank's stage of a pipelined model and the schedule that runs it (see the module docstring).

    Built in this order: the chain of units and its cut (decided on the full model, before TP);
    placeholders for what other stages own; TP on what is left; this stage's units, the sequence-
    parallel region over its blocks, DDP or fully_shard over them (dp > 1), the PipelineStage and
    the schedule."""

    def __init__(self, model: nn.Module, resolved, info, tp, n_microbatches: Optional[int] = None,
                 schedule: str = "1f1b", balance: Optional[str] = "time", split_points=None,
                 example_input_ids: Optional[torch.Tensor] = None, data_parallel: str = "ddp",
                 data_mesh=None, context=None):
        """``data_mesh``: the mesh of the ranks that hold this stage's parameters, None when there
        is one: 1-D (dp, or dp x cp flattened), or with ``data_parallel="hsdp"`` HSDP's 2-D
        (replicate, shard) mesh; ``context``: the cp dim's ``ContextParallel``, None at cp = 1."""
        self.pp, self.stage_index, self.pg = info.size["pp"], info.coord["pp"], info.group["pp"]
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.pp - 1
        self.n_microbatches = n_microbatches or self.pp
        self.top, self.tp, self.context = model, tp, context
        self.vocab = model.config.vocab_size
        self.output_type = _return_type(model)
        self.full_key_shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
        self.param_names = [nm for nm, _ in model.named_parameters()]
        self.blocks_name = resolved.blocks[0]
        self.parts = ModelParts(model, self.blocks_name)
        self.before, self.after = outer_modules(model, self.blocks_name)
        self.tied = self._tied_pair()
        self.device = next(model.parameters()).device

        n = len(self.parts.blocks)
        units = ([Embed(self.parts, [mod for _, mod in self.before])]
                 + [Block(self.parts, i) for i in range(n)]
                 + [Head(self.parts, [mod for _, mod in self.after])])
        bounds = self._cut(units, info, balance, split_points, example_input_ids)
        self.units = range(bounds[self.stage_index], bounds[self.stage_index + 1])
        blocks_here = [i - 1 for i in self.units if 1 <= i <= n]
        self._drop_other_stages(resolved.styles, blocks_here)
        ep = info.size["ep"]  # this stage's experts over its ep group, as without pipeline (moe.py)
        ep_mod.apply(model, resolved, info.group["ep"], ep, info.coord["ep"], tp.overlap,
                     tp.param_specs)
        if tp.world > 1:
            tp.apply(model, resolved, install_region=False)
        # with ep > 1 fully_shard runs over every data rank (dp x ep) even without a dp dim
        fully_sharded = data_parallel == "hsdp" or (
            data_parallel == "fsdp" and (data_mesh is not None or ep > 1))
        ep_mod.average_gradients(model, info.group["ep"], ep, replicated_by_fsdp=fully_sharded)
        self.parts.blocks = list(self.parts.base._modules[self.parts.attr])  # now TP-sharded
        if context is not None:  # after the cut: its profiling runs no cp collective
            context.install(model)
            self.parts.positions = context.positions
        tp.install_sequence_region([self.parts.blocks[i] for i in blocks_here])
        self.submodule = self._stage_module(n)

        # the group over which fully_shard cut this stage's parameters (None: not sharded)
        self.ddp, runner, self.dp_shards, self.shard_group = None, self.submodule, None, None
        if fully_sharded:
            if ep > 1:  # the experts units of their own over dp, the rest over dp x ep (moe.py)
                ep_mod.shard_experts(model, ep_mod.experts_mesh(info.mesh), tp.param_specs)
                data_mesh = ep_mod.data_mesh(info.mesh, info.size["dp"])
            # (world, rank) of the data-parallel shards: the mesh's last dim (HSDP's shard dim)
            shard_dim = data_mesh.ndim - 1
            self.dp_shards = (data_mesh.size(shard_dim), data_mesh.get_local_rank(shard_dim))
            self.shard_group = data_mesh.get_group(shard_dim)
            fsdp_compose.shard_model(model, None, data_mesh, tp.param_specs,
                                     root=self.submodule,
                                     blocks=[self.parts.blocks[i] for i in blocks_here])
            runner = fsdp_compose.FullyShardedStage(self.submodule, self.n_microbatches)
        elif data_mesh is not None:
            self.ddp = DistributedDataParallel(self.submodule, process_group=data_mesh.get_group())
            runner = _DataParallelStage(self.ddp, self.n_microbatches)
        self.runner = runner
        self.stage = PipelineStage(runner, self.stage_index, self.pp, self.device, group=self.pg)
        sched_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.num_items = None
        # The loss function already divides by the whole batch's token count, so the schedule must not
        # scale the microbatch losses again (exact for uneven microbatches too).
        self.schedule = sched_cls(self.stage, self.n_microbatches, loss_fn=self._loss,
                                  scale_grads=False)
        logger.info("pyfused.parallelize: pipeline stage %d/%d runs units %d..%d of %d (embedding, "
                    "%d blocks, head) with %s", self.stage_index, self.pp, self.units.start,
                    self.units.stop - 1, n + 2, n, schedule)

    def _cut(self, units, info, balance, split_points, example_input_ids) -> List[int]:
        """Unit indices where the stages start, the same on every rank of the mesh.

        On the full model, before TP: only pp rank 0 profiles, so it must run no TP collective.
        Every pipeline group decides; all then adopt the cut of the group at dp = tp = cp = 0 (HSDP:
        dp_replicate = dp_shard = 0; the TP, data and cp ranks of a stage must hold the same blocks,
        and timings differ from rank to rank)."""
        model = self.top
        if split_points is None and balance is None:
            split_points = even_starts(len(units), self.pp)
        if example_input_ids is None and split_points is None:
            g = torch.Generator().manual_seed(0)
            seq = min(16, getattr(model.config, "max_position_embeddings", 16) or 16)
            example_input_ids = torch.randint(0, self.vocab, (1, seq), generator=g)
        example = (example_input_ids.to(self.device),) if example_input_ids is not None else None
        _, self.report = split(units, self.pp, example, balance=balance or "time",
                               split_points=split_points, group=self.pg)
        points = list(self.report.split_points)
        # the peers take the points of their group's rank 0 (a dim absent from the mesh: no group)
        for dim in ("tp", "dp", "dp_replicate", "dp_shard", "cp"):
            points = comm.agree_on(info.group[dim], "parallelize", points,
                                   detail=f"the split points along {dim}")[0]
        return [0, *points, len(units)]

    def _drop_other_stages(self, styles, blocks_here: List[int]) -> None:
        """Placeholders for the modules other stages own (the owned blocks keep their indices, so
        their parameter names are the original ones). 'replicate' modules before the blocks stay:
        the forward calls them on every stage (GPT-2's position embedding)."""
        model, parts, stage = self.top, self.parts, self.stage_index
        for i in range(len(parts.blocks)):
            if i not in blocks_here:
                parts.base._modules[parts.attr][i] = NotOnThisStage(f"{self.blocks_name}.{i}", stage)
        has_params = lambda mod: any(True for _ in mod.parameters())  # noqa: E731
        if not self.is_first:
            for name, mod in self.before:
                if has_params(mod) and styles.get(name) != "replicate":
                    replace_with_placeholder(model, name, stage)
        if not self.is_last:
            for name, mod in self.after:
                if has_params(mod):
                    replace_with_placeholder(model, name, stage)

    def _stage_module(self, n: int) -> nn.Module:
        model, local = self.top, []
        first_block = next((i for i in self.units if 1 <= i <= n), None)
        for i in self.units:
            if i == 0:
                local.append(Embed(self.parts, [model.get_submodule(nm) for nm, _ in self.before]))
            elif i == n + 1:
                local.append(Head(self.parts, [model.get_submodule(nm) for nm, _ in self.after]))
            else:  # inside the stage's sequence-parallel region, blocks pass shards to each other
                shards = self.tp.world if self.tp.sp and i != first_block else 1
                local.append(Block(self.parts, i - 1, shards))
        return PipelineSegment([(str(i), u) for i, u in zip(self.units, local)])

    def _tied_pair(self):
        """(embedding module name, head module name) when the LM head shares the embedding's weight."""
        head = self.top.get_output_embeddings()
        for name, mod in self.before:
            w = getattr(mod, "weight", None)
            if w is not None and head is not None and head.weight is w:
                return name, next(nm for nm, md in self.after if md is head)
        return None

    def _loss(self, logits, labels):
        if self.context is not None:  # labels shifted over the whole sequence (context.py)
            return self.context.part_of_loss(logits, labels, self.num_items) * self.context.size
        # sum over the microbatch / tokens of the whole batch: the microbatches' losses add up to
        # the full batch's mean loss, however the batch was split and padded
        return self.top.loss_function(logits=logits, labels=labels, vocab_size=self.vocab,
                                      num_items_in_batch=self.num_items)

    # ---- a call --------------------------------------------------------------------------------
    def run(self, args, kwargs):
        kwargs = dict(kwargs)
        input_ids = kwargs.pop("input_ids", args[0] if args else None)
        labels = kwargs.pop("labels", None)
        for k in ("use_cache", "return_dict"):
            kwargs.pop(k, None)
        extra = [k for k, v in kwargs.items() if v is not None]
        if len(args) > 1 or extra or not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"with pipeline parallelism the model takes input_ids (and labels) only; "
                             f"got {len(args)} positional argument(s) and {sorted(extra)}")
        self._check_one_batch_shape(input_ids)
        # a training step (forward and backward) only where the original's call could be one
        train = self.top.training and torch.is_grad_enabled() and labels is not None
        if self.context is not None:  # this rank's rows, the labels shifted before the cut
            call, labels, self.num_items = self.context.shard_call(
                {"input_ids": input_ids, "labels": labels})
            input_ids = call["input_ids"]
        elif labels is not None:
            self.num_items = (labels[..., 1:] != -100).sum()
        if hasattr(self.runner, "count"):  # DDP or FSDP: microbatches counted per step
            self.runner.count = 0
        losses: list = []
        if train:
            logits = self.schedule.step(input_ids, target=labels, losses=losses)
            self._sum_tied_grads()
        else:
            with torch.no_grad():
                logits = self.schedule.eval(input_ids, target=labels, losses=losses)
        loss = None
        if labels is not None:
            loss = torch.stack(losses).sum() if self.is_last else torch.zeros((), device=input_ids.device)
            loss = loss.float()
            if self.context is not None and self.is_last:
                loss = self.context.sum_over_group(loss / self.context.size)
            with comm.failures_named("parallelize pipeline (loss broadcast)", self.pg):
                dist.broadcast(loss, group=self.pg, group_src=self.pp - 1)
        return self.output_type(loss=loss, logits=logits if self.is_last else None)

    def _check_one_batch_shape(self, input_ids: torch.Tensor) -> None:
        """Under fully_shard every data rank of a stage must feed batches of one shape: the
        pipeline's shape pass (pyfused/pipeline/meta.py), which gathers the stage's parameters
        over ``shard_group``, runs again when a pipeline's shapes change, and ranks running it a
        different number of times would wait on each other's gathers until the timeout. One
        all-reduce of four integers per call (none with validation "off"); the same ``InputError``
        on every rank of the group."""
        if self.shard_group is None or not comm.validation_enabled():
            return
        dims = list(input_ids.shape[:2]) + [0] * (2 - min(2, input_ids.dim()))
        both = torch.tensor(dims + [-d for d in dims], dtype=torch.int64,
                            device=comm.comm_device(self.shard_group))
        with comm.failures_named("parallelize pipeline (batch shape check)", self.shard_group):
            dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.shard_group)
        low, high = both[:2].tolist(), [-d for d in both[2:].tolist()]
        if low != high:
            raise comm.InputError(
                f"pyfused.parallelize: with pipeline parallelism and a fully sharded data-parallel "
                f"dim, every data rank must feed input_ids of the same shape; this step's batch, "
                f"sequence range over the ranks from {low} to {high} (pad the batches to one "
                f"shape)")

    def _sum_tied_grads(self) -> None:
        if self.tied is None:
            return
        emb, head = self.tied
        name = emb if self.is_first else head if self.is_last else None
        w = self.top.get_submodule(name).weight if name else None
        if w is not None:  # under FSDP the two ends hold the same dp rows: their local pieces add
            g = (fsdp_compose.local(w.grad) if w.grad is not None
                 else torch.zeros_like(fsdp_compose.local(w)))
        else:  # a middle stage: the tensor the two ends sum, [V/tp, h] (its dp rows under FSDP)
            v, h = self.full_key_shapes[f"{emb}.weight"]
            rows = v // self.tp.world
            if self.dp_shards is not None:
                world, rank = self.dp_shards
                chunk = -(-rows // world)
                rows = max(0, min(chunk, rows - rank * chunk))
            g = torch.zeros((rows, h), device=self.device)
        with comm.failures_named("parallelize pipeline (tied embedding gradients)", self.pg):
            dist.all_reduce(g, group=self.pg)
        if w is not None and w.grad is None:
            w.grad = _like(w, g)

    def duplicate_params(self) -> set:
        """ids of this stage's parameters that another stage owns as well: the tied LM head on the
        last stage (the embedding on the first counts), and copies of 'replicate' modules that
        only the first stage trains."""
        dup = set()
        if self.tied is not None and self.is_last:
            dup.add(id(self.top.get_submodule(self.tied[1]).weight))
        if not self.is_first:
            owned = {id(p) for p in self.submodule.parameters()}
            dup |= {id(p) for p in self.top.parameters() if id(p) not in owned}
        return dup

    # ---- state -----------------------------------------------------------------------------------
    def gather_stages(self, local: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        parts = comm.agree_on(self.pg, "parallelize", {k: v.cpu() for k, v in local.items()},
                              detail="every stage's state")
        merged = {}
        for part in parts:  # stage order: the first stage's copy of a shared module wins
            for k, v in part.items():
                merged.setdefault(k, v)
        order = [k for k in self.full_key_shapes if k in merged]
        order += [k for k in merged if k not in self.full_key_shapes]
        return {k: merged[k].to(self.device) for k in order}
