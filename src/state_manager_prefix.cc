// SPDX-License-Identifier: Apache-2.0
// The StateManager's prefix caching: registering prompts, looking up a first Schedule's cached
// prefix, publishing blocks as they fill. The rest of the manager is in state_manager.cc.
#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <variant>

#include "blockkv/state_manager.h"
#include "internal/block_size.h"
#include "internal/check.h"
#include "internal/strings.h"
#include "prefix_host_tier.h"
#include "remote_tier.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"

namespace blockkv {

using internal::ColdStrCat;
using internal::StrCat;

namespace {

Status CheckTokenIds(SeqId uid, std::span<const TokenId> tokens) {
  const auto bad = std::find_if(tokens.begin(), tokens.end(), [](TokenId t) { return t < 0; });
  if (bad == tokens.end()) return Status::Ok();
  return InvalidArgumentError(StrCat("sequence ", uid, ": token ", bad - tokens.begin(), " is ",
                                     *bad, "; token ids are >= 0"));
}

}  // namespace

void StateManager::Impl::EnablePrefixCache() {
  // A STATE group is keyed by checkpoint intervals: a cached "block" of it is a slot holding the
  // state after a whole number of intervals.
  checkpoint_group_ = state_group_;
  if (checkpoint_group_ >= 0) {
    checkpoint_tokens_ = static_cast<int32_t>(config_.prefix_cache.state_checkpoint_tokens);
  }
  std::vector<int32_t> block_sizes;
  block_sizes.reserve(static_cast<size_t>(num_groups()));
  for (int g = 0; g < num_groups(); ++g) {
    block_sizes.push_back(g == checkpoint_group_ ? checkpoint_tokens_ : kv_block_size(g));
  }
  prefix_ = std::make_unique<PrefixCache>(config_.prefix_cache, std::span<BlockPool>(pools_),
                                          std::move(block_sizes));
  keys_ = std::make_unique<SequenceKeys[]>(static_cast<size_t>(config_.max_tracked_sequences));
  for (int32_t slot = 0; slot < config_.max_tracked_sequences; ++slot) {
    keys_[slot].groups.resize(static_cast<size_t>(num_groups()));
  }
  for (int g = 0; g < num_groups(); ++g) {
    block_marks_.emplace_back(static_cast<size_t>(pools_[g].num_blocks()), 0);
    hit_step_ = std::lcm(hit_step_, int64_t{prefix_->block_size(g)});
  }
  match_blocks_.resize(static_cast<size_t>(num_groups()));
}

Result<Sequence*> StateManager::Impl::AddSequence(SeqId uid, std::span<const TokenId> prompt,
                                                  const SequenceOptions& options) {
  if (Find(uid) != nullptr) {
    return AlreadyExistsError(StrCat("AddSequence: sequence ", uid, " is already tracked"));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckTokenIds(uid, prompt));
  if (options.priority < kMinRetentionPriority || options.priority > kMaxRetentionPriority) {
    return InvalidArgumentError(StrCat("AddSequence: priority ", options.priority, " is outside [",
                                       kMinRetentionPriority, ", ", kMaxRetentionPriority, "]"));
  }
  if (static_cast<int64_t>(prompt.size()) > config_.max_context) {
    return InvalidArgumentError(StrCat("AddSequence: sequence ", uid, " has ", prompt.size(),
                                       " prompt tokens, max_context=", config_.max_context));
  }
  BLOCKKV_ASSIGN_OR_RETURN(Sequence * seq, GetOrCreateSequence(uid));
  if (prefix_ == nullptr) return seq;
  SequenceKeys& keys = keys_[seq->slot_];
  keys.registered = true;
  keys.looked_up = false;
  keys.ns_id = prefix_->InternNamespace(options.keys.ns);
  keys.priority = options.priority;
  keys.tokens.assign(prompt.begin(), prompt.end());
  keys.extras = options.keys;
  return seq;
}

Status StateManager::Impl::AppendTokens(SeqId uid, std::span<const TokenId> tokens) {
  const Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("AppendTokens: sequence ", uid, " is not tracked"));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckTokenIds(uid, tokens));
  if (prefix_ == nullptr) return Status::Ok();
  SequenceKeys& keys = keys_[seq->slot_];
  if (!keys.registered) {
    return FailedPreconditionError(StrCat("AppendTokens: sequence ", uid,
                                          " was not added with AddSequence, so its earlier "
                                          "tokens are unknown"));
  }
  keys.tokens.insert(keys.tokens.end(), tokens.begin(), tokens.end());
  return Status::Ok();
}

