"""Shapes the benchmark suites and the tuner (``python -m pyfused.tune``) run: Llama-3 8B / 70B
layers, tensor-parallel sharded.

The four GEMMs of a Llama-3 decoder layer that tensor parallelism (TP) shards, as ``[in, out]``:

    attn.qkv      H -> (heads + 2 * kv_heads) * head_dim     column-parallel
    attn.out      H -> H                                     row-parallel
    mlp.gate_up   H -> 2 * F  (gate and up fused)            column-parallel
    mlp.down      F -> H                                     row-parallel

    llama3-8b:  H = 4096, F = 14336, 32 heads, 8 kv heads, head_dim 128
    llama3-70b: H = 8192, F = 28672, 64 heads, 8 kv heads, head_dim 128

Which op runs which layer follows its registry entry (``OpSpec.gathers_dim0``: an op whose result
gathers dim 0 runs the column-parallel layers, the others the row-parallel ones). For S tokens
(dim 0, sequence-first) on W ranks; shapes are *per rank*:

    all_gather_matmul      column-parallel + sequence parallel:  a [S/W, in]   b [in, out/W]
    matmul_reduce_scatter  row-parallel + sequence parallel:     a [S, in/W]   b [in/W, out]
    matmul_all_reduce      row-parallel, no sequence parallel:   a [S, in/W]   b [in/W, out]

Scaling rule. On GPUs the layers run at full size with S = 8192 tokens (one 8k sequence). A 2-core
CPU does about 0.1 TFLOP/s, where one full-size 70B mlp.down GEMM alone would take seconds, so on CPU
every model dimension (H, F, head_dim) is divided by ``CPU_DIVISOR`` = 8 and S = 512: the layers keep
their aspect ratios (F/H = 3.5, the qkv/out ratio, the GQA ratio) and the whole default CPU run of
all suites takes a few minutes. ``--quick`` (CI smoke tests) divides by 16 and uses S = 128 tokens
and only the 8B MLP layers. A sharded dimension that W does not divide is rounded up to a multiple
of W (S to W * ceil(S/W), out/W to ceil(out/W)), so odd world sizes such as 3 still run.

A ``--shapes`` spec is a comma-separated list of
  * model names (``llama3-8b``, ``llama3-70b``), optionally one layer (``llama3-70b.mlp.down``);
  * either of those with ``@tpN`` (``llama3-70b@tp8``): the weights sharded as for N-way TP whatever
    the world size W the run has, so each rank's GEMM is the one a TP=N rank runs -- column-parallel
    [S, in] x [in, out/N] (of which all_gather_matmul's a is the [S/W, in] shard), row-parallel
    [S, in/N] x [in/N, out]. This is how Llama-3 70B TP=8 layers are measured with 2 or 4 ranks on
    one GPU (the communicated volume is then W's, not N's);
  * literal per-rank GEMMs ``MxKxN``: a [M, K], b [K, N] on every rank, for whichever op runs them
    (for an op that gathers dim 0, such as all_gather_matmul, M is the rows of this rank's shard;
    for one that scatters it, such as matmul_reduce_scatter, M must be divisible by W).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..ops.registry import GEMM_OPS as OPS, OPS as SPECS  # OPS: the ops these GEMM shapes serve


@dataclass(frozen=True)
class Model:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layers(self) -> Dict[str, Tuple[int, int, str]]:
        """name -> (in_features, out_features, "column" | "row")."""
        h, f = self.hidden, self.ffn
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {
            "attn.qkv": (h, qkv, "column"),
            "attn.out": (h, h, "row"),
            "mlp.gate_up": (h, 2 * f, "column"),
            "mlp.down": (f, h, "row"),
        }


MODELS: Dict[str, Model] = {
    "llama3-8b": Model(hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama3-70b": Model(hidden=8192, ffn=28672, heads=64, kv_heads=8),
}


@dataclass(frozen=True)
class Scale:
    """How model dimensions are shrunk to fit a device (see the module docstring)."""
    divisor: int
    tokens: int
    models: Tuple[str, ...]
    layers: Optional[Tuple[str, ...]] = None  # None: all four


GPU_SCALE = Scale(divisor=1, tokens=8192, models=("llama3-8b", "llama3-70b"))
GPU_QUICK = Scale(divisor=1, tokens=2048, models=("llama3-8b",), layers=("mlp.gate_up", "mlp.down"))
CPU_DIVISOR = 8
CPU_SCALE = Scale(divisor=CPU_DIVISOR, tokens=512, models=("llama3-8b", "llama3-70b"))
CPU_QUICK = Scale(divisor=16, tokens=128, models=("llama3-8b",), layers=("mlp.gate_up", "mlp.down"))


def default_scale(device_type: str, quick: bool) -> Scale:
    if device_type == "cuda":
        return GPU_QUICK if quick else GPU_SCALE
    return CPU_QUICK if quick else CPU_SCALE


@dataclass(frozen=True)
class OpShape:
    """One benchmark point: per-rank input shapes of one op, and where they come from."""
    label: str                 # e.g. "llama3-8b/8 mlp.down S=512" or "512x256x448"
    op: str
    a: Tuple[int, int]
    b: Tuple[int, int]

    @property
    def gemm_mnk(self) -> Tuple[int, int, int]:
        """(M, N, K) of the op's whole GEMM on one rank (all_gather_matmul multiplies W shards)."""
        return self.a[0], self.b[1], self.a[1]


