// SPDX-License-Identifier: Apache-2.0
// Python arguments → C++ values: integers (range-checked, common.h), dtypes, devices.
#include <Python.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

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

// --- Integers (common.h)
// --------------------------------------------------------------------------
//
// The fast paths read what the caller passed without NumPy's generic conversion: a Python int, a
// list or tuple item by item, a NumPy array's buffer in its own dtype, a torch tensor through
// tolist() (one C call; large tensors through their NumPy view instead). Anything else goes
// through numpy.asarray.

constexpr int64_t kScalar = -1;  // an error's index for a value not in a sequence
// torch tensors of up to this many elements are read through tolist(): one C call and a Python
// int per element, where the NumPy view costs a few microseconds whatever the size.
constexpr int64_t kTensorListLimit = 256;

template <class T>
std::string RangeText() {
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>);
  return std::string(sizeof(T) == 4 ? "int32" : "int64") + " [" +
         std::to_string(std::numeric_limits<T>::min()) + ", " +
         std::to_string(std::numeric_limits<T>::max()) + "]";
}

std::string Position(const char* what, int64_t index) {
  return index == kScalar ? std::string(what) + " "
                          : std::string(what) + "[" + std::to_string(index) + "] = ";
}

template <class T>
[[noreturn]] void ThrowOutOfRange(const char* what, int64_t index, const std::string& value) {
  Throw(PyExc_ValueError, Position(what, index) + value + " is outside " + RangeText<T>());
}

[[noreturn]] void ThrowNotAnInt(const char* what, int64_t index, py::handle item) {
  if (PyBool_Check(item.ptr())) {
    Throw(PyExc_TypeError, std::string(what) + " must be integers, got a bool");
  }
  if (index == kScalar) {
    Throw(PyExc_TypeError, std::string(what) +
                               " must be an int or a 1-D sequence of ints (a list, a tuple, a " +
                               "NumPy array, a torch tensor), got " + TypeName(item));
  }
  Throw(PyExc_TypeError, std::string(what) + "[" + std::to_string(index) +
                             "] must be an int, got " + TypeName(item));
}

[[noreturn]] void ThrowDimensions(const char* what, int64_t dims) {
  Throw(PyExc_ValueError, std::string(what) + " must be an int or a 1-D sequence, got " +
                              std::to_string(dims) + " dimensions");
}

// A Python int, or an object with __index__, as T.
template <class T>
T CheckedInt(py::handle obj, const char* what, int64_t index) {
  PyObject* value = obj.ptr();
  if (PyBool_Check(value)) ThrowNotAnInt(what, index, obj);
  py::object converted;
  if (!PyLong_Check(value)) {
    if (!PyIndex_Check(value)) ThrowNotAnInt(what, index, obj);
    PyObject* as_int = PyNumber_Index(value);  // a NumPy or torch integer scalar
    if (as_int == nullptr) {
      PyErr_Clear();
      ThrowNotAnInt(what, index, obj);
    }
    converted = py::reinterpret_steal<py::object>(as_int);
    value = as_int;
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow != 0) ThrowOutOfRange<T>(what, index, py::str(value));
  if (v == -1 && PyErr_Occurred() != nullptr) throw py::error_already_set();
  if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
    ThrowOutOfRange<T>(what, index, std::to_string(v));
  }
  return static_cast<T>(v);
}

template <class T>
void AppendInts(py::handle obj, const char* what, std::vector<T>* out);

