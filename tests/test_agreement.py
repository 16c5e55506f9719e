"""``pyfused.comm.agree_on``: the one way ranks agree on a local outcome.

World sizes 1-3 (3: no power-of-two assumption), both transports (objects, fixed-size ints): the
same values on every rank; one rank's error raised on every rank naming it; a dead or frozen peer
turns into ``PeerFailure`` naming the agreement within the group's timeout.
"""
from __future__ import annotations

import ast
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.fault_ranks import launch, record_strike

TIMEOUT = 60
FAULT_TIMEOUT_S = 3.0  # the fault cases' group timeout: what bounds the wait on a frozen peer
MARGIN_S = 6.0  # a shared 2-core box may be slow to raise after the timeout


def _values_agreed(rank, world):
    from pyfused import comm

    pg = dist.group.WORLD
    objects = comm.agree_on(pg, "test objects", {"rank": rank, "name": f"r{rank}"})
    ints = comm.agree_on(pg, "test ints", [rank, 7 * rank, -rank], width=3)
    tensor = comm.agree_on(pg, "test tensor", torch.tensor([rank + 1, 2]), width=2)
    flags = comm.agree_on(pg, "test flags", width=0)
    return objects, ints, tensor, flags


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_every_value(ranks, world):
    got = ranks.run(world, _values_agreed, timeout=TIMEOUT)
    objects = [{"rank": r, "name": f"r{r}"} for r in range(world)]
    ints = [[r, 7 * r, -r] for r in range(world)]
    tensor = [[r + 1, 2] for r in range(world)]
    assert all(g == (objects, ints, tensor, [[]] * world) for g in got), got


def _error_on(rank, world, failing, width):
    from pyfused import comm

    value = [rank] if width else rank
    error = f"OSError: disk {rank} full" if rank in failing else None
    t0 = time.monotonic()
    try:
        comm.agree_on(dist.group.WORLD, "writing a file", value, error, width=width)
    except comm.LocalWorkError as e:
        default = (str(e), e.failed)
    else:
        default = None

    def fail(failed, world):
        return ValueError(f"custom: {failed} of {world}")

    try:
        comm.agree_on(dist.group.WORLD, "writing a file", value, error, width=width, fail=fail)
    except ValueError as e:
        custom = str(e)
    else:
        custom = None
    dist.barrier()  # where a rank that was not told would wait for the group's timeout
    return default, custom, time.monotonic() - t0


@pytest.mark.parametrize("width", [None, 1], ids=["objects", "ints"])
@pytest.mark.parametrize("world,failing", [(1, (0,)), (2, (1,)), (3, (1,)), (3, (0, 2))])
def test_one_rank_error_raised_everywhere(ranks, world, failing, width):
    got = ranks.run(world, _error_on, failing, width, timeout=TIMEOUT)
    first = failing[0]
    where = f" on rank {first}" if world > 1 else ""
    others = f" (and on ranks {list(failing[1:])})" if len(failing) > 1 else ""
    failed = [(r, f"OSError: disk {r} full") for r in failing]
    for default, custom, seconds in got:
        assert default == (f"writing a file failed{where}{others}: OSError: disk {first} full",
                           failed), default
        assert custom == f"custom: {failed} of {world}", custom
        assert seconds < FAULT_TIMEOUT_S * 10  # at once, not after the pool's 90 s timeout


def test_a_wrong_width_is_refused_before_any_collective():
    from pyfused import comm

    with pytest.raises(ValueError, match="value has 2 ints, width is 3"):
        comm.agree_on(None, "test", [1, 2], width=3)


# ----------------------------------------------------------------------------- a peer dies
def _agree_then_strike(rank, out, mode, width):
    from pyfused import comm

    pg = dist.group.WORLD
    comm.agree_on(pg, "test agreement", [rank], width=width)  # a healthy one first
    if rank == 1:
        record_strike(out)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    comm.agree_on(pg, "test agreement", [rank], width=width, detail="after the strike")


@pytest.mark.parametrize("width", [None, 1], ids=["objects", "ints"])
@pytest.mark.parametrize("mode", ["kill", "freeze"])
def test_a_dead_peer_is_named_in_bounded_time(tmp_path, mode, width):
    bound = (FAULT_TIMEOUT_S if mode == "freeze" else 0.0) + MARGIN_S
    results = launch(_agree_then_strike, (mode, width), world=3, victim=1, out=tmp_path,
                     timeout_s=FAULT_TIMEOUT_S, bound_s=bound)
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        assert "pyfused.test agreement (after the strike)" in res["message"], res["message"]
        assert f"timeout is {FAULT_TIMEOUT_S:g} s" in res["message"], res["message"]
        assert 0 <= res["raise_s"] <= bound, f"rank {r} raised after {res['raise_s']:.1f} s"


# ----------------------------------------------------------------------------- no second helper
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list"}
AGREEMENT = Path("comm") / "agreement.py"  # the one file that may call them


def object_collective_calls(root: Path):
    """(file, line, name) of every call of a torch.distributed object collective in the library
    under ``root`` (the installed suites, ``pyfused/benchmarks``, are not library)."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "benchmarks" or rel == AGREEMENT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if name in OBJECT_COLLECTIVES:
                    yield str(rel), node.lineno, name


def test_only_comm_agreement_gathers_objects():
    """Ranks agree through ``comm.agree_on``: no other library file calls an object collective."""
    import pyfused

    found = list(object_collective_calls(Path(pyfused.__file__).parent))
    assert not found, f"agree through pyfused.comm.agree_on instead: {found}"
