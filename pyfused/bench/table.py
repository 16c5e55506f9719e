"""The CLI's printed table: one rich table per suite, nccl-tests style (a row per point, times and
bandwidths side by side). The same rows go, unformatted, to the CSV/JSON files."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

from .harness import ROW_COLUMNS

# column -> (header, format). Columns a suite leaves out are not shown.
DISPLAY = {
    "shape": ("shape", "{}"),
    "dtype": ("dtype", "{}"),
    "method": ("method", "{}"),
    "transport": ("transport", "{}"),
    "time_ms": ("time ms", "{:.3f}"),
    "tflops": ("TFLOP/s", "{:.3f}"),
    "algbw_GBps": ("algbw GB/s", "{:.2f}"),
    "busbw_GBps": ("busbw GB/s", "{:.2f}"),
    "speedup": ("speedup", "{:.2f}x"),  # vs the suite's baseline: unfused in the op suites
    "speedup_vs_torch_tp": ("speedup vs torch-tp", "{:.2f}x"),
    "overlap_eff": ("overlap eff", "{:.2f}"),
}
# Columns that describe the run, not the point: shown once in the table's caption.
RUN_COLUMNS = ("device", "backend", "world", "torch", "nccl", "commit", "time", "validate",
               "warmup", "iters", "threads", "quick", "suite")
# Extra columns of a suite's rows shown after the known ones (at most this many).
MAX_EXTRA = 4
NOTE_WIDTH = 48
SHAPE_WIDTH = 30
HIDDEN = {"m", "n", "k", "op", "status", "note", "tokens", "hidden", "ffn", "sequence_parallel"}
# A ratio's interval (``<ratio>_lo`` / ``<ratio>_hi``): in the CSV and JSON, and in
# ``benchmarks.compare_runs``, not in the console table, where it would crowd out the suite's columns.
INTERVAL_SUFFIXES = ("_lo", "_hi")


def fmt(value: Any, pattern: str = "{}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and pattern == "{}":
        pattern = "{:.4g}"
    try:
        return pattern.format(value)
    except (ValueError, TypeError):
        return str(value)


ALWAYS = ("shape", "dtype", "method", "transport", "time_ms")


def columns_of(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The known columns some row has a value in (a column empty in every row is left out), then a
    few of the suite's own."""
    present = {c for r in rows for c in r if c in ALWAYS or fmt(r[c]) != ""}
    cols = [c for c in DISPLAY if c in present]
    extra = [c for r in rows for c in r
             if c not in DISPLAY and c not in RUN_COLUMNS and c not in HIDDEN
             and c not in ROW_COLUMNS and not c.endswith(INTERVAL_SUFFIXES)]
    seen: List[str] = []
    for c in extra:
        if c not in seen:
            seen.append(c)
    return cols + seen[:MAX_EXTRA]


def note_of(row: Dict[str, Any]) -> str:
    status = str(row.get("status", "ok"))
    note = str(row.get("note", "") or "")
    if status != "ok":
        return status + (f"; {note}" if note else "")
    return note


def render(suite: str, rows: List[Dict[str, Any]], console) -> None:
    from rich.table import Table
    from rich.text import Text

    first = rows[0] if rows else {}
    caption = ", ".join(f"{k}={first[k]}" for k in ("device", "world", "backend", "torch", "commit",
                                                    "validate", "iters") if k in first)
    table = Table(title=Text(suite, style="bold"), caption=Text(caption), caption_justify="left",
                  show_lines=False, header_style="bold")
    cols = columns_of(rows)
    for c in cols:
        header = DISPLAY.get(c, (c, ""))[0]
        numeric = c in ("time_ms", "tflops", "algbw_GBps", "busbw_GBps", "speedup",
                        "speedup_vs_torch_tp", "overlap_eff")
        table.add_column(header, justify="right" if numeric else "left", overflow="fold",
                         no_wrap=c in ("method", "transport", "dtype"),
                         max_width=SHAPE_WIDTH if c == "shape" else None)
    # Notes (auto's choice, why a method is unavailable) are cut to one line here; the files keep
    # them whole.
    table.add_column("note", overflow="ellipsis", no_wrap=True, max_width=NOTE_WIDTH)
    prev_shape = None
    for row in rows:
        same_shape = prev_shape is not None and row.get("shape") == prev_shape
        if prev_shape is not None and not same_shape:
            table.add_section()
        prev_shape = row.get("shape")
        status = str(row.get("status", "ok"))
        style = "red" if status.startswith("failed") else ("dim" if status != "ok" else None)
        cells = [("" if c == "shape" and same_shape else fmt(row.get(c), DISPLAY.get(c, (c, "{}"))[1]))
                 for c in cols]
        # Text, not markup: error messages contain brackets rich would parse as tags.
        table.add_row(*(Text(c) for c in cells), Text(note_of(row)), style=style)
    console.print(table)