// A list or tuple, item by item. The list is re-read at each step: an item's __index__ may run
// Python code that changes it.
template <class T>
void AppendSequence(py::handle seq, const char* what, std::vector<T>* out) {
  PyObject* p = seq.ptr();
  const bool list = PyList_Check(p) != 0;
  out->reserve(out->size() + static_cast<size_t>(list ? PyList_GET_SIZE(p) : PyTuple_GET_SIZE(p)));
  for (Py_ssize_t i = 0; i < (list ? PyList_GET_SIZE(p) : PyTuple_GET_SIZE(p)); ++i) {
    auto item =
        py::reinterpret_borrow<py::object>(list ? PyList_GET_ITEM(p, i) : PyTuple_GET_ITEM(p, i));
    if (PyList_Check(item.ptr()) || PyTuple_Check(item.ptr()) ||
        (py::isinstance<py::array>(item) && py::reinterpret_borrow<py::array>(item).ndim() > 0)) {
      ThrowDimensions(what, 2);
    }
    out->push_back(CheckedInt<T>(item, what, i));
  }
}

// Element i of a 1-D array (or the value of a 0-d one) of `Stored`, as T.
template <class T, class Stored>
void AppendElements(const char* base, py::ssize_t stride, py::ssize_t n, const char* what,
                    bool scalar, std::vector<T>* out) {
  if constexpr (std::is_same_v<Stored, T>) {
    if (stride == static_cast<py::ssize_t>(sizeof(T))) {  // contiguous, every value fits
      const size_t old_size = out->size();
      out->resize(old_size + static_cast<size_t>(n));
      std::memcpy(out->data() + old_size, base, static_cast<size_t>(n) * sizeof(T));
      return;
    }
  }
  for (py::ssize_t i = 0; i < n; ++i) {
    Stored v;
    std::memcpy(&v, base + i * stride, sizeof(v));  // the array may be unaligned
    if constexpr (std::is_signed_v<Stored>) {
      if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
        ThrowOutOfRange<T>(what, scalar ? kScalar : i, std::to_string(v));
      }
    } else if (v > static_cast<std::make_unsigned_t<T>>(std::numeric_limits<T>::max())) {
      ThrowOutOfRange<T>(what, scalar ? kScalar : i, std::to_string(v));
    }
    out->push_back(static_cast<T>(v));
  }
}

bool NativeByteOrder(const py::dtype& dtype) {
  const char order = dtype.byteorder();
  constexpr char kNative = std::endian::native == std::endian::little ? '<' : '>';
  return order == '=' || order == '|' || order == kNative;
}

// A NumPy array of any integer dtype, read in place. `passed`: what the caller passed, when the
// array was made from it (named in a TypeError).
template <class T>
void AppendArray(const py::array& array, const char* what, std::vector<T>* out,
                 py::handle passed = py::handle()) {
  if (array.ndim() > 1) ThrowDimensions(what, array.ndim());
  const bool scalar = array.ndim() == 0;
  const py::ssize_t n = scalar ? 1 : array.shape(0);
  if (n == 0) return;  // whatever the dtype: an empty list becomes float64
  const py::dtype dtype = array.dtype();
  const char kind = dtype.kind();
  if (kind == 'O') {  // Python objects: each must be an int
    if (scalar) ThrowNotAnInt(what, kScalar, array.attr("item")());
    AppendSequence(array.attr("tolist")(), what, out);
    return;
  }
  if (kind == 'b')
    Throw(PyExc_TypeError, std::string(what) + " must be integers, got a bool array");
  if (kind != 'i' && kind != 'u') {
    Throw(PyExc_TypeError, std::string(what) + " must be integers, got " +
                               TypeName(passed ? passed : py::handle(array)) + " of dtype " +
                               std::string(py::str(dtype.attr("name"))));
  }
  if (!NativeByteOrder(dtype)) {
    AppendArray(py::array(array.attr("astype")(dtype.attr("newbyteorder")("="))), what, out);
    return;
  }
  const auto* base = static_cast<const char*>(array.data());
  const py::ssize_t stride = scalar ? 0 : array.strides(0);
  out->reserve(out->size() + static_cast<size_t>(n));
  const bool is_signed = kind == 'i';
  switch (dtype.itemsize()) {
    case 1:
      return is_signed ? AppendElements<T, int8_t>(base, stride, n, what, scalar, out)
                       : AppendElements<T, uint8_t>(base, stride, n, what, scalar, out);
    case 2:
      return is_signed ? AppendElements<T, int16_t>(base, stride, n, what, scalar, out)
                       : AppendElements<T, uint16_t>(base, stride, n, what, scalar, out);
    case 4:
      return is_signed ? AppendElements<T, int32_t>(base, stride, n, what, scalar, out)
                       : AppendElements<T, uint32_t>(base, stride, n, what, scalar, out);
    case 8:
      return is_signed ? AppendElements<T, int64_t>(base, stride, n, what, scalar, out)
                       : AppendElements<T, uint64_t>(base, stride, n, what, scalar, out);
    default:
      Throw(PyExc_TypeError, std::string(what) + " must be integers of at most 64 bits, got " +
                                 "dtype " + std::string(py::str(dtype.attr("name"))));
  }
}

