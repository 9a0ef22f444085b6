// SPDX-License-Identifier: Apache-2.0
// The remote prefix tier against a real redis-server that each test starts itself (redis_server.h):
// two managers share blocks through it byte for byte, and every fault — no server, a server
// killed and restarted, a wrong password, a corrupted value, another namespace or model — is a
// counted miss or a clear error, never wrong data in the cache.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "blockkv/log.h"
#include "blockkv/state_manager.h"
#include "remote_tier.h"
#include "unit/redis_server.h"

namespace blockkv {
namespace {

using testing::RedisCluster;
using testing::RedisServer;

constexpr int32_t kBlockSize = 4;
constexpr int64_t kLayers = 2;

class Engine {
 public:
  static std::unique_ptr<Engine> Make(RemoteTierConfig remote, Status* status = nullptr) {
    StateManagerConfig config;
    config.max_tracked_sequences = 16;
    config.max_ragged_batch_size = 256;
    config.max_ragged_sequence_count = 16;
    config.memory_config = {.mode = AllocationMode::kAllocate, .size = 32};
    config.prefix_cache.enabled = true;
    config.remote_tier = std::move(remote);
    auto mgr = StateManager::Create(config,
                                    {KVCacheConfig{.block_size = kBlockSize,
                                                   .cache_shape = {kLayers, 2, 8},
                                                   .cache_dtype = DType::kFloat32,
                                                   .max_blocks_per_allocation_group = 32}},
                                    CpuDevice(64 << 20));
    if (status != nullptr) *status = mgr.status();
    if (!mgr.ok()) return nullptr;
    auto e = std::make_unique<Engine>();
    e->mgr = std::move(*mgr);
    return e;
  }

  // What a model would write for the block holding `tokens`: a function of them alone.
  static uint8_t Byte(std::span<const TokenId> tokens, int64_t layer, size_t i) {
    uint32_t h = static_cast<uint32_t>(layer) * 2654435761u + static_cast<uint32_t>(i);
    for (const TokenId t : tokens) h = h * 31 + static_cast<uint32_t>(t);
    return static_cast<uint8_t>(h ^ (h >> 13));
  }
  size_t LayerBlockBytes() const {
    const TensorView view = *mgr->GetCache(0, 0);
    return static_cast<size_t>(view.stride(0)) * ElementSize(view.dtype);
  }
  std::vector<uint8_t> Expected(std::span<const TokenId> tokens) const {
    std::vector<uint8_t> out;
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      for (size_t i = 0; i < LayerBlockBytes(); ++i) out.push_back(Byte(tokens, layer, i));
    }
    return out;
  }
  std::vector<uint8_t> Bytes(BlockId b) const {
    std::vector<uint8_t> out;
    const size_t n = LayerBlockBytes();
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const TensorView view = *mgr->GetCache(layer, 0);
      const auto* p = static_cast<const uint8_t*>(view.data) + static_cast<size_t>(b) * n;
      out.insert(out.end(), p, p + n);
    }
    return out;
  }
  void Write(BlockId b, std::span<const TokenId> tokens) {
    const std::vector<uint8_t> bytes = Expected(tokens);
    const size_t n = LayerBlockBytes();
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const TensorView view = *mgr->GetCache(layer, 0);
      std::memcpy(static_cast<uint8_t*>(view.data) + static_cast<size_t>(b) * n,
                  &bytes[static_cast<size_t>(layer) * n], n);
    }
  }
  // Adds `uid` with `prompt`, computes what the cache does not give (writing each block it
  // computes), and returns the tokens taken from the cache.
  int64_t Prefill(SeqId uid, const std::vector<TokenId>& prompt, const std::string& ns = "",
                  bool add = true) {
    if (add) {
      EXPECT_TRUE(mgr->AddSequence(uid, prompt, {.keys = {.ns = ns}}).ok());
    }
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
    const Status s = mgr->Schedule({.uids = uids, .lengths = lengths});
    EXPECT_TRUE(s.ok()) << s;
    const Sequence* seq = mgr->GetSequence(uid);
    const int64_t cached = seq->seen_tokens();
    const std::span<const BlockId> table = seq->block_table(0);
    for (auto b = static_cast<size_t>(cached / kBlockSize); b < table.size(); ++b) {
      if (prompt.size() >= (b + 1) * kBlockSize) {
        Write(table[b], std::span(prompt).subspan(b * kBlockSize, kBlockSize));
      }
    }
    EXPECT_TRUE(mgr->PostForward(uids).ok());
    return cached;
  }
  // Every block of the first `blocks` of `uid`'s table holds what the model would have written.
  void ExpectPrefixData(SeqId uid, const std::vector<TokenId>& prompt, size_t blocks) const {
    const std::span<const BlockId> table = mgr->GetSequence(uid)->block_table(0);
    for (size_t b = 0; b < blocks; ++b) {
      EXPECT_EQ(Bytes(table[b]), Expected(std::span(prompt).subspan(b * kBlockSize, kBlockSize)))
          << "block " << b;
    }
    const Status ok = mgr->CheckInvariants();
    EXPECT_TRUE(ok.ok()) << ok;
  }

  std::unique_ptr<StateManager> mgr;
};

std::vector<TokenId> Prompt(TokenId first, size_t n) {
  std::vector<TokenId> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = first + static_cast<TokenId>(i);
  return p;
}

// An engine that computed `prompt` as sequence 1 and stored its full blocks in the tier.
std::unique_ptr<Engine> Stored(RemoteTierConfig config, const std::vector<TokenId>& prompt) {
  auto engine = Engine::Make(std::move(config));
  if (engine == nullptr) return nullptr;
  EXPECT_EQ(engine->Prefill(1, prompt), 0);
  engine->mgr->FlushRemoteTier();
  EXPECT_EQ(engine->mgr->remote_tier_stats().stored, std::ssize(prompt) / kBlockSize);
  return engine;
}

// Every key the server holds.
std::vector<std::string> Keys(redisContext* c) {
  std::vector<std::string> out;
  auto* r = static_cast<redisReply*>(redisCommand(c, "KEYS *"));
  for (size_t i = 0; r != nullptr && i < r->elements; ++i) {
    out.emplace_back(r->element[i]->str, r->element[i]->len);
  }
  freeReplyObject(r);
  return out;
}

std::vector<std::string> Keys(const RedisServer& server) {
  redisContext* c = server.Connect();
  std::vector<std::string> keys = Keys(c);
  redisFree(c);
  return keys;
}

// The block index a stored value holds (offset 48, docs/remote_tier.md).
uint32_t BlockIndex(const RedisServer& server, const std::string& key) {
  const std::string value = server.Text({"GET", key});
  uint32_t index = ~0u;
  if (value.size() >= 52) std::memcpy(&index, value.data() + 48, sizeof(index));
  return index;
}

// SIGCONTs a stalled server when the test ends, however it ends.
struct Resume {
  const RedisServer& server;
  ~Resume() { server.Continue(); }
};

TEST(RemoteTierTest, ASecondEngineHitsTheFirstEnginesBlocks) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);  // 4 full blocks, 1 token left
  auto a = Engine::Make({.url = server.url(), .model_id = "m"});
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(a->mgr->remote_tier_stats().connected);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  RemoteTierStats sa = a->mgr->remote_tier_stats();
  EXPECT_EQ(sa.stored, 4);
  EXPECT_GT(sa.stored_bytes, int64_t{4} * kLayers * static_cast<int64_t>(a->LayerBlockBytes()));
  EXPECT_EQ(sa.misses, 1);  // its own first lookup found nothing
  EXPECT_EQ(sa.hits, 0);
  redisContext* c = server.Connect();
  EXPECT_EQ(Keys(c).size(), 4u);
  redisFree(c);

  auto b = Engine::Make({.url = server.url(), .model_id = "m"});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Prefill(7, prompt), 16);  // its first prompt: every full block from the tier
  b->ExpectPrefixData(7, prompt, 4);
  const RemoteTierStats sb = b->mgr->remote_tier_stats();
  EXPECT_EQ(sb.hits, 4);
  EXPECT_EQ(sb.misses, 0);
  EXPECT_EQ(sb.invalid, 0);
  EXPECT_EQ(sb.nodes, 1);
  EXPECT_EQ(sa.misses_not_found, 1);
  EXPECT_EQ(sb.fetched_bytes, sa.stored_bytes);
  EXPECT_EQ(sb.stored, 0);  // fetched blocks are not written back
  // The fetched blocks are cached on b's device now: a second request hits them there.
  ASSERT_TRUE(b->mgr->FlushSequence(7).ok());
  EXPECT_EQ(b->Prefill(8, prompt), 16);
  EXPECT_EQ(b->mgr->remote_tier_stats().hits, 4);
  b->ExpectPrefixData(8, prompt, 4);
  // A longer prompt: the local run continues on the tier past what b has.
  const std::vector<TokenId> longer = Prompt(100, 25);
  EXPECT_EQ(a->Prefill(2, longer), 16);
  a->mgr->FlushRemoteTier();
  EXPECT_EQ(a->mgr->remote_tier_stats().stored, 6);
  EXPECT_EQ(b->Prefill(9, longer), 24);
  EXPECT_EQ(b->mgr->remote_tier_stats().hits, 6);
  b->ExpectPrefixData(9, longer, 6);
  // prefix_cache_stats splits the hits by where they came from: 16 + 16 + 24 tokens, of which
  // 16 (request 7) and 8 (request 9's last 2 blocks) from the tier.
  const PrefixCacheStats p = b->mgr->prefix_cache()->total_stats();
  EXPECT_EQ(p.hit_tokens, 56);
  EXPECT_EQ(p.remote_hit_tokens, 24);
  EXPECT_EQ(p.host_hit_tokens, 0);
}

// Creates an engine on `url` while nothing answers there; expects one warning naming `port`.
std::unique_ptr<Engine> MakeUnconnected(const std::string& url, int port) {
  std::vector<std::string> lines;
  std::mutex mu;
  SetLogSink([&](LogLevel level, std::string_view line) {
    std::lock_guard lock(mu);
    if (level == LogLevel::kWarning) lines.emplace_back(line);
  });
  auto e = Engine::Make({.url = url, .timeout_ms = 500});
  SetLogSink(nullptr);
  EXPECT_EQ(lines.size(), 1u);
  for (const std::string& line : lines) {
    EXPECT_NE(line.find("remote tier not connected"), std::string::npos) << line;
    EXPECT_NE(line.find(std::to_string(port)), std::string::npos) << line;
  }
  return e;
}

// Prefills new prompts on `e` until its tier is connected (at most 5 s); the tier's stores of
// them may or may not have gone through.
void PrefillUntilConnected(Engine& e, SeqId first_uid) {
  for (int i = 0; i < 100 && !e.mgr->remote_tier_stats().connected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(e.Prefill(first_uid + i, Prompt(7000 + 10 * i, 5)), 0);
    ASSERT_TRUE(e.mgr->FlushSequence(first_uid + i).ok());
  }
  ASSERT_TRUE(e.mgr->remote_tier_stats().connected);
}

// A server that is not up yet when the engine starts (a deployment whose Redis starts after its
// engines): the engine runs without the tier, one warning, then uses it once it answers.
TEST(RemoteTierTest, AServerDownAtStartIsConnectedOnceItAnswers) {
  const int port = testing::FreePort();
  auto e = MakeUnconnected("redis://127.0.0.1:" + std::to_string(port), port);
  ASSERT_NE(e, nullptr);
  const std::vector<TokenId> prompt = Prompt(1, 9);
  EXPECT_EQ(e->Prefill(1, prompt), 0);
  ASSERT_TRUE(e->mgr->FlushSequence(1).ok());
  EXPECT_EQ(e->Prefill(2, prompt), 8);  // the local prefix cache works as without the tier
  e->ExpectPrefixData(2, prompt, 2);
  e->mgr->FlushRemoteTier();
  RemoteTierStats s = e->mgr->remote_tier_stats();
  EXPECT_FALSE(s.connected);
  EXPECT_EQ(s.stored + s.hits, 0);
  EXPECT_EQ(s.dropped, 2);  // the prompt's two blocks: no server to store them on

  RedisServer server({}, port);
  PrefillUntilConnected(*e, 10);
  const std::vector<TokenId> next = Prompt(5000, 9);
  EXPECT_EQ(e->Prefill(3, next), 0);
  e->mgr->FlushRemoteTier();
  s = e->mgr->remote_tier_stats();
  EXPECT_GE(s.stored, 2);
  EXPECT_EQ(s.reconnects, 0);  // first connections, not reconnections
  auto other = Engine::Make({.url = server.url()});
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other->Prefill(1, next), 8);
  other->ExpectPrefixData(1, next, 2);
}

TEST(RemoteTierTest, AKilledServerIsMissesThenARestartedOneIsReconnected) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  auto a = Engine::Make({.url = server.url(), .timeout_ms = 500});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  EXPECT_EQ(a->mgr->remote_tier_stats().stored, 4);

  server.Kill();
  auto b = Engine::Make({.url = server.url(), .timeout_ms = 500}, nullptr);
  ASSERT_NE(b, nullptr);  // created while the server is down: its tier is off
  EXPECT_FALSE(b->mgr->remote_tier_stats().connected);
  // a's connection is gone: its lookup misses and recomputes, its stores are dropped.
  EXPECT_EQ(a->Prefill(2, Prompt(300, 9)), 0);
  a->ExpectPrefixData(2, Prompt(300, 9), 2);
  a->mgr->FlushRemoteTier();
  RemoteTierStats s = a->mgr->remote_tier_stats();
  EXPECT_GE(s.errors, 1);
  EXPECT_EQ(s.misses_error, 1);  // the lookup of Prompt(300, 9)
  EXPECT_EQ(s.stored, 4);
  EXPECT_EQ(s.dropped, 2);
  EXPECT_FALSE(s.connected);

  // Restarted (empty: persistence is off). a reconnects once its backoff has passed.
  server.Start();
  for (int i = 0; i < 100 && !a->mgr->remote_tier_stats().connected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(a->Prefill(10 + i, Prompt(1000 + 10 * i, 5)), 0);
    ASSERT_TRUE(a->mgr->FlushSequence(10 + i).ok());
  }
  a->mgr->FlushRemoteTier();
  s = a->mgr->remote_tier_stats();
  EXPECT_EQ(s.reconnects, 2);  // the fetches' connection and the stores'
  EXPECT_TRUE(s.connected);
  const std::vector<TokenId> next = Prompt(5000, 9);
  const int64_t stored = s.stored;
  EXPECT_EQ(a->Prefill(3, next), 0);
  a->mgr->FlushRemoteTier();
  EXPECT_EQ(a->mgr->remote_tier_stats().stored, stored + 2);
  auto c = Engine::Make({.url = server.url()});
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Prefill(1, next), 8);
  c->ExpectPrefixData(1, next, 2);
  EXPECT_EQ(c->Prefill(2, prompt), 0);  // what the killed server held is gone: a miss
}

