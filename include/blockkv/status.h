// SPDX-License-Identifier: Apache-2.0
// Status and Result<T>: how every blockkv operation that can fail reports it.
//
// blockkv throws no exceptions. An operation a caller can make fail (bad input, too little
// memory, an unknown id) returns a Status or a Result<T>; a failed call has changed nothing.
// What only a bug inside blockkv can cause is checked with BLOCKKV_CHECK, which aborts.
//
//   Result<std::vector<BlockId>> blocks = allocator.Allocate(4);
//   if (!blocks.ok()) return blocks.status();   // e.g. kResourceExhausted
//   Use(*blocks);
//
// Codes are chosen for what the caller can do next:
//   kInvalidArgument    the arguments are wrong whatever the state (fix the call)
//   kOutOfRange         an index or id outside its valid range
//   kResourceExhausted  not enough blocks / memory now (free something, retry later)
//   kFailedPrecondition the state does not allow it (e.g. freeing a block that is free)
//   kPermissionDenied   the process may not open or write a file it was given (fix the path or
//                       its permissions)
//   kNotFound, kAlreadyExists, kDataLoss, kUnavailable, kUnimplemented, kInternal
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace blockkv {

enum class StatusCode {
  kOk,
  kInvalidArgument,
  kOutOfRange,
  kResourceExhausted,
  kFailedPrecondition,
  kNotFound,
  kAlreadyExists,
  kDataLoss,
  kUnavailable,
  kUnimplemented,
  kInternal,
  kPermissionDenied,  // last: the codes before it keep their values
};

// "OK", "INVALID_ARGUMENT", ... as absl spells them.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);
  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // Empty for OK.
  const std::string& message() const;
  // "RESOURCE_EXHAUSTED: cannot allocate 17 blocks: 16 free", or "OK".
  std::string ToString() const;

  // Explicitly drops a status the caller has decided not to look at.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message() == b.message();
  }

 private:
  // An OK status is one word and a null pointer, so returning one costs nothing; only an error
  // allocates its message.
  StatusCode code_ = StatusCode::kOk;
  std::unique_ptr<std::string> message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);
std::ostream& operator<<(std::ostream& os, StatusCode code);

Status InvalidArgumentError(std::string message);
Status OutOfRangeError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status DataLossError(std::string message);
Status UnavailableError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status PermissionDeniedError(std::string message);

// Either a T or a non-OK Status. Accessing the value of a failed Result aborts.
template <class T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> is meaningless");

 public:
  // A non-OK status; constructing from an OK status is a bug and aborts.
  Result(Status status) : rep_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(rep_).ok()) FailOkStatus();
  }
  Result(const T& value) : rep_(value) {}        // NOLINT(google-explicit-constructor)
  Result(T&& value) : rep_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  template <class U,
            class = std::enable_if_t<
                std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, Status> &&
                !std::is_same_v<std::decay_t<U>, T> && !std::is_same_v<std::decay_t<U>, Result>>>
  Result(U&& value) : rep_(std::in_place_type<T>, std::forward<U>(value)) {}  // NOLINT

  bool ok() const { return std::holds_alternative<T>(rep_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(rep_); }

  T& value() & { return CheckedValue(), std::get<T>(rep_); }
  const T& value() const& { return CheckedValue(), std::get<T>(rep_); }
  T&& value() && { return CheckedValue(), std::move(std::get<T>(rep_)); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  [[noreturn]] static void FailOkStatus();
  void CheckedValue() const;

  std::variant<Status, T> rep_;
};

namespace internal {
[[noreturn]] void ResultFailure(const char* what, const Status* status);
}  // namespace internal

template <class T>
void Result<T>::FailOkStatus() {
  internal::ResultFailure("Result constructed from an OK status", nullptr);
}

template <class T>
void Result<T>::CheckedValue() const {
  if (!ok()) internal::ResultFailure("value() of a failed Result", &std::get<Status>(rep_));
}

}  // namespace blockkv

// Returns the status of `expr` from the enclosing function when it is not OK.
#define BLOCKKV_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::blockkv::Status blockkv_status_ = (expr);        \
    if (!blockkv_status_.ok()) return blockkv_status_; \
  } while (false)

#define BLOCKKV_CONCAT_INNER_(a, b) a##b
#define BLOCKKV_CONCAT_(a, b) BLOCKKV_CONCAT_INNER_(a, b)

// `BLOCKKV_ASSIGN_OR_RETURN(auto x, MakeX());` returns MakeX()'s status on failure.
#define BLOCKKV_ASSIGN_OR_RETURN(lhs, expr) \
  BLOCKKV_ASSIGN_OR_RETURN_IMPL_(BLOCKKV_CONCAT_(blockkv_result_, __LINE__), lhs, expr)
// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` may be a declaration such as `auto x`.
#define BLOCKKV_ASSIGN_OR_RETURN_IMPL_(result, lhs, expr) \
  auto result = (expr);                                   \
  if (!result.ok()) return result.status();               \
  lhs = std::move(result).value()
// NOLINTEND(bugprone-macro-parentheses)
