"""Launcher of the grouped GEMM over row segments (grouped_gemm.py) and its fp32 reference.

``grouped_gemm(a, weight, segments)``: for every segment s of ``segments`` (a ``SegmentTable``),
``out[c_start:c_start + rows] = a[a_start:a_start + rows] @ weight[expert]``, with fp32
accumulation, the row counts on the device (no host read). Options, each off by default:
  * wait (``wait_flags``): a tile of chunk c reads ``a`` only once ``wait_flags[c] >=
    wait_expected`` -- dispatch -> grouped GEMM, each source rank's rows used as they land;
  * signal (``signal_words``): once every tile of chunk c is stored, ``signal_value`` is stored
    (release, system scope) to the int32 word at ``signal_words[c]`` -- grouped GEMM -> combine,
    each destination told as soon as its rows are written;
  * scatter (``out_chunks``): chunk c's rows go to the buffer at address ``out_chunks[c]`` (a
    ``PointerTable``, e.g. the peers' symmetric buffers) instead of ``out``.

``segments_of_counts(counts)`` is the plain grouped GEMM's table: rows grouped by expert, expert e
owns the ``counts[e]`` rows after those of experts 0..e-1, in place (``out`` rows = ``a`` rows).
bf16 under the interpreter multiplies fp32 copies, as gemm_launch.py explains.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import preload
from .gemm_launch import _interpreter_dot_operands
from .reduce_launch import (
    DEFAULT_SPIN_LIMIT,
    DEFAULT_TIMEOUT_MS,
    PointerTable,
    check_backend,
    check_flags,
    check_scope,
    check_wait_args,
    new_status,
    raise_on_timeout,
    serialized,
    timeout_ns,
)

FIELDS = ("a_start", "c_start", "rows", "expert", "chunk")


@dataclass(frozen=True)
class SegmentTable:
    """int32 [5, S] on the device: rows ``FIELDS`` of S segments; ``num_chunks`` chunks."""

    table: Tensor
    num_chunks: int

    @property
    def num_segments(self) -> int:
        return self.table.shape[1]

    @classmethod
    def of(cls, a_start: Tensor, c_start: Tensor, rows: Tensor, expert: Tensor, chunk: Tensor,
           num_chunks: int) -> "SegmentTable":
        """A table from five [S] integer tensors on one device (stacked there, no host read)."""
        return cls(torch.stack([a_start, c_start, rows, expert, chunk]).to(torch.int32), num_chunks)


def segments_of_counts(counts: Tensor) -> SegmentTable:
    """The table of rows grouped by expert (``counts [E]`` on the device): segment e = expert e's
    rows, at the same place in ``a`` and ``out``, one chunk."""
    counts = counts.to(torch.int64)
    start = counts.cumsum(0) - counts
    experts = torch.arange(counts.numel(), device=counts.device)
    return SegmentTable.of(start, start, counts, experts, torch.zeros_like(experts), 1)


def grouped_gemm_ref(a: Tensor, weight: Tensor, segments: SegmentTable, out_rows: int) -> Tensor:
    """fp32 (fp64 for fp64 inputs) reference: one ``matmul`` per segment (reads the table on the
    host); rows no segment writes are zero."""
    dt = torch.promote_types(a.dtype, torch.float32)
    out = torch.zeros((out_rows, weight.shape[2]), dtype=dt, device=a.device)
    for a0, c0, rows, expert, _ in segments.table.t().tolist():
        if rows:
            out[c0:c0 + rows] = a[a0:a0 + rows].to(dt) @ weight[expert].to(dt)
    return out


def describe_grouped_timeout(code: int) -> str:
    return f"the wait flag of chunk {code - 1}"


def _check(a: Tensor, weight: Tensor, segments: SegmentTable) -> None:
    if a.dim() != 2 or weight.dim() != 3 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"a must be [R, K] and weight [E, K, N]; got a {tuple(a.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if a.dtype != weight.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"a and weight must share a dtype among float16, bfloat16, float32; got "
                         f"a {a.dtype}, weight {weight.dtype}")
    table = segments.table
    if table.dim() != 2 or table.shape[0] != len(FIELDS) or table.dtype != torch.int32 \
            or table.device != a.device or weight.device != a.device:
        raise ValueError(f"segments must be int32 [5, S] on a's device {a.device}, and weight "
                         f"there too; got {table.dtype} {tuple(table.shape)} on {table.device}")
    if 0 in (weight.shape[1], weight.shape[2]):
        raise ValueError(f"empty GEMM not supported: K={weight.shape[1]}, N={weight.shape[2]}")


def expected_tiles(segments: SegmentTable, block_m: int, tiles_n: int) -> Tensor:
    """int32 [num_chunks] on the device: the tiles of each chunk (what the signal counts to)."""
    rows = segments.table[2].to(torch.int64)
    tiles = (rows + block_m - 1) // block_m * tiles_n
    out = torch.zeros(segments.num_chunks, dtype=torch.int64, device=rows.device)
    return out.index_add_(0, segments.table[4].to(torch.int64), tiles).to(torch.int32)


def grouped_gemm(a: Tensor, weight: Tensor, segments: SegmentTable, *,
                 out: Optional[Tensor] = None, out_rows: Optional[int] = None,
                 wait_flags: Optional[Tensor] = None, wait_expected: int = 1,
                 signal_words: Optional[Tensor] = None, signal_value: int = 1,
                 out_chunks: Optional[PointerTable] = None,
                 status: Optional[Tensor] = None, spin_limit: int = DEFAULT_SPIN_LIMIT,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, flag_scope: str = "sys",
                 signal_scope: str = "sys", config=None, num_programs: Optional[int] = None,
                 allow_tf32: Optional[bool] = None) -> Optional[Tensor]:
    """The grouped GEMM of ``segments``; see the module docstring.

    a [R, K]; weight [E, K, N] (any strides: a transposed view serves a backward).
    out / out_rows: the [out_rows, N] result (default: a new tensor of a's rows); with
      ``out_chunks`` there is none and None is returned.
    wait_flags: int32 [num_chunks]; signal_words: int64 [num_chunks] addresses of int32 words.
    status: int32 [1] zero word a wait that gives up writes ``1 + chunk`` to (the launcher checks
      it itself on CPU; on a GPU the caller does, after synchronizing).
    config: a ``GemmConfig`` (its group_m is unused); default ``choose_grouped_config``.
    """
    from .gemm_configs import NOMINAL_SMS, arch_of
    from .grouped_gemm import grouped_gemm_kernel
    from .grouped_gemm_configs import choose_grouped_config

    _check(a, weight, segments)
    device = a.device
    interpreted = check_backend(device, grouped_gemm_kernel,
                                "pyfused.kernels.grouped_gemm_launch.grouped_gemm")
    k, n = weight.shape[1], weight.shape[2]
    if allow_tf32 is None:
        allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    allow_tf32 = allow_tf32 and a.dtype == torch.float32
    cfg = config or choose_grouped_config(n, k, a.dtype, arch_of(device), allow_tf32)
    check_scope("flag_scope", flag_scope)
    check_scope("signal_scope", signal_scope)
    chunks = segments.num_chunks
    wait, signal, scatter = wait_flags is not None, signal_words is not None, out_chunks is not None
    if wait:
        check_flags("wait_flags", wait_flags, (chunks,), device)
        check_wait_args("wait_flags", wait_flags, wait_expected, spin_limit)
    if signal and (signal_words.dtype != torch.int64 or tuple(signal_words.shape) != (chunks,)
                   or signal_words.device != device):
        raise ValueError(f"signal_words must be int64 [{chunks}] on {device}")
    status = new_status(device) if status is None else status
    check_flags("status", status, (1,), device)
    if scatter:
        if out is not None or len(out_chunks) != chunks or out_chunks.dtype != a.dtype \
                or out_chunks.shape[1] != n:
            raise ValueError(f"out_chunks must be one {a.dtype} buffer of width {n} per chunk "
                             f"({chunks}), and out must not be given with it")
        c_arg, c_strides = torch.empty(1, dtype=a.dtype, device=device), out_chunks.stride
    else:
        if out is None:
            out = torch.empty((a.shape[0] if out_rows is None else out_rows, n), dtype=a.dtype,
                              device=device)
        if out.dim() != 2 or out.shape[1] != n or out.dtype != a.dtype or out.device != device:
            raise ValueError(f"out must be [rows, {n}] {a.dtype} on {device}")
        c_arg, c_strides = out, out.stride()
    if num_programs is None:
        num_programs = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else NOMINAL_SMS["interpreter"])
    tiles_n = -(-n // cfg.block_n)
    dummy = status  # stands in for absent optional pointers; never dereferenced
    counters = expected = dummy
    if signal:
        counters = torch.zeros(chunks, dtype=torch.int32, device=device)
        expected = expected_tiles(segments, cfg.block_m, tiles_n)
    if interpreted:
        a, weight = _interpreter_dot_operands(a, weight, wait)
    args = (a, weight, c_arg, segments.table, out_chunks.ptrs if scatter else dummy,
            wait_flags if wait else dummy, counters, expected,
            signal_words if signal else dummy, status,
            segments.num_segments, chunks, n, k,
            a.stride(0), a.stride(1), *weight.stride(), *c_strides,
            int(wait_expected), int(signal_value), int(spin_limit), timeout_ns(timeout_ms))
    with serialized(device):
        preload.launch(
            grouped_gemm_kernel, (num_programs,),
            *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            WAIT=wait, SIGNAL=signal, SCATTER=scatter, EVEN_K=k % cfg.block_k == 0,
            INPUT_PRECISION="tf32" if a.dtype != torch.float32 or allow_tf32 else "ieee",
            FLAG_SCOPE=flag_scope, SIGNAL_SCOPE=signal_scope, WALL_CLOCK=device.type == "cuda",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if wait and device.type != "cuda":
        raise_on_timeout(status, describe_grouped_timeout)
    return out
