// SPDX-License-Identifier: Apache-2.0
// StateManager::PreemptSequence / ResumeSequence through the offload tiers: contents survive a
// preempt-resume round trip byte for byte at new block ids, failures keep everything, and the
// manager's invariants hold throughout (the offload store itself is tested in offload_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include "blockkv/state_manager.h"
#include "unit/offload_test_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

constexpr int32_t kBlockSize = 4;

KVCacheConfig Group(int64_t layers, int32_t block_size = kBlockSize) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {layers, 2, 8},
                       .cache_dtype = DType::kFloat32,
                       .max_blocks_per_allocation_group = 32};
}

StateManagerConfig Config(int32_t num_blocks, OffloadConfig offload) {
  StateManagerConfig config;
  config.max_tracked_sequences = 16;
  config.max_ragged_batch_size = 256;
  config.max_ragged_sequence_count = 16;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = num_blocks};
  config.offload = true;
  config.offload_config = std::move(offload);
  return config;
}

class PreemptTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, OffloadConfig offload,
            std::vector<KVCacheConfig> groups = {Group(3)}) {
    auto mgr = StateManager::Create(Config(num_blocks, std::move(offload)), std::move(groups),
                                    CpuDevice(64 << 20));
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    mgr_ = std::move(*mgr);
  }

  // Every byte of block `b` of group g in every layer.
  std::vector<uint8_t> Bytes(int g, BlockId b) const {
    std::vector<uint8_t> out;
    const KVCacheConfig& c = mgr_->kv_cache().config(g);
    for (int64_t layer = 0; layer < c.num_caches(); ++layer) {
      const TensorView view = *mgr_->GetCache(layer, g);
      const size_t bytes = static_cast<size_t>(view.stride(0)) * ElementSize(view.dtype);
      const auto* base = static_cast<const uint8_t*>(view.data) + static_cast<size_t>(b) * bytes;
      out.insert(out.end(), base, base + bytes);
    }
    return out;
  }
  void Fill(int g, BlockId b, uint32_t salt) {
    const KVCacheConfig& c = mgr_->kv_cache().config(g);
    for (int64_t layer = 0; layer < c.num_caches(); ++layer) {
      const TensorView view = *mgr_->GetCache(layer, g);
      const size_t bytes = static_cast<size_t>(view.stride(0)) * ElementSize(view.dtype);
      auto* base = static_cast<uint8_t*>(view.data) + static_cast<size_t>(b) * bytes;
      for (size_t i = 0; i < bytes; ++i) base[i] = static_cast<uint8_t>(salt * 37 + layer * 11 + i);
    }
  }
  // Schedules `tokens` for `uid`, fills its blocks with distinct bytes and advances.
  std::vector<std::vector<std::vector<uint8_t>>> Run(SeqId uid, int64_t tokens) {
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {tokens};
    EXPECT_TRUE(mgr_->Schedule({.uids = uids, .lengths = lengths}).ok());
    EXPECT_TRUE(mgr_->PostForward(uids).ok());
    std::vector<std::vector<std::vector<uint8_t>>> contents(mgr_->num_groups());
    for (int g = 0; g < mgr_->num_groups(); ++g) {
      for (const BlockId b : mgr_->GetSequence(uid)->block_table(g)) {
        Fill(g, b, static_cast<uint32_t>(uid * 1000 + b));
        contents[g].push_back(Bytes(g, b));
      }
    }
    return contents;
  }
  void ExpectContents(SeqId uid, const std::vector<std::vector<std::vector<uint8_t>>>& want) {
    for (int g = 0; g < mgr_->num_groups(); ++g) {
      const std::span<const BlockId> table = mgr_->GetSequence(uid)->block_table(g);
      ASSERT_EQ(table.size(), want[g].size());
      for (size_t i = 0; i < table.size(); ++i) {
        EXPECT_EQ(Bytes(g, table[i]), want[g][i]) << "group " << g << " block " << i;
      }
    }
  }
  void ExpectInvariants() {
    const Status s = mgr_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }

  std::unique_ptr<StateManager> mgr_;
};

