"""``ExpertParallelExperts``: an expert-parallel drop-in for the experts module of a transformers 5
mixture-of-experts block (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``,
``OlmoeExperts``, ``DeepseekV3Experts``, ...).

Those modules hold every expert's weights as 3-D parameters -- ``gate_up_proj [E, 2F, H]`` (the
[gate|up] halves concatenated) and ``down_proj [E, H, F]``, ``nn.Linear``'s [out, in] layout -- and
are called by their block as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``
after the block's router, returning ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(t)``
with expert(x) = down(act(gate(x)) * up(x)). Replaced by this layer, each rank of ``group`` holds
experts ``rank * E/W .. (rank + 1) * E/W - 1`` (``E/W`` rows of both parameters, under their
original names) and the call runs

    h, layout = moe_dispatch(hidden, top_k_index, gate_up_proj^T)     tokens to their experts
    out       = moe_combine(act(gate) * up, top_k_weights, top_k_index, layout, down_proj^T)

The router is not touched: it stays replicated in the block, so the router logits and the
auxiliary load-balancing loss the model returns are computed as before, from this rank's tokens.
Each rank passes its own tokens (expert parallelism shares ranks with data parallelism): the
experts' gradients then sum every rank's tokens routed to them, while the router's, like every
replicated parameter's, are this rank's part (``parallelize`` averages both over the group).

Every rank checks the module it was given, and the expert count, together (``_common.prepare``):
a module that is not such an experts module on any rank -- or one whose variant this layer does not
compute exactly (biases, a gate other than transformers' default [gate|up] split, a norm after
each expert, no gate) -- and an expert count the group size does not divide are the same
``InputError`` on every rank before any collective.
"""
from __future__ import annotations

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
    "is not a transformers experts module (3-D gate_up_proj [E, 2F, H] and down_proj [E, H, F] "
    "parameters, called as experts(hidden, top_k_index, top_k_weights))",
    "has expert biases (gate_up_proj_bias / down_proj_bias), which this layer does not compute",
    "stores its weights transposed ([E, H, 2F]) or its [gate|up] halves interleaved, which this "
    "layer does not compute",
    "applies a gate of its own (_apply_gate) instead of transformers' default act(gate) * up",
    "has a norm after each expert or no gate, which this layer does not compute",
)


def describe(experts: nn.Module) -> Tuple[int, int, int, int]:
    """(refusal code: 0 if the layer computes this module exactly, experts, hidden, ffn)."""
    up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3
            and down.dim() == 3 and up.shape[0] == down.shape[0]):
        return 1, 0, 0, 0
    experts_count, two_ffn, hidden = up.shape
    sizes = (experts_count, hidden, two_ffn // 2)
    if getattr(experts, "has_bias", False) or hasattr(experts, "gate_up_proj_bias") \
            or hasattr(experts, "down_proj_bias"):
        return (2, *sizes)
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return (3, *sizes)
    if not _default_gate(experts):
        return (4, *sizes)
    if getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "has_gate", True):
        return (5, *sizes)
    if two_ffn % 2 or tuple(down.shape) != (experts_count, hidden, two_ffn // 2) \
            or not hasattr(experts, "act_fn"):
        return 1, 0, 0, 0
    return (0, *sizes)


def _default_gate(experts: nn.Module) -> bool:
    own = getattr(type(experts), "_apply_gate", None)
    if own is None:
        return True  # not decorated by transformers: the plain act(gate) * up of its forward
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return own is _default_apply_gate


def _check(sigs: List[_common.CallSignature], world: int, allowed) -> Optional[str]:
    for r, s in enumerate(sigs):
        where = f" (rank {r})" if len(sigs) > 1 else ""
        code, experts = s.options[0], s.options[1]
        if code:
            return f"the module passed{where} {REFUSALS[code]}"
        if experts % world:
            return (f"num_experts={experts} is not divisible by the expert-parallel size {world} "
                    f"(each rank holds num_experts / {world} experts){where}")
    return comm.differs(sigs, "(num_experts, hidden size, expert width, dtype)",
                        lambda s: s.options[1:])


class ExpertParallelExperts(nn.Module):
    """The experts of ``experts`` spread over ``group`` (module docstring). ``method``: the MoE ops'
    method ("auto", "unfused", "decomposed"). The full module is only read: each rank copies its
    experts' rows."""

    def __init__(self, experts: nn.Module, group=None, *, method: str = "auto"):
        super().__init__()
        code, num_experts, hidden, ffn = describe(experts)
        dtype_code = _dtype_code(experts) if code == 0 else 0
        self.pg, _ = _common.prepare(KIND, (), (), group, method, check=_check,
                                     options=(code, num_experts, hidden, ffn, dtype_code))
        world, rank = comm.world_size(self.pg), comm.rank(self.pg)
        local = num_experts // world
        rows = slice(rank * local, (rank + 1) * local)
        self.num_experts, self.num_local_experts = num_experts, local
        self.hidden_dim, self.intermediate_dim = hidden, ffn
        self.first_expert = rank * local
        self.method = method
        with torch.no_grad():
            self.gate_up_proj = nn.Parameter(experts.gate_up_proj[rows].clone())
            self.down_proj = nn.Parameter(experts.down_proj[rows].clone())
        self.act_fn = experts.act_fn

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        h, layout = moe_dispatch(hidden_states, top_k_index, self.gate_up_proj.transpose(1, 2),
                                 self.pg, num_experts=self.num_experts, method=self.method)
        gate, up = h.chunk(2, dim=-1)
        out = moe_combine(self.act_fn(gate) * up, top_k_weights, top_k_index, layout,
                          self.down_proj.transpose(1, 2), self.pg, method=self.method)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} "
                f"of {self.num_experts}, hidden={self.hidden_dim}, ffn={self.intermediate_dim}, "
                f"group size {comm.world_size(self.pg)}, method={self.method!r}")


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_code(experts: nn.Module) -> int:
    dtype = experts.gate_up_proj.dtype
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else len(_DTYPES) + 1
