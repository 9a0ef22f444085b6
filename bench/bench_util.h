// What blockkv's benchmarks share: aborting on a failed setup, and reading --benchmark_color for
// a display reporter of their own.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "blockkv/status.h"

namespace blockkv_bench {

// A benchmark whose setup failed must not report a time: prints the program, `what` and the
// status, and aborts.
inline void Check(const blockkv::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s: %s\n", program_invocation_short_name, what,
                 status.ToString().c_str());
    std::abort();
  }
}

// A display reporter passed in by main() does not see --benchmark_color, so it is read here:
// true/yes/1 or false/no/0, else colour when stdout is a terminal.
inline bool UseColor(int argc, char** argv) {
  constexpr std::string_view kFlag = "--benchmark_color=";
  bool color = isatty(STDOUT_FILENO) != 0;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (!arg.starts_with(kFlag)) continue;
    const std::string_view value = arg.substr(kFlag.size());
    if (value == "true" || value == "yes" || value == "1") color = true;
    if (value == "false" || value == "no" || value == "0") color = false;
  }
  return color;
}

}  // namespace blockkv_bench
