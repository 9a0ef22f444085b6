// SPDX-License-Identifier: Apache-2.0
// AppendKV and PagedAttention on the CPU against a dense double-precision reference
// (tests/unit/kernels_reference.h): DeepSpeed's kernel-test shapes, GQA ratios, every head size
// and dtype, mixed prefill + decode, contexts past 256 blocks, sliding windows over released
// blocks, rotary (full and partial), padded batches, the fp8 codec, and every error path.
// Inputs are random with a fresh seed per run, printed on failure; outputs are poisoned (NaN)
// first so full coverage is checked.
#include "blockkv/kernels.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "unit/kernels_reference.h"
#include "unit/test_util.h"

// Cases are designated initializers that name only what differs from the defaults.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace blockkv {
namespace {

using ::blockkv_test::AttentionCase;
using ::blockkv_test::BatchSetup;
using ::blockkv_test::HostTensor;
using ::blockkv_test::KernelBatch;
using ::blockkv_test::SeqSpec;
using ::testing::HasSubstr;

uint32_t FreshSeed() { return std::random_device{}(); }

std::string Describe(const std::vector<SeqSpec>& seqs) {
  std::ostringstream os;
  for (const SeqSpec& s : seqs) os << "(" << s.n << "," << s.history << ")";
  return os.str();
}

// What torch's DLPack export gives a tensor: stride 1 for every dimension of extent 1.
TensorView TorchStrides(TensorView t) {
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 1) t.strides[i] = 1;
  }
  return t;
}

// Appends random K/V for the batch's new tokens, runs attention into a poisoned out, and checks
// it against the reference. torch_strides: every tensor (cache included) as torch exports it.
void RunAttention(const AttentionCase& c, bool torch_strides = false) {
  const uint32_t seed = FreshSeed();
  std::ostringstream trace;
  trace << "seed " << seed << " seqs " << Describe(c.seqs) << " D " << c.setup.head_size << " Hq "
        << c.q_heads << " Hkv " << c.setup.num_kv_heads << " act " << DTypeName(c.act)
        << " fp8 cache " << (c.setup.cache_dtype == DType::kFloat8E4M3);
  SCOPED_TRACE(trace.str());
  BatchSetup setup = c.setup;
  if (setup.cache_dtype != DType::kFloat8E4M3) setup.cache_dtype = c.act;
  KernelBatch kb(setup, c.seqs, seed);
  const int64_t rows = kb.rows();
  HostTensor q(c.act, rows, c.q_heads, c.setup.head_size);
  HostTensor k(c.act, rows, c.setup.num_kv_heads, c.setup.head_size);
  HostTensor v(c.act, rows, c.setup.num_kv_heads, c.setup.head_size);
  HostTensor out(c.act, rows, c.q_heads, c.setup.head_size);
  q.Fill(kb.rng());
  k.Fill(kb.rng());
  v.Fill(kb.rng());
  out.Poison();
  auto as_given = [&](const TensorView& t) { return torch_strides ? TorchStrides(t) : t; };
  const TensorView qv = as_given(q.view);
  AppendKVOptions append{.rotary = c.rotary, .q = &qv, .kv_scale = c.options.kv_scale};
  ASSERT_OK(AppendKV(as_given(kb.cache()), as_given(k.view), as_given(v.view), kb.batch(), append));
  ASSERT_OK(PagedAttention(qv, as_given(kb.cache()), kb.batch(), as_given(out.view), c.options));
  const std::vector<double> ref = blockkv_test::ReferenceAttention(kb, q, c.options);
  EXPECT_LE(blockkv_test::RelativeError(out, ref, kb.tokens()),
            blockkv_test::Tolerance(c.act, c.setup.cache_dtype));
}

const std::vector<SeqSpec> kSingleBlock[] = {{{1, 0}}, {{17, 0}}, {{33, 8}}, {{63, 1}}};
const std::vector<SeqSpec> kSeveralBlocks[] = {{{128, 0}}, {{177, 0}}, {{169, 8}}, {{117, 88}}};
const std::vector<SeqSpec> kSeveralSequences = {{128, 0}, {177, 0}, {169, 8}, {117, 88},
                                                {1, 293}, {1, 733}, {1, 33}};

TEST(PagedAttention, DeepSpeedSingleBlockShapesEveryHeadSize) {
  for (int64_t d : {64, 80, 96, 128, 256}) {
    for (const auto& seqs : kSingleBlock) {
      RunAttention({.setup = {.num_kv_heads = 2, .head_size = d}, .seqs = seqs, .q_heads = 2});
    }
  }
}

TEST(PagedAttention, DeepSpeedSeveralBlockShapes) {
  for (const auto& seqs : kSeveralBlocks) {
    RunAttention({.setup = {.num_kv_heads = 2, .head_size = 64}, .seqs = seqs, .q_heads = 4});
  }
}

TEST(PagedAttention, DeepSpeedSeveralSequencesMixPrefillAndDecode) {
  RunAttention({.setup = {.num_kv_heads = 2, .head_size = 128},
                .seqs = kSeveralSequences,
                .q_heads = 2,
                .act = DType::kBFloat16});
}