Status StateManager::Impl::CheckRecordableTokens(const Sequence& seq, int64_t seen_tokens,
                                                 std::span<const int64_t> tokens) const {
  const SequenceKeys& keys = keys_[seq.slot_];
  const auto known = static_cast<int64_t>(keys.tokens.size());
  if (!keys.registered || known < seen_tokens) return Status::Ok();  // nothing to record
  for (auto t = static_cast<size_t>(known - seen_tokens); t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] > std::numeric_limits<TokenId>::max()) [[unlikely]] {
      return FailedPreconditionError(ColdStrCat(
          "PostForward: sequence ", seq.uid(), " was given token id ", tokens[t], " at position ",
          seen_tokens + static_cast<int64_t>(t), "; token ids are in [0, 2^31)"));
    }
  }
  return Status::Ok();
}

void StateManager::Impl::RecordTokens(const Sequence& seq, std::span<const int64_t> tokens) {
  SequenceKeys& keys = keys_[seq.slot_];
  const auto known = static_cast<int64_t>(keys.tokens.size());
  // Tokens the engine gave before some unknown ones cannot be placed: leave the gap unknown.
  if (!keys.registered || known < seq.seen_tokens_) return;
  const auto skip = static_cast<size_t>(known - seq.seen_tokens_);
  for (size_t t = skip; t < tokens.size(); ++t) {
    keys.tokens.push_back(static_cast<TokenId>(tokens[t]));
  }
}

void StateManager::Impl::ResetKeys(int32_t slot) {
  if (prefix_ == nullptr) return;
  SequenceKeys& keys = keys_[slot];
  keys.registered = keys.looked_up = false;
  keys.tokens.clear();
  keys.extras = {};
  for (SequenceKeys::Group& g : keys.groups) g = {};
  keys.chunks = keys.checkpointed = 0;
  keys.chunk_key = {};
  DropPrefetch(keys);
}

void StateManager::Impl::ForkKeys(const Sequence& from, const Sequence& to) {
  if (prefix_ == nullptr) return;
  SequenceKeys& child = keys_[to.slot_];
  child = keys_[from.slot_];
  child.looked_up = true;
  child.prefetch = nullptr;  // the parent's, if it has one
  child.agreed = -1;
}

// ---- scheduling -------------------------------------------------------------------------------

int64_t StateManager::Impl::SlidingWindow(int group) const {
  return windows_[static_cast<size_t>(group)];
}

int32_t StateManager::Impl::WindowStart(int group, int32_t blocks) const {
  const int64_t window = SlidingWindow(group);
  const int64_t end = int64_t{blocks} * kv_block_size(group);
  if (window <= 0 || end <= window) return 0;
  return static_cast<int32_t>((end - window) / kv_block_size(group));
}

