// SPDX-License-Identifier: Apache-2.0
// OffloadStore's copies racing with the scheduling thread, for ThreadSanitizer (the `tsan` preset
// runs this with the rest of the `offload` label) and as a plain stress test elsewhere.
//
// The scheduling thread keeps many tickets outstanding while it offloads, restores (also handles
// whose offload is still running), spills, drops, copies blocks to and from host slots itself
// (CopyToHost / CopyToDevice), and Reserve/Free-s and writes other blocks of the same cache — so
// the worker reads and writes device blocks and host slots while the test thread writes their
// neighbours, takes blocks the store has just given back, and reuses slots the store has just
// freed. A block given back or a slot reused before its copy is done shows up as a data race under
// TSan, and as wrong bytes in the checks at the end of each round everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "blockkv/offload.h"
#include "unit/offload_test_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::blockkv_test::Bytes;
using ::blockkv_test::ReadBlock;
using ::blockkv_test::TempDir;
using ::blockkv_test::WriteBlock;

// 4 layers, 16 tokens, 2 heads of 16, fp16: 4·16·2·2·16·2 = 8 KiB per block, so a copy takes
// long enough for the scheduling thread to get ahead of the worker.
KVCacheConfig RaceGroup() {
  return {.block_size = 16, .cache_shape = {4, 2, 16}, .cache_dtype = DType::kFloat16};
}

constexpr int32_t kBlocks = 192;

// Contents unique to `tag`: word i is tag·φ + i. Cheap enough for a Debug build under TSan, where
// a random generator per word would cost more than everything else the test does.
Bytes Pattern(uint64_t tag, int64_t bytes) {
  Bytes out(static_cast<size_t>(bytes));
  const uint64_t base = tag * 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i + 8 <= out.size(); i += 8) {
    const uint64_t word = base + i;
    std::memcpy(out.data() + i, &word, 8);
  }
  return out;
}

struct Offloaded {
  OffloadHandle handle;
  Bytes bytes;
};
struct Restoring {
  OffloadTicket ticket;
  std::vector<BlockId> blocks;
  std::vector<Bytes> bytes;
};
struct Owned {
  BlockId block;
  Bytes bytes;
};

class OffloadRace {
 public:
  OffloadRace(uint64_t seed, bool disk) : rng_(seed), disk_(disk) {}

  void Run(int rounds, int steps_per_round) {
    cache_ = blockkv_test::MakeCache({RaceGroup(), blockkv_test::OddGroup()}, kBlocks);
    ASSERT_NE(cache_, nullptr);
    OffloadConfig config{.host_blocks = 96};
    if (disk_) {
      config.disk_path = dir_.File("tier");
      config.disk_blocks = 64;
    }
    Result<std::unique_ptr<OffloadStore>> store = OffloadStore::Create(cache_.get(), config);
    ASSERT_OK(store);
    store_ = std::move(*store);
    for (int round = 0; round < rounds; ++round) {
      SCOPED_TRACE(round);
      for (int step = 0; step < steps_per_round; ++step) {
        ASSERT_NO_FATAL_FAILURE(Step());
      }
      ASSERT_NO_FATAL_FAILURE(Settle());
    }
    // Leave copies in flight for the destructor.
    ASSERT_NO_FATAL_FAILURE(Step());
    ASSERT_NO_FATAL_FAILURE(OffloadSome(0, 8));
    store_.reset();
    for (int g = 0; g < 2; ++g) {
      size_t mine = owned_[g].size();
      for (const Restoring& r : restoring_[g]) mine += r.blocks.size();
      EXPECT_EQ(cache_->free_blocks()[g] + static_cast<int32_t>(mine), kBlocks) << "group " << g;
    }
    EXPECT_OK(cache_->CheckInvariants());
  }

 private:
  int Pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // Writes new contents into block `b` of group g and returns them.
  Bytes Fill(int g, BlockId b) {
    Bytes bytes = Pattern(++tag_, *cache_->config(g).bytes_per_block());
    WriteBlock(*cache_, g, b, bytes);
    return bytes;
  }

