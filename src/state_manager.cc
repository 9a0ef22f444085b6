// SPDX-License-Identifier: Apache-2.0
#include "blockkv/state_manager.h"

#include "blockkv/ragged_batch.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <utility>

#include "internal/block_size.h"
#include "internal/check.h"
#include "internal/checked_math.h"
#include "internal/host_memory.h"
#include "internal/strings.h"
#include "internal/uid_map.h"
#include "internal/validate.h"
#include "prefix_host_tier.h"
#include "ragged_batch_impl.h"
#include "remote_tier.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"
#include "state_manager_offload.h"
#include "transfer.h"

namespace blockkv {

using internal::ColdStrCat;
using internal::StrCat;

Status StateManagerConfig::Validate() const {
  auto positive = [](const char* field, int64_t value) {
    return internal::CheckPositive("StateManagerConfig", field, value);
  };
  BLOCKKV_RETURN_IF_ERROR(positive("max_tracked_sequences", max_tracked_sequences));
  BLOCKKV_RETURN_IF_ERROR(positive("max_ragged_batch_size", max_ragged_batch_size));
  BLOCKKV_RETURN_IF_ERROR(positive("max_ragged_sequence_count", max_ragged_sequence_count));
  BLOCKKV_RETURN_IF_ERROR(positive("max_context", max_context));
  // The batch pads its token count (PaddedTokenCount); the padded capacity must be an int32 too.
  // Checked here, before Create sizes anything from the other fields.
  if (const int64_t padded = PaddedTokenCount(max_ragged_batch_size);
      padded > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(StrCat("max_ragged_batch_size ", max_ragged_batch_size, " pads to ",
                                       padded, " tokens, more than int32 holds"));
  }
  if (max_ragged_sequence_count > max_tracked_sequences) {
    return InvalidArgumentError(StrCat("max_ragged_sequence_count (", max_ragged_sequence_count,
                                       ") must be <= max_tracked_sequences (",
                                       max_tracked_sequences, ")"));
  }
  if (max_ragged_sequence_count > max_ragged_batch_size) {
    return InvalidArgumentError(StrCat("max_ragged_sequence_count (", max_ragged_sequence_count,
                                       ") must be <= max_ragged_batch_size (",
                                       max_ragged_batch_size, ")"));
  }
  if (kv_events) {
    if (Status s = kv_events->Validate(); !s.ok()) {
      return {s.code(), StrCat("StateManagerConfig.kv_events: ", s.message())};
    }
    if (!prefix_cache.enabled || prefix_cache.max_events == 0) {
      return InvalidArgumentError(
          "StateManagerConfig.kv_events needs prefix_cache.enabled = true and "
          "prefix_cache.max_events > 0: the events it publishes are the prefix cache's");
    }
  }
  if (remote_tier && !prefix_cache.enabled) {
    return InvalidArgumentError(
        "StateManagerConfig.remote_tier needs prefix caching on (prefix_cache.enabled)");
  }
  return memory_config.Validate();
}

std::string_view SchedulingResultName(SchedulingResult result) {
  switch (result) {
    case SchedulingResult::kSuccess:
      return "Success";
    case SchedulingResult::kEngineSequenceLimitExceeded:
      return "EngineSequenceLimitExceeded";
    case SchedulingResult::kBatchSequenceLimitExceeded:
      return "BatchSequenceLimitExceeded";
    case SchedulingResult::kBatchTokenLimitExceeded:
      return "BatchTokenLimitExceeded";
    case SchedulingResult::kKVCacheLimitExceeded:
      return "KVCacheLimitExceeded";
    case SchedulingResult::kSequenceTokenLimitExceeded:
      return "SequenceTokenLimitExceeded";
  }
  return "Unknown";
}

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

KVRequirement ComputeKVRequirement(int64_t seen_tokens, int32_t allocated_blocks,
                                   const KVBudget& budget, int32_t block_size) {
  const int64_t max_new_tokens = budget.max_new_tokens;
  const int32_t max_new_blocks = budget.max_new_blocks;
  const int64_t required = CeilDiv(seen_tokens + max_new_tokens, block_size) - allocated_blocks;
  if (required <= max_new_blocks) return {max_new_tokens, static_cast<int32_t>(required)};
  return {(int64_t{max_new_blocks} + allocated_blocks) * block_size - seen_tokens, max_new_blocks};
}

// ---- creation ---------------------------------------------------------------------------------

namespace {

// Host bytes a manager's own bookkeeping takes for `config` (block tables, sequences, the uid
// map), or nullopt when that overflows.
std::optional<int64_t> BookkeepingBytes(const StateManagerConfig& config,
                                        std::span<const KVCacheConfig> kv_configs) {
  std::optional<int64_t> bytes = internal::CheckedProduct(
      {config.max_tracked_sequences, int64_t{sizeof(Sequence) + 64}});  // + uid map and marks
  for (const KVCacheConfig& c : kv_configs) {
    const auto table =
        internal::CheckedProduct({config.max_tracked_sequences, c.max_blocks_per_allocation_group,
                                  int64_t{sizeof(BlockId)}});
    if (!bytes || !table) return std::nullopt;
    bytes = internal::CheckedAdd(*bytes, *table);
  }
  return bytes;
}

// prefix_cache.state_checkpoint_tokens when 0: the smallest multiple of every other group's
// block size of at least 512 tokens, at most max_context (0 when even one block size exceeds it,
// which CheckCheckpoints refuses).
int64_t DefaultCheckpointTokens(const StateManagerConfig& config,
                                std::span<const KVCacheConfig> kv_configs) {
  int64_t step = 1;
  for (const KVCacheConfig& c : kv_configs) {
    if (c.type == KVCacheType::kState || c.block_size <= 0) continue;  // Validate refuses <= 0
    step = std::lcm(step, int64_t{c.block_size});
    if (step > config.max_context) return 0;
  }
  const int64_t fit = config.max_context / step;
  return step * std::max<int64_t>(1, std::min<int64_t>(CeilDiv(512, step), fit));
}

// With prefix caching and a STATE group (`state_group`, or -1): the checkpoint interval is a whole
// number of every other group's blocks, and a forward can end at it.
Status CheckCheckpoints(const StateManagerConfig& config, std::span<const KVCacheConfig> kv_configs,
                        int state_group) {
  const int64_t every = config.prefix_cache.state_checkpoint_tokens;
  if (every < 0) {
    return InvalidArgumentError(StrCat("prefix_cache.state_checkpoint_tokens is ", every,
                                       "; it is >= 0 tokens (0: the default)"));
  }
  if (!config.prefix_cache.enabled) return Status::Ok();
  if (state_group < 0) {
    if (every == 0) return Status::Ok();
    return InvalidArgumentError(StrCat("prefix_cache.state_checkpoint_tokens is ", every,
                                       " but no cache group is STATE (leave it 0)"));
  }
  for (size_t g = 0; g < kv_configs.size(); ++g) {
    if (kv_configs[g].type == KVCacheType::kState) continue;
    if (every == 0 || every % kv_configs[g].block_size != 0) {
      return InvalidArgumentError(StrCat(
          "prefix_cache.state_checkpoint_tokens is ", every, ", not a multiple of cache group ", g,
          "'s block_size ", kv_configs[g].block_size, " (max_context=", config.max_context,
          "): a prefix hit is whole blocks of every group"));
    }
  }
  if (every > config.max_context) {
    return InvalidArgumentError(StrCat("prefix_cache.state_checkpoint_tokens is ", every,
                                       ", past max_context=", config.max_context,
                                       ": no forward could end at a checkpoint"));
  }
  return Status::Ok();
}

// What the manager itself requires of its configuration, beyond what BlockedKVCache checks.
Status CheckManagerConfig(const StateManagerConfig& config,
                          std::span<const KVCacheConfig> kv_configs) {
  BLOCKKV_RETURN_IF_ERROR(config.Validate());
  if (config.offload) {
    if (Status s = config.offload_config.Validate(); !s.ok()) {
      return {s.code(), StrCat("StateManagerConfig.offload_config: ", s.message())};
    }
  }
  const std::vector<int64_t>& windows = config.prefix_cache.sliding_windows;
  if (windows.size() > kv_configs.size()) {
    return InvalidArgumentError(StrCat("prefix_cache.sliding_windows has ", windows.size(),
                                       " entries for ", kv_configs.size(), " cache groups"));
  }
  for (size_t g = 0; g < windows.size(); ++g) {
    if (windows[g] < 0) {
      return InvalidArgumentError(StrCat("prefix_cache.sliding_windows[", g, "] is ", windows[g],
                                         "; a window is >= 0 tokens (0: full attention)"));
    }
  }
  int state_group = -1;  // with prefix caching: the STATE group, whose checkpoints it keeps
  for (size_t g = 0; g < kv_configs.size(); ++g) {
    if (Status s = kv_configs[g].Validate(); !s.ok()) {
      return {s.code(), StrCat("cache group ", g, ": ", s.message())};
    }
    // A LOCAL group's window is its own: a second one for the prefix cache may only repeat it.
    if (kv_configs[g].type == KVCacheType::kLocal && g < windows.size() && windows[g] != 0 &&
        windows[g] != kv_configs[g].local_window) {
      return InvalidArgumentError(StrCat("prefix_cache.sliding_windows[", g, "] is ", windows[g],
                                         " but cache group ", g,
                                         " is LOCAL with local_window=", kv_configs[g].local_window,
                                         " (give 0 or the same window)"));
    }
    if (kv_configs[g].type == KVCacheType::kState && config.prefix_cache.enabled) {
      if (state_group >= 0) {
        return UnimplementedError(StrCat("cache groups ", state_group, " and ", g,
                                         " are both STATE and prefix caching is on: checkpoints "
                                         "are kept for one STATE group; put every state layer in "
                                         "one group or turn prefix_cache off"));
      }
      state_group = static_cast<int>(g);
    }
    if (kv_configs[g].num_allocation_groups != 1) {
      return UnimplementedError(
          StrCat("cache group ", g, ": num_allocation_groups=", kv_configs[g].num_allocation_groups,
                 "; the state manager supports only 1 (as DeepSpeed's engine uses)"));
    }
  }
  BLOCKKV_RETURN_IF_ERROR(CheckCheckpoints(config, kv_configs, state_group));
  // The tables live in host memory: refuse what cannot fit instead of throwing bad_alloc.
  const std::optional<int64_t> bytes = BookkeepingBytes(config, kv_configs);
  const int64_t available = internal::ReadHostMemory().available;
  if (!bytes || *bytes > available) {
    return ResourceExhaustedError(StrCat(
        "the state manager's block tables for ", config.max_tracked_sequences, " sequences need ",
        bytes ? StrCat(*bytes, " bytes") : std::string("more than 2^63 bytes"), " of host memory, ",
        available,
        " available; lower max_tracked_sequences or "
        "max_blocks_per_allocation_group"));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<StateManager>> StateManager::Create(StateManagerConfig config,
                                                           std::vector<KVCacheConfig> kv_configs,
                                                           std::shared_ptr<Device> device,
                                                           Communicator* comm) {
  // STATE groups (issue 21): a sequence holds one slot whatever its length, the group's one
  // block of max_context tokens; one slot per tracked sequence unless the config says otherwise.
  bool state = false;
  for (KVCacheConfig& c : kv_configs) {
    if (c.type != KVCacheType::kState) continue;
    state = true;
    c.block_size = static_cast<int32_t>(
        std::clamp<int64_t>(config.max_context, 1, std::numeric_limits<int32_t>::max()));
    c.max_blocks_per_allocation_group = 1;
  }
  if (state && config.memory_config.state_slots == 0) {
    config.memory_config.state_slots = config.max_tracked_sequences;
  }
  if (state && config.prefix_cache.enabled && config.prefix_cache.state_checkpoint_tokens == 0) {
    config.prefix_cache.state_checkpoint_tokens = DefaultCheckpointTokens(config, kv_configs);
  }
  if (Status s = CheckManagerConfig(config, kv_configs); !s.ok()) {
    // The other ranks are entering the cache's collectives: join them, so they fail too.
    BlockedKVCache::AbandonCreate(comm, config.memory_config.mode);
    return s;
  }
  BLOCKKV_ASSIGN_OR_RETURN(BlockedAllocator slots,
                           BlockedAllocator::Create(config.max_tracked_sequences));
  BLOCKKV_ASSIGN_OR_RETURN(
      std::unique_ptr<BlockedKVCache> cache,
      BlockedKVCache::Create(std::move(kv_configs), config.memory_config, std::move(device), comm));
  std::unique_ptr<StateManager> manager(new StateManager(
      std::make_unique<Impl>(std::move(config), std::move(cache), std::move(slots))));
  Impl& impl = *manager->impl_;
  impl.owner_ = manager.get();
  if (impl.config_.offload) BLOCKKV_RETURN_IF_ERROR(impl.EnableOffload());
  if (impl.config_.kv_events) BLOCKKV_RETURN_IF_ERROR(impl.EnableKVEvents());
  if (impl.config_.remote_tier) BLOCKKV_RETURN_IF_ERROR(impl.EnableRemoteTier());
  if (impl.config_.transfer) BLOCKKV_RETURN_IF_ERROR(impl.EnableTransfer());
  return manager;
}

StateManager::StateManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StateManager::~StateManager() = default;

// ---- the API: each call is the Impl's (state_manager_impl.h) ----------------------------------

Result<Sequence*> StateManager::GetOrCreateSequence(SeqId uid) {
  return impl_->GetOrCreateSequence(uid);
}
Result<Sequence*> StateManager::AddSequence(SeqId uid, std::span<const TokenId> prompt,
                                            const SequenceOptions& options) {
  return impl_->AddSequence(uid, prompt, options);
}
Status StateManager::AppendTokens(SeqId uid, std::span<const TokenId> tokens) {
  return impl_->AppendTokens(uid, tokens);
}
const Sequence* StateManager::GetSequence(SeqId uid) const { return impl_->GetSequence(uid); }
bool StateManager::Owns(const Sequence& seq) const { return impl_->Owns(seq); }
Status StateManager::FlushSequence(SeqId uid) {
  Status s = impl_->FlushSequence(uid);
  impl_->MaybePublishKVEvents();
  return s;
}
Result<KVRequirement> StateManager::Query(SeqId uid, const KVBudget& budget, int group) const {
  return impl_->Query(uid, budget, group);
}
Result<SchedulingResult> StateManager::CanSchedule(const ScheduleRequest& request) {
  return impl_->CanSchedule(request);
}
Status StateManager::Schedule(const ScheduleRequest& request, SchedulingResult* result) {
  Status s = impl_->Schedule(request, result);
  impl_->MaybePublishKVEvents();
  return s;
}
Status StateManager::ScheduleBatch(const ScheduleRequest& request, std::span<const TokenId> tokens,
                                   RaggedBatch& batch, bool padding, SchedulingResult* result) {
  Status s = impl_->ScheduleBatch(request, tokens, batch, padding, result);
  impl_->MaybePublishKVEvents();
  return s;
}
Status StateManager::PostForward(std::span<const SeqId> uids, std::span<const int64_t> accepted) {
  Status s =
      accepted.empty() ? impl_->PostForward(uids) : impl_->PostForwardAccepted(uids, accepted);
  impl_->MaybePublishKVEvents();
  return s;
}
Status StateManager::PostForward(const RaggedBatch& batch, std::span<const int64_t> accepted) {
  Status s = impl_->PostForward(batch, accepted);
  impl_->MaybePublishKVEvents();
  return s;
}
Status StateManager::Rollback(SeqId uid, int64_t n) { return impl_->Rollback(uid, n); }
Status StateManager::FreeLeadingBlocks(SeqId uid, int32_t num_blocks, int group) {
  return impl_->FreeLeadingBlocks(uid, num_blocks, group);
}
Status StateManager::Fork(SeqId parent, SeqId child) { return impl_->Fork(parent, child); }
int64_t StateManager::RemainingBlockCapacity(SeqId uid, int group) const {
  return impl_->RemainingBlockCapacity(uid, group);
}
const PrefixCache* StateManager::prefix_cache() const { return impl_->prefix_cache(); }
CacheEventBatch StateManager::DrainCacheEvents() { return impl_->DrainCacheEvents(); }
int64_t StateManager::ResetPrefixCache() {
  const int64_t n = impl_->ResetPrefixCache();
  impl_->MaybePublishKVEvents();
  return n;
}
std::vector<BlockHash> StateManager::cached_keys(int group, CacheMedium medium) const {
  return impl_->cached_keys(group, medium);
}
void StateManager::PublishKVEvents(bool wait) {
  if (impl_->kv_publisher_ == nullptr) return;
  impl_->PublishKVEvents();
  if (!wait) return;
  impl_->kv_publisher_->Flush();
  if (impl_->kv_resync_) {  // the queue was full: it has room now (unless paused for a test)
    impl_->PublishKVEvents();
    impl_->kv_publisher_->Flush();
  }
}
KVEventPublisher* StateManager::kv_event_publisher() const { return impl_->kv_publisher_.get(); }
Status StateManager::SaveSnapshot(const std::string& path) const {
  return impl_->SaveSnapshot(path);
}
Result<std::vector<std::byte>> StateManager::SaveSnapshot() const { return impl_->SaveSnapshot(); }
Status StateManager::LoadSnapshot(const std::string& path) {
  Status s = impl_->LoadSnapshot(path);
  impl_->MaybePublishKVEvents();
  return s;
}
Status StateManager::LoadSnapshot(std::span<const std::byte> bytes) {
  Status s = impl_->LoadSnapshot(bytes);
  impl_->MaybePublishKVEvents();
  return s;
}
Result<OffloadTicket> StateManager::PreemptSequence(SeqId uid) {
  return impl_->PreemptSequence(uid);
}
Result<OffloadTicket> StateManager::ResumeSequence(SeqId uid) { return impl_->ResumeSequence(uid); }
const OffloadStore* StateManager::offload_store() const { return impl_->offload_store(); }
StateManager::HostPrefixStats StateManager::host_prefix_stats() const {
  return impl_->host_prefix_stats();
}
Result<TensorView> StateManager::GetCache(int64_t cache_id, int group) const {
  return impl_->GetCache(cache_id, group);
}
const BlockedKVCache& StateManager::kv_cache() const { return impl_->kv_cache(); }
const BlockPool& StateManager::pool(int group) const { return impl_->pool(group); }
const BlockId* StateManager::block_tables(int group) const { return impl_->block_tables(group); }
const StateManagerConfig& StateManager::config() const { return impl_->config(); }
int StateManager::num_groups() const { return impl_->num_groups(); }
int32_t StateManager::n_tracked_sequences() const { return impl_->n_tracked_sequences(); }
std::vector<int32_t> StateManager::free_blocks() const { return impl_->free_blocks(); }
int32_t StateManager::kv_block_size(int group) const { return impl_->kv_block_size(group); }
int32_t StateManager::max_blocks_per_sequence(int group) const {
  return impl_->max_blocks_per_sequence(group);
}
Status StateManager::CheckInvariants() const { return impl_->CheckInvariants(); }

StateManager::Impl::Impl(StateManagerConfig config, std::unique_ptr<BlockedKVCache> cache,
                         BlockedAllocator slots)
    : config_(std::move(config)),
      cache_(std::move(cache)),
      slots_(std::move(slots)),
      by_uid_(std::make_unique<internal::UidMap>(config_.max_tracked_sequences)) {
  const int num_groups = cache_->num_groups();
  const auto tracked = static_cast<size_t>(config_.max_tracked_sequences);
  token_limit_ = config_.max_context;
  pools_.reserve(static_cast<size_t>(num_groups));
  for (int g = 0; g < num_groups; ++g) {
    int lead = 0;  // the first group of g's pool
    while (cache_->pool_of(lead) != cache_->pool_of(g)) ++lead;
    pool_lead_.push_back(lead);
    if (lead == g) {
      pools_.emplace_back(cache_.get(), g);
    } else {
      pools_.emplace_back(pools_[static_cast<size_t>(lead)], g);
    }
    tables_.emplace_back(tracked * static_cast<size_t>(max_blocks_per_sequence(g)), kNoBlock);
    block_sizes_.emplace_back(kv_block_size(g));
    const KVCacheConfig& c = cache_->config(g);
    const std::vector<int64_t>& windows = config_.prefix_cache.sliding_windows;
    windows_.push_back(c.type == KVCacheType::kLocal             ? c.local_window
                       : static_cast<size_t>(g) < windows.size() ? windows[static_cast<size_t>(g)]
                                                                 : 0);
    if (c.type == KVCacheType::kLocal) local_groups_.push_back(g);
    if (c.type == KVCacheType::kState && state_group_ < 0) state_group_ = g;
    token_limit_ = std::min(token_limit_, int64_t{max_blocks_per_sequence(g)} * kv_block_size(g));
  }
  sequences_.reset(new Sequence[tracked]);
  static_assert(offsetof(Sequence, one_group_) + sizeof(Sequence::GroupState) <= 64,
                "a sequence's hot state is its first cache line");
  if (num_groups > 1) group_states_.resize(tracked * static_cast<size_t>(num_groups));
  for (size_t slot = 0; slot < tracked; ++slot) {
    Sequence& seq = sequences_[slot];
    seq.groups_ =
        num_groups == 1 ? &seq.one_group_ : &group_states_[slot * static_cast<size_t>(num_groups)];
    for (int g = 0; g < num_groups; ++g) {
      seq.groups_[g].row =
          tables_[g].data() + slot * static_cast<size_t>(max_blocks_per_sequence(g));
    }
  }
  scratch_.resize(static_cast<size_t>(num_groups));
  slot_marks_.assign(tracked, 0);
  if (config_.prefix_cache.enabled) EnablePrefixCache();
}

StateManager::Impl::~Impl() {
  // The transfer endpoint first: its thread serves peers' gets from the KV cache's registered
  // memory until it is joined, and members go in reverse order (cache_ is declared after it).
  transfer_.reset();
}

// ---- lookups ----------------------------------------------------------------------------------

Sequence* StateManager::Impl::Find(SeqId uid) {
  const int32_t slot = by_uid_->Find(uid);
  return slot == internal::UidMap::kAbsent ? nullptr : &sequences_[slot];
}

const Sequence* StateManager::Impl::Find(SeqId uid) const {
  const int32_t slot = by_uid_->Find(uid);
  return slot == internal::UidMap::kAbsent ? nullptr : &sequences_[slot];
}

int32_t StateManager::Impl::n_tracked_sequences() const { return by_uid_->size(); }

const Sequence* StateManager::Impl::GetSequence(SeqId uid) const { return Find(uid); }

int32_t StateManager::Impl::kv_block_size(int group) const {
  return cache_->config(group).block_size;
}

int32_t StateManager::Impl::max_blocks_per_sequence(int group) const {
  return cache_->config(group).max_blocks_per_allocation_group;
}

std::vector<int32_t> StateManager::Impl::free_blocks() const {
  std::vector<int32_t> free;
  for (const BlockPool& pool : pools_) free.push_back(pool.free_blocks());
  return free;
}

Result<TensorView> StateManager::Impl::GetCache(int64_t cache_id, int group) const {
  return cache_->GetCache(cache_id, group);
}

Status StateManager::Impl::CheckGroupArg(int group) const {
  if (group < 0 || group >= num_groups()) {
    return OutOfRangeError(
        StrCat("cache group ", group, " does not exist: there are ", num_groups()));
  }
  return Status::Ok();
}

int64_t StateManager::Impl::RemainingBlockCapacity(SeqId uid, int group) const {
  const Sequence* seq = Find(uid);
  if (seq == nullptr || group < 0 || group >= num_groups()) return 0;
  return block_sizes_[group].Offset(seq->seen_tokens());
}

// ---- sequences --------------------------------------------------------------------------------

Sequence* StateManager::Impl::CreateInSlot(SeqId uid) {
  BlockId slot = kNoBlock;
  const Status taken = slots_.Allocate(1, std::span<BlockId>(&slot, 1));
  BLOCKKV_CHECK(taken.ok(), "CreateInSlot without a free slot");
  Sequence& seq = sequences_[slot];
  seq.uid_ = uid;
  seq.slot_ = slot;
  seq.seen_tokens_ = 0;
  seq.in_flight_tokens_ = 0;
  seq.table_version_ = ++last_table_version_;
  seq.cached_prefix_tokens_ = 0;
  seq.preempted_ = false;
  seq.exported_ = false;
  seq.importing_ = false;
  for (int g = 0; g < num_groups(); ++g) seq.groups_[g].allocated = seq.groups_[g].released = 0;
  by_uid_->Insert(uid, slot);
  return &seq;
}

Result<Sequence*> StateManager::Impl::GetOrCreateSequence(SeqId uid) {
  if (Sequence* seq = Find(uid)) return seq;
  if (slots_.free_blocks() == 0) {
    return ResourceExhaustedError(StrCat("unable to create a tracking slot for sequence ", uid,
                                         ": all ", config_.max_tracked_sequences,
                                         " slots (max_tracked_sequences) are in use"));
  }
  return CreateInSlot(uid);
}

void StateManager::Impl::ReleaseSequenceBlocks(Sequence& seq) {
  for (int g = 0; g < num_groups(); ++g) {
    Sequence::GroupState& state = seq.groups_[g];
    std::span<const BlockId> held = state.held();
    if (prefix_ != nullptr) {
      // Last block first: deeper blocks of a prefix become the least recently used, so eviction
      // takes a chain from its end and its shorter prefixes stay usable.
      tail_scratch_.assign(held.rbegin(), held.rend());
      held = tail_scratch_;
    }
    const Status released = pools_[g].Release(held);
    BLOCKKV_CHECK(released.ok(), "a sequence held a block without a reference");
    std::fill(state.row, state.row + state.allocated, kNoBlock);
    state.allocated = state.released = 0;
  }
}

Status StateManager::Impl::FlushSequence(SeqId uid) {
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("cannot flush sequence ", uid, ": it is not tracked"));
  }
  if (seq->exported_) [[unlikely]] {
    return FailedPreconditionError(
        StrCat("cannot flush sequence ", uid, ": it is exported; CancelExport it first"));
  }
  if (seq->importing_) [[unlikely]] {
    return FailedPreconditionError(StrCat("cannot flush sequence ", uid,
                                          ": it is being imported; CompleteImports after its "
                                          "transfer has finished"));
  }
  DropParked(*seq);
  ReleaseSequenceBlocks(*seq);
  ResetKeys(seq->slot_);
  const BlockId slot = seq->slot_;
  const Status freed = slots_.Free(std::span<const BlockId>(&slot, 1));
  BLOCKKV_CHECK(freed.ok(), "a tracked sequence's slot was free");
  by_uid_->Erase(uid);
  seq->slot_ = -1;
  seq->seen_tokens_ = seq->in_flight_tokens_ = seq->cached_prefix_tokens_ = 0;
  return Status::Ok();
}

Status StateManager::Impl::PostForward(std::span<const SeqId> uids) {
  slot_scratch_.resize(uids.size());
  for (size_t i = 0; i < uids.size(); ++i) {
    slot_scratch_[i] = by_uid_->Find(uids[i]);
    if (slot_scratch_[i] == internal::UidMap::kAbsent) {
      return NotFoundError(ColdStrCat("PostForward: sequence ", uids[i], " is not tracked"));
    }
    // Its blocks are still being read: publishing them would cache what is not there yet.
    if (sequences_[slot_scratch_[i]].importing_) [[unlikely]] {
      return FailedPreconditionError(ColdStrCat("PostForward: sequence ", uids[i],
                                                " is being imported; CompleteImports first"));
    }
  }
  for (const int32_t slot : slot_scratch_) Advance(sequences_[slot]);
  return Status::Ok();
}

inline void StateManager::Impl::Advance(Sequence& seq) {
  seq.seen_tokens_ += seq.in_flight_tokens_;
  seq.in_flight_tokens_ = 0;
  // A resumed sequence's blocks are published once their copy is known to be good.
  if (prefix_ != nullptr && (resuming_ == 0 || RestoreDone(seq))) PublishFullBlocks(seq);
  // Published first: a block that leaves the window stays in the prefix cache. A resume copy
  // still in flight writes into its blocks: they go once it has settled (the next Schedule).
  if (!local_groups_.empty() && (resuming_ == 0 || RestoreDone(seq))) [[unlikely]] {
    ReleaseOutOfWindow(seq);
  }
}

void StateManager::Impl::ReleaseOutOfWindow(Sequence& seq) {
  bool changed = false;
  for (const int g : local_groups_) {
    Sequence::GroupState& state = seq.groups_[g];
    // The blocks wholly before position seen - W (the next query sees (seen - W, seen]), as a
    // prefix hit of `seen` tokens would keep (WindowStart).
    const int64_t end = seq.seen_tokens_ - windows_[static_cast<size_t>(g)];
    if (end <= 0) continue;
    const auto out =
        static_cast<int32_t>(std::min<int64_t>(block_sizes_[g].Index(end), state.allocated));
    if (out <= state.released) continue;
    BlockId* first = state.row + state.released;
    const Status released = pools_[g].Release(
        std::span<const BlockId>(first, static_cast<size_t>(out - state.released)));
    BLOCKKV_CHECK(released.ok(), "a sequence held a block without a reference");
    std::fill(first, state.row + out, kNoBlock);
    state.released = out;
    changed = true;
  }
  if (changed) seq.table_version_ = ++last_table_version_;
}

// Here, not in state_manager_rollback.cc: Advance is inline.
void StateManager::Impl::AdvanceAccepted(Sequence& seq, int64_t accepted) {
  if (accepted < seq.in_flight_tokens_) {
    // The rejected tokens' blocks go before publishing, which then sees only kept tokens. The
    // block holding position seen + accepted was written by this forward: it is private.
    TrimTo(seq, seq.seen_tokens_ + accepted);
    seq.in_flight_tokens_ = accepted;
  }
  Advance(seq);
}

Status StateManager::Impl::PostForward(const RaggedBatch& batch,
                                       std::span<const int64_t> accepted) {
  // The batch's entries, read directly (StateManager is a friend of RaggedBatch): a decode step
  // does this for every sequence.
  const std::span<const RaggedBatch::Impl::Entry> entries = batch.impl_->entries();
  const int64_t* ids = batch.impl_->input_ids.host.data();
  auto tokens = [&](const RaggedBatch::Impl::Entry& e) {
    return std::span<const int64_t>(ids + e.start, static_cast<size_t>(e.n_tokens));
  };
  const bool prefix = prefix_ != nullptr;
  BLOCKKV_RETURN_IF_ERROR(CheckAcceptedCount(entries.size(), accepted));
  const bool speculative = !accepted.empty();
  for (const RaggedBatch::Impl::Entry& e : entries) {
    if (!Owns(*e.seq)) [[unlikely]] {
      return InvalidArgumentError(ColdStrCat("PostForward: batch sequence ", &e - entries.data(),
                                             " is not a tracked sequence of this manager"));
    }
    if (e.seq->seen_tokens_ != e.seen_tokens || e.seq->in_flight_tokens_ != e.n_tokens)
        [[unlikely]] {
      return FailedPreconditionError(
          ColdStrCat("PostForward: sequence ", e.seq->uid_, " changed since it was inserted"));
    }
    std::span<const int64_t> given = tokens(e);
    if (speculative) [[unlikely]] {
      const int64_t kept = accepted[static_cast<size_t>(&e - entries.data())];
      BLOCKKV_RETURN_IF_ERROR(CheckAccepted(*e.seq, kept));
      given = given.first(static_cast<size_t>(kept));
    }
    if (prefix) BLOCKKV_RETURN_IF_ERROR(CheckRecordableTokens(*e.seq, e.seen_tokens, given));
  }
  for (const RaggedBatch::Impl::Entry& e : entries) {
    // One of this manager's own sequences (Owns above), which it may change. A batch holds each
    // sequence once (InsertSequence and ScheduleBatch refuse a repeat).
    auto& seq = const_cast<Sequence&>(*e.seq);
    if (speculative) [[unlikely]] {
      const int64_t kept = accepted[static_cast<size_t>(&e - entries.data())];
      if (prefix) RecordTokens(seq, tokens(e).first(static_cast<size_t>(kept)));
      AdvanceAccepted(seq, kept);
      continue;
    }
    if (prefix) RecordTokens(seq, tokens(e));
    Advance(seq);
  }
  return Status::Ok();
}

Status StateManager::Impl::FreeLeadingBlocks(SeqId uid, int32_t num_blocks, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroupArg(group));
  if (num_blocks < 0) {
    return InvalidArgumentError(StrCat("cannot free a negative number of blocks: ", num_blocks));
  }
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("FreeLeadingBlocks: sequence ", uid, " is not tracked"));
  }
  BLOCKKV_RETURN_IF_ERROR(RequireResident(*seq, StrCat("FreeLeadingBlocks: sequence ", uid)));
  if (group == state_group_ || cache_->config(group).type == KVCacheType::kState) {
    return InvalidArgumentError(StrCat("FreeLeadingBlocks: cache group ", group,
                                       " is STATE: a sequence holds one slot there, not blocks "
                                       "to release"));
  }
  Sequence::GroupState& state = seq->groups_[group];
  const int64_t full =
      std::min<int64_t>(block_sizes_[group].Index(seq->seen_tokens_), state.allocated);
  if (state.released + int64_t{num_blocks} > full) {
    return OutOfRangeError(StrCat("sequence ", uid, " can release at most ", full - state.released,
                                  " more blocks of group ", group, " (", full,
                                  " blocks lie wholly before seen_tokens=", seq->seen_tokens_, ", ",
                                  state.released, " already released), asked for ", num_blocks));
  }
  if (num_blocks == 0) return Status::Ok();  // nothing released: the table version stays
  BlockId* first = state.row + state.released;
  BLOCKKV_RETURN_IF_ERROR(
      pools_[group].Release(std::span<const BlockId>(first, static_cast<size_t>(num_blocks))));
  std::fill(first, first + num_blocks, kNoBlock);
  state.released += num_blocks;
  seq->table_version_ = ++last_table_version_;
  return Status::Ok();
}

