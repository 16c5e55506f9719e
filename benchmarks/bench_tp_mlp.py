"""A tensor-parallel MLP block, forward + backward: pyfused's layers against torch's own tensor
parallelism, on the same process group, in the same run.

The block is LayerNorm -> Column-parallel Linear(H, F) -> GELU -> Row-parallel Linear(F, H) on a
sequence-first input [S, H], in two variants:
  * TP (no sequence parallelism): input replicated; the row layer all-reduces its output
    (pyfused: matmul_all_reduce; torch: ColwiseParallel / RowwiseParallel);
  * SP (sequence parallelism): input and output are sequence shards [S/W, H]; the column layer
    all-gathers its input and the row layer reduce-scatters its output (pyfused: all_gather_matmul /
    matmul_reduce_scatter with sequence_parallel=True; torch: SequenceParallel on the norm,
    ColwiseParallel(input_layouts=Shard(0)), RowwiseParallel(output_layouts=Shard(0))).
Rows per (shape, variant): torch-tp (DTensor ``parallelize_module``), and pyfused's
``ColumnParallelLinear`` / ``RowParallelLinear`` with overlap = unfused | decomposed | fused | auto.
The norm runs on the sequence shard in both SP models, and neither reduces its weight gradient in
the step (torch leaves a Partial DTensor, pyfused a per-rank partial, as Megatron does until the
optimizer step). Both models are sharded from the same full layers; their outputs and input
gradients are checked against each other before anything is timed, and the variants are then timed
round-robin (``time_interleaved``). One step is: forward, then the backward of ``sum(y * g)`` for a
fixed ``g`` (the gradient reaching ``y`` is ``g``; the input requires grad, so the input-gradient
collectives are counted). The loss uses the block's output as a next layer would, so a collective
that returns before its result is ready (DTensor's ``AsyncCollectiveTensor``) is waited for before
the backward starts: with a bare ``y.backward(g)`` torch's forward all-reduce / reduce-scatter ran
behind the whole backward, an overlap no model allows (its next layer needs the value).

TFLOP/s counts the two GEMMs, forward and backward: 3 x 2 GEMMs x 2*S*H*F/W = 12*S*H*F/W per rank.
Shapes: the Llama-3 MLP sizes of pyfused/bench/shapes.py scaled as there (the MLP uses F, not the fused
gate_up 2F, since it has no gate); ``--shapes MxKxN`` means S=M, H=K, F=N.
"""
from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn as nn

from pyfused.bench.gemm_collective import agree_close, method_transport
from pyfused.bench.harness import interleaved_samples, op_row, speedup, vs_peer

from . import shapes

MULTI_RANK = True
METHODS = ("unfused", "decomposed", "fused", "auto")
# Rounds outside --quick (at least --iters): a step moves by +-10% from round to round on a 2-core
# CPU box (+-15% for the 8B shape's 35 ms steps); the paired ratios' median moved by up to 13%
# between runs of 40 rounds, and its error falls as one over the root of the count.
ROUNDS = 80


@dataclass(frozen=True)
class MlpShape:
    label: str
    tokens: int
    hidden: int
    ffn: int


def mlp_shapes(ctx) -> List[MlpShape]:
    w = ctx.world
    scale = shapes.default_scale(ctx.device.type, ctx.quick)
    spec = ctx.options.get("shapes")
    items = [s.strip() for s in spec.split(",") if s.strip()] if spec else list(scale.models)
    out = []
    for item in items:
        lit = shapes.LITERAL.match(item)
        if lit:
            s, h, f = map(int, lit.groups())
            label = item
        else:
            name = item.partition(".")[0]  # a layer name selects its model's MLP
            if name not in shapes.MODELS:
                raise ValueError(f"--shapes: unknown item {item!r}")
            model = shapes.MODELS[name]
            s, h, f = scale.tokens, model.hidden // scale.divisor, model.ffn // scale.divisor
            label = name if scale.divisor == 1 else f"{name}/{scale.divisor}"
        s, f = w * math.ceil(s / w), w * math.ceil(f / w)  # shardable on W ranks
        shape = MlpShape(f"{label} mlp S={s} H={h} F={f}", s, h, f)
        if shape not in out:
            out.append(shape)
    return out


