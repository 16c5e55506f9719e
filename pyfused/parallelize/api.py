"""``pyfused.parallelize(model, mesh, plan="auto", *, sequence_parallel=True)``.

``parallelize`` runs these steps (steps.py), in this order, on every rank, on the same full model:
  1. ``check_locally``: the checks that need no communication: the mesh's dims, the plan
     (``plan="auto"`` picks the family from ``config.model_type``), every parameter covered, every
     sharded size divisible, what the pipeline needs, the options;
  2. ``agree_across_ranks``: one fixed-size exchange per mesh dim (``checks.agree``): all ranks must
     hold the same model (a fingerprint of its structure, and a checksum of its values), the same
     mesh (dim names, and the global ranks of each named group), plan and options, and any rank's
     problem is raised on every rank with the same message -- before any other collective;
  3. ``apply_ep``: the experts of mixture-of-experts layers spread over the ``ep`` dim (moe.py);
  4. ``apply_tp``: tensor/sequence parallelism in place on the ``tp`` dim (tensor_parallel.py);
  5. ``average_over_ep``: the ep ranks, which feed their own batches, average their gradients;
  6. ``apply_cp``: context parallelism on the ``cp`` dim (context.py);
  7. ``apply_fsdp`` (``dp="fsdp"``, or ``dp="hsdp"``) or ``apply_ddp`` (``dp="ddp"``): data
     parallelism on the ``dp`` dim (HSDP: the ``dp_replicate`` x ``dp_shard`` dims; DDP: dp x cp):
     ``fully_shard`` or pyfused's DistributedDataParallel of the whole model.
With pp > 1, ``apply_pipeline`` takes the place of 3 to 7: this rank's pipeline stage
(pipeline.py), whose modules get tensor parallelism, context parallelism, then data parallelism.

The returned ``ParallelModel`` is called like the original model and returns what it returns;
``full_state_dict()`` / ``load_full_state_dict()`` translate to and from the original model's state.
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .._logging import logger
from ..fsdp import compose as fsdp_compose
from . import report as report_mod, tensor_parallel as tp_mod
from .checks import ParallelizeError
from .sequence import _check_divisible
from .shard import ShardSpec
from .steps import (
    MeshInfo,
    agree_across_ranks,
    apply_cp,
    apply_ddp,
    apply_ep,
    apply_fsdp,
    apply_pipeline,
    apply_tp,
    average_over_ep,
    check_locally,
    fsdp_mesh,
)

__all__ = ["MeshInfo", "ParallelModel", "ParallelizeError", "parallelize"]


def parallelize(model: nn.Module, mesh, plan: Union[str, Dict[str, str]] = "auto", *,
                sequence_parallel: bool = True, overlap: str = "auto", check_weights: bool = True,
                verbose: bool = False, dp: str = "ddp", **pipeline_options) -> "ParallelModel":
    """Shard ``model`` (a full model, identical on every rank) over ``mesh``; see the module docstring.

    ``mesh``: a DeviceMesh with any of the dims "dp", "cp", "tp", "pp", "ep" (sizes may be 1); all
    communication stays within the mesh's dim groups. With ``dp="hsdp"`` the dims "dp_replicate",
    "dp_shard" (adjacent, in that order) take the place of "dp". The ranks along "ep" feed their own
    batches and share the experts of mixture-of-experts layers out (pyfused/parallelize/moe.py); the
    ranks along "cp" each hold a share of every sequence (pyfused/parallelize/context.py).
    ``plan``: "auto" (the model types in ``plans.FAMILIES``) or ``{module pattern: style}`` (plans.py).
    ``sequence_parallel``: shard the norms' activations along the sequence inside the blocks (TP > 1).
    ``overlap``: the pyfused layers' ``overlap=`` method ("auto", "decomposed", "unfused", "fused").
    ``check_weights``: check that every rank holds the same parameter and buffer values (one
    checksum per tensor, exchanged with the fingerprint); False for ranks that differ on purpose.
    ``verbose``: print the report of what was done (``ParallelModel.report()``) on global rank 0,
    now and once the first call has recorded the op methods chosen.
    ``pipeline_options``: for pp > 1, see pyfused/parallelize/pipeline.py.
    ``dp``: "ddp" (pyfused's DistributedDataParallel) or "fsdp" (``pyfused.fully_shard`` on the dp
    dim: each block a unit, then the model -- with pp > 1 this rank's stage module, whose units
    stay gathered through a step's microbatches and reduce-scatter once, on its last backward;
    docs/FSDP.md) or "hsdp" (``fully_shard`` on the 2-D ("dp_replicate", "dp_shard") mesh: sharded
    within dp_shard, replicated across dp_replicate; with pp > 1 each stage, as with "fsdp").
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pyfused.parallelize needs torch.distributed initialised (torchrun, or "
                           "init_process_group) and a DeviceMesh over it")
    info, resolved, problem = check_locally(model, mesh, plan, sequence_parallel, dp,
                                            pipeline_options)
    options = (bool(sequence_parallel), overlap, dp, bool(check_weights),
               sorted(pipeline_options.items()))
    agree_across_ranks(model, mesh, info, plan, options, problem, check_weights)

    tp = tp_mod.TensorParallel(info.group["tp"], info.size["tp"], info.coord["tp"],
                               sequence_parallel, overlap)
    stage, runner, cp = None, model, None
    if info.size["pp"] > 1:
        stage = apply_pipeline(model, resolved, info, tp, dp, pipeline_options)
        cp = stage.context
    else:
        apply_ep(model, resolved, info, tp)
        apply_tp(model, resolved, tp)
        average_over_ep(model, info, dp)
        cp = apply_cp(model, info)
        runner = apply_ddp(model, info) if dp == "ddp" else apply_fsdp(model, resolved, info, tp)
    logger.info("pyfused.parallelize: %s on mesh %s (sequence_parallel=%s)", type(model).__name__,
                info.describe(), tp.sp)
    parallel = ParallelModel(model, info, tp, stage, data_parallel=dp, runner=runner,
                             plan_styles=resolved.styles, verbose=verbose, context=cp)
    if verbose and dist.get_rank() == 0:
        print(parallel.report(), flush=True)
    return parallel


