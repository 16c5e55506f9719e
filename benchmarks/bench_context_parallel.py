"""Context-parallel attention: ``pyfused.ops.ring_attention`` at cp = the suite's world size, each
method, against single-device attention and torch's ``context_parallel`` where it runs, in one run.

Work: causal attention forward + backward of one sequence, B = 1, Hq = 8 query heads, Hkv = 2
key/value heads (grouped-query, as Llama 3), head dim 64, in the suite's dtype (fp32 on CPU); the
sequence in the zigzag layout, one rank's rows per rank.

Rows (``method``):
  single device   torch's ``scaled_dot_product_attention`` (``enable_gqa``) on the whole sequence on
                  each rank: the work one device would do (the baseline of ``speedup`` and of
                  ``mem_ratio``)
  ring, allgather, ulysses   ``ring_attention`` with that method on this rank's rows
  torch context_parallel     ``torch.distributed.tensor.experimental.context_parallel`` on the same
                  rows, or its status when it cannot run here (it needs CUDA flash or efficient
                  attention kernels)
Columns: ``time_ms`` the median fwd+bwd (slowest rank per iteration); ``tokens_per_s`` = global
sequence length / time; ``peak_MB`` the peak of live tensor bytes on this rank during one fwd+bwd
(``torch.distributed._tools.mem_tracker.MemTracker``: this rank's q, k, v, and the activations,
gradients and buffers made during the step);
``mem_ratio`` = peak_MB / single device's peak_MB (goal <= 1/cp + 0.1); ``speedup`` = single
device's time / this row's (goal for ring: >= 1.0 x torch's context_parallel where that runs).
Rank 0 draws ``context_parallel_memory.png`` (peak MB per rank against sequence length).

Sequence lengths: 1k-8k by default, 1k-2k with ``--quick``; the environment variable
``PYFUSED_CP_LENGTHS=1024,32768`` sets them (32k takes minutes per iteration on a CPU core).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pyfused.bench.harness import BenchContext, op_row, time_interleaved
from pyfused.ops.ring_attention import ring_attention
from pyfused.ops.sequence_shards import shard_sequence

MULTI_RANK = True
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
LENGTHS, QUICK_LENGTHS = (1024, 2048, 4096, 8192), (1024, 2048)
METHODS = ("ring", "allgather", "ulysses")
PLOT = "context_parallel_memory.png"
MB = 1024 * 1024


LENGTHS_ENV = "PYFUSED_CP_LENGTHS"


def lengths(ctx: BenchContext) -> List[int]:
    spec = os.environ.get(LENGTHS_ENV)
    if spec:
        return [int(s) for s in spec.split(",") if s.strip()]
    return list(QUICK_LENGTHS if ctx.quick else LENGTHS)


def _inputs(length: int, ctx: BenchContext):
    g = torch.Generator().manual_seed(length)
    dt = ctx.dtype
    q = torch.randn(1, HEADS, length, HEAD_DIM, generator=g).to(ctx.device, dt)
    k, v = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=g).to(ctx.device, dt)
            for _ in range(2))
    return q, k, v


def _fwd_bwd(attention: Callable, tensors) -> Callable[[], None]:
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def step():
        out = attention(*leaves)
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None
    step.inputs = leaves
    return step


def peak_bytes(step: Callable[[], None]) -> int:
    """Peak live tensor bytes during ``step()`` on this rank, its inputs (``step.inputs``: q, k, v
    of this rank) included, or -1 where MemTracker is missing. MemTracker counts a tensor made
    before it started only when told (``track_external``); otherwise the first view of it inside
    the step (a slice of q's rows) would count its storage as new."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # pragma: no cover - older torch
        return -1
    tracker = MemTracker()
    tracker.track_external(*getattr(step, "inputs", ()))
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")
    return max(v.get("Total", 0) for v in snap.values())


def _torch_context_parallel(q, k, v, ctx: BenchContext) -> Optional[Callable[[], None]]:
    """torch's context_parallel on the whole q, k, v (it shards them along the sequence itself),
    or raises why it cannot run here (on CPU: DTensor has no sharding rule for the CPU flash
    kernel)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    buffers = [t.detach().clone() for t in (q, k, v)]

    def step():
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            leaves = [t.detach().requires_grad_() for t in buffers]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
    step()  # fails here where torch's ring cannot run (an error, the same on every rank)
    return step


def _agree(ok: bool, ctx: BenchContext) -> bool:
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def run(ctx: BenchContext) -> List[Dict]:
    rows: List[Dict] = []
    for length in lengths(ctx):
        rows += _rows_at(length, ctx)
    if ctx.rank == 0:
        out = Path(ctx.options.get("out") or "bench_out")
        note = draw(rows, out / PLOT)
        for row in rows:
            row["plot"] = note or str(out / PLOT)
    return rows


def _steps(length: int, ctx: BenchContext):
    """(whole q, k, v; fwd + bwd of single-device attention and of each method on this rank)."""
    whole = _inputs(length, ctx)
    local = [shard_sequence(t, 2, ctx.rank, ctx.world) for t in whole]
    steps: Dict[str, Callable[[], None]] = {
        "single device": _fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), whole)}
    for method in METHODS:
        steps[method] = _fwd_bwd(lambda q, k, v, m=method: ring_attention(
            q, k, v, ctx.group, method=m), local)
    return whole, steps


def peaks_at(length: int, ctx: BenchContext) -> Dict[str, float]:
    """Peak bytes per rank of single-device attention and of each method at ``length``."""
    return {name: peak_bytes(step) for name, step in _steps(length, ctx)[1].items()}


def _rows_at(length: int, ctx: BenchContext) -> List[Dict]:
    cp = ctx.world
    whole, steps = _steps(length, ctx)
    torch_status = "ok"
    try:
        torch_step = _torch_context_parallel(*whole, ctx)
    except Exception as e:  # noqa: BLE001 - reported as the row's status
        torch_step, torch_status = None, f"unavailable: {type(e).__name__}: {str(e)[:200]}"
    if _agree(torch_step is not None, ctx) and torch_step is not None:
        steps["torch context_parallel"] = torch_step
    elif torch_status == "ok":
        torch_status = "unavailable on some rank"
    peaks = {name: peak_bytes(step) / MB for name, step in steps.items()}
    times = time_interleaved(steps, ctx)
    shape = f"S={length} H={HEADS}/{KV_HEADS} D={HEAD_DIM}"
    rows = []
    for name in (*steps, *(() if "torch context_parallel" in steps else ("torch context_parallel",))):
        ms = times.get(name)
        rows.append(op_row(
            ctx, shape=shape, dtype=ctx.dtype, method=name, ms=ms,
            transport="none" if name == "single device" else ctx.transport,
            t_baseline=times["single device"], status="ok" if ms else torch_status,
            seq_len=length, cp=cp, tokens_per_s=length / ms * 1e3 if ms else float("nan"),
            peak_MB=peaks.get(name, float("nan")),
            mem_ratio=(peaks[name] / peaks["single device"] if name in peaks else float("nan"))))
    return rows


def draw(rows: List[Dict], png: Path) -> str:
    """Peak MB per rank against sequence length, one line per method; "" or why nothing was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    by_method: Dict[str, Dict[int, float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r["peak_MB"] == r["peak_MB"] and r["peak_MB"] > 0:
            by_method.setdefault(r["method"], {})[r["seq_len"]] = r["peak_MB"]
    png.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, points in sorted(by_method.items()):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global sequence length (tokens)")
    ax.set_ylabel("peak tensor MB per rank (fwd + bwd)")
    ax.set_title(f"causal attention, cp = {rows[0]['cp'] if rows else '?'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return ""
