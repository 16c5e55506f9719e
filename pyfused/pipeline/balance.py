"""Contiguous partitioning of per-layer costs: pure functions, tested against brute force.

``partition(costs, k)`` cuts ``costs`` (one number per layer, in model order) into ``k`` non-empty
contiguous groups so that the largest group sum -- the slowest stage, which sets the pipeline's
pace -- is as small as possible. Exact dynamic programming over (stages used, layers covered):

    best[j][i] = min over t in [j-1, i) of max(best[j-1][t], sum(costs[t:i]))

O(k * n^2) time for n layers, which is nothing next to profiling them. Ties are broken by taking,
from the last stage backwards, the earliest start that reaches the optimum, so the answer is a
deterministic function of the costs.
"""
from __future__ import annotations

from itertools import accumulate
from typing import List, Sequence, Tuple


def stage_sums(costs: Sequence[float], starts: Sequence[int]) -> List[float]:
    """Sum of each stage's costs; ``starts`` holds the first layer of stages 1..k-1."""
    bounds = [0, *starts, len(costs)]
    return [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:])]


def check_starts(n: int, k: int, starts: Sequence[int]) -> None:
    if len(starts) != k - 1:
        raise ValueError(f"{k} stages need {k - 1} split points, got {len(starts)}: {list(starts)}")
    bounds = [0, *starts, n]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split points must be strictly increasing within (0, {n}) so that every "
                         f"stage has at least one layer; got {list(starts)}")


def partition(costs: Sequence[float], k: int) -> Tuple[int, ...]:
    """Split points (first layer of stages 1..k-1) minimising the largest stage sum."""
    n = len(costs)
    if k < 1:
        raise ValueError(f"need at least one stage, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be non-negative")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    inf = float("inf")
    # best[j][i]: the smallest bottleneck covering layers [0, i) with j stages; cut[j][i]: where
    # the j-th stage starts in that optimum.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for t in range(j - 1, i):
                if best[j - 1][t] == inf:
                    continue
                value = max(best[j - 1][t], prefix[i] - prefix[t])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, t
    starts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        starts.append(i)
    return tuple(reversed(starts))


def even_starts(n: int, k: int) -> Tuple[int, ...]:
    """Split by layer count: sizes differ by at most one, the larger stages first."""
    if n < k:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    size, extra = divmod(n, k)
    starts, pos = [], 0
    for j in range(k - 1):
        pos += size + (1 if j < extra else 0)
        starts.append(pos)
    return tuple(starts)
