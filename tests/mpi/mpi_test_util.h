// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the MPI tests.
#pragma once

#include <mpi.h>

namespace blockkv::testing {

inline int WorldRank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline int WorldSize() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

}  // namespace blockkv::testing
