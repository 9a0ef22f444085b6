// SPDX-License-Identifier: Apache-2.0
// `blockkv simulate`: a small trace whose prefix-cache hits are worked out by hand, the JSONL
// reader's messages for bad traces, and a generated workload run to the end with and without the
// host tier.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "commands.h"
#include "json.h"
#include "unit/redis_server.h"

namespace blockkv::tool {
namespace {

std::string WriteTemp(const std::string& name, const std::string& text) {
  std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string Tokens(int first, int last) {  // "[first, ..., last]"
  std::string s = "[";
  for (int t = first; t <= last; ++t) s += std::to_string(t) + (t < last ? ", " : "]");
  return s;
}

TEST(Simulate, KnownHitRate) {
  // Block size 16, a cache far larger than the trace. By hand:
  //  line 1, 2: 80-token prompts starting with the same 64 tokens ("sys"), both at step 0:
  //             scheduled in the same step, so neither finds the other's blocks: 0 hit each.
  //             Each publishes 5 full blocks; the first 4 are the shared prefix.
  //  line 3:    the same system prompt at step 20 (lines 1-2 finished by step 3): the 4 shared
  //             blocks hit (64 tokens); its 5th block differs.
  //  line 4:    40 tokens of its own: 0.
  //  line 5:    tokens 1..33 at step 40: 0; publishes 2 full blocks (1..16, 17..32).
  //  line 6:    tokens 1..33 again: both blocks hit, 32 tokens (the 33rd is computed).
  //  line 7:    tokens 1..32: a hit never takes the last prompt token (the engine needs its
  //             logits), so at most 31 tokens: 1 whole block, 16.
  // Queried (prompt tokens looked up) 80+80+80+40+33+33+32 = 378; hit 64+32+16 = 112.
  const std::string path = WriteTemp(
      "known_hits.jsonl",
      R"({"arrival": 0, "prompt_len": 80, "prefix_group": "sys", "prefix_len": 64, "output_len": 4}
{"arrival": 0, "prompt_len": 80, "prefix_group": "sys", "prefix_len": 64, "output_len": 4}

{"arrival": 20, "prompt_len": 80, "prefix_group": "sys", "prefix_len": 64, "output_len": 4}
{"arrival": 20, "prompt_len": 40, "output_len": 2, "id": "no prefix"}
{"arrival": 40, "prompt": )" +
          Tokens(1, 33) + R"(, "output_len": 1}
{"arrival": 50, "prompt": )" +
          Tokens(1, 33) + R"(, "output_len": 1}
{"arrival": 60, "prompt": )" +
          Tokens(1, 32) + R"(, "output_len": 1}
)");
  Result<std::vector<EngineRequest>> trace = ReadTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 7u);
  EXPECT_EQ((*trace)[2].line, 4);  // the blank line counts
  SimulateOptions options;
  options.engine.num_blocks = 256;
  options.engine.host_blocks = 256;
  Result<SimulateReport> report = Simulate(*trace, options);
  ASSERT_TRUE(report.ok()) << report.status();
  const EngineStats& s = report->stats;
  EXPECT_EQ(s.finished, 7);
  EXPECT_EQ(s.queried_tokens, 378);
  EXPECT_EQ(s.hit_tokens, 112);
  EXPECT_DOUBLE_EQ(s.hit_rate(), 112.0 / 378.0);
  // Computed prompt tokens: 80 + 80 + 16 + 40 + 33 + 1 + 16 = 266. Decoded: each request runs
  // output_len - 1 generated tokens (the last one sampled is never run): 3+3+3+1 = 10.
  EXPECT_EQ(s.prompt_tokens, 266);
  EXPECT_EQ(s.decode_tokens, 10);
  EXPECT_EQ(s.generated, 4 + 4 + 4 + 2 + 1 + 1 + 1);
  EXPECT_EQ(s.preemptions, 0);
  EXPECT_EQ(s.recomputations, 0);
  EXPECT_EQ(s.evictions, 0);
  EXPECT_EQ(std::ssize(report->samples), s.steps);
}

// Four requests sharing a 256-token prompt prefix (16 blocks), arriving at `arrivals`, dealt
// round-robin to two engines: engine 0 gets requests 1 and 3, engine 1 requests 2 and 4.
std::string SharedPrefixTrace(const std::vector<int>& arrivals) {
  std::string text;
  std::string name = "shared_prefix";
  for (const int arrival : arrivals) {
    text += R"({"arrival": )" + std::to_string(arrival) +
            R"(, "prompt_len": 300, "prefix_group": "sys", "prefix_len": 256, "output_len": 2})" +
            "\n";
    name.push_back('_');
    name.append(std::to_string(arrival));
  }
  return WriteTemp(name + ".jsonl", text);
}

// Far apart: without the tier each engine computes the prefix once (its second request hits it
// locally): 300 + 44 per engine. With it, engine 1's first request (at step 10, after engine 0's
// first was computed and stored) fetches the 16 blocks: 300 + 44 + 44 + 44.
// SharedPrefixTrace(arrivals) over two engines of 256 blocks that share the tier at `url`.
Result<SimulateReport> SimulateSharedPrefix(const std::string& url,
                                            const std::vector<int>& arrivals,
                                            SimulateOptions* options) {
  BLOCKKV_ASSIGN_OR_RETURN(std::vector<EngineRequest> trace,
                           ReadTrace(SharedPrefixTrace(arrivals)));
  options->engine.num_blocks = 256;
  options->engines = 2;
  options->remote = RemoteTierConfig{.url = url, .model_id = "tool-test"};
  return Simulate(trace, *options);
}

TEST(SimulateRemote, SecondEngineFetchesTheFirstEnginesPrefixFromTheTier) {
  blockkv::testing::RedisServer server;
  ASSERT_TRUE(server.running());
  SimulateOptions options;
  Result<SimulateReport> report = SimulateSharedPrefix(server.url(), {0, 10, 20, 30}, &options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->engines, 2);
  EXPECT_TRUE(report->remote);
  EXPECT_TRUE(report->remote_connected);
  EXPECT_EQ(report->stats.finished, 4);
  EXPECT_EQ(report->without_tier.finished, 4);
  EXPECT_EQ(report->tier.hits, 16);
  EXPECT_EQ(report->tier.invalid, 0);
  EXPECT_EQ(report->tier.errors, 0);
  EXPECT_GT(report->tier.misses, 0);  // the first engine's lookups: nothing stored yet
  EXPECT_EQ(report->tier.misses_not_found, report->tier.misses);
  EXPECT_EQ(report->tier.nodes, 1);
  EXPECT_EQ(report->tier.dropped, 0);
  EXPECT_GT(report->tier.fetched_bytes, 0);
  EXPECT_GT(report->tier.stored_bytes, 0);
  EXPECT_EQ(report->without_tier.prompt_tokens, 2 * (300 + 44));
  EXPECT_EQ(report->stats.prompt_tokens, 300 + 3 * 44);
  EXPECT_LT(report->stats.prompt_tokens, report->without_tier.prompt_tokens);
  EXPECT_GT(report->stats.hit_rate(), report->without_tier.hit_rate());
  // Both reports carry the tier's numbers and the comparison.
  const nlohmann::json j =
      nlohmann::json::parse(FormatSimulate(*report, options.engine, /*json=*/true));
  EXPECT_EQ(j["engines"], 2);
  EXPECT_EQ(j["remote"]["hits"], 16);
  EXPECT_EQ(j["remote"]["connected"], true);
  EXPECT_EQ(j["remote"]["misses_not_found"], report->tier.misses_not_found);
  EXPECT_EQ(j["remote"]["misses_error"], 0);
  EXPECT_EQ(j["remote"]["nodes"], 1);
  EXPECT_EQ(j["without_remote"]["prompt_tokens"], 688);
  EXPECT_EQ(j["prompt_tokens"], 432);
  const std::string text = FormatSimulate(*report, options.engine, /*json=*/false);
  EXPECT_NE(text.find("remote tier   16 blocks hit"), std::string::npos) << text;
  EXPECT_NE(text.find("without tier"), std::string::npos) << text;
}

// Requests 1 and 2 arrive together, one on each engine: both engines compute the prefix in the
// same step, neither finds the other's (as two engines of a deployment would not), so the tier
// saves nothing; the later two hit their own engine's cache. Run one engine after the other, the
// second engine would have fetched what the first had computed.
TEST(SimulateRemote, EnginesSteppingTogetherDoNotSeeWhatTheOtherComputesInThatStep) {
  blockkv::testing::RedisServer server;
  ASSERT_TRUE(server.running());
  SimulateOptions options;
  Result<SimulateReport> report = SimulateSharedPrefix(server.url(), {0, 0, 20, 20}, &options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->stats.finished, 4);
  EXPECT_EQ(report->tier.hits, 0);
  EXPECT_EQ(report->tier.errors, 0);
  EXPECT_GT(report->tier.stored, 0);
  EXPECT_EQ(report->stats.prompt_tokens, 2 * (300 + 44));
  EXPECT_EQ(report->without_tier.prompt_tokens, 2 * (300 + 44));
}

TEST(SimulateRemote, UnreachableServerRunsWithoutTheTierAndSaysSo) {
  const int port = blockkv::testing::FreePort();  // nothing listens there
  ASSERT_GT(port, 0);
  SimulateOptions options;
  Result<SimulateReport> report =
      SimulateSharedPrefix("redis://127.0.0.1:" + std::to_string(port), {0, 10, 20, 30}, &options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->remote_connected);
  EXPECT_EQ(report->tier.hits, 0);
  EXPECT_EQ(report->stats.finished, 4);
  EXPECT_EQ(report->stats.prompt_tokens, report->without_tier.prompt_tokens);
  const std::string text = FormatSimulate(*report, options.engine, /*json=*/false);
  EXPECT_NE(text.find("remote tier   not connected at start: the server was unreachable"),
            std::string::npos)
      << text;
}

// `blockkv simulate ARGS...`: its exit code, and what it wrote on stderr (on stdout: *stdout_text).
std::pair<int, std::string> RunSimulateCli(std::vector<std::string> args,
                                           std::string* stdout_text = nullptr) {
  args.insert(args.begin(), {"blockkv", "simulate", "--no-progress"});
  std::vector<char*> argv;
  argv.reserve(args.size());
  for (std::string& a : args) argv.push_back(a.data());
  char* err_buffer = nullptr;
  size_t err_size = 0;
  std::FILE* err = open_memstream(&err_buffer, &err_size);
  char* out_buffer = nullptr;
  size_t out_size = 0;
  std::FILE* out = open_memstream(&out_buffer, &out_size);
  const int code = RunCli(argv, CliOptions{.out = out, .err = err});
  std::fclose(out);
  std::fclose(err);
  std::string message(err_buffer, err_size);
  if (stdout_text != nullptr) *stdout_text = std::string(out_buffer, out_size);
  std::free(err_buffer);
  std::free(out_buffer);
  return {code, message};
}

TEST(SimulateRemote, BadEnginesCountsExitTwoNamingTheValueAndLimit) {
  for (const char* bad : {"0", "65", "1000000000000", "two", "-1"}) {
    const auto [code, message] = RunSimulateCli({"--requests", "4", "--engines", bad});
    EXPECT_EQ(code, 2) << bad;
    EXPECT_NE(message.find("--engines"), std::string::npos) << message;
    EXPECT_NE(message.find("[1, 64]"), std::string::npos) << message;
  }
  SimulateOptions options;
  options.engines = 65;
  Result<SimulateReport> r = Simulate(std::span<const EngineRequest>{}, options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("65"), std::string::npos) << r.status();
}

// --max-pending sizes each engine's store queue; 0 stores nothing (every store dropped, counted),
// so no engine hits another's blocks. Bad values and the flag without --remote exit 2.
TEST(SimulateRemote, MaxPendingSizesTheStoreQueue) {
  blockkv::testing::RedisServer server;
  ASSERT_TRUE(server.running());
  const std::vector<std::string> run = {"--requests",        "8",          "--prefix-groups", "1",
                                        "--shared-fraction", "0.9",        "--engines",       "2",
                                        "--remote",          server.url(), "--json"};
  std::string out;
  std::vector<std::string> none = run;
  none.insert(none.end(), {"--max-pending", "0"});
  auto [code, message] = RunSimulateCli(none, &out);
  ASSERT_EQ(code, 0) << message;
  nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j["remote"]["stored_bytes"], 0) << out;
  EXPECT_GT(j["remote"]["dropped"], 0) << out;
  EXPECT_EQ(j["remote"]["hits"], 0) << out;
  std::tie(code, message) = RunSimulateCli(run, &out);  // the default queue
  ASSERT_EQ(code, 0) << message;
  j = nlohmann::json::parse(out);
  EXPECT_GT(j["remote"]["stored_bytes"], 0) << out;
  EXPECT_EQ(j["remote"]["dropped"], 0) << out;
  for (const char* bad : {"-1", "2147483648", "many"}) {
    std::tie(code, message) =
        RunSimulateCli({"--requests", "4", "--remote", server.url(), "--max-pending", bad});
    EXPECT_EQ(code, 2) << bad;
    EXPECT_NE(message.find("--max-pending"), std::string::npos) << message;
    EXPECT_NE(message.find("[0, 2147483647]"), std::string::npos) << message;
  }
  std::tie(code, message) = RunSimulateCli({"--requests", "4", "--max-pending", "5"});
  EXPECT_EQ(code, 2);
  EXPECT_NE(message.find("--max-pending sizes the remote tier's store queue: it needs --remote"),
            std::string::npos)
      << message;
}

TEST(SimulateRemote, UnparsableUrlAndNoPrefixCacheAreClearErrors) {
  const auto [code, message] = RunSimulateCli({"--requests", "4", "--remote", "http://nowhere"});
  EXPECT_EQ(code, 1);
  EXPECT_NE(message.find("http://nowhere"), std::string::npos) << message;
  const auto [code2, message2] =
      RunSimulateCli({"--requests", "4", "--remote", "redis://127.0.0.1:1", "--no-prefix-cache"});
  EXPECT_EQ(code2, 2);
  EXPECT_NE(message2.find("--remote needs prefix caching"), std::string::npos) << message2;
}

TEST(Simulate, GeneratedWorkloadUnderPressureFinishesWithEveryBlockFree) {
  WorkloadOptions workload;
  workload.requests = 60;
  workload.rate = 2;
  SimulateOptions options;
  options.engine.num_blocks = 256;  // far too small for 60 requests at once
  options.engine.token_budget = 512;
  options.engine.host_blocks = 256;
  Result<SimulateReport> with_host = Simulate(GenerateWorkload(workload), options);
  ASSERT_TRUE(with_host.ok()) << with_host.status();
  EXPECT_EQ(with_host->stats.finished, 60);
  EXPECT_GT(with_host->stats.preemptions, 0);
  EXPECT_EQ(with_host->stats.resumes, with_host->stats.preemptions);
  EXPECT_GT(with_host->stats.hit_tokens, 0);
  EXPECT_EQ(with_host->stats.peak_used_blocks, 256);
  // Without a host tier the same pressure recomputes instead; the generated tokens are the same.
  options.engine.host_blocks = 0;
  Result<SimulateReport> recompute = Simulate(GenerateWorkload(workload), options);
  ASSERT_TRUE(recompute.ok()) << recompute.status();
  EXPECT_EQ(recompute->stats.preemptions, 0);
  EXPECT_GT(recompute->stats.recomputations, 0);
  EXPECT_EQ(recompute->stats.generated, with_host->stats.generated);
}

TEST(Simulate, RequestThatCanNeverFitNamesItsLine) {
  const std::string path = WriteTemp("too_long.jsonl",
                                     "{\"prompt_len\": 10, \"output_len\": 1}\n"
                                     "{\"prompt_len\": 5000, \"output_len\": 1}\n");
  SimulateOptions options;
  options.engine.num_blocks = 64;  // 1,024 tokens
  Result<SimulateReport> r = Simulate(*ReadTrace(path), options);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("line 2"), std::string::npos) << r.status();
}

