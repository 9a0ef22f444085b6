// SPDX-License-Identifier: Apache-2.0
// `blockkv demo`: a tiny Llama generates for a batch of requests with shared system prompts
// through the library's real path — StateManager (prefix cache on, a cache small enough that
// requests are preempted), RaggedBatch, AppendKV and PagedAttention on an fp32 cache — and the
// greedy tokens are checked against the same model run one request at a time over a plain
// dense cache.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <random>

#include "commands.h"
#include "json.h"
#include "model.h"

namespace blockkv::tool {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double CpuSeconds(std::clock_t since) {  // the process's, every thread
  return static_cast<double>(std::clock() - since) / CLOCKS_PER_SEC;
}

double Margin(std::span<const float> logits) {  // top-1 − top-2
  float first = -INFINITY, second = -INFINITY;
  for (const float x : logits) {
    if (x > first) {
      second = first;
      first = x;
    } else if (x > second) {
      second = x;
    }
  }
  return static_cast<double>(first) - second;
}

// A NaN or an infinity in the logits (a checkpoint of non-finite or overflowing weights) makes
// greedy sampling meaningless and the comparison vacuous (NaN != NaN, inf - inf): a failure.
Status CheckFinite(std::span<const float> logits, const char* run, size_t request, int64_t token) {
  const auto bad =
      std::find_if(logits.begin(), logits.end(), [](float x) { return !std::isfinite(x); });
  if (bad == logits.end()) return Status::Ok();
  return DataLossError(std::string("the ") + run + " run's logits are not finite (" +
                       std::to_string(*bad) + " for token id " +
                       std::to_string(bad - logits.begin()) + " at request " +
                       std::to_string(request) + ", token " + std::to_string(token) +
                       "): the model's weights or activations overflow");
}

// The engine's StepRunner for the demo: the model's forward over the batch, greedy sampling,
// and every sampled position's logits kept per request for the comparison.
class ModelRunner : public StepRunner {
 public:
  // keep_logits: keep every sampled position's logits for the dense comparison.
  ModelRunner(const Model& model, const Engine& engine, size_t requests, bool keep_logits)
      : model_(model), engine_(engine), keep_logits_(keep_logits), logits_(requests) {}

  Status Run(const RaggedBatch& batch, std::span<const size_t> requests,
             std::span<const uint8_t> sample, std::span<TokenId> next) override {
    tokens_.clear();
    rows_.clear();
    for (int32_t i = 0; i < batch.current_sequences(); ++i) {
      const RaggedBatch::Inserted entry = batch.inserted(i);
      for (const int64_t t : entry.tokens) tokens_.push_back(static_cast<int32_t>(t));
      if (sample[i] != 0) rows_.push_back(std::ssize(tokens_) - 1);
    }
    const int32_t vocab = model_.config().vocab_size;
    out_.resize(rows_.size() * static_cast<size_t>(vocab));
    PagedAttentionBackend paged(engine_.manager(), batch, model_.config());
    BLOCKKV_RETURN_IF_ERROR(model_.Forward(tokens_, paged, rows_, out_));
    size_t row = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (sample[i] == 0) continue;
      const std::span<const float> logits(out_.data() + row * vocab, static_cast<size_t>(vocab));
      const size_t r = requests[i];
      BLOCKKV_RETURN_IF_ERROR(CheckFinite(logits, "paged", r, std::ssize(logits_[r])));
      next[i] = ArgMax(logits);
      min_margin_ = std::min(min_margin_, Margin(logits));
      if (keep_logits_) {
        logits_[r].emplace_back(logits.begin(), logits.end());
      } else {
        logits_[r].emplace_back();  // counts the request's tokens
      }
      ++row;
    }
    return Status::Ok();
  }

  // Per request, per generated token, the logits it was sampled from (empty without keep_logits).
  const std::vector<std::vector<std::vector<float>>>& logits() const { return logits_; }
  // The smallest top-1 − top-2 gap over every sampled position.
  double min_margin() const { return min_margin_; }

 private:
  const Model& model_;
  const Engine& engine_;
  bool keep_logits_;
  double min_margin_ = INFINITY;
  std::vector<std::vector<std::vector<float>>> logits_;
  std::vector<int32_t> tokens_;
  std::vector<int64_t> rows_;
  std::vector<float> out_;
};