// ---- scheduling -------------------------------------------------------------------------------

Result<KVRequirement> StateManager::Impl::Query(SeqId uid, const KVBudget& budget,
                                                int group) const {
  const int64_t max_new_tokens = budget.max_new_tokens;
  const int32_t max_new_blocks = budget.max_new_blocks;
  BLOCKKV_RETURN_IF_ERROR(CheckGroupArg(group));
  if (max_new_tokens < 0 || max_new_blocks < 0) {
    return InvalidArgumentError(StrCat("Query: max_new_tokens (", max_new_tokens,
                                       ") and max_new_blocks (", max_new_blocks, ") must be >= 0"));
  }
  const Sequence* seq = Find(uid);
  if (seq == nullptr && slots_.free_blocks() == 0) return KVRequirement{};
  const int64_t seen = seq ? seq->seen_tokens_ : 0;
  const int32_t allocated = seq ? seq->groups_[group].allocated : 0;
  const int64_t tokens = std::min(max_new_tokens, TokenCapacity(seen));
  return ComputeKVRequirement(seen, allocated,
                              {.max_new_tokens = tokens, .max_new_blocks = max_new_blocks},
                              kv_block_size(group));
}

// One pass over the uids: a step's sequences are each looked up once, and what the verdict
// counts is left for Schedule. An argument error anywhere wins over the verdict (every uid's
// arguments are checked, also after the verdict is known).
Result<SchedulingResult> StateManager::Impl::Check(const ScheduleRequest& request,
                                                   std::string* why) {
  const std::span<const SeqId> uids = request.uids;
  const std::span<const int64_t> lengths = request.lengths;
  if (uids.size() != lengths.size()) {
    return InvalidArgumentError(ColdStrCat(uids.size(), " uids but ", lengths.size(), " lengths"));
  }
  // Duplicates: tracked uids by an epoch mark on their slot, new uids by sorting.
  NextMarkEpoch();
  std::vector<SeqId>& fresh = uid_scratch_;
  fresh.clear();
  slot_scratch_.resize(uids.size());
  need_scratch_.resize(uids.size() * static_cast<size_t>(num_groups()));
  std::vector<int64_t>& free = free_scratch_;
  free.assign(static_cast<size_t>(num_groups()), 0);
  for (int g = 0; g < num_groups(); ++g) free[g] = pools_[g].free_blocks();
  if (prefix_ != nullptr) {
    hit_index_.assign(uids.size(), -1);
    hits_.clear();
    hit_blocks_.clear();
    hit_starts_.clear();
    promote_entries_.clear();
    remote_values_.clear();
    promoted_ = 0;
  }
  SchedulingResult verdict = SchedulingResult::kSuccess;
  const auto n = static_cast<int64_t>(uids.size());
  if (n > config_.max_ragged_sequence_count) {
    *why = ColdStrCat(
        n, " sequences exceed max_ragged_sequence_count=", config_.max_ragged_sequence_count);
    verdict = SchedulingResult::kBatchSequenceLimitExceeded;
  }
  // Negative lengths before the uids' own errors; their sum for ScheduleBatch. One branch-free
  // pass: fewer than 2^31 lengths below 2^32 add up to less than 2^63; otherwise (a negative
  // length among them) a second, checked pass.
  uint64_t sum = 0;
  uint64_t bits = 0;
  for (const int64_t length : lengths) {
    sum += static_cast<uint64_t>(length);
    bits |= static_cast<uint64_t>(length);
  }
  lengths_sum_ = static_cast<int64_t>(sum);
  if ((bits >> 32) != 0 || lengths.size() >= (size_t{1} << 31)) [[unlikely]] {
    int64_t checked = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      if (lengths[i] < 0) {
        return InvalidArgumentError(
            ColdStrCat("sequence ", uids[i], " has a negative length ", lengths[i]));
      }
      if (checked >= 0 && __builtin_add_overflow(checked, lengths[i], &checked)) checked = -1;
    }
    lengths_sum_ = checked;
  }
  CheckTotals totals{.verdict = verdict, .tracked = n_tracked_sequences()};
  const Status checked = num_groups() == 1 && prefix_ == nullptr
                             ? CheckEach<true>(request, why, totals)
                             : CheckEach<false>(request, why, totals);
  BLOCKKV_RETURN_IF_ERROR(checked);
  verdict = totals.verdict;
  const int64_t tracked = totals.tracked;
  const int64_t tokens = totals.tokens;
  std::sort(fresh.begin(), fresh.end());
  const auto dup = std::adjacent_find(fresh.begin(), fresh.end());
  if (dup != fresh.end()) {
    return InvalidArgumentError(ColdStrCat("sequence ", *dup, " appears twice in one batch"));
  }
  if (verdict != SchedulingResult::kSuccess) return verdict;
  if (tracked > config_.max_tracked_sequences) {
    *why = ColdStrCat(tracked, " tracked sequences would exceed max_tracked_sequences=",
                      config_.max_tracked_sequences);
    return SchedulingResult::kEngineSequenceLimitExceeded;
  }
  if (tokens > config_.max_ragged_batch_size) {
    *why =
        ColdStrCat(tokens, " tokens exceed max_ragged_batch_size=", config_.max_ragged_batch_size);
    return SchedulingResult::kBatchTokenLimitExceeded;
  }
  return SchedulingResult::kSuccess;
}

