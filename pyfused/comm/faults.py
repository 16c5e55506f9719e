"""Naming the pyfused operation a communication failure happened in (see docs/FAULTS.md).

pyfused never waits on a peer by itself: every wait is a ``torch.distributed`` collective, a p2p
transfer or ``Work.wait()``, and those are bounded by the process group's timeout
(``init_process_group(timeout=...)``, ``new_group(timeout=...)``). gloo raises in the waiting call
when a peer's socket closes (a killed rank: at once) or when the timeout passes (a frozen rank);
NCCL's watchdog aborts the communicator, and with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (default 3)
ends the process. pyfused starts no thread, queue or event of its own that could outlive a peer.

What pyfused adds is the *where*: ``failures_named(op, pg, ...)`` wraps the communicating part of
an operation and turns a failure of torch.distributed into ``PeerFailure``, whose message names the
pyfused operation, this rank, the group, the peer when one is known, and the group's timeout; the
original error is its ``__cause__``. On the success path it costs one small object and a
``with`` (about 1 us on a loaded 2-core box, against tens of microseconds for the smallest gloo
collective; docs/FAULTS.md); the message is built only when something failed.

The other half, ranks agreeing on what happened on each of them (an error met on one rank alone,
so that the others raise at once instead of at their next collective's timeout), is
``pyfused.comm.agreement``. ``inherit_default_timeout`` gives a DeviceMesh's groups the default
group's timeout, ``transfer_timeout`` is what a ``Work.wait`` must be given for that timeout to
bound it, and ``wait_bounded`` waits so.

``fault_point(name)`` marks a moment of an operation (``"pipeline.recv:before"``...) at which a test
can make this process kill or stop itself (``strike_at``), so that a fault test hits the same
moment every run; unarmed it is one comparison.
"""
from __future__ import annotations

import datetime
import functools
import inspect
import os
import signal
import time
import weakref
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._logging import logger
from .group import group_from_name

Detail = Union[str, Tuple[object, ...]]  # what the operation was doing: a string, or its parts

# Substrings of the errors torch.distributed raises when a peer is gone or silent, for the plain
# RuntimeErrors that gloo and NCCL raise (torch's own DistError subclasses are recognised by type).
_COMM_MARKERS = ("gloo", "nccl", "timed out", "timeout", "connection", "pair closure", "socket",
                 "peer", "aborted", "broken pipe", "watchdog")


class PeerFailure(dist.DistError):
    """A pyfused operation's communication failed: a peer died, stopped responding for longer
    than the group's timeout, or the group was aborted. The cause is the backend's own error."""

    def __init__(self, message: str, *, op: str, rank: int, peer: Optional[int] = None):
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.peer = peer


# Each group's backend, found once: the search below costs about 10 us (an exception per device
# type the group has no backend for), and a fused call asks for the default group's timeout every
# time. The timeout itself is read from the backend's options at each call: set_timeout changes it.
_BACKENDS: "weakref.WeakKeyDictionary[dist.ProcessGroup, object]" = weakref.WeakKeyDictionary()


def group_timeout(pg: Optional[dist.ProcessGroup]) -> Optional[datetime.timedelta]:
    """The timeout of ``pg``'s backend (what bounds its collectives), or None if unknown."""
    if pg is None:
        return None
    backend = _BACKENDS.get(pg)
    if backend is not None:
        return backend.options._timeout
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            timeout = backend.options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
        _BACKENDS[pg] = backend
        return timeout
    return None


