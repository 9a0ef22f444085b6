// libFuzzer target: the `blockkv` tool's argument parser (tools/cli.cc) on arbitrary command
// lines, in dry-run mode (every flag parsed and range-checked, no command run). The input is the
// arguments after "blockkv", separated by NUL bytes. It aborts when the exit code is anything but
// 0 (good arguments) or 2 (bad ones); ASan and UBSan catch the rest. Keep each crash found as a
// named regression test in tests/tool/tool_cli_test.cc.
//
//   tool_args_fuzz -max_total_time=60 tests/fuzz/corpus/tool_args_fuzz/
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static std::FILE* const null = std::fopen("/dev/null", "w");
  std::vector<std::string> words = {"blockkv"};
  std::string word;
  for (size_t i = 0; i < size && words.size() < 64; ++i) {
    if (data[i] == 0) {
      words.push_back(word);
      word.clear();
    } else {
      word += static_cast<char>(data[i]);
    }
  }
  if (!word.empty() || (size > 0 && data[size - 1] == 0)) words.push_back(word);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  const blockkv::tool::CliOptions options{.out = null, .err = null, .dry_run = true};
  const int code = blockkv::tool::RunCli(argv, options);
  if (code != 0 && code != 2) {
    std::fprintf(stderr, "blockkv exited %d in a dry run:", code);
    for (const std::string& w : words) std::fprintf(stderr, " '%s'", w.c_str());
    std::fprintf(stderr, "\n");
    std::abort();
  }
  return 0;
}
