// SPDX-License-Identifier: Apache-2.0
// `blockkv demo`: a tiny Llama generates for a batch of requests with shared system prompts
// through the library's real path — StateManager (prefix cache on, a cache small enough that
// requests are preempted), RaggedBatch, AppendKV and PagedAttention on an fp32 cache — and the
// greedy tokens are checked against the same model run one request at a time over a plain
// dense cache. Then speculative decoding with rollback: drafts from the model's first layers,
// verified by the whole model (StateManager::PostForward with accepted counts, Rollback on the
// draft's cache), must give exactly the greedy tokens.
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

// ---- speculative decoding --------------------------------------------------------------------

// One sequence's side of speculative decoding: a state manager over a model's fp32 cache, and a
// forward of some tokens that keeps the logits of chosen rows.
class Decoder {
 public:
  static Result<Decoder> Create(const Model& model, int32_t block_size, int64_t max_tokens) {
    const ModelConfig& c = model.config();
    const auto blocks = static_cast<int32_t>((max_tokens + block_size - 1) / block_size);
    StateManagerConfig config;
    config.max_tracked_sequences = 1;
    config.max_ragged_sequence_count = 1;
    config.max_ragged_batch_size = static_cast<int32_t>(std::min<int64_t>(max_tokens, 1 << 20));
    config.max_context = max_tokens;
    config.memory_config = {.mode = AllocationMode::kAllocate, .size = blocks};
    BLOCKKV_ASSIGN_OR_RETURN(
        std::unique_ptr<StateManager> manager,
        StateManager::Create(
            config,
            {KVCacheConfig{.block_size = block_size,
                           .cache_shape = {c.n_layers, c.n_kv_heads, c.head_size()},
                           .cache_dtype = DType::kFloat32,
                           .max_blocks_per_allocation_group = blocks}},
            CpuDevice()));
    BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<RaggedBatch> batch, RaggedBatch::Create(*manager));
    return Decoder(model, std::move(manager), std::move(batch));
  }

  // Runs `tokens` as the sequence's next ones; the argmax of each of the last `sampled` rows into
  // `next`. The forward stays in flight until Keep.
  Status Forward(std::span<const TokenId> tokens, int64_t sampled, std::vector<TokenId>* next) {
    const int64_t lengths[] = {std::ssize(tokens)};
    BLOCKKV_RETURN_IF_ERROR(
        manager_->ScheduleBatch({.uids = kUids, .lengths = lengths}, tokens, *batch_));
    rows_.clear();
    for (int64_t r = std::ssize(tokens) - sampled; r < std::ssize(tokens); ++r) rows_.push_back(r);
    const int32_t vocab = model_->config().vocab_size;
    logits_.resize(rows_.size() * static_cast<size_t>(vocab));
    PagedAttentionBackend paged(*manager_, *batch_, model_->config());
    BLOCKKV_RETURN_IF_ERROR(model_->Forward(tokens, paged, rows_, logits_));
    next->clear();
    for (size_t r = 0; r < rows_.size(); ++r) {
      next->push_back(ArgMax(std::span<const float>(logits_).subspan(r * vocab, vocab)));
    }
    return Status::Ok();
  }
  // PostForward keeping the first `accepted` tokens of the forward in flight.
  Status Keep(int64_t accepted) {
    const int64_t kept[] = {accepted};
    return manager_->PostForward(*batch_, kept);
  }
  Status Rollback(int64_t n) { return manager_->Rollback(kUids[0], n); }
  Status Reset() {
    BLOCKKV_RETURN_IF_ERROR(manager_->CheckInvariants());
    return manager_->FlushSequence(kUids[0]);
  }

 private:
  static constexpr SeqId kUids[] = {0};
  Decoder(const Model& model, std::unique_ptr<StateManager> manager,
          std::unique_ptr<RaggedBatch> batch)
      : model_(&model), manager_(std::move(manager)), batch_(std::move(batch)) {}
  const Model* model_;
  std::unique_ptr<StateManager> manager_;
  std::unique_ptr<RaggedBatch> batch_;
  std::vector<int64_t> rows_;
  std::vector<float> logits_;
};

