"""Pipeline schedules: step time and bubble, pyfused vs torch.distributed.pipelining.

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank, and the split-backward
ones: ZB-H1, interleaved zero bubble and ZBV with 2 stages per rank, DualPipeV) the same model,
split the same way (an even split of identical blocks, so the theory's equal-stage assumption
holds), runs with the same microbatch count m = 4p under both implementations in the same process
group. torch has no ZB-H1 class; its row runs torch's ``ScheduleInterleavedZeroBubble`` with one
stage per rank (its ZB1P order), named in ``torch_schedule``. The split-backward schedules run
twice in pyfused: ``pyfused`` with the fixed orders (built for F = B = W) and ``pyfused-measured``
with ``costs="measure"``: its first (untimed) step measures every stage's F, B and W, and the
orders of the timed steps are built from those times (pipeline/cost_orders.py).
Rows carry, per implementation (``method``: torch | pyfused | pyfused-measured; ``shape``:
schedule, p, v, m):
  * ``time_ms``: median step time (harness.time_fn: barrier, every rank, slowest rank per iteration);
  * ``speedup``: torch time / this time; ``vs_torch`` (pyfused rows): pyfused / torch (goal <= 1.0);
  * ``speedup_paired``: the median over rounds of torch's step time / this step time, the two
    measured in the same round (> 1: faster than torch), the estimate least moved by load drift;
    ``speedup_paired_lo`` / ``speedup_paired_hi``: its 95% interval (harness.median_interval);
  * ``bubble_theory``: (p-1) / (v*m + p-1) for the unsplit schedules; for the split ones the
    idle fraction of pyfused's order replayed on the unit-time model (F = B = W), which for ZB-H1
    is the paper's (p-1) / (3m + p-1) (pipeline/zero_bubble.py);
  * ``bubble_step``: 1 - compute_only_ms / step_ms, where ``compute_only_ms`` is the step's compute
    with no pipeline at all (m forward+backward passes of each rank's stages, slowest rank), each
    backward run as the row's implementation runs it: plain autograd for torch, with pyfused's
    gradient-accumulation fusion (pipeline/weight_accumulation.py) for pyfused -- so this is each
    implementation's idle fraction including every transfer and scheduling overhead, and the
    difference of the two compute times is what the fusion saves;
  * ``bubble_timeline`` (pyfused only): median over the timed steps of 1 - compute / step span
    (from recorded events, averaged over ranks), and ``timeline_png``: the step of median length
    drawn (compute and transfers per rank; B and W in separate colours), above the same order
    replayed with the measured costs; without matplotlib (or when drawing fails) the plot is
    skipped, ``timeline_png`` is empty and ``note`` says why;
  * ``bubble_predicted`` (pyfused split-backward rows): the idle fraction of the row's order
    replayed with the measured F, B, W times (the same average over ranks as ``bubble_timeline``),
    and ``stage_costs_ms``: those times, F/B/W per stage.
The candidates (torch step, pyfused steps, both compute-only passes) alternate iteration by
iteration, each timed by harness.time_fn, so a load change on a shared machine hits all alike.

Run with the bench CLI (``python -m pyfused.bench``) or alone:
``torchrun --nproc_per_node 2 benchmarks/bench_pipeline.py [--quick] [--out bench_out]``.
"""
from __future__ import annotations

import copy
import statistics
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

from pyfused import comm, pipeline as pf
from pyfused._logging import logger
from pyfused.bench.harness import BenchContext, metadata, paired_interval, paired_speedup, time_fn
from pyfused.pipeline import bubble_theory, even_starts, layer_units, split, timeline, weight_accumulation
from pyfused.pipeline.cost_orders import cost_of
from pyfused.pipeline.plan import SPLIT_BACKWARD, V_SHAPED, local_stages, rank_order, stage_rank
from pyfused.pipeline.zero_bubble import bubble_of, replay, unit_bubble

MULTI_RANK = True

# Timed steps per candidate outside --quick (at least --iters). Steps move by +-10% from round to
# round on a 2-core CPU box; the paired ratio's median moved by up to 12% between runs of 20
# rounds, and its error falls as one over the root of the count.
ROUNDS = 40

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbh1", 1),
             ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)]
# schedule -> (pyfused class, torch class name, single stage per rank)
CLASSES = {
    "gpipe": ("ScheduleGPipe", "ScheduleGPipe", True),
    "1f1b": ("Schedule1F1B", "Schedule1F1B", True),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", False),
    "zbh1": ("ScheduleZBH1", "ScheduleInterleavedZeroBubble", True),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "ScheduleInterleavedZeroBubble", False),
    "zbv": ("ScheduleZBVZeroBubble", "ScheduleZBVZeroBubble", False),
    "dualpipev": ("ScheduleDualPipeV", "ScheduleDualPipeV", False),
}


def build_model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.GELU()))
    return nn.Sequential(*layers)


