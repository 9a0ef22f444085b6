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
#include <span>

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
  // The element-wise minimum of `values` over all ranks, in place, on every rank; every rank
  // passes as many values. This default runs AllReduceMin once per value (MpiCommunicator
  // overrides it with one MPI_Allreduce). On an error `values` is unspecified.
  virtual Status AllReduceMinEach(std::span<int64_t> values);
  // Returns once every rank has entered it.
  virtual Status Barrier() = 0;
};

// A world of one: AllReduceMin returns its argument, AllReduceMinEach and Barrier return at once.
class LocalCommunicator final : public Communicator {
 public:
  int world_size() const override { return 1; }
  int rank() const override { return 0; }
  Result<int64_t> AllReduceMin(int64_t value) override { return value; }
  Status AllReduceMinEach(std::span<int64_t> /*values*/) override { return Status::Ok(); }
  Status Barrier() override { return Status::Ok(); }
};

inline Status Communicator::AllReduceMinEach(std::span<int64_t> values) {
  for (int64_t& v : values) {
    Result<int64_t> min = AllReduceMin(v);
    if (!min.ok()) return min.status();
    v = *min;
  }
  return Status::Ok();
}

}  // namespace blockkv
