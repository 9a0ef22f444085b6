// SPDX-License-Identifier: Apache-2.0
// StateManager's remote prefix tier (docs/remote_tier.md): opening it, fetching a lookup's
// following blocks from Redis into fresh blocks, and writing newly published blocks through. The
// client is remote_tier.cc.
#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/log.h"
#include "blockkv/state_manager.h"
#include "internal/checked_math.h"
#include "internal/host_memory.h"
#include "internal/strings.h"
#include "remote_tier.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace blockkv {

using internal::StrCat;

namespace {

// Bumped whenever the bytes a block holds for the same config could differ (a kernel's layout).
constexpr uint32_t kRemoteLayoutVersion = 1;

template <typename T>
void Append(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

std::string_view ExtraBytes(const BlockKeyExtras& extras, size_t index) {
  return index < extras.block_bytes.size() ? std::string_view(extras.block_bytes[index])
                                           : std::string_view();
}

int64_t LayerBlockBytes(const KVCacheConfig& c) {
  return c.elements_per_layer_block() * static_cast<int64_t>(ElementSize(c.cache_dtype));
}

}  // namespace

Status StateManager::Impl::EnableRemoteTier() {
  const RemoteTierConfig& rc = *config_.remote_tier;
  if (prefix_ == nullptr) {
    return InvalidArgumentError(
        "StateManagerConfig.remote_tier needs prefix caching on (prefix_cache.enabled)");
  }
  if (num_groups() != 1 || SlidingWindow(0) != 0) {
    return UnimplementedError(StrCat("StateManagerConfig.remote_tier: ", num_groups(),
                                     " cache groups; the remote tier supports one cache group "
                                     "without a sliding window"));
  }
  // Each queued store holds its block's bytes until it is sent: a stalled server fills the queue.
  const KVCacheConfig& c = cache_->config(0);
  const int64_t value_bytes = c.num_caches() * LayerBlockBytes(c);
  const std::optional<int64_t> queue_bytes = internal::CheckedMul(rc.max_pending, value_bytes);
  if (const int64_t available = internal::ReadHostMemory().available;
      !queue_bytes || *queue_bytes > available) {
    return ResourceExhaustedError(
        StrCat("StateManagerConfig.remote_tier: max_pending=", rc.max_pending, " stores of ",
               internal::HumanBytes(static_cast<long double>(value_bytes)),
               " each may wait for a slow server: ",
               queue_bytes ? internal::HumanBytes(static_cast<long double>(*queue_bytes))
                           : std::string("more than 2^63 bytes"),
               ", more than the ", internal::HumanBytes(static_cast<long double>(available)),
               " of host memory available; lower max_pending"));
  }
  Result<std::unique_ptr<internal::RemoteTier>> tier = internal::RemoteTier::Open(rc);
  if (!tier.ok()) {
    return {tier.status().code(),
            StrCat("StateManagerConfig.remote_tier: ", tier.status().message())};
  }
  remote_ = std::move(*tier);
  if (!remote_->unreachable().empty()) {
    Log(LogLevel::kWarning,
        StrCat("remote tier not connected (retried in the background; until then every lookup "
               "misses and every store is dropped): ",
               remote_->unreachable()));
  }
  // Everything that makes two engines' bytes for one key comparable.
  std::string fp = "blockkv-remote";
  Append<uint32_t>(fp, kRemoteLayoutVersion);
  Append<uint64_t>(fp, config_.prefix_cache.hash_seed);
  Append<int32_t>(fp, c.block_size);
  Append<int32_t>(fp, static_cast<int32_t>(c.type));
  Append<int32_t>(fp, static_cast<int32_t>(c.cache_dtype));
  for (const int64_t d : c.cache_shape) Append<int64_t>(fp, d);
  Append<int64_t>(fp, c.latent_dim);
  Append<int64_t>(fp, c.rope_dim);
  Append<int64_t>(fp, LayerBlockBytes(c));
  Append<int32_t>(fp, rc.tp_rank);
  Append<int32_t>(fp, rc.tp_size);
  Append<uint64_t>(fp, rc.model_id.size());
  fp += rc.model_id;
  remote_fingerprint_ = XXH3_64bits(fp.data(), fp.size());
  return Status::Ok();
}

RemoteTierStats StateManager::Impl::remote_tier_stats() const {
  return remote_ != nullptr ? remote_->stats() : RemoteTierStats{};
}

void StateManager::Impl::FlushRemoteTier() {
  if (remote_ != nullptr) remote_->Drain();
}

void StateManager::Impl::RemoteKeys(const SequenceKeys& keys, size_t n) {
  remote_keys_.resize(n);
  prefix_->ChainKeys(keys.tokens, kv_block_size(0), keys.extras, remote_keys_);
}

void StateManager::Impl::DropPrefetch(SequenceKeys& keys) {
  keys.agreed = -1;
  if (keys.prefetch == nullptr) return;
  if (remote_ != nullptr && !keys.prefetch->Done()) remote_->Cancel(keys.prefetch);
  keys.prefetch = nullptr;
}

Result<std::pair<std::shared_ptr<internal::RemoteFetchJob>, int32_t>>
StateManager::Impl::FetchRemotePrefix(SeqId uid) {
  if (!config_.remote_tier) {
    return FailedPreconditionError(
        "FetchRemotePrefix: no remote tier (StateManagerConfig.remote_tier is unset)");
  }
  const Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("FetchRemotePrefix: sequence ", uid, " is not tracked"));
  }
  SequenceKeys& keys = keys_[seq->slot_];
  if (!keys.registered) {
    return FailedPreconditionError(StrCat("FetchRemotePrefix: sequence ", uid,
                                          " was not added with AddSequence: its prompt is "
                                          "unknown"));
  }
  if (keys.looked_up || seq->seen_tokens_ != 0 || seq->groups_[0].allocated != 0) {
    return FailedPreconditionError(
        StrCat("FetchRemotePrefix: sequence ", uid,
               " was scheduled already; its prefix is looked up at its first Schedule"));
  }
  std::pair<std::shared_ptr<internal::RemoteFetchJob>, int32_t> none{nullptr, 0};
  if (remote_ == nullptr) return none;  // no tier configured
  DropPrefetch(keys);
  // What the device holds now is not fetched; the last known token is always computed. At most
  // the blocks free now: a fetch lands in host memory until Schedule copies it to fresh blocks.
  const auto bs = static_cast<int64_t>(kv_block_size(0));
  const auto known = static_cast<int64_t>(keys.tokens.size());
  const auto limit = static_cast<int32_t>(known > 0 ? (known - 1) / bs : 0);
  const int32_t run = DeviceRun(keys);
  const auto count = static_cast<int32_t>(
      std::min<int64_t>(limit - run, std::max<int64_t>(0, pools_[0].free_blocks())));
  if (count <= 0) return none;
  RemoteKeys(keys, static_cast<size_t>(run) + static_cast<size_t>(count));
  std::vector<std::string> names;
  names.reserve(static_cast<size_t>(count));
  for (auto i = static_cast<size_t>(run); i < remote_keys_.size(); ++i) {
    names.push_back(internal::RemoteKey(remote_fingerprint_, keys.extras.ns, remote_keys_[i]));
  }
  keys.prefetch = remote_->FetchAsync(std::move(names));
  keys.prefetch_first = run;
  return std::pair{keys.prefetch, count};
}

