// SPDX-License-Identifier: Apache-2.0
// Configuration of a blocked KV cache, with DeepSpeed-FastGen's names, fields and defaults
// (deepspeed.inference.v2.ragged.KVCacheConfig / MemoryConfig). Unlike DeepSpeed, every field is
// validated, block_size included, and every size product is overflow-checked.
#pragma once

#include <array>
#include <cstdint>

#include "blockkv/dtype.h"
#include "blockkv/status.h"

namespace blockkv {

enum class AllocationMode {
  kReserve,   // size the cache from memory: keep MemoryConfig::size bytes free, use the rest
  kAllocate,  // MemoryConfig::size is the number of blocks
};

// "reserve" / "allocate".
const char* AllocationModeName(AllocationMode mode);

// What the layers of a cache group keep per token (DeepSpeed's KVCacheType, extended by issue 21).
enum class KVCacheType {
  kDense,  // K and V per KV head: [num_blocks, block_size, 2, num_kv_heads, head_size] per layer
  kLocal,  // sliding-window attention: as kDense, over the last local_window tokens; the state
           // manager releases a sequence's blocks that fall wholly out of the window
  kState,  // a fixed state per sequence (Mamba conv + SSM, linear attention): one slot of
           // state_bytes per layer and sequence, [num_slots, state_bytes / element size] per
           // layer; the slots are their own pool (MemoryConfig::state_slots)
  kMla,    // multi-head latent attention (DeepSeek-V2/V3): one latent vector and one rotary key
           // per token, shared by every head, no K/V split:
           // [num_blocks, block_size, latent_dim + rope_dim] per layer
};

// "dense", "local", "state", "mla" (DeepSpeed's values for the first two).
const char* KVCacheTypeName(KVCacheType type);

// One cache group: a set of layers sharing one block pool and one shape.
//
// An MLA group (type = kMla) states its shape twice, so that code reading cache_shape alone
// (num_kv_heads · head_size elements per token and plane) still sizes it right:
//   cache_shape = {num_layers, 1, latent_dim + rope_dim}, latent_dim > 0, rope_dim >= 0
// and it has one plane where a dense group has two (kv_planes() == 1). Each token's row holds the
// latent c_kv in [0, latent_dim) and the rotary key k_pe in [latent_dim, latent_dim + rope_dim).
// DeepSeek-V3: {61, 1, 576}, latent_dim 512, rope_dim 64.
struct KVCacheConfig {
  int32_t block_size = 128;  // tokens per block
  int32_t num_allocation_groups = 1;
  // {num_caches (layers in this group), num_kv_heads, head_size}
  std::array<int64_t, 3> cache_shape{};
  DType cache_dtype = DType::kFloat16;
  int32_t max_blocks_per_allocation_group = 64;
  KVCacheType type = KVCacheType::kDense;  // DeepSpeed's field name
  int64_t latent_dim = 0;                  // kMla: the latent c_kv's width (DeepSeek-V3: 512)
  int64_t rope_dim = 0;                    // kMla: the rotary key k_pe's width (DeepSeek-V3: 64)
  int64_t state_bytes = 0;                 // kState: bytes of one layer's state of a sequence
  // kLocal: the attention window W in tokens (DeepSpeed's KVCacheType.LOCAL has no field for it;
  // vLLM calls it sliding_window): the query at position p sees keys (p - W, p]. 0 otherwise.
  int64_t local_window = 0;

  int64_t num_caches() const { return cache_shape[0]; }
  int64_t num_kv_heads() const { return cache_shape[1]; }
  int64_t head_size() const { return cache_shape[2]; }
  // Planes per token and KV head: 2 (K and V) for dense groups, 1 for MLA (the latent row).
  int64_t kv_planes() const { return type == KVCacheType::kMla ? 1 : 2; }

  // Every field > 0, a known dtype, and bytes_per_block() representable in int64.
  // kInvalidArgument names the field and its value. kMla: latent_dim > 0, rope_dim >= 0 and
  // cache_shape[1] == 1, cache_shape[2] == latent_dim + rope_dim; latent_dim, rope_dim and
  // state_bytes are 0 for the kinds that do not use them. kLocal: local_window > 0 (0 for every
  // other kind). kState: state_bytes > 0, a multiple of the element size, and cache_shape ==
  // {num_layers, 1, state_bytes / element size}, as MLA restates its row; block_size and
  // max_blocks_per_allocation_group are not used by the cache (a StateManager sets them so that
  // a sequence holds one slot: block_size = max_context, one table entry).
  Status Validate() const;

  // num_caches · block_size · kv_planes · num_kv_heads · head_size · ElementSize(cache_dtype):
  // the bytes one block takes across all layers of this group (kState: one slot, num_caches ·
  // state_bytes). kInvalidArgument on overflow.
  Result<int64_t> bytes_per_block() const;
  // block_size · kv_planes · num_kv_heads · head_size: elements of one block of one layer.
  // REQUIRES: Validate() is OK.
  int64_t elements_per_layer_block() const;
};

struct MemoryConfig {
  AllocationMode mode = AllocationMode::kReserve;
  int64_t size = 1'000'000'000;  // RESERVE: bytes left free; ALLOCATE: number of blocks
  // vLLM's hybrid allocator (not DeepSpeed's): every cache group draws its blocks from ONE pool
  // of num_blocks ids, and layer i of every group views the same memory, so the blocks a LOCAL
  // group releases serve a DENSE group. A block id belongs to one group at a time. Every group
  // must have the same number of layers and the same bytes per block per layer
  // (BlockedKVCache::Create refuses others with kInvalidArgument naming the groups). false:
  // DeepSpeed's layout, one buffer and one allocator per group, the same num_blocks in each.
  bool shared_pool = false;
  // Slots of every STATE group (one per sequence holding a state): planned before the blocks of
  // the other groups. 0: none; a cache with a STATE group needs > 0 (a StateManager sets it to
  // max_tracked_sequences when 0).
  int32_t state_slots = 0;

  Status Validate() const;  // size > 0, state_slots >= 0 and a known mode
};

}  // namespace blockkv
