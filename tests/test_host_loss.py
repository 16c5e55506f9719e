"""Losing a host: examples/train_llm.py under ``torchrun --nnodes 1:N --max-restarts 3
--rdzv-backend c10d`` on N namespace hosts (tests/multihost.py), a DCP checkpoint every 2 steps.
Once the job has trained a few steps, one host is struck:

* ``kill``: every process of the host gets SIGKILL (a host that lost power);
* ``cut``: its link goes down (``ip link set mhlink down``): its processes live on, unreachable;
* ``freeze``: every process of the host gets SIGSTOP (a hung host: sockets open, nothing answers).

Then every surviving host's ranks raise ``PeerFailure`` within the group timeout (``--timeout``;
at once after a kill, whose sockets close), torchrun's agents on the other hosts re-form the job
(c10d rendezvous: the lost host's agent stops sending heartbeats and is dropped), and the
restarted ranks, on the smaller mesh, resume from the newest checkpoint marked complete when the
survivors failed. Their losses must equal, bit for bit, those of an uninterrupted run of the same
script restarted from that checkpoint on that mesh (on the shared rank pool with the hosts named
by ``PYFUSED_HOST``, or in the test's process where one rank is left). Every checkpoint marked
complete holds every byte its DCP metadata names; those after the resumed step were written again
by the smaller job.

By default the compact cases run: 2 hosts x 1 rank (dp=2 across the hosts), host 1 killed
(``test_training_survives_a_killed_host``), or its link cut or its processes frozen with a 30 s
group timeout (``test_training_survives_a_host_cut_off_or_frozen``), the job re-formed on host 0
alone (dp=1); the reference run starts as soon as the checkpoint to resume from is known, while
torchrun re-forms the job. Besides a cut or frozen host's timeout, nearly all of their time is
starting processes: 2 agents and 2 ranks importing torch and transformers, then 1 rank again.

The full matrix runs with ``PYFUSED_FULL_FAULT_MATRIX=1`` (2-4 minutes a case on the 2-core box,
more than CI's 25-minute budget leaves): 3 hosts x 2 ranks, dp=3 x tp=2 (each host one
tensor-parallel pair), re-formed at dp=2 x tp=2; host 2 killed, its link cut or the host frozen
(the last two waiting out the group timeout), and host 0 killed. In the cases on host 2, host 0
serves the rendezvous store (``is_host``), as the first node of a c10d rendezvous does; the store
is not replicated, so losing host 0 would end the job (docs/MULTIHOST.md). The ``host0`` case
serves the store from the bed's rendezvous host instead (a namespace running no ranks,
``rendezvous_host=True``) and kills host 0: the job re-forms on hosts 1 and 2, its rank 0 now on
host 1. ``pytest -s`` prints the times.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from benchmarks import multihost_testbed as mt
from tests import multihost as M, multihost_checks as C

pytest.importorskip("transformers", reason="examples/train_llm.py needs transformers (the 'models' extra)")
pytestmark = pytest.mark.slow

TRAIN_LLM = M.REPO / "examples" / "train_llm.py"
SAVE_EVERY = 2


@dataclass(frozen=True)
class Job:
    """An elastic job of ``hosts`` x ``per_host`` ranks at tensor parallelism ``tp`` (inside a
    host), struck once its first mesh trained ``strike_after`` steps, trained to ``steps``."""

    hosts: int
    per_host: int
    tp: int
    steps: int
    strike_after: int
    # --timeout: how long a survivor's collective waits for a cut or frozen host; it also bounds
    # how far apart the ranks may arrive at start-up
    group_timeout_s: int = 60

    def raise_within(self, case: str) -> float:
        """Upper bound, generous to a loaded machine, on the survivors' ``PeerFailure`` after the
        strike: a killed host's sockets close at once; a cut or frozen one is noticed when a
        survivor's collective times out."""
        return self.group_timeout_s + (0 if case == "kill" else 45)

    @property
    def world_after(self) -> int:
        """Ranks of the job re-formed on the hosts left."""
        return (self.hosts - 1) * self.per_host

    def train_args(self) -> List[str]:
        # Tiny on purpose: the time goes into starting processes. The batch splits over the dp
        # sizes before and after the loss (3 and 2, or 2 and 1).
        return ["--tp", str(self.tp), "--hidden", "32", "--layers", "2", "--heads", "4",
                "--kv-heads", "2", "--ffn", "64", "--seq", "16", "--batch", "12", "--lr", "1e-2",
                "--log-every", "1", "--steps", str(self.steps)]


