"""Multi-source reduce with fused residual-add and RMSNorm epilogues.

Computes, for rows i and columns j of P source buffers src_0 .. src_{P-1}, all [M, N]:

    h[i, j] = sum_p src_p[i, j]  (+ residual[i, j])                  accumulated in fp32
    out     = h                                                       without RMSNorm
    out     = h * rsqrt(mean_j h[i, j]^2 + eps) * weight[j]           with RMSNorm (weight [N])
    res_out = h  (rounded to res_out's dtype), when requested

This is the all-reduce + residual + RMSNorm step of a tensor-parallel transformer block: the P
sources are the P ranks' partial sums (peers' symmetric buffers, or slots peers pushed into), the
residual is the residual stream, ``res_out`` is the updated residual stream (may be the residual
buffer itself: every element is read before it is written, by the same thread) and ``out`` is the
next sub-layer's normalized input. The mean of squares is taken over the unrounded fp32 ``h`` (as
vLLM's fused_add_rms_norm does), not over ``h`` rounded to the residual's dtype.

Layout
  Sources are given as a table of P int64 addresses (``src_table``), all with the same row stride
  ``stride_src`` and unit column stride, all of ``out``'s element type. ALIGNED_SRC=True tells the
  compiler every address is 16-byte aligned (the launcher checks) so loads vectorize. Rows are split
  into ``num_chunks`` chunks of ``chunk_rows = ceil(M / num_chunks)`` rows, as in gemm.py.

Schedule
  A tile is ``rows_per_prog`` rows of one chunk by BLOCK_N columns (a whole row with RMSNorm); tiles
  are numbered chunk-major in the order ``order[...]`` (identity without an order table). ``grid =
  (P,)`` persistent programs take tiles ``pid, pid + P, ...`` and step over a tile's rows BLOCK_M at
  a time. The grid is capped by the launcher (``num_programs``): programs that spin on flags hold
  their SMs, so a reduce with one program per tile could fill the GPU and starve the kernels that
  set those flags (a peer's GEMM under virtual ranks, this rank's own signal kernels).

Wait, WAIT=True
  Before reading source p in chunk c, the program spins (one thread, acquire at FLAG_SCOPE, bounded
  by ``spin_limit`` polls) until ``flags[p * flag_stride_p + c] >= expected`` and then passes a
  CTA barrier, as in gemm.py's ``wait_flag`` (bounded by ``timeout_ns`` of wall-clock time on
  a GPU, by ``spin_limit`` polls in the interpreter): the writer of src_p's chunk c stores the data,
  then releases the flag; acquire + barrier order those stores before every load of the program.
  ``flag_stride_p = 0`` gives one flag per chunk for all sources, ``num_chunks`` gives one per
  (source, chunk). A timeout records ``1 + p * num_chunks + c`` in ``status[0]`` (first one wins);
  later waits are skipped and the reduce reads whatever the sources hold. The writers must not need
  SMs this kernel holds (peers' kernels, copy engines or the host).
"""
import triton
import triton.language as tl

from .gemm import chunk_tile, wait_flag


# The epoch changes every call: specializing on it (1, multiples of 16) would recompile the
# kernel at calls 1, 2 and 16 of a run.
@triton.jit(do_not_specialize=["wait_expected", "spin_limit", "timeout_ns"])
def multi_source_reduce_kernel(
    src_table_ptr, out_ptr, residual_ptr, res_out_ptr, weight_ptr,
    flags_ptr, order_ptr, status_ptr,
    M, N, chunk_rows, num_chunks, rows_per_prog,
    stride_src, stride_out, stride_res, stride_res_out,
    flag_stride_p, wait_expected, spin_limit, timeout_ns, eps,
    P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WAIT: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr, RMSNORM: tl.constexpr, ALIGNED_SRC: tl.constexpr,
    FLAG_SCOPE: tl.constexpr, WALL_CLOCK: tl.constexpr,
):
    """``out = epilogue(sum_p src_p (+ residual))``, tile by tile; see the module docstring."""
    src_ty = out_ptr.dtype.element_ty
    tiles_r = tl.cdiv(chunk_rows, rows_per_prog)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_chunks * tiles_r * tiles_n
    for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        chunk, tr, tn = chunk_tile(tile_id, tiles_r * tiles_n, tiles_r, tiles_n, order_ptr,
                                   HAS_ORDER, 1)
        if WAIT:
            for p in tl.static_range(P):
                wait_flag(flags_ptr + p * flag_stride_p + chunk, wait_expected, status_ptr,
                          spin_limit, timeout_ns, 1 + p * num_chunks + chunk, FLAG_SCOPE, WALL_CLOCK)
        _reduce_tile(src_table_ptr, out_ptr, residual_ptr, res_out_ptr, weight_ptr, src_ty,
                     chunk * chunk_rows, tr * rows_per_prog,
                     tl.minimum(tr * rows_per_prog + rows_per_prog,
                                tl.minimum(chunk_rows, M - chunk * chunk_rows)),
                     tn, N, stride_src, stride_out, stride_res, stride_res_out, eps,
                     P, BLOCK_M, BLOCK_N, HAS_RESIDUAL, WRITE_RESIDUAL, RMSNORM, ALIGNED_SRC)


@triton.jit
def _reduce_tile(src_table_ptr, out_ptr, residual_ptr, res_out_ptr, weight_ptr, src_ty,
                 chunk_start, row_lo, row_hi, tn, N, stride_src, stride_out, stride_res,
                 stride_res_out, eps, P: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
                 RMSNORM: tl.constexpr, ALIGNED_SRC: tl.constexpr):
    """Rows [row_lo, row_hi) of the chunk starting at ``chunk_start``, column tile ``tn``."""
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N

    for r0 in range(row_lo, row_hi, BLOCK_M):
        local = r0 + tl.arange(0, BLOCK_M)
        rows = (chunk_start + local).to(tl.int64)
        mask = (local < row_hi)[:, None] & col_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # A loop, not unrolled: one source's loads in flight per thread. Unrolled, the compiler
        # issues all P sources' loads first and holds P times the tile's share of registers (at
        # P = 8 that spills on sm_90a); the occupancy this leaves keeps enough loads in flight.
        for p in tl.range(P, loop_unroll_factor=1):
            src = tl.load(src_table_ptr + p).to(tl.pointer_type(src_ty))
            if ALIGNED_SRC:
                src = tl.multiple_of(src, 16)
            acc += tl.load(src + rows[:, None] * stride_src + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            acc += tl.load(residual_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        if WRITE_RESIDUAL:
            tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :],
                     acc.to(res_out_ptr.dtype.element_ty), mask=mask)
        if RMSNORM:
            rstd = tl.rsqrt(tl.sum(acc * acc, axis=1) / N + eps)
            # Loaded here rather than once per tile: kept across the row loop it would hold a
            # register per element of the thread's share of the row. It stays in L2.
            w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc = acc * rstd[:, None] * w[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(src_ty), mask=mask)
