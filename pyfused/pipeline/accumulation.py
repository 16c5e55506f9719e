"""Stage modules that accumulate their gradients over a step's microbatches and reduce them once.

A data-parallel stage module (``pyfused.fsdp.FullyShardedStage``, parallelize's DDP stage) keeps
its gradient reduction off for a step's first microbatches and arms it as the last microbatch's
backward starts (``before_backward``), so it reduces the step's sum once, overlapped with that
backward. That is right only where the last microbatch's backward is the stage's last backward of
the step: the schedules of ``ACCUMULATING_SCHEDULES``, not those that split the backward (their
weight-gradient parts W follow).

The schedules check each stage's module with ``stage_module_problem``: an ``AccumulatingStage``
must run under one of those schedules, with the schedule's microbatch count, and a module holding
fully_shard units must be one when a step has more than one microbatch. The data-parallel packages
build on this module; it imports none of them, and the schedules import no data-parallel package.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

# the schedules whose last microbatch's backward is each stage's last backward of the step
ACCUMULATING_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class _BeforeBackward(torch.autograd.Function):
    """Identity whose backward first runs ``callback()``, then passes the gradient on."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.callback()
        return g, None


def before_backward(x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
    """``x``, such that the backward through it begins with ``callback()``: how a stage module arms
    its gradient reduction at the start of a step's last microbatch's backward."""
    return _BeforeBackward.apply(x, callback)


class AccumulatingStage(nn.Module):
    """A stage module that accumulates its gradients over ``n_microbatches`` per step and reduces
    them once; the stage calls ``begin_step()`` at the start of every step."""

    n_microbatches: int

    def begin_step(self) -> None:
        raise NotImplementedError


def stage_module_problem(module: nn.Module, schedule: str, n_microbatches: int) -> Optional[str]:
    """Why a schedule cannot run the stage module ``module``, which holds fully_shard units, or
    None. Unwrapped units would sync on every microbatch's backward, and the root of the first
    stage (inputs without gradient, so only the end of a backward reduces it) would leave some
    microbatches' gradients unreduced."""
    if isinstance(module, AccumulatingStage):
        kind = type(module).__name__
        if schedule not in ACCUMULATING_SCHEDULES:
            return (f"a {kind} runs under the schedules {ACCUMULATING_SCHEDULES}, not "
                    f"{schedule!r}: with a split backward its last microbatch's input-gradient "
                    f"part B is not the stage's last backward (the weight-gradient parts W follow)")
        if module.n_microbatches != n_microbatches:
            return (f"the {kind} counts {module.n_microbatches} microbatches per step "
                    f"but the schedule runs {n_microbatches}")
        return None
    if n_microbatches > 1:
        return ("the stage's module holds fully_shard units: pass "
                "pyfused.fsdp.FullyShardedStage(module, n_microbatches) as the stage's module, so "
                "that its gradients accumulate over the microbatches and are reduce-scattered "
                "once per step")
    return None
