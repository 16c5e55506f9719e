"""``python -m pyfused.bench``: run the benchmark suites, print an nccl-tests-style table, write
CSV/JSON.

Suites are the modules ``pyfused.benchmarks.bench_<name>`` (the repository's ``benchmarks/``), each
with ``run(ctx) -> list[dict]`` and ``MULTI_RANK`` (True: run collectively on every rank; False: a
single-device suite, run on rank 0 alone). ``--suites`` also takes dotted module paths.

Ranks: under torchrun the launched ones; otherwise this process starts them with torchrun's elastic
launch (pyfused/bench/launch.py): one per GPU with NCCL, or 2 gloo ranks on CPU (``--world``).

Rows as they go: while a suite runs, rank 0 appends each row it finishes to
``<out>/<suite>.rows.jsonl`` (flushed per row), and replaces them with the suite's returned rows
when it ends, so a run killed mid-way keeps every point it measured; ``--suite-timeout`` bounds a
suite's wall-clock time (no measurement starts after it; the suite then fails, its rows kept there).

A failing suite never stops the run: every suite runs in a process group of its own whose collectives
time out after ``--timeout`` seconds (so a suite that raised on some ranks cannot hang the others),
the ranks then agree over a separate control group on what happened, and the suite shows up as a
failed row (its traceback on stderr). The exit status is 1 if any suite failed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import os
import pkgutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from . import harness, launch
from .harness import BenchContext

SUITE_PACKAGE = "pyfused.benchmarks"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# (warmup, iters) by (device type, quick)
ITERS = {("cpu", False): (2, 10), ("cpu", True): (1, 3), ("cuda", False): (5, 20),
         ("cuda", True): (2, 5)}
# The control group only waits for the slowest rank to finish a suite (a single-device suite runs
# on rank 0 while the others wait), so its timeout is a whole suite's, not a collective's.
CONTROL_TIMEOUT_S = 4 * 3600


def available_suites() -> List[str]:
    pkg = importlib.import_module(SUITE_PACKAGE)
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(pkg.__path__)
                  if m.name.startswith("bench_"))


def suite_module(name: str) -> str:
    if "." in name:
        return name
    return f"{SUITE_PACKAGE}.{name if name.startswith('bench_') else 'bench_' + name}"


def suite_name(module: str) -> str:
    last = module.rsplit(".", 1)[-1]
    return last[len("bench_"):] if last.startswith("bench_") else last


def select_suites(spec: Optional[str]) -> List[str]:
    """Module paths of the suites ``--suites`` names (all discovered ones by default)."""
    known = available_suites()
    if not spec:
        return [suite_module(n) for n in known]
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        short = item[len("bench_"):] if item.startswith("bench_") else item
        if "." not in item and short not in known:
            raise ValueError(f"--suites: no suite {item!r}; available: {', '.join(known)} "
                             f"(or a dotted module path)")
        out.append(suite_module(item))
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pyfused.bench", description=__doc__.split("\n")[0])
    p.add_argument("--suites", help="comma-separated suite names (default: all); see --list")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--quick", action="store_true", help="few shapes and iterations (smoke test)")
    p.add_argument("--out", default="bench_out", help="output folder for CSV/JSON (default: %(default)s)")
    p.add_argument("--world", type=int, help="ranks to start (default: one per GPU, or 2 on CPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--shapes", help="model names (llama3-8b, llama3-70b[.layer][@tpN]) or MxKxN literals; "
                                    "see pyfused/bench/shapes.py")
    p.add_argument("--iters", type=int, help="timed iterations per point")
    p.add_argument("--warmup", type=int, help="untimed iterations per point")
    p.add_argument("--no-validate", action="store_true",
                   help="validation mode off while timing: no cross-rank input exchange at all "
                        "(pyfused.comm.set_validation('off')); the mode is recorded in every row")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for a peer inside a suite before it fails: "
                        "a dead or frozen rank fails the suite after this long (default: "
                        "%(default)s = 5 minutes; torch's own default is 30)")
    p.add_argument("--suite-timeout", type=float,
                   help="seconds of wall-clock time a suite may take: no measurement starts after "
                        "that, and the suite fails with the rows it measured kept in "
                        "<out>/<suite>.rows.jsonl (default: no limit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _plain(v: Any) -> Any:
    """Row values as plain JSON-able scalars (rows are pickled between ranks and written out)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return str(v)