TEST_F(PreemptTest, RoundTripThroughTheHostTier) {
  Make(16, {.host_blocks = 16}, {Group(3), Group(2, 8)});
  const auto before = Run(1, 21);  // 6 blocks of group 0, 3 of group 1
  const std::vector<int32_t> free_before = mgr_->free_blocks();
  Result<OffloadTicket> out = mgr_->PreemptSequence(1);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectInvariants();
  EXPECT_TRUE(mgr_->GetSequence(1)->preempted());
  for (const BlockId b : mgr_->GetSequence(1)->block_table(0)) EXPECT_EQ(b, kNoBlock);
  ASSERT_TRUE(out->Wait().ok());
  EXPECT_TRUE(out->Poll());
  ExpectInvariants();
  EXPECT_EQ(mgr_->free_blocks()[0], free_before[0] + 6);
  EXPECT_EQ(mgr_->free_blocks()[1], free_before[1] + 3);
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 9);

  // Another sequence takes the freed blocks and overwrites them.
  Run(2, 40);
  const SeqId two[] = {2};
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  static_cast<void>(two);

  Result<OffloadTicket> in = mgr_->ResumeSequence(1);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_FALSE(mgr_->GetSequence(1)->preempted());
  ASSERT_TRUE(in->Wait().ok());
  ExpectInvariants();
  ExpectContents(1, before);
  EXPECT_EQ(mgr_->GetSequence(1)->seen_tokens(), 21);
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 0);
  // It runs on where it stopped.
  const SeqId uids[] = {1};
  const int64_t lengths[] = {5};
  ASSERT_TRUE(mgr_->Schedule({.uids = uids, .lengths = lengths}).ok());
  ASSERT_TRUE(mgr_->PostForward(uids).ok());
  EXPECT_EQ(mgr_->GetSequence(1)->seen_tokens(), 26);
  ExpectInvariants();
}

