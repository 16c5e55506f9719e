"""The library's training paths over a real process group, each against single-process training.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_nccl_paths.py --out DIR ARGS

with ARGS ``--device cuda --backend nccl`` on the GPU, ``--device cpu --backend gloo`` on CPU.

A correctness check of the transport, no timings: pyfused DDP, its sharded optimizer (ZeRO),
``fully_shard``, a 1F1B pipeline, ``parallelize`` at tp=2, the expert-parallel MoE layer and ring
attention (``nccl_path_checks.py`` says what each trains and compares). Several ranks may share
one GPU: each then claims its own NCCL host id and talks over sockets (``pyfused.bench.launch``).

Rank 0 prints one line per path, ``path  PASS|FAIL  max_abs_diff  max_rel_diff  seconds`` (and
the first failures or the exception), and writes the same as JSON lines to DIR/nccl_paths.jsonl.
Each path runs in its own try/except, and the ranks agree on its outcome before the next one; the
process group's timeout (``--group-timeout``) bounds a path that hangs. A rank that fails mid-path
leaves the group out of step: that path and the ones after it are reported FAIL (not run). Exit
status 0 iff every path passed. ``--perturb PATH`` adds an error to PATH's distributed results (it
must FAIL).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # pyfused and the tests' helpers, whatever the working directory

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.nccl_path_checks import PATHS, Comparison  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of: " + ", ".join(PATHS))
    p.add_argument("--perturb", default=None, choices=list(PATHS), help="make this path's results wrong")
    p.add_argument("--group-timeout", type=float, default=60.0, help="seconds a collective may wait")
    args = p.parse_args(argv)
    if (args.device == "cuda") != (args.backend == "nccl"):
        p.error("--device cuda goes with --backend nccl, --device cpu with --backend gloo")
    args.paths = [x for x in args.paths.split(",") if x]
    unknown = [x for x in args.paths if x not in PATHS]
    if unknown:
        p.error(f"unknown path(s) {unknown}; known: {', '.join(PATHS)}")
    return args


def init_group(args) -> torch.device:
    """Join the group from torchrun's environment (pyfused.bench.launch: ranks sharing a GPU claim
    their own NCCL host ids); fp32 matmuls stay fp32 on the GPU, as the references are."""
    from pyfused.bench.launch import init_rank

    _, _, device = init_rank(args.backend, args.group_timeout)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def run_path(name: str, device: torch.device, perturb: bool) -> dict:
    """Run one path on this rank; every rank's outcome, agreed, as one row."""
    from pyfused.comm.agreement import agree_on

    rank, world = dist.get_rank(), dist.get_world_size()
    cmp = Comparison(perturb=perturb)
    error = None
    start = time.perf_counter()
    try:
        PATHS[name](cmp, rank, world, device)
        if device.type == "cuda":
            torch.cuda.synchronize()  # an asynchronous CUDA error belongs to this path
    except Exception as e:  # noqa: BLE001 - recorded; the other paths still run
        error = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    seconds = time.perf_counter() - start
    mine = (cmp.max_abs, cmp.max_rel, [f"rank {rank}: {f}" for f in cmp.failures], error)
    row = {"path": name, "seconds": round(seconds, 3), "world": world, "device": str(device),
           "backend": dist.get_backend(), "torch": torch.__version__, "group_broken": False}
    try:
        every = agree_on(dist.group.WORLD, f"nccl path {name}", value=mine)
    except Exception as e:  # noqa: BLE001 - a rank left mid-path: the group is out of step
        row["group_broken"] = True
        error = (error or "") + f"\nrank {rank}: the ranks could not agree ({type(e).__name__}: {e})"
        every = [mine[:3] + (error,)]
    failures = [f for _, _, fs, _ in every for f in fs]
    errors = [e for *_, e in every if e is not None]
    return dict(row, passed=not failures and not errors,
                max_abs_diff=max(a for a, *_ in every), max_rel_diff=max(r for _, r, *_ in every),
                failures=failures[:10], n_failures=len(failures), errors=errors)


def skipped(name: str, broken_by: str) -> dict:
    """The row of a path not run: an earlier one left the group out of step."""
    return {"path": name, "passed": False, "max_abs_diff": None, "max_rel_diff": None,
            "seconds": 0.0, "failures": [], "n_failures": 0,
            "errors": [f"not run: the process group broke in {broken_by}"]}


def report(row: dict, out) -> None:
    verdict = "PASS" if row["passed"] else "FAIL"
    diffs = ("-", "-") if row["max_abs_diff"] is None else (
        f"{row['max_abs_diff']:.3e}", f"{row['max_rel_diff']:.3e}")
    print(f"{row['path']:<15} {verdict}  {diffs[0]}  {diffs[1]}  {row['seconds']:.2f}", flush=True)
    for line in row["failures"][:3] + row["errors"]:
        print("    " + line.rstrip().replace("\n", "\n    "), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_group(args)
    rank = dist.get_rank()
    passed = True
    out = None
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        out = open(args.out / "nccl_paths.jsonl", "w")
    try:
        broken_by = None
        for name in args.paths:
            row = skipped(name, broken_by) if broken_by else run_path(name, device, name == args.perturb)
            if row.get("group_broken"):
                broken_by = name
            passed &= row["passed"]
            if out is not None:
                report(row, out)
    finally:
        if out is not None:
            out.close()
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