@dataclass
class SuiteResult:
    name: str
    rows: List[Dict[str, Any]] = field(default_factory=list)
    errors: List[Tuple[int, str]] = field(default_factory=list)  # (rank, traceback)
    seconds: float = 0.0


class Progress:
    """Rank 0's progress bar (rich, on stderr): suites done, and measurements of the current one."""

    def __init__(self, enabled: bool, n_suites: int):
        self.bar = None
        self.console = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress as RichProgress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console(stderr=True)
        self.bar = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                                transient=True)
        self.suites = self.bar.add_task("suites", total=n_suites)
        self.points = self.bar.add_task("measurements", total=None)
        self.bar.start()
        harness.progress_hook = lambda: self.bar.advance(self.points)

    def start_suite(self, name: str) -> None:
        if self.bar:
            self.bar.update(self.suites, description=f"suite {name}")
            self.bar.reset(self.points, total=None, description=f"  {name}: measurements")

    def end_suite(self, result: SuiteResult) -> None:
        if self.bar:
            self.bar.advance(self.suites)
            state = "FAILED" if result.errors else f"{len(result.rows)} rows"
            self.console.print(f"suite {result.name}: {state} in {result.seconds:.1f} s",
                               markup=False, highlight=False)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
            harness.progress_hook = None


def _default_iters(args, device: torch.device) -> Tuple[int, int]:
    warmup, iters = ITERS[(device.type, bool(args.quick))]
    return (args.warmup if args.warmup is not None else warmup,
            args.iters if args.iters is not None else iters)


def _load_suite(module: str):
    mod = importlib.import_module(module)
    if not callable(getattr(mod, "run", None)):
        raise TypeError(f"suite {module} has no run(ctx) function")
    multi = getattr(mod, "MULTI_RANK", None)
    if not isinstance(multi, bool):
        raise TypeError(f"suite {module} must define MULTI_RANK = True or False (got {multi!r})")
    return mod


def run_suite(module: str, base: BenchContext, control, timeout_s: float,
              budget_s: Optional[float] = None) -> SuiteResult:
    """Run one suite on every rank (or rank 0 alone); every rank returns the same SuiteResult."""
    result = SuiteResult(suite_name(module))
    t0 = time.perf_counter()
    mod, err, rows_file = None, None, None
    try:
        mod = _load_suite(module)
        if base.rank == 0 and base.options.get("out"):
            # emptied before the suite starts: an earlier run's rows are not this one's
            rows_file = Path(base.options["out"]) / f"{result.name}.rows.jsonl"
            rows_file.parent.mkdir(parents=True, exist_ok=True)
            rows_file.write_text("")
    except Exception:  # noqa: BLE001 - reported as the suite's failure
        err = traceback.format_exc()
    try:
        comm.agree_on(control, f"bench loading suite {result.name}", error=err)
    except comm.LocalWorkError as e:
        result.errors = e.failed
        result.seconds = time.perf_counter() - t0
        return result

    timeout = datetime.timedelta(seconds=timeout_s)
    if mod.MULTI_RANK:
        group = dist.new_group(backend=base.backend, timeout=timeout)
        ctx = BenchContext(base.rank, base.world, group, base.device, base.backend, base.quick,
                           base.warmup, base.iters, dict(base.options))
        runs_here = True
    else:
        group = dist.new_group(ranks=[0], backend=base.backend, timeout=timeout)
        ctx = BenchContext(0, 1, group, base.device, base.backend, base.quick, base.warmup,
                           base.iters, dict(base.options))
        runs_here = base.rank == 0
    rows, err = [], None
    if runs_here:
        try:
            rows = _run_recorded(mod, ctx, result.name, rows_file, budget_s)
        except Exception:  # noqa: BLE001 - reported as the suite's failure
            rows, err = [], traceback.format_exc()
    with _bounded(control, timeout_s if mod.MULTI_RANK else None):
        try:
            everyone = comm.agree_on(control, f"bench agreement after suite {result.name}",
                                     (len(rows), rows if base.rank == 0 else None), err)
        except comm.LocalWorkError as e:
            result.errors = e.failed
    counts = {n for n, _ in everyone} if mod.MULTI_RANK and not result.errors else set()
    if len(counts) > 1:
        result.errors = [(0, f"ranks returned different numbers of rows: "
                             f"{[n for n, _ in everyone]}")]
    if not result.errors:
        result.rows = everyone[0][1]
    if group is not None and (mod.MULTI_RANK or base.rank == 0):
        dist.destroy_process_group(group)
    result.seconds = time.perf_counter() - t0
    return result


