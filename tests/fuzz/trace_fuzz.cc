// libFuzzer target: a whole JSONL trace (TraceReader: lines, blank lines, every field) read from
// the fuzzer's bytes and, when it is small, replayed through `simulate`'s engine on a tiny cache.
// It aborts when
//   - the reader fails with a code other than INVALID_ARGUMENT, or hands out a request outside
//     its contract (an empty or too long prompt, output_len < 1, lines not increasing),
//   - the replay fails with a code other than INVALID_ARGUMENT (a request that cannot fit), or
//     leaves blocks held or the state manager inconsistent (Simulate checks both: INTERNAL).
// Keep each crash found as a named regression test in tests/tool/tool_simulate_test.cc.
//
//   trace_fuzz -max_total_time=60 tests/fuzz/corpus/trace_fuzz/
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "blockkv/log.h"
#include "commands.h"

namespace {

constexpr int64_t kMaxTokens = 256;

[[noreturn]] void Fail(const char* what, const blockkv::Status& status) {
  std::fprintf(stderr, "trace_fuzz: %s: %s\n", what, status.ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  blockkv::SetLogLevel(blockkv::LogLevel::kError);
  std::vector<uint8_t> bytes(data, data + size);
  bytes.push_back(0);  // fmemopen needs a non-empty buffer; the reader sees only `size` bytes
  std::FILE* file = fmemopen(bytes.data(), size == 0 ? 1 : size, "r");
  if (file == nullptr) return 0;
  if (size == 0) std::fgetc(file);  // an empty file
  blockkv::tool::TraceReader reader;
  reader.Attach(file, "fuzz.jsonl", kMaxTokens);
  std::vector<blockkv::tool::EngineRequest> requests;
  blockkv::tool::EngineRequest request;
  int64_t last_line = 0;
  blockkv::Status status;
  while (requests.size() < 64) {
    blockkv::Result<bool> more = reader.Next(&request);
    if (!more.ok()) {
      status = more.status();
      break;
    }
    if (!*more) break;
    if (request.prompt.empty() || std::ssize(request.prompt) > kMaxTokens ||
        request.output_len < 1 || request.arrival < 0 || request.line <= last_line) {
      Fail("a request outside the contract", blockkv::Status::Ok());
    }
    last_line = request.line;
    requests.push_back(std::move(request));
  }
  std::fclose(file);
  if (!status.ok()) {
    if (status.code() != blockkv::StatusCode::kInvalidArgument) Fail("the reader", status);
    return 0;
  }
  // Replay what is small enough to take microseconds: a 64-block cache of 4-token blocks, a host
  // tier of 16, so that requests are preempted and recomputed.
  int64_t tokens = 0;
  for (const auto& r : requests)
    tokens += std::ssize(r.prompt) + std::min<int64_t>(r.output_len, 64);
  if (requests.empty() || tokens > 4096) return 0;
  blockkv::tool::SimulateOptions options;
  options.engine.block_size = 4;
  options.engine.num_blocks = 64;
  options.engine.host_blocks = 16;
  options.engine.token_budget = 64;
  options.engine.max_seqs = 8;
  options.engine.max_context = kMaxTokens;
  blockkv::Result<blockkv::tool::SimulateReport> report =
      blockkv::tool::Simulate(requests, options);
  if (!report.ok() && report.status().code() != blockkv::StatusCode::kInvalidArgument) {
    Fail("the replay", report.status());
  }
  return 0;
}
