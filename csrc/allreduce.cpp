// Custom all-reduce over symmetric buffers: op schemas, the shared argument checks, the CPU model of
// the kernels, Meta kernels, and the CUDA IPC helpers that map peers' buffers (the CUDA kernels are
// in allreduce_cuda.cu; the pad layout and the grid in allreduce.h).
//
//   all_reduce_rows(Tensor buffer_ptrs, Tensor pad_ptrs, Tensor(a!) out, Tensor? residual,
//                   Tensor(b!)? residual_out, Tensor? weight, float eps, int rank, int epoch,
//                   int algo, int timeout_ms=60000, int max_blocks=64) -> ()
//       Every rank p holds x_p, rows x cols of out's dtype, at the start of its symmetric buffer
//       (buffer_ptrs[p], an address valid in this process); pad_ptrs[p] is p's signal pad. Computes
//           h   = sum_{p = 0..W-1} x_p (+ residual)     fp32 accumulation in rank order, rounded to
//                                                       out's dtype (so every rank gets the same bits)
//           out = h * rsqrt(mean_j h^2 + eps) * weight   with weight (fp32 [cols]); else out = h
//           residual_out = h                             if given
//       algo 0 (one-shot): every rank reads every peer's rows. algo 1 (two-shot): rank s reduces its
//       segment of rows into its own buffer (in place), then every rank reads each segment from its
//       owner. Barriers on the signal pads (epoch = this call's epoch) order the phases; the end
//       barrier guarantees no peer still reads this rank's buffer when the op returns (stream order).
//   symm_barrier(Tensor pad_ptrs, int rank, int channel, int block, int epoch, int timeout_ms=60000)
//       All ranks meet at (channel, block): each stores epoch into its slot of every peer's pad, then
//       waits until every peer's slot in its own pad is >= epoch.
//   symm_layout() -> int[]: the pad constants of allreduce.h, for pyfused/comm/symmetric.py to check.
//   ipc_alloc(int nbytes, int device) -> Tensor          cudaMalloc'd, zeroed uint8 buffer, freed
//                                                         (cudaFree) when the last reference dies
//   ipc_handle(Tensor buffer) -> Tensor                  its cudaIpcMemHandle_t, CPU uint8 [64]
//   ipc_open(Tensor handle, int nbytes, int device) -> Tensor
//                                                         a peer's buffer mapped here (closed when
//                                                         the last reference dies)
//
// CPU semantics: the same algorithms run on host addresses (buffers in POSIX shared memory mapped by
// every rank: pyfused.comm.symmetric's "host-shm" backend, used by tests). "Blocks" run one after
// another in block order on every rank, and the barriers are release stores / acquire loads on the
// shared pads, so a block that read rows written by a different block of a peer would read them
// before they were written: the CPU model checks the row -> block assignment of the GPU kernel. A
// barrier that is not met within timeout_ms raises (it never hangs).
//
// The IPC ops are host-side setup calls and have no Meta kernels (they are never traced).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

#include "allreduce.h"

namespace pyfused {

using namespace symm;

static void check_ptr_table(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D int64 tensor of addresses, got ", t.scalar_type(), " ",
              t.sizes());
  if (auto n = t.sym_size(0).maybe_as_int()) {
    TORCH_CHECK(*n >= 1 && *n <= kMaxWorld, op, ": ", name, " must hold 1 to ", kMaxWorld,
                " addresses (one per rank), got ", *n);
  }
}

static void check_epoch(int64_t epoch, int64_t timeout_ms, const char* op) {
  TORCH_CHECK(epoch >= 1 && epoch <= std::numeric_limits<int32_t>::max(), op,
              ": epoch must be in [1, 2^31), got ", epoch);
  TORCH_CHECK(timeout_ms >= 0, op, ": timeout_ms must be >= 0 (0: wait forever), got ", timeout_ms);
}

