"""The ``moe`` suite: an expert-parallel MoE block and a small Mixtral's training step
(``moe_model_step.py``), each pyfused method against what a torch user writes today
(``moe_reference.py``), in the same run; and the body of the two op suites (``moe_dispatch``,
``moe_combine``: ``op_suite``).

The block, on every rank of the group (expert parallelism over all of them): T tokens of width H,
each routed to k = 2 of E = 4 W experts (E/W per rank), then per expert a SwiGLU MLP (gate|up
[H, 2F], down [F, H]) and the weighted sum back on the token's rank -- forward and backward
(a training step of the block, without the router):

  * pyfused, per method: ``moe_dispatch(x, idx, gate_up)`` -> SwiGLU -> ``moe_combine(h, weights,
    idx, layout, down)``;
  * torch: the counts by ``all_to_all_single``, the tokens by the differentiable
    ``torch.distributed.nn.functional.all_to_all_single`` with split sizes, one SwiGLU MLP per
    local expert (a loop over its rows), the rows back the same way, the weighted sum.

Routing cases: ``uniform`` (each token's two experts uniformly at random), ``hot`` (half of all
choices go to expert 0), ``empty`` (expert 1 gets no token). Per case every variant runs
round-robin (``interleaved_samples``: iteration i of every variant before iteration i+1 of any,
each iteration the slowest rank's time); a row reports the median time, tokens/s (all ranks'
tokens per second) and ``vs_torch``: the median over iterations of torch's time / the method's
time in the same iteration (``paired_speedup``, as the overhead suite does). ``timeline_png``: one decomposed
step of the uniform case, every rank's count exchanges, transfer waits, GEMMs and weighted sums
(``pyfused.ops.moe_exchange.recording``), drawn on rank 0 (skipped, with a note, without
matplotlib).
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from pyfused import comm
from pyfused.bench.harness import BenchContext, interleaved_samples, metadata, op_row, paired_speedup
from pyfused.ops import MethodUnavailable, moe_combine, moe_dispatch
from pyfused.ops.registry import OPS

from . import moe_model_step
from .moe_reference import rows_against_reference, swiglu, torch_user_moe

MULTI_RANK = True
METHODS = ("unfused", "decomposed", "fused", "auto")
TOPK = 2
EXPERTS_PER_RANK = 4
# per rank: (tokens, hidden, ffn); --quick: the first
BLOCK_SHAPES = {"cpu": [(256, 256, 256), (1024, 512, 1024)],
                "cuda": [(4096, 2048, 1024), (16384, 4096, 2048)]}
ROUTINGS = ("uniform", "hot", "empty")
SHAPES_ENV = "PYFUSED_MOE_SHAPES"  # e.g. 1024x1024x256,256x256x256: the block's T x H x F per rank
# the op suites' (tokens, hidden, expert width) per rank
OP_SHAPES = {"cpu": [(256, 256, 256), (1024, 512, 1024)], "cuda": [(4096, 4096, 2048)]}


def _routing(case: str, tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    scores = torch.rand(tokens, experts, generator=gen)
    if case == "hot":  # expert 0 first for half of the tokens: half of all choices
        scores[: tokens // 2, 0] = 2.0
    if case == "empty":
        scores[:, 1] = -1.0
    return scores.topk(TOPK, dim=1).indices


def _pyfused_block(x, idx, gates, gate_up, down, pg, method):
    h, layout = moe_dispatch(x, idx, gate_up, pg, method=method)
    return moe_combine(swiglu(h), gates, idx, layout, down, pg, method=method)


def _step(block: Callable, leaves, grad):
    def run():
        for t in leaves:
            t.grad = None
        block().backward(grad)
    return run


def _block_rows(ctx: BenchContext, shape, case: str, out_dir: Path) -> List[Dict]:
    tokens, hidden, ffn = shape
    world, pg, dev, dt = ctx.world, ctx.group, ctx.device, ctx.dtype
    experts = EXPERTS_PER_RANK * world
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    x = torch.randn(tokens, hidden, generator=gen).to(dev, dt).requires_grad_()
    idx = _routing(case, tokens, experts, gen).to(dev)
    gates = torch.rand(tokens, TOPK, generator=gen).softmax(-1).to(dev, dt).requires_grad_()
    gate_up = (torch.randn(EXPERTS_PER_RANK, hidden, 2 * ffn, generator=gen) * hidden ** -0.5
               ).to(dev, dt).requires_grad_()
    down = (torch.randn(EXPERTS_PER_RANK, ffn, hidden, generator=gen) * ffn ** -0.5
            ).to(dev, dt).requires_grad_()
    grad = torch.randn(tokens, hidden, generator=gen).to(dev, dt)
    leaves = (x, gates, gate_up, down)
    args = (x, idx, gates, gate_up, down, pg)
    fns = {"torch": _step(lambda: torch_user_moe(*args), leaves, grad)}
    reference = torch_user_moe(*args).detach()
    unavailable = {}
    for method in METHODS:
        try:
            out = _pyfused_block(*args, method)
        except MethodUnavailable as e:  # raised on every rank alike
            unavailable[method] = str(e)
            continue
        torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)
        fns[method] = _step(lambda m=method: _pyfused_block(*args, m), leaves, grad)
    samples = interleaved_samples(fns, ctx)
    label = f"{case} T={tokens} H={hidden} F={ffn} E={experts} k={TOPK}"
    return rows_against_reference(ctx, samples, METHODS, unavailable, tokens * world,
                                  shape=label, dtype=dt, transport=ctx.transport,
                                  suite_part="block", routing=case, tokens=tokens, hidden=hidden,
                                  ffn=ffn, experts=experts)


def _timeline(ctx: BenchContext, shape, out_dir: Path) -> Dict:
    """One decomposed step of the uniform block, recorded on every rank and drawn on rank 0."""
    tokens, hidden, ffn = shape
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    dev, dt = ctx.device, ctx.dtype
    x = torch.randn(tokens, hidden, generator=gen).to(dev, dt).requires_grad_()
    idx = _routing("uniform", tokens, EXPERTS_PER_RANK * ctx.world, gen).to(dev)
    gates = torch.rand(tokens, TOPK, generator=gen).softmax(-1).to(dev, dt)
    gate_up = torch.randn(EXPERTS_PER_RANK, hidden, 2 * ffn, generator=gen).to(dev, dt)
    down = torch.randn(EXPERTS_PER_RANK, ffn, hidden, generator=gen).to(dev, dt)
    step = _step(lambda: _pyfused_block(x, idx, gates, gate_up, down, ctx.group, "decomposed"),
                 (x,), torch.ones(tokens, hidden, device=dev, dtype=dt))
    step()
    from pyfused.ops import moe_exchange

    dist.barrier(group=ctx.group)
    with moe_exchange.recording() as events:
        t0 = moe_exchange.now()
        step()
    mine = [(what, start - t0, end - t0) for what, start, end in events]
    every = [None] * ctx.world
    dist.all_gather_object(every, mine, group=ctx.group)
    png = out_dir / f"moe_timeline_w{ctx.world}_T{tokens}.png"
    note = ""
    if ctx.rank == 0:
        note = draw_timeline(every, png, f"pyfused MoE block, decomposed, forward + backward: "
                                         f"{ctx.world} ranks, T={tokens} H={hidden} F={ffn} "
                                         f"({ctx.backend} on {metadata(ctx)['device']})")
    box = [note]
    dist.broadcast_object_list(box, src=comm.global_rank(ctx.group, 0), group=ctx.group)
    return {"timeline_png": "" if box[0] else str(png), "timeline_note": box[0]}


COLORS = {"counts": "#937860", "all_to_all": "#C44E52", "wait": "#C44E52", "gemm": "#4C72B0",
          "sum": "#55A868"}


def draw_timeline(events_by_rank, png: Path, title: str) -> str:
    """One row per rank: GEMMs (blue), weighted sums (green), count exchanges (brown) and time
    blocked on transfers (red). Returns "" or, when it could not be drawn, why."""
    try:
        import matplotlib
    except ImportError:
        return "timeline plot skipped: matplotlib is not installed (pip install matplotlib)"
    try:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = len(events_by_rank)
        fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * n))
        for rank, evs in enumerate(events_by_rank):
            y = n - 1 - rank
            for what, start, end in evs:
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (y - 0.35, 0.7),
                               facecolors=COLORS[what], edgecolor="black", lw=0.2)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
                   (COLORS["gemm"], COLORS["sum"], COLORS["counts"], COLORS["wait"])]
        labels = ["grouped GEMM", "weighted sum", "count exchange", "blocked on transfer"]
        ax.legend(handles, labels, loc="upper right", fontsize=7)
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"rank {n - 1 - i}" for i in range(n)])
        ax.set_xlabel("ms since the step started")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001 - a plot must not fail the suite
        return f"timeline plot skipped: drawing it raised {type(e).__name__}: {e}"
    return ""


def block_shapes(ctx: BenchContext) -> List[tuple]:
    """The block's (tokens, hidden, ffn) points: ``PYFUSED_MOE_SHAPES`` if set, else the device's."""
    spec = os.environ.get(SHAPES_ENV)
    if spec:
        try:
            shapes = [tuple(int(n) for n in item.lower().split("x")) for item in spec.split(",")
                      if item.strip()]
        except ValueError:
            shapes = []
        if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
            raise ValueError(f"{SHAPES_ENV}={spec!r}: expected TxHxF points separated by commas, "
                             f"e.g. 1024x1024x256")
        return shapes
    return BLOCK_SHAPES.get(ctx.device.type, BLOCK_SHAPES["cuda"])[: 1 if ctx.quick else None]


def run(ctx: BenchContext) -> List[Dict]:
    if ctx.world < 2:
        return []  # expert parallelism needs peers; the op suites cover one rank
    out_dir = Path(ctx.options.get("out") or "bench_out")
    comm.agree_on_local_work(ctx.group, "creating the output folder",
                             lambda: out_dir.mkdir(parents=True, exist_ok=True)
                             if ctx.rank == 0 else None)
    shapes = block_shapes(ctx)
    rows: List[Dict] = []
    for shape in shapes:
        for case in ROUTINGS:
            rows += _block_rows(ctx, shape, case, out_dir)
    timeline = _timeline(ctx, shapes[-1], out_dir)
    for row in rows:
        row.update(timeline)
    return rows + moe_model_step.model_rows(ctx, METHODS)


# ---------------------------------------------------------------------------------------------
# The body of the op suites (bench_moe_dispatch.py, bench_moe_combine.py): registry-driven

def op_suite(ctx: BenchContext, op: str) -> List[Dict]:
    """``op`` alone (forward) on its registry hook's inputs, per method and against the op's
    ``plain_torch`` hook, round-robin; ``vs_torch`` paired as in the block rows."""
    spec = OPS[op]
    rows: List[Dict] = []
    for tokens, hidden, width in OP_SHAPES.get(ctx.device.type, OP_SHAPES["cuda"])[
            : 1 if ctx.quick else None]:
        tensors = spec.make_inputs(ctx.world, tokens, hidden, width, ctx.dtype, ctx.device,
                                   seed=0)[ctx.rank]
        fns = {"torch": spec.plain_torch(tensors, ctx.group)}
        unavailable = {}
        for method in METHODS:
            call = (lambda m=method: spec.function(*tensors, group=ctx.group, method=m))
            try:
                call()
            except MethodUnavailable as e:
                unavailable[method] = str(e)
                continue
            fns[method] = call
        samples = interleaved_samples(fns, ctx)
        label = f"T={tokens} H={hidden} N={width}"
        for name in ("torch", *METHODS):
            common = dict(shape=label, dtype=ctx.dtype, transport=ctx.transport, op=op,
                          tokens=tokens)
            if name in unavailable:
                rows.append(op_row(ctx, method=name, ms=None, status="unavailable",
                                   note=unavailable[name], **common))
                continue
            ms = statistics.median(samples[name])
            rows.append(op_row(ctx, method=name, ms=ms,
                               tokens_per_s=tokens * ctx.world / (ms * 1e-3),
                               vs_torch=paired_speedup(samples["torch"], samples[name]), **common))
    return rows
