// SPDX-License-Identifier: Apache-2.0
// PrefixHostTier (src/prefix_host_tier.h) on its own, over a real cache, block pool, prefix cache
// and offload store (no StateManager): evicted cached blocks are demoted with their bytes and
// identity, matched exactly, promoted back under their old chain ids, dropped least recently used
// first (pinned entries kept), and a failed promotion indexes nothing.
#include "prefix_host_tier.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <vector>

#include "blockkv/block_pool.h"
#include "blockkv/device.h"
#include "blockkv/kv_cache.h"
#include "blockkv/offload.h"
#include "blockkv/prefix_cache.h"
#include "unit/test_util.h"

namespace blockkv::internal {
namespace {

constexpr int32_t kBlock = 4;      // tokens per block
constexpr int32_t kNumBlocks = 8;  // device blocks
constexpr int32_t kPriority = kDefaultRetentionPriority;

class PrefixHostTierTest : public ::testing::Test {
 protected:
  // A cache of kNumBlocks blocks, its pool, a prefix cache, a store with `host_blocks` host slots
  // and the tier over them.
  void Make(int32_t host_blocks) {
    const KVCacheConfig model{.block_size = kBlock,
                              .cache_shape = {1, 1, 8},
                              .cache_dtype = DType::kFloat16,
                              .max_blocks_per_allocation_group = 16};
    auto cache =
        BlockedKVCache::Create({model}, {.mode = AllocationMode::kAllocate, .size = kNumBlocks},
                               CpuDevice(/*memory_budget=*/1 << 20));
    ASSERT_OK(cache);
    cache_ = std::move(cache).value();
    pools_.emplace_back(cache_.get(), 0);
    prefix_ =
        std::make_unique<PrefixCache>(PrefixCacheConfig{.enabled = true},
                                      std::span<BlockPool>(pools_), std::vector<int32_t>{kBlock});
    auto store = OffloadStore::Create(cache_.get(), {.host_blocks = host_blocks});
    ASSERT_OK(store);
    store_ = std::move(store).value();
    tier_ =
        std::make_unique<PrefixHostTier>(prefix_.get(), store_.get(), std::span<BlockPool>(pools_));
    ns_ = prefix_->InternNamespace("");
  }

  BlockPool& pool() { return pools_[0]; }

  // The bytes of device block `block` (its one layer).
  std::span<std::byte> Bytes(BlockId block) {
    const TensorView layer = *cache_->GetCache(0);
    const int64_t size = *cache_->config().bytes_per_block();
    return {static_cast<std::byte*>(layer.data) + block * size, static_cast<size_t>(size)};
  }

  // Takes `n` fresh blocks, fills block i with the byte `fill + i`, publishes them as blocks
  // 0..n-1 of `tokens` and releases them (evictable, cached). Returns their ids.
  std::vector<BlockId> PublishChain(const std::vector<TokenId>& tokens, int32_t n, uint8_t fill,
                                    const BlockKeyExtras& extras = {}) {
    std::vector<BlockId> blocks(static_cast<size_t>(n));
    EXPECT_OK(pool().Take(n, blocks));
    PrefixCache::Published parent;
    for (int32_t i = 0; i < n; ++i) {
      std::memset(Bytes(blocks[i]).data(), fill + i, Bytes(blocks[i]).size());
      const auto index = static_cast<size_t>(i);
      const std::span<const TokenId> block_tokens =
          std::span(tokens).subspan(index * kBlock, kBlock);
      const BlockHash key =
          prefix_->Hash(i == 0 ? nullptr : &parent.key, block_tokens, extras, index);
      parent = prefix_->Publish(0, blocks[i], i == 0 ? nullptr : &parent, key, block_tokens,
                                prefix_->InternNamespace(extras.ns), extras, index, kPriority);
    }
    EXPECT_OK(pool().Release(blocks));
    return blocks;
  }

  // Takes every free block, which evicts every cached one (demoting it), and gives them back.
  void EvictAll() {
    std::vector<BlockId> all(static_cast<size_t>(pool().free_blocks()));
    ASSERT_OK(pool().Take(static_cast<int32_t>(all.size()), all));
    ASSERT_OK(pool().Release(all));
    ASSERT_EQ(prefix_->cached_blocks(0), 0);
  }

  void ExpectConsistent() {
    EXPECT_OK(tier_->CheckInvariants());
    EXPECT_OK(prefix_->CheckInvariants());
    EXPECT_OK(pool().CheckInvariants());
    EXPECT_OK(store_->CheckInvariants());
  }

