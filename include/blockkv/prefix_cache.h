// SPDX-License-Identifier: Apache-2.0
// Prefix caching: sequences that start with the same tokens share the KV blocks of that prefix
// (vLLM's automatic prefix caching, SGLang's RadixAttention, TensorRT-LLM's block reuse).
//
// Every full block of a sequence's known tokens has a key: a chained 128-bit hash
//   hash(block i) = H(seed; hash(block i−1) or nothing, adapter id, token ids,
//                     namespace (block 0 only), opaque per-block bytes)
// with H = XXH3-128 over a fixed little-endian encoding (so equal for a given seed in every
// process, rank and run; LMCache's most reported bug is a per-process seed). The namespace mixed
// into block 0 isolates tenants as vLLM's cache_salt does: two namespaces never share a block.
// The hash only finds candidates: a hit also compares the block's token ids, namespace, adapter
// and extra bytes exactly, and that its parent is the block matched just before (by a chain id
// that exact copies share and other contents never get), so a hash collision never hands out
// another prompt's KV.
//
// The StateManager owns one PrefixCache when StateManagerConfig.prefix_cache.enabled; an engine
// uses it through the manager:
//   auto mgr = *StateManager::Create({.prefix_cache = {.enabled = true}}, {llama}, CpuDevice());
//   Result<Sequence*> seq = mgr->AddSequence(uid, prompt, {.keys = {.ns = "tenant-a"}});
//   const SeqId uids[] = {uid};
//   const int64_t lengths[] = {std::ssize(prompt)};
//   Status s = mgr->Schedule({.uids = uids, .lengths = lengths});  // the cached prefix is shared
//   int64_t cached = (*seq)->seen_tokens();  // tokens taken from the cache; the rest in flight
//   ... forward over prompt[seen, seen + in_flight) ...
//   s = mgr->PostForward(uids);              // blocks that became full are published
//   for (const CacheEvent& e : mgr->DrainCacheEvents().events) router.Apply(e);
//
// Eviction lives in BlockPool (LRU within a retention priority); this class holds the keys:
// per cache group an index hash → cached blocks (duplicates allowed: two sequences computing the
// same prefix at once each publish their block), and per block its key and token ids in flat
// arrays. Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "blockkv/block_pool.h"
#include "blockkv/sequence.h"
#include "blockkv/status.h"

namespace blockkv {
namespace internal {
class UidMap;
}  // namespace internal

struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
};
std::string ToString(const BlockHash& hash);  // 32 hex digits, hi then lo

// H above: any function of (bytes, seed). Tests inject colliding ones.
using BlockHashFunction = BlockHash (*)(std::span<const std::byte> bytes, uint64_t seed);
BlockHash Xxh3BlockHash(std::span<const std::byte> bytes, uint64_t seed);

// What, besides token ids, a request's blocks are keyed by.
struct BlockKeyExtras {
  std::string ns{};        // tenant namespace ("" = the shared default), block 0 only
  int64_t adapter_id = 0;  // LoRA adapter (0 = none), every block
  // Opaque bytes per block index (e.g. the hashes of the images a block's tokens stand for);
  // blocks past the end have none.
  std::vector<std::string> block_bytes{};
};

// The key of one full block: `parent` is the previous block's key (nullptr for block 0).
BlockHash HashBlock(const BlockHash* parent, std::span<const TokenId> tokens,
                    const BlockKeyExtras& extras, size_t block_index, uint64_t seed,
                    BlockHashFunction hash = Xxh3BlockHash);

struct PrefixCacheConfig {
  bool enabled = false;
  uint64_t hash_seed = 0;
  // Attention window in tokens per cache group (0, or a group past the end: full attention).
  // A hit in a windowed group needs only the blocks holding the window's tokens before it.
  std::vector<int64_t> sliding_windows{};
  // A STATE group (Mamba, linear attention) resumes only from a state saved when a forward ended
  // at a multiple of this many tokens (a checkpoint; vLLM's "align" mode): a hit's length is a
  // multiple of it. A multiple of every other group's block size, at most max_context.
  // 0: the smallest such multiple of at least 512 tokens. Only with a STATE group.
  int64_t state_checkpoint_tokens = 0;
  size_t max_events = 65536;                  // events kept until drained; 0 = no events
  BlockHashFunction hash_function = nullptr;  // nullptr = Xxh3BlockHash
};

// Which level of the cache an event is about. On the wire (docs/kv_events.md) these are vLLM's
// `medium` strings where vLLM has one: "GPU" for the device blocks the kernels read (whatever the
// device; vLLM's CPU backend says "GPU" too), "CPU" for the host level (vLLM's offloading
// connector); blockkv's own for the levels vLLM has no name for: "DISK", "REMOTE".
enum class CacheMedium : uint8_t { kDevice, kHost, kDisk, kRemote };
// "GPU", "CPU", "DISK", "REMOTE".
const char* CacheMediumName(CacheMedium medium);

