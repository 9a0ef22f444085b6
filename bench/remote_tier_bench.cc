// SPDX-License-Identifier: Apache-2.0
// remote_tier_bench: the remote prefix tier's store and fetch throughput (docs/remote_tier.md)
// against hiredis's own pipelined SET / MGET of the same bytes, in one binary, against a
// redis-server on loopback that it starts itself (127.0.0.1, a free port, persistence off), and
// the same against a Redis Cluster of 3 masters it starts too (redis-cli --cluster create).
//
//   ./build/default/bench/remote_tier_bench
//
// Blocks of 2 MiB (Llama-3-8B: 32 layers × 16 tokens × 2 × 8 KV heads × 128 × fp16) and 64 KiB
// (one such layer); k blocks per operation (8 of 2 MiB, 32 of 64 KiB), a prompt of k full blocks
// + 1 token. Rows (one iteration = k blocks):
//   tier_store   AddSequence + Schedule + PostForward + FlushSequence of a new prompt (its k
//                blocks published, copied to the host, queued), then FlushRemoteTier (stored);
//                prompts:8 does the first four for 8 prompts in a row (an engine's steps: each
//                prompt's lookup and copies made while the worker sends the last one's), then
//                flushes
//   tier_store_only  tier_store of one prompt with its AddSequence and Schedule (the lookup, a
//                miss: one round trip) untimed: the write-through alone
//   raw_set      k SETs (k × prompts) of distinct values of the same size, pipelined on one
//                hiredis connection (each prompt's written before the next one's is formatted),
//                then every reply read
//   tier_fetch   AddSequence + Schedule of a prompt whose k blocks are only on the server (one
//                MGET, verification, copies into fresh blocks), then FlushSequence and, untimed,
//                ResetPrefixCache
//   raw_mget     one MGET of the same k keys
//   tier_fetch_ahead   FetchRemotePrefix, its ticket waited for, then the Schedule that takes it
//   tier_fetch_ahead_many  8 requests of k / 8 blocks fetched ahead at once, waited for and
//                scheduled together (the queued fetches pipelined: one round trip, not 8)
//   tier_fetch_agreed  the same with AgreeRemotePrefix (a world of one) in place of the wait: what
//                the tensor-parallel agreement adds (its offer verifies the values once more)
//   unix_tier_store, unix_raw_set, unix_tier_fetch, unix_raw_mget   as above over the server's
//                unix socket (unix:// for the tier, redisConnectUnix for raw)
//   tls_tier_store, tls_tier_fetch   as above over TLS to the same server's tls-port (rediss://,
//                its certificate checked; a CA and certificate made with the openssl tool at
//                start): against tier_store / tier_fetch over TCP, what TLS costs
//   tls_raw_set, tls_raw_mget   the raw rows over TLS with OpenSSL alone (hiredis 0.14 has no
//                TLS): each prompt's SETs formatted into one buffer and written, or the MGET
//                written, then the replies' bytes read, counted, not parsed
//   cluster_tier_store, cluster_tier_store_only, cluster_tier_fetch   as above, the tier given
//                redis+cluster://
//   cluster_raw_set   the k SETs routed to their slots' masters, one hiredis connection per node:
//                     every node's pipeline written, then every reply read
//   cluster_raw_get   the k keys' GETs, routed and pipelined the same way (MGET across slots is
//                     refused by a cluster)
//   serve_vs_recompute/recompute_2048  blockkv demo's model (4 layers, dim 128, fp32, random
//                weights) prefills a 2,049-token prompt on the CPU: what a miss costs
//   serve_vs_recompute/serve_2048  a cold engine takes the prompt's 128 blocks from the tier (one
//                MGET, verification, copies) and the model computes the last token; its logits
//                against the recomputing engine's are the counter logit_max_diff
// Counters: bytes/s of KV (k × block bytes per iteration); the store rows' lookup_us, the mean time
// of a prompt's Schedule (its lookup, a miss: one round trip, which in a stream of prompts waits
// behind the servers' work on the previous prompt's SETs). FLUSHALL runs untimed between store
// iterations so that the server's memory stays bounded.
#include <hiredis/hiredis.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "blockkv/blockkv.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "model.h"

extern char** environ;

namespace blockkv {
namespace {

constexpr int32_t kBlockSize = 16;
int g_port = 0;
std::string g_unix_path;           // the standalone server's unix socket
int g_tls_port = 0;                // the standalone server's TLS port
std::string g_tls_ca;              // the CA that signed its certificate
std::vector<int> g_cluster_ports;  // the cluster's masters

// Where the tier's server is: the standalone one over TCP, its unix socket or TLS, or the cluster.
enum class Server { kTcp, kUnix, kTls, kCluster };

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::fprintf(stderr, "remote_tier_bench: no free port\n");
    std::abort();
  }
  close(fd);
  return ntohs(addr.sin_port);
}

