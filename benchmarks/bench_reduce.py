"""Benchmark of the multi-source reduce + residual + RMSNorm (pyfused/kernels/reduce.py), single
device.

The all-reduce + residual + RMSNorm step of a TP transformer block, with the P ranks' partial sums
standing in as P local buffers: hidden 8192 (Llama-3 70B), M in {2048, 8192} tokens ({2048} with
--quick), P in {2, 4, 8}, residual_out a separate buffer (the bytes are those of the in-place case).

Rows, each a CUDA-graph replay, all measured in the same run:
  torch.copy_      copy bandwidth of this device: a 2 GiB buffer copied (the copy engines' path),
                   GB/s = 2 * size / time
  torch.add        the same bytes copied by an elementwise kernel on the SMs (src + 0)
  torch            baseline: residual + sum of the P sources (P adds), then F.rms_norm
  triton           the fused kernel
  triton.wait      the same with 8 chunks and one flag per (source, chunk), flags pre-set
``gbps`` = the fused op's minimum traffic / time: (P + 1) reads and 2 writes of M x N elements plus
the weight, the same byte count for every row of a point (the baseline moves more than that).
``pct_copy_bw`` = gbps / the faster copy row's GB/s (the first GPU run's 512 MiB ``copy_`` alone read
2726 GB/s on an H200, slower than the fused kernel at several points, so it was no ceiling); the
issue's target for the Triton rows is >= 85%.

On CPU (no GPU) the Triton kernel would run in the interpreter: the suite then measures the copy and
the torch baseline only (M = 256) and emits ``skipped`` rows for the Triton variants.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from pyfused._logging import logger
from pyfused.bench.harness import BenchContext, op_row, tensor_bytes, time_fn

from .bench_gemm import SKIP_STATUS, _close, graphed

MULTI_RANK = False

HIDDEN = 8192
TOKENS = (2048, 8192)
CPU_TOKENS = 256
SOURCES = (2, 4, 8)
CHUNKS = 8
EPS = 1e-5
TARGET_PCT = 0.85
TRITON_VARIANTS = ("triton", "triton.wait")
COPY_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}
# Two ways to copy, since either may be the faster on a device: the copy engine path of
# ``Tensor.copy_`` (a device-to-device memcpy) and an elementwise kernel on the SMs (``src + 0``).
COPY_METHODS = {"torch.copy_": lambda src, dst: dst.copy_(src),
                "torch.add": lambda src, dst: torch.add(src, 0, out=dst)}


def _copy_rows(ctx: BenchContext, dtype: torch.dtype):
    """The copy rows and the device's copy bandwidth in this run: the faster of the two copies
    (bytes read + written per second), the reference of every ``pct_copy_bw``."""
    nbytes = COPY_BYTES[ctx.device.type]
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=ctx.device).fill_(1)
    dst = torch.empty_like(src)
    measured = {}
    for method, copy in COPY_METHODS.items():
        ms = time_fn(graphed(lambda copy=copy: copy(src, dst), ctx.device), ctx)
        measured[method] = (ms, 2 * nbytes / (ms * 1e-3) / 1e9)
    best = max(gbps for _, gbps in measured.values())
    rows = [op_row(ctx, shape=f"{nbytes >> 20}MiB", dtype=dtype, method=method, transport="none",
                   ms=ms, case="copy_bandwidth", gbps=gbps, pct_copy_bw=gbps / best)
            for method, (ms, gbps) in measured.items()]
    return rows, best


def run(ctx: BenchContext) -> List[dict]:
    from pyfused.kernels.reduce_launch import PointerTable, multi_source_reduce, reduce_ref

    dtype, dev = ctx.dtype, ctx.device
    on_gpu = dev.type == "cuda"
    if not on_gpu:
        logger.warning("bench_reduce: no GPU; measuring copy and torch baseline only (%s)", SKIP_STATUS)
    rows, copy_gbps = _copy_rows(ctx, dtype)
    tokens = (TOKENS[:1] if ctx.quick else TOKENS) if on_gpu else (CPU_TOKENS,)
    n = HIDDEN
    for m in tokens:
        for p in SOURCES:
            g = torch.Generator().manual_seed(m + p)
            srcs = [torch.randn(m, n, generator=g).to(dtype).to(dev) for _ in range(p)]
            residual = torch.randn(m, n, generator=g).to(dtype).to(dev)
            weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(dev)
            out, res_out, h = (torch.empty(m, n, dtype=dtype, device=dev) for _ in range(3))
            nbytes = tensor_bytes((m, n), dtype) * (p + 3) + tensor_bytes((n,), dtype)
            common = dict(shape=f"{m}x{n}", dtype=dtype, transport="none", case=f"P={p}",
                          sources=p, nbytes=nbytes)

            def torch_step():
                torch.add(residual, srcs[0], out=h)
                for s in srcs[1:]:
                    h.add_(s)
                return F.rms_norm(h, (n,), weight, EPS)

            t_base = time_fn(graphed(torch_step, dev), ctx)
            rows.append(op_row(ctx, method="torch", ms=t_base, **common, **_bw(nbytes, t_base, copy_gbps)))
            if not on_gpu:
                rows += [op_row(ctx, method=v, ms=None, status=SKIP_STATUS, **common)
                         for v in TRITON_VARIANTS]
                continue
            ref_out, ref_h = reduce_ref(srcs, residual, weight, EPS)
            flags = torch.ones(p, CHUNKS, dtype=torch.int32, device=dev)
            status = torch.zeros(1, dtype=torch.int32, device=dev)
            table = PointerTable.of(srcs)  # once: building it is an H2D copy a graph cannot capture
            launches = {
                "triton": lambda: multi_source_reduce(table, out=out, residual=residual,
                                                      residual_out=res_out, weight=weight, eps=EPS),
                "triton.wait": lambda: multi_source_reduce(
                    table, out=out, residual=residual, residual_out=res_out, weight=weight, eps=EPS,
                    num_chunks=CHUNKS, wait_flags=flags, status=status),
            }
            for name in TRITON_VARIANTS:
                status_txt, ms = "ok", None
                try:
                    ms = time_fn(graphed(launches[name], dev), ctx)
                    if not (_close(out, ref_out) and _close(res_out, ref_h)):
                        status_txt, ms = "wrong result (timing discarded)", None
                except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                    status_txt = f"failed: {type(e).__name__}: {e}"[:300]
                bw = _bw(nbytes, ms, copy_gbps)
                rows.append(op_row(ctx, method=name, ms=ms, t_baseline=t_base, status=status_txt,
                                   target=f">= {TARGET_PCT:.0%} of copy bandwidth",
                                   meets_target=bool(ms) and bw["pct_copy_bw"] >= TARGET_PCT,
                                   **common, **bw))
    return rows


def _bw(nbytes: float, ms, copy_gbps: float) -> dict:
    if not ms:
        return {"gbps": float("nan"), "pct_copy_bw": float("nan")}
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {"gbps": gbps, "pct_copy_bw": gbps / copy_gbps}
