"""A rank that dies (SIGKILL) or freezes (stuck in ``time.sleep``, or SIGSTOP) mid-run never hangs
the others: on every communicating path of pyfused, each surviving rank raises ``PeerFailure``
naming the pyfused operation within the group's timeout plus a margin, and exits.

The shared rank pool (tests/dist_pool.py) cannot lose a rank, so these tests start three fresh gloo
ranks per case (tests/fault_ranks.py), with a group timeout of ``TIMEOUT_S``. The victim is rank
``VICTIM``; it records when it struck, the survivors record when and what they raised, and every
process left is killed in teardown. Each case prints its times (``pytest -s`` shows them).
tests/test_faults_pipeline.py strikes at every moment of a pipeline step; tests/test_faults_ddp.py
bounds DDP's waits behind gradient buckets that a peer joined late.

The tests after them use the shared pool: local work that fails on one rank reaches every rank at
once (the pipeline bench suite without matplotlib included), and the fused kernels' waits and a
DeviceMesh's groups take the group's timeout.
"""
from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fault_ranks import launch, record_strike

WORLD = 3
VICTIM = 1
TIMEOUT_S = 3.0   # the process group's timeout: what bounds a wait on a frozen peer
# Raising after the group's timeout may take a little longer: the survivor may start a new wait
# just after the freeze, and the machine is shared (2 cores, several ranks).
MARGIN_S = 6.0
STRIKE_STEP = 2   # the victim runs two healthy steps first, so every path is past its first call
STEPS = 4


# ----------------------------------------------------------------------------- the fault
class Fault:
    """Where the victim strikes: ``point(step)`` kills or freezes this process at STRIKE_STEP."""

    def __init__(self, rank: int, mode: str, out: Path):
        self.rank, self.mode, self.out = rank, mode, out

    def point(self, step: int) -> None:
        if self.rank != VICTIM or step != STRIKE_STEP:
            return
        record_strike(self.out)
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:  # "freeze": alive (gloo's threads too), but never calls into the group again
            time.sleep(3600)


# ----------------------------------------------------------------------------- the paths
def _ops(rank, fault, method):
    import pyfused.ops as ops

    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        fault.point(step)
        a = torch.randn(WORLD * 4, 8, generator=g, requires_grad=True)
        b = torch.randn(8, 6, generator=g, requires_grad=True)
        y = ops.all_gather_matmul(a, b, method=method)                      # [3 * 12, 6]
        z = ops.matmul_reduce_scatter(y, torch.randn(6, 6, generator=g), method=method)  # [12, 6]
        z = ops.matmul_all_reduce(z, torch.randn(6, 6, generator=g), method=method)
        normed, _ = ops.all_reduce_add_rmsnorm(z, torch.zeros_like(z), torch.ones(6), method=method)
        normed.sum().backward()


def _tp_layers(rank, fault):
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    mlp = nn.Sequential(ColumnParallelLinear(10, 6 * WORLD), nn.GELU(), RowParallelLinear(6 * WORLD, 10))
    for step in range(STEPS):
        fault.point(step)
        x = torch.randn(5, 10, requires_grad=True)
        mlp(x).pow(2).sum().backward()


def _ddp(rank, fault, shard_optimizer):
    from pyfused.layers import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0005, shard_optimizer=shard_optimizer)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if shard_optimizer:
        opt = ddp.wrap_optimizer(opt)
    for step in range(STEPS):
        loss = ddp(torch.randn(6, 12)).pow(2).mean()
        if not shard_optimizer:
            fault.point(step)  # between forward and backward: the peers wait in the reduction
        loss.backward()
        if shard_optimizer:
            fault.point(step)  # before the step: the peers' next forward waits for the gathers
        opt.step()
        opt.zero_grad()


def _fsdp(rank, fault):
    from pyfused import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        loss = model(torch.randn(6, 12)).pow(2).mean()
        fault.point(step)  # between forward and backward: the peers wait in the reduce-scatters
        loss.backward()
        opt.step()
        opt.zero_grad()


