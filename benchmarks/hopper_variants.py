"""The variants ``benchmarks/hopper_compile.py`` compiles: every Triton kernel of pyfused as its
launcher calls it, over the configs the launcher can pick, the dtypes and the shapes the ops accept.

A variant is data (``Variant``, picklable, so worker processes can compile it) and a launch:
``launch(variant)`` calls the real launcher on empty CPU tensors of the variant's shape (their
memory is never touched: hopper_compile records the launch instead of running it). The configs come
from the launchers' own choosers, asked for the variant's target arch; ``uncovered_configs`` lists
any config a chooser can return that no variant reaches, and the compile test fails on it.

Kernels (in pyfused/kernels/): ``persistent_gemm_kernel`` (gemm.py, launcher ``gemm_launch.gemm``),
``multi_source_reduce_kernel`` (reduce.py, ``reduce_launch.multi_source_reduce``),
``segment_copy_scale_kernel`` (bucket.py, launcher pyfused.dp.bucket_copy),
``grouped_gemm_kernel`` (grouped_gemm.py, ``grouped_gemm_launch.grouped_gemm``). The only other
``@triton.jit`` in the project, the interpreter probe of reduce_launch.py, runs only under
TRITON_INTERPRET and is never compiled for a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

ARCH = {90: "sm_90", 80: "sm_80"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "tf32": torch.float32, "fp64": torch.float64}
CHUNKS = 8  # ranks of a TP=8 group: the fused ops cut rows into one chunk per rank
EPOCH = 3   # a wait's expected flag value (not specialized on: any value compiles the same)


@dataclass(frozen=True)
class Variant:
    kernel: str                # "gemm" | "reduce" | "bucket" | "grouped"
    cc: int                    # compute capability of the target: 90 is sm_90a (H100)
    dtype: str                 # gemm, reduce: a key of DTYPES ("tf32": fp32 inputs, TF32 products);
    #                            bucket: "src>dst"
    shape: Tuple[int, ...]     # gemm (M, N, K); reduce (M, N, P sources); bucket: segment lengths;
    #                            grouped (N, K)
    call: str                  # which call of the launcher (see the launch functions)
    config: Optional[object] = None  # gemm: an explicit GemmConfig (autotune candidates)

    @property
    def name(self) -> str:
        if self.kernel == "grouped":
            return f"{self.kernel} sm_{self.cc} {self.dtype} {self.shape[0]}x{self.shape[1]} {self.call}"
        if self.kernel == "bucket":
            shape = "aligned" if all(n % 16 == 0 for n in self.shape) else "odd segments"
        else:
            shape = "x".join(map(str, self.shape[:3 if self.kernel == "gemm" else 2]))
            if self.kernel == "reduce":
                shape += f" P={self.shape[2]}"
        extra = f" {config_str(self.config)}" if self.config is not None else ""
        return f"{self.kernel} sm_{self.cc} {self.dtype} {shape} {self.call}{extra}"


def config_str(cfg) -> str:
    """A config as the table shows it: tile (GEMM MxNxK, reduce rows x columns, bucket elements),
    warps, and pipeline stages for the GEMM."""
    if hasattr(cfg, "block_k"):
        return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    if hasattr(cfg, "rows_per_prog"):
        return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps}"
    return f"{cfg.block} w{cfg.num_warps}"


# ---------------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------------


# (M, N, K) the GEMM variants are drawn from: Llama-3 70B TP=8 layers at 8192, 4096 and 2048 tokens
# (the large and medium tiles), and 512 tokens (64 rows per chunk: the small-M tile). Odd shapes (the
# unaligned tile): K not a multiple of 16 (rows of A and of a weight are not 16-byte aligned), N not
# a multiple of 16 (rows of B [K, N] and of C), and the tests' 97 x 1025 x 259.
GEMM_SHAPES = [(8192, 8192, 1024), (4096, 1280, 8192), (2048, 1280, 8192), (512, 8192, 3584),
               (4096, 1280, 8191), (4096, 1025, 8192), (97, 1025, 259)]
GEMM_DTYPES = ("bf16", "fp16", "tf32", "fp32")
# Calls of gemm() made by the fused ops (pyfused/fused/gemm_collectives.py) and the plain GEMM; "all"
# turns every option on at once (wait + signal + scatter + bias + order): the most registers, so it is
# the call compiled at every config, dtype and shape; the others at the large bf16 tile.
GEMM_CALLS = ("all", "plain", "all-gather", "reduce-scatter")


def _gemm_alignment(v: Variant, cfg) -> Tuple[bool, ...]:
    """What Triton specializes on besides the config: which of M, N, K are multiples of 16, and
    whether K is a multiple of BLOCK_K (EVEN_K)."""
    m, n, k = v.shape
    return m % 16 == 0, n % 16 == 0, k % 16 == 0, k % cfg.block_k == 0


def chosen_gemm_config(v: Variant):
    """The config the launcher uses for this variant (its chooser at the variant's arch)."""
    from pyfused.kernels.gemm_configs import choose_gemm_config

    m, n, k = v.shape
    chunks = 1 if v.call == "plain" else CHUNKS
    return v.config or choose_gemm_config(m, n, k, DTYPES[v.dtype], ARCH[v.cc], chunks,
                                          allow_tf32=v.dtype == "tf32")


def gemm_variants(cc: int) -> List[Variant]:
    """Every (config, specialization) the chooser gives the GEMM_SHAPES, per dtype, with every option
    on; the fused ops' own calls and the autotune candidates outside the table, in bf16.
    Shapes that give the same config and the same specialization compile the same: kept once."""
    from pyfused.kernels.gemm_configs import autotune_candidates

    out, seen = [], set()
    for dtype in GEMM_DTYPES:
        for shape in GEMM_SHAPES:
            v = Variant("gemm", cc, dtype, shape, "all")
            cfg = chosen_gemm_config(v)
            key = (dtype, cfg, _gemm_alignment(v, cfg))
            if key not in seen:
                seen.add(key)
                out.append(v)
    large = GEMM_SHAPES[0]
    out += [Variant("gemm", cc, "bf16", large, call) for call in GEMM_CALLS[1:]]
    table = {chosen_gemm_config(v) for v in out}
    extra = [c for c in autotune_candidates(ARCH[cc], torch.bfloat16) if c not in table]
    # autotune=True times these for a plain GEMM; every BLOCK_K of theirs divides K here (EVEN_K)
    out += [Variant("gemm", cc, "bf16", large, "plain", config=c) for c in extra]
    return out


def launch_gemm(v: Variant) -> None:
    from pyfused.kernels.gemm_launch import gemm
    from pyfused.kernels.reduce_launch import PointerTable

    m, n, k = v.shape
    dt, tf32 = DTYPES[v.dtype], v.dtype == "tf32"
    a = torch.empty(m, k, dtype=dt)
    order = [(i + 3) % CHUNKS for i in range(CHUNKS)]
    flags = torch.full((CHUNKS,), EPOCH, dtype=torch.int32)
    counters = torch.zeros(CHUNKS, dtype=torch.int32)
    rows = -(-m // CHUNKS)

    def targets():
        return PointerTable.of([torch.empty(rows, n, dtype=dt) for _ in range(CHUNKS)])

    if v.call == "plain":  # an nn.Linear weight, as the layers and the benchmark pass it
        gemm(a, torch.empty(n, k, dtype=dt), b_layout="nk", config=v.config, allow_tf32=tf32)
    elif v.call == "all-gather":  # fused_all_gather_matmul: wait on the peers' pushes
        gemm(a, torch.empty(k, n, dtype=dt), num_chunks=CHUNKS, chunk_order=order, wait_flags=flags,
             wait_expected=EPOCH, flag_scope="sys", allow_tf32=tf32)
    elif v.call == "reduce-scatter":  # fused_matmul_reduce_scatter: scatter to peers and signal
        gemm(a, torch.empty(k, n, dtype=dt), num_chunks=CHUNKS, chunk_order=order,
             out_chunks=targets(), signal_counters=counters, signal_scope="sys", allow_tf32=tf32)
    elif v.call == "all":
        gemm(a, torch.empty(n, k, dtype=dt), torch.empty(n, dtype=dt), b_layout="nk",
             num_chunks=CHUNKS, chunk_order=order, wait_flags=flags, wait_expected=EPOCH,
             signal_counters=counters, out_chunks=targets(), allow_tf32=tf32)
    else:
        raise ValueError(f"unknown GEMM call {v.call!r}")


# ---------------------------------------------------------------------------------------------------
# Reduce
# ---------------------------------------------------------------------------------------------------

# RMSNorm holds a whole row: the chooser's tile is (block_m, next_pow2(hidden)), block_m up to
# 8192 / block_n rows, 8 warps (16 from 16384 columns on). A power of two per block_n from 1024 to
# the largest hidden the op accepts, with rows enough for the largest block_m (the most elements per
# thread); a hidden size between two powers of two compiles like the power above it (same tile, N
# divisible by 16), so 3072, 5120, 12288 are covered; 4099 is the odd one (N not divisible by 16:
# masked, unaligned rows). Fewer rows (decode) give fewer rows per tile and no more elements per
# thread: one such variant, 1 row at hidden 8192.
NORM_HIDDEN = (1024, 2048, 4096, 8192, 16384, 32768, 4099)  # each up to its dtype's maximum
REDUCE_ROWS = 1024  # 128 rows per chunk: not below any block_m the chooser picks
REDUCE_DTYPES = ("bf16", "fp16", "fp32")


def reduce_variants(cc: int) -> List[Variant]:
    from pyfused.kernels.reduce_configs import MAX_NORM_HIDDEN, max_norm_hidden

    assert max(NORM_HIDDEN) == MAX_NORM_HIDDEN, "NORM_HIDDEN must reach the largest hidden accepted"
    out = [Variant("reduce", cc, dt, (REDUCE_ROWS, n, CHUNKS), "rmsnorm")
           for dt in REDUCE_DTYPES for n in NORM_HIDDEN if n <= max_norm_hidden(DTYPES[dt])]
    # the 32768-element row fills 64 registers per thread: its other calls too
    out += [Variant("reduce", cc, "bf16", (1, n, CHUNKS), "rmsnorm") for n in (8192, 32768)]
    out += [Variant("reduce", cc, "bf16", (REDUCE_ROWS, n, 2), "rmsnorm-nowait") for n in (8192, 32768)]
    # the reduce of fused_matmul_reduce_scatter: the W slots of this rank's chunk, one flag each
    out += [Variant("reduce", cc, dt, (REDUCE_ROWS, n, CHUNKS), "reduce-scatter")
            for dt in REDUCE_DTYPES for n in (8192, 1025)]
    return out


def chosen_reduce_config(v: Variant):
    from pyfused.kernels.reduce_configs import choose_reduce_config

    m, n, p = v.shape
    chunks = CHUNKS if v.call == "rmsnorm" and m >= CHUNKS else 1
    return choose_reduce_config(m, n, p, DTYPES[v.dtype], ARCH[v.cc], chunks,
                                rmsnorm=v.call != "reduce-scatter")


def launch_reduce(v: Variant) -> None:
    from pyfused.kernels.reduce_launch import PointerTable, multi_source_reduce

    m, n, p = v.shape
    dt = DTYPES[v.dtype]
    sources = PointerTable.of([torch.empty(m, n, dtype=dt) for _ in range(p)])
    if v.call == "reduce-scatter":
        flags = torch.full((p, 1), EPOCH, dtype=torch.int32)
        multi_source_reduce(sources, wait_flags=flags, wait_expected=EPOCH, flag_scope="sys")
        return
    residual, weight = torch.empty(m, n, dtype=dt), torch.empty(n, dtype=dt)
    if v.call == "rmsnorm-nowait":  # the plain all-reduce + residual + RMSNorm step
        multi_source_reduce(sources, residual=residual, residual_out=residual, weight=weight)
    elif v.call == "rmsnorm":  # ... reading each source's chunk once its (source, chunk) flag is set
        chunks = CHUNKS if m >= CHUNKS else 1
        flags = torch.full((p, chunks), EPOCH, dtype=torch.int32)
        multi_source_reduce(sources, residual=residual, residual_out=residual, weight=weight,
                            num_chunks=chunks, chunk_order=list(range(chunks))[::-1],
                            wait_flags=flags, wait_expected=EPOCH)
    else:
        raise ValueError(f"unknown reduce call {v.call!r}")


# ---------------------------------------------------------------------------------------------------
# Bucket copy
# ---------------------------------------------------------------------------------------------------

# (gradient dtype, communication dtype) of DDP buckets: the gradient's own dtype, or a narrower one
# for fp32 gradients (comm_dtype=torch.bfloat16 / float16). Flatten copies grad -> comm, unflatten
# comm -> grad. Segment lengths: multiples of 16 (the 16-byte vector form), or the tests' odd ones
# (the scalar form, compiled for the two element sizes).
BUCKET_DTYPES = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "bf16"),
                 ("fp16", "fp16"), ("fp64", "fp64")]