def _world_group():
    """The group a failure of a parallel model is reported in (ranks are global ones)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class ParallelModel(nn.Module):
    """The parallelized model: called like the original, returns what it returns.

    ``module`` is the original model object, sharded in place (with pp > 1: only this rank's stage
    keeps its blocks). ``full_state_dict()`` and ``load_full_state_dict()`` use the original model's
    keys and shapes; ``state_dict()`` is this rank's shard.
    """

    def __init__(self, module: nn.Module, info: MeshInfo, tp: "tp_mod.TensorParallel", stage=None,
                 data_parallel: str = "ddp", runner: Optional[nn.Module] = None,
                 plan_styles: Optional[Dict[str, str]] = None, verbose: bool = False,
                 context=None):
        """``stage``: this rank's pipeline stage (pp > 1), else None; ``runner``: what a call runs
        without one: ``module``, or the DistributedDataParallel wrapping it (default ``module``);
        ``context``: the cp dim's ``ContextParallel`` (context.py), None without one."""
        super().__init__()
        self.module = module
        # not registered as submodules: parameters and state_dict come from ``module`` alone
        object.__setattr__(self, "mesh_info", info)
        object.__setattr__(self, "_tp", tp)
        object.__setattr__(self, "_stage", stage)
        # parameters are DTensors over dp (HSDP: over dp_shard, or dp_shard x cp, the shard dim of
        # its mesh; with ep > 1 the replicated ones over dp x ep, the experts over dp; with cp over
        # dp x cp, the cp dim's replicas): the group their norms sum over
        shard_group = None
        if data_parallel == "hsdp":  # the replicas along dp_replicate hold the same rows
            shards = fsdp_mesh(info)
            shard_group = shards.get_group(1) if shards.size(1) > 1 else None
        elif data_parallel == "fsdp" and info.size["dp"] > 1:
            shard_group = info.group["dp"]
        ep_sharded = data_parallel == "fsdp" and info.size["ep"] > 1
        if ep_sharded:
            shard_group = fsdp_mesh(info).get_group() if stage is None else stage.shard_group
        if data_parallel == "fsdp" and context is not None and context.size > 1:
            shard_group = context.replicas
        object.__setattr__(self, "_dp_shard_group", shard_group)
        object.__setattr__(self, "_ep_in_shard_group", ep_sharded)
        object.__setattr__(self, "_runner", module if runner is None else runner)
        object.__setattr__(self, "_full_keys", self._key_shapes())
        object.__setattr__(self, "_recorder", report_mod.MethodRecorder())  # for the first call
        object.__setattr__(self, "_choices", {})
        object.__setattr__(self, "_plan_styles", {} if plan_styles is None else plan_styles)
        object.__setattr__(self, "_verbose", bool(verbose))
        object.__setattr__(self, "context", context if context is not None and context.size > 1
                           else None)

    def train(self, mode: bool = True):
        super().train(mode)
        if self._runner is not self.module:
            self._runner.train(mode)
        return self

    @property
    def mesh(self):
        return self.mesh_info.mesh

    def forward(self, *args, **kwargs):
        self._check_sequence(args, kwargs)
        recorder = self._recorder
        if recorder is None:
            return self._call(args, kwargs)
        object.__setattr__(self, "_recorder", None)
        with recorder.recording(self.module):  # the op methods of the first call, for report()
            out = self._call(args, kwargs)
        object.__setattr__(self, "_choices", recorder.choices)
        if self._verbose and dist.get_rank() == 0:
            print(self.report(), flush=True)
        return out

    def _call(self, args, kwargs):
        with comm.failures_named("parallelize forward", _world_group()):
            if self._stage is not None:
                return self._stage.run(args, kwargs)
            if self.context is not None:
                return self.context.run(self._runner, args, kwargs)
            return self._runner(*args, **kwargs)

    def report(self) -> "report_mod.ParallelizeReport":
        """Per module of the plan (on this rank's stage): the style applied, what it became, its
        communication and the op method it ran (unfused / decomposed / fused, and why; under
        overlap="auto" as chosen by the first call). ``str()`` of it is a table."""
        return report_mod.build_report(self.module, self._plan_styles, self.mesh_info.describe(),
                                       self._tp.sp, self._tp.overlap, self._choices)

    def _check_sequence(self, args, kwargs) -> None:
        config = getattr(self.module, "config", None)

        def wanted(flag):
            v = kwargs.get(flag)
            return bool(getattr(config, flag, False) if v is None else v)

        if self._tp.world > 1 and wanted("output_attentions"):
            raise ValueError("pyfused.parallelize: output_attentions is not supported with tensor "
                             "parallelism (each rank holds only its heads' attention weights)")
        if self._tp.sp and wanted("output_hidden_states"):
            raise ValueError("pyfused.parallelize: output_hidden_states is not supported with "
                             "sequence parallelism (the blocks' outputs are sequence shards); "
                             "parallelize with sequence_parallel=False")
        if not self._tp.sp:
            return
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        if not (isinstance(x, torch.Tensor) and x.dim() >= 2):
            return
        length = x.shape[1] if self.context is None else self.context.local_length(x.shape[1])
        if length % self._tp.world:  # with cp, sequence parallelism shards this rank's rows
            _check_divisible(length, self._tp.world)

    # ---- state dicts ----------------------------------------------------------------------------
    def _spec_of(self, key: str, t: torch.Tensor) -> ShardSpec:
        spec = self._tp.param_specs.get(id(t))
        return spec if spec is not None else ShardSpec(tuple(t.shape))

    def _key_shapes(self) -> Dict[str, tuple]:
        if self._stage is not None:
            return self._stage.full_key_shapes
        return {k: self._spec_of(k, t).full_shape for k, t in self.module.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The original model's state dict, on every rank (a collective over the whole mesh)."""
        local = {k: self._spec_of(k, t).gather(fsdp_compose.full(t), self._tp.pg)
                 for k, t in self.module.state_dict(keep_vars=True).items()}
        if self._stage is not None:
            return self._stage.gather_stages(local)
        return local

    @torch.no_grad()
    def full_grad_dict(self) -> Dict[str, torch.Tensor]:
        """``{parameter name: the full model's gradient}`` (as ``named_parameters()`` of the original
        names them), on every rank; a collective over the whole mesh. For checks and debugging."""
        local = {}
        for name, p in self.module.named_parameters():
            g = (fsdp_compose.full(p.grad) if p.grad is not None
                 else torch.zeros_like(fsdp_compose.full(p)))
            local[name] = self._spec_of(name, p).gather(g, self._tp.pg)
        if self._stage is not None:
            merged = self._stage.gather_stages(local)
            return {k: merged[k] for k in self._stage.param_names}
        return local

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the full model: the norm of all gradients as the
        single-process model would have them (TP shards summed over the tp group, replicated ones
        counted once, pipeline stages summed, a tied LM head counted once), the same on every rank;
        then every local gradient is scaled. A collective over the tp and pp groups: call it on every
        rank. ``norm_type``: 2.0 or inf."""
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
        grads = [fsdp_compose.local(p.grad) for p in self.parameters() if p.grad is not None]
        skip = self._stage.duplicate_params() if self._stage is not None else set()
        device = grads[0].device if grads else torch.device("cpu")
        inf = norm_type == float("inf")
        # [sharded over tp, replicated, sharded over ep (experts)]
        parts = torch.zeros(3, dtype=torch.float64, device=device)
        for name, p in self.module.named_parameters():
            if p.grad is None or id(p) in skip:
                continue
            g = fsdp_compose.local(p.grad).detach().double()
            spec = self._spec_of(name, p)
            v = g.abs().max() if inf else g.pow(2).sum() / spec.replicas  # replicas: counted once
            i = 2 if spec.group is not None else 0 if spec.dim is not None and self._tp.world > 1 \
                else 1
            parts[i] = torch.maximum(parts[i], v) if inf else parts[i] + v
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        with comm.failures_named("parallelize clip_grad_norm_", _world_group()):
            if self._dp_shard_group is not None:  # each dp rank holds other rows of every gradient
                dist.all_reduce(parts, op=op, group=self._dp_shard_group)
            if self._tp.world > 1:
                dist.all_reduce(parts[:1], op=op, group=self._tp.pg)
            if self.mesh_info.size["ep"] > 1 and not self._ep_in_shard_group:
                dist.all_reduce(parts[2:], op=op, group=self.mesh_info.group["ep"])
            total = parts.max() if inf else parts.sum()
            if self._stage is not None:
                dist.all_reduce(total, op=op, group=self._stage.pg)
        norm = total if inf else total.sqrt()
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {norm.item()}")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm.float()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` -- except with pipeline parallelism, where the call that returned the
        loss already ran the backward of every microbatch (the schedule interleaves them)."""
        if self._stage is None:
            with comm.failures_named("parallelize backward", _world_group()):
                loss.backward()

    @torch.no_grad()
    def load_full_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Load the original model's state dict (the same on every rank): each rank takes its shard."""
        own = self.module.state_dict(keep_vars=True)
        tied = {}
        for k, t in own.items():
            tied.setdefault(id(t), []).append(k)
        missing = [k for k in self._full_keys if k not in state
                   and not (k in own and any(o in state for o in tied[id(own[k])]))]
        unexpected = [k for k in state if k not in self._full_keys]
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys "
                           f"{unexpected[:5]} (counts {len(missing)}, {len(unexpected)})")
        for k, want in self._full_keys.items():
            if k in state and tuple(state[k].shape) != tuple(want):
                raise ValueError(f"load_full_state_dict: {k} has shape {list(state[k].shape)}, the model "
                                 f"expects {list(want)}")
        for k, t in own.items():
            src = state.get(k)
            if src is None:
                src = next(state[o] for o in tied[id(t)] if o in state)
            fsdp_compose.copy_full_into(t, self._spec_of(k, t).shard(src.to(t.device)))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # config, generation settings... of the wrapped model
            return getattr(self._modules["module"], name)
