"""Automatic stage splitting: ``split(model, num_stages, example_args, balance="time")``.

Layers ("units") are the model's top-level children in registration order, with every
``nn.ModuleList`` / ``nn.Sequential`` child expanded into its blocks (so a transformer's
``[embed, layers: ModuleList, norm, head]`` gives ``embed, layers.0, ..., layers.N-1, norm,
head``). An ``nn.Sequential`` is a chain by definition; for any other model pyfused checks that
running the units one after the other gives ``model(*example_args)`` and refuses to split it
otherwise (a forward with a residual around blocks, extra arguments, or unused children is not a
chain, and a silently wrong split would train a different model).

Each unit is profiled on the example input as it flows through the chain: forward time, forward +
backward time (``torch.autograd.grad``, so no ``.grad`` is touched), parameter bytes, and the bytes
of the tensors autograd saves for backward (the activation memory one microbatch holds, found with
``saved_tensors_hooks``; parameters excluded). Buffers (BatchNorm statistics) and the RNG state are
restored afterwards. ``balance="time"`` minimises the slowest stage's forward+backward time,
``balance="memory"`` the largest stage's parameter + activation bytes, exactly (balance.partition).

In a distributed job the plan is decided on group rank 0 -- timings differ from rank to rank -- and
broadcast, so every rank builds the same stages; the report says which rank decided.
"""
from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .._logging import logger
from .balance import check_starts, even_starts, partition, stage_sums
from .errors import PipelineError, agree_step
from .stage import as_tuple

BALANCES = ("time", "memory")
MAX_POINTS = 16  # manual split points carried in the cross-rank signature


class PipelineSegment(nn.Module):
    """A contiguous run of units; each unit gets the previous one's output (a tuple is unpacked)."""

    def __init__(self, units: Sequence[Tuple[str, nn.Module]]):
        super().__init__()
        self.layer_names = [name for name, _ in units]
        self.layers = nn.ModuleList([m for _, m in units])

    def forward(self, *args):
        x = args
        for layer in self.layers:
            x = as_tuple(layer(*x))
        return x[0] if len(x) == 1 else x

    def extra_repr(self) -> str:
        return f"layers: {', '.join(self.layer_names)}"


