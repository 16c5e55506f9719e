"""Measure an op's methods on one shape and record the fastest for ``method="auto"``.

``tune(op, a_shape, b_shape, dtype, group)`` is a collective: every rank of ``group`` calls it with
the same arguments. It times each candidate -- unfused, decomposed (for matmul_all_reduce once per
chunk count), fused where it can run -- with the bench harness (``time_interleaved``: the candidates
round-robin, the same fixed number of iterations on every rank, each iteration's time the slowest
rank's, the median of those). Rank 0
then decides (``decide``) and broadcasts the entry, and every rank writes that same entry to its
cache file, so ``auto`` makes the same choice everywhere even if ranks' files were written apart.

"auto never chooses a slower method than unfused on the measured shape" holds by construction:
unfused is always measured, and ``decide`` keeps it unless another candidate's measured time beats
it by more than ``margin`` (default 2%, so that noise between two equal methods keeps the baseline).
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..ops.registry import CHUNKED_OPS as CHUNKED, OPS as SPECS, TUNED_OPS as TUNED
from ..ops.tuned import Entry, key, store

OPS = TUNED  # the ops the tuner measures, read from the registry at each use
# CHUNKED: the ops whose decomposed method takes a chunk count (row pieces of a chunked all-reduce).
NORM_EPS = 1e-6
TUNABLE = ("unfused", "decomposed", "fused")
DEFAULT_CHUNKS = (2, 4, 8)
DEFAULT_MARGIN = 0.02
# (warmup, iters) by device type
DEFAULT_ITERS = {"cpu": (2, 10), "cuda": (5, 20)}

Candidate = Tuple[str, int]  # (method, chunks); chunks 0 = the op's default


def label(candidate: Candidate) -> str:
    method, chunks = candidate
    return f"{method}/c{chunks}" if chunks else method


def decide(times: Dict[Candidate, float], margin: float = DEFAULT_MARGIN) -> Entry:
    """The entry for measured ``times`` (ms): the fastest candidate if it beats unfused by more than
    ``margin`` (a fraction), else unfused. Never slower than unfused on these measurements."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    base = times.get(("unfused", 0))
    if base is None or not math.isfinite(base) or base <= 0:
        raise ValueError(f"decide needs a measured unfused time; got {times}")
    best, best_ms = ("unfused", 0), base
    for cand in sorted(times):  # sorted: ties resolve the same way everywhere
        ms = times[cand]
        if math.isfinite(ms) and 0 < ms < best_ms:
            best, best_ms = cand, ms
    if best != ("unfused", 0) and best_ms < base * (1 - margin):
        return Entry(*best)
    return Entry("unfused", 0)


@dataclass
class TuneResult:
    entry: Entry
    key: str
    times_ms: Dict[str, float]           # label -> median ms (rank 0's view; slowest rank's times)
    skipped: Dict[str, str] = field(default_factory=dict)  # label -> why it could not run
    path: Optional[Path] = None          # the cache file written (None: write=False)

    @property
    def method(self) -> str:
        return self.entry.method

    @property
    def chunks(self) -> int:
        return self.entry.chunks


def _device_for(pg, device) -> torch.device:
    from .. import comm

    if device is not None:
        return torch.device(device)
    if pg is not None:
        return comm.comm_device(pg)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _op_call(op: str, a_shape, b_shape, dtype, device, rank: int, pg) -> Callable[..., object]:
    """``call(method=..., [chunks=...])`` running ``op`` on fixed random inputs of these shapes
    (per-rank a / x; replicated residual and weight, as in a TP model)."""
    gen = torch.Generator().manual_seed(7 + rank)
    a = torch.randn(a_shape, generator=gen).to(device, dtype)
    fn = SPECS[op].function
    if not SPECS[op].gemm:
        shared = torch.Generator().manual_seed(11)
        residual = torch.randn(a_shape, generator=shared).to(device, dtype)
        weight = (1 + 0.1 * torch.randn(b_shape, generator=shared)).to(device, dtype)
        return lambda **kw: fn(a, residual, weight, NORM_EPS, pg, **kw)
    b = (torch.randn(b_shape, generator=gen) * b_shape[0] ** -0.5).to(device, dtype)
    return lambda **kw: fn(a, b, pg, **kw)


