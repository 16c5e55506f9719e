"""The chain of units pyfused.parallelize cuts out of a transformers causal LM for pipelining.

  ``Embed``   input_ids -> the hidden states entering block 0;
  ``Block i`` hidden -> block i's output, called with the side inputs the model's forward passes it;
  ``Head``    hidden -> logits (final norm and LM head).

Every unit runs **the model's own forward code** with the block list temporarily replaced by
stand-ins (``ModelParts._blocks_replaced``): ``Embed`` runs the base model on the ids and stops at the
first block (``_StopHere`` raises ``_Stop`` with the arguments the block was called with); a block's
side inputs (mask, rotary table, position ids) are taken the same way, from a forward on
``inputs_embeds`` of the microbatch's shape under no_grad, cached per (block, shape) since they depend
on the shape only (no padding mask travels through the pipeline); with context parallelism
(``ModelParts.positions``) every forward is given the global positions of this rank's rows, which
depend on the length only, so the rotary tables are the whole sequence's; ``Head`` runs the causal-LM forward
with a first stand-in that injects the received hidden states (``_Inject``), so the model's own final
norm, reshape and LM head produce the logits. Stopping by an exception is safe here: transformers'
forward decorators restore their state in ``finally`` blocks, and the stand-ins hold no state.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.nn as nn


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


class NotOnThisStage(nn.Module):
    pyfused_placeholder = True

    def __init__(self, name: str, stage: int):
        super().__init__()
        self.what = f"{name} is not on pipeline stage {stage}"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"pyfused.parallelize: {self.what}")

    def extra_repr(self) -> str:
        return self.what


class ModelParts:
    """Handles on the parts of a transformers causal LM that the units run."""

    def __init__(self, model: nn.Module, blocks_name: str):
        self.top = model
        base_name, _, self.attr = blocks_name.rpartition(".")
        self.base = model.get_submodule(base_name) if base_name else model
        self.blocks = list(getattr(self.base, self.attr))
        self.side_cache: Dict[tuple, tuple] = {}
        # (length, device) -> [1, length] position ids of this rank's rows; None: 0 .. length - 1
        self.positions = None

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
        stand_ins = [_Pass() for _ in range(i)] + [_StopHere()] + [_Pass() for _ in range(n - i - 1)]
        if self.positions is not None:
            x = inputs.get("input_ids", inputs.get("inputs_embeds"))
            inputs["position_ids"] = self.positions(x.shape[1], x.device).expand(x.shape[0], -1)
        with self._blocks_replaced(stand_ins):
            try:
                self.base(use_cache=False, **inputs)
            except _Stop as stop:
                return stop.args, stop.kwargs
        raise RuntimeError(f"{type(self.base).__name__}.forward never called its block {i}")

    def side_inputs(self, i: int, batch_first_shape: tuple, like: torch.Tensor):
        """(args, kwargs) after the hidden states that the forward passes block ``i`` for a batch of
        ``batch_first_shape`` ([b, s, h]); they depend on the shape only, so they are cached."""
        key = (i, tuple(batch_first_shape), like.dtype, like.device)
        if key not in self.side_cache:
            with torch.no_grad():
                dummy = like.new_zeros(batch_first_shape)
                args, kwargs = self.until_block(i, inputs_embeds=dummy)
            self.side_cache[key] = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})
        return self.side_cache[key]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        n = len(self.blocks)
        with self._blocks_replaced([_Inject(hidden)] + [_Pass() for _ in range(n - 1)]):
            return self.top(inputs_embeds=hidden.detach(), use_cache=False).logits


class Embed(nn.Module):
    def __init__(self, m: ModelParts, owned: List[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_m", m)
        self.owned = nn.ModuleList(owned)  # registered for parameters(); run through the model

    def forward(self, input_ids):
        args, kwargs = self._m.until_block(0, input_ids=input_ids)
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class Block(nn.Module):
    """Block ``index``. ``sequence_shards=W > 1``: it receives the previous block's sequence-parallel
    output, a ``[s/W, b, h]`` shard (only a stage's first block gets the full ``[b, s, h]``)."""

    def __init__(self, m: ModelParts, index: int, sequence_shards: int = 1):
        super().__init__()
        object.__setattr__(self, "_m", m)
        self.index = index
        self.sequence_shards = sequence_shards
        self.block = m.blocks[index]

    def forward(self, hidden):
        shape = tuple(hidden.shape)
        if self.sequence_shards > 1:
            shape = (shape[1], shape[0] * self.sequence_shards, *shape[2:])
        args, kwargs = self._m.side_inputs(self.index, shape, hidden)
        out = self.block(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, m: ModelParts, owned: List[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_m", m)
        self.owned = nn.ModuleList(owned)

    def forward(self, hidden):
        return self._m.head(hidden)


def outer_modules(model: nn.Module, blocks_name: str):
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


def replace_with_placeholder(model: nn.Module, name: str, stage: int) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, NotOnThisStage(name, stage))
