// SPDX-License-Identifier: Apache-2.0
// blockkv.Tensor and the DLPack protocol, both ways (see tensor.h).
#include "tensor.h"

#include <Python.h>
#include <dlpack/dlpack.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace blockkv::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";           // DLPack's name for a fresh capsule
constexpr const char* kUsedCapsuleName = "used_dltensor";  // ... once a consumer took it

// What one exported DLManagedTensor owns: its shape and strides, and a reference to the storage.
struct ExportContext {
  DLManagedTensor managed{};
  std::shared_ptr<const void> owner;
  std::array<int64_t, kMaxTensorDims> shape{};
  std::array<int64_t, kMaxTensorDims> strides{};
};

void DeleteExport(DLManagedTensor* managed) {
  delete static_cast<ExportContext*>(managed->manager_ctx);
}

// A capsule nobody consumed still owns its tensor.
void DestroyCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kUsedCapsuleName) != 0) return;
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed == nullptr) {
    PyErr_WriteUnraisable(capsule);
  } else if (managed->deleter != nullptr) {
    managed->deleter(managed);
  }
  PyErr_Restore(type, value, traceback);
}

DLDataType ToDLDataType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return {kDLFloat, 32, 1};
    case DType::kFloat16:
      return {kDLFloat, 16, 1};
    case DType::kBFloat16:
      return {kDLBfloat, 16, 1};
    case DType::kFloat8E4M3:
      return {kDLUInt, 8, 1};  // raw bytes: DLPack 0.6 has no fp8
    case DType::kInt8:
      return {kDLInt, 8, 1};
    case DType::kInt32:
      return {kDLInt, 32, 1};
    case DType::kInt64:
      return {kDLInt, 64, 1};
  }
  Throw(PyExc_TypeError, "unknown dtype");
}

std::optional<DType> FromDLDataType(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
  if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
  if (t.code == kDLUInt && t.bits == 8) return DType::kFloat8E4M3;  // how blockkv exports fp8
  if (t.code == kDLInt && t.bits == 8) return DType::kInt8;
  if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
  if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
  return std::nullopt;
}

DLDevice ToDLDevice(const TensorView& view) {
  if (view.device == DeviceKind::kCuda) return {kDLCUDA, view.device_ordinal};
  return {kDLCPU, 0};
}

std::string DeviceString(const TensorView& view) {
  if (view.device == DeviceKind::kCuda) return "cuda:" + std::to_string(view.device_ordinal);
  return "cpu";
}

py::tuple ToTuple(const std::array<int64_t, kMaxTensorDims>& values, int n) {
  py::tuple out(n);
  for (int i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = py::int_(values[static_cast<size_t>(i)]);
  return out;
}

py::object ExportCapsule(const OwnedTensor& t, const py::object& dl_device,
                         const py::object& copy) {
  if (!copy.is_none() && copy.cast<bool>()) {
    Throw(PyExc_BufferError, "blockkv.Tensor exports views of its storage only (copy=True)");
  }
  const DLDevice device = ToDLDevice(t.view);
  if (!dl_device.is_none()) {
    auto wanted = dl_device.cast<std::pair<int, int>>();
    if (wanted.first != device.device_type || wanted.second != device.device_id) {
      Throw(PyExc_BufferError, "blockkv.Tensor lives on " + DeviceString(t.view) +
                                   " and cannot be exported to another device");
    }
  }
  auto context = std::make_unique<ExportContext>();
  context->owner = t.owner;
  context->shape = t.view.shape;
  context->strides = t.view.strides;
  DLTensor& dl = context->managed.dl_tensor;
  dl.data = t.view.data;
  dl.device = device;
  dl.ndim = t.view.ndim;
  dl.dtype = ToDLDataType(t.view.dtype);
  dl.shape = context->shape.data();
  dl.strides = context->strides.data();
  dl.byte_offset = 0;
  context->managed.manager_ctx = context.get();
  context->managed.deleter = DeleteExport;
  PyObject* capsule = PyCapsule_New(&context->managed, kCapsuleName, DestroyCapsule);
  if (capsule == nullptr) throw py::error_already_set();
  context.release();  // NOLINT(bugprone-unused-return-value): the capsule owns it now
  return py::reinterpret_steal<py::object>(capsule);
}

std::string Repr(const OwnedTensor& t) {
  std::string shape = py::str(ToTuple(t.view.shape, t.view.ndim));
  return "blockkv.Tensor(shape=" + shape + ", dtype=" + std::string(DTypeName(t.view.dtype)) +
         ", device=" + DeviceString(t.view) + ")";
}

// NumPy's name for a dtype, or nullptr when NumPy has none (bf16).
const char* NumpyDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat8E4M3:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBFloat16:
      return nullptr;
  }
  return nullptr;
}

}  // namespace

