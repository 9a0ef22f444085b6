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

#include <cstdint>
#include <memory>
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

// --- Arguments -----------------------------------------------------------------------------------

// An int, or a 0-/1-D sequence of ints: a list, a tuple, a NumPy array or a CPU torch tensor (a
// tensor on another device is copied to the host). Booleans and floats are a TypeError.
std::vector<int64_t> ToInt64Vector(py::handle obj, const char* what);
// The same for block ids; an id outside int32 is a ValueError naming it.
std::vector<BlockId> ToBlockIds(py::handle obj);
// `value` as an int32 field; outside int32 is a ValueError naming `what`.
int32_t ToInt32(int64_t value, const char* what);

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

}  // namespace blockkv::python
