// SPDX-License-Identifier: Apache-2.0
#include "blockkv/prefix_cache.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <utility>

#include "internal/check.h"
#include "internal/strings.h"
#include "internal/uid_map.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace blockkv {

using internal::StrCat;

static_assert(std::endian::native == std::endian::little,
              "block keys hash a little-endian encoding; add byte swaps for this machine");

std::string ToString(const BlockHash& hash) {
  std::string out;
  out.reserve(32);
  internal::AppendHex64(out, hash.hi);
  internal::AppendHex64(out, hash.lo);
  return out;
}

BlockHash Xxh3BlockHash(std::span<const std::byte> bytes, uint64_t seed) {
  const XXH128_hash_t h = XXH3_128bits_withSeed(bytes.data(), bytes.size(), seed);
  return {h.low64, h.high64};
}

namespace {

// Writes `value` at out[at, at + sizeof(T)) and returns the next offset.
template <class T>
size_t Put(std::span<std::byte> out, size_t at, const T& value) {
  std::memcpy(out.data() + at, &value, sizeof(T));
  return at + sizeof(T);
}

size_t PutBytes(std::span<std::byte> out, size_t at, std::string_view bytes) {
  at = Put(out, at, static_cast<uint32_t>(bytes.size()));
  if (!bytes.empty()) std::memcpy(out.data() + at, bytes.data(), bytes.size());
  return at + bytes.size();
}

std::string_view BlockBytes(const BlockKeyExtras& extras, size_t index) {
  return index < extras.block_bytes.size() ? std::string_view(extras.block_bytes[index]) : "";
}

// The encoding H hashes, little-endian: a version byte, a has-parent byte, the parent key
// (zeros without one), the adapter id, the token count and ids, the namespace (block 0 only) and
// the block's extra bytes, each with a u32 length.
std::string_view KeyNamespace(const BlockKeyExtras& extras, size_t index) {
  return index == 0 ? std::string_view(extras.ns) : std::string_view();
}

size_t EncodedKeySize(std::span<const TokenId> tokens, const BlockKeyExtras& extras, size_t index) {
  return 2 + 16 + 8 + 4 + tokens.size_bytes() + 4 + KeyNamespace(extras, index).size() + 4 +
         BlockBytes(extras, index).size();
}

// REQUIRES: out.size() == EncodedKeySize(tokens, extras, index).
void EncodeBlockKey(std::span<std::byte> out, const BlockHash* parent,
                    std::span<const TokenId> tokens, const BlockKeyExtras& extras, size_t index) {
  const std::string_view ns = KeyNamespace(extras, index);
  const std::string_view bytes = BlockBytes(extras, index);
  size_t at = Put(out, 0, uint8_t{1});
  at = Put(out, at, static_cast<uint8_t>(parent != nullptr));
  at = Put(out, at, parent != nullptr ? parent->lo : uint64_t{0});
  at = Put(out, at, parent != nullptr ? parent->hi : uint64_t{0});
  at = Put(out, at, extras.adapter_id);
  at = Put(out, at, static_cast<uint32_t>(tokens.size()));
  std::memcpy(out.data() + at, tokens.data(), tokens.size_bytes());
  at = PutBytes(out, at + tokens.size_bytes(), ns);
  PutBytes(out, at, bytes);
}

}  // namespace

BlockHash HashBlock(const BlockHash* parent, std::span<const TokenId> tokens,
                    const BlockKeyExtras& extras, size_t block_index, uint64_t seed,
                    BlockHashFunction hash) {
  // Encoded on the stack when it fits (blocks of up to ~500 tokens without extra bytes): nothing
  // is allocated or shared, so PrefixCache::Hash is a const method that writes no member.
  const size_t size = EncodedKeySize(tokens, extras, block_index);
  std::array<std::byte, 2048> stack;  // NOLINT(cppcoreguidelines-pro-type-member-init): written
  if (size <= stack.size()) {
    const std::span<std::byte> key(stack.data(), size);
    EncodeBlockKey(key, parent, tokens, extras, block_index);
    return hash(key, seed);
  }
  std::vector<std::byte> heap(size);
  EncodeBlockKey(heap, parent, tokens, extras, block_index);
  return hash(heap, seed);
}