def _op_takes(op: str, kind: str) -> bool:
    """An op that gathers dim 0 runs the column-parallel layers (sequence parallel: its input is
    this rank's rows), the others the row-parallel ones."""
    return (kind == "column") == SPECS[op].gathers_dim0


def layer_shape(op: str, model_name: str, layer: str, world: int, scale: Scale,
                tp: Optional[int] = None) -> OpShape:
    """Per-rank shapes of ``layer`` for ``op`` on ``world`` ranks, the weights sharded ``tp`` ways
    (default: ``world`` ways, i.e. the run is the TP group)."""
    model = MODELS[model_name]
    fin, fout, kind = model.layers()[layer]
    fin, fout = fin // scale.divisor, fout // scale.divisor
    shards = tp or world
    s = world * math.ceil(scale.tokens / world)
    if SPECS[op].gathers_dim0:
        a, b = (s // world, fin), (fin, math.ceil(fout / shards))
    else:
        k = math.ceil(fin / shards)
        a, b = (s, k), (k, fout)
    size = model_name if scale.divisor == 1 else f"{model_name}/{scale.divisor}"
    return OpShape(f"{size}{f' TP={tp}' if tp else ''} {layer} S={s}", op, a, b)


def model_shapes(op: str, world: int, scale: Scale, models: Sequence[str] = None,
                 layer: str = None, tp: Optional[int] = None) -> List[OpShape]:
    out = []
    for name in models or scale.models:
        for lname, (_, _, kind) in MODELS[name].layers().items():
            if layer not in (None, lname) or not _op_takes(op, kind):
                continue
            if layer is None and scale.layers is not None and lname not in scale.layers:
                continue
            out.append(layer_shape(op, name, lname, world, scale, tp))
    return out


LITERAL = re.compile(r"^(\d+)x(\d+)x(\d+)$")


def parse(spec: Optional[str], op: str, world: int, device_type: str, quick: bool) -> List[OpShape]:
    """The shapes ``op`` runs for a ``--shapes`` spec (None: the defaults for the device)."""
    scale = default_scale(device_type, quick)
    if not spec:
        return model_shapes(op, world, scale)
    out: List[OpShape] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        lit = LITERAL.match(item)
        if lit:
            m, k, n = map(int, lit.groups())
            if SPECS[op].scatters_dim0 and m % world:
                raise ValueError(f"--shapes {item}: M={m} must be divisible by the world size {world} "
                                 f"for {op}")
            out.append(OpShape(item, op, (m, k), (k, n)))
            continue
        item, _, tp_spec = item.partition("@")
        tp = None
        if tp_spec:
            tp_match = re.fullmatch(r"tp([1-9]\d*)", tp_spec)
            if not tp_match:
                raise ValueError(f"--shapes: {item}@{tp_spec}: the suffix must be @tpN with N >= 1")
            tp = int(tp_match.group(1))
        name, _, layer = item.partition(".")
        if name not in MODELS:
            raise ValueError(f"--shapes: unknown item {item!r}; use one of {sorted(MODELS)}, "
                             f"<model>.<layer>, either with @tpN, or MxKxN")
        if layer and layer not in MODELS[name].layers():
            raise ValueError(f"--shapes: {name} has no layer {layer!r} "
                             f"(layers: {', '.join(MODELS[name].layers())})")
        full = Scale(scale.divisor, scale.tokens, (name,))  # a named model runs all its layers
        out += model_shapes(op, world, full, (name,), layer or None, tp)
    return out


def validate(spec: Optional[str]) -> None:
    """Raise ValueError for a malformed spec (checked once, before any rank starts)."""
    for op in OPS:
        parse(spec, op, 1, "cpu", False)


# ---- all_reduce_add_rmsnorm: x [rows, hidden] on every rank ----------------------------------------
# Message sizes (bytes of x on one rank, nccl-tests' S), hidden size by device (bench and tuner).
NORM_HIDDEN = {"cuda": 4096, "cpu": 1024}
NORM_GPU_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20, 64 << 20]
NORM_CPU_SIZES = [8 << 10, 64 << 10, 512 << 10, 4 << 20]
NORM_QUICK_SIZES = [8 << 10, 512 << 10]
NORM_LITERAL = re.compile(r"^(\d+)x(\d+)$")


def norm_sizes(device_type: str, quick: bool) -> List[int]:
    if quick:
        return NORM_QUICK_SIZES
    return NORM_GPU_SIZES if device_type == "cuda" else NORM_CPU_SIZES


def norm_shapes(spec: Optional[str], device_type: str, quick: bool,
                element_size: int) -> List[Tuple[int, int]]:
    """(rows, hidden) of x for the ops without a GEMM (all_reduce_add_rmsnorm): the default message
    sizes at the device's hidden size, or a ``--shapes`` spec of ``RxH`` literals and model names
    (S tokens x hidden of the device's scale)."""
    if not spec:
        hidden = NORM_HIDDEN.get(device_type, NORM_HIDDEN["cuda"])
        return [(max(1, n // (hidden * element_size)), hidden) for n in norm_sizes(device_type, quick)]
    scale = default_scale(device_type, quick)
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        lit = NORM_LITERAL.match(item)
        if lit:
            out.append((int(lit.group(1)), int(lit.group(2))))
            continue
        name = item.partition("@")[0].partition(".")[0]
        if name not in MODELS:
            raise ValueError(f"--shapes {item!r}: an op without a GEMM takes RxH (rows x hidden) "
                             f"or a model name ({', '.join(sorted(MODELS))})")
        out.append((scale.tokens, MODELS[name].hidden // scale.divisor))
    return out
