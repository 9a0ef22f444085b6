// SPDX-License-Identifier: Apache-2.0
// `blockkv demo` on a tiny configuration: the paged run (state manager, prefix cache, AppendKV,
// PagedAttention, preemption through the host tier or by recompute) must give the same greedy
// tokens as the dense-cache reference.
#include <gtest/gtest.h>

#include <fstream>
#include <vector>

#include "commands.h"
#include "model.h"

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

// Speculative decoding with rollback (issue 21): drafts from the model's first layer, verified
// by all four, give exactly the paged run's greedy tokens; the demo fails otherwise.
TEST(Demo, SpeculativeDecodingEqualsGreedyWithRollbacks) {
  DemoOptions options = Tiny();
  options.draft_layers = 1;
  Result<DemoReport> r = Demo(options);
  ASSERT_TRUE(r.ok()) << r.status();
  const DemoReport::Speculative& spec = r->speculative;
  EXPECT_TRUE(spec.ran);
  EXPECT_EQ(spec.generated, 5 * 8);
  EXPECT_EQ(spec.draft_layers, 1);
  EXPECT_EQ(spec.draft_tokens, 4);
  EXPECT_GT(spec.drafted, 0);
  EXPECT_LE(spec.accepted, spec.drafted);
  EXPECT_GT(spec.rollbacks, 0);  // a one-layer draft is wrong often
  // Every full-model forward yields one token of its own, plus the drafts it accepted.
  EXPECT_EQ(spec.generated, spec.target_forwards + spec.accepted);
  const std::string text = FormatDemo(*r, options, false);
  EXPECT_NE(text.find("identical to greedy (40 tokens)"), std::string::npos) << text;
  const std::string json = FormatDemo(*r, options, true);
  EXPECT_NE(json.find("\"acceptance_rate\""), std::string::npos) << json;
}

// The whole model as its own draft: every draft is accepted, nothing is rolled back, and each
// full-model forward yields k + 1 tokens.
TEST(Demo, SpeculativeDecodingWithTheModelAsItsOwnDraftAcceptsEverything) {
  DemoOptions options = Tiny();
  options.draft_layers = 4;
  options.check = false;
  Result<DemoReport> r = Demo(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->speculative.accepted, r->speculative.drafted);
  EXPECT_EQ(r->speculative.rollbacks, 0);
  // Per request: the prefill's token, then 7 more in forwards of up to 5 (5, then 2).
  EXPECT_EQ(r->speculative.target_forwards, 5 * 3);
}

TEST(Demo, SpeculativeDecodingRejectsADraftDeeperThanTheModel) {
  DemoOptions options = Tiny();
  options.draft_layers = 5;
  Result<DemoReport> r = Demo(options);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("a draft of 5 layers: the model has 4"), std::string::npos)
      << r.status();
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

TEST(Demo, LogitsThatOverflowFailTheCheck) {
  // Finite weights whose logits overflow: a classifier of 3e38 (the unshared wcls ends the file).
  // The demo reported "identical ... smallest top-2 margin inf" and succeeded before.
  ModelConfig config;
  config.dim = 64;
  config.hidden_dim = 96;
  config.n_layers = 1;
  config.n_heads = 1;
  config.n_kv_heads = 1;
  config.vocab_size = 32;
  config.seq_len = 64;
  config.shared_classifier = false;
  const std::string path = testing::TempDir() + "/overflow.bin";
  ASSERT_TRUE(Model::Random(config, 1)->SaveLlama2c(path).ok());
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-static_cast<std::streamoff>(4 * config.vocab_size * config.dim), std::ios::end);
    const std::vector<float> huge(static_cast<size_t>(config.vocab_size * config.dim), 3e38F);
    file.write(reinterpret_cast<const char*>(huge.data()), std::ssize(huge) * 4);
  }
  DemoOptions options = Tiny();
  options.model_path = path;
  options.system_len = 16;
  options.output_len = 2;
  Result<DemoReport> r = Demo(options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("the paged run's logits are not finite"), std::string::npos)
      << r.status();
}

TEST(Demo, CheckThatWouldHoldTooManyLogitsIsRefused) {
  DemoOptions options = Tiny();
  options.requests = kMaxDemoRequests;
  options.system_len = 16;
  options.output_len = 512;
  // 2 x 16384 x 512 x 256 (the random model's vocabulary) x 4 bytes = 16 GiB.
  Result<DemoReport> r = Demo(options);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("the dense comparison keeps 16.00 GiB of logits"),
            std::string::npos)
      << r.status();
}

TEST(Demo, MissingCheckpointIsNotFound) {
  DemoOptions options = Tiny();
  options.model_path = testing::TempDir() + "/no_such_model.bin";
  EXPECT_EQ(Demo(options).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace blockkv::tool