// ---- the index --------------------------------------------------------------------------------

// One cache group's keys. What a candidate check reads sits in one 64-byte record per block;
// the token ids it compares last are one more line. Blocks whose hashes share their low 64 bits
// form a bucket: a doubly linked list through the records whose head the index maps hash.lo to.
//
// Chain ids: exact copies of one block (same key, parent chain, tokens, adapter, namespace for
// block 0, bytes; two sequences that computed the same prefix) share one chain id, and a child
// names its parent by it, so any copy of a parent leads to the children of every copy. An id is
// never given to other contents, so a chain of matches is exact whatever the hash does.
struct PrefixCache::Group {
  struct alignas(64) Record {
    BlockHash hash;
    uint64_t chain_id = 0;   // 0 = not indexed
    uint64_t parent_id = 0;  // the parent's chain id; 0 for block 0
    int64_t adapter = 0;
    BlockId next = kNoBlock;  // bucket links, kNoBlock at the ends
    BlockId prev = kNoBlock;
    int32_t ns = 0;          // namespace id (block 0; inherited through the chain after)
    bool has_bytes = false;  // bytes[block] is not empty
  };

  Group(int32_t num_blocks, int32_t tokens_per_block)
      : index(num_blocks),
        records(static_cast<size_t>(num_blocks)),
        parent_hash(static_cast<size_t>(num_blocks)),
        bytes(static_cast<size_t>(num_blocks)),
        tokens(static_cast<size_t>(num_blocks) * static_cast<size_t>(tokens_per_block)),
        block_size(tokens_per_block) {}

  std::span<const TokenId> Tokens(BlockId block) const {
    return {tokens.data() + static_cast<size_t>(block) * static_cast<size_t>(block_size),
            static_cast<size_t>(block_size)};
  }
  BlockId Head(const BlockHash& key) const {
    const int32_t head = index.Find(static_cast<int64_t>(key.lo));
    return head == internal::UidMap::kAbsent ? kNoBlock : head;
  }
  // Whether some indexed block has exactly this key (what routers were told is cached).
  bool HasKey(const BlockHash& key) const {
    for (BlockId b = Head(key); b != kNoBlock; b = records[static_cast<size_t>(b)].next) {
      if (records[static_cast<size_t>(b)].hash == key) return true;
    }
    return false;
  }
  // Whether `block` holds block `i` of a sequence with these tokens and extras, keyed `key`,
  // whose parent (i > 0) has chain id `parent_id`.
  bool Holds(BlockId block, const BlockHash& key, uint64_t parent_id, std::span<const TokenId> want,
             int32_t ns_id, const BlockKeyExtras& extras, size_t i) const {
    const Record& r = records[static_cast<size_t>(block)];
    const std::string_view extra = BlockBytes(extras, i);
    return r.hash == key && r.parent_id == parent_id && r.adapter == extras.adapter_id &&
           (i > 0 || r.ns == ns_id) && r.has_bytes == !extra.empty() &&
           (!r.has_bytes || bytes[static_cast<size_t>(block)] == extra) &&
           std::equal(want.begin(), want.end(), Tokens(block).begin());
  }

  internal::UidMap index;              // hash.lo → first block of the bucket
  std::vector<Record> records;         // [num_blocks]
  std::vector<BlockHash> parent_hash;  // [num_blocks] key it was chained from (window anchor)
  std::vector<std::string> bytes;      // [num_blocks] extra bytes, usually empty
  std::vector<TokenId> tokens;         // [num_blocks, block_size]
  int32_t block_size;
  int64_t cached = 0;
};

PrefixCache::PrefixCache(PrefixCacheConfig config, std::span<BlockPool> pools,
                         std::vector<int32_t> block_sizes)
    : config_(std::move(config)), pools_(pools), block_sizes_(std::move(block_sizes)) {
  BLOCKKV_CHECK(pools_.size() == block_sizes_.size(), "PrefixCache: one block size per pool");
  if (config_.hash_function == nullptr) config_.hash_function = Xxh3BlockHash;
  for (size_t g = 0; g < pools_.size(); ++g) {
    groups_.push_back(std::make_unique<Group>(pools_[g].num_blocks(), block_sizes_[g]));
    pools_[g].set_eviction_listener(this);
  }
  InternNamespace("");
}