  void Step() {
    const int what = Pick(0, 11);
    const int g = Pick(0, 3) == 0 ? 1 : 0;
    if (what < 3) {
      ReserveSome(g, Pick(1, 8));
    } else if (what < 6) {
      OffloadSome(g, Pick(1, 8));
    } else if (what < 8) {
      RestoreSome(g, Pick(1, 6));
    } else if (what == 8) {
      FreeAndScribble(g);
    } else if (what == 9) {
      SpillOrDrop(g);
    } else if (what == 10) {
      SyncCopies(g);
    } else {
      // A burst: many small offloads back to back, then restores of the newest handles, whose
      // offloads are likely still queued.
      ReserveSome(g, 16);
      for (int i = Pick(4, 12); i > 0; --i) OffloadSome(g, static_cast<size_t>(Pick(1, 2)));
      RestoreSome(g, static_cast<size_t>(Pick(1, 4)));
    }
    // Poll the oldest outstanding tickets: the store applies what is done.
    while (!offloads_.empty() && offloads_.front().Poll()) offloads_.pop_front();
    EXPECT_OK(store_->CheckInvariants());
  }

  // Takes blocks from the cache (ones an offload just gave back among them) and writes them.
  void ReserveSome(int g, int32_t n) {
    n = std::min(n, cache_->free_blocks()[g]);
    if (n == 0) return;
    Result<std::vector<BlockId>> blocks = cache_->Reserve(n, g);
    ASSERT_OK(blocks);
    for (BlockId b : *blocks) {
      ASSERT_FALSE(store_->busy(g, b)) << "block " << b << " handed out with a copy in flight";
      owned_[g].push_back({b, Fill(g, b)});
    }
  }

  void OffloadSome(int g, size_t n) {
    n = std::min(n, owned_[g].size());
    const Tier tier = disk_ && Pick(0, 2) == 0 ? Tier::kDisk : Tier::kHost;
    const int32_t free =
        tier == Tier::kHost ? store_->free_host_blocks(g) : store_->free_disk_blocks(g);
    n = std::min(n, static_cast<size_t>(free));
    if (n == 0) return;
    std::shuffle(owned_[g].begin(), owned_[g].end(), rng_);
    std::vector<BlockId> blocks;
    for (size_t i = 0; i < n; ++i) blocks.push_back(owned_[g][owned_[g].size() - 1 - i].block);
    std::vector<OffloadHandle> out(n);
    Result<OffloadTicket> ticket = store_->Offload(blocks, g, out, tier);
    ASSERT_OK(ticket);
    offloads_.push_back(*ticket);
    for (size_t i = 0; i < n; ++i) {
      handles_[g].push_back({out[i], std::move(owned_[g].back().bytes)});
      owned_[g].pop_back();
    }
  }

  // Restores handles, most often the newest (whose offload may still be running).
  void RestoreSome(int g, size_t n) {
    n = std::min(n, handles_[g].size());
    if (n == 0) return;
    if (Pick(0, 1) == 0) std::shuffle(handles_[g].begin(), handles_[g].end(), rng_);
    std::vector<OffloadHandle> hs;
    Restoring r;
    for (size_t i = 0; i < n; ++i) {
      hs.push_back(handles_[g].back().handle);
      r.bytes.push_back(std::move(handles_[g].back().bytes));
      handles_[g].pop_back();
    }
    r.blocks.assign(n, kNoBlock);
    Result<OffloadTicket> ticket = store_->Restore(hs, g, r.blocks);
    if (ticket.status().code() ==
        StatusCode::kResourceExhausted) {  // the cache is full: put them back
      for (size_t i = 0; i < n; ++i) handles_[g].push_back({hs[i], std::move(r.bytes[i])});
      return;
    }
    ASSERT_OK(ticket);
    r.ticket = *ticket;
    restoring_[g].push_back(std::move(r));
  }

  // Frees some owned blocks (checking them first) and rewrites others, while copies run.
  void FreeAndScribble(int g) {
    std::vector<BlockId> freed;
    std::vector<Owned> kept;
    for (Owned& o : owned_[g]) {
      const int what = Pick(0, 3);
      if (what == 0) {
        ASSERT_TRUE(ReadBlock(*cache_, g, o.block) == o.bytes) << "block " << o.block;
        freed.push_back(o.block);
        continue;
      }
      if (what == 1) o.bytes = Fill(g, o.block);
      kept.push_back(std::move(o));
    }
    owned_[g] = std::move(kept);
    ASSERT_OK(cache_->Free(freed, g));
  }

