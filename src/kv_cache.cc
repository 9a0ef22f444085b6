// SPDX-License-Identifier: Apache-2.0
#include "blockkv/kv_cache.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "blockkv/log.h"
#include "internal/check.h"
#include "internal/checked_math.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

namespace {

// Bytes of one block of one layer of a group.
int64_t LayerBlockBytes(const KVCacheConfig& c) {
  return c.elements_per_layer_block() * static_cast<int64_t>(ElementSize(c.cache_dtype));
}

// Group g can share group f's memory pool: layer i of both is one buffer, so they need the same
// number of layers and the same bytes per block of a layer. REQUIRES: both valid.
Status CheckShareable(const KVCacheConfig& first, const KVCacheConfig& c, size_t f, size_t g) {
  if (c.num_caches() != first.num_caches()) {
    return InvalidArgumentError(StrCat(
        "MemoryConfig.shared_pool: cache group ", g, " has ", c.num_caches(),
        " layers (cache_shape[0]) and cache group ", f, " has ", first.num_caches(),
        "; groups sharing one pool need the same number of layers (pad the smaller group, as "
        "vLLM does, or keep separate pools)"));
  }
  if (LayerBlockBytes(c) != LayerBlockBytes(first)) {
    return InvalidArgumentError(StrCat(
        "MemoryConfig.shared_pool: a block of one layer of cache group ", g, " is ",
        LayerBlockBytes(c), " bytes and one of cache group ", f, " is ", LayerBlockBytes(first),
        " bytes; groups sharing one pool need the same bytes per block and layer "
        "(block_size x planes x num_kv_heads x head_size x element size)"));
  }
  return Status::Ok();
}

}  // namespace

int BlockedKVCache::PoolOf(std::span<const KVCacheConfig> configs, bool shared, size_t group) {
  // Pools in the order of their first group; with `shared` the groups of blocks (not STATE)
  // have one, numbered at their first group.
  int next = 0;
  int blocks_pool = -1;
  for (size_t g = 0;; ++g) {
    const bool blocks = configs[g].type != KVCacheType::kState;
    int pool = next;
    if (shared && blocks && blocks_pool >= 0) {
      pool = blocks_pool;
    } else {
      ++next;
      if (shared && blocks) blocks_pool = pool;
    }
    if (g == group) return pool;
  }
}