ALIGNED_SEGMENTS = (4096 * 1024, 4096, 11008 * 16, 16)
ODD_SEGMENTS = (97, 35, 1, 1025, 4098)


def bucket_variants(cc: int) -> List[Variant]:
    pairs = []
    for grad, comm in BUCKET_DTYPES:
        pairs += [(grad, comm, "flatten")] + ([(comm, grad, "unflatten")] if comm != grad else [])
    out = [Variant("bucket", cc, f"{s}>{d}", ALIGNED_SEGMENTS, call) for s, d, call in pairs]
    out += [Variant("bucket", cc, pair, ODD_SEGMENTS, "flatten") for pair in ("fp32>fp32", "bf16>bf16")]
    return out


def chosen_bucket_config(v: Variant):
    from pyfused.kernels.bucket import choose_config

    return choose_config("cuda", max(DTYPES[d].itemsize for d in v.dtype.split(">")))


def launch_bucket(v: Variant) -> None:
    from pyfused.dp.bucket_copy import CopyPlan, flatten_scale, unflatten_scale

    src, dst = (DTYPES[d] for d in v.dtype.split(">"))
    plan = CopyPlan(v.shape, torch.device("cpu"), max(src.itemsize, dst.itemsize), interpret=False)
    total = sum(v.shape)
    if v.call == "flatten":
        flatten_scale([torch.empty(n, dtype=src) for n in v.shape], torch.empty(total, dtype=dst),
                      0.125, plan)
    else:
        unflatten_scale(torch.empty(total, dtype=src), [torch.empty(n, dtype=dst) for n in v.shape],
                        1.0, plan)


