"""The namespace test bed as pytest fixtures (benchmarks/multihost_testbed.py builds it).

``testbed(hosts, shaping, log_dir, rendezvous_host)`` yields a bed that is up (``rendezvous_host``:
torchrun's rendezvous store served by a namespace of its own), or skips the test with the reason a
bed cannot be made here (no root, no iproute2, no network namespaces); the bed is taken down, its
processes ended, however the test ends. ``run_checks(bed, checks, tmp)`` launches tests/multihost_worker.py
under torchrun on every host, bounded by ``LAUNCH_TIMEOUT_S``, and returns every rank's result.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from benchmarks import multihost_testbed as mt

LAUNCH_TIMEOUT_S = 150
REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def testbed(hosts: int = 2, shaping: mt.Shaping = mt.Shaping(), log_dir: Path = None,
            rendezvous_host: bool = False) -> Iterator[mt.Testbed]:
    why = mt.unavailable_reason()
    if why:
        pytest.skip(f"multihost test bed unavailable: {why}")
    with mt.Testbed(hosts, shaping, log_dir, rendezvous_host=rendezvous_host) as bed:
        yield bed


def worker_env() -> Dict[str, str]:
    """The ranks import this checkout (tests/, pyfused/) whatever the working directory."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def run_checks(bed: mt.Testbed, checks: List[str], out: Path,
               timeout: float = LAUNCH_TIMEOUT_S) -> List[Dict]:
    """Every rank's result of ``checks`` (tests/multihost_worker.py), in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    launch = bed.launch(["-m", "tests.multihost_worker", str(out), ",".join(checks)],
                        env=worker_env(), log_dir=out)
    codes = launch.wait(timeout)
    assert codes == [0] * bed.hosts, f"torchrun exited {codes}\n{launch.tails()}"
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]
