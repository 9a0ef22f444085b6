// SPDX-License-Identifier: Apache-2.0
// remote_tier_bench: the remote prefix tier's store and fetch throughput (docs/remote_tier.md)
// against hiredis's own pipelined SET / MGET of the same bytes, in one binary, against a
// redis-server on loopback that it starts itself (127.0.0.1, a free port, persistence off).
//
//   ./build/default/bench/remote_tier_bench
//
// Blocks of 2 MiB (Llama-3-8B: 32 layers × 16 tokens × 2 × 8 KV heads × 128 × fp16) and 64 KiB
// (one such layer); k blocks per operation (8 of 2 MiB, 32 of 64 KiB), a prompt of k full blocks
// + 1 token. Rows (one iteration = k blocks):
//   tier_store   AddSequence + Schedule + PostForward of a new prompt (its k blocks published,
//                copied to the host, queued) + FlushRemoteTier (stored), then FlushSequence
//   raw_set      k SETs of values of the same size, pipelined on one hiredis connection
//   tier_fetch   AddSequence + Schedule of a prompt whose k blocks are only on the server (one
//                MGET, verification, copies into fresh blocks), then FlushSequence and, untimed,
//                ResetPrefixCache
//   raw_mget     one MGET of the same k keys
// Counter: bytes/s of KV (k × block bytes per iteration). FLUSHALL runs untimed between store
// iterations so that the server's memory stays bounded.
#include <hiredis/hiredis.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "blockkv/blockkv.h"
#include "blockkv/state_manager.h"

extern char** environ;

