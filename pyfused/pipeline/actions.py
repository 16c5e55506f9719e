"""The vocabulary of the pipeline's orders: the schedules, the compute actions, and which rank
holds which stage.

Pure, like the orders built from it (plan.py for GPipe, 1F1B and interleaved 1F1B, zero_bubble.py
for the split-backward schedules) and the transfer plans plan.py derives from those orders.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbh1", "interleaved_zb", "zbv", "dualpipev")
# Schedules whose backward is split: B computes the input gradients (sent on at once), W later the
# weight gradients of the same stage and microbatch (split_backward.py).
SPLIT_BACKWARD = ("zbh1", "interleaved_zb", "zbv", "dualpipev")
# Schedules that place stage s on rank s for s < p and on rank 2p-1-s after (two stages per rank).
V_SHAPED = ("zbv", "dualpipev")


@dataclass(frozen=True)
class Action:
    op: str  # FORWARD, BACKWARD or WEIGHT
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.op}{self.stage}.{self.mb}"


def stage_rank(stage: int, p: int, v_shaped: bool = False) -> int:
    """The group rank of ``stage``: torch's "loop" placement (``s % p``), or its "v" placement
    (stage ``s`` and stage ``2p-1-s`` on rank ``s``: the first and the last stage share rank 0)."""
    if v_shaped:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def local_stages(rank: int, p: int, v: int, v_shaped: bool = False) -> List[int]:
    if v_shaped:
        return [rank, 2 * p - 1 - rank]
    return [rank + j * p for j in range(v)]


def rounds(p: int, m: int) -> Tuple[int, int]:
    """(number of rounds, microbatches per round) of the interleaved schedule."""
    n_rounds = max(1, m // p)
    return n_rounds, m // n_rounds
