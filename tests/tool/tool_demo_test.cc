// `blockkv demo` on a tiny configuration: the paged run (state manager, prefix cache, AppendKV,
// PagedAttention, preemption through the host tier or by recompute) must give the same greedy
// tokens as the dense-cache reference.
#include <gtest/gtest.h>

#include "commands.h"

namespace blockkv::tool {
namespace {

DemoOptions Tiny() {
  DemoOptions options;
  options.requests = 5;
  options.prompt_groups = 2;
  options.system_len = 32;
  options.output_len = 8;
  options.engine.token_budget = 64;  // prompts of 40-48 tokens: chunked prefill
  return options;
}

TEST(Demo, PagedRunEqualsDenseThroughTheHostTier) {
  // The default cache holds a third of what all requests would at once: requests are preempted
  // to the host tier and resumed.
  Result<DemoReport> r = Demo(Tiny());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->checked);
  EXPECT_TRUE(r->identical) << r->mismatch;
  EXPECT_EQ(r->generated, 5 * 8);
  EXPECT_GT(r->stats.preemptions, 0);
  EXPECT_EQ(r->stats.resumes, r->stats.preemptions);
  EXPECT_GT(r->stats.hit_tokens, 0);  // the shared system prompts
  // fp32 cache: only the attention's summation order differs from the reference.
  EXPECT_LT(r->max_logit_diff, 1e-3);
  EXPECT_EQ(r->outputs.size(), 5u);
}

TEST(Demo, PagedRunEqualsDenseWhenPreemptionRecomputes) {
  DemoOptions options = Tiny();
  options.engine.host_blocks = 0;
  Result<DemoReport> r = Demo(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->identical) << r->mismatch;
  EXPECT_EQ(r->stats.preemptions, 0);
  EXPECT_GT(r->stats.recomputations, 0);
}

TEST(Demo, AmpleCacheNeedsNoPreemption) {
  DemoOptions options = Tiny();
  options.engine.num_blocks = 64;
  Result<DemoReport> r = Demo(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->identical) << r->mismatch;
  EXPECT_EQ(r->stats.preemptions + r->stats.recomputations, 0);
  const std::string json = FormatDemo(*r, options, true);
  EXPECT_NE(json.find("\"identical\": true"), std::string::npos) << json;
}

TEST(Demo, MissingCheckpointIsNotFound) {
  DemoOptions options = Tiny();
  options.model_path = testing::TempDir() + "/no_such_model.bin";
  EXPECT_EQ(Demo(options).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace blockkv::tool
