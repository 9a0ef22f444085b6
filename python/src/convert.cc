// Python arguments → C++ values: integer lists, dtypes, devices.
#include <Python.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "blockkv/config.h"
#include "common.h"

namespace blockkv::python {
namespace {

std::string TypeName(py::handle obj) { return py::str(py::type::of(obj).attr("__name__")); }

std::string Repr(py::handle obj) { return py::repr(obj); }

bool IsTorchObject(py::handle obj) {
  py::object module = py::type::of(obj).attr("__module__");
  return py::isinstance<py::str>(module) && module.cast<std::string>().rfind("torch", 0) == 0;
}

std::shared_ptr<Device> CudaOrThrow(int64_t ordinal) {
  return ValueOrThrow(CudaDevice(ToInt32(ordinal, "CUDA device ordinal")));
}

// torch's current CUDA device when torch is imported and has CUDA, else 0.
int64_t CurrentCudaOrdinal() {
  py::dict modules = py::module_::import("sys").attr("modules");
  if (!modules.contains("torch")) return 0;
  py::object cuda = modules["torch"].attr("cuda");
  if (!cuda.attr("is_available")().cast<bool>()) return 0;
  return cuda.attr("current_device")().cast<int64_t>();
}

}  // namespace

int32_t ToInt32(int64_t value, const char* what) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    Throw(PyExc_ValueError, std::string(what) + " " + std::to_string(value) + " is outside int32");
  }
  return static_cast<int32_t>(value);
}

std::vector<int64_t> ToInt64Vector(py::handle obj, const char* what) {
  if (PyBool_Check(obj.ptr())) {
    Throw(PyExc_TypeError, std::string(what) + " must be integers, got a bool");
  }
  if (PyLong_Check(obj.ptr())) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
    if (overflow != 0) {
      Throw(PyExc_ValueError, std::string(what) + " " + Repr(obj) + " is outside int64");
    }
    return {static_cast<int64_t>(value)};
  }
  auto host = py::reinterpret_borrow<py::object>(obj);
  if (IsTorchObject(obj) && py::hasattr(obj, "cpu")) host = host.attr("detach")().attr("cpu")();
  py::array array = py::module_::import("numpy").attr("asarray")(host);
  if (array.ndim() > 1) {
    Throw(PyExc_ValueError, std::string(what) + " must be an int or a 1-D sequence, got " +
                                std::to_string(array.ndim()) + " dimensions");
  }
  if (array.size() == 0) return {};
  const char kind = array.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    Throw(PyExc_TypeError, std::string(what) + " must be integers, got " + TypeName(obj) +
                               " of dtype " + std::string(py::str(array.dtype())));
  }
  auto values = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(array);
  if (!values) throw py::error_already_set();
  return {values.data(), values.data() + values.size()};
}

std::vector<BlockId> ToBlockIds(py::handle obj) {
  const std::vector<int64_t> ids = ToInt64Vector(obj, "block ids");
  std::vector<BlockId> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < std::numeric_limits<BlockId>::min() ||
        ids[i] > std::numeric_limits<BlockId>::max()) {
      Throw(PyExc_ValueError, "Invalid block " + std::to_string(ids[i]) + ": outside int32");
    }
    out[i] = static_cast<BlockId>(ids[i]);
  }
  return out;
}

DType ToDType(py::handle obj) {
  std::string name;
  if (py::isinstance<py::str>(obj)) {
    name = obj.cast<std::string>();
  } else if (IsTorchObject(obj)) {  // torch.float16 prints as "torch.float16"
    name = py::str(obj);
  } else if (py::hasattr(obj, "value") && py::hasattr(py::type::of(obj), "__members__")) {
    return ToDType(obj.attr("value"));  // an Enum member, e.g. DeepSpeed's DtypeEnum.fp16
  } else {
    try {
      name = py::str(py::module_::import("numpy").attr("dtype")(obj).attr("name"));
    } catch (const py::error_already_set&) {
      Throw(PyExc_ValueError, "unknown cache_dtype " + Repr(obj));
    }
  }
  std::string_view view = name;
  if (view.rfind("torch.", 0) == 0) view.remove_prefix(6);
  return ValueOrThrow(ParseDType(view));
}

