"""Which ranks share a host: a group's layout over hosts, and a DeviceMesh ("host", "local").

A *host* is what ranks can share memory on (symmetric memory, GPU peer access, shared memory);
ranks on different hosts talk over the network, which is slower. This process names its host
with ``local_host()``, without a collective:

  * ``PYFUSED_HOST`` when set: an explicit name (containers whose hostnames collide, or a test
    that splits one machine into pretend hosts);
  * otherwise the hostname, followed by torchrun's node rank (``GROUP_RANK``) when torchrun
    launched the process: each torchrun agent is one node, and network namespaces on one machine
    share a hostname while being different hosts to the network. Two torchrun agents started on
    one machine therefore count as two hosts (the safe side: nothing is shared between them).

``host_layout(group)`` gathers every rank's name, node rank and ``LOCAL_WORLD_SIZE`` once per
group (one ``agree_on`` at first use, cached by group name), checks that they are
consistent, and returns the same ``HostLayout`` on every rank; so a group built by the user (any
subset of ranks, any order) gets its layout like the default group does. ``host_mesh()`` turns the
default group's layout into a 2-D ``DeviceMesh`` with dims ("host", "local"): ``mesh["local"]``
holds the ranks of this rank's host, ``mesh["host"]`` the ranks with this rank's local index on
every host.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from .agreement import agree_on
from .faults import inherit_default_timeout
from .group import BufferProvider, group_name, resolve_group, world_size

HOST_ENV = "PYFUSED_HOST"
MESH_DIMS = ("host", "local")


class TopologyError(ValueError):
    """The ranks' host records do not fit together, or a host mesh cannot be made; raised with the
    same message on every rank of the group."""


def local_host() -> str:
    """This process's host name (module docstring); no collective."""
    explicit = os.environ.get(HOST_ENV, "").strip()
    if explicit:
        return explicit
    node = os.environ.get("GROUP_RANK", "").strip()
    host = socket.gethostname()
    return f"{host}/node{node}" if node else host


@dataclass(frozen=True)
class HostRecord:
    """What one rank says about where it runs (gathered once per group)."""

    host: str
    local_world_size: int  # torchrun's LOCAL_WORLD_SIZE, -1 where unknown

    @staticmethod
    def mine() -> "HostRecord":
        lws = os.environ.get("LOCAL_WORLD_SIZE", "")
        return HostRecord(local_host(), int(lws) if lws.isdigit() else -1)


@dataclass(frozen=True)
class HostLayout:
    """The hosts of a group's ranks, in group-rank order (the same object on every rank)."""

    hosts: Tuple[str, ...]  # group rank -> its host's name

    @property
    def names(self) -> Tuple[str, ...]:
        """The distinct hosts, in the order of their lowest rank."""
        return tuple(dict.fromkeys(self.hosts))

    def ranks_of(self, host: str) -> Tuple[int, ...]:
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    @property
    def spans_hosts(self) -> bool:
        return len(self.names) > 1

    @property
    def ranks_per_host(self) -> Optional[int]:
        """The number of ranks on each host, or None when hosts hold different numbers."""
        counts = {len(self.ranks_of(h)) for h in self.names}
        return counts.pop() if len(counts) == 1 else None

    def describe(self) -> str:
        """E.g. ``2 hosts: 'a' (ranks 0, 1), 'b' (ranks 2, 3)``."""
        parts = [f"{h!r} (rank{'s' if len(self.ranks_of(h)) > 1 else ''} "
                 f"{', '.join(map(str, self.ranks_of(h)))})" for h in self.names]
        n = len(self.names)
        return f"{n} host{'s' if n > 1 else ''}: {', '.join(parts)}"


def check_records(records: List[HostRecord], whole_world: bool) -> Optional[str]:
    """Why these records cannot be one layout, or None; a pure function of its arguments, so every
    rank reaches the same verdict. ``whole_world``: the group holds every rank of the job, so each
    host must hold exactly its ``LOCAL_WORLD_SIZE`` ranks."""
    by_host: Dict[str, List[int]] = {}
    for r, rec in enumerate(records):
        by_host.setdefault(rec.host, []).append(r)
    for host, ranks in by_host.items():
        sizes = sorted({records[r].local_world_size for r in ranks})
        if len(sizes) > 1:
            return (f"the ranks on host {host!r} (ranks {ranks}) report different LOCAL_WORLD_SIZE "
                    f"values {sizes}")
        size = sizes[0]
        if size > 0 and (len(ranks) > size or whole_world and len(ranks) != size):
            return (f"host {host!r} holds {len(ranks)} of the group's ranks ({ranks}) but its ranks "
                    f"report LOCAL_WORLD_SIZE={size}: two nodes share a host name (set "
                    f"{HOST_ENV} to tell them apart) or the environment is not torchrun's")
    return None


_layouts: Dict[Tuple[str, str], HostLayout] = {}


def host_layout(group=None) -> HostLayout:
    """The layout of ``group`` over hosts. Collective over ``group`` the first time (every rank of
    it must call), then cached; one rank, or ranks of one process, need no collective."""
    pg = resolve_group(group)
    mine = HostRecord.mine()
    if pg is None or isinstance(pg, BufferProvider) or world_size(pg) == 1:
        return HostLayout((mine.host,) * world_size(pg))
    key = (group_name(pg), mine.host)
    layout = _layouts.get(key)
    if layout is None:
        records = agree_on(pg, "host_layout", mine, detail="gathering the ranks' host names")
        whole = dist.is_initialized() and world_size(pg) == dist.get_world_size()
        why = check_records(records, whole)
        if why:
            raise TopologyError(f"pyfused.comm.host_layout: {why}")
        layout = _layouts[key] = HostLayout(tuple(r.host for r in records))
    return layout


def forget_layouts() -> None:
    """Forget every cached layout and host mesh (after ``PYFUSED_HOST`` changed; every rank)."""
    _layouts.clear()
    _meshes.clear()


_meshes: Dict[HostLayout, object] = {}


def host_mesh():
    """A ``DeviceMesh`` of the default group with dims ("host", "local"): row h holds the ranks of
    host h (hosts in the order of their lowest rank), column l the l-th rank of every host.
    Collective over the default group, like ``init_device_mesh``: every rank calls it (the first
    call gathers the layout and creates the mesh's groups; later calls return the same mesh).
    Raises ``TopologyError`` (every rank alike) when hosts hold different numbers of ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_initialized()):
        raise TopologyError("pyfused.comm.host_mesh needs torch.distributed to be initialised")
    layout = host_layout(None)
    mesh = _meshes.get(layout)
    if mesh is None:
        per_host = layout.ranks_per_host
        if per_host is None:
            raise TopologyError(f"pyfused.comm.host_mesh: the hosts hold different numbers of ranks "
                                f"({layout.describe()}); a 2-D mesh needs the same number on each")
        rows = [list(layout.ranks_of(h)) for h in layout.names]
        backend = str(dist.get_backend()).lower()
        device_type = "cuda" if "nccl" in backend or "cuda" in backend else "cpu"
        mesh = _meshes[layout] = DeviceMesh(device_type, rows, mesh_dim_names=MESH_DIMS)
        inherit_default_timeout([mesh.get_group(d) for d in MESH_DIMS])
    return mesh


def describe_mesh(mesh) -> str:
    """``2 hosts x 2 ranks`` for a ("host", "local") mesh."""
    return f"{mesh.size(0)} host{'s' if mesh.size(0) > 1 else ''} x {mesh.size(1)} rank" + \
        ("s" if mesh.size(1) > 1 else "")