TEST(RemoteTierTest, AWrongPasswordIsAClearErrorWhenTheTierOpens) {
  RedisServer server({"--requirepass", "secret"});
  Status status;
  EXPECT_EQ(Engine::Make({.url = server.url(":wrong")}, &status), nullptr);
  EXPECT_EQ(status.code(), StatusCode::kPermissionDenied) << status;
  EXPECT_NE(status.message().find("StateManagerConfig.remote_tier"), std::string::npos) << status;
  EXPECT_NE(status.message().find("AUTH"), std::string::npos) << status;
  EXPECT_EQ(status.message().find("wrong"), std::string::npos) << "the password leaked: " << status;
  // The right one, as user:password and as :password.
  auto right = Engine::Make({.url = server.url("default:secret")}, &status);
  ASSERT_NE(right, nullptr) << status;
  const std::vector<TokenId> prompt = Prompt(7, 9);
  EXPECT_EQ(right->Prefill(1, prompt), 0);
  right->mgr->FlushRemoteTier();
  EXPECT_EQ(right->mgr->remote_tier_stats().stored, 2);
  auto other = Engine::Make({.url = server.url(":secret")});
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other->Prefill(1, prompt), 8);
}

// URLs as deployments write them: a password with URL delimiters in it, percent-encoded, and a
// server on an IPv6 address.
TEST(RemoteTierTest, AnEncodedPasswordAndAnIPv6HostReachTheirServer) {
  RedisServer server({"--requirepass", "p@ss:w/ord%", "--bind", "127.0.0.1", "::1"});
  const std::string port = std::to_string(server.port());
  Status status;
  auto ipv6 = Engine::Make({.url = "redis://:p%40ss%3Aw%2Ford%25@[::1]:" + port}, &status);
  ASSERT_NE(ipv6, nullptr) << status;
  EXPECT_TRUE(ipv6->mgr->remote_tier_stats().connected);
  const std::vector<TokenId> prompt = Prompt(11, 9);
  EXPECT_EQ(ipv6->Prefill(1, prompt), 0);
  ipv6->mgr->FlushRemoteTier();
  EXPECT_EQ(ipv6->mgr->remote_tier_stats().stored, 2);
  auto ipv4 = Engine::Make({.url = server.url("default:p%40ss%3Aw%2Ford%25")}, &status);
  ASSERT_NE(ipv4, nullptr) << status;
  EXPECT_EQ(ipv4->Prefill(1, prompt), 8);
  // Not decoded, the same password is refused (it is not what the server has).
  EXPECT_EQ(Engine::Make({.url = server.url(":p%2540ss")}, &status), nullptr);
  EXPECT_EQ(status.code(), StatusCode::kPermissionDenied) << status;
}

// A server on the same machine through its unix socket (no TCP on the way): what one engine
// stores there, an engine on the server's TCP port reads, and the other way round.
TEST(RemoteTierTest, AServersUnixSocketIsATierLikeItsPort) {
  const std::string path = "/tmp/blockkv-test-" + std::to_string(getpid()) + ".sock";
  {
    RedisServer server({"--unixsocket", path, "--unixsocketperm", "700", "--requirepass", "pw"});
    Status status;
    auto local = Engine::Make({.url = "unix://:pw@" + path + "?db=1"}, &status);
    ASSERT_NE(local, nullptr) << status;
    EXPECT_TRUE(local->mgr->remote_tier_stats().connected);
    const std::vector<TokenId> first = Prompt(21, 9);
    EXPECT_EQ(local->Prefill(1, first), 0);
    local->mgr->FlushRemoteTier();
    EXPECT_EQ(local->mgr->remote_tier_stats().stored, 2);
    auto tcp = Engine::Make({.url = server.url(":pw") + "/1"}, &status);
    ASSERT_NE(tcp, nullptr) << status;
    EXPECT_EQ(tcp->Prefill(1, first), 8);
    const std::vector<TokenId> second = Prompt(22, 9);
    EXPECT_EQ(tcp->Prefill(2, second), 0);
    tcp->mgr->FlushRemoteTier();
    EXPECT_EQ(local->Prefill(2, second), 8);
    // Another database of the same socket holds none of them.
    auto db0 = Engine::Make({.url = "unix://:pw@" + path}, &status);
    ASSERT_NE(db0, nullptr) << status;
    EXPECT_EQ(db0->Prefill(1, first), 0);
  }
  // No socket there: the tier is off (one warning), the engine runs.
  Status status;
  auto none = Engine::Make({.url = "unix://" + path}, &status);
  ASSERT_NE(none, nullptr) << status;
  EXPECT_FALSE(none->mgr->remote_tier_stats().connected);
  EXPECT_EQ(none->Prefill(1, Prompt(21, 9)), 0);
  std::filesystem::remove(path);
}

// rediss://: the tier over TLS to a server's tls-port, its certificate checked against the CA the
// URL names; what it stores is read over the server's plain port, and the other way round. A
// certificate that does not verify (another CA's, not in the system's CAs, for another name),
// TLS to a plain port, or no client certificate where the server wants one fail Create, naming
// the cause; a bad file named in the URL too.
TEST(RemoteTierTest, ATlsServerIsATierWithItsCertificateChecked) {
  const testing::TlsFiles files;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const int tls_port = testing::FreePort();
  std::vector<std::string> args = files.ServerArgs(tls_port);
  args.insert(args.end(), {"--requirepass", "pw"});
  RedisServer server(args);
  const std::string port = std::to_string(tls_port);
  const std::string tls = "rediss://:pw@127.0.0.1:" + port;
  const std::string ca = "?ssl_ca_certs=" + files.path("ca.pem");
  const std::vector<TokenId> first = Prompt(31, 9);
  auto secure = Stored({.url = tls + ca}, first);
  ASSERT_NE(secure, nullptr);
  EXPECT_TRUE(secure->mgr->remote_tier_stats().connected);
  Status status;
  auto plain = Engine::Make({.url = server.url(":pw")}, &status);
  ASSERT_NE(plain, nullptr) << status;
  EXPECT_EQ(plain->Prefill(1, first), 8);
  plain->ExpectPrefixData(1, first, 2);
  const std::vector<TokenId> second = Prompt(32, 9);
  EXPECT_EQ(plain->Prefill(2, second), 0);
  plain->mgr->FlushRemoteTier();
  EXPECT_EQ(secure->Prefill(2, second), 8);
  secure->ExpectPrefixData(2, second, 2);
  EXPECT_EQ(secure->mgr->remote_tier_stats().errors, 0);
  // The certificate is for 127.0.0.1 and localhost; not checked at all with
  // ssl_cert_reqs=none; checked for the chain only with ssl_check_hostname=false.
  for (const std::string& url :
       {"rediss://:pw@localhost:" + port + ca, tls + "?ssl_cert_reqs=none",
        tls + ca + "&ssl_server_name=redis.example&ssl_check_hostname=false"}) {
    auto other = Engine::Make({.url = url}, &status);
    ASSERT_NE(other, nullptr) << url << ": " << status;
    EXPECT_EQ(other->Prefill(1, first), 8) << url;
  }
  const auto refused = [&](const std::string& url, StatusCode code, std::string_view why) {
    Status s;
    EXPECT_EQ(Engine::Make({.url = url}, &s), nullptr) << url;
    EXPECT_EQ(s.code(), code) << url << ": " << s;
    EXPECT_NE(s.message().find(why), std::string::npos) << url << ": " << s;
  };
  refused(tls + "?ssl_ca_certs=" + files.path("other_ca.pem"), StatusCode::kPermissionDenied,
          "certificate does not verify");
  refused(tls, StatusCode::kPermissionDenied, "does not verify");  // the system's CAs
  refused(tls + ca + "&ssl_server_name=redis.example", StatusCode::kPermissionDenied,
          "does not verify: hostname mismatch");
  refused(tls + "?ssl_ca_certs=/nonexistent/ca.pem", StatusCode::kInvalidArgument,
          "ssl_ca_certs \"/nonexistent/ca.pem\" does not load");
  refused(tls + ca + "&ssl_certfile=" + files.path("client.pem"), StatusCode::kInvalidArgument,
          "ssl_certfile and ssl_keyfile go together");
  refused(tls + ca + "&ssl_certfile=" + files.path("client.pem") +
              "&ssl_keyfile=" + files.path("server.key"),
          StatusCode::kInvalidArgument, "ssl_keyfile");
  // A plain client at the TLS port, or TLS at the plain port (which waits for a command's end
  // and answers nothing): the tier is off, the engine runs.
  for (const std::string& url : {"redis://:pw@127.0.0.1:" + port,
                                 "rediss://:pw@127.0.0.1:" + std::to_string(server.port()) + ca}) {
    auto lost = Engine::Make({.url = url, .timeout_ms = 300}, &status);
    ASSERT_NE(lost, nullptr) << url << ": " << status;
    EXPECT_FALSE(lost->mgr->remote_tier_stats().connected) << url;
    EXPECT_EQ(lost->Prefill(1, first), 0) << url;
  }

  // A server that wants a client certificate signed by its CA (tls-auth-clients yes).
  const int mutual_port = testing::FreePort();
  RedisServer mutual(files.ServerArgs(mutual_port, /*client_certs=*/true));
  const std::string mutual_url = "rediss://127.0.0.1:" + std::to_string(mutual_port) + ca;
  refused(mutual_url, StatusCode::kPermissionDenied, "ssl_certfile and ssl_keyfile?");
  auto shown = Stored({.url = mutual_url + "&ssl_certfile=" + files.path("client.pem") +
                              "&ssl_keyfile=" + files.path("client.key")},
                      first);
  ASSERT_NE(shown, nullptr);
  EXPECT_EQ(shown->Prefill(2, first), 8);
}

// A TLS server killed while the store worker writes to it: the writes fail (EPIPE), the stores
// are dropped, and the engine's process lives on. OpenSSL writes a socket with write(), which
// raises SIGPIPE on a connection the peer closed: the tier's connections write with
// send(MSG_NOSIGNAL) instead, as its plain ones always did.
TEST(RemoteTierTest, ATlsServerKilledMidStoreIsDroppedStoresNotASignal) {
  const testing::TlsFiles files;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const int tls_port = testing::FreePort();
  RedisServer server(files.ServerArgs(tls_port));
  auto tier = internal::RemoteTier::Open({.url = "rediss://127.0.0.1:" + std::to_string(tls_port) +
                                                 "?ssl_ca_certs=" + files.path("ca.pem"),
                                          .timeout_ms = 2000,
                                          .max_pending = 1 << 20});
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (int round = 0; round < 2; ++round) {  // the second: the connection found dead, or not
    std::vector<internal::RemoteTier::PendingStore> stores;
    for (int i = 0; i < 64; ++i) {
      stores.push_back((*tier)->NewStore("big:" + std::to_string(i), size_t{2} << 20));
      std::fill_n(stores.back().value.data.get(), size_t{2} << 20, static_cast<char>(i));
    }
    (*tier)->Store(stores);
    if (round == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the worker is writing
      server.Kill();
    }
    (*tier)->Drain();
  }
  const RemoteTierStats stats = (*tier)->stats();
  EXPECT_EQ(stats.stored + stats.dropped, 128) << stats.stored;
  EXPECT_GE(stats.dropped, 64);
  EXPECT_GE(stats.errors, 1);
}

// rediss+sentinel://: the sentinels asked over TLS, and the master they name (its TLS port: a
// sentinel with tls-replication yes watches it there) served over TLS.
TEST(RemoteTierTest, ASentinelAndItsMasterAreReachedOverTls) {
  const testing::TlsFiles files;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const int master_tls = testing::FreePort();
  RedisServer master(files.ServerArgs(master_tls));
  const int sentinel_tls = testing::FreePort();
  std::vector<std::string> extra = files.ServerArgs(sentinel_tls);
  extra.insert(extra.end(), {"--tls-replication", "yes"});
  RedisServer sentinel(
      RedisServer::SentinelOf{.name = "kv", .master_port = master_tls, .extra = extra});
  const std::vector<TokenId> prompt = Prompt(41, 9);
  auto secure = Stored({.url = "rediss+sentinel://127.0.0.1:" + std::to_string(sentinel_tls) +
                               "/kv?ssl_ca_certs=" + files.path("ca.pem")},
                       prompt);
  ASSERT_NE(secure, nullptr);
  const RemoteTierStats stats = secure->mgr->remote_tier_stats();
  EXPECT_TRUE(stats.connected);
  EXPECT_GE(stats.topology_refreshes, 1);  // the sentinel asked
  Status status;
  auto plain = Engine::Make({.url = master.url()}, &status);  // the master's plain port
  ASSERT_NE(plain, nullptr) << status;
  EXPECT_EQ(plain->Prefill(1, prompt), 8);
  plain->ExpectPrefixData(1, prompt, 2);
}

