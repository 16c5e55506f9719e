"""Fully sharded data parallel: ``pyfused.fully_shard`` against torch's ``fully_shard`` (FSDP2).

Model: ``depth`` residual blocks (Linear(width, 2*width) + GELU + Linear(2*width, width)), an input
and an output Linear; each block one unit, then the root, on the same 1-D mesh, fp32 parameters,
AdamW (foreach), MSE loss on a random batch per rank, ``reshard_after_forward=True``. One step =
``zero_grad`` + forward + backward + ``optimizer.step()``.

Rows (``method``):
  torch-fsdp2     torch.distributed.fsdp.fully_shard (the baseline of ``speedup``)
  pyfused         pyfused.fully_shard, same arguments
  compute alone   the unsharded model in one process on the rank's batch: forward + backward + step
  comm alone      one step's collectives, on buffers of pyfused's unit sizes: every unit's all-gather
                  for forward, again for backward (the root's once) and its reduce-scatter, launched
                  in that order one at a time and waited (no compute)
  ... hsdp        the same three on HSDP's 2-D (replicate, shard) mesh (``mesh`` column R x S):
                  gathers and reduce-scatters within a shard group, then (comm alone) each unit's
                  gradient shard all-reduced across its replicate group; ``speedup`` against
                  ``torch-fsdp2 hsdp``. The mesh: one replica per host where the ranks span hosts
                  evenly (R hosts x S ranks, ``pyfused.comm.host_mesh()``), else 2 x W/2 on one
                  host; no HSDP rows below 4 ranks, where a 2-D mesh has a dim of 1 (FSDP or DDP
                  with extra bookkeeping: nothing hybrid to measure) -- ``--world 4``.
Times: all rows are timed round-robin (``interleaved_samples``), at least ``MIN_SAMPLES`` steps
each outside ``--quick`` (``samples``). ``time_ms`` is the best sample, as ``timeit`` reports: on
a machine shared with other jobs, interference only ever adds time, so the fastest step is the
closest estimate of a step's own cost; ``median_ms`` is the median sample, whose distance from the
best shows how much the machine's noise moved the run.
Derived columns:
  speedup     = torch FSDP2's best / this row's best; ``median_speedup`` the same of the medians;
  comm_hidden = (T_compute + T_comm - T_step) / T_comm, of the best times: the fraction of the
                communication hidden under computation (1: all; 0: none; negative: slower than
                serial);
  state_MB    = this rank's parameter, gradient and optimizer-state bytes after a step (local
                shards; storages counted once);
  peak_MB     = the peak of live tensor bytes during one step (``torch.distributed._tools.
                mem_tracker.MemTracker``: parameters, gradients, optimizer state, activations and
                communication buffers, whichever implementation allocates them).
Goals (reported, not asserted): step time <= 1.0 x torch FSDP2, peak_MB <= torch's.

Standalone: ``torchrun --nproc-per-node 4 -m pyfused.benchmarks.bench_fsdp [--quick]``.
"""
from __future__ import annotations

import copy
import re
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

from pyfused import comm
from pyfused.bench.harness import interleaved_samples, op_row, vs_peer

MULTI_RANK = True
MB = 1024 * 1024
# Steps per timer outside --quick: the paired ratios' median moved by 6% between runs of 20 on a
# 2-core CPU box; its error falls as one over the root of the count.
MIN_SAMPLES = 60


@dataclass(frozen=True)
class ModelShape:
    depth: int
    width: int
    batch: int

    @property
    def label(self) -> str:
        return f"blocks {self.depth}x{self.width} b{self.batch}"


# CPU: ~8.4M parameters (32 MB fp32) in 8 units of 4 MB, a step of ~0.1-0.2 s per rank on one core.
SHAPES = {("cpu", False): ModelShape(8, 512, 64), ("cpu", True): ModelShape(3, 256, 32),
          ("cuda", False): ModelShape(16, 4096, 4096), ("cuda", True): ModelShape(4, 1024, 1024)}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.inp = nn.Linear(shape.width, shape.width)
        self.blocks = nn.ModuleList(Block(shape.width) for _ in range(shape.depth))
        self.out = nn.Linear(shape.width, 16)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def shape_of(ctx) -> ModelShape:
    spec = ctx.options.get("shapes")
    if spec:
        m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", spec)
        if not m:
            raise ValueError(f"bench_fsdp: --shapes takes DEPTHxWIDTHxBATCH, got {spec!r}")
        return ModelShape(*map(int, m.groups()))
    return SHAPES[(ctx.device.type, bool(ctx.quick))]


