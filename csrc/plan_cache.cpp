// The plan cache: the steady-state lookup of an op call, in C++ because it runs on every call.
//
// An op call that was validated across ranks once (pyfused/comm/validate.py) is remembered with
// its plan (the group, the agreed method, how to run it). A later call with the same op, group,
// method, scalar arguments and tensor metadata finds that plan here with one call from Python:
// the key is built from the tensors' C++ metadata, with no Python attribute access and no
// Python-level hashing. Written in Python the same lookup costs several microseconds per call,
// more than a latency-bound op's own work on a CPU.
//
// What a key holds, per call: the op's code, the group (by identity; None resolves to
// torch.distributed.group.WORLD at each call, so a re-initialised default group is a new key),
// the method name (by value), whether grad mode is on, then per argument
//   * a tensor: its dims, sizes, dtype, layout, device type and index, and requires_grad;
//     only plain tensors and Parameters (a subclass such as DTensor may mean other semantics),
//   * an int, a bool or a float: its type and value (a float by its bits; -0.0 != 0.0),
//   * None;
// anything else makes the call uncacheable (a lookup misses, a store does nothing).
//
// The cache only accelerates the Python-side record of validated calls: every key it holds was
// stored after that record accepted the call, so a hit here is always a hit there. It may therefore
// drop entries freely (it clears itself when full); pyfused clears it whenever the record is
// cleared or the validation mode changes.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace pyfused {
namespace {

constexpr size_t kMaxEntries = 4096;

struct Key {
  PyObject* group;  // borrowed in lookups; the map's own copy holds a reference
  std::vector<int64_t> words;