struct BadTrace {
  const char* text;
  const char* message;  // expected in the status
};

TEST(ReadTrace, MalformedLinesAreNamed) {
  const BadTrace cases[] = {
      {"{\"prompt_len\": 4, \"output_len\": 1}\n{\"prompt_len\": 4,, }\n",
       ":2: column 18: syntax error while parsing object key"},
      {"{\"prompt_len\": 4}\n", ":1: missing \"output_len\""},
      {"\n\n{\"prompt_len\": 4, \"output_len\": 0}\n",
       ":3: \"output_len\" 0 must be an integer >= 1"},
      {"{\"promt_len\": 4, \"output_len\": 1}\n", ":1: unknown field \"promt_len\""},
      {"{\"prompt\": [1, -2], \"output_len\": 1}\n", ":1: \"prompt\"[1] -2 is not a token id"},
      {"{\"prompt\": [1], \"prompt_len\": 1, \"output_len\": 1}\n", "cannot both be given"},
      {"{\"prompt_len\": 4, \"prefix_group\": 1, \"output_len\": 1}\n", "missing \"prefix_len\""},
      {"{\"prompt_len\": 4, \"prefix_group\": 1, \"prefix_len\": 5, \"output_len\": 1}\n",
       "longer than \"prompt_len\""},
      {"{\"arrival\": -1, \"prompt_len\": 4, \"output_len\": 1}\n",
       "\"arrival\" -1 is not a step in [0, 10^15]"},
      {"[1, 2]\n", ":1: expected an object, found an array"},
      {"{\"prompt_len\": 4, \"output_len\": 1} x\n", "expected end of input"},
      {"{\"prompt_len\": 4, \"output_len\": 1, \"output_len\": 2}\n",
       ":1: duplicate field \"output_len\""},
      {"\n", "no requests"},
  };
  int i = 0;
  for (const BadTrace& c : cases) {
    const std::string path = WriteTemp("bad" + std::to_string(i++) + ".jsonl", c.text);
    Result<std::vector<EngineRequest>> r = ReadTrace(path);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos)
        << c.text << " -> " << r.status();
  }
  EXPECT_EQ(ReadTrace(::testing::TempDir() + "/no_such.jsonl").status().code(),
            StatusCode::kNotFound);
}

