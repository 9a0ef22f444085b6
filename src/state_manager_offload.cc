// SPDX-License-Identifier: Apache-2.0
// StateManager's preemption through the offload tiers: PreemptSequence, ResumeSequence, and the
// waits the rest of the manager does for a resume in flight. The store is in offload.cc.
#include <algorithm>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/check.h"
#include "internal/strings.h"
#include "internal/uid_map.h"
#include "prefix_host_tier.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"
#include "state_manager_offload.h"

namespace blockkv {

using internal::StrCat;

void StateManager::Impl::PoolOwner::Release(int group, std::span<const BlockId> blocks) {
  const Status released = (*pools_)[group].Release(blocks);
  BLOCKKV_CHECK(released.ok(), "the offload store gave back a block it held no reference to");
}

// The parameters are OffloadStore::BlockOwner's (offload.h), which this overrides.
// NOLINTNEXTLINE(bugprone-easily-swappable-parameters)
Status StateManager::Impl::PoolOwner::Adopt(int group, std::span<const BlockId> blocks,
                                            std::span<const int32_t> store_holds) {
  const BlockPool& pool = (*pools_)[group];
  for (const BlockId b : blocks) {
    if (pool.ref_count(b) <= store_holds[b]) {
      return FailedPreconditionError(StrCat("Offload: block ", b, " of group ", group, " has ",
                                            pool.ref_count(b), " references, all the store's"));
    }
  }
  return Status::Ok();
}

Status StateManager::Impl::EnableOffload() {
  pool_owner_ = std::make_unique<PoolOwner>(&pools_);
  Result<std::unique_ptr<OffloadStore>> store =
      OffloadStore::Create(cache_.get(), config_.offload_config, pool_owner_.get());
  if (!store.ok()) {
    return {store.status().code(),
            StrCat("StateManagerConfig.offload_config: ", store.status().message())};
  }
  offload_ = std::move(*store);
  parked_ = std::make_unique<Parked[]>(static_cast<size_t>(config_.max_tracked_sequences));
  // Promotion continues a run of whole blocks, which needs one group without a window.
  if (prefix_ != nullptr && num_groups() == 1 && SlidingWindow(0) == 0) {
    host_prefix_ = std::make_unique<internal::PrefixHostTier>(prefix_.get(), offload_.get(),
                                                              std::span<BlockPool>(pools_));
  }
  return Status::Ok();
}

StateManager::HostPrefixStats StateManager::Impl::host_prefix_stats() const {
  if (host_prefix_ == nullptr) return {};
  const internal::PrefixHostTier::Stats& s = host_prefix_->stats();
  return {.entries = host_prefix_->size(),
          .demoted = s.demoted,
          .promoted = s.promoted,
          .dropped = s.dropped};
}

Result<OffloadTicket> StateManager::Impl::PreemptSequence(SeqId uid) {
  if (offload_ == nullptr) {
    return FailedPreconditionError(
        StrCat("PreemptSequence(", uid, "): offload is off (StateManagerConfig.offload)"));
  }
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("PreemptSequence: sequence ", uid, " is not tracked"));
  }
  if (seq->preempted_) {
    return FailedPreconditionError(
        StrCat("PreemptSequence: sequence ", uid, " is preempted already"));
  }
  if (seq->exported_ || seq->importing_) {
    return FailedPreconditionError(
        StrCat("PreemptSequence: sequence ", uid,
               seq->exported_ ? " is exported to another engine; CancelExport it first"
                              : " is being imported; CompleteImports first"));
  }
  BLOCKKV_RETURN_IF_ERROR(SettleRestore(*seq));
  if (seq->in_flight_tokens_ != 0) {
    return FailedPreconditionError(StrCat("PreemptSequence: sequence ", uid, " has ",
                                          seq->in_flight_tokens_,
                                          " tokens in flight; preempt after PostForward"));
  }
  // Each group's blocks go to the host tier, or to the disk when the host tier is full.
  const int groups = num_groups();
  std::vector<Tier> tiers(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    const auto held = static_cast<int32_t>(seq->groups_[g].held().size());
    // Cached blocks on the host level make room for a preempted sequence.
    const int32_t room =
        offload_->free_host_blocks(g) + (host_prefix_ != nullptr ? host_prefix_->droppable(g) : 0);
    if (room >= held) {
      tiers[g] = Tier::kHost;
    } else if (offload_->free_disk_blocks(g) >= held) {
      tiers[g] = Tier::kDisk;
    } else {
      return ResourceExhaustedError(
          StrCat("PreemptSequence: sequence ", uid, " holds ", held, " blocks of group ", g,
                 "; the host tier has ", offload_->free_host_blocks(g), " free and the disk tier ",
                 offload_->free_disk_blocks(g)));
    }
  }
  Parked& parked = parked_[seq->slot_];
  parked.counts.assign(static_cast<size_t>(groups), 0);
  parked.handles.clear();
  OffloadTicket ticket;
  for (int g = 0; g < groups; ++g) {
    const std::span<BlockId> held = seq->groups_[g].held();
    parked.counts[g] = static_cast<int32_t>(held.size());
    if (tiers[g] == Tier::kHost && host_prefix_ != nullptr) {
      host_prefix_->MakeRoom(g, parked.counts[g]);
    }
    const size_t first = parked.handles.size();
    parked.handles.resize(first + held.size());
    Result<OffloadTicket> copied =
        offload_->Offload(held, g, std::span(parked.handles).subspan(first), tiers[g]);
    BLOCKKV_CHECK(copied.ok(), "PreemptSequence: an offload that was checked failed");
    Result<OffloadTicket> joined = OffloadTicket::Join(ticket, *copied);
    BLOCKKV_CHECK(joined.ok(), "PreemptSequence: tickets of one store did not join");
    ticket = *joined;
    // The store holds the sequence's references now.
    std::fill(held.begin(), held.end(), kNoBlock);
  }
  if (prefix_ != nullptr) {
    // Its blocks are no longer cached blocks of its own: publishing starts again from block 0
    // once it is resumed (the restored copies are published as duplicates of their keys).
    // A group with released leading entries publishes nothing more (its chain would start at a
    // released block): nothing is left of its last publish either.
    for (SequenceKeys::Group& keys : keys_[seq->slot_].groups) keys = {};
  }
  seq->preempted_ = true;
  seq->table_version_ = ++last_table_version_;
  return ticket;
}

