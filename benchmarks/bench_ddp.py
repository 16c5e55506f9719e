"""Data parallelism: pyfused ``DistributedDataParallel`` against torch DDP, in the same run.

Model: an MLP of ``depth`` x (Linear(width, width) + GELU) + a Linear head, fp32 parameters (bf16
autocast on CUDA when the run's dtype is bf16), AdamW (foreach), MSE loss on a random batch per rank.
One step = ``zero_grad`` + forward + backward + ``optimizer.step()``; a sharded variant's parameter
all-gathers are waited for in the next step's forward, so they are inside the timed window.

Rows (``method``):
  torch-ddp              torch.nn.parallel.DistributedDataParallel (the baseline of ``speedup``)
  pyfused                pyfused DistributedDataParallel, same options
  torch-ddp+bf16hook     torch DDP with its bf16_compress_hook
  pyfused comm=bf16      pyfused with comm_dtype=torch.bfloat16
  torch-zero1            torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer
  pyfused zero2          pyfused with shard_optimizer=True (+ wrap_optimizer)
  torch-fsdp2 zero2      torch fully_shard(reshard_after_forward=False) on every Linear and the
                         root: FSDP2's ZeRO-2 (gradients and optimizer state sharded, parameters
                         kept gathered from forward to backward)
and the two parts the overlap is measured against: ``compute alone`` (the same model, one process,
its local batch, no communication: forward + backward + step) and, per communication pattern, the
collectives alone (each bucket's all-reduce -- or reduce-scatter + all-gather -- launched back to
back and waited, as the reducer issues them).

Times: every variant and part is timed round-robin (``interleaved_samples``: round i steps each
once before round i+1 steps any), ``ROUNDS`` rounds outside ``--quick``; ``time_ms`` is the median.
Each pyfused row names its torch ``peer`` (pyfused: torch-ddp; comm=bf16: torch-ddp+bf16hook;
zero2: torch-zero1 and, as ``vs_fsdp2``, torch-fsdp2 zero2) and compares with it three ways:
  vs_peer       = the median over rounds of T_peer / T_this within each round (> 1: pyfused faster):
                  the suite's ratio; a slow patch of a shared machine slows both steps of a round;
  vs_peer_best  = the peer's best step / this row's best step (``timeit``'s estimator);
  speedup       = T_torch-ddp / T_this of the medians (every row, the CLI table's column).
Derived columns:
  comm_hidden = (T_compute + T_comm - T_step) / T_comm: the fraction of the communication hidden
                behind computation (1: all of it; 0: none; negative: slower than serial);
  overlap_eff = the harness's (T_compute + T_comm - T_step) / min(T_compute, T_comm);
  opt_state_MB, opt_state_ratio (per rank, relative to the unsharded optimizer of the same model:
                the goal for a sharded one is <= 1.1 / world);
  peak_MB (CUDA: ``max_memory_allocated`` over the variant's steps, above what was allocated
                before it was built) or, on CPU, where no allocator statistics exist, state_MB: the
                live bytes of parameters, gradients, communication buckets and optimizer state after
                a step (storages counted once; torch DDP's buckets from its reducer's sizes).
Goals (reported, not asserted): vs_peer >= 1.0 (zero2: vs_fsdp2 too); sharded state <= 1.1 / world.

Standalone: ``torchrun --nproc-per-node 2 -m pyfused.benchmarks.bench_ddp [--quick]``.
"""
from __future__ import annotations

import copy
import gc
import re
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from pyfused import comm
from pyfused.bench.harness import interleaved_samples, op_row, vs_peer
from pyfused.dp import shard_comm

MULTI_RANK = True
MB = 1024 * 1024


@dataclass(frozen=True)
class ModelShape:
    depth: int
    width: int
    batch: int

    @property
    def label(self) -> str:
        return f"mlp {self.depth}x{self.width} b{self.batch}"


# (device type, quick) -> shape. CPU: ~6.3M parameters (25 MB of fp32 gradients, two buckets of the
# default 25 MB cap plus the 1 MB first one), a step of ~100 ms on one core per rank. CUDA: ~135M
# parameters, bucketed into ~22 buckets, a step dominated by GEMMs of 4096 x 4096.
SHAPES = {("cpu", False): ModelShape(6, 1024, 32), ("cpu", True): ModelShape(3, 256, 16),
          ("cuda", False): ModelShape(8, 4096, 2048), ("cuda", True): ModelShape(4, 1024, 512)}


