// SPDX-License-Identifier: Apache-2.0
// StateManager's offload types, shared by state_manager.cc (which owns them) and
// state_manager_offload.cc (which uses them).
#pragma once

#include <cstdint>
#include <vector>

#include "blockkv/offload.h"
#include "blockkv/state_manager.h"
#include "state_manager_impl.h"

namespace blockkv {

// Device blocks for the offload store come from, and go back to, the manager's pools: a block
// being offloaded keeps the sequence's reference until its copy is done.
class StateManager::Impl::PoolOwner final : public OffloadStore::BlockOwner {
 public:
  explicit PoolOwner(std::vector<BlockPool>* pools) : pools_(pools) {}
  Status Take(int group, std::span<BlockId> out) override {
    return (*pools_)[group].Take(static_cast<int32_t>(out.size()), out);
  }
  void Release(int group, std::span<const BlockId> blocks) override;
  // The caller holds a reference beyond the store's: pools count one per holder.
  Status Adopt(int group, std::span<const BlockId> blocks,
               std::span<const int32_t> store_holds) override;
  void GiveBack(int /*group*/, std::span<const BlockId> /*blocks*/) override {}  // references move

 private:
  std::vector<BlockPool>* pools_;
};

// A preempted sequence's handles (or a resuming one's, until its copy settles), by slot.
struct StateManager::Impl::Parked {
  std::vector<OffloadHandle> handles;  // group after group, table order within a group
  std::vector<int32_t> counts;         // [num_groups]: handles of each group
  OffloadTicket restore;               // the resume copy, while `resuming`
  bool resuming = false;
};

}  // namespace blockkv
