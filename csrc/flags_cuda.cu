// CUDA kernels of the stream-ordered signal flags (schemas and CPU/Meta kernels: flags.cpp).
//
// Memory-ordering contract. A producer stream P publishes a buffer to a consumer stream C (same
// GPU, a peer GPU reading P's memory over NVLink/PCIe, or another process mapping it through IPC
// or symmetric memory) with one int32 flag that both can address:
//
//   P: ... kernels writing `data` ...;  signal_flag(flags, i, e)
//   C: wait_flag(flags, i, e);  ... kernels reading `data` ...
//
// 1. signal_flag's kernel starts only after every earlier kernel and copy on P has completed
//    (stream order), so their writes to `data` are complete. Its single thread issues
//    fence.sc.sys (__threadfence_system), which orders all writes it has observed -- the earlier
//    kernels' writes included -- before its later writes, for every observer in the system; then
//    st.release.sys stores e into flags[i].
// 2. wait_flag's kernel spins with ld.acquire.sys until it reads a value >= e. That acquire
//    synchronizes with the release of step 1, so everything P wrote before the flag happens-before
//    the end of the spin. A trailing fence.sc.sys extends this to the work C launches next, which
//    the stream starts only after the wait kernel has completed.
// 3. Hence kernels enqueued on C after wait_flag see `data` as P wrote it. System scope (.sys) is
//    what makes this hold across GPUs and with the host; .gpu would only cover one device.
//
// Epochs instead of resets: a flag only grows. Step k of a schedule signals e = base + k and
// waits for >= base + k, so nothing has to clear a flag between uses (a clear racing with a late
// wait is the classic lost-wakeup). Reset flags (flags.zero_()) only when no signal or wait on them
// can be in flight, e.g. after a barrier; epochs must stay below 2^31.
//
// Caveats. The wait occupies one thread of one SM while it spins. It deadlocks if the signal can
// only run after the wait: the same stream, or a stream made to wait on an event recorded after
// the wait. The timeout turns that into an error: after timeout_ms the kernel prints the flag and
// executes trap; the CUDA context is then unusable and the next synchronizing call raises
// (cudaErrorLaunchFailure), so the process fails loudly instead of hanging forever.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>

#include "flags.h"
#include "ptx_sync.cuh"

namespace pyfused {
namespace {

using pyfused_ptx::globaltimer_ns;
using pyfused_ptx::ld_acquire_sys;
using pyfused_ptx::st_release_sys;

__global__ void signal_flag_kernel(int32_t* flag, int32_t value) {
  __threadfence_system();  // step 1: earlier writes before the flag, system-wide
  st_release_sys(flag, value);
}

__global__ void wait_flag_kernel(const int32_t* flag, int32_t value, uint64_t timeout_ns,
                                 int64_t index) {
  const uint64_t start = globaltimer_ns();
  int32_t seen;
  while ((seen = ld_acquire_sys(flag)) < value) {
    if (timeout_ns != 0 && globaltimer_ns() - start > timeout_ns) {
      printf("pyfused::wait_flag timed out after %llu ms: flags[%lld] is %d, waiting for >= %d. "
             "Is the signal ordered after this wait (same stream, or an event recorded after "
             "it)? Trapping: the CUDA context is lost.\n",
             static_cast<unsigned long long>(timeout_ns / 1000000), static_cast<long long>(index),
             seen, value);
      __trap();
    }
    __nanosleep(32);  // spinning harder only adds traffic on the (possibly remote) flag
  }
  __threadfence_system();  // step 2: order the work launched after this kernel
}

void signal_flag_cuda(const at::Tensor& flags, int64_t index, int64_t value) {
  check_flag_args(flags, index, value, "pyfused::signal_flag");
  c10::cuda::CUDAGuard guard(flags.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flags.device().index()).stream();
  int32_t* flag = flags.mutable_data_ptr<int32_t>() + flag_offset(flags, index);
  signal_flag_kernel<<<1, 1, 0, stream>>>(flag, static_cast<int32_t>(value));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void wait_flag_cuda(const at::Tensor& flags, int64_t index, int64_t value, int64_t timeout_ms) {
  check_flag_args(flags, index, value, "pyfused::wait_flag");
  check_timeout(timeout_ms);
  c10::cuda::CUDAGuard guard(flags.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flags.device().index()).stream();
  const int32_t* flag = flags.const_data_ptr<int32_t>() + flag_offset(flags, index);
  wait_flag_kernel<<<1, 1, 0, stream>>>(flag, static_cast<int32_t>(value),
                                        static_cast<uint64_t>(timeout_ms) * 1000000ull, index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace pyfused

TORCH_LIBRARY_IMPL(pyfused, CUDA, m) {
  m.impl("signal_flag", &pyfused::signal_flag_cuda);
  m.impl("wait_flag", &pyfused::wait_flag_cuda);
}
