// SPDX-License-Identifier: Apache-2.0
// The StateManager's speculative decoding: PostForward with accepted counts (a step keeps j of
// its k in-flight tokens) and Rollback of committed tokens. Both shrink a sequence the same way
// (TrimTo); the contracts are in include/blockkv/state_manager.h, the design in
// docs/state_manager.md, "Speculative decoding".
//
// Why publishing needs no change: PublishFullBlocks publishes only blocks wholly before
// seen_tokens, and seen_tokens only ever counts kept tokens; the known tokens a sequence keeps
// for its keys are cut at seen_tokens whenever tokens are rejected, so a block's key is always
// the tokens its KV was computed from. What Rollback must add is that a block the sequence
// shares or has published is never written again: the new partial last block is copied first.
#include <algorithm>
#include <string>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/block_size.h"
#include "internal/check.h"
#include "internal/strings.h"
#include "internal/uid_map.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"

namespace blockkv {

using internal::ColdStrCat;
using internal::StrCat;

uint32_t StateManager::Impl::NextMarkEpoch() {
  if (++mark_epoch_ == 0) {
    std::fill(slot_marks_.begin(), slot_marks_.end(), 0);
    for (std::vector<uint32_t>& marks : block_marks_) std::fill(marks.begin(), marks.end(), 0);
    mark_epoch_ = 1;
  }
  return mark_epoch_;
}

Status StateManager::Impl::CheckAcceptedCount(size_t n, std::span<const int64_t> accepted) {
  if (accepted.empty() || accepted.size() == n) return Status::Ok();
  return InvalidArgumentError(
      ColdStrCat("PostForward: ", accepted.size(), " accepted counts for ", n, " sequences"));
}

Status StateManager::Impl::CheckAccepted(const Sequence& seq, int64_t accepted) const {
  if (accepted >= 0 && accepted <= seq.in_flight_tokens_) [[likely]] {
    if (state_group_ < 0 || accepted == seq.in_flight_tokens_) return Status::Ok();
    return FailedPreconditionError(ColdStrCat(
        "PostForward: sequence ", seq.uid_, " accepted ", accepted, " of its ",
        seq.in_flight_tokens_, " tokens in flight, but cache group ", state_group_,
        " is STATE: the forward applied every token to its state, which cannot be un-applied "
        "(keep every token)"));
  }
  return InvalidArgumentError(ColdStrCat(
      "PostForward: sequence ", seq.uid_, " accepted ", accepted, " tokens of ",
      seq.in_flight_tokens_, " in flight; accepted is in [0, ", seq.in_flight_tokens_, "]"));
}

Status StateManager::Impl::PostForwardAccepted(std::span<const SeqId> uids,
                                               std::span<const int64_t> accepted) {
  BLOCKKV_RETURN_IF_ERROR(CheckAcceptedCount(uids.size(), accepted));
  slot_scratch_.resize(uids.size());
  const uint32_t epoch = NextMarkEpoch();
  for (size_t i = 0; i < uids.size(); ++i) {
    const int32_t slot = by_uid_->Find(uids[i]);
    if (slot == internal::UidMap::kAbsent) {
      return NotFoundError(ColdStrCat("PostForward: sequence ", uids[i], " is not tracked"));
    }
    // A repeated uid would be advanced twice by counts checked against one in-flight total.
    if (slot_marks_[static_cast<size_t>(slot)] == epoch) {
      return InvalidArgumentError(
          ColdStrCat("PostForward: sequence ", uids[i], " appears twice with accepted counts"));
    }
    slot_marks_[static_cast<size_t>(slot)] = epoch;
    BLOCKKV_RETURN_IF_ERROR(CheckAccepted(sequences_[slot], accepted[i]));
    slot_scratch_[i] = slot;
  }
  for (size_t i = 0; i < uids.size(); ++i)
    AdvanceAccepted(sequences_[slot_scratch_[i]], accepted[i]);
  return Status::Ok();
}

void StateManager::Impl::TrimTo(Sequence& seq, int64_t end) {
  bool changed = false;
  for (int g = 0; g < num_groups(); ++g) {
    Sequence::GroupState& state = seq.groups_[g];
    const auto keep = static_cast<int32_t>(block_sizes_[g].BlocksFor(end));
    if (state.allocated <= keep) continue;
    BLOCKKV_CHECK(keep >= state.released, "TrimTo: a released entry would be kept");
    // Last block first, as FlushSequence: deeper blocks of a prefix become the least recently
    // used, so eviction takes a chain from its end.
    tail_scratch_.assign(std::make_reverse_iterator(state.row + state.allocated),
                         std::make_reverse_iterator(state.row + keep));
    const Status released = pools_[g].Release(tail_scratch_);
    BLOCKKV_CHECK(released.ok(), "TrimTo: a sequence held a block without a reference");
    std::fill(state.row + keep, state.row + state.allocated, kNoBlock);
    state.allocated = keep;
    changed = true;
  }
  if (changed) seq.table_version_ = ++last_table_version_;
  if (prefix_ == nullptr) return;
  SequenceKeys& keys = keys_[seq.slot_];
  if (std::ssize(keys.tokens) > end) keys.tokens.resize(static_cast<size_t>(end));
  for (int g = 0; g < num_groups(); ++g) {
    SequenceKeys::Group& published = keys.groups[static_cast<size_t>(g)];
    const auto full = static_cast<int32_t>(block_sizes_[g].Index(end));
    if (published.published <= full) continue;
    // The blocks it still holds up to `full` were published by it or a sibling: chain on from
    // the last (held, hence still cached). Rollback keeps it held (past any released entries).
    published.published = full;
    published.last =
        full > 0 ? prefix_->published(g, seq.groups_[g].row[full - 1]) : PrefixCache::Published{};
  }
}

Status StateManager::Impl::Rollback(SeqId uid, int64_t n) {
  if (n < 0) {
    return InvalidArgumentError(
        StrCat("Rollback: sequence ", uid, ": cannot roll back ", n, " tokens; n is >= 0"));
  }
  Sequence* const seq = Find(uid);
  if (seq == nullptr) return NotFoundError(StrCat("Rollback: sequence ", uid, " is not tracked"));
  BLOCKKV_RETURN_IF_ERROR(RequireResident(*seq, StrCat("Rollback: sequence ", uid)));
  if (seq->in_flight_tokens_ != 0) {
    return FailedPreconditionError(StrCat(
        "Rollback: sequence ", uid, " has ", seq->in_flight_tokens_,
        " tokens in flight; reject them with PostForward's accepted counts, then roll back"));
  }
  const int64_t seen = seq->seen_tokens_;
  if (n > seen) {
    return InvalidArgumentError(StrCat("Rollback: cannot roll back ", n, " tokens of sequence ",
                                       uid, ": it has ", seen, " (n <= seen_tokens)"));
  }
  if (n == 0) return Status::Ok();
  if (state_group_ >= 0) {
    return FailedPreconditionError(
        StrCat("Rollback: sequence ", uid, ": cache group ", state_group_,
               " is STATE, and a state cannot un-apply tokens (no checkpoints are kept); the "
               "sequence keeps its ",
               seen, " tokens"));
  }
  const int64_t end = seen - n;
  // A group whose window released leading blocks must keep a whole block before the new end:
  // the block it writes next must be held, and publishing chains on from a held block.
  // A LOCAL group's query at the new end sees (end - W, end]: none of it may have been released.
  for (int g = 0; g < num_groups(); ++g) {
    const int32_t released = seq->groups_[g].released;
    if (released == 0) continue;
    const int64_t bs = block_sizes_[g].value();
    int64_t least = (int64_t{released} + 1) * bs;  // the smallest end it can roll back to
    if (cache_->config(g).type == KVCacheType::kLocal) {
      least = std::max(least, int64_t{released} * bs + windows_[static_cast<size_t>(g)]);
    }
    if (end < least) {
      return FailedPreconditionError(StrCat(
          "Rollback: sequence ", uid, " released its first ", released, " blocks of group ", g,
          cache_->config(g).type == KVCacheType::kLocal ? " (out of its local_window)"
                                                        : " (FreeLeadingBlocks)",
          "; it can roll back at most ", std::max<int64_t>(0, seen - least), " of its ", seen,
          " tokens, asked for ", n));
    }
  }
  // Copy-on-write of the new partial last block where another holder (a fork, a prefix hit) or
  // the prefix cache has it: the sequence writes into it next. Every copy's block is checked
  // before any is taken, as Fork does (taking one may evict a cached block).
  std::vector<BlockId> shared(static_cast<size_t>(num_groups()), kNoBlock);
  for (int g = 0; g < num_groups(); ++g) {
    if (block_sizes_[g].Offset(end) == 0) continue;
    const BlockId block = seq->groups_[g].row[block_sizes_[g].Index(end)];
    if (pools_[g].ref_count(block) > 1 || pools_[g].is_cached(block)) shared[g] = block;
  }
  std::vector<BlockId>& copies = tail_scratch_;
  if (BlockCopies c = CopyOneBlockPerGroup(shared, copies); !c.status.ok()) {
    if (c.no_free_block) {
      return ResourceExhaustedError(StrCat("Rollback: sequence ", uid, " needs a block of group ",
                                           c.group, " for a private copy of block ",
                                           block_sizes_[c.group].Index(end),
                                           ", which it shares; none free"));
    }
    return {c.status.code(),
            StrCat("Rollback: sequence ", uid, ": copying the shared block of group ", c.group,
                   ": ", c.status.message())};
  }
  // Nothing fails from here on.
  for (int g = 0; g < num_groups(); ++g) {
    if (copies[g] == kNoBlock) continue;
    BlockId& entry = seq->groups_[g].row[block_sizes_[g].Index(end)];
    const Status released = pools_[g].Release(std::span(&entry, 1));
    BLOCKKV_CHECK(released.ok(), "Rollback: a sequence held a block without a reference");
    entry = copies[g];
    seq->table_version_ = ++last_table_version_;
  }
  TrimTo(*seq, end);
  seq->seen_tokens_ = end;
  // What it still holds of its prefix hit (a snapshot checks cached <= seen).
  seq->cached_prefix_tokens_ = std::min(seq->cached_prefix_tokens_, end);
  return Status::Ok();
}

}  // namespace blockkv
