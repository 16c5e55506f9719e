"""Fresh gloo ranks that may lose one of their own: the launcher of the fault tests.

The shared rank pool (tests/dist_pool.py) cannot lose a rank, so a fault test starts its own ranks
for each case: processes forked from a forkserver that has torch and pyfused imported (a start costs
~0.1 s, not an interpreter's import), joined through a FileStore in the case's folder ``out``.

Each rank runs ``target(rank, out, *args)`` and writes ``rank<r>.json``: what it raised (type,
message, ``op``, ``peer``) and when (``time.monotonic()``, which all processes of one machine share).
The victim calls ``record_strike(out)`` just before it strikes. ``launch`` waits until every survivor
has exited -- at most ``STARTUP_S`` for the strike, then ``bound_s + SLACK_S`` after it -- and kills
every process still there, so a case never leaves one behind (a stopped one included).
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Sequence

import torch
import torch.distributed as dist

STARTUP_S = 120.0  # forkserver start, imports, group join, healthy steps: slow on a loaded box
SLACK_S = 20.0     # past the bound a survivor must raise in, before it is called stuck

_context = None


def _forkserver(preload: Sequence[str]):
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "torch.distributed", "pyfused", *preload])
    return _context


def record_strike(out: Path) -> None:
    (Path(out) / "struck.json").write_text(json.dumps({"t": time.monotonic()}))


def _rank_main(rank: int, world: int, out: str, timeout_s: float, target: Callable, args) -> None:
    torch.set_num_threads(1)
    out_dir = Path(out)
    dist.init_process_group("gloo", store=dist.FileStore(str(out_dir / "store"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        target(rank, out_dir, *args)
        result = {"raised": None}
    except Exception as e:  # noqa: BLE001 - what the survivor raised is the test's subject
        result = {"raised": type(e).__name__, "message": str(e), "t": time.monotonic(),
                  "op": getattr(e, "op", None), "peer": getattr(e, "peer", None),
                  "traceback": traceback.format_exc(limit=-4)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if result["raised"]:
        raise SystemExit(1)  # a plain exit, through the interpreter's and torch's teardown


def launch(target: Callable, args: tuple, *, world: int, victim: int, out: Path, timeout_s: float,
           bound_s: float, preload: Sequence[str] = ()) -> Dict[int, dict]:
    """Run ``target`` on ``world`` fresh gloo ranks (group timeout ``timeout_s``) of which
    ``victim`` strikes; return each survivor's result with ``raise_s`` and ``exit_s`` (seconds
    after the strike) and ``exitcode``. Every process is gone when this returns."""
    ctx = _forkserver(preload)
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(out), timeout_s, target, args),
                         daemon=True) for r in range(world)]
    survivors = [r for r in range(world) if r != victim]
    exited: Dict[int, float] = {}
    struck_file = Path(out) / "struck.json"
    try:
        for p in procs:
            p.start()
        deadline, seen_strike = time.monotonic() + STARTUP_S, False
        while len(exited) < len(survivors) and time.monotonic() < deadline:
            if not seen_strike and struck_file.exists():
                seen_strike, deadline = True, time.monotonic() + bound_s + SLACK_S
            for r in survivors:
                if r not in exited and not procs[r].is_alive():
                    exited[r] = time.monotonic()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    found = {f.name: f.read_text()[:2000] for f in Path(out).glob("rank*.json")}
    if not struck_file.exists():
        raise AssertionError(f"the victim (rank {victim}) never struck; the ranks wrote {found}")
    lingering = sorted(set(survivors) - set(exited))
    assert not lingering, (f"survivors {lingering} still running {bound_s + SLACK_S:g} s after "
                           f"the strike (a hang); the others wrote {found}")
    struck = json.loads(struck_file.read_text())["t"]
    results = {}
    for r in survivors:
        file = Path(out) / f"rank{r}.json"
        assert file.exists(), f"rank {r} exited (code {procs[r].exitcode}) without a result"
        res = json.loads(file.read_text())
        res["raise_s"] = res["t"] - struck if res.get("raised") else None
        res["exit_s"] = exited[r] - struck
        res["exitcode"] = procs[r].exitcode
        results[r] = res
    return results
