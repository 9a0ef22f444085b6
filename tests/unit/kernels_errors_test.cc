// SPDX-License-Identifier: Apache-2.0
// Every argument check of AppendKV and PagedAttention: the code, a message naming the value, and
// nothing written (cache, q and out compared byte for byte after each failed call).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "blockkv/kernels.h"
#include "unit/kernels_reference.h"
#include "unit/test_util.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace blockkv {
namespace {

using ::blockkv_test::HostTensor;
using ::blockkv_test::KernelBatch;
using ::testing::HasSubstr;

std::vector<uint8_t> Bytes(const TensorView& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  return {p, p + t.numel() * static_cast<int64_t>(ElementSize(t.dtype))};
}

// A decode + prefill batch of 2 KV heads, D 64, fp16, and valid tensors for it.
class KernelErrors : public ::testing::Test {
 protected:
  KernelErrors()
      : kb_({.block_size = 16, .num_kv_heads = 2, .head_size = 64}, {{3, 20}, {1, 5}}, 42),
        q_(DType::kFloat16, 4, 4, 64),
        k_(DType::kFloat16, 4, 2, 64),
        v_(DType::kFloat16, 4, 2, 64),
        out_(DType::kFloat16, 4, 4, 64) {
    q_.Fill(kb_.rng());
    k_.Fill(kb_.rng());
    v_.Fill(kb_.rng());
    out_.Poison();
  }

  // `call` fails with `code` and a message containing `text`, and writes nothing.
  void ExpectRejected(const std::function<Status()>& call, StatusCode code,
                      const std::string& text) {
    const std::vector<uint8_t> cache = Bytes(kb_.cache());
    const std::vector<uint8_t> q = q_.bytes;
    const std::vector<uint8_t> out = out_.bytes;
    const Status status = call();
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(status.message(), HasSubstr(text));
    EXPECT_TRUE(Bytes(kb_.cache()) == cache) << "the cache changed: " << status;
    EXPECT_TRUE(q_.bytes == q) << "q changed: " << status;
    EXPECT_TRUE(out_.bytes == out) << "out changed: " << status;
  }

  Status Append(const TensorView& cache, const AppendKVOptions& options = {}) {
    return AppendKV(cache, k_.view, v_.view, kb_.batch(), options);
  }
  Status Attend(const TensorView& q, const TensorView& cache,
                const AttentionOptions& options = {}) {
    return PagedAttention(q, cache, kb_.batch(), out_.view, options);
  }

