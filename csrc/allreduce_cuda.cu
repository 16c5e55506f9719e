// CUDA kernels of the custom all-reduce over symmetric buffers (schemas, checks and the CPU model:
// allreduce.cpp; pad layout and grid: allreduce.h).
//
// all_reduce_rows: x_p (rows x cols, one per rank p) sits at the start of rank p's symmetric buffer.
//   h = round_T(sum_{p=0..W-1} x_p (+ residual)), fp32 accumulation in rank order, so every rank and
//   both algorithms produce the same bits of h; out = h * rsqrt(mean(h^2) + eps) * weight (the mean
//   over the rounded h) or out = h; residual_out = h.
//   One-shot (algo 0): block b of every rank reduces rows b, b+G, ... reading all W buffers.
//   Two-shot (algo 1): rank s owns rows [seg_begin(s), seg_begin(s+1)). Phase 1: block b of rank s
//   reduces rows seg_begin(s) + b + kG of its segment from all W buffers and stores h over its own
//   x (in place: those rows of rank s's buffer are read by rank s alone in phase 1). Phase 2: block b
//   of every rank reads rows seg_begin(s) + b + kG of segment s from rank s's buffer, for every s.
//   Reads per rank: one-shot W * rows * cols elements; two-shot 2 * rows * cols (plus its segment's
//   W reads), the reason two-shot wins once the bytes, not the latency, dominate.
//
// Barriers: block b of rank r meets block b of every peer at channel c by storing the epoch into
// slot(c, b, r) of every peer's pad (st.release.sys after __syncthreads and fence.sc.sys), then
// spinning with ld.acquire.sys on slot(c, b, q) of its own pad for every q (thread q < W polls peer
// q), then __syncthreads. Release/acquire at system scope plus the CTA barriers order every write the
// block (and the work queued before the kernel) made before the barrier before every read a peer's
// block makes after it. Per-block barriers suffice because block b only reads rows that block b of the
// writer wrote (allreduce.h: the same row -> block map in both phases), and the end barrier makes the
// op return only once no peer block still reads this rank's buffer, so the next writer of the buffer
// (stream-ordered after this kernel) cannot race a reader.
// Peer data is loaded with ld.global.cg (L2, not L1): the L1 is not coherent with other GPUs' writes.
//
// Liveness: block b spins until the same block of every peer arrives; the peers' kernels must run
// (different GPUs, or ranks sharing one GPU by time-slicing -- correct but slow; see
// docs/TESTBED.md). A wait that exceeds timeout_ms prints the slot and traps (the CUDA context is
// lost: a loud failure instead of a hang), as pyfused::wait_flag does.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>

#include "allreduce.h"
#include "ptx_sync.cuh"

namespace pyfused {
namespace {

using namespace symm;

using pyfused_ptx::globaltimer_ns;
using pyfused_ptx::ld_acquire_sys;
using pyfused_ptx::st_release_sys;

// The cold path of a barrier wait, out of line: printf's argument buffer would otherwise sit on
// every kernel's stack and cost registers in the hot loops.
__device__ __noinline__ void barrier_timed_out(uint64_t timeout_ns, int rank, int block, int channel,
                                               int q, int32_t seen, int32_t epoch) {
  printf("pyfused symmetric-memory barrier timed out after %llu ms: rank %d block %d channel %d "
         "waits for rank %d (slot holds %d, expected >= %d). A peer did not reach the barrier. "
         "Trapping: the CUDA context is lost.\n",
         static_cast<unsigned long long>(timeout_ns / 1000000), rank, block, channel, q, seen, epoch);
  __trap();
}

__device__ void block_barrier(const int64_t* pads, int rank, int world, int channel, int block,
                              int32_t epoch, uint64_t timeout_ns) {
  __syncthreads();
  if (threadIdx.x < world) {
    const int q = threadIdx.x;
    int32_t* remote = reinterpret_cast<int32_t*>(pads[q]) + barrier_slot(channel, block, rank);
    __threadfence_system();
    st_release_sys(remote, epoch);
    const int32_t* mine = reinterpret_cast<const int32_t*>(pads[rank]) + barrier_slot(channel, block, q);
    const uint64_t start = globaltimer_ns();
    int32_t seen;
    while ((seen = ld_acquire_sys(mine)) < epoch) {
      if (timeout_ns != 0 && globaltimer_ns() - start > timeout_ns) {
        barrier_timed_out(timeout_ns, rank, block, channel, q, seen, epoch);
      }
    }
  }
  __syncthreads();
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <int BYTES> struct RawOf;
template <> struct RawOf<16> { using type = int4; };
template <> struct RawOf<8> { using type = int2; };
template <> struct RawOf<4> { using type = int; };
template <> struct RawOf<2> { using type = unsigned short; };

// A pack of a (possibly remote) buffer, through L2 only.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_cg(const T* p) {
  using Raw = typename RawOf<sizeof(T) * VEC>::type;
  Raw raw = __ldcg(reinterpret_cast<const Raw*>(p));
  Pack<T, VEC> out;
  *reinterpret_cast<Raw*>(&out) = raw;
  return out;
}

struct Params {
  const int64_t* buffer_ptrs;
  const int64_t* pad_ptrs;
  void* out;
  const void* residual;
  void* residual_out;
  const float* weight;
  float eps;
  int64_t rows;
  int64_t cols;
  int rank;
  int world;
  int32_t epoch;
  int algo;
  int max_blocks;
  uint64_t timeout_ns;
};

// d1[j] (and d2[j]) = round_T(sum_{i < nsrc} srcs[i][offset + j] (+ residual[j])) for this thread's
// packs of one row; returns this thread's sum of squares of the rounded values.
template <typename T, int VEC>
__device__ float produce_row(const int64_t* srcs, int nsrc, int64_t offset, int64_t cols,
                             const T* residual, T* d1, T* d2) {
  float ss = 0.f;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    for (int i = 0; i < nsrc; ++i) {
      const Pack<T, VEC> x = load_cg<T, VEC>(reinterpret_cast<const T*>(srcs[i]) + offset + c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += static_cast<float>(x.v[k]);
    }
    if (residual) {
      const Pack<T, VEC> r = *reinterpret_cast<const Pack<T, VEC>*>(residual + c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += static_cast<float>(r.v[k]);
    }
    Pack<T, VEC> h;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      h.v[k] = static_cast<T>(acc[k]);
      const float hv = static_cast<float>(h.v[k]);
      ss += hv * hv;
    }
    *reinterpret_cast<Pack<T, VEC>*>(d1 + c) = h;
    if (d2) *reinterpret_cast<Pack<T, VEC>*>(d2 + c) = h;
  }
  return ss;
}

__device__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
  __syncthreads();  // scratch may still be read by the previous row's reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// out = h * rsqrt(mean(h^2) + eps) * weight, h being the row this thread's produce_row just wrote
// (each thread reads back only its own packs, so no barrier is needed besides the reduction's).
template <typename T, int VEC>
__device__ void norm_row(const T* h, T* out, const float* weight, float eps, int64_t cols, float ss,
                         float* scratch) {
  const float rstd = rsqrtf(block_sum(ss, scratch) / static_cast<float>(cols) + eps);
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(h + c);
    Pack<T, VEC> y;
#pragma unroll
    for (int k = 0; k < VEC; ++k) y.v[k] = static_cast<T>(static_cast<float>(x.v[k]) * rstd * weight[c + k]);
    *reinterpret_cast<Pack<T, VEC>*>(out + c) = y;
  }
}

// The epilogue of one row from sources `srcs` (W buffers for one-shot, the owner for two-shot).
template <typename T, int VEC>
__device__ void finish_row(const Params& p, const int64_t* srcs, int nsrc, int64_t row,
                           const T* residual, float* scratch) {
  const int64_t off = row * p.cols;
  T* out = static_cast<T*>(p.out) + off;
  T* res_out = p.residual_out ? static_cast<T*>(p.residual_out) + off : nullptr;
  const T* res = residual ? residual + off : nullptr;
  if (p.weight) {
    T* h = res_out ? res_out : out;
    const float ss = produce_row<T, VEC>(srcs, nsrc, off, p.cols, res, h, nullptr);
    norm_row<T, VEC>(h, out, p.weight, p.eps, p.cols, ss, scratch);
  } else {
    produce_row<T, VEC>(srcs, nsrc, off, p.cols, res, out, res_out);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(1024) all_reduce_rows_kernel(Params p) {
  __shared__ int64_t bufs[kMaxWorld];
  __shared__ int64_t pads[kMaxWorld];
  __shared__ float scratch[32];
  if (threadIdx.x < p.world) {
    bufs[threadIdx.x] = p.buffer_ptrs[threadIdx.x];
    pads[threadIdx.x] = p.pad_ptrs[threadIdx.x];
  }
  __syncthreads();
  const int b = blockIdx.x, grid = gridDim.x;
  const T* residual = static_cast<const T*>(p.residual);
  block_barrier(pads, p.rank, p.world, kChanStart, b, p.epoch, p.timeout_ns);
  if (p.algo == kOneShot) {
    for (int64_t row = b; row < p.rows; row += grid) finish_row<T, VEC>(p, bufs, p.world, row, residual, scratch);
  } else {
    T* mine = reinterpret_cast<T*>(bufs[p.rank]);
    const int64_t hi = seg_begin(p.rows, p.world, p.rank + 1);
    for (int64_t row = seg_begin(p.rows, p.world, p.rank) + b; row < hi; row += grid) {
      const int64_t off = row * p.cols;
      produce_row<T, VEC>(bufs, p.world, off, p.cols, residual ? residual + off : nullptr, mine + off, nullptr);
    }
    block_barrier(pads, p.rank, p.world, kChanMid, b, p.epoch, p.timeout_ns);
    for (int s = 0; s < p.world; ++s) {
      const int64_t end = seg_begin(p.rows, p.world, s + 1);
      for (int64_t row = seg_begin(p.rows, p.world, s) + b; row < end; row += grid) {
        finish_row<T, VEC>(p, bufs + s, 1, row, nullptr, scratch);
      }
    }
  }
  block_barrier(pads, p.rank, p.world, kChanEnd, b, p.epoch, p.timeout_ns);
}

__global__ void symm_barrier_kernel(const int64_t* pad_ptrs, int rank, int world, int channel,
                                    int block, int32_t epoch, uint64_t timeout_ns) {
  __shared__ int64_t pads[kMaxWorld];
  if (threadIdx.x < world) pads[threadIdx.x] = pad_ptrs[threadIdx.x];
  __syncthreads();
  block_barrier(pads, rank, world, channel, block, epoch, timeout_ns);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, int VEC>
void launch(const Params& p, cudaStream_t stream) {
  const int grid = launch_blocks(p.rows, p.world, p.algo, p.max_blocks);
  const int64_t packs = (p.cols + VEC - 1) / VEC;
  int threads = static_cast<int>(((packs < 1024 ? packs : 1024) + 31) / 32 * 32);
  threads = threads < 32 ? 32 : threads;
  all_reduce_rows_kernel<T, VEC><<<grid, threads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void all_reduce_rows_cuda(const at::Tensor& buffer_ptrs, const at::Tensor& pad_ptrs, const at::Tensor& out,
                          const std::optional<at::Tensor>& residual,
                          const std::optional<at::Tensor>& residual_out,
                          const std::optional<at::Tensor>& weight, double eps, int64_t rank,
                          int64_t epoch, int64_t algo, int64_t timeout_ms, int64_t max_blocks) {
  check_all_reduce_args(buffer_ptrs, pad_ptrs, out, residual, residual_out, weight, rank, epoch, algo,
                        timeout_ms, max_blocks);
  c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  Params p;
  p.buffer_ptrs = buffer_ptrs.const_data_ptr<int64_t>();
  p.pad_ptrs = pad_ptrs.const_data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.residual = residual ? residual->const_data_ptr() : nullptr;
  p.residual_out = residual_out ? residual_out->data_ptr() : nullptr;
  p.weight = weight ? weight->const_data_ptr<float>() : nullptr;
  p.eps = static_cast<float>(eps);
  p.rows = out.size(0);
  p.cols = out.size(1);
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(buffer_ptrs.size(0));
  p.epoch = static_cast<int32_t>(epoch);
  p.algo = static_cast<int>(algo);
  p.timeout_ns = static_cast<uint64_t>(timeout_ms) * 1000000ull;
  p.max_blocks = static_cast<int>(max_blocks < kMaxBlocks ? max_blocks : kMaxBlocks);
  if (p.rows == 0 || p.cols == 0) return;
  // 16-byte packs need every row start aligned: peers' buffers are allocation-aligned and rows are
  // cols elements apart; the local tensors are checked. Otherwise one element per access.
  const bool vec_ok = aligned16(p.out) && (!p.residual || aligned16(p.residual)) &&
                      (!p.residual_out || aligned16(p.residual_out));
  dispatch_float_types(out.scalar_type(), "pyfused::all_reduce_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (vec_ok && p.cols % kVec == 0) {
      launch<scalar_t, kVec>(p, stream);
    } else {
      launch<scalar_t, 1>(p, stream);
    }
  });
}

void symm_barrier_cuda(const at::Tensor& pad_ptrs, int64_t rank, int64_t channel, int64_t block,
                       int64_t epoch, int64_t timeout_ms) {
  check_barrier_args(pad_ptrs, rank, channel, block, epoch, timeout_ms);
  c10::cuda::CUDAGuard guard(pad_ptrs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(pad_ptrs.device().index()).stream();
  symm_barrier_kernel<<<1, 32, 0, stream>>>(
      pad_ptrs.const_data_ptr<int64_t>(), static_cast<int>(rank), static_cast<int>(pad_ptrs.size(0)),
      static_cast<int>(channel), static_cast<int>(block), static_cast<int32_t>(epoch),
      static_cast<uint64_t>(timeout_ms) * 1000000ull);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace pyfused

TORCH_LIBRARY_IMPL(pyfused, CUDA, m) {
  m.impl("all_reduce_rows", &pyfused::all_reduce_rows_cuda);
  m.impl("symm_barrier", &pyfused::symm_barrier_cuda);
}
