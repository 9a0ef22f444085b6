// SPDX-License-Identifier: Apache-2.0
// Cache group kinds (KVCacheConfig::type, issue 21) and the MLA layout: validation of each kind's
// fields, the bytes an MLA block takes and how planning counts them, the 3-D layer views, and
// that what copies whole blocks (fork copies, offload and restore, snapshots) round-trips an MLA
// group byte for byte next to a dense one.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "blockkv/config.h"
#include "blockkv/kv_cache.h"
#include "blockkv/offload.h"
#include "blockkv/state_manager.h"
#include "unit/offload_test_util.h"
#include "unit/snapshot_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using blockkv_test::Bytes;

// DeepSeek-V3: 61 layers, latent 512 + rope 64, bf16.
KVCacheConfig DeepSeekV3(int32_t block_size = 64) {
  return {.block_size = block_size,
          .cache_shape = {61, 1, 576},
          .cache_dtype = DType::kBFloat16,
          .type = KVCacheType::kMla,
          .latent_dim = 512,
          .rope_dim = 64};
}

// A small MLA group: 2 layers, blocks of 2 tokens, latent 6 + rope 2, fp32.
KVCacheConfig SmallMla() {
  return {.block_size = 2,
          .cache_shape = {2, 1, 8},
          .cache_dtype = DType::kFloat32,
          .max_blocks_per_allocation_group = 32,
          .type = KVCacheType::kMla,
          .latent_dim = 6,
          .rope_dim = 2};
}

TEST(KVCacheTypeTest, NamesAreDeepSpeedsValues) {
  EXPECT_STREQ(KVCacheTypeName(KVCacheType::kDense), "dense");
  EXPECT_STREQ(KVCacheTypeName(KVCacheType::kLocal), "local");
  EXPECT_STREQ(KVCacheTypeName(KVCacheType::kState), "state");
  EXPECT_STREQ(KVCacheTypeName(KVCacheType::kMla), "mla");
}

TEST(KVCacheTypeTest, DenseIsTheDefaultAndKeepsTwoPlanes) {
  const KVCacheConfig c{.block_size = 16, .cache_shape = {32, 8, 128}};
  EXPECT_EQ(c.type, KVCacheType::kDense);
  ASSERT_OK(c.Validate());
  EXPECT_EQ(c.kv_planes(), 2);
  EXPECT_EQ(*c.bytes_per_block(), int64_t{32} * 16 * 2 * 8 * 128 * 2);
}

TEST(KVCacheTypeTest, MlaBlockHoldsOneLatentRowPerTokenAndLayer) {
  const KVCacheConfig c = DeepSeekV3();
  ASSERT_OK(c.Validate());
  EXPECT_EQ(c.kv_planes(), 1);
  EXPECT_EQ(c.elements_per_layer_block(), 64 * 576);
  // 61 layers · 64 tokens · 576 elements · 2 bytes.
  EXPECT_EQ(*c.bytes_per_block(), int64_t{61} * 64 * 576 * 2);
  EXPECT_EQ(*c.bytes_per_block(), 4'497'408);
}

TEST(KVCacheTypeTest, MlaShapeMustRestateLatentPlusRope) {
  KVCacheConfig c = DeepSeekV3();
  c.cache_shape = {61, 1, 512};
  Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("(61, 1, 576)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("got (61, 1, 512)"), std::string::npos) << s;

  c = DeepSeekV3();
  c.cache_shape = {61, 128, 576};  // heads do not belong in an MLA shape
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);

  c = DeepSeekV3();
  c.latent_dim = 0;
  c.cache_shape = {61, 1, 64};
  s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("latent_dim must be > 0, got 0"), std::string::npos) << s;

  c = DeepSeekV3();
  c.rope_dim = -1;
  s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rope_dim must be >= 0, got -1"), std::string::npos) << s;

  c = DeepSeekV3();  // no rotary part: allowed
  c.rope_dim = 0;
  c.cache_shape = {61, 1, 512};
  EXPECT_OK(c.Validate());

  c = DeepSeekV3();
  c.state_bytes = 8;
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
}

TEST(KVCacheTypeTest, OtherKindsFieldsMustStayZeroOnADenseGroup) {
  KVCacheConfig c{.block_size = 16, .cache_shape = {2, 1, 576}, .latent_dim = 512};
  Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("latent_dim=512"), std::string::npos) << s;
  c.latent_dim = 0;
  c.rope_dim = 64;
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
  c.rope_dim = 0;
  c.state_bytes = 1024;
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
}

TEST(KVCacheTypeTest, StateRestatesItsBytesInCacheShape) {
  // fp16: 4,096 bytes of state per layer are 2,048 elements.
  KVCacheConfig c{.block_size = 16,
                  .cache_shape = {2, 1, 64},
                  .type = KVCacheType::kState,
                  .state_bytes = 4096};
  Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cache_shape must be (num_layers, 1, state_bytes / element size) = "
                             "(2, 1, 4096 / 2), got (2, 1, 64)"),
            std::string::npos)
      << s;
  c.cache_shape = {2, 1, 2048};
  EXPECT_OK(c.Validate());
  EXPECT_EQ(*c.bytes_per_block(), 2 * 4096);  // one slot of every layer, whatever block_size
  c.type = static_cast<KVCacheType>(9);
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
  c.type = KVCacheType::kState;
  c.state_bytes = 0;
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
}

