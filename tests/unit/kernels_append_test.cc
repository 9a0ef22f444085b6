// SPDX-License-Identifier: Apache-2.0
// AppendKV on the CPU: DeepSpeed's test_blocked_kv_copy / test_blocked_rotary_emb scenarios (each
// slot holds exactly its token's K and V, nothing else in the cache changes, Q rotated in place),
// the fp8 e4m3 codec, and every argument check of both kernels (each failing call changes
// nothing).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/kernels.h"
#include "internal/float_convert.h"
#include "unit/kernels_reference.h"
#include "unit/test_util.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace blockkv {
namespace {

using ::blockkv_test::BatchSetup;
using ::blockkv_test::Decode;
using ::blockkv_test::HostTensor;
using ::blockkv_test::KernelBatch;
using ::blockkv_test::SeqSpec;
using ::testing::HasSubstr;

uint32_t FreshSeed() { return std::random_device{}(); }

std::vector<uint8_t> Snapshot(const TensorView& cache) {
  const auto* p = static_cast<const uint8_t*>(cache.data);
  return {p, p + cache.numel() * static_cast<int64_t>(ElementSize(cache.dtype))};
}

// Runs AppendKV and checks every slot against k / v (rotated by the reference when asked), q
// against its rotation, and that no other byte of the cache changed.
// torch_strides: k, v, q and the cache as torch exports them (stride 1 for extent-1 dimensions).
void CheckAppend(const BatchSetup& setup, const std::vector<SeqSpec>& seqs, DType act,
                 const AppendKVOptions& base, int64_t q_heads, bool torch_strides = false) {
  const uint32_t seed = FreshSeed();
  std::ostringstream trace;
  trace << "seed " << seed << " D " << setup.head_size << " act " << DTypeName(act) << " cache "
        << DTypeName(setup.cache_dtype) << " rotary " << base.rotary.enabled << " dim "
        << base.rotary.rotary_dim;
  SCOPED_TRACE(trace.str());
  KernelBatch kb(setup, seqs, seed);
  const int64_t d = setup.head_size;
  const int64_t hkv = setup.num_kv_heads;
  HostTensor k(act, kb.rows(), hkv, d), v(act, kb.rows(), hkv, d), q(act, kb.rows(), q_heads, d);
  k.Fill(kb.rng());
  v.Fill(kb.rng());
  q.Fill(kb.rng());
  const HostTensor q_before = q;
  std::vector<uint8_t> expected = Snapshot(kb.cache());
  auto as_given = [&](TensorView t) {
    for (int i = 0; torch_strides && i < t.ndim; ++i) {
      if (t.shape[i] == 1) t.strides[i] = 1;
    }
    return t;
  };
  const TensorView qv = as_given(q.view);
  AppendKVOptions options = base;
  options.q = &qv;
  ASSERT_OK(
      AppendKV(as_given(kb.cache()), as_given(k.view), as_given(v.view), kb.batch(), options));

  const double tol = blockkv_test::Tolerance(act, setup.cache_dtype);
  const int64_t rd = base.rotary.rotary_dim == 0 ? d : base.rotary.rotary_dim;
  const TensorView& c = kb.cache();
  const size_t elem = ElementSize(c.dtype);
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int64_t j = 0; j < seqs[i].n; ++j) {
      const int64_t pos = seqs[i].history + j;
      const int64_t row = kb.Row(i, j);
      auto check = [&](const HostTensor& x, int64_t heads, int plane, bool rotate,
                       const HostTensor* got) {
        for (int64_t h = 0; h < heads; ++h) {
          std::vector<double> want(static_cast<size_t>(d));
          for (int64_t e = 0; e < d; ++e)
            want[static_cast<size_t>(e)] = x.at((row * heads + h) * d + e);
          if (rotate) blockkv_test::ReferenceRotate(want, pos, rd, base.rotary.theta);
          for (int64_t e = 0; e < d; ++e) {
            const double w = want[static_cast<size_t>(e)];
            double g = 0;
            if (got != nullptr) {
              g = got->at((row * heads + h) * d + e);
            } else {
              const int64_t at = kb.CacheIndex(i, pos, plane, h) + e;
              g = Decode(c.data, at, c.dtype, base.kv_scale);
              std::memcpy(expected.data() + at * static_cast<int64_t>(elem),
                          static_cast<const uint8_t*>(c.data) + at * static_cast<int64_t>(elem),
                          elem);
            }
            // Other dtypes round once; fp8 e4m3 to half a unit of its 3-bit mantissa (2^-4
            // relative), and to 2^-10 · kv_scale among the subnormals.
            const double bound = c.dtype == DType::kFloat8E4M3 && got == nullptr
                                     ? std::max(0.0626 * std::abs(w), 0.001 * base.kv_scale)
                                     : tol * std::max(1.0, std::abs(w));
            ASSERT_LE(std::abs(g - w), bound) << "seq " << i << " token " << j << " head " << h
                                              << " elem " << e << " plane " << plane;
          }
        }
      };
      check(k, hkv, 0, base.rotary.enabled, nullptr);
      check(v, hkv, 1, false, nullptr);
      if (base.rotary.enabled) check(q_before, q_heads, -1, true, &q);
    }
  }
  EXPECT_TRUE(Snapshot(kb.cache()) == expected) << "bytes outside the new slots changed";
  if (!base.rotary.enabled) {
    EXPECT_TRUE(q.bytes == q_before.bytes) << "q changed without rotary";
  }
}