const StateManager::Impl::PrefixHit* StateManager::Impl::LookupPrefix(size_t i, const Sequence* seq,
                                                                      int64_t length) {
  if (seq == nullptr || seq->seen_tokens_ != 0) return nullptr;
  const SequenceKeys& keys = keys_[seq->slot_];
  if (!keys.registered || keys.looked_up) return nullptr;
  for (int g = 0; g < num_groups(); ++g) {
    if (seq->groups_[g].allocated != 0) return nullptr;
  }
  // The last known token is always recomputed: the engine needs its logits.
  const auto known = static_cast<int64_t>(keys.tokens.size());
  const int64_t cap = known > 0 ? known - 1 : 0;
  // Each group's matches: a full-attention group's leading run bounds the hit; a windowed
  // group's matches are checked per candidate below.
  int64_t most = cap;
  int32_t promoted = 0;  // blocks of the run found on the host level
  size_t promote_first = 0;
  int32_t remote = 0;  // blocks of the run found on the remote tier, after those
  size_t remote_first = 0;
  auto remote_miss = internal::RemoteTier::Miss::kNone;
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<BlockId>& blocks = match_blocks_[static_cast<size_t>(g)];
    auto limit = static_cast<int32_t>(cap / prefix_->block_size(g));
    // Tensor-parallel ranks agreed on the hit (AgreeRemotePrefix; one group).
    if (keys.agreed >= 0) limit = std::min(limit, keys.agreed);
    blocks.assign(static_cast<size_t>(limit), kNoBlock);
    if (g == checkpoint_group_) {
      MatchCheckpoints(keys, limit);
    } else if (SlidingWindow(g) > 0) {
      match_keys_.resize(static_cast<size_t>(limit));
      prefix_->MatchWindow(g, keys.tokens, keys.ns_id, keys.extras, limit, blocks, match_keys_);
    } else {
      BlockHash last;
      int32_t run = prefix_->Match(g, keys.tokens, keys.ns_id, keys.extras, limit, blocks, &last);
      // Promotions (host level, remote tier) continue the device's run (one group, so g == 0);
      // each block they bring takes a fresh block, so they go no further than the free blocks.
      // The evictable blocks of the device run are revived by this hit (counted below): they
      // are not there for promotions.
      int64_t free = 0;
      if ((host_prefix_ != nullptr || remote_ != nullptr) && run < limit) {
        free = free_scratch_[g];
        for (int32_t b = 0; b < run; ++b) {
          const BlockId block = blocks[static_cast<size_t>(b)];
          free -= pools_[g].is_evictable(block) && block_marks_[g][block] != mark_epoch_;
        }
      }
      if (host_prefix_ != nullptr && run < limit) {
        const PrefixCache::Published parent =
            run > 0 ? prefix_->published(g, blocks[static_cast<size_t>(run) - 1])
                    : PrefixCache::Published{};
        promote_first = promote_entries_.size();
        promoted = host_prefix_->Match(
            g, keys.tokens, keys.ns_id, keys.extras, run, run > 0 ? &parent : nullptr,
            static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(limit - run, free))),
            &promote_entries_);
        // An entry an earlier sequence of this batch promotes is not there for a second one:
        // its run stops before it.
        const auto earlier = promote_entries_.begin() + static_cast<std::ptrdiff_t>(promote_first);
        for (int32_t k = 0; k < promoted; ++k) {
          if (std::find(promote_entries_.begin(), earlier, earlier[k]) != earlier) {
            promoted = k;
            break;
          }
        }
        promote_entries_.resize(promote_first + static_cast<size_t>(promoted));
        run += promoted;
      }
      if (remote_ != nullptr && run < limit) {
        // The remote tier continues past the local levels (synchronously: docs/remote_tier.md).
        remote_first = remote_values_.size();
        const Verified got = MatchRemote(keys, run,
                                         static_cast<int32_t>(std::max<int64_t>(
                                             0, std::min<int64_t>(limit - run, free - promoted))));
        remote = got.blocks;
        remote_miss = got.miss;
        run += remote;
      }
      most = std::min(most, int64_t{run} * kv_block_size(g));
    }
  }
  // The longest prefix, in whole blocks of every group, that every windowed group holds and the
  // STATE group has a checkpoint of.
  int64_t tokens = most - most % hit_step_;
  for (; tokens > 0; tokens -= hit_step_) {
    bool held = true;
    if (checkpoint_group_ >= 0) {
      const auto n = static_cast<size_t>(tokens / checkpoint_tokens_);
      held = match_blocks_[static_cast<size_t>(checkpoint_group_)][n - 1] != kNoBlock;
    }
    for (int g = 0; g < num_groups() && held; ++g) {
      if (SlidingWindow(g) <= 0 || g == checkpoint_group_) continue;
      const auto n = static_cast<int32_t>(tokens / kv_block_size(g));
      const std::vector<BlockId>& blocks = match_blocks_[static_cast<size_t>(g)];
      held = std::all_of(blocks.begin() + WindowStart(g, n), blocks.begin() + n,
                         [](BlockId b) { return b != kNoBlock; });
    }
    if (held) break;
  }
  // Record the hit's blocks; the evictable ones it revives are no longer free for the batch.
  hit_index_[i] = static_cast<int32_t>(hits_.size());
  hits_.push_back({.tokens = tokens,
                   .in_flight = tokens > 0 ? std::min(length, known - tokens) : length,
                   .first = hit_blocks_.size(),
                   .promoted = promoted + remote,
                   .promote_first = promote_first,
                   .remote = remote,
                   .remote_first = remote_first,
                   .remote_miss = remote_miss});
  if (promoted + remote > 0) {
    free_scratch_[0] -= promoted + remote;
    promoted_ += promoted + remote;
  }
  if (checkpoint_group_ >= 0 && tokens > 0) {
    // The sequence's own slot is a fresh one (Check counts it); the checkpoint is copied into it.
    const int g = checkpoint_group_;
    const BlockId block =
        match_blocks_[static_cast<size_t>(g)][static_cast<size_t>(tokens / checkpoint_tokens_) - 1];
    hits_.back().checkpoint = block;
    if (pools_[g].is_evictable(block) && block_marks_[g][block] != mark_epoch_) {
      block_marks_[g][block] = mark_epoch_;
      --free_scratch_[static_cast<size_t>(pool_lead_[g])];
    }
  }
  for (int g = 0; g < num_groups(); ++g) {
    // A STATE group's table entry is its slot, never a cached block: n = 0 (tokens < max_context).
    const auto n = static_cast<int32_t>(tokens / kv_block_size(g));
    const int32_t start = WindowStart(g, n);
    hit_starts_.push_back(start);
    for (int32_t b = start; b < n; ++b) {
      const BlockId block = match_blocks_[static_cast<size_t>(g)][static_cast<size_t>(b)];
      hit_blocks_.push_back(block);
      if (block == kNoBlock) continue;  // promoted from the host level
      if (pools_[g].is_evictable(block) && block_marks_[g][block] != mark_epoch_) {
        block_marks_[g][block] = mark_epoch_;
        --free_scratch_[static_cast<size_t>(pool_lead_[g])];
      }
    }
  }
  return &hits_.back();
}