void check_barrier_args(const at::Tensor& pad_ptrs, int64_t rank, int64_t channel, int64_t block,
                        int64_t epoch, int64_t timeout_ms) {
  const char* op = "pyfused::symm_barrier";
  check_ptr_table(pad_ptrs, "pad_ptrs", op);
  TORCH_CHECK(rank >= 0 && rank < pad_ptrs.size(0), op, ": rank ", rank, " is not in [0, ",
              pad_ptrs.size(0), ")");
  TORCH_CHECK(channel >= 0 && channel < kChannels, op, ": channel must be in [0, ", kChannels,
              "), got ", channel);
  TORCH_CHECK(block >= 0 && block < kMaxBlocks, op, ": block must be in [0, ", kMaxBlocks, "), got ",
              block);
  check_epoch(epoch, timeout_ms, op);
}

static void check_rows_like(const at::Tensor& t, const at::Tensor& out, const char* name) {
  TORCH_CHECK(t.sizes() == out.sizes() && t.scalar_type() == out.scalar_type() &&
                  t.device() == out.device() && t.is_contiguous(),
              "pyfused::all_reduce_rows: ", name, " must be a contiguous ", out.scalar_type(), " ",
              out.sizes(), " tensor on ", out.device(), ", got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device(), " (contiguous=", t.is_contiguous(), ")");
}

void check_all_reduce_args(const at::Tensor& buffer_ptrs, const at::Tensor& pad_ptrs,
                           const at::Tensor& out, const std::optional<at::Tensor>& residual,
                           const std::optional<at::Tensor>& residual_out,
                           const std::optional<at::Tensor>& weight, int64_t rank, int64_t epoch,
                           int64_t algo, int64_t timeout_ms, int64_t max_blocks) {
  const char* op = "pyfused::all_reduce_rows";
  TORCH_CHECK(max_blocks >= 1, op, ": max_blocks must be >= 1, got ", max_blocks);
  check_ptr_table(buffer_ptrs, "buffer_ptrs", op);
  check_ptr_table(pad_ptrs, "pad_ptrs", op);
  TORCH_CHECK(buffer_ptrs.sym_sizes() == pad_ptrs.sym_sizes(), op,
              ": buffer_ptrs and pad_ptrs must have one entry per rank each");
  TORCH_CHECK(buffer_ptrs.device() == out.device() && pad_ptrs.device() == out.device(), op,
              ": the address tables must be on out's device ", out.device());
  TORCH_CHECK(rank >= 0 && rank < buffer_ptrs.size(0), op, ": rank ", rank, " is not in [0, ",
              buffer_ptrs.size(0), ")");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), op, ": out must be a contiguous 2-D tensor, got ",
              out.sizes());
  const auto dt = out.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
              ": out must be float32, float16 or bfloat16, got ", dt);
  if (residual) check_rows_like(*residual, out, "residual");
  if (residual_out) check_rows_like(*residual_out, out, "residual_out");
  if (weight) {
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->dim() == 1 &&
                    weight->sym_size(0) == out.sym_size(1) && weight->is_contiguous() &&
                    weight->device() == out.device(),
                op, ": weight must be a contiguous float32 [", out.sym_size(1), "] tensor on ",
                out.device(), ", got ", weight->scalar_type(), " ", weight->sizes());
  }
  TORCH_CHECK(algo == kOneShot || algo == kTwoShot, op, ": algo must be 0 (one-shot) or 1 (two-shot), got ",
              algo);
  check_epoch(epoch, timeout_ms, op);
}

namespace {

// ---------------------------------------------------------------------------------------------
// CPU model

void barrier_host(const int64_t* pads, int rank, int world, int channel, int block, int32_t epoch,
                  int64_t timeout_ms) {
  for (int q = 0; q < world; ++q) {
    int32_t* slot = reinterpret_cast<int32_t*>(pads[q]) + barrier_slot(channel, block, rank);
    __atomic_store_n(slot, epoch, __ATOMIC_RELEASE);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int q = 0; q < world; ++q) {
    const int32_t* mine = reinterpret_cast<const int32_t*>(pads[rank]) + barrier_slot(channel, block, q);
    int32_t seen;
    while ((seen = __atomic_load_n(mine, __ATOMIC_ACQUIRE)) < epoch) {
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::steady_clock::now() - start).count();
      TORCH_CHECK(timeout_ms == 0 || waited < timeout_ms, "pyfused symmetric-memory barrier (CPU): rank ",
                  rank, " waited ", waited, " ms for rank ", q, " at channel ", channel, " block ",
                  block, ": its slot holds ", seen, ", expected >= ", epoch,
                  ". A peer did not reach the barrier (it skipped the call, or its epochs differ).");
      std::this_thread::yield();
    }
  }
}