// Events for cache-aware routers (vLLM's KV events). Per (medium, group) they describe a set of
// keys: BlockStored adds one, BlockRemoved takes one away, AllCleared empties every set.
struct BlockStored {  // `hash` became cached in `group` (a second copy says nothing)
  BlockHash hash{};
  bool has_parent = false;
  BlockHash parent{};  // valid when has_parent
  std::vector<TokenId> tokens{};
  std::string ns{};
  int64_t adapter_id = 0;
  int group = 0;
  CacheMedium medium = CacheMedium::kDevice;
};
struct BlockRemoved {  // the last cached copy of `hash` in `group` is gone
  BlockHash hash{};
  int group = 0;
  CacheMedium medium = CacheMedium::kDevice;
};
struct AllCleared {};  // nothing is cached any more
using CacheEvent = std::variant<BlockStored, BlockRemoved, AllCleared>;
struct CacheEventBatch {
  std::vector<CacheEvent> events;  // oldest first
  uint64_t dropped = 0;            // events lost to overflow since the last drain (the oldest)
};

struct PrefixCacheStats {
  int64_t lookups = 0;         // prompts looked up (first schedule of a sequence with a prompt)
  int64_t queried_tokens = 0;  // prompt tokens those lookups could have hit
  int64_t hit_tokens = 0;      // tokens taken from the cache
  int64_t evictions = 0;       // cached blocks taken for reuse (counted for the block's namespace)
  // Of hit_tokens, those whose blocks were copied back from the host level (offload) and those
  // fetched from the remote tier (remote_tier.h); the rest were on the device.
  int64_t host_hit_tokens = 0;
  int64_t remote_hit_tokens = 0;
};

class PrefixCache : public BlockPool::EvictionListener {
 public:
  // REQUIRES: `pools` (one per cache group) outlive the cache; the cache registers itself as
  // their eviction listener.
  PrefixCache(PrefixCacheConfig config, std::span<BlockPool> pools,
              std::vector<int32_t> block_sizes);
  ~PrefixCache() override;
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  const PrefixCacheConfig& config() const { return config_; }
  int32_t block_size(int group) const { return block_sizes_[group]; }

  // The key of block `index` of a sequence whose previous block's key is `parent`.
  BlockHash Hash(const BlockHash* parent, std::span<const TokenId> block_tokens,
                 const BlockKeyExtras& extras, size_t index) const;
  // The chained keys of the first out.size() blocks of `block_size` tokens of `tokens`:
  // out[i] = Hash(i == 0 ? nullptr : &out[i - 1], block i, extras, i).
  // REQUIRES: tokens.size() >= out.size() * block_size.
  void ChainKeys(std::span<const TokenId> tokens, int32_t block_size, const BlockKeyExtras& extras,
                 std::span<BlockHash> out) const;

  // The namespace's id, interned on first use.
  int32_t InternNamespace(std::string_view ns);

  // Walks the full blocks of `tokens` (at most `max_blocks`) from block 0, keying each from the
  // previous one, and stops at the first that is not cached: returns how many matched, their ids
  // in out[0, n), and the last matched block's key in *last_key (untouched when n = 0).
  // REQUIRES: out.size() >= max_blocks.
  int32_t Match(int group, std::span<const TokenId> tokens, int32_t ns_id,
                const BlockKeyExtras& extras, int32_t max_blocks, std::span<BlockId> out,
                BlockHash* last_key) const;

  // For a windowed group: the same walk over every full block (at most `max_blocks`), not
  // stopping at a miss. out[i] is the cached block matching block i or kNoBlock, keys[i] block
  // i's key. Block i matches when its parent is the block matched at i − 1, or, when block
  // i − 1 matched nothing (its copy was evicted or released out of the window), when the key
  // its publisher chained it from equals keys[i − 1]: there, and only there, exactness rests on
  // the 128-bit hash. REQUIRES: out.size() and keys.size() >= max_blocks.
  void MatchWindow(int group, std::span<const TokenId> tokens, int32_t ns_id,
                   const BlockKeyExtras& extras, int32_t max_blocks, std::span<BlockId> out,
                   std::span<BlockHash> keys) const;

  // A STATE group's checkpoints are published as roots (Publish with parent nullptr) under the
  // chained key of the whole prefix they end, since a sequence keeps few of its checkpoints and
  // a chain of them would break at the first one missing: the cached checkpoint holding block
  // `index` of a sequence with these tokens and extras under `key`, or kNoBlock. The block's own
  // tokens are compared exactly; the tokens before it rest on the 128-bit key, as MatchWindow's
  // anchors do.
  BlockId FindRoot(int group, const BlockHash& key, std::span<const TokenId> block_tokens,
                   int32_t ns_id, const BlockKeyExtras& extras, size_t index) const {
    return Find(group, key, /*parent_id=*/0, block_tokens, ns_id, extras, index);
  }

