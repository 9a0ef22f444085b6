// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the `blockkv` Python module (the pybind11 extension `blockkv._blockkv`): how a
// Status becomes a Python exception, how Python arguments become C++ values, and the Bind*
// functions each component file provides.
//
// Errors (docs/python.md): kInvalidArgument, kOutOfRange, kFailedPrecondition, kNotFound and
// kAlreadyExists raise ValueError; kResourceExhausted raises blockkv.ResourceExhaustedError, a
// subclass of both ValueError (DeepSpeed's type for running out of blocks) and RuntimeError
// (DeepSpeed's type for a full ragged batch or no tracking slot); kUnimplemented raises
// NotImplementedError; anything else RuntimeError. The message is the C++ one.
//
// GIL: a Python exception may only be raised with the GIL held, so code that releases it keeps
// the Status and throws after reacquiring (see CallWithoutGil).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/config.h"
#include "blockkv/device.h"
#include "blockkv/dtype.h"
#include "blockkv/status.h"

namespace blockkv::python {

namespace py = pybind11;

// Raises the Python exception for `status`. REQUIRES: !status.ok(), the GIL is held.
[[noreturn]] void ThrowStatus(const Status& status);

// The Python exception `status` would raise, as an object (None for OK): for results that
// report several statuses at once. REQUIRES: the GIL is held.
py::object StatusException(const Status& status);

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

template <class T>
T ValueOrThrow(Result<T> result) {
  if (!result.ok()) ThrowStatus(result.status());
  return std::move(result).value();
}

// Raises the Python builtin `type` (PyExc_ValueError, ...) with `message`.
[[noreturn]] void Throw(PyObject* type, const std::string& message);

// An optional config field (StateManagerConfig.kv_events, .remote_tier): None, or an instance of
// the bound class T, copied. Anything else raises TypeError naming `field`, `type_name` and what
// was given.
template <class T>
std::optional<T> OptionalConfig(py::handle obj, const char* field, const char* type_name) {
  if (obj.is_none()) return std::nullopt;
  if (!py::isinstance<T>(obj)) {
    Throw(PyExc_TypeError, std::string(field) + " must be None or a " + type_name + ", got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  return obj.cast<T>();
}

// Runs `fn` (returning a Status) with the GIL released and raises its error once the GIL is back.
template <class Fn>
void CallWithoutGil(Fn&& fn) {
  Status status;
  {
    py::gil_scoped_release release;
    status = fn();
  }
  ThrowIfError(status);
}

// --- Integers -----------------------------------------------------------------------------------
//
// Every integer that crosses into C++ is checked against the C++ type it becomes, the same way
// whatever carried it: a Python int, any object with __index__ (a NumPy or torch integer
// scalar), and in the sequence forms below a list or tuple of those, a NumPy array of any integer
// dtype (uint64 included) or a torch tensor. A value outside the type is a ValueError naming it
// and the range ("uid 18446744073709551615 is outside int64 [-9223372036854775808,
// 9223372036854775807]", "block ids[1] = 4294967296 is outside int32 [...]"); a bool, a float or
// anything else not an integer is a TypeError. Conversion happens before any object's lock is
// taken, so a failure changes nothing.

// `obj` as T. REQUIRES: T is int32_t or int64_t.
template <class T>
T ToInt(py::handle obj, const char* what);
// An int, or a 0-/1-D sequence of ints: a list, a tuple, a NumPy array or a torch tensor (one on
// another device is copied to the host). More dimensions are a ValueError.
template <class T>
std::vector<T> ToInts(py::handle obj, const char* what);
extern template int32_t ToInt<int32_t>(py::handle, const char*);
extern template int64_t ToInt<int64_t>(py::handle, const char*);
extern template std::vector<int32_t> ToInts<int32_t>(py::handle, const char*);
extern template std::vector<int64_t> ToInts<int64_t>(py::handle, const char*);

inline std::vector<int64_t> ToInt64Vector(py::handle obj, const char* what) {
  return ToInts<int64_t>(obj, what);
}
inline std::vector<BlockId> ToBlockIds(py::handle obj) { return ToInts<BlockId>(obj, "block ids"); }
// `value` (already an int64) as an int32 named `what`: the same ValueError when it does not fit.
int32_t ToInt32(int64_t value, const char* what);

// The name of an argument, as a template argument: Int<int64_t, "uid">.
template <size_t N>
struct ArgName {
  // NOLINTNEXTLINE(google-explicit-constructor): built from a string literal in a template.
  constexpr ArgName(const char (&text)[N]) { std::copy_n(text, N, chars); }
  char chars[N] = {};
};

// An integer parameter of a bound function: pybind11 converts it with ToInt<T>(arg, kName), so
// an out-of-range value is the ValueError above, where pybind11's own int / int64_t conversion
// raises a TypeError that names neither the value nor the range. Not an integer at all: pybind11's
// TypeError listing the signature.
template <class T, ArgName kName>
struct Int {
  T value = 0;
  // NOLINTNEXTLINE(google-explicit-constructor): used as the T it holds.
  operator T() const { return value; }
};

// A torch dtype (torch.float16), a NumPy dtype, or one of ParseDType's strings (with or without
// a "torch." prefix). Unknown: ValueError.
DType ToDType(py::handle obj);
// The dtype as torch names it when torch can be imported and has it (torch.float16), else
// blockkv's short name ("fp16"); DeepSpeed's configs hand back torch dtypes.
py::object DTypeToPython(DType dtype);

// None: the current CUDA GPU when blockkv was built with CUDA and one is present (torch's current
// device when torch is imported, else GPU 0), else the host. "cpu"; "cuda" / "cuda:N" / an int N
// (kUnavailable without CUDA or GPU N: RuntimeError); a torch.device; a blockkv Device.
std::shared_ptr<Device> ToDevice(py::handle obj);
// A KVCacheConfig, or a sequence of them (DeepSpeed passes a tuple, one per cache group); anything
// else is a TypeError.
std::vector<KVCacheConfig> ToConfigs(py::handle obj);
// mp_group / base_mp_group: only None, since communicators are not bound.
void RequireNoGroup(py::handle group, const char* argument);

// A copy of `values` as a 1-D NumPy array.
template <class T>
py::array_t<T> ToNumpy(const std::vector<T>& values) {
  py::array_t<T> out(static_cast<py::ssize_t>(values.size()));
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

// --- Bindings, one per component file --------------------------------------------------------

void BindErrors(py::module_& m);        // errors.cc: ResourceExhaustedError
void BindTensor(py::module_& m);        // tensor.cc: Tensor (DLPack), _split_kv
void BindConfig(py::module_& m);        // config.cc: KVCacheConfig, PrefixCacheConfig, ...
void BindKVCache(py::module_& m);       // kv_cache.cc: Device, BlockedAllocator, BlockedKVCache,
                                        // OffloadTicket
void BindStateManager(py::module_& m);  // state_manager.cc (+ prefix_cache.cc)
void BindRaggedBatch(py::module_& m);   // ragged_batch.cc: RaggedBatchWrapper
void BindKernels(py::module_& m);       // kernels.cc: append_kv, paged_attention
void BindDeepSpeed(py::module_& m);     // deepspeed_state_manager.cc: _ds_* functions

}  // namespace blockkv::python

namespace pybind11::detail {

// Int<T, kName> from Python (see ToInt); back to Python as an int.
template <class T, blockkv::python::ArgName kName>
struct type_caster<blockkv::python::Int<T, kName>> {
  using Value = blockkv::python::Int<T, kName>;
  PYBIND11_TYPE_CASTER(Value, const_name("int"));

  bool load(handle src, bool /*convert*/) {
    // Not an integer: let pybind11 try the next overload, then raise its TypeError.
    if (PyBool_Check(src.ptr()) || (!PyLong_Check(src.ptr()) && !PyIndex_Check(src.ptr()))) {
      return false;
    }
    value.value = blockkv::python::ToInt<T>(src, kName.chars);  // ValueError when out of range
    return true;
  }
  static handle cast(const Value& src, return_value_policy /*policy*/, handle /*parent*/) {
    return PyLong_FromLongLong(src.value);
  }
};

}  // namespace pybind11::detail
