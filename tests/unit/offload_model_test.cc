// SPDX-License-Identifier: Apache-2.0
// A model-based random test of OffloadStore: a few thousand random operations (fill, offload to
// either tier, restore by group or across groups, spill, drop, poll, wait, scribble, free, calls
// with stale handles) on two cache groups, against a reference that knows the bytes of every
// device block the test owns and of every handle. The disk file fails one write in a while
// (ENOSPC), so offloads and spills fail at random and must lose nothing. After every operation:
// CheckInvariants of the store and the cache, and the counts the reference can bound; at every
// checkpoint (everything waited for) the counts it knows exactly; every restore is compared byte
// for byte.
//
// A ticket's outcome is known only once it is waited for, so the reference keeps each pending
// ticket with what it will mean and resolves it on Wait or a true Poll — and right after any call
// on a handle with a copy in flight, because the store waits for that copy itself (the reference
// then waits on the ticket, which returns at once, and checks the call's result against what it
// learned). A seed fixes the operations, not the worker's timing, so what Poll sees (and hence
// the exact path) can differ between runs; every path is checked the same way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "blockkv/offload.h"
#include "unit/offload_test_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::blockkv_test::Bytes;
using ::blockkv_test::FaultPlan;
using ::blockkv_test::FillRandom;
using ::blockkv_test::ReadBlock;
using ::blockkv_test::TempDir;

constexpr int kGroups = 2;
constexpr int32_t kBlocks = 48;
constexpr int32_t kHostSlots = 20;
constexpr int32_t kDiskSlots = 16;
constexpr int kOps = 3000;
constexpr int kCheckpointEvery = 150;

class OffloadModel {
 public:
  explicit OffloadModel(uint64_t seed) : rng_(seed) {}

