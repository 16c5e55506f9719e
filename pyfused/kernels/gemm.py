"""Persistent tiled GEMM with per-chunk wait / signal flags and scattered output.

Computes ``C = A @ B (+ bias)``, accumulating in fp32, for fp16/bf16 (tensor cores) or fp32 inputs
(exact "ieee" or "tf32" products). The launcher and the fp32 reference are in gemm_launch.py;
launch configs are in gemm_configs.py.

Layout
  A [M, K] and B [K, N] are addressed through their strides, so B may be an nn.Linear weight
  W [N, K] read as ``W.t()`` (stride_bk = 1, stride_bn = K) with no copy. C is [M, N] with strides
  (stride_cm, stride_cn). Rows of A (and of C) are split into ``num_chunks`` chunks of
  ``chunk_rows = ceil(M / num_chunks)`` rows (the last may be shorter, none is empty): chunk c is
  rows [c*chunk_rows, min(M, (c+1)*chunk_rows)).

Tiles and schedule
  An output tile is BLOCK_M x BLOCK_N and never straddles two chunks: chunk c owns
  ``tiles_per_chunk = ceil(chunk_rows / BLOCK_M) * ceil(N / BLOCK_N)`` tiles (the same count for
  every chunk; tiles of the last, shorter chunk that fall past M store nothing but still count).
  Tiles are numbered chunk-major in the order ``order[0], order[1], ...`` (identity without an order
  table); inside a chunk, groups of GROUP_M row-tiles are visited column by column so that B's
  columns are reused from L2. ``grid = (P,)`` persistent programs take tiles ``pid, pid + P, ...``:
  all programs work on the first chunk in the order, then the next, ... so with the order "my own
  chunk first, then the peers' chunks in the order they arrive", compute starts on local data while
  the peers' chunks are still in flight.

Wait (consumer half of all-gather + GEMM), WAIT=True
  Before a tile of chunk c reads A, one thread of the program spins on an acquire read of
  ``flags[c]`` (an atomic add of 0 with sem="acquire" at scope FLAG_SCOPE) until
  ``flags[c] >= expected``, then the whole program passes a barrier (bar.sync) before its loads of
  A. The writer of chunk c (a peer's kernel, a copy engine, or the host) writes the rows of chunk c
  and then sets ``flags[c]`` with release semantics (or after a stream-ordered copy has completed).
  Release (writer) -> acquire (this thread) -> CTA barrier (every thread of the program) orders the
  writer's stores of chunk c before every load of A of this tile. FLAG_SCOPE must contain the
  writer: "sys" for a peer GPU or the host, "gpu" for another stream of the same GPU.
  A is read with ordinary loads (cp.async on sm_80/sm_90), which the acquire orders; TMA loads would
  go through the async proxy and need a proxy fence after the acquire, which Triton cannot emit
  without inline asm -- the reason this kernel does not use tensor descriptors.
  The writer must not need SMs this kernel holds (persistent programs that spin keep their SMs):
  peers' kernels, copy engines and the host are fine; a kernel queued on another stream of the same
  GPU behind this one may never get an SM.
  No hang: a spin gives up after ``timeout_ns`` of wall-clock time on a GPU (``%globaltimer``, read
  in inline PTX; WALL_CLOCK=True), or after ``spin_limit`` polls in the interpreter; the program
  then records ``1 + c`` in ``status[0]`` (first timeout wins, atomic compare-and-swap) and
  computes the tile from whatever A holds; every later tile of every program sees ``status[0] != 0``
  and stops waiting. The launcher turns a non-zero status into an error
  (``pyfused.kernels.gemm_launch.raise_on_timeout``).

Signal (producer half of GEMM + reduce-scatter / all-reduce), SIGNAL=True
  After a tile of chunk c is stored, the program passes a barrier (every thread's stores of the tile
  are issued and ordered before it), then one thread does ``atomic_add(counters[c], 1)`` with
  sem="release" at scope SIGNAL_SCOPE. A consumer that acquire-reads ``counters[c] ==
  base + tiles_per_chunk`` (``base`` = the counter's value before the launch) therefore sees all of
  chunk c of C. Counters are never reset by the kernel: the caller zeroes them or tracks ``base``.

Scatter output, SCATTER=True
  Chunk c of C is written to the buffer whose address is ``out_table[c]`` (int64 table of
  ``data_ptr()``s, e.g. a peer's symmetric buffer), at local row ``row - c*chunk_rows`` with strides
  (stride_cm, stride_cn); ``c_ptr`` is then only used for its element type. ALIGNED_OUT=True tells the
  compiler each table address is 16-byte aligned (the launcher checks) so stores vectorize.

Interpreter (TRITON_INTERPRET=1, CPU tensors): programs run one after another, so a wait whose flag
is not already set would spin to ``spin_limit``; the launcher refuses such a call up front. Pointer
tables of CPU tensors work: the interpreter dereferences the raw host addresses.
"""
import triton
import triton.language as tl

