// SPDX-License-Identifier: Apache-2.0
// A prefix-cache tier shared by every engine: full prompt blocks stored in Redis, below the
// device and host levels (docs/remote_tier.md). Given as StateManagerConfig::remote_tier with
// prefix caching on; the StateManager writes newly published full blocks through a bounded queue
// on a worker thread and, when a prefix lookup runs past its local matches, fetches the following
// blocks (one MGET) into fresh blocks. Every fetched value is verified (header, fingerprint, key,
// parent key, tokens, namespace, adapter, extra bytes, checksum): what does not verify is a
// counted miss, never data in the cache.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/sequence.h"

namespace blockkv {
namespace internal {
struct RemoteFetchJob;
}  // namespace internal

struct RemoteTierConfig {
  // A standalone server: redis://[user:password@]host:port[/db]  (a password alone:
  // redis://:password@host:port). A Redis Cluster: redis+cluster://[user:password@]host:port[,...]
  // (seed nodes; the slot map is read from the first that answers; database 0 only). User and
  // password are percent-decoded (p%40ss is p@ss); an IPv6 host is bracketed, [::1]:6379. A
  // server's unix socket: unix://[user:password@]/path/to/redis.sock[?db=N]. The master that
  // sentinels watch: redis+sentinel://[user:password@]host:port[,...]/master_name[/db]. A server
  // that cannot be reached at Create is no error: the tier is connected in the background once
  // it answers (one warning logged; lookups miss and stores are dropped until then).
  std::string url;
  // Identifies the model whose KV the blocks hold; part of every key's fingerprint, so two
  // models never share a block. The engine supplies it (e.g. "meta-llama/Llama-3-8B@rev").
  std::string model_id{};
  // Connect and command timeout; a lookup waits at most this long for a fetch.
  int32_t timeout_ms = 1000;
  // Stores waiting for the worker; a store past this is dropped and counted (never blocks). Each
  // holds its block's bytes until sent: Create refuses (kResourceExhausted) a max_pending whose
  // full queue would not fit in the host memory available.
  int32_t max_pending = 1024;
  // Part of the fingerprint: tensor-parallel rank and world size of this engine.
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  friend bool operator==(const RemoteTierConfig&, const RemoteTierConfig&) = default;
};

struct RemoteTierStats {
  int64_t hits = 0;    // blocks fetched, verified and placed in the cache
  int64_t misses = 0;  // lookups whose run stopped at a block the tier did not give; by cause:
  int64_t misses_not_found = 0;      // the server had no value for the key
  int64_t misses_verify_failed = 0;  // a value that did not verify (header, tokens, checksum)
  int64_t misses_error = 0;          // the command failed: connection lost, socket timeout, a node
                                     // down, a reply that was an error
  int64_t misses_late = 0;           // the lookup stopped waiting for the fetch after timeout_ms
  int64_t misses_other_rank = 0;     // another tensor-parallel rank lacked the block
                                     // (AgreeRemotePrefix)
  int64_t invalid = 0;               // fetched values that did not verify (= misses_verify_failed)
  int64_t fetched_bytes = 0;         // value bytes received
  int64_t stored = 0;                // blocks stored
  int64_t stored_bytes = 0;          // value bytes stored
  int64_t dropped = 0;               // stores dropped: queue full, or the server unreachable
  int64_t errors = 0;                // failed commands, connects and fetch timeouts
  int64_t reconnects = 0;            // connections made again after a failure (fetches and stores
                                     // have their own)
  int64_t redirects = 0;             // cluster MOVED / ASK replies followed
  int64_t topology_refreshes = 0;    // cluster slot maps read again (CLUSTER SLOTS) after open
  int64_t replica_reads = 0;         // keys asked of a cluster replica (READONLY) because
                                     // their slot's master could not be reached
  int32_t nodes = 0;                 // servers that own slots (1 for a standalone server)
  bool connected = false;            // both workers' connections to every such server are up
};

// A fetch from the remote tier in flight (StateManager::FetchRemotePrefix): the blocks of a
// prompt past its local matches, asked for ahead of its first Schedule, which takes what has
// arrived by then without waiting (docs/remote_tier.md, "Fetching ahead"). Copyable; outlives
// the manager safely (a fetch still queued when the tier closes is finished as failed).
class RemoteFetchTicket {
 public:
  RemoteFetchTicket() = default;  // nothing to fetch: done
  // Whether the values arrived (or the fetch failed: then Schedule counts a miss).
  bool Poll() const;
  // Blocks until Poll() is true: at most about the tier's timeout_ms per server it asks.
  void Wait() const;
  // Blocks asked for (0: nothing to fetch, e.g. the tier is off or holds nothing past the
  // local matches).
  int32_t blocks() const { return blocks_; }

 private:
  friend class StateManager;
  RemoteFetchTicket(std::shared_ptr<internal::RemoteFetchJob> job, int32_t blocks)
      : job_(std::move(job)), blocks_(blocks) {}
  std::shared_ptr<internal::RemoteFetchJob> job_;
  int32_t blocks_ = 0;
};

// StateManager::RemotePrefixOffer's result, for an engine that runs the all-reduce itself: the
// uids it was made for, and the values to reduce (element-wise minimum over the ranks, in place)
// before StateManager::AgreeRemotePrefix(vote). Opaque values: a header, then one per uid.
struct RemotePrefixVote {
  std::vector<SeqId> uids;
  std::vector<int64_t> values;
};

}  // namespace blockkv
