"""Pipeline parallelism with torch.distributed.pipelining's API (see docs/PIPELINE.md).

    from pyfused.pipeline import PipelineStage, Schedule1F1B, split
    stages, report = split(model, num_stages=world, example_args=(x_micro,))   # rank 0 decides
    stage = PipelineStage(stages[rank], rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x) / schedule.step() / schedule.step(target=y, losses=losses)  # first/middle/last

Modules: actions.py (the orders' vocabulary), plan.py (pure orders and transfer plans, checked by a
simulator), balance.py (pure partitioning), stage.py, meta.py (shape agreement), p2p.py (batched,
overlapped transfers), executor.py, schedules.py, errors.py (same error on every rank), autosplit.py
(split), timeline.py, split_backward.py (B and W of any module), weight_accumulation.py (weight
gradients accumulated inside their GEMMs), zero_bubble.py (orders of the
split-backward schedules), cost_orders.py (their orders from measured F, B, W times), costs.py
(measuring those times and agreeing on them).
"""
from .autosplit import PipelineSegment, Split, SplitReport, layer_units, split
from .balance import even_starts, partition, stage_sums
from .errors import PipelineError
from .plan import PlanError, bubble_theory
from .schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBH1,
    ScheduleZBVZeroBubble,
)
from .stage import PipelineStage

__all__ = [
    "PipelineError", "PipelineSegment", "PipelineStage", "PlanError", "Schedule1F1B",
    "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble", "ScheduleZBH1", "ScheduleZBVZeroBubble", "Split", "SplitReport",
    "bubble_theory",
    "even_starts", "layer_units", "partition", "split", "stage_sums",
]