void StateManager::Impl::TakePrefix(size_t i, Sequence& seq) {
  SequenceKeys& keys = keys_[seq.slot_];
  keys.looked_up = true;
  DropPrefetch(keys);  // its values, when taken, are in remote_values_
  const auto index = static_cast<size_t>(hit_index_[i]);
  const PrefixHit& hit = hits_[index];
  const BlockId* blocks = hit_blocks_.data() + hit.first;
  for (int g = 0; g < num_groups(); ++g) {
    const auto n = static_cast<int32_t>(hit.tokens / kv_block_size(g));
    const int32_t start = hit_starts_[index * static_cast<size_t>(num_groups()) + g];
    Sequence::GroupState& state = seq.groups_[g];
    std::copy_n(blocks, n - start, state.row + start);
    blocks += n - start;
    state.released = start;
    state.allocated = n;
    // A block is kept as long as its most valuable user wants it kept.
    for (int32_t b = start; b < n; ++b) pools_[g].MarkCached(state.row[b], keys.priority);
    SequenceKeys::Group& published = keys.groups[static_cast<size_t>(g)];
    published.published = n;
    if (n > 0) published.last = prefix_->published(g, state.row[n - 1]);
  }
  if (hit.checkpoint != kNoBlock) {
    keys.checkpointed = static_cast<int32_t>(hit.tokens / checkpoint_tokens_);
  }
  if (hit.remote_miss != internal::RemoteTier::Miss::kNone) {
    remote_->CountLookup(0, hit.remote_miss);
  }
  seq.seen_tokens_ = hit.tokens;
  seq.cached_prefix_tokens_ = hit.tokens;
  const int64_t bs = kv_block_size(0);  // promotions are of group 0 (one group, no window)
  prefix_->RecordLookup(keys.ns_id, {.lookups = 1,
                                     .queried_tokens = static_cast<int64_t>(keys.tokens.size()),
                                     .hit_tokens = hit.tokens,
                                     .host_hit_tokens = int64_t{hit.promoted - hit.remote} * bs,
                                     .remote_hit_tokens = int64_t{hit.remote} * bs});
}

