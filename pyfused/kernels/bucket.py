"""Bucket copies of data parallelism: flatten + scale + cast, and unflatten + cast, one launch each.

Computes, for S segments (one per parameter of a gradient bucket) with ``numel[s]`` elements each:

    dst_s[i] = cast_dst( fp32(src_s[i]) * scale )          for 0 <= i < numel[s]

Flatten (before a bucket's all-reduce / reduce-scatter): ``src_s`` is parameter s's gradient,
``dst_s`` is the bucket buffer at the parameter's offset, ``scale = 1 / world`` (the pre-division
torch DDP does, as a multiplication by the fp32 reciprocal, like its reducer), and the cast is to
the communication dtype (bf16 with ``comm_dtype=torch.bfloat16``). Unflatten (after the reduction):
``src_s`` is the bucket at the parameter's offset, ``dst_s`` the gradient (``scale = 1``), the cast
back to the gradient's dtype. Without the kernel these are S copies plus a division plus a cast:
2S+1 launches and two extra passes over the bucket.

Layout
  Segments are addressed by two int64 tables of element addresses (``src_table[s]``,
  ``dst_table[s]``, each the address of the segment's first element, contiguous after it) and
  ``numel[s]``. The grid is one program per BLOCK elements of one segment: program p copies
  elements ``[blk_start[p], blk_start[p] + BLOCK)`` of segment ``blk_seg[p]`` (masked at the
  segment's end). The block tables depend only on the bucket's layout and are built once per bucket;
  the address tables change only when gradients are reallocated.

Ordering
  No program reads what another writes (segments of one launch never overlap), so there is no
  inter-program synchronisation. The launch is stream-ordered like any kernel: the caller puts it
  on the comm stream after that stream waited for the gradients, and the collective that reads the
  bucket is enqueued after it on the same stream.

Rounding: fp32 math, one rounding at the store (round-to-nearest-even on GPU). The Triton
interpreter truncates fp32 -> bf16/fp16 instead, so CPU tests of the kernel allow one unit in the
last place for low-precision outputs and compare fp32 outputs exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class BucketCopyConfig:
    block: int      # elements per program (a power of two)
    num_warps: int


# Launch configs as data, keyed by (target, element size of the wider side). GPU: 16 KiB read per
# program keeps enough 16-byte loads in flight for a copy to reach bandwidth; none has been measured
# on a GPU yet. Interpreter: large blocks (fewer programs,
# each run in numpy).
CONFIGS = {
    ("cuda", 4): BucketCopyConfig(block=4096, num_warps=8),
    ("cuda", 2): BucketCopyConfig(block=8192, num_warps=8),
    ("interpreter", 4): BucketCopyConfig(block=1024, num_warps=4),
    ("interpreter", 2): BucketCopyConfig(block=1024, num_warps=4),
}


def choose_config(target: str, elem_size: int) -> BucketCopyConfig:
    return CONFIGS[(target, 4 if elem_size >= 4 else 2)]


@triton.jit
def segment_copy_scale_kernel(src_table_ptr, dst_table_ptr, numel_ptr, blk_seg_ptr, blk_start_ptr,
                              scale, SRC_T: tl.constexpr, DST_T: tl.constexpr,
                              BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """``dst_s[i] = cast(fp32(src_s[i]) * scale)`` for one BLOCK of one segment; see the module doc.

    ALIGN > 1 claims what the launcher checked: every address in both tables is 16-byte aligned and
    every ``numel[s]`` is a multiple of ALIGN elements (16 bytes of the narrower side). The masks
    are then constant over ALIGN elements and accesses compile to 16-byte vectors. ALIGN = 1 claims
    nothing: element-wise accesses, any address and length."""
    pid = tl.program_id(0)
    seg = tl.load(blk_seg_ptr + pid)
    start = tl.multiple_of(tl.load(blk_start_ptr + pid), BLOCK)  # blocks start at multiples of BLOCK
    n = tl.load(numel_ptr + seg)
    src = tl.load(src_table_ptr + seg).to(tl.pointer_type(SRC_T))
    dst = tl.load(dst_table_ptr + seg).to(tl.pointer_type(DST_T))
    if ALIGN > 1:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        n = tl.multiple_of(n, ALIGN)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, (x * scale).to(DST_T), mask=mask)
