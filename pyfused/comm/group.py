"""Resolving the ``group=`` argument every pyfused op and layer takes.

``group`` may be
  * ``None``: the default process group, or -- when ``torch.distributed`` is not initialised --
    a single-process "local" group of size 1, so the ops run unchanged on a laptop;
  * a ``ProcessGroup``;
  * a one-dimensional ``DeviceMesh`` (e.g. ``mesh["tp"]``), or a ``(DeviceMesh, dim_name)`` pair;
  * a ``BufferProvider``: one rank of a group whose ranks share this process (the fused methods
    take it where they take a ``ProcessGroup``).

Registered ops cannot take a ``ProcessGroup`` argument, so they take the group's name (as torch's own
functional collectives do); ``LOCAL`` (the empty string) names the local group of size 1.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

LOCAL = ""


class GroupError(ValueError):
    pass


class BufferProvider:
    """One rank of a group whose ranks all live in this process, passed as ``group``: it names
    itself (``group_name``), says its ``rank`` and the group's size (``world``), and provides its
    own symmetric buffers (``symmetric_buffer``), so comm exchanges and synchronizes nothing for
    it. It has no torch.distributed collectives. The one-GPU test bed's virtual ranks
    (pyfused/testing/virtual_ranks.py) are providers."""

    rank: int
    world: int
    group_name: str

    def symmetric_buffer(self, data_bytes: int, device: torch.device):
        """This rank's ``SymmetricBuffer`` of size class ``data_bytes`` on ``device``, whose peers
        are the group's other ranks."""
        raise NotImplementedError


def resolve_group(group: Any = None) -> Optional[dist.ProcessGroup]:
    """Return the ProcessGroup ``group`` names, or None for the single-process local group."""
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None
    # two checks, ProcessGroup first: under torch.compile a group is a fake script object that
    # Dynamo matches against ProcessGroup alone, not inside a tuple of classes
    if isinstance(group, dist.ProcessGroup) or isinstance(group, BufferProvider):
        return group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        DeviceMesh = ()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        return mesh.get_group(dim)
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise GroupError(
                f"a {group.ndim}-D DeviceMesh was passed as group; pass one dimension, "
                f"e.g. mesh['tp'] or (mesh, 'tp') (its dims are {group.mesh_dim_names})"
            )
        return group.get_group()
    raise GroupError(
        f"group must be None, a ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, dim name); "
        f"got {type(group).__name__}"
    )


def group_name(pg: Optional[dist.ProcessGroup]) -> str:
    return LOCAL if pg is None else pg.group_name  # a BufferProvider's too


def group_from_name(name: str) -> Optional[dist.ProcessGroup]:
    if name == LOCAL:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def world_size(pg: Optional[dist.ProcessGroup]) -> int:
    if isinstance(pg, dist.ProcessGroup):  # a member's group: its size, without get_world_size's checks
        return pg.size()
    if isinstance(pg, BufferProvider):
        return pg.world
    return 1 if pg is None else dist.get_world_size(pg)


def rank(pg: Optional[dist.ProcessGroup]) -> int:
    if isinstance(pg, dist.ProcessGroup):  # a member's group: its rank in it, without get_rank's checks
        return pg.rank()
    if isinstance(pg, BufferProvider):
        return pg.rank
    return 0 if pg is None else dist.get_rank(pg)


def global_rank(pg: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The default-group rank of ``group_rank`` in ``pg`` (p2p calls address peers by global rank)."""
    return group_rank if pg is None else dist.get_global_rank(pg, group_rank)


def comm_device(pg: Optional[dist.ProcessGroup]) -> torch.device:
    """The device small control tensors (validation, agreement) must live on for ``pg``'s backend."""
    if pg is None:
        return torch.device("cpu")
    backend = str(dist.get_backend(pg)).lower()
    if "gloo" in backend or "cuda" not in backend and "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