  KernelBatch kb_;
  HostTensor q_, k_, v_, out_;
};

TEST_F(KernelErrors, ValidCallsSucceed) {
  EXPECT_OK(Append(kb_.cache(), {.rotary = {.enabled = true}, .q = &q_.view}));
  EXPECT_OK(Attend(q_.view, kb_.cache()));
}

TEST_F(KernelErrors, UnsupportedHeadSize) {
  TensorView cache = kb_.cache();
  cache.shape[4] = 72;
  ExpectRejected([&] { return Append(cache); }, StatusCode::kInvalidArgument, "head size 72");
  ExpectRejected([&] { return Attend(q_.view, cache); }, StatusCode::kInvalidArgument,
                 "head size 72");
}

TEST_F(KernelErrors, UnsupportedDTypes) {
  TensorView cache = kb_.cache();
  cache.dtype = DType::kInt8;
  ExpectRejected([&] { return Append(cache); }, StatusCode::kInvalidArgument, "int8");
  TensorView q = q_.view;
  q.dtype = DType::kFloat8E4M3;
  ExpectRejected([&] { return Attend(q, kb_.cache()); }, StatusCode::kInvalidArgument, "fp8_e4m3");
  q.dtype = DType::kBFloat16;  // bf16 queries over an fp16 cache
  ExpectRejected([&] { return Attend(q, kb_.cache()); }, StatusCode::kInvalidArgument, "bf16");
  TensorView k = k_.view;
  k.dtype = DType::kFloat32;
  ExpectRejected([&] { return AppendKV(kb_.cache(), k, v_.view, kb_.batch()); },
                 StatusCode::kInvalidArgument, "fp32");
}

TEST_F(KernelErrors, GqaRatio) {
  HostTensor q(DType::kFloat16, 4, 3, 64);
  HostTensor out(DType::kFloat16, 4, 3, 64);
  ExpectRejected([&] { return PagedAttention(q.view, kb_.cache(), kb_.batch(), out.view); },
                 StatusCode::kInvalidArgument, "query heads 3");
  ExpectRejected([&] { return Append(kb_.cache(), {.rotary = {.enabled = true}, .q = &q.view}); },
                 StatusCode::kInvalidArgument, "query heads 3");
}

TEST_F(KernelErrors, MoreQueryHeadsThanTheLimit) {
  HostTensor q(DType::kFloat16, 4, 65536, 64);  // 32,768 per KV head: a multiple, past 65,535
  ExpectRejected([&] { return Attend(q.view, kb_.cache()); }, StatusCode::kInvalidArgument,
                 "query heads 65536 exceed the limit of 65535");
}

TEST_F(KernelErrors, Shapes) {
  HostTensor k(DType::kFloat16, 5, 2, 64);  // T is 4
  ExpectRejected([&] { return AppendKV(kb_.cache(), k.view, v_.view, kb_.batch()); },
                 StatusCode::kInvalidArgument, "got shape [5, 2, 64]");
  HostTensor out(DType::kFloat16, 4, 2, 64);  // heads differ from q
  ExpectRejected([&] { return PagedAttention(q_.view, kb_.cache(), kb_.batch(), out.view); },
                 StatusCode::kInvalidArgument, "out must be [T, 4, 64]");
  TensorView cache = kb_.cache();
  cache.ndim = 4;
  ExpectRejected([&] { return Append(cache); }, StatusCode::kInvalidArgument, "layer_cache must");
  TensorView strided = q_.view;
  strided.strides[2] = 2;
  ExpectRejected([&] { return Attend(strided, kb_.cache()); }, StatusCode::kInvalidArgument,
                 "got strides [256, 64, 2]");
}

TEST_F(KernelErrors, AnAbsurdThreadCountIsClampedNotAllocated) {
  EXPECT_OK(Attend(q_.view, kb_.cache(), {.num_threads = 1 << 30}));
  EXPECT_OK(Append(kb_.cache(), {.num_threads = 1 << 28}));
}

TEST_F(KernelErrors, OverlappingOrBroadcastActivations) {
  // Work items write different (row, head) ranges in parallel: a head stride of 0 would make
  // them write one row from several threads (and rotate one q row four times).
  TensorView broadcast = q_.view;
  broadcast.strides[1] = 0;
  ExpectRejected(
      [&] { return Append(kb_.cache(), {.rotary = {.enabled = true}, .q = &broadcast}); },
      StatusCode::kInvalidArgument, "do not overlap");
  TensorView short_rows = out_.view;
  short_rows.strides[0] = 64;  // rows 64 elements apart, 4 heads of 64 each
  ExpectRejected([&] { return PagedAttention(q_.view, kb_.cache(), kb_.batch(), short_rows); },
                 StatusCode::kInvalidArgument, "do not overlap");
  // q rotated in place while k is read: they must not share memory.
  TensorView q_over_k = q_.view;
  q_over_k.data = k_.view.data;
  q_over_k.dtype = k_.view.dtype;
  ExpectRejected([&] { return Append(kb_.cache(), {.rotary = {.enabled = true}, .q = &q_over_k}); },
                 StatusCode::kInvalidArgument, "q and k overlap");
  ExpectRejected([&] { return PagedAttention(q_.view, kb_.cache(), kb_.batch(), q_.view); },
                 StatusCode::kInvalidArgument, "out and q overlap");
}

TEST_F(KernelErrors, ACacheViewThatIsNotALayerOfTheBatchsGroup) {
  TensorView cache = kb_.cache();
  cache.shape[1] = 8;  // the batch's group has blocks of 16
  cache.shape[0] *= 2;
  ExpectRejected([&] { return Append(cache); }, StatusCode::kInvalidArgument,
                 "not a layer of cache group 0");
  cache = kb_.cache();
  cache.shape[0] = 1;  // fewer blocks than the tables use
  ExpectRejected([&] { return Attend(q_.view, cache); }, StatusCode::kInvalidArgument,
                 "not a layer of cache group 0");
  // Inside the storage but not at a layer's start: the layer would run past the end.
  cache = kb_.cache();
  cache.data = static_cast<std::byte*>(cache.data) + 2;
  ExpectRejected([&] { return Attend(q_.view, cache); }, StatusCode::kInvalidArgument,
                 "not a layer of cache group 0");
}

TEST_F(KernelErrors, AnotherManagersCacheOfTheSameShape) {
  // Its block ids index this batch's manager's cache only: writing them into another cache
  // would overwrite blocks that cache handed out to its own sequences.
  KernelBatch other({.block_size = 16, .num_kv_heads = 2, .head_size = 64}, {{3, 20}, {1, 5}}, 7);
  const std::vector<uint8_t> before = Bytes(other.cache());
  ExpectRejected([&] { return Append(other.cache()); }, StatusCode::kInvalidArgument,
                 "not a layer of cache group 0");
  EXPECT_TRUE(Bytes(other.cache()) == before);
}

TEST_F(KernelErrors, Options) {
  ExpectRejected(
      [&] { return Append(kb_.cache(), {.rotary = {.enabled = true, .rotary_dim = 63}}); },
      StatusCode::kInvalidArgument, "rotary_dim 63");
  ExpectRejected(
      [&] { return Append(kb_.cache(), {.rotary = {.enabled = true, .rotary_dim = 80}}); },
      StatusCode::kInvalidArgument, "rotary_dim 80");
  ExpectRejected([&] { return Append(kb_.cache(), {.rotary = {.enabled = true, .theta = -1.0}}); },
                 StatusCode::kInvalidArgument, "theta");
  ExpectRejected([&] { return Append(kb_.cache(), {.kv_scale = 0.0f}); },
                 StatusCode::kInvalidArgument, "kv_scale");
  ExpectRejected(
      [&] {
        return Attend(q_.view, kb_.cache(), {.kv_scale = std::numeric_limits<float>::quiet_NaN()});
      },
      StatusCode::kInvalidArgument, "kv_scale");
  ExpectRejected([&] { return Attend(q_.view, kb_.cache(), {.scale = -1.0f}); },
                 StatusCode::kInvalidArgument, "scale");
  ExpectRejected([&] { return Attend(q_.view, kb_.cache(), {.sliding_window = -1}); },
                 StatusCode::kInvalidArgument, "sliding_window -1");
  ExpectRejected(
      [&] { return Attend(q_.view, kb_.cache(), {.causal = false, .sliding_window = 8}); },
      StatusCode::kInvalidArgument, "sliding_window 8");
  ExpectRejected([&] { return Attend(q_.view, kb_.cache(), {.num_threads = -1}); },
                 StatusCode::kInvalidArgument, "num_threads");
  ExpectRejected([&] { return Attend(q_.view, kb_.cache(), {.group = 1}); },
                 StatusCode::kOutOfRange, "cache group 1");
}

TEST_F(KernelErrors, Devices) {
  TensorView q = q_.view;
  q.device = DeviceKind::kCuda;
  ExpectRejected([&] { return Attend(q, kb_.cache()); }, StatusCode::kInvalidArgument,
                 "q is on cuda:0 but layer_cache on cpu:0");
#if !defined(BLOCKKV_HAVE_CUDA)
  TensorView cache = kb_.cache();
  cache.device = DeviceKind::kCuda;
  ExpectRejected([&] { return Append(cache); }, StatusCode::kUnavailable, "without CUDA");
#endif
}

TEST_F(KernelErrors, BatchNotFinalized) {
  kb_.mutable_batch().Clear();
  ExpectRejected([&] { return Append(kb_.cache()); }, StatusCode::kFailedPrecondition,
                 "not finalized");
  ExpectRejected([&] { return Attend(q_.view, kb_.cache()); }, StatusCode::kFailedPrecondition,
                 "not finalized");
}

TEST_F(KernelErrors, RotaryWithABadQWritesNoKey) {
  HostTensor q(DType::kFloat16, 4, 4, 80);
  ExpectRejected([&] { return Append(kb_.cache(), {.rotary = {.enabled = true}, .q = &q.view}); },
                 StatusCode::kInvalidArgument, "q must be [T, 4, 64]");
}

}  // namespace
}  // namespace blockkv