PrefixCache::~PrefixCache() {
  for (BlockPool& pool : pools_) pool.set_eviction_listener(nullptr);
}

BlockHash PrefixCache::Hash(const BlockHash* parent, std::span<const TokenId> block_tokens,
                            const BlockKeyExtras& extras, size_t index) const {
  return HashBlock(parent, block_tokens, extras, index, config_.hash_seed, config_.hash_function);
}

void PrefixCache::ChainKeys(std::span<const TokenId> tokens, int32_t block_size,
                            const BlockKeyExtras& extras, std::span<BlockHash> out) const {
  const auto n = static_cast<size_t>(block_size);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = Hash(i == 0 ? nullptr : &out[i - 1], tokens.subspan(i * n, n), extras, i);
  }
}

int32_t PrefixCache::InternNamespace(std::string_view ns) {
  auto [it, inserted] =
      ns_ids_.try_emplace(std::string(ns), static_cast<int32_t>(ns_names_.size()));
  if (inserted) {
    ns_names_.emplace_back(ns);
    ns_stats_.emplace_back();
  }
  return it->second;
}

BlockId PrefixCache::Find(int group, const BlockHash& key, uint64_t parent_id,
                          std::span<const TokenId> want, int32_t ns_id,
                          const BlockKeyExtras& extras, size_t index) const {
  const Group& g = *groups_[group];
  for (BlockId b = g.Head(key); b != kNoBlock; b = g.records[b].next) {
    if (g.Holds(b, key, parent_id, want, ns_id, extras, index)) return b;
  }
  return kNoBlock;
}

int32_t PrefixCache::Match(int group, std::span<const TokenId> tokens, int32_t ns_id,
                           const BlockKeyExtras& extras, int32_t max_blocks, std::span<BlockId> out,
                           BlockHash* last_key) const {
  const Group& g = *groups_[group];
  const auto bs = static_cast<size_t>(block_sizes_[group]);
  const auto limit = std::min(static_cast<size_t>(max_blocks), tokens.size() / bs);
  // A software pipeline over the chain: keys are hashed kAhead blocks ahead of the comparison,
  // each prefetching its index slot as it is made; one block ahead, the slot (loaded by then)
  // names the bucket head, whose record and token ids are prefetched in turn. A cold index slot,
  // record and tokens then cost one memory latency together, not three in a row.
  constexpr size_t kAhead = 4;
  std::array<BlockHash, kAhead + 1> keys;  // keys[i % (kAhead + 1)] is block i's
  size_t hashed = 0;                       // blocks [0, hashed) have their key
  auto hash_next = [&] {
    const BlockHash* parent = hashed == 0 ? nullptr : &keys[(hashed - 1) % keys.size()];
    BlockHash& key = keys[hashed % keys.size()];
    key = Hash(parent, tokens.subspan(hashed * bs, bs), extras, hashed);
    g.index.Prefetch(static_cast<int64_t>(key.lo));
    ++hashed;
  };
  auto prefetch_head = [&](size_t i) {
    const BlockId head = g.Head(keys[i % keys.size()]);
    if (head == kNoBlock) return;
    __builtin_prefetch(&g.records[static_cast<size_t>(head)]);
    __builtin_prefetch(g.Tokens(head).data());
  };
  while (hashed < std::min(limit, kAhead)) hash_next();
  if (limit > 0) prefetch_head(0);
  uint64_t parent = 0;  // chain id of the block matched just before
  size_t i = 0;
  for (; i < limit; ++i) {
    if (hashed < limit) hash_next();
    if (i + 1 < limit) prefetch_head(i + 1);
    const BlockHash& key = keys[i % keys.size()];
    const BlockId found = Find(group, key, parent, tokens.subspan(i * bs, bs), ns_id, extras, i);
    if (found == kNoBlock) break;
    out[i] = found;
    parent = g.records[found].chain_id;
    *last_key = key;
  }
  return static_cast<int32_t>(i);
}