Result<OffloadTicket> StateManager::Impl::ResumeSequence(SeqId uid) {
  if (offload_ == nullptr) {
    return FailedPreconditionError(
        StrCat("ResumeSequence(", uid, "): offload is off (StateManagerConfig.offload)"));
  }
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("ResumeSequence: sequence ", uid, " is not tracked"));
  }
  if (!seq->preempted_) {
    return FailedPreconditionError(StrCat("ResumeSequence: sequence ", uid, " is not preempted"));
  }
  Parked& parked = parked_[seq->slot_];
  // Fresh blocks are needed only for handles on the host or disk: a handle whose offload failed
  // (the disk full) still holds its device block and comes back without a copy. (Counted from
  // what the store has applied so far, before Restore applies the copies done since.)
  // Groups sharing a memory pool need their blocks from one total (at the pool's lead group).
  size_t next = 0;
  std::vector<int32_t> need(static_cast<size_t>(num_groups()), 0);
  for (int g = 0; g < num_groups(); ++g) {
    int32_t& pool_need = need[static_cast<size_t>(pool_lead_[g])];
    for (int32_t i = 0; i < parked.counts[g]; ++i) {
      const Result<Tier> where = offload_->tier(parked.handles[next++]);
      pool_need += static_cast<int32_t>(!where.ok() || *where != Tier::kDevice);
    }
    if (pools_[g].free_blocks() < pool_need) {
      return ResourceExhaustedError(
          StrCat("ResumeSequence: sequence ", uid, " needs ", pool_need, " blocks of group ", g,
                 SharesPool(g) ? " (and the groups sharing its pool before it)" : "", ", ",
                 pools_[g].free_blocks(), " are free"));
    }
  }
  std::vector<BlockId>& blocks = tail_scratch_;
  blocks.resize(parked.handles.size());
  Result<OffloadTicket> copied = offload_->Restore(parked.handles, OffloadStore::kAnyGroup, blocks);
  if (!copied.ok()) return copied.status();  // nothing changed
  next = 0;
  for (int g = 0; g < num_groups(); ++g) {
    const std::span<BlockId> held = seq->groups_[g].held();
    std::copy_n(blocks.begin() + static_cast<std::ptrdiff_t>(next), held.size(), held.begin());
    next += held.size();
  }
  parked.restore = *copied;
  parked.resuming = true;
  ++resuming_;
  seq->preempted_ = false;
  seq->table_version_ = ++last_table_version_;
  return *copied;
}

