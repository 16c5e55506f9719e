"""Side streams for communication, as no-ops on CPU.

NCCL collectives and p2p already run on NCCL's internal stream, ordered after the current stream at
launch and joined by ``work.wait()``; these helpers are for the copies and kernels pyfused itself
puts on a side stream (symmetric-memory pushes, flag writes). On CPU every helper does nothing, so
the same op code runs on gloo.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

import torch

_streams: Dict[int, "torch.cuda.Stream"] = {}


def comm_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The (cached, high-priority) communication stream of a CUDA device; None on CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _streams[index]


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


def join_comm_stream(device: torch.device) -> None:
    """Make the current stream wait for everything queued on the comm stream (no-op on CPU)."""
    stream = comm_stream(device)
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)


def keep_alive(tensor: torch.Tensor, stream: Optional["torch.cuda.Stream"]) -> None:
    """Tell the caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if stream is not None and tensor.is_cuda:
        tensor.record_stream(stream)