// port 0: the standalone server; -1: its unix socket.
redisContext* Connect(int port = 0) {
  if (port == 0) port = g_port;
  redisContext* c =
      port < 0 ? redisConnectUnix(g_unix_path.c_str()) : redisConnect("127.0.0.1", port);
  if (c == nullptr || c->err != 0) {
    std::fprintf(stderr, "remote_tier_bench: cannot connect to redis on port %d\n", port);
    std::abort();
  }
  return c;
}

void FlushAll(bool cluster = false) {
  for (const int port : cluster ? g_cluster_ports : std::vector<int>{g_port}) {
    redisContext* c = Connect(port);
    freeReplyObject(redisCommand(c, "FLUSHALL"));
    redisFree(c);
  }
}

std::string ClusterUrl() {
  std::string url = "redis+cluster://";
  for (size_t i = 0; i < g_cluster_ports.size(); ++i) {
    if (i > 0) url.push_back(',');
    url.append("127.0.0.1:");
    url.append(std::to_string(g_cluster_ports[i]));
  }
  return url;
}

// layers = 32: 2 MiB blocks; 1: 64 KiB.
std::unique_ptr<StateManager> MakeManager(int64_t layers, int32_t k, Server where = Server::kTcp) {
  StateManagerConfig config;
  config.max_tracked_sequences = 16;
  config.max_ragged_batch_size = 4096;
  config.max_ragged_sequence_count = 16;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = 2 * k + 4};
  config.prefix_cache.enabled = true;
  std::string url = "redis://127.0.0.1:" + std::to_string(g_port);
  if (where == Server::kCluster) url = ClusterUrl();
  if (where == Server::kUnix) url = "unix://" + g_unix_path;
  if (where == Server::kTls) {
    url = "rediss://127.0.0.1:" + std::to_string(g_tls_port) + "?ssl_ca_certs=" + g_tls_ca;
  }
  config.remote_tier = RemoteTierConfig{.url = url, .timeout_ms = 10000, .max_pending = 4096};
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

// With `lookup_timed` false (one prompt only), the prompt's AddSequence and Schedule (its lookup:
// a miss, one round trip) run untimed: what is timed is the write-through alone.
void TierStoreOn(benchmark::State& state, Server where, bool lookup_timed = true) {
  const bool cluster = where == Server::kCluster;
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  const int64_t prompts = lookup_timed ? state.range(2) : 1;
  std::unique_ptr<StateManager> mgr = MakeManager(layers, k, where);
  int64_t seed = 0;
  double lookup_s = 0;  // in Schedule: the prompt's lookup, a miss
  const SeqId uids[] = {1};
  for (auto _ : state) {
    for (int64_t p = 0; p < prompts; ++p) {
      const std::vector<TokenId> prompt = Prompt(++seed, k);
      const int64_t lengths[] = {std::ssize(prompt)};
      if (!lookup_timed) state.PauseTiming();
      blockkv_bench::Check(mgr->AddSequence(1, prompt).status(), "AddSequence");
      const auto lookup = std::chrono::steady_clock::now();
      blockkv_bench::Check(mgr->Schedule({.uids = uids, .lengths = lengths}), "Schedule");
      lookup_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - lookup).count();
      if (mgr->GetSequence(1)->cached_prefix_tokens() != 0) state.SkipWithError("a store row hit");
      if (!lookup_timed) state.ResumeTiming();
      blockkv_bench::Check(mgr->PostForward(uids), "PostForward");
      blockkv_bench::Check(mgr->FlushSequence(1), "FlushSequence");
    }
    mgr->FlushRemoteTier();
    state.PauseTiming();
    mgr->ResetPrefixCache();
    FlushAll(cluster);
    state.ResumeTiming();
  }
  const RemoteTierStats s = mgr->remote_tier_stats();
  if (s.stored != state.iterations() * k * prompts) {
    state.SkipWithError("not every block was stored");
  }
  if (cluster && s.nodes != std::ssize(g_cluster_ports)) state.SkipWithError("not every node");
  SetBytes(state, layers, static_cast<int32_t>(k * prompts));
  if (lookup_timed) {
    state.counters["lookup_us"] =
        1e6 * lookup_s / static_cast<double>(state.iterations() * prompts);
  }
}
void TierStore(benchmark::State& state) { TierStoreOn(state, Server::kTcp); }
void UnixTierStore(benchmark::State& state) { TierStoreOn(state, Server::kUnix); }
void TlsTierStore(benchmark::State& state) { TierStoreOn(state, Server::kTls); }
void ClusterTierStore(benchmark::State& state) { TierStoreOn(state, Server::kCluster); }
void TierStoreOnly(benchmark::State& state) { TierStoreOn(state, Server::kTcp, false); }
void ClusterTierStoreOnly(benchmark::State& state) { TierStoreOn(state, Server::kCluster, false); }