Result<KVCachePlan> PlanKVCache(std::span<const KVCacheConfig> configs, const MemoryConfig& memory,
                                int64_t available_bytes) {
  if (configs.empty()) return InvalidArgumentError("a KV cache needs at least one KVCacheConfig");
  BLOCKKV_RETURN_IF_ERROR(memory.Validate());
  if (available_bytes < 0) {
    return InvalidArgumentError(StrCat("available_bytes must be >= 0, got ", available_bytes));
  }
  KVCachePlan plan;
  size_t first_blocks = configs.size();  // the first group of blocks (not STATE)
  for (size_t g = 0; g < configs.size(); ++g) {
    if (Status s = configs[g].Validate(); !s.ok()) {
      return Status(s.code(), StrCat("cache group ", g, ": ", s.message()));
    }
    if (configs[g].type == KVCacheType::kState) {  // its own pool of state_slots slots
      if (memory.state_slots <= 0) {
        return InvalidArgumentError(StrCat("cache group ", g,
                                           " is STATE: MemoryConfig.state_slots (one slot per "
                                           "sequence) must be > 0, got ",
                                           memory.state_slots));
      }
      const auto bytes =
          internal::CheckedMul(int64_t{memory.state_slots}, *configs[g].bytes_per_block());
      const auto sum = bytes ? internal::CheckedAdd(plan.state_bytes, *bytes) : std::nullopt;
      if (!sum) {
        return InvalidArgumentError(StrCat("the state slots of cache group ", g,
                                           " overflow int64: ", memory.state_slots, " x ",
                                           *configs[g].bytes_per_block(), " bytes"));
      }
      plan.state_bytes = *sum;
      plan.state_slots = memory.state_slots;
      continue;
    }
    if (memory.shared_pool && first_blocks < g) {
      BLOCKKV_RETURN_IF_ERROR(CheckShareable(configs[first_blocks], configs[g], first_blocks, g));
      continue;  // one pool: the first group's block bytes are every group's
    }
    first_blocks = std::min(first_blocks, g);
    const auto sum = internal::CheckedAdd(plan.bytes_per_block, *configs[g].bytes_per_block());
    if (!sum) {
      return InvalidArgumentError(
          StrCat("bytes per block summed over groups overflows int64 at group ", g, ": ",
                 plan.bytes_per_block, " + ", *configs[g].bytes_per_block()));
    }
    plan.bytes_per_block = *sum;
  }

  if (first_blocks == configs.size()) {
    return InvalidArgumentError(
        "a KV cache needs a DENSE, LOCAL or MLA group besides its STATE groups");
  }
  constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();
  int64_t num_blocks = 0;
  if (memory.mode == AllocationMode::kReserve) {
    // The state slots first (all >= 0: cannot overflow), then the blocks.
    const int64_t usable = available_bytes - memory.size - plan.state_bytes;
    if (usable < plan.bytes_per_block) {
      return ResourceExhaustedError(StrCat(
          "insufficient memory for the KV cache: one block needs ", plan.bytes_per_block,
          " bytes, ", std::max<int64_t>(usable, 0), " bytes are usable (", available_bytes,
          " available, ", memory.size, " kept free by MemoryConfig.size",
          plan.state_bytes > 0 ? StrCat(", ", plan.state_bytes, " for the state slots") : "", ")"));
    }
    num_blocks = usable / plan.bytes_per_block;
  } else {
    num_blocks = memory.size;
  }
  if (num_blocks > kMaxBlocks) {
    return OutOfRangeError(StrCat("the KV cache plan has ", num_blocks,
                                  " blocks, more than the limit of ", kMaxBlocks,
                                  "; use larger blocks or ALLOCATE mode with fewer blocks"));
  }
  const auto blocks_total = internal::CheckedMul(num_blocks, plan.bytes_per_block);
  const auto total =
      blocks_total ? internal::CheckedAdd(*blocks_total, plan.state_bytes) : std::nullopt;
  if (!total) {
    return InvalidArgumentError(
        StrCat(num_blocks, " blocks of ", plan.bytes_per_block, " bytes overflow int64"));
  }
  if (memory.mode == AllocationMode::kAllocate && *total > available_bytes) {
    return ResourceExhaustedError(StrCat("insufficient memory for the KV cache: ", num_blocks,
                                         " blocks need ", *total, " bytes, ", available_bytes,
                                         " bytes are available"));
  }
  plan.num_blocks = static_cast<int32_t>(num_blocks);
  plan.total_bytes = *total;
  return plan;
}

namespace {

// Plans on this rank, then agrees on one num_blocks with every other rank of `comm`. Every rank
// enters both collectives whatever its local outcome, so none waits for a rank that gave up.
Result<KVCachePlan> PlanAcrossRanks(std::span<const KVCacheConfig> configs,
                                    const MemoryConfig& memory, Device* device,
                                    Communicator& comm) {
  BLOCKKV_RETURN_IF_ERROR(comm.Barrier());  // warm-up: the group is formed before planning
  Result<KVCachePlan> local = PlanKVCache(configs, memory, device->available_memory());
  BLOCKKV_ASSIGN_OR_RETURN(const int64_t agreed,
                           comm.AllReduceMin(local.ok() ? local->num_blocks : 0));
  if (!local.ok()) return local.status();
  if (agreed < 1) {
    return ResourceExhaustedError(StrCat("another rank of ", comm.world_size(),
                                         " cannot fit a single KV-cache block; this rank (",
                                         comm.rank(), ") could fit ", local->num_blocks));
  }
  KVCachePlan plan = *local;
  plan.num_blocks = static_cast<int32_t>(agreed);
  plan.total_bytes = agreed * plan.bytes_per_block + plan.state_bytes;  // <= the local total
  return plan;
}

}  // namespace