TEST_F(PreemptTest, APreemptedSequenceCannotRunUntilResumed) {
  Make(16, {.host_blocks = 16});
  Run(1, 10);
  ASSERT_TRUE(mgr_->PreemptSequence(1).ok());
  const SeqId uids[] = {1};
  const int64_t lengths[] = {1};
  EXPECT_EQ(mgr_->Schedule({.uids = uids, .lengths = lengths}).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr_->CanSchedule({.uids = uids, .lengths = lengths}).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr_->Fork(1, 2).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr_->FreeLeadingBlocks(1, 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr_->PreemptSequence(1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr_->ResumeSequence(7).status().code(), StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(PreemptTest, ErrorsChangeNothing) {
  Make(8, {.host_blocks = 2});
  Run(1, 12);  // 3 blocks: more than the host tier holds
  const std::vector<int32_t> free = mgr_->free_blocks();
  EXPECT_EQ(mgr_->PreemptSequence(1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(mgr_->GetSequence(1)->preempted());
  EXPECT_EQ(mgr_->free_blocks(), free);
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 0);
  // Tokens in flight.
  const SeqId uids[] = {1};
  const int64_t lengths[] = {1};
  ASSERT_TRUE(mgr_->Schedule({.uids = uids, .lengths = lengths}).ok());
  EXPECT_EQ(mgr_->PreemptSequence(1).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(mgr_->PostForward(uids).ok());
  ExpectInvariants();

  // Resume with too few free blocks: the sequence stays preempted with its handles.
  Make(8, {.host_blocks = 8});
  const auto before = Run(1, 16);  // 4 blocks
  ASSERT_TRUE(mgr_->PreemptSequence(1)->Wait().ok());
  Run(2, 32);  // all 8 blocks
  EXPECT_EQ(mgr_->ResumeSequence(1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(mgr_->GetSequence(1)->preempted());
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 4);
  ExpectInvariants();
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  ASSERT_TRUE(mgr_->ResumeSequence(1)->Wait().ok());
  ExpectContents(1, before);
  ExpectInvariants();
}

TEST_F(PreemptTest, FullHostTierSpillsToDisk) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("blockkv_preempt_" + std::to_string(::getpid())))
          .string();
  Make(16, {.host_blocks = 2, .disk_path = path, .disk_blocks = 8});
  const auto before = Run(1, 12);
  ASSERT_TRUE(mgr_->PreemptSequence(1)->Wait().ok());
  EXPECT_EQ(mgr_->offload_store()->free_disk_blocks(0), 5);
  ExpectInvariants();
  ASSERT_TRUE(mgr_->ResumeSequence(1)->Wait().ok());
  ExpectContents(1, before);
  ExpectInvariants();
}

TEST_F(PreemptTest, FlushDropsHandlesAndResumesInFlight) {
  Make(16, {.host_blocks = 16});
  Run(1, 9);
  Run(2, 9);
  ASSERT_TRUE(mgr_->PreemptSequence(1).ok());  // not waited for
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 0);
  ExpectInvariants();
  ASSERT_TRUE(mgr_->PreemptSequence(2)->Wait().ok());
  ASSERT_TRUE(mgr_->ResumeSequence(2).ok());  // flushed while its copy may be in flight
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  ExpectInvariants();
  EXPECT_EQ(mgr_->free_blocks()[0], 16);
}

TEST_F(PreemptTest, SharedBlocksStayWithTheirOtherHolders) {
  Make(16, {.host_blocks = 16});
  const auto before = Run(1, 10);  // 2 full blocks + a partial one
  ASSERT_TRUE(mgr_->Fork(1, 2).ok());
  const std::vector<BlockId> child(mgr_->GetSequence(2)->block_table(0).begin(),
                                   mgr_->GetSequence(2)->block_table(0).end());
  ASSERT_TRUE(mgr_->PreemptSequence(1)->Wait().ok());
  ExpectInvariants();
  // The child still holds the shared full blocks; only the parent's private tail was freed.
  EXPECT_EQ(mgr_->pool(0).ref_count(child[0]), 1);
  EXPECT_EQ(Bytes(0, child[0]), before[0][0]);
  ASSERT_TRUE(mgr_->ResumeSequence(1)->Wait().ok());
  ExpectContents(1, before);
  ExpectInvariants();
}

// A disk tier whose reads come back flipped: the resume fails with kDataLoss naming the block,
// the sequence stays preempted with its handles, nothing else changes.
class FlippingFile final : public BlockFile {
 public:
  explicit FlippingFile(std::unique_ptr<BlockFile> file) : file_(std::move(file)) {}
  Status Write(int64_t offset, std::span<const std::byte> data) override {
    return file_->Write(offset, data);
  }
  Status Read(int64_t offset, std::span<std::byte> data) override {
    BLOCKKV_RETURN_IF_ERROR(file_->Read(offset, data));
    data[data.size() / 2] ^= std::byte{0x20};
    return Status::Ok();
  }

 private:
  std::unique_ptr<BlockFile> file_;
};

TEST_F(PreemptTest, ACorruptDiskSlotFailsTheResumeAndKeepsTheSequencePreempted) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("blockkv_flip_" + std::to_string(::getpid())))
          .string();
  OffloadConfig offload{.host_blocks = 1, .disk_path = path, .disk_blocks = 8};
  offload.open_file = [](const std::string& p) -> Result<std::unique_ptr<BlockFile>> {
    BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<BlockFile> file, OpenPosixBlockFile(p));
    return std::unique_ptr<BlockFile>(std::make_unique<FlippingFile>(std::move(file)));
  };
  Make(16, std::move(offload));
  Run(1, 8);  // 2 blocks: to disk
  ASSERT_TRUE(mgr_->PreemptSequence(1)->Wait().ok());
  Result<OffloadTicket> in = mgr_->ResumeSequence(1);
  ASSERT_TRUE(in.ok());
  const Status copied = in->Wait();
  EXPECT_EQ(copied.code(), StatusCode::kDataLoss) << copied;
  EXPECT_NE(copied.message().find("checksum"), std::string::npos) << copied;
  const SeqId uids[] = {1};
  const int64_t lengths[] = {1};
  const Status scheduled = mgr_->Schedule({.uids = uids, .lengths = lengths});
  EXPECT_EQ(scheduled.code(), StatusCode::kDataLoss) << scheduled;
  EXPECT_TRUE(mgr_->GetSequence(1)->preempted());
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 2);
  ExpectInvariants();
  EXPECT_EQ(mgr_->free_blocks()[0], 16);
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());
  ExpectInvariants();
}