// ParseTraceLine's message for `text`, or "ok".
std::string LineError(const std::string& text, int64_t max_tokens = 32768) {
  Result<TraceLine> line = ParseTraceLine(text, max_tokens);
  return line.ok() ? "ok" : line.status().message();
}

TEST(TraceLine, IntegersAreExactAndWhatDoesNotFitIsRejected) {
  // Floats past 2^53 were cast to int64 (undefined behaviour): 1e19 and -3e30 shared a group.
  EXPECT_NE(
      LineError(R"({"prompt_len": 8, "prefix_group": 1e19, "prefix_len": 8, "output_len": 1})")
          .find("\"prefix_group\" 1e19 must be an integer in [-2^63, 2^64) or a string"),
      std::string::npos);
  EXPECT_NE(
      LineError(R"({"prompt_len": 8, "prefix_group": -3e30, "prefix_len": 8, "output_len": 1})")
          .find("\"prefix_group\" -3e30"),
      std::string::npos);
  EXPECT_NE(LineError(R"({"prompt_len": 9223372036854775808, "output_len": 1})")
                .find("\"prompt_len\" 9223372036854775808 must be an integer >= 1 that fits"),
            std::string::npos);
  EXPECT_NE(LineError(R"({"prompt": [2147483648], "output_len": 1})")
                .find("\"prompt\"[0] 2147483648 is not a token id"),
            std::string::npos);
  EXPECT_NE(LineError(R"({"prompt": [1, 2.5], "output_len": 1})").find("\"prompt\"[1] 2.5"),
            std::string::npos);
  // Groups past 2^53 keep their identity: 2^53 and 2^53 + 1 differ, as do 2^64 - 1 and -1.
  Result<TraceLine> a = ParseTraceLine(
      R"({"prompt_len": 8, "prefix_group": 9007199254740992, "prefix_len": 8, "output_len": 1})",
      64);
  Result<TraceLine> b = ParseTraceLine(
      R"({"prompt_len": 8, "prefix_group": 9007199254740993, "prefix_len": 8, "output_len": 1})",
      64);
  Result<TraceLine> c = ParseTraceLine(
      R"({"prompt_len": 8, "prefix_group": 18446744073709551615, "prefix_len": 8, "output_len": 1})",
      64);
  Result<TraceLine> d = ParseTraceLine(
      R"({"prompt_len": 8, "prefix_group": -1, "prefix_len": 8, "output_len": 1})", 64);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  EXPECT_EQ(a->prefix_group, "9007199254740992");
  EXPECT_EQ(b->prefix_group, "9007199254740993");
  EXPECT_EQ(c->prefix_group, "18446744073709551615");
  EXPECT_EQ(d->prefix_group, "-1");
  EXPECT_FALSE(a->group_is_string);
}