def shape_of(ctx) -> ModelShape:
    spec = ctx.options.get("shapes")
    if spec:
        m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", spec)
        if not m:
            raise ValueError(f"bench_ddp: --shapes takes DEPTHxWIDTHxBATCH, got {spec!r}")
        return ModelShape(*map(int, m.groups()))
    return SHAPES[(ctx.device.type, bool(ctx.quick))]


def build_model(shape: ModelShape, device) -> nn.Module:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(shape.depth):
        layers += [nn.Linear(shape.width, shape.width), nn.GELU()]
    layers.append(nn.Linear(shape.width, 16))
    return nn.Sequential(*layers).to(device)


def make_opt(params, zero=False, group=None):
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4,
                                       process_group=group)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


# ----------------------------------------------------------------------------- variants

def variant(name: str, ctx, base: nn.Module) -> Tuple[nn.Module, torch.optim.Optimizer, str]:
    """(wrapped model, optimizer, comm pattern) for one row."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel

    model = copy.deepcopy(base)
    g = ctx.group
    if name == "torch-ddp":
        m = TorchDDP(model, process_group=g)
        return m, make_opt(m.parameters()), "allreduce"
    if name == "torch-ddp+bf16hook":
        m = TorchDDP(model, process_group=g)
        m.register_comm_hook(g, bf16_compress_hook)
        return m, make_opt(m.parameters()), "allreduce-bf16"
    if name == "torch-zero1":
        m = TorchDDP(model, process_group=g)
        return m, make_opt(m.parameters(), zero=True, group=g), "zero1"
    if name == "pyfused":
        m = DistributedDataParallel(model, process_group=g)
        return m, make_opt(m.parameters()), "allreduce"
    if name == "pyfused comm=bf16":
        m = DistributedDataParallel(model, process_group=g, comm_dtype=torch.bfloat16)
        return m, make_opt(m.parameters()), "allreduce-bf16"
    if name == "pyfused zero2":
        m = DistributedDataParallel(model, process_group=g, shard_optimizer=True)
        return m, m.wrap_optimizer(make_opt(m.parameters())), "zero2"
    if name == "torch-fsdp2 zero2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(g, ctx.device.type)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model, make_opt(model.parameters()), "fsdp2"
    raise ValueError(name)


VARIANTS = ("torch-ddp", "pyfused", "torch-ddp+bf16hook", "pyfused comm=bf16", "torch-zero1",
            "pyfused zero2", "torch-fsdp2 zero2")
QUICK_VARIANTS = ("torch-ddp", "pyfused", "pyfused zero2")
# Each pyfused row's torch peer (``vs_peer``); zero2 is also compared with FSDP2's ZeRO-2.
PEERS = {"pyfused": "torch-ddp", "pyfused comm=bf16": "torch-ddp+bf16hook",
         "pyfused zero2": "torch-zero1"}
FSDP2_PEER = {"pyfused zero2": "torch-fsdp2 zero2"}
# Steps per variant outside --quick (at least --iters). A step's time on the 2-core CPU box moves
# by +-15% from round to round; the paired ratios' median moved by up to 9% between runs of 40
# rounds, and its error falls as one over the root of the count.
ROUNDS = 100


def step_fn(model, opt, x, y, amp_dtype) -> Callable[[], None]:
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        opt.step()
    return step


# ----------------------------------------------------------------------------- communication alone

def comm_alone(pattern: str, ctx, bucket_numels: List[int], padded: List[int]) -> Callable[[], None]:
    """The variant's collectives on buffers of its bucket sizes, launched back to back, waited."""
    dev, g, w = ctx.device, ctx.group, ctx.world
    all_gather = comm.all_gather_single
    full = [torch.zeros(n, device=dev) for n in padded]
    shards = [torch.zeros(n // w, device=dev) for n in padded]
    if pattern in ("allreduce", "allreduce-bf16", "zero1"):
        dt = torch.bfloat16 if pattern == "allreduce-bf16" else torch.float32
        bufs = [torch.zeros(n, dtype=dt, device=dev) for n in bucket_numels]

        def run():
            works = [dist.all_reduce(b, group=g, async_op=True) for b in bufs]
            if pattern == "zero1":  # then every rank's updated parameters are shared
                works += [all_gather(f, s, group=g, async_op=True) for s, f in zip(shards, full)]
            for wk in works:
                wk.wait()
        return run

    def run_zero2():  # in the form the sharded optimizer issues them (pyfused/dp/shard_comm.py)
        works = [shard_comm.reduce_scatter(s, f, g) for s, f in zip(shards, full)]
        works += [shard_comm.all_gather_in_place(f, f.numel() // w, g) for f in full]
        for wk in works:
            wk.wait()
    return run_zero2


# ----------------------------------------------------------------------------- memory

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.device)


def state_bytes(model, opt) -> int:
    """Live bytes of parameters, gradients, communication buckets and optimizer state."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    reducer = getattr(model, "reducer", None)
    if hasattr(reducer, "buckets"):  # pyfused
        for b in reducer.buckets:
            for v in b.extra.values():
                add(v if isinstance(v, torch.Tensor) else None)
    elif reducer is not None:  # torch DDP: its bucket buffers are C++-side; take their sizes
        for gb in reducer._get_zeros_like_grad_buckets():
            total += gb.buffer().numel() * gb.buffer().element_size()
    inner = getattr(opt, "optim", opt)
    for st in inner.state.values():
        for v in st.values():
            add(v if isinstance(v, torch.Tensor) else None)
    return total


def opt_state_bytes(opt) -> int:
    """Bytes of this rank's optimizer state (FSDP2's: its DTensors' local shards)."""
    seen, total = set(), 0
    for st in getattr(opt, "optim", opt).state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v = _local(v)
                if _storage_key(v) not in seen:
                    seen.add(_storage_key(v))
                    total += v.untyped_storage().nbytes()
    return total


# ----------------------------------------------------------------------------- suite

def run(ctx) -> List[Dict]:
    shape = shape_of(ctx)
    dev = ctx.device
    amp = torch.bfloat16 if dev.type == "cuda" and ctx.dtype == torch.bfloat16 else None
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    x = torch.randn(shape.batch, shape.width, generator=gen).to(dev)
    y = torch.randn(shape.batch, 16, generator=gen).to(dev)
    base = build_model(shape, dev)
    dtype = amp or torch.float32
    names = QUICK_VARIANTS if ctx.quick else VARIANTS

    # Build every variant (memory measured as each is built and stepped), then time them all in
    # interleaved rounds, so that a slow patch of a shared machine hits every variant alike.
    local = copy.deepcopy(base)
    timers: Dict[str, Callable[[], None]] = {
        "compute alone": step_fn(local, make_opt(local.parameters()), x, y, amp)}
    info: Dict[str, Dict] = {}
    patterns: Dict[str, str] = {}
    live = []
    for name in names:
        model, opt, pattern, extra = _build_and_measure(name, ctx, base, x, y, amp)
        live.append((model, opt))
        timers[name] = step_fn(model, opt, x, y, amp)
        info[name], patterns[name] = extra, pattern
        key = f"comm alone ({pattern})"
        if key not in timers and pattern != "fsdp2":  # FSDP2's collectives are its own
            numels, padded = _bucket_sizes(model, ctx.world)
            timers[key] = comm_alone(pattern, ctx, numels, padded)
            info[key] = {"note": f"{len(numels)} buckets, {sum(numels) * 4 / MB:.1f} MB of fp32 "
                                 f"gradients"}
    rounds = ctx.iters if ctx.quick else max(ROUNDS, ctx.iters)
    samples = interleaved_samples(timers, ctx, iters=rounds)
    t = {k: statistics.median(v) for k, v in samples.items()}

    unsharded = info.get("torch-ddp", {}).get("opt_state_bytes")
    rows = [op_row(ctx, shape=shape.label, dtype=dtype, method="compute alone", transport="none",
                   ms=t["compute alone"], note="one process, local batch, no communication")]
    for k in t:
        if k.startswith("comm alone"):
            rows.append(op_row(ctx, shape=shape.label, dtype=dtype, method=k,
                               transport=ctx.transport, ms=t[k], note=info[k]["note"]))
    for name in names:
        t_comm = t.get(f"comm alone ({patterns[name]})", float("nan"))
        extra = dict(info[name])
        ob = extra.pop("opt_state_bytes")
        extra["opt_state_MB"] = ob / MB
        extra["opt_state_ratio"] = ob / unsharded if unsharded else float("nan")
        extra.update(_vs_peers(name, samples))
        hidden = (t["compute alone"] + t_comm - t[name]) / t_comm if t_comm > 0 else float("nan")
        rows.append(op_row(ctx, shape=shape.label, dtype=dtype, method=name,
                           transport=ctx.transport, ms=t[name], t_baseline=t.get("torch-ddp"),
                           t_gemm=t["compute alone"], t_comm=t_comm, note=_note(name, ctx.world),
                           comm_hidden=hidden, rounds=rounds, **extra))
    del live
    return rows


def _vs_peers(name: str, samples: Dict[str, List[float]]) -> Dict:
    """A pyfused row's ratios to its torch peers, from the same rounds (module docstring)."""
    out = vs_peer(PEERS[name], name, samples) if name in PEERS else {}
    if name in FSDP2_PEER:
        fsdp2 = vs_peer(FSDP2_PEER[name], name, samples)
        if fsdp2:
            out.update(vs_fsdp2=fsdp2["vs_peer"], vs_fsdp2_lo=fsdp2["vs_peer_lo"],
                       vs_fsdp2_hi=fsdp2["vs_peer_hi"], vs_fsdp2_best=fsdp2["vs_peer_best"])
    return out


def _build_and_measure(name, ctx, base, x, y, amp):
    """Build one variant, run two steps; (model, optimizer, comm pattern, memory columns)."""
    dev = ctx.device
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    mem0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    model, opt, pattern = variant(name, ctx, base)
    step = step_fn(model, opt, x, y, amp)
    for _ in range(2):
        step()
    sync_params = getattr(model, "synchronize_params", None)
    if sync_params is not None:
        sync_params()
    extra: Dict = {}
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        extra["peak_MB"] = (torch.cuda.max_memory_allocated(dev) - mem0) / MB
    else:
        extra["state_MB"] = state_bytes(model, opt) / MB
    extra["opt_state_bytes"] = opt_state_bytes(opt)
    return model, opt, pattern, extra


def _bucket_sizes(model, world) -> Tuple[List[int], List[int]]:
    """Gradient bucket sizes of the wrapped model (pyfused: its buckets; torch: its reducer's)."""
    reducer = model.reducer
    if hasattr(reducer, "buckets"):
        return [b.numel for b in reducer.buckets], [b.padded for b in reducer.buckets]
    numels = [gb.buffer().numel() for gb in reducer._get_zeros_like_grad_buckets()]
    return numels, [-(-n // world) * world for n in numels]


def _note(name: str, world: int) -> str:
    if name == "pyfused zero2":
        return f"goal: vs_peer, vs_fsdp2 >= 1.0; opt_state_ratio <= {1.1 / world:.3f}"
    if name.startswith("pyfused"):
        return f"goal: vs_peer >= 1.0 (step time <= {PEERS[name]}'s)"
    return ""


def _main() -> None:  # torchrun --nproc-per-node N -m pyfused.benchmarks.bench_ddp [--quick]
    import argparse
    from pathlib import Path

    from pyfused.bench import launch
    from pyfused.bench.harness import BenchContext, write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shapes", default=None, help="DEPTHxWIDTHxBATCH")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", default=None, help="folder for ddp.csv / ddp.json (rank 0)")
    args = p.parse_args()
    backend = launch.resolve_backend("auto")
    rank, world, device = launch.init_rank(backend, 300)
    warmup, iters = (1, 3) if args.quick else (2, 10)
    ctx = BenchContext(rank, world, dist.group.WORLD, device, backend, args.quick, warmup,
                       args.iters or iters, {"shapes": args.shapes})
    rows = run(ctx)
    if rank == 0:
        cols = ("method", "time_ms", "speedup", "vs_peer", "vs_peer_best", "vs_fsdp2",
                "comm_hidden", "state_MB", "peak_MB", "opt_state_MB", "opt_state_ratio")
        print(f"{rows[0]['shape']}  world={world}  backend={backend}")
        print("  ".join(f"{c:>18}" for c in cols))
        for r in rows:
            print("  ".join(f"{_fmt(r.get(c)):>18}" for c in cols))
        if args.out:
            write_results(rows, Path(args.out), "ddp")
    dist.destroy_process_group()


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if v != v else f"{v:.3f}"
    return "" if v is None else str(v)


if __name__ == "__main__":
    _main()