def _run_recorded(mod, ctx: BenchContext, name: str, rows_file: Optional[Path],
                  budget_s: Optional[float]) -> List[Dict[str, Any]]:
    """``mod.run(ctx)`` with its rows appended to ``rows_file`` (rank 0; None elsewhere) as they are
    measured and no measurement started after ``budget_s``; the finished rows, which then replace
    the streamed ones in the file."""
    start_meta = harness.metadata(ctx) if rows_file is not None else {}
    recorder = harness.SuiteRecorder(rows_file, lambda r: _finish_row(r, name, ctx, start_meta),
                                     budget_s)
    harness.recorder = recorder
    try:
        rows = mod.run(ctx)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TypeError(f"run(ctx) must return a list of dicts, got {type(rows).__name__}")
        if not rows:
            raise RuntimeError("run(ctx) returned no rows")
        meta = harness.metadata(ctx)
        rows = [_finish_row(r, name, ctx, meta) for r in rows]
    except BaseException:
        recorder.flush()  # what it measured before failing stays in the file
        raise
    finally:
        harness.recorder = None
    recorder.replace(rows)
    return rows


@contextlib.contextmanager
def _bounded(control, suite_timeout_s: Optional[float]):
    """The bound of the agreement after a suite. After a multi-rank suite the ranks arrive within
    about one collective's timeout of each other (every rank took part in the suite's collectives),
    so the wait is bounded by twice ``--timeout``: a rank that froze in the suite then fails the run
    instead of holding the others for the control group's whole-suite timeout."""
    if suite_timeout_s is None or not hasattr(dist, "set_timeout"):
        yield
        return
    dist.set_timeout(datetime.timedelta(seconds=2 * suite_timeout_s), control)
    try:
        yield
    finally:
        dist.set_timeout(datetime.timedelta(seconds=CONTROL_TIMEOUT_S), control)


def _finish_row(row: Dict[str, Any], name: str, ctx: BenchContext, meta: Dict[str, Any]
                ) -> Dict[str, Any]:
    out: Dict[str, Any] = {"suite": name}
    out.update({str(k): _plain(v) for k, v in row.items()})
    if not out.get("transport"):
        out["transport"] = ctx.transport
    out.setdefault("status", "ok")
    for k, v in meta.items():
        out.setdefault(k, v)
    out.setdefault("quick", ctx.quick)
    return out


def _failed_row(result: SuiteResult, base: BenchContext) -> Dict[str, Any]:
    ranks = sorted({r for r, _ in result.errors})
    last = result.errors[0][1].strip().splitlines()[-1]
    row = {"suite": result.name, "status": f"failed on rank(s) {ranks}: {last}",
           "transport": "none"}
    row.update(harness.metadata(base))
    row["quick"] = base.quick
    return row


def worker(args: argparse.Namespace, modules: List[str], backend: str) -> int:
    """The body every rank runs; returns the exit status (the same on every rank)."""
    rank, world, device = launch.init_rank(backend, args.timeout)
    try:
        return _run_all(args, modules, backend, rank, world, device)
    finally:
        dist.destroy_process_group()