// dst[row] = round(sum_p src_p[row] (+ residual[row])), sources in rank order.
template <typename T>
void sum_row_host(const int64_t* bufs, int world, int64_t row, int64_t cols, const T* residual,
                  T* dst) {
  for (int64_t j = 0; j < cols; ++j) {
    float acc = 0.f;
    for (int p = 0; p < world; ++p) acc += static_cast<float>(reinterpret_cast<const T*>(bufs[p])[row * cols + j]);
    if (residual) acc += static_cast<float>(residual[row * cols + j]);
    dst[row * cols + j] = static_cast<T>(acc);
  }
}

// From the rounded row h: residual_out = h (if given), out = rmsnorm(h) * weight or h. out may be h.
template <typename T>
void finish_row_host(const T* h, int64_t cols, T* out, T* residual_out, const float* weight, float eps) {
  if (residual_out && residual_out != h) std::memcpy(residual_out, h, cols * sizeof(T));
  if (!weight) {
    if (out != h) std::memcpy(out, h, cols * sizeof(T));
    return;
  }
  float ss = 0.f;
  for (int64_t j = 0; j < cols; ++j) {
    const float v = static_cast<float>(h[j]);
    ss += v * v;
  }
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(cols) + eps);
  for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<T>(static_cast<float>(h[j]) * rstd * weight[j]);
}

template <typename T>
void all_reduce_rows_host(const int64_t* bufs, const int64_t* pads, T* out, const T* residual,
                          T* residual_out, const float* weight, float eps, int64_t rows, int64_t cols,
                          int rank, int world, int32_t epoch, int algo, int64_t timeout_ms,
                          int max_blocks) {
  const int grid = launch_blocks(rows, world, algo, max_blocks);
  for (int b = 0; b < grid; ++b) {
    barrier_host(pads, rank, world, kChanStart, b, epoch, timeout_ms);
    if (algo == kOneShot) {
      T* hdst = residual_out ? residual_out : out;
      for (int64_t row = b; row < rows; row += grid) {
        sum_row_host<T>(bufs, world, row, cols, residual, hdst);
        finish_row_host<T>(hdst + row * cols, cols, out + row * cols, nullptr, weight, eps);
      }
    } else {
      T* mine = reinterpret_cast<T*>(bufs[rank]);
      for (int64_t row = seg_begin(rows, world, rank) + b; row < seg_begin(rows, world, rank + 1); row += grid) {
        sum_row_host<T>(bufs, world, row, cols, residual, mine);
      }
      barrier_host(pads, rank, world, kChanMid, b, epoch, timeout_ms);
      for (int s = 0; s < world; ++s) {
        const T* owner = reinterpret_cast<const T*>(bufs[s]);
        for (int64_t row = seg_begin(rows, world, s) + b; row < seg_begin(rows, world, s + 1); row += grid) {
          finish_row_host<T>(owner + row * cols, cols, out + row * cols,
                          residual_out ? residual_out + row * cols : nullptr, weight, eps);
        }
      }
    }
    barrier_host(pads, rank, world, kChanEnd, b, epoch, timeout_ms);
  }
}