// Check's pass over the uids. kSimple (one cache group, no prefix caching) is compiled on its
// own: its loop is free of the hits and the group loop.
template <bool kSimple>
Status StateManager::Impl::CheckEach(const ScheduleRequest& request, std::string* why,
                                     CheckTotals& totals) {
  const std::span<const SeqId> uids = request.uids;
  const std::span<const int64_t> lengths = request.lengths;
  // The loop reads everything through locals: its stores through int32 / int64 pointers could
  // alias members, which the compiler would then load again for every uid.
  const size_t groups = kSimple ? 1 : static_cast<size_t>(num_groups());
  const internal::BlockSize* const sizes = block_sizes_.data();
  const internal::UidMap::Reader map = by_uid_->reader();
  const Sequence* const seqs = sequences_.get();
  int32_t* const slots = slot_scratch_.data();
  int32_t* const need = need_scratch_.data();
  int64_t* const left = free_scratch_.data();
  const int* const lead = pool_lead_.data();
  const int64_t token_limit = token_limit_;
  std::vector<SeqId>& fresh = uid_scratch_;
  SchedulingResult verdict = totals.verdict;
  int64_t tracked = totals.tracked;
  int64_t tokens = 0;
  uint32_t* const marks = slot_marks_.data();
  const uint32_t epoch = mark_epoch_;
  const bool prefix = !kSimple && prefix_ != nullptr;
  constexpr size_t kAhead = 8;  // uids whose map entries are asked for before they are looked up
  for (size_t i = 0; i < std::min(kAhead, uids.size()); ++i) map.Prefetch(uids[i]);
  for (size_t i = 0; i < uids.size(); ++i) {
    if (i + kAhead < uids.size()) map.Prefetch(uids[i + kAhead]);
    const SeqId uid = uids[i];
    int64_t length = lengths[i];
    const int32_t slot = map.Find(uid);
    slots[i] = slot;
    const Sequence* seq = nullptr;
    if (slot == internal::UidMap::kAbsent) {
      fresh.push_back(uid);
      ++tracked;
    } else {
      if (marks[slot] == epoch) [[unlikely]] {
        return InvalidArgumentError(ColdStrCat("sequence ", uid, " appears twice in one batch"));
      }
      marks[slot] = epoch;
      seq = &seqs[slot];
      if (seq->preempted_ || seq->exported_ || seq->importing_) [[unlikely]] {
        return FailedPreconditionError(
            seq->preempted_
                ? ColdStrCat("sequence ", uid, " is preempted; ResumeSequence before scheduling it")
            : seq->exported_
                ? ColdStrCat("sequence ", uid,
                             " is exported to another engine; CancelExport before scheduling it")
                : ColdStrCat("sequence ", uid,
                             " is being imported; CompleteImports before scheduling it"));
      }
    }
    // The verdict, once known, stands; the other uids' arguments are still checked.
    if (verdict != SchedulingResult::kSuccess) continue;
    // DeepSpeed's order: context and table capacity, then KV blocks of every group, taken off
    // what is left of each group's free blocks.
    int64_t seen = seq ? seq->seen_tokens_ : 0;
    const PrefixHit* hit = prefix ? LookupPrefix(i, seq, length) : nullptr;
    if (hit != nullptr) {
      seen = hit->tokens;
      length = hit->in_flight;
    }
    if (length > TokenCapacity(token_limit, seen)) [[unlikely]] {
      *why = ColdStrCat("sequence ", uid, " at ", seen, " tokens cannot take ", length,
                        " more: max_context=", config_.max_context, " and its block tables hold ",
                        seen + TokenCapacity(seen), " tokens");
      verdict = SchedulingResult::kSequenceTokenLimitExceeded;
      continue;
    }
    for (size_t g = 0; g < groups; ++g) {
      int64_t allocated = 0;
      if (hit != nullptr) {
        allocated = sizes[g].Index(hit->tokens);
      } else if (seq != nullptr) {
        allocated = kSimple ? seq->one_group_.allocated : seq->groups_[g].allocated;
      }
      const int64_t needed = std::max<int64_t>(0, sizes[g].BlocksFor(seen + length) - allocated);
      need[i * groups + g] = static_cast<int32_t>(needed);
      // Groups sharing a memory pool count against one total, at the pool's first group.
      const size_t p = kSimple ? 0 : static_cast<size_t>(lead[g]);
      if (needed > left[p]) [[unlikely]] {
        if (verdict == SchedulingResult::kSuccess) {  // the first group short of blocks
          *why =
              ColdStrCat("sequence ", uid, " needs ", needed, " blocks of cache group ", g, ", ",
                         left[p], " left for it (", pools_[g].free_blocks(), " free",
                         SharesPool(static_cast<int>(g)) ? " in the pool its groups share)" : ")");
          verdict = SchedulingResult::kKVCacheLimitExceeded;
        }
        continue;
      }
      left[p] -= needed;
    }
    tokens += length;
  }
  totals = {.verdict = verdict, .tracked = tracked, .tokens = tokens};
  return Status::Ok();
}