def full_mlp(shape: MlpShape, ctx) -> nn.Sequential:
    """The unsharded block, identical on every rank (same seed)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    model = nn.Sequential(nn.LayerNorm(shape.hidden), nn.Linear(shape.hidden, shape.ffn), nn.GELU(),
                          nn.Linear(shape.ffn, shape.hidden))
    torch.random.set_rng_state(gen_state)
    return model.to(ctx.device, ctx.dtype)


def pyfused_mlp(full: nn.Sequential, ctx, sp: bool, overlap: str) -> nn.Module:
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    return nn.Sequential(
        copy.deepcopy(full[0]),
        ColumnParallelLinear.from_linear(full[1], group=ctx.group, sequence_parallel=sp,
                                         overlap=overlap),
        nn.GELU(),
        RowParallelLinear.from_linear(full[3], group=ctx.group, sequence_parallel=sp,
                                      overlap=overlap),
    )


def torch_tp_mlp(full: nn.Sequential, ctx, sp: bool) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    if sp:
        plan = {"0": SequenceParallel(sequence_dim=0), "1": ColwiseParallel(input_layouts=Shard(0)),
                "3": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
    return parallelize_module(copy.deepcopy(full), mesh, plan)


def auto_note(shape: MlpShape, ctx, sp: bool):
    """(note, methods): what ``overlap="auto"`` runs in the forward (the agreed choice the layers'
    ops make; a collective like them)."""
    from pyfused.ops import _common

    w = ctx.world
    empty = lambda *s: torch.empty(*s, device=ctx.device, dtype=ctx.dtype)  # noqa: E731
    f_local = shape.ffn // w
    if sp:
        col = _common.prepare_matmul("all_gather_matmul", empty(shape.tokens // w, shape.hidden),
                              empty(shape.hidden, f_local), ctx.group, "auto")[1]
        row = _common.prepare_matmul("matmul_reduce_scatter", empty(shape.tokens, f_local),
                              empty(f_local, shape.hidden), ctx.group, "auto")[1]
        return f"col chose {col.method}, row chose {row.method}", (col.method, row.method)
    row = _common.prepare_matmul("matmul_all_reduce", empty(shape.tokens, f_local),
                          empty(f_local, shape.hidden), ctx.group, "auto")[1]
    return f"row chose {row.method}", (row.method,)


def finish(y: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produced ``y``: DTensor's local outputs are
    ``AsyncCollectiveTensor``s whose collective is waited for only when the value is used."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return y.wait() if isinstance(y, AsyncCollectiveTensor) else y


def bench_variant(ctx, shape: MlpShape, sp: bool) -> List[Dict]:
    from pyfused.ops import MethodUnavailable

    w, r = ctx.world, ctx.rank
    full = full_mlp(shape, ctx)
    gen = torch.Generator().manual_seed(99)
    x_full = torch.randn(shape.tokens, shape.hidden, generator=gen).to(ctx.device, ctx.dtype)
    g_full = torch.randn(shape.tokens, shape.hidden, generator=gen).to(ctx.device, ctx.dtype)
    rows_per_rank = shape.tokens // w
    x = (x_full[r * rows_per_rank:(r + 1) * rows_per_rank] if sp else x_full).clone()
    grad = (g_full[r * rows_per_rank:(r + 1) * rows_per_rank] if sp else g_full).clone()
    x.requires_grad_(True)

    def step_of(model):
        params = list(model.parameters())

        def step():
            for p in params:
                p.grad = None
            x.grad = None
            y = model(x)
            (y * grad).sum().backward()  # uses y's value (module docstring)
        return step

    def forward_backward(model):
        x.grad = None
        y = model(x)
        (y * grad).sum().backward()
        return finish(y).detach().clone(), x.grad.detach().clone()

    label = f"{shape.label} {'SP' if sp else 'TP'}"
    notes: Dict[str, str] = {}
    transports: Dict[str, str] = {"torch-tp": ctx.transport}
    torch_model = torch_tp_mlp(full, ctx, sp)
    y_ref, gx_ref = forward_backward(torch_model)
    steps = {"torch-tp": step_of(torch_model)}
    for method in METHODS:
        model = pyfused_mlp(full, ctx, sp, method)
        transports[method] = method_transport(method, ctx)
        try:
            y, gx = forward_backward(model)
        except MethodUnavailable as e:  # raised on every rank alike
            notes[method] = f"unavailable: {e}"
            continue
        agree_close(y, y_ref, f"tp_mlp[{method}] output vs torch-tp at {label}", ctx)
        agree_close(gx, gx_ref, f"tp_mlp[{method}] input grad vs torch-tp at {label}", ctx)
        if method == "auto":
            notes[method], chosen = auto_note(shape, ctx, sp)
            transports[method] = ("symm-mem" if "fused" in chosen and w > 1 else ctx.transport)
        steps[method] = step_of(model)
    rounds = ctx.iters if ctx.quick else max(ROUNDS, ctx.iters)
    samples = interleaved_samples(steps, ctx, iters=rounds)  # round-robin: none favoured by when it ran
    times = {name: statistics.median(t) for name, t in samples.items()}

    flop = 12.0 * shape.tokens * shape.hidden * shape.ffn / w
    rows = []
    for method in ("torch-tp", *METHODS):
        ms = times.get(method)
        note = notes.get(method, "")
        status = "ok"
        if note.startswith("unavailable"):
            status, note = note, ""
        rows.append(op_row(ctx, shape=label, dtype=ctx.dtype, method=method,
                           transport=transports[method], ms=ms, flop=flop,
                           t_baseline=times.get("unfused"), status=status, note=note,
                           speedup_vs_torch_tp=speedup(times["torch-tp"], ms) if ms else None,
                           **vs_peer("torch-tp", method, samples), sequence_parallel=sp,
                           tokens=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, rounds=rounds))
    return rows


def run(ctx) -> List[Dict]:
    rows: List[Dict] = []
    for shape in mlp_shapes(ctx):
        for sp in (False, True):
            rows += bench_variant(ctx, shape, sp)
    return rows