# ---------------------------------------------------------------------------------------------------
# Grouped GEMM (expert parallelism)
# ---------------------------------------------------------------------------------------------------

# (N, K) of the experts' GEMMs: Mixtral-8x7B's gate_up (2 x 14336 from 4096, the dispatch side) and
# down projection (4096 from 14336, the combine side), and the tests' odd 1025 x 259 (the unaligned
# tile). The row counts are device values: no M to specialize on.
GROUPED_SHAPES = [(28672, 4096), (4096, 14336), (1025, 259)]
GROUPED_DTYPES = ("bf16", "fp16", "tf32", "fp32")
# the fused dispatch (wait per source chunk) and the fused combine (scatter + signal per chunk)
GROUPED_CALLS = ("dispatch", "combine")
EXPERTS = 8


def grouped_variants(cc: int) -> List[Variant]:
    """Every dtype at an aligned and an unaligned shape, both calls; the other aligned shape in
    bf16 (same config, other K and N)."""
    out = [Variant("grouped", cc, dt, shape, call) for dt in GROUPED_DTYPES
           for shape in (GROUPED_SHAPES[0], GROUPED_SHAPES[2]) for call in GROUPED_CALLS]
    return out + [Variant("grouped", cc, "bf16", GROUPED_SHAPES[1], call) for call in GROUPED_CALLS]


