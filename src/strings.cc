// SPDX-License-Identifier: Apache-2.0
#include "internal/strings.h"

#include <cstdio>
#include <iterator>

namespace blockkv::internal {

std::string HumanBytes(long double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  while (bytes >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    bytes /= 1024;
    ++unit;
  }
  char text[64];
  if (unit == 0) {
    std::snprintf(text, sizeof(text), "%.0Lf B", bytes);
  } else {
    std::snprintf(text, sizeof(text), "%.2Lf %s", bytes, kUnits[unit]);
  }
  return text;
}

}  // namespace blockkv::internal