TEST(KVCacheTypeTest, LocalNeedsItsWindowAndOnlyLocalHasOne) {
  KVCacheConfig c{.block_size = 16, .cache_shape = {2, 1, 64}, .type = KVCacheType::kLocal};
  Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("local_window (the attention window in tokens) must be > 0, got 0"),
            std::string::npos)
      << s;
  c.local_window = -3;
  EXPECT_CODE(c.Validate(), StatusCode::kInvalidArgument);
  c.local_window = 4096;
  EXPECT_OK(c.Validate());
  // A LOCAL block is a dense block: K and V per KV head.
  EXPECT_EQ(c.kv_planes(), 2);
  EXPECT_EQ(*c.bytes_per_block(), int64_t{2} * 16 * 2 * 64 * 2);
  c.type = KVCacheType::kDense;
  s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("local_window is for LOCAL groups; a dense group must leave it 0, "
                             "got 4096"),
            std::string::npos)
      << s;
}

TEST(KVCacheTypeTest, PlanSumsMlaAndDenseGroupsBlockBytes) {
  const std::vector<KVCacheConfig> groups = {DeepSeekV3(),
                                             {.block_size = 64, .cache_shape = {1, 8, 128}}};
  const int64_t per_block = int64_t{61} * 64 * 576 * 2 + int64_t{1} * 64 * 2 * 8 * 128 * 2;
  Result<KVCachePlan> plan =
      PlanKVCache(groups, MemoryConfig{.size = 1000}, 1000 + 10 * per_block + 7);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->bytes_per_block, per_block);
  EXPECT_EQ(plan->num_blocks, 10);
}

TEST(MlaCacheTest, LayerViewsAreThreeDimensionalAndContiguous) {
  auto cache = blockkv_test::MakeCache({SmallMla(), blockkv_test::SmallGroup()}, 5);
  ASSERT_NE(cache, nullptr);
  Result<TensorView> layer = cache->GetCache(1, 0);
  ASSERT_OK(layer);
  ASSERT_EQ(layer->ndim, 3);
  EXPECT_EQ(layer->shape[0], 5);
  EXPECT_EQ(layer->shape[1], 2);
  EXPECT_EQ(layer->shape[2], 8);
  EXPECT_EQ(layer->stride(0), 16);
  EXPECT_EQ(layer->stride(1), 8);
  EXPECT_EQ(layer->stride(2), 1);
  Result<TensorView> storage = cache->GetGroupStorage(0);
  ASSERT_OK(storage);
  ASSERT_EQ(storage->ndim, 4);
  EXPECT_EQ(storage->numel(), 2 * 5 * 2 * 8);
  // Layer 1 starts one layer (5 blocks of 16 floats) after layer 0.
  EXPECT_EQ(static_cast<float*>(layer->data) - static_cast<float*>(storage->data), 5 * 16);
  // The dense group beside it keeps its 5-D views.
  Result<TensorView> dense = cache->GetCache(0, 1);
  ASSERT_OK(dense);
  EXPECT_EQ(dense->ndim, 5);
  EXPECT_CODE(cache->GetCache(2, 0), StatusCode::kOutOfRange);
  EXPECT_OK(cache->CheckInvariants());
}

TEST(MlaCacheTest, CopyBlocksCopiesEveryLayerOfAnMlaBlock) {
  auto cache = blockkv_test::MakeCache({SmallMla()}, 4);
  ASSERT_NE(cache, nullptr);
  std::mt19937_64 rng(3);
  const Bytes want = blockkv_test::FillRandom(*cache, 0, 1, rng);
  const Bytes other = blockkv_test::FillRandom(*cache, 0, 2, rng);
  const std::vector<BlockId> src = {1};
  const std::vector<BlockId> dst = {3};
  ASSERT_OK(cache->CopyBlocks(src, dst));
  EXPECT_EQ(blockkv_test::ReadBlock(*cache, 0, 3), want);
  EXPECT_EQ(blockkv_test::ReadBlock(*cache, 0, 2), other);
}

