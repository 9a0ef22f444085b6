// SPDX-License-Identifier: Apache-2.0
// The remote prefix tier's Redis client and value format (docs/remote_tier.md). Internal to the
// StateManager, which keys, verifies and places the blocks.
//
// Two worker threads, one for fetches and one for stores, each with its own lane: one connection
// (RedisConnection: TCP, unix socket or TLS) per server (one for a standalone server, one per
// master of a Redis Cluster, and for fetches one per replica read from while its master is down)
// and its own slot map (CLUSTER SLOTS, read at open and again after a MOVED or a connection error),
// so a fetch never waits behind a batch of SETs being sent. Stores are queued (bounded; a full
// queue drops and counts) and sent pipelined, up to kStoreBatch SETs per batch, grouped per node; a
// fetch (waited for at most timeout_ms) is one MGET on a standalone server and pipelined GETs per
// node on a cluster, every node's commands written before any reply is read, so k blocks cost one
// round trip per node; the fetches queued while one runs go together in the next pipeline. MOVED /
// ASK are followed (ASK with ASKING). A failed command or connect closes that node's connection and
// leaves the node alone for a backoff (50 ms doubling to 2 s while it keeps failing, reset by an
// answered command) during which its commands fail at once (stores dropped, fetched keys missing,
// or, on a cluster, read from the master's replica) while the other nodes keep serving.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "blockkv/prefix_cache.h"
#include "blockkv/remote_tier.h"
#include "blockkv/status.h"
#include "redis_connection.h"

struct redisReply;

namespace blockkv::internal {

struct RedisUrl {
  struct HostPort {
    std::string host;
    int port = 6379;
  };
  std::vector<HostPort> hosts;  // one for a standalone server; the seeds of a cluster
  bool cluster = false;
  bool unix_socket = false;  // unix://: hosts[0].host is the socket's path, its port 0
  // redis+sentinel://: the name of the master the sentinels (`hosts`) monitor; the tier serves
  // from that master, asking them for its address at each connect (following their failovers).
  std::string sentinel_master;
  std::string user;      // "" = the default user
  std::string password;  // "" = no AUTH
  int db = 0;
  bool tls = false;        // rediss://, rediss+cluster://, rediss+sentinel://: every connection TLS
  TlsOptions tls_options;  // their ?ssl_...= query
};
// redis://[user:password@]host:port[/db], redis+cluster://[user:password@]host:port[,host:port
// ...], redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db] (sentinels,
// port 26379 by default) or unix://[user:password@]/path/to/redis.sock[?db=N]; rediss (TLS) for
// any of the first three, with an optional query of ssl_ca_certs, ssl_certfile, ssl_keyfile,
// ssl_cert_reqs (none, optional, required), ssl_check_hostname and ssl_server_name;
// kInvalidArgument naming the URL and the part that is wrong. The user and password are
// percent-decoded; an IPv6 host is written in brackets ([::1]:6379) and kept without them.
Result<RedisUrl> ParseRedisUrl(std::string_view url);
// The cluster slot (0..16383) of `key`: CRC16 (XMODEM) of its hash tag (what is between the first
// '{' and the next '}', when not empty), else of the whole key, modulo 16384.
int KeySlot(std::string_view key);

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
// The value: header, tokens, payload, then the checksum, which SealRemoteValue writes once the
// payload is in (RemoteTier::Store's worker). EncodeRemoteHeader: what comes before the payload.
std::string EncodeRemoteHeader(const RemoteBlockMeta& meta);
inline constexpr size_t kRemoteChecksumBytes = sizeof(uint64_t);
void SealRemoteValue(std::string& value);
// The same over `size` bytes at `value`, writing the checksum at value + size.
void SealRemoteValue(char* value, size_t size);
// Whether `value`'s trailing checksum matches its bytes (the fetch worker hashes a value read
// from the socket as its bytes arrive, while the server still sends the next ones).
bool RemoteValueChecksumOk(std::string_view value);
// The offset of the payload when `value` verifies against `want` (every field equal, checksum
// right: `checksum_ok` says RemoteValueChecksumOk(value) was found true already); -1 otherwise.
int64_t VerifyRemoteValue(std::string_view value, const RemoteBlockMeta& want,
                          bool checksum_ok = false);
// "blockkv:{<fingerprint>:<namespace hash>:<block key>}": hex, one hash tag (one cluster slot).
std::string RemoteKey(uint64_t fingerprint, std::string_view ns, const BlockHash& key);

class RemoteTier;

// The buffers values are read into (fetches) and written into (stores), kept for the next ones
// (up to max_bytes): freed, malloc would give their pages back to the kernel and the next fetch
// or store would fault every page in again. Thread-safe: the fetch worker and the scheduling
// thread (NewStore) take; whoever drops the last view of a fetch, and the store worker once a
// value is sent, give back.
class ValueBuffers {
 public:
  struct Buffer {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
  };
  explicit ValueBuffers(size_t max_bytes) : max_bytes_(max_bytes) {}
  Buffer Take(size_t n);  // at least n bytes, contents unspecified
  void Give(Buffer b);

