// SPDX-License-Identifier: Apache-2.0
// The extension module blockkv._blockkv; blockkv/__init__.py re-exports it with the pure-Python
// pieces (SchedulingError, PlaceholderSequenceDescriptor, split_kv's type dispatch).
#include <string>

#include "blockkv/log.h"
#include "common.h"

namespace {

blockkv::LogLevel ToLogLevel(const std::string& name) {
  if (name == "debug") return blockkv::LogLevel::kDebug;
  if (name == "info") return blockkv::LogLevel::kInfo;
  if (name == "warning") return blockkv::LogLevel::kWarning;
  if (name == "error") return blockkv::LogLevel::kError;
  blockkv::python::Throw(PyExc_ValueError, "unknown log level \"" + name +
                                               "\": expected debug, info, warning or error");
}

}  // namespace

PYBIND11_MODULE(_blockkv, m) {
  namespace bp = blockkv::python;
  namespace py = pybind11;
  m.doc() = "blockkv: a paged KV cache with DeepSpeed-FastGen's Python API";
#if defined(BLOCKKV_PYTHON_HAVE_CUDA)
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def(
      "set_log_level", [](const std::string& level) { blockkv::SetLogLevel(ToLogLevel(level)); },
      py::arg("level"),
      "Lines below `level` (\"debug\", \"info\", \"warning\", \"error\") are dropped; blockkv "
      "logs to stderr, one line per cache group created at \"info\".");
  bp::BindErrors(m);
  bp::BindTensor(m);
  bp::BindConfig(m);
  bp::BindKVCache(m);
  bp::BindStateManager(m);
  bp::BindRaggedBatch(m);
  bp::BindKernels(m);
  bp::BindDeepSpeed(m);
}
