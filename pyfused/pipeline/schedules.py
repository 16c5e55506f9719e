"""Schedules with torch.distributed.pipelining's API: ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, and the split-backward ones ``ScheduleZBH1``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``;
``.step(*args, target=None, losses=None)`` on every rank.

A step:
  1. one fixed-size exchange of every rank's arguments (``errors.agree_step``): schedule, microbatch
     count, stage placement, the first stage's batch and the last stage's target. Any problem --
     a batch with fewer rows than microbatches, a missing target, ranks that disagree --
     raises the same ``InputError`` on every rank before any transfer;
  2. on the first step, or when the first stage's microbatch shapes change, the metadata pass of
     meta.py agrees on every activation's shape;
  3. the rank runs its part of the plan (plan.py, executor.py) with overlapped transfers;
  4. one ``all_reduce`` of a failure flag: a stage that raised, or returned a shape other than the
     agreed one, fails the step with the same ``PipelineError`` on every rank.
Steps 1 and 4 are skipped with ``pyfused.comm.set_validation(False)``.

Orders of the split-backward schedules: by default the fixed ones (zero_bubble.py, built for equal
F, B and W times). With ``costs=`` a table of (F, B, W) milliseconds per stage, or ``"measure"``
(the first training step runs the fixed order and times every action, costs.py), the orders come
from those costs (cost_orders.py) within the fixed order's activation memory; ``stage_costs`` and
``orders`` show what a step used.

Microbatches: every positional argument (and the target) is split along dim 0 like
``torch.tensor_split(t, n_microbatches)``: when ``n_microbatches`` does not divide the batch ``b``,
the first ``b % n_microbatches`` microbatches get one row more.

Gradients: the last stage backpropagates ``loss_i * rows_i / rows`` for microbatch ``i`` (rows of
the target; ``loss / n_microbatches`` when they are equal) with ``scale_grads=True``, torch's
default, so with a mean-reduced ``loss_fn`` the parameter gradients equal those of one full-batch
step, uneven split included. torch divides ``.grad`` by ``n_microbatches`` after the step instead,
which with an uneven split weights the rows of small microbatches more. pyfused scales the loss, so
gradients already accumulated before ``step`` are left untouched.
"""
from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import comm
from .._logging import logger
from . import meta
from .accumulation import stage_module_problem
from .cost_orders import Costs, as_costs, check_costs
from .costs import CostMeter, agree_costs
from .errors import agree_step, raise_if_any
from .executor import StepRun
from .p2p import Transport, completes_as_group
from .plan import (
    DEFAULT_LOOKAHEAD,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    check_counts,
    choose_plan,
    local_stages,
)
from .stage import PipelineStage, describe

MAX_ARGS = 4       # step arguments described in the per-step signature (more are allowed)
MAX_LOCAL = 8      # stage indices of a rank described in the signature
_UNSUPPORTED = ("args_chunk_spec", "kwargs_chunk_spec", "output_merge_spec")


