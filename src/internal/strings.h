// StrCat: builds an error message from its pieces ("cannot allocate ", n, " blocks: ", free, ...).
// g++-12 has no std::format and the library does not depend on fmt.
#pragma once

#include <sstream>
#include <string>

namespace blockkv::internal {

template <class... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// "1.50 GiB", "512 B": for log lines.
std::string HumanBytes(long double bytes);

}  // namespace blockkv::internal