def chosen_grouped_config(v: Variant):
    from pyfused.kernels.grouped_gemm_configs import choose_grouped_config

    n, k = v.shape
    return choose_grouped_config(n, k, DTYPES[v.dtype], ARCH[v.cc], allow_tf32=v.dtype == "tf32")


def launch_grouped(v: Variant) -> None:
    from pyfused.kernels.grouped_gemm_launch import SegmentTable, grouped_gemm
    from pyfused.kernels.reduce_launch import PointerTable

    n, k = v.shape
    dt, tf32 = DTYPES[v.dtype], v.dtype == "tf32"
    rows = 1024
    segments = SegmentTable(torch.zeros(5, CHUNKS * EXPERTS, dtype=torch.int32), CHUNKS)
    a, weight = torch.empty(rows, k, dtype=dt), torch.empty(EXPERTS, k, n, dtype=dt)
    if v.call == "dispatch":
        flags = torch.full((CHUNKS,), EPOCH, dtype=torch.int32)
        grouped_gemm(a, weight, segments, wait_flags=flags, wait_expected=EPOCH, allow_tf32=tf32)
    elif v.call == "combine":
        areas = PointerTable.of([torch.empty(rows, n, dtype=dt) for _ in range(CHUNKS)])
        words = torch.zeros(CHUNKS, dtype=torch.int64)
        grouped_gemm(a, weight, segments, out_chunks=areas, signal_words=words,
                     signal_value=EPOCH, allow_tf32=tf32)
    else:
        raise ValueError(f"unknown grouped GEMM call {v.call!r}")