py::object MakeTensor(const TensorView& view, std::shared_ptr<const void> owner) {
  return py::cast(OwnedTensor{view, std::move(owner)});
}

OwnedTensor ImportTensor(py::handle obj) {
  if (py::isinstance<OwnedTensor>(obj)) return obj.cast<OwnedTensor>();
  if (!py::hasattr(obj, "__dlpack__")) {
    Throw(PyExc_TypeError, "expected a tensor supporting DLPack (__dlpack__), got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  py::object capsule = obj.attr("__dlpack__")();
  if (PyCapsule_IsValid(capsule.ptr(), kCapsuleName) == 0) {
    Throw(PyExc_TypeError, "__dlpack__ did not return an unused \"dltensor\" capsule");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  if (managed == nullptr || PyCapsule_SetName(capsule.ptr(), kUsedCapsuleName) != 0) {
    throw py::error_already_set();
  }
  OwnedTensor out;
  out.owner = std::shared_ptr<const void>(managed, [](const void* p) {
    auto* m = static_cast<DLManagedTensor*>(const_cast<void*>(p));
    if (m->deleter != nullptr) m->deleter(m);
  });
  const DLTensor& dl = managed->dl_tensor;
  const std::optional<DType> dtype = FromDLDataType(dl.dtype);
  if (!dtype) {
    Throw(PyExc_TypeError, "unsupported DLPack dtype (code " + std::to_string(dl.dtype.code) +
                               ", " + std::to_string(dl.dtype.bits) + " bits, " +
                               std::to_string(dl.dtype.lanes) + " lanes)");
  }
  if (dl.ndim < 0 || dl.ndim > kMaxTensorDims) {
    Throw(PyExc_ValueError, "a tensor of " + std::to_string(dl.ndim) +
                                " dimensions; blockkv views hold at most " +
                                std::to_string(kMaxTensorDims));
  }
  TensorView& v = out.view;
  switch (dl.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      v.device = DeviceKind::kCpu;
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      v.device = DeviceKind::kCuda;
      v.device_ordinal = dl.device.device_id;
      break;
    default:
      Throw(PyExc_ValueError,
            "unsupported DLPack device type " + std::to_string(dl.device.device_type));
  }
  v.data = static_cast<char*>(dl.data) + dl.byte_offset;
  v.dtype = *dtype;
  v.ndim = dl.ndim;
  int64_t stride = 1;
  for (int i = dl.ndim - 1; i >= 0; --i) {
    const auto d = static_cast<size_t>(i);
    v.shape[d] = dl.shape[i];
    v.strides[d] = dl.strides != nullptr ? dl.strides[i] : stride;
    stride *= dl.shape[i];
  }
  // torch exports extent-1 dimensions with stride 1: such strides mean nothing, and blockkv's
  // checks compare canonical ones.
  v = CanonicalStrides(v);
  return out;
}

py::object HostArrayOrTensor(const TensorView& view, std::shared_ptr<const void> owner) {
  const char* dtype = NumpyDType(view.dtype);
  if (view.device != DeviceKind::kCpu || dtype == nullptr) {
    return MakeTensor(view, std::move(owner));
  }
  const auto element = static_cast<py::ssize_t>(ElementSize(view.dtype));
  std::vector<py::ssize_t> shape(static_cast<size_t>(view.ndim));
  std::vector<py::ssize_t> strides(static_cast<size_t>(view.ndim));
  for (size_t i = 0; i < shape.size(); ++i) {
    shape[i] = view.shape[i];
    strides[i] = view.strides[i] * element;
  }
  py::capsule base(new std::shared_ptr<const void>(std::move(owner)),
                   [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); });
  return py::array(py::dtype(dtype), shape, strides, view.data, base);
}

void BindTensor(py::module_& m) {
  py::class_<OwnedTensor>(m, "Tensor", R"doc(
A view of memory blockkv owns (a KV cache layer, a ragged batch array) or imported from another
framework. Convert it without a copy with torch.from_dlpack(t) or numpy.from_dlpack(t); the
result keeps the storage alive. Strides are in elements, as torch counts them.)doc")
      .def_property_readonly(
          "shape", [](const OwnedTensor& t) { return ToTuple(t.view.shape, t.view.ndim); })
      .def_property_readonly(
          "strides", [](const OwnedTensor& t) { return ToTuple(t.view.strides, t.view.ndim); })
      .def_property_readonly("ndim", [](const OwnedTensor& t) { return t.view.ndim; })
      .def_property_readonly(
          "dtype", [](const OwnedTensor& t) { return std::string(DTypeName(t.view.dtype)); })
      .def_property_readonly("device", [](const OwnedTensor& t) { return DeviceString(t.view); })
      .def("data_ptr",
           [](const OwnedTensor& t) { return reinterpret_cast<uintptr_t>(t.view.data); })
      .def("numel", [](const OwnedTensor& t) { return t.view.numel(); })
      .def("is_contiguous", [](const OwnedTensor& t) { return t.view.is_contiguous(); })
      .def("__len__",
           [](const OwnedTensor& t) {
             if (t.view.ndim == 0) Throw(PyExc_TypeError, "len() of a 0-d tensor");
             return t.view.shape[0];
           })
      .def("__repr__", &Repr)
      .def(
          "numpy",
          [](const OwnedTensor& t) {
            if (t.view.device != DeviceKind::kCpu || NumpyDType(t.view.dtype) == nullptr) {
              Throw(PyExc_TypeError, Repr(t) +
                                         " has no NumPy view: NumPy has no bfloat16 and "
                                         "no device memory");
            }
            return HostArrayOrTensor(t.view, t.owner);
          },
          "A writable NumPy view of a host tensor (numpy.from_dlpack's views are read-only); "
          "it keeps the storage alive. TypeError for bf16 or device memory.")
      .def(
          "__array__",
          [](const py::object& self, const py::object& dtype) {
            py::object array = self.attr("numpy")();
            return dtype.is_none() ? array : array.attr("astype")(dtype);
          },
          py::arg("dtype") = py::none())
      .def(
          "__dlpack__",
          [](const OwnedTensor& t, const py::object& /*stream*/, const py::object& /*max_version*/,
             const py::object& dl_device,
             const py::object& copy) { return ExportCapsule(t, dl_device, copy); },
          py::arg("stream") = py::none(), py::kw_only(), py::arg("max_version") = py::none(),
          py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
          "A DLPack capsule viewing this tensor's memory. `stream` is accepted and ignored: "
          "blockkv's writes are complete when its calls return; `max_version` is accepted and an "
          "unversioned (DLPack 0.6) capsule returned.")
      .def("__dlpack_device__", [](const OwnedTensor& t) {
        const DLDevice d = ToDLDevice(t.view);
        return py::make_tuple(static_cast<int>(d.device_type), d.device_id);
      });

  m.def(
      "_split_kv",
      [](py::handle kv_cache) {
        OwnedTensor t = ImportTensor(kv_cache);
        auto [k, v] = ValueOrThrow(SplitKV(t.view));
        return py::make_tuple(MakeTensor(k, t.owner), MakeTensor(v, t.owner));
      },
      py::arg("kv_cache"));
}

}  // namespace blockkv::python