Result<std::unique_ptr<BlockedKVCache>> BlockedKVCache::Create(std::vector<KVCacheConfig> configs,
                                                               MemoryConfig memory,
                                                               std::shared_ptr<Device> device,
                                                               Communicator* comm) {
  const bool collective =
      comm != nullptr && comm->world_size() > 1 && memory.mode == AllocationMode::kReserve;
  if (device == nullptr) {
    AbandonCreate(comm, memory.mode);
    return InvalidArgumentError("BlockedKVCache::Create needs a device, got null");
  }
  if (memory.mode == AllocationMode::kReserve) device->EmptyCache();
  Result<KVCachePlan> plan = collective ? PlanAcrossRanks(configs, memory, device.get(), *comm)
                                        : PlanKVCache(configs, memory, device->available_memory());
  if (!plan.ok()) return plan.status();

  Result<std::vector<Pool>> pools = AllocatePools(configs, memory.shared_pool, *plan, *device);
  if (collective) {
    // Every rank planned for the same capacity, so one that could not allocate it makes every
    // rank fail (each frees what it allocated), and none is left serving alone.
    BLOCKKV_ASSIGN_OR_RETURN(const int64_t all_allocated, comm->AllReduceMin(pools.ok() ? 1 : 0));
    if (pools.ok() && all_allocated < 1) {
      return ResourceExhaustedError(StrCat("another rank of ", comm->world_size(),
                                           " could not allocate its KV cache of ", plan->num_blocks,
                                           " blocks; rank ", comm->rank(), " released its own"));
    }
  }
  if (!pools.ok()) return pools.status();
  std::vector<Group> groups;
  for (size_t g = 0; g < configs.size(); ++g) {
    groups.push_back(Group{configs[g], PoolOf(configs, memory.shared_pool, g)});
  }
  for (size_t g = 0; g < configs.size(); ++g) {
    const KVCacheConfig& c = configs[g];
    const Pool& pool = (*pools)[static_cast<size_t>(groups[g].pool)];
    const std::string row =
        c.type == KVCacheType::kState
            ? StrCat(c.head_size(), "] (STATE: ", c.state_bytes, " bytes)")
        : c.type == KVCacheType::kMla
            ? StrCat(c.head_size(), "] (MLA: latent ", c.latent_dim, " + rope ", c.rope_dim, ")")
            : StrCat("2, ", c.num_kv_heads(), ", ", c.head_size(), "]");
    Log(LogLevel::kInfo,
        StrCat("KV cache group ", g, " on ", device->name(), ": shape [", c.num_caches(), ", ",
               pool.num_blocks, ", ", c.block_size, ", ", row, " ", DTypeName(c.cache_dtype), ", ",
               pool.num_blocks, c.type == KVCacheType::kState ? " state slots, " : " blocks, ",
               internal::HumanBytes(static_cast<long double>(pool.storage.size())),
               memory.shared_pool && c.type != KVCacheType::kState
                   ? ", in the pool its groups share"
                   : ""));
  }
  return std::unique_ptr<BlockedKVCache>(
      new BlockedKVCache(std::move(device), *plan, std::move(groups), std::move(*pools)));
}

void BlockedKVCache::AbandonCreate(Communicator* comm, AllocationMode mode) {
  if (comm == nullptr || comm->world_size() <= 1 || mode != AllocationMode::kReserve) return;
  // Create's warm-up barrier and plan agreement; the others see 0 blocks and fail before
  // allocating, so they enter no further collective.
  if (comm->Barrier().ok()) comm->AllReduceMin(0).status().IgnoreError();
}

Result<std::vector<BlockedKVCache::Pool>> BlockedKVCache::AllocatePools(
    std::span<const KVCacheConfig> configs, bool shared, const KVCachePlan& plan, Device& device) {
  std::vector<Pool> pools;
  for (size_t g = 0; g < configs.size(); ++g) {
    if (PoolOf(configs, shared, g) != static_cast<int>(pools.size())) continue;  // allocated
    const KVCacheConfig& config = configs[g];
    const int32_t n = config.type == KVCacheType::kState ? plan.state_slots : plan.num_blocks;
    BLOCKKV_ASSIGN_OR_RETURN(BlockedAllocator allocator, BlockedAllocator::Create(n));
    const int64_t bytes = n * *config.bytes_per_block();  // <= total_bytes
    Result<DeviceBuffer> storage = device.Allocate(bytes);
    if (!storage.ok()) {
      return Status(storage.status().code(), StrCat("allocating KV cache group ", g, " (", bytes,
                                                    " bytes): ", storage.status().message()));
    }
    pools.push_back(Pool{std::move(allocator), std::move(*storage), {}, n});
  }
  return pools;
}

