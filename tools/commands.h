// SPDX-License-Identifier: Apache-2.0
// The subcommands of the `blockkv` tool as functions, so that tests call them without a process:
// each takes its options (parsed by main.cc) and returns a report or the Status that main.cc
// turns into exit code 1. Arguments that are wrong whatever the machine (exit code 2) are
// rejected by main.cc and by the Check* functions here before anything runs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "blockkv/dtype.h"
#include "blockkv/status.h"
#include "engine.h"
#include "json.h"

namespace blockkv::tool {

// ---- sizes ----

// "80GiB", "1.5 TiB", "512MB", "4096" (bytes): binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB,
// case-insensitive, fractions rounded down to a byte. kInvalidArgument names the text.
Result<int64_t> ParseSize(std::string_view text);
// "2.00 MiB", "512 B".
std::string FormatBytes(int64_t bytes);
// A non-negative integer; kInvalidArgument otherwise.
Result<int64_t> ParseCount(std::string_view text);

// ---- plan ----

// The attention shape of a model, which is all the KV cache depends on.
struct ModelShape {
  std::string name;  // a preset's name, or "custom"
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_size = 0;
  int64_t max_context = 4096;  // the default --context
  int64_t sliding_window = 0;  // 0: full attention
  // Hybrid models (Gemma 2, gpt-oss): how many of the layers slide over `sliding_window` tokens;
  // the others attend to everything. 0: all of them (when sliding_window > 0).
  int64_t window_layers = 0;
  // MLA models (DeepSeek-V3): one latent row of latent_dim + rope_dim per token and layer,
  // shared by every head (kv_heads 1, head_size latent_dim + rope_dim, the same on every tp rank).
  int64_t latent_dim = 0;  // 0: not MLA
  int64_t rope_dim = 0;
  // Hybrid attention + Mamba models (Jamba): how many of the layers keep a fixed state per
  // sequence instead of KV (a STATE cache group), and that state's bytes per layer.
  int64_t state_layers = 0;
  int64_t state_bytes = 0;
};
// Llama-3-8B, Llama-3-70B, Llama-2-13B, Mistral-7B, Qwen2.5-7B, GPT-NeoX-20B, Phi-3-mini,
// DeepSeek-V3, Gemma-2-9B, gpt-oss-20b, Jamba-v0.1.
std::span<const ModelShape> ModelPresets();
// Case-insensitive; nullptr when there is no such preset.
const ModelShape* FindModelPreset(std::string_view name);

// Where the cache's memory comes from: a size, "host" (CpuDevice()), or "cuda:N".
struct MemorySpec {
  enum class Kind { kBytes, kHost, kCuda };
  Kind kind = Kind::kBytes;
  int64_t bytes = 0;  // kBytes
  int ordinal = 0;    // kCuda
  std::string text;   // as given
};
Result<MemorySpec> ParseMemory(std::string_view text);

struct PlanOptions {
  ModelShape shape;
  MemorySpec memory;
  int64_t slack = int64_t{1} << 30;  // bytes left free (MemoryConfig::size in RESERVE mode)
  int32_t block_size = 16;
  DType dtype = DType::kFloat16;
  int64_t tp = 1;       // tensor-parallel ranks: KV heads split across them
  int64_t context = 0;  // tokens per sequence; 0: the model's max_context
};

struct PlanReport {
  PlanOptions options;
  int64_t kv_heads_per_rank = 0;  // kv_heads / tp, or 1 when tp > kv_heads (heads replicated)
  int64_t context = 0;
  int64_t available_bytes = 0;  // memory the plan sees, per rank
  int64_t bytes_per_token = 0;  // per rank
  int64_t bytes_per_block = 0;  // per rank
  int64_t num_blocks = 0;
  int64_t cache_bytes = 0;  // num_blocks · bytes_per_block, per rank
  int64_t tokens = 0;       // num_blocks · block_size; hybrid: the sequences' tokens (below)
  int64_t blocks_per_sequence = 0;
  int64_t sequences = 0;  // of `context` tokens
  // Hybrid models, planned as one group of every layer: the fraction of the cache that holds
  // blocks only full-attention layers need (the window layers keep every block too). 0 otherwise.
  double window_waste = 0;
  // Hybrid models (0 < window_layers < layers) are planned as a DENSE and a LOCAL cache group in
  // one shared pool (MemoryConfig::shared_pool), both padded to `pool_layers` layers; the
  // headline numbers above are that plan's (a block: one block of pool_layers layers;
  // blocks_per_sequence: its DENSE plus its LOCAL blocks). Beside it, what the other layouts
  // hold: sequences of `context` tokens and the share of the cache those leave unused (blocks
  // no layer needs, padding layers, blocks no sequence fits in).
  struct Layout {
    int64_t sequences = 0;
    double unused = 0;
  };
  bool hybrid = false;
  int64_t pool_layers = 0;
  int64_t dense_blocks = 0;  // per sequence
  int64_t local_blocks = 0;  // per sequence: the window's
  Layout one_group;          // every layer one full-attention group
  Layout separate_pools;     // DENSE + LOCAL, a pool of one block count each (DeepSpeed's)
  Layout shared_pool;        // DENSE + LOCAL, one pool (the headline)
  // State models (state_layers > 0) are planned as a DENSE group of the attention layers and a
  // STATE group with one slot per sequence (its own pool, MemoryConfig::state_slots = the
  // sequences that fit, planned first); the headline numbers are the DENSE group's.
  // one_group: every layer planned as attention, for comparison. state_padding: the share of a
  // state page that is padding when, as vLLM does, the attention block size is raised until a
  // page of one layer holds a layer's state (padded_block_size tokens).
  int64_t state_bytes_per_sequence = 0;
  int64_t padded_block_size = 0;
  double state_padding = 0;
};

// kInvalidArgument for shapes, block sizes and tp that no machine could plan (exit code 2).
Status CheckPlanOptions(const PlanOptions& options);
// PlanKVCache over the resolved memory. kUnavailable for cuda:N without CUDA or that GPU;
// kResourceExhausted when not one block fits.
Result<PlanReport> Plan(const PlanOptions& options);
std::string FormatPlan(const PlanReport& report, bool json);

// ---- simulate ----

struct WorkloadOptions {
  int64_t requests = 200;
  int64_t prefix_groups = 8;     // distinct system prompts
  double shared_fraction = 0.8;  // requests that start with one of them
  double rate = 0.5;             // mean arrivals per step (Poisson)
  uint64_t seed = 1;
};
// The most requests `simulate` generates: a run of this many takes minutes (the generator
// itself holds one request at a time).
inline constexpr int64_t kMaxGeneratedRequests = 10'000'000;
inline constexpr int64_t kMaxPrefixGroups = 1'000'000;

// ShareGPT-like: system prompts of 128-1024 tokens; user turns and outputs log-normal (medians
// 150 and 200 tokens, clipped to [4, 2048] and [1, 1024]). One request at a time.
class WorkloadGenerator : public RequestSource {
 public:
  explicit WorkloadGenerator(const WorkloadOptions& options);
  Result<bool> Next(EngineRequest* out) override;
  int64_t total() const override { return options_.requests; }