namespace blockkv {
namespace {

constexpr int32_t kBlockSize = 16;
int g_port = 0;

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

redisContext* Connect() {
  redisContext* c = redisConnect("127.0.0.1", g_port);
  if (c == nullptr || c->err != 0) {
    std::fprintf(stderr, "remote_tier_bench: cannot connect to redis on port %d\n", g_port);
    std::abort();
  }
  return c;
}

void FlushAll() {
  redisContext* c = Connect();
  freeReplyObject(redisCommand(c, "FLUSHALL"));
  redisFree(c);
}

// layers = 32: 2 MiB blocks; 1: 64 KiB.
std::unique_ptr<StateManager> MakeManager(int64_t layers, int32_t k) {
  StateManagerConfig config;
  config.max_tracked_sequences = 4;
  config.max_ragged_batch_size = 4096;
  config.max_ragged_sequence_count = 4;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = 2 * k + 4};
  config.prefix_cache.enabled = true;
  config.remote_tier = RemoteTierConfig{.url = "redis://127.0.0.1:" + std::to_string(g_port),
                                        .timeout_ms = 10000,
                                        .max_pending = 4096};
  auto mgr = StateManager::Create(config,
                                  {KVCacheConfig{.block_size = kBlockSize,
                                                 .cache_shape = {layers, 8, 128},
                                                 .cache_dtype = DType::kFloat16,
                                                 .max_blocks_per_allocation_group = 2 * k + 4}},
                                  CpuDevice(int64_t{4} << 30));
  blockkv_bench::Check(mgr.status(), "StateManager::Create");
  return std::move(*mgr);
}

std::vector<TokenId> Prompt(int64_t seed, int32_t k) {
  std::vector<TokenId> p(static_cast<size_t>(k) * kBlockSize + 1);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<TokenId>((seed * 7919 + i) % 50000);
  return p;
}

// Schedules `prompt` whole as sequence `uid` and completes its forward; returns the cached tokens.
int64_t Run(StateManager& mgr, SeqId uid, const std::vector<TokenId>& prompt) {
  blockkv_bench::Check(mgr.AddSequence(uid, prompt).status(), "AddSequence");
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
  blockkv_bench::Check(mgr.Schedule({.uids = uids, .lengths = lengths}), "Schedule");
  const int64_t cached = mgr.GetSequence(uid)->cached_prefix_tokens();
  blockkv_bench::Check(mgr.PostForward(uids), "PostForward");
  return cached;
}

int64_t BlockBytes(int64_t layers) { return layers * kBlockSize * 2 * 8 * 128 * 2; }

void SetBytes(benchmark::State& state, int64_t layers, int32_t k) {
  state.counters["bytes/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * k * static_cast<double>(BlockBytes(layers)),
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

void TierStore(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  std::unique_ptr<StateManager> mgr = MakeManager(layers, k);
  int64_t seed = 0;
  for (auto _ : state) {
    const std::vector<TokenId> prompt = Prompt(++seed, k);
    if (Run(*mgr, 1, prompt) != 0) state.SkipWithError("a store row hit");
    mgr->FlushRemoteTier();
    blockkv_bench::Check(mgr->FlushSequence(1), "FlushSequence");
    state.PauseTiming();
    mgr->ResetPrefixCache();
    FlushAll();
    state.ResumeTiming();
  }
  const RemoteTierStats s = mgr->remote_tier_stats();
  if (s.stored != state.iterations() * k) state.SkipWithError("not every block was stored");
  SetBytes(state, layers, k);
}

void RawSet(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  redisContext* c = Connect();
  // A value of the tier's size for these blocks (header + tokens + bytes + checksum).
  const std::string value(static_cast<size_t>(BlockBytes(layers)) + 200, 'x');
  int64_t seed = 0;
  for (auto _ : state) {
    ++seed;
    for (int32_t i = 0; i < k; ++i) {
      const std::string key = "raw:" + std::to_string(seed) + ":" + std::to_string(i);
      const char* argv[] = {"SET", key.data(), value.data()};
      const size_t lens[] = {3, key.size(), value.size()};
      redisAppendCommandArgv(c, 3, argv, lens);
    }
    for (int32_t i = 0; i < k; ++i) {
      void* reply = nullptr;
      if (redisGetReply(c, &reply) != REDIS_OK) state.SkipWithError("SET failed");
      freeReplyObject(reply);
    }
    state.PauseTiming();
    freeReplyObject(redisCommand(c, "FLUSHALL"));
    state.ResumeTiming();
  }
  redisFree(c);
  SetBytes(state, layers, k);
}

void TierFetch(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  FlushAll();
  const std::vector<TokenId> prompt = Prompt(-1, k);
  {
    std::unique_ptr<StateManager> writer = MakeManager(layers, k);
    Run(*writer, 1, prompt);
    writer->FlushRemoteTier();
  }
  std::unique_ptr<StateManager> mgr = MakeManager(layers, k);
  for (auto _ : state) {
    if (Run(*mgr, 1, prompt) != int64_t{k} * kBlockSize) state.SkipWithError("not a full hit");
    blockkv_bench::Check(mgr->FlushSequence(1), "FlushSequence");
    state.PauseTiming();
    mgr->ResetPrefixCache();
    state.ResumeTiming();
  }
  SetBytes(state, layers, k);
}

void RawMget(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  redisContext* c = Connect();
  freeReplyObject(redisCommand(c, "FLUSHALL"));
  const std::string value(static_cast<size_t>(BlockBytes(layers)) + 200, 'x');
  std::vector<std::string> keys;
  for (int32_t i = 0; i < k; ++i) {
    keys.push_back("raw:" + std::to_string(i));
    freeReplyObject(redisCommand(c, "SET %b %b", keys.back().data(), keys.back().size(),
                                 value.data(), value.size()));
  }
  std::vector<const char*> argv = {"MGET"};
  std::vector<size_t> lens = {4};
  for (const std::string& key : keys) {
    argv.push_back(key.data());
    lens.push_back(key.size());
  }
  for (auto _ : state) {
    auto* reply = static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (reply == nullptr || reply->elements != static_cast<size_t>(k)) {
      state.SkipWithError("MGET failed");
    }
    benchmark::DoNotOptimize(reply);
    freeReplyObject(reply);
  }
  redisFree(c);
  SetBytes(state, layers, k);
}

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"layers", "k"})->Args({32, 8})->Args({1, 32})->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}
BENCHMARK(TierStore)->Apply(Args);
BENCHMARK(RawSet)->Apply(Args);
BENCHMARK(TierFetch)->Apply(Args);
BENCHMARK(RawMget)->Apply(Args);

}  // namespace
}  // namespace blockkv

int main(int argc, char** argv) {
  if (!blockkv_bench::InitializeWithRepetitions(argc, argv)) return 1;
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  blockkv::g_port = blockkv::FreePort();
  const std::string dir =
      std::filesystem::temp_directory_path() / ("blockkv-bench-redis-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::string port = std::to_string(blockkv::g_port);
  std::vector<std::string> args = {
      "redis-server", "--port", port,    "--bind", "127.0.0.1",  "--save", "",
      "--appendonly", "no",     "--dir", dir,      "--loglevel", "warning"};
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, "redis-server", nullptr, nullptr, cargs.data(), environ) != 0) {
    std::fprintf(stderr, "remote_tier_bench: cannot start redis-server\n");
    return 1;
  }
  for (int i = 0; i < 200; ++i) {
    redisContext* c = redisConnect("127.0.0.1", blockkv::g_port);
    const bool up = c != nullptr && c->err == 0;
    if (c != nullptr) redisFree(c);
    if (up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  std::filesystem::remove_all(dir);
  return 0;
}
