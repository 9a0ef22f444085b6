// SPDX-License-Identifier: Apache-2.0
#include "blockkv/tensor.h"

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView CanonicalStrides(const TensorView& view) {
  TensorView out = view;
  for (int i = out.ndim - 1; i >= 0; --i) {
    if (out.shape[i] != 1) continue;
    out.strides[i] = i + 1 < out.ndim ? out.strides[i + 1] * out.shape[i + 1] : 1;
  }
  return out;
}

TensorView ContiguousView(void* data, DType dtype, DeviceKind device, int device_ordinal,
                          std::initializer_list<int64_t> shape) {
  BLOCKKV_CHECK(shape.size() <= kMaxTensorDims, "ContiguousView: too many dimensions");
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.device_ordinal = device_ordinal;
  view.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t extent : shape) view.shape[i++] = extent;
  int64_t stride = 1;
  for (i = view.ndim - 1; i >= 0; --i) {
    view.strides[i] = stride;
    stride *= view.shape[i];
  }
  return view;
}

Result<std::pair<TensorView, TensorView>> SplitKV(const TensorView& kv_cache) {
  if (kv_cache.ndim != 5) {
    return InvalidArgumentError(internal::StrCat(
        "KV-cache must have 5 dimensions [num_blocks, block_size, 2, num_kv_heads, head_size], "
        "got ",
        kv_cache.ndim));
  }
  if (kv_cache.shape[2] != 2) {
    return InvalidArgumentError(internal::StrCat(
        "KV-cache dimension 2 must hold K and V (size 2), got size ", kv_cache.shape[2]));
  }
  TensorView k;
  k.dtype = kv_cache.dtype;
  k.device = kv_cache.device;
  k.device_ordinal = kv_cache.device_ordinal;
  k.ndim = 4;
  for (int src : {0, 1, 3, 4}) {
    const int dst = src < 2 ? src : src - 1;
    k.shape[dst] = kv_cache.shape[src];
    k.strides[dst] = kv_cache.strides[src];
  }
  TensorView v = k;
  k.data = kv_cache.data;
  const int64_t v_offset_bytes =
      kv_cache.strides[2] * static_cast<int64_t>(ElementSize(kv_cache.dtype));
  v.data = static_cast<char*>(kv_cache.data) + v_offset_bytes;
  return std::make_pair(k, v);
}

}  // namespace blockkv