void StateManager::Impl::ShareHitBlocks(bool share) {
  for (size_t h = 0; h < hits_.size(); ++h) {
    size_t at = hits_[h].first;
    for (int g = 0; g < num_groups(); ++g) {
      const auto n = static_cast<size_t>(hits_[h].tokens / kv_block_size(g));
      const auto start =
          static_cast<size_t>(hit_starts_[h * static_cast<size_t>(num_groups()) + g]);
      const size_t on_device = n - start - (g == 0 ? static_cast<size_t>(hits_[h].promoted) : 0);
      const std::span<const BlockId> blocks = std::span(hit_blocks_).subspan(at, on_device);
      const Status shared = share ? pools_[g].AddRef(blocks) : pools_[g].Release(blocks);
      BLOCKKV_CHECK(shared.ok(), "Schedule: a prefix hit found a block that is not cached");
      at += n - start;
    }
  }
  ShareCheckpoints(share);
}

Status StateManager::Impl::PromoteHits(std::span<const BlockId> blocks) {
  size_t next = 0;
  for (size_t i = 0; i < hit_index_.size(); ++i) {
    if (hit_index_[i] < 0) continue;
    const PrefixHit& hit = hits_[static_cast<size_t>(hit_index_[i])];
    if (hit.promoted == 0) continue;
    const auto count = static_cast<size_t>(hit.promoted);
    const auto remote = static_cast<size_t>(hit.remote);
    const std::span<const BlockId> into = blocks.subspan(next, count);
    const int32_t priority = keys_[slot_scratch_[i]].priority;
    if (count > remote) {
      BLOCKKV_RETURN_IF_ERROR(host_prefix_->Promote(
          0, std::span(promote_entries_).subspan(hit.promote_first, count - remote),
          into.first(count - remote), priority));
    }
    // One group, no window: the hit's blocks are table entries [0, n), the promoted ones last.
    const auto n = static_cast<size_t>(hit.tokens / kv_block_size(0));
    std::copy(into.begin(), into.end(),
              hit_blocks_.begin() + static_cast<std::ptrdiff_t>(hit.first + n - count));
    if (remote > 0) {
      const size_t run = n - remote;
      const PrefixCache::Published parent =
          run > 0 ? prefix_->published(0, hit_blocks_[hit.first + run - 1])
                  : PrefixCache::Published{};
      BLOCKKV_RETURN_IF_ERROR(PlaceRemote(keys_[slot_scratch_[i]], hit.remote_first,
                                          into.last(remote), static_cast<int32_t>(run),
                                          run > 0 ? &parent : nullptr, priority));
    }
    next += count;
  }
  return Status::Ok();
}

