"""Persistent grouped GEMM over row segments, with per-chunk wait / signal flags.

Computes, for every *segment* s of a segment table,

    C[c_start[s] : c_start[s] + rows[s]] = A[a_start[s] : a_start[s] + rows[s]] @ W[expert[s]]

accumulating in fp32 (fp16 / bf16 on tensor cores, fp32 as "ieee" or "tf32" products). A is
[R, K], W is [E, K, N] (an expert's weight may be a transposed view: strides are arguments), C is
[R', N]. The launcher and the fp32 reference are in grouped_gemm_launch.py, the launch configs in
grouped_gemm_configs.py.

Segment table
  One int32 tensor [5, S] on the device: rows a_start, c_start, rows, expert, chunk. A segment is a
  run of rows that share an expert and a *chunk* (for expert parallelism: the source rank the rows
  came from, or the rank they go back to). Row counts live on the device and may be zero; nothing
  here reads them on the host, so the grid is fixed (``P`` persistent programs) and every program
  walks the whole table, computing the running tile count itself.

Tiles and schedule
  Segment s has ``ceil(rows[s] / BLOCK_M) * ceil(N / BLOCK_N)`` tiles (none when it is empty), a
  tile never straddles two segments. Tiles are numbered in table order (segment-major, then row
  tile, then column tile), and program ``pid`` takes tiles ``pid, pid + P, ...``: all programs work
  on the first segments of the table first. The caller orders the table so that the rows already
  here come first (this rank's own chunk), then the chunks in the order they arrive.

Wait (dispatch -> grouped GEMM), WAIT=True
  Before a tile reads A, one thread spins on an acquire read of ``flags[chunk]`` until it is
  ``>= expected`` and the program passes a barrier (``gemm.wait_flag``, the same protocol as the
  all-gather GEMM: the writer stores the chunk's rows, then sets the flag with release semantics at
  a scope that contains it; release -> acquire -> CTA barrier orders its stores before every load
  of A of this tile). A is read with ordinary loads, never TMA (see gemm.py). Bounded: a wait gives
  up after ``timeout_ns`` (GPU, ``%globaltimer``) or ``spin_limit`` polls (interpreter), records
  ``1 + chunk`` in ``status[0]`` and every later wait of the launch is skipped.

Signal (grouped GEMM -> combine), SIGNAL=True
  After a tile is stored, the program passes a barrier and one thread adds 1 to
  ``counters[chunk]`` (acq_rel at SIGNAL_SCOPE). The program whose add completes the chunk (the
  old value + 1 equals ``expected_tiles[chunk]``, counted by the launcher on the device) then
  stores ``signal_value`` to the int32 word at ``signal_table[chunk]`` (an address, e.g. a flag in
  the chunk's owner's signal pad) with release semantics at system scope. Its acq_rel add read the
  adds of every other tile of the chunk, which released their stores, so by cumulativity the owner
  that acquires the flag sees every row of the chunk. Program 0 first sets the word of every chunk
  with no tile at all (no rows to send still has to say so). ``counters`` start at zero.

Scatter output, SCATTER=True
  Segment s is stored to the buffer at ``out_table[chunk[s]]`` (an int64 address: a peer's
  symmetric buffer), at rows ``c_start[s] ...`` with strides (stride_cm, stride_cn); ``c_ptr`` only
  gives the element type.

Interpreter (TRITON_INTERPRET=1, CPU tensors): programs run one after another, so every flag a wait
reads must be set before the launch (the launcher checks, unless launches may overlap).
"""
import triton
import triton.language as tl

from .gemm import wait_flag


@triton.jit
def _signal_word(signal_table_ptr, chunk, value):
    """Store ``value`` to the int32 word whose address is ``signal_table[chunk]`` (release, system
    scope: the word's reader may be a peer GPU or the host)."""
    word = tl.load(signal_table_ptr + chunk).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(word, value, sem="release", scope="sys")


# The epoch changes every call: specializing on it would recompile at calls 1, 2 and 16.
@triton.jit(do_not_specialize=["wait_expected", "signal_value", "spin_limit", "timeout_ns"])
def grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, seg_ptr, out_table_ptr,
    flags_ptr, counters_ptr, expected_ptr, signal_table_ptr, status_ptr,
    num_segments, num_chunks, N, K,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn,
    wait_expected, signal_value, spin_limit, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WAIT: tl.constexpr, SIGNAL: tl.constexpr, SCATTER: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FLAG_SCOPE: tl.constexpr, SIGNAL_SCOPE: tl.constexpr,
    WALL_CLOCK: tl.constexpr,
):
    """Every segment's rows times its expert's weight, tile by tile; see the module docstring."""
    out_ty = c_ptr.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    if SIGNAL:
        if pid == 0:
            for c in range(0, num_chunks):
                if tl.load(expected_ptr + c) == 0:
                    _signal_word(signal_table_ptr, c, signal_value)

    tile_base = 0
    for s in range(0, num_segments):
        a_start = tl.load(seg_ptr + s)
        c_start = tl.load(seg_ptr + num_segments + s)
        rows = tl.load(seg_ptr + 2 * num_segments + s)
        expert = tl.load(seg_ptr + 3 * num_segments + s).to(tl.int64)
        chunk = tl.load(seg_ptr + 4 * num_segments + s)
        seg_tiles = tl.cdiv(rows, BLOCK_M) * tiles_n
        # this program's first tile of the segment: the first t >= tile_base with t % P == pid
        first = tile_base + (pid - tile_base % programs + programs) % programs
        for t in range(first, tile_base + seg_tiles, programs):
            local = t - tile_base
            tm = local // tiles_n
            tn = local % tiles_n
            local_rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = local_rows < rows
            cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            # Rows / columns past the end read a valid row of this segment / column 0 instead of
            # being masked (unmasked loads in the K loop); their products are never stored.
            a_rows = (a_start + tl.where(row_ok, local_rows, 0)).to(tl.int64)
            w_cols = tl.where(col_ok, cols, 0).to(tl.int64)

            if WAIT:
                wait_flag(flags_ptr + chunk, wait_expected, status_ptr, spin_limit, timeout_ns,
                          chunk + 1, FLAG_SCOPE, WALL_CLOCK)

            a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
            w_ptrs = (w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
                      + w_cols[None, :] * stride_wn)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(0, k_tiles):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    w = tl.load(w_ptrs)
                else:
                    k_ok = offs_k < K - ki * BLOCK_K
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                w_ptrs += BLOCK_K * stride_wk

            c_rows = (c_start + local_rows).to(tl.int64)
            if SCATTER:
                base = tl.load(out_table_ptr + chunk).to(tl.pointer_type(out_ty))
            else:
                base = c_ptr
            c_ptrs = base + c_rows[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])

            if SIGNAL:
                tl.debug_barrier()
                done = tl.atomic_add(counters_ptr + chunk, 1, sem="acq_rel", scope=SIGNAL_SCOPE) + 1
                if done == tl.load(expected_ptr + chunk):
                    _signal_word(signal_table_ptr, chunk, signal_value)
        tile_base += seg_tiles