class _Strike(nn.Module):
    """A stage's layer that lets the fault strike in the middle of a pipeline step."""

    def __init__(self, fault):
        super().__init__()
        self.fault, self.calls = fault, 0

    def forward(self, x):
        self.calls += 1
        self.fault.point(self.calls // 3)  # the third microbatch of the second step
        return x


def _pipeline(rank, fault, where):
    from pyfused.pipeline import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh()]
    if where == "p2p":
        layers.append(_Strike(fault))
    stage = PipelineStage(nn.Sequential(*layers), rank, WORLD, "cpu")
    sched = Schedule1F1B(stage, 4, nn.MSELoss())
    for step in range(STEPS):
        if where == "agreement":
            fault.point(step)  # skips the step: the peers wait in the step's argument agreement
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == WORLD - 1 else None)


def _parallelize(rank, fault):
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=60, hidden_size=24, intermediate_size=30, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=16)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    pm = pyfused.parallelize(tf.LlamaForCausalLM(cfg), mesh)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        fault.point(step)
        ids = torch.randint(0, 60, (2, 9), generator=g)
        out = pm(input_ids=ids, labels=ids)
        pm.backward(out.loss)


# A bench suite (``python -m pyfused.bench --suites tests.test_faults``): one all-reduce per call;
# the victim strikes in its third call, inside the suite.
MULTI_RANK = True
_suite_state = {}


def run(ctx):
    step = _suite_state["calls"] = _suite_state.get("calls", 0) + 1
    _suite_state["fault"].point(step)
    x = torch.ones(4)
    dist.all_reduce(x, group=ctx.group)
    return [{"time_ms": float(x[0])}]


def _bench_suite(rank, fault):
    """The bench CLI's per-suite loop: the suite runs in its own group, then the ranks agree."""
    from pyfused.bench import cli
    from pyfused.bench.harness import BenchContext

    _suite_state["fault"] = fault
    control = dist.new_group(backend="gloo",
                             timeout=datetime.timedelta(seconds=cli.CONTROL_TIMEOUT_S))
    base = BenchContext(rank, WORLD, None, torch.device("cpu"), "gloo", True, 0, 1, {})
    for _ in range(STEPS):
        cli.run_suite("tests.test_faults", base, control, TIMEOUT_S)


PATHS = {
    "ops-unfused": lambda r, f: _ops(r, f, "unfused"),
    "ops-decomposed": lambda r, f: _ops(r, f, "decomposed"),
    "tp-layers": _tp_layers,
    "ddp": lambda r, f: _ddp(r, f, shard_optimizer=False),
    "ddp-sharded-optimizer": lambda r, f: _ddp(r, f, shard_optimizer=True),
    "fsdp": _fsdp,
    "pipeline-p2p": lambda r, f: _pipeline(r, f, "p2p"),
    "pipeline-agreement": lambda r, f: _pipeline(r, f, "agreement"),
    "parallelize": _parallelize,
    "bench-suite": _bench_suite,
}
# What each path's error must name (one of these, after "pyfused.").
NAMES = {
    "ops-unfused": ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                    "all_reduce_add_rmsnorm"),
    "tp-layers": ("ColumnParallelLinear", "RowParallelLinear", "all_gather_matmul",
                  "matmul_reduce_scatter", "matmul_all_reduce", "tensor-parallel"),
    "ddp": ("DistributedDataParallel backward",),
    "ddp-sharded-optimizer": ("DistributedDataParallel sharded optimizer (parameter gather)",),
    "fsdp": ("fully_shard",),
    "pipeline-p2p": ("pipeline schedule step",),
    "pipeline-agreement": ("pipeline.1f1b (cross-rank input check)",),
    "parallelize": ("parallelize", "all_gather_matmul", "matmul_reduce_scatter",
                    "matmul_all_reduce", "tensor-parallel", "ColumnParallelLinear",
                    "RowParallelLinear", "vocab"),
}
NAMES["ops-decomposed"] = NAMES["ops-unfused"]
NAMES["bench-suite"] = ("bench agreement after suite",)