int32_t StateManager::Impl::DeviceRun(const SequenceKeys& keys) {
  const auto bs = static_cast<int64_t>(kv_block_size(0));
  const auto known = static_cast<int64_t>(keys.tokens.size());
  const auto limit = static_cast<int32_t>(known > 0 ? (known - 1) / bs : 0);
  std::vector<BlockId>& scratch = match_blocks_[0];
  scratch.assign(static_cast<size_t>(limit), kNoBlock);
  BlockHash last;
  return prefix_->Match(0, keys.tokens, keys.ns_id, keys.extras, limit, scratch, &last);
}

StateManager::Impl::Verified StateManager::Impl::MatchRemote(const SequenceKeys& keys, int32_t run,
                                                             int32_t max) {
  if (max <= 0) return {};
  // Tensor-parallel ranks take only what they agreed on (AgreeRemotePrefix capped `max`).
  if (config_.remote_tier->tp_size > 1 && (keys.prefetch == nullptr || keys.agreed < 0)) return {};
  using Miss = internal::RemoteTier::Miss;
  RemoteKeys(keys, static_cast<size_t>(run) + static_cast<size_t>(max));
  if (keys.prefetch != nullptr) {  // fetched ahead: what has arrived, never a wait
    internal::RemoteFetchJob& job = *keys.prefetch;
    if (!job.Done()) return {.miss = Miss::kLate};
    // Blocks before it were evicted since: the chain breaks.
    if (run < keys.prefetch_first) return {.miss = Miss::kNotFound};
    const auto skip = static_cast<size_t>(run - keys.prefetch_first);
    const auto have = static_cast<int64_t>(job.keys.size()) - static_cast<int64_t>(skip);
    if (have <= 0) return {};
    return VerifyRemote(keys,
                        {.first = run, .count = static_cast<int32_t>(std::min<int64_t>(max, have))},
                        job.fetched, skip, &remote_values_);
  }
  std::vector<std::string> names;
  names.reserve(static_cast<size_t>(max));
  for (auto i = static_cast<size_t>(run); i < remote_keys_.size(); ++i) {
    names.push_back(internal::RemoteKey(remote_fingerprint_, keys.extras.ns, remote_keys_[i]));
  }
  const internal::RemoteTier::Fetched fetched = remote_->Fetch(std::move(names));
  return VerifyRemote(keys, {.first = run, .count = max}, fetched, 0, &remote_values_);
}

