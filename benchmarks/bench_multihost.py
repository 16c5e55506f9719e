"""Across hosts: the host-aware all-reduce against the flat one, by message size; then one
training step of DDP, ZeRO-2, FSDP and HSDP, pyfused against torch DDP and FSDP2 (flat and HSDP)
in the same run (benchmarks/multihost_steps.py: its rows and columns).

Rows (``method``), per size S (fp32 buffers of 1-64 MiB; ``--quick``: 1 and 4 MiB):
  flat          ``dist.all_reduce`` over the suite's group (gloo's ring over every rank; the
                baseline of ``speedup``)
  hierarchical  pyfused.comm.hierarchical.HostAllReduce over ``pyfused.comm.host_mesh()``:
                reduce-scatter inside each host, all-reduce across hosts, all-gather inside
``speedup`` = T_flat / T_hierarchical (the goal at >= 16 MiB across 2 hosts x 2 ranks on a 1 Gbit/s
link: >= 1.3); ``algbw``/``busbw`` by nccl-tests' all-reduce formula with W = every rank. Extra
columns: ``size_MiB``, ``hosts``, ``ranks_per_host``, ``link`` (the test bed's shaping, from
``MULTIHOST_LINK``, which benchmarks/multihost_testbed.py sets). Before timing, the two results are
compared on every rank (integer values, so any summation order is exact); the two variants
alternate iteration by iteration (harness.time_interleaved).

Where the suite's ranks share one host it returns one ``skipped`` row: there is no network to
spare. Run it on the namespace test bed (docs/MULTIHOST.md)::

    python -m benchmarks.multihost_testbed --hosts 2 --rate 1gbit -- \\
        -m pyfused.bench --suites multihost --out bench_out/multihost

Rank 0 draws ``multihost_allreduce.png`` (time and speedup against size) into the output folder
from the rows; ``python -m benchmarks.bench_multihost multihost.json [out.png]`` redraws it from a
results file.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from pyfused import comm
from pyfused._logging import logger
from pyfused.bench.harness import LINK_ENV, BenchContext, op_row, time_interleaved
from pyfused.comm.hierarchical import HostAllReduce

from . import multihost_steps

MULTI_RANK = True
MIB = 1 << 20
SIZES_MIB = (1, 2, 4, 8, 16, 32, 64)
QUICK_SIZES_MIB = (1, 4)
PLOT = "multihost_allreduce.png"


def _check_equal(reduce: HostAllReduce, numel: int, ctx: BenchContext) -> None:
    """The host-aware sum equals the flat one on every rank (small integers: exact in any order)."""
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(-8, 8, (numel,), generator=g).float().to(ctx.device)
    flat = x.clone()
    dist.all_reduce(flat, group=ctx.group)
    ok = torch.tensor([int(torch.equal(reduce(x), flat))], device=ctx.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctx.group)
    if not ok.item():
        raise AssertionError(f"the host-aware all-reduce of {numel} elements differs from the flat one")


def run(ctx: BenchContext) -> List[Dict]:
    layout = comm.host_layout(ctx.group)
    common = dict(dtype=torch.float32, transport=ctx.transport, collective="all_reduce",
                  hosts=len(layout.names), ranks_per_host=layout.ranks_per_host,
                  link=os.environ.get(LINK_ENV, ""))
    if not layout.spans_hosts or layout.ranks_per_host in (None, 1):
        why = (f"needs several hosts with the same number (>= 2) of ranks each; here "
               f"{layout.describe()} (run it on the test bed: docs/MULTIHOST.md)")
        return [op_row(ctx, shape="-", method="hierarchical", ms=None, status=f"skipped: {why}",
                       **common)]
    reduce = HostAllReduce(comm.host_mesh())
    rows: List[Dict] = []
    for mib in QUICK_SIZES_MIB if ctx.quick else SIZES_MIB:
        numel = mib * MIB // 4
        _check_equal(reduce, numel, ctx)
        flat_buf = torch.zeros(numel, device=ctx.device)
        host_buf = torch.zeros(numel, device=ctx.device)
        piece = torch.empty(numel // reduce.ranks_per_host, device=ctx.device)
        times = time_interleaved({
            "flat": lambda: dist.all_reduce(flat_buf, group=ctx.group),
            "hierarchical": lambda: reduce(host_buf, piece),
        }, ctx)
        for method, ms in times.items():
            rows.append(op_row(ctx, shape=f"{mib} MiB", method=method, ms=ms, nbytes=mib * MIB,
                               t_baseline=times["flat"], size_MiB=mib, **common))
    if ctx.rank == 0:
        out = Path(ctx.options.get("out") or "bench_out")
        note = draw(rows, out / PLOT)
        for row in rows:
            row["plot"] = "" if note else str(out / PLOT)
    columns = {k: common[k] for k in ("hosts", "ranks_per_host", "link")}
    return rows + multihost_steps.run(ctx, **columns)


def draw(rows: List[Dict], png: Path) -> str:
    """Time and speedup against message size; returns "" or why nothing was drawn (a picture
    never fails the measurements)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        rows = [r for r in rows if r.get("size_MiB")]  # the all-reduce rows, not the steps'
        by_method: Dict[str, Dict[float, float]] = {}
        for r in rows:
            if r.get("time_ms") and r["time_ms"] == r["time_ms"]:
                by_method.setdefault(r["method"], {})[r["size_MiB"]] = r["time_ms"]
        fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(10, 4))
        for method, points in sorted(by_method.items()):
            sizes = sorted(points)
            ax_t.plot(sizes, [points[s] for s in sizes], marker="o", label=method)
        speed = {r["size_MiB"]: r["speedup"] for r in rows if r["method"] == "hierarchical"}
        ax_s.plot(sorted(speed), [speed[s] for s in sorted(speed)], marker="o")
        ax_s.axhline(1.0, color="grey", lw=0.8)
        ax_s.axhline(1.3, color="grey", lw=0.8, ls="--")
        first = rows[0]
        title = (f"{first.get('hosts')} hosts x {first.get('ranks_per_host')} ranks, "
                 f"link {first.get('link') or 'unshaped'}")
        for ax in (ax_t, ax_s):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (MiB, fp32)")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("all-reduce time (ms, median)")
        ax_t.legend()
        ax_s.set_ylabel("flat / hierarchical")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return ""
    except Exception as e:  # noqa: BLE001 - see the docstring
        note = f"plot skipped: drawing it raised {type(e).__name__}: {e}"
        logger.warning("bench multihost: %s", note)
        return note


if __name__ == "__main__":
    results = Path(sys.argv[1])
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else results.with_name(PLOT)
    why = draw([r for r in json.loads(results.read_text()) if r.get("status") == "ok"], target)
    print(why or f"wrote {target}")