BlockedKVCache::BlockedKVCache(std::shared_ptr<Device> device, KVCachePlan plan,
                               std::vector<Group> groups, std::vector<Pool> pools)
    : device_(std::move(device)),
      plan_(plan),
      groups_(std::move(groups)),
      pools_(std::move(pools)) {}

BlockedKVCache::~BlockedKVCache() = default;

Status BlockedKVCache::CheckGroup(int group) const {
  if (group < 0 || group >= num_groups()) {
    return OutOfRangeError(
        StrCat("cache group ", group, " does not exist: the cache has ", num_groups(), " groups"));
  }
  return Status::Ok();
}

Result<std::vector<BlockId>> BlockedKVCache::Reserve(int32_t n, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroup(group));
  return pool(group).allocator.Allocate(n);
}

Status BlockedKVCache::Reserve(int32_t n, std::span<BlockId> out, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroup(group));
  return pool(group).allocator.Allocate(n, out);
}

Status BlockedKVCache::Free(std::span<const BlockId> blocks, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroup(group));
  const std::vector<uint8_t>& lent = pool(group).lent;
  if (!lent.empty()) {
    for (const BlockId b : blocks) {
      if (b >= 0 && b < pool(group).num_blocks && lent[b] != 0) {
        return FailedPreconditionError(
            StrCat("Free: block ", b, " of group ", group,
                   " is held by an offload store (its offload is in flight, or failed and kept "
                   "it); the store frees it once the copy is done, or restore or drop its handle"));
      }
    }
  }
  return pool(group).allocator.Free(blocks);
}

Status BlockedKVCache::CopyBlocks(std::span<const BlockId> src, std::span<const BlockId> dst,
                                  int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroup(group));
  if (src.size() != dst.size()) {
    return InvalidArgumentError(
        StrCat("CopyBlocks: ", src.size(), " sources but ", dst.size(), " destinations"));
  }
  const int32_t num_blocks = pool(group).num_blocks;
  for (const std::span<const BlockId> ids : {src, dst}) {
    for (const BlockId id : ids) {
      if (id < 0 || id >= num_blocks) {
        return OutOfRangeError(
            StrCat("CopyBlocks: block ", id, " is outside [0, ", num_blocks, ")"));
      }
    }
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    for (size_t j = 0; j < dst.size(); ++j) {
      if (dst[i] == src[j] || (j > i && dst[i] == dst[j])) {
        return InvalidArgumentError(StrCat("CopyBlocks: destination block ", dst[i],
                                           " is also a source or a repeated destination"));
      }
    }
  }
  const KVCacheConfig& c = groups_[group].config;
  const int64_t block_bytes = LayerBlockBytes(c);
  const int64_t layer_bytes = block_bytes * num_blocks;
  auto* base = static_cast<char*>(pool(group).storage.data());
  for (int64_t layer = 0; layer < c.num_caches(); ++layer) {
    char* layer_base = base + layer * layer_bytes;
    for (size_t i = 0; i < src.size(); ++i) {
      BLOCKKV_RETURN_IF_ERROR(device_->CopyWithin(layer_base + dst[i] * block_bytes,
                                                  layer_base + src[i] * block_bytes, block_bytes));
    }
  }
  return Status::Ok();
}

