// SPDX-License-Identifier: Apache-2.0
// `blockkv plan`: golden numbers worked out by hand, checked against what PlanKVCache gives.
#include <gtest/gtest.h>

#include "blockkv/status.h"
#include "commands.h"

namespace blockkv::tool {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

PlanOptions Preset(const char* name, int64_t memory, int64_t slack) {
  PlanOptions options;
  options.shape = *FindModelPreset(name);
  options.memory.kind = MemorySpec::Kind::kBytes;
  options.memory.bytes = memory;
  options.memory.text = "test";
  options.slack = slack;
  return options;
}

TEST(Plan, Llama3_8BOn80GiB) {
  // 32 layers x 16 tokens x 2 (K and V) x 8 KV heads x 128 x 2 bytes (fp16) = 2,097,152 bytes
  // per block (128 KiB per token). 80 GiB - 1 GiB kept free = 79 GiB = 79 x 512 blocks of 2 MiB
  // = 40,448 blocks = 647,168 tokens. A sequence of 8,192 tokens (the default context) takes
  // 512 blocks: 40,448 / 512 = 79 sequences (79.0 exactly).
  Result<PlanReport> r = Plan(Preset("Llama-3-8B", 80 * kGiB, 1 * kGiB));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_per_token, 131072);
  EXPECT_EQ(r->bytes_per_block, 2097152);
  EXPECT_EQ(r->num_blocks, 40448);
  EXPECT_EQ(r->cache_bytes, 79 * kGiB);
  EXPECT_EQ(r->tokens, 647168);
  EXPECT_EQ(r->context, 8192);
  EXPECT_EQ(r->blocks_per_sequence, 512);
  EXPECT_EQ(r->sequences, 79);
}

TEST(Plan, Llama2_13BSplitOverTwoRanks) {
  // 40 KV heads (no GQA), tp 2: 20 per rank. 40 layers x 16 x 2 x 20 x 128 x 2 bytes =
  // 6,553,600 bytes per block per rank. 24 GiB - 2 GiB = 23,622,320,128 bytes;
  // / 6,553,600 = 3,604.48 -> 3,604 blocks = 57,664 tokens. Context 4,096 = 256 blocks:
  // 3,604 / 256 = 14.08 -> 14 sequences.
  PlanOptions options = Preset("Llama-2-13B", 24 * kGiB, 2 * kGiB);
  options.tp = 2;
  Result<PlanReport> r = Plan(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kv_heads_per_rank, 20);
  EXPECT_EQ(r->bytes_per_block, 6553600);
  EXPECT_EQ(r->num_blocks, 3604);
  EXPECT_EQ(r->tokens, 57664);
  EXPECT_EQ(r->blocks_per_sequence, 256);
  EXPECT_EQ(r->sequences, 14);
}

TEST(Plan, SlidingWindowHoldsOnlyTheWindowsBlocks) {
  // Mistral-7B: 2 MiB per block as Llama-3-8B. 16 GiB, nothing kept free: 8,192 blocks. A
  // 32,768-token sequence under a 4,096-token window holds 4,096 / 16 = 256 blocks, plus one
  // when the window straddles a block boundary: 257; 8,192 / 257 = 31.9 -> 31 sequences.
  // Without the window it would be 2,048 blocks each: 4 sequences.
  Result<PlanReport> r = Plan(Preset("Mistral-7B", 16 * kGiB, 0));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_blocks, 8192);
  EXPECT_EQ(r->context, 32768);
  EXPECT_EQ(r->blocks_per_sequence, 257);
  EXPECT_EQ(r->sequences, 31);
  // A context inside the window needs all its blocks: 2,048 tokens = 128 blocks -> 64.
  PlanOptions shorter = Preset("Mistral-7B", 16 * kGiB, 0);
  shorter.context = 2048;
  EXPECT_EQ(Plan(shorter)->sequences, 64);
}

TEST(Plan, CustomShapeFp8AndReplicatedHeads) {
  // 2 layers x 8 tokens x 2 x 4 heads x 64 x 1 byte (fp8) = 8,192 bytes: 1 MiB -> 128 blocks.
  PlanOptions options;
  options.shape = {"custom", 2, 4, 64, 4096, 0};
  options.memory = *ParseMemory("1MiB");
  options.slack = 0;
  options.block_size = 8;
  options.dtype = DType::kFloat8E4M3;
  Result<PlanReport> r = Plan(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_per_block, 8192);
  EXPECT_EQ(r->num_blocks, 128);
  // tp 8 over 4 KV heads: each rank keeps one head (replicated), not half of one.
  options.tp = 8;
  r = Plan(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kv_heads_per_rank, 1);
  EXPECT_EQ(r->bytes_per_block, 2048);
}

