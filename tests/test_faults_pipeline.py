"""A pipeline stage killed or frozen at any moment of a step never holds the others past the group's
timeout.

Three gloo ranks run ``Schedule1F1B`` or ``ScheduleGPipe`` (one stage each, 4 microbatches). The
victim -- each stage in turn -- strikes at a fault point of its second step
(``pyfused.comm.faults.strike_at``): before and after the per-step agreement, before and after
posting a batch of sends and receives (after: its transfers in flight), before and after waiting
for a receive, after its last sends completed, before and after the end-of-step agreement; it is
killed (SIGKILL) or frozen (SIGSTOP). The same case strikes at the same moment every run. Every
survivor must raise ``PeerFailure`` naming a pipeline operation, itself and the group's timeout,
within that timeout (frozen) or at once (killed), plus a margin, and exit.

The group starts with a long timeout, so that starting the ranks and the healthy first step cannot
time out on a loaded machine, and is shortened to ``TIMEOUT_S`` by ``torch.distributed.set_timeout``
before the struck step -- as ``parallelize`` shortens a DeviceMesh's groups. gloo bounds a p2p wait
without a timeout of its own by the timeout a group was created with, so these cases catch a wait
that ignores the timeout the group has now.

``test_stage_collective_failure_ends_the_step``: a stage whose module runs a collective of its own
(TP or DP inside a stage) and loses its peer there raises at once, naming that stage, instead of
running the rest of the schedule against a dead peer.
"""
from __future__ import annotations

import datetime
import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fault_ranks import launch, record_strike

WORLD = 3
START_TIMEOUT_S = 60.0  # the group's timeout while the ranks start and run their healthy step
TIMEOUT_S = 3.0         # ... and from the struck step on (torch.distributed.set_timeout)
MARGIN_S = 6.0          # raising may take a little longer than the timeout on a shared machine
STRIKE_STEP = 1         # one healthy step first: the shape pass and every lazy set-up are done
STEPS = 3
MICROBATCHES = 4
SCHEDULES = ("1f1b", "gpipe")
# (fault point, which occurrence in the struck step). Every stage posts 9 batches and waits for 4
# receives per step with 4 microbatches; the third is mid-step.
POINTS = [
    ("pipeline.agreement:before", 1), ("pipeline.agreement:after", 1),
    ("pipeline.post:before", 3), ("pipeline.post:after", 3),
    ("pipeline.recv:before", 3), ("pipeline.recv:after", 3),
    ("pipeline.finish:after", 1), ("pipeline.end:before", 1), ("pipeline.end:after", 1),
]
ACTIONS = ("kill", "stop")


def _cases():
    """(schedule, victim stage, point, nth, action) of every struck run.

    Every moment is struck with every action; the (schedule, stage) pairs rotate so that each action
    meets all six pairs: 18 runs, about 2 minutes on 2 cores. The full product (2 schedules x 3
    stages x 9 moments x 2 actions = 108 runs, about 12 minutes) runs with
    ``PYFUSED_FULL_FAULT_MATRIX=1``."""
    pairs = [(s, v) for s in SCHEDULES for v in range(WORLD)]
    if os.environ.get("PYFUSED_FULL_FAULT_MATRIX") == "1":
        return [(s, v, p, n, a) for s, v in pairs for p, n in POINTS for a in ACTIONS]
    return [(*pairs[(j + 3 * i) % len(pairs)], p, n, a)
            for i, a in enumerate(ACTIONS) for j, (p, n) in enumerate(POINTS)]


def _case_id(case) -> str:
    schedule, victim, point, nth, action = case
    return f"{schedule}-stage{victim}-{point.split('.')[1].replace(':', '-')}-{nth}-{action}"


def _schedule(name, stage):
    from pyfused.pipeline import Schedule1F1B, ScheduleGPipe

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name]
    return cls(stage, MICROBATCHES, nn.MSELoss())


def _run_steps(rank: int, out: Path, sched, victim: int, strike) -> None:
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        if step == STRIKE_STEP:
            dist.barrier()  # every rank has finished the healthy steps, under the long timeout
            dist.set_timeout(datetime.timedelta(seconds=TIMEOUT_S))
            if rank == victim:
                strike()
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == WORLD - 1 else None)


