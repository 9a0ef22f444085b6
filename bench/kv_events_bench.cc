// SPDX-License-Identifier: Apache-2.0
// kv_events_bench: what publishing the prefix cache's events over ZeroMQ (kv_events.h) costs the
// scheduling thread — Schedule / PostForward throughput with events published against the same
// workload with events drained in process and with events off, in one binary.
//
//   ./build/default/bench/kv_events_bench   # about 30 s on 2 cores
//
// Workload (fixed seed): 32 system prompts of 512 tokens; 1,000 requests, each a system prompt
// (uniform) + 64 random tokens, scheduled whole, then 16 decode steps (AppendTokens, Schedule 1,
// PostForward), then FlushSequence. Block size 16, 1,024 device blocks (the 32 prompts' 1,024
// full blocks plus the requests' own do not fit: blocks are evicted and published again, so
// every kind of event flows). One iteration = the whole workload on a manager reset to empty
// (untimed). Rows:
//   events_off         prefix caching with max_events = 0: no events at all (the baseline)
//   events_in_process  the default queue, drained once per request (DrainCacheEvents)
//   events_zmq         StateManagerConfig.kv_events on tcp://127.0.0.1:* with no subscriber
//   events_zmq_sub     the same with a SUB socket on another thread receiving every message
// Counters: steps/s (Schedule + PostForward pairs per second, real time) and, for the zmq rows,
// the publisher's batches per iteration and drops (there should be none: the queue is 100,000).
#include <zmq.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "blockkv/blockkv.h"
#include "blockkv/kv_events.h"
#include "blockkv/state_manager.h"

