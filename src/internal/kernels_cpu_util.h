// SPDX-License-Identifier: Apache-2.0
// What the CPU kernels (kernels_cpu.cc, kernels_cpu_append.cc) share: element addressing, row
// conversion between the storage dtypes and float, and the work-stealing thread loop.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "blockkv/dtype.h"
#include "internal/check.h"
#include "internal/float_convert.h"

namespace blockkv::internal::cpu {

// Elements of `dtype` at `base + index` as bytes.
inline const uint8_t* ElementPtr(const void* base, int64_t index, DType dtype) {
  return static_cast<const uint8_t*>(base) + index * static_cast<int64_t>(ElementSize(dtype));
}

// Converts `n` elements of `dtype` to float (fp8 values times `scale`).
inline void ToFloat(const void* src, DType dtype, int32_t n, float scale, float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16:
      for (int32_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kBFloat16:
      for (int32_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kFloat8E4M3:
      for (int32_t i = 0; i < n; ++i) {
        dst[i] = Fp8E4M3ToFloat(static_cast<const uint8_t*>(src)[i]) * scale;
      }
      return;
    default:
      BLOCKKV_CHECK(false, "unsupported dtype reached the CPU kernels");
  }
}

// Converts `n` floats to `dtype` (fp8: value / scale, saturating).
inline void FromFloat(const float* src, int32_t n, DType dtype, float scale, void* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16:
      for (int32_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToFp16(src[i]);
      return;
    case DType::kBFloat16:
      for (int32_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToBf16(src[i]);
      return;
    case DType::kFloat8E4M3:
      for (int32_t i = 0; i < n; ++i) {
        static_cast<uint8_t*>(dst)[i] = FloatToFp8E4M3(src[i] / scale);
      }
      return;
    default:
      BLOCKKV_CHECK(false, "unsupported dtype reached the CPU kernels");
  }
}

// Runs fn(item, thread) for item in [0, n_items) on up to `threads` threads (the caller's one
// included); one thread when `work` (a rough element count) is too small to pay for more.
inline void ParallelFor(int64_t n_items, int threads, int64_t work,
                        const std::function<void(int64_t, int)>& fn) {
  constexpr int64_t kWorkPerThread = int64_t{1} << 18;
  const int64_t useful = std::max<int64_t>(1, work / kWorkPerThread);
  const int n = static_cast<int>(std::min<int64_t>({threads, n_items, useful}));
  std::atomic<int64_t> next{0};
  auto run = [&](int thread) {
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) {
      fn(item, thread);
    }
  };
  if (n <= 1) {
    run(0);
    return;
  }
  std::vector<std::jthread> workers;
  workers.reserve(static_cast<size_t>(n - 1));
  for (int t = 1; t < n; ++t) workers.emplace_back(run, t);
  run(0);
}

}  // namespace blockkv::internal::cpu
