// SPDX-License-Identifier: Apache-2.0
#include "blockkv/status.h"

#include <cstdio>
#include <cstdlib>

#include "internal/check.h"

namespace blockkv {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kDataLoss:
      return "DATA_LOSS";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
  }
  return "UNKNOWN";
}

Status::Status(StatusCode code, std::string message) : code_(code) {
  // An OK status carries no message.
  if (code_ != StatusCode::kOk) message_ = std::make_unique<std::string>(std::move(message));
}

Status::Status(const Status& other)
    : code_(other.code_),
      message_(other.message_ ? std::make_unique<std::string>(*other.message_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) *this = Status(other);
  return *this;
}

const std::string& Status::message() const {
  static const std::string* const kEmpty = new std::string();
  return message_ ? *message_ : *kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message();
  return out;
}

std::ostream& operator<<(std::ostream& os, const Status& status) { return os << status.ToString(); }
std::ostream& operator<<(std::ostream& os, StatusCode code) { return os << StatusCodeName(code); }

Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
Status OutOfRangeError(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
Status ResourceExhaustedError(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
Status FailedPreconditionError(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
Status AlreadyExistsError(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
Status UnimplementedError(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
Status PermissionDeniedError(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}

namespace internal {

void ResultFailure(const char* what, const Status* status) {
  std::fprintf(stderr, "blockkv: %s%s%s\n", what, status ? ": " : "",
               status ? status->ToString().c_str() : "");
  std::abort();
}

void CheckFailure(const char* condition, const char* file, int line, const char* message) {
  std::fprintf(stderr, "blockkv: check failed at %s:%d: %s: %s\n", file, line, condition, message);
  std::abort();
}

}  // namespace internal
}  // namespace blockkv
