"""Cross-rank validation: the same clear error on every rank, before any collective.

A collective that some ranks skip hangs the group, so a rank must never raise on its own. Each op
call builds a fixed-size integer *signature* of its inputs (op, method, every tensor's shape, dtype
and device, and whatever else the op must agree on), the ranks exchange signatures with one small
all-gather of fixed length (so the exchange itself cannot mismatch), and every rank
runs the same check over the same list. The error message is a pure function of that list, so every
rank raises the identical ``InputError``. Decisions that must agree across ranks (``method="auto"``,
whether a fast path is usable everywhere) are made from the gathered list too.

Modes (``set_validation(mode)`` or ``PYFUSED_VALIDATE``; the ops and layers follow them, see
docs/ARCHITECTURE.md "Validation modes"):
  * ``"first"`` (default): an op's signatures are exchanged on the first call of each distinct
    (group, op, signature) and the agreed outcome (its method choice included) is remembered
    (``seen``/``remember``); a call whose signature this rank has seen before costs one dictionary
    lookup: no collective, no host sync. The outcome is remembered only after an exchange in which
    every rank's signature passed the check, so every rank of the group holds the same set and ranks
    that pass equal signatures always decide alike. Guarded: any bad input on a call whose signature
    is new on every rank (the first call of a shape, method, option...), and a bad input on one rank
    while the others pass a signature that is new to them too. Not guarded: a rank whose signature is
    new while the others repeat one already seen (it enters the exchange, they enter the op's
    collective), or ranks that each repeat a different seen signature (each runs its own collective).
    Those mismatched collectives end when the process group's timeout expires (``timeout=`` of
    ``init_process_group`` / ``new_group``): a bounded error, never an unbounded hang. ``"always"``
    catches them with the same ``InputError`` everywhere.
  * ``"always"``: exchange on every call (one small all-gather per call); for debugging.
  * ``"off"``: local checks only, no exchange: ranks that disagree run mismatched collectives, as
    with plain torch.distributed.
``PYFUSED_VALIDATE`` takes the mode's name, or ``1`` (= ``first``) and ``0`` (= ``off``).

The exchange runs on the group's CPU backend where the group has one, and then costs no GPU
synchronisation: with ``init_process_group(backend="cpu:gloo,cuda:nccl")`` (torch's per-device
backends; the groups and DeviceMeshes made from it inherit both) the ops' data goes over NCCL and
their signatures over gloo. On a NCCL-only group the signatures go over NCCL and are read on the host,
so the CPU waits for the GPU work queued before the op, once per exchange; the first such exchange
logs this (INFO). pyfused does not make a gloo mirror of a group by itself: a mirror created lazily by
the group's members alone (torch's ``use_local_synchronization``) advances torch's group counter on
those ranks only, after which the next ``new_group`` gets different names on different ranks and
hangs.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._logging import logger
from . import plans
from .agreement import Fail, agree_on, agree_on_ints
from .group import comm_device, rank, world_size

MAX_DIMS = 8
SIG_LEN = 96

_DTYPES = [
    None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_DEVICES = [None, "cpu", "cuda", "meta", "other"]
_op_names: Dict[int, str] = {}

MODES = ("first", "always", "off")
_MODE_ALIASES = {"1": "first", "true": "first", "on": "first", "yes": "first",
                 "0": "off", "false": "off", "no": "off"}


def _parse_mode(value) -> str:
    if isinstance(value, bool):
        return "first" if value else "off"
    mode = _MODE_ALIASES.get(str(value).strip().lower(), str(value).strip().lower())
    if mode not in MODES:
        raise ValueError(f"validation mode must be one of {MODES} (or 1/0, True/False); got {value!r}")
    return mode


_mode = _parse_mode(os.environ.get("PYFUSED_VALIDATE", "first") or "first")
# (group name, key) -> the agreed outcome of a call whose signature passed the exchange.
_seen: Dict[Tuple[str, Hashable], object] = {}


class InputError(ValueError):
    """Bad input to a pyfused op; raised with the same message on every rank of the group."""


def set_validation(mode="first") -> None:
    """Select the cross-rank check: ``"first"`` (default), ``"always"`` or ``"off"`` (module
    docstring); ``True`` / ``False`` mean ``"first"`` / ``"off"``. Call it on every rank alike.
    Outcomes remembered under another mode are forgotten."""
    global _mode
    _mode = _parse_mode(mode)
    forget_seen()


def validation_mode() -> str:
    return _mode


def validation_enabled() -> bool:
    """Whether signatures are exchanged at all (``"first"`` or ``"always"``)."""
    return _mode != "off"


def seen(pg: Optional[dist.ProcessGroup], key: Hashable):
    """The remembered outcome of a call with this ``key`` on ``pg``, or None (always None in
    ``"always"`` mode, and for a key that cannot be hashed). One dictionary lookup; an op call
    repeated with plain tensors is found earlier still, in the plan cache (pyfused/comm/plans.py)."""
    if _mode == "always":
        return None
    try:
        return _seen.get((pg, key))
    except TypeError:  # an unhashable argument: such a call always takes the exchange
        return None


def remember(pg: Optional[dist.ProcessGroup], key: Hashable, outcome) -> None:
    """Record the outcome of a call that passed the exchange (or, mode ``"off"``, the local check)."""
    if _mode != "always":
        try:
            _seen[(pg, key)] = outcome
        except TypeError:  # unhashable: not remembered, the next such call is checked again
            pass


def forget_seen() -> None:
    """Forget every remembered outcome (e.g. after the tuning cache changed); call on every rank.
    The plan cache (pyfused/comm/plans.py), which only accelerates this record, is cleared too."""
    _seen.clear()
    plans.clear()


_op_codes: Dict[str, int] = {}


def op_code(name: str) -> int:
    code = _op_codes.get(name)
    if code is None:
        code = _op_codes[name] = zlib.crc32(name.encode()) & 0x3FFFFFFF
        _op_names[code] = name
    return code


def op_name(code: int) -> str:
    return _op_names.get(code, f"<op #{code}>")


@dataclass(frozen=True)
class TensorMeta:
    shape: Optional[Tuple[int, ...]]  # None: the tensor was not given
    dtype: Optional[torch.dtype]
    device: Optional[str]

    @staticmethod
    def of(t: Optional[torch.Tensor]) -> "TensorMeta":
        if t is None:
            return TensorMeta(None, None, None)
        dev = t.device.type if t.device.type in _DEVICES else "other"
        return TensorMeta(tuple(t.shape), t.dtype, dev)

    def describe(self) -> str:
        if self.shape is None:
            return "None"
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')} on {self.device}"


@dataclass(frozen=True)
class Signature:
    op: int
    ints: Tuple[int, ...]
    tensors: Tuple[TensorMeta, ...]

    @property
    def name(self) -> str:
        return op_name(self.op)

    def encode(self) -> List[int]:
        out = [self.op, len(self.ints), *self.ints, len(self.tensors)]
        for t in self.tensors:
            if t.shape is None:
                out += [0] * (4 + MAX_DIMS)
                continue
            ndim = len(t.shape) if len(t.shape) <= MAX_DIMS else -1
            shape = list(t.shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(t.shape), MAX_DIMS))
            dt = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
            out += [1, ndim, *shape, dt, _DEVICES.index(t.device)]
        if len(out) > SIG_LEN:
            raise ValueError(f"signature of {self.name} too long ({len(out)} > {SIG_LEN})")
        return out + [0] * (SIG_LEN - len(out))

    @staticmethod
    def decode(v: Sequence[int]) -> "Signature":
        op, n_ints = v[0], v[1]
        ints = tuple(v[2:2 + n_ints])
        pos = 2 + n_ints
        n_t = v[pos]
        pos += 1
        tensors = []
        for _ in range(n_t):
            present, ndim = v[pos], v[pos + 1]
            shape = v[pos + 2:pos + 2 + MAX_DIMS]
            dt, dev = v[pos + 2 + MAX_DIMS], v[pos + 3 + MAX_DIMS]
            pos += 4 + MAX_DIMS
            if not present:
                tensors.append(TensorMeta(None, None, None))
                continue
            dims = tuple(shape[:ndim]) if ndim >= 0 else (-1,) * (MAX_DIMS + 1)
            tensors.append(TensorMeta(dims, _DTYPES[dt] if dt >= 0 else None, _DEVICES[dev]))
        return Signature(op, ints, tuple(tensors))


_gpu_sync_noted = False


def _note_gpu_sync(pg: dist.ProcessGroup) -> None:
    """Say once per process why validation waits for the GPU here, and how to avoid it."""
    global _gpu_sync_noted
    if _gpu_sync_noted:
        return
    _gpu_sync_noted = True
    logger.info("pyfused: group %s has no CPU backend (%s), so each op's input check goes over it and "
                "the host waits for the GPU work queued before the op; "
                "init_process_group(backend='cpu:gloo,cuda:nccl') runs the check on gloo instead "
                "(no GPU sync), and pyfused.comm.set_validation(False) skips it",
                pg.group_name, dist.get_backend(pg))


def exchange(pg: Optional[dist.ProcessGroup], sig: Signature, error: Optional[str] = None,
             fail: Optional[Fail] = None) -> List[Signature]:
    """Every rank's signature, in group-rank order (just ``[sig]`` for one rank or validation off):
    one fixed-size ``agree_on``. ``error``: a problem this rank found alone, raised on every rank
    by ``fail`` (``agree_on``), before any signature is checked."""
    encoded = sig.encode()
    world = world_size(pg)
    if world == 1 or _mode == "off":  # this rank alone: its own error, no exchange
        if error is not None:
            agree_on(None, sig.name, error=error, fail=fail)
        return [sig]
    dev = comm_device(pg)
    if dev.type == "cuda":
        _note_gpu_sync(pg)
    rows = agree_on_ints(pg, world, sig.name, encoded, SIG_LEN, error, "cross-rank input check",
                         fail, dev)
    return [Signature.decode(r) for r in rows]


def differs(sigs: Sequence[Signature], what: str, key: Callable[[Signature], object],
            show: Callable[[Signature], str] = None) -> Optional[str]:
    """A message naming the first rank whose ``key`` differs from rank 0's, or None."""
    show = show or (lambda s: str(key(s)))
    for r, s in enumerate(sigs[1:], start=1):
        if key(s) != key(sigs[0]):
            return f"{what} differs between ranks: rank 0 has {show(sigs[0])}, rank {r} has {show(s)}"
    return None


