"""A rank of the ring killed or frozen in the middle of ``ring_attention`` never holds the others past
the group's timeout: each survivor raises ``PeerFailure`` naming ring_attention, itself and the
timeout.

Three fresh gloo ranks (tests/fault_ranks.py) run one healthy forward + backward under a long
timeout, shorten it to ``TIMEOUT_S`` (``torch.distributed.set_timeout``, as ``parallelize`` does
to a mesh's groups), and run again; the victim, rank 1, strikes at the second ring step of the
backward, where the K/V blocks and the dK/dV accumulators are both in flight.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.fault_ranks import launch, record_strike

WORLD, VICTIM = 3, 1
START_TIMEOUT_S = 60.0
TIMEOUT_S = 3.0
MARGIN_S = 6.0
# the forward passes the point W times, then the backward: its second step
POINT, NTH = "ring_attention.ring:step", WORLD + 2


def _ring_case(rank: int, out: Path, action: str) -> None:
    from pyfused.comm import faults
    from pyfused.ops.ring_attention import ring_attention

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g).requires_grad_() for _ in range(3))
    ring_attention(q, k, v, method="ring").sum().backward()
    dist.barrier()
    dist.set_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    if rank == VICTIM:
        faults.strike_at(POINT, NTH, action, before=lambda _: record_strike(out))
    ring_attention(q, k, v, method="ring").sum().backward()


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_survivors_raise_peer_failure_within_the_timeout(action, tmp_path):
    bound = (TIMEOUT_S if action == "stop" else 0.0) + MARGIN_S
    results = launch(_ring_case, (action,), world=WORLD, victim=VICTIM, out=tmp_path,
                     timeout_s=START_TIMEOUT_S, bound_s=TIMEOUT_S + MARGIN_S,
                     preload=["pyfused.ops.ring_attention", "tests.test_ring_attention_faults"])
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        msg = res["message"]
        assert "pyfused.ring_attention" in msg and f"on rank {r} of group" in msg, msg
        assert f"timeout is {TIMEOUT_S:g} s" in msg, msg
        assert 0 <= res["raise_s"] <= bound, f"rank {r} raised after {res['raise_s']:.1f} s: {msg}"