void PrefixCache::MatchWindow(int group, std::span<const TokenId> tokens, int32_t ns_id,
                              const BlockKeyExtras& extras, int32_t max_blocks,
                              std::span<BlockId> out, std::span<BlockHash> keys) const {
  const Group& g = *groups_[group];
  const auto bs = static_cast<size_t>(block_sizes_[group]);
  const auto limit = std::min(static_cast<size_t>(max_blocks), tokens.size() / bs);
  for (size_t i = 0; i < limit; ++i) {
    const std::span<const TokenId> want = tokens.subspan(i * bs, bs);
    keys[i] = Hash(i == 0 ? nullptr : &keys[i - 1], want, extras, i);
    if (i == 0 || out[i - 1] != kNoBlock) {
      const uint64_t parent = i == 0 ? 0 : g.records[out[i - 1]].chain_id;
      out[i] = Find(group, keys[i], parent, want, ns_id, extras, i);
      continue;
    }
    // Block i − 1 matched nothing: anchor on the key this block was chained from.
    out[i] = kNoBlock;
    for (BlockId b = g.Head(keys[i]); b != kNoBlock && out[i] == kNoBlock; b = g.records[b].next) {
      const uint64_t parent = g.records[b].parent_id;
      if (parent != 0 && g.parent_hash[b] == keys[i - 1] &&
          g.Holds(b, keys[i], parent, want, ns_id, extras, i)) {
        out[i] = b;
      }
    }
  }
}

PrefixCache::Published PrefixCache::Publish(int group, BlockId block, const Published* parent,
                                            const BlockHash& key,
                                            std::span<const TokenId> block_tokens, int32_t ns_id,
                                            const BlockKeyExtras& extras, size_t index,
                                            int32_t priority) {
  BLOCKKV_CHECK(parent == nullptr || parent->id != 0, "PrefixCache::Publish: a parent without id");
  const uint64_t parent_id = parent == nullptr ? 0 : parent->id;
  // An exact copy already cached lends its chain id, so children of either are found from both.
  const BlockId copy = Find(group, key, parent_id, block_tokens, ns_id, extras, index);
  const uint64_t id = copy != kNoBlock ? groups_[group]->records[copy].chain_id : ++last_chain_id_;
  Insert(group,
         {.block = block,
          .chain_id = id,
          .parent_id = parent_id,
          .key = key,
          .parent_key = parent == nullptr ? BlockHash{} : parent->key,
          .adapter_id = extras.adapter_id,
          .ns = ns_names_[static_cast<size_t>(ns_id)],
          .bytes = BlockBytes(extras, index),
          .tokens = block_tokens},
         ns_id, priority);
  return {id, key};
}

void PrefixCache::Restore(int group, const CachedBlock& b, int32_t priority) {
  BLOCKKV_CHECK(b.parent_id < b.chain_id, "PrefixCache::Restore: a parent id after its child's");
  last_chain_id_ = std::max(last_chain_id_, b.chain_id);
  Insert(group, b, InternNamespace(b.ns), priority);
}

void PrefixCache::Insert(int group, const CachedBlock& b, int32_t ns_id, int32_t priority) {
  Group& g = *groups_[group];
  Group::Record& r = g.records[b.block];
  BLOCKKV_CHECK(r.chain_id == 0 && !pools_[group].is_cached(b.block),
                "PrefixCache: publishing a block that is cached already");
  BLOCKKV_CHECK(b.tokens.size() == static_cast<size_t>(g.block_size),
                "PrefixCache: a block is published full");
  pools_[group].MarkCached(b.block, priority);
  const BlockId head = g.Head(b.key);
  const bool stored_before = g.HasKey(b.key);  // then routers know it already
  r = Group::Record{.hash = b.key,
                    .chain_id = b.chain_id,
                    .parent_id = b.parent_id,
                    .adapter = b.adapter_id,
                    .next = head,
                    .prev = kNoBlock,
                    .ns = ns_id,
                    .has_bytes = !b.bytes.empty()};
  g.parent_hash[b.block] = b.parent_key;
  g.bytes[b.block] = b.bytes;
  std::copy(b.tokens.begin(), b.tokens.end(),
            g.tokens.begin() + static_cast<std::ptrdiff_t>(b.block) * g.block_size);
  // Newest first in its bucket.
  const auto bucket = static_cast<int64_t>(b.key.lo);
  if (head != kNoBlock) {
    g.records[head].prev = b.block;
    g.index.Erase(bucket);
  }
  g.index.Insert(bucket, b.block);
  ++g.cached;
  if (config_.max_events > 0 && !stored_before) {
    Emit(BlockStored{.hash = b.key,
                     .has_parent = b.parent_id != 0,
                     .parent = b.parent_key,
                     .tokens = std::vector<TokenId>(b.tokens.begin(), b.tokens.end()),
                     .ns = ns_names_[static_cast<size_t>(ns_id)],
                     .adapter_id = b.adapter_id,
                     .group = group});
  }
}