# ----------------------------------------------------------------------------- one case
def _run_path(rank: int, out: Path, path: str, mode: str) -> None:
    PATHS[path](rank, Fault(rank, mode, out))


def run_with_fault(path: str, mode: str, tmp_path: Path) -> dict:
    """Run ``path`` on 3 fresh gloo ranks with rank VICTIM striking; return the survivors' results
    and timings. Every process is gone when this returns."""
    bound = 3 * TIMEOUT_S + MARGIN_S  # the longest any path may take (the bench suite's)
    return launch(_run_path, (path, mode), world=WORLD, victim=VICTIM, out=tmp_path,
                  timeout_s=TIMEOUT_S, bound_s=bound,
                  preload=["pyfused.layers", "pyfused.pipeline", "pyfused.parallelize",
                           "transformers.models.llama.modeling_llama", "tests.test_faults"])


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", ["kill", "freeze"])
@pytest.mark.parametrize("path", list(PATHS))
def test_survivors_raise_in_bounded_time(path, mode, tmp_path):
    results = run_with_fault(path, mode, tmp_path)
    # the bench waits for a frozen rank in the suite (--timeout), then in the agreement after it
    # (twice --timeout; pyfused/bench/cli.py _bounded), whose timeout the message names
    named_s = 2 * TIMEOUT_S if path == "bench-suite" else TIMEOUT_S
    waits_s = TIMEOUT_S + named_s if path == "bench-suite" else TIMEOUT_S
    bound = (waits_s if mode != "kill" else 0.0) + MARGIN_S
    times = ", ".join(f"rank {r} raised at {res['raise_s']:.2f} s, exited at {res['exit_s']:.2f} s"
                      for r, res in results.items() if res.get("raised"))
    print(f"\n{path} / {mode} (group timeout {TIMEOUT_S:g} s): {times}")
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        assert res["exitcode"] == 1, f"rank {r}: {res}"
        msg = res["message"]
        assert any(f"pyfused.{name}" in msg for name in NAMES[path]), f"rank {r}: {msg}"
        assert f"on rank {r} of group" in msg and f"timeout is {named_s:g} s" in msg, msg
        assert 0 <= res["raise_s"] <= bound, f"rank {r} raised after {res['raise_s']:.1f} s: {msg}"
        assert res["exit_s"] - res["raise_s"] <= MARGIN_S, f"rank {r} lingered: {res}"
    if path.startswith("pipeline-p2p"):
        # a transfer names the peer it waited on (one of the survivors waits on the victim)
        assert any(res["peer"] is not None for res in results.values()), results


def test_sigstop_is_a_freeze(tmp_path):
    """A stopped process (SIGSTOP: its gloo threads stop too) is handled like a frozen one."""
    results = run_with_fault("ddp", "stop", tmp_path)
    for r, res in results.items():
        assert res["raised"] == "PeerFailure" and res["raise_s"] <= TIMEOUT_S + MARGIN_S, (r, res)


def test_non_communication_errors_pass_through():
    """A module's own error inside a named block is not dressed up as a peer failure; a backend's
    is, by the context manager and by the decorator (over a ``pg`` or ``group_name`` argument)."""
    from pyfused.comm import InputError, PeerFailure, failures_named, names_failures

    with pytest.raises(InputError):
        with failures_named("op", None):
            raise InputError("bad shape")
    with pytest.raises(ZeroDivisionError):
        with failures_named("op", None):
            1 / 0

    @names_failures("op2")
    def run(a, pg, method):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer")

    with pytest.raises(PeerFailure, match=r"pyfused\.op2 \(unfused\).*Connection closed"):
        run(1, None, "unfused")
    with pytest.raises(PeerFailure, match=r"pyfused\.op \(decomposed\).*Timed out"):
        with failures_named("op", None, "decomposed"):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms")


