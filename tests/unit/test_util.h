// SPDX-License-Identifier: Apache-2.0
// Helpers shared by blockkv's unit tests: assertions on Status and Result<T>, and MODEL_CHECK for
// the model-based tests' comparisons.
#pragma once

#include <gtest/gtest.h>

#include <utility>

#include "blockkv/status.h"

namespace blockkv_test {

inline blockkv::Status ToStatus(const blockkv::Status& status) { return status; }
template <class T>
blockkv::Status ToStatus(const blockkv::Result<T>& result) {
  return result.status();
}

}  // namespace blockkv_test

// Assertions on a Status or Result<T>; like gtest's, they take more message with <<.
//   ASSERT_OK(allocator.Free(ids)) << "step " << step;
//   EXPECT_CODE(allocator.Allocate(-1), StatusCode::kInvalidArgument);
#define BLOCKKV_TEST_STATUS_CHECK_(expr, condition, fail)                                         \
  GTEST_AMBIGUOUS_ELSE_BLOCKER_                                                                   \
  if (const ::blockkv::Status blockkv_test_status_ = ::blockkv_test::ToStatus(expr); condition) { \
  } else                                                                                          \
    fail() << #expr << " gave " << blockkv_test_status_ << ". "

#define ASSERT_OK(expr) BLOCKKV_TEST_STATUS_CHECK_(expr, blockkv_test_status_.ok(), GTEST_FAIL)
#define EXPECT_OK(expr) BLOCKKV_TEST_STATUS_CHECK_(expr, blockkv_test_status_.ok(), ADD_FAILURE)
#define ASSERT_CODE(expr, expected_code)                                                       \
  BLOCKKV_TEST_STATUS_CHECK_(expr, blockkv_test_status_.code() == (expected_code), GTEST_FAIL) \
      << "Expected " << (expected_code) << ". "
#define EXPECT_CODE(expr, expected_code)                                                        \
  BLOCKKV_TEST_STATUS_CHECK_(expr, blockkv_test_status_.code() == (expected_code), ADD_FAILURE) \
      << "Expected " << (expected_code) << ". "

// In a function returning ::testing::AssertionResult (a model test's comparison): fails with the
// condition and whatever is streamed after it.
//   MODEL_CHECK(seq.seen == want.seen) << "sequence " << uid;
#define MODEL_CHECK(condition) \
  if (condition) {             \
  } else                       \
    return ::testing::AssertionFailure() << "(" #condition ") is false: "