# dp=3 x tp=2, each host one tensor-parallel pair: the cut link, the frozen host, losing host 0
FULL_JOB = Job(hosts=3, per_host=2, tp=2, steps=30, strike_after=5)
# The smallest job that still loses a host: one rank per host, dp=2 across the hosts, then dp=1 on
# the host left; fewer processes to start, twice (4, then 1), and fewer steps to train and compare.
COMPACT_JOB = Job(hosts=2, per_host=1, tp=1, steps=8, strike_after=3)
# The same job cut off or frozen: the survivor waits out its group timeout, shortened to 30 s
# (two ranks launched together arrive at start-up within seconds of each other)
COMPACT_TIMEOUT_JOB = replace(COMPACT_JOB, group_timeout_s=30)
# A dead agent is dropped 5 s after its last heartbeat (keep_alive_*); a round with fewer than all
# hosts closes 5 s after the first one joined (last_call_timeout; torchrun's defaults: 15 s, 30 s).
ELASTIC = mt.Elastic(min_nodes=1, max_restarts=3, rdzv_conf=(
    "keep_alive_interval=1", "keep_alive_max_attempt=5", "last_call_timeout=5"))
START_WITHIN_S, RESUME_WITHIN_S, FINISH_WITHIN_S = 400, 400, 300
STRIKES: Dict[str, Callable[[mt.Testbed, int], object]] = {
    "kill": mt.Testbed.kill_host, "cut": mt.Testbed.cut_link, "freeze": mt.Testbed.freeze_host}
FULL = os.environ.get("PYFUSED_FULL_FAULT_MATRIX") == "1"
EXCEPTION = re.compile(r"^\[rank(\d+)\]: ([A-Za-z_][\w.]*): (.*)$", re.MULTILINE)
MESH = re.compile(r"^mesh dp=(\d+) x pp=1 x tp=\d+ \(world (\d+).*?(?:starting at|resumed at) "
                  r"step (\d+)", re.MULTILINE)


@pytest.mark.timeout(START_WITHIN_S + RESUME_WITHIN_S + FINISH_WITHIN_S + 300)
def test_training_survives_a_killed_host(tmp_path, ranks):
    """The compact case, run by default: host 1 of 2 killed, the job re-formed on host 0."""
    _check_host_loss(COMPACT_JOB, "kill", 1, tmp_path, ranks)


@pytest.mark.parametrize("case", ["cut", "freeze"])
@pytest.mark.timeout(START_WITHIN_S + RESUME_WITHIN_S + FINISH_WITHIN_S + 300)
def test_training_survives_a_host_cut_off_or_frozen(case, tmp_path, ranks):
    """The compact job again, host 1's link cut or its processes stopped: host 0's rank raises
    when its collective times out, and the job re-forms on host 0."""
    _check_host_loss(COMPACT_TIMEOUT_JOB, case, 1, tmp_path, ranks)