// torch.Tensor's type once a torch tensor was seen (a reference kept for the process's life), so
// recognizing one is a type check, not an import.
bool IsTorchTensor(py::handle obj) {
  static PyObject* tensor_type = nullptr;
  if (tensor_type == nullptr) {
    if (!IsTorchObject(obj)) return false;
    tensor_type = py::object(py::module_::import("torch").attr("Tensor")).release().ptr();
  }
  return PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(tensor_type)) != 0;
}

// A method call without arguments (`name` interned once by the caller).
py::object CallMethod(py::handle obj, PyObject* name) {
  PyObject* result = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

template <class T>
void AppendTensor(py::handle tensor, const char* what, std::vector<T>* out) {
  // numel() and tolist() are C methods; len() is Python code in torch and costs more than both.
  static PyObject* const kNumel = PyUnicode_InternFromString("numel");
  static PyObject* const kToList = PyUnicode_InternFromString("tolist");
  if (CallMethod(tensor, kNumel).cast<int64_t>() <= kTensorListLimit) {
    AppendInts(CallMethod(tensor, kToList), what, out);  // an int for a 0-d tensor
    return;
  }
  py::object host = py::reinterpret_borrow<py::object>(tensor).attr("detach")().attr("cpu")();
  AppendArray(py::array(host.attr("numpy")()), what, out);
}

template <class T>
void AppendInts(py::handle obj, const char* what, std::vector<T>* out) {
  PyObject* p = obj.ptr();
  if (PyLong_Check(p) && !PyBool_Check(p)) {
    out->push_back(CheckedInt<T>(obj, what, kScalar));
  } else if (PyList_Check(p) || PyTuple_Check(p)) {
    AppendSequence(obj, what, out);
  } else if (py::isinstance<py::array>(obj)) {
    AppendArray(py::reinterpret_borrow<py::array>(obj), what, out);
  } else if (IsTorchTensor(obj)) {
    AppendTensor(obj, what, out);
  } else if (PyIndex_Check(p) && !PyBool_Check(p)) {  // a NumPy integer scalar
    out->push_back(ToInt<T>(obj, what));
  } else {  // ranges, array-likes, ...; a bool, a float or a str fails the dtype check
    AppendArray(py::array(py::module_::import("numpy").attr("asarray")(obj)), what, out, obj);
  }
}

}  // namespace

int32_t ToInt32(int64_t value, const char* what) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    ThrowOutOfRange<int32_t>(what, kScalar, std::to_string(value));
  }
  return static_cast<int32_t>(value);
}

template <class T>
T ToInt(py::handle obj, const char* what) {
  return CheckedInt<T>(obj, what, kScalar);
}

template <class T>
std::vector<T> ToInts(py::handle obj, const char* what) {
  std::vector<T> out;
  AppendInts(obj, what, &out);
  return out;
}

template int32_t ToInt<int32_t>(py::handle, const char*);
template int64_t ToInt<int64_t>(py::handle, const char*);
template std::vector<int32_t> ToInts<int32_t>(py::handle, const char*);
template std::vector<int64_t> ToInts<int64_t>(py::handle, const char*);

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
