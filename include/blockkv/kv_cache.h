// SPDX-License-Identifier: Apache-2.0
// BlockedKVCache: the storage of a paged KV cache and one block allocator per cache group —
// DeepSpeed-FastGen's BlockedKVCache in C++.
//
//   KVCacheConfig llama{.block_size = 16, .cache_shape = {32, 8, 128}};   // layers, heads, dim
//   auto cache = BlockedKVCache::Create({llama}, MemoryConfig{.size = 1LL << 30}, CpuDevice());
//   Result<std::vector<BlockId>> blocks = (*cache)->Reserve(4);
//   Result<TensorView> layer0 = (*cache)->GetCache(0);   // [num_blocks, 16, 2, 8, 128]
//   Status s = (*cache)->Free(*blocks);
//
// Layout of cache group g: one contiguous, row-major allocation of shape
//   [num_caches, num_blocks, block_size, 2, num_kv_heads, head_size]
// Token t of a sequence lives in block table[t / block_size] at offset t % block_size; K is plane
// 0, V plane 1. Every group has the same num_blocks (as in DeepSpeed). With
// MemoryConfig::shared_pool every group draws from one allocator of num_blocks ids and layer i
// of every group is the same memory (vLLM's hybrid allocator): group g's storage is the pool's
// [num_caches, num_blocks, ...] buffer seen with g's shape. An MLA group
// (KVCacheType::kMla) has no K/V split and one row per token:
//   [num_caches, num_blocks, block_size, latent_dim + rope_dim]
// (the latent c_kv first, then the rotary k_pe); its layer views are 3-D. A STATE group has one
// slot per sequence instead of blocks, MemoryConfig::state_slots of them, in its own pool:
//   [num_caches, state_slots, state_bytes / element size]     (layer views: [slots, elements])
//
// Ownership: an engine either calls Reserve/Free here directly or drives a StateManager built over
// this cache, never both at once. Not thread-safe: one thread schedules.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/communicator.h"
#include "blockkv/config.h"
#include "blockkv/device.h"
#include "blockkv/status.h"
#include "blockkv/tensor.h"

namespace blockkv {

struct KVCachePlan {
  int32_t num_blocks = 0;       // blocks in every group (in the one pool when shared)
  int64_t bytes_per_block = 0;  // one block summed over all pools and their layers (not STATE)
  int64_t total_bytes = 0;      // num_blocks · bytes_per_block + state_bytes
  int32_t state_slots = 0;      // slots of every STATE group (MemoryConfig::state_slots)
  int64_t state_bytes = 0;      // Σ over STATE groups of state_slots · bytes_per_block()
};

// How many blocks fit. bytes_per_block = Σ over groups of KVCacheConfig::bytes_per_block(); with
// memory.shared_pool, one group's (every group's is the same, else kInvalidArgument naming the
// two groups and their layer counts or per-layer block bytes). STATE groups are planned first:
// memory.state_slots slots each (kInvalidArgument when 0), their bytes taken off what RESERVE
// divides into blocks; a cache of STATE groups only is kInvalidArgument.
//   RESERVE:  num_blocks = (available_bytes − memory.size) / bytes_per_block; fewer than one
//             block is kResourceExhausted naming both numbers.
//   ALLOCATE: num_blocks = memory.size; more than available_bytes is kResourceExhausted.
// A plan of more than 2^31 − 1 blocks is kOutOfRange. Invalid configs (or none) are
// kInvalidArgument.
Result<KVCachePlan> PlanKVCache(std::span<const KVCacheConfig> configs, const MemoryConfig& memory,
                                int64_t available_bytes);

class BlockedKVCache {
 public:
  // Plans against device->available_memory() (after EmptyCache()) and allocates one buffer per
  // group. With `comm` of world size > 1 in RESERVE mode, every rank enters a warm-up barrier and
  // an all-reduce MIN of num_blocks, so every rank ends with the same num_blocks; if any rank
  // cannot plan (too little memory, bad config), every rank fails with kResourceExhausted or the
  // local error, and none is left waiting in a collective. A last all-reduce after allocating
  // makes every rank fail when any rank's allocation failed. Logs one line per group.
  static Result<std::unique_ptr<BlockedKVCache>> Create(std::vector<KVCacheConfig> configs,
                                                        MemoryConfig memory,
                                                        std::shared_ptr<Device> device,
                                                        Communicator* comm = nullptr);

  // For a rank that fails before it can call Create (a StateManager whose own configuration is
  // invalid): enters the collectives Create enters, offering nothing, so the other ranks fail
  // instead of waiting. Does nothing unless `comm` has more than one rank and `mode` is RESERVE.
  static void AbandonCreate(Communicator* comm, AllocationMode mode);

  BlockedKVCache(const BlockedKVCache&) = delete;
  BlockedKVCache& operator=(const BlockedKVCache&) = delete;
  ~BlockedKVCache();

