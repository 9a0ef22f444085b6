// The StateManager's prefix caching: registering prompts, looking up a first Schedule's cached
// prefix, publishing blocks as they fill. The rest of the manager is in state_manager.cc.
#include <algorithm>
#include <string>

#include "blockkv/state_manager.h"
#include "internal/block_size.h"
#include "internal/check.h"
#include "internal/strings.h"
#include "state_manager_keys.h"

namespace blockkv {

using internal::StrCat;

namespace {

Status CheckTokenIds(SeqId uid, std::span<const TokenId> tokens) {
  const auto bad = std::find_if(tokens.begin(), tokens.end(), [](TokenId t) { return t < 0; });
  if (bad == tokens.end()) return Status::Ok();
  return InvalidArgumentError(StrCat("sequence ", uid, ": token ", bad - tokens.begin(), " is ",
                                     *bad, "; token ids are >= 0"));
}

}  // namespace

void StateManager::EnablePrefixCache() {
  std::vector<int32_t> block_sizes;
  for (int g = 0; g < num_groups(); ++g) block_sizes.push_back(kv_block_size(g));
  prefix_ = std::make_unique<PrefixCache>(config_.prefix_cache, std::span<BlockPool>(pools_),
                                          std::move(block_sizes));
  keys_.reset(new SequenceKeys[static_cast<size_t>(config_.max_tracked_sequences)]);
  for (int32_t slot = 0; slot < config_.max_tracked_sequences; ++slot) {
    keys_[slot].groups.resize(static_cast<size_t>(num_groups()));
  }
  for (int g = 0; g < num_groups(); ++g) {
    block_marks_.emplace_back(static_cast<size_t>(pools_[g].num_blocks()), 0);
  }
}

Result<Sequence*> StateManager::AddSequence(SeqId uid, std::span<const TokenId> prompt,
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

Status StateManager::AppendTokens(SeqId uid, std::span<const TokenId> tokens) {
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

void StateManager::ResetKeys(int32_t slot) {
  if (prefix_ == nullptr) return;
  SequenceKeys& keys = keys_[slot];
  keys.registered = keys.looked_up = false;
  keys.tokens.clear();
  keys.extras = {};
  for (SequenceKeys::Group& g : keys.groups) g = {};
}

void StateManager::ForkKeys(const Sequence& from, const Sequence& to) {
  if (prefix_ == nullptr) return;
  SequenceKeys& child = keys_[to.slot_];
  child = keys_[from.slot_];
  child.looked_up = true;
}

// ---- scheduling -------------------------------------------------------------------------------

const StateManager::PrefixHit* StateManager::LookupPrefix(size_t i, const Sequence* seq,
                                                          int64_t length) const {
  if (seq == nullptr || seq->seen_tokens_ != 0) return nullptr;
  const SequenceKeys& keys = keys_[seq->slot_];
  if (!keys.registered || keys.looked_up) return nullptr;
  for (int g = 0; g < num_groups(); ++g) {
    if (seq->groups_[g].allocated != 0) return nullptr;
  }
  // The last known token is always recomputed: the engine needs its logits.
  const auto known = static_cast<int64_t>(keys.tokens.size());
  const int64_t cap = known > 0 ? known - 1 : 0;
  const auto groups = static_cast<size_t>(num_groups());
  const size_t first = hit_blocks_.size();
  const size_t key_at = hits_.size() * groups;
  hit_keys_.resize(key_at + groups);
  // Each group's longest match, then the longest prefix every group holds in whole blocks.
  int64_t tokens = cap;
  std::vector<int32_t>& matched = matched_scratch_;
  matched.assign(groups, 0);
  for (size_t g = 0; g < groups; ++g) {
    const int32_t bs = kv_block_size(static_cast<int>(g));
    const auto most = static_cast<int32_t>(cap / bs);
    const size_t at = hit_blocks_.size();
    hit_blocks_.resize(at + static_cast<size_t>(most));
    matched[g] = prefix_->Match(static_cast<int>(g), keys.tokens, keys.ns_id, keys.extras, most,
                                std::span(hit_blocks_).subspan(at), &hit_keys_[key_at + g]);
    hit_blocks_.resize(at + static_cast<size_t>(matched[g]));
    tokens = std::min(tokens, int64_t{matched[g]} * bs);
  }
  for (bool stable = false; !stable;) {  // a multiple of every block size
    stable = true;
    for (size_t g = 0; g < groups; ++g) {
      const int32_t bs = kv_block_size(static_cast<int>(g));
      if (tokens % bs != 0) {
        tokens -= tokens % bs;
        stable = false;
      }
    }
  }
  // Keep each group's first tokens/bs blocks, re-keying a group that matched more.
  size_t read = first;
  size_t write = first;
  for (size_t g = 0; g < groups; ++g) {
    const auto keep = static_cast<int32_t>(tokens / kv_block_size(static_cast<int>(g)));
    std::copy_n(hit_blocks_.begin() + static_cast<std::ptrdiff_t>(read), keep,
                hit_blocks_.begin() + static_cast<std::ptrdiff_t>(write));
    if (keep < matched[g] && keep > 0) {
      std::vector<BlockId>& again = rematch_scratch_;
      again.resize(static_cast<size_t>(keep));
      prefix_->Match(static_cast<int>(g), keys.tokens, keys.ns_id, keys.extras, keep, again,
                     &hit_keys_[key_at + g]);
    }
    read += static_cast<size_t>(matched[g]);
    write += static_cast<size_t>(keep);
  }
  hit_blocks_.resize(write);
  // Evictable blocks this hit revives are no longer free for the rest of the batch.
  for (size_t g = 0, at = first; g < groups; ++g) {
    const auto keep = static_cast<size_t>(tokens / kv_block_size(static_cast<int>(g)));
    for (size_t b = 0; b < keep; ++b) {
      const BlockId block = hit_blocks_[at + b];
      if (pools_[g].is_evictable(block) && block_marks_[g][block] != mark_epoch_) {
        block_marks_[g][block] = mark_epoch_;
        --free_scratch_[g];
      }
    }
    at += keep;
  }
  hit_index_[i] = static_cast<int32_t>(hits_.size());
  hits_.push_back({.tokens = tokens,
                   .in_flight = tokens > 0 ? std::min(length, known - tokens) : length,
                   .first = first});
  return &hits_.back();
}

void StateManager::TakePrefix(size_t i, Sequence& seq) {
  SequenceKeys& keys = keys_[seq.slot_];
  keys.looked_up = true;
  const PrefixHit& hit = hits_[static_cast<size_t>(hit_index_[i])];
  const auto groups = static_cast<size_t>(num_groups());
  size_t at = hit.first;
  for (size_t g = 0; g < groups; ++g) {
    const auto count = static_cast<int32_t>(hit.tokens / kv_block_size(static_cast<int>(g)));
    Sequence::GroupState& state = seq.groups_[g];
    std::copy_n(hit_blocks_.begin() + static_cast<std::ptrdiff_t>(at), count, state.row);
    // A block is kept as long as its most valuable user wants it kept.
    for (int32_t b = 0; b < count; ++b) pools_[g].MarkCached(state.row[b], keys.priority);
    state.allocated = count;
    keys.groups[g].published = count;
    if (count > 0)
      keys.groups[g].last_key = hit_keys_[static_cast<size_t>(hit_index_[i]) * groups + g];
    at += static_cast<size_t>(count);
  }
  seq.seen_tokens_ = hit.tokens;
  seq.cached_prefix_tokens_ = hit.tokens;
  prefix_->RecordLookup(keys.ns_id, static_cast<int64_t>(keys.tokens.size()), hit.tokens);
}

void StateManager::ShareHitBlocks() {
  const auto groups = static_cast<size_t>(num_groups());
  for (const PrefixHit& hit : hits_) {
    size_t at = hit.first;
    for (size_t g = 0; g < groups; ++g) {
      const auto count = static_cast<size_t>(hit.tokens / kv_block_size(static_cast<int>(g)));
      const Status shared = pools_[g].AddRef(std::span(hit_blocks_).subspan(at, count));
      BLOCKKV_CHECK(shared.ok(), "Schedule: a prefix hit found a block that is not cached");
      at += count;
    }
  }
}

void StateManager::PublishFullBlocks(Sequence& seq) {
  SequenceKeys& keys = keys_[seq.slot_];
  if (!keys.registered) return;
  const int64_t known =
      std::min<int64_t>(seq.seen_tokens_, static_cast<int64_t>(keys.tokens.size()));
  for (int g = 0; g < num_groups(); ++g) {
    SequenceKeys::Group& state = keys.groups[static_cast<size_t>(g)];
    const int32_t bs = kv_block_size(g);
    const BlockId* row = seq.groups_[g].row;
    for (const int64_t full = known / bs; state.published < full; ++state.published) {
      const int32_t index = state.published;
      const BlockId block = row[index];
      const BlockId parent = index == 0 ? kNoBlock : row[index - 1];
      // A released block (sliding window) breaks the chain: nothing after it can be keyed.
      if (block == kNoBlock ||
          (index > 0 && (parent == kNoBlock || !pools_[g].is_cached(parent)))) {
        break;
      }
      const std::span<const TokenId> tokens =
          std::span(keys.tokens)
              .subspan(static_cast<size_t>(index) * static_cast<size_t>(bs),
                       static_cast<size_t>(bs));
      const BlockHash key = prefix_->Hash(index == 0 ? nullptr : &state.last_key, tokens,
                                          keys.extras, static_cast<size_t>(index));
      if (!pools_[g].is_cached(block)) {  // a fork may have published a block both hold
        prefix_->Publish(g, block, parent, key, tokens, keys.ns_id, keys.extras,
                         static_cast<size_t>(index), keys.priority);
      }
      state.last_key = key;
    }
  }
}

CacheEventBatch StateManager::DrainCacheEvents() {
  return prefix_ != nullptr ? prefix_->DrainEvents() : CacheEventBatch{};
}

int64_t StateManager::ResetPrefixCache() { return prefix_ != nullptr ? prefix_->Reset() : 0; }

Status StateManager::CheckKeys(const Sequence& seq) const {
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