void all_reduce_rows_cpu(const at::Tensor& buffer_ptrs, const at::Tensor& pad_ptrs, const at::Tensor& out,
                         const std::optional<at::Tensor>& residual,
                         const std::optional<at::Tensor>& residual_out,
                         const std::optional<at::Tensor>& weight, double eps, int64_t rank,
                         int64_t epoch, int64_t algo, int64_t timeout_ms, int64_t max_blocks) {
  check_all_reduce_args(buffer_ptrs, pad_ptrs, out, residual, residual_out, weight, rank, epoch, algo,
                        timeout_ms, max_blocks);
  const int world = static_cast<int>(buffer_ptrs.size(0));
  dispatch_float_types(out.scalar_type(), "pyfused::all_reduce_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    all_reduce_rows_host<scalar_t>(
        buffer_ptrs.const_data_ptr<int64_t>(), pad_ptrs.const_data_ptr<int64_t>(),
        out.mutable_data_ptr<scalar_t>(), residual ? residual->const_data_ptr<scalar_t>() : nullptr,
        residual_out ? residual_out->mutable_data_ptr<scalar_t>() : nullptr,
        weight ? weight->const_data_ptr<float>() : nullptr, static_cast<float>(eps), out.size(0),
        out.size(1), static_cast<int>(rank), world, static_cast<int32_t>(epoch), static_cast<int>(algo),
        timeout_ms, static_cast<int>(std::min<int64_t>(max_blocks, kMaxBlocks)));
  });
}

void symm_barrier_cpu(const at::Tensor& pad_ptrs, int64_t rank, int64_t channel, int64_t block,
                      int64_t epoch, int64_t timeout_ms) {
  check_barrier_args(pad_ptrs, rank, channel, block, epoch, timeout_ms);
  barrier_host(pad_ptrs.const_data_ptr<int64_t>(), static_cast<int>(rank), static_cast<int>(pad_ptrs.size(0)),
               static_cast<int>(channel), static_cast<int>(block), static_cast<int32_t>(epoch), timeout_ms);
}

void all_reduce_rows_meta(const at::Tensor& buffer_ptrs, const at::Tensor& pad_ptrs, const at::Tensor& out,
                          const std::optional<at::Tensor>& residual,
                          const std::optional<at::Tensor>& residual_out,
                          const std::optional<at::Tensor>& weight, double eps, int64_t rank,
                          int64_t epoch, int64_t algo, int64_t timeout_ms, int64_t max_blocks) {
  check_all_reduce_args(buffer_ptrs, pad_ptrs, out, residual, residual_out, weight, rank, epoch, algo,
                        timeout_ms, max_blocks);
}

void symm_barrier_meta(const at::Tensor& pad_ptrs, int64_t rank, int64_t channel, int64_t block,
                       int64_t epoch, int64_t timeout_ms) {
  check_barrier_args(pad_ptrs, rank, channel, block, epoch, timeout_ms);
}

std::vector<int64_t> symm_layout() {
  return {kMaxWorld, kMaxBlocks, kChannels, kPadInts, kFlagOffset, kMaxFlags,
          kChanStart, kChanMid, kChanEnd, kChanEntry, kChanSync};
}

// ---------------------------------------------------------------------------------------------
// CUDA IPC: buffers of our own (cudaMalloc, so that a handle covers exactly the buffer: the caching
// allocator's blocks are sub-ranges of larger segments) and peers' buffers mapped into this process.

std::mutex g_ipc_mutex;
std::unordered_set<void*> g_ipc_allocs;

void require_device(int64_t device, const char* op) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) (void)cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess && count > 0, op, " needs a CUDA device, but none is usable here (",
              cudaGetErrorString(err), ")");
  TORCH_CHECK(device >= 0 && device < count, op, ": device ", device, " is not in [0, ", count, ")");
}