  // `n` free blocks of `group`, as BlockedAllocator::Allocate. A bad group is kOutOfRange.
  Result<std::vector<BlockId>> Reserve(int32_t n, int group = 0);
  Status Reserve(int32_t n, std::span<BlockId> out, int group = 0);
  // Returns blocks of `group`, as BlockedAllocator::Free. A bad group is kOutOfRange; a block an
  // OffloadStore holds (its offload in flight, or kept by one that failed) is
  // kFailedPrecondition: the store gives it back itself. Nothing is freed on failure.
  Status Free(std::span<const BlockId> blocks, int group = 0);

  // Copies the contents of block src[i] to block dst[i] in every layer of `group` (a fork's
  // private copy of a shared tail). Spans of equal length, valid ids, no id in both, and no
  // repeated destination; kInvalidArgument / kOutOfRange otherwise, nothing copied. The
  // overlap check is quadratic: meant for a few blocks at a time. A device error part-way
  // (kInternal) can leave some destinations copied; their contents are then unspecified.
  Status CopyBlocks(std::span<const BlockId> src, std::span<const BlockId> dst, int group = 0);

  // Layer `cache_id` of `group`: [num_blocks, block_size, 2, num_kv_heads, head_size],
  // contiguous; an MLA group's: [num_blocks, block_size, latent_dim + rope_dim]. kOutOfRange for
  // a bad cache_id or group.
  Result<TensorView> GetCache(int64_t cache_id, int group = 0) const;
  // The whole group: [num_caches, num_blocks, block_size, 2, num_kv_heads, head_size]; an MLA
  // group's: [num_caches, num_blocks, block_size, latent_dim + rope_dim].
  Result<TensorView> GetGroupStorage(int group = 0) const;

  // One entry per group (groups sharing a pool report the pool's count).
  std::vector<int32_t> free_blocks() const;
  int num_groups() const { return static_cast<int>(groups_.size()); }  // DeepSpeed's num_caches
  // Memory pools: one per group, or one in all with MemoryConfig::shared_pool.
  int num_pools() const { return static_cast<int>(pools_.size()); }
  // The memory pool `group` draws from. REQUIRES: 0 <= group < num_groups().
  int pool_of(int group) const { return groups_[group].pool; }
  bool shared_pool() const { return pools_.size() < groups_.size(); }
  int32_t num_blocks() const { return plan_.num_blocks; }  // of the groups of blocks
  // Blocks of `group`'s pool: num_blocks(), or a STATE group's slots. REQUIRES: a valid group.
  int32_t num_blocks(int group) const { return pool(group).num_blocks; }
  const KVCachePlan& plan() const { return plan_; }
  // REQUIRES: 0 <= group < num_groups().
  const KVCacheConfig& config(int group = 0) const;
  const BlockedAllocator& allocator(int group = 0) const;
  const std::shared_ptr<Device>& device() const { return device_; }

  // Every group's allocator is consistent and its buffer matches the plan.
  Status CheckInvariants() const;

 private:
  struct Group {
    KVCacheConfig config;
    int pool = 0;  // index in pools_
  };
  struct Pool {
    BlockedAllocator allocator;
    DeviceBuffer storage;  // [num_caches, num_blocks, block_size, 2, num_kv_heads, head_size]
                           // (MLA: [num_caches, num_blocks, block_size, latent + rope])
    // [num_blocks] once an OffloadStore lent a block (empty before): 1 while a store holds the
    // reserved block, which Free then refuses.
    std::vector<uint8_t> lent;
    int32_t num_blocks = 0;  // plan's num_blocks, or a STATE group's state_slots
  };
  // The pool `group` draws from: one per group, or with `shared` one for every group of blocks
  // (not STATE); numbered in the order of their first group.
  static int PoolOf(std::span<const KVCacheConfig> configs, bool shared, size_t group);
  // An OffloadStore over this cache with the default owner marks the blocks it takes over.
  friend class OffloadStore;

  BlockedKVCache(std::shared_ptr<Device> device, KVCachePlan plan, std::vector<Group> groups,
                 std::vector<Pool> pools);
  // One buffer and allocator per pool, as planned; on failure what was allocated is freed.
  static Result<std::vector<Pool>> AllocatePools(std::span<const KVCacheConfig> configs,
                                                 bool shared, const KVCachePlan& plan,
                                                 Device& device);
  Pool& pool(int group) { return pools_[groups_[group].pool]; }
  const Pool& pool(int group) const { return pools_[groups_[group].pool]; }
  Status CheckGroup(int group) const;

  std::shared_ptr<Device> device_;
  KVCachePlan plan_;
  std::vector<Group> groups_;
  std::vector<Pool> pools_;
};

}  // namespace blockkv