def _make(module, index, kind, mods, stage_ids, n_stages, m, device, pg, **extra):
    stages = [module.PipelineStage(mods[s], s, n_stages, device, group=pg) for s in stage_ids]
    cls = getattr(module, CLASSES[kind][index])
    single = CLASSES[kind][2] and not (index == 1 and kind == "zbh1")
    return cls(stages[0] if single else stages, m, nn.MSELoss(), **extra)


def _ours(*args):
    return _make(pf, 0, *args)


def _ours_measured(*args):
    return _make(pf, 0, *args, costs="measure")


def _torch(*args):
    from torch.distributed import pipelining as tp

    return _make(tp, 1, *args)


def _theory(kind: str, p: int, v: int, m: int) -> float:
    if kind not in SPLIT_BACKWARD:
        return bubble_theory(p, m, v)
    orders = {r: rank_order(kind, r, p, v, m, True) for r in range(p)}
    return unit_bubble(orders, p, p * v, kind in V_SHAPED, True)


def _compute_only(mods, stage_ids, x_mb, m: int, fused: bool):
    """A step's compute on this rank without the pipeline: m forward+backward passes of each of
    the rank's stages on a microbatch, no transfers, no scheduling; ``fused``: each backward with
    gradient-accumulation fusion, as pyfused's stages run it."""
    backward = weight_accumulation.backward if fused else torch.autograd.backward
    inputs = {}
    for s in stage_ids:
        h = x_mb
        for mod in mods[:s]:
            h = mod(h)
        inputs[s] = h.detach().requires_grad_(s > 0)

    def run_once():
        for s in stage_ids:
            for _ in range(m):
                out = mods[s](inputs[s])
                backward([out], [torch.ones_like(out)])
        for s in stage_ids:
            for prm in mods[s].parameters():
                prm.grad = None

    return run_once


def _predicted(kind: str, orders, p: int, v: int, costs):
    """Every action's (start, end) ms when ``orders`` run with ``costs``, and the bubble."""
    times = replay(orders, p, p * v, kind in V_SHAPED, cost_of(costs))
    return times, bubble_of(orders, times)


def _stepper(sched, mods, args, target, recorders=None):
    def one_step():
        for mod in mods:
            for prm in mod.parameters():
                prm.grad = None
        if recorders is not None:
            sched.timeline = timeline.Recorder()
        sched.step(*args, target=target)
        if recorders is not None:
            recorders.append(sched.timeline)
            sched.timeline = None

    return one_step


