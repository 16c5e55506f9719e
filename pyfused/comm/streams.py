"""Side streams for communication, as no-ops on CPU.

NCCL collectives and p2p already run on NCCL's internal stream, ordered after the current stream at
launch and joined by ``work.wait()``; these helpers are for the copies and kernels pyfused itself
puts on a side stream (symmetric-memory pushes, flag writes). On CPU every helper does nothing, so
the same op code runs on gloo.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Hashable, Iterator, List, Optional, Tuple

import torch

_streams: Dict[Tuple[int, Hashable, int], "torch.cuda.Stream"] = {}
# Whose side streams these are: one process is one rank (None), except under virtual ranks
# (pyfused/testing/virtual_ranks.py), where each rank of the process has its own.
_OWNER: contextvars.ContextVar[Hashable] = contextvars.ContextVar("pyfused_stream_owner",
                                                                   default=None)
# At most this many distinct push streams per owner (None: one per peer). Virtual ranks set it: all
# their streams must fit the device's hardware queues (pyfused/testing/virtual_ranks.py).
_PUSH_LIMIT: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("pyfused_push_limit",
                                                                            default=None)


@contextlib.contextmanager
def owned_by(owner: Hashable) -> Iterator[None]:
    """Side streams taken in this context belong to ``owner`` (a virtual rank)."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


@contextlib.contextmanager
def push_limit(limit: Optional[int]) -> Iterator[None]:
    """``push_streams`` in this context hands out at most ``limit`` distinct streams."""
    token = _PUSH_LIMIT.set(limit)
    try:
        yield
    finally:
        _PUSH_LIMIT.reset(token)


def push_slots(count: int, limit: Optional[int]) -> List[int]:
    """The side-stream slot of each of ``count`` pushes: its own (1, 2, ...), or with a ``limit``
    of distinct streams, those ``limit`` slots in turn."""
    distinct = count if limit is None else max(1, min(count, limit))
    return [1 + i % distinct for i in range(count)]


def assign(owner: Hashable, device: torch.device, side: List["torch.cuda.Stream"]) -> None:
    """Give ``owner`` these side streams of ``device``: ``side[0]`` its comm stream, the rest its
    push streams (virtual ranks, whose streams must each have a hardware queue of their own)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for slot, stream in enumerate(side):
        _streams[(index, owner, slot)] = stream


def forget_owner(owner: Hashable) -> None:
    """Drop the cached side streams of ``owner`` (a virtual rank that is done)."""
    for key in [k for k in _streams if k[1] == owner]:
        del _streams[key]


def _side_stream(device: torch.device, slot: int) -> Optional["torch.cuda.Stream"]:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _OWNER.get(), slot)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=index, priority=-1)
    return _streams[key]


def comm_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The (cached, high-priority) communication stream of a CUDA device; None on CPU."""
    return _side_stream(device, 0)


def push_streams(device: torch.device, count: int) -> List[Optional["torch.cuda.Stream"]]:
    """``count`` (cached, high-priority) side streams besides the comm stream, e.g. one per peer so
    that pushes to different peers run concurrently (under ``push_limit``: fewer distinct streams,
    taken in turn); Nones on CPU."""
    return [_side_stream(device, slot) for slot in push_slots(count, _PUSH_LIMIT.get())]


@contextlib.contextmanager
def on_comm_stream(device: torch.device) -> Iterator[Optional["torch.cuda.Stream"]]:
    """Run the body on the comm stream, after the work already queued on the current stream."""
    stream = comm_stream(device)
    if stream is None:
        yield None
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


def join_comm_stream(device: torch.device, *others: Optional["torch.cuda.Stream"]) -> None:
    """Make the current stream wait for everything queued on the comm stream and on ``others``
    (no-op on CPU)."""
    for stream in (comm_stream(device), *others):
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)


def keep_alive(tensor: torch.Tensor, stream: Optional["torch.cuda.Stream"]) -> None:
    """Tell the caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if stream is not None and tensor.is_cuda:
        tensor.record_stream(stream)
