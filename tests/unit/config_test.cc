// SPDX-License-Identifier: Apache-2.0
// KVCacheConfig and MemoryConfig: DeepSpeed's defaults and validation of every field.
#include "blockkv/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

KVCacheConfig ValidConfig() {
  KVCacheConfig c;
  c.block_size = 16;
  c.cache_shape = {4, 8, 64};
  return c;
}

TEST(KVCacheConfigTest, DefaultsMatchDeepSpeed) {
  KVCacheConfig c;
  EXPECT_EQ(c.block_size, 128);
  EXPECT_EQ(c.num_allocation_groups, 1);
  EXPECT_EQ(c.cache_dtype, DType::kFloat16);
  EXPECT_EQ(c.max_blocks_per_allocation_group, 64);
  EXPECT_EQ(c.cache_shape, (std::array<int64_t, 3>{0, 0, 0}));
  // cache_shape has no default in DeepSpeed either: a default config must be filled in.
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
}

TEST(MemoryConfigTest, DefaultsMatchDeepSpeed) {
  MemoryConfig m;
  EXPECT_EQ(m.mode, AllocationMode::kReserve);
  EXPECT_EQ(m.size, 1'000'000'000);
  EXPECT_OK(m.Validate());
}

TEST(KVCacheConfigTest, ValidConfigPasses) {
  KVCacheConfig c = ValidConfig();
  EXPECT_OK(c.Validate());
  EXPECT_EQ(c.num_caches(), 4);
  EXPECT_EQ(c.num_kv_heads(), 8);
  EXPECT_EQ(c.head_size(), 64);
}

TEST(KVCacheConfigTest, RejectsNonPositiveBlockSizeNamingFieldAndValue) {
  for (int32_t bad : {0, -1}) {
    KVCacheConfig c = ValidConfig();
    c.block_size = bad;
    Status s = c.Validate();
    EXPECT_CODE(s, StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("block_size"), HasSubstr(std::to_string(bad))));
  }
}

TEST(KVCacheConfigTest, RejectsEveryOtherNonPositiveField) {
  struct Case {
    const char* field;
    void (*set)(KVCacheConfig&, int32_t);
  };
  const Case cases[] = {
      {"num_allocation_groups", [](KVCacheConfig& c, int32_t v) { c.num_allocation_groups = v; }},
      {"num_caches", [](KVCacheConfig& c, int32_t v) { c.cache_shape[0] = v; }},
      {"num_kv_heads", [](KVCacheConfig& c, int32_t v) { c.cache_shape[1] = v; }},
      {"head_size", [](KVCacheConfig& c, int32_t v) { c.cache_shape[2] = v; }},
      {"max_blocks_per_allocation_group",
       [](KVCacheConfig& c, int32_t v) { c.max_blocks_per_allocation_group = v; }},
  };
  for (const Case& test : cases) {
    for (int32_t bad : {0, -1, INT32_MIN}) {
      KVCacheConfig c = ValidConfig();
      test.set(c, bad);
      Status s = c.Validate();
      EXPECT_CODE(s, StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(), AllOf(HasSubstr(test.field), HasSubstr(std::to_string(bad))));
    }
  }
}

TEST(KVCacheConfigTest, RejectsInvalidDTypeCast) {
  KVCacheConfig c = ValidConfig();
  c.cache_dtype = static_cast<DType>(17);
  Status s = c.Validate();
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("cache_dtype"), HasSubstr("17")));
  EXPECT_CODE(c.bytes_per_block(), StatusCode::kInvalidArgument);
}

TEST(KVCacheConfigTest, BytesPerBlockIsTheFullProduct) {
  KVCacheConfig c = ValidConfig();  // 4 layers, 16 tokens, 8 heads, 64 dims, fp16
  Result<int64_t> bytes = c.bytes_per_block();
  ASSERT_OK(bytes);
  EXPECT_EQ(*bytes, 4 * 16 * 2 * 8 * 64 * 2);
  EXPECT_EQ(c.elements_per_layer_block(), 16 * 2 * 8 * 64);
  c.cache_dtype = DType::kFloat32;
  EXPECT_EQ(*c.bytes_per_block(), 4 * 16 * 2 * 8 * 64 * 4);
}

TEST(KVCacheConfigTest, RejectsOverflowingProduct) {
  KVCacheConfig c = ValidConfig();
  c.cache_shape = {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 20};
  Status s = c.Validate();
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overflow"));
  EXPECT_CODE(c.bytes_per_block(), StatusCode::kInvalidArgument);

  // Exactly at the edge: 2^62 bytes fits, twice that does not.
  c.block_size = 1;
  c.cache_dtype = DType::kInt8;
  c.cache_shape = {int64_t{1} << 30, int64_t{1} << 30, 2};  // 2^30 · 1 · 2 · 2^30 · 2 · 1
  ASSERT_OK(c.bytes_per_block());
  EXPECT_EQ(*c.bytes_per_block(), int64_t{1} << 62);
  c.cache_shape[2] = 4;
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
}

TEST(MemoryConfigTest, RejectsNonPositiveSize) {
  for (AllocationMode mode : {AllocationMode::kReserve, AllocationMode::kAllocate}) {
    for (int64_t bad : {int64_t{0}, int64_t{-1}, INT64_MIN}) {
      MemoryConfig m{.mode = mode, .size = bad};
      Status s = m.Validate();
      EXPECT_CODE(s, StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(), AllOf(HasSubstr("size"), HasSubstr(std::to_string(bad))));
    }
  }
  EXPECT_OK((MemoryConfig{.mode = AllocationMode::kAllocate, .size = 1}).Validate());
}

TEST(MemoryConfigTest, RejectsInvalidModeCast) {
  MemoryConfig m{.mode = static_cast<AllocationMode>(9), .size = 10};
  EXPECT_CODE(m.Validate(), StatusCode::kInvalidArgument);
}

TEST(MemoryConfigTest, ModeNames) {
  EXPECT_STREQ(AllocationModeName(AllocationMode::kReserve), "reserve");
  EXPECT_STREQ(AllocationModeName(AllocationMode::kAllocate), "allocate");
}

}  // namespace
}  // namespace blockkv

namespace blockkv {
namespace {

TEST(KVCacheConfigDType, RejectsIndexTypesAsCacheElements) {
  for (DType index : {DType::kInt32, DType::kInt64}) {
    KVCacheConfig c;
    c.cache_shape = {1, 1, 8};
    c.cache_dtype = index;
    const Status s = c.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(std::string(DTypeName(index))), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace blockkv
