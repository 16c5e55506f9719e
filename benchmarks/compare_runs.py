"""Put several runs of the same suites side by side: every row that has a torch peer, its ratio in
each run, the worst run and the spread.

    python -m benchmarks.compare_runs RUN_DIR [RUN_DIR ...] [--suites ddp,pipeline,...]

Each RUN_DIR is an ``--out`` folder of ``python -m pyfused.bench``. The ratio is the one the suite
itself reports against its peer, each the median of per-round paired ratios (docs/BENCH.md says how
each suite estimates it), > 1 when pyfused is faster: ``vs_peer`` (ddp, fsdp, parallelize, tp_mlp;
ZeRO-2 also ``vs_fsdp2``), ``speedup_paired`` (pipeline), ``vs_torch`` (moe) and, for ``overhead``,
``overhead_x`` (pyfused's time per call as a multiple of plain torch's, < 1 better) of the
world-size-1 rows. The output is a Markdown table; ``spread`` is (max - min) / median over the runs.
Where the row has it, a cell also shows the ratio's 95% interval (``<field>_lo`` - ``<field>_hi``,
``harness.median_interval`` of the per-round ratios) and a ``!`` when the whole interval lies on the
losing side: under 1.0 for a ratio against torch, over 1.03 (the per-call goal) for ``overhead_x``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

RATIO_FIELDS = ("vs_peer", "speedup_paired", "vs_torch")  # the first a row has
OVERHEAD_GOAL = 1.03  # overhead_x at world size 1 (docs/BENCH.md)
Key = Tuple[str, str, str]
Ratio = Tuple[float, Optional[float], Optional[float]]  # the ratio and its interval, if recorded


def _with_interval(row: dict, field: str) -> Ratio:
    lo, hi = row.get(f"{field}_lo"), row.get(f"{field}_hi")
    return (float(row[field]), None if lo is None else float(lo), None if hi is None else float(hi))


def _ratio(suite: str, row: dict) -> Optional[Ratio]:
    if row.get("status", "ok") != "ok":
        return None
    if suite == "overhead":
        if row.get("world_size") != 1 or row.get("method") == "torch" or row.get("overhead_x") is None:
            return None
        return _with_interval(row, "overhead_x")
    if row.get("method") in ("torch", "compute alone") or str(row.get("method", "")).startswith("torch"):
        return None
    for field in RATIO_FIELDS:
        if row.get(field) is not None:
            return _with_interval(row, field)
    return None


def ratios(run: Path, suites: Optional[List[str]]) -> Tuple[Dict[Key, Ratio], str]:
    """``{(suite, shape, method): (ratio, low, high)}`` of one run folder, and the commit its rows
    name."""
    found: Dict[Key, Ratio] = {}
    commits = set()
    for path in sorted(run.glob("*.json")):
        suite = path.stem
        if suite == "all" or (suites and suite not in suites):
            continue
        for row in json.loads(path.read_text()):
            value = _ratio(suite, row)
            if value is None:
                continue
            key = (suite, str(row.get("op") or ""), f"{row.get('shape')}: {row.get('method')}")
            found[key] = value
            if row.get("vs_fsdp2") is not None:  # ZeRO-2's second peer
                found[key[:2] + (key[2] + " (vs FSDP2)",)] = _with_interval(row, "vs_fsdp2")
            commits.add(str(row.get("commit", "?")))
    return found, ",".join(sorted(commits)) or "?"


def _cell(suite: str, value: Optional[Ratio]) -> str:
    if value is None:
        return "-"
    ratio, lo, hi = value
    if lo is None or hi is None:
        return f"{ratio:.3f}"
    losing = lo > OVERHEAD_GOAL if suite == "overhead" else hi < 1.0
    return f"{ratio:.3f} ({lo:.2f}-{hi:.2f}){' !' if losing else ''}"


def table(runs: List[Path], suites: Optional[List[str]]) -> str:
    per_run = [ratios(r, suites) for r in runs]
    keys: List[Key] = []
    for found, _ in per_run:
        keys += [k for k in found if k not in keys]
    head = "| suite | row | " + " | ".join(f"run {i + 1}" for i in range(len(runs)))
    lines = [head + " | worst | spread |", "|---|---|" + "---|" * (len(runs) + 2)]
    for key in keys:
        values = [found.get(key) for found, _ in per_run]
        seen = [v[0] for v in values if v is not None]
        worst = max(seen) if key[0] == "overhead" else min(seen)
        spread = (max(seen) - min(seen)) / statistics.median(seen) if len(seen) > 1 else 0.0
        row = " ".join(p for p in key[1:] if p)
        cells = " | ".join(_cell(key[0], v) for v in values)
        lines.append(f"| {key[0]} | {row} | {cells} | {worst:.3f} | {spread:.1%} |")
    commits = "; ".join(f"run {i + 1}: {r} (commit {c})" for i, (r, (_, c)) in
                        enumerate(zip(runs, per_run)))
    return "\n".join(lines) + f"\n\n{commits}\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="--out folders of python -m pyfused.bench")
    p.add_argument("--suites", default="", help="comma-separated suites (default: every one found)")
    args = p.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s] or None
    print(table(args.runs, suites), end="")


if __name__ == "__main__":
    main()