  // Declared in construction order: the tier goes first (it hands the pools' eviction listener
  // back to the prefix cache), the cache last.
  std::unique_ptr<BlockedKVCache> cache_;
  std::vector<BlockPool> pools_;
  std::unique_ptr<PrefixCache> prefix_;
  std::unique_ptr<OffloadStore> store_;
  std::unique_ptr<PrefixHostTier> tier_;
  int32_t ns_ = 0;
};

std::vector<TokenId> Tokens(int32_t n, TokenId first = 100) {
  std::vector<TokenId> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST_F(PrefixHostTierTest, EvictedCachedBlocksAreDemotedAndMatchedInOrder) {
  Make(/*host_blocks=*/4);
  const std::vector<TokenId> tokens = Tokens(3 * kBlock);
  PublishChain(tokens, 3, /*fill=*/10);
  EXPECT_EQ(tier_->size(), 0);
  EvictAll();
  EXPECT_EQ(tier_->size(), 3);
  EXPECT_EQ(tier_->stats().demoted, 3);
  EXPECT_EQ(tier_->droppable(0), 3);
  EXPECT_EQ(store_->free_host_blocks(0), 1);
  std::vector<int32_t> entries;
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, /*first=*/0, nullptr, /*max_blocks=*/3, &entries), 3);
  EXPECT_EQ(entries.size(), 3U);
  // At most max_blocks.
  std::vector<int32_t> two;
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 2, &two), 2);
  EXPECT_EQ(two, std::vector<int32_t>(entries.begin(), entries.begin() + 2));
  ExpectConsistent();
}

TEST_F(PrefixHostTierTest, MatchIsExactOnTokensNamespaceAndAdapter) {
  Make(4);
  const std::vector<TokenId> tokens = Tokens(2 * kBlock);
  PublishChain(tokens, 2, 10);
  EvictAll();
  std::vector<int32_t> entries;
  std::vector<TokenId> other = tokens;
  other[kBlock + 1] = 7;  // the second block differs
  EXPECT_EQ(tier_->Match(0, other, ns_, {}, 0, nullptr, 2, &entries), 1);
  entries.clear();
  other = tokens;
  other[0] = 7;  // the first block differs: nothing matches
  EXPECT_EQ(tier_->Match(0, other, ns_, {}, 0, nullptr, 2, &entries), 0);
  const BlockKeyExtras tenant{.ns = "tenant-b"};
  EXPECT_EQ(tier_->Match(0, tokens, prefix_->InternNamespace("tenant-b"), tenant, 0, nullptr, 2,
                         &entries),
            0);
  const BlockKeyExtras adapter{.adapter_id = 3};
  EXPECT_EQ(tier_->Match(0, tokens, ns_, adapter, 0, nullptr, 2, &entries), 0);
  EXPECT_TRUE(entries.empty());
}

TEST_F(PrefixHostTierTest, PromoteCopiesTheBytesAndIndexesUnderTheOldChainIds) {
  Make(4);
  const std::vector<TokenId> tokens = Tokens(3 * kBlock);
  const std::vector<BlockId> old = PublishChain(tokens, 3, 10);
  std::vector<PrefixCache::Published> before;
  for (const BlockId b : old) before.push_back(prefix_->published(0, b));
  EvictAll();
  std::vector<int32_t> entries;
  ASSERT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 3, &entries), 3);
  std::vector<BlockId> fresh(3);
  ASSERT_OK(pool().Take(3, fresh));
  for (const BlockId b : fresh) std::memset(Bytes(b).data(), 0, Bytes(b).size());
  ASSERT_OK(tier_->Promote(0, entries, fresh, kPriority));
  EXPECT_EQ(tier_->size(), 0);
  EXPECT_EQ(tier_->stats().promoted, 3);
  EXPECT_EQ(store_->free_host_blocks(0), 4);
  for (size_t i = 0; i < fresh.size(); ++i) {
    for (const std::byte b : Bytes(fresh[i])) {
      ASSERT_EQ(b, static_cast<std::byte>(10 + i)) << "block " << i;
    }
    const PrefixCache::Published now = prefix_->published(0, fresh[i]);
    EXPECT_EQ(now.id, before[i].id) << "block " << i;
    EXPECT_EQ(now.key, before[i].key) << "block " << i;
  }
  // The device cache matches the chain again.
  std::vector<BlockId> out(3);
  BlockHash last;
  EXPECT_EQ(prefix_->Match(0, tokens, ns_, {}, 3, out, &last), 3);
  EXPECT_EQ(out, fresh);
  ASSERT_OK(pool().Release(fresh));
  ExpectConsistent();
}

