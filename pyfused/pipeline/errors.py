"""Errors that reach every rank of the pipeline group, so none is left waiting on a transfer.

Two moments need it, both one ``pyfused.comm.agree_on``:
  * before a step (``agree_step``): the arguments of every rank are exchanged in one fixed-size
    signature (``pyfused.comm.exchange``) and checked by a pure function of all of them, so every
    rank raises the identical ``InputError`` before any transfer. A problem that a rank found on its
    own while building its stage (a wrong type, say) travels as the agreement's error: every rank
    raises the first one, naming its rank.
  * after a step (``raise_if_any``): a stage that failed mid-step (its module raised, or returned a
    shape other than the one agreed) keeps running the schedule with zeros in place of its results,
    so every transfer still has its partner; at the end one fixed-size agreement tells every rank
    whether any rank failed, and all raise the same ``PipelineError``.

Both are collectives, which gloo bounds by the group's current timeout. The moments
``pipeline.agreement`` and ``pipeline.end`` (``:before`` / ``:after``) are fault points
(``pyfused.comm.faults.fault_point``) for the fault tests.

With ``pyfused.comm.set_validation(False)`` neither exchange happens: a rank raises its own error
alone, and its peers may then wait, as they would with plain torch.distributed.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from .. import comm
from ..comm.faults import fault_point


class PipelineError(RuntimeError):
    """A stage failed during a step; raised with the same message on every rank of the group."""


def agree_step(pg, name: str, ints: Sequence[int], tensors: Sequence[Optional[torch.Tensor]],
               local_error: Optional[str],
               check: Callable[[List[comm.Signature]], Optional[str]]) -> List[comm.Signature]:
    """Exchange this rank's signature; raise the same ``InputError`` everywhere on any problem.

    ``ints[0]`` of every signature is 1 where that rank has a local error (the layout the steps'
    checks index). ``check`` sees all signatures (only this rank's when validation is off) once no
    rank has a local error."""
    sig = comm.Signature(comm.op_code(name), (int(local_error is not None), *ints),
                         tuple(comm.TensorMeta.of(t) for t in tensors))

    def fail(failed, world):
        where = f"rank {failed[0][0]}: " if world > 1 else ""
        return comm.InputError(f"pyfused.{name}: {where}{failed[0][1]}")

    fault_point("pipeline.agreement:before")
    sigs = comm.exchange(pg, sig, local_error, fail)
    fault_point("pipeline.agreement:after")
    msg = comm.validate.differing_ops(pg, sigs, "the pipeline call") or check(sigs)
    if msg is not None:
        raise comm.InputError(f"pyfused.{name}: {msg}")
    return sigs


def raise_if_any(pg, local_error: Optional[str]) -> None:
    """Raise ``PipelineError`` on every rank if any rank has ``local_error`` (one fixed-size
    ``agree_on``)."""
    if comm.world_size(pg) == 1 or not comm.validation_enabled():
        if local_error is not None:
            raise PipelineError(local_error)
        return
    fault_point("pipeline.end:before")
    comm.agree_on(pg, "pipeline end-of-step agreement", error=local_error, width=0,
                  fail=_step_failed)
    fault_point("pipeline.end:after")


def _step_failed(failed, world) -> PipelineError:
    others = [r for r, _ in failed[1:]]
    extra = f" (ranks {others} failed too)" if others else ""
    return PipelineError(f"rank {failed[0][0]}: {failed[0][1]}{extra}")
