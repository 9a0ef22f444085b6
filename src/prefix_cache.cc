#include "blockkv/prefix_cache.h"

#include <algorithm>
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
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[static_cast<size_t>(15 - i)] = kDigits[(hash.hi >> (4 * i)) & 0xf];
    out[static_cast<size_t>(31 - i)] = kDigits[(hash.lo >> (4 * i)) & 0xf];
  }
  return out;
}

BlockHash Xxh3BlockHash(std::span<const std::byte> bytes, uint64_t seed) {
  const XXH128_hash_t h = XXH3_128bits_withSeed(bytes.data(), bytes.size(), seed);
  return {h.low64, h.high64};
}

namespace {

template <class T>
void Append(std::vector<std::byte>& out, const T& value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

void AppendBytes(std::vector<std::byte>& out, std::string_view bytes) {
  Append(out, static_cast<uint32_t>(bytes.size()));
  const size_t at = out.size();
  out.resize(at + bytes.size());
  if (!bytes.empty()) std::memcpy(out.data() + at, bytes.data(), bytes.size());
}

std::string_view BlockBytes(const BlockKeyExtras& extras, size_t index) {
  return index < extras.block_bytes.size() ? std::string_view(extras.block_bytes[index]) : "";
}

// The encoding H hashes, little-endian: a version byte, a has-parent byte, the parent key
// (zeros without one), the adapter id, the token count and ids, the namespace (block 0 only) and
// the block's extra bytes, each with a u32 length.
void EncodeBlockKey(std::vector<std::byte>& out, const BlockHash* parent,
                    std::span<const TokenId> tokens, const BlockKeyExtras& extras, size_t index) {
  out.clear();
  Append(out, uint8_t{1});
  Append(out, static_cast<uint8_t>(parent != nullptr));
  Append(out, parent != nullptr ? parent->lo : uint64_t{0});
  Append(out, parent != nullptr ? parent->hi : uint64_t{0});
  Append(out, extras.adapter_id);
  Append(out, static_cast<uint32_t>(tokens.size()));
  const size_t at = out.size();
  out.resize(at + tokens.size_bytes());
  std::memcpy(out.data() + at, tokens.data(), tokens.size_bytes());
  AppendBytes(out, index == 0 ? std::string_view(extras.ns) : std::string_view());
  AppendBytes(out, BlockBytes(extras, index));
}

}  // namespace

BlockHash HashBlock(const BlockHash* parent, std::span<const TokenId> tokens,
                    const BlockKeyExtras& extras, size_t block_index, uint64_t seed,
                    BlockHashFunction hash) {
  std::vector<std::byte> bytes;
  EncodeBlockKey(bytes, parent, tokens, extras, block_index);
  return hash(bytes, seed);
}

// ---- the index --------------------------------------------------------------------------------

// One cache group's keys. Blocks whose hashes share their low 64 bits form a bucket: a doubly
// linked list through next_/prev_ whose head the index maps hash.lo to.
struct PrefixCache::Group {
  Group(int32_t num_blocks, int32_t block_size)
      : index(num_blocks),
        hash(static_cast<size_t>(num_blocks)),
        parent_hash(static_cast<size_t>(num_blocks)),
        next(static_cast<size_t>(num_blocks), kNoBlock),
        prev(static_cast<size_t>(num_blocks), kNoBlock),
        publish_id(static_cast<size_t>(num_blocks), 0),
        parent_id(static_cast<size_t>(num_blocks), 0),
        ns(static_cast<size_t>(num_blocks), 0),
        adapter(static_cast<size_t>(num_blocks), 0),
        bytes(static_cast<size_t>(num_blocks)),
        tokens(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size)) {}

  std::span<const TokenId> Tokens(BlockId block, int32_t block_size) const {
    return {tokens.data() + static_cast<size_t>(block) * static_cast<size_t>(block_size),
            static_cast<size_t>(block_size)};
  }

  internal::UidMap index;              // hash.lo → first block of the bucket
  std::vector<BlockHash> hash;         // [num_blocks]
  std::vector<BlockHash> parent_hash;  // [num_blocks] key it was chained from (window anchor)
  std::vector<BlockId> next;           // [num_blocks] bucket links, kNoBlock at the ends
  std::vector<BlockId> prev;           // [num_blocks]
  std::vector<uint64_t> publish_id;    // [num_blocks] unique per publish; 0 = not indexed
  std::vector<uint64_t> parent_id;     // [num_blocks] the parent's publish id; 0 for block 0
  std::vector<int32_t> ns;             // [num_blocks] namespace id
  std::vector<int64_t> adapter;        // [num_blocks]
  std::vector<std::string> bytes;      // [num_blocks] extra bytes, usually empty
  std::vector<TokenId> tokens;         // [num_blocks, block_size]
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
  EncodeBlockKey(scratch_, parent, block_tokens, extras, index);
  return config_.hash_function(scratch_, config_.hash_seed);
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

int32_t PrefixCache::Match(int group, std::span<const TokenId> tokens, int32_t ns_id,
                           const BlockKeyExtras& extras, int32_t max_blocks, std::span<BlockId> out,
                           BlockHash* last_key) const {
  const Group& g = *groups_[group];
  const auto bs = static_cast<size_t>(block_sizes_[group]);
  const auto limit = std::min(static_cast<size_t>(max_blocks), tokens.size() / bs);
  BlockHash key;
  uint64_t parent = 0;  // publish id of the block matched just before
  size_t i = 0;
  for (; i < limit; ++i) {
    const std::span<const TokenId> want = tokens.subspan(i * bs, bs);
    key = Hash(i == 0 ? nullptr : &key, want, extras, i);
    const int32_t head = g.index.Find(static_cast<int64_t>(key.lo));
    BlockId found = kNoBlock;
    for (BlockId b = head == internal::UidMap::kAbsent ? kNoBlock : head;
         b != kNoBlock && found == kNoBlock; b = g.next[b]) {
      const bool same =
          g.hash[b] == key && g.parent_id[b] == parent && g.adapter[b] == extras.adapter_id &&
          (i > 0 || g.ns[b] == ns_id) &&
          std::equal(want.begin(), want.end(), g.Tokens(b, block_sizes_[group]).begin()) &&
          g.bytes[b] == BlockBytes(extras, i);
      if (same) found = b;
    }
    if (found == kNoBlock) break;
    out[i] = found;
    parent = g.publish_id[found];
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
    const uint64_t parent = i == 0 || out[i - 1] == kNoBlock ? 0 : g.publish_id[out[i - 1]];
    const bool anchored = i > 0 && out[i - 1] == kNoBlock;
    const int32_t head = g.index.Find(static_cast<int64_t>(keys[i].lo));
    out[i] = kNoBlock;
    for (BlockId b = head == internal::UidMap::kAbsent ? kNoBlock : head;
         b != kNoBlock && out[i] == kNoBlock; b = g.next[b]) {
      const bool chained = anchored ? g.parent_id[b] != 0 && g.parent_hash[b] == keys[i - 1]
                                    : g.parent_id[b] == parent;
      const bool same =
          g.hash[b] == keys[i] && chained && g.adapter[b] == extras.adapter_id &&
          (i > 0 || g.ns[b] == ns_id) &&
          std::equal(want.begin(), want.end(), g.Tokens(b, block_sizes_[group]).begin()) &&
          g.bytes[b] == BlockBytes(extras, i);
      if (same) out[i] = b;
    }
  }
}

PrefixCache::Published PrefixCache::Publish(int group, BlockId block, const Published* parent,
                                            const BlockHash& key,
                                            std::span<const TokenId> block_tokens, int32_t ns_id,
                                            const BlockKeyExtras& extras, size_t index,
                                            int32_t priority) {
  Group& g = *groups_[group];
  const int32_t bs = block_sizes_[group];
  BLOCKKV_CHECK(g.publish_id[block] == 0 && !pools_[group].is_cached(block),
                "PrefixCache::Publish: the block is cached already");
  BLOCKKV_CHECK(block_tokens.size() == static_cast<size_t>(bs),
                "PrefixCache::Publish: a block is published full");
  BLOCKKV_CHECK(parent == nullptr || parent->id != 0, "PrefixCache::Publish: a parent without id");
  pools_[group].MarkCached(block, priority);
  g.hash[block] = key;
  g.publish_id[block] = ++last_publish_id_;
  g.parent_id[block] = parent == nullptr ? 0 : parent->id;
  g.parent_hash[block] = parent == nullptr ? BlockHash{} : parent->key;
  g.ns[block] = ns_id;
  g.adapter[block] = extras.adapter_id;
  g.bytes[block] = BlockBytes(extras, index);
  std::copy(block_tokens.begin(), block_tokens.end(),
            g.tokens.begin() + static_cast<std::ptrdiff_t>(block) * bs);
  // Newest first in its bucket.
  const auto bucket = static_cast<int64_t>(key.lo);
  const int32_t head = g.index.Find(bucket);
  g.prev[block] = kNoBlock;
  g.next[block] = head == internal::UidMap::kAbsent ? kNoBlock : head;
  if (head != internal::UidMap::kAbsent) {
    g.prev[head] = block;
    g.index.Erase(bucket);
  }
  g.index.Insert(bucket, block);
  ++g.cached;
  if (config_.max_events > 0) {
    Emit(BlockStored{.hash = key,
                     .has_parent = parent != nullptr,
                     .parent = g.parent_hash[block],
                     .tokens = std::vector<TokenId>(block_tokens.begin(), block_tokens.end()),
                     .ns = ns_names_[static_cast<size_t>(ns_id)],
                     .adapter_id = extras.adapter_id,
                     .group = group});
  }
  return {g.publish_id[block], key};
}

PrefixCache::Published PrefixCache::published(int group, BlockId block) const {
  const Group& g = *groups_[group];
  return {g.publish_id[block], g.hash[block]};
}

void PrefixCache::Forget(int group, BlockId block) {
  Group& g = *groups_[group];
  BLOCKKV_CHECK(g.publish_id[block] != 0, "PrefixCache: forgetting a block it does not hold");
  const auto key = static_cast<int64_t>(g.hash[block].lo);
  const BlockId before = g.prev[block];
  const BlockId after = g.next[block];
  if (before != kNoBlock) {
    g.next[before] = after;
  } else {
    g.index.Erase(key);
    if (after != kNoBlock) g.index.Insert(key, after);
  }
  if (after != kNoBlock) g.prev[after] = before;
  g.prev[block] = g.next[block] = kNoBlock;
  g.publish_id[block] = 0;
  g.bytes[block].clear();
  --g.cached;
  // BlockRemoved only when no other copy of the hash is left in the bucket.
  const int32_t head = g.index.Find(key);
  for (BlockId b = head == internal::UidMap::kAbsent ? kNoBlock : head; b != kNoBlock;
       b = g.next[b]) {
    if (g.hash[b] == g.hash[block]) return;
  }
  Emit(BlockRemoved{.hash = g.hash[block], .group = group});
}

void PrefixCache::OnEvict(int group, BlockId block) {
  ++ns_stats_[static_cast<size_t>(groups_[group]->ns[block])].evictions;
  Forget(group, block);
}

int64_t PrefixCache::Reset() {
  bool everything = true;
  for (size_t g = 0; g < groups_.size(); ++g) {
    everything = everything && groups_[g]->cached == pools_[g].evictable_blocks();
  }
  const size_t events_before = events_.size();
  const uint64_t dropped_before = dropped_events_;
  int64_t dropped = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (BlockId block = 0; block < pools_[g].num_blocks(); ++block) {
      if (!pools_[g].is_evictable(block)) continue;
      Forget(static_cast<int>(g), block);
      pools_[g].Uncache(block);
      ++dropped;
    }
  }
  if (everything && dropped_events_ == dropped_before) {
    // Say it once: drop the per-block removals just queued.
    events_.resize(events_before);
    Emit(AllCleared{});
  }
  return dropped;
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

void PrefixCache::RecordLookup(int32_t ns_id, int64_t queried_tokens, int64_t hit_tokens) {
  PrefixCacheStats& s = ns_stats_[static_cast<size_t>(ns_id)];
  ++s.lookups;
  s.queried_tokens += queried_tokens;
  s.hit_tokens += hit_tokens;
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
      const bool has_key = g.publish_id[b] != 0;
      if (has_key != pool.is_cached(b)) {
        return InternalError(StrCat("group ", gi, " block ", b, (has_key ? " has" : " has no"),
                                    " key but is", (pool.is_cached(b) ? "" : " not"), " cached"));
      }
      if (!has_key) continue;
      ++indexed;
      if (g.parent_id[b] >= g.publish_id[b]) {
        return InternalError(
            StrCat("group ", gi, " block ", b, " was published before its parent"));
      }
      // Reachable from its bucket's head.
      const int32_t head = g.index.Find(static_cast<int64_t>(g.hash[b].lo));
      BlockId at = head == internal::UidMap::kAbsent ? kNoBlock : head;
      while (at != kNoBlock && at != b) at = g.next[at];
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
