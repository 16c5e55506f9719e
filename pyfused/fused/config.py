"""Launch choices of the fused methods, as data. Every value here is a pure
function of what every rank agrees on (shapes, dtype, world size), so all ranks choose alike.

Where a value was measured, its comment names the run (benchmarks/results/); the others are
starting points that a GPU run of the benchmarks replaces (docs/PERF.md says how).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..comm.faults import group_timeout

ONE_SHOT = 0
TWO_SHOT = 1


@dataclass(frozen=True)
class AllReduceConfig:
    """One-shot (every rank reads all W buffers: W x the bytes, one barrier round) up to
    ``one_shot_max_bytes`` of the reduced tensor, two-shot (reduce-scatter + all-gather through the
    peers' buffers: 2x the bytes, two barrier rounds) above. The crossover falls as W grows, because
    one-shot's reads grow with W."""

    one_shot_max_bytes: int


# By world size: the largest message at which one-shot was measured faster than two-shot, device
# time of the fused all-reduce + residual + RMSNorm with W virtual ranks on one H200
# (benchmarks/results/2026-11-26_NVIDIA-H200_run2/call2/bench_virtual_crossover, sizes 8 KiB,
# 64 KiB, 512 KiB, 2 MiB, 8 MiB, ...): W = 2 and 4 one-shot up to 2 MiB, two-shot from 8 MiB; W = 8
# one-shot up to 512 KiB, two-shot from 2 MiB. W = 3 takes W = 4's value (not measured). The peers'
# buffers were memory of the same GPU: over NVLink one-shot's W-fold reads cost more, so the
# crossover there is lower or equal; the multi-GPU `all_reduce_add_rmsnorm` suite's
# fused.one_shot / fused.two_shot rows measure it.
ALL_REDUCE_CONFIGS = {
    1: AllReduceConfig(1 << 62),
    2: AllReduceConfig(2 << 20),
    3: AllReduceConfig(2 << 20),
    4: AllReduceConfig(2 << 20),
}
DEFAULT_ALL_REDUCE_CONFIG = AllReduceConfig(512 << 10)  # 5-8 ranks

# SMs the persistent GEMMs of the fused schedules leave free for the one-thread kernels that must run
# beside them on the comm stream: the relay of GEMM + reduce-scatter (wait on a local tile counter,
# signal the owner's flag) and the chunk signals of all-gather + GEMM. A GEMM holding every SM while
# it spins on peers' flags could otherwise starve the signals its peers' GEMMs are waiting for.
RELAY_SMS = 2

# Programs the fused kernels of this rank may hold at once, when set (``sm_budget``): with W virtual
# ranks on one GPU (pyfused/testing/virtual_ranks.py) each rank gets about SMs/W, so that every
# rank's spinning kernels are resident together. A context variable, so a rank launched from its own
# thread has its own.
_SM_BUDGET: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("pyfused_sm_budget",
                                                                            default=None)
# CPU tensors run in the Triton interpreter, which runs programs one after another: a few programs
# keep the persistent loops exercised.
INTERPRETER_PROGRAMS = 4


@contextlib.contextmanager
def sm_budget(programs: int) -> Iterator[None]:
    """Cap every fused kernel launched in this context at ``programs`` programs (SMs)."""
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"an SM budget must be a positive int, got {programs!r}")
    token = _SM_BUDGET.set(programs)
    try:
        yield
    finally:
        _SM_BUDGET.reset(token)


def budget_in_force() -> Optional[int]:
    """The ``sm_budget`` of this context, or None."""
    return _SM_BUDGET.get()


def grid_budget(device: torch.device) -> int:
    """The most programs one persistent fused kernel of this rank launches: the ``sm_budget`` in
    force, else the device's SMs less ``RELAY_SMS`` (the one-thread signal and relay kernels that run
    beside a spinning kernel must find an SM), else ``INTERPRETER_PROGRAMS`` on CPU."""
    budget = _SM_BUDGET.get()
    if budget is not None:
        return budget
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, _sm_count(index) - RELAY_SMS)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    """The SMs of cuda:``index``, asked once per device (every fused launch needs them)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def all_reduce_algo(nbytes: int, world: int) -> int:
    cfg = ALL_REDUCE_CONFIGS.get(world, DEFAULT_ALL_REDUCE_CONFIG)
    return ONE_SHOT if nbytes <= cfg.one_shot_max_bytes else TWO_SHOT


# The fused kernels' default wait bound, as a share of the process group's timeout (timeout_ms).
GROUP_TIMEOUT_SHARE = 0.8


def timeout_ms() -> int:
    """How long a device-side wait on a peer may take, in wall-clock time, before the kernel gives
    up: the CUDA kernels trap, the Triton kernels record the flag they waited on (reported as
    ``WaitTimeout``), the CPU models raise. ``PYFUSED_FUSED_TIMEOUT_MS`` if set (0 waits forever),
    else ``GROUP_TIMEOUT_SHARE`` of the default process group's timeout
    (``init_process_group(timeout=...)``): below the group's own, so that a frozen peer is reported
    by the kernel, naming rank, peer and flag, before the group's watchdog ends the job with less to
    say; else 60 s. Capped at 10^9 ms (the kernels count nanoseconds in 64 bits)."""
    env = os.environ.get("PYFUSED_FUSED_TIMEOUT_MS")
    if env is not None:
        return min(int(env), 10**9)
    timeout = group_timeout(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None
    if not timeout:
        return 60000
    return min(int(timeout.total_seconds() * 1000 * GROUP_TIMEOUT_SHARE), 10**9)


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_not_capturing(device: torch.device, what: str) -> None:
    """The fused schedules take their epochs and flag values from the host at launch, so a captured
    graph would replay one epoch forever and its barriers and waits would pass at once on every
    replay (a silent race). Refuse capture instead; the custom ops carry the
    ``cudagraph_unsafe`` tag, so torch.compile's CUDA graphs leave them out by themselves."""
    if capturing(device):
        raise RuntimeError(f"{what}: the fused method cannot be captured in a CUDA graph (its "
                           f"barrier epochs and chunk flags are host values baked into the launch); "
                           f"run it eagerly, or use method='unfused' inside the captured region")