StateManager::Impl::Verified StateManager::Impl::VerifyRemote(
    const SequenceKeys& keys, BlockRange blocks, const internal::RemoteTier::Fetched& fetched,
    size_t offset, std::vector<RemoteValue>* out) {
  using Miss = internal::RemoteTier::Miss;
  const auto bs = static_cast<size_t>(kv_block_size(0));
  const KVCacheConfig& c = cache_->config(0);
  Verified got;
  for (; got.blocks < blocks.count; ++got.blocks) {
    const size_t at = offset + static_cast<size_t>(got.blocks);
    const std::string_view value = fetched.values[at];
    if (value.empty()) {
      got.miss = fetched.late              ? Miss::kLate
                 : fetched.failed[at] != 0 ? Miss::kError
                                           : Miss::kNotFound;
      break;
    }
    const auto i = static_cast<size_t>(blocks.first) + static_cast<size_t>(got.blocks);
    const internal::RemoteBlockMeta want{
        .fingerprint = remote_fingerprint_,
        .key = remote_keys_[i],
        .parent_key = i == 0 ? BlockHash{} : remote_keys_[i - 1],
        .index = static_cast<uint32_t>(i),
        .adapter_id = keys.extras.adapter_id,
        .ns = keys.extras.ns,
        .extra = ExtraBytes(keys.extras, i),
        .tokens = std::span(keys.tokens).subspan(i * bs, bs),
        .payload_bytes = static_cast<uint64_t>(c.num_caches() * LayerBlockBytes(c))};
    const int64_t payload = internal::VerifyRemoteValue(
        value, want, at < fetched.checksum_ok.size() && fetched.checksum_ok[at] != 0);
    if (payload < 0) {
      got.miss = Miss::kVerifyFailed;
      break;
    }
    if (out != nullptr) {
      out->push_back(
          {.reply = fetched.reply, .value = value, .payload = static_cast<size_t>(payload)});
    }
  }
  return got;
}