def differing_ops(pg: Optional[dist.ProcessGroup], sigs: Sequence[Signature],
                  what: str) -> Optional[str]:
    """A message naming the first rank whose op differs from rank 0's (``what``: "the op called"),
    or None. A rank knows the names of the ops it has called, not the others' (a signature carries
    a code), so when the ops differ -- the same verdict on every rank, from the same list -- every
    rank sends its own op's name (one ``agree_on``, on this error path only)."""
    if all(s.op == sigs[0].op for s in sigs):
        return None
    names = agree_on(pg, "cross-rank input check", op_name(sigs[rank(pg)].op),
                     detail="exchanging the names of differing ops")
    for s, name in zip(sigs, names):
        _op_names.setdefault(s.op, name)
    return differs(sigs, what, lambda s: s.op, lambda s: s.name)


def agree(pg: Optional[dist.ProcessGroup], sig: Signature,
          check: Callable[[List[Signature]], Optional[str]]) -> List[Signature]:
    """Exchange signatures and raise the same ``InputError`` on every rank if ``check`` objects.

    ``check`` sees the list of all ranks' signatures (only this rank's when validation is off) and
    returns an error message or None. It runs after a check that every rank called the same op.
    """
    sigs = exchange(pg, sig)
    msg = differing_ops(pg, sigs, "the op called")
    if msg is None:
        msg = check(sigs)
    if msg is not None:
        raise InputError(f"pyfused.{sig.name}: {msg}")
    return sigs
