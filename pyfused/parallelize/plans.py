"""Parallelization plans: module-name patterns -> style, and the built-in plans of known model families.

A plan is a dict ``{pattern: style}`` over the model's module names (``model.named_modules()``), like
the ``parallelize_plan`` of torch's ``parallelize_module`` or transformers' ``tp_plan``. In a pattern
``*`` matches one name component (``model.layers.*.mlp.up_proj``). Styles:

  ``colwise``        ``nn.Linear`` / GPT-2 ``Conv1D`` -> ColumnParallelLinear (output features sharded).
                     Inside the sequence-parallel region it gathers the sequence shard itself
                     (``all_gather_matmul``) unless an enclosing ``attention`` module gathered it.
  ``colwise_qkv``    like ``colwise`` for a fused [q|k|v] projection: q, k and v each sharded, so each
                     rank holds its own heads of q, k and v in that order. The parts' widths come from
                     the config's head counts (q wider than k and v under grouped-query attention;
                     equal thirds without). It cannot see the layout inside the projection: a
                     per-head interleaved [q0 k0 v0 | q1 k1 v1 ...] projection (GPT-NeoX's
                     ``query_key_value``) needs plain ``colwise`` (contiguous rows are whole heads);
                     the model types known to be interleaved are refused.
  ``colwise_gate_up``  like ``colwise`` for a fused [gate|up] MLP projection (Phi-3's
                     ``gate_up_proj``): each half sharded, so each rank holds its share of both.
  ``colwise_kv``     like ``colwise`` for a projection onto the key/value heads of grouped-query
                     attention: sharded by whole KV heads; with more TP ranks than KV heads (TP a
                     multiple of them) each KV head is replicated on TP/KV consecutive ranks -- the
                     ranks whose query heads use it -- and its gradients are summed over those ranks.
  ``colwise_norm``   an RMSNorm over the full output width of a ``colwise`` projection (OLMo 2's
                     ``q_norm``): weight sharded like the projection, the mean square summed exactly
                     over the TP group. ``colwise_norm_kv``: the same after a ``colwise_kv`` one.
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
  ``replicate``      parameters replicated on every TP rank. Outside the blocks the module computes
                     on full tensors (final norm, position embedding). Inside the sequence-parallel
                     region it runs on the sequence shard, as ``sequence_parallel`` does: right for
                     per-token modules (a norm, a whole MLP), whose parameters' gradients are then
                     summed over the TP group (Megatron's rule for parameters in the region); an
                     attention module there is refused (it would attend over its shard only).
  ``blocks``         the ``nn.ModuleList`` of decoder blocks: the sequence-parallel region and the
                     unit the pipeline splitter cuts.
  ``experts``        a transformers experts module of a mixture-of-experts block (3-D
                     ``gate_up_proj`` / ``down_proj``) -> ``ExpertParallelExperts`` over the ``ep``
                     mesh dim (pyfused/parallelize/moe.py); replicated over tp, where in the
                     sequence-parallel region it runs on the shard as ``replicate`` does.

Every parameter of the model must be covered by some entry; ``resolve`` says which are not.

The fused projections of the families ``plan="auto"`` knows (``FUSED_PROJECTIONS``: Phi-3's [q|k|v]
``qkv_proj`` and [gate|up] ``gate_up_proj``, GPT-NeoX's per-head interleaved ``query_key_value``,
GPT-2's [q|k|v] ``c_attn``) take only the style that splits their layout, or ``replicate`` when
nothing else in their module is sharded (the module then runs whole on every rank); any other style
would cut through the layout (plain ``colwise`` on [q|k|v] gives the first rank all of q) and is
refused, naming the projection.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

LINEAR_STYLES = ("colwise", "colwise_qkv", "colwise_gate_up", "colwise_kv", "rowwise",
                 "colwise_gather_output")
ATTENTION_STYLES = ("attention", "attention_sequence_sharded")
NORM_STYLES = ("colwise_norm", "colwise_norm_kv")
STYLES = LINEAR_STYLES + ATTENTION_STYLES + NORM_STYLES + (
    "embedding", "sequence_parallel", "head_shared", "replicate", "blocks", "experts")
# styles whose modules run whole on each rank's sequence shard inside the sequence-parallel region
SHARD_LOCAL_STYLES = ("sequence_parallel", "replicate", "experts")

# transformers model_type -> family. The Llama family: decoder-only models with LlamaAttention's
# layout (separate q/k/v/o projections, optional q/k/v biases, grouped-query attention) and a
# gate/up/down MLP; its members differ in their norms (RMSNorm, Gemma's (1 + w) RMSNorm, StableLM's
# LayerNorm; Gemma2/3's extra feed-forward norms; Qwen3's and Gemma3's per-head q/k norms), rotary
# (StableLM's partial rotary), attention (Gemma2's soft-capping, sliding windows) and embedding
# (Gemma's scaled one) -- none of which changes how TP splits the projections.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "stablelm", "gemma", "gemma2", "gemma3_text")
FAMILIES = {**{t: "llama" for t in LLAMA_FAMILY}, "olmo2": "olmo2", "phi3": "phi3",
            "gpt_neox": "gpt_neox", "gpt2": "gpt2"}
# Mixture-of-experts families (pyfused/parallelize/moe.py): the MoE block of every layer runs whole
# ("replicate": router and shared experts), its experts module over the ep dim ("experts"). Those
# with Llama's attention layout take the Llama plan's attention styles; OLMoE's q/k norms (over the
# whole projection, rounded as OLMo 2's are not), DeepSeek-V3's latent attention and gpt-oss's
# attention sinks (one learned logit per head, which a head split would have to shard too) are not
# sharded: their blocks are replicated over tp.
MOE_LLAMA_ATTENTION = ("mixtral", "qwen2_moe", "qwen3_moe")
MOE_REPLICATED_ATTENTION = ("olmoe", "deepseek_v3", "gpt_oss")
FAMILIES.update({t: "moe" for t in MOE_LLAMA_ATTENTION + MOE_REPLICATED_ATTENTION})
# per-block norms of the Llama family and OLMo 2, by name; a plan lists those the model has
BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")
# model types whose fused query_key_value interleaves q, k, v per head ([q0 k0 v0 | q1 k1 v1 ...])
INTERLEAVED_QKV = ("gpt_neox", "gptj", "bloom", "falcon", "persimmon")
# (family, projection's own name) -> (its fused layout, the one style that shards that layout)
FUSED_PROJECTIONS = {
    ("phi3", "qkv_proj"): ("[q|k|v]", "colwise_qkv"),
    ("phi3", "gate_up_proj"): ("[gate|up]", "colwise_gate_up"),
    ("gpt_neox", "query_key_value"): ("per-head interleaved [q0 k0 v0 | q1 k1 v1 ...]", "colwise"),
    ("gpt2", "c_attn"): ("[q|k|v]", "colwise_qkv"),
}

# Attention-module attributes that hold a head count or a width proportional to it (checked against
# transformers 5.x: LlamaAttention reads only head_dim and num_key_value_groups, neither of which
# changes; GPT2Attention splits c_attn's output by split_size). Divided by the TP size when present.
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "split_size")


class PlanError(ValueError):
    pass


def llama_plan(prefix: str, has_lm_head: bool, qk_norm: bool = False,
               norms: Tuple[str, ...] = BLOCK_NORMS[:2], qk_norm_style: str = "head_shared",
               fused: bool = False) -> Dict[str, str]:
    """The Llama family's plan. ``norms``: the block's norms (sequence_parallel); ``qk_norm``: the
    attention's q_norm / k_norm in ``qk_norm_style`` (``head_shared`` for per-head norms as Qwen3's,
    ``colwise_norm`` for norms over the whole projection as OLMo 2's); ``fused``: Phi-3's fused
    ``qkv_proj`` and ``gate_up_proj`` instead of q/k/v and gate/up projections."""
    p = prefix
    plan = {f"{p}embed_tokens": "embedding", f"{p}layers": "blocks"}
    plan.update({f"{p}layers.*.{n}": "sequence_parallel" for n in norms})
    plan[f"{p}layers.*.self_attn"] = "attention"
    if fused:
        plan[f"{p}layers.*.self_attn.qkv_proj"] = "colwise_qkv"
    else:
        plan[f"{p}layers.*.self_attn.q_proj"] = "colwise"
        plan[f"{p}layers.*.self_attn.k_proj"] = "colwise_kv"
        plan[f"{p}layers.*.self_attn.v_proj"] = "colwise_kv"
    plan[f"{p}layers.*.self_attn.o_proj"] = "rowwise"
    if fused:
        plan[f"{p}layers.*.mlp.gate_up_proj"] = "colwise_gate_up"
    else:
        plan[f"{p}layers.*.mlp.gate_proj"] = "colwise"
        plan[f"{p}layers.*.mlp.up_proj"] = "colwise"
    plan[f"{p}layers.*.mlp.down_proj"] = "rowwise"
    plan[f"{p}norm"] = "replicate"
    if qk_norm:
        kv_style = qk_norm_style + "_kv" if qk_norm_style == "colwise_norm" else qk_norm_style
        plan[f"{p}layers.*.self_attn.q_norm"] = qk_norm_style
        plan[f"{p}layers.*.self_attn.k_norm"] = kv_style
    if has_lm_head:
        plan["lm_head"] = "colwise_gather_output"
    return plan


def gpt_neox_plan(prefix: str, lm_head: Optional[str]) -> Dict[str, str]:
    """GPT-NeoX (Pythia): the fused ``query_key_value`` is interleaved per head, so contiguous
    output rows are whole heads with their q, k and v: plain ``colwise`` gives each rank its heads."""
    p = prefix
    plan = {
        f"{p}embed_in": "embedding",
        f"{p}layers": "blocks",
        f"{p}layers.*.input_layernorm": "sequence_parallel",
        f"{p}layers.*.post_attention_layernorm": "sequence_parallel",
        f"{p}layers.*.attention": "attention",
        f"{p}layers.*.attention.query_key_value": "colwise",
        f"{p}layers.*.attention.dense": "rowwise",
        f"{p}layers.*.mlp.dense_h_to_4h": "colwise",
        f"{p}layers.*.mlp.dense_4h_to_h": "rowwise",
        f"{p}final_layer_norm": "replicate",
    }
    if lm_head:
        plan[lm_head] = "colwise_gather_output"
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


def moe_plan(model: nn.Module, model_type: str, names: Dict[str, nn.Module]) -> Dict[str, str]:
    """A mixture-of-experts family's plan: Llama's attention styles (or, for the types whose
    attention is not sharded, whole replicated blocks), the MoE block replicated and its experts
    module over the ep dim."""
    prefix = "model." if "model.layers" in names else ""
    p = prefix
    if f"{p}layers.0" not in names:
        raise PlanError(f"{type(model).__name__} ({model_type}) has no 'layers' block list where "
                        f"the MoE plan expects it")
    if model_type in MOE_LLAMA_ATTENTION:
        norms = tuple(n for n in BLOCK_NORMS if isinstance(names.get(f"{p}layers.0.{n}"), nn.Module))
        qk_norm = f"{p}layers.0.self_attn.q_norm" in names
        plan = llama_plan(prefix, "lm_head" in names, qk_norm, norms)
        for projection in ("gate_proj", "up_proj", "down_proj"):
            del plan[f"{p}layers.*.mlp.{projection}"]
    else:
        plan = {f"{p}embed_tokens": "embedding", f"{p}layers": "blocks",
                f"{p}layers.*": "replicate", f"{p}norm": "replicate"}
        if "lm_head" in names:
            plan["lm_head"] = "colwise_gather_output"
    plan[f"{p}layers.*.mlp"] = "replicate"
    plan[f"{p}layers.*.mlp.experts"] = "experts"
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
    if family == "moe":
        return moe_plan(model, model_type, names)
    if family == "gpt_neox":
        prefix = "gpt_neox." if "gpt_neox.layers" in names else ""
        if f"{prefix}layers" not in names:
            raise PlanError(f"{type(model).__name__} (gpt_neox) has no 'layers' block list where the "
                            f"GPT-NeoX plan expects it")
        heads = [n for n in ("lm_head", "embed_out") if n in names]  # embed_out: older transformers
        return gpt_neox_plan(prefix, heads[0] if heads else None)
    if family in ("llama", "olmo2", "phi3"):
        prefix = "model." if "model.layers" in names else ""
        if f"{prefix}layers.0" not in names:
            raise PlanError(f"{type(model).__name__} ({model_type}) has no 'layers' block list where the "
                            f"Llama-family plan expects it")
        norms = tuple(n for n in BLOCK_NORMS if isinstance(names.get(f"{prefix}layers.0.{n}"), nn.Module))
        qk_norm = f"{prefix}layers.0.self_attn.q_norm" in names
        return llama_plan(prefix, "lm_head" in names, qk_norm, norms,
                          "colwise_norm" if family == "olmo2" else "head_shared", family == "phi3")
    prefix = "transformer." if "transformer.h" in names else ""
    if f"{prefix}h" not in names:
        raise PlanError(f"{type(model).__name__} (gpt2) has no 'h' block list where the GPT-2 plan "
                        f"expects it")
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
    _check_fused_projections(model, styles)
    blocks = [n for n, s in styles.items() if s == "blocks"]
    if len(blocks) > 1:
        raise PlanError(f"the plan names {len(blocks)} block lists ({blocks}); pyfused supports one")
    _check_coverage(model, styles)
    return ResolvedPlan(styles, blocks)


def is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2): y = x @ W + b with W [in, out]
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def _overrides(module: nn.Module, base: type) -> bool:
    return type(module).forward is not base.forward


def _check_module_type(name: str, module: nn.Module, style: str) -> None:
    """The module is of the kind the style replaces, and its forward is that kind's: a subclass that
    overrides forward would be replaced by a layer that does not do what its forward adds."""
    from .embedding import embedding_scale
    from .norms import is_known_rms_norm

    cls = type(module).__name__
    if style in LINEAR_STYLES and not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise PlanError(f"{name!r} is a {cls}; style {style!r} needs an nn.Linear or a Conv1D")
    if style in LINEAR_STYLES and isinstance(module, nn.Linear) and _overrides(module, nn.Linear):
        raise PlanError(f"{name!r} is a {cls}, a subclass of nn.Linear whose forward differs from "
                        f"nn.Linear's; style {style!r} would replace it by a parallel linear layer and "
                        f"lose what its forward does: give it another style or parallelize it yourself")
    if style == "embedding" and not isinstance(module, nn.Embedding):
        raise PlanError(f"{name!r} is a {cls}; style 'embedding' needs an nn.Embedding")
    if style == "embedding" and _overrides(module, nn.Embedding) and embedding_scale(module) is None:
        raise PlanError(f"{name!r} is a {cls}, a subclass of nn.Embedding whose forward differs from "
                        f"nn.Embedding's (and is not a known scaled word embedding); style 'embedding' "
                        f"would replace it by a vocab-parallel embedding and lose what its forward does")
    if style in NORM_STYLES and not is_known_rms_norm(module):
        raise PlanError(f"{name!r} is a {cls}; style {style!r} replaces it by a sharded RMSNorm and "
                        f"knows only OLMo 2's RMSNorm (weight * x / rms(x), computed in fp32)")
    if style == "embedding" and (module.max_norm is not None or module.sparse):
        raise PlanError(f"{name!r}: a vocab-parallel embedding supports neither max_norm nor sparse")
    if style == "blocks" and not isinstance(module, nn.ModuleList):
        raise PlanError(f"{name!r} is a {type(module).__name__}; style 'blocks' needs an nn.ModuleList")
    if style == "experts":
        from ..layers.moe import REFUSALS, describe

        code = describe(module).refusal
        if code:
            raise PlanError(f"{name!r} ({cls}) {REFUSALS[code]}; style 'experts' cannot shard it")


def is_attention_module(module: nn.Module) -> bool:
    """Whether the module mixes positions as attention does (transformers names every attention
    class ``*Attention``: LlamaAttention, GPT2Attention, Phi3Attention, GPTNeoXAttention, ...)."""
    return type(module).__name__.endswith("Attention")


def _check_fused_projections(model: nn.Module, styles: Dict[str, str]) -> None:
    """A known fused projection takes the style that shards its layout, or ``replicate`` while
    nothing else in its module is sharded (module docstring)."""
    family, model_type = family_of(model)
    for name, style in styles.items():
        parent, _, own = name.rpartition(".")
        known = FUSED_PROJECTIONS.get((family, own))
        if known is None or style == known[1]:
            continue
        layout, right = known
        what = f"{name!r} is {model_type}'s fused {layout} projection"
        if style != "replicate":
            raise PlanError(f"{what}: style {style!r} would cut through that layout; give it style "
                            f"{right!r}")
        sharded = [(n, st) for n, st in styles.items() if n != name and (n == parent or n.startswith(
            parent + ".")) and st in LINEAR_STYLES + ATTENTION_STYLES + NORM_STYLES]
        if sharded:
            n, st = sharded[0]
            raise PlanError(f"{what}: it is replicated (full width on every rank) but {n!r} of the same "
                            f"module is sharded ({st!r}), which expects this rank's share of it; give "
                            f"it style {right!r}, or replicate the whole {parent!r}")


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
