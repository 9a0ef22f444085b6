// SPDX-License-Identifier: Apache-2.0
#include "blockkv/mpi_communicator.h"

#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

namespace {

// kInternal "<what> failed: <MPI's error string> (MPI error <code>)".
Status MpiError(std::string_view what, int error) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(error, text, &length) != MPI_SUCCESS) length = 0;
  return InternalError(StrCat(what,
                              " failed: ", std::string_view(text, static_cast<size_t>(length)),
                              " (MPI error ", error, ")"));
}

// kFailedPrecondition unless MPI is initialised and not yet finalised; both queries are legal at
// any time.
Status CheckMpiIsRunning(std::string_view what) {
  int initialized = 0;
  int finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || initialized == 0) {
    return FailedPreconditionError(StrCat(
        what, ": MPI is not initialised; call MPI_Init first (blockkv never initialises MPI)"));
  }
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized != 0) {
    return FailedPreconditionError(StrCat(what, ": MPI has already been finalised"));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<MpiCommunicator>> MpiCommunicator::Create(MPI_Comm comm) {
  BLOCKKV_RETURN_IF_ERROR(CheckMpiIsRunning("MpiCommunicator::Create"));
  if (comm == MPI_COMM_NULL) {
    return InvalidArgumentError("MpiCommunicator::Create: the communicator is MPI_COMM_NULL");
  }
  int inter = 0;
  if (int error = MPI_Comm_test_inter(comm, &inter); error != MPI_SUCCESS) {
    return MpiError("MpiCommunicator::Create: MPI_Comm_test_inter", error);
  }
  if (inter != 0) {
    return InvalidArgumentError(
        "MpiCommunicator::Create: an inter-communicator has no single group to reduce over");
  }
  int size = 0;
  int rank = 0;
  if (int error = MPI_Comm_size(comm, &size); error != MPI_SUCCESS) {
    return MpiError("MpiCommunicator::Create: MPI_Comm_size", error);
  }
  if (int error = MPI_Comm_rank(comm, &rank); error != MPI_SUCCESS) {
    return MpiError("MpiCommunicator::Create: MPI_Comm_rank", error);
  }
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(comm, size, rank));
}

Result<int64_t> MpiCommunicator::AllReduceMin(int64_t value) {
  BLOCKKV_RETURN_IF_ERROR(CheckMpiIsRunning("MpiCommunicator::AllReduceMin"));
  int64_t min = 0;
  if (int error = MPI_Allreduce(&value, &min, 1, MPI_INT64_T, MPI_MIN, comm_);
      error != MPI_SUCCESS) {
    return MpiError(StrCat("MPI_Allreduce(MIN) on rank ", rank_, " of ", world_size_), error);
  }
  return min;
}

Status MpiCommunicator::AllReduceMinEach(std::span<int64_t> values) {
  BLOCKKV_RETURN_IF_ERROR(CheckMpiIsRunning("MpiCommunicator::AllReduceMinEach"));
  if (values.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return InvalidArgumentError(StrCat("MpiCommunicator::AllReduceMinEach: ", values.size(),
                                       " values, more than an MPI count holds"));
  }
  if (int error = MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                                MPI_INT64_T, MPI_MIN, comm_);
      error != MPI_SUCCESS) {
    return MpiError(
        StrCat("MPI_Allreduce(MIN) of ", values.size(), " on rank ", rank_, " of ", world_size_),
        error);
  }
  return Status::Ok();
}

Status MpiCommunicator::Barrier() {
  BLOCKKV_RETURN_IF_ERROR(CheckMpiIsRunning("MpiCommunicator::Barrier"));
  if (int error = MPI_Barrier(comm_); error != MPI_SUCCESS) {
    return MpiError(StrCat("MPI_Barrier on rank ", rank_, " of ", world_size_), error);
  }
  return Status::Ok();
}

}  // namespace blockkv