// Waits up to `seconds` for `done`; whether it came.
template <typename F>
bool WaitUntil(F done, int seconds) {
  for (int i = 0; i < seconds * 20; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return done();
}

// The port of the master `sentinel` names as `name` ("" when it names none).
std::string SentinelsMaster(const RedisServer& sentinel, const std::string& name) {
  const auto r = sentinel.Command({"SENTINEL", "get-master-addr-by-name", name});
  if (r == nullptr || r->type != REDIS_REPLY_ARRAY || r->elements != 2) return "";
  return std::string(r->element[1]->str, r->element[1]->len);
}

// A master and two replicas watched by a sentinel (the high availability of a standalone Redis):
// the tier serves from the master the sentinel names and follows it through a failover after
// the master dies, then through a planned one (SENTINEL FAILOVER) that demotes a live master.
TEST(RemoteTierTest, ASentinelsMasterIsServedThenFollowedThroughItsFailovers) {
  RedisServer master;
  std::vector<std::unique_ptr<RedisServer>> replicas;
  for (int i = 0; i < 2; ++i) {
    replicas.push_back(std::make_unique<RedisServer>(
        std::vector<std::string>{"--replicaof", "127.0.0.1", std::to_string(master.port())}));
  }
  const auto role = [](const RedisServer& s) { return s.Text({"INFO", "replication"}); };
  ASSERT_TRUE(WaitUntil(
      [&] {
        return std::all_of(replicas.begin(), replicas.end(), [&](const auto& r) {
          return role(*r).find("master_link_status:up") != std::string::npos;
        });
      },
      10));
  RedisServer sentinel(RedisServer::SentinelOf{.name = "kv", .master_port = master.port()});
  ASSERT_TRUE(WaitUntil(
      [&] {
        const auto r = sentinel.Command({"SENTINEL", "replicas", "kv"});
        return r != nullptr && r->type == REDIS_REPLY_ARRAY && r->elements == 2;
      },
      15))
      << "the sentinel did not learn of the replicas";
  const std::string url = "redis+sentinel://127.0.0.1:" + std::to_string(sentinel.port()) + "/kv";
  Status status;
  auto a = Engine::Make({.url = url}, &status);
  ASSERT_NE(a, nullptr) << status;
  EXPECT_TRUE(a->mgr->remote_tier_stats().connected);
  const std::vector<TokenId> first = Prompt(31, 9);
  EXPECT_EQ(a->Prefill(1, first), 0);
  a->mgr->FlushRemoteTier();
  EXPECT_EQ(a->mgr->remote_tier_stats().stored, 2);
  EXPECT_EQ(master.Text({"DBSIZE"}), "2");  // on the master the sentinel named
  EXPECT_EQ(Engine::Make({.url = url})->Prefill(1, first), 8);
  ASSERT_EQ(master.Text({"WAIT", "2", "5000"}), "2");  // on the replicas too

  // Engine a stores prompts until one is stored whole (those before are dropped, counted: its
  // connection to the old master failed, and it asks the sentinel again after its backoff);
  // then a fresh engine reads it, and the first prompt, from the master the sentinel names.
  int next = 100;
  const auto follow = [&](const std::string& port) {
    std::vector<TokenId> landed;
    for (int i = 0; i < 100 && landed.empty(); ++i) {
      const int64_t before = a->mgr->remote_tier_stats().stored;
      const std::vector<TokenId> prompt = Prompt(next++, 9);
      a->Prefill(2, prompt);
      a->mgr->FlushRemoteTier();
      EXPECT_TRUE(a->mgr->FlushSequence(2).ok());
      if (a->mgr->remote_tier_stats().stored == before + 2) landed = prompt;
      if (landed.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_FALSE(landed.empty()) << "no store reached the master on port " << port;
    auto reader = Engine::Make({.url = url});
    ASSERT_NE(reader, nullptr);
    EXPECT_EQ(reader->Prefill(1, landed), 8);
    EXPECT_EQ(reader->Prefill(2, first), 8);  // stored before the failovers, replicated
  };
  master.Kill();
  ASSERT_TRUE(WaitUntil(
      [&] {
        const std::string now = SentinelsMaster(sentinel, "kv");
        return !now.empty() && now != std::to_string(master.port());
      },
      30))
      << "the sentinel did not fail over";
  const std::string promoted = SentinelsMaster(sentinel, "kv");
  follow(promoted);
  EXPECT_GE(a->mgr->remote_tier_stats().topology_refreshes, 3);  // the sentinel asked again

  // Planned: the live master is demoted to a replica of the other; until the sentinel has made
  // it one, it takes writes that its resync then drops (Redis's own window in a failover), so
  // the stores are checked from then on.
  ASSERT_TRUE(WaitUntil([&] { return sentinel.Text({"SENTINEL", "FAILOVER", "kv"}) == "OK"; }, 15));
  ASSERT_TRUE(WaitUntil(
      [&] {
        const std::string now = SentinelsMaster(sentinel, "kv");
        if (now.empty() || now == promoted) return false;
        for (const auto& r : replicas) {
          if (std::to_string(r->port()) == promoted &&
              role(*r).find("role:slave") == std::string::npos) {
            return false;
          }
        }
        return true;
      },
      30))
      << "the planned failover did not happen";
  follow(SentinelsMaster(sentinel, "kv"));

  // A master name the sentinel does not know is a clear error at Create.
  EXPECT_EQ(Engine::Make({.url = "redis+sentinel://127.0.0.1:" + std::to_string(sentinel.port()) +
                                 "/nosuch"},
                         &status),
            nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("knows no master named \"nosuch\""), std::string::npos) << status;
}

// A server set up in a way that refuses the tier's commands (full under noeviction, an ACL user
// without SET or GET) makes every store or fetch fail; each is counted, and each engine warns
// once per command and kind of refusal, saying what to change.
TEST(RemoteTierTest, AServerRefusingCommandsIsCountedAndNamedOnceWithTheFix) {
  RedisServer server({"--maxmemory", "1", "--maxmemory-policy", "noeviction"});
  ASSERT_EQ(
      server.Text({"ACL", "SETUSER", "reader", "on", ">pw", "~*", "+@connection", "+get", "+mget"}),
      "OK");
  ASSERT_EQ(server.Text({"ACL", "SETUSER", "writer", "on", ">pw", "~*", "+@connection", "+set"}),
            "OK");
  std::vector<std::string> lines;
  std::mutex mu;
  SetLogSink([&](LogLevel level, std::string_view line) {
    std::lock_guard lock(mu);
    if (level == LogLevel::kWarning) lines.emplace_back(line);
  });
  auto full = Engine::Make({.url = server.url()});
  ASSERT_NE(full, nullptr);
  for (int p = 0; p < 3; ++p) {
    EXPECT_EQ(full->Prefill(p + 1, Prompt(40 + p, 9)), 0);
    full->mgr->FlushRemoteTier();
  }
  RemoteTierStats s = full->mgr->remote_tier_stats();
  EXPECT_EQ(s.stored, 0);
  EXPECT_EQ(s.dropped, 6);
  EXPECT_EQ(s.errors, 6);
  const auto logged = [&] {
    std::lock_guard lock(mu);
    return lines.size();
  };
  EXPECT_EQ(logged(), 1u);  // one for the six
  // The reader may not SET (NOPERM); the writer may not GET: its lookups are error misses.
  auto reader = Engine::Make({.url = server.url("reader:pw")});
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(reader->Prefill(1, Prompt(50, 9)), 0);
  reader->mgr->FlushRemoteTier();
  EXPECT_EQ(reader->mgr->remote_tier_stats().dropped, 2);
  EXPECT_EQ(logged(), 2u);
  auto writer = Engine::Make({.url = server.url("writer:pw")});
  ASSERT_NE(writer, nullptr);
  EXPECT_EQ(writer->Prefill(1, Prompt(51, 9)), 0);
  EXPECT_EQ(writer->Prefill(2, Prompt(52, 9)), 0);
  writer->mgr->FlushRemoteTier();
  s = writer->mgr->remote_tier_stats();
  EXPECT_EQ(s.misses_error, 2);
  SetLogSink(nullptr);
  // Each line names the server, the command, the reply and what to change.
  std::string all;
  for (const std::string& line : lines) all += line + "\n";
  ASSERT_EQ(lines.size(), 4u) << all;
  EXPECT_NE(lines[0].find("refused SET: OOM"), std::string::npos) << all;
  EXPECT_NE(lines[0].find("allkeys-lru"), std::string::npos) << all;
  EXPECT_NE(lines[0].find(std::to_string(server.port())), std::string::npos) << all;
  EXPECT_NE(lines[1].find("refused SET: NOPERM"), std::string::npos) << all;
  EXPECT_NE(lines[1].find("+get +mget +set"), std::string::npos) << all;
  EXPECT_NE(lines[2].find("refused MGET: NOPERM"), std::string::npos) << all;
  EXPECT_NE(lines[3].find("refused SET: OOM"), std::string::npos) << all;
}

TEST(RemoteTierTest, ACorruptedValueIsACountedMissAndNothingWrongIsCached) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  auto a = Engine::Make({.url = server.url()});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  // Flip one byte of block 2's KV bytes (the block index is at offset 48 of the value).
  redisContext* c = server.Connect();
  bool flipped = false;
  for (const std::string& key : Keys(c)) {
    auto* r = static_cast<redisReply*>(redisCommand(c, "GET %b", key.data(), key.size()));
    ASSERT_NE(r, nullptr);
    std::string value(r->str, r->len);
    freeReplyObject(r);
    uint32_t index = 0;
    std::memcpy(&index, value.data() + 48, sizeof(index));
    if (index != 2) continue;
    value[value.size() - 9] = static_cast<char>(value[value.size() - 9] ^ 0x40);
    freeReplyObject(
        redisCommand(c, "SET %b %b", key.data(), key.size(), value.data(), value.size()));
    flipped = true;
  }
  redisFree(c);
  ASSERT_TRUE(flipped);
  auto b = Engine::Make({.url = server.url()});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Prefill(1, prompt), 8);  // blocks 0 and 1; block 2 does not verify
  b->ExpectPrefixData(1, prompt, 4);    // 2 and 3 were recomputed
  const RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 2);
  EXPECT_EQ(s.invalid, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.misses_verify_failed, 1);
  EXPECT_EQ(s.misses_not_found + s.misses_error + s.misses_late, 0);
}

// The fetch worker hashes each value as its bytes arrive, in pieces (values larger than one
// recv, and values whose last 8 bytes straddle a piece): every sealed value is reported whole and
// right, a value with a flipped byte (or shorter than a checksum) is not, and the scheduling
// thread's full check agrees. The buffers of a fetch dropped are reused by the next.
TEST(RemoteTierTest, TheFetchWorkerChecksValuesAsTheyArriveAndReusesTheirBuffers) {
  RedisServer server;
  auto tier = internal::RemoteTier::Open({.url = server.url()});
  ASSERT_TRUE(tier.ok()) << tier.status();
  const std::vector<size_t> sizes = {0, 1, 4096, (size_t{256} << 10) + 3, (size_t{1} << 20) + 5};
  std::vector<std::string> keys;
  std::vector<std::string> values;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::string v(sizes[i], '\0');
    for (size_t j = 0; j < v.size(); ++j) v[j] = static_cast<char>((i * 131 + j * 7) & 0xff);
    internal::SealRemoteValue(v);
    keys.push_back("sealed:" + std::to_string(i));
    values.push_back(v);
  }
  values.push_back(values.back());
  values.back()[values.back().size() / 2] ^= 1;  // corrupted after sealing
  keys.emplace_back("corrupted");
  values.emplace_back("short");  // no checksum at all
  keys.emplace_back("short");
  redisContext* c = server.Connect();
  for (size_t i = 0; i < keys.size(); ++i) {
    freeReplyObject(redisCommand(c, "SET %b %b", keys[i].data(), keys[i].size(), values[i].data(),
                                 values[i].size()));
  }
  redisFree(c);
  const void* first_buffer = nullptr;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    internal::RemoteTier::Fetched got = (*tier)->Fetch(keys);
    ASSERT_EQ(got.values.size(), keys.size());
    ASSERT_EQ(got.checksum_ok.size(), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(got.values[i], values[i]) << keys[i];
      const bool sealed = i < sizes.size();
      EXPECT_EQ(got.checksum_ok[i] != 0, sealed) << keys[i];
      EXPECT_EQ(internal::RemoteValueChecksumOk(got.values[i]), sealed) << keys[i];
    }
    const char* largest = got.values[sizes.size() - 1].data();
    if (round == 0) {
      first_buffer = largest;
    } else {
      EXPECT_EQ(largest, first_buffer);  // the same buffer, not a new one
    }
  }
}

// Something else listening where the tier's URL points (another service, a broken proxy): each
// reply to the fetch below (an MGET of the prompt's 4 full blocks) is a miss counted as an error,
// never a crash, a hang past the timeout or a value in the cache: a bulk string claiming a
// terabyte (allocating it would throw), a line that is not RESP, a connection closed mid-value.
// Stores written to a server that stalls with its socket full (values larger than loopback's
// buffers): the store worker waits at most timeout_ms for the socket to take a byte, then drops
// the batch and disconnects; once the server goes on, stores are made again and what a store
// wrote is exactly what a fetch reads (the value and its checksum).
TEST(RemoteTierTest, AStoreAStalledServerCannotTakeIsDroppedAfterTheTimeout) {
  RedisServer server;
  auto tier = internal::RemoteTier::Open({.url = server.url(), .timeout_ms = 300});
  ASSERT_TRUE(tier.ok()) << tier.status();
  const auto make = [&](const std::string& key, size_t size, char fill) {
    internal::RemoteTier::PendingStore store = (*tier)->NewStore(key, size);
    std::fill_n(store.value.data.get(), size, fill);
    return store;
  };
  server.Stop();
  {
    const Resume resume{server};
    std::vector<internal::RemoteTier::PendingStore> stores;
    for (int i = 0; i < 4; ++i) {
      stores.push_back(make("big:" + std::to_string(i), size_t{16} << 20, 'a'));
    }
    (*tier)->Store(stores);
    EXPECT_TRUE(stores.empty());
    (*tier)->Drain();  // returns: the write gave up after timeout_ms
    const RemoteTierStats s = (*tier)->stats();
    EXPECT_EQ(s.stored, 0);
    EXPECT_EQ(s.dropped, 4);
    EXPECT_GE(s.errors, 1);
  }
  // Going on: the store worker reconnects after its backoff.
  std::string wrote;
  for (int i = 0; i < 100 && (*tier)->stats().stored == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::vector<internal::RemoteTier::PendingStore> stores;
    stores.push_back(make("small", 1000 + static_cast<size_t>(i), static_cast<char>('b' + i)));
    wrote.assign(1000 + static_cast<size_t>(i), static_cast<char>('b' + i));
    (*tier)->Store(stores);
    (*tier)->Drain();
  }
  ASSERT_EQ((*tier)->stats().stored, 1);
  internal::SealRemoteValue(wrote);
  const internal::RemoteTier::Fetched got = (*tier)->Fetch({"small"});
  ASSERT_EQ(got.values.size(), 1u);
  EXPECT_EQ(got.values[0], wrote);
}

