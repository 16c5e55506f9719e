"""Tensor-parallel linear layers with Megatron-LM's semantics, on pyfused's overlapped ops.

Layout is sequence-first: dim 0 is the one sequence parallelism shards. Weights keep nn.Linear's
layout ``[out_local, in_local]``.

ColumnParallelLinear (weight rows sharded: out_local = out_features / W)
  * sequence_parallel=False: input replicated ``[s, ..., in]``; output ``[s, ..., out/W]`` (or the
    full ``[s, ..., out]`` with gather_output=True). Backward all-reduces the input gradient,
    overlapped with the weight-gradient GEMM unless overlap="unfused".
  * sequence_parallel=True: input is a sequence shard ``[s/W, ..., in]``; output
    ``all_gather_matmul(x, w^T)`` = ``[s, ..., out/W]``.
RowParallelLinear (weight columns sharded: in_local = in_features / W)
  * input ``[..., in/W]`` (input_is_parallel=True) or the full ``[..., in]`` to be split.
  * sequence_parallel=False: output ``matmul_all_reduce(x, w^T) + bias``, replicated ``[s, ..., out]``.
  * sequence_parallel=True: output ``matmul_reduce_scatter(x, w^T) + bias``, a sequence shard
    ``[s/W, ..., out]``; every rank's bias gradient is the full model's, the column sum of the output
    gradient that the backward gathers anyway (no collective of its own).
The bias of a row-parallel layer is added once, after the reduction.

``overlap`` is the ``method=`` of the underlying ops: "auto" | "decomposed" | "unfused" | "fused".
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import comm
from ..comm import plans
from ..ops import _common, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from ._tp_functions import (
    ColumnLinearReplicatedInput,
    GatherLastDim,
    RowLinearToSequenceShard,
    ScatterLastDim,
)


def _check_layer_args(kind: str):
    """The constructor's contract over all ranks' signatures (options: in_features, out_features,
    bias, gather_output / input_is_parallel, sequence_parallel)."""

    def check(sigs: List[_common.CallSignature], world: int, allowed) -> Optional[str]:
        for r, s in enumerate(sigs):
            where = f" (rank {r})" if len(sigs) > 1 else ""
            in_features, out_features, _, flag, sequence_parallel = s.options
            if in_features < 1 or out_features < 1:
                return f"in_features and out_features must be positive ints{where}"
            if kind == "ColumnParallelLinear" and flag == 1 and sequence_parallel == 1:
                return ("gather_output=True is not supported with sequence_parallel=True (the "
                        f"output is already gathered along the sequence){where}")
            if kind == "RowParallelLinear" and flag == 0 and sequence_parallel == 1:
                return f"sequence_parallel=True needs input_is_parallel=True (as in Megatron-LM){where}"
            sharded = out_features if kind == "ColumnParallelLinear" else in_features
            if sharded % world != 0:
                dim_name = "out_features" if kind == "ColumnParallelLinear" else "in_features"
                return f"{dim_name}={sharded} must be divisible by the tensor-parallel size {world}"
        return comm.differs(sigs, "(in_features, out_features, bias, gather_output or "
                                  "input_is_parallel, sequence_parallel)", lambda s: s.options)

    return check


def _check_forward_input(kind: str, width: int, replicated: bool):
    """A forward's contract: x [..., width] of the weight's dtype and device; a replicated input is
    the same tensor shape on every rank (its backward sums gradients across ranks)."""

    def check(sigs: List[_common.CallSignature], world: int, allowed) -> Optional[str]:
        for r, s in enumerate(sigs):
            where = f" (rank {r})" if len(sigs) > 1 else ""
            x, weight = s.tensors[0], s.tensors[1]
            if not x.shape or x.shape[-1] != width:
                return f"input's last dim must be {width}; got {x.describe()}{where}"
            if x.dtype != weight.dtype or x.device != weight.device:
                return (f"input must have the weight's dtype and device; got input {x.describe()}, "
                        f"weight {weight.describe()}{where}")
        if replicated:
            return comm.differs(sigs, "input", lambda s: s.tensors[0],
                                lambda s: s.tensors[0].describe())
        return None

    return check


def _layer_tensors(x, weight, bias) -> Tuple[Tuple[str, ...], tuple]:
    if bias is None:
        return ("input", "weight"), (x, weight)
    return ("input", "weight", "bias"), (x, weight, bias)


class _ParallelLinear(nn.Module):
    def _init_common(self, kind, in_features, out_features, bias, group, flag, sequence_parallel,
                     overlap):
        options = (_common.int_code(in_features), _common.int_code(out_features), int(bool(bias)),
                   int(bool(flag)), int(bool(sequence_parallel)))
        self.pg, _ = _common.prepare(kind, (), (), group, overlap, options=options,
                                     check=_check_layer_args(kind), method_arg="overlap")
        self.in_features, self.out_features = in_features, out_features
        self.world_size, self.rank = comm.world_size(self.pg), comm.rank(self.pg)
        self.group_name = comm.group_name(self.pg)
        self._forward_code = comm.op_code(f"{kind}.forward")  # its key in the plan cache
        self.sequence_parallel = sequence_parallel
        self.overlap = overlap
        self.has_bias = bias

    def _prepare_forward(self, x, width: int, replicated: bool) -> Optional[_common.Plan]:
        """Every rank agrees on this forward's input (and on which inputs need a gradient, which
        decides whether backward runs collectives) before any collective of the layer; the plan
        says whether the forward records an autograd graph. Traced by torch.compile (None), the
        check is left to the registered ops, which validate when they run."""
        if torch.compiler.is_dynamo_compiling():  # Dynamo cannot trace the C++ lookup
            return None
        key = (self.pg, self.overlap, width, replicated, x, self.weight, self.bias)
        plan = plans.lookup(self._forward_code, *key)
        if plan is not None:  # this forward was checked before
            return plan
        if torch.compiler.is_compiling():  # e.g. non-strict export: fake tensors, no exchange
            return None
        kind = type(self).__name__
        names, tensors = _layer_tensors(x, self.weight, self.bias)
        pg, choice = _common.prepare(f"{kind}.forward", names, tensors, self.pg, self.overlap,
                                     options=(width, int(replicated)),
                                     check=_check_forward_input(kind, width, replicated),
                                     method_arg="overlap")
        return _common.new_plan(f"{kind}.forward", pg, choice, 0, tensors, key,
                                code=self._forward_code)

    def reset_parameters(self) -> None:
        # nn.Linear's default init with the *full* layer's fan-in, so a shard draws from the same
        # distribution as the corresponding slice of an unsharded layer.
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def _gather_dim(self) -> int:
        raise NotImplementedError

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, Tensor]:
        """The unsharded layer's ``{"weight", "bias"}`` on every rank (a collective: call it on all)."""
        dim = self._gather_dim()
        out = {"weight": _all_gather_dim(self.weight, dim, self.pg)}
        if self.bias is not None:
            out["bias"] = _all_gather_dim(self.bias, 0, self.pg) if dim == 0 else self.bias.clone()
        return out

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding the gathered full layer (a collective: call it on all ranks)."""
        sd = self.full_state_dict()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        lin.load_state_dict(sd)
        return lin

    @torch.no_grad()
    def load_full_state_dict(self, state: Dict[str, Tensor]) -> None:
        """Load this rank's shard of an unsharded layer's ``{"weight", "bias"}``."""
        dim = self._gather_dim()
        shard = lambda t, d: t.chunk(self.world_size, dim=d)[self.rank]  # noqa: E731
        self.weight.copy_(shard(state["weight"], dim))
        if self.bias is not None:
            self.bias.copy_(shard(state["bias"], 0) if dim == 0 else state["bias"])

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs):
        """Shard an existing ``nn.Linear`` (identical on every rank, e.g. same seed or checkpoint)."""
        kwargs.setdefault("device", linear.weight.device)
        kwargs.setdefault("dtype", linear.weight.dtype)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    group=group, **kwargs)
        layer.load_full_state_dict(linear.state_dict())
        return layer


def _all_gather_dim(t: Tensor, dim: int, pg) -> Tensor:
    w = comm.world_size(pg)
    if w == 1:
        return t.detach().clone()
    parts = t.new_empty((w * t.shape[0], *t.shape[1:]))
    comm.all_gather_single(parts, t.detach().contiguous(), group=pg)
    return torch.cat(parts.view(w, *t.shape).unbind(0), dim=dim)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W^T + b`` with W's output rows sharded over the group; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 overlap: str = "auto", device=None, dtype=None):
        super().__init__()
        self._init_common("ColumnParallelLinear", in_features, out_features, bias, group,
                          gather_output, sequence_parallel, overlap)
        self.gather_output = gather_output
        self.out_local = out_features // self.world_size
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_local, **factory)) if bias else None
        self.reset_parameters()

    def _gather_dim(self) -> int:
        return 0

    def forward(self, x: Tensor) -> Tensor:
        plan = self._prepare_forward(x, self.in_features, replicated=not self.sequence_parallel)
        if self.sequence_parallel:
            y = all_gather_matmul(x, self.weight.t(), self.pg, method=self.overlap)
            return y + self.bias if self.bias is not None else y
        if plan is not None and plan.direct:  # no autograd graph: the forward is the local linear
            y = F.linear(x, self.weight, self.bias)
        else:
            y = ColumnLinearReplicatedInput.apply(x, self.weight, self.bias, self.group_name,
                                                  self.overlap)
        return GatherLastDim.apply(y, self.pg) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.out_local}), bias={self.bias is not None}, world={self.world_size}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap!r}")


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W^T + b`` with W's input columns sharded over the group; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 overlap: str = "auto", device=None, dtype=None):
        super().__init__()
        self._init_common("RowParallelLinear", in_features, out_features, bias, group,
                          input_is_parallel, sequence_parallel, overlap)
        self.input_is_parallel = input_is_parallel
        self.in_local = in_features // self.world_size
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def _gather_dim(self) -> int:
        return 1

    def forward(self, x: Tensor) -> Tensor:
        width = self.in_local if self.input_is_parallel else self.in_features
        plan = self._prepare_forward(x, width, replicated=not self.input_is_parallel)
        if plan is not None and plan.local:  # one rank, no autograd graph: the local linear
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = ScatterLastDim.apply(x, self.pg)
        if self.sequence_parallel:
            if self.bias is not None:
                return RowLinearToSequenceShard.apply(x, self.weight, self.bias, self.pg, self.overlap)
            return matmul_reduce_scatter(x, self.weight.t(), self.pg, method=self.overlap)
        y = matmul_all_reduce(x, self.weight.t(), self.pg, method=self.overlap)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_local}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"world={self.world_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}, overlap={self.overlap!r}")
