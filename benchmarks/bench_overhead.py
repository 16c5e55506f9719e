"""Per-call overhead of every op and method against the same work written in plain torch.

At latency-bound shapes (a few rows: the host's per-call work is what the time is made of) each op
of the registry (pyfused/ops/registry.py) runs with each of its methods (``OpSpec.methods``:
unfused, decomposed and fused for most; ring, allgather and ulysses for ring_attention) and auto, and
beside it, in the same run and on the same inputs, the plain-torch program a user would write
(the op's ``plain_torch`` hook): ``a @ b`` plus the torch.distributed collective
(all_gather_single then the GEMM; the GEMM then all_reduce or reduce_scatter_single), and for
all_reduce_add_rmsnorm ``all_reduce``, ``+`` and ``torch.nn.functional.rms_norm``, for the MoE ops
``all_to_all_single`` with split sizes and a GEMM per expert, for ring_attention an all-gather of K/V
and ``scaled_dot_product_attention`` with the causal mask of the rows. At world
size 1 the plain program is the computation alone (the ops skip the collective of a one-rank
group, so they are held to the stricter baseline).

Both world sizes are measured in one run: the run's group (2 ranks by default on CPU) and a group
of rank 0 alone, while the other ranks wait. A sample times ``CALLS`` back-to-back calls after a
barrier and counts as its slowest rank's. Each round takes one sample of every variant, in an order
shuffled per round; ``SAMPLES`` rounds. Reported per variant, in microseconds per call: the median
sample (``us_per_call``) beside plain torch's (``torch_us``), and ``overhead_x``, the median over
rounds of the variant's sample divided by plain torch's sample of the same round (1.00 = no
overhead), with ``overhead_x_lo`` / ``overhead_x_hi`` its 95% interval (``harness.median_interval``).
Pairing by round cancels the interference that outlasts a round (other processes,
gloo's threads, clock changes), which dominates the spread of single samples on a shared box; the
best sample (``best_us``, ``best_x`` = best over best, as ``timeit`` reports) is kept for
reference. On CPU each rank's main thread is pinned to its own core while the suite runs
(``_pinned_to_own_core``). Validation runs in the mode the process has (``--no-validate`` sets
"off"); the first call of every variant is untimed, so mode "first" is measured in its steady
state, where a call is found in the plan cache (``plan_cache`` names its implementation: C++ where
pyfused._C is built). One more row per shape, ``<first method>, validate=always`` (``unfused,
validate=always`` for most ops), times the op's first method and plain torch again with the
cross-rank check run on every call: what the check costs where mode "first" skips it.

On a GPU the timed calls also wait for their kernels, so host overhead hides behind GPU time there;
``host_us`` is then measured apart: the host's time per call while a sleep kernel queued first
keeps the GPU busy (launches return at once), and ``host_over_torch_us`` is its excess over the
plain program's (the goal: <= 5 us). On CPU the host time is the time (``host_us`` = ``us_per_call``).
"""
from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from pyfused import comm
from pyfused.bench.harness import BenchContext, op_row, paired_interval, paired_speedup
from pyfused.comm import plans
from pyfused.ops import _common
from pyfused.ops.registry import OPS

MULTI_RANK = True
# Per-rank (rows, K, N) of the GEMM ops, (rows, hidden) of the others (whose inputs their
# ``make_inputs`` hook builds).
GEMM_SHAPES = {"cpu": [(16, 256, 256), (64, 512, 512)], "cuda": [(16, 4096, 4096), (128, 8192, 1024)]}
NORM_SHAPES = {"cpu": [(16, 256), (64, 1024)], "cuda": [(16, 4096), (128, 8192)]}
CALLS = {"cpu": 1, "cuda": 200}
SAMPLES = {"cpu": 801, "cuda": 101}  # rounds; --quick: QUICK_SAMPLES
QUICK_SAMPLES = 3


