// SPDX-License-Identifier: Apache-2.0
// StrCat: builds an error message from its pieces ("cannot allocate ", n, " blocks: ", free, ...).
// g++-12 has no std::format and the library does not depend on fmt.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

namespace blockkv::internal {

template <class... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// StrCat kept out of line: for error messages built inside hot loops, so that the loop does not
// carry the stream's stack frame and code. The arguments are taken by value: a loop's counters
// passed by reference would need an address, and the loop would keep them in memory.
template <class... Args>
[[gnu::cold, gnu::noinline]] std::string ColdStrCat(Args... args) {
  return StrCat(args...);
}

// "1.50 GiB", "512 B": for log lines.
std::string HumanBytes(long double bytes);

// Appends v as 16 lowercase hex digits (a block key's halves, in its text and in remote keys).
void AppendHex64(std::string& out, uint64_t v);

}  // namespace blockkv::internal