TEST_F(PreemptTest, DiskFullKeepsTheDeviceBlocks) {
  blockkv_test::TempDir dir;
  auto plan = std::make_shared<blockkv_test::FaultPlan>();
  Make(16, {.host_blocks = 1,
            .disk_path = dir.File("tier"),
            .disk_blocks = 8,
            .open_file = blockkv_test::FaultyOpener(plan)});
  {
    std::lock_guard lock(plan->mu);
    plan->writes_ok = 0;  // the disk is full from now on
    plan->failing_writes = 1 << 20;
  }
  const auto before = Run(1, 8);
  Result<OffloadTicket> out = mgr_->PreemptSequence(1);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->Wait().code(), StatusCode::kResourceExhausted);
  ExpectInvariants();
  EXPECT_EQ(mgr_->free_blocks()[0], 14);  // the device blocks were kept
  ASSERT_TRUE(mgr_->ResumeSequence(1)->Wait().ok());
  ExpectContents(1, before);
  ExpectInvariants();
}

// A preemption whose copy fails (the disk full) keeps the device blocks; a resume then takes them
// back as they are, without a copy and without needing a free block, which is exactly the state
// an engine preempts in (was: "needs 2 blocks of group 0, 0 are free", the sequence stuck).
TEST_F(PreemptTest, AFailedPreemptionResumesWithoutACopyWhenNoBlockIsFree) {
  blockkv_test::TempDir dir;
  auto plan = std::make_shared<blockkv_test::FaultPlan>();
  Make(8, {.host_blocks = 1,
           .disk_path = dir.File("tier"),
           .disk_blocks = 8,
           .open_file = blockkv_test::FaultyOpener(plan)});
  {
    std::lock_guard lock(plan->mu);
    plan->writes_ok = 0;  // every disk write fails with ENOSPC from now on
    plan->failing_writes = 1 << 20;
  }
  const auto before = Run(1, 8);  // 2 blocks: more than the host tier's 1, so to the disk
  const std::vector<BlockId> table(mgr_->GetSequence(1)->block_table(0).begin(),
                                   mgr_->GetSequence(1)->block_table(0).end());
  Result<OffloadTicket> out = mgr_->PreemptSequence(1);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->Wait().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(mgr_->free_blocks()[0], 6);  // kept
  Run(2, 24);                            // another sequence takes every other block
  ASSERT_EQ(mgr_->free_blocks()[0], 0);
  const OffloadStats stats = mgr_->offload_store()->stats();

  Result<OffloadTicket> in = mgr_->ResumeSequence(1);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(in->Poll());  // nothing to copy
  ASSERT_TRUE(in->Wait().ok());
  const std::span<const BlockId> resumed = mgr_->GetSequence(1)->block_table(0);
  EXPECT_EQ(std::vector<BlockId>(resumed.begin(), resumed.end()), table);  // the same blocks
  ExpectContents(1, before);
  EXPECT_EQ(mgr_->free_blocks()[0], 0);
  EXPECT_EQ(mgr_->offload_store()->stats().bytes_read, stats.bytes_read);
  EXPECT_EQ(mgr_->offload_store()->live_handles(), 0);
  ExpectInvariants();
  // It runs on: once a block is free, its next token is scheduled.
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  const SeqId uids[] = {1};
  const int64_t one[] = {1};
  EXPECT_TRUE(mgr_->Schedule({.uids = uids, .lengths = one}).ok());
  ExpectInvariants();
}