// ---- tensor-parallel agreement ----------------------------------------------------------------
// A vote's values: {ok, h, -h, end_0, ..., end_n-1}. ok is 0 on a rank that refused the call;
// h a hash of the uids, so that min(h) == -min(-h) exactly when every rank passed the same ones;
// end_i the leading blocks of uid i this rank holds (device, then verified fetched values).

namespace {

constexpr size_t kVoteHeader = 3;

int64_t UidsHash(std::span<const SeqId> uids) {
  // Non-negative, so that its negation is too.
  return static_cast<int64_t>(XXH3_64bits(uids.data(), uids.size_bytes()) >> 2);
}

}  // namespace

Status StateManager::Impl::CheckAgreeable(std::span<const SeqId> uids, std::string_view who) const {
  if (!config_.remote_tier) {
    return FailedPreconditionError(
        StrCat(who, ": no remote tier (StateManagerConfig.remote_tier is unset)"));
  }
  for (size_t i = 0; i < uids.size(); ++i) {
    const Sequence* seq = Find(uids[i]);
    if (seq == nullptr) {
      return NotFoundError(StrCat(who, ": sequence ", uids[i], " is not tracked"));
    }
    const SequenceKeys& keys = keys_[seq->slot_];
    if (!keys.registered) {
      return FailedPreconditionError(StrCat(who, ": sequence ", uids[i],
                                            " was not added with AddSequence: its prompt is "
                                            "unknown"));
    }
    if (keys.looked_up || seq->seen_tokens_ != 0 || seq->groups_[0].allocated != 0) {
      return FailedPreconditionError(StrCat(who, ": sequence ", uids[i], " was scheduled already"));
    }
    if (std::find(uids.begin(), uids.begin() + static_cast<std::ptrdiff_t>(i), uids[i]) !=
        uids.begin() + static_cast<std::ptrdiff_t>(i)) {
      return InvalidArgumentError(StrCat(who, ": sequence ", uids[i], " is given twice"));
    }
  }
  return Status::Ok();
}

RemotePrefixVote StateManager::Impl::RemotePrefixOffer(std::span<const SeqId> uids) {
  RemotePrefixVote vote{.uids = {uids.begin(), uids.end()},
                        .values = std::vector<int64_t>(kVoteHeader + uids.size(), 0)};
  const int64_t h = UidsHash(uids);
  vote.values[1] = h;
  vote.values[2] = -h;
  if (!CheckAgreeable(uids, "RemotePrefixOffer").ok()) return vote;  // ok = 0
  vote.values[0] = 1;
  for (size_t i = 0; i < uids.size(); ++i) {
    SequenceKeys& keys = keys_[Find(uids[i])->slot_];
    const int32_t run = DeviceRun(keys);
    int64_t end = run;
    if (remote_ != nullptr && keys.prefetch != nullptr && keys.prefetch_first <= run) {
      internal::RemoteFetchJob& job = *keys.prefetch;
      while (!job.WaitFor(std::chrono::seconds(1))) {
      }
      const auto skip = static_cast<size_t>(run - keys.prefetch_first);
      const auto have = static_cast<int64_t>(job.keys.size()) - static_cast<int64_t>(skip);
      if (have > 0) {
        RemoteKeys(keys, static_cast<size_t>(run + have));
        end += VerifyRemote(keys, {.first = run, .count = static_cast<int32_t>(have)}, job.fetched,
                            skip, nullptr)
                   .blocks;
      }
    }
    vote.values[kVoteHeader + i] = end;
    keys.offered = static_cast<int32_t>(end);
  }
  return vote;
}

