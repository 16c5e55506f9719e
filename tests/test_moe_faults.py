"""A rank that dies or freezes inside moe_dispatch or moe_combine never hangs the others: each
survivor raises ``PeerFailure`` naming the MoE op within the group's timeout plus a margin.

Three fresh gloo ranks per case (tests/fault_ranks.py), as tests/test_faults.py runs the other
paths. Each rank runs steps of dispatch -> GELU -> combine, forward and backward; the victim strikes
(``comm.faults.strike_at``) the second time it passes one of the ops' fault points -- before the
count exchange, before the token transfer of dispatch, before combine's -- so that the first step
ran healthy. The full grid (PYFUSED_FULL_MOE_MATRIX=1) strikes each point once killed with the
decomposed method and once frozen with the unfused one; by default three cases cover each point
once, both actions and both methods.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.fault_ranks import launch, record_strike
from tests.moe_checks import grid

WORLD = 3
VICTIM = 1
# The group's timeout. Longer than tests/test_faults.py's 3 s: a healthy first step (custom-op
# registration, the first validation) on a loaded 2-core box took over 3 s once.
TIMEOUT_S = 8.0
MARGIN_S = 6.0  # a survivor may start a new wait just after the strike; the machine is shared
STEPS = 4
ALL_CASES = [(point, action, method)
             for point in ("moe_dispatch.counts:before", "moe_dispatch.transfer:before",
                           "moe_combine.transfer:before")
             for action, method in (("kill", "decomposed"), ("sleep", "unfused"))]
# by default each point once, the actions and methods alternating; PYFUSED_FULL_MOE_MATRIX=1: all
CASES = grid(ALL_CASES, ALL_CASES[0::3] + ALL_CASES[4:5])


def _steps(rank: int, out: Path, point: str, action: str, method: str) -> None:
    from pyfused.comm import faults
    from pyfused.ops import moe_combine, moe_dispatch

    if rank == VICTIM:
        faults.strike_at(point, nth=2, action=action, before=lambda _: record_strike(out))
    g = torch.Generator().manual_seed(rank)
    w1 = torch.randn(2, 8, 6, generator=g, requires_grad=True)
    w2 = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    for _ in range(STEPS):
        x = torch.randn(9, 8, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(2 * WORLD, generator=g)[:2] for _ in range(9)])
        h, layout = moe_dispatch(x, idx, w1, method=method)
        y = moe_combine(F.gelu(h), torch.rand(9, 2, generator=g), idx, layout, w2, method=method)
        y.sum().backward()


@pytest.mark.parametrize("point,action,method", CASES)
def test_survivors_raise_peer_failure_in_bounded_time(point, action, method, tmp_path):
    results = launch(_steps, (point, action, method), world=WORLD, victim=VICTIM, out=tmp_path,
                     timeout_s=TIMEOUT_S, bound_s=TIMEOUT_S + MARGIN_S,
                     preload=["pyfused.ops", "tests.test_moe_faults"])
    bound = (TIMEOUT_S if action != "kill" else 0.0) + MARGIN_S
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        msg = res["message"]
        assert "pyfused.moe_dispatch" in msg or "pyfused.moe_combine" in msg, f"rank {r}: {msg}"
        assert f"timeout is {TIMEOUT_S:g} s" in msg, msg
        assert 0 <= res["raise_s"] <= bound, f"rank {r} raised after {res['raise_s']:.1f} s: {msg}"
