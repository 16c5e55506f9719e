"""Loading a call's Triton kernels without running them, for W ranks in one CUDA context.

CUDA loads a module into a context only once the context's running kernels have finished
(docs/TESTBED.md, "Calls that wait for the context's kernels"), and Triton loads a kernel's
module at the first launch of each compiled variant. With virtual ranks
(pyfused/testing/virtual_ranks.py), W ranks on the streams of one context, a rank's first launch of
a variant can come while a peer's kernel spins on a flag that this rank sets later in the same
call. The load then waits for the spin, and the spin waits for work that this rank's host thread
has not queued yet, until the fused timeout traps. ``CUDA_MODULE_LOADING=EAGER`` covers the
modules present when CUDA starts (torch's, the extension's), not Triton's, which are compiled and
loaded when a call first needs them.

So a virtual group runs the first call of each function and input signature once in a *preload
pass*: every rank's thread runs the call under ``preloading(barrier)``. Then:

- ``launch`` compiles and loads each Triton kernel and queues nothing;
- the fused code queues none of the kernels that wait on peers (the symmetric-memory barrier, the
  flag waits, the CUDA all-reduce);
- a symmetric-memory barrier becomes ``barrier()``: the rank's stream drains, then the ranks' threads
  meet on the host. The data host code reads after a barrier (the MoE counts) is then what the real
  call sees, so the pass takes the same branches and loads the same kernel variants.

The pass's results are garbage and are dropped. Outside a preload pass ``active()`` is one
thread-local read per launch. On CPU (the Triton interpreter) a preload pass loads nothing; it runs
there only in the tests of the pass itself.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_state = threading.local()


def active() -> bool:
    """Whether this thread is in a preload pass."""
    return getattr(_state, "barrier", None) is not None


@contextmanager
def preloading(barrier: Callable[[], None]) -> Iterator[None]:
    """Run the body as one rank's preload pass; ``barrier()`` meets the other ranks' threads."""
    previous = getattr(_state, "barrier", None)
    _state.barrier = barrier
    try:
        yield
    finally:
        _state.barrier = previous


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; in a preload pass: compile the variant these arguments
    select and load its module, without queueing it."""
    if getattr(_state, "barrier", None) is None:
        kernel[grid](*args, **kwargs)
        return
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # the interpreter (CPU): no module to load
        return
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if compiled is not None:
        compiled._init_handles()


def barrier(device: torch.device) -> None:
    """The preload pass's stand-in for a symmetric-memory barrier: everything this rank queued has
    run, then every rank's thread has got here."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    _state.barrier()