// k values of the tier's size for these blocks (header + tokens + bytes + checksum), each its own
// bytes in its own memory, as k blocks are: one value sent k times would be read from the CPU's
// cache each time after the first, which no cache of blocks does.
std::vector<std::string> Values(int64_t layers, int32_t k) {
  std::vector<std::string> values;
  for (int32_t i = 0; i < k; ++i) {
    values.emplace_back(static_cast<size_t>(BlockBytes(layers)) + 200, static_cast<char>('a' + i));
  }
  return values;
}

// Writes what hiredis has buffered for `c`; false when the connection fails.
bool WriteAll(redisContext* c) {
  int done = 0;
  while (done == 0) {
    if (redisBufferWrite(c, &done) != REDIS_OK) return false;
  }
  return true;
}

// The SETs of every prompt's blocks, a prompt's written before the next one's are formatted
// (hiredis would otherwise grow one buffer to all of them, copying it as it grows), every reply
// read at the end.
void RawSetOn(benchmark::State& state, Server where) {
  const int64_t layers = state.range(0);
  const auto per_prompt = static_cast<int32_t>(state.range(1));
  const auto k = static_cast<int32_t>(per_prompt * state.range(2));
  redisContext* c = Connect(where == Server::kUnix ? -1 : 0);
  const std::vector<std::string> values = Values(layers, k);
  int64_t seed = 0;
  for (auto _ : state) {
    ++seed;
    for (int32_t i = 0; i < k; ++i) {
      const std::string key = "raw:" + std::to_string(seed) + ":" + std::to_string(i);
      const std::string& value = values[static_cast<size_t>(i)];
      const char* argv[] = {"SET", key.data(), value.data()};
      const size_t lens[] = {3, key.size(), value.size()};
      redisAppendCommandArgv(c, 3, argv, lens);
      if ((i + 1) % per_prompt == 0 && !WriteAll(c)) state.SkipWithError("SET failed");
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
void RawSet(benchmark::State& state) { RawSetOn(state, Server::kTcp); }
void UnixRawSet(benchmark::State& state) { RawSetOn(state, Server::kUnix); }

void TierFetchOn(benchmark::State& state, Server where) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  FlushAll(where == Server::kCluster);
  const std::vector<TokenId> prompt = Prompt(-1, k);
  {
    std::unique_ptr<StateManager> writer = MakeManager(layers, k, where);
    Run(*writer, 1, prompt);
    writer->FlushRemoteTier();
  }
  std::unique_ptr<StateManager> mgr = MakeManager(layers, k, where);
  for (auto _ : state) {
    if (Run(*mgr, 1, prompt) != int64_t{k} * kBlockSize) state.SkipWithError("not a full hit");
    blockkv_bench::Check(mgr->FlushSequence(1), "FlushSequence");
    state.PauseTiming();
    mgr->ResetPrefixCache();
    state.ResumeTiming();
  }
  SetBytes(state, layers, k);
}
void TierFetch(benchmark::State& state) { TierFetchOn(state, Server::kTcp); }
void UnixTierFetch(benchmark::State& state) { TierFetchOn(state, Server::kUnix); }
void TlsTierFetch(benchmark::State& state) { TierFetchOn(state, Server::kTls); }

// A TLS connection to the standalone server's TLS port with OpenSSL alone, its certificate
// checked against the bench's CA: the raw rows' client over TLS.
class RawTls {
 public:
  RawTls() {
    ctx_ = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(g_tls_port));
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ssl_ = SSL_new(ctx_);
    if (SSL_CTX_load_verify_locations(ctx_, g_tls_ca.c_str(), nullptr) != 1 ||
        connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        SSL_set_fd(ssl_, fd_) != 1 ||
        X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), "127.0.0.1") != 1 ||
        SSL_connect(ssl_) != 1) {
      std::fprintf(stderr, "remote_tier_bench: no TLS connection to port %d\n", g_tls_port);
      std::abort();
    }
  }
  ~RawTls() {
    SSL_free(ssl_);
    close(fd_);
    SSL_CTX_free(ctx_);
  }
  RawTls(const RawTls&) = delete;
  RawTls& operator=(const RawTls&) = delete;

  bool Write(std::string_view bytes) {
    while (!bytes.empty()) {
      const int n = SSL_write(ssl_, bytes.data(), static_cast<int>(bytes.size()));
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  // Reads n bytes (into one buffer, overwritten: a raw client's least work).
  bool Read(size_t n) {
    while (n > 0) {
      const int got = SSL_read(ssl_, buffer_.data(), static_cast<int>(std::min(n, buffer_.size())));
      if (got <= 0) return false;
      n -= static_cast<size_t>(got);
    }
    return true;
  }

 private:
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  int fd_ = -1;
  std::vector<char> buffer_ = std::vector<char>(size_t{1} << 20);
};

// "*3\r\n$3\r\nSET\r\n$<len>\r\n<key>\r\n$<len>\r\n<value>\r\n" appended to `out`.
void AppendSet(std::string& out, std::string_view key, std::string_view value) {
  out.append("*3\r\n$3\r\nSET\r\n$").append(std::to_string(key.size())).append("\r\n");
  out.append(key).append("\r\n$").append(std::to_string(value.size())).append("\r\n");
  out.append(value).append("\r\n");
}

void TlsRawSet(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto per_prompt = static_cast<int32_t>(state.range(1));
  const auto k = static_cast<int32_t>(per_prompt * state.range(2));
  RawTls tls;
  redisContext* c = Connect();
  const std::vector<std::string> values = Values(layers, k);
  std::string commands;
  int64_t seed = 0;
  for (auto _ : state) {
    ++seed;
    for (int32_t i = 0; i < k; ++i) {
      AppendSet(commands, "raw:" + std::to_string(seed) + ":" + std::to_string(i),
                values[static_cast<size_t>(i)]);
      if ((i + 1) % per_prompt == 0) {
        if (!tls.Write(commands)) state.SkipWithError("SET failed");
        commands.clear();
      }
    }
    if (!tls.Read(5 * static_cast<size_t>(k))) state.SkipWithError("SET failed");  // "+OK\r\n"
    state.PauseTiming();
    freeReplyObject(redisCommand(c, "FLUSHALL"));
    state.ResumeTiming();
  }
  redisFree(c);
  SetBytes(state, layers, k);
}

void TlsRawMget(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  RawTls tls;
  redisContext* c = Connect();
  freeReplyObject(redisCommand(c, "FLUSHALL"));
  const std::string value(static_cast<size_t>(BlockBytes(layers)) + 200, 'x');
  std::string mget = "*";
  mget.append(std::to_string(k + 1)).append("\r\n$4\r\nMGET\r\n");
  // The reply: "*<k>\r\n", then "$<len>\r\n<value>\r\n" for each key.
  size_t reply = 3 + std::to_string(k).size();
  const size_t per_value = 3 + std::to_string(value.size()).size() + value.size() + 2;
  for (int32_t i = 0; i < k; ++i) {
    const std::string key = "raw:" + std::to_string(i);
    freeReplyObject(
        redisCommand(c, "SET %b %b", key.data(), key.size(), value.data(), value.size()));
    mget.append("$").append(std::to_string(key.size())).append("\r\n").append(key).append("\r\n");
    reply += per_value;
  }
  redisFree(c);
  for (auto _ : state) {
    if (!tls.Write(mget) || !tls.Read(reply)) state.SkipWithError("MGET failed");
  }
  SetBytes(state, layers, k);
}

// A prompt fetched ahead (FetchRemotePrefix, waited for) and then scheduled; with `agree`, the
// ranks' agreement (AgreeRemotePrefix over a world of one: the offer's wait and verification and
// the cap, without a network's all-reduce) runs between. The pair prices the agreement.
void FetchAheadOn(benchmark::State& state, bool agree) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  FlushAll(false);
  const std::vector<TokenId> prompt = Prompt(-2, k);
  {
    std::unique_ptr<StateManager> writer = MakeManager(layers, k);
    Run(*writer, 1, prompt);
    writer->FlushRemoteTier();
  }
  std::unique_ptr<StateManager> mgr = MakeManager(layers, k);
  LocalCommunicator world;
  const SeqId uids[] = {1};
  const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
  for (auto _ : state) {
    blockkv_bench::Check(mgr->AddSequence(1, prompt).status(), "AddSequence");
    const Result<RemoteFetchTicket> ticket = mgr->FetchRemotePrefix(1);
    blockkv_bench::Check(ticket.status(), "FetchRemotePrefix");
    if (agree) {
      blockkv_bench::Check(mgr->AgreeRemotePrefix(uids, world).status(), "AgreeRemotePrefix");
    } else {
      ticket->Wait();
    }
    blockkv_bench::Check(mgr->Schedule({.uids = uids, .lengths = lengths}), "Schedule");
    if (mgr->GetSequence(1)->cached_prefix_tokens() != int64_t{k} * kBlockSize) {
      state.SkipWithError("not a full hit");
    }
    blockkv_bench::Check(mgr->FlushSequence(1), "FlushSequence");
    state.PauseTiming();
    mgr->ResetPrefixCache();
    state.ResumeTiming();
  }
  SetBytes(state, layers, k);
}
void TierFetchAhead(benchmark::State& state) { FetchAheadOn(state, false); }

