// SPDX-License-Identifier: Apache-2.0
#include "prefix_host_tier.h"

#include <algorithm>
#include <set>
#include <string_view>
#include <tuple>

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv::internal {
namespace {

std::string_view ExtraBytes(const BlockKeyExtras& extras, size_t index) {
  return index < extras.block_bytes.size() ? std::string_view(extras.block_bytes[index])
                                           : std::string_view();
}

}  // namespace

PrefixHostTier::PrefixHostTier(PrefixCache* prefix, OffloadStore* store, std::span<BlockPool> pools)
    : prefix_(prefix),
      store_(store),
      pools_(pools),
      index_(pools.size()),
      per_group_(pools.size(), 0),
      pinned_(pools.size(), 0) {
  for (BlockPool& pool : pools_) pool.set_eviction_listener(this);
}

PrefixHostTier::~PrefixHostTier() {
  for (BlockPool& pool : pools_) pool.set_eviction_listener(prefix_);
}

void PrefixHostTier::OnEvict(int group, BlockId block) {
  const PrefixCache::CachedBlock b = prefix_->cached_block(group, block);
  const bool known = [&] {  // an exact copy is on the host already
    const auto [first, last] = index_[static_cast<size_t>(group)].equal_range(b.key.lo);
    return std::any_of(first, last, [&](const auto& kv) {
      return entries_[static_cast<size_t>(kv.second)].chain_id == b.chain_id;
    });
  }();
  // Only into a free slot: replacing the least recently used entry copied a block only to throw
  // another away, and preempted sequences take slots back from entries anyway (MakeRoom), so in a
  // preemption-heavy run nearly every such copy was dropped unused (docs/prefix_cache.md).
  if (!known && store_->free_host_blocks(group) > 0) {
    if (Result<OffloadHandle> handle = store_->CopyToHost(group, block); handle.ok()) {
      int32_t e;
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
      } else {
        e = static_cast<int32_t>(entries_.size());
        entries_.emplace_back();
      }
      Entry& entry = entries_[static_cast<size_t>(e)];
      entry.handle = *handle;
      entry.group = group;
      entry.key = b.key;
      entry.parent_key = b.parent_key;
      entry.chain_id = b.chain_id;
      entry.parent_id = b.parent_id;
      entry.adapter_id = b.adapter_id;
      entry.ns_id = prefix_->InternNamespace(b.ns);
      entry.ns.assign(b.ns);
      entry.bytes.assign(b.bytes);
      entry.tokens.assign(b.tokens.begin(), b.tokens.end());
      entry.live = true;
      const bool stored_before = HasKey(group, b.key);
      index_[static_cast<size_t>(group)].emplace(b.key.lo, e);
      PushBack(e);
      if (!stored_before && announce_ && prefix_->events_enabled())
        prefix_->QueueEvent(StoredEvent(entry));
      ++per_group_[static_cast<size_t>(group)];
      ++live_;
      ++stats_.demoted;
    }
    // A failed copy only loses a cache entry: the key is forgotten as without this level.
  }
  prefix_->OnEvict(group, block);
}

int32_t PrefixHostTier::Find(int group, const BlockHash& key, uint64_t parent_id,
                             std::span<const TokenId> tokens, int32_t ns_id,
                             const BlockKeyExtras& extras, size_t index) const {
  const std::string_view extra = ExtraBytes(extras, index);
  const auto [first, last] = index_[static_cast<size_t>(group)].equal_range(key.lo);
  for (auto it = first; it != last; ++it) {
    const Entry& e = entries_[static_cast<size_t>(it->second)];
    if (e.key == key && e.parent_id == parent_id && e.adapter_id == extras.adapter_id &&
        (index > 0 || e.ns_id == ns_id) && e.bytes == extra &&
        std::equal(tokens.begin(), tokens.end(), e.tokens.begin(), e.tokens.end())) {
      return it->second;
    }
  }
  return -1;
}

int32_t PrefixHostTier::Match(int group, std::span<const TokenId> tokens, int32_t ns_id,
                              const BlockKeyExtras& extras, int32_t first,
                              const PrefixCache::Published* parent, int32_t max_blocks,
                              std::vector<int32_t>* entries) const {
  if (live_ == 0) return 0;
  const auto bs = static_cast<size_t>(prefix_->block_size(group));
  BlockHash parent_key = parent != nullptr ? parent->key : BlockHash{};
  uint64_t parent_id = parent != nullptr ? parent->id : 0;
  int32_t n = 0;
  for (; n < max_blocks; ++n) {
    const size_t index = static_cast<size_t>(first) + static_cast<size_t>(n);
    const std::span<const TokenId> block = tokens.subspan(index * bs, bs);
    const BlockHash key = prefix_->Hash(index == 0 ? nullptr : &parent_key, block, extras, index);
    const int32_t e = Find(group, key, parent_id, block, ns_id, extras, index);
    if (e < 0) break;
    entries->push_back(e);
    parent_key = key;
    parent_id = entries_[static_cast<size_t>(e)].chain_id;
  }
  return n;
}

Status PrefixHostTier::Promote(int group, std::span<const int32_t> entries,
                               std::span<const BlockId> blocks, int32_t priority) {
  for (size_t i = 0; i < entries.size(); ++i) {
    BLOCKKV_RETURN_IF_ERROR(
        store_->CopyToDevice(entries_[static_cast<size_t>(entries[i])].handle, blocks[i]));
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries_[static_cast<size_t>(entries[i])];
    prefix_->Restore(group,
                     PrefixCache::CachedBlock{.block = blocks[i],
                                              .chain_id = e.chain_id,
                                              .parent_id = e.parent_id,
                                              .key = e.key,
                                              .parent_key = e.parent_key,
                                              .adapter_id = e.adapter_id,
                                              .ns = e.ns,
                                              .bytes = e.bytes,
                                              .tokens = e.tokens},
                     priority);
    Drop(entries[i]);
    ++stats_.promoted;
  }
  return Status::Ok();
}

