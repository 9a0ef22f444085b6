// `blockkv simulate`: a small trace whose prefix-cache hits are worked out by hand, the JSONL
// reader's messages for bad traces, and a generated workload run to the end with and without the
// host tier.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "commands.h"
#include "json.h"

namespace blockkv::tool {
namespace {

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
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
      {"{\"prompt_len\": 4, \"output_len\": 1}\n{\"prompt_len\": 4,, }\n", ":2: expected a member"},
      {"{\"prompt_len\": 4}\n", ":1: missing \"output_len\""},
      {"\n\n{\"prompt_len\": 4, \"output_len\": 0}\n",
       ":3: \"output_len\" must be an integer >= 1"},
      {"{\"promt_len\": 4, \"output_len\": 1}\n", ":1: unknown field \"promt_len\""},
      {"{\"prompt\": [1, -2], \"output_len\": 1}\n", ":1: \"prompt\"[1] is not a token id"},
      {"{\"prompt\": [1], \"prompt_len\": 1, \"output_len\": 1}\n", "cannot both be given"},
      {"{\"prompt_len\": 4, \"prefix_group\": 1, \"output_len\": 1}\n", "missing \"prefix_len\""},
      {"{\"prompt_len\": 4, \"prefix_group\": 1, \"prefix_len\": 5, \"output_len\": 1}\n",
       "longer than \"prompt_len\""},
      {"{\"arrival\": -1, \"prompt_len\": 4, \"output_len\": 1}\n", "\"arrival\" must be"},
      {"[1, 2]\n", ":1: expected an object"},
      {"{\"prompt_len\": 4, \"output_len\": 1} x\n", "unexpected text after the value"},
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
  EXPECT_EQ(ReadTrace(testing::TempDir() + "/no_such.jsonl").status().code(),
            StatusCode::kNotFound);
}

TEST(Json, WriterAndReaderAgree) {
  JsonWriter w;
  w.BeginObject().Key("a").Int(-3).Key("b").BeginArray().Double(0.5).Bool(true).Null().EndArray();
  w.Key("s").String("x\"\n\\y").Key("e").BeginObject().EndObject().EndObject();
  Result<JsonValue> v = ParseJson(w.str());
  ASSERT_TRUE(v.ok()) << v.status() << "\n" << w.str();
  EXPECT_EQ(v->Find("a")->number, -3);
  EXPECT_EQ(v->Find("b")->array.size(), 3u);
  EXPECT_EQ(v->Find("s")->string, "x\"\n\\y");
  EXPECT_EQ(v->Find("e")->type, JsonValue::Type::kObject);
  EXPECT_EQ(ParseJson("{\"a\": 1, \"a\": 2}").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseJson("\"\\u00e9\"")->string, "\xc3\xa9");
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