// 8 requests of k / 8 blocks each, fetched ahead at once (an engine admitting 8 requests), waited
// for and scheduled together: the fetches queued behind the first go in one pipeline, so against
// raw_mget of all k keys this is the price of 8 requests over one.
void TierFetchAheadMany(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  constexpr int kRequests = 8;
  FlushAll(false);
  std::vector<std::vector<TokenId>> prompts;
  std::vector<SeqId> uids;
  std::vector<int64_t> lengths;
  for (int r = 0; r < kRequests; ++r) {
    prompts.push_back(Prompt(100 + r, k / kRequests));
    uids.push_back(r + 1);
    lengths.push_back(std::ssize(prompts.back()));
  }
  {
    std::unique_ptr<StateManager> writer = MakeManager(layers, k);
    for (int r = 0; r < kRequests; ++r) Run(*writer, uids[r], prompts[r]);
    writer->FlushRemoteTier();
  }
  std::unique_ptr<StateManager> mgr = MakeManager(layers, k);
  std::vector<RemoteFetchTicket> tickets(kRequests);
  for (auto _ : state) {
    for (int r = 0; r < kRequests; ++r) {
      blockkv_bench::Check(mgr->AddSequence(uids[r], prompts[r]).status(), "AddSequence");
      Result<RemoteFetchTicket> t = mgr->FetchRemotePrefix(uids[r]);
      blockkv_bench::Check(t.status(), "FetchRemotePrefix");
      tickets[static_cast<size_t>(r)] = *t;
    }
    for (const RemoteFetchTicket& t : tickets) t.Wait();
    blockkv_bench::Check(mgr->Schedule({.uids = uids, .lengths = lengths}), "Schedule");
    if (mgr->remote_tier_stats().hits % k != 0) state.SkipWithError("not a full hit");
    for (const SeqId uid : uids) blockkv_bench::Check(mgr->FlushSequence(uid), "FlushSequence");
    state.PauseTiming();
    mgr->ResetPrefixCache();
    state.ResumeTiming();
  }
  SetBytes(state, layers, k);
}
void TierFetchAgreed(benchmark::State& state) { FetchAheadOn(state, true); }
void ClusterTierFetch(benchmark::State& state) { TierFetchOn(state, Server::kCluster); }

