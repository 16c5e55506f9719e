"""The one benchmark harness (CONVENTIONS.md #8). Suites in ``benchmarks/bench_<name>.py`` (installed
as ``pyfused.benchmarks``) use only these pieces, so every number is timed, labelled and written the
same way.

Timing of a multi-rank call: every rank runs the same fixed number of iterations (an adaptive count
could differ between ranks and hang a collective); each iteration starts after a barrier, is timed
with CUDA events on GPU or ``perf_counter`` on CPU, and the iteration's time is the slowest rank's.
The reported time is the median over iterations.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist


@dataclass
class BenchContext:
    """What a suite's ``run(ctx)`` gets: where it runs and how hard to try."""

    rank: int
    world: int
    group: Optional[dist.ProcessGroup]
    device: torch.device
    backend: str  # "gloo", "nccl", or "local" (one process, no torch.distributed)
    quick: bool = False  # a short run (CI smoke tests): fewer shapes and iterations
    warmup: int = 3
    iters: int = 10
    options: Dict[str, Any] = field(default_factory=dict)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], ctx: BenchContext, warmup: Optional[int] = None,
            iters: Optional[int] = None) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs; the slowest rank's time per iteration.
    Every rank of ``ctx.group`` must call this with the same counts."""
    warmup = ctx.warmup if warmup is None else warmup
    iters = ctx.iters if iters is None else iters
    for _ in range(warmup):
        fn()
    synchronize(ctx.device)
    times = []
    for _ in range(iters):
        if ctx.world > 1:
            dist.barrier(group=ctx.group)
        if ctx.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if ctx.world > 1:
        t = torch.tensor(times, dtype=torch.float64,
                         device=ctx.device if ctx.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
        times = t.tolist()
    return statistics.median(times)


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def bandwidths(collective: str, nbytes: float, ms: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s as nccl-tests define them (doc/PERFORMANCE.md). ``nbytes`` is the
    size nccl-tests calls S: the full (gathered / unreduced) buffer of one rank."""
    if ms <= 0:
        return float("nan"), float("nan")
    algbw = nbytes / (ms * 1e-3) / 1e9
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "send_recv": 1.0,
    }[collective]
    return algbw, algbw * factor


def git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata(ctx: BenchContext) -> Dict[str, Any]:
    """Columns every row carries: where and when it was measured."""
    if ctx.device.type == "cuda":
        device_name = torch.cuda.get_device_name(ctx.device)
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": device_name,
        "backend": ctx.backend,
        "world": ctx.world,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ctx.backend == "nccl" else "",
        "commit": git_commit(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(rows: List[Dict[str, Any]], out_dir: Path, name: str) -> List[Path]:
    """Write ``rows`` as ``<name>.csv`` and ``<name>.json`` under ``out_dir``; return the paths."""
    import csv

    out_dir.mkdir(parents=True, exist_ok=True)
    columns: List[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    csv_path, json_path = out_dir / f"{name}.csv", out_dir / f"{name}.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps(rows, indent=1, default=str))
    return [csv_path, json_path]
