// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator: a Communicator over an MPI communicator the caller already has.
//
//   MPI_Init(&argc, &argv);                     // the caller initialises MPI, never blockkv
//   Result<std::unique_ptr<MpiCommunicator>> comm = MpiCommunicator::Create(tp_group_comm);
//   auto cache = BlockedKVCache::Create(configs, memory, *CudaDevice(local_rank), comm->get());
//   ...                                         // destroy blockkv objects, then MPI_Finalize()
//
// This header includes <mpi.h>, which is why it is separate from communicator.h: code that does
// not use MPI never needs MPI's headers. It exists only when blockkv was built with MPI
// (BLOCKKV_MPI=AUTO found it, or ON); otherwise including it is a compile-time error, not a link
// error.
//
// The wrapped MPI_Comm is borrowed: blockkv does not duplicate it, free it, or change its error
// handler. Consequences for the caller:
// - Collectives run on that communicator itself, so the caller must not run other collectives
//   on it concurrently from another thread (MPI requires every rank to order collectives on a
//   communicator the same way). Pass an MPI_Comm_dup of it to keep blockkv's traffic apart.
// - MPI errors come back as a Status only if the communicator's error handler is
//   MPI_ERRORS_RETURN; under MPI's default, MPI_ERRORS_ARE_FATAL, MPI aborts the job instead.
#pragma once

#if !defined(BLOCKKV_HAVE_MPI)
#error \
    "blockkv was built without MPI: reconfigure with BLOCKKV_MPI=ON (apt-get install libopenmpi-dev openmpi-bin)"
#endif

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <span>

#include "blockkv/communicator.h"
#include "blockkv/status.h"

namespace blockkv {

class MpiCommunicator final : public Communicator {
 public:
  // Wraps `comm`, an intra-communicator. kFailedPrecondition when MPI is not initialised or
  // already finalised; kInvalidArgument for MPI_COMM_NULL or an inter-communicator; kInternal
  // with MPI's error string when MPI fails. REQUIRES: `comm` outlives the MpiCommunicator.
  static Result<std::unique_ptr<MpiCommunicator>> Create(MPI_Comm comm);

  int world_size() const override { return world_size_; }
  int rank() const override { return rank_; }
  // MPI_Allreduce of one MPI_INT64_T with MPI_MIN. kFailedPrecondition after MPI_Finalize;
  // kInternal with MPI's error string when MPI fails.
  Result<int64_t> AllReduceMin(int64_t value) override;
  // One MPI_Allreduce(MPI_IN_PLACE, MPI_MIN) of all of `values`; errors as AllReduceMin.
  Status AllReduceMinEach(std::span<int64_t> values) override;
  // MPI_Barrier; errors as AllReduceMin.
  Status Barrier() override;

  MPI_Comm comm() const { return comm_; }

 private:
  MpiCommunicator(MPI_Comm comm, int world_size, int rank)
      : comm_(comm), world_size_(world_size), rank_(rank) {}

  MPI_Comm comm_;
  int world_size_;
  int rank_;
};

}  // namespace blockkv