Result<SchedulingResult> StateManager::Impl::CanSchedule(const ScheduleRequest& request) {
  std::string why;
  return Check(request, &why);
}

Status StateManager::Impl::Schedule(const ScheduleRequest& request, SchedulingResult* result) {
  return ScheduleInto(request, result, nullptr);
}

Status StateManager::Impl::ScheduleBatch(const ScheduleRequest& request,
                                         std::span<const TokenId> tokens, RaggedBatch& batch,
                                         bool padding, SchedulingResult* result) {
  if (&batch.manager() != owner_) {
    return InvalidArgumentError("ScheduleBatch: the batch was created for another state manager");
  }
  const BatchOut out{.tokens = tokens, .batch = &batch, .padding = padding};
  return ScheduleInto(request, result, &out);
}

Status StateManager::Impl::ScheduleInto(const ScheduleRequest& request, SchedulingResult* result,
                                        const BatchOut* out) {
  const std::span<const SeqId> uids = request.uids;
  const std::span<const int64_t> lengths = request.lengths;
  BLOCKKV_RETURN_IF_ERROR(SettleRestores(uids));
  MaybeCompleteExports();
  std::string why;
  BLOCKKV_ASSIGN_OR_RETURN(const SchedulingResult verdict, Check(request, &why));
  if (out != nullptr && std::ssize(out->tokens) != lengths_sum_) {  // no length is negative
    return InvalidArgumentError(ColdStrCat(
        "ScheduleBatch: ", out->tokens.size(), " tokens given, but the lengths add up to ",
        lengths_sum_ < 0 ? std::string("more than 2^63 - 1") : std::to_string(lengths_sum_)));
  }
  if (result != nullptr) *result = verdict;
  if (verdict != SchedulingResult::kSuccess) {
    return ResourceExhaustedError(
        StrCat("cannot schedule the batch: ", SchedulingResultName(verdict), ": ", why));
  }
  // A batch's descriptors hold positions as int32; only a max_context past that can exceed them.
  // A prefix hit runs from the end of its cached prefix.
  if (out != nullptr && token_limit_ > std::numeric_limits<int32_t>::max()) {
    for (size_t i = 0; i < uids.size(); ++i) {
      const PrefixHit* hit = HitOf(i);
      const int64_t end = hit != nullptr
                              ? hit->tokens + hit->in_flight
                              : (Scheduled(i) ? Scheduled(i)->seen_tokens_ : 0) + lengths[i];
      if (end > std::numeric_limits<int32_t>::max()) {
        return OutOfRangeError(StrCat("ScheduleBatch: sequence ", uids[i], " would reach ", end,
                                      " tokens, past the batch's int32 positions"));
      }
    }
  }
  // Prefix hits first: taking new blocks may evict evictable ones, never those being hit.
  if (prefix_ != nullptr) ShareHitBlocks(/*share=*/true);
  // What this batch promotes from the host level must survive the demotions its own evictions
  // cause.
  if (host_prefix_ != nullptr && promoted_ > 0) host_prefix_->Pin(promote_entries_, true);
  // Take every group's blocks at once; Check counted them and guaranteed they are there.
  const auto groups = static_cast<size_t>(num_groups());
  for (size_t g = 0; g < groups; ++g) {
    int64_t total = 0;
    if (prefix_ == nullptr && !cache_->shared_pool()) {
      // What Check took off the free blocks is what it counted.
      total = pools_[g].free_blocks() - free_scratch_[g];
    } else {  // Check also took off the evictable blocks hits revive; promotions go last
      total = g == 0 ? promoted_ : 0;
      for (size_t i = 0; i < uids.size(); ++i) total += need_scratch_[i * groups + g];
    }
    scratch_[g].resize(static_cast<size_t>(total));
    const Status taken = pools_[g].Take(static_cast<int32_t>(total), scratch_[g]);
    BLOCKKV_CHECK(taken.ok(), "Schedule: blocks that Check counted were not there");
  }
  if (prefix_ != nullptr && promoted_ > 0) {
    const std::span<const BlockId> fresh(scratch_[0]);
    if (Status s = PromoteHits(fresh.last(static_cast<size_t>(promoted_))); !s.ok()) {
      if (host_prefix_ != nullptr) host_prefix_->Pin(promote_entries_, false);
      UndoSchedule();  // a device error copying from the host: nothing scheduled
      return s;
    }
  }
  if (checkpoint_group_ >= 0) {
    if (Status s = ResumeFromCheckpoints(uids.size()); !s.ok()) {
      UndoSchedule();  // a device error copying a checkpoint: nothing scheduled
      return s;
    }
  }
  // Nothing can fail from here on but the copy to the batch's device mirror.
  next_scratch_.resize(groups);
  for (size_t g = 0; g < groups; ++g) next_scratch_[g] = scratch_[g].data();
  const bool simple = groups == 1 && prefix_ == nullptr;
  if (out == nullptr) {
    simple ? Commit<false, true>(request, nullptr) : Commit<false, false>(request, nullptr);
    return Status::Ok();
  }
  RaggedBatch::Impl& batch = *out->batch->impl_;
  batch.Clear();
  simple ? Commit<true, true>(request, out) : Commit<true, false>(request, out);
  Status finished = batch.Finish(out->padding);
  if (!finished.ok()) batch.MarkEntries();  // open to InsertSequence: its duplicate check
  return finished;
}

// One pass commits each sequence and, for ScheduleBatch (kBatch), writes its batch entry. Locals
// again, as in Check; next_scratch_ holds each group's next block to hand out. kSimple (one cache
// group, no prefix caching: almost every decode step) is compiled on its own, its loop free of
// the hits and the group loop, which would otherwise keep more values live than there are
// registers.
template <bool kBatch, bool kSimple>
void StateManager::Impl::Commit(const ScheduleRequest& request, const BatchOut* out) {
  const std::span<const SeqId> uids = request.uids;
  const std::span<const int64_t> lengths = request.lengths;
  const size_t groups = kSimple ? 1 : static_cast<size_t>(num_groups());
  const BlockId** const cursor = next_scratch_.data();
  const BlockId* next = cursor[0];  // kSimple: the one group's cursor
  int32_t* const slots = slot_scratch_.data();
  const int32_t* const need = need_scratch_.data();
  Sequence* const seqs = sequences_.get();
  std::optional<RaggedBatch::Impl::Writer> writer;
  const TokenId* tokens = nullptr;  // the i-th uid's tokens
  if constexpr (kBatch) {
    writer.emplace(*out->batch->impl_);
    tokens = out->tokens.data();
  }
  for (size_t i = 0; i < uids.size(); ++i) {
    if (slots[i] == internal::UidMap::kAbsent) [[unlikely]] {
      slots[i] = CreateInSlot(uids[i])->slot_;
    }
    Sequence& seq = seqs[slots[i]];
    const int64_t length = lengths[i];
    const PrefixHit* const hit = kSimple ? nullptr : HitOf(i);
    if (hit != nullptr) [[unlikely]] {
      TakePrefix(i, seq);
      seq.in_flight_tokens_ = hit->in_flight;
    } else {
      seq.in_flight_tokens_ = length;
    }
    if (kSimple) {
      seq.one_group_.Take(next, need[i]);
    } else {
      for (size_t g = 0; g < groups; ++g) seq.groups_[g].Take(cursor[g], need[i * groups + g]);
    }
    if constexpr (kBatch) {
      std::span<const TokenId> mine(tokens, static_cast<size_t>(length));
      tokens += length;
      if (hit != nullptr) [[unlikely]] {
        // A prefix hit runs the prompt's positions [cached, cached + in flight), whichever of its
        // chunks the engine passed (it passes them from position 0): their tokens are the
        // prompt's, which the manager knows.
        mine = std::span<const TokenId>(keys_[slots[i]].tokens)
                   .subspan(static_cast<size_t>(seq.seen_tokens_),
                            static_cast<size_t>(seq.in_flight_tokens_));
      }
      if constexpr (kSimple) {
        writer->AppendFilledOneGroup(seq, mine, seq.one_group_.row, seq.one_group_.allocated);
      } else {
        writer->AppendFilled(seq, mine);
      }
    }
  }
  if constexpr (kBatch) writer->Done();
}