def _inputs(op: str, shape: Tuple[int, ...], world: int, ctx: BenchContext):
    gen = torch.Generator().manual_seed(ctx.rank)
    dt = ctx.options.get("dtype") or (torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
    rand = lambda *s: torch.randn(*s, generator=gen).to(ctx.device, dt)  # noqa: E731
    if not OPS[op].gemm:  # the op's own inputs (its registry hook), rows x hidden
        rows, hidden = shape
        tensors = OPS[op].make_inputs(world, rows, hidden, 0, dt, ctx.device, seed=0)[ctx.rank]
        return tensors, f"{rows}x{hidden}", dt
    m, k, n = shape
    rows = m * world if OPS[op].scatters_dim0 else m
    return (rand(rows, k), rand(k, n) * k ** -0.5), f"{rows}x{k}x{n}", dt


def _time_per_call(fns: Dict[str, Callable[[], object]], ctx: BenchContext, pg,
                   samples: int, calls: int) -> Dict[str, List[float]]:
    """Per variant, ``samples`` times of ``calls`` back-to-back calls (the slowest rank's), in us
    per call; entry i of every list is from round i. Each round times every variant once, in an
    order shuffled per round (the same on every rank), so that no variant always follows the same
    other one; each variant is called once untimed first."""
    world = comm.world_size(pg)
    names = list(fns)
    for fn in fns.values():
        fn()
    order = random.Random(len(names) * samples)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for _ in range(samples):
        for name in order.sample(names, len(names)):
            fn = fns[name]
            if world > 1:
                dist.barrier(group=pg)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e6 / calls)
    if world > 1:
        t = torch.tensor([times[name] for name in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        times = dict(zip(names, t.tolist()))
    return times


def _host_us_per_call(fns: Dict[str, Callable[[], object]], pg, samples: int, calls: int
                      ) -> Dict[str, float]:
    """CUDA only: the host's own time per call (best sample), measured while the GPU is kept busy
    by a sleep kernel queued first, so that every launch returns at once instead of waiting for
    the GPU: what a call costs the CPU thread that issues it (the <= 5 us goal above torch's)."""
    world = comm.world_size(pg)
    best = {name: float("inf") for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            if world > 1:
                dist.barrier(group=pg)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(calls * 100e-6 * 1.5e9))  # ~100 us of GPU time per call (~1.5 GHz)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e6 / calls)
            torch.cuda.synchronize()
    if world > 1:
        t = torch.tensor(list(best.values()), dtype=torch.float64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        best = dict(zip(best, t.tolist()))
    return best


def _stats(times: Dict[str, List[float]], name: str) -> Dict[str, float]:
    """The row's figures of variant ``name`` against plain torch, from the same rounds."""
    mine, base = times[name], times["torch"]
    lo, hi = paired_interval(mine, base)  # of this / torch, round by round
    return dict(us_per_call=statistics.median(mine), torch_us=statistics.median(base),
                overhead_x=paired_speedup(mine, base), overhead_x_lo=lo, overhead_x_hi=hi,
                best_us=min(mine), best_x=min(mine) / min(base))


def _op_rows(op: str, shape, ctx: BenchContext, pg) -> List[dict]:
    world = comm.world_size(pg)
    tensors, label, dtype = _inputs(op, shape, world, ctx)
    fn, methods = OPS[op].function, (*OPS[op].methods, "auto")
    first = OPS[op].methods[0]
    checked_name = checked_row(op)  # the row of the check's own cost
    variants: Dict[str, Callable[[], object]] = {"torch": OPS[op].plain_torch(tensors, pg)}
    unavailable: Dict[str, str] = {}
    for method in methods:
        call = (lambda m=method: fn(*tensors, group=pg, method=m))
        try:
            call()  # the first call validates (mode "first" remembers it); raised on every rank alike
        except _common.MethodUnavailable as e:
            unavailable[method] = str(e)
            continue
        variants[method] = call
    samples = QUICK_SAMPLES if ctx.quick else SAMPLES.get(ctx.device.type, SAMPLES["cuda"])
    calls = CALLS.get(ctx.device.type, CALLS["cuda"])
    times = _time_per_call(variants, ctx, pg, samples, calls)
    host = (_host_us_per_call(variants, pg, samples, calls) if ctx.device.type == "cuda"
            else {name: statistics.median(t) for name, t in times.items()})
    checked = _checked_every_call(variants, first, ctx, pg, samples, calls)
    transport = ctx.transport if world > 1 else "none"
    rows = []
    for method in ("torch", *methods, checked_name):
        common = dict(shape=label, dtype=dtype, transport=transport, op=op, world_size=world,
                      validate="always" if method == checked_name else comm.validation_mode(),
                      plan_cache=plans.IMPLEMENTATION)
        if method == checked_name:
            figures = _stats(checked, first)
            rows.append(op_row(ctx, method=method, ms=figures["us_per_call"] / 1e3, **figures,
                               host_us=figures["us_per_call"],
                               host_over_torch_us=figures["us_per_call"] - figures["torch_us"],
                               note="every call exchanges and checks signatures", **common))
            continue
        if method in unavailable:
            rows.append(op_row(ctx, method=method, ms=None, status="unavailable",
                               note=f"unavailable: {unavailable[method]}", **common))
            continue
        figures = _stats(times, method)
        rows.append(op_row(ctx, method=method, ms=figures["us_per_call"] / 1e3, **figures,
                           host_us=host[method], host_over_torch_us=host[method] - host["torch"],
                           note="plain torch" if method == "torch" else "", **common))
    return rows


def checked_row(op: str) -> str:
    """The name of the row that times ``op``'s first method with the check on every call."""
    return f"{OPS[op].methods[0]}, validate=always"


def _checked_every_call(variants: Dict[str, Callable[[], object]], method: str, ctx: BenchContext,
                        pg, samples: int, calls: int) -> Dict[str, List[float]]:
    """Plain torch and ``method`` again, in rounds, in validation mode "always": what the
    cross-rank check costs when it runs on every call (mode "first" runs it once per signature)."""
    mode = comm.validation_mode()
    comm.set_validation("always")  # this process only: every rank of ``pg`` runs this alike
    try:
        return _time_per_call({name: variants[name] for name in ("torch", method)}, ctx, pg,
                              samples, calls)
    finally:
        comm.set_validation(mode)


def _rows_at(ctx: BenchContext, pg) -> List[dict]:
    rows = []
    for op in OPS:
        table = GEMM_SHAPES if OPS[op].gemm else NORM_SHAPES
        for shape in table.get(ctx.device.type, table["cuda"])[: 1 if ctx.quick else None]:
            rows += _op_rows(op, shape, ctx, pg)
    return rows


@contextlib.contextmanager
def _pinned_to_own_core(ctx: BenchContext):
    """On CPU, this rank's main thread runs on core ``rank mod cores`` while the suite runs. Unpinned,
    the scheduler moves the ranks' threads between the cores, and those migrations, not the
    programs, dominate the spread of a gloo collective's latency between samples."""
    if ctx.device.type != "cpu" or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    os.sched_setaffinity(0, {cores[ctx.rank % len(cores)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run(ctx: BenchContext) -> List[dict]:
    with _pinned_to_own_core(ctx):
        return _run(ctx)


def _run(ctx: BenchContext) -> List[dict]:
    rows = _rows_at(ctx, ctx.group) if ctx.world > 1 else []
    alone = [None]
    if ctx.world > 1:
        solo = dist.new_group([comm.global_rank(ctx.group, 0)], backend=ctx.backend)
        if ctx.rank == 0:
            alone = [_rows_at(ctx, solo)]
        dist.broadcast_object_list(alone, src=comm.global_rank(ctx.group, 0), group=ctx.group,
                                   device=ctx.device if ctx.backend == "nccl" else None)
        if ctx.rank == 0:
            dist.destroy_process_group(solo)
    else:
        alone = [_rows_at(ctx, ctx.group)]
    return alone[0] + rows
