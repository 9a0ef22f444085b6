// SPDX-License-Identifier: Apache-2.0
// Engine: the continuous-batching loop the `simulate` and `demo` subcommands share — requests
// arrive, are admitted while the cache keeps a reserve, prefilled in chunks under a token budget
// with their shared prefixes taken from the prefix cache, decoded one token a step, preempted
// (newest first) when the cache runs out, and flushed when done. Every block and table goes
// through the real StateManager and RaggedBatch; what a step computes is a StepRunner's business:
// nothing but made-up tokens for `simulate`, the tiny Llama for `demo`.
//
//   auto engine = *Engine::Create(options);
//   SpanSource requests(list);               // or a trace read as it is replayed
//   NullRunner runner;                       // or demo's model
//   Status s = engine->Run(requests, runner, [](const Engine& e) { ... after each step ... });
//   engine->stats().steps, engine->outputs()[i]
//
// Requests are pulled from their source as they arrive, and a finished request is dropped: what
// the engine holds is bounded by the requests alive at once (at most max_seqs running, as many
// preempted, and kMaxWaiting pulled while waiting), not by the length of the trace.
//
// Running requests are kept in arrival order: the oldest get the token budget first and the
// newest is preempted first (vLLM's first-come-first-served policy), so a request, once resumed,
// is not the next victim. Preemption is behind one seam, Engine::Preempt: with a host tier
// (EngineOptions::host_blocks), StateManager::PreemptSequence moves the victim's blocks there
// and ResumeSequence brings them back, oldest first, before anything new is admitted; without
// one, or when the tier is full, the victim's blocks are flushed and the request is queued again
// to be recomputed (its own cached blocks usually come back as prefix hits).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "blockkv/dtype.h"
#include "blockkv/prefix_cache.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/remote_tier.h"
#include "blockkv/state_manager.h"
#include "blockkv/status.h"

namespace blockkv::tool {

struct EngineRequest {
  int64_t arrival = 0;  // the step at which it arrives
  std::vector<TokenId> prompt;
  int64_t output_len = 1;  // tokens to generate (>= 1)
  int64_t line = 0;        // its trace line, for messages (0: not from a file)
};

// Requests in arrival order, one at a time, so that a trace is read while it is replayed.
class RequestSource {
 public:
  virtual ~RequestSource() = default;
  // The next request into *out: true, or false after the last. Errors name the input's line.
  virtual Result<bool> Next(EngineRequest* out) = 0;
  // How many requests there are in all, or -1 when that is known only at the end (a trace).
  virtual int64_t total() const { return -1; }
};

// The requests of a list, in its order (which must be arrival order).
class SpanSource : public RequestSource {
 public:
  explicit SpanSource(std::span<const EngineRequest> requests) : requests_(requests) {}
  Result<bool> Next(EngineRequest* out) override;
  int64_t total() const override { return std::ssize(requests_); }

