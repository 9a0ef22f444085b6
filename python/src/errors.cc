// SPDX-License-Identifier: Apache-2.0
// Status → Python exception (the table is in common.h).
#include <Python.h>

#include "common.h"

namespace blockkv::python {
namespace {

// blockkv.ResourceExhaustedError; created once in BindErrors and kept for the process's life
// (the module holds a reference too).
PyObject* g_resource_exhausted = nullptr;

PyObject* ExceptionType(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
      return PyExc_ValueError;
    case StatusCode::kResourceExhausted:
      return g_resource_exhausted != nullptr ? g_resource_exhausted : PyExc_ValueError;
    case StatusCode::kUnimplemented:
      return PyExc_NotImplementedError;
    case StatusCode::kPermissionDenied:
      return PyExc_PermissionError;
    default:  // kUnavailable, kDataLoss, kInternal
      return PyExc_RuntimeError;
  }
}

}  // namespace

void Throw(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

void ThrowStatus(const Status& status) {
  Throw(ExceptionType(status.code()),
        status.message().empty() ? std::string(StatusCodeName(status.code())) : status.message());
}

py::object StatusException(const Status& status) {
  if (status.ok()) return py::none();
  return py::handle(ExceptionType(status.code()))(
      status.message().empty() ? std::string(StatusCodeName(status.code())) : status.message());
}

void BindErrors(py::module_& m) {
  py::tuple bases = py::make_tuple(py::handle(PyExc_ValueError), py::handle(PyExc_RuntimeError));
  g_resource_exhausted = PyErr_NewExceptionWithDoc(
      "blockkv.ResourceExhaustedError",
      "Not enough of something now: free blocks, tracking slots, room in a ragged batch, memory. "
      "A ValueError (what DeepSpeed raises for running out of KV blocks) and a RuntimeError (what "
      "it raises for a full ragged batch or no tracking slot).",
      bases.ptr(), nullptr);
  if (g_resource_exhausted == nullptr) throw py::error_already_set();
  m.attr("ResourceExhaustedError") = py::handle(g_resource_exhausted);
}

}  // namespace blockkv::python