Result<std::vector<int32_t>> StateManager::Impl::AgreeRemotePrefix(
    const RemotePrefixVote& reduced) {
  const std::span<const SeqId> uids = reduced.uids;
  const std::span<const int64_t> v = reduced.values;
  if (v.size() != kVoteHeader + uids.size()) {
    return InvalidArgumentError(StrCat("AgreeRemotePrefix: ", v.size(), " values for ", uids.size(),
                                       " uids; RemotePrefixOffer gives ",
                                       kVoteHeader + uids.size()));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckAgreeable(uids, "AgreeRemotePrefix"));
  if (v[0] != 1) {
    return FailedPreconditionError(
        "AgreeRemotePrefix: another tensor-parallel rank refused the agreement (its own error "
        "names why); nothing was agreed");
  }
  if (v[1] != -v[2] || v[1] != UidsHash(uids)) {
    return FailedPreconditionError(
        StrCat("AgreeRemotePrefix: the tensor-parallel ranks passed different sequences (",
               uids.size(), " uids here); every rank must pass the same uids in the same order"));
  }
  std::vector<int32_t> agreed(uids.size());
  for (size_t i = 0; i < uids.size(); ++i) {
    agreed[i] = static_cast<int32_t>(
        std::clamp<int64_t>(v[kVoteHeader + i], 0, std::numeric_limits<int32_t>::max()));
  }
  for (size_t i = 0; i < uids.size(); ++i) {
    SequenceKeys& keys = keys_[Find(uids[i])->slot_];
    keys.agreed = agreed[i];
    // Another rank lacked a block this one holds: a miss of this rank's lookup.
    if (remote_ != nullptr && agreed[i] < keys.offered) {
      remote_->CountLookup(0, internal::RemoteTier::Miss::kOtherRank);
    }
  }
  return agreed;
}

Status StateManager::Impl::PlaceRemote(const SequenceKeys& keys, size_t first,
                                       std::span<const BlockId> blocks, int32_t run,
                                       const PrefixCache::Published* parent, int32_t priority) {
  const KVCacheConfig& c = cache_->config(0);
  const auto layer_block = static_cast<size_t>(LayerBlockBytes(c));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, cache_->GetGroupStorage(0));
  auto* base = static_cast<std::byte*>(storage.data);
  const auto num_blocks = static_cast<size_t>(cache_->num_blocks());
  Device& device = *cache_->device();
  for (size_t b = 0; b < blocks.size(); ++b) {
    const RemoteValue& v = remote_values_[first + b];
    for (size_t layer = 0; layer < static_cast<size_t>(c.num_caches()); ++layer) {
      std::byte* dst = base + (layer * num_blocks + static_cast<size_t>(blocks[b])) * layer_block;
      const Status copied = device.CopyFromHost(
          dst, v.value.data() + v.payload + layer * layer_block, static_cast<int64_t>(layer_block));
      if (!copied.ok()) {
        return {copied.code(),
                StrCat("copying a remote tier block to the device: ", copied.message())};
      }
    }
  }
  const auto bs = static_cast<size_t>(kv_block_size(0));
  PrefixCache::Published last = parent != nullptr ? *parent : PrefixCache::Published{};
  for (size_t b = 0; b < blocks.size(); ++b) {
    const size_t index = static_cast<size_t>(run) + b;
    const std::span<const TokenId> tokens = std::span(keys.tokens).subspan(index * bs, bs);
    const BlockHash key =
        prefix_->Hash(index == 0 ? nullptr : &last.key, tokens, keys.extras, index);
    last = prefix_->Publish(0, blocks[b], index == 0 ? nullptr : &last, key, tokens, keys.ns_id,
                            keys.extras, index, priority);
  }
  remote_->CountLookup(std::ssize(blocks), internal::RemoteTier::Miss::kNone);
  return Status::Ok();
}