 private:
  std::span<const EngineRequest> requests_;
  size_t next_ = 0;
};

struct EngineOptions {
  int32_t block_size = 16;
  int32_t num_blocks = 2048;
  int32_t token_budget = 2048;  // tokens per forward (max_ragged_batch_size)
  int32_t max_seqs = 256;       // sequences per forward
  int64_t max_context = 32768;
  bool prefix_cache = true;
  double watermark = 0.01;  // admit only while this fraction of the blocks stays free
  int32_t host_blocks = 0;  // host tier for preemption (0: none; preempted requests recompute)
  // The cache's layer shape {layers, kv heads, head size} and dtype: the bookkeeping of
  // `simulate` needs one tiny layer; `demo` gives its model's.
  std::array<int64_t, 3> cache_shape = {1, 1, 8};
  DType cache_dtype = DType::kFloat16;
  // Keep every request's generated tokens for outputs() (demo); simulate keeps none.
  bool keep_outputs = true;
  // The remote prefix tier (docs/remote_tier.md) for `simulate --remote`; needs prefix_cache.
  std::optional<RemoteTierConfig> remote_tier{};
};

struct EngineStats {
  int64_t requests = 0;
  int64_t finished = 0;
  int64_t steps = 0;             // forward steps
  int64_t clock = 0;             // steps including idle gaps between arrivals
  int64_t prompt_tokens = 0;     // prompt tokens computed (a recomputed request's again)
  int64_t decode_tokens = 0;     // generated tokens run through the model
  int64_t generated = 0;         // tokens sampled
  int64_t queried_tokens = 0;    // prefix cache: prompt tokens looked up
  int64_t hit_tokens = 0;        // ... and taken from the cache instead of computed
  int64_t evictions = 0;         // cached blocks taken for reuse
  int64_t preemptions = 0;       // PreemptSequence calls: a running request moved to the host
  int64_t resumes = 0;           // ResumeSequence calls
  int64_t preempted_blocks = 0;  // blocks those requests held (each comes back on resume)
  // The offload store's own counts: every block it copied out and back, preemption included.
  int64_t offloaded_blocks = 0;
  int64_t restored_blocks = 0;
  // The prefix cache's host level (StateManager::host_prefix_stats): evicted blocks copied to the
  // host, copied back for a hit, and dropped unused.
  int64_t host_demoted = 0;
  int64_t host_promoted = 0;
  int64_t host_dropped = 0;
  int64_t recomputations = 0;  // running requests flushed and queued again (no room on the host)
  int64_t deferred_steps = 0;  // steps at which a waiting request was not admitted
  int32_t num_blocks = 0;
  int32_t peak_used_blocks = 0;  // blocks held by sequences (not counting cached, evictable)
  double occupancy_sum = 0;      // Σ per step of used / num_blocks

  double hit_rate() const {
    return queried_tokens == 0
               ? 0
               : static_cast<double>(hit_tokens) / static_cast<double>(queried_tokens);
  }
  double mean_occupancy() const {
    return steps == 0 ? 0 : occupancy_sum / static_cast<double>(steps);
  }
};

// What one forward computes. Called after the batch is finalized and before PostForward.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Entry i of `batch` belongs to request requests[i]; for each i with sample[i] != 0 (it ran
  // its last known token), writes the token it generates into next[i].
  virtual Status Run(const RaggedBatch& batch, std::span<const size_t> requests,
                     std::span<const uint8_t> sample, std::span<TokenId> next) = 0;
};

// For `simulate`: no arithmetic; the "sampled" token is a hash of the request and position.
class NullRunner : public StepRunner {
 public:
  Status Run(const RaggedBatch& batch, std::span<const size_t> requests,
             std::span<const uint8_t> sample, std::span<TokenId> next) override;
};

class Engine {
 public:
  // Sequences per step at most: preempted ones double it, and it must stay an int32.
  static constexpr int32_t kMaxSequences = 1 << 20;