// Requests sharing `prompt_groups` system prompts, each with its own user turn of 8 to
// system_len / 2 tokens, all arriving at step 0.
std::vector<EngineRequest> MakeRequests(const DemoOptions& options, int32_t vocab) {
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  // Groups no request would use are not made.
  std::vector<std::vector<TokenId>> systems(
      static_cast<size_t>(std::min(options.prompt_groups, options.requests)));
  for (auto& s : systems) {
    s.resize(static_cast<size_t>(options.system_len));
    for (TokenId& t : s) t = token(rng);
  }
  std::uniform_int_distribution<int64_t> user(8, std::max<int64_t>(8, options.system_len / 2));
  std::vector<EngineRequest> requests(static_cast<size_t>(options.requests));
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt = systems[i % systems.size()];
    const int64_t own = user(rng);
    for (int64_t j = 0; j < own; ++j) requests[i].prompt.push_back(token(rng));
    requests[i].output_len = options.output_len;
  }
  return requests;
}

// The dense-cache reference for one request: prefill the prompt in one forward, then one token
// at a time; the logits of each sampled position into `logits`.
Status GenerateDense(const Model& model, const EngineRequest& request, size_t index,
                     std::vector<TokenId>* tokens, std::vector<std::vector<float>>* logits) {
  const int64_t vocab = model.config().vocab_size;
  DenseAttentionBackend dense(model.config(), std::ssize(request.prompt) + request.output_len);
  std::vector<int32_t> input(request.prompt.begin(), request.prompt.end());
  std::vector<float> out(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < request.output_len; ++i) {
    const std::array<int64_t, 1> row = {std::ssize(input) - 1};
    BLOCKKV_RETURN_IF_ERROR(model.Forward(input, dense, row, out));
    dense.Advance(std::ssize(input));
    BLOCKKV_RETURN_IF_ERROR(CheckFinite(out, "dense", index, i));
    const int32_t next = ArgMax(out);
    tokens->push_back(next);
    logits->push_back(out);
    input.assign(1, next);
  }
  return Status::Ok();
}

