"""The one benchmark harness. Suites in ``benchmarks/bench_<name>.py`` (installed
as ``pyfused.benchmarks``) use only these pieces, so every number is timed, labelled and written the
same way.

Timing of a multi-rank call: every rank runs the same fixed number of iterations (an adaptive count
could differ between ranks and hang a collective); each iteration starts after a barrier, is timed
with CUDA events on GPU or ``perf_counter`` on CPU, and the iteration's time is the slowest rank's.
The reported time is the median over iterations. Python's cyclic garbage collector is off while
rounds are timed, with a young-generation collection before each round, as torchtitan's training
loop runs it (``gc.disable()`` and ``gc.collect(1)`` every few steps): an automatic collection
lands in whichever call crosses its allocation threshold, charging one candidate a pause that
every candidate's garbage caused.

Rows. A suite's ``run(ctx)`` returns a list of dicts, one per measured point. The CLI prints and
writes them: the columns it knows (``ROW_COLUMNS``, which ``op_row`` fills) go into its table, every
other key is kept in the CSV/JSON. Every row names its ``transport`` ("gloo", "nccl", "symm-mem" or
"none"), so that a speedup measured over a slower transport is never read as a kernel's; on the
multi-host test bed (docs/MULTIHOST.md) every row also carries ``link``, the bed's description of
the links between its hosts (``LINK_ENV``). The
derived columns are computed here and only here (``tflops``, ``bandwidths``, ``speedup``,
``overlap_efficiency``); docs/BENCH.md repeats the formulas.

Rows as they go. While a suite runs, the CLI attaches a ``SuiteRecorder``: every ``op_row`` is
appended to ``<suite>.rows.jsonl`` once the suite moves on (its next row or measurement), so a suite
killed mid-way leaves the rows it finished; and no measurement starts once the suite's time budget
is spent.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# Called on every rank after each ``time_fn`` measurement; the CLI points it at its progress bar.
# Suites need not know about it.
progress_hook: Optional[Callable[[], None]] = None


class SuiteTimeout(RuntimeError):
    """A suite's time budget (the CLI's ``--suite-timeout``) was spent: no measurement started."""


class SuiteRecorder:
    """The suite running in this process: its rows written as they are measured, and its budget.

    ``op_row`` hands each new row to ``row``; the row is held until the suite starts its next
    measurement or row (a suite may still add columns to a row it just made) and then appended to
    ``path`` as one JSON line, flushed, so a process killed later loses none of it. ``path`` None
    (ranks other than 0) records nothing. ``finish`` turns a suite's row into the row the files hold
    (suite name, metadata). ``budget_s``: wall-clock seconds after which ``measuring`` raises
    ``SuiteTimeout`` instead of letting another measurement start."""

    def __init__(self, path: Optional[Path], finish: Callable[[Dict[str, Any]], Dict[str, Any]],
                 budget_s: Optional[float] = None):
        self.path = path
        self.finish = finish
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.written = 0
        self._pending: List[Dict[str, Any]] = []

    def row(self, row: Dict[str, Any]) -> None:
        self.flush()
        self._pending.append(row)

    def measuring(self) -> None:
        """Called as a measurement starts: the rows made so far are final; is there time left?"""
        self.flush()
        spent = time.monotonic() - self.started
        if self.budget_s is not None and spent > self.budget_s:
            raise SuiteTimeout(f"the suite's {self.budget_s:g} s budget (--suite-timeout) was spent "
                               f"after {spent:.0f} s and {self.written} rows: no further measurement "
                               f"started")

    def flush(self) -> None:
        if self.path is not None and self._pending:
            with self.path.open("a") as f:
                for row in self._pending:
                    f.write(json.dumps(json_safe(self.finish(dict(row))), default=str) + "\n")
                f.flush()
        self.written += len(self._pending)
        self._pending.clear()

    def replace(self, rows: List[Dict[str, Any]]) -> None:
        """The suite's finished rows (as the files hold them) in place of those streamed."""
        self._pending.clear()
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(json_safe(r), default=str) + "\n" for r in rows))
            os.replace(tmp, self.path)


# The recorder of the suite running in this process; the CLI sets it around each suite.
recorder: Optional[SuiteRecorder] = None


