"""Errors that reach every rank of the pipeline group, so none is left waiting on a transfer.

Two moments need it:
  * before a step (``agree_step``): the arguments of every rank are exchanged in one fixed-size
    signature (``pyfused.comm.exchange``) and checked by a pure function of all of them, so every
    rank raises the identical ``InputError`` before any transfer. Problems that a rank found on its
    own while building its stage (a wrong type, say) travel as a flag in the signature; when a flag
    is set, every rank gathers the messages (``all_gather_object``) and raises the first one.
  * after a step (``raise_if_any``): a stage that failed mid-step (its module raised, or returned a
    shape other than the one agreed) keeps running the schedule with zeros in place of its results,
    so every transfer still has its partner; at the end one ``all_reduce`` tells every rank whether
    any rank failed, and all raise the same ``PipelineError``.

Both are collectives, which gloo bounds by the group's current timeout. The moments
``pipeline.agreement`` and ``pipeline.end`` (``:before`` / ``:after``) are fault points
(``pyfused.comm.faults.fault_point``) for the fault tests.

With ``pyfused.comm.set_validation(False)`` neither exchange happens: a rank raises its own error
alone, and its peers may then wait, as they would with plain torch.distributed.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..comm.faults import fault_point


class PipelineError(RuntimeError):
    """A stage failed during a step; raised with the same message on every rank of the group."""


def _gather_messages(pg, message: Optional[str]) -> List[Optional[str]]:
    out: List[Optional[str]] = [None] * comm.world_size(pg)
    with comm.failures_named("pipeline error exchange", pg):
        dist.all_gather_object(out, message, group=pg)
    return out


def agree_step(pg, name: str, ints: Sequence[int], tensors: Sequence[Optional[torch.Tensor]],
               local_error: Optional[str],
               check: Callable[[List[comm.Signature]], Optional[str]]) -> List[comm.Signature]:
    """Exchange this rank's signature; raise the same ``InputError`` everywhere on any problem.

    ``ints[0]`` of every signature is the local-error flag. ``check`` sees all signatures (only
    this rank's when validation is off) once no rank has a local error."""
    sig = comm.Signature(comm.op_code(name), (int(local_error is not None), *ints),
                         tuple(comm.TensorMeta.of(t) for t in tensors))
    fault_point("pipeline.agreement:before")
    sigs = comm.exchange(pg, sig)
    fault_point("pipeline.agreement:after")
    msg = comm.validate.differing_ops(pg, sigs, "the pipeline call")
    if msg is None:
        flagged = [r for r, s in enumerate(sigs) if s.ints[0]]
        if flagged:
            messages = _gather_messages(pg, local_error) if len(sigs) > 1 else [local_error]
            where = f"rank {flagged[0]}: " if len(sigs) > 1 else ""
            msg = where + str(messages[flagged[0]])
        else:
            msg = check(sigs)
    if msg is not None:
        raise comm.InputError(f"pyfused.{name}: {msg}")
    return sigs


def raise_if_any(pg, local_error: Optional[str], device: torch.device) -> None:
    """Raise ``PipelineError`` on every rank if any rank has ``local_error`` (one tiny all_reduce)."""
    if comm.world_size(pg) == 1 or not comm.validation_enabled():
        if local_error is not None:
            raise PipelineError(local_error)
        return
    flag = torch.tensor([int(local_error is not None)], dtype=torch.int32, device=device)
    fault_point("pipeline.end:before")
    with comm.failures_named("pipeline end-of-step agreement", pg):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    fault_point("pipeline.end:after")
    if not flag.item():
        return
    messages = _gather_messages(pg, local_error)
    first = next(r for r, m in enumerate(messages) if m is not None)
    others = [r for r, m in enumerate(messages) if m is not None and r != first]
    extra = f" (ranks {others} failed too)" if others else ""
    raise PipelineError(f"rank {first}: {messages[first]}{extra}")