@pytest.mark.parametrize("case,lost", [
    pytest.param("kill", 2, id="kill", marks=pytest.mark.skipif(
        not FULL, reason="set PYFUSED_FULL_FAULT_MATRIX=1 to kill a host of an elastic 3-host job "
                         "(2-3 minutes on 2 cores: over CI's time budget; "
                         "test_training_survives_a_killed_host kills one of 2 hosts)")),
    pytest.param("cut", 2, id="cut", marks=pytest.mark.skipif(
        not FULL, reason="set PYFUSED_FULL_FAULT_MATRIX=1 to cut a host's link (waits out the "
                         "group timeout)")),
    pytest.param("freeze", 2, id="freeze", marks=pytest.mark.skipif(
        not FULL, reason="set PYFUSED_FULL_FAULT_MATRIX=1 to freeze a host (waits out the group "
                         "timeout)")),
    pytest.param("kill", 0, id="host0", marks=pytest.mark.skipif(
        not FULL, reason="set PYFUSED_FULL_FAULT_MATRIX=1 to kill host 0 of an elastic 3-host job "
                         "whose rendezvous store a host of its own serves")),
])
@pytest.mark.timeout(START_WITHIN_S + RESUME_WITHIN_S + FINISH_WITHIN_S + 300)
def test_training_survives_losing_a_host(case, lost, tmp_path, ranks):
    _check_host_loss(FULL_JOB, case, lost, tmp_path, ranks)


def _check_host_loss(job: Job, case: str, lost: int, tmp_path: Path, ranks) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    with ThreadPoolExecutor(max_workers=1) as background:
        def reference(step: int) -> Future:
            return background.submit(_reference_losses, ranks, job, ckpt, step,
                                     tmp_path / "reference.jsonl")

        run = _run_and_strike(job, case, lost, tmp_path, ckpt, metrics, reference)
        print(f"\nhost loss ({case} host {lost} of {job.hosts} x {job.per_host}): struck "
              f"{run['trained_after']:.1f} s after the launch; every surviving host raised "
              f"PeerFailure {max(run['raised'].values()):.1f} s after the strike; the job resumed "
              f"at step {run['resumed_step']} on {job.world_after} ranks, trained its first step "
              f"{run['resumed_after']:.1f} s and finished {run['finished_after']:.1f} s after "
              f"the strike; messages: {run['messages']}")
        assert max(run["raised"].values()) <= job.raise_within(case), run["raised"]
        resumed = run["resumed_step"]
        assert resumed == run["newest_complete"] and resumed >= SAVE_EVERY, run
        reference_losses = run["reference"].result()  # raises what the reference run raised
    losses = [json.loads(line) for line in metrics.read_text().splitlines()]
    # the re-formed job's lines: from its first step on (a step the struck job finished just
    # before the strike may have been written after it)
    first = max(i for i, m in enumerate(losses) if m["step"] == resumed + 1)
    assert first >= run["lines_before"], (first, run)
    after = losses[first:]
    assert [m["step"] for m in after] == list(range(resumed + 1, job.steps + 1)), after
    assert [m["loss"] for m in after] == reference_losses  # the same computation, bit for bit
    _check_checkpoints(job, ckpt, resumed)


