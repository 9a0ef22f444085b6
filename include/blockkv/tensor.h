// SPDX-License-Identifier: Apache-2.0
// TensorView: a non-owning, strided view of memory owned by someone else (a BlockedKVCache, an
// engine's tensor). It is what blockkv hands out and accepts; it never frees anything.
//
//   Result<TensorView> layer = cache.GetCache(/*cache_id=*/3);
//   // [num_blocks, block_size, 2, num_kv_heads, head_size]
//   auto [k, v] = *SplitKV(*layer);
//   // each [num_blocks, block_size, num_kv_heads, head_size], stride(1) = 2·H·D
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include "blockkv/device.h"
#include "blockkv/dtype.h"
#include "blockkv/status.h"

namespace blockkv {

inline constexpr int kMaxTensorDims = 8;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat16;
  DeviceKind device = DeviceKind::kCpu;
  int device_ordinal = 0;
  int ndim = 0;
  std::array<int64_t, kMaxTensorDims> shape{};    // shape[0..ndim)
  std::array<int64_t, kMaxTensorDims> strides{};  // in elements, not bytes

  // Product of shape[0..ndim); 1 for a 0-d view.
  int64_t numel() const;
  // True when strides are those of a row-major array of this shape.
  bool is_contiguous() const;
  int64_t size(int dim) const { return shape[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
};

// The same view with the stride of every extent-1 dimension replaced by the one a row-major
// layout gives it (stride[i + 1] · shape[i + 1], 1 for the last dimension). Such a stride is never
// multiplied by anything but 0 and frameworks export any value there (torch: 1), so every check
// that compares or bounds strides (the kernels', the cache-identity check, DLPack import) looks at
// these instead.
TensorView CanonicalStrides(const TensorView& view);

// A contiguous row-major view of `shape` (at most kMaxTensorDims dims) over `data`.
TensorView ContiguousView(void* data, DType dtype, DeviceKind device, int device_ordinal,
                          std::initializer_list<int64_t> shape);

// Splits one layer's cache [num_blocks, block_size, 2, H, D] into its K plane ([:, :, 0]) and
// V plane ([:, :, 1]), each [num_blocks, block_size, H, D] with stride(1) = 2·H·D. No copy.
// kInvalidArgument unless ndim == 5 and shape[2] == 2.
Result<std::pair<TensorView, TensorView>> SplitKV(const TensorView& kv_cache);

}  // namespace blockkv