void RawMgetOn(benchmark::State& state, Server where) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  redisContext* c = Connect(where == Server::kUnix ? -1 : 0);
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
void RawMget(benchmark::State& state) { RawMgetOn(state, Server::kTcp); }
void UnixRawMget(benchmark::State& state) { RawMgetOn(state, Server::kUnix); }

// k keys ("raw:<i>"), each with the connection of its slot's master (CLUSTER KEYSLOT and
// CLUSTER SLOTS, asked once).
struct Routed {
  std::vector<redisContext*> nodes;            // one per master, as g_cluster_ports
  std::vector<std::vector<std::string>> keys;  // per node
  std::vector<std::vector<size_t>> items;      // per node: i of its keys
  Routed(const Routed&) = delete;
  Routed& operator=(const Routed&) = delete;
  explicit Routed(int32_t k) {
    for (const int port : g_cluster_ports) nodes.push_back(Connect(port));
    keys.resize(nodes.size());
    items.resize(nodes.size());
    auto* slots = static_cast<redisReply*>(redisCommand(nodes[0], "CLUSTER SLOTS"));
    for (int32_t i = 0; i < k; ++i) {
      const std::string key = "raw:" + std::to_string(i);
      auto* slot = static_cast<redisReply*>(
          redisCommand(nodes[0], "CLUSTER KEYSLOT %b", key.data(), key.size()));
      for (size_t r = 0; r < slots->elements; ++r) {
        const redisReply* range = slots->element[r];
        if (range->element[0]->integer <= slot->integer &&
            slot->integer <= range->element[1]->integer) {
          const long long port = range->element[2]->element[1]->integer;
          for (size_t n = 0; n < nodes.size(); ++n) {
            if (g_cluster_ports[n] == port) {
              keys[n].push_back(key);
              items[n].push_back(static_cast<size_t>(i));
            }
          }
        }
      }
      freeReplyObject(slot);
    }
    freeReplyObject(slots);
  }
  ~Routed() {
    for (redisContext* c : nodes) redisFree(c);
  }
  // Every node's pipeline of `command key [value]` (key i's value: values[i]) written, then every
  // reply read. Keys are taken `per_write` at a time (a prompt's, as RawSet does): each group's
  // commands formatted and written to their nodes before the next group's.
  bool Pipeline(const char* command, const std::vector<std::string>* values, size_t per_write = 0) {
    size_t total = 0;
    for (const std::vector<std::string>& node_keys : keys) total += node_keys.size();
    if (per_write == 0) per_write = total;
    std::vector<size_t> next(nodes.size(), 0);  // per node: its first key not written
    for (size_t end = per_write;; end += per_write) {
      for (size_t n = 0; n < nodes.size(); ++n) {
        for (; next[n] < keys[n].size() && items[n][next[n]] < end; ++next[n]) {
          const std::string& key = keys[n][next[n]];
          const std::string* value = values != nullptr ? &(*values)[items[n][next[n]]] : nullptr;
          const char* argv[] = {command, key.data(), value != nullptr ? value->data() : nullptr};
          const size_t lens[] = {std::strlen(command), key.size(),
                                 value != nullptr ? value->size() : 0};
          redisAppendCommandArgv(nodes[n], value != nullptr ? 3 : 2, argv, lens);
        }
        if (!WriteAll(nodes[n])) return false;
      }
      if (end >= total) break;
    }
    for (size_t n = 0; n < nodes.size(); ++n) {
      for (size_t i = 0; i < keys[n].size(); ++i) {
        void* reply = nullptr;
        if (redisGetReply(nodes[n], &reply) != REDIS_OK) return false;
        const bool ok = static_cast<redisReply*>(reply)->type != REDIS_REPLY_ERROR &&
                        static_cast<redisReply*>(reply)->type != REDIS_REPLY_NIL;
        freeReplyObject(reply);
        if (!ok) return false;
      }
    }
    return true;
  }
};