def sharded(name: str, base: nn.Module, mesh) -> nn.Module:
    model = copy.deepcopy(base)
    if name == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from pyfused.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    return model


def make_opt(model: nn.Module):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def step_fn(model, opt, x, y) -> Callable[[], None]:
    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def comm_alone(model: nn.Module, ctx) -> Callable[[], None]:
    """pyfused's collectives of one step, one at a time, on buffers of its unit sizes (HSDP: within
    the shard group, and each reduced shard all-reduced across the replicate group)."""
    units = [model._pyfused_fsdp] + [b._pyfused_fsdp for b in model.blocks]
    dev = ctx.device
    plan = []  # (kind, numel of one rank's shard, the unit's ParamGroup)
    for u in units:  # forward
        plan.append(("gather", u.group.shard_numel, u.group))
    for u in reversed(units):  # backward: blocks gathered again, then every unit reduced
        if u is not units[0]:
            plan.append(("gather", u.group.shard_numel, u.group))
        plan.append(("reduce", u.group.grad_numel + len(u.group.trainable), u.group))
        if u.group.replicas > 1:
            plan.append(("all-reduce", u.group.grad_numel + len(u.group.trainable), u.group))
    bufs = [(kind, torch.zeros(n, device=dev), torch.zeros(g.world * n, device=dev), g)
            for kind, n, g in plan]

    def run():
        for kind, shard, full, g in bufs:
            if kind == "gather":
                comm.all_gather_single(full, shard, group=g.pg)
            elif kind == "reduce":
                comm.reduce_scatter_single(shard, full, group=g.pg)
            else:
                dist.all_reduce(shard, group=g.replicate_pg)
    return run, len(plan)


def hsdp_mesh(ctx):
    """HSDP's 2-D ("dp_replicate", "dp_shard") mesh of the bench's ranks (module docstring), or
    None below 4 ranks or with an odd number on one host. Collective over the default group (the
    bench's group must hold every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(ctx.group) if ctx.group is not None else \
        list(range(ctx.world))
    layout = comm.host_layout(ctx.group)
    if layout.spans_hosts and (layout.ranks_per_host or 0) >= 2:
        rows = [[ranks[r] for r in layout.ranks_of(h)] for h in layout.names]
    elif ctx.world >= 4 and ctx.world % 2 == 0:
        rows = [ranks[:ctx.world // 2], ranks[ctx.world // 2:]]
    else:
        return None
    return DeviceMesh(ctx.device.type, rows, mesh_dim_names=("dp_replicate", "dp_shard"))


def local_bytes(model, opt) -> int:
    seen, total = set(), 0
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values()]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = getattr(t, "_local_tensor", t)
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def peak_bytes(model, opt, step) -> int:
    """Peak live tensor bytes of one step on this rank (MemTracker), or -1 where it cannot run."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # pragma: no cover - older torch
        return -1
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")
    return max(v.get("Total", 0) for v in snap.values())


