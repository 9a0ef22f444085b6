// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator over MPI_COMM_WORLD and sub-communicators, on every rank of an mpirun.
#include "blockkv/mpi_communicator.h"

#include <mpi.h>

#include <cstdint>
#include <limits>

#include <gtest/gtest.h>

#include "mpi_test_util.h"

namespace blockkv {
namespace {

using ::blockkv::testing::WorldRank;
using ::blockkv::testing::WorldSize;

TEST(MpiCommunicatorTest, RankAndWorldSizeAreMpis) {
  Result<std::unique_ptr<MpiCommunicator>> comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->world_size(), WorldSize());
  EXPECT_EQ((*comm)->rank(), WorldRank());
  EXPECT_EQ((*comm)->comm(), MPI_COMM_WORLD);
  EXPECT_GE(WorldSize(), 2) << "run these tests under mpirun -np 2 or more";
}

TEST(MpiCommunicatorTest, AllReduceMinGivesTheMinimumOnEveryRank) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int rank = WorldRank();
  const int size = WorldSize();
  // The smallest value is on the last rank, so it is not rank 0's own value.
  Result<int64_t> min = (*comm)->AllReduceMin(1000 - 7 * rank);
  ASSERT_TRUE(min.ok()) << min.status();
  EXPECT_EQ(*min, 1000 - 7 * (size - 1));
}

TEST(MpiCommunicatorTest, AllReduceMinKeepsAll64Bits) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int64_t big = int64_t{1} << 40;
  Result<int64_t> min = (*comm)->AllReduceMin(big + WorldRank());
  ASSERT_TRUE(min.ok()) << min.status();
  EXPECT_EQ(*min, big);

  const int64_t lowest = std::numeric_limits<int64_t>::min();
  min = (*comm)->AllReduceMin(WorldRank() == WorldSize() - 1 ? lowest : 5);
  ASSERT_TRUE(min.ok()) << min.status();
  EXPECT_EQ(*min, lowest);
}

TEST(MpiCommunicatorTest, BarrierReturnsOk) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  for (int i = 0; i < 10; ++i) ASSERT_TRUE((*comm)->Barrier().ok());
}

TEST(MpiCommunicatorTest, SelfIsAWorldOfOne) {
  auto comm = MpiCommunicator::Create(MPI_COMM_SELF);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->world_size(), 1);
  EXPECT_EQ((*comm)->rank(), 0);
  EXPECT_EQ(*(*comm)->AllReduceMin(42 + WorldRank()), 42 + WorldRank());
  EXPECT_TRUE((*comm)->Barrier().ok());
}

// A tensor-parallel group is usually a sub-communicator: even and odd world ranks here.
TEST(MpiCommunicatorTest, ReducesWithinASplitCommunicator) {
  const int rank = WorldRank();
  MPI_Comm half = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half), MPI_SUCCESS);
  {
    auto comm = MpiCommunicator::Create(half);
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ((*comm)->rank(), rank / 2);
    Result<int64_t> min = (*comm)->AllReduceMin(100 - rank);
    ASSERT_TRUE(min.ok()) << min.status();
    // Largest world rank with the same parity as this one.
    int last = WorldSize() - 1;
    if (last % 2 != rank % 2) --last;
    EXPECT_EQ(*min, 100 - last);
  }
  MPI_Comm_free(&half);
}

TEST(MpiCommunicatorTest, NullCommunicatorIsInvalidArgument) {
  auto comm = MpiCommunicator::Create(MPI_COMM_NULL);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(comm.status().message().find("MPI_COMM_NULL"), std::string::npos);
}

}  // namespace
}  // namespace blockkv
