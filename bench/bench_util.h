// SPDX-License-Identifier: Apache-2.0
// What blockkv's benchmarks share: aborting on a failed setup, reading --benchmark_color for a
// display reporter of their own, and their default repetitions.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)
#include <unistd.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

// benchmark::Initialize with --benchmark_repetitions=5 and --benchmark_enable_random_interleaving
// as defaults, which the same flags on the command line override (they come later). False when
// a flag is not recognized (Google Benchmark has printed it).
inline bool InitializeWithRepetitions(int argc, char** argv) {
  std::string repetitions = "--benchmark_repetitions=5";
  std::string interleave = "--benchmark_enable_random_interleaving=true";
  std::vector<char*> args = {argv[0], repetitions.data(), interleave.data()};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  return !benchmark::ReportUnrecognizedArguments(count, args.data());
}

// Prints as the console reporter does, and keeps one user counter of each benchmark, times
// `scale`, per repetition and as their median, for a summary after the runs.
class CounterReporter : public benchmark::ConsoleReporter {
 public:
  CounterReporter(bool color, std::string counter, double scale)
      : ConsoleReporter(color ? OO_ColorTabular : OO_Tabular),
        counter_(std::move(counter)),
        scale_(scale) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      const auto it = run.counters.find(counter_);
      if (run.error_occurred || it == run.counters.end()) continue;
      Values& values = results_[run.run_name.function_name];
      const double value = it->second.value * scale_;
      if (run.run_type == Run::RT_Iteration) {
        values.repetitions.push_back(value);
      } else if (run.aggregate_name == "median") {
        values.median = value;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  // The median, or the one run's value without repetitions (no median aggregate then); nullopt
  // when the benchmark did not run.
  std::optional<double> Median(const std::string& name) const {
    const auto it = results_.find(name);
    if (it == results_.end()) return std::nullopt;
    if (it->second.median > 0) return it->second.median;
    if (it->second.repetitions.size() == 1) return it->second.repetitions[0];
    return std::nullopt;
  }
  // The lowest and highest repetition; {0, 0} when it did not run.
  std::pair<double, double> Range(const std::string& name) const {
    const auto it = results_.find(name);
    if (it == results_.end() || it->second.repetitions.empty()) return {0, 0};
    const auto [lo, hi] =
        std::minmax_element(it->second.repetitions.begin(), it->second.repetitions.end());
    return {*lo, *hi};
  }

 private:
  struct Values {
    double median = 0;
    std::vector<double> repetitions;
  };
  std::string counter_;
  double scale_;
  std::map<std::string, Values> results_;
};

}  // namespace blockkv_bench
