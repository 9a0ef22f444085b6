// SPDX-License-Identifier: Apache-2.0
// `blockkv simulate`: replays requests through the Engine with a NullRunner — the state manager,
// prefix cache and ragged batch do all their work, the model none — and reports what the cache
// went through.
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "commands.h"
#include "json.h"

namespace blockkv::tool {
namespace {

// A one-line progress bar on stderr, redrawn at most ten times a second.
class ProgressBar {
 public:
  ProgressBar(bool enabled, int64_t total) : enabled_(enabled), total_(total) {}
  ~ProgressBar() { Finish(); }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void Update(const Engine& engine) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const EngineStats& s = engine.stats();
    if (total_ < 0) {  // a trace: its length is known at its end
      std::fprintf(stderr, "\r%lld requests finished, step %lld, cache %3.0f%%, hits %3.0f%%",
                   static_cast<long long>(s.finished), static_cast<long long>(s.steps),
                   100.0 * engine.used_blocks() / s.num_blocks, 100 * s.hit_rate());
      std::fflush(stderr);
      drawn_ = true;
      return;
    }
    const double done =
        total_ == 0 ? 1.0 : static_cast<double>(s.finished) / static_cast<double>(total_);
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(done * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), '-');
    std::fprintf(stderr,
                 "\r[%s] %3.0f%% %lld/%lld requests, step %lld, cache %3.0f%%, hits %3.0f%%",
                 bar.c_str(), 100 * done, static_cast<long long>(s.finished),
                 static_cast<long long>(total_), static_cast<long long>(s.steps),
                 100.0 * engine.used_blocks() / s.num_blocks, 100 * s.hit_rate());
    std::fflush(stderr);
    drawn_ = true;
  }

  void Finish() {
    if (!drawn_) return;
    std::fputs("\r\033[K", stderr);  // clear the line
    std::fflush(stderr);
    drawn_ = false;
  }

