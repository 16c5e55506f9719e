"""``ExpertParallelExperts``: an expert-parallel drop-in for the experts module of a transformers 5
mixture-of-experts block (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``,
``OlmoeExperts``, ``DeepseekV3Experts``, ``GptOssExperts``, ...).

Those modules hold every expert's weights as 3-D parameters and are called by their block as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` after the block's router,
returning ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(t)`` with
expert(x) = down(gate_fn(gate_up(x))). Two variants are computed exactly (``ExpertsVariant``):

  * the default (Mixtral, Qwen, OLMoE, DeepSeek-V3): ``gate_up_proj [E, 2F, H]`` with its
    [gate|up] halves concatenated and ``down_proj [E, H, F]`` in ``nn.Linear``'s [out, in] layout,
    gate_fn = act(gate) * up;
  * gpt-oss: the weights stored transposed (``gate_up_proj [E, H, 2F]``, ``down_proj [E, F, H]``),
    biases ``gate_up_proj_bias [E, 2F]`` and ``down_proj_bias [E, H]``, the gate and up columns
    interleaved ([g0 u0 g1 u1 ...]) into a clamped SwiGLU (``clamped_swiglu``, its alpha and limit
    from the module).

Replaced by this layer, each rank of ``group`` holds experts ``rank * E/W .. (rank + 1) * E/W - 1``
(``E/W`` rows of every expert parameter, under their original names and layouts) and the call runs

    h, layout = moe_dispatch(hidden, top_k_index, W1)           tokens to their experts, x @ W1[e]
    h         = h + gate_up_proj_bias[expert of each row]       (gpt-oss)
    out       = moe_combine(gate_fn(h), top_k_weights, top_k_index, layout, W2)

with W1 [E/W, H, 2F] and W2 [E/W, F, H] the parameters or their transposed views. The down bias
rides in the combine's GEMM: gate_fn(h) gains a column of ones and W2 the row ``down_proj_bias``,
so that each row returns as ``y @ W2[e] + b2[e]`` before the weighted sum, by any method, its
overlap kept (one copy of the local W2 and of the rows per call).

The router is not touched: it stays replicated in the block, so the router logits and the
auxiliary load-balancing loss the model returns are computed as before, from this rank's tokens.
Each rank passes its own tokens (expert parallelism shares ranks with data parallelism): the
experts' gradients then sum every rank's tokens routed to them, while the router's, like every
replicated parameter's, are this rank's part (``parallelize`` averages both over the group).

Every rank checks the module it was given, and the expert count, together (``_common.prepare``):
a module that is not such an experts module on any rank -- or one whose variant this layer does not
compute exactly (a gate function of its own, a norm after each expert, no gate) -- and an expert
count the group size does not divide are the same ``InputError`` on every rank before any
collective; so are ranks whose variants differ.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .. import comm
from ..ops import _common, moe_combine, moe_dispatch

KIND = "ExpertParallelExperts"
# Why a module cannot be replaced (a code in the exchanged signature, the text for every rank)
REFUSALS = (
    None,
    "is not a transformers experts module (3-D gate_up_proj and down_proj parameters, called as "
    "experts(hidden, top_k_index, top_k_weights))",
    "has expert biases whose shapes are not gate_up_proj_bias [E, 2F] and down_proj_bias [E, H]",
    "stores its [gate|up] halves in a layout its gate function does not split (is_concatenated "
    "disagrees with the gate)",
    "applies a gate of its own (_apply_gate) that this layer does not compute (it knows "
    "transformers' default act(gate) * up and gpt-oss's clamped SwiGLU)",
    "has a norm after each expert or no gate, which this layer does not compute",
)
DEFAULT_GATE, CLAMPED_SWIGLU = 0, 1
# (module, class) whose ``_apply_gate`` is gpt-oss's clamped SwiGLU
_CLAMPED_SWIGLU_OWNER = ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts")
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertsVariant:
    """What an experts module computes, as far as this layer needs to know."""
    refusal: int = 1           # index in REFUSALS; 0: computed exactly
    experts: int = 0
    hidden: int = 0
    ffn: int = 0
    transposed: bool = False   # [E, in, out] weights instead of nn.Linear's [E, out, in]
    bias: bool = False         # gate_up_proj_bias [E, 2F] and down_proj_bias [E, H]
    gate: int = DEFAULT_GATE   # DEFAULT_GATE: act(gate) * up of [gate|up]; CLAMPED_SWIGLU: gpt-oss
    alpha: float = 0.0         # the clamped SwiGLU's constants
    limit: float = 0.0

    @property
    def parameters(self) -> Tuple[str, ...]:
        return EXPERT_WEIGHTS + (EXPERT_BIASES if self.bias else ())

    def options(self, dtype_code: int) -> Tuple[int, ...]:
        """The ints every rank exchanges: refusal first, then what the ranks must agree on."""
        return (self.refusal, self.experts, self.hidden, self.ffn, dtype_code, int(self.transposed),
                int(self.bias), self.gate, _float_bits(self.alpha), _float_bits(self.limit))


def describe(experts: nn.Module) -> ExpertsVariant:
    """The module's variant; ``refusal`` says why this layer would not compute it exactly."""
    up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3
            and down.dim() == 3 and up.shape[0] == down.shape[0]):
        return ExpertsVariant(1)
    transposed = bool(getattr(experts, "is_transposed", False))
    count, hidden, two_ffn = up.shape if transposed else (up.shape[0], up.shape[2], up.shape[1])
    ffn = two_ffn // 2
    down_shape = (count, ffn, hidden) if transposed else (count, hidden, ffn)
    if two_ffn % 2 or tuple(down.shape) != down_shape:
        return ExpertsVariant(1)
    sizes = dict(experts=count, hidden=hidden, ffn=ffn, transposed=transposed)
    bias = bool(getattr(experts, "has_bias", False)) or any(hasattr(experts, n) for n in EXPERT_BIASES)
    if bias and not _biases_fit(experts, count, two_ffn, hidden):
        return ExpertsVariant(2, **sizes)
    sizes["bias"] = bias
    if getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "has_gate", True):
        return ExpertsVariant(5, **sizes)
    gate = _gate_kind(experts)
    if gate is None or (gate == DEFAULT_GATE and not hasattr(experts, "act_fn")):
        return ExpertsVariant(4, **sizes)
    if bool(getattr(experts, "is_concatenated", gate == DEFAULT_GATE)) != (gate == DEFAULT_GATE):
        return ExpertsVariant(3, **sizes)
    if gate == CLAMPED_SWIGLU:
        return ExpertsVariant(0, **sizes, gate=gate, alpha=float(experts.alpha),
                              limit=float(experts.limit))
    return ExpertsVariant(0, **sizes)


def _biases_fit(experts: nn.Module, count: int, two_ffn: int, hidden: int) -> bool:
    up_bias = getattr(experts, "gate_up_proj_bias", None)
    down_bias = getattr(experts, "down_proj_bias", None)
    return (isinstance(up_bias, nn.Parameter) and isinstance(down_bias, nn.Parameter)
            and tuple(up_bias.shape) == (count, two_ffn) and tuple(down_bias.shape) == (count, hidden))


def _gate_kind(experts: nn.Module) -> Optional[int]:
    """DEFAULT_GATE, CLAMPED_SWIGLU, or None for a gate function this layer does not know."""
    own = getattr(type(experts), "_apply_gate", None)
    if own is None:
        return DEFAULT_GATE  # not decorated by transformers: the plain act(gate) * up of its forward
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    if own is _default_apply_gate:
        return DEFAULT_GATE
    module, cls = _CLAMPED_SWIGLU_OWNER
    owner = getattr(sys.modules.get(module), cls, None)  # imported if the module is one of its
    if owner is not None and own is owner.__dict__.get("_apply_gate"):
        return CLAMPED_SWIGLU
    return None


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's gate over interleaved [g0 u0 g1 u1 ...] columns, in its order of operations:
    (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(g, limit)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _check(sigs: List[_common.CallSignature], world: int, allowed) -> Optional[str]:
    for r, s in enumerate(sigs):
        where = f" (rank {r})" if len(sigs) > 1 else ""
        code, experts = s.options[0], s.options[1]
        if code:
            return f"the module passed{where} {REFUSALS[code]}"
        if experts % world:
            return (f"num_experts={experts} is not divisible by the expert-parallel size {world} "
                    f"(each rank holds num_experts / {world} experts){where}")
    return comm.differs(sigs, "(num_experts, hidden size, expert width, dtype, layout, biases, "
                        "gate and its constants)", lambda s: s.options[1:])


class ExpertParallelExperts(nn.Module):
    """The experts of ``experts`` spread over ``group`` (module docstring). ``method``: the MoE ops'
    method ("auto", "unfused", "decomposed"). The full module is only read: each rank copies its
    experts' rows."""

    def __init__(self, experts: nn.Module, group=None, *, method: str = "auto"):
        super().__init__()
        variant = describe(experts)
        dtype_code = _dtype_code(experts) if variant.refusal == 0 else 0
        self.pg, _ = _common.prepare(KIND, (), (), group, method, check=_check,
                                     options=variant.options(dtype_code))
        world, rank = comm.world_size(self.pg), comm.rank(self.pg)
        local = variant.experts // world
        rows = slice(rank * local, (rank + 1) * local)
        self.variant = variant
        self.num_experts, self.num_local_experts = variant.experts, local
        self.hidden_dim, self.intermediate_dim = variant.hidden, variant.ffn
        self.first_expert = rank * local
        self.method = method
        with torch.no_grad():
            for name in variant.parameters:
                setattr(self, name, nn.Parameter(getattr(experts, name)[rows].clone()))
        self.act_fn = getattr(experts, "act_fn", None) if variant.gate == DEFAULT_GATE else None

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        transposed = self.variant.transposed
        w1 = self.gate_up_proj if transposed else self.gate_up_proj.transpose(1, 2)
        w2 = self.down_proj if transposed else self.down_proj.transpose(1, 2)
        h, layout = moe_dispatch(hidden_states, top_k_index, w1, self.pg,
                                 num_experts=self.num_experts, method=self.method)
        if self.variant.bias:
            h = h + torch.repeat_interleave(self.gate_up_proj_bias, layout.sum(0), dim=0,
                                            output_size=h.shape[0])
        y = self._gate(h)
        if self.variant.bias:  # y @ W2[e] + b2[e] as one GEMM (module docstring)
            y = torch.cat([y, y.new_ones(y.shape[0], 1)], dim=1)
            w2 = torch.cat([w2, self.down_proj_bias.unsqueeze(1)], dim=1)
        out = moe_combine(y, top_k_weights, top_k_index, layout, w2, self.pg, method=self.method)
        return out.to(hidden_states.dtype)

    def _gate(self, h: Tensor) -> Tensor:
        if self.variant.gate == CLAMPED_SWIGLU:
            return clamped_swiglu(h, self.variant.alpha, self.variant.limit)
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def extra_repr(self) -> str:
        v = self.variant
        gate = (f"clamped SwiGLU (alpha={v.alpha}, limit={v.limit})" if v.gate == CLAMPED_SWIGLU
                else "act(gate) * up")
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} "
                f"of {self.num_experts}, hidden={self.hidden_dim}, ffn={self.intermediate_dim}, "
                f"gate {gate}, biases={v.bias}, group size {comm.world_size(self.pg)}, "
                f"method={self.method!r}")


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_code(experts: nn.Module) -> int:
    dtype = experts.gate_up_proj.dtype
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else len(_DTYPES) + 1
