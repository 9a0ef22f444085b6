// SPDX-License-Identifier: Apache-2.0
// DType: element sizes, names and DeepSpeed's aliases.
#include "blockkv/dtype.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string_view>
#include <utility>
#include <vector>

#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::HasSubstr;

TEST(DTypeTest, ElementSizes) {
  EXPECT_EQ(ElementSize(DType::kFloat32), 4u);
  EXPECT_EQ(ElementSize(DType::kFloat16), 2u);
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2u);
  EXPECT_EQ(ElementSize(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(ElementSize(DType::kInt8), 1u);
  EXPECT_EQ(ElementSize(DType::kInt32), 4u);
  EXPECT_EQ(ElementSize(DType::kInt64), 8u);
}

TEST(DTypeTest, CanonicalNamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                  DType::kInt8, DType::kInt32, DType::kInt64}) {
    EXPECT_TRUE(IsValidDType(d));
    Result<DType> parsed = ParseDType(DTypeName(d));
    ASSERT_OK(parsed);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(DTypeName(DType::kFloat8E4M3), "fp8_e4m3");
  EXPECT_EQ(DTypeName(DType::kInt64), "int64");
}

TEST(DTypeTest, ParsesEveryAlias) {
  const std::vector<std::pair<std::string_view, DType>> aliases = {
      {"fp32", DType::kFloat32},        {"float32", DType::kFloat32},
      {"float", DType::kFloat32},       {"fp16", DType::kFloat16},
      {"half", DType::kFloat16},        {"float16", DType::kFloat16},
      {"bf16", DType::kBFloat16},       {"bfloat16", DType::kBFloat16},
      {"fp8_e4m3", DType::kFloat8E4M3}, {"float8_e4m3fn", DType::kFloat8E4M3},
      {"int8", DType::kInt8},           {"int32", DType::kInt32},
      {"int64", DType::kInt64},
  };
  for (const auto& [name, dtype] : aliases) {
    Result<DType> parsed = ParseDType(name);
    ASSERT_OK(parsed) << name;
    EXPECT_EQ(*parsed, dtype) << name;
  }
}

TEST(DTypeTest, UnknownNameIsInvalidArgumentNamingIt) {
  for (std::string_view bad : {"fp64", "", "fp16 ", "torch.float16"}) {
    Result<DType> parsed = ParseDType(bad);
    ASSERT_CODE(parsed, StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr(std::string("'").append(bad).append("'")));
  }
}

TEST(DTypeTest, CastFromBadIntegerIsNotValid) {
  EXPECT_FALSE(IsValidDType(static_cast<DType>(7)));
  EXPECT_FALSE(IsValidDType(static_cast<DType>(-1)));
}

TEST(DTypeDeathTest, ElementSizeOfInvalidDTypeAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH((void)ElementSize(static_cast<DType>(99)), "invalid DType");
}

}  // namespace
}  // namespace blockkv
