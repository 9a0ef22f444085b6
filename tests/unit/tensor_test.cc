// SPDX-License-Identifier: Apache-2.0
// TensorView: numel, contiguity, ContiguousView and SplitKV.
#include "blockkv/tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::HasSubstr;

TEST(TensorViewTest, NumelIsTheProductOfTheShape) {
  TensorView t = ContiguousView(nullptr, DType::kFloat32, DeviceKind::kCpu, 0, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  TensorView scalar;
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.numel(), 1);
  TensorView empty = ContiguousView(nullptr, DType::kFloat32, DeviceKind::kCpu, 0, {5, 0, 3});
  EXPECT_EQ(empty.numel(), 0);
}

TEST(TensorViewTest, ContiguousViewHasRowMajorStrides) {
  int8_t storage[1];
  TensorView t = ContiguousView(storage, DType::kInt8, DeviceKind::kCuda, 3, {2, 3, 4, 5});
  EXPECT_EQ(t.data, storage);
  EXPECT_EQ(t.dtype, DType::kInt8);
  EXPECT_EQ(t.device, DeviceKind::kCuda);
  EXPECT_EQ(t.device_ordinal, 3);
  EXPECT_EQ(t.ndim, 4);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(3), 5);
  EXPECT_EQ(t.stride(0), 60);
  EXPECT_EQ(t.stride(1), 20);
  EXPECT_EQ(t.stride(2), 5);
  EXPECT_EQ(t.stride(3), 1);
  EXPECT_TRUE(t.is_contiguous());
}

TEST(TensorViewTest, IsContiguousDetectsOtherStrides) {
  TensorView t = ContiguousView(nullptr, DType::kFloat16, DeviceKind::kCpu, 0, {4, 6});
  TensorView transposed = t;
  transposed.shape = {6, 4};
  transposed.strides = {1, 6};
  EXPECT_FALSE(transposed.is_contiguous());
  TensorView sliced = t;
  sliced.strides[0] = 12;  // every other row
  EXPECT_FALSE(sliced.is_contiguous());
  // A dimension of extent 1 may have any stride.
  TensorView unit = ContiguousView(nullptr, DType::kFloat16, DeviceKind::kCpu, 0, {1, 6});
  unit.strides[0] = 1000;
  EXPECT_TRUE(unit.is_contiguous());
}

TEST(SplitKVTest, SplitsKAndVPlanesWithoutCopy) {
  // [num_blocks=3, block_size=4, 2, H=2, D=5] fp32
  std::vector<float> data(3 * 4 * 2 * 2 * 5);
  TensorView kv =
      ContiguousView(data.data(), DType::kFloat32, DeviceKind::kCpu, 0, {3, 4, 2, 2, 5});
  Result<std::pair<TensorView, TensorView>> split = SplitKV(kv);
  ASSERT_OK(split);
  const auto& [k, v] = *split;
  for (const TensorView* t : {&k, &v}) {
    EXPECT_EQ(t->ndim, 4);
    EXPECT_EQ(t->dtype, DType::kFloat32);
    EXPECT_EQ(t->shape[0], 3);
    EXPECT_EQ(t->shape[1], 4);
    EXPECT_EQ(t->shape[2], 2);
    EXPECT_EQ(t->shape[3], 5);
    EXPECT_EQ(t->stride(0), 4 * 2 * 2 * 5);
    EXPECT_EQ(t->stride(1), 2 * 2 * 5);  // 2·H·D
    EXPECT_EQ(t->stride(2), 5);
    EXPECT_EQ(t->stride(3), 1);
    EXPECT_FALSE(t->is_contiguous());
  }
  EXPECT_EQ(k.data, data.data());
  EXPECT_EQ(v.data, data.data() + 2 * 5);  // H·D elements later
}

TEST(SplitKVTest, KeepsDeviceOfTheCache) {
  TensorView kv =
      ContiguousView(nullptr, DType::kBFloat16, DeviceKind::kCuda, 1, {1, 16, 2, 8, 128});
  kv.data = reinterpret_cast<void*>(uintptr_t{1} << 20);
  Result<std::pair<TensorView, TensorView>> split = SplitKV(kv);
  ASSERT_OK(split);
  EXPECT_EQ(split->first.device, DeviceKind::kCuda);
  EXPECT_EQ(split->second.device_ordinal, 1);
  EXPECT_EQ(static_cast<char*>(split->second.data) - static_cast<char*>(split->first.data),
            8 * 128 * 2);
}

TEST(SplitKVTest, RejectsWrongRank) {
  for (auto shape : {std::vector<int64_t>{2, 2, 2, 2}, std::vector<int64_t>{1, 2, 2, 2, 2, 2}}) {
    TensorView t;
    t.ndim = static_cast<int>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
    Result<std::pair<TensorView, TensorView>> split = SplitKV(t);
    ASSERT_CODE(split, StatusCode::kInvalidArgument);
    EXPECT_THAT(split.status().message(), HasSubstr(std::to_string(shape.size())));
  }
}

TEST(SplitKVTest, RejectsKVDimensionOtherThanTwo) {
  TensorView t = ContiguousView(nullptr, DType::kFloat16, DeviceKind::kCpu, 0, {3, 4, 3, 2, 5});
  Result<std::pair<TensorView, TensorView>> split = SplitKV(t);
  ASSERT_CODE(split, StatusCode::kInvalidArgument);
  EXPECT_THAT(split.status().message(), HasSubstr("3"));
}

}  // namespace
}  // namespace blockkv