TEST(TraceReader, GroupsPastTwoToTheFiftyThreeShareNoPrefix) {
  const std::string path = WriteTemp(
      "big_groups.jsonl",
      R"({"prompt_len": 32, "prefix_group": 9007199254740992, "prefix_len": 32, "output_len": 1}
{"prompt_len": 32, "prefix_group": 9007199254740993, "prefix_len": 32, "output_len": 1}
{"prompt_len": 32, "prefix_group": "9007199254740992", "prefix_len": 32, "output_len": 1}
{"prompt_len": 32, "prefix_group": 9007199254740992, "prefix_len": 32, "output_len": 1}
)");
  Result<std::vector<EngineRequest>> trace = ReadTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 4u);
  EXPECT_NE((*trace)[0].prompt, (*trace)[1].prompt);
  EXPECT_NE((*trace)[0].prompt, (*trace)[2].prompt);  // a string never meets an integer
  EXPECT_EQ((*trace)[0].prompt, (*trace)[3].prompt);  // the same group shares its prefix
}

TEST(TraceLine, LeadingZerosInvalidUtf8AndDuplicatesAreRejected) {
  // "08" is not JSON: a syntax error, not a prompt_len of 0.
  EXPECT_NE(LineError(R"({"prompt_len": 08, "output_len": 1})").find("column 17: syntax error"),
            std::string::npos)
      << LineError(R"({"prompt_len": 08, "output_len": 1})");
  const std::string utf8 = LineError("{\"prompt_len\": 8, \"output_len\": 1, \"id\": \"\xff\"}");
  EXPECT_NE(utf8.find("ill-formed UTF-8"), std::string::npos) << utf8;
  EXPECT_EQ(utf8.find('\xff'), std::string::npos);  // the byte is escaped in the message
  EXPECT_NE(utf8.find("\\xFF"), std::string::npos) << utf8;
  EXPECT_EQ(LineError(std::string("{\"prompt_len\": 8, \"output_len\": 1}\0x", 36)),
            "column 35: a NUL byte, which JSON text cannot hold");
  EXPECT_NE(LineError(R"({"prompt_len": 8, "prompt_len": 8, "output_len": 1})")
                .find("duplicate field \"prompt_len\""),
            std::string::npos);
  EXPECT_NE(
      LineError(R"({"prompt_len": 8, "output_len": 1, "id": {"a": 1, "b": {"a": 2}, "a": 3}})")
          .find("duplicate member \"a\" inside \"id\""),
      std::string::npos);
}

