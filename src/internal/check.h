// SPDX-License-Identifier: Apache-2.0
// BLOCKKV_CHECK: an always-on assertion for what only a bug inside blockkv can cause. It prints
// the condition, the place and a message, then aborts. Never for what a caller can cause: that
// is a Status.
#pragma once

namespace blockkv::internal {
[[noreturn]] void CheckFailure(const char* condition, const char* file, int line,
                               const char* message);
}  // namespace blockkv::internal

#define BLOCKKV_CHECK(condition, message)                                           \
  do {                                                                              \
    if (!(condition)) [[unlikely]] {                                                \
      ::blockkv::internal::CheckFailure(#condition, __FILE__, __LINE__, (message)); \
    }                                                                               \
  } while (false)