// Greedy speculative decoding of every request, one at a time: the draft model proposes k tokens
// one forward each, the full model verifies the last token and the k drafts in one forward of
// k + 1 tokens, keeps the 1 + a that agree with its own greedy choices (PostForward with an
// accepted count) and adds its own next token; the draft's cache rolls back the drafts that were
// rejected (Rollback). The tokens must be the greedy run's.
Status RunSpeculative(const Model& model, const std::vector<EngineRequest>& requests,
                      const DemoOptions& options, DemoReport& report) {
  DemoReport::Speculative& spec = report.speculative;
  spec.ran = true;
  spec.draft_tokens = options.draft_tokens;
  spec.draft_layers =
      options.draft_layers > 0 ? options.draft_layers : std::max(1, model.config().n_layers / 2);
  BLOCKKV_ASSIGN_OR_RETURN(const Model draft, model.FirstLayers(spec.draft_layers));
  const int64_t k = options.draft_tokens;
  const int64_t context = model.config().seq_len;
  const int32_t bs = options.engine.block_size;
  BLOCKKV_ASSIGN_OR_RETURN(Decoder target, Decoder::Create(model, bs, context));
  BLOCKKV_ASSIGN_OR_RETURN(Decoder drafter, Decoder::Create(draft, bs, context));
  const Clock::time_point start = Clock::now();
  std::vector<TokenId> next, drafts, verify, pending;
  for (size_t r = 0; r < requests.size(); ++r) {
    const EngineRequest& request = requests[r];
    std::vector<TokenId> out;
    BLOCKKV_RETURN_IF_ERROR(target.Forward(request.prompt, 1, &next));
    BLOCKKV_RETURN_IF_ERROR(target.Keep(std::ssize(request.prompt)));
    ++spec.target_forwards;
    out.push_back(next[0]);
    BLOCKKV_RETURN_IF_ERROR(drafter.Forward(request.prompt, 0, &next));
    BLOCKKV_RETURN_IF_ERROR(drafter.Keep(std::ssize(request.prompt)));
    pending.assign(1, out.back());  // committed tokens the draft has not run
    while (std::ssize(out) < request.output_len) {
      // The step yields up to n + 1 tokens: never past the output (nor the context the demo
      // checked for it). n = 0 is a plain decode step.
      const int64_t n = std::min<int64_t>(k, request.output_len - std::ssize(out) - 1);
      drafts.clear();
      std::span<const TokenId> feed = pending;
      for (int64_t d = 0; d < n; ++d) {
        BLOCKKV_RETURN_IF_ERROR(drafter.Forward(feed, 1, &next));
        BLOCKKV_RETURN_IF_ERROR(drafter.Keep(std::ssize(feed)));
        drafts.push_back(next[0]);
        feed = std::span<const TokenId>(drafts).last(1);
      }
      // The draft ran pending + drafts[0, n - 1): the last draft's KV is not needed yet.
      verify.assign(1, out.back());
      verify.insert(verify.end(), drafts.begin(), drafts.end());
      BLOCKKV_RETURN_IF_ERROR(target.Forward(verify, std::ssize(verify), &next));
      int64_t a = 0;
      while (a < n && next[static_cast<size_t>(a)] == drafts[static_cast<size_t>(a)]) ++a;
      BLOCKKV_RETURN_IF_ERROR(target.Keep(1 + a));  // the verified token and a drafts
      ++spec.target_forwards;
      spec.drafted += n;
      spec.accepted += a;
      out.insert(out.end(), drafts.begin(), drafts.begin() + a);
      out.push_back(next[static_cast<size_t>(a)]);  // the full model's own next token
      if (n == 0) {
        pending.push_back(out.back());  // the draft ran nothing this step
      } else if (a < n) {
        // Drafts a .. n - 2 ran on the draft's cache and were rejected.
        if (n - 1 - a > 0) {
          BLOCKKV_RETURN_IF_ERROR(drafter.Rollback(n - 1 - a));
          ++spec.rollbacks;
        }
        pending.assign(1, out.back());
      } else {
        pending.assign({drafts.back(), out.back()});
      }
    }
    spec.generated += std::ssize(out);
    BLOCKKV_RETURN_IF_ERROR(target.Reset());
    BLOCKKV_RETURN_IF_ERROR(drafter.Reset());
    const std::vector<int32_t>& greedy = report.outputs[r];
    for (size_t i = 0; i < out.size(); ++i) {
      if (i >= greedy.size() || out[i] != greedy[i]) {
        return InternalError(
            "speculative decoding's tokens differ from greedy decoding's: request " +
            std::to_string(r) + ", token " + std::to_string(i) + ": speculative " +
            std::to_string(out[i]) + ", greedy " +
            (i < greedy.size() ? std::to_string(greedy[i]) : std::string("none")));
      }
    }
  }
  spec.seconds = Seconds(start);
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
  if (options.draft_tokens < 0 || options.draft_layers < 0) {
    return InvalidArgumentError("draft tokens (" + std::to_string(options.draft_tokens) +
                                ") and draft layers (" + std::to_string(options.draft_layers) +
                                ") must be >= 0");
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
  if (options.draft_tokens > 0) {
    BLOCKKV_RETURN_IF_ERROR(RunSpeculative(model, requests, options, report));
  }
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
    if (r.speculative.ran) {
      const DemoReport::Speculative& sp = r.speculative;
      w.Key("speculative").BeginObject();
      w.Key("draft_layers").Int(sp.draft_layers).Key("draft_tokens").Int(sp.draft_tokens);
      w.Key("drafted").Int(sp.drafted).Key("accepted").Int(sp.accepted);
      w.Key("acceptance_rate").Double(sp.acceptance());
      w.Key("target_forwards").Int(sp.target_forwards).Key("generated").Int(sp.generated);
      w.Key("draft_rollbacks").Int(sp.rollbacks).Key("seconds").Double(sp.seconds);
      w.Key("identical_to_greedy").Bool(true);
      w.EndObject();
    }
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
  if (r.speculative.ran) {
    const DemoReport::Speculative& sp = r.speculative;
    add("speculative   k=%d drafts from the first %d layers: %.1f%% of %lld accepted, %.2f "
        "tokens per full-model forward, %lld draft rollbacks; identical to greedy (%lld tokens)\n",
        sp.draft_tokens, sp.draft_layers, 100 * sp.acceptance(), static_cast<long long>(sp.drafted),
        sp.target_forwards > 0
            ? static_cast<double>(sp.generated) / static_cast<double>(sp.target_forwards)
            : 0.0,
        static_cast<long long>(sp.rollbacks), static_cast<long long>(sp.generated));
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