// Closing the tier with a stalled server and 100 batches queued: the first batch times out and
// the rest are dropped, where each batch used to wait its own timeout (10 s here, and an engine
// with thousands of stores queued hung at exit for minutes).
TEST(RemoteTierTest, ClosingWithAStalledServerDropsTheQueueAfterOneFailedBatch) {
  RedisServer server;
  auto tier =
      internal::RemoteTier::Open({.url = server.url(), .timeout_ms = 100, .max_pending = 64 * 100});
  ASSERT_TRUE(tier.ok()) << tier.status();
  std::vector<internal::RemoteTier::PendingStore> stores;
  const auto queue = [&](int n) {
    for (int i = 0; i < n; ++i) {
      stores.push_back((*tier)->NewStore("q:" + std::to_string(i), 100));
      std::fill_n(stores.back().value.data.get(), 100, 'q');
    }
    (*tier)->Store(stores);
  };
  queue(1);
  (*tier)->Drain();
  ASSERT_EQ((*tier)->stats().stored, 1);  // connected
  server.Stop();
  const Resume resume{server};
  queue(64 * 100);
  const auto start = std::chrono::steady_clock::now();
  tier->reset();
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(3));
}

// Values of odd sizes from one byte to past 2 MiB, many of them together, written by the store
// worker (sendmsg of many iovecs, partial writes, each value sealed by the worker) to one server
// and to the three nodes of a cluster: each must arrive byte for byte with the checksum of its
// bytes. The other tests store values of a few hundred bytes.
TEST(RemoteTierTest, ValuesOfEverySizeArriveSealedWhole) {
  RedisServer server;
  RedisCluster cluster;
  // And over TLS, to a server and a cluster (records of 16 KiB, writes gathered 256 KiB at a
  // time, partial TLS writes, the slot map over TLS).
  const testing::TlsFiles files;
  const int tls_port = testing::FreePort();
  RedisServer tls_server(files.ServerArgs(tls_port));
  const std::string tls_url =
      "rediss://127.0.0.1:" + std::to_string(tls_port) + "?ssl_ca_certs=" + files.path("ca.pem");
  RedisCluster tls_cluster(3, 0, &files);
  for (const std::string& url : {server.url(), cluster.url(), tls_url, tls_cluster.tls_url()}) {
    SCOPED_TRACE(url);
    auto tier = internal::RemoteTier::Open({.url = url, .timeout_ms = 5000});
    ASSERT_TRUE(tier.ok()) << tier.status();
    std::mt19937 rng(7);
    const size_t kib = 1024;
    std::vector<size_t> sizes = {
        1, 100, 128 * kib - 1, 128 * kib, 128 * kib + 1, 384 * kib + 5, 2049 * kib + 3};
    for (int i = 0; i < 24; ++i) sizes.push_back(64 * kib);  // a prompt of 64 KiB blocks
    for (int i = 0; i < 16; ++i) sizes.push_back(1 + rng() % 50000);
    std::vector<internal::RemoteTier::PendingStore> stores;
    std::vector<std::string> keys;
    std::vector<std::string> want;
    for (size_t i = 0; i < sizes.size(); ++i) {
      keys.push_back("sized:" + std::to_string(i));
      internal::RemoteTier::PendingStore store = (*tier)->NewStore(keys.back(), sizes[i]);
      std::string bytes(sizes[i], '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      std::copy(bytes.begin(), bytes.end(), store.value.data.get());
      internal::SealRemoteValue(bytes);
      want.push_back(std::move(bytes));
      stores.push_back(std::move(store));
    }
    (*tier)->Store(stores);
    (*tier)->Drain();
    EXPECT_EQ((*tier)->stats().stored, std::ssize(sizes));
    const internal::RemoteTier::Fetched got = (*tier)->Fetch(keys);
    ASSERT_EQ(got.values.size(), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_TRUE(got.values[i] == want[i]) << keys[i] << ", " << sizes[i] << " bytes";
      EXPECT_EQ(got.checksum_ok[i], 1) << keys[i];
    }
  }
}

// A socket listening on 127.0.0.1 at a free port (*port), for a test's own fake server; -1 when
// it cannot be had.
int Listen(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || listen(fd, 8) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

TEST(RemoteTierTest, AServerAnsweringNonsenseIsAMissNeverACrash) {
  for (const std::string& reply :
       {std::string("*4\r\n$1099511627776\r\n"), std::string("HTTP/1.1 400 Bad Request\r\n\r\n"),
        std::string("*4\r\n$100\r\nabc")}) {
    SCOPED_TRACE(reply);
    int port = 0;
    const int listener = Listen(&port);
    ASSERT_GE(listener, 0);
    // Answers every connection's first bytes with `reply`, then closes it.
    std::thread server([&] {
      for (int c = accept(listener, nullptr, nullptr); c >= 0;
           c = accept(listener, nullptr, nullptr)) {
        char buf[4096];
        if (recv(c, buf, sizeof(buf), 0) > 0) {
          EXPECT_EQ(send(c, reply.data(), reply.size(), MSG_NOSIGNAL),
                    static_cast<ssize_t>(reply.size()));
        }
        close(c);
      }
    });
    {
      auto engine =
          Engine::Make({.url = "redis://127.0.0.1:" + std::to_string(port), .timeout_ms = 2000});
      ASSERT_NE(engine, nullptr);
      const std::vector<TokenId> prompt = Prompt(300, 17);
      EXPECT_EQ(engine->Prefill(1, prompt), 0);  // nothing from the tier: computed
      const RemoteTierStats s = engine->mgr->remote_tier_stats();
      EXPECT_EQ(s.hits, 0);
      EXPECT_EQ(s.misses_error, 1);
      EXPECT_TRUE(engine->mgr->CheckInvariants().ok());
    }
    shutdown(listener, SHUT_RDWR);
    close(listener);
    server.join();
  }
}

// A cluster node whose slot map names far more nodes than any cluster has (16,384 one-slot
// ranges, each with a master and 16 replicas at addresses of their own: 278,528 nodes). Node
// indices are 16-bit in the slot map: before the lane capped its nodes, the 32,768th wrapped
// negative and indexed out of bounds. Now the map keeps the first kMaxNodes, the other ranges'
// keys miss, and the engine runs.
TEST(RemoteTierTest, ASlotMapNamingTooManyNodesIsCappedNeverACrash) {
  const int refused = testing::FreePort();  // nothing listens there
  ASSERT_GT(refused, 0);
  std::string map;
  // RESP pieces appended one by one (g++ 12 warns falsely on "literal" + std::string chains).
  const auto line = [&](char type, const std::string& text) {
    map.push_back(type);
    map += text;
    map += "\r\n";
  };
  const auto entry = [&](int a, int b, int c) {  // [host, port]
    std::string host = "127.";
    host += std::to_string(a);
    host.push_back('.');
    host += std::to_string(b);
    host.push_back('.');
    host += std::to_string(c);
    line('*', "2");
    line('$', std::to_string(host.size()));
    map += host;
    map += "\r\n";
    line(':', std::to_string(refused));
  };
  constexpr int kReplicas = 16;
  line('*', "16384");
  for (int slot = 0; slot < 16384; ++slot) {
    line('*', std::to_string(3 + kReplicas));
    line(':', std::to_string(slot));
    line(':', std::to_string(slot));
    entry(1, slot / 256, slot % 256);
    for (int r = 0; r < kReplicas; ++r) entry(2 + r, slot / 256, slot % 256);
  }
  int port = 0;
  const int listener = Listen(&port);
  ASSERT_GE(listener, 0);
  // Answers every command on every connection (the fetch and store workers' own) with the map.
  std::vector<std::thread> connections;
  std::thread server([&] {
    for (int c = accept(listener, nullptr, nullptr); c >= 0;
         c = accept(listener, nullptr, nullptr)) {
      connections.emplace_back([c, &map] {
        char buf[4096];
        while (recv(c, buf, sizeof(buf), 0) > 0) {
          if (send(c, map.data(), map.size(), MSG_NOSIGNAL) < 0) break;
        }
        close(c);
      });
    }
  });
  {
    auto engine = Engine::Make(
        {.url = "redis+cluster://127.0.0.1:" + std::to_string(port), .timeout_ms = 500});
    ASSERT_NE(engine, nullptr);
    const std::vector<TokenId> prompt = Prompt(300, 17);
    EXPECT_EQ(engine->Prefill(1, prompt), 0);  // nothing from the tier: computed
    engine->ExpectPrefixData(1, prompt, 4);
    const RemoteTierStats s = engine->mgr->remote_tier_stats();
    EXPECT_EQ(s.hits, 0);
    EXPECT_EQ(s.misses, 1);
    // Failed, or given up on (reading such a map takes a while under ThreadSanitizer).
    EXPECT_EQ(s.misses_error + s.misses_late, 1);
    EXPECT_GT(s.nodes, 0);
    EXPECT_LT(s.nodes, 4096);       // the masters among the first 4,096 nodes
    EXPECT_EQ(s.replica_reads, 0);  // none answers either
  }
  shutdown(listener, SHUT_RDWR);
  close(listener);
  server.join();
  for (std::thread& t : connections) t.join();
}

// A value whose checksum was recomputed after a change (a buggy writer, or anyone who can write
// to the server) is accepted exactly when no byte before its payload changed: every header field,
// the namespace, extra bytes and tokens are checked, and no length in them reads out of bounds.
// (A changed payload under a right checksum is accepted: the tier trusts its server's writers.)
TEST(RemoteTierTest, AResealedValueIsAcceptedOnlyWithItsHeaderIntact) {
  const std::vector<TokenId> tokens = {5, 6, 7, 8};
  const internal::RemoteBlockMeta want{.fingerprint = 0x1234,
                                       .key = {.lo = 1, .hi = 2},
                                       .parent_key = {.lo = 3, .hi = 4},
                                       .index = 1,
                                       .adapter_id = 9,
                                       .ns = "tenant",
                                       .extra = "xy",
                                       .tokens = tokens,
                                       .payload_bytes = 64};
  std::string value = internal::EncodeRemoteHeader(want);
  const size_t offset = value.size();
  for (size_t i = 0; i < want.payload_bytes; ++i) value.push_back(static_cast<char>(offset + i));
  internal::SealRemoteValue(value);
  ASSERT_EQ(internal::VerifyRemoteValue(value, want), static_cast<int64_t>(offset));
  std::mt19937 rng(7);
  for (int round = 0; round < 20000; ++round) {
    std::string v = value;
    const size_t body = v.size() - sizeof(uint64_t);
    size_t first_changed = body;
    for (int k = 0; k < 1 + round % 3; ++k) {
      const size_t at = rng() % body;
      const auto byte = static_cast<char>(rng());
      if (v[at] != byte) first_changed = std::min(first_changed, at);
      v[at] = byte;
    }
    if (round % 5 == 0) v.resize(rng() % (body + 1));  // cut short too
    if (v.size() >= sizeof(uint64_t)) {
      v.resize(v.size() - sizeof(uint64_t));
      internal::SealRemoteValue(v);
    }
    const int64_t got = internal::VerifyRemoteValue(v, want);
    const bool intact = v.size() == value.size() && first_changed >= offset;
    EXPECT_EQ(got, intact ? static_cast<int64_t>(offset) : -1) << "round " << round;
  }
}

TEST(RemoteTierTest, AnotherNamespaceOrModelNeverHits) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  auto a = Engine::Make({.url = server.url(), .model_id = "llama"});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt, "tenant-a"), 0);
  a->mgr->FlushRemoteTier();
  auto b = Engine::Make({.url = server.url(), .model_id = "llama"});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Prefill(1, prompt, "tenant-b"), 0);
  EXPECT_EQ(b->Prefill(2, prompt, ""), 0);
  auto other_model = Engine::Make({.url = server.url(), .model_id = "mistral"});
  ASSERT_NE(other_model, nullptr);
  EXPECT_EQ(other_model->Prefill(1, prompt, "tenant-a"), 0);
  EXPECT_EQ(other_model->mgr->remote_tier_stats().hits, 0);
  // Another rank's shard: nothing it could fetch verifies (its offer is 0 blocks).
  auto other_rank =
      Engine::Make({.url = server.url(), .model_id = "llama", .tp_rank = 1, .tp_size = 2});
  ASSERT_NE(other_rank, nullptr);
  ASSERT_TRUE(other_rank->mgr->AddSequence(1, prompt, {.keys = {.ns = "tenant-a"}}).ok());
  ASSERT_TRUE(other_rank->mgr->FetchRemotePrefix(1).ok());
  const SeqId one[] = {1};
  EXPECT_EQ(other_rank->mgr->RemotePrefixOffer(one).values.back(), 0);
  // The same tenant and model: a hit (so the misses above are the keys, not the setup).
  auto same = Engine::Make({.url = server.url(), .model_id = "llama"});
  ASSERT_NE(same, nullptr);
  EXPECT_EQ(same->Prefill(1, prompt, "tenant-a"), 16);
  same->ExpectPrefixData(1, prompt, 4);
}

TEST(RemoteTierTest, AFullQueueDropsStoresAndCountsThem) {
  RedisServer server;
  auto e = Engine::Make({.url = server.url(), .max_pending = 0});
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Prefill(1, Prompt(1, 17)), 0);
  e->mgr->FlushRemoteTier();
  const RemoteTierStats s = e->mgr->remote_tier_stats();
  EXPECT_EQ(s.dropped, 4);
  EXPECT_EQ(s.stored, 0);
  EXPECT_EQ(s.errors, 0);
}

TEST(RemoteTierTest, AStalledServerIsATimedOutMissAndNeverBlocksSchedule) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  const auto a = Stored({.url = server.url(), .timeout_ms = 200}, prompt);
  ASSERT_NE(a, nullptr);
  auto b = Engine::Make({.url = server.url(), .timeout_ms = 200});
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(b->mgr->remote_tier_stats().connected);

  server.Stop();  // connections stay open; nothing answers
  const Resume resume{server};
  // The fetch gives up (the socket's timeout or the lookup's wait): a miss, recomputed.
  EXPECT_EQ(b->Prefill(1, prompt), 0);
  b->ExpectPrefixData(1, prompt, 4);
  RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.misses_error + s.misses_late, 1);
  EXPECT_EQ(s.misses_not_found + s.misses_verify_failed, 0);
  EXPECT_GE(s.errors, 1);
  // Its 4 new blocks are queued for a server that does not answer; the next Schedule's lookup
  // still returns (a miss: it waits at most timeout_ms, whatever the worker is stuck on).
  const std::vector<TokenId> other = Prompt(2000, 9);
  EXPECT_EQ(b->Prefill(2, other), 0);
  b->ExpectPrefixData(2, other, 2);
  s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.misses, 2);
  EXPECT_EQ(s.misses_error + s.misses_late, 2);

  server.Continue();
  b->mgr->FlushRemoteTier();  // each stalled batch ended by the socket timeout
  // Served again: b's new blocks are stored once it has reconnected (after a backoff).
  bool served = false;
  std::vector<TokenId> next;
  for (int i = 0; i < 100 && !served; ++i) {
    next = Prompt(3000 + 100 * i, 9);
    const int64_t stored = b->mgr->remote_tier_stats().stored;
    EXPECT_EQ(b->Prefill(10, next), 0);
    ASSERT_TRUE(b->mgr->FlushSequence(10).ok());
    b->mgr->FlushRemoteTier();
    // Both workers back: each reconnects after its own backoff.
    served =
        b->mgr->remote_tier_stats().stored == stored + 2 && b->mgr->remote_tier_stats().connected;
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(served);
  auto c = Engine::Make({.url = server.url()});
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Prefill(1, prompt), 16);  // stored before the stall
  c->ExpectPrefixData(1, prompt, 4);
  EXPECT_EQ(c->Prefill(2, next), 8);
  c->ExpectPrefixData(2, next, 2);
}

// A stalled server accepts connections and answers nothing: after a command timed out it is left
// alone for its backoff (its keys miss at once) instead of costing every fetch the timeout.
TEST(RemoteTierTest, AStalledServerIsLeftAloneForItsBackoffNotAskedByEveryFetch) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  const auto a = Stored({.url = server.url()}, prompt);
  ASSERT_NE(a, nullptr);
  auto b = Engine::Make({.url = server.url(), .timeout_ms = 200});
  ASSERT_NE(b, nullptr);
  server.Stop();
  const Resume resume{server};
  // Ten fetches ahead, one after the other (no Schedule: nothing is stored meanwhile). Asking
  // the server each time would be ten timed-out commands (ten errors, 2 s).
  constexpr int kFetches = 10;
  for (SeqId uid = 1; uid <= kFetches; ++uid) {
    ASSERT_TRUE(b->mgr->AddSequence(uid, prompt).ok());
    Result<RemoteFetchTicket> ticket = b->mgr->FetchRemotePrefix(uid);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    EXPECT_EQ(ticket->blocks(), 4);
    ticket->Wait();
    ASSERT_TRUE(b->mgr->FlushSequence(uid).ok());
  }
  const RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_GE(s.errors, 1);
  EXPECT_LT(s.errors, kFetches);
  EXPECT_EQ(s.fetched_bytes, 0);
  EXPECT_FALSE(s.connected);

  // Resumed: answered again once its backoff (at most 2 s) has passed.
  server.Continue();
  bool hit = false;
  for (int i = 0; i < 100 && !hit; ++i) {
    b->mgr->ResetPrefixCache();
    const auto uid = static_cast<SeqId>(100 + i);
    hit = b->Prefill(uid, prompt) == 16;
    ASSERT_TRUE(b->mgr->FlushSequence(uid).ok());
    if (!hit) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(hit);
  EXPECT_TRUE(b->mgr->remote_tier_stats().connected);
}

TEST(RemoteTierTest, AFetchIsServedWhileStoresWait) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  const auto a = Stored({.url = server.url()}, prompt);
  ASSERT_NE(a, nullptr);
  auto b = Engine::Make({.url = server.url(), .timeout_ms = 1000});
  ASSERT_NE(b, nullptr);
  // Writes wait (CLIENT PAUSE ... WRITE), reads go on: b's stores hang, its fetches do not.
  ASSERT_EQ(server.Text({"CLIENT", "PAUSE", "2500", "WRITE"}), "OK");
  const std::vector<TokenId> fresh = Prompt(7000, 17);
  EXPECT_EQ(b->Prefill(1, fresh), 0);    // a read: not found; its 4 blocks queued, then hanging
  EXPECT_EQ(b->Prefill(2, prompt), 16);  // fetched while those SETs wait
  b->ExpectPrefixData(2, prompt, 4);
  RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 4);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.misses_not_found, 1);
  EXPECT_EQ(s.misses_error + s.misses_late, 0);
  ASSERT_EQ(server.Text({"CLIENT", "UNPAUSE"}), "OK");
  b->mgr->FlushRemoteTier();
  s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.stored + s.dropped, 4);  // sent once unpaused, or dropped at the socket's timeout
}

TEST(RemoteTierTest, AClusterSpreadsBlocksOverItsNodesAndAnotherEngineHitsThem) {
  RedisCluster cluster;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<TokenId> prompt = Prompt(100, 16 * kBlockSize + 1);  // 16 full blocks
  auto a = Engine::Make({.url = cluster.url(), .model_id = "m"});
  ASSERT_NE(a, nullptr);
  RemoteTierStats sa = a->mgr->remote_tier_stats();
  EXPECT_TRUE(sa.connected);
  EXPECT_EQ(sa.nodes, 3);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  sa = a->mgr->remote_tier_stats();
  EXPECT_EQ(sa.stored, 16);
  EXPECT_EQ(sa.dropped + sa.errors + sa.redirects, 0);
  // Every node holds some of the blocks, each key on the node that owns its slot, and the
  // tier's slot of a key is the cluster's.
  size_t total = 0;
  for (size_t i = 0; i < cluster.size(); ++i) {
    const std::vector<std::string> keys = Keys(cluster.node(i));
    EXPECT_GE(keys.size(), 1u) << "node " << i;
    total += keys.size();
    for (const std::string& key : keys) {
      EXPECT_EQ(internal::KeySlot(key), cluster.slot(key)) << key;
      EXPECT_EQ(cluster.owner(key), static_cast<int>(i)) << key;
    }
  }
  EXPECT_EQ(total, 16u);
  // Hash-tag edge cases as the cluster computes them: an empty tag or none hashes the whole key.
  for (const std::string key : {"a{}b", "x{y", "{}{z}", "{a}{b}", "blockkv:{0123}"}) {
    EXPECT_EQ(internal::KeySlot(key), cluster.slot(key)) << key;
  }

  auto b = Engine::Make({.url = cluster.url(), .model_id = "m"});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Prefill(7, prompt), 64);
  b->ExpectPrefixData(7, prompt, 16);
  const RemoteTierStats sb = b->mgr->remote_tier_stats();
  EXPECT_EQ(sb.hits, 16);
  EXPECT_EQ(sb.misses + sb.errors + sb.redirects, 0);
  EXPECT_EQ(sb.fetched_bytes, sa.stored_bytes);
}

// The same for a cluster: no seed answers at start; the slot map is read once they do.
TEST(RemoteTierTest, AClusterDownAtStartIsMappedAndConnectedOnceItAnswers) {
  RedisCluster cluster;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  for (size_t i = 0; i < cluster.size(); ++i) cluster.node(i).Kill();
  auto e = MakeUnconnected(cluster.url(), cluster.node(0).port());  // every seed named
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->Prefill(1, Prompt(1, 9)), 0);
  ASSERT_TRUE(e->mgr->FlushSequence(1).ok());
  EXPECT_EQ(e->mgr->remote_tier_stats().nodes, 0);  // no slot map yet

  // Restarted (their slots still theirs: nodes.conf is kept; their keys gone).
  for (size_t i = 0; i < cluster.size(); ++i) cluster.node(i).Start();
  cluster.WaitReady();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  PrefillUntilConnected(*e, 10);
  EXPECT_EQ(e->mgr->remote_tier_stats().nodes, 3);
  std::vector<std::vector<TokenId>> prompts;
  for (int p = 0; p < 6; ++p) {
    prompts.push_back(Prompt(9000 + 100 * p, 9));
    EXPECT_EQ(e->Prefill(100 + p, prompts.back()), 0);
  }
  e->mgr->FlushRemoteTier();
  const RemoteTierStats s = e->mgr->remote_tier_stats();
  EXPECT_GE(s.stored, 12);
  EXPECT_EQ(s.reconnects, 0);
  auto other = Engine::Make({.url = cluster.url()});
  ASSERT_NE(other, nullptr);
  for (int p = 0; p < 6; ++p) {
    EXPECT_EQ(other->Prefill(p + 1, prompts[static_cast<size_t>(p)]), 8) << "prompt " << p;
    other->ExpectPrefixData(p + 1, prompts[static_cast<size_t>(p)], 2);
  }
}

TEST(RemoteTierTest, AKilledClusterNodeMissesItsSlotsWhileTheOthersServeThenIsReconnected) {
  RedisCluster cluster;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto a = Engine::Make({.url = cluster.url(), .timeout_ms = 500});
  ASSERT_NE(a, nullptr);
  // 12 one-block prompts; which node holds each.
  std::vector<std::vector<TokenId>> prompts;
  std::vector<int> holder;
  for (int p = 0; p < 12; ++p) {
    prompts.push_back(Prompt(1000 * (p + 1), kBlockSize + 1));
    EXPECT_EQ(a->Prefill(p + 1, prompts.back()), 0);
    a->mgr->FlushRemoteTier();
    int held = -1;
    for (size_t i = 0; i < cluster.size(); ++i) {
      const auto before = std::count(holder.begin(), holder.end(), static_cast<int>(i));
      if (std::ssize(Keys(cluster.node(i))) > before) held = static_cast<int>(i);
    }
    ASSERT_NE(held, -1) << "prompt " << p << " stored on no node";
    holder.push_back(held);
  }
  ASSERT_EQ(a->mgr->remote_tier_stats().stored, 12);
  auto b = Engine::Make({.url = cluster.url(), .timeout_ms = 500});
  ASSERT_NE(b, nullptr);
  const int dead = holder[0];
  const auto on_dead = std::count(holder.begin(), holder.end(), dead);
  ASSERT_LT(on_dead, 12) << "every prompt on one node";
  cluster.node(static_cast<size_t>(dead)).Kill();

  for (int p = 0; p < 12; ++p) {
    const int64_t cached = b->Prefill(p + 1, prompts[static_cast<size_t>(p)]);
    EXPECT_EQ(cached, holder[static_cast<size_t>(p)] == dead ? 0 : kBlockSize) << "prompt " << p;
    b->ExpectPrefixData(p + 1, prompts[static_cast<size_t>(p)], 1);  // computed or fetched
  }
  const RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 12 - on_dead);
  EXPECT_EQ(s.misses, on_dead);
  EXPECT_EQ(s.misses_error, on_dead);
  EXPECT_EQ(s.misses_not_found + s.misses_verify_failed + s.misses_late, 0);
  EXPECT_GE(s.errors, 1);
  EXPECT_FALSE(s.connected);
  EXPECT_EQ(s.nodes, 3);  // the dead node still owns its slots (no failover)

  // Restarted (its keys gone: persistence off; its slots still its own): b reconnects after its
  // backoff and stores there again.
  for (int p = 0; p < 12; ++p) ASSERT_TRUE(b->mgr->FlushSequence(p + 1).ok());
  cluster.node(static_cast<size_t>(dead)).Start();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<TokenId>& again = prompts[0];  // its block's slot is the restarted node's
  bool stored = false;
  for (int i = 0; i < 100 && !stored; ++i) {
    b->mgr->ResetPrefixCache();
    const int64_t before = b->mgr->remote_tier_stats().stored;
    EXPECT_EQ(b->Prefill(100, again), 0);  // gone with the node: recomputed
    ASSERT_TRUE(b->mgr->FlushSequence(100).ok());
    b->mgr->FlushRemoteTier();
    stored = b->mgr->remote_tier_stats().stored == before + 1;
    if (!stored) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(stored);
  const RemoteTierStats after = b->mgr->remote_tier_stats();
  EXPECT_GE(after.reconnects, 1);
  EXPECT_TRUE(after.connected);
  auto c = Engine::Make({.url = cluster.url()});
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Prefill(1, again), kBlockSize);
  c->ExpectPrefixData(1, again, 1);
}