 private:
  const size_t max_bytes_;
  std::mutex mu_;
  std::multimap<size_t, std::unique_ptr<char[]>> free_;  // by capacity
  size_t bytes_ = 0;
};

// One fetch: its keys, and once `done`, what it got. Shared by the tier's queue, the state
// manager and RemoteFetchTicket; signals its own completion so that a ticket needs no tier.
struct RemoteFetchJob {
  struct Fetched {
    std::shared_ptr<const void> reply;
    std::vector<std::string_view> values;
    std::vector<uint8_t> failed;       // per key: 1 = the command failed (an error, not "none")
    std::vector<uint8_t> checksum_ok;  // per key: 1 = RemoteValueChecksumOk (empty: none checked)
    bool late = false;                 // the wait gave up after timeout_ms: every value ""
  };
  std::vector<std::string> keys;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu; `fetched` is final once it is set
  Fetched fetched;
  // Marks it done (the worker wrote `fetched` before) and wakes the waiters.
  void Finish();
  // Waits until done, at most `timeout`; whether it is done.
  bool WaitFor(std::chrono::milliseconds timeout);
  bool Done();
};

class RemoteTier {
 public:
  static constexpr size_t kStoreBatch = 64;
  // Keys of the queued fetches pipelined together (a single fetch larger than this goes alone).
  static constexpr size_t kFetchBatchKeys = 1024;

  // Connects (AUTH, SELECT) on the calling thread, then starts the workers. A server that cannot
  // be reached is no error: the tier opens unconnected (`unreachable()` says why) and its workers
  // connect when it answers, retrying after a backoff (every fetch misses and every store is
  // dropped meanwhile). kPermissionDenied: AUTH refused; kInvalidArgument: the URL or a field of
  // `config`, SELECT refused, or a cluster URL whose seed is not a cluster.
  static Result<std::unique_ptr<RemoteTier>> Open(const RemoteTierConfig& config);
  // Why Open could not connect ("" when it did).
  const std::string& unreachable() const { return unreachable_; }
  // Sends the queued stores (each bounded by the timeout), then stops; once a batch fails, the
  // rest are dropped (counted), so a stalled server holds it about two timeouts, not one a batch.
  ~RemoteTier();
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  // A SET to queue: the value's bytes in a buffer of the tier's pool (no fresh pages to fault
  // in, nothing zeroed first) with room for the checksum; given back to the pool once sent.
  struct PendingStore {
    std::string key;
    ValueBuffers::Buffer value;
    size_t size = 0;  // bytes of `value` written (the checksum's too, once sealed)
    std::string_view bytes() const { return {value.data.get(), size}; }
  };
  // A store of `size` bytes (EncodeRemoteHeader's and the payload) for the caller to write.
  PendingStore NewStore(std::string key, size_t size);
  // Queues `stores` (written, not sealed: the store worker seals them, off the scheduling thread)
  // under one lock and one wake-up, so that a prompt's blocks go out in one pipeline; those past
  // max_pending are dropped and counted. Leaves `stores` empty.
  void Store(std::vector<PendingStore>& stores);
  // What a fetch got: the values of its keys ("" for a key with none), views into `reply` (the
  // buffers they were read into: no copy), which the caller keeps as long as it reads them.
  using Fetched = RemoteFetchJob::Fetched;
  using FetchJob = RemoteFetchJob;
  // The values of `keys`, waiting at most timeout_ms: all "" on a timeout or an error (counted).
  Fetched Fetch(std::vector<std::string> keys);
  // Queues a fetch of `keys` and returns at once; the job is done when the fetch worker has run
  // it (every command bounded by timeout_ms), or failed when the tier closes first.
  std::shared_ptr<FetchJob> FetchAsync(std::vector<std::string> keys);
  // Late: takes `job` off the queue if it has not started, finishing it as failed (a started
  // one runs to its end).
  void Cancel(const std::shared_ptr<FetchJob>& job);
  // Waits until every store queued so far was sent or failed.
  void Drain();

