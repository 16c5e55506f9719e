"""Stream-ordered signal flags: the handshake the fused kernels build on.

A flag array is a 1-D int32 tensor (``new_flags``). One stream publishes a buffer, another stream
-- on the same GPU, on a peer GPU that maps the memory, or in another process through IPC or
symmetric memory -- orders itself after that publication::

    producer stream P:  kernels writing data;   signal_flag(flags, i, epoch)
    consumer stream C:  wait_flag(flags, i, epoch);   kernels reading data

Contract (CUDA; the kernels and the proof sketch are in csrc/flags_cuda.cu):

* ``signal_flag`` runs on P's current stream after all work enqueued before it: a one-thread kernel
  issues a system-scope fence, then stores ``epoch`` into ``flags[i]`` with release semantics at
  system scope. Whoever reads the new value also sees everything P wrote before it.
* ``wait_flag`` makes C's current stream wait: a one-thread kernel spins on ``flags[i]`` with
  system-scope acquire loads until it is ``>= epoch``, then fences; work enqueued on C after the
  wait starts only after that, so it reads the data P published. The host does not block.
* Flags only grow: step k signals ``base + k`` and waits for ``>= base + k``; nothing clears a flag
  between uses. Reset (``flags.zero_()``) only when no signal or wait on it is in flight.
* A wait whose signal can only come after it (same stream; a stream waiting on an event recorded
  after the wait) is a deadlock: after ``timeout_ms`` (schema default 60000; 0 = forever) the kernel
  prints the flag and traps. The CUDA context is then lost and the next synchronizing call raises:
  a loud failure instead of a hang.

CPU tensors run the same op schema with plain semantics: ``signal_flag`` stores at once; ``wait_flag``
cannot block (nothing runs beside the caller that could set the flag), so it raises ``RuntimeError``
unless the flag already holds ``>= epoch``.

torch.compile keeps both ops in its graphs (``wait_flag`` is registered as side-effectful, so it is
not dropped as dead code), but it functionalizes ``signal_flag``'s write: a backend that does not
re-inplace it writes the flag into a copy and copies it back at the end of the graph. The fused
kernels call these ops eagerly or inside CUDA graphs, where each call is one kernel on the stream.

The ops are ``torch.ops.pyfused.signal_flag`` / ``wait_flag``, registered by the CUDA extension
``pyfused._C`` (csrc/); without it, these wrappers raise ``ExtensionUnavailable`` saying why.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _ext

FLAG_DTYPE = torch.int32


class ExtensionUnavailable(RuntimeError):
    """The signal-flag ops need ``pyfused._C``, which is not built or does not import here."""


# Loaded when this module is imported, not on first call: torch.compile then sees a plain constant
# here instead of tracing into an import.
_AVAILABLE = _ext.available()


def _ops():
    if not _AVAILABLE:
        raise ExtensionUnavailable(f"signal flags need the CUDA extension: {_ext.load_error()}")
    return torch.ops.pyfused


def new_flags(count: int, device=None) -> torch.Tensor:
    """``count`` flags, all 0, on ``device`` (for peers to see them, allocate them in memory they
    map: symmetric memory or an IPC-shared buffer)."""
    return torch.zeros(count, dtype=FLAG_DTYPE, device=device)


def signal_flag(flags: torch.Tensor, index: int, value: int) -> None:
    """``flags[index] = value``, ordered after the work enqueued so far on the current stream of
    ``flags.device``, with release semantics at system scope (CPU: a plain store, done now)."""
    _ops().signal_flag(flags, index, value)


def wait_flag(flags: torch.Tensor, index: int, value: int, timeout_ms: Optional[int] = None) -> None:
    """Make the current stream of ``flags.device`` wait until ``flags[index] >= value``.

    ``timeout_ms``: None takes the op's default (60 s); 0 waits forever. CPU: returns if the flag
    is already ``>= value``, raises ``RuntimeError`` otherwise (see the module docstring)."""
    if timeout_ms is None:
        _ops().wait_flag(flags, index, value)
    else:
        _ops().wait_flag(flags, index, value, timeout_ms)
