"""DDP's end-of-backward waits are bounded by the group's timeout counted from the wait, whatever
gloo's own clocks say.

gloo runs a group's asynchronous collectives on two worker threads, in launch order, and starts a
collective's timeout only when a thread picks it up. Here the victim (rank ``VICTIM`` of three fresh
gloo ranks, tests/fault_ranks.py) joins its gradient buckets' all-reduces slowly -- ``DELAY_S``
apart, each well inside the timeout -- and gets stuck for good before its last bucket. The
survivors finished their backward at once and wait at its end (the status exchange, launched behind
every bucket); the buckets that the victim joins late hold gloo's threads, so the all-reduces
queued after them start their own clocks ``(BUCKETS - 2) * DELAY_S`` late. The survivors must
still raise ``PeerFailure`` within the group's timeout (plus a margin for the loaded box) of the
moment the victim's backward started, which is when their wait started.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn

from tests.fault_ranks import launch, record_strike

WORLD = 3
VICTIM = 1
TIMEOUT_S = 4.0   # the group's timeout
# Apart by DELAY_S, each bucket all-reduce waits 2 * DELAY_S for the victim (two threads): under the
# timeout with room for the load, so gloo never times one out, while the clock of the bucket the
# victim never joins starts (BUCKETS - 2) * DELAY_S = 16.8 s late.
DELAY_S = 1.2
BUCKETS = 16      # one parameter per bucket
MARGIN_S = 6.0    # the survivor's own backward and scheduling on a shared 2-core box
STRIKE_STEP = 2   # two healthy steps first: buckets rebuilt in gradient order, every path warm


class _SlowThenStuck:
    """The victim's gradient hook: record the strike, sleep DELAY_S before each of the first
    BUCKETS - 1 gradients, then never return (stuck in Python, its gloo threads alive)."""

    def __init__(self, out: Path):
        self.out, self.calls = out, 0

    def __call__(self, grad):
        if self.calls == 0:
            record_strike(self.out)
        self.calls += 1
        time.sleep(DELAY_S if self.calls < BUCKETS else 3600)
        return grad


def _ddp_slow_then_stuck(rank: int, out: Path) -> None:
    from pyfused.layers import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(BUCKETS)])
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6)  # every gradient a bucket of its own
    assert len(ddp.reducer.buckets) == BUCKETS
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(STRIKE_STEP + 1):
        if rank == VICTIM and step == STRIKE_STEP:
            hook = _SlowThenStuck(out)
            for p in model.parameters():
                p.register_hook(hook)
        ddp(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_ddp_wait_bounded_behind_late_buckets(tmp_path):
    queued_late_s = (BUCKETS - 2) * DELAY_S
    results = launch(_ddp_slow_then_stuck, (), world=WORLD, victim=VICTIM, out=tmp_path,
                     timeout_s=TIMEOUT_S, bound_s=queued_late_s + TIMEOUT_S,
                     preload=["pyfused.layers", "tests.test_faults_ddp"])
    times = ", ".join(f"rank {r} raised at {res['raise_s']:.2f} s" for r, res in results.items()
                      if res.get("raised"))
    print(f"\nddp, victim slow then stuck (group timeout {TIMEOUT_S:g} s, gloo's clock of the last "
          f"bucket {queued_late_s:.1f} s late): {times}")
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        msg = res["message"]
        assert "pyfused.DistributedDataParallel backward" in msg and f"on rank {r} of group" in msg
        assert f"timeout is {TIMEOUT_S:g} s" in msg, msg
        assert 0 <= res["raise_s"] <= TIMEOUT_S + MARGIN_S, (
            f"rank {r} raised {res['raise_s']:.1f} s after the victim's backward started, more "
            f"than the group's timeout ({TIMEOUT_S:g} s) + {MARGIN_S:g} s: {msg}")