  enum class Miss { kNone, kNotFound, kVerifyFailed, kError, kLate, kOtherRank };
  void CountLookup(int64_t hits, Miss miss);
  RemoteTierStats stats() const;
  const RedisUrl& url() const { return url_; }

 private:
  // How long a node that failed is left alone before it is tried again: doubling from the first
  // to the last while it keeps failing.
  static constexpr std::chrono::milliseconds kFirstBackoff{50};
  static constexpr std::chrono::milliseconds kMaxBackoff{2000};
  static constexpr size_t kMaxNodes = 4096;
  static constexpr size_t kNoNode = static_cast<size_t>(-1);
  // One server and the worker's connection to it.
  struct Node {
    std::string host;
    int port = 0;
    std::unique_ptr<RedisConnection> conn;  // null: not connected
    bool ever_connected = false;
    int32_t slots = 0;  // slots it owns (cluster)
    // Cluster: whether the map names it a replica (its connection is READONLY), and a master's
    // replicas (indices in the lane's nodes), read from when the master cannot be reached.
    bool replica = false;
    std::vector<int16_t> replicas;
    std::chrono::steady_clock::time_point retry_at{};
    std::chrono::milliseconds backoff = kFirstBackoff;  // waited after its next failure
  };
  // A node's command answered: its next failure waits the first backoff again.
  static void Served(Node& node) { node.backoff = kFirstBackoff; }
  // A node's connect or command failed at `now`: it is left alone for its backoff, which doubles.
  static void Failed(Node& node, std::chrono::steady_clock::time_point now) {
    node.retry_at = now + node.backoff;
    node.backoff = std::min<std::chrono::milliseconds>(node.backoff * 2, kMaxBackoff);
  }
  // A command of a fetch or a store batch that got MOVED or ASK.
  struct Redirect {
    size_t item = 0;
    bool ask = false;
    std::string host{};
    int port = 0;
  };
  RemoteTier(RemoteTierConfig config, RedisUrl url);
  // A connection to host:port with the URL's credentials (AUTH) and database (SELECT), over TLS
  // when the URL is rediss.
  Result<std::unique_ptr<RedisConnection>> Connect(const RedisUrl& url, const std::string& host,
                                                   int port) const;
  // Sentinel: asks the sentinels in turn for the master's address and points `node` at it.
  // kUnavailable when none answers, kInvalidArgument when those that answer know no such master.
  Status ResolveMaster(Node& node);
  // One worker's connections and slot map: only that worker touches them (and Start, before
  // the workers start).
  struct Lane {
    std::vector<std::unique_ptr<Node>> nodes;
    std::unordered_map<std::string, size_t> node_index;  // "host:port" -> index in nodes
    std::vector<int16_t> slots;  // cluster: slot -> index in nodes, -1 = none (empty: no map)
    bool refresh_needed = false;
    std::chrono::steady_clock::time_point refresh_at{};
    std::chrono::milliseconds refresh_backoff{50};
    std::atomic<int32_t> num_nodes{0};   // nodes owning slots (read by stats())
    std::atomic<bool> connected{false};  // every one of them connected (read by stats())
  };
  // Open's work on the calling thread, once per lane: the first seed that answers (a cluster: its
  // slot map, then a connection to every master; one that fails is retried later). Without
  // `connect`, only the lane's setup, for its worker to connect (kUnavailable).
  Status Start(Lane& lane, bool connect);
  void RunFetches();
  void RunStores();
  bool EnsureConnected(Lane& lane, Node& node);
  void Disconnect(Lane& lane, Node& node);  // after a failed command
  // A connected replica of `master` (cluster fetches, when the master cannot be reached), or
  // null; connects at most one (so a map listing many costs one connect per fetch at most).
  Node* ConnectedReplica(Lane& lane, const Node& master);
  // Its index in the lane's nodes, added when new; kNoNode when the lane knows kMaxNodes already
  // (a slot map or redirects naming more are no Redis Cluster's: a node index fits in int16_t).
  size_t NodeAt(Lane& lane, std::string_view host, int port);
  int NodeFor(const Lane& lane, std::string_view key) const;  // -1 = no node owns its slot
  Status RefreshSlots(Lane& lane);  // CLUSTER SLOTS from a connected node (or a seed)
  void MaybeRefresh(Lane& lane);
  void UpdateConnected(Lane& lane);
  // Sends `cmd` (GET or SET) for item i of `keys` to host:port after MOVED / ASK, following up to
  // a few redirects more; the reply, or null when it failed (counted).
  Reply FollowRedirect(Lane& lane, Redirect r, std::string_view cmd, std::string_view key,
                       std::string_view value);
  void DoFetch(Lane& lane, FetchJob& job);
  // A command `node` (null: a node a redirect named) refused with `reply` ("OOM ...", "NOPERM
  // ...", "READONLY ..."): a setting of the server, so every later one is refused too. Logged
  // once per command and kind (the reply's first word), with what to change where it is known.
  void WarnRefused(std::string_view command, const Node* node, std::string_view reply);
  // Whether a node of the batch could not be reached, written or read (its stores dropped).
  bool DoStores(Lane& lane, std::vector<PendingStore>& batch);