// A master stalled, then killed, in a cluster with replicas: until the cluster fails over, its
// slots are read from its replica (READONLY) and hit; stores to them drop. After the failover
// (the replica takes the slots over) stores go to the new master and every engine reads from it.
TEST(RemoteTierTest, AStalledOrKilledMastersSlotsAreReadFromItsReplicaThenFailedOverTo) {
  RedisCluster cluster(/*masters=*/3, /*replicas=*/1);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<TokenId> prompt = Prompt(300, 16 * kBlockSize + 1);
  auto a = Engine::Make({.url = cluster.url(), .timeout_ms = 500});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  ASSERT_EQ(a->mgr->remote_tier_stats().stored, 16);
  ASSERT_EQ(a->mgr->remote_tier_stats().nodes, 3);  // the masters: replicas own no slots
  // The master holding most of the prompt's blocks, once its replica has them all.
  int dead = -1;
  int64_t on_dead = 0;
  for (size_t i = 0; i < cluster.size(); ++i) {
    const auto held = std::ssize(Keys(cluster.node(i)));
    if (cluster.master_port(i) == 0 && held > on_dead) {
      dead = static_cast<int>(i);
      on_dead = held;
    }
  }
  ASSERT_GT(on_dead, 0);
  ASSERT_LT(on_dead, 16) << "every block on one node";
  const int replica = cluster.replica_of(static_cast<size_t>(dead));
  ASSERT_GE(replica, 0) << "node " << dead << " has no replica";
  for (int i = 0; i < 200 && std::ssize(Keys(cluster.node(static_cast<size_t>(replica)))) < on_dead;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(std::ssize(Keys(cluster.node(static_cast<size_t>(replica)))), on_dead);

  // Stalled first (SIGSTOP: it takes connections, answers nothing): once a command to it timed
  // out, it is left alone for its backoff and its slots are read from the replica.
  {
    auto stalled = Engine::Make({.url = cluster.url(), .timeout_ms = 300});
    ASSERT_NE(stalled, nullptr);
    cluster.node(static_cast<size_t>(dead)).Stop();
    const Resume resume{cluster.node(static_cast<size_t>(dead))};
    bool hit = false;
    for (SeqId uid = 1; uid <= 50 && !hit; ++uid) {
      stalled->mgr->ResetPrefixCache();
      hit = stalled->Prefill(uid, prompt) == 16 * kBlockSize;
      if (hit) stalled->ExpectPrefixData(uid, prompt, 16);
      ASSERT_TRUE(stalled->mgr->FlushSequence(uid).ok());
    }
    EXPECT_TRUE(hit);
    EXPECT_GE(stalled->mgr->remote_tier_stats().replica_reads, on_dead);
  }
  // Connected to every master before the kill: its first fetch finds the connection gone while
  // writing or reading, and asks the replica in the same fetch.
  auto early = Engine::Make({.url = cluster.url(), .timeout_ms = 500});
  ASSERT_NE(early, nullptr);
  ASSERT_TRUE(early->mgr->remote_tier_stats().connected);
  cluster.node(static_cast<size_t>(dead)).Kill();
  EXPECT_EQ(early->Prefill(1, prompt), 16 * kBlockSize);
  early->ExpectPrefixData(1, prompt, 16);
  RemoteTierStats s = early->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 16);
  EXPECT_EQ(s.misses, 0);
  EXPECT_EQ(s.replica_reads, on_dead);
  EXPECT_GE(s.errors, 1);  // the lost connection

  // Read from the replica: every block hits, byte for byte.
  auto b = Engine::Make({.url = cluster.url(), .timeout_ms = 500});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Prefill(1, prompt), 16 * kBlockSize);
  b->ExpectPrefixData(1, prompt, 16);
  s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 16);
  EXPECT_EQ(s.misses, 0);
  EXPECT_EQ(s.replica_reads, on_dead);
  EXPECT_FALSE(s.connected);  // a slot owner is down
  // A's stores to the dead master's slots drop (a replica takes no writes); the others land.
  ASSERT_TRUE(a->mgr->FlushSequence(1).ok());
  const auto live_keys = [&] {
    int64_t n = 0;
    for (size_t i = 0; i < cluster.size(); ++i) {
      if (static_cast<int>(i) != dead && cluster.master_port(i) == 0) {
        n += std::ssize(Keys(cluster.node(i)));
      }
    }
    return n;
  };
  const int64_t keys_before = live_keys();
  const std::vector<TokenId> second = Prompt(400, 16 * kBlockSize + 1);
  EXPECT_EQ(a->Prefill(2, second), 0);
  a->mgr->FlushRemoteTier();
  s = a->mgr->remote_tier_stats();
  EXPECT_EQ(s.stored - 16, live_keys() - keys_before);
  EXPECT_EQ(s.stored - 16 + s.dropped, 16);

  // The replica takes the slots over (as the cluster's own failover does after
  // cluster-node-timeout); the engines follow: stores land there, reads go there.
  ASSERT_EQ(cluster.node(static_cast<size_t>(replica)).Text({"CLUSTER", "FAILOVER", "TAKEOVER"}),
            "OK");
  const auto port = cluster.node(static_cast<size_t>(replica)).port();
  const auto owners_moved = [&] {  // every live node's map gives the replica the dead's slots
    for (size_t i = 0; i < cluster.size(); ++i) {
      if (static_cast<int>(i) == dead) continue;
      const std::shared_ptr<redisReply> slots = cluster.node(i).Command({"CLUSTER", "SLOTS"});
      bool owns = false;
      for (size_t r = 0; slots != nullptr && r < slots->elements; ++r) {
        owns = owns || slots->element[r]->element[2]->element[1]->integer == port;
      }
      if (!owns) return false;
    }
    return true;
  };
  for (int i = 0; i < 200 && !owners_moved(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(owners_moved());
  std::vector<TokenId> third;  // a new prompt each time, until every block of one is stored
  bool stored = false;
  for (int i = 0; i < 100 && !stored; ++i) {
    ASSERT_TRUE(a->mgr->FlushSequence(2).ok());
    third = Prompt(static_cast<TokenId>(1000 * (i + 1)), 16 * kBlockSize + 1);
    const int64_t before = a->mgr->remote_tier_stats().stored;
    EXPECT_EQ(a->Prefill(2, third), 0);
    a->mgr->FlushRemoteTier();
    stored = a->mgr->remote_tier_stats().stored == before + 16;
    if (!stored) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(stored) << "no store reached the new master on " << port;
  EXPECT_GE(a->mgr->remote_tier_stats().topology_refreshes, 1);
  auto c = Engine::Make({.url = cluster.url()});
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Prefill(1, third), 16 * kBlockSize);
  c->ExpectPrefixData(1, third, 16);
  s = c->mgr->remote_tier_stats();
  EXPECT_EQ(s.replica_reads, 0);  // the new master serves its slots
  EXPECT_EQ(s.nodes, 3);
  EXPECT_TRUE(s.connected);
}

TEST(RemoteTierTest, AReshardedSlotIsFollowedThroughAskThenMoved) {
  RedisCluster cluster;
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<TokenId> prompt = Prompt(100, 16 * kBlockSize + 1);
  auto a = Engine::Make({.url = cluster.url()});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  ASSERT_EQ(a->mgr->remote_tier_stats().stored, 16);
  // Both read the slot map now; the slot of block 0 moves afterwards.
  auto b = Engine::Make({.url = cluster.url()});
  auto c = Engine::Make({.url = cluster.url()});
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  std::string key0;
  size_t from = 0;
  for (size_t i = 0; i < cluster.size(); ++i) {
    for (const std::string& key : Keys(cluster.node(i))) {
      if (BlockIndex(cluster.node(i), key) == 0) {
        key0 = key;
        from = i;
      }
    }
  }
  ASSERT_FALSE(key0.empty());
  const size_t to = (from + 1) % cluster.size();
  const std::string slot = std::to_string(cluster.slot(key0));
  RedisServer& src = cluster.node(from);
  RedisServer& dst = cluster.node(to);
  // Migrating: the key moves, the slot is still src's: src answers ASK.
  ASSERT_EQ(dst.Text({"CLUSTER", "SETSLOT", slot, "IMPORTING", cluster.id(from)}), "OK");
  ASSERT_EQ(src.Text({"CLUSTER", "SETSLOT", slot, "MIGRATING", cluster.id(to)}), "OK");
  ASSERT_EQ(
      src.Text({"MIGRATE", "127.0.0.1", std::to_string(dst.port()), "", "0", "5000", "KEYS", key0}),
      "OK");
  EXPECT_EQ(b->Prefill(1, prompt), 64);
  b->ExpectPrefixData(1, prompt, 16);
  RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 16);
  EXPECT_EQ(s.redirects, 1);  // ASK, followed with ASKING
  EXPECT_EQ(s.misses + s.errors, 0);
  // Migrated: the slot is dst's; c's map still says src, which answers MOVED.
  for (const size_t i : {to, from, (to + 1) % cluster.size()}) {
    ASSERT_EQ(cluster.node(i).Text({"CLUSTER", "SETSLOT", slot, "NODE", cluster.id(to)}), "OK");
  }
  EXPECT_EQ(c->Prefill(1, prompt), 64);
  c->ExpectPrefixData(1, prompt, 16);
  s = c->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 16);
  EXPECT_EQ(s.redirects, 1);
  EXPECT_EQ(s.misses + s.errors, 0);
  // Its map is read again before its next command, which then goes to dst directly.
  ASSERT_TRUE(c->mgr->FlushSequence(1).ok());
  ASSERT_EQ(c->mgr->ResetPrefixCache(), 16);
  EXPECT_EQ(c->Prefill(2, prompt), 64);
  c->ExpectPrefixData(2, prompt, 16);
  s = c->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 32);
  EXPECT_EQ(s.redirects, 1);
  EXPECT_EQ(s.topology_refreshes, 1);
  EXPECT_TRUE(s.connected);
}

TEST(RemoteTierTest, APromptFetchedAheadIsTakenByScheduleWithoutWaiting) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);  // 4 full blocks, 1 token left
  auto a = Engine::Make({.url = server.url(), .model_id = "m"});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  // A fetch at Schedule would wait a minute for the stalled server below, and miss.
  auto b = Engine::Make({.url = server.url(), .model_id = "m", .timeout_ms = 60000});
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(b->mgr->AddSequence(7, prompt).ok());
  Result<RemoteFetchTicket> ticket = b->mgr->FetchRemotePrefix(7);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(ticket->blocks(), 4);
  ticket->Wait();
  EXPECT_TRUE(ticket->Poll());
  server.Stop();
  const Resume resume{server};
  // The values are here: Schedule takes them, verified, and asks the server nothing.
  EXPECT_EQ(b->Prefill(7, prompt, "", /*add=*/false), 16);
  b->ExpectPrefixData(7, prompt, 4);
  const RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 4);
  EXPECT_EQ(s.misses, 0);
  EXPECT_EQ(s.fetched_bytes, a->mgr->remote_tier_stats().stored_bytes);
  server.Continue();
}

TEST(RemoteTierTest, AFetchAheadStillInFlightIsALateMissAndRecomputed) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  auto a = Engine::Make({.url = server.url(), .model_id = "m"});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, prompt), 0);
  a->mgr->FlushRemoteTier();
  auto b = Engine::Make({.url = server.url(), .model_id = "m", .timeout_ms = 60000});
  ASSERT_NE(b, nullptr);
  server.Stop();  // the fetch cannot land until the server goes on
  const Resume resume{server};
  ASSERT_TRUE(b->mgr->AddSequence(7, prompt).ok());
  Result<RemoteFetchTicket> ticket = b->mgr->FetchRemotePrefix(7);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(ticket->blocks(), 4);
  EXPECT_FALSE(ticket->Poll());
  // An engine polling CanSchedule meanwhile counts nothing: a miss is a lookup taken.
  const SeqId uids[] = {7};
  const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(b->mgr->CanSchedule({.uids = uids, .lengths = lengths}).ok());
  }
  EXPECT_EQ(b->mgr->remote_tier_stats().misses, 0);
  // Schedule does not wait for it: a late miss, every block computed here.
  EXPECT_EQ(b->Prefill(7, prompt, "", /*add=*/false), 0);
  b->ExpectPrefixData(7, prompt, 4);
  RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.misses_late, 1);
  server.Continue();
  ticket->Wait();  // it lands, and is dropped: the sequence computed its blocks
  EXPECT_TRUE(ticket->Poll());
  b->ExpectPrefixData(7, prompt, 4);
  // A fetch queued behind it and dropped with its sequence is finished, not left hanging.
  ASSERT_TRUE(b->mgr->AddSequence(8, Prompt(900, 9)).ok());
  Result<RemoteFetchTicket> dropped = b->mgr->FetchRemotePrefix(8);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  ASSERT_TRUE(b->mgr->FlushSequence(8).ok());
  dropped->Wait();
  EXPECT_TRUE(dropped->Poll());
}

// Calls of `command` the server counted since CONFIG RESETSTAT.
int64_t CommandCalls(redisContext* c, const std::string& command) {
  auto* r = static_cast<redisReply*>(redisCommand(c, "INFO commandstats"));
  const std::string info(r->str, r->len);
  freeReplyObject(r);
  const std::string tag = "cmdstat_" + command + ":calls=";
  const size_t at = info.find(tag);
  return at == std::string::npos ? 0 : std::stoll(info.substr(at + tag.size()));
}