// ---- fork -------------------------------------------------------------------------------------

StateManager::Impl::BlockCopies StateManager::Impl::CopyOneBlockPerGroup(
    std::span<const BlockId> sources, std::vector<BlockId>& copies) {
  copies.assign(static_cast<size_t>(num_groups()), kNoBlock);
  // Per memory pool (at its lead group): the copies its groups need so far.
  std::vector<int32_t> wanted(static_cast<size_t>(num_groups()), 0);
  for (int g = 0; g < num_groups(); ++g) {
    if (sources[g] == kNoBlock) continue;
    if (++wanted[static_cast<size_t>(pool_lead_[g])] > pools_[g].free_blocks()) {
      return {.status = ResourceExhaustedError(""), .group = g, .no_free_block = true};
    }
  }
  for (int g = 0; g < num_groups(); ++g) {
    if (sources[g] == kNoBlock) continue;
    Status s = pools_[g].Take(1, std::span(&copies[g], 1));
    if (s.ok()) s = cache_->CopyBlocks(sources.subspan(g, 1), std::span(&copies[g], 1), g);
    if (!s.ok()) {
      for (int h = 0; h <= g; ++h) {
        if (copies[h] != kNoBlock) pools_[h].Release(std::span(&copies[h], 1)).IgnoreError();
        copies[h] = kNoBlock;
      }
      return {.status = std::move(s), .group = g};
    }
  }
  return {};
}