// When the copy is needed and no block is free, the resume is refused naming the counts, and the
// sequence stays preempted with its handles.
TEST_F(PreemptTest, AResumeThatNeedsBlocksIsRefusedAndChangesNothing) {
  Make(8, {.host_blocks = 8});
  const auto before = Run(1, 8);
  ASSERT_TRUE(mgr_->PreemptSequence(1)->Wait().ok());
  Run(2, 32);
  ASSERT_EQ(mgr_->free_blocks()[0], 0);
  const int64_t handles = mgr_->offload_store()->live_handles();
  const Result<OffloadTicket> in = mgr_->ResumeSequence(1);
  EXPECT_EQ(in.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(in.status().message().find("needs 2 blocks of group 0, 0 are free"), std::string::npos)
      << in.status();
  EXPECT_EQ(mgr_->offload_store()->live_handles(), handles);
  EXPECT_EQ(mgr_->free_blocks()[0], 0);
  ExpectInvariants();
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  ASSERT_TRUE(mgr_->ResumeSequence(1)->Wait().ok());
  ExpectContents(1, before);
}

// ---- the prefix cache's host level ----------------------------------------------------------

class HostPrefixTest : public PreemptTest {
 protected:
  void MakeCached(int32_t num_blocks, int32_t host_blocks) {
    StateManagerConfig config = Config(num_blocks, {.host_blocks = host_blocks});
    config.prefix_cache.enabled = true;
    auto mgr = StateManager::Create(config, {Group(2)}, CpuDevice(64 << 20));
    ASSERT_TRUE(mgr.ok()) << mgr.status();
    mgr_ = std::move(*mgr);
  }
  static uint8_t Byte(std::span<const TokenId> tokens, int64_t layer, size_t i) {
    uint32_t h = static_cast<uint32_t>(layer) * 2654435761u + static_cast<uint32_t>(i);
    for (const TokenId t : tokens) h = h * 31 + static_cast<uint32_t>(t);
    return static_cast<uint8_t>(h ^ (h >> 13));
  }
  // What a model would write for the block holding `tokens`: a function of them alone.
  std::vector<uint8_t> Expected(std::span<const TokenId> tokens) const {
    std::vector<uint8_t> out;
    for (int64_t layer = 0; layer < 2; ++layer) {
      const TensorView view = *mgr_->GetCache(layer, 0);
      const size_t bytes = static_cast<size_t>(view.stride(0)) * ElementSize(view.dtype);
      for (size_t i = 0; i < bytes; ++i) out.push_back(Byte(tokens, layer, i));
    }
    return out;
  }
  void Write(BlockId b, std::span<const TokenId> tokens) {
    const std::vector<uint8_t> bytes = Expected(tokens);
    size_t at = 0;
    for (int64_t layer = 0; layer < 2; ++layer) {
      const TensorView view = *mgr_->GetCache(layer, 0);
      const size_t n = static_cast<size_t>(view.stride(0)) * ElementSize(view.dtype);
      std::memcpy(static_cast<uint8_t*>(view.data) + static_cast<size_t>(b) * n, &bytes[at], n);
      at += n;
    }
  }
  // Adds `uid` with `prompt`, runs its whole prompt (writing every block it computes), and
  // returns the tokens taken from the cache.
  int64_t Prefill(SeqId uid, const std::vector<TokenId>& prompt, std::string ns = "") {
    EXPECT_TRUE(mgr_->AddSequence(uid, prompt, {.keys = {.ns = std::move(ns)}}).ok());
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
    const Status s = mgr_->Schedule({.uids = uids, .lengths = lengths});
    EXPECT_TRUE(s.ok()) << s;
    const Sequence* seq = mgr_->GetSequence(uid);
    const int64_t cached = seq->seen_tokens();
    const std::span<const BlockId> table = seq->block_table(0);
    for (size_t b = static_cast<size_t>(cached / kBlockSize); b < table.size(); ++b) {
      const size_t end = std::min(prompt.size(), (b + 1) * kBlockSize);
      if (end == (b + 1) * kBlockSize) {
        Write(table[b], std::span(prompt).subspan(b * kBlockSize, kBlockSize));
      }
    }
    EXPECT_TRUE(mgr_->PostForward(uids).ok());
    return cached;
  }
  void ExpectPrefixData(SeqId uid, const std::vector<TokenId>& prompt, size_t blocks) {
    const std::span<const BlockId> table = mgr_->GetSequence(uid)->block_table(0);
    for (size_t b = 0; b < blocks; ++b) {
      EXPECT_EQ(Bytes(0, table[b]), Expected(std::span(prompt).subspan(b * kBlockSize, kBlockSize)))
          << "block " << b;
    }
  }
  static std::vector<TokenId> Prompt(TokenId first, size_t n) {
    std::vector<TokenId> p(n);
    for (size_t i = 0; i < n; ++i) p[i] = first + static_cast<TokenId>(i);
    return p;
  }
};

TEST_F(HostPrefixTest, EvictedBlocksAreDemotedAndPromotedOnAHit) {
  MakeCached(/*num_blocks=*/8, /*host_blocks=*/16);
  const std::vector<TokenId> a = Prompt(100, 17);  // 4 full blocks
  EXPECT_EQ(Prefill(1, a), 0);
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());   // its 4 blocks stay cached, evictable
  EXPECT_EQ(Prefill(2, Prompt(500, 32)), 0);  // takes all 8 blocks: A's are evicted
  EXPECT_EQ(mgr_->host_prefix_stats().demoted, 4);
  EXPECT_EQ(mgr_->host_prefix_stats().entries, 4);
  ExpectInvariants();
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());

  // A's prompt again: nothing on the device, all four blocks on the host.
  EXPECT_EQ(Prefill(3, a), 16);
  EXPECT_EQ(mgr_->GetSequence(3)->cached_prefix_tokens(), 16);
  EXPECT_EQ(mgr_->host_prefix_stats().promoted, 4);
  ExpectPrefixData(3, a, 4);
  ExpectInvariants();
  // Promoted blocks are cached on the device again: a fourth copy hits them there.
  const int64_t promoted = mgr_->host_prefix_stats().promoted;
  EXPECT_EQ(Prefill(4, a), 16);
  EXPECT_EQ(mgr_->host_prefix_stats().promoted, promoted);
  ExpectPrefixData(4, a, 4);
  ExpectInvariants();
}

