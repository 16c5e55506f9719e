"""``python -m pyfused.tune`` (its ``main``): tune the ops on the benchmark shapes and fill the
cache ``auto`` reads.

Ranks are started as by ``python -m pyfused.bench`` (torchrun's, or torchrun's elastic launch from
here: one per GPU with NCCL, 2 gloo ranks on CPU). Every rank writes the same entries to its cache
(``--cache`` or ``PYFUSED_TUNE_CACHE``; default ``~/.cache/pyfused/tune.json``).

    python -m pyfused.tune --shapes llama3-8b                 # the 8B layers, every op
    python -m pyfused.tune --ops matmul_all_reduce --shapes 4096x1792x4096 --chunks 2,4,8,16
    python -m pyfused.tune --ops all_reduce_add_rmsnorm --shapes 8192x8192   # x: rows x hidden
    torchrun --nproc-per-node 8 -m pyfused.tune               # all default shapes, 8 GPUs
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from ..bench import launch
from ..bench.cli import DTYPES
from ..ops.registry import OPS as SPECS
from .tuner import CHUNKED, DEFAULT_MARGIN, OPS, TUNABLE


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pyfused.tune",
                                description="Tune pyfused ops' methods per shape for method='auto'.")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all)")
    p.add_argument("--shapes", help="as for python -m pyfused.bench (default: the device's benchmark "
                                    "shapes); see pyfused/bench/shapes.py")
    p.add_argument("--quick", action="store_true", help="the --quick benchmark shapes")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--methods", default=",".join(TUNABLE),
                   help="candidates (unfused is always measured)")
    p.add_argument("--chunks", help=f"chunk counts for {' and '.join(CHUNKED)} (default 2,4,8)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help="how much faster than unfused (a fraction) a method must measure to be "
                        "chosen (default: %(default)s)")
    p.add_argument("--iters", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--cache", help="cache file to write (sets PYFUSED_TUNE_CACHE for the ranks)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for a peer before it fails: a dead or frozen "
                        "rank stops the run after this long (default: %(default)s = 5 minutes; "
                        "torch's own default is 30)")
    return p.parse_args(argv)


def worker(args: argparse.Namespace, backend: str) -> int:
    from . import cache_path, reload
    from .tuner import tune

    if args.cache:
        os.environ["PYFUSED_TUNE_CACHE"] = args.cache
        reload()
    rank, world, device = launch.init_rank(backend, args.timeout)
    try:
        dtype = DTYPES[args.dtype] if args.dtype else None
        dtype = dtype or (DTYPES["bfloat16"] if device.type == "cuda" else DTYPES["float32"])
        chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else None
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        results = []
        for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
            for shape in _op_shapes(op, args, world, device.type, dtype):
                res = tune(op, shape.a, shape.b, dtype, methods=methods,
                           chunks=chunks if op in CHUNKED else None,
                           warmup=args.warmup, iters=args.iters, margin=args.margin, device=device)
                results.append((op, shape, res))
        if rank == 0:
            _print(results, world, backend, cache_path())
        return 0
    finally:
        dist.destroy_process_group()


def _op_shapes(op, args, world, device_type, dtype):
    """The benchmark's shapes of ``op`` (all_reduce_add_rmsnorm: x [rows, hidden], weight [hidden])."""
    from pyfused.bench import shapes

    if SPECS[op].gemm:
        return shapes.parse(args.shapes, op, world, device_type, args.quick)
    esize = torch.empty((), dtype=dtype).element_size()
    return [shapes.OpShape(f"{rows}x{hidden}", op, (rows, hidden), (hidden,))
            for rows, hidden in shapes.norm_shapes(args.shapes, device_type, args.quick, esize)]


def _print(results, world, backend, path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pyfused.tune: world {world}, {backend}", caption=f"written to {path}",
                  caption_justify="left")
    for col in ("op", "shape", "chosen", "unfused ms", "chosen ms", "speedup", "all (ms)"):
        table.add_column(col, justify="right" if col.endswith(("ms", "speedup")) else "left")
    for op, shape, res in results:
        chosen_label = res.method + (f"/c{res.chunks}" if res.chunks else "")
        t_unf, t_ch = res.times_ms["unfused"], res.times_ms[chosen_label]
        every = ", ".join(f"{k} {v:.3f}" for k, v in res.times_ms.items())
        dims = (f"x={shape.a[0]}x{shape.a[1]}" if len(shape.b) == 1
                else f"a={shape.a[0]}x{shape.a[1]} b={shape.b[0]}x{shape.b[1]}")
        table.add_row(op, f"{shape.label} {dims}",
                      chosen_label, f"{t_unf:.3f}", f"{t_ch:.3f}", f"{t_unf / t_ch:.2f}x", every)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        from pyfused.bench import shapes

        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            raise ValueError(f"--ops: unknown {unknown}; choose from {', '.join(OPS)}")
        if any(SPECS[op].gemm for op in ops):
            shapes.validate(args.shapes)
        if any(not SPECS[op].gemm for op in ops):
            shapes.norm_shapes(args.shapes, "cpu", args.quick, 4)
        backend = launch.resolve_backend(args.backend)
        if args.cache:
            os.environ["PYFUSED_TUNE_CACHE"] = os.path.abspath(args.cache)
            args.cache = os.environ["PYFUSED_TUNE_CACHE"]
        if launch.under_torchrun():
            return worker(args, backend)
        world = args.world if args.world is not None else launch.default_world(backend)
        launch.check_world(world, backend)
        return launch.spawn(worker, (args, backend), world, "pyfused-tune")
    except (ValueError, launch.LaunchError) as e:
        print(f"python -m pyfused.tune: error: {e}", file=sys.stderr)
        return 2
    except launch.ChildFailedError as e:
        print(f"python -m pyfused.tune: a rank failed:\n{e}", file=sys.stderr)
        return 1