Status StateManager::Impl::Fork(SeqId parent, SeqId child) {
  Sequence* const parent_seq = Find(parent);
  if (parent_seq == nullptr) {
    return NotFoundError(StrCat("Fork: parent ", parent, " is not tracked"));
  }
  BLOCKKV_RETURN_IF_ERROR(RequireResident(*parent_seq, StrCat("Fork: parent ", parent)));
  const Sequence* from = parent_seq;
  if (Find(child) != nullptr) {
    return AlreadyExistsError(StrCat("Fork: sequence ", child, " is already tracked"));
  }
  if (from->in_flight_tokens_ != 0) {
    return FailedPreconditionError(StrCat("Fork: parent ", parent, " has ", from->in_flight_tokens_,
                                          " tokens in flight; fork after PostForward"));
  }
  if (slots_.free_blocks() == 0) {
    return ResourceExhaustedError(StrCat("Fork: no tracking slot for sequence ", child, ": all ",
                                         config_.max_tracked_sequences, " are in use"));
  }
  // One private block per group whose last block is partial, taken before anything changes.
  const int64_t seen = from->seen_tokens_;
  std::vector<BlockId> sources(static_cast<size_t>(num_groups()), kNoBlock);
  // A STATE group's one slot is always copied: each sequence's state is its own.
  const auto state = [this](int g) { return cache_->config(g).type == KVCacheType::kState; };
  for (int g = 0; g < num_groups(); ++g) {
    if (state(g) ? from->groups_[g].allocated > 0 : block_sizes_[g].Offset(seen) != 0) {
      sources[g] = from->groups_[g].row[state(g) ? 0 : block_sizes_[g].Index(seen)];
    }
  }
  std::vector<BlockId>& tails = tail_scratch_;
  if (BlockCopies c = CopyOneBlockPerGroup(sources, tails); !c.status.ok()) {
    if (c.no_free_block) {
      return ResourceExhaustedError(StrCat("Fork: no block of cache group ", c.group,
                                           state(c.group)
                                               ? " for the copy of the state slot"
                                               : " for the copy of the partial last block"));
    }
    return {c.status.code(), StrCat("Fork: copying the partial last block of group ", c.group, ": ",
                                    c.status.message())};
  }
  Sequence* to = CreateInSlot(child);  // `from` stays valid: sequences live in fixed slots
  to->seen_tokens_ = seen;
  for (int g = 0; g < num_groups(); ++g) {
    const Sequence::GroupState& src = from->groups_[g];
    Sequence::GroupState& dst = to->groups_[g];
    const auto full = state(g) ? 0 : static_cast<int32_t>(block_sizes_[g].Index(seen));
    const std::span<const BlockId> shared(src.row + src.released,
                                          static_cast<size_t>(full - src.released));
    const Status added = pools_[g].AddRef(shared);
    BLOCKKV_CHECK(added.ok(), "Fork: the parent held a block without a reference");
    std::copy_n(src.row, full, dst.row);
    dst.released = src.released;
    dst.allocated = full;
    if (tails[g] != kNoBlock) dst.row[dst.allocated++] = tails[g];
  }
  ForkKeys(*from, *to);
  return Status::Ok();
}

}  // namespace blockkv