std::vector<PrefixCache::CachedBlock> PrefixCache::CachedBlocks(int group) const {
  const Group& g = *groups_[group];
  std::vector<CachedBlock> blocks;
  blocks.reserve(static_cast<size_t>(g.cached));
  // Each bucket from its tail (its oldest block) to its head: restoring blocks in this order
  // rebuilds every bucket as it is, and with it which of several exact copies a hit takes.
  for (BlockId tail = 0; tail < pools_[group].num_blocks(); ++tail) {
    if (g.records[tail].chain_id == 0 || g.records[tail].next != kNoBlock) continue;
    for (BlockId b = tail; b != kNoBlock; b = g.records[b].prev) {
      blocks.push_back(cached_block(group, b));
    }
  }
  return blocks;
}

PrefixCache::CachedBlock PrefixCache::cached_block(int group, BlockId block) const {
  const Group& g = *groups_[group];
  const Group::Record& r = g.records[block];
  BLOCKKV_CHECK(r.chain_id != 0, "PrefixCache::cached_block: the block is not cached");
  return {.block = block,
          .chain_id = r.chain_id,
          .parent_id = r.parent_id,
          .key = r.hash,
          .parent_key = g.parent_hash[block],
          .adapter_id = r.adapter,
          .ns = ns_names_[static_cast<size_t>(r.ns)],
          .bytes = g.bytes[block],
          .tokens = g.Tokens(block)};
}

PrefixCache::Published PrefixCache::published(int group, BlockId block) const {
  const Group::Record& r = groups_[group]->records[block];
  return {r.chain_id, r.hash};
}

void PrefixCache::Forget(int group, BlockId block, bool announce) {
  Group& g = *groups_[group];
  Group::Record& r = g.records[block];
  BLOCKKV_CHECK(r.chain_id != 0, "PrefixCache: forgetting a block it does not hold");
  const auto bucket = static_cast<int64_t>(r.hash.lo);
  if (r.prev != kNoBlock) {
    g.records[r.prev].next = r.next;
  } else {
    g.index.Erase(bucket);
    if (r.next != kNoBlock) g.index.Insert(bucket, r.next);
  }
  if (r.next != kNoBlock) g.records[r.next].prev = r.prev;
  r.prev = r.next = kNoBlock;
  r.chain_id = 0;
  r.has_bytes = false;
  g.bytes[block].clear();
  --g.cached;
  // BlockRemoved only when no other copy of the hash is left in the bucket.
  if (announce && !g.HasKey(r.hash)) Emit(BlockRemoved{.hash = r.hash, .group = group});
}

void PrefixCache::OnEvict(int group, BlockId block) {
  ++ns_stats_[static_cast<size_t>(groups_[group]->records[block].ns)].evictions;
  Forget(group, block, /*announce=*/true);
}

