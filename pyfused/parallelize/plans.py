"""Parallelization plans: module-name patterns -> style, and the built-in plans of known model families.

A plan is a dict ``{pattern: style}`` over the model's module names (``model.named_modules()``), like
the ``parallelize_plan`` of torch's ``parallelize_module`` or transformers' ``tp_plan``. In a pattern
``*`` matches one name component (``model.layers.*.mlp.up_proj``). Styles:

  ``colwise``        ``nn.Linear`` / GPT-2 ``Conv1D`` -> ColumnParallelLinear (output features sharded).
                     Inside the sequence-parallel region it gathers the sequence shard itself
                     (``all_gather_matmul``) unless an enclosing ``attention`` module gathered it.
  ``colwise_qkv``    like ``colwise`` for a fused q|k|v projection (three equal parts, each sharded).
  ``colwise_kv``     like ``colwise`` for a projection onto the key/value heads of grouped-query
                     attention: sharded by whole KV heads; with more TP ranks than KV heads (TP a
                     multiple of them) each KV head is replicated on TP/KV consecutive ranks -- the
                     ranks whose query heads use it -- and its gradients are summed over those ranks.
  ``rowwise``        -> RowParallelLinear (input features sharded); in the sequence-parallel region it
                     reduce-scatters to the sequence shard (``matmul_reduce_scatter``).
  ``colwise_gather_output``  the LM head: vocab-parallel, logits gathered to the full vocabulary.
                     Tied to the embedding when the original was (both hold the same vocab rows).
  ``embedding``      ``nn.Embedding`` -> VocabParallelEmbedding (output all-reduced, replicated).
  ``attention``      an attention module whose head counts are divided by the TP size; in the
                     sequence-parallel region its input is gathered once at entry (the module reads
                     its input's shape), so its projections take a replicated input.
  ``attention_sequence_sharded``  as ``attention``, but the module takes the sequence shard as is and
                     its (fused) projection gathers it -- only for modules that take every shape from
                     their projections' outputs (GPT2Attention).
  ``sequence_parallel``  a module of the block (a norm) that runs on the sequence shard; its
                     parameters are replicated and their gradients summed over the TP group.
  ``head_shared``    a module applied to every attention head alike (Qwen3's q_norm / k_norm over
                     head_dim): replicated, but each rank runs it on its own heads only, so its
                     gradients are summed over the TP group (with or without sequence parallelism).
  ``replicate``      parameters replicated on every TP rank, computed on full tensors (final norm,
                     position embedding).
  ``blocks``         the ``nn.ModuleList`` of decoder blocks: the sequence-parallel region and the
                     unit the pipeline splitter cuts.

Every parameter of the model must be covered by some entry; ``resolve`` says which are not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

LINEAR_STYLES = ("colwise", "colwise_qkv", "colwise_kv", "rowwise", "colwise_gather_output")
ATTENTION_STYLES = ("attention", "attention_sequence_sharded")
STYLES = LINEAR_STYLES + ATTENTION_STYLES + ("embedding", "sequence_parallel", "head_shared", "replicate",
                                             "blocks")

# transformers model_type -> family. The Llama family: decoder-only models with LlamaAttention's
# layout (separate q/k/v/o projections, optional q/k/v biases, grouped-query attention) and a
# gate/up/down MLP.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # qwen3: + per-head q/k RMSNorm
FAMILIES = {**{t: "llama" for t in LLAMA_FAMILY}, "gpt2": "gpt2"}

# Attention-module attributes that hold a head count or a width proportional to it (checked against
# transformers 5.x: LlamaAttention reads only head_dim and num_key_value_groups, neither of which
# changes; GPT2Attention splits c_attn's output by split_size). Divided by the TP size when present.
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "split_size")


class PlanError(ValueError):
    pass


def llama_plan(prefix: str, has_lm_head: bool, qk_norm: bool = False) -> Dict[str, str]:
    p = prefix
    plan = {
        f"{p}embed_tokens": "embedding",
        f"{p}layers": "blocks",
        f"{p}layers.*.input_layernorm": "sequence_parallel",
        f"{p}layers.*.self_attn": "attention",
        f"{p}layers.*.self_attn.q_proj": "colwise",
        f"{p}layers.*.self_attn.k_proj": "colwise_kv",
        f"{p}layers.*.self_attn.v_proj": "colwise_kv",
        f"{p}layers.*.self_attn.o_proj": "rowwise",
        f"{p}layers.*.post_attention_layernorm": "sequence_parallel",
        f"{p}layers.*.mlp.gate_proj": "colwise",
        f"{p}layers.*.mlp.up_proj": "colwise",
        f"{p}layers.*.mlp.down_proj": "rowwise",
        f"{p}norm": "replicate",
    }
    if qk_norm:
        plan[f"{p}layers.*.self_attn.q_norm"] = "head_shared"
        plan[f"{p}layers.*.self_attn.k_norm"] = "head_shared"
    if has_lm_head:
        plan["lm_head"] = "colwise_gather_output"
    return plan


def gpt2_plan(prefix: str, has_lm_head: bool) -> Dict[str, str]:
    p = prefix
    plan = {
        f"{p}wte": "embedding",
        f"{p}wpe": "replicate",
        f"{p}h": "blocks",
        f"{p}h.*.ln_1": "sequence_parallel",
        f"{p}h.*.attn": "attention_sequence_sharded",
        f"{p}h.*.attn.c_attn": "colwise_qkv",
        f"{p}h.*.attn.c_proj": "rowwise",
        f"{p}h.*.ln_2": "sequence_parallel",
        f"{p}h.*.mlp.c_fc": "colwise",
        f"{p}h.*.mlp.c_proj": "rowwise",
        f"{p}ln_f": "replicate",
    }
    if has_lm_head:
        plan["lm_head"] = "colwise_gather_output"
    return plan


def family_of(model: nn.Module) -> Tuple[Optional[str], str]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return FAMILIES.get(model_type), str(model_type)


def auto_plan(model: nn.Module) -> Dict[str, str]:
    family, model_type = family_of(model)
    if family is None:
        raise PlanError(
            f"plan='auto' does not know {type(model).__name__} (config.model_type={model_type!r}); "
            f"known model types: {', '.join(sorted(FAMILIES))}. Pass plan={{pattern: style}} "
            f"(styles: {', '.join(STYLES)}; see pyfused/parallelize/plans.py)")
    names = dict(model.named_modules())
    if family == "llama":
        prefix = "model." if "model.layers" in names else ""
        if f"{prefix}layers" not in names:
            raise PlanError(f"{type(model).__name__} ({model_type}) has no 'layers' block list where the "
                            f"Llama-family plan expects it")
        qk_norm = any(n.endswith(("self_attn.q_norm", "self_attn.k_norm")) for n in names)
        return llama_plan(prefix, "lm_head" in names, qk_norm)
    prefix = "transformer." if "transformer.h" in names else ""
    if f"{prefix}h" not in names:
        raise PlanError(f"{type(model).__name__} (gpt2) has no 'h' block list where the GPT-2 plan expects it")
    return gpt2_plan(prefix, "lm_head" in names)


def _pattern_regex(pattern: str) -> "re.Pattern":
    parts = [r"[^.]+" if c == "*" else re.escape(c) for c in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


@dataclass
class ResolvedPlan:
    """Module name -> style for every matched module, plus the block lists (in model order)."""

    styles: Dict[str, str]
    blocks: List[str]


def resolve(model: nn.Module, plan: Dict[str, str]) -> ResolvedPlan:
    """Match the plan against the model; raise PlanError naming what does not fit."""
    if not isinstance(plan, dict) or not plan:
        raise PlanError(f"plan must be 'auto' or a non-empty dict {{pattern: style}}, got {plan!r}")
    modules = dict(model.named_modules())
    styles: Dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"plan entry {pattern!r}: unknown style {style!r} (styles: {', '.join(STYLES)})")
        rx = _pattern_regex(pattern)
        hits = [n for n in modules if n and rx.match(n)]
        if not hits:
            raise PlanError(f"plan entry {pattern!r} matches no module of {type(model).__name__}: is this "
                            f"the right plan for this model?")
        for name in hits:
            if name in styles and styles[name] != style:
                raise PlanError(f"module {name!r} matched by two styles: {styles[name]!r} and {style!r}")
            styles[name] = style
    for name, style in styles.items():
        _check_module_type(name, modules[name], style)
    blocks = [n for n, s in styles.items() if s == "blocks"]
    if len(blocks) > 1:
        raise PlanError(f"the plan names {len(blocks)} block lists ({blocks}); pyfused supports one")
    _check_coverage(model, styles)
    return ResolvedPlan(styles, blocks)


def is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2): y = x @ W + b with W [in, out]
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def _check_module_type(name: str, module: nn.Module, style: str) -> None:
    if style in LINEAR_STYLES and not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise PlanError(f"{name!r} is a {type(module).__name__}; style {style!r} needs an nn.Linear or a "
                        f"Conv1D")
    if style == "embedding" and not isinstance(module, nn.Embedding):
        raise PlanError(f"{name!r} is a {type(module).__name__}; style 'embedding' needs an nn.Embedding")
    if style == "embedding" and (module.max_norm is not None or module.sparse):
        raise PlanError(f"{name!r}: a vocab-parallel embedding supports neither max_norm nor sparse")
    if style == "blocks" and not isinstance(module, nn.ModuleList):
        raise PlanError(f"{name!r} is a {type(module).__name__}; style 'blocks' needs an nn.ModuleList")


def style_of_param(styles: Dict[str, str], pname: str) -> Optional[Tuple[str, str]]:
    """(module name, style) of the nearest enclosing module with a parameter-owning style."""
    parts = pname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = ".".join(parts[:i])
        style = styles.get(mod)
        if style is not None and style not in ATTENTION_STYLES and style != "blocks":
            return mod, style
    return None


def _check_coverage(model: nn.Module, styles: Dict[str, str]) -> None:
    uncovered = [n for n, _ in model.named_parameters() if style_of_param(styles, n) is None]
    if uncovered:
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        raise PlanError(f"the plan does not cover parameter(s) {', '.join(uncovered[:5])}{more} of "
                        f"{type(model).__name__}: pyfused would not know whether to shard or replicate "
                        f"them (an architecture the plan was not written for?)")
