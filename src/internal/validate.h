// SPDX-License-Identifier: Apache-2.0
// Checks shared by the configs' Validate methods.
#pragma once

#include <cstdint>

#include "blockkv/status.h"
#include "internal/strings.h"

namespace blockkv::internal {

// OK when value > 0; else kInvalidArgument "<owner>.<field> must be > 0, got <value>".
inline Status CheckPositive(const char* owner, const char* field, int64_t value) {
  if (value > 0) return Status::Ok();
  return InvalidArgumentError(StrCat(owner, ".", field, " must be > 0, got ", value));
}

}  // namespace blockkv::internal
