// SPDX-License-Identifier: Apache-2.0
// Tensors across the Python boundary, through DLPack.
//
// blockkv.Tensor is a TensorView plus a shared_ptr to whatever owns its memory (a BlockedKVCache,
// a StateManager, a ragged batch, or a tensor imported from another framework). It implements
// the DLPack protocol (__dlpack__, __dlpack_device__), so torch.from_dlpack,
// torch.utils.dlpack.from_dlpack and numpy.from_dlpack give zero-copy views of the real storage.
// The DLManagedTensor handed out holds its own reference to the owner, so such a view keeps the
// storage alive after every blockkv Python object is gone; its deleter touches no Python object
// and needs no GIL. numpy.from_dlpack's arrays are read-only (DLPack 0.6 cannot say whether a
// tensor is writable); Tensor.numpy() gives a writable NumPy view that keeps the owner alive.
//
// dtypes in DLPack 0.6 terms: fp32/fp16 (kDLFloat), bf16 (kDLBfloat), int8/int32/int64
// (kDLInt); fp8_e4m3 has no DLPack 0.6 code and travels as raw bytes, uint8 (as vLLM stores an
// fp8 cache). NumPy has no bfloat16, so numpy.from_dlpack of a bf16 tensor raises.
#pragma once

#include <memory>

#include "blockkv/tensor.h"
#include "common.h"

namespace blockkv::python {

// A view and what keeps its memory alive.
struct OwnedTensor {
  TensorView view;
  std::shared_ptr<const void> owner;
};

// A new blockkv.Tensor.
py::object MakeTensor(const TensorView& view, std::shared_ptr<const void> owner);

// A view of any object with __dlpack__ (a blockkv.Tensor, a torch tensor, a NumPy array, ...).
// The imported DLManagedTensor is released when the last OwnedTensor sharing it goes.
// TypeError for an object without __dlpack__ or an unsupported dtype; ValueError for more than
// kMaxTensorDims dimensions or an unsupported device.
OwnedTensor ImportTensor(py::handle obj);

// A host view as a NumPy array sharing its memory (its base keeps `owner` alive); a device view
// as a blockkv.Tensor. For the arrays a ragged batch hands out.
py::object HostArrayOrTensor(const TensorView& view, std::shared_ptr<const void> owner);

}  // namespace blockkv::python
