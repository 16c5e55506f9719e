"""How the bench and tune CLIs get their ranks: torchrun's, or torchrun's machinery started from here.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) every process calls the entry
point itself. Otherwise ``spawn`` starts the ranks through ``torch.distributed.launcher.api
.elastic_launch`` -- the engine behind torchrun, with its c10d rendezvous on a free local port, as
``torchrun --standalone`` does -- and returns rank 0's result. No launcher or socket code of our own.
"""
from __future__ import annotations

import datetime
import os
import uuid
from typing import Any, Callable, Tuple

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: F401 (re-export)


class LaunchError(RuntimeError):
    pass


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_backend(requested: str = "auto") -> str:
    """"nccl" where there are GPUs (unless "gloo" was asked for), else "gloo"."""
    if requested not in ("auto", "gloo", "nccl"):
        raise LaunchError(f"--backend must be auto, gloo or nccl; got {requested!r}")
    has_cuda = torch.cuda.is_available()
    if requested == "nccl" and not has_cuda:
        raise LaunchError("--backend nccl needs CUDA GPUs; none is visible here")
    if requested == "auto":
        return "nccl" if has_cuda else "gloo"
    return requested


def default_world(backend: str) -> int:
    """One rank per GPU with NCCL; 2 gloo ranks on CPU (the smallest group that communicates)."""
    return torch.cuda.device_count() if backend == "nccl" else 2


def check_world(world: int, backend: str) -> None:
    if world < 1:
        raise LaunchError(f"--world must be at least 1; got {world}")


def shares_gpus(backend: str, local_world: int) -> bool:
    """More NCCL ranks on this host than GPUs: ranks share a GPU (docs/TESTBED.md)."""
    return backend == "nccl" and local_world > torch.cuda.device_count()


def spawn(entry: Callable[..., Any], args: Tuple, world: int, name: str) -> Any:
    """Run ``entry(*args)`` on ``world`` local ranks via torchrun's elastic launch; rank 0's result.

    A rank that raises or dies makes this raise ``torch.distributed.elastic.multiprocessing.errors
    .ChildFailedError`` (with the rank's traceback); nothing is restarted."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # torchrun --standalone's rendezvous
        max_restarts=0, start_method="spawn", monitor_interval=0.1,
    )
    return elastic_launch(config, entry)(*args)[0]


def init_rank(backend: str, timeout_s: float) -> Tuple[int, int, torch.device]:
    """Join the default process group from torchrun's environment; (rank, world, device).

    ``timeout_s`` bounds every collective of the default group. On CPU each rank gets an equal share
    of the cores (unless OMP_NUM_THREADS says otherwise): ranks that oversubscribe the cores only
    measure each other's noise."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device_id = None
    if backend == "nccl":
        if shares_gpus(backend, local_world):
            # NCCL refuses two ranks of one host on one GPU; each rank claims a host id of its own
            # and NCCL talks over sockets (docs/TESTBED.md): correct, but a slow transport, and
            # the CLI labels it "nccl-socket" in every row.
            os.environ.setdefault("NCCL_HOSTID", f"pyfused-rank{local_rank}")
            os.environ.setdefault("NCCL_NET", "Socket")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device_id = device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device_id)
    return dist.get_rank(), dist.get_world_size(), device
