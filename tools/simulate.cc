// SPDX-License-Identifier: Apache-2.0
// `blockkv simulate`: replays requests through the Engine with a NullRunner — the state manager,
// prefix cache and ragged batch do all their work, the model none — and reports what the cache
// went through.
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>

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

Result<SimulateReport> Simulate(RequestSource& requests, const SimulateOptions& options) {
  EngineOptions engine_options = options.engine;
  engine_options.keep_outputs = false;
  BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(engine_options));
  SimulateReport report;
  NullRunner runner;
  ProgressBar progress(options.progress, requests.total());
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  // One sample every `stride` steps, the stride doubling (and every other sample dropped) when
  // kMaxSamples are held: a long run's plot costs bounded memory.
  int64_t stride = 1;
  Status status = engine->Run(requests, runner, [&](const Engine& e) {
    const EngineStats& s = e.stats();
    if (s.steps % stride == 0) {
      report.samples.push_back(
          {s.steps, static_cast<double>(e.used_blocks()) / s.num_blocks, s.hit_rate()});
      if (std::ssize(report.samples) == SimulateReport::kMaxSamples) {
        for (size_t i = 0; 2 * i + 1 < report.samples.size(); ++i) {
          report.samples[i] = report.samples[2 * i + 1];
        }
        report.samples.resize(report.samples.size() / 2);
        stride *= 2;
      }
    }
    progress.Update(e);
  });
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  progress.Finish();
  BLOCKKV_RETURN_IF_ERROR(status);
  report.stats = engine->stats();
  // Every request finished, so every block must be free or cached, and the manager consistent.
  BLOCKKV_RETURN_IF_ERROR(engine->manager().CheckInvariants());
  if (engine->used_blocks() != 0 || engine->manager().n_tracked_sequences() != 0) {
    return InternalError(std::to_string(engine->used_blocks()) +
                         " blocks still held after every request finished");
  }
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
        .EndObject();
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
  return text;
}

bool StderrIsTerminal() { return isatty(STDERR_FILENO) != 0; }

}  // namespace blockkv::tool