 private:
  bool enabled_;
  int64_t total_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace

Result<SimulateReport> Simulate(std::span<const EngineRequest> requests,
                                const SimulateOptions& options) {
  SpanSource source(requests);
  return Simulate(source, options);
}

namespace {

// Adds one engine's remote tier counters to `sum` (nodes: the most any engine saw).
void AddTierStats(RemoteTierStats* sum, const RemoteTierStats& t) {
  sum->hits += t.hits;
  sum->misses += t.misses;
  sum->misses_not_found += t.misses_not_found;
  sum->misses_verify_failed += t.misses_verify_failed;
  sum->misses_error += t.misses_error;
  sum->misses_late += t.misses_late;
  sum->invalid += t.invalid;
  sum->fetched_bytes += t.fetched_bytes;
  sum->stored += t.stored;
  sum->stored_bytes += t.stored_bytes;
  sum->dropped += t.dropped;
  sum->errors += t.errors;
  sum->reconnects += t.reconnects;
  sum->redirects += t.redirects;
  sum->topology_refreshes += t.topology_refreshes;
  sum->replica_reads += t.replica_reads;
  sum->nodes = std::max(sum->nodes, t.nodes);
  sum->connected = sum->connected || t.connected;
}

// Sums the counts of several engines' runs (the peak is the largest engine's).
void AddStats(EngineStats* sum, const EngineStats& s) {
  sum->requests += s.requests;
  sum->finished += s.finished;
  sum->steps += s.steps;
  sum->clock += s.clock;
  sum->prompt_tokens += s.prompt_tokens;
  sum->decode_tokens += s.decode_tokens;
  sum->generated += s.generated;
  sum->queried_tokens += s.queried_tokens;
  sum->hit_tokens += s.hit_tokens;
  sum->evictions += s.evictions;
  sum->preemptions += s.preemptions;
  sum->resumes += s.resumes;
  sum->preempted_blocks += s.preempted_blocks;
  sum->offloaded_blocks += s.offloaded_blocks;
  sum->restored_blocks += s.restored_blocks;
  sum->host_demoted += s.host_demoted;
  sum->host_promoted += s.host_promoted;
  sum->host_dropped += s.host_dropped;
  sum->recomputations += s.recomputations;
  sum->deferred_steps += s.deferred_steps;
  sum->num_blocks = s.num_blocks;
  sum->peak_used_blocks = std::max(sum->peak_used_blocks, s.peak_used_blocks);
  sum->occupancy_sum += s.occupancy_sum;
}

// Runs sources[i] on engine i to the end, every engine stepped in one clock, as engines of one
// deployment run side by side: the engines whose clock is behind step next, together (each one's
// lookups made before any of them computes, so that requests arriving at the same time on two
// engines both miss what the other is computing), and the stores of their step reach the tier
// before any engine steps again (a store takes far less than a step). Engine 0's steps are sampled
// into `samples` (when given) and drawn by the progress bar. Returns the engines' stats (summed
// over several); `tier` gets their remote tier counters summed, `connected` whether engine 0's
// tier was connected at start.
Result<EngineStats> RunEngines(std::span<RequestSource* const> sources,
                               const EngineOptions& options, bool show_progress,
                               std::vector<StepSample>* samples, RemoteTierStats* tier,
                               bool* connected) {
  EngineOptions engine_options = options;
  engine_options.keep_outputs = false;
  std::vector<std::unique_ptr<Engine>> engines;
  for (size_t i = 0; i < sources.size(); ++i) {
    BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(engine_options));
    engine->Start();
    engines.push_back(std::move(engine));
  }
  if (connected != nullptr) *connected = engines[0]->manager().remote_tier_stats().connected;
  const bool share_tier = engines.size() > 1 && options.remote_tier.has_value();
  NullRunner runner;
  ProgressBar progress(show_progress, sources[0]->total());
  // One sample every `stride` steps, the stride doubling (and every other sample dropped) when
  // kMaxSamples are held: a long run's plot costs bounded memory.
  int64_t stride = 1;
  std::vector<uint8_t> finished(engines.size(), 0);
  std::vector<size_t> stepping;
  while (true) {
    int64_t now = std::numeric_limits<int64_t>::max();
    for (size_t i = 0; i < engines.size(); ++i) {
      if (finished[i] == 0) now = std::min(now, engines[i]->stats().clock);
    }
    if (now == std::numeric_limits<int64_t>::max()) break;  // every engine finished
    stepping.clear();
    for (size_t i = 0; i < engines.size(); ++i) {
      if (finished[i] != 0 || engines[i]->stats().clock != now) continue;
      BLOCKKV_ASSIGN_OR_RETURN(const Engine::Progress step, engines[i]->BeginStep(*sources[i]));
      if (step == Engine::Progress::kFinished) finished[i] = 1;
      if (step == Engine::Progress::kStepped) stepping.push_back(i);
    }
    for (const size_t i : stepping) BLOCKKV_RETURN_IF_ERROR(engines[i]->FinishStep(runner));
    if (share_tier) {
      for (const size_t i : stepping) engines[i]->FlushRemoteTier();
    }
    if (stepping.empty() || stepping[0] != 0) continue;
    const Engine& e = *engines[0];
    const EngineStats& s = e.stats();
    if (samples != nullptr && s.steps % stride == 0) {
      samples->push_back(
          {s.steps, static_cast<double>(e.used_blocks()) / s.num_blocks, s.hit_rate()});
      if (std::ssize(*samples) == SimulateReport::kMaxSamples) {
        for (size_t i = 0; 2 * i + 1 < samples->size(); ++i) (*samples)[i] = (*samples)[2 * i + 1];
        samples->resize(samples->size() / 2);
        stride *= 2;
      }
    }
    progress.Update(e);
  }
  progress.Finish();
  EngineStats sum;
  for (const std::unique_ptr<Engine>& engine : engines) {
    // Every request finished, so every block must be free or cached, and the manager consistent.
    BLOCKKV_RETURN_IF_ERROR(engine->manager().CheckInvariants());
    if (engine->used_blocks() != 0 || engine->manager().n_tracked_sequences() != 0) {
      return InternalError(std::to_string(engine->used_blocks()) +
                           " blocks still held after every request finished");
    }
    engine->FlushRemoteTier();  // what it stored is there for whoever runs next
    if (tier != nullptr) AddTierStats(tier, engine->manager().remote_tier_stats());
    if (engines.size() == 1) return engine->stats();
    AddStats(&sum, engine->stats());
  }
  return sum;
}

}  // namespace