def run(ctx) -> List[Dict]:
    from torch.distributed.device_mesh import DeviceMesh

    shape = shape_of(ctx)
    dev = ctx.device
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    x = torch.randn(shape.batch, shape.width, generator=gen).to(dev)
    y = torch.randn(shape.batch, 16, generator=gen).to(dev)
    torch.manual_seed(0)
    base = Model(shape).to(dev)
    meshes = {"": DeviceMesh.from_group(ctx.group, dev.type)}
    hsdp = hsdp_mesh(ctx)
    if hsdp is not None:
        meshes[" hsdp"] = hsdp

    local = copy.deepcopy(base)
    timers: Dict[str, Callable[[], None]] = {"compute alone": step_fn(local, make_opt(local), x, y)}
    memory: Dict[str, Dict] = {}
    collectives: Dict[str, int] = {}
    live = []
    for suffix, mesh in meshes.items():
        losses = {}
        for name in ("torch-fsdp2", "pyfused"):
            model = sharded(name, base, mesh)
            opt = make_opt(model)
            step = step_fn(model, opt, x, y)
            step()
            # memory first: after a no-grad forward FSDP2 reshards its root, and MemTracker then
            # misses the root's shards in the next step (0.5 MB less than FSDP2 holds on the CPU
            # model)
            memory[name + suffix] = {"state_MB": local_bytes(model, opt) / MB,
                                     "peak_MB": peak_bytes(model, opt, step) / MB}
            with torch.no_grad():  # after two steps from the same weights: the same model
                losses[name] = torch.nn.functional.mse_loss(model(x), y).item()
            if name == "pyfused":
                timers["comm alone" + suffix], collectives[suffix] = comm_alone(model, ctx)
            timers[name + suffix] = step
            live.append((model, opt))
        want, got = losses["torch-fsdp2"], losses["pyfused"]
        if abs(got - want) > 1e-4 * abs(want):
            raise RuntimeError(f"bench_fsdp: after one step pyfused{suffix}'s loss is {got}, torch "
                               f"FSDP2{suffix}'s {want}; not timing a wrong result")
    n = ctx.iters if ctx.quick else max(ctx.iters, MIN_SAMPLES)
    samples = interleaved_samples(timers, ctx, iters=n)
    t = {name: min(s) for name, s in samples.items()}
    med = {name: statistics.median(s) for name, s in samples.items()}
    rows = [op_row(ctx, shape=shape.label, dtype=torch.float32, method="compute alone",
                   transport="none", ms=t["compute alone"], median_ms=med["compute alone"],
                   samples=n, mesh="1",
                   note="one process, local batch, unsharded, no communication")]
    for suffix, mesh in meshes.items():
        label = "x".join(str(d) for d in mesh.shape)
        comm_name, base_name = "comm alone" + suffix, "torch-fsdp2" + suffix
        rows.append(op_row(ctx, shape=shape.label, dtype=torch.float32, method=comm_name,
                           transport=ctx.transport, ms=t[comm_name], median_ms=med[comm_name],
                           samples=n, mesh=label,
                           note=f"{collectives[suffix]} collectives of one step, serial"))
        for name in (base_name, "pyfused" + suffix):
            hidden = (t["compute alone"] + t[comm_name] - t[name]) / t[comm_name]
            rows.append(op_row(ctx, shape=shape.label, dtype=torch.float32, method=name,
                               transport=ctx.transport, ms=t[name], t_baseline=t[base_name],
                               t_gemm=t["compute alone"], t_comm=t[comm_name], comm_hidden=hidden,
                               median_ms=med[name], median_speedup=med[base_name] / med[name],
                               **vs_peer(base_name, name, samples), samples=n, mesh=label,
                               note="goal: speedup >= 1.0, peak_MB <= torch's"
                               if name.startswith("pyfused") else "", **memory[name]))
    del live
    return rows


def _main() -> None:  # torchrun --nproc-per-node N -m pyfused.benchmarks.bench_fsdp [--quick]
    import argparse

    from pyfused.bench import launch
    from pyfused.bench.harness import BenchContext

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shapes", default=None, help="DEPTHxWIDTHxBATCH")
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    backend = launch.resolve_backend("auto")
    rank, world, device = launch.init_rank(backend, 300)
    warmup, iters = (1, 3) if args.quick else (2, 10)
    ctx = BenchContext(rank, world, dist.group.WORLD, device, backend, args.quick, warmup,
                       args.iters or iters, {"shapes": args.shapes})
    rows = run(ctx)
    if rank == 0:
        cols = ("method", "mesh", "time_ms", "median_ms", "speedup", "median_speedup",
                "comm_hidden", "state_MB", "peak_MB")
        print(f"{rows[0]['shape']}  world={world}  backend={backend}")
        print("  ".join(f"{c:>14}" for c in cols))
        for r in rows:
            print("  ".join(f"{_fmt(r.get(c)):>14}" for c in cols))
    dist.destroy_process_group()


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if v != v else f"{v:.3f}"
    return "" if v is None else str(v)


if __name__ == "__main__":
    _main()