class _PipelineSchedule:
    _schedule = ""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn=None,
                 scale_grads: bool = True, lookahead: int = DEFAULT_LOOKAHEAD, costs=None,
                 **torch_only):
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            # Without a stage there is no group to report on; this one can only raise here.
            raise TypeError(f"{type(self).__name__} needs pyfused.pipeline.PipelineStage objects")
        self._stages = sorted(stages, key=lambda s: s.stage_index
                              if isinstance(s.stage_index, int) else 0)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None
        self.scale_grads = scale_grads
        self._lookahead = lookahead
        self._pg = self._stages[0].group
        self._device = self._stages[0].device
        self.timeline = None  # a timeline.Recorder: the next step records its events into it
        self._error = next((s.error for s in self._stages if s.error), None)
        given = [k for k in _UNSUPPORTED if torch_only.get(k) is not None]
        unknown = [k for k in torch_only if k not in _UNSUPPORTED + ("backward_requires_autograd",
                                                                      "defer_pp_recv")]
        if self._error is None and (given or unknown):
            self._error = (f"{', '.join(given + unknown)} not supported: pyfused splits every "
                           f"positional tensor argument (and the target) into microbatches "
                           f"along dim 0 and concatenates outputs along dim 0")
        elif self._error is None and torch_only.get("backward_requires_autograd") is False:
            self._error = "backward_requires_autograd=False is not supported"
        if self._error is None and any(s.group is not self._pg or s.device != self._device
                                       for s in self._stages):
            self._error = "all stages of one schedule must share one group and one device"
        if self._error is None and not (isinstance(n_microbatches, int) and n_microbatches >= 1):
            self._error = f"n_microbatches must be a positive int, got {n_microbatches!r}"
        if self._error is None and loss_fn is not None and not callable(loss_fn):
            self._error = "loss_fn must be callable"
        if self._error is None and any(hasattr(m, "_pyfused_fsdp") for s in self._stages
                                       for m in s.submod.modules()):
            self._error = next(filter(None, (stage_module_problem(s.submod, self._schedule,
                                                                  n_microbatches)
                                             for s in self._stages)), None)
        self._p = comm.world_size(self._pg)
        self._rank = comm.rank(self._pg)
        self._transport = Transport(self._pg, self._device)
        self._grouped = completes_as_group(self._pg, self._device)
        self._meta_key = None
        self._plans: Dict[tuple, Any] = {}
        self._measure = isinstance(costs, str) and costs == "measure"
        self._costs: Optional[Costs] = None if costs is None or self._measure else costs
        if self._error is None and costs is not None and not self._measure:
            err = check_costs(costs, self._stages[0].num_stages)
            self._error = f"{err}, or \"measure\"" if err else None
            self._costs = as_costs(costs) if err is None else None
        self.orders: Optional[Dict[int, List]] = None  # every rank's order in the last step

    @property
    def stage_costs(self) -> Optional[Costs]:
        """(F, B, W) milliseconds per stage that the orders are built from (None: unit costs)."""
        return self._costs

    # --- torch-compatible entry points ---------------------------------------------------------

    def step(self, *args, target=None, losses: Optional[list] = None, return_outputs: bool = True,
             **kwargs):
        """One training step; returns the merged output on the rank of the last stage."""
        return self._step(args, target, losses, return_outputs, kwargs, self._has_backward)

    def eval(self, *args, target=None, losses: Optional[list] = None, **kwargs):
        """One forward-only step (losses are computed when a target is given)."""
        with torch.no_grad():
            return self._step(args, target, losses, True, kwargs, False)

    # --- the step ------------------------------------------------------------------------------

    def _local_error(self, args, target, losses, kwargs, backward: bool) -> Optional[str]:
        if self._error:
            return self._error
        if kwargs:
            return (f"keyword arguments {sorted(kwargs)} are not supported: pass the first stage's "
                    f"inputs positionally (torch's loss_kwargs/arg_mbs/kwarg_mbs have no equivalent)")
        if backward and not torch.is_grad_enabled():
            return "step() needs gradients enabled; use eval() under torch.no_grad()"
        if any(s.is_first for s in self._stages) and not all(isinstance(a, torch.Tensor)
                                                              for a in args):
            return "the first stage's step() arguments must all be tensors"
        if target is not None and not isinstance(target, torch.Tensor):
            return f"target must be a tensor, got {type(target).__name__}"
        if losses is not None and not isinstance(losses, list):
            return f"losses must be a list, got {type(losses).__name__}"
        return None

    def _signature(self, args, target, backward: bool):
        indices = [s.stage_index if isinstance(s.stage_index, int) else -1 for s in self._stages]
        num_stages = self._stages[0].num_stages if isinstance(self._stages[0].num_stages, int) else -1
        m = self._n_microbatches if isinstance(self._n_microbatches, int) else -1
        first = any(s.is_first for s in self._stages)
        shown = [a if first and isinstance(a, torch.Tensor) else None for a in args[:MAX_ARGS]]
        shown += [None] * (MAX_ARGS - len(shown))
        # every argument's shape, hashed, so that a change beyond the first MAX_ARGS re-runs the
        # shape pass on every rank
        arg_hash = zlib.crc32(repr([(tuple(a.shape), str(a.dtype)) for a in args
                                    if isinstance(a, torch.Tensor)]).encode()) & 0x3FFFFFFF
        ints = (SCHEDULES.index(self._schedule), m, num_stages, len(self._stages), self._p,
                int(backward), int(bool(self.scale_grads)), len(args) if first else 0,
                int(isinstance(target, torch.Tensor)), arg_hash if first else 0, len(indices),
                *indices[:MAX_LOCAL], self._costs_code())
        return ints, shown + [target if isinstance(target, torch.Tensor) else None]

    def _check(self, sigs: List[comm.Signature], backward: bool) -> Optional[str]:
        """Pure in ``sigs`` (this rank's alone when validation is off): the same verdict everywhere."""
        ranks = range(len(sigs)) if len(sigs) == self._p else [self._rank]
        names = ("schedule", "n_microbatches", "num_stages", "stages per rank", "group size",
                 "backward (loss_fn given)", "scale_grads")
        for i, name in enumerate(names):
            msg = comm.differs(sigs, name, lambda s, i=i: s.ints[1 + i])
            if msg:
                return msg
        msg = comm.differs(sigs, "costs (none, \"measure\", or the table's hash)",
                           lambda s: s.ints[-1])
        if msg:
            return msg
        _, sched, m, num_stages, v, p, _, _ = sigs[0].ints[:8]
        err = check_counts(SCHEDULES[sched], p, v, m)
        if err:
            return err
        if num_stages != p * v:
            return (f"num_stages={num_stages} must equal the group size ({p}) times the stages per "
                    f"rank ({v})")
        v_shaped = SCHEDULES[sched] in V_SHAPED
        for r, s in zip(ranks, sigs):
            got = list(s.ints[12:12 + min(v, MAX_LOCAL)])
            want = sorted(local_stages(r, p, v, v_shaped))[:MAX_LOCAL]
            if got != want:
                rule = (f"stage s on rank s for s < {p} and on rank {2 * p - 1} - s after, torch's "
                        f"V placement" if v_shaped else f"stage s on rank s % {p}, torch's loop "
                        f"placement")
                return (f"rank {r} holds stages {got}; with {p} ranks and {v} stages per rank it "
                        f"must hold {want} ({rule})")
        for r, s in zip(ranks, sigs):
            if r == 0:
                err = self._check_batch(s, m)
                if err:
                    return err
            last_rank = 0 if v_shaped else (num_stages - 1) % p
            if r == last_rank and backward and not s.ints[9]:
                return (f"rank {r} holds the last stage and a loss_fn is set: pass "
                        f"step(..., target=...) there")
            if r == last_rank and s.ints[9]:
                t = s.tensors[MAX_ARGS]
                if len(t.shape) == 0 or t.shape[0] < m:
                    return (f"the target {t.describe()} has fewer rows (dim 0) than the {m} "
                            f"microbatches (n_microbatches={m})")
        return None

    @staticmethod
    def _check_batch(s: comm.Signature, m: int) -> Optional[str]:
        nargs = s.ints[8]
        if nargs == 0:
            return "rank 0 holds stage 0: pass the batch there, step(x, ...)"
        shown = [t for t in s.tensors[:min(nargs, MAX_ARGS)]]
        if any(len(t.shape) == 0 for t in shown):
            return "step() arguments must have a batch dimension (dim 0) to split into microbatches"
        sizes = {t.shape[0] for t in shown}
        if len(sizes) > 1:
            return (f"the step() arguments have different batch sizes (dim 0): "
                    f"{', '.join(t.describe() for t in shown)}")
        b = sizes.pop()
        if b < m:
            return (f"the batch of {b} (dim 0 of {shown[0].describe()}) has fewer rows than the "
                    f"{m} microbatches; every microbatch needs at least one row")
        return None

    def _step(self, args, target, losses, return_outputs, kwargs, backward: bool):
        name = f"pipeline.{self._schedule}"
        local = self._local_error(args, target, losses, kwargs, backward)
        ints, tensors = self._signature(args, target, backward)
        sigs = agree_step(self._pg, name, ints, tensors, local, lambda ss: self._check(ss, backward))
        m = self._n_microbatches
        first = any(s.is_first for s in self._stages)
        last = next((s for s in self._stages if s.is_last), None)
        arg_mbs = _split(args, m) if first else [()] * m
        target_mbs = _split((target,), m) if (last is not None and target is not None) else None
        target_mbs = [t[0] for t in target_mbs] if target_mbs else None
        for s in self._stages:
            s.reset_step()
        orders, plans, look = self._plan(backward)
        self.orders = orders
        meter = CostMeter() if backward and self._measure and self._costs is None else None
        n_large = args[0].shape[0] % m if first and args else 0  # one row more (tensor_split)
        self._ensure_metas(sigs, arg_mbs if first else None, n_large)
        run = StepRun(self._stages, self._transport, self._p, backward=backward,
                      loss_fn=self._loss_fn, scale=self._loss_scales(target_mbs, m),
                      arg_mbs=arg_mbs, target_mbs=target_mbs, recorder=self.timeline,
                      split_backward=self._schedule in SPLIT_BACKWARD,
                      v_shaped=self._schedule in V_SHAPED, meter=meter)
        run.run(plans[self._rank])
        raise_if_any(self._pg, run.error)
        if meter is not None:
            self._costs = agree_costs(self._pg, meter, [s.stage_index for s in self._stages],
                                      self._stages[0].num_stages, comm.comm_device(self._pg))
        if last is None:
            return None
        if losses is not None and last.losses:
            losses.clear()
            losses.extend(last.losses)
        if not return_outputs:
            return None
        merged = tuple(torch.cat(parts, dim=0) for parts in zip(*last.output_chunks))
        return merged[0] if len(merged) == 1 else merged

    def _loss_scales(self, target_mbs, m: int) -> List[float]:
        """The factor of each microbatch's loss (see the module docstring)."""
        if not self.scale_grads:
            return [1.0] * m
        if not target_mbs:
            return [1.0 / m] * m
        rows = [t.shape[0] for t in target_mbs]
        return [r / sum(rows) for r in rows]

    def _ensure_metas(self, sigs, arg_mbs, n_large: int) -> None:
        key = (self._n_microbatches, sigs[0].ints[10] if len(sigs) == self._p else None)
        if key == self._meta_key and all(s.out_metas is not None for s in self._stages):
            return
        self._meta_key = None
        error = meta.infer_all(self._stages, self._pg, arg_mbs[0] if arg_mbs else None,
                               arg_mbs[-1] if arg_mbs else None, n_large, self._p,
                               self._schedule in V_SHAPED)
        raise_if_any(self._pg, error)
        self._meta_key = key
        if self._measure:  # new shapes: the times measured on the old ones no longer hold
            self._costs = None
        self._transport.pool.clear()
        logger.debug("pipeline activations: %s", meta.describe_all(self._stages))

    def _costs_code(self) -> int:
        if self._measure:
            return 1
        if self._costs is None:
            return 0
        return 2 + (zlib.crc32(repr(self._costs).encode()) & 0x3FFFFFFF)

    def _plan(self, backward: bool):
        costs = self._costs if backward else None
        key = (self._n_microbatches, backward, costs)
        if key not in self._plans:
            v = len(self._stages)
            orders, plans, look = choose_plan(self._schedule, self._p, v, self._n_microbatches,
                                              backward, self._grouped, self._lookahead, costs)
            if look is None:
                logger.debug("%s with %d ranks, %d stages per rank, %d microbatches: lock-step "
                             "transfer plan, because this backend runs a rank's batches in order "
                             "on one stream", self._schedule, self._p, v, self._n_microbatches)
            elif look < self._lookahead:
                logger.debug("%s with %d ranks, %d stages per rank, %d microbatches: receives "
                             "posted %d actions ahead, not %d, because this backend completes "
                             "batches as ordered groups and the deeper plan would deadlock",
                             self._schedule, self._p, v, self._n_microbatches, look,
                             self._lookahead)
            self._plans[key] = (orders, plans, look)
        return self._plans[key]

    def describe(self) -> str:
        return f"{type(self).__name__}: " + "; ".join(
            f"stage {s.stage_index} {describe(s.in_metas)} -> {describe(s.out_metas)}"
            for s in self._stages)