// An engine fetching ahead for several admitted requests: the fetches queued while one runs go
// in one pipeline (one MGET), and each ticket gets its own blocks.
TEST(RemoteTierTest, FetchesQueuedTogetherShareOneRoundTrip) {
  RedisServer server;
  std::vector<std::vector<TokenId>> prompts;
  prompts.reserve(4);
  for (TokenId i = 0; i < 4; ++i) prompts.push_back(Prompt(1000 * (i + 1), 9));  // 2 blocks
  auto a = Engine::Make({.url = server.url(), .model_id = "m"});
  ASSERT_NE(a, nullptr);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(a->Prefill(static_cast<SeqId>(i), prompts[i]), 0);
  }
  a->mgr->FlushRemoteTier();
  auto b = Engine::Make({.url = server.url(), .model_id = "m", .timeout_ms = 60000});
  ASSERT_NE(b, nullptr);
  redisContext* c = server.Connect();
  freeReplyObject(redisCommand(c, "CONFIG RESETSTAT"));
  server.Stop();  // the first fetch waits in the socket; the others queue behind it
  std::vector<RemoteFetchTicket> tickets;
  tickets.reserve(prompts.size());
  {
    const Resume resume{server};
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto uid = static_cast<SeqId>(10 + i);
      ASSERT_TRUE(b->mgr->AddSequence(uid, prompts[i]).ok());
      Result<RemoteFetchTicket> t = b->mgr->FetchRemotePrefix(uid);
      ASSERT_TRUE(t.ok()) << t.status();
      tickets.push_back(*t);
    }
  }
  for (const RemoteFetchTicket& t : tickets) t.Wait();
  // The first alone (or with the others, had they queued before the worker took it), the rest
  // together: one MGET each would be 4.
  const int64_t mgets = CommandCalls(c, "mget");
  EXPECT_GE(mgets, 1);
  EXPECT_LE(mgets, 2);
  redisFree(c);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto uid = static_cast<SeqId>(10 + i);
    EXPECT_EQ(b->Prefill(uid, prompts[i], "", /*add=*/false), 8) << "request " << i;
    b->ExpectPrefixData(uid, prompts[i], 2);
  }
  EXPECT_EQ(b->mgr->remote_tier_stats().hits, 8);
}

// A refused MGET (here an ACL user without it) is a counted error and a miss; the connection
// stays usable (the error reply was read whole): stores go on.
TEST(RemoteTierTest, ARefusedFetchIsAnErrorMissAndTheConnectionStaysUsable) {
  RedisServer server;
  redisContext* c = server.Connect();
  freeReplyObject(redisCommand(c, "ACL SETUSER limited on >pw ~* +@all -mget"));
  redisFree(c);
  const std::string url = "redis://limited:pw@127.0.0.1:" + std::to_string(server.port());
  auto a = Engine::Make({.url = url, .model_id = "m"});
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Prefill(1, Prompt(100, 17)), 0);
  a->mgr->FlushRemoteTier();
  EXPECT_EQ(a->mgr->remote_tier_stats().stored, 4);
  auto b = Engine::Make({.url = url, .model_id = "m"});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Prefill(7, Prompt(100, 17)), 0);
  b->ExpectPrefixData(7, Prompt(100, 17), 4);
  RemoteTierStats s = b->mgr->remote_tier_stats();
  EXPECT_EQ(s.misses_error, 1);
  EXPECT_EQ(s.reconnects, 0);
  EXPECT_TRUE(s.connected);
  EXPECT_EQ(b->Prefill(8, Prompt(500, 17)), 0);
  b->mgr->FlushRemoteTier();
  EXPECT_EQ(b->mgr->remote_tier_stats().stored, 8);  // both prompts' blocks, computed here
}

TEST(RemoteTierTest, FetchingAheadIsRefusedWhereItCannotServeAndChangesNothing) {
  RedisServer server;
  auto b = Engine::Make({.url = server.url(), .model_id = "m"});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->mgr->FetchRemotePrefix(99).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(b->mgr->GetOrCreateSequence(5).ok());
  Status s = b->mgr->FetchRemotePrefix(5).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("was not added with AddSequence"), std::string::npos) << s;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  EXPECT_EQ(b->Prefill(6, prompt), 0);
  s = b->mgr->FetchRemotePrefix(6).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("was scheduled already"), std::string::npos) << s;
  // Nothing past the local matches: an empty ticket (sequence 6's blocks are on the device).
  ASSERT_TRUE(b->mgr->AddSequence(7, prompt).ok());
  Result<RemoteFetchTicket> none = b->mgr->FetchRemotePrefix(7);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->blocks(), 0);
  EXPECT_TRUE(none->Poll());
  ASSERT_TRUE(b->mgr->AddSequence(8, Prompt(500, 3)).ok());  // under a block and a token
  EXPECT_EQ(b->mgr->FetchRemotePrefix(8)->blocks(), 0);
  EXPECT_TRUE(b->mgr->CheckInvariants().ok());
  // A manager without a tier.
  StateManagerConfig config;
  config.prefix_cache.enabled = true;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = 32};
  auto plain = StateManager::Create(config,
                                    {KVCacheConfig{.block_size = kBlockSize,
                                                   .cache_shape = {1, 1, 8},
                                                   .cache_dtype = DType::kFloat32,
                                                   .max_blocks_per_allocation_group = 32}},
                                    CpuDevice(16 << 20));
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  ASSERT_TRUE((*plain)->AddSequence(1, prompt).ok());
  s = (*plain)->FetchRemotePrefix(1).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("no remote tier"), std::string::npos) << s;
}

TEST(RemoteTierTest, ClusterUrlsParseAndBadOnesNameTheBadPart) {
  Result<internal::RedisUrl> url =
      internal::ParseRedisUrl("redis+cluster://u:pw@10.0.0.1:7000,10.0.0.2,host-c:7002");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_TRUE(url->cluster);
  ASSERT_EQ(url->hosts.size(), 3u);
  EXPECT_EQ(url->hosts[0].host, "10.0.0.1");
  EXPECT_EQ(url->hosts[0].port, 7000);
  EXPECT_EQ(url->hosts[1].port, 6379);
  EXPECT_EQ(url->hosts[2].host, "host-c");
  EXPECT_EQ(url->user, "u");
  EXPECT_EQ(url->password, "pw");
  const auto error = [](std::string_view u) {
    const Result<internal::RedisUrl> r = internal::ParseRedisUrl(u);
    EXPECT_FALSE(r.ok()) << u;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << u;
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  EXPECT_NE(error("redis+cluster://h:7000,:7001").find("no host in \":7001\""), std::string::npos);
  EXPECT_NE(error("redis+cluster://h:7000,h:x").find("bad port \"x\" in \"h:x\""),
            std::string::npos);
  EXPECT_NE(error("redis+cluster://h:7000,").find("no host"), std::string::npos);
  EXPECT_NE(error("redis+cluster://h:7000/1").find("database 0 only"), std::string::npos);
  EXPECT_NE(error("redis://h:1,h:2").find("2 hosts"), std::string::npos);
  const std::string secret = error("redis+cluster://u:topsecret@h:99999");
  EXPECT_NE(secret.find("bad port \"99999\""), std::string::npos) << secret;
  EXPECT_EQ(secret.find("topsecret"), std::string::npos) << secret;
  EXPECT_NE(secret.find("u:***@h:99999"), std::string::npos) << secret;
  // The user and password percent-decoded, as URLs encode them; IPv6 addresses in brackets.
  url = internal::ParseRedisUrl("redis://us%65r:p%40ss%3Aw%2Ford%25@[::1]:7000/2");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_EQ(url->user, "user");
  EXPECT_EQ(url->password, "p@ss:w/ord%");
  ASSERT_EQ(url->hosts.size(), 1u);
  EXPECT_EQ(url->hosts[0].host, "::1");
  EXPECT_EQ(url->hosts[0].port, 7000);
  EXPECT_EQ(url->db, 2);
  url = internal::ParseRedisUrl("redis+cluster://[fe80::1],[::1]:7001,h");
  ASSERT_TRUE(url.ok()) << url.status();
  ASSERT_EQ(url->hosts.size(), 3u);
  EXPECT_EQ(url->hosts[0].host, "fe80::1");
  EXPECT_EQ(url->hosts[0].port, 6379);
  EXPECT_EQ(url->hosts[1].host, "::1");
  EXPECT_EQ(url->hosts[1].port, 7001);
  EXPECT_EQ(internal::HostPortText("::1", 7001), "[::1]:7001");
  EXPECT_EQ(internal::HostPortText("h", 7001), "h:7001");
  EXPECT_NE(error("redis://::1:6379").find("an IPv6 address is written in brackets"),
            std::string::npos);
  EXPECT_NE(error("redis://[::1:6379").find("no ']' in \"[::1:6379\""), std::string::npos);
  EXPECT_NE(error("redis://[::1]x").find("\"x\" after the address"), std::string::npos);
  EXPECT_NE(error("redis://[::1]:").find("bad port \"\""), std::string::npos);
  EXPECT_NE(error("redis://[]:6379").find("no host"), std::string::npos);
  EXPECT_NE(error("redis://h:").find("bad port \"\" in \"h:\""), std::string::npos);
  const std::string escape = error("redis://:top%zzsecret@h:1");
  EXPECT_NE(escape.find("'%' in the password"), std::string::npos) << escape;
  EXPECT_EQ(escape.find("top"), std::string::npos) << "the password leaked: " << escape;
  EXPECT_NE(error("redis://u%4:pw@h").find("in the user \"u%4\""), std::string::npos);
  EXPECT_NE(error("redis://:pw%@h").find("'%' in the password"), std::string::npos);
  EXPECT_NE(error("redis://:%@h").find("'%' in the password"), std::string::npos);
  // A unix socket: its path (an '@' in it is the path's), credentials and database.
  url = internal::ParseRedisUrl("unix://u:p%2Fw@/run/redis/a@b.sock?db=3");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_TRUE(url->unix_socket);
  EXPECT_FALSE(url->cluster);
  ASSERT_EQ(url->hosts.size(), 1u);
  EXPECT_EQ(url->hosts[0].host, "/run/redis/a@b.sock");
  EXPECT_EQ(url->hosts[0].port, 0);
  EXPECT_EQ(url->user, "u");
  EXPECT_EQ(url->password, "p/w");
  EXPECT_EQ(url->db, 3);
  url = internal::ParseRedisUrl("unix:///tmp/r.sock");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_EQ(url->hosts[0].host, "/tmp/r.sock");
  EXPECT_TRUE(url->password.empty());
  EXPECT_EQ(internal::HostPortText("/tmp/r.sock", 0), "/tmp/r.sock");
  EXPECT_NE(error("unix://tmp/r.sock").find("\"tmp/r.sock\" is not absolute"), std::string::npos);
  EXPECT_NE(error("unix://").find("\"\" is not absolute"), std::string::npos);
  EXPECT_NE(error("unix:///tmp/r.sock?timeout=5").find("only db=N"), std::string::npos);
  EXPECT_NE(error("unix:///tmp/r.sock?db=x").find("bad database \"x\""), std::string::npos);
  // Sentinels and the master they watch.
  url = internal::ParseRedisUrl("redis+sentinel://:pw@s1,s2:26380,[::1]/mymaster/4");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_FALSE(url->cluster);
  EXPECT_EQ(url->sentinel_master, "mymaster");
  EXPECT_EQ(url->db, 4);
  EXPECT_EQ(url->password, "pw");
  ASSERT_EQ(url->hosts.size(), 3u);
  EXPECT_EQ(url->hosts[0].port, 26379);
  EXPECT_EQ(url->hosts[1].port, 26380);
  EXPECT_EQ(url->hosts[2].host, "::1");
  EXPECT_NE(error("redis+sentinel://s1:26379").find("no master name"), std::string::npos);
  EXPECT_NE(error("redis+sentinel://s1:26379/").find("no master name"), std::string::npos);
  EXPECT_NE(error("redis+sentinel://s1:26379//2").find("no master name"), std::string::npos);
  EXPECT_NE(error("redis+sentinel://s1/m/x").find("bad database \"x\""), std::string::npos);
  // TLS: "rediss" for "redis" in each TCP form, its settings in the query (redis-py's names).
  url = internal::ParseRedisUrl(
      "rediss://u:p%3Fw@h:6380/2?ssl_ca_certs=/etc/ca%20dir/ca.pem&ssl_certfile=/c.pem"
      "&ssl_keyfile=/k.pem&ssl_server_name=redis.internal");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_TRUE(url->tls);
  EXPECT_FALSE(url->cluster);
  EXPECT_EQ(url->password, "p?w");
  EXPECT_EQ(url->db, 2);
  EXPECT_EQ(url->hosts[0].port, 6380);
  EXPECT_EQ(url->tls_options.ca_file, "/etc/ca dir/ca.pem");
  EXPECT_EQ(url->tls_options.cert_file, "/c.pem");
  EXPECT_EQ(url->tls_options.key_file, "/k.pem");
  EXPECT_EQ(url->tls_options.server_name, "redis.internal");
  EXPECT_TRUE(url->tls_options.verify);
  EXPECT_TRUE(url->tls_options.check_hostname);
  url = internal::ParseRedisUrl("rediss+cluster://a:7000,b:7001?ssl_cert_reqs=none");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_TRUE(url->tls && url->cluster);
  ASSERT_EQ(url->hosts.size(), 2u);
  EXPECT_EQ(url->hosts[1].port, 7001);
  EXPECT_FALSE(url->tls_options.verify);
  url = internal::ParseRedisUrl("rediss+sentinel://s1/m/3?ssl_check_hostname=false");
  ASSERT_TRUE(url.ok()) << url.status();
  EXPECT_TRUE(url->tls);
  EXPECT_EQ(url->sentinel_master, "m");
  EXPECT_EQ(url->db, 3);
  EXPECT_TRUE(url->tls_options.verify);
  EXPECT_FALSE(url->tls_options.check_hostname);
  EXPECT_FALSE(internal::ParseRedisUrl("redis://h:6379")->tls);
  EXPECT_NE(error("redis://h?ssl_ca_certs=/ca.pem").find("\"ssl_ca_certs\" is for TLS"),
            std::string::npos);
  EXPECT_NE(error("rediss://h?ssl_cert_reqs=maybe").find("ssl_cert_reqs=maybe: required or none"),
            std::string::npos);
  EXPECT_NE(error("rediss://h?timeout=5").find("unknown query item \"timeout\""),
            std::string::npos);
  EXPECT_NE(error("rediss://h?ssl_ca_certs").find("\"ssl_ca_certs\" that is not name=value"),
            std::string::npos);
  EXPECT_NE(error("redisx://h").find("not a redis:// URL"), std::string::npos);
  EXPECT_NE(error("rediss+unix:///tmp/s").find("not a redis:// URL"), std::string::npos);
  // Redis's own CRC16 check value, and the hash tag.
  EXPECT_EQ(internal::KeySlot("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(internal::KeySlot("a{123456789}b"), internal::KeySlot("123456789"));
}

// A key names blocks stored by earlier runs and other engines: its format must not move.
TEST(RemoteTierTest, KeysKeepTheirFormat) {
  const BlockHash key{.lo = 0x1111222233334444, .hi = 0xaaaabbbbccccdddd};
  EXPECT_EQ(internal::RemoteKey(0x0123456789abcdef, "", key),
            "blockkv:{0123456789abcdef:2d06800538d394c2:aaaabbbbccccdddd1111222233334444}");
  EXPECT_EQ(internal::RemoteKey(0xf, "tenant-a", BlockHash{}),
            "blockkv:{000000000000000f:635c5bebe6e5f781:00000000000000000000000000000000}");
}

TEST(RemoteTierTest, AStandaloneServerNamedAsAClusterIsAClearError) {
  RedisServer server;
  Status status;
  EXPECT_EQ(
      Engine::Make({.url = "redis+cluster://127.0.0.1:" + std::to_string(server.port())}, &status),
      nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("CLUSTER SLOTS refused"), std::string::npos) << status;
}

TEST(RemoteTierTest, BadConfigsAreClearErrors) {
  Status status;
  EXPECT_EQ(Engine::Make({.url = "http://127.0.0.1:6379"}, &status), nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("http://127.0.0.1:6379"), std::string::npos) << status;
  EXPECT_EQ(Engine::Make({.url = "redis://127.0.0.1:99999"}, &status), nullptr);
  EXPECT_NE(status.message().find("port"), std::string::npos) << status;
  EXPECT_EQ(Engine::Make({.url = "redis://127.0.0.1:1", .timeout_ms = 0}, &status), nullptr);
  EXPECT_NE(status.message().find("timeout_ms is 0"), std::string::npos) << status;
  EXPECT_EQ(Engine::Make({.url = "redis://127.0.0.1:1", .tp_rank = 2, .tp_size = 2}, &status),
            nullptr);
  EXPECT_NE(status.message().find("tp_rank 2"), std::string::npos) << status;
  // A queue whose stores could hold more than the host's memory (each keeps its block's bytes
  // until sent): refused before anything connects.
  EXPECT_EQ(Engine::Make({.url = "redis://127.0.0.1:1", .max_pending = 2'000'000'000}, &status),
            nullptr);
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("max_pending=2000000000"), std::string::npos) << status;
  EXPECT_NE(status.message().find("host memory available"), std::string::npos) << status;
  // Without prefix caching there is nothing to key blocks by.
  StateManagerConfig config;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = 8};
  config.remote_tier = RemoteTierConfig{.url = "redis://127.0.0.1:1"};
  auto mgr = StateManager::Create(
      config, {KVCacheConfig{.block_size = 4, .cache_shape = {1, 1, 8}}}, CpuDevice(16 << 20));
  ASSERT_FALSE(mgr.ok());
  EXPECT_EQ(mgr.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mgr.status().message().find("prefix_cache.enabled"), std::string::npos);
}

// ---- tensor parallelism: the ranks agree on each hit ------------------------------------------

// Element-wise minimum of the ranks' votes, as the engine's all-reduce would give each rank.
void ReduceVotes(const std::vector<RemotePrefixVote*>& votes) {
  for (RemotePrefixVote* v : votes) {
    for (size_t i = 0; i < v->values.size(); ++i) {
      for (const RemotePrefixVote* w : votes) {
        v->values[i] = std::min(v->values[i], w->values[i]);
      }
    }
  }
}

RemoteTierConfig RankConfig(const RedisServer& server, int32_t rank) {
  return {.url = server.url(), .model_id = "llama", .tp_rank = rank, .tp_size = 2};
}

// Two ranks' engines: each rank's writer stores the first stored[rank] tokens of `prompt` (its
// full blocks) in its shard; then each rank's reader, returned, adds `prompt` as sequence 7 and
// fetches it ahead.
std::array<std::unique_ptr<Engine>, 2> TwoRanksFetching(const RedisServer& server,
                                                        const std::vector<TokenId>& prompt,
                                                        std::array<size_t, 2> stored) {
  std::array<std::unique_ptr<Engine>, 2> readers;
  for (int32_t rank = 0; rank < 2; ++rank) {
    auto writer = Engine::Make(RankConfig(server, rank));
    EXPECT_NE(writer, nullptr);
    if (writer == nullptr) return {};
    const auto n = static_cast<std::ptrdiff_t>(stored[static_cast<size_t>(rank)]);
    EXPECT_EQ(writer->Prefill(1, {prompt.begin(), prompt.begin() + n}), 0);
    writer->mgr->FlushRemoteTier();
    auto reader = Engine::Make(RankConfig(server, rank));
    EXPECT_NE(reader, nullptr);
    if (reader == nullptr) return {};
    EXPECT_TRUE(reader->mgr->AddSequence(7, prompt).ok());
    EXPECT_TRUE(reader->mgr->FetchRemotePrefix(7).ok());
    readers[static_cast<size_t>(rank)] = std::move(reader);
  }
  return readers;
}

// Rank 0's tier holds the prompt's 8 blocks, rank 1's only its first 3: each rank's reader gets
// a hit of 3, the blocks every rank holds, byte for byte.
TEST(RemoteTierTest, TensorParallelRanksAgreeOnTheBlocksEveryRankHolds) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 33);  // 8 full blocks and a last token
  auto [r0, r1] = TwoRanksFetching(server, prompt, {33, 13});
  ASSERT_NE(r1, nullptr);
  const SeqId uids[] = {7};
  RemotePrefixVote v0 = r0->mgr->RemotePrefixOffer(uids);
  RemotePrefixVote v1 = r1->mgr->RemotePrefixOffer(uids);
  EXPECT_EQ(v0.values.back(), 8);
  EXPECT_EQ(v1.values.back(), 3);
  ReduceVotes({&v0, &v1});
  for (Engine* r : {r0.get(), r1.get()}) {
    const Result<std::vector<int32_t>> agreed = r->mgr->AgreeRemotePrefix(r == r0.get() ? v0 : v1);
    ASSERT_TRUE(agreed.ok()) << agreed.status();
    EXPECT_EQ(*agreed, std::vector<int32_t>{3});
    EXPECT_EQ(r->Prefill(7, prompt, "", /*add=*/false), 3 * kBlockSize);
    r->ExpectPrefixData(7, prompt, 3);
  }
  EXPECT_EQ(r0->mgr->remote_tier_stats().hits, 3);
  EXPECT_EQ(r0->mgr->remote_tier_stats().misses_other_rank, 1);
  EXPECT_EQ(r1->mgr->remote_tier_stats().hits, 3);
  EXPECT_EQ(r1->mgr->remote_tier_stats().misses_other_rank, 0);
}

// With tp_size > 1 a lookup never takes a block from the tier on its own: one rank alone cannot
// know that the others hold it.
TEST(RemoteTierTest, ATensorParallelRankTakesNoBlockFromTheTierWithoutAnAgreement) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  auto w0 = Engine::Make(RankConfig(server, 0));
  ASSERT_NE(w0, nullptr);
  EXPECT_EQ(w0->Prefill(1, prompt), 0);
  w0->mgr->FlushRemoteTier();
  auto r0 = Engine::Make(RankConfig(server, 0));
  ASSERT_NE(r0, nullptr);
  EXPECT_EQ(r0->Prefill(1, prompt), 0);  // no fetch ahead, no agreement
  ASSERT_TRUE(r0->mgr->AddSequence(2, Prompt(100, 18)).ok());
  ASSERT_TRUE(r0->mgr->FetchRemotePrefix(2).ok());
  EXPECT_EQ(r0->Prefill(2, Prompt(100, 18), "", /*add=*/false), 16);  // the device's 4 blocks
  EXPECT_EQ(r0->mgr->remote_tier_stats().hits, 0);
}

