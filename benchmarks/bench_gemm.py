"""Benchmark of the persistent Triton GEMM (pyfused/kernels/gemm.py) against torch.matmul, single
device.

Shapes: Llama-3 70B at TP=8, per rank, B as the nn.Linear weight [N, K] (K x N below):
attn.qkv 8192 x 1280, attn.out 1024 x 8192, mlp.gate_up 8192 x 7168, mlp.down 3584 x 8192, for
M in {4096, 8192, 16384} tokens ({4096} with --quick).

Variants, each timed as a CUDA-graph replay (GPU time of the kernel, no Python launch cost), with
the baseline measured in the same run on the same inputs:
  torch.matmul          a @ w.t()  (cuBLAS), the baseline of every row's ``speedup``
  triton                plain persistent GEMM, table config
  triton.eager          the same, launched from Python each time (launcher overhead included)
  triton.autotune       plain, config chosen by triton.autotune (not for collective use)
  triton.wait+signal    8 chunks, chunk order 3, 4, ..., 2, flags pre-set, counters on
  triton.wait+signal+scatter   the same, each chunk written to its own buffer
Target (the issue's): wait+signal >= 0.95x torch.matmul TFLOP/s in bf16 on H100; ``target`` says so
on those rows, ``meets_target`` compares (the plain ratio is reported beside it).

On CPU the Triton kernels would run in the interpreter, whose timings mean nothing: the suite then
measures only the torch baseline (at shapes divided by 8, M = 512) and emits one ``skipped`` row per
Triton variant saying it needs a GPU.
"""
from __future__ import annotations

from typing import Callable, List

import torch

from pyfused._logging import logger
from pyfused.bench.harness import BenchContext, op_row, time_fn

MULTI_RANK = False

# Llama-3 70B (hidden 8192, ffn 28672, 64 heads, 8 kv heads) at TP=8, per-rank (K, N).
LAYERS = {"attn.qkv": (8192, 1280), "attn.out": (1024, 8192), "mlp.gate_up": (8192, 7168),
          "mlp.down": (3584, 8192)}
TOKENS = (4096, 8192, 16384)
CPU_DIVISOR, CPU_TOKENS = 8, 512
CHUNKS = 8
TARGET_RATIO = 0.95
TRITON_VARIANTS = ("triton", "triton.eager", "triton.autotune", "triton.wait+signal",
                   "triton.wait+signal+scatter")
SKIP_STATUS = ("skipped: needs a CUDA GPU (on CPU the Triton kernels run in the interpreter, "
               "whose timings mean nothing)")


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after a warm-up run that compiles and caches): replaying it
    times the GPU work alone. On CPU, ``fn`` itself."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # compile, autotune, fill caches outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """A sanity check that a timed kernel computes the right thing (not the test suite's check)."""
    err = (actual.float() - expected.float()).abs().max().item()
    return err <= 3e-2 * expected.float().abs().max().item()


def _shapes(ctx: BenchContext):
    if ctx.device.type != "cuda":
        return [(CPU_TOKENS, name, k // CPU_DIVISOR, n // CPU_DIVISOR)
                for name, (k, n) in LAYERS.items()]
    tokens = TOKENS[:1] if ctx.quick else TOKENS
    return [(m, name, k, n) for m in tokens for name, (k, n) in LAYERS.items()]


def _triton_variants(a, w, out, dtype):
    """name -> (launch, result): ``result()`` is the product the launch just computed."""
    from pyfused.kernels.gemm_launch import gemm, plan_gemm
    from pyfused.kernels.reduce_launch import PointerTable

    m, n = out.shape
    dev = a.device
    order = [(3 + i) % CHUNKS for i in range(CHUNKS)]
    flags = torch.ones(CHUNKS, dtype=torch.int32, device=dev)
    counters = torch.zeros(CHUNKS, dtype=torch.int32, device=dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    plan = plan_gemm(m, n, a.shape[1], dtype, dev, num_chunks=CHUNKS)
    bufs = [torch.empty(plan.chunk_rows, n, dtype=dtype, device=dev) for _ in range(CHUNKS)]
    table = PointerTable.of(bufs)  # built once: a list would be turned into a table (an H2D copy,
    # which a CUDA graph cannot capture) on every call
    chunked = dict(b_layout="nk", num_chunks=CHUNKS, chunk_order=order, wait_flags=flags,
                   signal_counters=counters, status=status)

    def gathered():
        return torch.cat([bufs[c][:hi - lo] for c, (lo, hi) in
                          enumerate(plan.chunk_bounds(c) for c in range(CHUNKS))])

    return {
        "triton": (lambda: gemm(a, w, b_layout="nk", out=out), lambda: out),
        "triton.eager": (lambda: gemm(a, w, b_layout="nk", out=out), lambda: out),
        "triton.autotune": (lambda: gemm(a, w, b_layout="nk", out=out, autotune=True), lambda: out),
        "triton.wait+signal": (lambda: gemm(a, w, out=out, **chunked), lambda: out),
        "triton.wait+signal+scatter": (lambda: gemm(a, w, out_chunks=table, **chunked), gathered),
    }


def run(ctx: BenchContext) -> List[dict]:
    dtype = ctx.dtype
    dev = ctx.device
    on_gpu = dev.type == "cuda"
    if not on_gpu:
        logger.warning("bench_gemm: no GPU; measuring the torch.matmul baseline only (%s)", SKIP_STATUS)
    rows: List[dict] = []
    for m, layer, k, n in _shapes(ctx):
        g = torch.Generator().manual_seed(m + k + n)
        a = torch.randn(m, k, generator=g).to(dtype).to(dev)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(dev)
        out = torch.empty(m, n, dtype=dtype, device=dev)
        ref = torch.matmul(a, w.t())
        shape = f"{m}x{k}x{n}"
        common = dict(shape=shape, dtype=dtype, transport="none", flop=2.0 * m * n * k, case=layer,
                      b_layout="nk")
        t_base = time_fn(graphed(lambda: torch.matmul(a, w.t(), out=out), dev), ctx)
        rows.append(op_row(ctx, method="torch.matmul", ms=t_base, **common))
        if not on_gpu:
            rows += [op_row(ctx, method=v, ms=None, status=SKIP_STATUS, **common)
                     for v in TRITON_VARIANTS]
            continue
        variants = _triton_variants(a, w, out, dtype)
        for name in TRITON_VARIANTS:
            launch, result = variants[name]
            status, ms = "ok", None
            try:
                ms = time_fn(launch if name == "triton.eager" else graphed(launch, dev), ctx)
                if not _close(result(), ref):
                    status, ms = "wrong result (timing discarded)", None
            except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                status = f"failed: {type(e).__name__}: {e}"[:300]
            target = (f">= {TARGET_RATIO}x torch.matmul" if name == "triton.wait+signal" else "")
            row = op_row(ctx, method=name, ms=ms, t_baseline=t_base, status=status, target=target,
                         **common)
            if target:
                row["meets_target"] = bool(ms) and row["speedup"] >= TARGET_RATIO
            rows.append(row)
    return rows