# ---- the faulted run -------------------------------------------------------------------------------
def _run_and_strike(job: Job, case: str, lost: int, tmp_path: Path, ckpt: Path, metrics: Path,
                    reference: Callable[[int], Future]) -> dict:
    """Train on every host, strike host ``lost`` once that job passed ``job.strike_after`` steps,
    and follow the survivors until their job finished; every process is ended on the way out.
    Losing host 0 needs the rendezvous store on a host of its own. ``reference(step)`` starts the
    reference run from the checkpoint the re-formed job must resume from, as soon as it is known
    (it then runs while torchrun re-forms the job, which leaves the cores idle at first)."""
    argv = [str(TRAIN_LLM), *job.train_args(), "--save-every", str(SAVE_EVERY), "--ckpt-dir",
            str(ckpt), "--metrics-file", str(metrics), "--timeout", str(job.group_timeout_s)]
    # several agents: each worker group makes its own store (docs/CHECKPOINT.md); the agents log
    # their restarts and rendezvous rounds (torchrun's LOGLEVEL), which a failure's log tails show
    env = dict(M.worker_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO")
    survivors = [h for h in range(job.hosts) if h != lost]
    # rank 0 of a round is on the host with the lowest address there (torchrun sorts the nodes)
    first, first_after = 0, survivors[0]
    with M.testbed(job.hosts, log_dir=tmp_path, rendezvous_host=lost == 0) as bed:
        launched = time.monotonic()
        launch = bed.launch(argv, nproc_per_node=job.per_host, env=env, log_dir=tmp_path,
                            elastic=ELASTIC)
        world = job.hosts * job.per_host
        _wait_for(lambda: _trained_on(launch.logs[first], world) >= job.strike_after,
                  START_WITHIN_S, launch,
                  f"the {job.hosts}-host job to train {job.strike_after} steps")
        marks = [log.stat().st_size for log in launch.logs]
        lines_before = len(metrics.read_text().splitlines())
        struck = time.monotonic()
        trained_after = struck - launched
        STRIKES[case](bed, lost)
        raised = _wait_for_peer_failures(launch, marks, survivors, struck,
                                         job.raise_within(case) + 60)
        # no save completes once the survivors failed: this is the checkpoint to resume from
        newest_complete = max((_step(d) for d in _complete(ckpt)), default=0)
        reference_run = reference(newest_complete)
        _wait_for(lambda: _trained_on(launch.logs[first_after], job.world_after) > 0,
                  RESUME_WITHIN_S, launch, "first step of the re-formed job")
        resumed_after = time.monotonic() - struck
        codes = launch.wait(FINISH_WITHIN_S, hosts=survivors)
        finished_after = time.monotonic() - struck
        bed.kill_host(lost)  # a cut or frozen host's processes are still there
        assert codes == [0] * len(survivors), f"torchrun exited {codes}\n{launch.tails()}"
        since = _read(launch.logs[first_after], marks[first_after])
    meshes = MESH.findall(since)
    dp_after = job.world_after // job.tp
    assert meshes and meshes[-1][:2] == (str(dp_after), str(job.world_after)), meshes
    failure_text = {h: _failure_text(launch.logs[h], marks[h]) for h in survivors}
    return {"raised": raised, "newest_complete": newest_complete, "reference": reference_run,
            "resumed_step": int(meshes[-1][2]),
            "trained_after": trained_after, "resumed_after": resumed_after,
            "finished_after": finished_after, "lines_before": lines_before,
            "messages": _first_peer_failures(failure_text)}


def _wait_for(ready: Callable[[], bool], timeout: float, launch: mt.Launch, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s\n{launch.tails()}")
        time.sleep(0.1)


def _trained_on(log: Path, world: int) -> int:
    """The last step rank 0 logged since the job last started on ``world`` ranks (0 if none)."""
    text = _read(log) if log.exists() else ""
    starts = list(MESH.finditer(text))
    if not starts or starts[-1].group(2) != str(world):
        return 0
    steps = re.findall(r"^step +(\d+) \|", text[starts[-1].end():], re.MULTILINE)
    return int(steps[-1]) if steps else 0


def _wait_for_peer_failures(launch: mt.Launch, marks: List[int], hosts: List[int], struck: float,
                            timeout: float) -> Dict[int, float]:
    """Seconds from the strike until each host's log showed a rank's ``PeerFailure``; then every
    rank of those hosts that printed an exception must have ended with a ``PeerFailure`` (torchrun
    stops a host's other ranks once one failed, so one rank per host may be all there is)."""
    raised: Dict[int, float] = {}
    deadline = struck + timeout
    while len(raised) < len(hosts):
        for h in hosts:
            if h not in raised and "PeerFailure: " in _failure_text(launch.logs[h], marks[h]):
                raised[h] = time.monotonic() - struck
        if time.monotonic() > deadline:
            raise AssertionError(f"hosts {sorted(set(hosts) - set(raised))} raised no PeerFailure "
                                 f"within {timeout:.0f} s of the strike\n{launch.tails()}")
        time.sleep(0.1)
    time.sleep(2.0)  # the failing ranks' last lines
    for h in hosts:
        last = {}
        for rank, kind, _ in EXCEPTION.findall(_failure_text(launch.logs[h], marks[h])):
            last[rank] = kind
        assert last and all(k.endswith("PeerFailure") for k in last.values()), (h, last)
    return raised


def _read(log: Path, mark: int = 0) -> str:
    """``log`` from byte ``mark`` on (gloo's messages hold non-ASCII characters)."""
    return log.read_bytes()[mark:].decode(errors="replace")


def _failure_text(log: Path, mark: int) -> str:
    """Host log since the strike, up to the re-formed job's start."""
    text = _read(log, mark)
    start = MESH.search(text)
    return text[:start.start()] if start else text


def _first_peer_failures(texts: Dict[int, str]) -> Dict[int, str]:
    return {h: next((msg for _, kind, msg in EXCEPTION.findall(t) if kind.endswith("PeerFailure")),
                    None) for h, t in texts.items()}


# ---- checkpoints ------------------------------------------------------------------------------------
def _step(folder: Path) -> int:
    return int(folder.name.split("_")[1])


def _complete(ckpt: Path) -> List[Path]:
    from pyfused.parallelize import checkpoint

    return sorted((d for d in ckpt.glob("step_*") if re.fullmatch(r"step_\d+", d.name)
                   and checkpoint.is_complete(d)), key=_step)


def _check_checkpoints(job: Job, ckpt: Path, resumed: int) -> None:
    """Every checkpoint marked complete holds every byte its DCP metadata names, those after the
    resumed step were written by the smaller job, and no staging folder is left. (Those up to it
    were written by whichever job ran then: under load torchrun may start on fewer hosts before
    the third one joins.)"""
    from torch.distributed.checkpoint import FileSystemReader

    folders = _complete(ckpt)
    assert [_step(d) for d in folders] == list(range(SAVE_EVERY, job.steps + 1, SAVE_EVERY))
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [d.name for d in folders]
    for d in folders:
        world = json.loads((d / "COMPLETE").read_text())["world_size"]
        assert _step(d) <= resumed or world == job.world_after, (d, world)
        meta = FileSystemReader(d).read_metadata()
        for where in meta.storage_data.values():
            path = d / where.relative_path
            assert path.is_file() and path.stat().st_size >= where.offset + where.length, (d, where)


# ---- the reference: the same script restarted from that checkpoint on that mesh --------------------
def _reference_losses(ranks, job: Job, ckpt: Path, step: int, metrics: Path) -> List[float]:
    started = time.monotonic()
    # the checkpoint alone, in a folder of its own: the reference cannot touch the faulted run's
    folder = metrics.parent / "reference_ckpt"
    shutil.copytree(ckpt / f"step_{step:06d}", folder / f"step_{step:06d}")
    argv = [*job.train_args(), "--ckpt-dir", str(folder), "--resume", f"step_{step:06d}",
            "--metrics-file", str(metrics), "--timeout", str(job.group_timeout_s)]
    if job.world_after == 1:
        _train_in_this_process(str(TRAIN_LLM), argv)
    else:
        ranks.run(job.world_after, _train_on_fake_hosts, str(TRAIN_LLM), argv, job.per_host,
                  timeout=300)
    print(f"\nthe reference run took {time.monotonic() - started:.1f} s")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _train_on_fake_hosts(rank: int, world: int, script: str, argv: List[str],
                         per_host: int) -> None:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("train_llm", script)
    train_llm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_llm)
    with C.fake_hosts(rank, per_host):
        train_llm.train(train_llm.parse_args(argv), torch.device("cpu"))


def _train_in_this_process(script: str, argv: List[str]) -> None:
    """One rank needs no pool: a gloo group of one in the test's own process, running one thread
    as the bed's ranks do (OMP_NUM_THREADS=1), the process's random state restored afterwards."""
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized(), "the test process already has a default group"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                _train_on_fake_hosts(0, 1, script, argv, per_host=1)
            finally:
                dist.destroy_process_group()
    finally:
        torch.set_num_threads(threads)
