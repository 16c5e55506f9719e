"""The mesh a ``fully_shard`` unit lives on: FSDP's 1-D mesh, or HSDP's 2-D (replicate, shard) mesh.

HSDP (hybrid sharding) reads a 2-D mesh as torch FSDP2 does: dim 0 replicates, dim 1 shards. Every
parameter is cut along dim 0 over the shard dim's group (group.py's layout), so the S ranks of one
shard group hold one copy of the model between them and the R shard groups along the replicate dim
hold R identical copies. Parameters are gathered within the shard group; gradients are
reduce-scattered within it, and each rank's shard of the gradient is then all-reduced across its
replicate group, averaged over all R x S ranks. The shards are ``DTensor``s placed
``(Replicate(), Shard(0))`` on the 2-D mesh, as FSDP2 places them, so ``full_tensor()``, DCP and
``get_model_state_dict`` read them as they read FSDP's.

Where the mesh meets the hosts: a shard group gathers a unit's parameters for every forward and
backward, a replicate group all-reduces one shard of the gradients per step, so the shard dim
belongs inside a host and the replicate dim across hosts (``pyfused.comm.host_mesh()`` is such a
mesh: ("host", "local") = (replicate, shard)). A mesh laid the other way round -- its shard groups
span hosts while each replicate group stays inside one host -- trains correctly, only slower, so it
is not refused: every rank logs the same warning naming the hosts (``host_warning``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from .. import comm
from .._logging import logger
from ..comm import InputError

# words in a dim's name that say which role the user meant it for (torchtitan's "dp_replicate" and
# "dp_shard", FSDP2's ("replicate", "shard")); a 2-D mesh naming its dims the other way round was
# built for a reader that takes (shard, replicate), which neither torch nor pyfused is
SHARD_WORD, REPLICATE_WORD = "shard", "replicate"


@dataclass(frozen=True)
class ShardMesh:
    """A unit's mesh and its process groups. ``replicate_pg`` is None for a 1-D (FSDP) mesh."""

    mesh: object               # the DeviceMesh the shards' DTensors live on
    shard_pg: object
    shards: int                # S: ranks a parameter is cut over
    shard_rank: int
    replicate_pg: Optional[object]
    replicas: int              # R: copies of the sharded model (1 for FSDP)
    placements: Tuple          # the shards' DTensor placements

    @property
    def groups(self) -> List[object]:
        """The groups whose successive all-gathers reach every rank of the mesh, shard dim first."""
        return [self.shard_pg] + ([self.replicate_pg] if self.replicate_pg is not None else [])

    @property
    def ranks(self) -> List[int]:
        """The global ranks of the mesh in row-major order (replicate index, then shard index):
        the order of ``groups``' successive all-gathers."""
        return self.mesh.mesh.flatten().tolist()

    def describe(self) -> str:
        if self.replicate_pg is None:
            return f"1-D mesh of {self.shards} rank{'s' if self.shards > 1 else ''}"
        return f"{self.replicas} replicas x {self.shards} shards"


def _layout_problem(names: Tuple[str, ...]) -> Optional[str]:
    """Why a 2-D mesh's dim names contradict (replicate, shard), or None."""
    first, second = (n.lower() for n in names)
    if SHARD_WORD in first and REPLICATE_WORD not in first or \
            REPLICATE_WORD in second and SHARD_WORD not in second:
        return (f"the 2-D mesh's dims are named {names}, but fully_shard reads a 2-D mesh as "
                f"(replicate, shard), as torch's does: build it with the replicate dim first, e.g. "
                f"init_device_mesh(device, (R, S), mesh_dim_names=('dp_replicate', 'dp_shard'))")
    return None


def resolve(mesh, device: torch.device) -> ShardMesh:
    """``mesh`` (None: the default group) as a ``ShardMesh``; a mesh that is neither 1-D nor a 2-D
    (replicate, shard) mesh raises ``InputError``, before any collective (every rank passing the
    same mesh raises the same)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("pyfused.fully_shard needs torch.distributed initialised (torchrun, "
                               "or init_process_group) or a DeviceMesh")
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        got = f"a {mesh.ndim}-D DeviceMesh" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise InputError(f"pyfused.fully_shard: mesh must be None, a 1-D DeviceMesh (FSDP: the "
                         f"data-parallel dim, e.g. mesh['dp']) or a 2-D DeviceMesh (HSDP: "
                         f"(replicate, shard) dims, e.g. mesh['dp_replicate', 'dp_shard']); got {got}")
    if mesh.ndim == 1:
        pg = mesh.get_group()
        return ShardMesh(mesh, pg, comm.world_size(pg), comm.rank(pg), None, 1, (Shard(0),))
    problem = _layout_problem(tuple(mesh.mesh_dim_names)) if mesh.mesh_dim_names else None
    if problem is not None:
        raise InputError(f"pyfused.fully_shard: {problem}")
    shard_pg, replicate_pg = mesh.get_group(1), mesh.get_group(0)
    return ShardMesh(mesh, shard_pg, mesh.size(1), mesh.get_local_rank(1), replicate_pg,
                     mesh.size(0), (Replicate(), Shard(0)))


_warned = set()


def _on_hosts(pg, layout) -> str:
    """``'a' (ranks 0, 1), 'b' (rank 2)``: the group's hosts with the global ranks on each."""
    ranks = dist.get_process_group_ranks(pg)
    parts = []
    for host in layout.names:
        mine = [str(ranks[i]) for i in layout.ranks_of(host)]
        parts.append(f"{host!r} (rank{'s' if len(mine) > 1 else ''} {', '.join(mine)})")
    return ", ".join(parts)


def host_warning(sm: ShardMesh) -> Optional[str]:
    """The warning for an HSDP mesh whose shard groups span hosts while its replicate groups stay
    inside one (module docstring), logged on every rank, once per mesh; None for any other mesh.
    The first call per group gathers the host names over it (``pyfused.comm.host_layout``), so
    every rank of the mesh must call it; the verdict comes from the gathered names, the same
    everywhere."""
    if sm.replicate_pg is None or sm.replicas == 1 or sm.shards == 1:
        return None
    shard_hosts = comm.host_layout(sm.shard_pg)
    replicate_hosts = comm.host_layout(sm.replicate_pg)
    if not shard_hosts.spans_hosts or replicate_hosts.spans_hosts:
        return None
    message = (f"pyfused.fully_shard: this HSDP mesh ({sm.describe()}) shards across hosts "
               f"(this rank's shard group: {_on_hosts(sm.shard_pg, shard_hosts)}) and "
               f"replicates inside one (its replicate group: "
               f"{_on_hosts(sm.replicate_pg, replicate_hosts)}): every forward and backward "
               f"gathers parameters over the network, where the replicate dim would all-reduce "
               f"one shard of the gradients per step. Training is correct, only slower; put the "
               f"replicate dim across hosts, e.g. mesh=pyfused.comm.host_mesh()")
    key = (comm.group_name(sm.shard_pg), comm.group_name(sm.replicate_pg))
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)
    return message