const std::vector<SeqSpec> kCopyCases[] = {
    {{1, 0}},
    {{17, 0}},
    {{33, 8}},
    {{63, 1}},
    {{128, 0}},
    {{177, 0}},
    {{169, 8}},
    {{117, 88}},
    {{128, 0}, {177, 0}, {169, 8}, {117, 88}, {1, 293}, {1, 733}, {1, 33}}};

TEST(AppendKV, DeepSpeedCopyShapesEveryHeadSize) {
  for (int64_t d : {64, 80, 96, 128, 256}) {
    for (const auto& seqs : kCopyCases) {
      CheckAppend({.num_kv_heads = 4, .head_size = d}, seqs, DType::kFloat16, {}, 4);
    }
  }
}

TEST(AppendKV, DeepSpeedRotaryShapesFullAndPartial) {
  const std::vector<SeqSpec> cases[] = {{{1, 0}},    {{17, 0}},
                                        {{33, 15}},  {{1, 63}},
                                        {{117, 88}}, {{128, 0}, {1, 293}, {1, 733}, {169, 8}}};
  for (auto [d, rd] : {std::pair<int64_t, int32_t>{64, 0}, {80, 0}, {96, 0}, {80, 64}, {96, 64}}) {
    for (const auto& seqs : cases) {
      for (DType act : {DType::kFloat32, DType::kFloat16}) {
        CheckAppend({.num_kv_heads = 2, .head_size = d, .cache_dtype = act}, seqs, act,
                    {.rotary = {.enabled = true, .rotary_dim = rd}}, 4);
      }
    }
  }
}

TEST(AppendKV, EveryDTypeFp8CacheAndPadding) {
  for (DType act : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType cache : {act, DType::kFloat8E4M3}) {
      for (bool padding : {false, true}) {
        CheckAppend({.block_size = 16,
                     .num_kv_heads = 2,
                     .head_size = 128,
                     .cache_dtype = cache,
                     .padding = padding},
                    {{5, 30}, {1, 16}, {40, 0}}, act,
                    {.rotary = {.enabled = cache == DType::kFloat8E4M3, .theta = 500000.0},
                     .kv_scale = cache == DType::kFloat8E4M3 ? 0.25f : 1.0f},
                    8);
      }
    }
  }
}

// Issue 17: one token, one sequence, one KV head, blocks of one token, with torch's strides.
TEST(AppendKV, TorchStridesOfExtentOneDimensionsAreAccepted) {
  for (int32_t block_size : {1, 16}) {
    for (const std::vector<SeqSpec>& seqs :
         {std::vector<SeqSpec>{{1, 0}}, std::vector<SeqSpec>{{1, 9}},
          std::vector<SeqSpec>{{2, 3}}}) {
      CheckAppend({.block_size = block_size, .num_kv_heads = 1, .head_size = 64}, seqs,
                  DType::kFloat16, {.rotary = {.enabled = true}}, 1, /*torch_strides=*/true);
    }
  }
}

TEST(AppendKV, ManyThreadsWriteTheSame) {
  CheckAppend(
      {.block_size = 16, .num_kv_heads = 8, .head_size = 128, .cache_dtype = DType::kBFloat16},
      {{700, 0}, {300, 40}}, DType::kBFloat16, {.num_threads = 4}, 8);
}

TEST(Fp8E4M3, DecodeTableKnownCodes) {
  using internal::Fp8E4M3ToFloat;
  EXPECT_EQ(Fp8E4M3ToFloat(0x00), 0.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), 0.015625f);     // smallest normal, 2^-6
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);  // smallest subnormal, 2^-9
  EXPECT_EQ(Fp8E4M3ToFloat(0x3C), 1.5f);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xFF)));
}

TEST(Fp8E4M3, EncoderRoundsToNearestEvenAndSaturates) {
  using internal::FloatToFp8E4M3;
  for (int code = 0; code < 256; ++code) {  // every finite code round-trips
    if ((code & 0x7F) == 0x7F) continue;
    const float value = internal::Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (value == 0.0f) continue;  // -0 and +0
    EXPECT_EQ(FloatToFp8E4M3(value), code) << value;
  }
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);  // tie between 1 and 1.125: even (1)
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3A);  // tie between 1.125 and 1.25: even (1.25)
  EXPECT_EQ(FloatToFp8E4M3(1.07f), 0x39);    // past the tie
  EXPECT_EQ(FloatToFp8E4M3(460.0f), 0x7E);   // saturates at 448
  EXPECT_EQ(FloatToFp8E4M3(1e9f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(0.0009765625f), 0x00);   // 2^-10: tie between 0 and 2^-9, even
  EXPECT_EQ(FloatToFp8E4M3(0.00146484375f), 0x01);  // 1.5 · 2^-10 rounds up
  EXPECT_EQ(FloatToFp8E4M3(0.0146484375f), 0x08);   // 7.5 · 2^-9: to 8 (the smallest normal)
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

TEST(HalfConversions, RoundToNearestEven) {
  EXPECT_EQ(internal::FloatToFp16(1.0f), 0x3C00);
  EXPECT_EQ(internal::FloatToFp16(65504.0f), 0x7BFF);
  EXPECT_EQ(internal::FloatToFp16(65520.0f), 0x7C00);
  EXPECT_EQ(internal::FloatToFp16(5.9604644775390625e-8f), 0x0001);
  EXPECT_EQ(internal::FloatToFp16(1.0f + 1.0f / 2048), 0x3C00);  // tie: even
  EXPECT_EQ(internal::FloatToFp16(1.0f + 3.0f / 2048), 0x3C02);
  EXPECT_EQ(internal::Fp16ToFloat(0x0001), 5.9604644775390625e-8f);
  EXPECT_EQ(internal::Fp16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(internal::FloatToBf16(1.0f + 1.0f / 256), 0x3F80);  // tie: even
  EXPECT_EQ(internal::FloatToBf16(1.0f + 3.0f / 256), 0x3F82);
  EXPECT_EQ(internal::Bf16ToFloat(0x3F80), 1.0f);
}

}  // namespace
}  // namespace blockkv