def _run_all(args, modules, backend, rank, world, device) -> int:
    if args.no_validate:
        comm.set_validation("off")  # otherwise the mode PYFUSED_VALIDATE set (default "first")
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    # rank 0's list, even if paths differ
    modules = comm.agree_on(control, "bench", modules, detail="the suites to run")[0]
    warmup, iters = _default_iters(args, device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    options = {"dtype": DTYPES[args.dtype] if args.dtype else None, "shapes": args.shapes,
               "out": args.out,
               "transport": "nccl-socket" if launch.shares_gpus(backend, local_world) else None}
    base = BenchContext(rank, world, None, device, backend, args.quick, warmup, iters, options)
    progress = Progress(rank == 0 and not args.no_progress, len(modules))
    results: List[SuiteResult] = []
    try:
        for module in modules:
            progress.start_suite(suite_name(module))
            result = run_suite(module, base, control, args.timeout, args.suite_timeout)
            progress.end_suite(result)
            results.append(result)
    finally:
        progress.close()
    failed = [r for r in results if r.errors]
    try:  # rank 0 writes files; the others must not wait at a collective if that fails
        comm.agree_on_local_work(control, "writing the report",
                                 lambda: report(results, base, Path(args.out)) if rank == 0 else None)
    except comm.LocalWorkError as e:
        if rank == 0:
            print(f"python -m pyfused.bench: {e}", file=sys.stderr)
        return 1
    return 1 if failed else 0


def report(results: List[SuiteResult], base: BenchContext, out: Path) -> None:
    """Rank 0: print the tables and failures, write per-suite and combined CSV/JSON."""
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 240)
    all_rows: List[Dict[str, Any]] = []
    from .table import render

    tables = []
    for result in results:  # the files first: a rendering problem must not lose the numbers
        rows = result.rows if not result.errors else [_failed_row(result, base)]
        tables.append((result.name, rows))
        all_rows += rows
        harness.write_results(rows, out, result.name)
    harness.write_results(all_rows, out, "all")
    for name, rows in tables:
        render(name, rows, console)
    failed = [r for r in results if r.errors]
    for result in failed:
        for r, tb in result.errors:
            print(f"\n--- suite {result.name} failed on rank {r}:\n{tb}", file=sys.stderr)
    summary = (f"{len(results) - len(failed)} suite(s) ok"
               + (f", {len(failed)} FAILED: {', '.join(r.name for r in failed)}" if failed else "")
               + f"; results in {out}/ (all.csv, all.json and one pair per suite)")
    console.print(summary, style="red" if failed else "green", markup=False)


def main(argv: Optional[List[str]] = None) -> int:
    # Eager CUDA module loading for this process and the ranks it starts, before CUDA starts: with
    # lazy loading a kernel's first launch waits for the context's running kernels, which stalls
    # the virtual-rank suite's ranks behind their peers' spinning kernels (pyfused/testing/
    # virtual_ranks.py); the cost is start-up time only, which no measurement includes.
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    # and a hardware work queue per stream of the virtual ranks (push_streams_per_rank there)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    args = parse_args(argv)
    try:
        if args.list:
            print("\n".join(available_suites()))
            return 0
        modules = select_suites(args.suites)
        from pyfused.bench import shapes

        shapes.validate(args.shapes)
        backend = launch.resolve_backend(args.backend)
        if launch.under_torchrun():
            env_world = int(os.environ["WORLD_SIZE"])
            if args.world is not None and args.world != env_world:
                raise launch.LaunchError(f"--world {args.world} differs from torchrun's "
                                         f"WORLD_SIZE={env_world}")
            return worker(args, modules, backend)
        world = args.world if args.world is not None else launch.default_world(backend)
        launch.check_world(world, backend)
        return launch.spawn(worker, (args, modules, backend), world, "pyfused-bench")
    except (ValueError, launch.LaunchError) as e:
        print(f"python -m pyfused.bench: error: {e}", file=sys.stderr)
        return 2
    except launch.ChildFailedError as e:  # a rank died outside any suite (e.g. could not join)
        print(f"python -m pyfused.bench: a rank failed:\n{e}", file=sys.stderr)
        return 1