void StateManager::Impl::PublishFullBlocks(Sequence& seq) {
  SequenceKeys& keys = keys_[seq.slot_];
  if (!keys.registered) return;
  const int64_t known =
      std::min<int64_t>(seq.seen_tokens_, static_cast<int64_t>(keys.tokens.size()));
  if (checkpoint_group_ >= 0 && seq.seen_tokens_ % checkpoint_tokens_ == 0 &&
      seq.seen_tokens_ / checkpoint_tokens_ > keys.checkpointed &&
      std::ssize(keys.tokens) >= seq.seen_tokens_) {
    SaveCheckpoint(seq, keys);
  }
  for (int g = 0; g < num_groups(); ++g) {
    if (g == checkpoint_group_) continue;
    SequenceKeys::Group& state = keys.groups[static_cast<size_t>(g)];
    const int32_t bs = kv_block_size(g);
    const BlockId* row = seq.groups_[g].row;
    for (const int64_t full = known / bs; state.published < full; ++state.published) {
      const int32_t index = state.published;
      const BlockId block = row[index];
      // Released before it could be keyed (its tokens came late): nothing after it can be.
      if (block == kNoBlock) break;
      const std::span<const TokenId> tokens =
          std::span(keys.tokens)
              .subspan(static_cast<size_t>(index) * static_cast<size_t>(bs),
                       static_cast<size_t>(bs));
      const SequenceKeys::Published* parent = index == 0 ? nullptr : &state.last;
      const BlockHash key = prefix_->Hash(parent ? &parent->key : nullptr, tokens, keys.extras,
                                          static_cast<size_t>(index));
      // A fork's sibling may have published a block both hold: chain on from its publish.
      if (pools_[g].is_cached(block)) {
        state.last = prefix_->published(g, block);
      } else {
        const BlockHash parent_key = parent != nullptr ? parent->key : BlockHash{};
        state.last = prefix_->Publish(g, block, parent, key, tokens, keys.ns_id, keys.extras,
                                      static_cast<size_t>(index), keys.priority);
        // Write-through of a newly computed block (the remote tier is for one group: g == 0).
        if (remote_ != nullptr) {
          StoreRemote(keys, index, key, parent != nullptr ? &parent_key : nullptr, block);
        }
      }
    }
  }
  if (remote_ != nullptr) SendRemoteStores();  // the sequence's new blocks in one pipeline
}

// ---- a STATE group's checkpoints ----------------------------------------------------------------

BlockHash StateManager::Impl::CheckpointKey(SequenceKeys& keys, int32_t chunks) const {
  const auto n = static_cast<size_t>(checkpoint_tokens_);
  if (keys.chunks > chunks) keys.chunks = 0;  // a cache of a longer chain: start over
  for (; keys.chunks < chunks; ++keys.chunks) {
    const auto i = static_cast<size_t>(keys.chunks);
    keys.chunk_key = prefix_->Hash(i == 0 ? nullptr : &keys.chunk_key,
                                   std::span(keys.tokens).subspan(i * n, n), keys.extras, i);
  }
  return keys.chunk_key;
}

void StateManager::Impl::MatchCheckpoints(const SequenceKeys& keys, int32_t limit) {
  const int g = checkpoint_group_;
  const auto n = static_cast<size_t>(checkpoint_tokens_);
  std::vector<BlockId>& out = match_blocks_[static_cast<size_t>(g)];
  match_keys_.resize(static_cast<size_t>(limit));
  prefix_->ChainKeys(keys.tokens, checkpoint_tokens_, keys.extras, match_keys_);
  for (size_t i = 0; i < match_keys_.size(); ++i) {
    const std::span<const TokenId> chunk = std::span(keys.tokens).subspan(i * n, n);
    out[i] = prefix_->FindRoot(g, match_keys_[i], chunk, keys.ns_id, keys.extras, i);
  }
}

