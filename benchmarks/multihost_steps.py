"""Across hosts: one training step of each data-parallel method, pyfused against torch, in one run.

The ``multihost`` suite's step rows (benchmarks/bench_multihost.py runs them after its all-reduce
rows, on ranks that span hosts evenly). Model: bench_fsdp's (``depth`` residual blocks of
Linear(width, 2 width) + GELU + Linear(2 width, width), an input and an output Linear), fp32,
AdamW (foreach), MSE loss on a random batch of ``batch`` rows per rank; every variant starts from
the same weights. One step = ``zero_grad`` + forward + backward + ``optimizer.step()``.

Rows (``method``; the baseline of ``speedup`` in brackets):
  torch-ddp          torch DDP over every rank                                [itself]
  pyfused ddp        pyfused DistributedDataParallel, ``all_reduce="auto"`` over the host mesh
                     (hierarchical: reduce-scatter inside a host, all-reduce across)  [torch-ddp]
  pyfused zero2      pyfused DDP with ``shard_optimizer=True`` (ZeRO-2)        [torch-ddp]
  torch-fsdp2        torch ``fully_shard`` on the 1-D mesh of every rank       [itself]
  pyfused fsdp       ``pyfused.fully_shard``, the same mesh                    [torch-fsdp2]
  torch-fsdp2 hsdp   torch ``fully_shard`` on the host mesh (replicate across hosts, shard
                     inside one: ``pyfused.comm.host_mesh()``)                 [itself]
  pyfused hsdp       ``pyfused.fully_shard``, the same mesh                    [torch-fsdp2 hsdp]
Columns: ``time_ms`` the best step, ``median_ms`` the median (all rows sampled round-robin,
``harness.interleaved_samples``, at least ``MIN_SAMPLES`` outside ``--quick``; bench_fsdp's
docstring says why the best); ``speedup`` / ``median_speedup`` against the bracketed baseline;
``tokens_per_s`` = W x batch / best step (a row of the batch is one token's vector);
``state_MB`` (parameters, gradients, optimizer state of this rank) and ``peak_MB`` (live tensor
bytes during one step, ``MemTracker``) as bench_fsdp measures them; ``mesh`` W or R x S.

Before timing, every variant takes two steps from the same weights (the second measures memory)
and its loss afterwards must equal torch DDP's (relative 1e-4): the seven compute the same
training step.
"""
from __future__ import annotations

import copy
import statistics
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from pyfused import comm
from pyfused.bench.harness import BenchContext, interleaved_samples, op_row

from . import bench_fsdp

MB = 1024 * 1024
MIN_SAMPLES = 10
QUICK_SHAPE = bench_fsdp.ModelShape(3, 256, 32)
SHAPE = bench_fsdp.ModelShape(8, 512, 64)  # ~8.4M parameters: 33.6 MB of fp32 gradients
BASELINES = {"torch-ddp": "torch-ddp", "pyfused ddp": "torch-ddp", "pyfused zero2": "torch-ddp",
             "torch-fsdp2": "torch-fsdp2", "pyfused fsdp": "torch-fsdp2",
             "torch-fsdp2 hsdp": "torch-fsdp2 hsdp", "pyfused hsdp": "torch-fsdp2 hsdp"}


def _ddp(name: str, model: nn.Module, ctx: BenchContext):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel

    if name == "torch-ddp":
        m = TorchDDP(model, process_group=ctx.group)
        return m, bench_fsdp.make_opt(m)
    # the suite's group holds every rank but is not the default group: name the host mesh
    m = DistributedDataParallel(model, process_group=ctx.group, host_mesh=comm.host_mesh(),
                                shard_optimizer=name == "pyfused zero2")
    return m, m.wrap_optimizer(bench_fsdp.make_opt(m))


def build(name: str, base: nn.Module, ctx: BenchContext, meshes: Dict[str, object]
          ) -> Tuple[nn.Module, torch.optim.Optimizer, str]:
    """(model, optimizer, mesh label) of one row's variant, from a copy of ``base``."""
    if name in ("torch-ddp", "pyfused ddp", "pyfused zero2"):
        return (*_ddp(name, copy.deepcopy(base), ctx), str(ctx.world))
    mesh = meshes["hsdp" if name.endswith("hsdp") else "flat"]
    model = bench_fsdp.sharded("torch-fsdp2" if name.startswith("torch") else "pyfused", base, mesh)
    return model, bench_fsdp.make_opt(model), "x".join(str(d) for d in mesh.shape)


def _memory(model, opt, step) -> Dict[str, float]:
    try:
        peak = bench_fsdp.peak_bytes(model, opt, step) / MB
    except Exception:  # noqa: BLE001 - a memory tracker that cannot follow a wrapper: no figure
        peak = float("nan")
    return {"state_MB": bench_fsdp.local_bytes(model, opt) / MB, "peak_MB": peak}


def run(ctx: BenchContext, **columns) -> List[Dict]:
    """The step rows (module docstring), each also carrying ``columns``. Needs the ranks to span
    hosts with the same number (>= 2) on each (bench_multihost checks before calling)."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = QUICK_SHAPE if ctx.quick else SHAPE
    dev = ctx.device
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    x = torch.randn(shape.batch, shape.width, generator=gen).to(dev)
    y = torch.randn(shape.batch, 16, generator=gen).to(dev)
    torch.manual_seed(0)
    base = bench_fsdp.Model(shape).to(dev)
    meshes = {"flat": DeviceMesh.from_group(ctx.group, dev.type), "hsdp": bench_fsdp.hsdp_mesh(ctx)}
    timers: Dict[str, Callable[[], None]] = {}
    extra: Dict[str, Dict] = {}
    losses: Dict[str, float] = {}
    live = []
    for name in BASELINES:
        model, opt, mesh = build(name, base, ctx, meshes)
        step = bench_fsdp.step_fn(model, opt, x, y)
        step()
        # memory before the loss: after a no-grad forward FSDP2 reshards its root, and MemTracker
        # would then miss the root's shards in the next step (bench_fsdp.run)
        extra[name] = {"mesh": mesh, **_memory(model, opt, step)}
        with torch.no_grad():  # two steps from the same weights: the same model
            losses[name] = torch.nn.functional.mse_loss(model(x), y).item()
        timers[name] = step
        live.append((model, opt))
    want = losses["torch-ddp"]
    wrong = {n: v for n, v in losses.items() if abs(v - want) > 1e-4 * abs(want)}
    if wrong:
        raise RuntimeError(f"multihost steps: after one step the losses differ from torch DDP's "
                           f"{want}: {wrong}; not timing a wrong result")
    n = ctx.iters if ctx.quick else max(ctx.iters, MIN_SAMPLES)
    samples = interleaved_samples(timers, ctx, iters=n)
    best = {k: min(s) for k, s in samples.items()}
    med = {k: statistics.median(s) for k, s in samples.items()}
    rows = []
    for name, baseline in BASELINES.items():
        rows.append(op_row(ctx, shape=shape.label, dtype=torch.float32, method=name,
                           transport=ctx.transport, ms=best[name], t_baseline=best[baseline],
                           median_ms=med[name], median_speedup=med[baseline] / med[name],
                           samples=n, tokens_per_s=ctx.world * shape.batch / (best[name] * 1e-3),
                           baseline=baseline, **extra[name], **columns))
    del live
    return rows