 private:
  WorkloadOptions options_;
  std::mt19937_64 rng_;
  std::vector<int64_t> system_len_;  // per prefix group
  std::lognormal_distribution<double> user_;
  std::lognormal_distribution<double> output_;
  std::exponential_distribution<double> gap_;
  std::bernoulli_distribution shared_;
  double t_ = 0;  // the next arrival
  int64_t next_ = 0;
};
// All of a generator's requests (tests; the tool streams them).
std::vector<EngineRequest> GenerateWorkload(const WorkloadOptions& options);

// One line of a JSONL trace, as written: {"arrival": 3, "prompt": [1, 2, 3], "output_len": 16} or
// {"arrival": 3, "prompt_len": 700, "prefix_group": 2, "prefix_len": 512, "output_len": 128}.
struct TraceLine {
  int64_t arrival = 0;
  std::vector<TokenId> prompt;  // empty: prompt_len made-up tokens
  int64_t prompt_len = 0;
  std::string prefix_group;  // a string, or an integer's decimal digits
  bool group_is_string = false;
  int64_t prefix_len = 0;
  int64_t output_len = 0;
};
// Parses one line (nlohmann-json's SAX parser: strict JSON, exact integers, valid UTF-8).
// kInvalidArgument names the field, the value and the limit; a prompt longer than max_tokens
// (the context limit) stops the parse rather than growing.
Result<TraceLine> ParseTraceLine(std::string_view text, int64_t max_tokens);

// The requests of a JSONL trace, read one line at a time as the engine replays them. Made-up
// token ids of a length-only request: the first prefix_len from its prefix group (so requests of
// a group share them), the rest from its line.
class TraceReader : public RequestSource {
 public:
  // OpenInputFile's errors (json.h).
  Status Open(const std::string& path, int64_t max_tokens);
  // Reads from an open `file` (fmemopen in fuzzers), named `path` in messages.
  void Attach(std::FILE* file, const std::string& path, int64_t max_tokens);
  // kInvalidArgument "path:line: ..." naming the bad field, and "path: no requests in the trace"
  // for a file without any.
  Result<bool> Next(EngineRequest* out) override;

