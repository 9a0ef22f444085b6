// SPDX-License-Identifier: Apache-2.0
// Overflow-checked arithmetic on sizes. Every product that sizes memory goes through these.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace blockkv::internal {

// a · b, or nullopt when it does not fit in int64.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The product of all factors, or nullopt on overflow.
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

}  // namespace blockkv::internal