namespace blockkv {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int kPrompts = 32;
constexpr int kPromptLen = 512;
constexpr int kRequests = 1000;
constexpr int kSuffix = 64;
constexpr int kDecode = 16;
constexpr int32_t kBlocks = 1024;

struct Workload {
  std::vector<std::vector<TokenId>> prompts;  // per request
  std::vector<std::vector<TokenId>> decoded;
};

const Workload& GetWorkload() {
  static const Workload w = [] {
    std::mt19937_64 rng(20);
    std::uniform_int_distribution<TokenId> token(0, 50000);
    std::vector<std::vector<TokenId>> system(kPrompts);
    for (auto& p : system) {
      p.resize(kPromptLen);
      for (TokenId& t : p) t = token(rng);
    }
    Workload out;
    out.prompts.reserve(kRequests);
    out.decoded.reserve(kRequests);
    std::uniform_int_distribution<int> pick(0, kPrompts - 1);
    for (int r = 0; r < kRequests; ++r) {
      std::vector<TokenId> p = system[static_cast<size_t>(pick(rng))];
      p.resize(kPromptLen + kSuffix);
      for (int i = kPromptLen; i < kPromptLen + kSuffix; ++i)
        p[static_cast<size_t>(i)] = token(rng);
      out.prompts.push_back(std::move(p));
      std::vector<TokenId> d(kDecode);
      for (TokenId& t : d) t = token(rng);
      out.decoded.push_back(std::move(d));
    }
    return out;
  }();
  return w;
}

enum class Mode { kOff, kInProcess, kZmq, kZmqSubscriber };

// A SUB socket on its own thread receiving everything until stopped.
class Subscriber {
 public:
  explicit Subscriber(const std::string& endpoint) : ctx_(zmq_ctx_new()) {
    socket_ = zmq_socket(ctx_, ZMQ_SUB);
    zmq_setsockopt(socket_, ZMQ_SUBSCRIBE, "", 0);
    const int timeout_ms = 50;
    zmq_setsockopt(socket_, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_connect(socket_, endpoint.c_str());
    thread_ = std::thread([this] {
      char buffer[1 << 16];
      while (!stop_.load(std::memory_order_relaxed)) {
        if (zmq_recv(socket_, buffer, sizeof buffer, 0) >= 0) {
          received_.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  ~Subscriber() {
    stop_.store(true);
    thread_.join();
    const int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(socket_);
    zmq_ctx_term(ctx_);
  }

 private:
  void* ctx_;
  void* socket_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> received_{0};
};

void RunSteps(benchmark::State& state, Mode mode) {
  const Workload& w = GetWorkload();
  StateManagerConfig config;
  config.max_tracked_sequences = 4;
  config.max_ragged_sequence_count = 4;
  config.max_ragged_batch_size = 1024;
  config.max_context = 1024;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = kBlocks};
  config.prefix_cache = {.enabled = true, .max_events = mode == Mode::kOff ? size_t{0} : 65536};
  if (mode == Mode::kZmq || mode == Mode::kZmqSubscriber) {
    config.kv_events = KVEventsConfig{.endpoint = "tcp://127.0.0.1:*"};
  }
  const KVCacheConfig model{.block_size = kBlockSize,
                            .cache_shape = {1, 1, 8},
                            .cache_dtype = DType::kFloat16,
                            .max_blocks_per_allocation_group = 64};
  auto m = StateManager::Create(config, {model}, CpuDevice());
  blockkv_bench::Check(m.status(), "StateManager::Create");
  StateManager& mgr = **m;
  std::unique_ptr<Subscriber> sub;
  if (mode == Mode::kZmqSubscriber)
    sub = std::make_unique<Subscriber>(mgr.kv_event_publisher()->endpoint());
  int64_t steps = 0;
  const int64_t one = 1;
  for (auto _ : state) {
    for (int r = 0; r < kRequests; ++r) {
      const auto uid = static_cast<SeqId>(r);
      const std::span<const SeqId> uids(&uid, 1);
      const auto& prompt = w.prompts[static_cast<size_t>(r)];
      const int64_t len = std::ssize(prompt);
      blockkv_bench::Check(mgr.AddSequence(uid, prompt).status(), "AddSequence");
      blockkv_bench::Check(mgr.Schedule({.uids = uids, .lengths = std::span(&len, 1)}), "Schedule");
      blockkv_bench::Check(mgr.PostForward(uids), "PostForward");
      for (const TokenId& t : w.decoded[static_cast<size_t>(r)]) {
        blockkv_bench::Check(mgr.AppendTokens(uid, std::span(&t, 1)), "AppendTokens");
        blockkv_bench::Check(mgr.Schedule({.uids = uids, .lengths = std::span(&one, 1)}),
                             "Schedule decode");
        blockkv_bench::Check(mgr.PostForward(uids), "PostForward decode");
      }
      if (mode == Mode::kInProcess) benchmark::DoNotOptimize(mgr.DrainCacheEvents());
      blockkv_bench::Check(mgr.FlushSequence(uid), "FlushSequence");
      steps += 1 + kDecode;
    }
    state.PauseTiming();
    mgr.ResetPrefixCache();
    if (KVEventPublisher* p = mgr.kv_event_publisher()) p->Flush();
    state.ResumeTiming();
  }
  state.counters["steps/s"] =
      benchmark::Counter(static_cast<double>(steps), benchmark::Counter::kIsRate);
  if (KVEventPublisher* p = mgr.kv_event_publisher()) {
    const KVEventsStats s = p->stats();
    state.counters["batches"] = benchmark::Counter(static_cast<double>(s.batches_published),
                                                   benchmark::Counter::kAvgIterations);
    state.counters["dropped"] = static_cast<double>(s.batches_dropped);
  }
}

}  // namespace
}  // namespace blockkv

int main(int argc, char** argv) {
  if (!blockkv_bench::InitializeWithRepetitions(argc, argv)) return 1;
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  using blockkv::Mode;
  for (const auto& [name, mode] :
       {std::pair{"events_off", Mode::kOff}, std::pair{"events_in_process", Mode::kInProcess},
        std::pair{"events_zmq", Mode::kZmq}, std::pair{"events_zmq_sub", Mode::kZmqSubscriber}}) {
    benchmark::RegisterBenchmark(name, blockkv::RunSteps, mode)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(20)
        ->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