bool PrefixHostTier::HasKey(int group, const BlockHash& key) const {
  const auto [first, last] = index_[static_cast<size_t>(group)].equal_range(key.lo);
  return std::any_of(first, last, [&](const auto& kv) {
    return entries_[static_cast<size_t>(kv.second)].key == key;
  });
}

BlockStored PrefixHostTier::StoredEvent(const Entry& e) {
  return BlockStored{.hash = e.key,
                     .has_parent = e.parent_id != 0,
                     .parent = e.parent_key,
                     .tokens = e.tokens,
                     .ns = e.ns,
                     .adapter_id = e.adapter_id,
                     .group = e.group,
                     .medium = CacheMedium::kHost};
}

std::vector<BlockStored> PrefixHostTier::StoredKeys() const {
  std::vector<BlockStored> out;
  std::set<std::tuple<int, uint64_t, uint64_t>> seen;  // one event per (group, key)
  for (int32_t e = head_; e >= 0; e = entries_[static_cast<size_t>(e)].next) {
    const Entry& entry = entries_[static_cast<size_t>(e)];
    if (seen.emplace(entry.group, entry.key.hi, entry.key.lo).second) {
      out.push_back(StoredEvent(entry));
    }
  }
  return out;
}

void PrefixHostTier::Unlink(int32_t e) {
  Entry& entry = entries_[static_cast<size_t>(e)];
  (entry.prev >= 0 ? entries_[static_cast<size_t>(entry.prev)].next : head_) = entry.next;
  (entry.next >= 0 ? entries_[static_cast<size_t>(entry.next)].prev : tail_) = entry.prev;
  entry.prev = entry.next = -1;
}

void PrefixHostTier::PushBack(int32_t e) {
  Entry& entry = entries_[static_cast<size_t>(e)];
  entry.prev = tail_;
  entry.next = -1;
  (tail_ >= 0 ? entries_[static_cast<size_t>(tail_)].next : head_) = e;
  tail_ = e;
}

void PrefixHostTier::Drop(int32_t e) {
  Entry& entry = entries_[static_cast<size_t>(e)];
  const Status dropped = store_->Drop(std::span(&entry.handle, 1));
  BLOCKKV_CHECK(dropped.ok(), "a host-tier prefix entry's handle was not live");
  auto& index = index_[static_cast<size_t>(entry.group)];
  const auto [first, last] = index.equal_range(entry.key.lo);
  for (auto it = first; it != last; ++it) {
    if (it->second == e) {
      index.erase(it);
      break;
    }
  }
  if (announce_ && prefix_->events_enabled() && !HasKey(entry.group, entry.key)) {
    prefix_->QueueEvent(
        BlockRemoved{.hash = entry.key, .group = entry.group, .medium = CacheMedium::kHost});
  }
  Unlink(e);
  --per_group_[static_cast<size_t>(entry.group)];
  if (entry.pinned) --pinned_[static_cast<size_t>(entry.group)];
  entry.pinned = false;
  --live_;
  entry.live = false;
  entry.tokens.clear();
  entry.bytes.clear();
  free_.push_back(e);
}

void PrefixHostTier::MakeRoom(int group, int32_t slots) {
  int32_t e = head_;
  while (store_->free_host_blocks(group) < slots) {
    BLOCKKV_CHECK(e >= 0, "PrefixHostTier::MakeRoom: not enough entries to drop");
    const int32_t next = entries_[static_cast<size_t>(e)].next;
    const Entry& entry = entries_[static_cast<size_t>(e)];
    if (entry.group == group && !entry.pinned) {
      Drop(e);
      ++stats_.dropped;
    }
    e = next;
  }
}

void PrefixHostTier::Pin(std::span<const int32_t> entries, bool pinned) {
  for (const int32_t e : entries) {
    Entry& entry = entries_[static_cast<size_t>(e)];
    if (entry.pinned == pinned) continue;
    entry.pinned = pinned;
    pinned_[static_cast<size_t>(entry.group)] += pinned ? 1 : -1;
  }
}

int64_t PrefixHostTier::Clear() {
  const int64_t n = live_;
  while (head_ >= 0) Drop(head_);
  stats_.dropped += n;
  return n;
}

Status PrefixHostTier::CheckInvariants() const {
  int64_t listed = 0;
  std::vector<int32_t> per_group(per_group_.size(), 0);
  for (int32_t e = head_; e >= 0; e = entries_[static_cast<size_t>(e)].next) {
    const Entry& entry = entries_[static_cast<size_t>(e)];
    if (!entry.live) return InternalError(StrCat("host prefix entry ", e, " is listed but dead"));
    if (++listed > live_) return InternalError("the host prefix LRU list has a cycle");
    ++per_group[static_cast<size_t>(entry.group)];
    const Result<Tier> where = store_->tier(entry.handle);
    if (!where.ok() || *where != Tier::kHost) {
      return InternalError(StrCat("host prefix entry ", e, " has no host copy"));
    }
    const auto [first, last] = index_[static_cast<size_t>(entry.group)].equal_range(entry.key.lo);
    if (std::count_if(first, last, [&](const auto& kv) { return kv.second == e; }) != 1) {
      return InternalError(StrCat("host prefix entry ", e, " is not indexed once"));
    }
  }
  if (listed != live_ || per_group != per_group_) {
    return InternalError(StrCat("host prefix entries: ", listed, " listed, ", live_, " live"));
  }
  return Status::Ok();
}

}  // namespace blockkv::internal
