"""Launch choices of the fused methods, as data (CONVENTIONS.md #6). Every value here is a pure
function of what every rank agrees on (shapes, dtype, world size), so all ranks choose alike.

The numbers are starting points that no GPU has measured yet (docs/PERF.md says how to measure
them); a GPU session replaces them with measured crossovers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ONE_SHOT = 0
TWO_SHOT = 1


@dataclass(frozen=True)
class AllReduceConfig:
    """One-shot (every rank reads all W buffers: W x the bytes, one barrier round) up to
    ``one_shot_max_bytes`` of the reduced tensor, two-shot (reduce-scatter + all-gather through the
    peers' buffers: 2x the bytes, two barrier rounds) above. The crossover falls as W grows, because
    one-shot's reads grow with W."""

    one_shot_max_bytes: int


# By world size; the values follow the shape of the published custom all-reduce crossovers
# (latency-bound below a few hundred KB on NVLink), not a measurement of ours.
ALL_REDUCE_CONFIGS = {
    1: AllReduceConfig(1 << 62),
    2: AllReduceConfig(1 << 20),
    3: AllReduceConfig(512 << 10),
    4: AllReduceConfig(512 << 10),
}
DEFAULT_ALL_REDUCE_CONFIG = AllReduceConfig(256 << 10)  # 5-8 ranks

# SMs the persistent GEMMs of the fused schedules leave free for the one-thread kernels that must run
# beside them on the comm stream: the relay of GEMM + reduce-scatter (wait on a local tile counter,
# signal the owner's flag) and the chunk signals of all-gather + GEMM. A GEMM holding every SM while
# it spins on peers' flags could otherwise starve the signals its peers' GEMMs are waiting for.
RELAY_SMS = 2


def all_reduce_algo(nbytes: int, world: int) -> int:
    cfg = ALL_REDUCE_CONFIGS.get(world, DEFAULT_ALL_REDUCE_CONFIG)
    return ONE_SHOT if nbytes <= cfg.one_shot_max_bytes else TWO_SHOT


def timeout_ms() -> int:
    """How long a device-side wait on a peer may take before the kernel traps (CUDA) or raises
    (CPU models): ``PYFUSED_FUSED_TIMEOUT_MS`` if set (0 waits forever), else the default process
    group's timeout (``init_process_group(timeout=...)``, as for every other wait on a peer), else
    60 s. Capped at 10^9 ms (the kernels count nanoseconds in 64 bits)."""
    env = os.environ.get("PYFUSED_FUSED_TIMEOUT_MS")
    if env is not None:
        return min(int(env), 10**9)
    import torch.distributed as dist

    from ..comm.faults import group_timeout

    timeout = group_timeout(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None
    return min(int(timeout.total_seconds() * 1000), 10**9) if timeout else 60000


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


# The Triton kernels' waits count polls, not time (no clock without inline asm): about how many
# system-scope acquire polls one millisecond holds -- an estimate from the latency of such a load
# (~1 us), not a measurement; the CUDA kernels' waits, which read %globaltimer, are exact.
POLLS_PER_MS = 1000
MAX_SPIN_LIMIT = 2**31 - 1


def spin_limit() -> int:
    """The Triton waits' poll bound matching ``timeout_ms()`` (0, "wait forever", gives the largest
    bound: about half an hour)."""
    ms = timeout_ms()
    return MAX_SPIN_LIMIT if ms <= 0 else max(1, min(MAX_SPIN_LIMIT, ms * POLLS_PER_MS))