# ---------------------------------------------------------------------------------------------------

LAUNCH = {"gemm": launch_gemm, "reduce": launch_reduce, "bucket": launch_bucket,
          "grouped": launch_grouped}
CHOSEN = {"gemm": chosen_gemm_config, "reduce": chosen_reduce_config, "bucket": chosen_bucket_config,
          "grouped": chosen_grouped_config}

# sm_90a (the H100 the project targets) gets the whole grid. sm_80 keeps the compile of its own GEMM
# table (every 16-bit tile and the fp32 one, all options, with an odd K) and one reduce.
SM80_GEMM = [(dt, shape) for dt in ("bf16", "fp32") for shape in GEMM_SHAPES[:5]]


def all_variants() -> List[Variant]:
    out = gemm_variants(90) + reduce_variants(90) + bucket_variants(90) + grouped_variants(90)
    seen = set()
    for dt, shape in SM80_GEMM:
        v = Variant("gemm", 80, dt, shape, "all")
        key = (dt, chosen_gemm_config(v), _gemm_alignment(v, chosen_gemm_config(v)))
        if key not in seen:
            seen.add(key)
            out.append(v)
    out.append(Variant("reduce", 80, "bf16", (REDUCE_ROWS, 8192, CHUNKS), "rmsnorm"))
    return out


def config_of(v: Variant):
    return CHOSEN[v.kernel](v)


def uncovered_configs(variants: List[Variant]) -> Dict[str, list]:
    """Configs a chooser can return that no variant compiles: GEMM table entries per arch and dtype
    class, bucket configs per element size."""
    from pyfused.kernels import bucket, gemm_configs
    from pyfused.kernels.grouped_gemm_configs import selectable_grouped_configs

    reached = {(v.kernel, v.cc, v.dtype if v.kernel in ("gemm", "grouped") else None, config_of(v))
               for v in variants}
    missing: Dict[str, list] = {}
    for cc in sorted({v.cc for v in variants if v.kernel == "gemm"}):
        for dt in GEMM_DTYPES:
            if cc == 80 and dt not in {d for d, _ in SM80_GEMM}:
                continue
            for cfg in gemm_configs.selectable_configs(ARCH[cc], DTYPES[dt], dt == "tf32"):
                if ("gemm", cc, dt, cfg) not in reached:
                    missing.setdefault(f"gemm sm_{cc} {dt}", []).append(cfg)
    for dt in GROUPED_DTYPES:
        for cfg in selectable_grouped_configs(ARCH[90], DTYPES[dt], dt == "tf32"):
            if ("grouped", 90, dt, cfg) not in reached:
                missing.setdefault(f"grouped sm_90 {dt}", []).append(cfg)
    for (target, _), cfg in bucket.CONFIGS.items():
        if target == "cuda" and ("bucket", 90, None, cfg) not in reached:
            missing.setdefault("bucket", []).append(cfg)
    return missing
