// SPDX-License-Identifier: Apache-2.0
// Element types of a KV cache and of the index arrays blockkv hands to kernels, and their sizes.
#pragma once

#include <cstddef>
#include <string_view>

#include "blockkv/status.h"

namespace blockkv {

// kInt32 / kInt64 type the index arrays of a RaggedBatch (block tables, slot mappings); they were
// appended so the earlier values keep their numbers.
enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3, kInt8, kInt32, kInt64 };

// Bytes per element: 4, 2, 2, 1, 1, 4, 8. REQUIRES: `dtype` is one of the enumerators.
size_t ElementSize(DType dtype);

// "fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int32", "int64": the canonical short name.
std::string_view DTypeName(DType dtype);

// True when `dtype` holds one of the enumerators (a cast from a bad integer does not).
bool IsValidDType(DType dtype);

// Accepts DeepSpeed's aliases: "fp32", "float32", "float", "fp16", "half", "float16", "bf16",
// "bfloat16", "fp8_e4m3", "float8_e4m3fn", "int8"; and "int32", "int64". kInvalidArgument names
// the bad string.
Result<DType> ParseDType(std::string_view name);

}  // namespace blockkv
