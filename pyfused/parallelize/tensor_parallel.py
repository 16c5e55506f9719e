"""Apply a resolved plan's tensor (and sequence) parallelism to a model, in place.

Modules keep their names, and the pyfused layers keep ``weight`` / ``bias``, so the parallel model's
parameter names are the original's; ``specs`` says, per state-dict key, how the local tensor relates
to the original one (pyfused/parallelize/shard.py).

``check`` runs first, locally and without communication, so that a model TP cannot split fails with
the same message on every rank before any layer (whose constructor agrees over the group) is built.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from .._logging import logger
from ..layers import ColumnParallelLinear, RowParallelLinear
from .embedding import VocabParallelEmbedding, VocabParallelHead, embedding_scale, padded_vocab
from .norms import ColumnShardedRMSNorm
from .plans import (
    ATTENTION_STYLES,
    HEAD_ATTRIBUTES,
    INTERLEAVED_QKV,
    LINEAR_STYLES,
    NORM_STYLES,
    SHARD_LOCAL_STYLES,
    ResolvedPlan,
    is_attention_module,
    is_conv1d,
    style_of_param,
)
from .sequence import (
    LocalInputColumn,
    SequenceParallelColumn,
    SequenceParallelRow,
    gather_for_local_columns,
    gather_from_sequence_shard,
    scatter_to_sequence_shard,
    sum_grad_over_group,
)
from .shard import ShardSpec, sum_grad_over_replicas


def _linear_dims(module: nn.Module):
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def _under(name: str, parent: Optional[str]) -> bool:
    return parent is not None and name.startswith(parent + ".")


def _enclosing_attention(styles: Dict[str, str], name: str) -> Optional[str]:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = ".".join(parts[:i])
        if styles.get(mod) in ATTENTION_STYLES:
            return styles[mod]
    return None


def head_counts(model: nn.Module):
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv


def kv_replicas(model: nn.Module, tp: int) -> int:
    """How many TP ranks hold each KV head: TP / KV when TP is a multiple of the KV heads above
    them (grouped-query attention with few KV heads), else 1 (each rank its own KV heads)."""
    _, kv = head_counts(model)
    return tp // kv if kv and kv < tp and tp % kv == 0 else 1


def qkv_sections(model: nn.Module, name: str, width: int):
    """(q, k, v) widths of a fused [q|k|v] projection of ``width`` outputs, from the config's head
    counts, or a message saying why they do not fit."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in INTERLEAVED_QKV:
        return (f"{name}: style 'colwise_qkv' assumes a [q|k|v] layout, but {model_type}'s fused "
                f"projection interleaves q, k and v per head ([q0 k0 v0 | q1 k1 v1 ...]); use 'colwise' "
                f"(contiguous rows are whole heads) with an 'attention' entry on its attention module")
    heads, kv = head_counts(model)
    if heads is None:
        if width % 3:
            return f"{name}: style 'colwise_qkv' needs out_features divisible by 3, got {width}"
        return (width // 3,) * 3
    head_dim, rest = divmod(width, heads + 2 * kv)
    if rest or getattr(config, "head_dim", None) not in (None, head_dim):
        return (f"{name}: out_features={width} is not (num_attention_heads + 2 * num_key_value_heads) "
                f"x head_dim = ({heads} + 2 x {kv}) x {getattr(config, 'head_dim', None) or '?'}: not "
                f"the fused [q|k|v] layout style 'colwise_qkv' splits")
    return heads * head_dim, kv * head_dim, kv * head_dim


def _linear_problem(model: nn.Module, name: str, m: nn.Module, style: str, tp: int,
                    replicas: int) -> Optional[str]:
    """Why a linear style cannot shard ``m`` over ``tp`` ranks (each fused part must divide), or None."""
    fin, fout = _linear_dims(m)
    parts = (fin,) if style == "rowwise" else (fout,)
    if style == "colwise_qkv":
        parts = qkv_sections(model, name, fout)
        if isinstance(parts, str):
            return parts
        if replicas > 1:
            return (f"{name}: a fused [q|k|v] projection needs num_key_value_heads divisible by the "
                    f"tensor-parallel size {tp} (KV heads are replicated only for separate k/v "
                    f"projections)")
    if style == "colwise_gate_up":
        ffn = getattr(getattr(model, "config", None), "intermediate_size", None)
        if fout % 2 or ffn not in (None, fout // 2):
            return (f"{name}: style 'colwise_gate_up' needs out_features = 2 x the config's "
                    f"intermediate_size ({ffn}), got {fout}: not a fused [gate|up] projection")
        parts = (fout // 2,) * 2
    what = ("in_features" if style == "rowwise" else "out_features") + (" part" if len(parts) > 1 else "")
    bad = [p for p in parts if p % tp]
    if bad:
        return f"{name}: {what}={bad[0]} is not divisible by the tensor-parallel size {tp}"
    return None


def _sequence_region_problem(modules: Dict[str, nn.Module], styles: Dict[str, str],
                             block_list: str) -> Optional[str]:
    """Inside the sequence-parallel region every module without a style of its own runs on this
    rank's sequence shard (``[s/W, b, h]``), which is right only for per-token modules (norms, MLPs:
    their replicated parameters' gradients are summed over the group). An attention module mixes
    positions: it must take an attention style, which gathers the sequence for it."""
    for name, m in modules.items():
        in_region = _under(name, block_list)
        if in_region and is_attention_module(m) and styles.get(name) not in ATTENTION_STYLES:
            owner = style_of_param(styles, name + ".x")
            how = f"under style {owner[1]!r} of {owner[0]!r}" if owner else "without a style"
            return (f"{name} ({type(m).__name__}) is in the sequence-parallel region {how}: it would "
                    f"attend over this rank's sequence shard only. Give it style 'attention' (and shard "
                    f"its projections), or parallelize with sequence_parallel=False")
    return None


def check(model: nn.Module, resolved: ResolvedPlan, tp: int, sequence_parallel: bool) -> Optional[str]:
    """The first reason TP of size ``tp`` cannot apply the plan to this model, or None."""
    modules = dict(model.named_modules())
    styles = resolved.styles
    if sequence_parallel and tp > 1 and not resolved.blocks:
        return "sequence_parallel=True needs a 'blocks' entry in the plan (the sequence-parallel region)"
    if sequence_parallel and tp > 1:
        problem = _sequence_region_problem(modules, styles, resolved.blocks[0])
        if problem:
            return problem
    embedding_weights = {id(modules[n].weight): n for n, s in styles.items() if s == "embedding"}
    replicas = kv_replicas(model, tp)
    for name, style in styles.items():
        m = modules[name]
        if style == "colwise_kv" and replicas > 1:
            continue  # whole KV heads, each on tp/kv ranks: nothing is split inside a head
        if style == "colwise_gather_output":
            for ename in embedding_weights.values():
                e = modules[ename]
                if e.weight is m.weight and e.num_embeddings != _linear_dims(m)[1]:
                    return f"{name} is tied to {ename} but their vocabulary sizes differ"
            continue  # any vocabulary: padded to a multiple of tp (embedding.py)
        if style in LINEAR_STYLES:
            problem = _linear_problem(model, name, m, style, tp, replicas)
            if problem:
                return problem
        if style in NORM_STYLES:
            width = m.weight.shape[0]
            chunks = tp // replicas if style == "colwise_norm_kv" else tp
            if width % chunks:
                return f"{name}: width {width} is not divisible into {chunks} shards"
        if style in ATTENTION_STYLES:
            heads, kv = head_counts(model)
            if heads is None:
                return f"{name}: the model's config has no num_attention_heads to divide across TP ranks"
            if heads % tp:
                return (f"{name}: num_attention_heads={heads} is not divisible by the tensor-parallel "
                        f"size {tp}")
            kv_styles = {st for n, st in styles.items() if n.startswith(name + ".")
                         and n.rsplit(".", 1)[-1] in ("k_proj", "v_proj")}
            if kv % tp and not (replicas > 1 and kv_styles == {"colwise_kv"}):
                return (f"{name}: num_key_value_heads={kv} is not divisible by the tensor-parallel size "
                        f"{tp} (grouped-query attention shards whole KV heads; with k_proj / v_proj "
                        f"in style 'colwise_kv', a TP size that is a multiple of {kv} replicates them)")
            for attr in HEAD_ATTRIBUTES:
                if attr == "num_key_value_heads" and replicas > 1:
                    continue  # replicated instead (checked above)
                v = getattr(m, attr, None)
                if isinstance(v, int) and not isinstance(v, bool) and v % tp:
                    return f"{name}.{attr}={v} is not divisible by the tensor-parallel size {tp}"
    # a parameter shared between modules (a tied LM head) must be sharded the same way in each
    shared: Dict[int, List[tuple]] = {}
    for name, style in styles.items():
        w = getattr(modules[name], "weight", None)
        if isinstance(w, nn.Parameter) and style not in ATTENTION_STYLES + ("blocks",):
            shared.setdefault(id(w), []).append((name, style))
    for users in shared.values():
        kinds = sorted(st for _, st in users)
        ok = (len(set(kinds)) == 1 and kinds[0] in ("replicate", "sequence_parallel")
              or kinds == ["colwise_gather_output", "embedding"])
        if len(users) > 1 and not ok:
            return ("a tied weight is used by " + ", ".join(f"{n} ({st})" for n, st in users)
                    + ": only an 'embedding' tied to a 'colwise_gather_output' LM head can share a shard")
    return None


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _linear_layout(module: nn.Module) -> torch.Tensor:
    return module.weight.detach().t() if is_conv1d(module) else module.weight.detach()


class LocalHeadsConfig:
    """A read-through view of a shared model config with some attributes (this rank's head counts)
    replaced; everything else, and later changes to the shared config, read from it."""

    def __init__(self, base, **overrides):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"the attention module's view of the config is read-only ({name}); "
                             f"change the model's config instead")

    def __repr__(self) -> str:
        return f"LocalHeadsConfig({self._overrides}, of {type(self._base).__name__})"


class TensorParallel:
    """What applying TP did to a model: the per-key specs and the hooks it installed."""

    def __init__(self, pg, world: int, rank: int, sequence_parallel: bool, overlap: str):
        self.pg, self.world, self.rank = pg, world, rank
        self.sp = sequence_parallel and world > 1
        self.overlap = overlap
        self.param_specs: Dict[int, ShardSpec] = {}  # id(parameter) -> spec
        self.hooks: list = []
        self.kv_replicas = 1  # set by apply from the model's head counts

    def spec(self, full_shape, dim=None, parts=1, transpose=False, replicas=1, padded=0,
             sections=()) -> ShardSpec:
        return ShardSpec(tuple(full_shape), dim, parts, transpose, self.world, self.rank, replicas,
                         padded, tuple(sections))

    def apply(self, model: nn.Module, resolved: ResolvedPlan, install_region: bool = True) -> None:
        """Shard ``model`` in place. ``install_region=False`` leaves entering/leaving the sequence-parallel
        region to the caller (the pipeline does it per stage)."""
        styles = resolved.styles
        self.kv_replicas = kv_replicas(model, self.world)
        self.model = model
        block_list = resolved.blocks[0] if resolved.blocks else None
        modules = dict(model.named_modules())
        embeddings = {}  # id(original weight) -> new embedding module
        heads = []
        for name, style in styles.items():  # named_modules order: the same on every rank
            m = modules.get(name)
            if m is None or getattr(m, "pyfused_placeholder", False):
                continue  # on another pipeline stage
            in_region = self.sp and _under(name, block_list)
            if style in LINEAR_STYLES:
                new = self._linear(m, style, in_region, _enclosing_attention(styles, name))
                _set_submodule(model, name, new)
                if style == "colwise_gather_output" and id(m.weight) in embeddings:
                    self.param_specs.pop(id(new.weight))
                    new.weight = embeddings[id(m.weight)].weight  # tied: the same vocab rows here
            elif style == "embedding":
                new = VocabParallelEmbedding(m.num_embeddings, m.embedding_dim, m.padding_idx,
                                             group=self.pg, device=m.weight.device, dtype=m.weight.dtype,
                                             embed_scale=embedding_scale(m))
                spec = self.spec(m.weight.shape, dim=0, padded=padded_vocab(m.num_embeddings, self.world))
                with torch.no_grad():
                    new.weight.copy_(spec.shard(m.weight.detach()))
                self.param_specs[id(new.weight)] = spec
                embeddings[id(m.weight)] = new
                _set_submodule(model, name, new)
            elif style in NORM_STYLES:
                _set_submodule(model, name, self._column_norm(m, style))
            elif style in ATTENTION_STYLES:
                heads.append(name)
                self._divide_heads(name, m)
                if style == "attention" and in_region:
                    self.hooks.append(m.register_forward_pre_hook(self._gather_input, with_kwargs=True))
        # a tied LM head processed before its embedding (not the case in transformers' models)
        for name, style in styles.items():
            if style == "colwise_gather_output" and name in modules and not getattr(
                    modules[name], "pyfused_placeholder", False):
                lm = model.get_submodule(name)
                orig = modules[name]
                if id(orig.weight) in embeddings and lm.weight is not embeddings[id(orig.weight)].weight:
                    self.param_specs.pop(id(lm.weight))
                    lm.weight = embeddings[id(orig.weight)].weight
        self._sum_partial_grads(model, styles, block_list)
        if install_region and self.sp and block_list is not None:
            self.install_sequence_region(list(model.get_submodule(block_list)))
        logger.debug("pyfused.parallelize: TP=%d (sequence_parallel=%s) applied to %d modules; head "
                     "counts divided in %d attention modules", self.world, self.sp, len(styles), len(heads))

    def _sum_partial_grads(self, model: nn.Module, styles: Dict[str, str],
                           block_list: Optional[str]) -> None:
        """Sum over the TP group the gradients of replicated parameters that each rank computes from
        part of the data: those of modules run on the sequence shard (styles ``sequence_parallel``
        and ``replicate`` inside the region) and of ``head_shared`` modules (run on this rank's heads).
        Each parameter takes the style of its nearest styled module, and one hook."""
        for pname, p in model.named_parameters():
            owner = style_of_param(styles, pname)
            if owner is None:
                continue
            module, style = owner
            on_shard = self.sp and _under(module, block_list) and style in SHARD_LOCAL_STYLES
            if on_shard or style == "head_shared":
                handle = sum_grad_over_group(p, self.pg)
                if handle is not None:
                    self.hooks.append(handle)

    def _linear(self, m: nn.Module, style: str, in_region: bool, attention: Optional[str]) -> nn.Module:
        fin, fout = _linear_dims(m)
        has_bias = m.bias is not None
        factory = {"device": m.weight.device, "dtype": m.weight.dtype, "overlap": self.overlap}
        conv = is_conv1d(m)
        parts = 2 if style == "colwise_gate_up" else 1
        sections = qkv_sections(self.model, "", fout) if style == "colwise_qkv" else ()
        # KV heads replicated on `replicas` ranks: the layer is built `replicas` times as wide, so
        # that its local share (out / world) is one chunk of out / (world / replicas) features
        replicas = self.kv_replicas if style == "colwise_kv" else 1
        if style == "rowwise":
            cls = SequenceParallelRow if in_region else RowParallelLinear
            new = cls(fin, fout, has_bias, group=self.pg, sequence_parallel=in_region, **factory)
            wspec = self.spec(m.weight.shape, dim=1, transpose=conv)
            bspec = self.spec(m.bias.shape) if has_bias else None
        else:
            gather = style == "colwise_gather_output"
            # in the SP region a column layer gathers the shard itself, unless an enclosing
            # 'attention' module already gathered its input (then it is a local GEMM on it)
            seq = in_region and not gather and attention != "attention"
            local = in_region and not gather and attention == "attention"
            cls = SequenceParallelColumn if seq else LocalInputColumn if local else ColumnParallelLinear
            padded = padded_vocab(fout, self.world) if gather else 0
            if gather and padded != fout:  # a vocabulary tp does not divide: padded, logits cut back
                new = VocabParallelHead(fin, fout, has_bias, group=self.pg, **factory)
            else:
                new = cls(fin, fout * replicas, has_bias, group=self.pg, gather_output=gather,
                          sequence_parallel=seq, **factory)
            wspec = self.spec(m.weight.shape, dim=0, parts=parts, transpose=conv, replicas=replicas,
                              padded=padded, sections=sections)
            bspec = (self.spec(m.bias.shape, dim=0, parts=parts, replicas=replicas, padded=padded,
                               sections=sections) if has_bias else None)
        with torch.no_grad():
            new.weight.copy_(wspec.shard(m.weight.detach()))
            if has_bias:
                new.bias.copy_(bspec.shard(m.bias.detach()))
        self.param_specs[id(new.weight)] = wspec
        if has_bias:
            self.param_specs[id(new.bias)] = bspec
        for param, pspec in ((new.weight, wspec), (new.bias, bspec)):
            handle = sum_grad_over_replicas(param, pspec, self.pg) if pspec is not None else None
            if handle is not None:
                self.hooks.append(handle)
        return new

    def _column_norm(self, m: nn.Module, style: str) -> nn.Module:
        replicas = self.kv_replicas if style == "colwise_norm_kv" else 1
        width = m.weight.shape[0]
        spec = self.spec(m.weight.shape, dim=0, replicas=replicas)
        new = ColumnShardedRMSNorm(width, width * replicas // self.world, m.variance_epsilon,
                                   group=self.pg, replicas=replicas, device=m.weight.device,
                                   dtype=m.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(spec.shard(m.weight.detach()))
        self.param_specs[id(new.weight)] = spec
        handle = sum_grad_over_replicas(new.weight, spec, self.pg)
        if handle is not None:
            self.hooks.append(handle)
        return new

    def _divide_heads(self, name: str, m: nn.Module) -> None:
        changed = []
        for attr in HEAD_ATTRIBUTES:
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                new = v * self.kv_replicas // self.world if attr == "num_key_value_heads" else v // self.world
                setattr(m, attr, new)
                changed.append(f"{attr} {v}->{new}")
        config = getattr(m, "config", None)
        if getattr(config, "num_attention_heads", None) is not None:
            # the module's own view of the config with this rank's head counts (Phi-3's attention
            # reads config.num_attention_heads at forward time); the shared config is untouched
            heads, kv = head_counts(self.model)
            m.config = LocalHeadsConfig(config, num_attention_heads=heads // self.world,
                                        num_key_value_heads=kv * self.kv_replicas // self.world)
            changed.append(f"config head counts {heads}/{kv}->{m.config.num_attention_heads}/"
                           f"{m.config.num_key_value_heads} (module's view)")
        groups = getattr(m, "num_key_value_groups", None)
        if self.kv_replicas > 1 and isinstance(groups, int) and not isinstance(groups, bool):
            # query heads per local KV head: (heads / tp) / (kv * replicas / tp)
            m.num_key_value_groups = groups // self.kv_replicas
            changed.append(f"num_key_value_groups {groups}->{groups // self.kv_replicas}")
        logger.debug("pyfused.parallelize: %s: %s", name, ", ".join(changed) or
                     "no head-count attribute (shapes come from the projections)")

    def _gather_input(self, module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=gather_for_local_columns(kwargs["hidden_states"], self.pg))
        elif args:
            args = (gather_for_local_columns(args[0], self.pg), *args[1:])
        else:
            raise ValueError(f"{type(module).__name__}: no hidden_states input to gather")
        return args, kwargs

    def install_sequence_region(self, blocks: List[nn.Module]) -> None:
        """Enter the sequence-parallel region at the first of ``blocks``, leave it after the last."""
        if not self.sp or not blocks:
            return
        pg = self.pg

        def enter(module, args, kwargs):
            if "hidden_states" in kwargs:
                shard = scatter_to_sequence_shard(kwargs["hidden_states"], pg)
                return args, dict(kwargs, hidden_states=shard)
            return (scatter_to_sequence_shard(args[0], pg), *args[1:]), kwargs

        def leave(module, args, kwargs, output):
            if isinstance(output, tuple):
                return (gather_from_sequence_shard(output[0], pg), *output[1:])
            return gather_from_sequence_shard(output, pg)

        self.hooks.append(blocks[0].register_forward_pre_hook(enter, with_kwargs=True))
        self.hooks.append(blocks[-1].register_forward_hook(leave, with_kwargs=True))
