// pyfused._C: the Python module, the op schemas, and the CPU and Meta kernels of the signal flags.
// The CUDA kernels are in flags_cuda.cu.
//
// Schemas (namespace pyfused; Python's torch.library.custom_op defines other ops in the same
// namespace, hence TORCH_LIBRARY_FRAGMENT and not TORCH_LIBRARY):
//
//   signal_flag(Tensor(a!) flags, int index, int value) -> ()
//       flags[index] = value, ordered after all work enqueued earlier on the current stream of
//       flags' device, with release semantics at system scope (peers and the host see the data
//       written before the flag no later than the flag).
//   wait_flag(Tensor flags, int index, int value, int timeout_ms=60000) -> ()
//       Work enqueued later on the current stream starts only once flags[index] >= value.
//       CUDA: a one-thread kernel spins with acquire loads; past timeout_ms (0: never) it prints
//       the flag and traps, which makes the CUDA context fail loudly instead of hanging.
//
// CPU semantics (same schema, so CPU tests exercise the op as registered):
//   signal_flag is a plain release store, done when the call returns.
//   wait_flag cannot block: on CPU no stream runs beside the caller that could ever set the flag,
//   so a wait on a flag still below value would hang forever. It checks the flag and raises a
//   RuntimeError naming the flag, what it holds and what was awaited; it returns at once if the
//   flag is already >= value.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <limits>

#include "flags.h"

namespace pyfused {

void check_flag_args(const at::Tensor& flags, int64_t index, int64_t value, const char* op) {
  TORCH_CHECK(flags.scalar_type() == at::kInt, op, ": flags must be an int32 tensor, got ",
              flags.scalar_type());
  TORCH_CHECK(flags.dim() == 1, op, ": flags must be 1-D, got ", flags.dim(), " dims");
  TORCH_CHECK(index >= 0, op, ": index must be >= 0, got ", index);
  if (auto size = flags.sym_size(0).maybe_as_int()) {
    TORCH_CHECK(index < *size, op, ": index ", index, " is out of range for ", *size, " flags");
  }
  TORCH_CHECK(value >= std::numeric_limits<int32_t>::min() &&
                  value <= std::numeric_limits<int32_t>::max(),
              op, ": value ", value, " does not fit the int32 flag");
}

void check_timeout(int64_t timeout_ms) {
  TORCH_CHECK(timeout_ms >= 0, "pyfused::wait_flag: timeout_ms must be >= 0 (0: wait forever), got ",
              timeout_ms);
}

namespace {

void signal_flag_cpu(const at::Tensor& flags, int64_t index, int64_t value) {
  check_flag_args(flags, index, value, "pyfused::signal_flag");
  int32_t* flag = flags.mutable_data_ptr<int32_t>() + flag_offset(flags, index);
  __atomic_store_n(flag, static_cast<int32_t>(value), __ATOMIC_RELEASE);
}

void wait_flag_cpu(const at::Tensor& flags, int64_t index, int64_t value, int64_t timeout_ms) {
  check_flag_args(flags, index, value, "pyfused::wait_flag");
  check_timeout(timeout_ms);
  const int32_t* flag = flags.const_data_ptr<int32_t>() + flag_offset(flags, index);
  const int32_t seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
  TORCH_CHECK(seen >= value, "pyfused::wait_flag on CPU: flags[", index, "] is ", seen,
              ", below the awaited ", value,
              ". A CPU wait cannot block: no stream runs beside the caller that could set the "
              "flag, so it would never return. Signal the flag before waiting on it, or use CUDA "
              "tensors to order two streams.");
}

// Meta (and FakeTensor) kernels: the ops return nothing and change no shape; they only check.
void signal_flag_meta(const at::Tensor& flags, int64_t index, int64_t value) {
  check_flag_args(flags, index, value, "pyfused::signal_flag");
}

void wait_flag_meta(const at::Tensor& flags, int64_t index, int64_t value, int64_t timeout_ms) {
  check_flag_args(flags, index, value, "pyfused::wait_flag");
  check_timeout(timeout_ms);
}

}  // namespace
}  // namespace pyfused

TORCH_LIBRARY_FRAGMENT(pyfused, m) {
  m.def("signal_flag(Tensor(a!) flags, int index, int value) -> ()");
  m.def("wait_flag(Tensor flags, int index, int value, int timeout_ms=60000) -> ()");
}

TORCH_LIBRARY_IMPL(pyfused, CPU, m) {
  m.impl("signal_flag", &pyfused::signal_flag_cpu);
  m.impl("wait_flag", &pyfused::wait_flag_cpu);
}

TORCH_LIBRARY_IMPL(pyfused, Meta, m) {
  m.impl("signal_flag", &pyfused::signal_flag_meta);
  m.impl("wait_flag", &pyfused::wait_flag_meta);
}

namespace pyfused {
int add_plan_cache_functions(PyObject* module);  // csrc/plan_cache.cpp
}  // namespace pyfused

// The extension module: importing it runs the registrations above; its only Python functions are
// the plan cache's (csrc/plan_cache.cpp). No pybind11, so the files compile quickly.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "pyfused._C",
      "pyfused CUDA extension: registers torch.ops.pyfused.signal_flag and wait_flag, and holds "
      "the plan cache of the ops' steady-state calls.",
      -1,
      nullptr,
  };
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && pyfused::add_plan_cache_functions(module) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