TEST(RemoteTierTest, AnAgreementRefusedOnOneRankIsRefusedOnEveryRankAndChangesNothing) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 17);
  auto [r0, r1] = TwoRanksFetching(server, prompt, {17, 17});
  ASSERT_NE(r1, nullptr);
  // Rank 1 names a sequence it does not track: it says which, rank 0 that another rank refused.
  {
    const SeqId good[] = {7};
    const SeqId bad[] = {9};
    RemotePrefixVote v0 = r0->mgr->RemotePrefixOffer(good);
    RemotePrefixVote v1 = r1->mgr->RemotePrefixOffer(bad);
    ReduceVotes({&v0, &v1});
    const auto a0 = r0->mgr->AgreeRemotePrefix(v0);
    const auto a1 = r1->mgr->AgreeRemotePrefix(v1);
    EXPECT_EQ(a0.status().code(), StatusCode::kFailedPrecondition) << a0.status();
    EXPECT_NE(a0.status().message().find("another tensor-parallel rank"), std::string::npos);
    EXPECT_EQ(a1.status().code(), StatusCode::kNotFound) << a1.status();
    EXPECT_NE(a1.status().message().find("sequence 9"), std::string::npos);
  }
  // The ranks pass different (tracked) sequences.
  {
    for (Engine* r : {r0.get(), r1.get()}) ASSERT_TRUE(r->mgr->AddSequence(8, prompt).ok());
    const SeqId a[] = {7};
    const SeqId b[] = {8};
    RemotePrefixVote v0 = r0->mgr->RemotePrefixOffer(a);
    RemotePrefixVote v1 = r1->mgr->RemotePrefixOffer(b);
    ReduceVotes({&v0, &v1});
    for (auto [r, v] : {std::pair{r0.get(), &v0}, std::pair{r1.get(), &v1}}) {
      const auto agreed = r->mgr->AgreeRemotePrefix(*v);
      EXPECT_EQ(agreed.status().code(), StatusCode::kFailedPrecondition) << agreed.status();
      EXPECT_NE(agreed.status().message().find("different sequences"), std::string::npos);
    }
  }
  // A vote of the wrong size, a uid twice.
  {
    const SeqId a[] = {7};
    RemotePrefixVote v = r0->mgr->RemotePrefixOffer(a);
    v.values.pop_back();
    EXPECT_EQ(r0->mgr->AgreeRemotePrefix(v).status().code(), StatusCode::kInvalidArgument);
    const SeqId twice[] = {7, 7};
    const auto refused = r0->mgr->AgreeRemotePrefix(r0->mgr->RemotePrefixOffer(twice));
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
  }
  // Nothing was agreed: the first Schedule takes nothing from the tier.
  EXPECT_EQ(r0->Prefill(7, prompt, "", /*add=*/false), 0);
  EXPECT_EQ(r0->mgr->remote_tier_stats().hits, 0);
}

// Two ranks, one thread each, whose collectives meet in memory: the element-wise minimum.
class ThreadPairCommunicator final : public Communicator {
 public:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int64_t arrived = 0;
    int64_t generation = 0;
    int64_t min = 0;
    int64_t result = 0;
  };
  ThreadPairCommunicator(Shared* shared, int rank) : shared_(shared), rank_(rank) {}
  int world_size() const override { return 2; }
  int rank() const override { return rank_; }
  Result<int64_t> AllReduceMin(int64_t value) override {
    std::unique_lock lock(shared_->mu);
    const int64_t generation = shared_->generation;
    shared_->min = shared_->arrived == 0 ? value : std::min(shared_->min, value);
    if (++shared_->arrived == 2) {
      shared_->arrived = 0;
      shared_->result = shared_->min;
      ++shared_->generation;
      shared_->cv.notify_all();
      return shared_->result;
    }
    shared_->cv.wait(lock, [&] { return shared_->generation != generation; });
    return shared_->result;
  }
  Status Barrier() override { return AllReduceMin(0).status(); }

 private:
  Shared* shared_;
  int rank_;
};

TEST(RemoteTierTest, AgreeRemotePrefixRunsOverTheEnginesCommunicator) {
  RedisServer server;
  const std::vector<TokenId> prompt = Prompt(100, 33);
  auto [r0, r1] = TwoRanksFetching(server, prompt, {21, 33});  // 5 and 8 blocks
  ASSERT_NE(r1, nullptr);
  ThreadPairCommunicator::Shared shared;
  Result<std::vector<int32_t>> agreed[2] = {InternalError("not run"), InternalError("not run")};
  Status misconfigured[2];
  {
    std::vector<std::thread> ranks;
    ranks.reserve(2);
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        Engine& r = rank == 0 ? *r0 : *r1;
        ThreadPairCommunicator comm(&shared, rank);
        const SeqId uids[] = {7};
        agreed[rank] = r.mgr->AgreeRemotePrefix(uids, comm);
        // A communicator whose rank is not the config's: that rank says so, the other refuses.
        ThreadPairCommunicator swapped(&shared, 1 - rank);
        misconfigured[rank] = rank == 1 ? r.mgr->AgreeRemotePrefix(uids, swapped).status()
                                        : r.mgr->AgreeRemotePrefix(uids, comm).status();
      });
    }
    for (std::thread& t : ranks) t.join();
  }
  for (const Result<std::vector<int32_t>>& a : agreed) {
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(*a, std::vector<int32_t>{5});
  }
  EXPECT_EQ(misconfigured[0].code(), StatusCode::kFailedPrecondition) << misconfigured[0];
  EXPECT_EQ(misconfigured[1].code(), StatusCode::kInvalidArgument) << misconfigured[1];
  EXPECT_NE(misconfigured[1].message().find("rank 0 of 2"), std::string::npos);
  // The first agreement stands.
  for (Engine* r : {r0.get(), r1.get()}) {
    EXPECT_EQ(r->Prefill(7, prompt, "", /*add=*/false), 5 * kBlockSize);
    r->ExpectPrefixData(7, prompt, 5);
  }
}

}  // namespace
}  // namespace blockkv