void ClusterRawSet(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto per_prompt = static_cast<size_t>(state.range(1));
  const auto k = static_cast<int32_t>(state.range(1) * state.range(2));  // every prompt's blocks
  Routed routed(k);
  const std::vector<std::string> values = Values(layers, k);
  for (auto _ : state) {
    if (!routed.Pipeline("SET", &values, per_prompt)) state.SkipWithError("SET failed");
    state.PauseTiming();
    FlushAll(/*cluster=*/true);
    state.ResumeTiming();
  }
  SetBytes(state, layers, k);
}

void ClusterRawGet(benchmark::State& state) {
  const int64_t layers = state.range(0);
  const auto k = static_cast<int32_t>(state.range(1));
  FlushAll(/*cluster=*/true);
  Routed routed(k);
  const std::vector<std::string> values = Values(layers, k);
  if (!routed.Pipeline("SET", &values)) state.SkipWithError("SET failed");
  for (auto _ : state) {
    if (!routed.Pipeline("GET", nullptr)) state.SkipWithError("GET failed");
  }
  SetBytes(state, layers, k);
}

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"layers", "k"})->Args({32, 8})->Args({1, 32})->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}
// Stores: also a stream of 8 prompts (each scheduled, forwarded and flushed, the next one's
// lookup and copies made while the worker sends the last one's) against one pipeline of all
// their SETs.
void StoreArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"layers", "k", "prompts"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (const int64_t prompts : {1, 8}) b->Args({32, 8, prompts})->Args({1, 32, prompts});
}
BENCHMARK(TierStore)->Apply(StoreArgs);
BENCHMARK(TierStoreOnly)->Apply(Args);
BENCHMARK(RawSet)->Apply(StoreArgs);
BENCHMARK(TierFetch)->Apply(Args);
BENCHMARK(RawMget)->Apply(Args);
BENCHMARK(TierFetchAhead)->Apply(Args);
BENCHMARK(TierFetchAgreed)->Apply(Args);
BENCHMARK(TierFetchAheadMany)
    ->ArgNames({"layers", "k"})
    ->Args({1, 32})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(UnixTierStore)->Apply(StoreArgs);
BENCHMARK(UnixRawSet)->Apply(StoreArgs);
BENCHMARK(UnixTierFetch)->Apply(Args);
BENCHMARK(UnixRawMget)->Apply(Args);
BENCHMARK(TlsTierStore)->Apply(StoreArgs);
BENCHMARK(TlsRawSet)->Apply(StoreArgs);
BENCHMARK(TlsTierFetch)->Apply(Args);
BENCHMARK(TlsRawMget)->Apply(Args);
BENCHMARK(ClusterTierStore)->Apply(StoreArgs);
BENCHMARK(ClusterTierStoreOnly)->Apply(Args);
BENCHMARK(ClusterRawSet)->Apply(StoreArgs);
BENCHMARK(ClusterTierFetch)->Apply(Args);
BENCHMARK(ClusterRawGet)->Apply(Args);

// ---- serving a 2,048-token prefix from the tier against recomputing it ----------------------

constexpr int64_t kServedTokens = 2048;