TEST(TraceLine, TwoHundredThousandMembersParse) {
  // The old reader compared each member with every earlier one: minutes for this line. Each
  // object's names now go into a hash set; the line's own fields into a bit mask.
  std::string members;
  for (int i = 0; i < 200000; ++i) members += (i > 0 ? ",\"k" : "\"k") + std::to_string(i) + "\":1";
  EXPECT_EQ(LineError(R"({"prompt_len": 8, "output_len": 1, "id": {)" + members + "}}"), "ok");
  EXPECT_NE(LineError(R"({"prompt_len": 8, "output_len": 1, "id": {)" + members + ",\"k7\":2}}")
                .find("duplicate member \"k7\""),
            std::string::npos);
}

TEST(TraceLine, PromptsStopAtTheContextLimit) {
  EXPECT_EQ(LineError(R"({"prompt_len": 16777216, "output_len": 1})", 1000),
            "\"prompt_len\" 16777216 exceeds the context limit of 1000 (--max-context)");
  std::string tokens = "[1";
  for (int i = 0; i < 5000; ++i) tokens += ",1";
  EXPECT_EQ(LineError(R"({"prompt": )" + tokens + R"(], "output_len": 1})", 1000),
            "\"prompt\" has more than 1000 tokens, the context limit (--max-context)");
  EXPECT_EQ(LineError(R"({"prompt": )" + tokens + R"(], "output_len": 1})", 5001), "ok");
}

