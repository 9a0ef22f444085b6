// SPDX-License-Identifier: Apache-2.0
#include "blockkv/config.h"

#include "internal/checked_math.h"
#include "internal/strings.h"
#include "internal/validate.h"

namespace blockkv {

using internal::StrCat;

const char* AllocationModeName(AllocationMode mode) {
  switch (mode) {
    case AllocationMode::kReserve:
      return "reserve";
    case AllocationMode::kAllocate:
      return "allocate";
  }
  return "invalid";
}

const char* KVCacheTypeName(KVCacheType type) {
  switch (type) {
    case KVCacheType::kDense:
      return "dense";
    case KVCacheType::kLocal:
      return "local";
    case KVCacheType::kState:
      return "state";
    case KVCacheType::kMla:
      return "mla";
  }
  return "invalid";
}

namespace {

// The fields of the group kinds: each kind's own are checked, the others' must be 0.
Status ValidateKind(const KVCacheConfig& c) {
  if (c.type != KVCacheType::kLocal && c.local_window != 0) {
    return InvalidArgumentError(StrCat("KVCacheConfig.local_window is for LOCAL groups; a ",
                                       KVCacheTypeName(c.type), " group must leave it 0, got ",
                                       c.local_window));
  }
  switch (c.type) {
    case KVCacheType::kDense:
      break;
    case KVCacheType::kLocal:
      if (c.local_window <= 0) {
        return InvalidArgumentError(
            StrCat("KVCacheConfig of type LOCAL: local_window (the attention window in tokens) "
                   "must be > 0, got ",
                   c.local_window));
      }
      break;
    case KVCacheType::kState: {
      BLOCKKV_RETURN_IF_ERROR(
          internal::CheckPositive("KVCacheConfig", "state_bytes", c.state_bytes));
      const int64_t element = IsValidDType(c.cache_dtype) ? ElementSize(c.cache_dtype) : 1;
      if (c.state_bytes % element != 0 || c.cache_shape[1] != 1 ||
          c.cache_shape[2] != c.state_bytes / element) {
        return InvalidArgumentError(
            StrCat("KVCacheConfig of type STATE: cache_shape must be (num_layers, 1, state_bytes / "
                   "element size) = (",
                   c.cache_shape[0], ", 1, ", c.state_bytes, " / ", element, "), got (",
                   c.cache_shape[0], ", ", c.cache_shape[1], ", ", c.cache_shape[2], ")"));
      }
      if (c.latent_dim != 0 || c.rope_dim != 0) {
        return InvalidArgumentError(StrCat(
            "KVCacheConfig of type STATE: latent_dim and rope_dim are for MLA groups; they must be "
            "0, got latent_dim=",
            c.latent_dim, " rope_dim=", c.rope_dim));
      }
      return Status::Ok();
    }
    case KVCacheType::kMla: {
      BLOCKKV_RETURN_IF_ERROR(internal::CheckPositive("KVCacheConfig", "latent_dim", c.latent_dim));
      if (c.rope_dim < 0) {
        return InvalidArgumentError(
            StrCat("KVCacheConfig.rope_dim must be >= 0, got ", c.rope_dim));
      }
      const auto row = internal::CheckedAdd(c.latent_dim, c.rope_dim);
      if (c.cache_shape[1] != 1 || !row || c.cache_shape[2] != *row) {
        return InvalidArgumentError(StrCat(
            "KVCacheConfig of type MLA: cache_shape must be (num_layers, 1, latent_dim + rope_dim) "
            "= (",
            c.cache_shape[0], ", 1, ", row ? StrCat(*row) : std::string("overflow"), "), got (",
            c.cache_shape[0], ", ", c.cache_shape[1], ", ", c.cache_shape[2], ")"));
      }
      if (c.state_bytes != 0) {
        return InvalidArgumentError(
            StrCat("KVCacheConfig.state_bytes is for STATE groups; an MLA "
                   "group must leave it 0, got ",
                   c.state_bytes));
      }
      return Status::Ok();
    }
    default:
      return InvalidArgumentError(
          StrCat("KVCacheConfig.type is not a known type (value ", static_cast<int>(c.type), ")"));
  }
  if (c.latent_dim != 0 || c.rope_dim != 0 || c.state_bytes != 0) {
    return InvalidArgumentError(StrCat(
        "KVCacheConfig of type ", KVCacheTypeName(c.type),
        ": latent_dim and rope_dim are for MLA groups, state_bytes for STATE groups; they must be "
        "0, got latent_dim=",
        c.latent_dim, " rope_dim=", c.rope_dim, " state_bytes=", c.state_bytes));
  }
  return Status::Ok();
}

}  // namespace

Status KVCacheConfig::Validate() const {
  auto positive = [](const char* field, int64_t value) {
    return internal::CheckPositive("KVCacheConfig", field, value);
  };
  BLOCKKV_RETURN_IF_ERROR(positive("block_size", block_size));
  BLOCKKV_RETURN_IF_ERROR(positive("num_allocation_groups", num_allocation_groups));
  BLOCKKV_RETURN_IF_ERROR(positive("cache_shape[0] (num_caches)", cache_shape[0]));
  BLOCKKV_RETURN_IF_ERROR(positive("cache_shape[1] (num_kv_heads)", cache_shape[1]));
  BLOCKKV_RETURN_IF_ERROR(positive("cache_shape[2] (head_size)", cache_shape[2]));
  BLOCKKV_RETURN_IF_ERROR(
      positive("max_blocks_per_allocation_group", max_blocks_per_allocation_group));
  BLOCKKV_RETURN_IF_ERROR(ValidateKind(*this));
  if (!IsValidDType(cache_dtype)) {
    return InvalidArgumentError(StrCat("KVCacheConfig.cache_dtype is not a known dtype (value ",
                                       static_cast<int>(cache_dtype), ")"));
  }
  if (cache_dtype == DType::kInt32 || cache_dtype == DType::kInt64) {
    return InvalidArgumentError(StrCat("KVCacheConfig.cache_dtype ", DTypeName(cache_dtype),
                                       " is an index type, not a KV-cache element type; use fp32, "
                                       "fp16, bf16, fp8_e4m3 or int8"));
  }
  return bytes_per_block().status();
}

Result<int64_t> KVCacheConfig::bytes_per_block() const {
  // An unknown dtype has no size; 0 bytes per block would reach a division in the planner.
  if (!IsValidDType(cache_dtype)) {
    return InvalidArgumentError(StrCat("KVCacheConfig.cache_dtype is not a known dtype (value ",
                                       static_cast<int>(cache_dtype), ")"));
  }
  // A STATE group's "block" is one sequence's slot: state_bytes per layer, whatever block_size.
  const auto bytes =
      type == KVCacheType::kState
          ? internal::CheckedProduct(
                {num_caches(), head_size(), static_cast<int64_t>(ElementSize(cache_dtype))})
          : internal::CheckedProduct({num_caches(), block_size, kv_planes(), num_kv_heads(),
                                      head_size(), static_cast<int64_t>(ElementSize(cache_dtype))});
  if (!bytes) {
    return InvalidArgumentError(StrCat(
        "KVCacheConfig bytes per block overflows int64: num_caches=", num_caches(),
        " block_size=", block_size, " num_kv_heads=", num_kv_heads(), " head_size=", head_size(),
        " planes=", kv_planes(), " dtype=", DTypeName(cache_dtype)));
  }
  return *bytes;
}

int64_t KVCacheConfig::elements_per_layer_block() const {
  if (type == KVCacheType::kState) return head_size();  // one slot: state_bytes / element size
  return int64_t{block_size} * kv_planes() * num_kv_heads() * head_size();
}

Status MemoryConfig::Validate() const {
  if (mode != AllocationMode::kReserve && mode != AllocationMode::kAllocate) {
    return InvalidArgumentError(
        StrCat("MemoryConfig.mode is not a known mode (value ", static_cast<int>(mode), ")"));
  }
  if (size <= 0) {
    return InvalidArgumentError(
        StrCat("MemoryConfig.size must be > 0 (",
               mode == AllocationMode::kReserve ? "bytes to keep free" : "number of blocks",
               "), got ", size));
  }
  if (state_slots < 0) {
    return InvalidArgumentError(StrCat("MemoryConfig.state_slots must be >= 0, got ", state_slots));
  }
  return Status::Ok();
}

}  // namespace blockkv