def draw_timeline(events, png: Path, title: str, predicted=None, predicted_title: str = "") -> str:
    """Draw one step's timeline; return "" or, when it could not be drawn, a note saying why. The
    picture is an optional extra: without matplotlib, or if drawing fails, the suite goes on."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        note = "timeline plot skipped: matplotlib is not installed (pip install matplotlib)"
    else:
        try:
            timeline.draw(events, png, title, predicted, predicted_title)
            return ""
        except Exception as e:  # noqa: BLE001 - a picture never fails the measurements
            note = f"timeline plot skipped: drawing it raised {type(e).__name__}: {e}"
    logger.warning("bench pipeline: %s", note)
    return note


def _pyfused_columns(ctx, kind, p, v, m, impl, sched, recorders, costs, out_dir: Path) -> Dict:
    """bubble_timeline, bubble_predicted, stage_costs_ms and the PNG of one pyfused variant."""
    events = [timeline.gather(r, ctx.group) for r in recorders]
    bubbles = [timeline.bubble(e) for e in events]
    median_step = sorted(range(len(events)), key=lambda i: timeline.span(events[i]))[len(events) // 2]
    predicted, predicted_title, cols = None, "", {}
    if costs is not None:
        times, bubble = _predicted(kind, sched.orders, p, v, costs)
        cols = {"bubble_predicted": bubble,
                "stage_costs_ms": "; ".join("/".join(f"{t:.3f}" for t in c) for c in costs)}
        predicted = timeline.planned(times, lambda s: stage_rank(s, p, kind in V_SHAPED), p)
        predicted_title = (f"predicted: this order replayed with the measured F/B/W ms per stage "
                           f"({cols['stage_costs_ms']}), bubble {bubble:.3f}")
    suffix = "_measured" if impl == "pyfused-measured" else ""
    png = out_dir / f"pipeline_timeline_{kind}{suffix}_p{p}_m{m}.png"
    note = ""
    if ctx.rank == 0:
        note = draw_timeline(events[median_step], png,
                             f"{impl} {kind}: {p} ranks x {v} stages, {m} microbatches, "
                             f"{ctx.backend} on {metadata(ctx)['device']} (measured: the step of "
                             f"median length, bubble {bubbles[median_step]:.3f})",
                             predicted, predicted_title)
    return {**cols, "bubble_timeline": statistics.median(bubbles),
            "timeline_png": "" if note else str(png), "note": note}


def run(ctx: BenchContext) -> List[Dict]:
    p, rank = ctx.world, ctx.rank
    width, blocks, rows = (256, 8, 8) if ctx.quick else (1024, 8, 32)
    iters = 4 if ctx.quick else max(ctx.iters, ROUNDS)
    m = 4 * p
    out_dir = Path(ctx.options.get("out") or ctx.options.get("output_dir") or "bench_out")
    # local work that can fail on rank 0 alone: every rank learns of it at once, not at a timeout
    comm.agree_on_local_work(ctx.group, "creating the output folder",
                             lambda: out_dir.mkdir(parents=True, exist_ok=True) if rank == 0 else None)
    model = build_model(width, blocks)
    rows_out: List[Dict] = []
    for kind, v in SCHEDULES:
        n_stages = p * v
        if blocks < n_stages:
            continue
        starts = even_starts(len(layer_units(model)), n_stages)
        stage_ids = sorted(local_stages(rank, p, v, kind in V_SHAPED))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(m * rows, width, generator=g).to(ctx.device)
        y = torch.randn(m * rows, width, generator=g).to(ctx.device)
        args = (x,) if 0 in stage_ids else ()
        target = y if n_stages - 1 in stage_ids else None
        split_kind = kind in SPLIT_BACKWARD
        impls = [("torch", _torch), ("pyfused", _ours)]
        if split_kind:
            impls.append(("pyfused-measured", _ours_measured))
        recorders: Dict[str, List] = {impl: [] for impl, _ in impls if impl != "torch"}
        fns, scheds = {}, {}
        for impl, make in impls:
            mods = [m_.to(ctx.device) for m_ in
                    split(copy.deepcopy(model), n_stages, split_points=starts).stages]
            scheds[impl] = make(kind, mods, stage_ids, n_stages, m, ctx.device, ctx.group)
            fns[impl] = _stepper(scheds[impl], mods, args, target, recorders.get(impl))
        if split_kind:  # the measuring step, untimed: the timed steps run the measured orders
            fns["pyfused-measured"]()
        for name, fused in (("compute", False), ("compute-fused", True)):
            compute_mods = [m_.to(ctx.device) for m_ in split(copy.deepcopy(model), n_stages,
                                                              split_points=starts).stages]
            fns[name] = _compute_only(compute_mods, stage_ids, x[:rows], m, fused)
        # Interleave the candidates iteration by iteration (each call: barrier, run, slowest
        # rank), so that load changes on a shared machine hit all of them alike.
        times = {k: [] for k in fns}
        for it in range(ctx.warmup + iters):
            for k in (list(fns) if it % 2 else list(fns)[::-1]):
                t = time_fn(fns[k], ctx, warmup=0, iters=1)
                if it >= ctx.warmup:
                    times[k].append(t)
        med = {k: statistics.median(v_) for k, v_ in times.items()}
        costs = scheds["pyfused-measured"].stage_costs if split_kind else None
        for impl, _ in impls:
            compute = "compute" if impl == "torch" else "compute-fused"
            lo, hi = paired_interval(times["torch"], times[impl])
            # time_ms / method / shape / speedup are the CLI table's own columns (pyfused/bench/table.py)
            row = {**metadata(ctx), "suite": "pipeline", "shape": f"{kind} p{p} v{v} m{m}",
                   "dtype": "float32", "method": impl, "time_ms": med[impl],
                   "speedup": med["torch"] / med[impl],
                   "speedup_paired": paired_speedup(times["torch"], times[impl]),
                   "speedup_paired_lo": lo, "speedup_paired_hi": hi,
                   "bubble_theory": _theory(kind, p, v, m),
                   "torch_schedule": CLASSES[kind][1],
                   "bubble_step": 1 - med[compute] / med[impl],
                   "bubble_timeline": float("nan"), "bubble_predicted": float("nan"),
                   "compute_only_ms": med[compute],
                   "schedule": kind, "stages_per_rank": v, "microbatches": m, "width": width,
                   "blocks": blocks, "rows_per_microbatch": rows, "iters": iters}
            if impl != "torch":
                row.update(_pyfused_columns(ctx, kind, p, v, m, impl, scheds[impl],
                                            recorders[impl][-iters:], costs, out_dir))
                row["vs_torch"] = med[impl] / med["torch"]
            rows_out.append(row)
    return rows_out


def _main() -> None:
    import argparse
    import datetime

    from pyfused.bench.harness import write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    ctx = BenchContext(rank=dist.get_rank(), world=dist.get_world_size(), group=dist.group.WORLD,
                       device=torch.device("cpu"), backend="gloo", quick=args.quick,
                       iters=args.iters, options={"out": args.out})
    rows = run(ctx)
    if ctx.rank == 0:
        paths = write_results(rows, Path(args.out), "pipeline")
        for r in rows:
            print(f"{r['schedule']:>17} {r['method']:>16}  step {r['time_ms']:8.2f} ms  paired "
                  f"speedup {r['speedup_paired']:.3f}  bubble: theory {r['bubble_theory']:.3f} "
                  f"step {r['bubble_step']:.3f}"
                  + (f" timeline {r['bubble_timeline']:.3f} predicted {r['bubble_predicted']:.3f}"
                     if r["method"] != "torch" else ""))
        print("wrote", *paths, *[r["timeline_png"] for r in rows if r.get("timeline_png")])
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