TEST(TraceReader, LinePastTheLimitIsAnErrorNotAnAllocation) {
  const std::string path = ::testing::TempDir() + "/huge_line.jsonl";
  {
    std::ofstream out(path);
    out << "{\"prompt_len\": 8, \"output_len\": 1}\n{\"id\": \"";
    const std::string chunk(1 << 20, 'a');
    for (int64_t i = 0; i <= JsonlReader::kMaxLineBytes >> 20; ++i) out << chunk;
    out << "\"}\n";
  }
  Result<std::vector<EngineRequest>> r = ReadTrace(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("huge_line.jsonl:2: the line is longer than 64 MiB"),
            std::string::npos)
      << r.status();
  std::remove(path.c_str());
}

TEST(TraceReader, DirectoryAndEmptyNameAreNamed) {
  Result<std::vector<EngineRequest>> dir = ReadTrace(::testing::TempDir());
  EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.status().message().find("Is a directory"), std::string::npos) << dir.status();
  EXPECT_EQ(ReadTrace("").status().code(), StatusCode::kInvalidArgument);
}

// A source of `n` requests, one arriving per step, that counts what the engine pulled.
class CountingSource : public RequestSource {
 public:
  explicit CountingSource(int64_t n) : n_(n) {}
  Result<bool> Next(EngineRequest* out) override {
    if (pulled_ == n_) return false;
    *out = EngineRequest{};
    out->arrival = pulled_;
    out->prompt.assign(40, static_cast<TokenId>(pulled_ % 1000));
    out->output_len = 4;
    ++pulled_;
    return true;
  }
  int64_t pulled() const { return pulled_; }