// A full host level: the demotions the promoting Schedule's own evictions cause must not drop
// (and reuse the slots of) the entries it is promoting.
TEST_F(HostPrefixTest, APromotionSurvivesTheDemotionsOfItsOwnEvictions) {
  MakeCached(/*num_blocks=*/8, /*host_blocks=*/4);
  const std::vector<TokenId> a = Prompt(100, 17);
  Prefill(1, a);
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());
  Prefill(2, Prompt(500, 32));  // evicts A's 4 blocks: the host level is full of them
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  EXPECT_EQ(mgr_->offload_store()->free_host_blocks(0), 0);
  EXPECT_EQ(Prefill(3, a), 16);  // promotes all 4 while evicting 5 of B's blocks
  ExpectPrefixData(3, a, 4);
  ExpectInvariants();
  const StateManager::HostPrefixStats stats = mgr_->host_prefix_stats();
  EXPECT_EQ(stats.promoted, 4);
  EXPECT_EQ(stats.demoted, stats.promoted + stats.dropped + stats.entries);
}

// Two sequences of one batch with the same prompt: the first promotes the host blocks, the
// second does not take the same entries again.
TEST_F(HostPrefixTest, OneBatchPromotesAnEntryOnce) {
  MakeCached(/*num_blocks=*/16, /*host_blocks=*/16);
  const std::vector<TokenId> a = Prompt(100, 17);
  Prefill(1, a);
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());
  Prefill(2, Prompt(500, 64));  // all 16 blocks: A's are demoted
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  ASSERT_TRUE(mgr_->AddSequence(3, a).ok());
  ASSERT_TRUE(mgr_->AddSequence(4, a).ok());
  const SeqId uids[] = {3, 4};
  const int64_t lengths[] = {17, 17};
  const Status s = mgr_->Schedule({.uids = uids, .lengths = lengths});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(mgr_->GetSequence(3)->seen_tokens(), 16);
  EXPECT_EQ(mgr_->GetSequence(4)->seen_tokens(), 0);
  ExpectPrefixData(3, a, 4);
  ExpectInvariants();
}