def transfer_timeout(pg: Optional[dist.ProcessGroup], device: torch.device) -> datetime.timedelta:
    """What to pass to ``Work.wait(timeout)`` of a transfer or an asynchronous collective on ``pg``:
    the group's timeout on a CPU backend; ``timedelta(0)`` (no timeout of the wait's own) on CUDA.

    gloo's own clocks do not bound such waits by the group's timeout counted from the wait:

    * a send or receive waited without a timeout is bounded by the timeout the group was *created*
      with: one changed later by ``torch.distributed.set_timeout`` -- as ``inherit_default_timeout``
      changes a DeviceMesh's 30-minute groups -- is ignored, and a frozen peer holds the wait that
      long;
    * a collective's clock starts when one of the group's worker threads (two by default) picks it
      up, so a collective queued behind others that a slow peer joins late -- DDP's status
      exchange behind its gradient buckets -- times out that much later.

    A timeout passed to the wait bounds it from the wait's start, as NCCL's watchdog times every
    collective from its launch. On CUDA a wait with a timeout would block the host until the work
    ends; NCCL's watchdog bounds it there instead (docs/FAULTS.md)."""
    if device.type != "cpu":
        return datetime.timedelta(0)
    return group_timeout(pg) or datetime.timedelta(0)


def wait_bounded(work, pg: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """``work.wait()``, at most the group's timeout from now on a CPU backend (``transfer_timeout``
    says why); past it gloo raises ``RuntimeError: Operation timed out!``, which ``failures_named``
    turns into ``PeerFailure``. ``work``: a ``torch.distributed.Work``, or any handle whose ``wait``
    takes a timeout. ``Work.wait(timeout)`` costs what ``wait()`` costs; reading the group's
    timeout adds a few microseconds, so a caller waiting on many works reads it once
    (``transfer_timeout``) and passes it to each."""
    work.wait(transfer_timeout(pg, device))


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` looks like a failed collective or transfer (not a bug in the local compute)."""
    if isinstance(e, PeerFailure):
        return False  # already named, by an inner operation
    if isinstance(e, dist.DistError):
        return True
    if type(e) is not RuntimeError:
        return False
    text = str(e).lower()
    return any(m in text for m in _COMM_MARKERS)


def describe(op: str, pg: Optional[dist.ProcessGroup], detail: Detail = "",
             peer: Optional[int] = None) -> str:
    """``pyfused.<op> [detail] on rank r of group g (size w), peer p: ...`` -- the context a failure
    message starts with. A tuple ``detail`` is joined with spaces (callers on hot paths pass its
    parts, so that nothing is formatted unless something failed)."""
    if isinstance(detail, tuple):
        detail = " ".join(map(str, detail))
    where = f"pyfused.{op}" + (f" ({detail})" if detail else "")
    if pg is None or not dist.is_initialized():
        return where
    try:
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        grank = dist.get_rank()
    except (RuntimeError, ValueError):
        return where
    where += f" on rank {rank} of group {pg.group_name!r} (size {world}, global rank {grank})"
    if peer is not None:
        where += f", waiting on peer rank {peer}"
    return where


class failures_named:  # noqa: N801 - used as a context manager, reads like one
    """``with failures_named("all_gather_matmul", pg, detail="decomposed"):`` -- re-raise a
    communication failure inside the block as ``PeerFailure`` naming the operation.

    ``peer``: the group rank waited on, when the block waits on one (p2p). Errors that are not
    communication failures (``InputError``, a module's own exception) pass through untouched."""

    __slots__ = ("op", "pg", "detail", "peer")

    def __init__(self, op: str, pg: Optional[dist.ProcessGroup], detail: Detail = "",
                 peer: Optional[int] = None):
        self.op = op
        self.pg = pg
        self.detail = detail
        self.peer = peer

    def __enter__(self) -> "failures_named":
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if e is None or not is_comm_failure(e):
            return False
        raise peer_failure(e, self.op, self.pg, self.detail, self.peer) from e


def peer_failure(e: BaseException, op: str, pg: Optional[dist.ProcessGroup], detail: Detail = "",
                 peer: Optional[int] = None) -> PeerFailure:
    """The ``PeerFailure`` for backend error ``e`` met in ``op``."""
    timeout = group_timeout(pg)
    bound = f"the group's timeout is {timeout.total_seconds():g} s" if timeout else "timeout unknown"
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    message = (f"{describe(op, pg, detail, peer)}: a peer rank died or stopped responding "
               f"({bound}; see docs/FAULTS.md): {type(e).__name__}: {first_line}")
    rank = dist.get_rank(pg) if pg is not None and dist.is_initialized() else 0
    return PeerFailure(message, op=op, rank=rank, peer=peer)


def names_failures(op: str):
    """Decorator form of ``failures_named`` for an op's implementation, whose arguments include its
    group as ``group_name`` (a registered op) or ``pg``, and optionally ``method`` (named in the
    message): one extra call on success."""
    def wrap(fn):
        params = list(inspect.signature(fn).parameters)
        at_group = params.index("group_name" if "group_name" in params else "pg")
        at_method = params.index("method") if "method" in params else None

        @functools.wraps(fn)
        def named(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                if not is_comm_failure(e):
                    raise
                bound = dict(zip(params, args), **kwargs)
                pg = bound.get(params[at_group])
                pg = group_from_name(pg or "") if isinstance(pg, str) or pg is None else pg
                detail = str(bound.get(params[at_method], "")) if at_method is not None else ""
                raise peer_failure(e, op, pg, detail) from e
        # torch.library reads the schema from the signature: give it the types, evaluated in the
        # op's module (its annotations may be strings)
        named.__signature__ = inspect.signature(fn, eval_str=True)
        return named
    return wrap


def inherit_default_timeout(groups) -> None:
    """Give each of ``groups`` the default group's timeout where its own is longer.

    A ``DeviceMesh`` creates the groups of its dimensions (those smaller than the world) with
    torch's default timeout -- 30 minutes on gloo, 10 on NCCL -- whatever
    ``init_process_group(timeout=...)`` said, so a frozen rank would hang its tp or dp peers that
    long. ``parallelize`` calls this on its mesh's groups so that the one timeout the user set bounds
    every wait (``torch.distributed.set_timeout``; logged at INFO)."""
    if not (dist.is_available() and dist.is_initialized()) or not hasattr(dist, "set_timeout"):
        return
    wanted = group_timeout(dist.group.WORLD)
    if wanted is None:
        return
    for pg in groups:
        current = group_timeout(pg)
        if pg is None or pg is dist.group.WORLD or current is None or current <= wanted:
            continue
        dist.set_timeout(wanted, pg)
        logger.info("pyfused: group %r had torch's default timeout %s; set to the default group's %s",
                    pg.group_name, current, wanted)


# ---- deterministic faults, for tests -----------------------------------------------------------
class _Strike:
    __slots__ = ("point", "nth", "action", "before", "seen")

    def __init__(self, point: str, nth: int, action: str, before: Optional[Callable[[str], None]]):
        self.point, self.nth, self.action, self.before, self.seen = point, nth, action, before, 0


_strike: Optional[_Strike] = None
STRIKE_ACTIONS = ("kill", "stop", "sleep")


def strike_at(point: str, nth: int = 1, action: str = "kill",
              before: Optional[Callable[[str], None]] = None) -> None:
    """Make this process strike the ``nth`` time (counted from this call) it passes
    ``fault_point(point)``: ``"kill"`` (SIGKILL), ``"stop"`` (SIGSTOP: frozen, its threads too) or
    ``"sleep"`` (alive, its backend's threads too, but never back); ``before(point)`` runs just
    before (a test records the time there). For fault tests; one strike is armed at a time.
    ``point``: see the ``fault_point`` calls (docs/FAULTS.md lists them)."""
    global _strike
    if action not in STRIKE_ACTIONS or nth < 1:
        raise ValueError(f"strike_at: action must be one of {STRIKE_ACTIONS} and nth >= 1; "
                         f"got {action!r}, {nth}")
    _strike = _Strike(point, nth, action, before)


def disarm() -> None:
    """Forget the strike armed by ``strike_at``."""
    global _strike
    _strike = None


def fault_point(point: str) -> None:
    """A named moment of an operation, where an armed strike (``strike_at``) may hit."""
    if _strike is None or _strike.point != point:
        return
    _strike.seen += 1
    if _strike.seen == _strike.nth:
        _strike_now(_strike, point)


def _strike_now(strike: _Strike, point: str) -> None:
    logger.warning("pyfused: striking (%s) at %s, as strike_at asked", strike.action, point)
    if strike.before is not None:
        strike.before(point)
    if strike.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif strike.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        while True:
            time.sleep(3600)
