"""The steps ``parallelize`` composes (pyfused/parallelize/api.py), in the order it runs them.

  check_locally       what needs no communication: the mesh's dims, the plan, the tensor-parallel
                      and pipeline checks, the options; the first problem found, or None;
  agree_across_ranks  the first collective: one fixed-size exchange per mesh dim (checks.agree);
                      any rank's problem, or ranks that differ, raise the same ParallelizeError on
                      every rank;
  apply_ep            the experts modules spread over the ep dim, in place (moe.py);
  apply_tp            tensor (and sequence) parallelism on the tp dim, in place;
  average_over_ep     the ep ranks' share of data parallelism: gradient hooks (moe.py);
  apply_cp            context parallelism on the cp dim: attention through ring_attention
                      (context.py);
  apply_pipeline      with pp > 1, in place of apply_tp, apply_cp and data parallelism: this rank's
                      pipeline stage, which applies them to the modules it keeps (pipeline.py);
  apply_fsdp          ``fully_shard`` on the dp dim: each block a unit, then the model;
                      with dp="hsdp" on the 2-D ("dp_replicate", "dp_shard") mesh (HSDP;
                      with cp > 1 the shard dim is dp_shard x cp: ``hsdp_mesh``);
  apply_ddp           pyfused's DistributedDataParallel on the dp dim (dp x cp with a cp dim).

Every step after the agreement runs the same collectives in the same order on every rank, since
all ranks agreed on the model, the mesh, the plan and the options.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch.nn as nn

from .. import comm
from ..fsdp import compose as fsdp_compose
from ..layers import DistributedDataParallel
from . import (
    checks as checks_mod,
    context as cp_mod,
    moe as ep_mod,
    pipeline as pp_mod,
    plans as plans_mod,
    tensor_parallel as tp_mod,
)

try:
    from torch.distributed.device_mesh import DeviceMesh as DeviceMeshType
except ImportError:  # pragma: no cover - torch without DeviceMesh
    DeviceMeshType = ()

MESH_DIMS = checks_mod.MESH_DIMS
OPTIONAL_DIMS = ("cp", "ep")  # described only where the mesh names them
DATA_PARALLEL = ("ddp", "fsdp", "hsdp")
HSDP_DIMS = ("dp_replicate", "dp_shard")


class MeshInfo:
    """Size, group and this rank's coordinate of each of dp / tp / pp (size 1 where absent), and of
    HSDP's dp_replicate / dp_shard. On an HSDP mesh "dp" is the data-parallel degree they make
    together: size R x S, coordinate (replicate index) x S + (shard index), no group."""

    def __init__(self, mesh):
        self.mesh = mesh
        names = tuple(mesh.mesh_dim_names or ())
        self.names = names
        self.size: Dict[str, int] = {d: 1 for d in MESH_DIMS}
        self.group: Dict[str, Any] = {d: None for d in MESH_DIMS}
        self.coord: Dict[str, int] = {d: 0 for d in MESH_DIMS}
        for i, name in enumerate(names):
            if name in MESH_DIMS:
                self.size[name] = mesh.size(i)
                self.group[name] = mesh.get_group(name)
                self.coord[name] = mesh.get_local_rank(name)
        self.hsdp = all(d in names for d in HSDP_DIMS)
        if self.hsdp:
            self.size["dp"] = self.size["dp_replicate"] * self.size["dp_shard"]
            self.coord["dp"] = (self.coord["dp_replicate"] * self.size["dp_shard"]
                                + self.coord["dp_shard"])
        # the mesh's own groups would otherwise keep torch's default timeout (docs/FAULTS.md)
        comm.faults.inherit_default_timeout(self.group.values())

    def describe(self) -> str:
        dims = (HSDP_DIMS if self.hsdp else ("dp",)) + ("pp", "tp")
        dims += tuple(d for d in OPTIONAL_DIMS if d in self.names)
        return " x ".join(f"{d}={self.size[d]}" for d in dims)


# ---- checks --------------------------------------------------------------------------------------
def mesh_problem(mesh) -> Optional[str]:
    """Why ``mesh`` is not a DeviceMesh with distinct dims named among MESH_DIMS, or None."""
    if not isinstance(mesh, DeviceMeshType):
        return f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}"
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        return "mesh needs named dims: init_device_mesh(..., mesh_dim_names=('dp', 'tp', ...))"
    bad = [n for n in names if n not in MESH_DIMS]
    if bad or len(set(names)) != len(names):
        return f"mesh dims must be distinct names among {MESH_DIMS}; got {names}"
    return None


def check_locally(model: nn.Module, mesh, plan, sequence_parallel: bool, dp: str, pipeline_options: Dict
                  ) -> Tuple[Optional[MeshInfo], Optional[plans_mod.ResolvedPlan], Optional[str]]:
    """(the mesh's dims, the resolved plan, the first problem or None), without communication.

    Checked in this order, each only when everything before passed: the mesh's dims, the plan
    (``"auto"`` picks the family from ``config.model_type``; every parameter covered), what tensor
    parallelism needs (every sharded size divisible, fused layouts, the sequence-parallel region),
    what expert parallelism needs (ep > 1), what the pipeline needs (pp > 1), what context
    parallelism needs (cp > 1), ``dp`` and its mesh dims, and no pipeline options without a pp dim. The mesh's
    dims are None when the mesh is unusable, the plan when it does not resolve."""
    problem = mesh_problem(mesh)
    if problem is not None:
        return None, None, problem
    info = MeshInfo(mesh)
    try:
        resolved = plans_mod.resolve(model, plans_mod.auto_plan(model) if plan == "auto" else plan)
    except plans_mod.PlanError as e:
        return info, None, str(e)
    pp = info.size["pp"]
    problem = tp_mod.check(model, resolved, info.size["tp"], sequence_parallel)
    if problem is None:
        problem = ep_mod.check(model, resolved, info.size["ep"], pp, dp)
    if problem is None and pp > 1:
        problem = pp_mod.check(model, resolved, pp, pipeline_options)
    if problem is None:
        problem = cp_mod.problem(model, info.size["cp"], dp, info.size["ep"])
    if problem is None and dp not in DATA_PARALLEL:
        problem = f"dp must be 'ddp', 'fsdp' or 'hsdp', got {dp!r}"
    if problem is None:
        problem = data_parallel_problem(info, dp)
    if problem is None and pp == 1 and pipeline_options:
        problem = (f"pipeline options {sorted(pipeline_options)} given but the mesh has no pp "
                   "dim > 1")
    return info, resolved, problem


def data_parallel_problem(info: MeshInfo, dp: str) -> Optional[str]:
    """Why the mesh's data-parallel dims do not fit ``dp``, or None: dp="hsdp" takes the dims
    "dp_replicate" and "dp_shard", adjacent and in that order (fully_shard's (replicate, shard)),
    in place of "dp"; "ddp" and "fsdp" take "dp"."""
    names = info.names
    hsdp_dims = [d for d in HSDP_DIMS if d in names]
    example = ("e.g. init_device_mesh(device, (R, S, tp), mesh_dim_names=('dp_replicate', "
               "'dp_shard', 'tp'))")
    if dp != "hsdp":
        if hsdp_dims:
            return (f"the mesh dims {tuple(hsdp_dims)} are HSDP's: pass dp='hsdp' with both "
                    f"'dp_replicate' and 'dp_shard', or name the data-parallel dim 'dp' for "
                    f"dp={dp!r}; got mesh dims {names}")
        return None
    if "dp" in names or len(hsdp_dims) < 2:
        return (f"dp='hsdp' needs the mesh dims 'dp_replicate' and 'dp_shard' (replicate across, "
                f"shard within) in place of 'dp', {example}; got mesh dims {names}")
    if names.index("dp_shard") != names.index("dp_replicate") + 1:
        return (f"dp='hsdp' needs 'dp_shard' right after 'dp_replicate' (fully_shard reads the 2-D "
                f"mesh as (replicate, shard)), {example}; got mesh dims {names}")
    return None


def agree_across_ranks(model: nn.Module, mesh, info: Optional[MeshInfo], plan, options: tuple,
                       problem: Optional[str], check_weights: bool) -> None:
    """The first collective of ``parallelize``: raise the same ParallelizeError on every rank when
    any rank has a problem, or the ranks differ in model, weights (``check_weights``), mesh, plan or
    ``options``. Every rank of the mesh calls it, whatever ``check_locally`` found."""
    claims = checks_mod.Claims(
        info.mesh if info else None, problem=problem, model=model if check_weights else None,
        alike={"model": checks_mod.model_fingerprint(model),
               "mesh": checks_mod.fingerprint((info.names, tuple(mesh.shape))) if info else 0,
               "plan": checks_mod.fingerprint(plan), "options": checks_mod.fingerprint(options)})
    msg = checks_mod.agree(claims)
    if msg is not None:
        raise checks_mod.ParallelizeError(f"pyfused.parallelize: {msg}")


# ---- steps ---------------------------------------------------------------------------------------
def apply_ep(model: nn.Module, resolved: plans_mod.ResolvedPlan, info: MeshInfo,
             tp: tp_mod.TensorParallel) -> None:
    """The plan's experts modules spread over the ep dim, their shard specs beside the TP ones;
    before apply_tp, so that its sequence-parallel hooks see the experts' new parameters."""
    ep_mod.apply(model, resolved, info.group["ep"], info.size["ep"], info.coord["ep"], tp.overlap,
                 tp.param_specs)


def average_over_ep(model: nn.Module, info: MeshInfo, dp: str) -> None:
    """Gradients averaged over the ep ranks' batches (after apply_tp: on the final parameters); with
    dp="fsdp" the replicated ones by fully_shard over every data rank (apply_fsdp)."""
    ep_mod.average_gradients(model, info.group["ep"], info.size["ep"], dp == "fsdp")


def apply_tp(model: nn.Module, resolved: plans_mod.ResolvedPlan, tp: tp_mod.TensorParallel) -> None:
    """Tensor (and sequence) parallelism on the tp dim, in place; nothing at tp = 1."""
    if tp.world > 1:
        tp.apply(model, resolved)


def apply_pipeline(model: nn.Module, resolved: plans_mod.ResolvedPlan, info: MeshInfo,
                   tp: tp_mod.TensorParallel, dp: str,
                   pipeline_options: Dict) -> pp_mod.PipelinedModel:
    """This rank's pipeline stage and its schedule: the cut is decided on the full model, then TP,
    cp and ``dp`` (over dp x cp, where the stage's parameters are replicated; HSDP: over
    ``fsdp_mesh``) apply to the modules the stage keeps (pipeline.py)."""
    context = apply_cp(None, info) if info.size["cp"] > 1 else None
    if info.hsdp:
        data_mesh = fsdp_mesh(info)
    else:
        data_mesh = replica_mesh(info) if info.size["dp"] * info.size["cp"] > 1 else None
    return pp_mod.PipelinedModel(model, resolved, info, tp, data_parallel=dp, data_mesh=data_mesh,
                                 context=context, **pipeline_options)


def apply_fsdp(model: nn.Module, resolved: plans_mod.ResolvedPlan, info: MeshInfo,
               tp: tp_mod.TensorParallel) -> nn.Module:
    """``fully_shard`` over ``fsdp_mesh``, after TP (each block a unit, then the model; the TP specs
    follow the parameters to their shards): the model, sharded in place (itself on one rank). With
    ep > 1 each experts layer is first a unit of its own over the dp dim (moe.py). With a cp dim the
    mesh is dp x cp flattened, where the parameters are replicated too (context.py scales the loss
    so that the average over that group sums the parts of one sequence)."""
    if info.size["ep"] > 1:
        ep_mod.shard_experts(model, ep_mod.experts_mesh(info.mesh), tp.param_specs)
    mesh = fsdp_mesh(info)
    if mesh is not None:
        fsdp_compose.shard_model(model, resolved.blocks[0] if resolved.blocks else None,
                                 mesh, tp.param_specs)
    return model


def fsdp_mesh(info: MeshInfo):
    """The mesh fully_shard shards the model over, None on one rank: HSDP's 2-D mesh
    (``hsdp_mesh``), the dp dim, with ep > 1 every data rank, dp x ep flattened (the experts
    aside; moe.py), or with cp > 1 dp x cp (``replica_mesh``). Made once per mesh: every rank
    makes it at the same step."""
    if not hasattr(info, "fsdp_mesh"):
        if info.hsdp:
            info.fsdp_mesh = hsdp_mesh(info)
        elif info.size["ep"] > 1:
            info.fsdp_mesh = ep_mod.data_mesh(info.mesh, info.size["dp"])
        elif info.size["cp"] > 1:
            info.fsdp_mesh = replica_mesh(info)
        else:
            info.fsdp_mesh = info.mesh["dp"] if info.size["dp"] > 1 else None
    return info.fsdp_mesh


def hsdp_mesh(info: MeshInfo):
    """HSDP's 2-D (replicate, shard) mesh: ("dp_replicate", "dp_shard"), or with cp > 1
    ("dp_replicate", dp_shard x cp flattened): the cp ranks hold the same parameters, so they
    share the shards out with dp_shard, as dp="fsdp" shards over dp x cp."""
    if info.size["cp"] == 1:
        return info.mesh[HSDP_DIMS]
    # joined, not sliced out of the root mesh: torch deprecates slicing a flattened dim from it
    return DeviceMeshType._concatenate([info.mesh["dp_replicate"],
                                        flattened(info, ("dp_shard", "cp"))])


def apply_cp(model: Optional[nn.Module], info: MeshInfo) -> cp_mod.ContextParallel:
    """Context parallelism on the cp dim: the attention modules of ``model`` run ring_attention
    (context.py); ``model`` None: the cp dim only, which a pipeline stage installs itself."""
    replicas = replica_group(info) if info.size["cp"] > 1 else None
    cp = cp_mod.ContextParallel(info.group["cp"], info.size["cp"], info.coord["cp"], replicas)
    if model is not None:
        cp.install(model)
    return cp


def apply_ddp(model: nn.Module, info: MeshInfo) -> nn.Module:
    """The model under pyfused's DistributedDataParallel over the dp dim, and the cp dim where the
    parameters are replicated too (itself when both are 1)."""
    if info.size["dp"] * info.size["cp"] > 1:
        return DistributedDataParallel(model, process_group=replica_group(info))
    return model


def replica_group(info: MeshInfo):
    """The group of the ranks that hold the same parameters: dp, or dp x cp flattened (made once
    per mesh: every rank makes it at the same step)."""
    if not hasattr(info, "replicas"):
        info.replicas = _replica_group(info)
    return info.replicas


def _replica_group(info: MeshInfo):
    if info.size["cp"] == 1:
        return info.group["dp"]
    return replica_mesh(info).get_group()


def replica_mesh(info: MeshInfo):
    """The 1-D mesh of dp (without a cp dim), cp (at dp = 1), or dp x cp flattened; on an HSDP
    mesh dp_replicate x dp_shard x cp flattened (made once per mesh)."""
    if info.hsdp:
        return flattened(info, HSDP_DIMS + ("cp",))
    if info.size["cp"] == 1:
        return info.mesh["dp"]
    if info.size["dp"] == 1:
        return info.mesh["cp"]
    return flattened(info, ("dp", "cp"))


def flattened(info: MeshInfo, dims: Tuple[str, ...]):
    """The mesh's dims among ``dims``, in the mesh's order, flattened into one 1-D mesh (made once
    per mesh and dims: every rank makes it at the same step)."""
    dims = tuple(n for n in info.names if n in dims)
    if len(dims) == 1:
        return info.mesh[dims[0]]
    made = info.__dict__.setdefault("flat_meshes", {})
    if dims not in made:
        made[dims] = info.mesh[dims]._flatten()
    return made[dims]
