"""Drop-in parallel modules: tensor-parallel linears, expert-parallel MoE experts, data parallel,
and (re-exported from ``pyfused.pipeline``, where they live) the pipeline stage and schedules."""
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ExpertParallelExperts

_PIPELINE = ("PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")


def __getattr__(name):
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    if name in _PIPELINE:
        from .. import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'pyfused.layers' has no attribute {name!r}")


__all__ = ["ColumnParallelLinear", "ExpertParallelExperts", "RowParallelLinear",
           "DistributedDataParallel", *_PIPELINE]