def layer_units(model) -> List[Tuple[str, nn.Module]]:
    """The units ``split`` cuts between (see the module docstring)."""
    if isinstance(model, (list, tuple)):
        return [(str(i), m) for i, m in enumerate(model)]
    units: List[Tuple[str, nn.Module]] = []

    def add(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                add(full + ".", child)
            else:
                units.append((full, child))

    add("", model)
    return units


@dataclass
class SplitReport:
    balance: str
    layer_names: List[str]
    layer_time_ms: List[float]       # forward + backward on the example input
    layer_memory_bytes: List[int]    # parameters + saved activations
    split_points: Tuple[int, ...]    # first layer of stages 1..k-1
    stage_time_ms: List[float] = field(default_factory=list)
    stage_memory_bytes: List[float] = field(default_factory=list)
    imbalance: float = float("nan")          # largest / mean stage cost, in the balanced metric
    even_split_points: Tuple[int, ...] = ()
    even_bottleneck: float = float("nan")    # largest stage cost of the even split, same metric
    decided_by_rank: int = 0

    def stage_layers(self) -> List[List[str]]:
        bounds = [0, *self.split_points, len(self.layer_names)]
        return [self.layer_names[a:b] for a, b in zip(bounds, bounds[1:])]

    def __str__(self) -> str:
        unit = "ms" if self.balance == "time" else "MiB"
        cost = (self.stage_time_ms if self.balance == "time"
                else [b / 2 ** 20 for b in self.stage_memory_bytes])
        lines = [f"split by {self.balance} on rank {self.decided_by_rank}: imbalance "
                 f"{self.imbalance:.3f} (largest/mean); bottleneck {max(cost):.3f} {unit} vs "
                 f"{self.even_bottleneck:.3f} {unit} for an even split by layer count"]
        for i, (names, t, mem) in enumerate(zip(self.stage_layers(), self.stage_time_ms,
                                                 self.stage_memory_bytes)):
            lines.append(f"  stage {i}: {t:8.3f} ms {mem / 2 ** 20:9.3f} MiB  {names[0]} .. "
                         f"{names[-1]} ({len(names)} layers)")
        return "\n".join(lines)


class Split(NamedTuple):
    stages: List[PipelineSegment]
    report: SplitReport


def _structure_hash(units) -> int:
    text = ";".join(f"{n}:{type(m).__name__}:" + ",".join(str(tuple(p.shape)) for p in m.parameters())
                    for n, m in units)
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


def split(model, num_stages: int, example_args=None, *, balance: str = "time",
          split_points: Optional[Sequence[int]] = None, group=None, repeats: int = 3) -> Split:
    """Cut ``model`` into ``num_stages`` contiguous ``PipelineSegment``s; returns (stages, report).

    ``split_points=[i, j, ...]`` (first layer of stages 1..k-1) overrides the search; the report
    then still carries the profiled costs when ``example_args`` is given. The stages share their
    modules (and parameters) with ``model``."""
    pg = comm.resolve_group(group)
    units = layer_units(model) if isinstance(model, (nn.Module, list, tuple)) else []
    points = tuple(split_points) if split_points is not None else None
    error = None
    if not isinstance(model, (nn.Module, list, tuple)):
        error = f"model must be an nn.Module or a list of modules, got {type(model).__name__}"
    elif balance not in BALANCES:
        error = f"balance must be one of {BALANCES}, got {balance!r}"
    elif not isinstance(num_stages, int) or not 1 <= num_stages <= len(units):
        error = (f"num_stages={num_stages!r} must be an int between 1 and the number of layers "
                 f"({len(units)}: {', '.join(n for n, _ in units[:8])}{' ...' if len(units) > 8 else ''})")
    elif points is None and example_args is None:
        error = "example_args are needed to profile the layers (or pass split_points)"
    elif points is not None:
        try:
            check_starts(len(units), num_stages, [int(x) for x in points])
        except (ValueError, TypeError) as e:
            error = str(e)
    ints = (num_stages if isinstance(num_stages, int) else -1, len(units),
            BALANCES.index(balance) if balance in BALANCES else -1, -1 if points is None else len(points),
            *[int(x) for x in (points or ())[:MAX_POINTS] if isinstance(x, int)],
            _structure_hash(units))

    def check(sigs):
        return comm.differs(sigs, "(num_stages, layers, balance, split points, model structure)",
                            lambda s: s.ints[1:])

    agree_step(pg, "pipeline.split", ints, (), error, check)
    decided = None
    if comm.rank(pg) == 0:  # rank 0 profiles and decides; every rank takes its decision
        decided = _decide(model, units, num_stages, example_args, balance, points, repeats)
    payload = comm.agree_on(pg, "pipeline.split", decided, detail="rank 0's split")[0]
    kind, value = payload
    if kind == "error":
        raise PipelineError(f"pyfused.pipeline.split: {value}")
    report: SplitReport = value
    bounds = [0, *report.split_points, len(units)]
    stages = [PipelineSegment(units[a:b]) for a, b in zip(bounds, bounds[1:])]
    logger.debug("%s", report)
    return Split(stages, report)


def _decide(model, units, k, example_args, balance, points, repeats):
    """("ok", SplitReport) or ("error", message): runs on one rank only, so it must not raise."""
    try:
        n = len(units)
        if example_args is None:
            times, mems = [float("nan")] * n, [0] * n
        else:
            times, mems = _profile(model, units, as_tuple(example_args), repeats)
        costs = times if balance == "time" else mems
        if points is None:
            points = partition(costs, k)
        even = even_starts(n, k)
        cost_sums = stage_sums(costs, points)
        mean = sum(cost_sums) / k
        report = SplitReport(balance, [n_ for n_, _ in units], times, mems, tuple(points),
                             stage_sums(times, points), stage_sums(mems, points),
                             max(cost_sums) / mean if mean > 0 else float("nan"), even,
                             max(stage_sums(costs, even)), decided_by_rank=dist.get_rank()
                             if dist.is_initialized() else 0)
        return ("ok", report)
    except Exception as e:  # sent to every rank, raised there
        return ("error", f"{type(e).__name__}: {e}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(model, units, example: Tuple, repeats: int) -> Tuple[List[float], List[int]]:
    buffers = {id(b): (b, b.detach().clone()) for _, m in units for b in m.buffers()}
    try:
        with torch.random.fork_rng(devices=[]):
            if not isinstance(model, (nn.Sequential, list, tuple)):
                _check_chain(model, units, example)
            return _measure(units, example, max(1, repeats))
    finally:
        with torch.no_grad():
            for b, saved in buffers.values():
                b.copy_(saved)


def _check_chain(model: nn.Module, units, example: Tuple) -> None:
    with torch.no_grad():
        torch.manual_seed(0)
        expected = as_tuple(model(*example))
        torch.manual_seed(0)
        got = as_tuple(PipelineSegment(units)(*example))
    same = len(got) == len(expected) and all(
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        and torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, expected))
    if not same:
        raise ValueError(
            f"{type(model).__name__}.forward is not the chain of its layers "
            f"({', '.join(n for n, _ in units[:6])}{' ...' if len(units) > 6 else ''}): running "
            f"them one after the other gives a different result. Pass an nn.Sequential or a list "
            f"of modules whose chain is the model")


def _measure(units, example: Tuple, repeats: int) -> Tuple[List[float], List[int]]:
    times, mems = [], []
    x = example
    for name, unit in units:
        inputs = tuple(t.detach().requires_grad_(t.is_floating_point())
                       if isinstance(t, torch.Tensor) else t for t in x)
        params = [p for p in unit.parameters() if p.requires_grad]
        param_ptrs = {p.untyped_storage().data_ptr() for p in unit.parameters()}
        saved = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = as_tuple(unit(*inputs))
        wrt = params + [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        device = next((t.device for t in out if isinstance(t, torch.Tensor)), torch.device("cpu"))

        def forward_backward():
            outs = [o for o in as_tuple(unit(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)

        forward_backward()  # warm-up
        samples = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            forward_backward()
            _sync(device)
            samples.append((time.perf_counter() - t0) * 1e3)
        times.append(statistics.median(samples))
        mems.append(sum(p.numel() * p.element_size() for p in unit.parameters()) + sum(saved.values()))
        x = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)
    return times, mems