TEST(PagedAttention, GroupedQueryAttentionRatios) {
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{32, 8}, {64, 16}, {40, 8}}) {
    RunAttention({.setup = {.block_size = 16, .num_kv_heads = hkv, .head_size = 128},
                  .seqs = {{1, 100}, {9, 30}, {1, 7}},
                  .q_heads = hq});
  }
}

// Issue 17: a KV head with more than 64 query heads (Falcon-7B: 71 query heads, 1 KV head) ran
// past a fixed array of row blocks. Groups 1 to 128, decode and prefill, every dtype, 1 and 2
// threads.
TEST(PagedAttention, GqaGroupsUpTo128DecodeAndPrefill) {
  for (int64_t g : {1, 2, 7, 64, 65, 71, 128}) {
    for (DType act : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (int threads : {1, 2}) {
        AttentionCase c{.setup = {.block_size = 16, .num_kv_heads = 1, .head_size = 64},
                        .seqs = {{1, 40}, {3, 20}, {1, 0}},
                        .q_heads = g,
                        .act = act};
        c.options.num_threads = threads;
        RunAttention(c);
      }
    }
  }
}

TEST(PagedAttention, Falcon7BShapeEveryHeadSizeAndFp8AndTwoKVHeads) {
  for (int64_t d : {64, 80, 96, 128, 256}) {
    RunAttention({.setup = {.block_size = 16, .num_kv_heads = 1, .head_size = d},
                  .seqs = {{1, 33}, {17, 0}},
                  .q_heads = 71});
  }
  AttentionCase fp8{.setup = {.block_size = 16,
                              .num_kv_heads = 1,
                              .head_size = 64,
                              .cache_dtype = DType::kFloat8E4M3},
                    .seqs = {{1, 33}, {5, 2}},
                    .q_heads = 71};
  fp8.options.kv_scale = 0.01f;
  RunAttention(fp8);
  RunAttention({.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = 64},
                .seqs = {{1, 50}, {4, 9}},
                .q_heads = 142});
}

// Issue 17: torch exports extent-1 dimensions with stride 1 ([1, 128, 1] for one token of one KV
// head); such strides mean nothing. One token, one sequence, one KV head, blocks of one token.
TEST(PagedAttention, TorchStridesOfExtentOneDimensionsAreAccepted) {
  for (int32_t block_size : {1, 16}) {
    for (int64_t hkv : {1, 2}) {
      for (const std::vector<SeqSpec>& seqs :
           {std::vector<SeqSpec>{{1, 0}}, std::vector<SeqSpec>{{1, 9}},
            std::vector<SeqSpec>{{3, 2}}}) {
        RunAttention({.setup = {.block_size = block_size, .num_kv_heads = hkv, .head_size = 64},
                      .seqs = seqs,
                      .q_heads = hkv},
                     /*torch_strides=*/true);
      }
    }
  }
}

TEST(PagedAttention, EveryDTypeAndCacheDType) {
  const std::vector<SeqSpec> seqs = {{1, 70}, {20, 5}, {1, 0}};
  for (DType act : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType cache : {act, DType::kFloat8E4M3}) {
      for (int64_t d : {80, 128}) {
        AttentionCase c{
            .setup = {.block_size = 16, .num_kv_heads = 2, .head_size = d, .cache_dtype = cache},
            .seqs = seqs,
            .q_heads = 4,
            .act = act};
        if (cache == DType::kFloat8E4M3) c.options.kv_scale = 0.01f;
        RunAttention(c);
      }
    }
  }
}

TEST(PagedAttention, ContextsLongerThan256Blocks) {
  // 2,100 tokens of history in blocks of 8: 263 blocks (DeepSpeed's kernel stops at 256).
  RunAttention({.setup = {.block_size = 8,
                          .num_kv_heads = 1,
                          .head_size = 64,
                          .cache_dtype = DType::kFloat32},
                .seqs = {{1, 2100}, {3, 2050}},
                .q_heads = 2,
                .act = DType::kFloat32});
}

TEST(PagedAttention, NonCausalSeesEveryKeyOfTheSequence) {
  AttentionCase c{.setup = {.block_size = 16,
                            .num_kv_heads = 2,
                            .head_size = 64,
                            .cache_dtype = DType::kFloat32},
                  .seqs = {{20, 10}, {5, 0}},
                  .q_heads = 2,
                  .act = DType::kFloat32};
  c.options.causal = false;
  c.options.scale = 0.5f;
  RunAttention(c);
}

TEST(PagedAttention, SlidingWindow) {
  for (int64_t window : {1, 17, 64, 1000}) {
    AttentionCase c{.setup = {.block_size = 16,
                              .num_kv_heads = 2,
                              .head_size = 96,
                              .cache_dtype = DType::kFloat32},
                    .seqs = {{40, 90}, {1, 300}, {3, 0}},
                    .q_heads = 4,
                    .act = DType::kFloat32};
    c.options.sliding_window = window;
    RunAttention(c);
  }
}

TEST(PagedAttention, SlidingWindowReadsNoReleasedBlock) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const BatchSetup setup{
      .block_size = 16, .num_kv_heads = 1, .head_size = 64, .cache_dtype = DType::kFloat32};
  KernelBatch kb(setup, {{1, 300}}, seed);
  // Window 100 at position 300 needs keys from 201: blocks 0..11 (tokens < 192) can go.
  ASSERT_OK(kb.manager().FreeLeadingBlocks(0, 12));
  kb.Rebuild();
  HostTensor q(DType::kFloat32, kb.rows(), 1, 64);
  HostTensor out(DType::kFloat32, kb.rows(), 1, 64);
  q.Fill(kb.rng());
  out.Poison();
  AttentionOptions options{.sliding_window = 100};
  ASSERT_OK(PagedAttention(q.view, kb.cache(), kb.batch(), out.view, options));
  EXPECT_LE(blockkv_test::RelativeError(out, blockkv_test::ReferenceAttention(kb, q, options), 1),
            1e-5);
  options.sliding_window = 120;  // needs keys from 181: block 11 was released
  const Status status = PagedAttention(q.view, kb.cache(), kb.batch(), out.view, options);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("block 11"));
  EXPECT_CODE(PagedAttention(q.view, kb.cache(), kb.batch(), out.view, {}),
              StatusCode::kFailedPrecondition);
}

TEST(PagedAttention, PaddedBatchLeavesPaddedRowsUntouched) {
  AttentionCase c{.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = 64, .padding = true},
                  .seqs = {{5, 3}, {1, 40}},
                  .q_heads = 2};
  RunAttention(c);  // 6 real rows of 64; RelativeError checks the 58 others are still NaN
}

TEST(PagedAttention, RotaryFullAndPartialThroughAppendKV) {
  for (auto [d, rd] : {std::pair<int64_t, int32_t>{64, 0}, {80, 64}, {96, 64}, {128, 32}}) {
    AttentionCase c{.setup = {.block_size = 16,
                              .num_kv_heads = 2,
                              .head_size = d,
                              .cache_dtype = DType::kFloat32},
                    .seqs = {{17, 15}, {1, 63}},
                    .q_heads = 4,
                    .act = DType::kFloat32,
                    .rotary = {.enabled = true, .rotary_dim = rd}};
    RunAttention(c);
  }
}

TEST(PagedAttention, ThreadCountsAgree) {
  for (int threads : {1, 3}) {
    AttentionCase c{.setup = {.block_size = 16,
                              .num_kv_heads = 4,
                              .head_size = 64,
                              .cache_dtype = DType::kFloat32},
                    .seqs = {{64, 100}, {1, 500}, {1, 20}},
                    .q_heads = 8,
                    .act = DType::kFloat32};
    c.options.num_threads = threads;
    RunAttention(c);
  }
}

// The decode path that reads fp16/bf16/fp32 rows in place (up to 8 query rows per KV head) and
// its edges: head sizes that end in half a vector (80), groups that leave a partial block of 4
// rows (G = 1, 5) or need two (G = 8), one key, tiles that end inside a block of four keys (31,
// 33 keys), long contexts, two-token steps whose rows see different keys of the last tile (and,
// with G = 5 or 8, more than 8 rows: the fp32 copy), and windows that start inside a tile.
TEST(PagedAttention, InPlaceRowsEdgeCases) {
  for (DType act : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (int64_t d : {64, 80, 96, 128, 256}) {
      for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{2, 2}, {8, 2}, {10, 2}, {16, 2}}) {
        RunAttention({.setup = {.block_size = 16, .num_kv_heads = hkv, .head_size = d},
                      .seqs = {{1, 0}, {1, 30}, {1, 32}, {2, 31}, {1, 1500}},
                      .q_heads = hq,
                      .act = act});
      }
    }
    for (int64_t window : {3, 40}) {
      AttentionCase c{.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = 128},
                      .seqs = {{1, 100}, {2, 45}, {1, 2}},
                      .q_heads = 8,
                      .act = act};
      c.options.sliding_window = window;
      RunAttention(c);
    }
  }
}

// Each SIMD target compiled into the kernels, not only the one this machine picks: vectors of 16
// floats (AVX-512), 8 (AVX2), 4 (SSE4) and 1 (scalar) take different paths to the same sums.
TEST(PagedAttention, EverySimdTargetAgrees) {
  const int64_t supported = hwy::SupportedTargets();
  for (int64_t target : {HWY_AVX3, HWY_AVX2, HWY_SSE4, HWY_SCALAR}) {
    if ((supported & target) == 0) continue;
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    for (DType act : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (int64_t d : {80, 128}) {
        RunAttention({.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = d},
                      .seqs = {{1, 70}, {20, 5}, {2, 33}, {1, 0}},
                      .q_heads = 10,
                      .act = act});
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(PagedAttention, EmptyBatchIsOk) {
  KernelBatch kb({.num_kv_heads = 2}, {}, 1);
  HostTensor q(DType::kFloat16, 0, 2, 64);
  EXPECT_OK(PagedAttention(q.view, kb.cache(), kb.batch(), q.view));
  EXPECT_OK(AppendKV(kb.cache(), q.view, q.view, kb.batch()));
}

}  // namespace
}  // namespace blockkv