int64_t PrefixCache::Reset() {
  // When nothing will be left cached, say so once instead of a removal per block.
  // (Groups sharing a memory pool share its evictable count: compared once per pool.)
  bool everything = true;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (g > 0 && pools_[g].same_pool(pools_[g - 1])) continue;
    int64_t cached = 0;
    for (size_t h = g; h < groups_.size() && pools_[h].same_pool(pools_[g]); ++h) {
      cached += groups_[h]->cached;
    }
    everything = everything && cached == pools_[g].evictable_blocks();
  }
  int64_t dropped = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (BlockId block = 0; block < pools_[g].num_blocks(); ++block) {
      if (!pools_[g].is_evictable(block) || pools_[g].cached_group(block) != static_cast<int>(g)) {
        continue;
      }
      Forget(static_cast<int>(g), block, /*announce=*/!everything);
      pools_[g].Uncache(block);
      ++dropped;
    }
  }
  if (everything) Emit(AllCleared{});
  return dropped;
}

const char* CacheMediumName(CacheMedium medium) {
  switch (medium) {
    case CacheMedium::kDevice:
      return "GPU";
    case CacheMedium::kHost:
      return "CPU";
    case CacheMedium::kDisk:
      return "DISK";
    case CacheMedium::kRemote:
      return "REMOTE";
  }
  return "UNKNOWN";
}

void PrefixCache::Emit(CacheEvent event) {
  if (config_.max_events == 0) return;
  if (events_.size() == config_.max_events) {
    events_.pop_front();
    ++dropped_events_;
  }
  events_.push_back(std::move(event));
}

CacheEventBatch PrefixCache::DrainEvents() {
  CacheEventBatch batch{
      .events = {std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end())},
      .dropped = dropped_events_};
  events_.clear();
  dropped_events_ = 0;
  return batch;
}

void PrefixCache::RecordLookup(int32_t ns_id, const PrefixCacheStats& lookup) {
  PrefixCacheStats& s = ns_stats_[static_cast<size_t>(ns_id)];
  s.lookups += lookup.lookups;
  s.queried_tokens += lookup.queried_tokens;
  s.hit_tokens += lookup.hit_tokens;
  s.host_hit_tokens += lookup.host_hit_tokens;
  s.remote_hit_tokens += lookup.remote_hit_tokens;
}

PrefixCacheStats PrefixCache::stats(std::string_view ns) const {
  const auto it = ns_ids_.find(std::string(ns));
  return it == ns_ids_.end() ? PrefixCacheStats{} : ns_stats_[static_cast<size_t>(it->second)];
}

PrefixCacheStats PrefixCache::total_stats() const {
  PrefixCacheStats total;
  for (const PrefixCacheStats& s : ns_stats_) {
    total.lookups += s.lookups;
    total.queried_tokens += s.queried_tokens;
    total.hit_tokens += s.hit_tokens;
    total.evictions += s.evictions;
    total.host_hit_tokens += s.host_hit_tokens;
    total.remote_hit_tokens += s.remote_hit_tokens;
  }
  return total;
}

int64_t PrefixCache::cached_blocks(int group) const { return groups_[group]->cached; }

Status PrefixCache::CheckInvariants() const {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = *groups_[gi];
    const BlockPool& pool = pools_[gi];
    int64_t indexed = 0;
    for (BlockId b = 0; b < pool.num_blocks(); ++b) {
      const Group::Record& r = g.records[b];
      const bool has_key = r.chain_id != 0;
      // (A shared memory pool's block is cached by at most one of its groups.)
      const bool cached = pool.is_cached(b) && pool.cached_group(b) == static_cast<int>(gi);
      if (has_key != cached) {
        return InternalError(StrCat("group ", gi, " block ", b, (has_key ? " has" : " has no"),
                                    " key but is", (cached ? "" : " not"), " cached by it"));
      }
      if (!has_key) continue;
      ++indexed;
      if (r.parent_id >= r.chain_id || r.has_bytes == g.bytes[b].empty()) {
        return InternalError(StrCat("group ", gi, " block ", b, ": chain id ", r.chain_id,
                                    " after its parent's ", r.parent_id, ", or bad bytes flag"));
      }
      BlockId at = g.Head(r.hash);  // reachable from its bucket's head
      while (at != kNoBlock && at != b) at = g.records[at].next;
      if (at != b) return InternalError(StrCat("group ", gi, " block ", b, " is not indexed"));
    }
    if (indexed != g.cached) {
      return InternalError(
          StrCat("group ", gi, ": ", g.cached, " cached blocks counted, ", indexed, " found"));
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