def _pipeline_case(rank, out, schedule, victim, point, nth, action):
    from pyfused.comm import faults
    from pyfused.pipeline import PipelineStage

    torch.manual_seed(0)
    stage = PipelineStage(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), rank, WORLD, "cpu")
    strike = partial(faults.strike_at, point, nth, action, before=lambda _: record_strike(out))
    _run_steps(rank, out, _schedule(schedule, stage), victim, strike)


def _check(results, action, names=("pyfused.pipeline",)):
    bound = (TIMEOUT_S if action != "kill" else 0.0) + MARGIN_S
    times = ", ".join(f"rank {r} raised at {res['raise_s']:.2f} s, exited at {res['exit_s']:.2f} s"
                      for r, res in results.items() if res.get("raised"))
    print(f"  {action} (group timeout {TIMEOUT_S:g} s): {times}")
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        msg = res["message"]
        assert any(n in msg for n in names), f"rank {r}: {msg}"
        assert f"on rank {r} of group" in msg and f"timeout is {TIMEOUT_S:g} s" in msg, msg
        assert 0 <= res["raise_s"] <= bound, f"rank {r} raised after {res['raise_s']:.1f} s: {msg}"
        assert res["exitcode"] == 1 and res["exit_s"] - res["raise_s"] <= MARGIN_S, (r, res)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,victim,point,nth,action", _cases(),
                         ids=[_case_id(c) for c in _cases()])
def test_survivors_raise_within_the_timeout(schedule, victim, point, nth, action, tmp_path):
    bound = TIMEOUT_S + MARGIN_S
    results = launch(_pipeline_case, (schedule, victim, point, nth, action), world=WORLD,
                     victim=victim, out=tmp_path, timeout_s=START_TIMEOUT_S, bound_s=bound,
                     preload=["pyfused.pipeline", "tests.test_faults_pipeline"])
    print(f"\n{schedule}, stage {victim} at {point} #{nth}:", end="")
    _check(results, action)


# ---- a stage's own collective -------------------------------------------------------------------
class _StageCollective(nn.Module):
    """A layer that sums its input over a group of its own, as a TP layer inside a stage does."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        x = x.clone()
        dist.all_reduce(x, group=self.group)
        return x


def _stage_collective_case(rank, out, schedule, action):
    """Ranks 0-2: the pipeline (its own group); rank 3: stage 1's partner in ``_StageCollective``,
    one all-reduce per call of stage 1's module (the shape pass's included), striking before its
    first all-reduce of the struck step."""
    from pyfused.comm import faults
    from pyfused.pipeline import PipelineStage

    long = datetime.timedelta(seconds=START_TIMEOUT_S)
    pp, pair = dist.new_group([0, 1, 2], timeout=long), dist.new_group([1, 3], timeout=long)
    if rank == 3:
        for step in range(STEPS):
            if step == STRIKE_STEP:
                dist.barrier()
                for g in (None, pair):
                    dist.set_timeout(datetime.timedelta(seconds=TIMEOUT_S), g)
                faults.strike_at("test.partner:before", 1, action, before=lambda _: record_strike(out))
            for _ in range(MICROBATCHES + (step == 0)):
                faults.fault_point("test.partner:before")
                dist.all_reduce(torch.zeros(8 // MICROBATCHES, 8), group=pair)
        return
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh()] + ([_StageCollective(pair)] if rank == 1 else [])
    stage = PipelineStage(nn.Sequential(*layers), rank, 3, "cpu", group=pp)
    sched = _schedule(schedule, stage)
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        if step == STRIKE_STEP:
            dist.barrier()
            for group in (None, pp) + ((pair,) if rank == 1 else ()):
                dist.set_timeout(datetime.timedelta(seconds=TIMEOUT_S), group)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 2 else None)


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_collective_failure_ends_the_step(schedule, action, tmp_path):
    """Stage 1 raises from its module's collective, named as its stage's, at once -- not a
    PipelineError on every rank after running the rest of the step against a lost peer."""
    results = launch(_stage_collective_case, (schedule, action), world=4, victim=3, out=tmp_path,
                     timeout_s=START_TIMEOUT_S, bound_s=TIMEOUT_S + MARGIN_S,
                     preload=["pyfused.pipeline", "tests.test_faults_pipeline"])
    print(f"\n{schedule}, stage 1's collective partner:", end="")
    _check(results, action)
    assert "pipeline stage 1" in results[1]["message"], results[1]
