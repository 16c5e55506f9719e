"""Pipeline parallelism of a transformers decoder model with pyfused.pipeline.

The chain. A transformers model's forward is not a chain of its children (the blocks take masks,
rotary tables and position ids that the forward computes from the input's shape), so pyfused cuts a
chain of N+2 units out of it and lets ``pyfused.pipeline.split`` balance them:

  ``_Embed``   input_ids -> the hidden states entering block 0;
  ``_Block i`` hidden -> block i's output, called with the side inputs the model's forward passes it;
  ``_Head``    hidden -> logits (final norm and LM head).

Every unit runs **the model's own forward code**, with the block list temporarily replaced by stand-
ins (``_run_with_blocks``): ``_Embed`` runs the base model on the ids and stops at the first block,
taking the hidden states it was given; a block's side inputs are taken the same way, on the
microbatch's shape (``inputs_embeds`` of that shape, under no_grad; cached per shape and block,
since they depend on the shape only -- no padding mask is passed through the pipeline); ``_Head``
runs the causal-LM forward with a first stand-in that injects the received hidden states, so the
model's final norm, reshape and LM head produce the logits. Masks, rotary tables and position
embeddings therefore come from transformers itself, for any Llama-family or GPT-2 variant.

Ownership. Modules registered before the block list (embeddings) belong to the first unit, those
after it (final norm, LM head) to the last; a stage keeps only its units' modules (the others are
replaced by ``_NotOnThisStage``), except small ``replicate`` modules the forward calls on every stage
(GPT-2's position embedding), whose copies on later stages get no gradient and are not gathered. A
tied LM head on the last stage keeps the embedding's Parameter; its gradient is summed over the
pipeline group after each step (Megatron's embedding group), so the two copies stay equal.

A call. ``model(input_ids, labels=...)`` with gradients enabled runs one schedule step -- forward and
backward of every microbatch -- and returns the causal-LM output on every rank: logits on the ranks
of the last stage (None elsewhere) and the loss broadcast from the last stage. Its backward already
ran, so ``ParallelModel.backward(loss)`` is a no-op here (it is ``loss.backward()`` without PP).
Without labels, or under no_grad, the call is a forward-only (eval) step.
"""
from __future__ import annotations

import contextlib
import typing
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .._logging import logger

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


class _Stop(Exception):
    def __init__(self, args, kwargs):
        super().__init__("stop")
        self.args, self.kwargs = args, kwargs


class _StopHere(nn.Module):
    def forward(self, *args, **kwargs):
        raise _Stop(args, kwargs)


class _Pass(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Inject(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return self.hidden


class _NotOnThisStage(nn.Module):
    pyfused_placeholder = True

    def __init__(self, name: str, stage: int):
        super().__init__()
        self.what = f"{name} is not on pipeline stage {stage}"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"pyfused.parallelize: {self.what}")

    def extra_repr(self) -> str:
        return self.what


class _Model:
    """Handles on the parts of a transformers causal LM that the units run."""

    def __init__(self, model: nn.Module, blocks_name: str):
        self.top = model
        base_name, _, self.attr = blocks_name.rpartition(".")
        self.base = model.get_submodule(base_name) if base_name else model
        self.blocks = list(getattr(self.base, self.attr))
        self.side_cache: Dict[tuple, tuple] = {}

    @contextlib.contextmanager
    def _blocks_replaced(self, stand_ins: List[nn.Module]):
        real = self.base._modules[self.attr]
        self.base._modules[self.attr] = nn.ModuleList(stand_ins)
        try:
            yield
        finally:
            self.base._modules[self.attr] = real

    def until_block(self, i: int, **inputs):
        """(args, kwargs) the forward passes to block ``i``."""
        n = len(self.blocks)
        with self._blocks_replaced([_Pass() for _ in range(i)] + [_StopHere()] + [_Pass()] * (n - i - 1)):
            try:
                self.base(use_cache=False, **inputs)
            except _Stop as stop:
                return stop.args, stop.kwargs
        raise RuntimeError(f"{type(self.base).__name__}.forward never called its block {i}")

    def side_inputs(self, i: int, hidden: torch.Tensor):
        key = (i, tuple(hidden.shape), hidden.dtype, hidden.device)
        if key not in self.side_cache:
            with torch.no_grad():
                args, kwargs = self.until_block(i, inputs_embeds=hidden.detach())
            self.side_cache[key] = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})
        return self.side_cache[key]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        n = len(self.blocks)
        with self._blocks_replaced([_Inject(hidden)] + [_Pass() for _ in range(n - 1)]):
            return self.top(inputs_embeds=hidden.detach(), use_cache=False).logits