TEST(Plan, PresetsAreFoundWhateverTheCase) {
  EXPECT_EQ(ModelPresets().size(), 11u);
  EXPECT_EQ(FindModelPreset("jamba-v0.1")->state_layers, 28);
  EXPECT_EQ(FindModelPreset("deepseek-v3")->latent_dim, 512);
  EXPECT_EQ(FindModelPreset("GEMMA-2-9B")->window_layers, 21);
  ASSERT_NE(FindModelPreset("qwen2.5-7b"), nullptr);
  EXPECT_EQ(FindModelPreset("qwen2.5-7b")->kv_heads, 4);
  EXPECT_EQ(FindModelPreset("gpt-neox-20b")->head_size, 96);
  EXPECT_EQ(FindModelPreset("Llama-4"), nullptr);
}

TEST(Plan, BadArgumentsAreInvalidArgument) {
  PlanOptions options = Preset("Llama-3-8B", 80 * kGiB, 1);
  options.tp = 3;  // 8 KV heads
  EXPECT_EQ(CheckPlanOptions(options).code(), StatusCode::kInvalidArgument);
  options.tp = 1;
  options.block_size = 0;
  EXPECT_EQ(CheckPlanOptions(options).code(), StatusCode::kInvalidArgument);
  options.block_size = 16;
  options.dtype = DType::kInt64;
  EXPECT_EQ(CheckPlanOptions(options).code(), StatusCode::kInvalidArgument);
}

TEST(Plan, TooLittleMemoryIsResourceExhausted) {
  Result<PlanReport> r = Plan(Preset("Llama-3-70B", 1 << 20, 0));
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
}

TEST(Plan, CudaWithoutAGpuIsUnavailable) {
  PlanOptions options = Preset("Llama-3-8B", 0, 1);
  options.memory = *ParseMemory("cuda:0");
  Result<PlanReport> r = Plan(options);
  if (r.ok()) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
}

