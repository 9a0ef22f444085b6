// SPDX-License-Identifier: Apache-2.0
// KV events on the wire: the prefix cache's events (prefix_cache.h) published over ZeroMQ in
// vLLM's format (vllm/distributed/kv_events.py), so that a router written for vLLM — llm-d's
// KV-cache indexer, Dynamo's KV router — subscribes to a blockkv engine unchanged.
//
//   StateManagerConfig config;
//   config.prefix_cache.enabled = true;
//   config.kv_events = KVEventsConfig{.endpoint = "tcp://*:5557",
//                                     .replay_endpoint = "tcp://*:5558"};
//   auto mgr = StateManager::Create(config, {llama}, CudaDevice(0).value());
//
// Every Schedule, PostForward, FlushSequence and ResetPrefixCache then publishes what the prefix
// cache queued during it as one batch.
//
// The wire format, field by field, and where blockkv differs from vLLM: docs/kv_events.md.
//
// Publishing never blocks the scheduling thread: a batch is moved into a bounded queue (a mutex
// held for a push) and a publisher thread encodes it (msgpack), sends it (PUB: topic, 8-byte
// big-endian sequence number, payload) and keeps it for replay (ROUTER). A batch that finds the
// queue full is dropped and counted; the StateManager's next batch that fits is then a resync
// (AllBlocksCleared, then every key the cache holds), so a subscriber's view is exact again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockkv/prefix_cache.h"
#include "blockkv/status.h"

namespace blockkv {

// vLLM's KVEventsConfig / ZmqEventPublisher arguments, same names and defaults.
struct KVEventsConfig {
  // PUB socket. As vLLM: bound when it has a wildcard ('*' or '::') or is ipc:// or inproc://,
  // connected otherwise ("tcp://*:5557" binds, "tcp://router:5557" connects). tcp://, ipc:// and
  // inproc:// only.
  std::string endpoint = "tcp://*:5557";
  // ROUTER socket for replay requests (always bound); "" = no replay.
  std::string replay_endpoint{};
  std::string topic{};             // first frame of every message
  size_t max_queue_size = 100000;  // batches waiting for the publisher thread (> 0)
  size_t buffer_steps = 10000;     // batches kept for replay (> 0)
  int32_t hwm = 100000;            // the PUB socket's send high-water mark (>= 0; 0 = none)
  int32_t data_parallel_rank = 0;  // EventBatch.data_parallel_rank (>= 0)
  // Block hashes as vLLM's int form (the key's low 64 bits, an unsigned msgpack int) instead of
  // its bytes form (the whole 128-bit key, 16 bytes big-endian: the default).
  bool int_block_hashes = false;

  // kInvalidArgument naming the field: an empty endpoint or one of another transport, sizes out
  // of range.
  Status Validate() const;
  friend bool operator==(const KVEventsConfig&, const KVEventsConfig&) = default;
};

struct KVEventsStats {
  uint64_t batches_queued = 0;     // batches handed to the publisher thread
  uint64_t batches_published = 0;  // batches sent (each has a sequence number)
  uint64_t batches_dropped = 0;    // batches that found the queue full
  uint64_t events_dropped = 0;     // events in them, and events the prefix cache's own queue lost
  uint64_t resyncs = 0;            // full-state batches sent after drops
  uint64_t replay_requests = 0;    // replay requests answered
};

// The msgpack payload of one KVEventBatch: [ts, [events...], data_parallel_rank]. Consecutive
// BlockStored events of one chain (same group, medium and adapter, each the previous one's child)
// become one BlockStored with several hashes, as vLLM sends a request's new blocks; consecutive
// BlockRemoved of one group and medium become one. `block_sizes[g]` is group g's block size: an
// event of a group outside it is kInvalidArgument.
Result<std::string> EncodeKVEventBatch(std::span<const CacheEvent> events, double ts,
                                       std::span<const int32_t> block_sizes,
                                       const KVEventsConfig& config);

// The ZeroMQ publisher. Thread-safe: Publish may be called from any thread; one publisher thread
// does the rest.
class KVEventPublisher {
 public:
  // Validates the config, creates and binds (or connects) the sockets and starts the thread.
  // kInvalidArgument (a bad config or endpoint: nothing is started), kAlreadyExists (the address
  // is in use), kUnavailable (any other socket error).
  static Result<std::unique_ptr<KVEventPublisher>> Create(KVEventsConfig config,
                                                          std::vector<int32_t> block_sizes);
  // Sends what is queued (for up to a second, as vLLM's shutdown), then closes the sockets.
  ~KVEventPublisher();
  KVEventPublisher(const KVEventPublisher&) = delete;
  KVEventPublisher& operator=(const KVEventPublisher&) = delete;

  // Queues one batch (`ts`: seconds since the epoch) without blocking; false (and counted) when
  // the queue is full. A batch with an event of a group past the block sizes given to Create is
  // dropped (and counted) by the publisher thread. `resync`: the batch is a full state after drops
  // (counted in stats).
  bool Publish(std::vector<CacheEvent> events, double ts, bool resync = false);
  // Whether Publish would queue a batch now (the scheduling thread skips building a resync that
  // would only be dropped).
  bool has_room() const;
  // Counts a batch of `events` the caller dropped without calling Publish (a resync owed while
  // the queue is full: the events it drained are covered by the resync to come).
  void CountDroppedBatch(uint64_t events);
  // Counts events lost before they reached Publish (the prefix cache's own queue overflowing).
  void CountDropped(uint64_t events);

  KVEventsStats stats() const;
  const KVEventsConfig& config() const;
  // The addresses the sockets are bound to, ports resolved ("tcp://127.0.0.1:*" binds any free
  // port); the endpoint as given when the PUB socket connects; "" for no replay socket.
  std::string endpoint() const;
  std::string replay_endpoint() const;
  // Blocks until the publisher thread has sent every batch queued so far (tests, shutdown).
  void Flush();
  // Tests only: while paused, the publisher thread takes nothing from the queue, so that a
  // small queue fills deterministically.
  void PauseForTesting(bool paused);

 private:
  class Impl;
  explicit KVEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockkv
