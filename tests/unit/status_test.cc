// SPDX-License-Identifier: Apache-2.0
// Status, Result<T> and the BLOCKKV_RETURN_IF_ERROR / BLOCKKV_ASSIGN_OR_RETURN macros.
#include "blockkv/status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::HasSubstr;

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_EQ(Status::Ok(), s);
}

TEST(StatusTest, OkCodeDropsTheMessage) {
  Status s(StatusCode::kOk, "ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s, Status::Ok());
}

TEST(StatusTest, FactoriesSetTheirCodes) {
  const std::vector<std::pair<Status, StatusCode>> cases = {
      {InvalidArgumentError("m"), StatusCode::kInvalidArgument},
      {OutOfRangeError("m"), StatusCode::kOutOfRange},
      {ResourceExhaustedError("m"), StatusCode::kResourceExhausted},
      {FailedPreconditionError("m"), StatusCode::kFailedPrecondition},
      {NotFoundError("m"), StatusCode::kNotFound},
      {AlreadyExistsError("m"), StatusCode::kAlreadyExists},
      {DataLossError("m"), StatusCode::kDataLoss},
      {UnavailableError("m"), StatusCode::kUnavailable},
      {UnimplementedError("m"), StatusCode::kUnimplemented},
      {InternalError("m"), StatusCode::kInternal},
      {PermissionDeniedError("m"), StatusCode::kPermissionDenied},
  };
  for (const auto& [status, code] : cases) {
    EXPECT_FALSE(status.ok());
    EXPECT_EQ(status.code(), code);
    EXPECT_EQ(status.message(), "m");
  }
}

TEST(StatusTest, CodeNamesAreAbslSpellings) {
  EXPECT_EQ(StatusCodeName(StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeName(StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeName(StatusCode::kOutOfRange), "OUT_OF_RANGE");
  EXPECT_EQ(StatusCodeName(StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(StatusCode::kFailedPrecondition), "FAILED_PRECONDITION");
  EXPECT_EQ(StatusCodeName(StatusCode::kNotFound), "NOT_FOUND");
  EXPECT_EQ(StatusCodeName(StatusCode::kAlreadyExists), "ALREADY_EXISTS");
  EXPECT_EQ(StatusCodeName(StatusCode::kDataLoss), "DATA_LOSS");
  EXPECT_EQ(StatusCodeName(StatusCode::kUnavailable), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeName(StatusCode::kUnimplemented), "UNIMPLEMENTED");
  EXPECT_EQ(StatusCodeName(StatusCode::kInternal), "INTERNAL");
  EXPECT_EQ(StatusCodeName(StatusCode::kPermissionDenied), "PERMISSION_DENIED");
}

TEST(StatusTest, ToStringAndStreamShowCodeAndMessage) {
  Status s = ResourceExhaustedError("cannot allocate 17 blocks: 16 free");
  EXPECT_EQ(s.ToString(), "RESOURCE_EXHAUSTED: cannot allocate 17 blocks: 16 free");
  std::ostringstream os;
  os << s << " | " << StatusCode::kOutOfRange << " | " << Status::Ok();
  EXPECT_EQ(os.str(), "RESOURCE_EXHAUSTED: cannot allocate 17 blocks: 16 free | OUT_OF_RANGE | OK");
}

TEST(StatusTest, EqualityComparesCodeAndMessage) {
  EXPECT_EQ(NotFoundError("a"), NotFoundError("a"));
  EXPECT_FALSE(NotFoundError("a") == NotFoundError("b"));
  EXPECT_FALSE(NotFoundError("a") == InternalError("a"));
}

TEST(ResultTest, HoldsAValue) {
  Result<int> r = 42;
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), 42);
  EXPECT_EQ(*r, 42);
  EXPECT_TRUE(r.status().ok());
  *r = 7;
  EXPECT_EQ(r.value(), 7);
}

TEST(ResultTest, HoldsAnError) {
  Result<int> r = OutOfRangeError("index 9 of 4");
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r.status().message(), "index 9 of 4");
}

TEST(ResultTest, ArrowAndMoveOnlyValues) {
  Result<std::string> s = std::string("abc");
  EXPECT_EQ(s->size(), 3u);
  Result<std::unique_ptr<int>> p = std::make_unique<int>(5);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> taken = *std::move(p);
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(*taken, 5);
}

TEST(ResultTest, ConvertsFromConstructibleValues) {
  Result<std::vector<int>> r = std::vector<int>{1, 2, 3};
  EXPECT_EQ(r->size(), 3u);
  Result<std::string> s = "literal";  // const char* → std::string
  EXPECT_EQ(*s, "literal");
}

Status FailIf(bool fail) { return fail ? DataLossError("bad") : Status::Ok(); }

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd " + std::to_string(x));
  return x / 2;
}

Status Chain(bool fail, int* reached) {
  BLOCKKV_RETURN_IF_ERROR(FailIf(fail));
  *reached = 1;
  return Status::Ok();
}

Result<int> Quarter(int x, int* reached) {
  BLOCKKV_ASSIGN_OR_RETURN(int half, Half(x));
  *reached = 1;
  BLOCKKV_ASSIGN_OR_RETURN(const int quarter, Half(half));
  *reached = 2;
  return quarter;
}

TEST(StatusMacrosTest, ReturnIfErrorPropagatesAndStops) {
  int reached = 0;
  Status s = Chain(true, &reached);
  EXPECT_EQ(s, DataLossError("bad"));
  EXPECT_EQ(reached, 0);
  EXPECT_OK(Chain(false, &reached));
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesAndAssigns) {
  int reached = 0;
  Result<int> r = Quarter(8, &reached);
  ASSERT_OK(r);
  EXPECT_EQ(*r, 2);
  EXPECT_EQ(reached, 2);

  reached = 0;
  r = Quarter(7, &reached);
  EXPECT_EQ(r.status(), InvalidArgumentError("odd 7"));
  EXPECT_EQ(reached, 0);

  r = Quarter(6, &reached);
  EXPECT_EQ(r.status(), InvalidArgumentError("odd 3"));
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturnMovesTheValue) {
  auto make = []() -> Result<std::unique_ptr<int>> { return std::make_unique<int>(3); };
  auto use = [&]() -> Result<int> {
    BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<int> p, make());
    return *p + 1;
  };
  Result<int> r = use();
  ASSERT_OK(r);
  EXPECT_EQ(*r, 4);
}

TEST(ResultDeathTest, ValueOfAnErrorAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Result<int> r = NotFoundError("no such sequence 12");
  EXPECT_DEATH((void)r.value(), "value\\(\\) of a failed Result.*NOT_FOUND: no such sequence 12");
  EXPECT_DEATH((void)*r, "failed Result");
}

TEST(ResultDeathTest, ConstructionFromOkStatusAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Result<int> r{Status::Ok()};
        (void)r;
      },
      "OK status");
}

}  // namespace
}  // namespace blockkv