at::Tensor ipc_alloc(int64_t nbytes, int64_t device) {
  TORCH_CHECK(nbytes > 0, "pyfused::ipc_alloc: nbytes must be > 0, got ", nbytes);
  require_device(device, "pyfused::ipc_alloc");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(nbytes)));
  // Zeroed before any peer can map it (the pad's slots must start below every epoch).
  cudaError_t err = cudaMemset(ptr, 0, static_cast<size_t>(nbytes));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(ptr);
    C10_CUDA_CHECK(err);
  }
  {
    std::lock_guard<std::mutex> lock(g_ipc_mutex);
    g_ipc_allocs.insert(ptr);
  }
  auto deleter = [device](void* p) {
    {
      std::lock_guard<std::mutex> lock(g_ipc_mutex);
      g_ipc_allocs.erase(p);
    }
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
    (void)cudaFree(p);  // may fail at interpreter shutdown once the driver is gone; nothing to do then
  };
  return at::from_blob(ptr, {nbytes}, deleter,
                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

at::Tensor ipc_handle(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_cuda() && buffer.scalar_type() == at::kByte,
              "pyfused::ipc_handle: buffer must be a uint8 CUDA tensor from pyfused::ipc_alloc");
  void* ptr = buffer.data_ptr();
  {
    std::lock_guard<std::mutex> lock(g_ipc_mutex);
    TORCH_CHECK(g_ipc_allocs.count(ptr) == 1,
                "pyfused::ipc_handle: the buffer must start an allocation of pyfused::ipc_alloc (a "
                "handle covers a whole cudaMalloc allocation; a view or a caching-allocator block "
                "would map the wrong bytes)");
  }
  c10::cuda::CUDAGuard guard(buffer.device());
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, ptr));
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(handle))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.mutable_data_ptr(), &handle, sizeof(handle));
  return out;
}

at::Tensor ipc_open(const at::Tensor& handle, int64_t nbytes, int64_t device) {
  TORCH_CHECK(!handle.is_cuda() && handle.scalar_type() == at::kByte &&
                  handle.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)) && handle.is_contiguous(),
              "pyfused::ipc_open: handle must be the CPU uint8 [", sizeof(cudaIpcMemHandle_t),
              "] tensor pyfused::ipc_handle returned");
  TORCH_CHECK(nbytes > 0, "pyfused::ipc_open: nbytes must be > 0, got ", nbytes);
  require_device(device, "pyfused::ipc_open");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.const_data_ptr(), sizeof(h));
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) (void)cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "pyfused::ipc_open: cudaIpcOpenMemHandle failed: ", cudaGetErrorString(err),
              ". (A process cannot open a handle it exported itself; the exporter must still hold "
              "the buffer; both processes must see the device.)");
  auto deleter = [device](void* p) {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
    (void)cudaIpcCloseMemHandle(p);
  };
  return at::from_blob(ptr, {nbytes}, deleter,
                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

}  // namespace
}  // namespace pyfused

TORCH_LIBRARY_FRAGMENT(pyfused, m) {
  m.def(
      "all_reduce_rows(Tensor buffer_ptrs, Tensor pad_ptrs, Tensor(a!) out, Tensor? residual, "
      "Tensor(b!)? residual_out, Tensor? weight, float eps, int rank, int epoch, int algo, "
      "int timeout_ms=60000, int max_blocks=64) -> ()");
  m.def("symm_barrier(Tensor pad_ptrs, int rank, int channel, int block, int epoch, "
        "int timeout_ms=60000) -> ()");
  // Host-side helpers: one kernel for every dispatch key (they take no tensor or a CPU handle).
  m.def("symm_layout() -> int[]", &pyfused::symm_layout);
  m.def("ipc_alloc(int nbytes, int device) -> Tensor", &pyfused::ipc_alloc);
  m.def("ipc_handle(Tensor buffer) -> Tensor", &pyfused::ipc_handle);
  m.def("ipc_open(Tensor handle, int nbytes, int device) -> Tensor", &pyfused::ipc_open);
}

TORCH_LIBRARY_IMPL(pyfused, CPU, m) {
  m.impl("all_reduce_rows", &pyfused::all_reduce_rows_cpu);
  m.impl("symm_barrier", &pyfused::symm_barrier_cpu);
}

TORCH_LIBRARY_IMPL(pyfused, Meta, m) {
  m.impl("all_reduce_rows", &pyfused::all_reduce_rows_meta);
  m.impl("symm_barrier", &pyfused::symm_barrier_meta);
}