  bool operator==(const Key& other) const {
    return group == other.group && words == other.words;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t h = reinterpret_cast<uintptr_t>(key.group) * 0x9E3779B97F4A7C15ull;
    for (int64_t w : key.words) {
      h ^= static_cast<uint64_t>(w) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

std::unordered_map<Key, PyObject*, KeyHash>& table() {
  static auto* entries = new std::unordered_map<Key, PyObject*, KeyHash>();  // never destroyed
  return *entries;
}

// Where group=None is resolved from (torch.distributed.group); set by configure().
PyObject* g_world_holder = nullptr;

const char* const kMethods[] = {"auto", "unfused", "decomposed", "fused"};

// The method's code, or -1 for anything that is not one of the method names.
int64_t method_code(PyObject* method) {
  if (!PyUnicode_Check(method)) {
    return -1;
  }
  for (int64_t i = 0; i < 4; ++i) {
    if (PyUnicode_CompareWithASCIIString(method, kMethods[i]) == 0) {
      return i;
    }
  }
  return -1;
}

enum Tag : int64_t { kNone = 1, kInt, kBool, kFloat, kTensor };

// Appends one argument's words; false when the argument makes the call uncacheable.
bool add_argument(PyObject* arg, std::vector<int64_t>& words) {
  if (arg == Py_None) {
    words.push_back(kNone);
    return true;
  }
  if (THPVariable_CheckExact(arg)) {
    const at::Tensor& t = THPVariable_Unpack(arg);
    const auto sizes = t.sizes();
    const auto device = t.device();
    words.push_back(kTensor);
    words.push_back(static_cast<int64_t>(sizes.size()));
    words.insert(words.end(), sizes.begin(), sizes.end());
    words.push_back(static_cast<int64_t>(t.scalar_type()) |
                    static_cast<int64_t>(t.layout()) << 8 |
                    static_cast<int64_t>(device.type()) << 16 |
                    (static_cast<int64_t>(device.index()) + 1) << 24 |
                    static_cast<int64_t>(t.requires_grad()) << 40);
    return true;
  }
  if (PyBool_Check(arg)) {
    words.push_back(kBool);
    words.push_back(arg == Py_True);
    return true;
  }
  if (PyLong_CheckExact(arg)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    words.push_back(kInt);
    words.push_back(value);
    return true;
  }
  if (PyFloat_CheckExact(arg)) {
    const double value = PyFloat_AS_DOUBLE(arg);
    int64_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    words.push_back(kFloat);
    words.push_back(bits);
    return true;
  }
  return false;
}

// The key of the call being looked up or stored: one object reused by every call (the GIL
// serialises them), so that a lookup allocates nothing once its words have grown to size.
Key& scratch_key() {
  static auto* key = new Key{nullptr, {}};  // never destroyed
  return *key;
}

// Builds the key of (op, group, method, *arguments); false when the call is uncacheable or an
// error is set (only if resolving group=None raised).
bool make_key(PyObject* const* args, Py_ssize_t nargs, Key& key) {
  key.words.clear();
  if (nargs < 3 || !PyLong_CheckExact(args[0])) {
    return false;
  }
  const int64_t method = method_code(args[2]);
  if (method < 0) {
    return false;
  }
  PyObject* group = args[1];
  PyObject* resolved = nullptr;  // a new reference while group=None is resolved
  if (group == Py_None && g_world_holder != nullptr) {
    resolved = PyObject_GetAttrString(g_world_holder, "WORLD");
    if (resolved == nullptr) {
      return false;
    }
    group = resolved;
  }
  key.group = group;
  Py_XDECREF(resolved);  // the default group stays referenced by torch.distributed while it lives
  key.words.push_back(PyLong_AsLongLong(args[0]));
  key.words.push_back(method);
  key.words.push_back(at::GradMode::is_enabled());
  for (Py_ssize_t i = 3; i < nargs; ++i) {
    if (!add_argument(args[i], key.words)) {
      return false;
    }
  }
  return !PyErr_Occurred();
}

// plan_lookup(op_code, group, method, *arguments) -> the stored plan, or None.
PyObject* plan_lookup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Key& key = scratch_key();
  if (!make_key(args, nargs, key)) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  auto& entries = table();
  const auto hit = entries.find(key);
  if (hit == entries.end()) {
    Py_RETURN_NONE;
  }
  Py_INCREF(hit->second);
  return hit->second;
}

// plan_store(plan, op_code, group, method, *arguments) -> whether the call could be stored.
PyObject* plan_store(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "plan_store(plan, op_code, group, method, *arguments)");
    return nullptr;
  }
  Key& key = scratch_key();
  if (!make_key(args + 1, nargs - 1, key)) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_FALSE;
  }
  auto& entries = table();
  if (entries.size() >= kMaxEntries) {  // many distinct shapes: start over rather than grow
    for (auto& entry : entries) {
      Py_DECREF(entry.first.group);
      Py_DECREF(entry.second);
    }
    entries.clear();
  }
  PyObject* plan = args[0];
  const auto found = entries.find(key);
  if (found != entries.end()) {
    Py_INCREF(plan);
    Py_DECREF(found->second);
    found->second = plan;
    Py_RETURN_TRUE;
  }
  Py_INCREF(key.group);
  Py_INCREF(plan);
  entries.emplace(key, plan);  // a copy: the scratch key is reused
  Py_RETURN_TRUE;
}

PyObject* plan_clear(PyObject*, PyObject*) {
  auto& entries = table();
  for (auto& entry : entries) {
    Py_DECREF(entry.first.group);
    Py_DECREF(entry.second);
  }
  entries.clear();
  Py_RETURN_NONE;
}

PyObject* plan_count(PyObject*, PyObject*) {
  return PyLong_FromSize_t(table().size());
}

// plan_configure(world_holder): group=None resolves to world_holder.WORLD
// (torch.distributed.group); None: group=None stays None (torch.distributed unavailable).
PyObject* plan_configure(PyObject*, PyObject* holder) {
  Py_XDECREF(g_world_holder);
  g_world_holder = holder == Py_None ? nullptr : holder;
  Py_XINCREF(g_world_holder);
  Py_RETURN_NONE;
}

PyMethodDef kMethodsTable[] = {
    {"plan_lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_lookup)),
     METH_FASTCALL, "plan_lookup(op_code, group, method, *arguments) -> plan or None"},
    {"plan_store", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_store)),
     METH_FASTCALL, "plan_store(plan, op_code, group, method, *arguments) -> bool"},
    {"plan_clear", plan_clear, METH_NOARGS, "plan_clear() -> None"},
    {"plan_count", plan_count, METH_NOARGS, "plan_count() -> int"},
    {"plan_configure", plan_configure, METH_O, "plan_configure(torch.distributed.group or None)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

int add_plan_cache_functions(PyObject* module) {
  return PyModule_AddFunctions(module, kMethodsTable);
}

}  // namespace pyfused