TEST(MlaCacheTest, OffloadAndRestoreRoundTripAnMlaGroupNextToADenseOne) {
  auto cache = blockkv_test::MakeCache({SmallMla(), blockkv_test::OddGroup()}, 8);
  ASSERT_NE(cache, nullptr);
  Result<std::unique_ptr<OffloadStore>> store =
      OffloadStore::Create(cache.get(), {.host_blocks = 4});
  ASSERT_OK(store);
  EXPECT_EQ((*store)->block_bytes(0), 2 * 2 * 8 * 4);
  std::mt19937_64 rng(11);
  for (int group = 0; group < 2; ++group) {
    SCOPED_TRACE(testing::Message() << "group " << group);
    Result<std::vector<BlockId>> blocks = cache->Reserve(3, group);
    ASSERT_OK(blocks);
    std::vector<Bytes> want;
    for (BlockId b : *blocks) want.push_back(blockkv_test::FillRandom(*cache, group, b, rng));
    std::vector<OffloadHandle> handles(3);
    Result<OffloadTicket> offload = (*store)->Offload(*blocks, group, handles, Tier::kHost);
    ASSERT_OK(offload);
    ASSERT_OK(offload->Wait());
    // Scribble on the freed blocks, so that a restore must bring the bytes back.
    Result<std::vector<BlockId>> taken = cache->Reserve(3, group);
    ASSERT_OK(taken);
    for (BlockId b : *taken) blockkv_test::FillRandom(*cache, group, b, rng);
    std::vector<BlockId> out(3, kNoBlock);
    Result<OffloadTicket> restore = (*store)->Restore(handles, group, out);
    ASSERT_OK(restore);
    ASSERT_OK(restore->Wait());
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(blockkv_test::ReadBlock(*cache, group, out[i]), want[i]) << "block " << i;
    }
    ASSERT_OK((*store)->CheckInvariants());
  }
}

TEST(MlaCacheTest, SnapshotOfAManagerWithAnMlaGroupRoundTripsByteExact) {
  std::vector<KVCacheConfig> groups = blockkv_test::SnapshotGroups();
  groups[1] = SmallMla();
  groups[1].block_size = 4;
  groups[1].max_blocks_per_allocation_group = 16;
  auto a = blockkv_test::MakeSnapshotManager(blockkv_test::SnapshotConfig(), groups);
  blockkv_test::SnapshotWorkload w(*a, 21);
  w.Run(150);
  w.FillContents();
  ASSERT_OK(a->CheckInvariants());
  Result<std::vector<std::byte>> bytes = a->SaveSnapshot();
  ASSERT_OK(bytes);

  auto b = blockkv_test::MakeSnapshotManager(blockkv_test::SnapshotConfig(), groups);
  blockkv_test::SnapshotWorkload(*b, 22).Run(50);
  ASSERT_OK(b->LoadSnapshot(*bytes));
  ASSERT_OK(b->CheckInvariants());
  Result<std::vector<std::byte>> again = b->SaveSnapshot();
  ASSERT_OK(again);
  EXPECT_TRUE(*again == *bytes);
  // The used blocks' latent rows are where they were.
  for (const SeqId uid : w.live()) {
    const std::span<const BlockId> ta = a->GetSequence(uid)->block_table(1);
    const std::span<const BlockId> tb = b->GetSequence(uid)->block_table(1);
    const std::vector<BlockId> table(ta.begin(), ta.end());
    ASSERT_EQ(std::vector<BlockId>(tb.begin(), tb.end()), table);
    for (const BlockId block : table) {
      if (block == kNoBlock) continue;
      for (int64_t layer = 0; layer < 2; ++layer) {
        const std::span<std::byte> x = blockkv_test::LayerChunk(a->kv_cache(), 1, layer, block);
        const std::span<std::byte> y = blockkv_test::LayerChunk(b->kv_cache(), 1, layer, block);
        EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size()), 0) << "block " << block;
      }
    }
  }
}

// Two MLA groups of one shape that split the row differently are not the same cache: a snapshot
// names the field, and the manager is left as it was.
TEST(MlaCacheTest, SnapshotOfAnotherLatentSplitIsRefusedNamingTheField) {
  std::vector<KVCacheConfig> groups = blockkv_test::SnapshotGroups();
  groups[1] = SmallMla();
  groups[1].block_size = 4;
  groups[1].max_blocks_per_allocation_group = 16;
  auto a = blockkv_test::MakeSnapshotManager(blockkv_test::SnapshotConfig(), groups);
  blockkv_test::SnapshotWorkload(*a, 31).Run(60);
  Result<std::vector<std::byte>> bytes = a->SaveSnapshot();
  ASSERT_OK(bytes);

  groups[1].latent_dim = 4;  // 4 + 4 where the snapshot holds 6 + 2: same shape, same bytes
  groups[1].rope_dim = 4;
  auto b = blockkv_test::MakeSnapshotManager(blockkv_test::SnapshotConfig(), groups);
  blockkv_test::SnapshotWorkload(*b, 32).Run(30);
  Result<std::vector<std::byte>> before = b->SaveSnapshot();
  ASSERT_OK(before);
  Status s = b->LoadSnapshot(*bytes);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("cache group 1 latent_dim: expected 4 (this manager), found 6"),
            std::string::npos)
      << s;
  EXPECT_TRUE(*b->SaveSnapshot() == *before);

  // A dense group of the MLA group's shape: the kind differs.
  groups[1] = SmallMla();
  groups[1].block_size = 4;
  groups[1].max_blocks_per_allocation_group = 16;
  groups[1].type = KVCacheType::kDense;
  groups[1].latent_dim = groups[1].rope_dim = 0;
  auto c = blockkv_test::MakeSnapshotManager(blockkv_test::SnapshotConfig(), groups);
  s = c->LoadSnapshot(*bytes);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("cache group 1 type: expected dense (this manager), found mla"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace blockkv