// A promotion that continues a device match: its parent is what the device's last block was
// published as.
TEST_F(PrefixHostTierTest, MatchContinuesFromADeviceParent) {
  Make(4);
  const std::vector<TokenId> tokens = Tokens(3 * kBlock);
  const std::vector<BlockId> old = PublishChain(tokens, 3, 10);
  const PrefixCache::Published first = prefix_->published(0, old[0]);
  EvictAll();
  std::vector<int32_t> entries;
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, /*first=*/1, &first, 2, &entries), 2);
  // A parent that is not the block the entries were chained from matches nothing.
  const PrefixCache::Published stranger{.id = first.id + 100, .key = first.key};
  entries.clear();
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, 1, &stranger, 2, &entries), 0);
}

TEST_F(PrefixHostTierTest, FailedPromotionIndexesNothingAndKeepsTheEntries) {
  Make(4);
  const std::vector<TokenId> tokens = Tokens(2 * kBlock);
  PublishChain(tokens, 2, 10);
  EvictAll();
  std::vector<int32_t> entries;
  ASSERT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 2, &entries), 2);
  BlockId fresh = kNoBlock;
  ASSERT_OK(pool().Take(1, std::span(&fresh, 1)));
  const BlockId blocks[] = {fresh, kNumBlocks + 5};  // the second copy fails: no such block
  EXPECT_CODE(tier_->Promote(0, entries, blocks, kPriority), StatusCode::kOutOfRange);
  EXPECT_EQ(tier_->size(), 2);
  EXPECT_EQ(tier_->stats().promoted, 0);
  EXPECT_EQ(prefix_->cached_blocks(0), 0);
  EXPECT_FALSE(pool().is_cached(fresh));
  std::vector<int32_t> again;
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 2, &again), 2);
  ASSERT_OK(pool().Release(std::span(&fresh, 1)));
  ExpectConsistent();
}

// A full tier takes no more demotions (issue 17 item 12): replacing its least recently used entry
// copied a block only to throw another away. Here that also keeps the chain's head, so the
// entries still match from the start (replacing dropped block 0 and left 1 and 2 unreachable).
TEST_F(PrefixHostTierTest, AFullTierDemotesNothingMoreAndKeepsWhatItHas) {
  Make(/*host_blocks=*/2);
  const std::vector<TokenId> tokens = Tokens(3 * kBlock);
  PublishChain(tokens, 3, 10);  // released block 0 first: evicted (and demoted) first
  EvictAll();
  EXPECT_EQ(tier_->size(), 2);
  EXPECT_EQ(tier_->stats().demoted, 2);
  EXPECT_EQ(tier_->stats().dropped, 0);
  std::vector<int32_t> entries;
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 3, &entries), 2);
  ExpectConsistent();
}

TEST_F(PrefixHostTierTest, MakeRoomSkipsPinnedEntries) {
  Make(2);
  const std::vector<TokenId> tokens = Tokens(2 * kBlock);
  PublishChain(tokens, 2, 10);
  EvictAll();
  std::vector<int32_t> entries;
  ASSERT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 2, &entries), 2);
  tier_->Pin(std::span(entries).first(1), true);  // the least recently used one
  EXPECT_EQ(tier_->droppable(0), 1);
  tier_->MakeRoom(0, 1);
  EXPECT_EQ(tier_->size(), 1);
  EXPECT_EQ(store_->free_host_blocks(0), 1);
  std::vector<int32_t> left;
  EXPECT_EQ(tier_->Match(0, tokens, ns_, {}, 0, nullptr, 2, &left), 1);
  EXPECT_EQ(left, std::vector<int32_t>{entries[0]});
  tier_->Pin(std::span(entries).first(1), false);
  EXPECT_EQ(tier_->droppable(0), 1);
  ExpectConsistent();
}

TEST_F(PrefixHostTierTest, AnExactCopyAlreadyOnTheHostIsNotDemotedTwice) {
  Make(4);
  const std::vector<TokenId> tokens = Tokens(kBlock);
  // Two sequences computed the same block at once and each published its copy.
  PublishChain(tokens, 1, 10);
  PublishChain(tokens, 1, 10);
  EXPECT_EQ(prefix_->cached_blocks(0), 2);
  EvictAll();
  EXPECT_EQ(tier_->size(), 1);
  EXPECT_EQ(tier_->stats().demoted, 1);
  ExpectConsistent();
}

TEST_F(PrefixHostTierTest, ClearDropsEveryEntry) {
  Make(4);
  PublishChain(Tokens(3 * kBlock), 3, 10);
  EvictAll();
  EXPECT_EQ(tier_->Clear(), 3);
  EXPECT_EQ(tier_->size(), 0);
  EXPECT_EQ(tier_->stats().dropped, 3);
  EXPECT_EQ(store_->free_host_blocks(0), 4);
  EXPECT_EQ(store_->live_handles(), 0);
  ExpectConsistent();
}

}  // namespace
}  // namespace blockkv::internal
