// SPDX-License-Identifier: Apache-2.0
// The remote prefix tier's Redis client and value format (docs/remote_tier.md). Internal to the
// StateManager, which keys, verifies and places the blocks.
//
// One hiredis connection, owned by a worker thread: stores are queued (bounded; a full queue
// drops and counts) and sent pipelined, up to kStoreBatch SETs per round trip; a fetch is one
// MGET, queued ahead of the stores, that the scheduling thread waits for at most timeout_ms. A
// failed command closes the connection; the next command reconnects, and a failed reconnect
// waits a backoff (50 ms doubling to 2 s) during which commands fail at once (stores dropped,
// fetches empty).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "blockkv/prefix_cache.h"
#include "blockkv/remote_tier.h"
#include "blockkv/status.h"

struct redisContext;

namespace blockkv::internal {

struct RedisUrl {
  std::string host;
  int port = 6379;
  std::string user;      // "" = the default user
  std::string password;  // "" = no AUTH
  int db = 0;
};
// redis://[user:password@]host:port[/db]; kInvalidArgument naming what is wrong.
Result<RedisUrl> ParseRedisUrl(std::string_view url);

// What a block's value must say to be accepted (docs/remote_tier.md, "Values").
struct RemoteBlockMeta {
  uint64_t fingerprint = 0;
  BlockHash key;
  BlockHash parent_key;  // zeros for block 0
  uint32_t index = 0;    // block index in its sequence
  int64_t adapter_id = 0;
  std::string_view ns;
  std::string_view extra;
  std::span<const TokenId> tokens;
  uint64_t payload_bytes = 0;
};
inline constexpr uint32_t kRemoteValueVersion = 1;
// The value: header, tokens, payload (to be filled at payload_offset), then the checksum, which
// SealRemoteValue writes once the payload is in.
std::string EncodeRemoteValue(const RemoteBlockMeta& meta, size_t* payload_offset);
void SealRemoteValue(std::string& value);
// The offset of the payload when `value` verifies against `want` (every field equal, checksum
// right); -1 otherwise.
int64_t VerifyRemoteValue(std::string_view value, const RemoteBlockMeta& want);
// "blockkv:{<fingerprint>:<namespace hash>:<block key>}": hex, one hash tag (one cluster slot).
std::string RemoteKey(uint64_t fingerprint, std::string_view ns, const BlockHash& key);

class RemoteTier {
 public:
  static constexpr size_t kStoreBatch = 64;

  // Connects (AUTH, SELECT) on the calling thread, then starts the worker. kUnavailable: the
  // server cannot be reached; kPermissionDenied: AUTH refused; kInvalidArgument: the URL or a
  // field of `config`, or SELECT refused.
  static Result<std::unique_ptr<RemoteTier>> Open(const RemoteTierConfig& config);
  ~RemoteTier();  // sends the queued stores (each bounded by the timeout), then stops
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  // Queues a SET; false (and counted) when the queue is full.
  bool Store(std::string key, std::string value);
  // What a fetch got: the values of its keys ("" for a key with none), views into `reply`
  // (hiredis's own buffers: no copy), which the caller keeps as long as it reads them.
  struct Fetched {
    std::shared_ptr<const void> reply;
    std::vector<std::string_view> values;
  };
  // The values of `keys`, waiting at most timeout_ms: all "" on a timeout or an error (counted).
  Fetched Fetch(std::vector<std::string> keys);
  // Waits until every store queued so far was sent or failed.
  void Drain();

  void CountLookup(int64_t hits, bool missed, int64_t invalid);
  RemoteTierStats stats() const;
  const RedisUrl& url() const { return url_; }

 private:
  struct FetchJob {
    std::vector<std::string> keys;
    Fetched fetched;
    bool done = false;
  };
  RemoteTier(RemoteTierConfig config, RedisUrl url, redisContext* ctx);
  static Result<redisContext*> Connect(const RedisUrl& url, int32_t timeout_ms);
  void Run();
  bool EnsureConnected();  // worker only
  void Disconnect();       // worker only, after a failed command
  void DoFetch(FetchJob& job);
  void DoStores(std::vector<std::pair<std::string, std::string>>& batch);

  const RemoteTierConfig config_;
  const RedisUrl url_;
  redisContext* ctx_;  // worker only (and Open, before the worker starts)
  std::chrono::steady_clock::time_point retry_at_{};
  std::chrono::milliseconds backoff_{50};

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<FetchJob>> fetches_;
  std::deque<std::pair<std::string, std::string>> stores_;
  bool storing_ = false;
  bool stop_ = false;

  std::atomic<int64_t> hits_{0}, misses_{0}, invalid_{0}, fetched_bytes_{0}, stored_{0},
      stored_bytes_{0}, dropped_{0}, errors_{0}, reconnects_{0};
  std::atomic<bool> connected_{false};
  std::thread worker_;
};

}  // namespace blockkv::internal