// blockkv demo's model (tools/model.h: 4 layers, dim 128, 2 heads / 1 KV head × 64, SwiGLU 384,
// random fp32 weights) with a manager of its cache shape; `remote`: the tier on, else off.
struct DemoEngine {
  explicit DemoEngine(bool remote) {
    tool::ModelConfig mc;
    mc.seq_len = 4096;
    Result<tool::Model> m = tool::Model::Random(mc, /*seed=*/7);
    blockkv_bench::Check(m.status(), "Model::Random");
    model = std::make_unique<tool::Model>(std::move(*m));
    StateManagerConfig config;
    config.max_tracked_sequences = 4;
    config.max_ragged_batch_size = 4096;
    config.max_ragged_sequence_count = 4;
    config.max_context = 4096;
    config.memory_config = {.mode = AllocationMode::kAllocate, .size = 600};
    config.prefix_cache.enabled = true;
    if (remote) {
      config.remote_tier = RemoteTierConfig{.url = "redis://127.0.0.1:" + std::to_string(g_port),
                                            .model_id = "demo",
                                            .timeout_ms = 10000};
    }
    auto mgr = StateManager::Create(
        config,
        {KVCacheConfig{.block_size = kBlockSize,
                       .cache_shape = {mc.n_layers, mc.n_kv_heads, mc.head_size()},
                       .cache_dtype = DType::kFloat32,
                       .max_blocks_per_allocation_group = 256}},
        CpuDevice(int64_t{1} << 30));
    blockkv_bench::Check(mgr.status(), "StateManager::Create");
    manager = std::move(*mgr);
    auto b = RaggedBatch::Create(*manager);
    blockkv_bench::Check(b.status(), "RaggedBatch::Create");
    batch = std::move(*b);
  }
  // Schedules `prompt` as `uid` (what the cache gives is taken), runs the model over the rest,
  // keeps the last token's logits; returns the tokens taken from the cache.
  int64_t Run(SeqId uid, const std::vector<TokenId>& prompt) {
    blockkv_bench::Check(manager->AddSequence(uid, prompt).status(), "AddSequence");
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {std::ssize(prompt)};
    blockkv_bench::Check(manager->ScheduleBatch({.uids = uids, .lengths = lengths}, prompt, *batch),
                         "ScheduleBatch");
    const Sequence& seq = *manager->GetSequence(uid);
    const std::span<const TokenId> tokens = std::span(prompt).subspan(
        static_cast<size_t>(seq.seen_tokens()), static_cast<size_t>(seq.in_flight_tokens()));
    const int64_t rows[] = {std::ssize(tokens) - 1};
    logits.resize(static_cast<size_t>(model->config().vocab_size));
    tool::PagedAttentionBackend paged(*manager, *batch, model->config());
    blockkv_bench::Check(model->Forward(tokens, paged, rows, logits), "Model::Forward");
    const int64_t cached = seq.cached_prefix_tokens();
    blockkv_bench::Check(manager->PostForward(*batch), "PostForward");
    return cached;
  }
  // Forgets the sequence and every cached block: the next Run starts cold.
  void Reset(SeqId uid) {
    blockkv_bench::Check(manager->FlushSequence(uid), "FlushSequence");
    manager->ResetPrefixCache();
  }
  std::unique_ptr<tool::Model> model;
  std::unique_ptr<StateManager> manager;
  std::unique_ptr<RaggedBatch> batch;
  std::vector<float> logits;
};

std::vector<TokenId> DemoPrompt() {
  std::vector<TokenId> p(kServedTokens + 1);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<TokenId>((i * 37 + 11) % 256);
  return p;
}

// What a miss costs: the model computes all 2,049 tokens.
void RecomputePrefix(benchmark::State& state) {
  DemoEngine engine(/*remote=*/false);
  const std::vector<TokenId> prompt = DemoPrompt();
  for (auto _ : state) {
    if (engine.Run(1, prompt) != 0) state.SkipWithError("a recompute row hit");
    state.PauseTiming();
    engine.Reset(1);
    state.ResumeTiming();
  }
  state.counters["tokens_computed"] = static_cast<double>(prompt.size());
}

// A cold engine serves the 2,048-token prefix from the tier (one MGET of 128 blocks of 32 KiB,
// verification, copies into fresh blocks) and computes the last token. logit_max_diff: the
// largest difference between its last-token logits and the recomputing engine's (untimed).
void ServePrefixFromTier(benchmark::State& state) {
  const std::vector<TokenId> prompt = DemoPrompt();
  DemoEngine writer(/*remote=*/true);
  if (writer.Run(1, prompt) != 0) state.SkipWithError("the writer hit");
  writer.manager->FlushRemoteTier();
  const std::vector<float> want = writer.logits;
  DemoEngine reader(/*remote=*/true);
  double diff = 0;
  for (auto _ : state) {
    if (reader.Run(1, prompt) != kServedTokens) state.SkipWithError("the tier did not serve");
    state.PauseTiming();
    for (size_t i = 0; i < want.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(reader.logits[i] - want[i])));
    }
    reader.Reset(1);
    state.ResumeTiming();
  }
  state.counters["tokens_computed"] = 1;
  state.counters["logit_max_diff"] = diff;
  FlushAll();
}

BENCHMARK(RecomputePrefix)
    ->Name("serve_vs_recompute/recompute_2048")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(ServePrefixFromTier)
    ->Name("serve_vs_recompute/serve_2048")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();  // the server's share of the work is in the wall time only

}  // namespace
}  // namespace blockkv

