// SPDX-License-Identifier: Apache-2.0
// The prefix cache's second level: cached blocks evicted from the device are demoted into the
// offload store's host tier instead of being dropped (SGLang HiCache's write_back policy), and a
// prefix lookup that runs past the device's matches continues here and promotes what it finds
// back into device blocks. Internal to the StateManager (docs/offload.md).
//
// An entry keeps the evicted block's whole identity — key, chain id, parent chain id, tokens,
// namespace, adapter, extra bytes — so a match here is as exact as one on the device (tokens,
// namespace, adapter and bytes compared, the parent by chain id), and a promoted block is
// indexed again under its old chain ids, so its descendants still on the host keep matching.
// The level has its own LRU over all groups; it shares the host slots with preempted sequences,
// which come first (MakeRoom drops the least recently used entries for them).
//
// With announce on (StateManagerConfig.kv_events sets it), its stores and drops are events (medium
// kHost) in the prefix cache's queue, so that a router learns what the host holds as it learns
// what the device holds. Off, the queue stays the device's alone, as in-process consumers (and
// prefix_cache_model_test's reference) know it.
//
// Copies are synchronous on the scheduling thread: a demotion must be done before the evicted
// block is handed to its new owner, a promotion before the engine's next forward reads it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "blockkv/block_pool.h"
#include "blockkv/offload.h"
#include "blockkv/prefix_cache.h"
#include "blockkv/status.h"

namespace blockkv::internal {

class PrefixHostTier final : public BlockPool::EvictionListener {
 public:
  struct Stats {
    int64_t demoted = 0;   // evicted blocks copied to the host
    int64_t promoted = 0;  // host entries copied back for a hit
    int64_t dropped = 0;   // entries dropped for room (their keys are gone)
  };

  // Registers itself as the pools' eviction listener in place of `prefix`, which it calls after
  // each demotion. REQUIRES: everything outlives it.
  PrefixHostTier(PrefixCache* prefix, OffloadStore* store, std::span<BlockPool> pools);
  ~PrefixHostTier() override;
  PrefixHostTier(const PrefixHostTier&) = delete;
  PrefixHostTier& operator=(const PrefixHostTier&) = delete;

  // Demotes `block` of `group` (when a host slot can be had), then lets the prefix cache forget
  // it.
  void OnEvict(int group, BlockId block) override;

  // Continues a device match of `first` blocks of `tokens` (`parent`: what block first − 1 was
  // published as; nullptr when first == 0) over at most `max_blocks` more: appends the entries
  // matching blocks first, first + 1, ... to *entries and returns how many.
  int32_t Match(int group, std::span<const TokenId> tokens, int32_t ns_id,
                const BlockKeyExtras& extras, int32_t first, const PrefixCache::Published* parent,
                int32_t max_blocks, std::vector<int32_t>* entries) const;
  // Copies entries[i] into blocks[i] (held, not cached) and indexes each in the prefix cache
  // under its saved identity at `priority`; the entries are dropped. A device error is
  // kInternal: then nothing is indexed and the entries stay.
  Status Promote(int group, std::span<const int32_t> entries, std::span<const BlockId> blocks,
                 int32_t priority);
  // Drops least recently used unpinned entries of `group` until its host tier has `slots` free
  // slots. REQUIRES: free host slots + droppable(group) >= slots.
  void MakeRoom(int group, int32_t slots);
  int32_t droppable(int group) const {
    return per_group_[static_cast<size_t>(group)] - pinned_[static_cast<size_t>(group)];
  }
  // Pins (or unpins) entries a Schedule is about to promote, so that the demotions its own
  // evictions cause never drop them (a dropped entry's slot and index would be reused at once).
  void Pin(std::span<const int32_t> entries, bool pinned);
  // Drops every entry (ResetPrefixCache); returns how many.
  int64_t Clear();

  int64_t size() const { return live_; }
  void set_announce(bool announce) { announce_ = announce; }
  // BlockStored (medium kHost) for every key the level holds, once per (group, key): what a
  // subscriber that lost events needs to rebuild the level (KV events' resync).
  std::vector<BlockStored> StoredKeys() const;
  const Stats& stats() const { return stats_; }
  // Every entry is indexed once under its key, its handle live on the host, the LRU list holds
  // exactly the entries.
  Status CheckInvariants() const;

 private:
  struct Entry {
    OffloadHandle handle;
    int group = 0;
    BlockHash key;
    BlockHash parent_key;
    uint64_t chain_id = 0;
    uint64_t parent_id = 0;
    int64_t adapter_id = 0;
    int32_t ns_id = 0;
    std::string ns;
    std::string bytes;
    std::vector<TokenId> tokens;
    int32_t prev = -1;  // LRU links: least recently used at head_
    int32_t next = -1;
    bool live = false;
    bool pinned = false;
  };

  // Whether a live entry of `group` holds `key` (the level's events, like the device's, are
  // about keys: a second copy of a key says nothing, and only its last copy's drop is a removal).
  bool HasKey(int group, const BlockHash& key) const;
  static BlockStored StoredEvent(const Entry& e);
  void Unlink(int32_t e);
  void PushBack(int32_t e);
  void Drop(int32_t e);
  // An entry of `group` holding exactly this block, or -1.
  int32_t Find(int group, const BlockHash& key, uint64_t parent_id, std::span<const TokenId> tokens,
               int32_t ns_id, const BlockKeyExtras& extras, size_t index) const;

  PrefixCache* prefix_;
  OffloadStore* store_;
  std::span<BlockPool> pools_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_;
  std::vector<std::unordered_multimap<uint64_t, int32_t>> index_;  // per group: key.lo -> entry
  std::vector<int32_t> per_group_;                                 // live entries per group
  std::vector<int32_t> pinned_;                                    // pinned entries per group
  int32_t head_ = -1;
  int32_t tail_ = -1;
  int64_t live_ = 0;
  Stats stats_;
  bool announce_ = false;
};

}  // namespace blockkv::internal
