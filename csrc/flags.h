// Stream-ordered signal flags: shared declarations of csrc/flags.cpp and csrc/flags_cuda.cu.
//
// A flag array is a 1-D int32 tensor; flags[i] holds an epoch. A producer publishes data with
// signal_flag(flags, i, e) (flags[i] = e, ordered after the producer stream's earlier work); a
// consumer orders its stream after that publication with wait_flag(flags, i, e) (its stream goes
// on once flags[i] >= e). The full memory-ordering contract is in csrc/flags_cuda.cu and
// pyfused/comm/flags.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pyfused {

// Checks shared by every backend (CPU, CUDA, Meta): flags is a 1-D int32 tensor, index is inside
// it (when its size is known: with symbolic sizes under torch.compile the kernel checks it later),
// value and timeout_ms fit the kernels' types. Raises c10::Error (RuntimeError in Python).
void check_flag_args(const at::Tensor& flags, int64_t index, int64_t value, const char* op);
void check_timeout(int64_t timeout_ms);

// Address of flags[index] (strided: a non-contiguous 1-D view is fine).
inline int64_t flag_offset(const at::Tensor& flags, int64_t index) {
  return index * flags.stride(0);
}

}  // namespace pyfused
