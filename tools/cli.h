// SPDX-License-Identifier: Apache-2.0
// The `blockkv` command line as a function, so that the binary (main.cc), tests and the argument
// fuzzer (tests/fuzz/tool_args_fuzz.cc) run the same code.
//
//   char* argv[] = {"blockkv", "plan", "--model", "Llama-3-8B", "--memory", "80GiB"};
//   int code = RunCli(argv, {});   // 0, 1 (runtime failure) or 2 (bad arguments)
#pragma once

#include <cstdio>
#include <span>

namespace blockkv::tool {

struct CliOptions {
  std::FILE* out = stdout;  // reports, --help
  std::FILE* err = stderr;  // errors, usage after bad arguments
  // Parse and check the arguments, then return 0 instead of running the command.
  bool dry_run = false;
};

// Runs `blockkv args[1] args[2...]` and returns its exit code. Never throws: an exception that
// escapes a command is exit 1 with a message of the tool's own.
int RunCli(std::span<char* const> args, const CliOptions& options);

}  // namespace blockkv::tool
