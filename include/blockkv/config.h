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

// One cache group: a set of layers sharing one block pool and one shape.
struct KVCacheConfig {
  int32_t block_size = 128;  // tokens per block
  int32_t num_allocation_groups = 1;
  // {num_caches (layers in this group), num_kv_heads, head_size}
  std::array<int64_t, 3> cache_shape{};
  DType cache_dtype = DType::kFloat16;
  int32_t max_blocks_per_allocation_group = 64;

  int64_t num_caches() const { return cache_shape[0]; }
  int64_t num_kv_heads() const { return cache_shape[1]; }
  int64_t head_size() const { return cache_shape[2]; }

  // Every field > 0, a known dtype, and bytes_per_block() representable in int64.
  // kInvalidArgument names the field and its value.
  Status Validate() const;

  // num_caches · block_size · 2 · num_kv_heads · head_size · ElementSize(cache_dtype): the bytes
  // one block takes across all layers of this group. kInvalidArgument on overflow.
  Result<int64_t> bytes_per_block() const;
  // block_size · 2 · num_kv_heads · head_size: elements of one block of one layer.
  // REQUIRES: Validate() is OK.
  int64_t elements_per_layer_block() const;
};

struct MemoryConfig {
  AllocationMode mode = AllocationMode::kReserve;
  int64_t size = 1'000'000'000;  // RESERVE: bytes left free; ALLOCATE: number of blocks

  Status Validate() const;  // size > 0 and a known mode
};

}  // namespace blockkv