class _Embed(nn.Module):
    def __init__(self, m: _Model, owned: List[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_m", m)
        self.owned = nn.ModuleList(owned)  # registered for parameters(); run through the model

    def forward(self, input_ids):
        args, kwargs = self._m.until_block(0, input_ids=input_ids)
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class _Block(nn.Module):
    def __init__(self, m: _Model, index: int):
        super().__init__()
        object.__setattr__(self, "_m", m)
        self.index = index
        self.block = m.blocks[index]

    def forward(self, hidden):
        args, kwargs = self._m.side_inputs(self.index, hidden)
        out = self.block(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, m: _Model, owned: List[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_m", m)
        self.owned = nn.ModuleList(owned)

    def forward(self, hidden):
        return self._m.head(hidden)


def _outer_modules(model: nn.Module, blocks_name: str):
    """(before, after): the modules registered before / after the block list along its ancestors'
    children, as (name, module) -- the embedding side and the head side of the model."""
    before, after = [], []
    parts = blocks_name.split(".")
    parent, prefix = model, ""
    for depth, part in enumerate(parts):
        seen = False
        for name, child in parent.named_children():
            if name == part:
                seen = True
                continue
            (after if seen else before).append((prefix + name, child))
        parent = getattr(parent, part)
        prefix += part + "."
    return before, after


def _placeholder(model: nn.Module, name: str, stage: int) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, _NotOnThisStage(name, stage))


def _return_type(model: nn.Module):
    try:
        hint = typing.get_type_hints(type(model).forward).get("return")
    except Exception:  # unresolvable annotations: fall back to the generic causal-LM output
        hint = None
    if isinstance(hint, type):
        return hint
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


class _SyncLastBackward(torch.autograd.Function):
    """Identity whose backward arms DDP's reducer: the gradients accumulated by the earlier
    microbatches (run under ``no_sync``) and this one are then reduced as this backward finishes."""

    @staticmethod
    def forward(ctx, x, ddp):
        ctx.ddp = ddp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.ddp.reducer.prepare_for_backward(())
        return g, None


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
            out = _SyncLastBackward.apply(out, self.ddp)
        return out


class PipelinedModel:
    """This rank's stage of a pipelined model and the schedule that runs it (see the module docstring)."""

    @classmethod
    def build(cls, model: nn.Module, resolved, info, tp, n_microbatches: Optional[int] = None,
              schedule: str = "1f1b", balance: Optional[str] = "time", split_points=None,
              example_input_ids: Optional[torch.Tensor] = None) -> "PipelinedModel":
        from ..pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, split

        self = cls()
        pp, stage = info.size["pp"], info.coord["pp"]
        self.pg, self.pp, self.stage_index = info.group["pp"], pp, stage
        self.n_microbatches = n_microbatches or pp
        self.top = model
        self.full_key_shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
        self.output_type = _return_type(model)
        blocks_name = resolved.blocks[0]
        m = _Model(model, blocks_name)
        before, after = _outer_modules(model, blocks_name)
        n = len(m.blocks)
        units = ([_Embed(m, [mod for _, mod in before])] + [_Block(m, i) for i in range(n)]
                 + [_Head(m, [mod for _, mod in after])])
        device = next(model.parameters()).device
        if example_input_ids is None and split_points is None and balance is not None:
            g = torch.Generator().manual_seed(0)
            seq = min(16, getattr(model.config, "max_position_embeddings", 16) or 16)
            example_input_ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g)
        if split_points is None and balance is None:
            from ..pipeline import even_starts

            split_points = even_starts(len(units), pp)
        example = (example_input_ids.to(device),) if example_input_ids is not None else None
        # Before TP, so that profiling runs no TP collective (only pp rank 0 profiles). Every
        # pipeline group decides, then all adopt the cut of the group at dp = tp = 0: the TP ranks of
        # a stage must hold the same blocks.
        _, report = split(units, pp, example, balance=balance or "time", split_points=split_points,
                          group=self.pg)
        points = [list(report.split_points)]
        for dim in ("tp", "dp"):
            if info.size[dim] > 1:
                dist.broadcast_object_list(points, group=info.group[dim], group_src=0,
                                           device=comm.comm_device(info.group[dim]))
        self.report = report
        bounds = [0, *points[0], len(units)]
        mine = range(bounds[stage], bounds[stage + 1])
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        self.tied = self._tied_pair(model, before, after)
        if self.tied:
            v, h = model.get_submodule(self.tied[0]).weight.shape
            self.tied_local_shape = (v // tp.world, h)
        self.param_names = [nm for nm, _ in model.named_parameters()]
        # keep only this stage's modules (placeholders keep the owned blocks' indices and names)
        blocks_here = [i - 1 for i in mine if 1 <= i <= n]
        for i in range(n):
            if i not in blocks_here:
                m.base._modules[m.attr][i] = _NotOnThisStage(f"{blocks_name}.{i}", stage)
        styles = resolved.styles
        if not self.is_first:
            for name, mod in before:
                if any(True for _ in mod.parameters()) and styles.get(name) != "replicate":
                    _placeholder(model, name, stage)
        if not self.is_last:
            for name, mod in after:
                if any(True for _ in mod.parameters()):
                    _placeholder(model, name, stage)
        if tp.world > 1:
            tp.apply(model, resolved, install_region=False)
        m.blocks = list(m.base._modules[m.attr])  # the TP-sharded blocks
        local_units = []
        for i in mine:
            if i == 0:
                local_units.append(_Embed(m, [model.get_submodule(nm) for nm, _ in before]))
            elif i == n + 1:
                local_units.append(_Head(m, [model.get_submodule(nm) for nm, _ in after]))
            else:
                local_units.append(_Block(m, i - 1))
        tp.install_sequence_region([m.blocks[i] for i in blocks_here])
        from ..pipeline.autosplit import PipelineSegment

        self.submodule = PipelineSegment([(str(i), u) for i, u in zip(mine, local_units)])
        self.model_handle = m
        self.tp = tp
        runner = self.submodule
        self.ddp = None
        if info.size["dp"] > 1:
            from ..layers import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.submodule, process_group=info.group["dp"])
            runner = _DataParallelStage(self.ddp, self.n_microbatches)
        self.runner = runner
        self.stage = PipelineStage(runner, stage, pp, device, group=self.pg)
        sched_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.num_items = None
        self.schedule = sched_cls(self.stage, self.n_microbatches, loss_fn=self._loss)
        self.vocab = model.config.vocab_size
        logger.info("pyfused.parallelize: pipeline stage %d/%d holds units %s (%s): %s", stage, pp,
                    list(mine), schedule, "embedding, blocks, head = units 0, 1..N, N+1")
        return self

    @staticmethod
    def _tied_pair(model, before, after):
        """(embedding module name, head module name) when the LM head shares the embedding's weight."""
        head = model.get_output_embeddings()
        for name, mod in before:
            w = getattr(mod, "weight", None)
            if w is not None and head is not None and head.weight is w:
                head_name = next(nm for nm, md in after if md is head)
                return name, head_name
        return None

    def _loss(self, logits, labels):
        # sum over the microbatch / tokens of the whole batch, times the microbatch count (the
        # schedule divides by it): the full batch's mean loss whatever the microbatches' padding
        return self.top.loss_function(logits=logits, labels=labels, vocab_size=self.vocab,
                                      num_items_in_batch=self.num_items) * self.n_microbatches

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
        train = torch.is_grad_enabled() and labels is not None
        if labels is not None:
            self.num_items = (labels[..., 1:] != -100).sum()
        if isinstance(self.runner, _DataParallelStage):
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
            loss = torch.stack(losses).mean() if self.is_last else torch.zeros((), device=input_ids.device)
            loss = loss.float()
            dist.broadcast(loss, group=self.pg, group_src=self.pp - 1)
        return self.output_type(loss=loss, logits=logits if self.is_last else None)

    def _sum_tied_grads(self) -> None:
        if self.tied is None:
            return
        emb, head = self.tied
        name = emb if self.is_first else head if self.is_last else None
        w = self.top.get_submodule(name).weight if name else None
        if w is not None:
            g = w.grad if w.grad is not None else torch.zeros_like(w)
        else:
            g = torch.zeros(self.tied_local_shape, device=next(self.top.parameters()).device)
        dist.all_reduce(g, group=self.pg)
        if w is not None:
            w.grad = g

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
        parts: List[Optional[dict]] = [None] * self.pp
        dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()}, group=self.pg)
        merged = {}
        for part in parts:  # stage order: the first stage's copy of a shared module wins
            for k, v in part.items():
                merged.setdefault(k, v)
        device = next(self.top.parameters()).device
        order = [k for k in self.full_key_shapes if k in merged] + [k for k in merged if k not in self.full_key_shapes]
        return {k: merged[k].to(device) for k in order}
