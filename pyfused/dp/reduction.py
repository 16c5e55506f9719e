"""Which all-reduce ``DistributedDataParallel`` runs per bucket: flat or host-aware.

``all_reduce=``:
  * ``"flat"``: one all-reduce over the group per bucket (torch DDP's).
  * ``"hierarchical"``: the host-aware schedule of pyfused/comm/hierarchical.py (reduce-scatter
    inside each host, all-reduce across hosts, all-gather inside) over a ("host", "local") mesh:
    ``host_mesh=`` when given (its ranks must be the group's ranks), otherwise
    ``pyfused.comm.host_mesh()``, which needs the group to hold every rank of the job and every
    host the same number of them.
  * ``"auto"`` (default): hierarchical exactly where it sends fewer bytes over the network than
    flat: the group spans two or more hosts, each holding the same number L >= 2 of its ranks, and
    the host groups can be made (the group holds every rank, or ``host_mesh=`` names them);
    otherwise flat. With ``host_mesh=`` the mesh says where the hosts are (H >= 2, L >= 2).
    With ``shard_optimizer=True`` buckets are reduce-scattered, not all-reduced: always flat.

The decision is a function of agreed options and of the group's gathered host layout, so every
rank makes the same one; an impossible explicit request raises the same ``InputError`` on every
rank. ``DistributedDataParallel.all_reduce`` holds the outcome and its reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .. import comm
from .._logging import logger
from ..comm import InputError
from ..comm.hierarchical import HostAllReduce
from ..comm.topology import MESH_DIMS, describe_mesh

MODES = ("auto", "flat", "hierarchical")
OP = "DistributedDataParallel"


@dataclass(frozen=True)
class ReductionChoice:
    method: str  # "flat" or "hierarchical"
    reason: str
    reduce: Optional[HostAllReduce] = None  # the hierarchical all-reduce, when chosen

    @property
    def ranks_per_host(self) -> int:
        return self.reduce.ranks_per_host if self.reduce is not None else 1


# host_mesh= problems, by error code of pyfused/dp/checks.py's table.
MESH_NOT_2D = 9
MESH_OTHER_RANKS = 10


def mesh_error(mesh, pg) -> int:
    """0, or the error code of why ``host_mesh=`` cannot serve ``pg`` (a local check; the ranks
    agree on it through the construction checks)."""
    if mesh is None:
        return 0
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        return MESH_NOT_2D
    if pg is None or sorted(mesh.mesh.flatten().tolist()) != sorted(dist.get_process_group_ranks(pg)):
        return MESH_OTHER_RANKS
    return 0


def mesh_code(mesh) -> int:
    """host_mesh's shape as one int for the options the ranks compare (0: no mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        return 0
    return mesh.size(0) << 16 | mesh.size(1)


def choose(pg, mode: str, mesh, sharded: bool) -> ReductionChoice:
    """The reduction (module docstring). Collective over ``pg`` the first time a group's layout is
    needed, and over the default group when it builds ``pyfused.comm.host_mesh()``."""
    choice = _choose(pg, mode, mesh, sharded)
    logger.info("pyfused DDP: %s all-reduce (%s)", choice.method, choice.reason)
    return choice


def _choose(pg, mode: str, mesh, sharded: bool) -> ReductionChoice:
    if mode == "flat":
        return ReductionChoice("flat", "all_reduce='flat'")
    if comm.world_size(pg) == 1:
        return ReductionChoice("flat", "one rank: nothing to reduce")
    if sharded:  # explicit "hierarchical" was refused by the construction checks
        return ReductionChoice("flat", "shard_optimizer=True reduce-scatters each bucket")
    if mesh is not None:
        hosts, per_host = mesh.size(0), mesh.size(1)
        if mode == "auto" and (hosts < 2 or per_host < 2):
            return ReductionChoice("flat", f"host_mesh has {describe_mesh(mesh)}: the host-aware "
                                           f"schedule sends no fewer bytes over the network")
        return ReductionChoice("hierarchical", f"host_mesh= ({describe_mesh(mesh)})",
                               HostAllReduce(mesh))
    layout = comm.host_layout(pg)
    per_host = layout.ranks_per_host
    if mode == "auto":
        if not layout.spans_hosts:
            return ReductionChoice("flat", f"the group's ranks share one host ({layout.describe()})")
        if per_host is None:
            return ReductionChoice("flat", f"the hosts hold different numbers of the group's ranks "
                                           f"({layout.describe()})")
        if per_host == 1:
            return ReductionChoice("flat", f"one rank per host: nothing to reduce inside a host "
                                           f"({layout.describe()})")
    whole = comm.world_size(pg) == dist.get_world_size()
    refusal = _refusal(layout, whole)
    if refusal and mode == "auto":
        return ReductionChoice("flat", refusal)
    if refusal:
        raise InputError(f"pyfused.{OP}: all_reduce='hierarchical' cannot run: {refusal}")
    mesh = comm.host_mesh()
    return ReductionChoice("hierarchical", f"the group spans {layout.describe()}",
                           HostAllReduce(mesh))


def _refusal(layout, whole_world: bool) -> Optional[str]:
    if layout.ranks_per_host is None:
        return (f"the hosts hold different numbers of the group's ranks ({layout.describe()}); the "
                f"host-aware schedule needs the same number on each")
    if not whole_world:
        return ("the group is a subgroup of the job, whose host groups its members cannot create "
                "alone; pass host_mesh= (a ('host', 'local') DeviceMesh of the group's ranks)")
    return None
