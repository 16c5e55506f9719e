// System-scope memory-ordering primitives shared by the signal-flag and all-reduce kernels.
//
// Generic addressing (no .global): the word may live in device memory, peer-mapped memory (IPC /
// symmetric memory) or host-mapped pinned memory. A release store makes every write the thread did
// before it visible to whoever reads the stored value with an acquire load; .sys scope covers peer
// GPUs and the host.
#pragma once

#include <cstdint>

namespace pyfused_ptx {

__device__ __forceinline__ void st_release_sys(int32_t* addr, int32_t value) {
  asm volatile("st.release.sys.s32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* addr) {
  int32_t value;
  asm volatile("ld.acquire.sys.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

// Nanoseconds from the GPU's global timer: bounds spin-waits so a missing signal fails, not hangs.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace pyfused_ptx
