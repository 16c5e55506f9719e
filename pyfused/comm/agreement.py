"""Ranks agreeing on a local outcome: ``agree_on``, the one way pyfused makes them agree.

A rank's *outcome* is a value it computed alone (a fingerprint, a host name, a decision) or an
error it met alone (a file it could not write, an input it refuses). Every rank of the group calls
``agree_on(pg, what, value, error)`` and gets the same answer: the list of every rank's value, in
group-rank order; or, when any rank brought an error, the same exception on every rank, naming the
ranks that failed and the first one's message. Without it a rank that failed alone would raise on
its own, and its peers would wait at their next collective until the group's timeout.

Two transports, one contract:

* objects (``width=None``): one ``all_gather_object`` of every rank's (value, error) pair. For
  anything picklable, where the call is rare (construction, a file, the end of a suite).
* fixed-size integers (``width=n``): ``value`` is ``n`` ints (a sequence, or an int64 tensor on
  the device it was computed on); one ``all_gather_single`` of ``[*value, failed]`` rows on the
  group's control device, the error texts gathered only when some rank failed. For the hot paths
  (an op's cross-rank input check) and per-step checks: no pickling, a fixed message size, so the
  exchange itself cannot mismatch.

Bounded: every wait is a torch.distributed collective, which the group's timeout bounds; a dead or
frozen peer raises ``PeerFailure`` naming ``what`` (and ``detail``) on the surviving ranks.

What is agreed on (a module's fingerprint, a pipeline step's ints, a signature) is each package's
own business; how is this module's. ``agree_on_ints`` is ``agree_on``'s fixed-size path, which
the op validation's exchange calls directly; ``agree_on_local_work`` is the common case of running
local work and agreeing on whether it failed.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.distributed as dist

from .collectives import all_gather_single
from .faults import Detail, failures_named
from .group import comm_device, world_size

T = TypeVar("T")
Failed = List[Tuple[int, str]]  # (group rank, its error message) of every rank that failed
# builds the exception every rank raises from the failed ranks and the group's size
Fail = Callable[[Failed, int], BaseException]


class LocalWorkError(RuntimeError):
    """Local work (a file, a plot, an import) failed on some rank; raised on every rank at once.
    ``failed``: (group rank, message) of every rank that failed, in rank order."""

    def __init__(self, message: str, failed: Optional[Failed] = None):
        super().__init__(message)
        self.failed = list(failed or [])


def failure_message(what: str, failed: Failed, world: int) -> str:
    """``<what> failed on rank r (and on ranks [...]): <rank r's message>`` (no rank on one rank)."""
    where = f" on rank {failed[0][0]}" if world > 1 else ""
    others = f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    return f"{what} failed{where}{others}: {failed[0][1]}"


def agree_on(pg: Optional[dist.ProcessGroup], what: str, value=None, error: Optional[str] = None,
             *, width: Optional[int] = None, detail: Detail = "", fail: Optional[Fail] = None,
             device: Optional[torch.device] = None) -> list:
    """Every rank's ``value`` in group-rank order, the same list on every rank of ``pg``; or, if any
    rank passed an ``error``, ``fail(failed, world)`` raised on every rank (default: a
    ``LocalWorkError`` with ``failure_message``). Every rank of ``pg`` must call it alike.

    ``width``: ``value`` is that many ints, exchanged in one fixed-size all-gather, and each rank's
    value comes back as a list of ints (module docstring); None: any picklable value.
    ``what`` / ``detail`` name the agreement in the ``PeerFailure`` of a dead or frozen peer.
    ``device``: where the fixed-size rows go (default ``comm_device(pg)``, given by a caller that
    knows it already). One rank (or ``pg`` None): no collective."""
    if width is not None:
        if _count(value) != width:
            raise ValueError(f"agree_on({what!r}): value has {_count(value)} ints, width is {width}")
        return agree_on_ints(pg, world_size(pg), what, value, width, error, detail, fail, device)
    world = world_size(pg)
    pairs = [(value, error)]
    if world > 1:
        pairs = [None] * world
        with failures_named(what, pg, detail):
            dist.all_gather_object(pairs, (value, error), group=pg)
    _raise_failed(what, [p[1] for p in pairs], fail)
    return [p[0] for p in pairs]


def agree_on_ints(pg, world: int, what: str, value, width: int, error: Optional[str],
                  detail: Detail, fail: Optional[Fail], device: Optional[torch.device]) -> list:
    """``agree_on`` with ``width``, its arguments checked (``world``: the size of ``pg``); the op
    validation's exchange, a hot path, calls it directly."""
    if world == 1:
        _raise_failed(what, [error], fail)
        return [_ints(value)]
    rows = _gather_fixed(pg, world, what, detail, value, width, error is not None,
                         device or comm_device(pg))
    if rows is None:  # some rank failed: its message travels now
        _raise_failed(what, _gather_errors(pg, what, error), fail)
    return rows


def _raise_failed(what: str, errors: Sequence[Optional[str]], fail: Optional[Fail]) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise (fail or _local_work_error(what))(failed, len(errors))


def agree_on_local_work(pg: Optional[dist.ProcessGroup], what: str, fn: Callable[[], T]) -> T:
    """Run ``fn()`` -- work of this rank alone that may fail here and not elsewhere -- then agree
    (``agree_on``): if any rank's ``fn`` raised, every rank raises the same ``LocalWorkError``
    naming the first such rank. Returns ``fn()``'s value."""
    value, error = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - reported on every rank by the agreement
        error = f"{type(e).__name__}: {e}"
    agree_on(pg, f"agreement after {what}", error=error, fail=_local_work_error(what))
    return value


def _local_work_error(what: str) -> Fail:
    return lambda failed, world: LocalWorkError(failure_message(what, failed, world), failed)


def _count(value: Union[None, Sequence[int], torch.Tensor]) -> int:
    return 0 if value is None else value.numel() if isinstance(value, torch.Tensor) else len(value)


def _ints(value: Union[None, Sequence[int], torch.Tensor]) -> List[int]:
    if value is None:
        return []
    return value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value)


def _gather_fixed(pg, world: int, what: str, detail: Detail, value, width: int, failed: bool,
                  device: torch.device) -> Optional[List[List[int]]]:
    """Every rank's ints, or None when some rank failed: one all-gather of ``[*value, failed]``
    rows (``width + 1`` int64 each). The hot path of op validation: no work per row but a pop."""
    if isinstance(value, torch.Tensor):  # stays on its device: no host wait before the exchange
        value = value.reshape(-1).to(torch.int64)
        mine = torch.cat([value, value.new_tensor([int(failed)])]).to(device)
    else:
        mine = torch.tensor(list(value or ()) + [int(failed)], dtype=torch.int64, device=device)
    every = torch.empty(world * (width + 1), dtype=torch.int64, device=device)
    with failures_named(what, pg, detail):
        all_gather_single(every, mine, group=pg)
        rows = every.view(world, width + 1).tolist()
    someone_failed = 0
    for row in rows:
        someone_failed |= row.pop()
    return None if someone_failed else rows


def _gather_errors(pg, what: str, error: Optional[str]) -> List[Optional[str]]:
    """Every rank's error text (after a fixed-size exchange flagged one)."""
    errors: List[Optional[str]] = [None] * world_size(pg)
    with failures_named(what, pg, "exchanging the error messages"):
        dist.all_gather_object(errors, error, group=pg)
    return errors


