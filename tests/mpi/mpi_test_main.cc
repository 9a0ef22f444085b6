// SPDX-License-Identifier: Apache-2.0
// main() for the MPI tests: every rank runs the same GoogleTest program under mpirun.
//
// MPI is initialised here, as an engine would, and finalised after the last test. Rank 0 prints
// GoogleTest's usual report; the other ranks print only their failures, each line prefixed with
// the rank, so a failure on rank 2 is visible without three interleaved reports. Every rank exits
// with the worst result of all ranks.
#include <mpi.h>

#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "blockkv/log.h"

namespace {

class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}

  // The name is kept here: asking UnitTest for the current test inside OnTestPartResult
  // deadlocks on GoogleTest's own mutex.
  void OnTestStart(const testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }

  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::printf("[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(),
                result.file_name() != nullptr ? result.file_name() : "?", result.line_number(),
                result.summary());
    std::fflush(stdout);
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);  // one info line per cache per rank is noise
  if (rank != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int result = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != 0 && result == 0) {
    std::printf("[rank 0] passed, but another rank failed (see its [rank N] lines)\n");
  }
  MPI_Finalize();
  return worst;
}
