"""Context parallelism for ``parallelize``: the ``cp`` mesh dim shards the sequence.

Every rank of a cp group is given the same whole batch (``input_ids`` [B, S], ``labels``), and the
parallel model
  1. pads the sequence at the end to a multiple of 2 * cp (padding after the last real token is
     invisible to it under a causal mask, and its labels are ignored), and keeps this rank's rows
     in the zigzag layout (pyfused/ops/sequence_shards.py), which balances causal attention work;
  2. passes the rows' global ``position_ids``, so rotary embeddings are those of the whole sequence;
  3. runs every attention module through ``ring_attention`` over the cp group (an attention function
     registered with transformers' ``AttentionInterface``, with the module's scaling, sliding window
     and softcapping);
  4. computes the loss of the whole sequence: labels shifted over the whole sequence before it is cut,
     each rank's cross-entropy sum divided by the whole batch's token count, summed over the cp
     group. The returned ``loss`` has that value on every rank; its gradient is cp times this rank's
     part, so that the data-parallel average over the (dp x cp) group -- where the parameters are
     replicated (DDP) or sharded (``dp="fsdp"``: fully_shard over dp x cp flattened; ``dp="hsdp"``:
     sharded over dp_shard x cp flattened, replicated over dp_replicate) -- sums the parts of one
     sequence and averages over the dp batches.
The returned ``logits`` are this rank's rows (``gather_rows`` puts them in global order).

Refused, with the same error on every rank: model types outside ``CP_FAMILIES`` (their attention
does not go through transformers' attention interface with rotary position ids), ep with
cp > 1, and -- at call time -- an ``attention_mask`` that is not all ones
followed by padding at the end (checked on the whole cp group's batch when one is passed).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..ops.ring_attention import ring_attention
from ..ops.sequence_shards import padded_length, shard_positions, shard_sequence, unshard_sequence

ATTENTION_NAME = "pyfused_context_parallel"
CP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYOUT = "zigzag"
IGNORE = -100


def problem(model: nn.Module, cp: int, dp: str, ep: int = 1) -> Optional[str]:
    """Why ``model`` cannot run with context parallelism of size ``cp``, or None (no communication)."""
    if cp == 1:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in CP_FAMILIES:
        return (f"context parallelism (cp={cp}) supports the model types {CP_FAMILIES}, whose "
                f"attention takes rotary position ids and transformers' attention interface; "
                f"got {model_type!r}")
    if ep > 1:
        return (f"context parallelism (cp={cp}) composes with tp, pp and dp='ddp', 'fsdp' or "
                f"'hsdp', not with expert parallelism; got ep={ep}")
    return None


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function contract: [B, H, S, D] in, ([B, S, H, D], None) out."""
    ctx: "ContextParallel" = module.pyfused_context
    if dropout:
        raise ValueError("pyfused context parallelism: attention dropout is not supported")
    out = ring_attention(query, key, value, ctx.pg, causal=True, window=sliding_window or None,
                         softcap=softcap or None, scale=scaling, layout=LAYOUT)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    """The mask function of ``ATTENTION_NAME``: ring_attention builds its mask from positions."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class ContextParallel:
    """The cp dim of a parallel model: its group, size and this rank's coordinate."""

    def __init__(self, pg, size: int, coord: int, replicas=None):
        """``replicas``: the group of every rank that holds these parameters (dp x cp; HSDP:
        dp_replicate x dp_shard x cp), over which a bad ``attention_mask`` on any rank is reported
        on all."""
        self.pg, self.size, self.coord = pg, size, coord
        self.replicas = pg if replicas is None else replicas

    def install(self, model: nn.Module) -> None:
        """Route every attention module of ``model`` through ring_attention over the cp group."""
        if self.size == 1:
            return
        _register()
        model.set_attn_implementation(ATTENTION_NAME)
        for module in model.modules():
            if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
                module.pyfused_context = self

    # ---- a call ----------------------------------------------------------------------------------
    def run(self, runner, args: tuple, kwargs: dict):
        """``runner``'s output on this rank's rows, its ``loss`` that of the whole sequence."""
        if args:
            kwargs = dict(zip(("input_ids", "attention_mask"), args), **kwargs)
        call, labels, count = self.shard_call(kwargs)
        out = runner(**call)
        if labels is not None:
            out["loss"] = self.loss(out["logits"], labels, count)
        return out

    def local_length(self, length: int) -> int:
        """How many rows of a ``length``-token sequence this rank holds (after the padding)."""
        return padded_length(length, self.size, LAYOUT) // self.size

    def shard_call(self, kwargs: dict) -> tuple:
        """(the model's keyword arguments for this rank's rows, the whole-sequence labels of this
        rank's rows or None, the batch's number of counted labels)."""
        kwargs = dict(kwargs)
        ids = kwargs.pop("input_ids")
        labels = kwargs.pop("labels", None)
        mask = kwargs.pop("attention_mask", None)
        if kwargs.get("position_ids") is not None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("pyfused context parallelism: pass input_ids without position_ids or "
                             "inputs_embeds (positions are the whole sequence's)")
        length = ids.shape[1]
        real = self._real_tokens(mask, ids)
        pad = padded_length(length, self.size, LAYOUT) - length
        local = shard_sequence(F.pad(ids, (0, pad)), 1, self.coord, self.size, LAYOUT)
        s_local = local.shape[1]
        positions = shard_positions(self.coord, self.size, s_local, LAYOUT, ids.device)
        kwargs.update(input_ids=local, position_ids=positions.expand(ids.shape[0], s_local))
        if labels is None:
            return kwargs, None, 0
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)
        shifted = shifted.masked_fill(~real, IGNORE)
        count = int((shifted != IGNORE).sum())
        shifted = F.pad(shifted, (0, pad), value=IGNORE)
        return kwargs, shard_sequence(shifted, 1, self.coord, self.size, LAYOUT), count

    def _real_tokens(self, mask: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """Which positions are real tokens: all without a mask; with one, it must be ones followed
        by zeros on every row (the same verdict on every rank of the group)."""
        if mask is None:
            return torch.ones_like(ids, dtype=torch.bool)
        real = mask.bool()
        ones_then_zeros = bool((real.long().diff(dim=1) <= 0).all())
        comm.agree_on_local_work(self.replicas, "pyfused context parallelism: the attention_mask check",
                                 lambda: _refuse_unless(ones_then_zeros))
        return real

    def positions(self, length: int, device) -> torch.Tensor:
        """[1, length]: the global positions of this rank's ``length`` rows."""
        return shard_positions(self.coord, self.size, length, LAYOUT, device).view(1, length)

    def part_of_loss(self, logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
        """This rank's rows' share of the whole batch's mean cross-entropy (``count`` labels)."""
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                               reduction="sum") / max(count, 1)

    def sum_over_group(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the cp group (a collective; no gradient)."""
        total = value.detach().clone()
        with comm.failures_named("parallelize context-parallel loss", self.pg):
            dist.all_reduce(total, group=self.pg)
        return total

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
        """The whole sequence's mean cross-entropy on every rank; gradient cp times this rank's part."""
        part = self.part_of_loss(logits, labels, count)
        total = self.sum_over_group(part)
        return part * self.size + (total - part.detach() * self.size)

    def gather_rows(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's rows of ``t`` (sharded along ``dim``) in global order (a collective)."""
        shards = [torch.empty_like(t) for _ in range(self.size)]
        with comm.failures_named("parallelize gather_rows", self.pg):
            dist.all_gather(shards, t.contiguous(), group=self.pg)
        return unshard_sequence(shards, dim, LAYOUT)


def _refuse_unless(ok: bool) -> None:
    if not ok:
        raise ValueError("context parallelism takes an attention_mask only of ones followed by "
                         "padding at the end of each row (anything else is not causal attention "
                         "over one sequence)")