# ----------------------------------------------------------------------------- local work
def _local_failure_on_rank_1(rank, world):
    from pyfused.comm import LocalWorkError, agree_on_local_work

    def write_file():
        if rank == 1:
            raise OSError("disk full")
        return rank

    assert agree_on_local_work(dist.group.WORLD, "writing a file", lambda: rank) == rank
    t0 = time.monotonic()
    try:
        agree_on_local_work(dist.group.WORLD, "writing a file", write_file)
    except LocalWorkError as e:
        return str(e), time.monotonic() - t0
    dist.barrier()  # where a rank that was not told would wait for the group's timeout
    return None, time.monotonic() - t0


def test_local_failure_reaches_every_rank_at_once(ranks):
    got = ranks.run(3, _local_failure_on_rank_1, timeout=30)
    for message, seconds in got:
        assert message == "writing a file failed on rank 1: OSError: disk full", message
        assert seconds < 10  # at once, not after the group's timeout (90 s in the pool)


def _bench_pipeline_without_matplotlib(rank, world, out):
    import sys

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_pipeline

    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "matplotlib"}
    sys.modules["matplotlib"] = None  # ``import matplotlib`` raises ImportError: a minimal install
    try:
        ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                           warmup=1, iters=2, options={"out": out})
        return bench_pipeline.run(ctx)
    finally:
        del sys.modules["matplotlib"]
        sys.modules.update(saved)


def test_pipeline_suite_without_matplotlib_skips_its_plot(ranks, tmp_path):
    results = ranks.run(2, _bench_pipeline_without_matplotlib, str(tmp_path), timeout=120)
    ours = [r for r in results[0] if r["method"] == "pyfused"]
    assert ours and all(r["time_ms"] > 0 for r in results[0])
    for r in ours:
        assert r["timeline_png"] == "" and "matplotlib is not installed" in r["note"], r
    assert not list(tmp_path.glob("*.png"))
    assert [r["shape"] for r in results[1]] == [r["shape"] for r in results[0]]


def _fused_wait_bound(rank, world):
    from pyfused.comm import group_timeout
    from pyfused.fused import config

    saved = os.environ.pop("PYFUSED_FUSED_TIMEOUT_MS", None)  # the override (gpu_check.sh sets it)
    try:
        return config.timeout_ms(), group_timeout(dist.group.WORLD).total_seconds()
    finally:
        if saved is not None:
            os.environ["PYFUSED_FUSED_TIMEOUT_MS"] = saved


def test_fused_waits_follow_the_group_timeout(ranks):
    """The fused kernels' device-side waits on peers are bounded by the group's timeout too, and end
    before it, so that the kernel's report (rank, peer, flag) is the one the user sees."""
    from pyfused.fused.config import GROUP_TIMEOUT_SHARE

    for ms, group_s in ranks.run(2, _fused_wait_bound, timeout=30):
        assert 0 < ms == int(group_s * 1000 * GROUP_TIMEOUT_SHARE) < group_s * 1000


def _mesh_timeouts(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from pyfused.comm import group_timeout
    from pyfused.parallelize.api import MeshInfo

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("tp", "dp"))
    before = group_timeout(mesh.get_group("dp")).total_seconds()  # a dim smaller than the world
    after = group_timeout(MeshInfo(mesh).group["dp"]).total_seconds()
    return before, after, group_timeout(dist.group.WORLD).total_seconds()


def test_parallelize_mesh_groups_take_the_default_timeout(ranks):
    """A DeviceMesh's sub-groups are made with torch's 30-minute default; parallelize gives them
    the timeout of init_process_group."""
    for before, after, world_s in ranks.run(3, _mesh_timeouts, timeout=30):
        assert before == 30 * 60 and after == world_s != before