void StateManager::Impl::SaveCheckpoint(Sequence& seq, SequenceKeys& keys) {
  const int g = checkpoint_group_;
  const auto chunks = static_cast<int32_t>(seq.seen_tokens_ / checkpoint_tokens_);
  keys.checkpointed = chunks;
  const BlockHash key = CheckpointKey(keys, chunks);
  const auto i = static_cast<size_t>(chunks - 1);
  const auto n = static_cast<size_t>(checkpoint_tokens_);
  const std::span<const TokenId> chunk = std::span(keys.tokens).subspan(i * n, n);
  // Another sequence saved this state already: one copy serves both.
  if (prefix_->FindRoot(g, key, chunk, keys.ns_id, keys.extras, i) != kNoBlock) return;
  BlockId block = kNoBlock;
  const BlockId slot = seq.groups_[g].row[0];
  Status s = pools_[g].Take(1, std::span(&block, 1));  // may evict the least recent checkpoint
  if (s.ok()) s = cache_->CopyBlocks(std::span(&slot, 1), std::span(&block, 1), g);
  if (!s.ok()) {
    if (block != kNoBlock) pools_[g].Release(std::span(&block, 1)).IgnoreError();
    ++checkpoints_skipped_;
    return;
  }
  prefix_->Publish(g, block, /*parent=*/nullptr, key, chunk, keys.ns_id, keys.extras, i,
                   keys.priority);
  const Status released = pools_[g].Release(std::span(&block, 1));  // cached, evictable
  BLOCKKV_CHECK(released.ok(), "SaveCheckpoint: giving back the checkpoint's reference");
}

Status StateManager::Impl::ResumeFromCheckpoints(size_t n_uids) {
  const int g = checkpoint_group_;
  const auto groups = static_cast<size_t>(num_groups());
  std::vector<BlockId>& from = checkpoint_from_;
  std::vector<BlockId>& into = checkpoint_into_;
  from.clear();
  into.clear();
  size_t at = 0;  // the group's blocks this call took, handed out in uid order (Commit)
  for (size_t i = 0; i < n_uids; ++i) {
    const PrefixHit* hit = HitOf(i);
    if (hit != nullptr && hit->checkpoint != kNoBlock) {
      BLOCKKV_CHECK(need_scratch_[i * groups + static_cast<size_t>(g)] == 1,
                    "Schedule: a checkpoint hit without a fresh slot");
      from.push_back(hit->checkpoint);
      into.push_back(scratch_[static_cast<size_t>(g)][at]);
    }
    at += static_cast<size_t>(need_scratch_[i * groups + static_cast<size_t>(g)]);
  }
  if (from.empty()) return Status::Ok();
  BLOCKKV_RETURN_IF_ERROR(cache_->CopyBlocks(from, into, g));
  ShareCheckpoints(/*share=*/false);  // copied: each stays cached, evictable again
  return Status::Ok();
}

void StateManager::Impl::ShareCheckpoints(bool share) {
  if (checkpoint_group_ < 0) return;
  BlockPool& pool = pools_[checkpoint_group_];
  for (const PrefixHit& hit : hits_) {
    if (hit.checkpoint == kNoBlock) continue;
    const std::span<const BlockId> block(&hit.checkpoint, 1);
    const Status s = share ? pool.AddRef(block) : pool.Release(block);
    BLOCKKV_CHECK(s.ok(), "Schedule: a checkpoint hit found a slot that is not cached");
  }
}

CacheEventBatch StateManager::Impl::DrainCacheEvents() {
  return prefix_ != nullptr ? prefix_->DrainEvents() : CacheEventBatch{};
}

std::vector<BlockHash> StateManager::Impl::cached_keys(int group, CacheMedium medium) const {
  std::vector<BlockHash> keys;
  if (prefix_ == nullptr) return keys;
  std::set<std::pair<uint64_t, uint64_t>> seen;
  auto add = [&](const BlockHash& key) {
    if (seen.emplace(key.hi, key.lo).second) keys.push_back(key);
  };
  if (medium == CacheMedium::kDevice) {
    for (const PrefixCache::CachedBlock& b : prefix_->CachedBlocks(group)) add(b.key);
  } else if (medium == CacheMedium::kHost && host_prefix_ != nullptr) {
    for (const BlockStored& e : host_prefix_->StoredKeys()) {
      if (e.group == group) add(e.hash);
    }
  }
  return keys;
}