  // The prefix cache's synchronous copies, on this thread while the worker copies other blocks
  // and slots: an owned block to a new host handle, and that handle into another owned block.
  void SyncCopies(int g) {
    if (owned_[g].size() < 2 || store_->free_host_blocks(g) == 0) return;
    std::shuffle(owned_[g].begin(), owned_[g].end(), rng_);
    Result<OffloadHandle> h = store_->CopyToHost(g, owned_[g][0].block);
    ASSERT_OK(h);
    handles_[g].push_back({*h, owned_[g][0].bytes});
    ASSERT_OK(store_->CopyToDevice(*h, owned_[g][1].block));
    owned_[g][1].bytes = owned_[g][0].bytes;
  }

  void SpillOrDrop(int g) {
    if (handles_[g].empty()) return;
    const size_t i = static_cast<size_t>(Pick(0, static_cast<int>(handles_[g].size()) - 1));
    const OffloadHandle h = handles_[g][i].handle;
    if (disk_ && Pick(0, 1) == 0) {
      Result<OffloadTicket> spill = store_->Spill(std::span(&h, 1));
      if (spill.status().code() == StatusCode::kResourceExhausted) return;
      ASSERT_OK(spill);
      offloads_.push_back(*spill);
      return;
    }
    ASSERT_OK(store_->Drop(std::span(&h, 1)));
    handles_[g].erase(handles_[g].begin() + static_cast<std::ptrdiff_t>(i));
  }

  // Waits for the restores of group g and checks their blocks, which are the test's from then on.
  void FinishRestores(int g) {
    for (Restoring& r : restoring_[g]) {
      ASSERT_OK(r.ticket.Wait());
      for (size_t i = 0; i < r.blocks.size(); ++i) {
        ASSERT_TRUE(ReadBlock(*cache_, g, r.blocks[i]) == r.bytes[i])
            << "group " << g << " block " << r.blocks[i];
        owned_[g].push_back({r.blocks[i], std::move(r.bytes[i])});
      }
    }
    restoring_[g].clear();
  }

  // Waits for everything and checks every byte: restored blocks, owned blocks, and (by restoring
  // half of them) offloaded ones.
  void Settle() {
    for (OffloadTicket& t : offloads_) EXPECT_OK(t.Wait());
    offloads_.clear();
    for (int g = 0; g < 2; ++g) {
      ASSERT_NO_FATAL_FAILURE(FinishRestores(g));
      for (const Owned& o : owned_[g]) {
        ASSERT_TRUE(ReadBlock(*cache_, g, o.block) == o.bytes) << "group " << g;
      }
      ASSERT_NO_FATAL_FAILURE(RestoreSome(g, handles_[g].size() / 2));
      ASSERT_NO_FATAL_FAILURE(FinishRestores(g));
    }
    ASSERT_OK(store_->CheckInvariants());
    EXPECT_EQ(store_->live_handles(),
              static_cast<int64_t>(handles_[0].size() + handles_[1].size()));
  }

  std::mt19937_64 rng_;
  uint64_t tag_ = 0;
  bool disk_;
  TempDir dir_;
  std::unique_ptr<BlockedKVCache> cache_;
  std::unique_ptr<OffloadStore> store_;
  std::vector<Owned> owned_[2];
  std::vector<Offloaded> handles_[2];
  std::vector<Restoring> restoring_[2];
  std::deque<OffloadTicket> offloads_;  // offload and spill tickets, oldest first
};

TEST(OffloadRaceTest, HostTierCopiesRaceWithTheSchedulingThread) {
  OffloadRace race(/*seed=*/31, /*disk=*/false);
  race.Run(/*rounds=*/6, /*steps_per_round=*/250);
}

TEST(OffloadRaceTest, HostAndDiskTierCopiesRaceWithTheSchedulingThread) {
  OffloadRace race(/*seed=*/32, /*disk=*/true);
  race.Run(/*rounds=*/6, /*steps_per_round=*/250);
}

}  // namespace
}  // namespace blockkv