// What the options make the demo hold, against the model's context and a memory bound, before
// anything is allocated. REQUIRES: the counts are in main.cc's ranges (each < 2^31), so the
// products below fit 64 bits.
Status CheckDemoSizes(const DemoOptions& options, const ModelConfig& config) {
  const int64_t user = std::max<int64_t>(8, options.system_len / 2);
  const int64_t longest = options.system_len + user + options.output_len - 1;
  if (longest > config.seq_len) {
    return InvalidArgumentError(
        "a request holds up to " + std::to_string(longest) + " tokens (--system-len " +
        std::to_string(options.system_len) + ", a user turn of up to " + std::to_string(user) +
        ", --output-len " + std::to_string(options.output_len) +
        " - 1), more than the model's context of " + std::to_string(config.seq_len));
  }
  if (options.check) {
    // The comparison keeps the logits of every sampled position of both runs.
    const int64_t bytes = 2 * options.requests * options.output_len * config.vocab_size * 4;
    if (bytes > kMaxDemoLogitBytes) {
      return InvalidArgumentError(
          "the dense comparison keeps " + FormatBytes(bytes) + " of logits (2 runs x --requests " +
          std::to_string(options.requests) + " x --output-len " +
          std::to_string(options.output_len) + " x vocabulary " +
          std::to_string(config.vocab_size) + " x 4 bytes), more than the limit of " +
          FormatBytes(kMaxDemoLogitBytes) + ": give fewer, or --no-check");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<DemoReport> Demo(const DemoOptions& options) {
  if (options.requests <= 0 || options.prompt_groups <= 0 || options.system_len <= 0 ||
      options.output_len <= 0 || options.engine.block_size <= 0) {
    return InvalidArgumentError(
        "requests, prompt groups, system length, output length and "
        "block size must be > 0");
  }
  DemoReport report;
  Result<Model> loaded = options.model_path.empty()
                             ? Model::Random(ModelConfig{.shared_classifier = false}, options.seed)
                             : Model::LoadLlama2c(options.model_path);
  BLOCKKV_RETURN_IF_ERROR(loaded.status());
  const Model& model = *loaded;
  const ModelConfig& config = model.config();
  BLOCKKV_RETURN_IF_ERROR(CheckDemoSizes(options, config));
  report.model = (options.model_path.empty() ? "random (seed " + std::to_string(options.seed) + ")"
                                             : options.model_path) +
                 ": " + model.Describe();
  const std::vector<EngineRequest> requests = MakeRequests(options, config.vocab_size);

  EngineOptions engine_options = options.engine;
  engine_options.cache_shape = {config.n_layers, config.n_kv_heads, config.head_size()};
  engine_options.cache_dtype = DType::kFloat32;  // the dense comparison reads fp32 too
  engine_options.max_context = config.seq_len;
  if (engine_options.num_blocks <= 0) {
    int64_t largest = 0, all = 0;
    for (const EngineRequest& r : requests) {
      const int64_t blocks =
          (std::ssize(r.prompt) + r.output_len - 1 + engine_options.block_size - 1) /
          engine_options.block_size;
      largest = std::max(largest, blocks);
      all += blocks;
    }
    engine_options.num_blocks = static_cast<int32_t>(std::max(largest + 2, all / 3));
  }
  if (engine_options.host_blocks < 0) engine_options.host_blocks = engine_options.num_blocks;
  report.host_blocks = engine_options.host_blocks;
  BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(engine_options));
  ModelRunner runner(model, *engine, requests.size(), options.check);
  const Clock::time_point paged_start = Clock::now();
  const std::clock_t paged_cpu = std::clock();
  SpanSource source(requests);
  BLOCKKV_RETURN_IF_ERROR(engine->Run(source, runner));
  report.paged_seconds = Seconds(paged_start);
  report.paged_cpu_seconds = CpuSeconds(paged_cpu);
  report.stats = engine->stats();
  report.outputs = engine->outputs();
  report.generated = report.stats.generated;
  BLOCKKV_RETURN_IF_ERROR(engine->manager().CheckInvariants());

  report.min_margin = runner.min_margin();
  if (!options.check) return report;

  report.checked = true;
  report.identical = true;
  const Clock::time_point dense_start = Clock::now();
  const std::clock_t dense_cpu = std::clock();
  std::vector<std::vector<TokenId>> dense_tokens(requests.size());
  std::vector<std::vector<std::vector<float>>> dense_logits(requests.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    BLOCKKV_RETURN_IF_ERROR(
        GenerateDense(model, requests[r], r, &dense_tokens[r], &dense_logits[r]));
    report.dense_tokens += std::ssize(requests[r].prompt) + requests[r].output_len - 1;
  }
  report.dense_seconds = Seconds(dense_start);
  report.dense_cpu_seconds = CpuSeconds(dense_cpu);
  for (size_t r = 0; r < requests.size() && report.identical; ++r) {
    for (size_t i = 0; i < dense_tokens[r].size(); ++i) {
      const std::vector<float>& paged = runner.logits()[r][i];
      for (size_t v = 0; v < paged.size(); ++v) {
        report.max_logit_diff =
            std::max<double>(report.max_logit_diff, std::fabs(paged[v] - dense_logits[r][i][v]));
      }
      if (report.outputs[r][i] != dense_tokens[r][i]) {
        report.identical = false;
        report.mismatch = "request " + std::to_string(r) + ", token " + std::to_string(i) +
                          ": paged " + std::to_string(report.outputs[r][i]) + ", dense " +
                          std::to_string(dense_tokens[r][i]);
        break;
      }
    }
  }
  return report;
}

std::string FormatDemo(const DemoReport& r, const DemoOptions& options, bool json) {
  const EngineStats& s = r.stats;
  const int64_t paged_tokens = s.prompt_tokens + s.decode_tokens;
  const double paged_rate =
      r.paged_seconds > 0 ? static_cast<double>(paged_tokens) / r.paged_seconds : 0;
  const double dense_rate =
      r.dense_seconds > 0 ? static_cast<double>(r.dense_tokens) / r.dense_seconds : 0;
  const double peak = static_cast<double>(s.peak_used_blocks) / s.num_blocks;
  const std::string verdict = !r.checked    ? "not checked"
                              : r.identical ? "identical"
                                            : "DIFFERENT (" + r.mismatch + ")";
  if (json) {
    JsonWriter w;
    w.BeginObject().Key("model").String(r.model);
    w.Key("requests").Int(s.requests).Key("generated_tokens").Int(r.generated);
    w.Key("steps").Int(s.steps).Key("paged_seconds").Double(r.paged_seconds);
    w.Key("paged_cpu_seconds").Double(r.paged_cpu_seconds);
    w.Key("paged_tokens").Int(paged_tokens).Key("paged_tokens_per_second").Double(paged_rate);
    w.Key("paged_generated_per_second")
        .Double(static_cast<double>(r.generated) / std::max(r.paged_seconds, 1e-9));
    w.Key("num_blocks").Int(s.num_blocks).Key("block_size").Int(options.engine.block_size);
    w.Key("peak_occupancy").Double(peak).Key("mean_occupancy").Double(s.mean_occupancy());
    w.Key("hit_rate").Double(s.hit_rate()).Key("hit_tokens").Int(s.hit_tokens);
    w.Key("queried_tokens").Int(s.queried_tokens).Key("evictions").Int(s.evictions);
    w.Key("preemptions").Int(s.preemptions).Key("resumes").Int(s.resumes);
    w.Key("preempted_blocks").Int(s.preempted_blocks);
    w.Key("host_tier_blocks_out").Int(s.offloaded_blocks);
    w.Key("host_tier_blocks_in").Int(s.restored_blocks);
    w.Key("recomputations").Int(s.recomputations).Key("host_blocks").Int(r.host_blocks);
    w.Key("checked").Bool(r.checked).Key("identical").Bool(r.identical);
    if (r.checked) {
      w.Key("dense_seconds").Double(r.dense_seconds).Key("dense_tokens").Int(r.dense_tokens);
      w.Key("dense_cpu_seconds").Double(r.dense_cpu_seconds);
      w.Key("dense_tokens_per_second").Double(dense_rate);
      w.Key("speedup").Double(r.paged_seconds > 0 ? r.dense_seconds / r.paged_seconds : 0.0);
      w.Key("max_logit_diff").Double(r.max_logit_diff);
    }
    w.Key("min_margin").Double(r.min_margin);
    if (!r.mismatch.empty()) w.Key("mismatch").String(r.mismatch);
    w.EndObject();
    return w.str();
  }
  std::string text;
  char line[512];
  const auto add = [&](const char* format, auto... args) {
    std::snprintf(line, sizeof(line), format, args...);
    text += line;
  };
  add("model         %s\n", r.model.c_str());
  add("requests      %lld (%lld system prompts of %lld tokens), %lld greedy tokens each\n",
      static_cast<long long>(s.requests), static_cast<long long>(options.prompt_groups),
      static_cast<long long>(options.system_len), static_cast<long long>(options.output_len));
  add("paged run     %lld steps, %lld tokens computed in %.3f s: %.0f tokens/s, %.0f generated/s\n",
      static_cast<long long>(s.steps), static_cast<long long>(paged_tokens), r.paged_seconds,
      paged_rate, static_cast<double>(r.generated) / std::max(r.paged_seconds, 1e-9));
  add("cache         %d blocks of %d tokens (fp32): held at peak %.0f%%, mean %.0f%%\n",
      s.num_blocks, options.engine.block_size, 100 * peak, 100 * s.mean_occupancy());
  add("prefix cache  %.1f%% hit: %lld of %lld prompt tokens reused, %lld blocks evicted\n",
      100 * s.hit_rate(), static_cast<long long>(s.hit_tokens),
      static_cast<long long>(s.queried_tokens), static_cast<long long>(s.evictions));
  add("preemption    %lld to the host tier of %d blocks (%lld blocks moved), %lld recomputed\n",
      static_cast<long long>(s.preemptions), r.host_blocks,
      static_cast<long long>(s.preempted_blocks), static_cast<long long>(s.recomputations));
  if (r.checked) {
    add("dense run     %lld tokens computed in %.3f s: %.0f tokens/s\n",
        static_cast<long long>(r.dense_tokens), r.dense_seconds, dense_rate);
    add("paged/dense   %.2fx tokens/s per computed token, %.2fx faster end to end (same "
        "outputs)\n",
        dense_rate > 0 ? paged_rate / dense_rate : 0.0,
        r.paged_seconds > 0 ? r.dense_seconds / r.paged_seconds : 0.0);
    add("check         %s: %lld greedy tokens, largest logit difference %.2g, smallest top-2 "
        "margin %.2g\n",
        verdict.c_str(), static_cast<long long>(r.generated), r.max_logit_diff, r.min_margin);
  } else {
    add("check         %s\n", verdict.c_str());
  }
  if (!r.outputs.empty()) {
    text += "request 0     ";
    for (size_t i = 0; i < r.outputs[0].size() && i < 16; ++i) {
      text += std::to_string(r.outputs[0][i]) + " ";
    }
    text += r.outputs[0].size() > 16 ? "...\n" : "\n";
  }
  return text;
}

}  // namespace blockkv::tool
