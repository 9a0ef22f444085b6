// SPDX-License-Identifier: Apache-2.0
// StateManager::SequenceKeys, shared by state_manager.cc (which owns the array) and
// state_manager_prefix.cc (which uses it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "blockkv/state_manager.h"
#include "state_manager_impl.h"

namespace blockkv {

// What the manager knows of a sequence's tokens, by tracking slot.
struct StateManager::Impl::SequenceKeys {
  using Published = PrefixCache::Published;
  struct Group {
    int32_t published = 0;  // leading blocks cached (hit or published by this sequence)
    Published last;         // the publish of block published − 1
  };
  bool registered = false;  // added with AddSequence: tokens are known
  bool looked_up = false;   // its first Schedule happened
  int32_t ns_id = 0;
  int32_t priority = kDefaultRetentionPriority;
  std::vector<TokenId> tokens;  // prompt + appended tokens, from position 0
  BlockKeyExtras extras;
  std::vector<Group> groups;  // [num_groups]; a STATE group's stays {0, {}}
  // A STATE group's checkpoints (state_manager_prefix.cc): the key of the prefix of
  // `chunks` whole checkpoint intervals (a cache of the chain, rebuilt from `tokens` when 0), and
  // how many intervals the latest checkpoint this sequence saved or resumed from covers.
  int32_t chunks = 0;
  BlockHash chunk_key;
  int32_t checkpointed = 0;
  // The remote tier's fetch ahead (FetchRemotePrefix) of blocks [prefetch_first, ...), until the
  // first Schedule takes it.
  std::shared_ptr<internal::RemoteFetchJob> prefetch;
  int32_t prefetch_first = 0;
  // AgreeRemotePrefix: the leading blocks of group 0 its first Schedule may take (the hit every
  // tensor-parallel rank holds); -1: not agreed. Forgotten with the fetch ahead.
  int32_t agreed = -1;
  int32_t offered = 0;  // what this rank offered (RemotePrefixOffer), to count a cut as a miss
};

}  // namespace blockkv
