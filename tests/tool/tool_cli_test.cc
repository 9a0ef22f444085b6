// SPDX-License-Identifier: Apache-2.0
// The `blockkv` binary: exit codes (0 success, 2 bad arguments with usage, 1 runtime failure with
// the status), and the messages that name a bad file's line.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

namespace {

struct ToolRun {
  int code = -1;
  std::string output;  // stdout and stderr together
};

ToolRun Blockkv(const std::string& args) {
  const std::string command = std::string(BLOCKKV_TOOL_BINARY) + " " + args + " 2>&1";
  ToolRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  std::array<char, 4096> buffer;
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    run.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

#define EXPECT_RUN(args, expected_code, expected_text)                              \
  do {                                                                              \
    const ToolRun run_ = Blockkv(args);                                             \
    EXPECT_EQ(run_.code, expected_code) << (args) << "\n" << run_.output;           \
    EXPECT_NE(run_.output.find(expected_text), std::string::npos) << (args) << "\n" \
                                                                  << run_.output;   \
  } while (false)

TEST(Cli, BadArgumentsExitTwoWithUsage) {
  EXPECT_RUN("", 2, "usage: blockkv <command>");
  EXPECT_RUN("frobnicate", 2, "unknown command 'frobnicate'");
  EXPECT_RUN("plan --model Llama-3-8B", 2, "--memory is required");
  EXPECT_RUN("plan --model Llama-3-8B", 2, "usage: blockkv plan");
  EXPECT_RUN("plan --model Llama-3-8B --memory 80XB", 2, "unknown unit 'XB'");
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB --bogus", 2, "unknown flag --bogus");
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB --tp 3", 2, "cannot split 8 KV heads");
  EXPECT_RUN("plan --model Llama-9 --memory 80GiB", 2, "unknown model 'Llama-9'");
  EXPECT_RUN("plan --layers 32 --memory 80GiB", 2, "--kv-heads and --head-size");
  EXPECT_RUN("plan --layers 61 --latent-dim 512 --kv-heads 8 --memory 80GiB", 2,
             "takes no --kv-heads or --head-size");
  EXPECT_RUN("plan --layers 61 --latent-dim 0 --memory 80GiB", 2, "--latent-dim");
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB --block-size 0", 2, "--block-size '0'");
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB --dtype fp64", 2, "--dtype");
  EXPECT_RUN("plan --model Llama-3-8B --memory", 2, "--memory needs a value");
  EXPECT_RUN("plan --model Llama-3-8B --memory 1GiB --json=yes", 2, "--json takes no value");
  EXPECT_RUN("simulate --blocks -4", 2, "--blocks '-4'");
  EXPECT_RUN("simulate --trace t.jsonl --requests 5", 2, "generator's flags do not apply");
  EXPECT_RUN("simulate --watermark 2", 2, "--watermark '2': expected a number in [0, 0.5]");
  EXPECT_RUN("demo --requests 0", 2, "usage: blockkv demo");
  EXPECT_RUN("demo extra", 2, "unexpected argument 'extra'");
}

TEST(Cli, HelpExitsZero) {
  EXPECT_RUN("--help", 0, "commands:");
  EXPECT_RUN("plan --help", 0, "--memory SIZE|host|cuda:N");
  EXPECT_RUN("simulate --help", 0, "--trace FILE");
  EXPECT_RUN("demo --help", 0, "--model PATH");
}

TEST(Cli, PlanPrintsTextAndJson) {
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB", 0, "blocks     40448 (79.00 GiB)");
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB --json", 0, "\"num_blocks\": 40448");
  EXPECT_RUN("plan --layers 32 --kv-heads 8 --head-size 128 --memory=80GiB --context 8192", 0,
             "sequences  79 of 8192 tokens");
  EXPECT_RUN("plan --model Llama-3-8B --memory host --slack 0", 0, "available (host)");
}

TEST(Cli, PlanTakesACustomMlaShape) {
  // 61 x 16 x (512 + 64) x 2 bytes = 1,124,352 per block, as the DeepSeek-V3 preset.
  EXPECT_RUN("plan --layers 61 --latent-dim 512 --rope-dim 64 --dtype bf16 --memory 80GiB", 0,
             "per block  1.07 MiB (1124352 bytes)");
  EXPECT_RUN("plan --model DeepSeek-V3 --dtype bf16 --memory 80GiB", 0, "(1124352 bytes)");
  EXPECT_RUN("plan --model gpt-oss-20b --memory 80GiB", 0, "(2.00x a pool per group)");
}

TEST(Cli, RuntimeFailuresExitOneWithTheStatus) {
  EXPECT_RUN("plan --model Llama-3-70B --memory 1MiB --slack 0", 1, "RESOURCE_EXHAUSTED");
  const ToolRun cuda = Blockkv("plan --model Llama-3-8B --memory cuda:0");
  if (cuda.code != 0) {  // no GPU here
    EXPECT_EQ(cuda.code, 1) << cuda.output;
    EXPECT_NE(cuda.output.find("UNAVAILABLE"), std::string::npos) << cuda.output;
  }
  EXPECT_RUN("simulate --trace " + testing::TempDir() + "/absent.jsonl", 1, "cannot open");
  EXPECT_RUN("demo --model " + testing::TempDir() + "/absent.bin", 1, "NOT_FOUND");
}

TEST(Cli, BadTraceFilesNameTheLine) {
  const std::string malformed = WriteTemp(
      "malformed.jsonl", "{\"prompt_len\": 8, \"output_len\": 2}\n\n{\"prompt_len\": 8 \"x\"}\n");
  EXPECT_RUN("simulate --trace " + malformed, 1, "malformed.jsonl:3: column 20: syntax error");
  const std::string missing = WriteTemp("missing.jsonl", "{\"prompt_len\": 8}\n");
  EXPECT_RUN("simulate --trace " + missing, 1, "missing.jsonl:1: missing \"output_len\"");
  const std::string too_long = WriteTemp("too_long.jsonl",
                                         "{\"prompt_len\": 8, \"output_len\": 1}\n"
                                         "{\"prompt_len\": 900, \"output_len\": 1}\n");
  // The engine's errors name the line as the reader's do, "file:N:" (docs/tool.md).
  EXPECT_RUN("simulate --blocks 32 --trace " + too_long, 1, "too_long.jsonl:2: 900 tokens");
}

TEST(Cli, SimulateWritesJsonAndPlot) {
  const std::string plot = testing::TempDir() + "/simulate.svg";
  std::remove(plot.c_str());
  EXPECT_RUN("simulate --requests 30 --blocks 256 --json --plot " + plot, 0, "\"finished\": 30");
  std::ifstream svg(plot);
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<polyline"), std::string::npos);
  EXPECT_RUN("simulate --requests 5 --plot /nonexistent-dir/x.svg", 1, "cannot write");
}

TEST(Cli, DemoChecksItself) {
  EXPECT_RUN("demo --requests 3 --system-len 16 --output-len 4", 0, "check         identical");
}

TEST(Cli, DemoDraftFlagsSetTheSpeculativeRun) {
  const std::string demo = "demo --requests 2 --system-len 16 --output-len 8 ";
  EXPECT_RUN(demo + "--draft-tokens 3 --draft-layers 1", 0,
             "speculative   k=3 drafts from the first 1 layers");
  const ToolRun skipped = Blockkv(demo + "--draft-tokens 0");
  EXPECT_EQ(skipped.code, 0) << skipped.output;
  EXPECT_EQ(skipped.output.find("speculative"), std::string::npos) << skipped.output;
  EXPECT_RUN(demo + "--draft-layers 0", 2, "--draft-layers");
  EXPECT_RUN(demo + "--draft-tokens -1", 2, "--draft-tokens");
  EXPECT_RUN(demo + "--draft-layers 99", 1, "a draft of 99 layers: the model has");
}

// How often `text` occurs in `output`.
size_t Count(const std::string& output, const std::string& text) {
  size_t n = 0;
  for (size_t at = output.find(text); at != std::string::npos; at = output.find(text, at + 1)) ++n;
  return n;
}

TEST(Cli, OutOfRangeFlagsNameTheRange) {
  EXPECT_RUN("plan --model Llama-3-8B --memory 80GiB --block-size 3000000000", 2,
             "--block-size '3000000000': expected an integer in [1, 2147483647]");
  EXPECT_RUN("simulate --requests 2147483647", 2,
             "--requests '2147483647': expected an integer in [1, 10000000]");
  EXPECT_RUN("demo --requests 2147483647", 2,
             "--requests '2147483647': expected an integer in [1, 16384]");
  EXPECT_RUN("simulate --max-seqs 2147483647", 2, "expected an integer in [1, 1048576]");
  EXPECT_RUN("simulate --max-context 9223372036854775807", 2,
             "--max-context '9223372036854775807': expected an integer in [1, 2147483647]");
  EXPECT_RUN("simulate --seed 99999999999999999999", 2, "--seed '99999999999999999999'");
}

TEST(Cli, MemoryZeroNamesTheFlagOnce) {
  const ToolRun run = Blockkv("plan --model Llama-3-8B --memory 0");
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_NE(run.output.find("--memory: '0' is 0 bytes: expected more"), std::string::npos)
      << run.output;
  EXPECT_EQ(Count(run.output, "--memory:"), 1u) << run.output;
}

TEST(Cli, EmptyFileNamesAreBadArguments) {
  EXPECT_RUN("simulate --requests 5 --plot ''", 2, "--plot '': expected a file name");
  EXPECT_RUN("simulate --trace ''", 2, "--trace '': expected a file name");
  EXPECT_RUN("demo --model ''", 2, "--model '': expected a file name");
}

TEST(Cli, DirectoriesAreNamedAsDirectories) {
  const std::string dir = testing::TempDir();
  EXPECT_RUN("demo --model " + dir, 1, "INVALID_ARGUMENT: cannot open " + dir + ": Is a directory");
  EXPECT_RUN("simulate --trace " + dir, 1, "INVALID_ARGUMENT: cannot open " + dir);
  EXPECT_RUN("simulate --requests 5 --plot " + dir, 1, "INVALID_ARGUMENT: cannot write " + dir);
}

TEST(Cli, PlotFailuresAreNotInternal) {
  const ToolRun run = Blockkv("simulate --requests 5 --plot /nonexistent-dir/x.svg");
  EXPECT_EQ(run.code, 1) << run.output;
  EXPECT_NE(run.output.find("NOT_FOUND: cannot write /nonexistent-dir/x.svg"), std::string::npos)
      << run.output;
  EXPECT_EQ(run.output.find("INTERNAL"), std::string::npos) << run.output;
}

TEST(Cli, PermissionDeniedIsPermissionDenied) {
  // Root may write anything but a read-only sysfs attribute; /sys is there on every machine.
  const std::string sysfs = "/sys/devices/system/cpu/online";
  EXPECT_RUN("simulate --requests 5 --plot " + sysfs, 1,
             "PERMISSION_DENIED: cannot write " + sysfs);
  // Reading: root reads anything, so only another user can be refused.
  if (geteuid() == 0) return;
  const std::string path =
      WriteTemp("unreadable.jsonl", "{\"prompt_len\": 8, \"output_len\": 1}\n");
  ASSERT_EQ(chmod(path.c_str(), 0), 0);
  EXPECT_RUN("simulate --trace " + path, 1, "PERMISSION_DENIED: cannot open " + path);
  EXPECT_RUN("demo --model " + path, 1, "PERMISSION_DENIED: cannot open " + path);
}

TEST(Cli, DemoSizesAreCheckedBeforeAnythingIsAllocated) {
  // It grew past 12 GB before; now the model's context is checked first.
  EXPECT_RUN("demo --system-len 2147483647", 1,
             "a request holds up to 3221225501 tokens (--system-len 2147483647, a user turn of up "
             "to 1073741823, --output-len 32 - 1), more than the model's context of 1024");
}

TEST(Cli, TraceOfHugePromptLengthsStopsAtTheContextLimit) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "{\"prompt_len\": 16777216, \"output_len\": 1}\n";
  const std::string path = WriteTemp("huge_prompts.jsonl", text);
  EXPECT_RUN("simulate --trace " + path, 1,
             "huge_prompts.jsonl:1: \"prompt_len\" 16777216 exceeds the context limit of 32768");
}

TEST(Cli, SizeArithmeticPastTheLimitsIsAnError) {
  // Each allocated a size no machine has, or overflowed an int32, before.
  EXPECT_RUN("simulate --blocks 2147483647", 1, "RESOURCE_EXHAUSTED");
  EXPECT_RUN("simulate --max-seqs 1048576 --token-budget 2147483647", 1, "INVALID_ARGUMENT");
}

}  // namespace