def tune(op: str, a_shape: Sequence[int], b_shape: Sequence[int], dtype: torch.dtype = torch.float32,
         group=None, methods: Optional[Sequence[str]] = None, chunks: Optional[Sequence[int]] = None,
         *, warmup: Optional[int] = None, iters: Optional[int] = None,
         margin: float = DEFAULT_MARGIN, device=None,
         timer: Optional[Callable] = None, write: bool = True) -> TuneResult:
    """Measure ``op``'s methods on per-rank inputs a ``a_shape``, b ``b_shape`` and cache the choice.
    For all_reduce_add_rmsnorm ``a_shape`` is x's (and the residual's) and ``b_shape`` the weight's,
    ``(hidden,)``.

    ``methods``: a subset of unfused | decomposed | fused (unfused is always added: it is the
    baseline). ``chunks``: chunk counts to try for the decomposed method of the chunked ops
    (``CHUNKED``; default 2, 4, 8, capped at the row count). ``timer({label: fn}, ctx)
    -> {label: ms}`` replaces the harness's ``time_interleaved`` (tests use it to script timings).
    Returns the agreed entry and the measurements."""
    from .. import comm
    from ..bench.harness import BenchContext, time_interleaved
    from ..ops import MethodUnavailable

    if op not in OPS:
        raise ValueError(f"tune: op must be one of {OPS}, got {op!r}")
    methods = tuple(methods) if methods is not None else TUNABLE
    bad = [m for m in methods if m not in TUNABLE]
    if bad:
        raise ValueError(f"tune: methods must be among {TUNABLE} (auto is what tuning is for); "
                         f"got {bad}")
    a_shape, b_shape = tuple(int(d) for d in a_shape), tuple(int(d) for d in b_shape)
    rows = math.prod(a_shape[:-1])
    if not SPECS[op].gemm and (len(a_shape) < 2 or b_shape != a_shape[-1:]):
        raise ValueError(f"tune({op}): x must be [..., hidden] and the weight "
                         f"[hidden]; got x {a_shape}, weight {b_shape}")
    if op in CHUNKED:
        chunk_list = tuple(sorted({min(int(c), rows) for c in (chunks or DEFAULT_CHUNKS)}))
        if any(c < 1 for c in chunk_list):
            raise ValueError(f"tune: chunks must be positive, got {chunks}")
    elif chunks:
        raise ValueError(f"tune: chunks apply to {' and '.join(CHUNKED)} only (the ring schedules "
                         f"of {op} take one step per rank)")
    else:
        chunk_list = (0,)

    pg = comm.resolve_group(group)
    world, rank = comm.world_size(pg), comm.rank(pg)
    device = _device_for(pg, device)
    backend = "local" if pg is None else ("nccl" if device.type == "cuda" else "gloo")
    w0, i0 = DEFAULT_ITERS.get(device.type, DEFAULT_ITERS["cuda"])
    ctx = BenchContext(rank, world, pg, device, backend, warmup=w0 if warmup is None else warmup,
                       iters=i0 if iters is None else iters)
    timer = timer or time_interleaved

    fn = _op_call(op, a_shape, b_shape, dtype, device, rank, pg)

    candidates = [("unfused", 0)]
    if "decomposed" in methods:
        candidates += [("decomposed", c) for c in chunk_list]
    if "fused" in methods:
        candidates.append(("fused", 0))
    calls: Dict[str, Callable[[], object]] = {}
    skipped: Dict[str, str] = {}
    for method, n_chunks in candidates:
        extra = {"chunks": n_chunks} if op in CHUNKED else {}
        call = (lambda m=method, e=extra: fn(method=m, **e))
        try:
            call()  # validates on every rank; an unavailable method says so on every rank
        except MethodUnavailable as e:
            skipped[label((method, n_chunks))] = str(e)
            continue
        calls[label((method, n_chunks))] = call
    measured = timer(calls, ctx)  # round-robin by default: no candidate favoured by its turn
    times: Dict[Candidate, float] = {c: float(measured[label(c)]) for c in candidates
                                     if label(c) in calls}

    entry_key = key(op, world, a_shape, b_shape, dtype, device)
    value, error = None, None
    if rank == 0:  # rank 0 decides; its decision (or why it could not) reaches every rank
        try:
            entry = decide(times, margin)
        except ValueError as e:
            error = str(e)
        else:
            value = {"method": entry.method, "chunks": entry.chunks,
                     "times_ms": {label(c): ms for c, ms in sorted(times.items())},
                     "skipped": skipped, "margin": margin, "torch": torch.__version__,
                     "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds")}

    def undecided(failed, world) -> RuntimeError:
        return RuntimeError(f"tune({op}, a={a_shape}, b={b_shape}): rank 0 could not decide: "
                            f"{failed[0][1]}")

    value = comm.agree_on(pg, f"tune({op})", value, error, detail="rank 0's decision",
                          fail=undecided)[0]
    path = None
    if write:  # a write that fails on one rank (disk, permissions) fails every rank at once
        path = comm.agree_on_local_work(pg, "writing the tune cache",
                                        lambda: store({entry_key: value}))
    return TuneResult(Entry(value["method"], int(value["chunks"])), entry_key,
                      dict(value["times_ms"]), dict(value["skipped"]), path)