void StateManager::Impl::StoreRemote(const SequenceKeys& keys, int32_t index, const BlockHash& key,
                                     const BlockHash* parent_key, BlockId block) {
  const KVCacheConfig& c = cache_->config(0);
  const auto layer_block = static_cast<size_t>(LayerBlockBytes(c));
  const auto i = static_cast<size_t>(index);
  const auto bs = static_cast<size_t>(kv_block_size(0));
  const internal::RemoteBlockMeta meta{
      .fingerprint = remote_fingerprint_,
      .key = key,
      .parent_key = parent_key != nullptr ? *parent_key : BlockHash{},
      .index = static_cast<uint32_t>(index),
      .adapter_id = keys.extras.adapter_id,
      .ns = keys.extras.ns,
      .extra = ExtraBytes(keys.extras, i),
      .tokens = std::span(keys.tokens).subspan(i * bs, bs),
      .payload_bytes = static_cast<uint64_t>(c.num_caches()) * layer_block};
  const std::string header = internal::EncodeRemoteHeader(meta);
  const Result<TensorView> storage = cache_->GetGroupStorage(0);
  if (!storage.ok()) return;
  internal::RemoteTier::PendingStore store =
      remote_->NewStore(internal::RemoteKey(remote_fingerprint_, keys.extras.ns, key),
                        header.size() + meta.payload_bytes);
  char* const out = store.value.data.get();
  std::copy(header.begin(), header.end(), out);
  const auto* base = static_cast<const std::byte*>(storage->data);
  const auto num_blocks = static_cast<size_t>(cache_->num_blocks());
  Device& device = *cache_->device();
  for (size_t layer = 0; layer < static_cast<size_t>(c.num_caches()); ++layer) {
    const std::byte* src = base + (layer * num_blocks + static_cast<size_t>(block)) * layer_block;
    if (!device
             .CopyToHost(out + header.size() + layer * layer_block, src,
                         static_cast<int64_t>(layer_block))
             .ok()) {
      return;  // a block not written through is only a later miss
    }
  }
  remote_stores_.push_back(std::move(store));
}

void StateManager::Impl::SendRemoteStores() {
  if (!remote_stores_.empty()) remote_->Store(remote_stores_);
}

RemoteTierStats StateManager::remote_tier_stats() const { return impl_->remote_tier_stats(); }

Result<RemoteFetchTicket> StateManager::FetchRemotePrefix(SeqId uid) {
  BLOCKKV_ASSIGN_OR_RETURN(auto job, impl_->FetchRemotePrefix(uid));
  return RemoteFetchTicket(std::move(job.first), job.second);
}

RemotePrefixVote StateManager::RemotePrefixOffer(std::span<const SeqId> uids) {
  return impl_->RemotePrefixOffer(uids);
}

Result<std::vector<int32_t>> StateManager::AgreeRemotePrefix(const RemotePrefixVote& reduced) {
  return impl_->AgreeRemotePrefix(reduced);
}

Result<std::vector<int32_t>> StateManager::AgreeRemotePrefix(std::span<const SeqId> uids,
                                                             Communicator& comm) {
  RemotePrefixVote vote = impl_->RemotePrefixOffer(uids);
  const std::optional<RemoteTierConfig>& rc = impl_->config().remote_tier;
  Status mismatch;
  if (rc && (comm.world_size() != rc->tp_size || comm.rank() != rc->tp_rank)) {
    mismatch = InvalidArgumentError(StrCat(
        "AgreeRemotePrefix: the communicator is rank ", comm.rank(), " of ", comm.world_size(),
        ", the remote tier's config rank ", rc->tp_rank, " of tp_size ", rc->tp_size));
    vote.values[0] = 0;
  }
  BLOCKKV_RETURN_IF_ERROR(comm.AllReduceMinEach(vote.values));
  BLOCKKV_RETURN_IF_ERROR(mismatch);
  return impl_->AgreeRemotePrefix(vote);
}

bool RemoteFetchTicket::Poll() const { return job_ == nullptr || job_->Done(); }

void RemoteFetchTicket::Wait() const {
  while (job_ != nullptr && !job_->WaitFor(std::chrono::seconds(1))) {
  }
}
void StateManager::FlushRemoteTier() { impl_->FlushRemoteTier(); }

}  // namespace blockkv