 private:
  int64_t n_;
  int64_t pulled_ = 0;
};

TEST(Engine, PullsRequestsAsTheyArriveAndKeepsNoOutputs) {
  EngineOptions options;
  options.num_blocks = 64;
  options.keep_outputs = false;
  std::unique_ptr<Engine> engine = *Engine::Create(options);
  CountingSource source(5000);
  NullRunner runner;
  int64_t most_ahead = 0;
  ASSERT_TRUE(engine
                  ->Run(source, runner,
                        [&](const Engine& e) {
                          // Pulled but not finished: what the engine holds.
                          most_ahead = std::max(most_ahead, source.pulled() - e.stats().finished);
                        })
                  .ok());
  EXPECT_EQ(engine->stats().finished, 5000);
  EXPECT_EQ(engine->stats().requests, 5000);
  EXPECT_LE(most_ahead, 16);  // one arrival a step, each done in a few steps
  EXPECT_TRUE(engine->outputs().empty());
}

TEST(Engine, ArrivalsOutOfOrderNameTheLine) {
  const std::string path = WriteTemp("unordered.jsonl",
                                     "{\"arrival\": 5, \"prompt_len\": 8, \"output_len\": 1}\n"
                                     "{\"arrival\": 3, \"prompt_len\": 8, \"output_len\": 1}\n");
  SimulateOptions options;
  Result<SimulateReport> r = Simulate(*ReadTrace(path), options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("line 2: arrival 3 is before the previous request's 5"),
            std::string::npos)
      << r.status();
}

TEST(Json, WriterOutputParsesBackWithNlohmann) {
  JsonWriter w;
  w.BeginObject().Key("a").Int(-3).Key("b").BeginArray().Double(0.5).Bool(true).Null().EndArray();
  w.Key("s").String("x\"\n\\y\x01").Key("e").BeginObject().EndObject();
  w.Key("inf").Double(INFINITY).EndObject();
  const nlohmann::json v = nlohmann::json::parse(w.str());
  EXPECT_EQ(v["a"], -3);
  EXPECT_EQ(v["b"].size(), 3u);
  EXPECT_EQ(v["s"], "x\"\n\\y\x01");
  EXPECT_TRUE(v["e"].is_object());
  EXPECT_TRUE(v["inf"].is_null());
}

TEST(Plot, TwoPolylines) {
  std::vector<StepSample> samples;
  for (int i = 1; i <= 5000; ++i) samples.push_back({i, (i % 100) / 100.0, i / 5000.0});
  const std::string svg = PlotSvg(samples, "test <&>");
  size_t count = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(svg.rfind("</svg>\n"), svg.size() - 7);
  EXPECT_EQ(svg.find("<&>"), std::string::npos);  // the title is escaped
}

}  // namespace
}  // namespace blockkv::tool