TEST_F(HostPrefixTest, HostHitsAreExact) {
  MakeCached(8, 16);
  const std::vector<TokenId> a = Prompt(100, 17);
  Prefill(1, a);
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());
  Prefill(2, Prompt(500, 32));  // evicts (demotes) A's blocks
  ASSERT_TRUE(mgr_->FlushSequence(2).ok());
  std::vector<TokenId> b = a;
  b[9] = 7;                     // block 2 differs
  EXPECT_EQ(Prefill(3, b), 8);  // blocks 0 and 1 only
  ExpectPrefixData(3, b, 2);
  ASSERT_TRUE(mgr_->FlushSequence(3).ok());
  EXPECT_EQ(Prefill(4, a, "tenant-b"), 0);  // another namespace never shares
  ExpectInvariants();
}

TEST_F(HostPrefixTest, PreemptionDropsHostBlocksForRoomAndResetClearsThem) {
  MakeCached(8, /*host_blocks=*/4);
  Prefill(1, Prompt(100, 17));  // 5 blocks; flushed: 4 cached, 1 free
  ASSERT_TRUE(mgr_->FlushSequence(1).ok());
  Prefill(2, Prompt(500, 12));  // 3 of the 4 free blocks
  Prefill(3, Prompt(900, 12));  // the last free one and 2 of A's, evicted: demoted
  EXPECT_EQ(mgr_->host_prefix_stats().demoted, 2);
  EXPECT_EQ(mgr_->offload_store()->free_host_blocks(0), 2);
  // Preempting 3 blocks needs 3 host slots: the least recently used host entry makes room.
  ASSERT_TRUE(mgr_->PreemptSequence(3)->Wait().ok());
  EXPECT_EQ(mgr_->host_prefix_stats().dropped, 1);
  EXPECT_EQ(mgr_->host_prefix_stats().entries, 1);
  ExpectInvariants();
  ASSERT_TRUE(mgr_->ResumeSequence(3)->Wait().ok());
  ExpectInvariants();
  mgr_->ResetPrefixCache();
  const StateManager::HostPrefixStats stats = mgr_->host_prefix_stats();
  EXPECT_EQ(stats.entries, 0);
  EXPECT_EQ(stats.dropped, stats.demoted - stats.promoted);  // every entry went one way
  ExpectInvariants();
}

TEST(PreemptConfigTest, OffloadIsOffByDefaultAndABadTierIsRefused) {
  StateManagerConfig config;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = 8};
  auto mgr = StateManager::Create(config, {Group(1)}, CpuDevice(16 << 20));
  ASSERT_TRUE(mgr.ok());
  EXPECT_EQ((*mgr)->offload_store(), nullptr);
  EXPECT_EQ((*mgr)->PreemptSequence(1).status().code(), StatusCode::kFailedPrecondition);
  config.offload = true;  // and no host tier size
  EXPECT_EQ(StateManager::Create(config, {Group(1)}, CpuDevice(16 << 20)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace blockkv