Result<TensorView> BlockedKVCache::GetGroupStorage(int group) const {
  BLOCKKV_RETURN_IF_ERROR(CheckGroup(group));
  const KVCacheConfig& c = groups_[group].config;
  void* const data = pool(group).storage.data();
  const int64_t n = pool(group).num_blocks;
  if (c.type == KVCacheType::kState) {
    return ContiguousView(data, c.cache_dtype, device_->kind(), device_->ordinal(),
                          {c.num_caches(), n, c.head_size()});
  }
  if (c.type == KVCacheType::kMla) {
    return ContiguousView(data, c.cache_dtype, device_->kind(), device_->ordinal(),
                          {c.num_caches(), n, c.block_size, c.head_size()});
  }
  return ContiguousView(data, c.cache_dtype, device_->kind(), device_->ordinal(),
                        {c.num_caches(), n, c.block_size, 2, c.num_kv_heads(), c.head_size()});
}

Result<TensorView> BlockedKVCache::GetCache(int64_t cache_id, int group) const {
  BLOCKKV_RETURN_IF_ERROR(CheckGroup(group));
  const KVCacheConfig& c = groups_[group].config;
  if (cache_id < 0 || cache_id >= c.num_caches()) {
    return OutOfRangeError(StrCat("cache_id ", cache_id, " does not exist: cache group ", group,
                                  " has ", c.num_caches(), " caches (layers)"));
  }
  const int64_t n = pool(group).num_blocks;
  const int64_t layer_bytes = n * LayerBlockBytes(c);
  char* base = static_cast<char*>(pool(group).storage.data()) + cache_id * layer_bytes;
  if (c.type == KVCacheType::kState) {
    return ContiguousView(base, c.cache_dtype, device_->kind(), device_->ordinal(),
                          {n, c.head_size()});
  }
  if (c.type == KVCacheType::kMla) {
    return ContiguousView(base, c.cache_dtype, device_->kind(), device_->ordinal(),
                          {n, c.block_size, c.head_size()});
  }
  return ContiguousView(base, c.cache_dtype, device_->kind(), device_->ordinal(),
                        {n, c.block_size, 2, c.num_kv_heads(), c.head_size()});
}

std::vector<int32_t> BlockedKVCache::free_blocks() const {
  std::vector<int32_t> out;
  out.reserve(groups_.size());
  for (const Group& g : groups_) out.push_back(pools_[g.pool].allocator.free_blocks());
  return out;
}

const KVCacheConfig& BlockedKVCache::config(int group) const {
  BLOCKKV_CHECK(group >= 0 && group < num_groups(), "config(group): group out of range");
  return groups_[group].config;
}

const BlockedAllocator& BlockedKVCache::allocator(int group) const {
  BLOCKKV_CHECK(group >= 0 && group < num_groups(), "allocator(group): group out of range");
  return pool(group).allocator;
}

Status BlockedKVCache::CheckInvariants() const {
  for (int g = 0; g < num_groups(); ++g) {
    const Group& group = groups_[g];
    const Pool& pool = pools_[group.pool];
    std::vector<KVCacheConfig> configs;
    for (const Group& each : groups_) configs.push_back(each.config);
    if (group.pool != PoolOf(configs, shared_pool(), static_cast<size_t>(g))) {
      return InternalError(StrCat("cache group ", g, " draws from pool ", group.pool));
    }
    const int32_t planned =
        group.config.type == KVCacheType::kState ? plan_.state_slots : plan_.num_blocks;
    if (Status s = pool.allocator.CheckInvariants(); !s.ok()) {
      return InternalError(StrCat("cache group ", g, ": ", s.message()));
    }
    if (pool.allocator.num_blocks() != planned || pool.num_blocks != planned) {
      return InternalError(StrCat("cache group ", g, " allocator has ", pool.allocator.num_blocks(),
                                  " blocks, plan has ", planned));
    }
    if (pool.storage.size() != planned * *group.config.bytes_per_block()) {
      return InternalError(StrCat("cache group ", g, " storage is ", pool.storage.size(),
                                  " bytes, not num_blocks x bytes_per_block"));
    }
    for (size_t b = 0; b < pool.lent.size(); ++b) {
      if (pool.lent[b] != 0 && !pool.allocator.IsUsed(static_cast<BlockId>(b))) {
        return InternalError(StrCat("cache group ", g, ": block ", b, " is lent but free"));
      }
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