  const RemoteTierConfig config_;
  const RedisUrl url_;
  std::shared_ptr<TlsContext> tls_;  // rediss: made by Open, used by every connection
  std::string unreachable_;          // set by Open
  Lane fetch_lane_;
  Lane store_lane_;
  // Kept value buffers: enough for a fetch or a store batch of 64 blocks of 2 MiB (Llama-3-8B's).
  const std::shared_ptr<ValueBuffers> value_buffers_ =
      std::make_shared<ValueBuffers>(size_t{128} << 20);

  std::mutex mu_;
  std::condition_variable fetch_cv_;
  std::condition_variable store_cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<FetchJob>> fetches_;
  std::deque<PendingStore> stores_;
  bool storing_ = false;
  bool stop_ = false;
  std::vector<std::string> warned_;  // WarnRefused's kinds logged, under mu_

  std::atomic<int64_t> hits_{0}, misses_{0}, not_found_{0}, verify_failed_{0}, miss_error_{0},
      late_{0}, other_rank_{0}, fetched_bytes_{0}, stored_{0}, stored_bytes_{0}, dropped_{0},
      errors_{0}, reconnects_{0}, redirects_{0}, refreshes_{0}, replica_reads_{0};
  std::thread fetch_worker_;
  std::thread store_worker_;
};

}  // namespace blockkv::internal