@dataclass
class BenchContext:
    """What a suite's ``run(ctx)`` gets: where it runs and how hard to try.

    ``options`` carries the CLI's choices: ``dtype`` (a torch.dtype), ``shapes`` (the ``--shapes``
    spec string or None), ``out`` (the output folder). Multi-rank suites must communicate over
    ``group`` only (the CLI gives every suite a group of its own, with a timeout, so a suite that
    fails on some ranks cannot hang the run)."""

    rank: int
    world: int
    group: Optional[dist.ProcessGroup]
    device: torch.device
    backend: str  # "gloo", "nccl", or "local" (one process, no torch.distributed)
    quick: bool = False  # a short run (CI smoke tests): fewer shapes and iterations
    warmup: int = 3
    iters: int = 10
    options: Dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.options.get("dtype") or (torch.bfloat16 if self.device.type == "cuda"
                                             else torch.float32)

    @property
    def transport(self) -> str:
        """The transport of this context's collectives: "gloo", "nccl", "nccl-socket" (NCCL ranks
        sharing a GPU, over sockets), or "none" (one rank)."""
        if self.world == 1 or self.backend not in ("gloo", "nccl"):
            return "none"
        return self.options.get("transport") or self.backend


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_timed(fn: Callable[[], Any], ctx: BenchContext) -> float:
    """One iteration: barrier, then ``fn()`` timed on this rank (ms)."""
    if ctx.world > 1:
        dist.barrier(group=ctx.group)
    if ctx.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def collection_between_rounds():
    """Python's automatic garbage collection off inside the block (module docstring); yields the
    function to call before each round, which collects the young generations. The collector's
    state is restored at the end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield lambda: gc.collect(1)
    finally:
        if was_enabled:
            gc.enable()


def _slowest_rank(times: List[float], ctx: BenchContext) -> List[float]:
    """Each iteration's time on the slowest rank (one all-reduce for the whole list)."""
    if ctx.world == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def time_fn(fn: Callable[[], Any], ctx: BenchContext, warmup: Optional[int] = None,
            iters: Optional[int] = None) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs; the slowest rank's time per iteration.
    Every rank of ``ctx.group`` must call this with the same counts."""
    return time_interleaved({"fn": fn}, ctx, warmup, iters)["fn"]


def interleaved_samples(fns: Dict[str, Callable[[], Any]], ctx: BenchContext,
                        warmup: Optional[int] = None,
                        iters: Optional[int] = None) -> Dict[str, List[float]]:
    """Every timed iteration (ms, the slowest rank's) of several functions measured in rounds:
    iteration i of every function runs in round i, before iteration i+1 of any. Load that drifts
    during a run (a shared machine, clocks, the allocator) then hits every variant alike instead of
    whichever was timed first, which matters when the variants are compared with each other
    (speedups, ``paired_speedup``). The order inside a round is shuffled per round, the same on
    every rank (a fixed seed), so that no variant always runs right after the same other one: a
    step can leave work behind for the next (gloo's threads, the allocator's frees). Same count on
    every rank."""
    if recorder is not None:
        recorder.measuring()
    warmup = ctx.warmup if warmup is None else warmup
    iters = ctx.iters if iters is None else iters
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    synchronize(ctx.device)
    order = random.Random(len(names) * 1000 + iters)
    times: Dict[str, List[float]] = {name: [] for name in names}
    with collection_between_rounds() as between_rounds:
        for _ in range(iters):
            between_rounds()
            for name in order.sample(names, len(names)):
                times[name].append(_run_timed(fns[name], ctx))
    flat = _slowest_rank([t for name in names for t in times[name]], ctx)
    if progress_hook is not None:
        for _ in names:
            progress_hook()
    return {name: flat[i * iters:(i + 1) * iters] for i, name in enumerate(names)}


def device_samples(fns: Dict[str, Callable[[], object]], rounds: int, calls: int
                   ) -> Dict[str, List[Tuple[float, float, bool]]]:
    """Per function and round: (device ms per call, host ms to queue a call, host-bound). A sleep
    kernel holds the current stream while the host queues ``calls`` calls behind it (every call
    orders the ranks' streams after the current stream and the current stream after them), so the
    events around the calls time the device alone; a round whose queueing outlasted the sleep is
    host-bound. The order of the functions is shuffled per round. CUDA only: for calls whose host
    time exceeds their device time, which a wall-clock timing would measure instead."""
    host_ms = {}
    for name, fn in fns.items():  # warm, and the host time a call takes to queue
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host_ms[name] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    order = random.Random(rounds)
    out: Dict[str, List[Tuple[float, float, bool]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name in order.sample(list(fns), len(fns)):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            # ~2 GHz at most: at least twice the expected queueing time
            torch.cuda._sleep(int(2 * calls * host_ms[name] * 1e-3 * 2e9) + 1000)
            e1.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            queued = (time.perf_counter() - t0) * 1e3
            e2.record()
            e2.synchronize()
            out[name].append((e1.elapsed_time(e2) / calls, queued / calls,
                              queued > e0.elapsed_time(e1)))
    return out


def time_interleaved(fns: Dict[str, Callable[[], Any]], ctx: BenchContext,
                     warmup: Optional[int] = None, iters: Optional[int] = None) -> Dict[str, float]:
    """The median of each function's ``interleaved_samples``."""
    return {name: statistics.median(t)
            for name, t in interleaved_samples(fns, ctx, warmup, iters).items()}


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


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a ``shape`` tensor of ``dtype``. For ``bandwidths`` pass the tensor nccl-tests calls
    S: the gathered output of an all-gather, the unreduced input of a reduce-scatter, the buffer of
    an all-reduce."""
    return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


def speedup(t_baseline_ms: Optional[float], t_ms: Optional[float]) -> float:
    """``T_baseline / T_method``: how many times faster than the baseline (> 1 is faster)."""
    if not t_baseline_ms or not t_ms or t_ms <= 0:
        return float("nan")
    return t_baseline_ms / t_ms


def paired_ratios(baseline: List[float], samples: List[float]) -> List[float]:
    """``baseline[i] / samples[i]`` for every round i in which both were timed (positive)."""
    return [b / s for b, s in zip(baseline, samples) if b > 0 and s > 0]


def paired_speedup(baseline: List[float], samples: List[float]) -> float:
    """The median over rounds of ``baseline[i] / samples[i]``: sample i of both was taken in the same
    round of ``interleaved_samples`` (> 1: faster than the baseline).

    Load that lasts longer than a round (other processes on a shared machine, clock changes) slows
    both samples of a round alike and cancels in their ratio; the median then drops the rounds a
    burst hit only one of. That makes it the steadiest of the three estimators the suites report
    (``speedup`` of the medians, ``best_speedup`` of the best samples)."""
    pairs = paired_ratios(baseline, samples)
    return statistics.median(pairs) if pairs else float("nan")


def median_interval(values: Sequence[float], confidence: float = 0.95) -> Tuple[float, float]:
    """A distribution-free confidence interval of the median the values are drawn from: the order
    statistics x_(j) and x_(n+1-j) (1-based, values sorted) for the largest j with
    P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2, which cover the median with at least
    ``confidence`` whatever the distribution (the sign test's interval). Below 6 values no j
    qualifies at 95%: (min, max) is returned, covering less. (nan, nan) for none."""
    x = sorted(values)
    n = len(x)
    if n == 0:
        return float("nan"), float("nan")
    tail, below, j = (1 - confidence) / 2, 0.0, 0
    while j < n // 2:
        below += math.comb(n, j) / 2 ** n  # P(Binomial(n, 1/2) <= j) after this line
        if below > tail:
            break
        j += 1
    j = max(j, 1)
    return x[j - 1], x[n - j]


def paired_interval(baseline: List[float], samples: List[float]) -> Tuple[float, float]:
    """``median_interval`` of the per-round ratios ``paired_speedup`` takes the median of: where
    the ratio of the two programs' typical round lies, given the rounds' spread."""
    return median_interval(paired_ratios(baseline, samples))


def best_speedup(baseline: List[float], samples: List[float]) -> float:
    """``min(baseline) / min(samples)``: the best sample of each, as ``timeit`` reports (the
    quietest moment each variant met, not necessarily the same moment)."""
    if not baseline or not samples or min(samples) <= 0:
        return float("nan")
    return min(baseline) / min(samples)


def vs_peer(peer: str, name: str, samples: Dict[str, List[float]]) -> Dict[str, Any]:
    """The columns comparing variant ``name`` with its ``peer`` (torch's counterpart) from the same
    ``interleaved_samples``: ``peer``, ``vs_peer`` (``paired_speedup``, the suite's ratio),
    ``vs_peer_lo`` / ``vs_peer_hi`` (its 95% ``paired_interval``) and ``vs_peer_best``
    (``best_speedup``); none for the peer itself or a variant not timed."""
    if name == peer or name not in samples or peer not in samples:
        return {}
    lo, hi = paired_interval(samples[peer], samples[name])
    return {"peer": peer, "vs_peer": paired_speedup(samples[peer], samples[name]),
            "vs_peer_lo": lo, "vs_peer_hi": hi,
            "vs_peer_best": best_speedup(samples[peer], samples[name])}


def overlap_efficiency(t_gemm_ms: Optional[float], t_comm_ms: Optional[float],
                       t_method_ms: Optional[float]) -> float:
    """``(T_gemm + T_comm - T_method) / min(T_gemm, T_comm)``, the three measured in the same run.

    The fraction of the shorter part that the method hid behind the longer one: 0 for a serial
    schedule (``T_method = T_gemm + T_comm``), 1 for perfect overlap (``T_method = max(...)``);
    negative when the method is slower than the two parts back to back."""
    if not t_gemm_ms or not t_comm_ms or not t_method_ms:
        return float("nan")
    shorter = min(t_gemm_ms, t_comm_ms)
    if shorter <= 0:
        return float("nan")
    return (t_gemm_ms + t_comm_ms - t_method_ms) / shorter


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|, in fp64 (inf or nan where out is not finite): how a suite checks
    a method's output against its reference before timing it."""
    return (out.double() - ref.double()).abs().max().item() / max(ref.double().abs().max().item(),
                                                                  1e-30)


# The columns the CLI's table knows, in display order; any other key of a row is kept in the files.
ROW_COLUMNS = ("suite", "shape", "dtype", "method", "transport", "status", "time_ms", "tflops",
               "algbw_GBps", "busbw_GBps", "speedup", "overlap_eff", "note")


def op_row(ctx: BenchContext, *, shape: str, dtype: torch.dtype, method: str, transport: str,
           ms: Optional[float], flop: float = 0.0, collective: Optional[str] = None,
           nbytes: float = 0.0, t_baseline: Optional[float] = None,
           t_gemm: Optional[float] = None, t_comm: Optional[float] = None, status: str = "ok",
           note: str = "", **extra: Any) -> Dict[str, Any]:
    """One row, its derived columns computed from the measured times by the formulas above.

    ``t_baseline`` is the unfused time of the same shape (for ``speedup``); ``t_gemm`` and
    ``t_comm`` the GEMM and the collective measured alone (for ``overlap_eff``). A point that could
    not run has ``ms=None`` and a ``status`` saying why; its numbers are then NaN (empty in the
    table), never zero."""
    nan = float("nan")
    ok = ms is not None and ms > 0
    algbw = busbw = nan
    if ok and collective and nbytes and ctx.world > 1:
        algbw, busbw = bandwidths(collective, nbytes, ms, ctx.world)
    row: Dict[str, Any] = {
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "method": method,
        "transport": transport,
        "status": status,
        "time_ms": ms if ok else nan,
        "tflops": tflops(flop, ms) if ok and flop else nan,
        "algbw_GBps": algbw,
        "busbw_GBps": busbw,
        "speedup": speedup(t_baseline, ms) if ok else nan,
        "overlap_eff": overlap_efficiency(t_gemm, t_comm, ms) if ok else nan,
        "note": note,
    }
    row.update(extra)
    if recorder is not None:
        recorder.row(row)
    return row


def git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Set by the multi-host test bed (benchmarks/multihost_testbed.py) on every host it starts.
LINK_ENV = "MULTIHOST_LINK"


def metadata(ctx: BenchContext) -> Dict[str, Any]:
    """Columns every row carries: where and when it was measured, and how."""
    from .. import comm

    link = {"link": os.environ[LINK_ENV]} if os.environ.get(LINK_ENV) else {}
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
        "validate": comm.validation_mode(),
        "warmup": ctx.warmup,
        "iters": ctx.iters,
        "threads": torch.get_num_threads(),
        **link,
    }


def json_safe(row: Dict[str, Any]) -> Dict[str, Any]:
    """A number that could not be measured is NaN in memory; it is written as an empty CSV cell and
    a JSON null (NaN is not JSON)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def write_results(rows: List[Dict[str, Any]], out_dir: Path, name: str) -> List[Path]:
    """Write ``rows`` as ``<name>.csv`` and ``<name>.json`` under ``out_dir``; return the paths."""
    import csv

    rows = [json_safe(row) for row in rows]
    out_dir = Path(out_dir)
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