  ::testing::AssertionResult Init() {
    cache_ =
        blockkv_test::MakeCache({blockkv_test::SmallGroup(), blockkv_test::OddGroup()}, kBlocks);
    MODEL_CHECK(cache_ != nullptr);
    Result<std::unique_ptr<OffloadStore>> store =
        OffloadStore::Create(cache_.get(), {.host_blocks = kHostSlots,
                                            .disk_path = dir_.File("tier"),
                                            .disk_blocks = kDiskSlots,
                                            .open_file = blockkv_test::FaultyOpener(plan_)});
    MODEL_CHECK(store.ok()) << store.status();
    store_ = std::move(*store);
    live_.resize(kGroups);
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Step(int op) {
    const int what = Pick(0, 99);
    ::testing::AssertionResult r = ::testing::AssertionSuccess();
    if (what < 14) {
      r = Fill();
    } else if (what < 32) {
      r = Offload();
    } else if (what < 50) {
      r = Restore();
    } else if (what < 58) {
      r = Spill();
    } else if (what < 64) {
      r = Drop();
    } else if (what < 72) {
      r = PollOne();
    } else if (what < 78) {
      r = WaitOne();
    } else if (what < 86) {
      r = Scribble();
    } else if (what < 92) {
      r = FreeSome();
    } else if (what < 95) {
      r = Stale();
    } else {
      // Arm a write failure a few writes from now.
      std::lock_guard lock(plan_->mu);
      plan_->writes_ok = Pick(0, 4);
      plan_->failing_writes = 1;
    }
    if (!r) return r;
    if ((op + 1) % kCheckpointEvery == 0) return Checkpoint();
    return CheckBounds();
  }

  // Waits for everything, restores every handle and checks every byte, then destroys the store.
  ::testing::AssertionResult Finish() {
    if (auto r = Checkpoint(); !r) return r;
    for (int g = 0; g < kGroups; ++g) {
      // Make room: give the test's blocks back (their bytes were checked by now or never will be).
      std::vector<BlockId> mine;
      for (const LiveBlock& b : live_[g]) mine.push_back(b.block);
      MODEL_CHECK(cache_->Free(mine, g).ok());
      live_[g].clear();
      std::vector<size_t> idx;
      for (size_t i = 0; i < handles_.size(); ++i) {
        if (handles_[i].group == g) idx.push_back(i);
      }
      if (auto r = RestoreIndices(idx, g); !r) return r;
    }
    if (auto r = Checkpoint(); !r) return r;
    MODEL_CHECK(handles_.empty()) << handles_.size() << " handles left";
    store_.reset();
    for (int g = 0; g < kGroups; ++g) {
      MODEL_CHECK(cache_->free_blocks()[g] == kBlocks - static_cast<int32_t>(live_[g].size()));
    }
    MODEL_CHECK(cache_->CheckInvariants().ok());
    return ::testing::AssertionSuccess();
  }

  int64_t failures_seen() const { return failures_seen_; }
  // For the log: what the run did.
  std::string Summary() const {
    const OffloadStats& s = store_->stats();
    return "offloaded " + std::to_string(s.offloaded_blocks) + ", restored " +
           std::to_string(s.restored_blocks) + ", spilled " + std::to_string(s.spilled_blocks) +
           ", failed tickets " + std::to_string(s.failed_copies) + ", calls with a stale handle " +
           std::to_string(stale_calls_);
  }

 private:
  struct LiveBlock {
    BlockId block;
    Bytes bytes;
  };
  struct Handle {
    OffloadHandle h;
    int group;
    Bytes bytes;
    BlockId source;       // the device block it came from (kept there when its offload failed)
    Tier tier;            // as of its last resolved ticket (the target while an offload runs)
    int64_t pending = 0;  // the pending ticket on it, 0 when none
  };
  enum class Kind { kOffload, kRestore, kSpill };
  struct Pending {
    OffloadTicket ticket;
    Kind kind;
    std::vector<OffloadHandle> handles;
    std::vector<BlockId> blocks;  // restore: the blocks being written
    std::vector<Bytes> bytes;     // restore: what they will hold
    std::vector<int> groups;      // restore: each block's group
  };

  int Pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // The handle in handles_ with this identity, or nullopt.
  std::optional<size_t> Find(OffloadHandle h) const {
    for (size_t i = 0; i < handles_.size(); ++i) {
      if (handles_[i].h == h) return i;
    }
    return std::nullopt;
  }

  // Up to n distinct random indices of handles_ matching `pred`.
  template <class Pred>
  std::vector<size_t> PickHandles(int n, Pred pred) {
    std::vector<size_t> all;
    for (size_t i = 0; i < handles_.size(); ++i) {
      if (pred(handles_[i])) all.push_back(i);
    }
    std::shuffle(all.begin(), all.end(), rng_);
    if (static_cast<int>(all.size()) > n) all.resize(static_cast<size_t>(n));
    return all;
  }

  // --- resolving tickets ---

  // `after_call`: resolved right after a call on its handles, whose own effects (releasing them,
  // a spill done and reaped by this Wait) the store may show already.
  ::testing::AssertionResult Resolve(int64_t id, bool after_call = false) {
    auto it = pending_.find(id);
    MODEL_CHECK(it != pending_.end()) << "pending ticket " << id;
    Pending p = std::move(it->second);
    pending_.erase(it);
    const Status s = p.ticket.Wait();
    if (!s.ok()) ++failures_seen_;
    switch (p.kind) {
      case Kind::kOffload:
        for (const OffloadHandle& oh : p.handles) {
          const std::optional<size_t> i = Find(oh);
          MODEL_CHECK(i.has_value()) << "offloaded handle " << oh.index;
          Handle& h = handles_[*i];
          h.pending = 0;
          if (!s.ok()) {
            MODEL_CHECK(s.code() == StatusCode::kResourceExhausted) << s;
            h.tier = Tier::kDevice;
          }
          const Result<Tier> t = store_->tier(oh);
          MODEL_CHECK(after_call || (t.ok() && *t == h.tier))
              << "handle " << oh.index << " after its offload gave " << s;
        }
        break;
      case Kind::kSpill:
        for (const OffloadHandle& oh : p.handles) {
          const std::optional<size_t> i = Find(oh);
          MODEL_CHECK(i.has_value());
          Handle& h = handles_[*i];
          h.pending = 0;
          if (s.ok()) h.tier = Tier::kDisk;
          const Result<Tier> t = store_->tier(oh);
          MODEL_CHECK(after_call || (t.ok() && *t == h.tier)) << "handle " << oh.index;
        }
        break;
      case Kind::kRestore:
        MODEL_CHECK(s.ok()) << "restore failed without a read fault: " << s;
        for (size_t k = 0; k < p.handles.size(); ++k) {
          const std::optional<size_t> i = Find(p.handles[k]);
          MODEL_CHECK(i.has_value());
          handles_.erase(handles_.begin() + static_cast<std::ptrdiff_t>(*i));
          MODEL_CHECK(store_->tier(p.handles[k]).status().code() == StatusCode::kNotFound);
          MODEL_CHECK(!store_->busy(p.groups[k], p.blocks[k]));
          MODEL_CHECK(ReadBlock(*cache_, p.groups[k], p.blocks[k]) == p.bytes[k])
              << "restored block " << p.blocks[k] << " of group " << p.groups[k];
          live_[p.groups[k]].push_back({p.blocks[k], p.bytes[k]});
          dead_.push_back(p.handles[k]);
        }
        break;
    }
    return ::testing::AssertionSuccess();
  }

  // Resolves the pending tickets on these handles (the store waited for them already when the
  // call reached its checks).
  ::testing::AssertionResult ResolveHandles(const std::vector<OffloadHandle>& hs) {
    for (const OffloadHandle& oh : hs) {
      const std::optional<size_t> i = Find(oh);
      if (!i.has_value() || handles_[*i].pending == 0) continue;
      if (auto r = Resolve(handles_[*i].pending, /*after_call=*/true); !r) return r;
    }
    return ::testing::AssertionSuccess();
  }

  // True when a restore in flight holds one of `hs`: the store waits for it, finds the handle
  // released, and fails the call with kNotFound (restores do not fail in this model).
  bool AnyRestoring(const std::vector<OffloadHandle>& hs) const {
    for (const OffloadHandle& oh : hs) {
      const std::optional<size_t> i = Find(oh);
      if (!i.has_value() || handles_[*i].pending == 0) continue;
      if (pending_.at(handles_[*i].pending).kind == Kind::kRestore) return true;
    }
    return false;
  }
  ::testing::AssertionResult ExpectStaleCall(const Status& s,
                                             const std::vector<OffloadHandle>& hs) {
    MODEL_CHECK(s.code() == StatusCode::kNotFound) << s;
    ++stale_calls_;
    return ResolveHandles(hs);
  }

  int64_t AddPending(Pending p) {
    const int64_t id = next_pending_++;
    for (const OffloadHandle& oh : p.handles) {
      if (const std::optional<size_t> i = Find(oh)) handles_[*i].pending = id;
    }
    pending_.emplace(id, std::move(p));
    return id;
  }

  // --- operations ---

  ::testing::AssertionResult Fill() {
    const int g = Pick(0, kGroups - 1);
    const int32_t n = std::min(Pick(1, 6), cache_->free_blocks()[g]);
    if (n == 0) return ::testing::AssertionSuccess();
    Result<std::vector<BlockId>> blocks = cache_->Reserve(n, g);
    MODEL_CHECK(blocks.ok()) << blocks.status();
    for (BlockId b : *blocks) {
      MODEL_CHECK(!store_->busy(g, b)) << "the cache handed out block " << b << " mid-copy";
      live_[g].push_back({b, FillRandom(*cache_, g, b, rng_)});
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Offload() {
    const int g = Pick(0, kGroups - 1);
    if (live_[g].empty()) return ::testing::AssertionSuccess();
    std::shuffle(live_[g].begin(), live_[g].end(), rng_);
    const size_t n = std::min<size_t>(static_cast<size_t>(Pick(1, 6)), live_[g].size());
    const Tier tier = Pick(0, 2) == 0 ? Tier::kDisk : Tier::kHost;
    std::vector<BlockId> blocks;
    for (size_t i = 0; i < n; ++i) blocks.push_back(live_[g][live_[g].size() - 1 - i].block);
    std::vector<OffloadHandle> out(n);
    Result<OffloadTicket> ticket = store_->Offload(blocks, g, out, tier);
    if (!ticket.ok()) {
      MODEL_CHECK(ticket.status().code() == StatusCode::kResourceExhausted) << ticket.status();
      const int32_t free =
          tier == Tier::kHost ? store_->free_host_blocks(g) : store_->free_disk_blocks(g);
      MODEL_CHECK(free < static_cast<int32_t>(n)) << ticket.status();
      return ::testing::AssertionSuccess();
    }
    Pending p{*ticket, Kind::kOffload, out, {}, {}, {}};
    for (size_t i = 0; i < n; ++i) {
      LiveBlock b = std::move(live_[g].back());
      live_[g].pop_back();
      handles_.push_back({out[i], g, std::move(b.bytes), b.block, tier, 0});
    }
    AddPending(std::move(p));
    return ::testing::AssertionSuccess();
  }

  // Restores handles_[idx] (all of `group`, or kAnyGroup) and checks the result.
  ::testing::AssertionResult RestoreIndices(const std::vector<size_t>& idx, int group) {
    std::vector<OffloadHandle> hs;
    for (size_t i : idx) hs.push_back(handles_[i].h);
    std::vector<BlockId> out(hs.size(), kNoBlock);
    const bool restoring = AnyRestoring(hs);
    Result<OffloadTicket> ticket = store_->Restore(hs, group, out);
    // The free blocks the call decided on: resolving the handles below waits, and may reap
    // other copies that give blocks back.
    const std::vector<int32_t> free_then = cache_->free_blocks();
    if (restoring) return ExpectStaleCall(ticket.status(), hs);
    // Before anything reaps it: the blocks being copied into are busy.
    std::vector<bool> busy(hs.size(), false);
    for (size_t k = 0; k < hs.size() && ticket.ok(); ++k) {
      busy[k] =
          out[k] >= 0 && out[k] < kBlocks && store_->busy(handles_[*Find(hs[k])].group, out[k]);
    }
    if (auto r = ResolveHandles(hs); !r) return r;
    // What the store saw: the handles' tiers after their copies in flight were done.
    std::vector<int32_t> need(kGroups, 0);
    for (const OffloadHandle& oh : hs) {
      const std::optional<size_t> i = Find(oh);
      MODEL_CHECK(i.has_value());
      need[handles_[*i].group] += handles_[*i].tier != Tier::kDevice;
    }
    if (!ticket.ok()) {
      MODEL_CHECK(ticket.status().code() == StatusCode::kResourceExhausted) << ticket.status();
      bool short_somewhere = false;
      for (int g = 0; g < kGroups; ++g) short_somewhere |= free_then[g] < need[g];
      MODEL_CHECK(short_somewhere) << ticket.status();
      for (const OffloadHandle& oh : hs) MODEL_CHECK(store_->tier(oh).ok());
      return ::testing::AssertionSuccess();
    }
    Pending p{*ticket, Kind::kRestore, {}, {}, {}, {}};
    std::set<BlockId> seen[kGroups];
    for (size_t k = 0; k < hs.size(); ++k) {
      const size_t i = *Find(hs[k]);
      const Handle h = handles_[i];
      MODEL_CHECK(out[k] >= 0 && out[k] < kBlocks);
      MODEL_CHECK(seen[h.group].insert(out[k]).second) << "block " << out[k] << " twice";
      if (h.tier == Tier::kDevice) {
        // Handed back at once, the same block with its bytes.
        MODEL_CHECK(out[k] == h.source);
        MODEL_CHECK(ReadBlock(*cache_, h.group, out[k]) == h.bytes);
        MODEL_CHECK(store_->tier(h.h).status().code() == StatusCode::kNotFound);
        live_[h.group].push_back({out[k], h.bytes});
        dead_.push_back(h.h);
        handles_.erase(handles_.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      MODEL_CHECK(busy[k]) << "block " << out[k] << " was not busy while being restored into";
      p.handles.push_back(h.h);
      p.blocks.push_back(out[k]);
      p.bytes.push_back(h.bytes);
      p.groups.push_back(h.group);
    }
    if (p.handles.empty()) {
      MODEL_CHECK(ticket->Poll());
      return ::testing::AssertionSuccess();
    }
    const int64_t id = AddPending(std::move(p));
    // Sometimes wait at once (the engine before a forward pass).
    if (Pick(0, 2) == 0) return Resolve(id);
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Restore() {
    if (handles_.empty()) return ::testing::AssertionSuccess();
    const int n = Pick(1, 5);
    if (Pick(0, 3) == 0) {
      return RestoreIndices(PickHandles(n, [](const Handle&) { return true; }),
                            OffloadStore::kAnyGroup);
    }
    const int g = Pick(0, kGroups - 1);
    std::vector<size_t> idx = PickHandles(n, [g](const Handle& h) { return h.group == g; });
    if (idx.empty()) return ::testing::AssertionSuccess();
    return RestoreIndices(idx, g);
  }

  ::testing::AssertionResult Spill() {
    std::vector<size_t> idx = PickHandles(Pick(1, 5), [](const Handle&) { return true; });
    if (idx.empty()) return ::testing::AssertionSuccess();
    std::vector<OffloadHandle> hs;
    for (size_t i : idx) hs.push_back(handles_[i].h);
    const bool restoring = AnyRestoring(hs);
    Result<OffloadTicket> ticket = store_->Spill(hs);
    // The free disk slots the call decided on (as in RestoreIndices).
    std::vector<int32_t> free_then(kGroups);
    for (int g = 0; g < kGroups; ++g) free_then[g] = store_->free_disk_blocks(g);
    if (restoring) return ExpectStaleCall(ticket.status(), hs);
    if (auto r = ResolveHandles(hs); !r) return r;
    std::vector<int32_t> need(kGroups, 0);
    std::vector<OffloadHandle> moving;
    for (const OffloadHandle& oh : hs) {
      const Handle& h = handles_[*Find(oh)];
      if (h.tier == Tier::kHost) {
        ++need[h.group];
        moving.push_back(oh);
      }
    }
    if (!ticket.ok()) {
      MODEL_CHECK(ticket.status().code() == StatusCode::kResourceExhausted) << ticket.status();
      bool short_somewhere = false;
      for (int g = 0; g < kGroups; ++g) short_somewhere |= free_then[g] < need[g];
      MODEL_CHECK(short_somewhere) << ticket.status();
      return ::testing::AssertionSuccess();
    }
    if (moving.empty()) {
      MODEL_CHECK(ticket->Poll());
      return ::testing::AssertionSuccess();
    }
    AddPending({*ticket, Kind::kSpill, moving, {}, {}, {}});
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Drop() {
    std::vector<size_t> idx = PickHandles(Pick(1, 3), [](const Handle&) { return true; });
    if (idx.empty()) return ::testing::AssertionSuccess();
    std::vector<OffloadHandle> hs;
    for (size_t i : idx) hs.push_back(handles_[i].h);
    const bool restoring = AnyRestoring(hs);
    const Status s = store_->Drop(hs);
    if (restoring) return ExpectStaleCall(s, hs);
    if (auto r = ResolveHandles(hs); !r) return r;
    MODEL_CHECK(s.ok()) << s;
    for (const OffloadHandle& oh : hs) {
      MODEL_CHECK(store_->tier(oh).status().code() == StatusCode::kNotFound);
      handles_.erase(handles_.begin() + static_cast<std::ptrdiff_t>(*Find(oh)));
      dead_.push_back(oh);
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult PollOne() {
    if (pending_.empty()) return ::testing::AssertionSuccess();
    auto it = pending_.begin();
    std::advance(it, Pick(0, static_cast<int>(pending_.size()) - 1));
    if (it->second.ticket.Poll()) return Resolve(it->first);
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult WaitOne() {
    if (pending_.empty()) return ::testing::AssertionSuccess();
    auto it = pending_.begin();
    std::advance(it, Pick(0, static_cast<int>(pending_.size()) - 1));
    return Resolve(it->first);
  }

  // The test writes new bytes into blocks it owns while copies of other blocks run.
  ::testing::AssertionResult Scribble() {
    const int g = Pick(0, kGroups - 1);
    for (LiveBlock& b : live_[g]) {
      if (Pick(0, 2) != 0) continue;
      MODEL_CHECK(!store_->busy(g, b.block)) << "the test owns block " << b.block;
      MODEL_CHECK(ReadBlock(*cache_, g, b.block) == b.bytes) << "block " << b.block << " changed";
      b.bytes = FillRandom(*cache_, g, b.block, rng_);
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult FreeSome() {
    const int g = Pick(0, kGroups - 1);
    std::vector<BlockId> freed;
    std::vector<LiveBlock> kept;
    for (LiveBlock& b : live_[g]) {
      if (Pick(0, 3) == 0) {
        MODEL_CHECK(ReadBlock(*cache_, g, b.block) == b.bytes) << "block " << b.block;
        freed.push_back(b.block);
      } else {
        kept.push_back(std::move(b));
      }
    }
    live_[g] = std::move(kept);
    MODEL_CHECK(cache_->Free(freed, g).ok());
    return ::testing::AssertionSuccess();
  }

  // A call naming a dead handle among live ones fails with kNotFound and changes no handle.
  ::testing::AssertionResult Stale() {
    if (dead_.empty()) return ::testing::AssertionSuccess();
    std::vector<OffloadHandle> hs;
    for (size_t i : PickHandles(2, [](const Handle&) { return true; })) hs.push_back(handles_[i].h);
    hs.insert(hs.begin() + Pick(0, static_cast<int>(hs.size())),
              dead_[static_cast<size_t>(Pick(0, static_cast<int>(dead_.size()) - 1))]);
    std::vector<BlockId> out(hs.size(), kNoBlock);
    const int which = Pick(0, 2);
    const Status s = which == 0   ? store_->Drop(hs)
                     : which == 1 ? store_->Spill(hs).status()
                                  : store_->Restore(hs, OffloadStore::kAnyGroup, out).status();
    MODEL_CHECK(s.code() == StatusCode::kNotFound) << s;
    ++stale_calls_;
    if (auto r = ResolveHandles(hs); !r) return r;
    for (BlockId b : out) MODEL_CHECK(b == kNoBlock);
    for (const Handle& h : handles_) {
      if (AnyRestoring({h.h})) continue;  // it may be released by now
      const Result<Tier> t = store_->tier(h.h);
      MODEL_CHECK(t.ok()) << "handle " << h.h.index << ": " << t.status();
    }
    return ::testing::AssertionSuccess();
  }

  // --- checks ---

  // What holds whatever the worker has done: bounds on the counts, and the invariants.
  ::testing::AssertionResult CheckBounds() {
    MODEL_CHECK(store_->CheckInvariants().ok()) << store_->CheckInvariants();
    MODEL_CHECK(cache_->CheckInvariants().ok()) << cache_->CheckInvariants();
    int64_t restoring = 0;
    for (const auto& [id, p] : pending_) {
      if (p.kind == Kind::kRestore) restoring += static_cast<int64_t>(p.handles.size());
    }
    const int64_t live = store_->live_handles();
    const auto known = static_cast<int64_t>(handles_.size());
    MODEL_CHECK(live <= known && live >= known - restoring)
        << "live " << live << ", the model has " << known << " with " << restoring
        << " being restored";
    return ::testing::AssertionSuccess();
  }

  // Everything waited for: the counts are exact.
  ::testing::AssertionResult Checkpoint() {
    store_->WaitAll();
    while (!pending_.empty()) {
      if (auto r = Resolve(pending_.begin()->first); !r) return r;
    }
    MODEL_CHECK(store_->CheckInvariants().ok()) << store_->CheckInvariants();
    MODEL_CHECK(cache_->CheckInvariants().ok());
    MODEL_CHECK(store_->live_handles() == static_cast<int64_t>(handles_.size()));
    for (int g = 0; g < kGroups; ++g) {
      int32_t host = 0;
      int32_t disk = 0;
      std::vector<BlockId> kept;
      for (const Handle& h : handles_) {
        if (h.group != g) continue;
        MODEL_CHECK(*store_->tier(h.h) == h.tier) << "handle " << h.h.index;
        host += h.tier == Tier::kHost;
        disk += h.tier == Tier::kDisk;
        if (h.tier == Tier::kDevice) kept.push_back(h.source);
      }
      MODEL_CHECK(store_->free_host_blocks(g) == kHostSlots - host) << "group " << g;
      MODEL_CHECK(store_->free_disk_blocks(g) == kDiskSlots - disk) << "group " << g;
      std::vector<BlockId> held = store_->held_blocks(g);
      std::sort(held.begin(), held.end());
      std::sort(kept.begin(), kept.end());
      MODEL_CHECK(held == kept) << "group " << g;
      const auto owned = static_cast<int32_t>(live_[g].size() + kept.size());
      MODEL_CHECK(cache_->free_blocks()[g] == kBlocks - owned)
          << "group " << g << ": " << cache_->free_blocks()[g] << " free, " << owned << " owned";
      for (const LiveBlock& b : live_[g]) {
        MODEL_CHECK(!store_->busy(g, b.block));
        MODEL_CHECK(ReadBlock(*cache_, g, b.block) == b.bytes) << "block " << b.block;
      }
    }
    return ::testing::AssertionSuccess();
  }

  std::mt19937_64 rng_;
  TempDir dir_;
  std::shared_ptr<FaultPlan> plan_ = std::make_shared<FaultPlan>();
  std::unique_ptr<BlockedKVCache> cache_;
  std::unique_ptr<OffloadStore> store_;
  std::vector<std::vector<LiveBlock>> live_;  // [group]: device blocks the test owns
  std::vector<Handle> handles_;               // live handles
  std::vector<OffloadHandle> dead_;           // restored or dropped
  std::map<int64_t, Pending> pending_;
  int64_t next_pending_ = 1;
  int64_t failures_seen_ = 0;
  int64_t stale_calls_ = 0;
};

TEST(OffloadModelTest, RandomOperationsMatchTheReference) {
  for (const uint64_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    OffloadModel model(seed);
    ASSERT_TRUE(model.Init());
    for (int op = 0; op < kOps; ++op)
      ASSERT_TRUE(model.Step(op)) << "seed " << seed << " op " << op;
    EXPECT_GT(model.failures_seen(), 0) << "no injected write failure reached a ticket";
    std::printf("seed %u: %s\n", static_cast<unsigned>(seed), model.Summary().c_str());
    ASSERT_TRUE(model.Finish());
  }
}

}  // namespace
}  // namespace blockkv