TEST(Sizes, ParseBinaryAndDecimalUnits) {
  EXPECT_EQ(*ParseSize("80GiB"), 80 * kGiB);
  EXPECT_EQ(*ParseSize("80gib"), 80 * kGiB);
  EXPECT_EQ(*ParseSize("40GB"), 40'000'000'000);
  EXPECT_EQ(*ParseSize("1.5KiB"), 1536);
  EXPECT_EQ(*ParseSize("2 TiB"), 2 * 1024 * kGiB);
  EXPECT_EQ(*ParseSize("512MB"), 512'000'000);
  EXPECT_EQ(*ParseSize("4096"), 4096);
  EXPECT_EQ(*ParseSize("0"), 0);
  for (const char* bad : {"", "GiB", "12XB", "1.2.3GB", "-1GiB", "99999999TiB"}) {
    EXPECT_EQ(ParseSize(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(FormatBytes(2097152), "2.00 MiB");
  EXPECT_EQ(FormatBytes(512), "512 B");
}

TEST(Sizes, MemoryIsASizeHostOrCuda) {
  EXPECT_EQ(ParseMemory("host")->kind, MemorySpec::Kind::kHost);
  EXPECT_EQ(ParseMemory("cuda:1")->ordinal, 1);
  EXPECT_EQ(ParseMemory("cuda:x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseMemory("0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseMemory("8GiB")->bytes, 8 * kGiB);
}

TEST(Plan, JsonHasEveryNumber) {
  const std::string json = FormatPlan(*Plan(Preset("Llama-3-8B", 80 * kGiB, kGiB)), true);
  EXPECT_NE(json.find("\"num_blocks\": 40448"), std::string::npos) << json;
  EXPECT_NE(json.find("\"sequences\": 79"), std::string::npos) << json;
  EXPECT_NE(json.find("\"bytes_per_block\": 2097152"), std::string::npos) << json;
}

TEST(Plan, DeepSeekV3PlansOneLatentRowPerTokenAndLayer) {
  // MLA: 61 layers x 16 tokens x (512 + 64) x 2 bytes (bf16) = 1,124,352 bytes per block, no K/V
  // split (70,272 bytes per token, where 128 heads of K and V would take 61 x 2 x 128 x 192 x 2
  // = 5,996,544). 79 GiB / 1,124,352 = 75,443.6 -> 75,443 blocks = 1,207,088 tokens; a sequence
  // of 163,840 tokens (the model's maximum) takes 10,240 blocks: 7 sequences.
  PlanOptions options = Preset("DeepSeek-V3", 80 * kGiB, 1 * kGiB);
  options.dtype = DType::kBFloat16;
  Result<PlanReport> r = Plan(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_per_token, 70272);
  EXPECT_EQ(r->bytes_per_block, 1124352);
  EXPECT_EQ(r->num_blocks, 75443);
  EXPECT_EQ(r->tokens, 1207088);
  EXPECT_EQ(r->blocks_per_sequence, 10240);
  EXPECT_EQ(r->sequences, 7);
  // The latent is shared by every head: tp 8 replicates it, each rank plans the same.
  options.tp = 8;
  Result<PlanReport> tp = Plan(options);
  ASSERT_TRUE(tp.ok()) << tp.status();
  EXPECT_EQ(tp->bytes_per_block, 1124352);
  EXPECT_EQ(tp->num_blocks, 75443);
  const std::string text = FormatPlan(*tp, false);
  EXPECT_NE(text.find("MLA latent 512 + rope 64"), std::string::npos) << text;
  EXPECT_NE(text.find("replicated on every rank"), std::string::npos) << text;
  const std::string json = FormatPlan(*tp, true);
  EXPECT_NE(json.find("\"latent_dim\": 512"), std::string::npos) << json;
  EXPECT_NE(json.find("\"rope_dim\": 64"), std::string::npos) << json;
}

TEST(Plan, CustomMlaShapeMustNotNameKvHeads) {
  PlanOptions options = Preset("DeepSeek-V3", 80 * kGiB, 1 * kGiB);
  options.shape.kv_heads = 128;
  EXPECT_EQ(CheckPlanOptions(options).code(), StatusCode::kInvalidArgument);
  options = Preset("DeepSeek-V3", 80 * kGiB, 1 * kGiB);
  options.shape.latent_dim = 0;  // rope without a latent
  EXPECT_EQ(CheckPlanOptions(options).code(), StatusCode::kInvalidArgument);
}

TEST(Plan, HybridGemma2PlansADenseAndALocalGroupInOneSharedPool) {
  // A block of one layer: 16 x 2 x 8 x 256 x 2 = 131,072 bytes; 79 GiB usable. Context 8,192 =
  // 512 blocks; the 21 window layers need 4,096 / 16 + 1 = 257 of them.
  Result<PlanReport> r = Plan(Preset("Gemma-2-9B", 80 * kGiB, 1 * kGiB));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->hybrid);
  // Its tokens are those of the sequences that fit: a token takes an entry in both groups.
  EXPECT_EQ(r->tokens, r->sequences * 8192);
  EXPECT_NE(FormatPlan(*r, false).find("tokens     327680 in the sequences below"),
            std::string::npos);
  // One group of all 42 layers (5,505,024 bytes a block): 15,408 blocks, 30 sequences; the window
  // layers hold 21 x 255 / (42 x 512) = 24.9% past their window (vLLM's RFC: 25% for Gemma-2).
  EXPECT_DOUBLE_EQ(r->window_waste, 21.0 * 255 / (42 * 512));
  EXPECT_EQ(r->one_group.sequences, 30);
  // A pool per group, one block count (15,408) for both: the DENSE pool bounds it at 30, and
  // 1 - 30 x (21 x 512 + 21 x 257) / (15,408 x 42) = 25.1% of the cache is left unused.
  EXPECT_EQ(r->separate_pools.sequences, 30);
  EXPECT_NEAR(r->separate_pools.unused, 1.0 - 30.0 * (21 * 512 + 21 * 257) / (15408.0 * 42), 1e-12);
  // One shared pool of 21-layer blocks (2,752,512 bytes): 30,817 blocks, 769 a sequence: 40.
  EXPECT_EQ(r->pool_layers, 21);
  EXPECT_EQ(r->bytes_per_block, 2752512);
  EXPECT_EQ(r->num_blocks, 30817);
  EXPECT_EQ(r->dense_blocks, 512);
  EXPECT_EQ(r->local_blocks, 257);
  EXPECT_EQ(r->blocks_per_sequence, 769);
  EXPECT_EQ(r->sequences, 40);
  EXPECT_EQ(r->shared_pool.sequences, 40);
  EXPECT_NEAR(r->shared_pool.unused, 1.0 - 40.0 * 769 / 30817, 1e-12);
  const std::string text = FormatPlan(*r, false);
  EXPECT_NE(text.find("21 of them with a sliding window of 4096"), std::string::npos) << text;
  EXPECT_NE(text.find("DENSE 21 layers + LOCAL 21 layers (window 4096) in one shared pool"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("DENSE + LOCAL, a pool per group             30   25.1%"), std::string::npos)
      << text;
  EXPECT_NE(text.find("DENSE + LOCAL, one shared pool              40    0.2%  (1.33x"),
            std::string::npos)
      << text;
  const std::string json = FormatPlan(*r, true);
  EXPECT_NE(json.find("\"separate_pools\""), std::string::npos) << json;
}

TEST(Plan, HybridGptOss20bDoublesItsSequencesInOneSharedPool) {
  // A block of one layer: 16 x 2 x 8 x 64 x 2 = 32,768 bytes; 131,072 tokens = 8,192 blocks, the
  // 12 window layers need 128 / 16 + 1 = 9.
  Result<PlanReport> r = Plan(Preset("gpt-oss-20b", 80 * kGiB, 1 * kGiB));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->window_waste, 12.0 * 8183 / (24 * 8192));  // 49.9% as one group
  EXPECT_EQ(r->one_group.sequences, 13);
  EXPECT_EQ(r->separate_pools.sequences, 13);
  EXPECT_EQ(r->num_blocks, 215722);  // 12-layer blocks of 393,216 bytes
  EXPECT_EQ(r->blocks_per_sequence, 8192 + 9);
  EXPECT_EQ(r->sequences, 26);
  EXPECT_NE(FormatPlan(*r, false).find("(2.00x a pool per group)"), std::string::npos);
  // A short context that fits the window wastes nothing, in any layout.
  PlanOptions options = Preset("gpt-oss-20b", 80 * kGiB, 1 * kGiB);
  options.context = 128;
  Result<PlanReport> short_context = Plan(options);
  ASSERT_TRUE(short_context.ok()) << short_context.status();
  EXPECT_EQ(short_context->window_waste, 0.0);
  EXPECT_EQ(short_context->local_blocks, 8);
}

TEST(Plan, HybridWithUnequalLayerCountsPadsTheSmallerGroup) {
  PlanOptions options = Preset("Gemma-2-9B", 80 * kGiB, 1 * kGiB);
  options.shape.window_layers = 14;  // 28 full + 14 window layers: both padded to 28
  Result<PlanReport> r = Plan(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->pool_layers, 28);
  EXPECT_EQ(r->bytes_per_block, 28 * 131072);
  // The padding is unused: 14 of the 56 layers of a LOCAL block are there only to share.
  EXPECT_GT(r->shared_pool.unused, 0.0);
  EXPECT_NE(FormatPlan(*r, false).find("the smaller group padded"), std::string::npos);
}

TEST(Plan, JambaPlansItsMambaLayersAsOneStateSlotPerSequence) {
  // 4 attention layers: 16 x 2 x 8 x 128 x 2 x 4 = 262,144 bytes a block; 262,144 tokens =
  // 16,384 blocks (4 GiB) a sequence, plus 28 x 311,296 bytes (8.31 MiB) of state.
  Result<PlanReport> r = Plan(Preset("Jamba-v0.1", 80 * kGiB, 1 * kGiB));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_per_block, 262144);
  EXPECT_EQ(r->state_bytes_per_sequence, 28 * 311296);
  const int64_t per_sequence = int64_t{16384} * 262144 + 28 * 311296;
  EXPECT_EQ(r->sequences, 79 * kGiB / per_sequence);  // 19
  EXPECT_EQ(r->sequences, 19);
  EXPECT_EQ(r->one_group.sequences, 2);  // every layer as attention: 2 MiB a block
  // vLLM pads instead: 311,296 bytes of state per layer need 76 tokens of one layer's K and V
  // (4,096 bytes a token), blocks of 80: 327,680-byte pages, 5% of each state page padding.
  EXPECT_EQ(r->padded_block_size, 80);
  EXPECT_NEAR(r->state_padding, (327680.0 - 311296) / 327680, 1e-12);
  const std::string text = FormatPlan(*r, false);
  EXPECT_NE(text.find("DENSE 4 attention layers + STATE 28 layers"), std::string::npos) << text;
  EXPECT_NE(text.find("MemoryConfig.state_slots = 19"), std::string::npos) << text;
  EXPECT_NE(text.find("5.0% of each state page padding"), std::string::npos) << text;
  PlanOptions bad = Preset("Jamba-v0.1", 80 * kGiB, 1 * kGiB);
  bad.shape.state_layers = 32;  // no attention layer left
  EXPECT_EQ(CheckPlanOptions(bad).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace blockkv::tool