  // The state manager (ALLOCATE mode, options.num_blocks blocks on the host) and its batch.
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);

  // Waiting requests pulled from the source ahead of admission. Admission takes at most
  // max_seqs a step from the front of the queue, so pulling more would change nothing but memory.
  static constexpr size_t kMaxWaiting = 4096;

  // Runs every request of `source` to completion; requests are numbered in the order the source
  // gives them (StepRunner's `requests`, outputs()). kInvalidArgument (naming the request's
  // trace line) for a request that could never fit (longer than max_context or the whole cache)
  // or that arrives before the one given before it; the source's errors and any blockkv error
  // are returned as they are.
  Status Run(RequestSource& source, StepRunner& runner,
             const std::function<void(const Engine&)>& after_step = {});

  // Run, one step at a time (several engines stepped in one clock): Start, then Step until it
  // returns kFinished. A Step runs one step (kStepped), or, with nothing to run before the next
  // request arrives, moves the clock to its arrival (kWaited). Errors as Run's.
  enum class Progress { kStepped, kWaited, kFinished };
  void Start();
  Result<Progress> Step(RequestSource& source, StepRunner& runner);
  // Step in two halves: BeginStep admits and schedules the step (every prefix lookup is made
  // here); when it returns kStepped, FinishStep runs the forward and its PostForward (every new
  // block is published, and stored to a remote tier, here). Engines that step at the same time
  // all begin before any finishes, so none of them finds what another computes in that step.
  Result<Progress> BeginStep(RequestSource& source);
  Status FinishStep(StepRunner& runner);

  const EngineStats& stats() const { return stats_; }
  const StateManager& manager() const { return *manager_; }
  // StateManager::FlushRemoteTier: waits for the stores queued so far.
  void FlushRemoteTier() { manager_->FlushRemoteTier(); }
  const EngineOptions& options() const { return options_; }
  // Blocks held by sequences now (the rest are free or cached and evictable).
  int32_t used_blocks() const;
  // Per request, the tokens it generated (empty unless EngineOptions::keep_outputs).
  const std::vector<std::vector<TokenId>>& outputs() const { return outputs_; }

 private:
  // A request between admission and completion.
  struct Live {
    size_t index = 0;  // its number, in the order the source gave it: running requests are
                       // kept sorted by it (arrival order)
    SeqId uid = 0;
    std::vector<TokenId> tokens;  // prompt, then the generated tokens
    int64_t prompt_len = 0;
    int64_t output_len = 0;
    int64_t generated = 0;
    int64_t computed = 0;  // tokens whose keys and values are in the cache
  };
  struct Entry {
    Live* live;
    int64_t length;
    bool admitted;  // admitted this step
  };

  Engine(EngineOptions options, std::unique_ptr<StateManager> manager,
         std::unique_ptr<RaggedBatch> batch);
  Status CheckRequest(const EngineRequest& request, size_t index) const;
  // Pulls the requests that have arrived by now into waiting_ (at most kMaxWaiting there).
  Status Arrive(RequestSource& source);
  // This step's decodes and prefill chunks of running requests, then admissions.
  Status PlanStep(std::vector<Entry>* entries);
  // Schedules `entries` and builds the step's batch from them (StateManager::ScheduleBatch),
  // shrinking them (admissions first, then preempting the newest running request) until it fits.
  Status ScheduleStep(std::vector<Entry>* entries);
  // Adds a request to `list` (running_ or preempted_) at its place in arrival order.
  static void InsertByArrival(std::vector<std::unique_ptr<Live>>& list, std::unique_ptr<Live> live);
  // The seam: frees a running request's blocks under pressure.
  Status Preempt(Live* victim);
  // Brings preempted requests back, oldest first, while the cache keeps its reserve.
  Status Resume();
  // The forward over the batch of `entries` (ScheduleStep's), then its bookkeeping.
  Status RunStep(std::vector<Entry>& entries, StepRunner& runner);
  void RecordStep();

  EngineOptions options_;
  std::unique_ptr<StateManager> manager_;
  std::unique_ptr<RaggedBatch> batch_;
  // The next request from the source, not yet arrived (valid while has_pending_).
  EngineRequest pending_;
  bool has_pending_ = false;
  bool source_done_ = false;
  int64_t last_arrival_ = 0;
  std::deque<std::unique_ptr<Live>> waiting_;     // arrived, not running (front first)
  std::vector<std::unique_ptr<Live>> running_;    // in arrival order: the newest is preempted first
  std::vector<std::unique_ptr<Live>> preempted_;  // on the host tier, in arrival order
  std::vector<std::vector<TokenId>> outputs_;
  EngineStats stats_;
  int32_t watermark_blocks_ = 1;
  // Per step, reused.
  std::vector<Entry> entries_;
  std::vector<SeqId> uids_;
  std::vector<int64_t> lengths_;
  std::vector<TokenId> ids_;
  std::vector<size_t> entry_requests_;
  std::vector<uint8_t> sample_;
  std::vector<TokenId> next_;
};

}  // namespace blockkv::tool