# A bounded spin in one asm block, run by every thread of the program: acquire-poll the flag until it
# is >= expected or ``timeout_ns`` of wall-clock time (%globaltimer, ns) have passed; the last value
# seen. Time, not a poll count: with ranks sharing one GPU a poll may wait a whole time slice, so a
# count says nothing about how long a wait took. Labels live inside the braces, so each inlined copy
# has its own.
_SPIN_ASM = """{{
.reg .pred %spin_p<2>;
.reg .u64 %spin_t<2>;
mov.u64 %spin_t0, %globaltimer;
SPIN_{scope}:
ld.acquire.{scope}.global.b32 $0, [$1];
setp.ge.s32 %spin_p0, $0, $2;
@%spin_p0 bra DONE_{scope};
mov.u64 %spin_t1, %globaltimer;
sub.u64 %spin_t1, %spin_t1, %spin_t0;
setp.lt.u64 %spin_p1, %spin_t1, $3;
@%spin_p1 bra SPIN_{scope};
DONE_{scope}:
}}"""
_SPIN_SYS = tl.constexpr(_SPIN_ASM.format(scope="sys"))
_SPIN_GPU = tl.constexpr(_SPIN_ASM.format(scope="gpu"))


@triton.jit
def _spin_until(flag_ptr, expected, timeout_ns, SCOPE: tl.constexpr):
    # The asm's operand widths are fixed: a 32-bit flag value, a 64-bit time (a launch may pass
    # either width: the JIT types small ints as i32).
    expected = expected.to(tl.int32)
    timeout_ns = timeout_ns.to(tl.int64)
    if SCOPE == "sys":
        seen = tl.inline_asm_elementwise(_SPIN_SYS, "=r,l,r,l", [flag_ptr, expected, timeout_ns],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.inline_asm_elementwise(_SPIN_GPU, "=r,l,r,l", [flag_ptr, expected, timeout_ns],
                                         dtype=tl.int32, is_pure=False, pack=1)
    return seen


@triton.jit
def wait_flag(flag_ptr, expected, status_ptr, spin_limit, timeout_ns, timeout_code,
              SCOPE: tl.constexpr, WALL_CLOCK: tl.constexpr):
    """Wait until ``*flag_ptr >= expected`` with acquire semantics, then barrier the program.
    Bounded: by ``timeout_ns`` of wall-clock time on a GPU (WALL_CLOCK), by ``spin_limit`` polls in
    the interpreter (which has no clock and runs programs one after another). Records
    ``timeout_code`` in ``*status_ptr`` if it gives up. Shared with reduce.py."""
    # The status word and the flag's final value are read by one thread and broadcast (Triton lowers
    # a scalar atomic that way), so every thread of the program takes the same branch: the barriers
    # inside must not diverge. The timed spin itself is per thread and holds no barrier.
    if tl.atomic_add(status_ptr, 0, sem="relaxed", scope="gpu") == 0:
        if WALL_CLOCK:
            _spin_until(flag_ptr, expected, timeout_ns, SCOPE)
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
        else:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
            spins = 0
            while (seen < expected) & (spins < spin_limit):
                seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
                spins += 1
        if seen < expected:
            tl.atomic_cas(status_ptr, 0, timeout_code, sem="relaxed")
    tl.debug_barrier()


@triton.jit
def chunk_tile(tile_id, tiles_per_chunk, tiles_m, tiles_n, order_ptr, HAS_ORDER: tl.constexpr,
               GROUP_M: tl.constexpr):
    """(chunk, row-tile in chunk, column tile) of the tile_id-th tile in schedule order."""
    pos = tile_id // tiles_per_chunk
    local = tile_id % tiles_per_chunk
    if HAS_ORDER:
        chunk = tl.load(order_ptr + pos)
    else:
        chunk = pos
    in_group = GROUP_M * tiles_n
    first_m = (local // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (local % in_group) % group_rows
    tn = (local % in_group) // group_rows
    return chunk, tm, tn


# The epoch changes every call: specializing on it (1, multiples of 16) would recompile the
# kernel at calls 1, 2 and 16 of a run.
@triton.jit(do_not_specialize=["wait_expected", "spin_limit", "timeout_ns"])
def persistent_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, out_table_ptr,
    flags_ptr, counters_ptr, order_ptr, status_ptr,
    M, N, K, chunk_rows, num_chunks,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    wait_expected, spin_limit, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WAIT: tl.constexpr, SIGNAL: tl.constexpr, SCATTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ORDER: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED_OUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FLAG_SCOPE: tl.constexpr, SIGNAL_SCOPE: tl.constexpr,
    WALL_CLOCK: tl.constexpr,
):
    """``C[chunk rows] = A[chunk rows] @ B (+ bias)`` tile by tile; see the module docstring."""
    out_ty = c_ptr.dtype.element_ty
    tiles_m = tl.cdiv(chunk_rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_chunk = tiles_m * tiles_n
    num_tiles = num_chunks * tiles_per_chunk
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    # Not flattened with the K loop: the software pipeliner must not hoist the next tile's loads of A
    # above that tile's wait.
    for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        chunk, tm, tn = chunk_tile(tile_id, tiles_per_chunk, tiles_m, tiles_n, order_ptr, HAS_ORDER,
                                   GROUP_M)
        chunk_start = chunk * chunk_rows
        chunk_len = tl.minimum(chunk_rows, M - chunk_start)
        local_rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = local_rows < chunk_len
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        # Out-of-range rows/columns read a valid row (of this same chunk) / column instead of being
        # masked: unmasked loads in the K loop; their products are never stored.
        a_rows = (chunk_start + tl.where(row_ok, local_rows, 0)).to(tl.int64)
        b_cols = tl.where(col_ok, cols, 0)
        b_cols = tl.max_contiguous(tl.multiple_of(b_cols, BLOCK_N), BLOCK_N).to(tl.int64)

        if WAIT:
            wait_flag(flags_ptr + chunk, wait_expected, status_ptr, spin_limit, timeout_ns, chunk + 1,
                      FLAG_SCOPE, WALL_CLOCK)

        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + b_cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(0, k_tiles):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - ki * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        if HAS_BIAS:
            acc += tl.load(bias_ptr + b_cols).to(tl.float32)[None, :]
        c_mask = row_ok[:, None] & col_ok[None, :]
        if SCATTER:
            base = tl.load(out_table_ptr + chunk).to(tl.pointer_type(out_ty))
            if ALIGNED_OUT:
                base = tl.multiple_of(base, 16)
            c_rows = local_rows.to(tl.int64)
        else:
            base = c_ptr
            c_rows = (chunk_start + local_rows).to(tl.int64)
        c_ptrs = base + c_rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(out_ty), mask=c_mask)

        if SIGNAL:
            tl.debug_barrier()
            tl.atomic_add(counters_ptr + chunk, 1, sem="release", scope=SIGNAL_SCOPE)