 private:
  JsonlReader reader_;
  int64_t max_tokens_ = 0;
  int64_t requests_ = 0;
};
// Every request of a trace (tests; the tool streams them).
Result<std::vector<EngineRequest>> ReadTrace(const std::string& path,
                                             int64_t max_tokens = EngineOptions{}.max_context);

// `simulate --engines N`: at most this many engines in one process.
inline constexpr int32_t kMaxSimulatedEngines = 64;

struct SimulateOptions {
  EngineOptions engine;
  bool progress = false;  // a progress bar on stderr
  // The requests are dealt round-robin (request i to engine i mod N) over this many engines, each
  // its own StateManager; they run side by side in one clock (the engines behind step together).
  int32_t engines = 1;
  // `--remote URL`: every engine gets this remote tier (engine.prefix_cache must be on), and the
  // same requests also run over the same engines without it, for the report's comparison.
  std::optional<RemoteTierConfig> remote{};
};
// Per forward step, for the plot.
struct StepSample {
  int64_t step = 0;
  double occupancy = 0;  // blocks held by sequences / all blocks
  double hit_rate = 0;   // prefix-cache hit tokens / queried tokens so far
};
struct SimulateReport {
  std::string source;  // "trace.jsonl" or "generated (seed 1)", for the report
  EngineStats stats;
  double seconds = 0;
  double cpu_seconds = 0;  // of the process, every thread: steadier than wall time under load
  // Every step's, up to kMaxSamples; a longer run keeps every 2nd, 4th, ... step's.
  static constexpr int64_t kMaxSamples = 1 << 16;
  std::vector<StepSample> samples;
  int32_t engines = 1;
  // With --remote: the tier's counters summed over the engines, whether it was reachable, and
  // the same run's stats without the tier.
  bool remote = false;
  bool remote_connected = false;
  RemoteTierStats tier{};
  EngineStats without_tier{};
};
// Runs the requests of `source` (which Simulate reads as it replays them).
Result<SimulateReport> Simulate(RequestSource& source, const SimulateOptions& options);
Result<SimulateReport> Simulate(std::span<const EngineRequest> requests,
                                const SimulateOptions& options);
std::string FormatSimulate(const SimulateReport& report, const EngineOptions& engine, bool json);

// Two polylines, occupancy and hit rate against the step, in a standalone SVG document.
std::string PlotSvg(std::span<const StepSample> samples, std::string_view title);
// Writes `text` to `path`; FileError's codes (json.h) name the path and the reason.
Status WriteFile(const std::string& path, std::string_view text);
// Whether the progress bar can be drawn.
bool StderrIsTerminal();

// ---- demo ----

struct DemoOptions {
  std::string model_path;  // a llama2.c checkpoint; empty: the built-in random model
  uint64_t seed = 7;
  int64_t requests = 16;
  int64_t prompt_groups = 4;  // shared system prompts
  int64_t system_len = 64;    // tokens of each
  int64_t output_len = 32;    // greedy tokens per request
  // Cache and batching; num_blocks 0: a third of what every request at once would hold (at
  // least the largest request), so that requests are preempted.
  // host_blocks -1: a host tier as large as the cache.
  EngineOptions engine{
      .block_size = 16, .num_blocks = 0, .token_budget = 128, .max_seqs = 16, .host_blocks = -1};
  bool check = true;  // compare with the dense-cache run
  // Speculative decoding after the paged run: drafts of `draft_tokens` tokens from the model's
  // first `draft_layers` layers (0: half, at least 1), verified by the full model; the tokens
  // must equal the paged run's greedy ones. draft_tokens 0: skipped.
  int32_t draft_tokens = 4;
  int32_t draft_layers = 0;
};
// Bounds on what `demo` may be asked to hold (main.cc checks the flags against them; Demo checks
// what depends on the model).
inline constexpr int64_t kMaxDemoRequests = 16384;
inline constexpr int64_t kMaxDemoLogitBytes = int64_t{1} << 30;

struct DemoReport {
  EngineStats stats;
  std::string model;             // what ran
  double paged_seconds = 0;      // the engine, state manager and kernels
  double dense_seconds = 0;      // the same requests one by one on a dense cache
  double paged_cpu_seconds = 0;  // process CPU time (the kernels' threads included) of each run
  double dense_cpu_seconds = 0;
  int64_t dense_tokens = 0;  // tokens the dense run computed
  int64_t generated = 0;     // greedy tokens per run
  int32_t host_blocks = 0;   // the host tier used
  bool checked = false;
  bool identical = false;                     // every greedy token equal
  double max_logit_diff = 0;                  // over every sampled position
  double min_margin = 0;                      // smallest top-1 − top-2 logit gap of the paged run
  std::string mismatch;                       // the first difference, when not identical
  std::vector<std::vector<int32_t>> outputs;  // per request, the paged run's tokens
  // Speculative decoding (draft_tokens > 0): StateManager::PostForward with accepted counts on
  // the full model's cache, Rollback on the draft's.
  struct Speculative {
    bool ran = false;
    int32_t draft_layers = 0;
    int32_t draft_tokens = 0;  // k
    int64_t drafted = 0;       // draft tokens the full model verified
    int64_t accepted = 0;      // of them kept
    int64_t target_forwards = 0;
    int64_t generated = 0;  // tokens it produced (equal to the greedy run's, or it fails)
    int64_t rollbacks = 0;  // Rollback calls on the draft's cache
    double seconds = 0;
    double acceptance() const {
      return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0;
    }
  } speculative;
};
Result<DemoReport> Demo(const DemoOptions& options);
std::string FormatDemo(const DemoReport& report, const DemoOptions& options, bool json);

}  // namespace blockkv::tool
