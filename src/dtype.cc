// SPDX-License-Identifier: Apache-2.0
#include "blockkv/dtype.h"

#include <array>
#include <string>
#include <utility>

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

bool IsValidDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat8E4M3:
    case DType::kInt8:
    case DType::kInt32:
    case DType::kInt64:
      return true;
  }
  return false;
}

size_t ElementSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kInt8:
      return 1;
  }
  BLOCKKV_CHECK(false, "ElementSize of an invalid DType");
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
    case DType::kInt8:
      return "int8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "invalid";
}

Result<DType> ParseDType(std::string_view name) {
  static constexpr std::array<std::pair<std::string_view, DType>, 13> kNames{{
      {"fp32", DType::kFloat32},
      {"float32", DType::kFloat32},
      {"float", DType::kFloat32},
      {"fp16", DType::kFloat16},
      {"half", DType::kFloat16},
      {"float16", DType::kFloat16},
      {"bf16", DType::kBFloat16},
      {"bfloat16", DType::kBFloat16},
      {"fp8_e4m3", DType::kFloat8E4M3},
      {"float8_e4m3fn", DType::kFloat8E4M3},
      {"int8", DType::kInt8},
      {"int32", DType::kInt32},
      {"int64", DType::kInt64},
  }};
  for (const auto& [alias, dtype] : kNames) {
    if (alias == name) return dtype;
  }
  return InvalidArgumentError(internal::StrCat(
      "unknown dtype '", name, "'; expected one of fp32, float32, float, fp16, half, float16, ",
      "bf16, bfloat16, fp8_e4m3, float8_e4m3fn, int8, int32, int64"));
}

}  // namespace blockkv