Status StateManager::Impl::SettleRestore(Sequence& seq) {
  if (parked_ == nullptr) return Status::Ok();
  Parked& parked = parked_[seq.slot_];
  if (!parked.resuming) return Status::Ok();
  const Status copied = parked.restore.Wait();
  parked.resuming = false;
  --resuming_;
  if (copied.ok()) {
    parked.handles.clear();
    if (prefix_ != nullptr) PublishFullBlocks(seq);  // the contents are there now
    return Status::Ok();
  }
  // The copy failed: its handles are kept, its blocks hold nothing. Park it again.
  for (int g = 0; g < num_groups(); ++g) {
    const std::span<BlockId> held = seq.groups_[g].held();
    const Status released = pools_[g].Release(held);
    BLOCKKV_CHECK(released.ok(), "a resumed sequence held a block without a reference");
    std::fill(held.begin(), held.end(), kNoBlock);
  }
  seq.preempted_ = true;
  seq.table_version_ = ++last_table_version_;
  return {copied.code(), StrCat("sequence ", seq.uid_,
                                " could not be resumed, it stays preempted: ", copied.message())};
}

Status StateManager::Impl::RequireResident(Sequence& seq, std::string_view who) {
  BLOCKKV_RETURN_IF_ERROR(SettleRestore(seq));
  if (seq.preempted_) {
    return FailedPreconditionError(StrCat(who, " is preempted; resume it first"));
  }
  if (seq.exported_) {
    return FailedPreconditionError(
        StrCat(who, " is exported to another engine; CancelExport it first"));
  }
  if (seq.importing_) {
    return FailedPreconditionError(StrCat(who, " is being imported; CompleteImports first"));
  }
  return Status::Ok();
}

bool StateManager::Impl::RestoreDone(Sequence& seq) {
  if (parked_ == nullptr || !parked_[seq.slot_].resuming) return true;
  OffloadTicket& restore = parked_[seq.slot_].restore;
  if (!restore.Poll() || !restore.Wait().ok()) return false;
  return SettleRestore(seq).ok();
}

Status StateManager::Impl::SettleRestores(std::span<const SeqId> uids) {
  if (resuming_ == 0) return Status::Ok();
  for (const SeqId uid : uids) {
    if (Sequence* seq = Find(uid)) BLOCKKV_RETURN_IF_ERROR(SettleRestore(*seq));
  }
  return Status::Ok();
}

void StateManager::Impl::DropParked(Sequence& seq) {
  if (parked_ == nullptr) return;
  SettleRestore(seq).IgnoreError();  // a failed resume parks it again: dropped below
  Parked& parked = parked_[seq.slot_];
  if (!seq.preempted_) return;
  const Status dropped = offload_->Drop(parked.handles);
  BLOCKKV_CHECK(dropped.ok(), "a preempted sequence's handles were not live");
  parked.handles.clear();
  for (int g = 0; g < num_groups(); ++g) {
    seq.groups_[g].allocated = seq.groups_[g].released = 0;
  }
  seq.preempted_ = false;
}

Status StateManager::Impl::CheckParked(const Sequence& seq, int group) const {
  const Parked* parked = parked_ == nullptr ? nullptr : &parked_[seq.slot_];
  const bool has_handles = parked != nullptr && !parked->handles.empty();
  if (!seq.preempted_) {
    if (has_handles && !parked->resuming) {
      return InternalError(StrCat("sequence ", seq.uid_, " is not preempted but has ",
                                  parked->handles.size(), " offload handles"));
    }
    return Status::Ok();
  }
  const auto entries = static_cast<int32_t>(seq.groups_[group].held().size());
  if (parked == nullptr || parked->counts.size() != static_cast<size_t>(num_groups()) ||
      parked->counts[group] != entries) {
    return InternalError(StrCat("preempted sequence ", seq.uid_, " group ", group, ": ", entries,
                                " table entries but ",
                                parked == nullptr ? 0 : parked->counts[group], " handles"));
  }
  size_t first = 0;
  for (int g = 0; g < group; ++g) first += static_cast<size_t>(parked->counts[g]);
  for (int32_t i = 0; i < parked->counts[group]; ++i) {
    if (!offload_->tier(parked->handles[first + static_cast<size_t>(i)]).ok()) {
      return InternalError(StrCat("preempted sequence ", seq.uid_, " group ", group, ": handle ", i,
                                  " is not live"));
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