py::object DTypeToPython(DType dtype) {
  const char* torch_name = nullptr;
  switch (dtype) {
    case DType::kFloat32:
      torch_name = "float32";
      break;
    case DType::kFloat16:
      torch_name = "float16";
      break;
    case DType::kBFloat16:
      torch_name = "bfloat16";
      break;
    case DType::kFloat8E4M3:
      torch_name = "float8_e4m3fn";
      break;
    case DType::kInt8:
      torch_name = "int8";
      break;
    case DType::kInt32:
      torch_name = "int32";
      break;
    case DType::kInt64:
      torch_name = "int64";
      break;
  }
  try {
    py::module_ torch = py::module_::import("torch");
    if (torch_name != nullptr && py::hasattr(torch, torch_name)) return torch.attr(torch_name);
  } catch (const py::error_already_set&) {
    // No torch: blockkv's own name.
  }
  return py::str(std::string(DTypeName(dtype)));
}

std::shared_ptr<Device> ToDevice(py::handle obj) {
  if (obj.is_none()) {
#if defined(BLOCKKV_PYTHON_HAVE_CUDA)
    Result<std::shared_ptr<Device>> gpu = CudaDevice(ToInt32(CurrentCudaOrdinal(), "CUDA device"));
    if (gpu.ok()) return *gpu;
#endif
    return CpuDevice();
  }
  if (py::isinstance<Device>(obj)) return obj.cast<std::shared_ptr<Device>>();
  if (PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr())) return CudaOrThrow(obj.cast<int64_t>());
  if (!py::isinstance<py::str>(obj) && !IsTorchObject(obj)) {
    Throw(PyExc_TypeError,
          "device must be None, a string such as \"cpu\" or \"cuda:0\", an int, "
          "a torch.device or a blockkv Device; got " +
              TypeName(obj));
  }
  const std::string name = py::str(obj);
  if (name == "cpu") return CpuDevice();
  if (name == "cuda") return CudaOrThrow(CurrentCudaOrdinal());
  if (name.rfind("cuda:", 0) == 0) {
    const std::string index = name.substr(5);
    if (!index.empty() && index.find_first_not_of("0123456789") == std::string::npos &&
        index.size() < 10) {
      return CudaOrThrow(std::stoll(index));
    }
  }
  Throw(PyExc_ValueError, "unknown device \"" + name + R"(": expected "cpu", "cuda" or "cuda:N")");
}

std::vector<KVCacheConfig> ToConfigs(py::handle obj) {
  if (py::isinstance<KVCacheConfig>(obj)) return {obj.cast<KVCacheConfig>()};
  if (!py::isinstance<py::sequence>(obj)) {
    Throw(PyExc_TypeError, "expected a KVCacheConfig or a sequence of them, got " + TypeName(obj));
  }
  std::vector<KVCacheConfig> configs;
  for (py::handle item : obj) {
    if (!py::isinstance<KVCacheConfig>(item)) {
      Throw(PyExc_TypeError, "every cache config must be a KVCacheConfig, got " + TypeName(item));
    }
    configs.push_back(item.cast<KVCacheConfig>());
  }
  return configs;
}

void RequireNoGroup(py::handle group, const char* argument) {
  if (group.is_none()) return;
  Throw(PyExc_NotImplementedError,
        std::string(argument) +
            " must be None: blockkv's Python module does not bind communicators, so it runs as "
            "one rank. Tensor-parallel capacity agreement is available from C++ "
            "(MpiCommunicator, NcclCommunicator).");
}

}  // namespace blockkv::python