  // A cached block's identity: its chain id (shared by exact copies, never given to other
  // contents; 0 = none) and its key.
  struct Published {
    uint64_t id = 0;
    BlockHash key;
  };
  // Publishes `block`, block `index` of a sequence, under `key`, chained from `parent` (what
  // the sequence's block index − 1 was published as; nullptr for index 0): the block becomes
  // cached at `priority`, and BlockStored is queued unless another block holds `key` already.
  // Returns what the block was published as. REQUIRES:
  // `block` is held and not cached, parent->id != 0.
  Published Publish(int group, BlockId block, const Published* parent, const BlockHash& key,
                    std::span<const TokenId> block_tokens, int32_t ns_id,
                    const BlockKeyExtras& extras, size_t index, int32_t priority);
  // What `block` was published as (chain id 0 when it is not cached).
  Published published(int group, BlockId block) const;

  // One cached block as the index holds it: what StateManager::SaveSnapshot writes and
  // LoadSnapshot gives back to Restore. Views are valid until the cache next changes.
  struct CachedBlock {
    BlockId block = kNoBlock;
    uint64_t chain_id = 0;   // shared by exact copies, never given to other contents
    uint64_t parent_id = 0;  // the parent's chain id (0 for block 0); the parent may be evicted
    BlockHash key;
    BlockHash parent_key;  // the key it was chained from (zeros for block 0)
    int64_t adapter_id = 0;
    std::string_view ns;              // its publisher's namespace
    std::string_view bytes;           // its extra bytes ("" for none)
    std::span<const TokenId> tokens;  // [block_size]
  };
  // Every cached block of `group`, oldest first among blocks whose keys share a bucket, so that
  // Restore-ing them in this order rebuilds the index as it is (which of several exact copies a
  // hit takes included).
  std::vector<CachedBlock> CachedBlocks(int group) const;
  // One of them. REQUIRES: `block` is cached.
  CachedBlock cached_block(int group, BlockId block) const;
  // Indexes `b.block` exactly as `b` describes it — chain ids included, so that a restored
  // cache matches (and chains on) as the saved one did — cached at `priority`, and queues
  // BlockStored as Publish does. Later publishes get chain ids above b's. REQUIRES: the block is
  // held and not cached, b.tokens holds block_size ids, 0 <= parent_id < chain_id.
  void Restore(int group, const CachedBlock& b, int32_t priority);

  // Forgets every cached block no one references (they go back to the allocators); returns
  // how many. Queues BlockRemoved for each hash whose last copy went, and AllCleared when nothing
  // is cached any more.
  int64_t Reset();

  CacheEventBatch DrainEvents();
  // Queues an event of a level below the device (PrefixHostTier, a remote tier), so that one
  // queue keeps every level's events in the order they happened. Nothing when events are off.
  void QueueEvent(CacheEvent event) { Emit(std::move(event)); }
  bool events_enabled() const { return config_.max_events > 0; }
  // Whether DrainEvents would return anything (events, or a count of dropped ones).
  bool has_pending_events() const { return !events_.empty() || dropped_events_ > 0; }
  // Stats of one namespace ("" = the default), or of all of them together.
  PrefixCacheStats stats(std::string_view ns) const;
  PrefixCacheStats total_stats() const;
  // Adds one lookup's counters (lookups, queried, hit, host and remote hit tokens) to `ns_id`'s.
  void RecordLookup(int32_t ns_id, const PrefixCacheStats& lookup);

  int64_t cached_blocks(int group) const;

  // Every indexed block is cached in its pool and every cached block indexed once, its hash in
  // the index under it, its parent cached and published before it.
  Status CheckInvariants() const;

  void OnEvict(int group, BlockId block) override;

 private:
  struct Group;
  // The cached block of `group` holding block `index` of a sequence with these tokens and
  // extras under `key`, chained from `parent_id`; kNoBlock when none.
  BlockId Find(int group, const BlockHash& key, uint64_t parent_id, std::span<const TokenId> want,
               int32_t ns_id, const BlockKeyExtras& extras, size_t index) const;
  // Drops the key; queues BlockRemoved when `announce` and no other copy of the key is left.
  void Forget(int group, BlockId block, bool announce);
  // Publish and Restore: marks `b.block` cached at `priority` and indexes it under b's ids,
  // queueing BlockStored unless another block holds b.key already.
  void Insert(int group, const CachedBlock& b, int32_t ns_id, int32_t priority);
  void Emit(CacheEvent event);

  PrefixCacheConfig config_;
  std::span<BlockPool> pools_;
  std::vector<int32_t> block_sizes_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::unordered_map<std::string, int32_t> ns_ids_;
  std::vector<std::string> ns_names_;
  std::vector<PrefixCacheStats> ns_stats_;
  std::deque<CacheEvent> events_;
  uint64_t dropped_events_ = 0;
  uint64_t last_chain_id_ = 0;
};

}  // namespace blockkv
