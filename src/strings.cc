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

void AppendHex64(std::string& out, uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  char digits[16];
  for (int i = 15; i >= 0; --i, v >>= 4) digits[i] = kDigits[v & 15];
  out.append(digits, sizeof(digits));
}

}  // namespace blockkv::internal