namespace {

// Starts `args` (stdout to /dev/null), its pid appended to `pids`; 0 or the error.
// Starts a program, its stdout (and with `quiet_stderr` its stderr) discarded; 0 or the error.
int Spawn(std::vector<std::string> args, std::vector<pid_t>* pids, bool quiet_stderr = false) {
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t quiet;
  posix_spawn_file_actions_init(&quiet);
  posix_spawn_file_actions_addopen(&quiet, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  if (quiet_stderr) {
    posix_spawn_file_actions_addopen(&quiet, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, argv[0], &quiet, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&quiet);
  if (err == 0) pids->push_back(pid);
  return err;
}

void WaitUp(int port) {
  for (int i = 0; i < 200; ++i) {
    redisContext* c = redisConnect("127.0.0.1", port);
    const bool up = c != nullptr && c->err == 0;
    if (c != nullptr) redisFree(c);
    if (up) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool WaitClusterOk() {
  for (int i = 0; i < 400; ++i) {
    bool ok = true;
    for (const int port : blockkv::g_cluster_ports) {
      redisContext* c = blockkv::Connect(port);
      auto* r = static_cast<redisReply*>(redisCommand(c, "CLUSTER INFO"));
      ok = ok && r != nullptr && r->str != nullptr &&
           std::string_view(r->str, r->len).find("cluster_state:ok") != std::string_view::npos &&
           std::string_view(r->str, r->len).find("cluster_known_nodes:3") != std::string_view::npos;
      freeReplyObject(r);
      redisFree(c);
    }
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (!blockkv_bench::InitializeWithRepetitions(argc, argv)) return 1;
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  blockkv::g_port = blockkv::FreePort();
  const std::string dir =
      std::filesystem::temp_directory_path() / ("blockkv-bench-redis-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  blockkv::g_unix_path = dir + "/redis.sock";
  // The standalone server (also on a unix socket), then the cluster's nodes: no persistence.
  const auto server_args = [](int port, const std::string& where) {
    return std::vector<std::string>{"redis-server",
                                    "--port",
                                    std::to_string(port),
                                    "--bind",
                                    "127.0.0.1",
                                    "--save",
                                    "",
                                    "--appendonly",
                                    "no",
                                    "--dir",
                                    where,
                                    "--loglevel",
                                    "warning"};
  };
  std::vector<pid_t> pids;  // every server started, killed at the end
  // Kills every server and removes their files; 1 with `why` said, 0 without.
  const auto stop = [&](const char* why) {
    if (why != nullptr) std::fprintf(stderr, "remote_tier_bench: %s\n", why);
    for (const pid_t p : pids) {
      kill(p, SIGKILL);
      waitpid(p, nullptr, 0);
    }
    std::filesystem::remove_all(dir);
    return why != nullptr ? 1 : 0;
  };
  // A CA and a certificate it signed for 127.0.0.1, for the server's TLS port.
  blockkv::g_tls_ca = dir + "/ca.pem";
  const std::string key_args = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ";
  for (const std::string& command :
       {"openssl req -x509 -days 2 -subj /CN=ca " + key_args + dir + "/ca.key -out " + dir +
            "/ca.pem",
        "openssl req -subj /CN=server " + key_args + dir + "/server.key -out " + dir +
            "/server.csr",
        "printf 'subjectAltName=IP:127.0.0.1\\n' > " + dir + "/server.ext",
        "openssl x509 -req -in " + dir + "/server.csr -CA " + dir + "/ca.pem -CAkey " + dir +
            "/ca.key -CAcreateserial -days 2 -extfile " + dir + "/server.ext -out " + dir +
            "/server.pem"}) {
    std::vector<pid_t> openssl;
    int status = 1;
    if (Spawn({"sh", "-c", command}, &openssl, /*quiet_stderr=*/true) != 0 ||
        waitpid(openssl[0], &status, 0) != openssl[0] || status != 0) {
      return stop("cannot make a TLS certificate with the openssl tool");
    }
  }
  blockkv::g_tls_port = blockkv::FreePort();
  std::vector<std::string> args = server_args(blockkv::g_port, dir);
  args.insert(args.end(), {"--unixsocket", blockkv::g_unix_path, "--unixsocketperm", "700",
                           "--tls-port", std::to_string(blockkv::g_tls_port), "--tls-cert-file",
                           dir + "/server.pem", "--tls-key-file", dir + "/server.key",
                           "--tls-ca-cert-file", dir + "/ca.pem", "--tls-auth-clients", "no"});
  if (Spawn(args, &pids) != 0) return stop("cannot start redis-server");
  WaitUp(blockkv::g_port);
  // The cluster: 3 masters (free ports and bus ports), joined by redis-cli --cluster create.
  std::vector<std::string> create = {"redis-cli", "--cluster", "create"};
  for (int i = 0; i < 3; ++i) {
    const int node_port = blockkv::FreePort();
    const std::string node_dir = dir + "/node" + std::to_string(i);
    std::filesystem::create_directories(node_dir);
    std::vector<std::string> node_args = server_args(node_port, node_dir);
    node_args.insert(node_args.end(), {"--cluster-enabled", "yes", "--cluster-port",
                                       std::to_string(blockkv::FreePort()),
                                       "--cluster-require-full-coverage", "no"});
    if (Spawn(node_args, &pids) != 0) return stop("cannot start a cluster redis-server");
    blockkv::g_cluster_ports.push_back(node_port);
    create.push_back("127.0.0.1:" + std::to_string(node_port));
    WaitUp(node_port);
  }
  create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
  std::vector<pid_t> cli;
  int status = 1;
  if (Spawn(create, &cli) != 0 || waitpid(cli[0], &status, 0) != cli[0] || status != 0 ||
      !WaitClusterOk()) {
    return stop("redis-cli --cluster create failed");
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return stop(nullptr);
}
