// Custom all-reduce over symmetric buffers: what csrc/allreduce.cpp (schemas, CPU/Meta kernels,
// CUDA IPC helpers) and csrc/allreduce_cuda.cu (CUDA kernels) share, so that the CPU model and the
// GPU kernel use the same signal-pad layout, the same grid and the same row -> block assignment.
// pyfused/comm/symmetric.py mirrors the pad constants (PAD_INTS, FLAG_OFFSET, ...); a test checks
// that they agree with torch.ops.pyfused.symm_layout().
//
// Symmetric buffer of each rank (pyfused.comm.SymmetricBuffer): [data bytes][signal pad], where the
// pad is kPadInts int32 words, zero at allocation:
//   words [0, kBarrierInts): barrier slots, slot(channel, block, src) = (channel*kMaxBlocks + block)
//       * kMaxWorld + src. Rank `src` announces "block `block` reached barrier `channel`" to rank q by
//       storing the call's epoch into slot(channel, block, src) of q's pad.
//   words [kFlagOffset, kFlagOffset + kMaxFlags): per-chunk data flags of the fused GEMM schedules
//       (pyfused/fused/gemm_collectives.py), written by signal_flag with the call's epoch.
// Epochs: every call on a buffer takes the next epoch (1, 2, ...), the same on every rank; a slot or a
// flag only grows, and a wait is for ">= epoch", so nothing is reset between calls.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PYFUSED_HD __host__ __device__ __forceinline__
#else
#define PYFUSED_HD inline
#endif

namespace pyfused {
namespace symm {

constexpr int kMaxWorld = 8;
constexpr int kMaxBlocks = 64;
// Barrier channels: the all-reduce's start / mid (two-shot) / end barriers, the entry barrier of the
// fused GEMM schedules (pyfused/fused), and a host-side sync used by the CPU model of those schedules.
constexpr int kChanStart = 0;
constexpr int kChanMid = 1;
constexpr int kChanEnd = 2;
constexpr int kChanEntry = 3;
constexpr int kChanSync = 4;
constexpr int kChannels = 5;
constexpr int kBarrierInts = kChannels * kMaxBlocks * kMaxWorld;  // 2560
constexpr int kFlagOffset = 4096;
constexpr int kMaxFlags = 4096;
constexpr int kPadInts = kFlagOffset + kMaxFlags;  // 8192 words = 32 KiB
static_assert(kBarrierInts <= kFlagOffset, "barrier slots overlap the chunk flags");

constexpr int kOneShot = 0;
constexpr int kTwoShot = 1;

PYFUSED_HD int barrier_slot(int channel, int block, int src) {
  return (channel * kMaxBlocks + block) * kMaxWorld + src;
}

// Two-shot: rank s owns rows [seg_begin(s), seg_begin(s + 1)) (the last segments may be short or
// empty): it reduces them in phase 1, and every rank gathers them from s in phase 2.
PYFUSED_HD int64_t seg_rows(int64_t rows, int world) { return (rows + world - 1) / world; }

PYFUSED_HD int64_t seg_begin(int64_t rows, int world, int s) {
  const int64_t b = seg_rows(rows, world) * s;
  return b < rows ? b : rows;
}

// The grid: a pure function of (rows, world, algo, max_blocks), so every rank launches the same blocks and block
// b of one rank meets block b of every peer at each barrier. Block b handles rows first + b, first +
// b + G, ... of every row range it walks (all rows for one-shot; each segment for two-shot), in both
// phases, so that a block only ever reads rows that the same-numbered block of the writer wrote
// before the barrier they share. max_blocks (<= kMaxBlocks; the same on every rank) caps the grid:
// ranks that share one GPU each get a share of its SMs (virtual ranks).
PYFUSED_HD int launch_blocks(int64_t rows, int world, int algo, int max_blocks) {
  const int64_t span = algo == kTwoShot ? seg_rows(rows, world) : rows;
  const int64_t cap = max_blocks < kMaxBlocks ? max_blocks : kMaxBlocks;
  if (span < 1) return 1;
  return static_cast<int>(span < cap ? span : cap);
}

}  // namespace symm
}  // namespace pyfused

#include <ATen/core/Tensor.h>

#include <optional>

namespace pyfused {
// Checks shared by the CPU, CUDA and Meta kernels of all_reduce_rows (c10::Error on failure).
void check_all_reduce_args(const at::Tensor& buffer_ptrs, const at::Tensor& pad_ptrs,
                           const at::Tensor& out, const std::optional<at::Tensor>& residual,
                           const std::optional<at::Tensor>& residual_out,
                           const std::optional<at::Tensor>& weight, int64_t rank, int64_t epoch,
                           int64_t algo, int64_t timeout_ms, int64_t max_blocks);
void check_barrier_args(const at::Tensor& pad_ptrs, int64_t rank, int64_t channel, int64_t block,
                        int64_t epoch, int64_t timeout_ms);

// f(T{}) for the three element types the kernels serve (not AT_DISPATCH_FLOATING_TYPES_AND2: that
// would also instantiate double, which the checks refuse, for nothing but compile time).
template <typename F>
void dispatch_float_types(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t);
  }
}
}  // namespace pyfused
