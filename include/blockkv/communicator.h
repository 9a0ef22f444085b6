// SPDX-License-Identifier: Apache-2.0
// Communicator: the collectives blockkv needs from an engine's tensor-parallel group, so that
// every rank plans the KV cache against the same capacity.
//
// blockkv never creates a world behind the caller's back: an engine that runs several ranks
// wraps the communicator it already has (MPI_Comm, ncclComm_t) and passes it in.
//
// Collectives are blocking and must be entered by every rank of the group in the same order.
#pragma once

#include <cstdint>

#include "blockkv/status.h"

namespace blockkv {

class Communicator {
 public:
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  virtual int world_size() const = 0;
  virtual int rank() const = 0;
  // The minimum of `value` over all ranks, returned on every rank.
  virtual Result<int64_t> AllReduceMin(int64_t value) = 0;
  // Returns once every rank has entered it.
  virtual Status Barrier() = 0;
};

// A world of one: AllReduceMin returns its argument, Barrier returns at once.
class LocalCommunicator final : public Communicator {
 public:
  int world_size() const override { return 1; }
  int rank() const override { return 0; }
  Result<int64_t> AllReduceMin(int64_t value) override { return value; }
  Status Barrier() override { return Status::Ok(); }
};

}  // namespace blockkv