def _split(tensors, m: int) -> List[tuple]:
    """Microbatches as ``torch.tensor_split`` makes them (the first ``b % m`` one row larger)."""
    if not tensors:
        return [()] * m
    return list(zip(*(torch.tensor_split(t, m, dim=0) for t in tensors)))


class _SingleStageSchedule(_PipelineSchedule):
    """A schedule of one stage per rank (torch's single-stage constructor signature)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True, *, lookahead: int = DEFAULT_LOOKAHEAD):
        super().__init__([stage], n_microbatches, loss_fn, scale_grads, lookahead,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec)


class ScheduleGPipe(_SingleStageSchedule):
    """All forwards, then all backwards (fill-drain). Memory: every microbatch's activations."""
    _schedule = "gpipe"


class Schedule1F1B(_SingleStageSchedule):
    """One forward, one backward in the steady state; at most ``p - rank`` microbatches in flight.
    Unlike torch, ``n_microbatches < num_stages`` is allowed (the warm-up is then shorter)."""
    _schedule = "1f1b"


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Several stages per rank (stage s on rank s % p), depth-first 1F1B over them: the bubble
    shrinks to (p-1) / (v*m + p-1) for v stages per rank."""
    _schedule = "interleaved_1f1b"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn=None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, *, lookahead: int = DEFAULT_LOOKAHEAD):
        if defer_pp_recv:
            logger.debug("ScheduleInterleaved1F1B: defer_pp_recv is torch's knob; pyfused posts "
                         "receives %d actions ahead by its own plan", lookahead)
        super().__init__(list(stages), n_microbatches, loss_fn, scale_grads, lookahead,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec,
                         backward_requires_autograd=backward_requires_autograd)


class ScheduleZBH1(_PipelineSchedule):
    """ZB-H1 (Qi et al. 2024): one stage per rank, the backward split into B (input gradients,
    sent on at once) and W (weight gradients), W's held back to fill the drain. Bubble
    (p-1) / (3m + p-1) with equal F, B, W times (1F1B: (p-1) / (m + p-1)); at most ``p - rank``
    microbatches before their B (1F1B's) and ``p - 1`` more waiting for their W. ``costs``: see
    the module docstring."""
    _schedule = "zbh1"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True, *, lookahead: int = DEFAULT_LOOKAHEAD, costs=None):
        super().__init__([stage], n_microbatches, loss_fn, scale_grads, lookahead, costs,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec)


class _MultiStageSchedule(_PipelineSchedule):
    """A split-backward schedule of several stages per rank (torch's multi-stage constructor
    signature; ``costs``: see the module docstring)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn=None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, *, lookahead: int = DEFAULT_LOOKAHEAD, costs=None):
        super().__init__(list(stages), n_microbatches, loss_fn, scale_grads, lookahead, costs,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec,
                         backward_requires_autograd=backward_requires_autograd)


class ScheduleInterleavedZeroBubble(_MultiStageSchedule):
    """Several stages per rank in torch's loop placement (stage s on rank s % p), split backward,
    W's filling the bubbles; activation memory bounded like interleaved 1F1B's. Unlike torch's,
    any ``n_microbatches >= 1`` is accepted (no multiple-of-rounds rule)."""
    _schedule = "interleaved_zb"


class ScheduleZBVZeroBubble(_MultiStageSchedule):
    """ZB-V: exactly two stages per rank in a V (rank r holds stages r and 2p-1-r, so the first and
    the last stage, with the loss, are on rank 0), split backward; activation memory bounded by
    1F1B's (2p half-stage microbatches per rank). With at least as many microbatches as stages
    torch's order, whose steady state runs whole backwards (B with its W, one autograd pass)."""
    _schedule = "zbv"


class ScheduleDualPipeV(_MultiStageSchedule):
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V of two stages per rank): in the steady
    state a rank runs the forward of one microbatch and then the whole backward (B with its W, one
    autograd pass) of another; W's are split off only to fill the drain. With at least as many
    microbatches as stages this is torch's order; unlike torch, fewer are accepted (then the list
    scheduler's order, whose F+B pairs post their transfers together)."""
    _schedule = "dualpipev"