Status StateManager::Impl::EnableKVEvents() {
  std::vector<int32_t> block_sizes(static_cast<size_t>(num_groups()));
  for (int g = 0; g < num_groups(); ++g) block_sizes[static_cast<size_t>(g)] = kv_block_size(g);
  Result<std::unique_ptr<KVEventPublisher>> publisher =
      KVEventPublisher::Create(*config_.kv_events, std::move(block_sizes));
  if (!publisher.ok()) {
    return {publisher.status().code(),
            StrCat("StateManagerConfig.kv_events: ", publisher.status().message())};
  }
  kv_publisher_ = std::move(*publisher);
  if (host_prefix_ != nullptr) host_prefix_->set_announce(true);
  return Status::Ok();
}

void StateManager::Impl::PublishKVEvents() {
  CacheEventBatch drained = prefix_->DrainEvents();
  if (drained.dropped > 0) {  // the prefix cache's own queue overflowed: a router is behind
    kv_publisher_->CountDropped(drained.dropped);
    kv_resync_ = true;
  }
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  if (!kv_resync_) {
    if (drained.events.empty()) return;
    kv_resync_ = !kv_publisher_->Publish(std::move(drained.events), now());
    return;
  }
  // A resync: the state now, which the events just drained led to, so they are not needed. Not
  // built while the queue is full (it would only be dropped: O(cached blocks) for nothing).
  if (!kv_publisher_->has_room()) {
    kv_publisher_->CountDroppedBatch(drained.events.size());
    return;
  }
  std::vector<CacheEvent> events;
  events.emplace_back(AllCleared{});
  for (int g = 0; g < num_groups(); ++g) {
    std::set<std::pair<uint64_t, uint64_t>> seen;
    for (const PrefixCache::CachedBlock& b : prefix_->CachedBlocks(g)) {
      if (!seen.emplace(b.key.hi, b.key.lo).second) continue;
      events.emplace_back(BlockStored{.hash = b.key,
                                      .has_parent = b.parent_id != 0,
                                      .parent = b.parent_key,
                                      .tokens = {b.tokens.begin(), b.tokens.end()},
                                      .ns = std::string(b.ns),
                                      .adapter_id = b.adapter_id,
                                      .group = g,
                                      .medium = CacheMedium::kDevice});
    }
  }
  if (host_prefix_ != nullptr) {
    for (BlockStored& e : host_prefix_->StoredKeys()) events.emplace_back(std::move(e));
  }
  if (kv_publisher_->Publish(std::move(events), now(), /*resync=*/true)) {
    kv_resync_ = false;
  } else {
    kv_publisher_->CountDropped(drained.events.size());
  }
}

int64_t StateManager::Impl::ResetPrefixCache() {
  if (prefix_ == nullptr) return 0;
  // The host level first, so that the device's AllCleared, when it says nothing is left, comes
  // last (a router that applies it clears every level).
  const int64_t host = host_prefix_ != nullptr ? host_prefix_->Clear() : 0;
  return prefix_->Reset() + host;
}

void StateManager::Impl::UndoSchedule() {
  for (size_t g = 0; g < scratch_.size(); ++g) {
    const Status released = pools_[g].Release(scratch_[g]);
    BLOCKKV_CHECK(released.ok(), "Schedule: giving back blocks it took");
  }
  ShareHitBlocks(/*share=*/false);
}

Status StateManager::Impl::CheckKeys(const Sequence& seq) const {
  if (prefix_ == nullptr) return Status::Ok();
  const SequenceKeys& keys = keys_[seq.slot_];
  for (int g = 0; g < num_groups(); ++g) {
    const Sequence::GroupState& state = seq.groups_[g];
    const int32_t published = keys.groups[static_cast<size_t>(g)].published;
    if (published > state.allocated) {
      return InternalError(StrCat("sequence ", seq.uid_, " published ", published,
                                  " blocks of group ", g, " but holds ", state.allocated));
    }
    for (int32_t b = state.released; b < published; ++b) {
      if (!pools_[g].is_cached(state.row[b])) {
        return InternalError(StrCat("sequence ", seq.uid_, " block ", b, " of group ", g,
                                    " counts as published but is not cached"));
      }
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
