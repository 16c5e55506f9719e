"""Measured F, B and W times of every stage, the same table on every rank of the pipeline group.

A split-backward schedule built with ``costs="measure"`` runs its first training step in the fixed
order while the executor times every compute action on its rank (``CostMeter``, two
``perf_counter`` calls per action). At the end of that step the ranks agree on one table: each
stage's median F, B and W milliseconds over the step's microbatches, in one ``all_reduce`` of a
``num_stages x 3`` tensor to which each rank adds only its own stages (a sum with zeros is exact,
so every rank holds identical numbers and computes identical orders from them, cost_orders.py).
The times are those of the real step: the last stage's F includes the loss, B and W are the split
backward's own (split_backward.py), on the real microbatch shapes.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .actions import Action
from .cost_orders import OPS, Costs, as_costs

MIN_MS = 1e-4  # a measured time is never 0 (a first stage's B computes nothing): orders need > 0


class CostMeter:
    """Milliseconds of every compute action of one rank during a step."""

    def __init__(self):
        self.samples: Dict[Tuple[int, str], List[float]] = defaultdict(list)

    def add(self, action: Action, ms: float) -> None:
        self.samples[action.stage, action.op].append(ms)

    def table(self, stages: Sequence[int], num_stages: int) -> torch.Tensor:
        """``num_stages x 3`` medians (F, B, W), zeros outside ``stages``."""
        t = torch.zeros(num_stages, len(OPS), dtype=torch.float64)
        for s in stages:
            for i, op in enumerate(OPS):
                got = self.samples.get((s, op))
                if got:
                    t[s, i] = max(MIN_MS, statistics.median(got))
        return t


def agree_costs(pg, meter: CostMeter, stages: Sequence[int], num_stages: int,
                device: torch.device) -> Costs:
    """The cost table of every stage, identical on every rank (one all_reduce)."""
    t = meter.table(stages, num_stages).to(device)
    if comm.world_size(pg) > 1:
        with comm.failures_named("pipeline cost agreement", pg):
            dist.all_reduce(t, group=pg)
    return as_costs(t.cpu().tolist())