Result<SimulateReport> Simulate(RequestSource& requests, const SimulateOptions& options) {
  if (options.engines < 1 || options.engines > kMaxSimulatedEngines) {
    return InvalidArgumentError("engines " + std::to_string(options.engines) + ": expected 1 to " +
                                std::to_string(kMaxSimulatedEngines));
  }
  if (options.remote && !options.engine.prefix_cache) {
    return InvalidArgumentError("the remote tier needs prefix caching on");
  }
  SimulateReport report;
  report.engines = options.engines;
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  if (options.engines == 1 && !options.remote) {
    RequestSource* const one[] = {&requests};  // read as it is replayed
    BLOCKKV_ASSIGN_OR_RETURN(report.stats, RunEngines(one, options.engine, options.progress,
                                                      &report.samples, nullptr, nullptr));
  } else {
    // Several engines (or two runs): the requests are read once and dealt round-robin.
    std::vector<std::vector<EngineRequest>> slices(static_cast<size_t>(options.engines));
    EngineRequest request;
    for (size_t i = 0;; ++i) {
      BLOCKKV_ASSIGN_OR_RETURN(bool more, requests.Next(&request));
      if (!more) break;
      slices[i % slices.size()].push_back(std::move(request));
    }
    const auto run = [&](const EngineOptions& engine_options, std::vector<StepSample>* samples,
                         RemoteTierStats* tier, bool* connected) {
      std::vector<std::unique_ptr<SpanSource>> owned;
      std::vector<RequestSource*> sources;
      for (const std::vector<EngineRequest>& slice : slices) {
        owned.push_back(std::make_unique<SpanSource>(slice));
        sources.push_back(owned.back().get());
      }
      return RunEngines(sources, engine_options, options.progress, samples, tier, connected);
    };
    EngineOptions with = options.engine;
    with.remote_tier = options.remote;
    BLOCKKV_ASSIGN_OR_RETURN(report.stats,
                             run(with, &report.samples, &report.tier, &report.remote_connected));
    if (options.remote) {
      report.remote = true;
      EngineOptions without = options.engine;
      without.remote_tier.reset();
      BLOCKKV_ASSIGN_OR_RETURN(report.without_tier, run(without, nullptr, nullptr, nullptr));
    }
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  return report;
}

std::string FormatSimulate(const SimulateReport& report, const EngineOptions& engine, bool json) {
  const EngineStats& s = report.stats;
  const double steps_per_second =
      report.seconds > 0 ? static_cast<double>(s.steps) / report.seconds : 0;
  const double peak = static_cast<double>(s.peak_used_blocks) / s.num_blocks;
  if (json) {
    JsonWriter w;
    w.BeginObject()
        .Key("source")
        .String(report.source)
        .Key("requests")
        .Int(s.requests)
        .Key("finished")
        .Int(s.finished)
        .Key("steps")
        .Int(s.steps)
        .Key("clock")
        .Int(s.clock)
        .Key("seconds")
        .Double(report.seconds)
        .Key("cpu_seconds")
        .Double(report.cpu_seconds)
        .Key("steps_per_second")
        .Double(steps_per_second)
        .Key("prompt_tokens")
        .Int(s.prompt_tokens)
        .Key("decode_tokens")
        .Int(s.decode_tokens)
        .Key("generated_tokens")
        .Int(s.generated)
        .Key("queried_tokens")
        .Int(s.queried_tokens)
        .Key("hit_tokens")
        .Int(s.hit_tokens)
        .Key("hit_rate")
        .Double(s.hit_rate())
        .Key("evictions")
        .Int(s.evictions)
        .Key("preemptions")
        .Int(s.preemptions)
        .Key("resumes")
        .Int(s.resumes)
        .Key("preempted_blocks")
        .Int(s.preempted_blocks)
        .Key("host_tier_blocks_out")
        .Int(s.offloaded_blocks)
        .Key("host_tier_blocks_in")
        .Int(s.restored_blocks)
        .Key("host_prefix_demoted")
        .Int(s.host_demoted)
        .Key("host_prefix_promoted")
        .Int(s.host_promoted)
        .Key("host_prefix_dropped")
        .Int(s.host_dropped)
        .Key("recomputations")
        .Int(s.recomputations)
        .Key("host_blocks")
        .Int(engine.host_blocks)
        .Key("deferred_steps")
        .Int(s.deferred_steps)
        .Key("num_blocks")
        .Int(s.num_blocks)
        .Key("block_size")
        .Int(engine.block_size)
        .Key("token_budget")
        .Int(engine.token_budget)
        .Key("peak_occupancy")
        .Double(peak)
        .Key("mean_occupancy")
        .Double(s.mean_occupancy())
        .Key("engines")
        .Int(report.engines);
    if (report.remote) {
      const RemoteTierStats& t = report.tier;
      const EngineStats& o = report.without_tier;
      w.Key("remote")
          .BeginObject()
          .Key("connected")
          .Bool(report.remote_connected)
          .Key("hits")
          .Int(t.hits)
          .Key("misses")
          .Int(t.misses)
          .Key("misses_not_found")
          .Int(t.misses_not_found)
          .Key("misses_verify_failed")
          .Int(t.misses_verify_failed)
          .Key("misses_error")
          .Int(t.misses_error)
          .Key("misses_late")
          .Int(t.misses_late)
          .Key("invalid")
          .Int(t.invalid)
          .Key("fetched_bytes")
          .Int(t.fetched_bytes)
          .Key("stored")
          .Int(t.stored)
          .Key("stored_bytes")
          .Int(t.stored_bytes)
          .Key("dropped")
          .Int(t.dropped)
          .Key("errors")
          .Int(t.errors)
          .Key("reconnects")
          .Int(t.reconnects)
          .Key("redirects")
          .Int(t.redirects)
          .Key("topology_refreshes")
          .Int(t.topology_refreshes)
          .Key("replica_reads")
          .Int(t.replica_reads)
          .Key("nodes")
          .Int(t.nodes)
          .EndObject()
          .Key("without_remote")
          .BeginObject()
          .Key("prompt_tokens")
          .Int(o.prompt_tokens)
          .Key("queried_tokens")
          .Int(o.queried_tokens)
          .Key("hit_tokens")
          .Int(o.hit_tokens)
          .Key("hit_rate")
          .Double(o.hit_rate())
          .Key("steps")
          .Int(o.steps)
          .EndObject();
    }
    w.EndObject();
    return w.str();
  }
  std::string text;
  char line[512];
  const auto add = [&](const char* format, auto... args) {
    std::snprintf(line, sizeof(line), format, args...);
    text += line;
  };
  const auto ll = [](int64_t x) { return static_cast<long long>(x); };
  add("workload      %s: %lld requests, %lld finished\n", report.source.c_str(), ll(s.requests),
      ll(s.finished));
  add("steps         %lld forward steps (clock %lld) in %.2f s: %.0f steps/s\n", ll(s.steps),
      ll(s.clock), report.seconds, steps_per_second);
  add("tokens        %lld prompt tokens computed, %lld decoded, %lld generated\n",
      ll(s.prompt_tokens), ll(s.decode_tokens), ll(s.generated));
  add("prefix cache  %.1f%% hit: %lld of %lld prompt tokens reused; %lld cached blocks evicted\n",
      100 * s.hit_rate(), ll(s.hit_tokens), ll(s.queried_tokens), ll(s.evictions));
  add("cache         %d blocks of %d tokens, %d-token budget per step; held at peak %.1f%%, "
      "mean %.1f%%\n",
      s.num_blocks, engine.block_size, engine.token_budget, 100 * peak, 100 * s.mean_occupancy());
  add("preemption    %lld to the host tier of %d blocks (%lld blocks moved), %lld recomputed; "
      "admission deferred at %lld steps\n",
      ll(s.preemptions), engine.host_blocks, ll(s.preempted_blocks), ll(s.recomputations),
      ll(s.deferred_steps));
  add("host prefix   %lld evicted blocks demoted to the host, %lld promoted back, %lld dropped\n",
      ll(s.host_demoted), ll(s.host_promoted), ll(s.host_dropped));
  if (report.engines > 1 || report.remote) {
    add("engines       %d, requests dealt round-robin, run side by side; counts summed\n",
        report.engines);
  }
  if (report.remote) {
    const RemoteTierStats& t = report.tier;
    const EngineStats& o = report.without_tier;
    if (!report.remote_connected) {
      text +=
          "remote tier   not connected at start: the server was unreachable (retried in the "
          "background)\n";
    }
    add("remote tier   %lld blocks hit, %lld misses (%lld not found, %lld did not verify, %lld "
        "errors, %lld late); %lld bytes fetched, %lld blocks (%lld bytes) stored, %lld dropped, "
        "%lld errors, %lld reconnects, %lld redirects, %d node(s)\n",
        ll(t.hits), ll(t.misses), ll(t.misses_not_found), ll(t.misses_verify_failed),
        ll(t.misses_error), ll(t.misses_late), ll(t.fetched_bytes), ll(t.stored),
        ll(t.stored_bytes), ll(t.dropped), ll(t.errors), ll(t.reconnects), ll(t.redirects),
        t.nodes);
    add("with tier     %.1f%% hit, %lld prompt tokens computed\n", 100 * s.hit_rate(),
        ll(s.prompt_tokens));
    add("without tier  %.1f%% hit, %lld prompt tokens computed (the same requests and engines)\n",
        100 * o.hit_rate(), ll(o.prompt_tokens));
  }
  return text;
}

bool StderrIsTerminal() { return isatty(STDERR_FILENO) != 0; }

}  // namespace blockkv::tool
