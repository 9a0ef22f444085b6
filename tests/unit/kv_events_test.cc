// SPDX-License-Identifier: Apache-2.0
// KV events on the wire (kv_events.h): the msgpack encoding against bytes derived by hand from
// the msgpack spec and vLLM's array_like layouts, the publisher's errors, sequence numbers,
// replay protocol and drops, and the StateManager's resync after a drop. The end-to-end check (a
// subscriber rebuilding the cache from the events alone) is python/tests/test_kv_events.py.
#include "blockkv/kv_events.h"

#include <gtest/gtest.h>
#include <zmq.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/msgpack_writer.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

std::string Bytes(std::initializer_list<int> bytes) {
  std::string out;
  for (const int b : bytes) out.push_back(static_cast<char>(b));
  return out;
}

std::string Hex(const std::string& s) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (const char c : s) {
    out.push_back(kDigits[static_cast<uint8_t>(c) >> 4]);
    out.push_back(kDigits[static_cast<uint8_t>(c) & 15]);
  }
  return out;
}

std::string Written(void (*write)(internal::MsgpackWriter&)) {
  std::string out;
  internal::MsgpackWriter w(&out);
  write(w);
  return out;
}

TEST(MsgpackWriterTest, IntegersTakeTheirShortestSpecForm) {
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(0); })), "00");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(127); })), "7f");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(128); })), "cc80");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(255); })), "ccff");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(256); })), "cd0100");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(65536); })), "ce00010000");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Uint(uint64_t{1} << 32); })), "cf0000000100000000");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Uint(~uint64_t{0}); })), "cfffffffffffffffff");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(-1); })), "ff");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(-32); })), "e0");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(-33); })), "d0df");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(-129); })), "d1ff7f");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(-32769); })), "d2ffff7fff");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Int(INT64_MIN); })), "d38000000000000000");
}

TEST(MsgpackWriterTest, FloatsStringsBinsAndArraysFollowTheSpec) {
  EXPECT_EQ(Hex(Written([](auto& w) { w.Float64(1.5); })), "cb3ff8000000000000");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Nil(); })), "c0");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Str("GPU"); })), "a3475055");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Str(std::string(31, 'x')); })).substr(0, 2), "bf");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Str(std::string(32, 'x')); })).substr(0, 4), "d920");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Str(std::string(256, 'x')); })).substr(0, 6), "da0100");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Bin("ab"); })), "c4026162");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Bin(std::string(256, 'x')); })).substr(0, 6), "c50100");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Array(15); })), "9f");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Array(16); })), "dc0010");
  EXPECT_EQ(Hex(Written([](auto& w) { w.Array(65536); })), "dd00010000");
}

const std::vector<int32_t> kBlockSizes = {2, 16};

TEST(EncodeKVEventBatchTest, AllBlocksClearedIsATaggedOneElementArray) {
  const std::vector<CacheEvent> events = {AllCleared{}};
  const std::string got = EncodeKVEventBatch(events, 1.5, kBlockSizes, KVEventsConfig{}).value();
  // [1.5, [["AllBlocksCleared"]], 0]
  EXPECT_EQ(Hex(got), Hex(Bytes({0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0})) +
                          Hex("AllBlocksCleared") + "00");
}

TEST(EncodeKVEventBatchTest, BlockStoredHasVllmsTenFieldsWithTheKeyAsSixteenBytes) {
  const std::vector<CacheEvent> events = {
      BlockStored{.hash = {.lo = 2, .hi = 1}, .tokens = {1, 200}, .group = 0}};
  KVEventsConfig config;
  config.data_parallel_rank = 3;
  const std::string got = EncodeKVEventBatch(events, 0.0, kBlockSizes, config).value();
  const std::string want =
      Bytes({0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x9a, 0xab}) + "BlockStored" +
      Bytes({0x91, 0xc4, 0x10, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2}) +  // hashes
      Bytes({0xc0}) +                                                              // parent
      Bytes({0x92, 0x01, 0xcc, 0xc8}) +                                            // tokens
      Bytes({0x02, 0xc0, 0xa3}) + "GPU" +  // block_size, lora_id, medium
      Bytes({0xc0, 0xc0, 0x00}) +          // lora_name, extra_keys, group_idx
      Bytes({0x03});                       // data_parallel_rank
  EXPECT_EQ(Hex(got), Hex(want));
}

TEST(EncodeKVEventBatchTest, AChainOfStoresBecomesOneEventAndIntHashesAreTheLow64Bits) {
  const BlockHash a{.lo = 10, .hi = 0xff}, b{.lo = 11, .hi = 0xee}, c{.lo = 300, .hi = 0};
  const std::vector<CacheEvent> events = {
      BlockStored{.hash = a, .tokens = {1, 2}, .adapter_id = 7, .group = 0},
      BlockStored{.hash = b, .has_parent = true, .parent = a, .tokens = {3, 4}, .adapter_id = 7},
      // Not b's child: a new event, with its parent.
      BlockStored{.hash = c, .has_parent = true, .parent = a, .tokens = {5, 6}, .adapter_id = 7},
  };
  KVEventsConfig config;
  config.int_block_hashes = true;
  const std::string got = EncodeKVEventBatch(events, 0.0, kBlockSizes, config).value();
  const std::string head = Bytes({0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x92});
  const std::string first = Bytes({0x9a, 0xab}) + "BlockStored" + Bytes({0x92, 10, 11, 0xc0}) +
                            Bytes({0x94, 1, 2, 3, 4, 0x02, 0x07, 0xa3}) + "GPU" +
                            Bytes({0xc0, 0xc0, 0x00});
  const std::string second =
      Bytes({0x9a, 0xab}) + "BlockStored" + Bytes({0x91, 0xcd, 0x01, 0x2c, 10}) +
      Bytes({0x92, 5, 6, 0x02, 0x07, 0xa3}) + "GPU" + Bytes({0xc0, 0xc0, 0x00});
  EXPECT_EQ(Hex(got), Hex(head + first + second + Bytes({0x00})));
}

TEST(EncodeKVEventBatchTest, RemovalsOfOneGroupAndMediumBecomeOneEvent) {
  const std::vector<CacheEvent> events = {
      BlockRemoved{.hash = {.lo = 1}, .group = 1, .medium = CacheMedium::kHost},
      BlockRemoved{.hash = {.lo = 2}, .group = 1, .medium = CacheMedium::kHost},
      BlockRemoved{.hash = {.lo = 3}, .group = 1, .medium = CacheMedium::kDevice},
  };
  KVEventsConfig config;
  config.int_block_hashes = true;
  const std::string got = EncodeKVEventBatch(events, 0.0, kBlockSizes, config).value();
  const std::string want = Bytes({0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x92}) + Bytes({0x94, 0xac}) +
                           "BlockRemoved" + Bytes({0x92, 1, 2, 0xa3}) + "CPU" + Bytes({0x01}) +
                           Bytes({0x94, 0xac}) + "BlockRemoved" + Bytes({0x91, 3, 0xa3}) + "GPU" +
                           Bytes({0x01}) + Bytes({0x00});
  EXPECT_EQ(Hex(got), Hex(want));
}

TEST(EncodeKVEventBatchTest, AGroupWithoutABlockSizeIsInvalidArgument) {
  const std::vector<CacheEvent> events = {AllCleared{},
                                          BlockRemoved{.hash = {.lo = 1}, .group = 2}};
  const Result<std::string> got = EncodeKVEventBatch(events, 0.0, kBlockSizes, KVEventsConfig{});
  ASSERT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("event 1 names cache group 2, block_sizes has 2"),
            std::string::npos)
      << got.status();
}

TEST(CacheMediumTest, NamesAreVllmsWhereVllmHasThem) {
  EXPECT_STREQ(CacheMediumName(CacheMedium::kDevice), "GPU");
  EXPECT_STREQ(CacheMediumName(CacheMedium::kHost), "CPU");
  EXPECT_STREQ(CacheMediumName(CacheMedium::kDisk), "DISK");
  EXPECT_STREQ(CacheMediumName(CacheMedium::kRemote), "REMOTE");
}

// ---- the publisher ----------------------------------------------------------------------------

KVEventsConfig Local(size_t max_queue_size = 100, size_t buffer_steps = 100) {
  KVEventsConfig c;
  c.endpoint = "tcp://127.0.0.1:*";
  c.replay_endpoint = "tcp://127.0.0.1:*";
  c.topic = "kv";
  c.max_queue_size = max_queue_size;
  c.buffer_steps = buffer_steps;
  return c;
}

TEST(KVEventPublisherTest, BadConfigsAreInvalidArgumentsNamingTheField) {
  KVEventsConfig c = Local();
  c.endpoint = "http://127.0.0.1:5557";
  Result<std::unique_ptr<KVEventPublisher>> p = KVEventPublisher::Create(c, {16});
  ASSERT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("KVEventsConfig.endpoint = 'http://127.0.0.1:5557'"),
            std::string::npos)
      << p.status();
  c = Local();
  c.endpoint = "tcp://*:notaport";
  p = KVEventPublisher::Create(c, {16});
  ASSERT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status();
  EXPECT_NE(p.status().message().find("tcp://*:notaport"), std::string::npos);
  c = Local();
  c.replay_endpoint = "udp://127.0.0.1:1";
  EXPECT_CODE(KVEventPublisher::Create(c, {16}), StatusCode::kInvalidArgument);
  c = Local();
  c.max_queue_size = 0;
  EXPECT_CODE(KVEventPublisher::Create(c, {16}), StatusCode::kInvalidArgument);
  c = Local();
  c.buffer_steps = 0;
  EXPECT_CODE(KVEventPublisher::Create(c, {16}), StatusCode::kInvalidArgument);
}

TEST(KVEventPublisherTest, AnEndpointInUseIsAlreadyExists) {
  KVEventsConfig c = Local();
  c.endpoint = "tcp://*:*";  // a wildcard: bound (vLLM's rule), on any free port
  Result<std::unique_ptr<KVEventPublisher>> first = KVEventPublisher::Create(c, {16});
  ASSERT_OK(first);
  const std::string bound = (*first)->endpoint();  // tcp://0.0.0.0:<port>
  c.endpoint = "tcp://*:" + bound.substr(bound.rfind(':') + 1);
  Result<std::unique_ptr<KVEventPublisher>> second = KVEventPublisher::Create(c, {16});
  ASSERT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status();
  EXPECT_NE(second.status().message().find(c.endpoint), std::string::npos);
  // The replay socket is always bound.
  c = Local();
  c.replay_endpoint = (*first)->replay_endpoint();
  EXPECT_CODE(KVEventPublisher::Create(c, {16}), StatusCode::kAlreadyExists);
}

// A DEALER talking to the replay socket as vLLM's subscriber example does.
class ReplayClient {
 public:
  explicit ReplayClient(const std::string& endpoint) : ctx_(zmq_ctx_new()) {
    socket_ = zmq_socket(ctx_, ZMQ_DEALER);
    const int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof linger);
    const int timeout_ms = 10000;  // a hang guard, not a timing assertion
    zmq_setsockopt(socket_, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    EXPECT_EQ(zmq_connect(socket_, endpoint.c_str()), 0);
  }
  ~ReplayClient() {
    zmq_close(socket_);
    zmq_ctx_term(ctx_);
  }
  // Sends ["", start] and returns the (seq, payload) frames up to the end marker.
  std::vector<std::pair<int64_t, std::string>> Replay(int64_t start) {
    char seq[8];
    for (int i = 0; i < 8; ++i)
      seq[i] = static_cast<char>(static_cast<uint64_t>(start) >> (56 - 8 * i));
    zmq_send(socket_, "", 0, ZMQ_SNDMORE);
    zmq_send(socket_, seq, 8, 0);
    std::vector<std::pair<int64_t, std::string>> out;
    while (true) {
      std::vector<std::string> frames = Receive();
      if (frames.size() != 3) {
        ADD_FAILURE() << "a replay message of " << frames.size() << " frames";
        return out;
      }
      EXPECT_EQ(frames[0], "");
      EXPECT_EQ(frames[1].size(), 8U);
      uint64_t s = 0;
      for (const char c : frames[1]) s = (s << 8) | static_cast<uint8_t>(c);
      if (static_cast<int64_t>(s) == -1) {
        EXPECT_EQ(frames[2], "");
        return out;
      }
      out.emplace_back(static_cast<int64_t>(s), frames[2]);
    }
  }

 private:
  std::vector<std::string> Receive() {
    std::vector<std::string> frames;
    while (true) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, socket_, 0) < 0) {
        zmq_msg_close(&msg);
        return frames;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      const bool more = zmq_msg_more(&msg) != 0;
      zmq_msg_close(&msg);
      if (!more) return frames;
    }
  }
  void* ctx_;
  void* socket_;
};

std::vector<CacheEvent> One(uint64_t lo) { return {BlockRemoved{.hash = {.lo = lo}, .group = 0}}; }

TEST(KVEventPublisherTest, ReplayReturnsBufferedBatchesFromTheStartSeqThenTheEndMarker) {
  Result<std::unique_ptr<KVEventPublisher>> p =
      KVEventPublisher::Create(Local(/*max_queue_size=*/100, /*buffer_steps=*/3), {16});
  ASSERT_OK(p);
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE((*p)->Publish(One(i), 2.0));
  (*p)->Flush();
  ReplayClient client((*p)->replay_endpoint());
  // Only the last buffer_steps = 3 batches are kept: seqs 2, 3, 4.
  const auto all = client.Replay(0);
  ASSERT_EQ(all.size(), 3U);
  for (size_t k = 0; k < all.size(); ++k) {
    EXPECT_EQ(all[k].first, static_cast<int64_t>(k + 2));
    EXPECT_EQ(Hex(all[k].second),
              Hex(*EncodeKVEventBatch(One(k + 2), 2.0, std::vector<int32_t>{16}, Local())));
  }
  const auto tail = client.Replay(4);
  ASSERT_EQ(tail.size(), 1U);
  EXPECT_EQ(tail[0].first, 4);
  EXPECT_TRUE(client.Replay(5).empty());
  (*p)->Flush();
  const KVEventsStats s = (*p)->stats();
  EXPECT_EQ(s.batches_published, 5U);
  EXPECT_EQ(s.replay_requests, 3U);
}

TEST(KVEventPublisherTest, APubSubscriberGetsTopicSequenceNumberAndPayloadFrames) {
  Result<std::unique_ptr<KVEventPublisher>> p = KVEventPublisher::Create(Local(), {16});
  ASSERT_OK(p);
  void* ctx = zmq_ctx_new();
  void* sub = zmq_socket(ctx, ZMQ_SUB);
  ASSERT_EQ(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "kv", 2), 0);
  ASSERT_EQ(zmq_connect(sub, (*p)->endpoint().c_str()), 0);
  // A SUB socket misses what is sent before its subscription reaches the publisher (ZeroMQ's
  // slow joiner): publish until one arrives, then check that the rest follow in order.
  std::vector<std::string> frames;
  uint64_t sent = 0;
  while (frames.empty()) {
    ASSERT_TRUE((*p)->Publish(One(sent++), 1.0));
    (*p)->Flush();
    zmq_pollitem_t item{sub, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, 50) <= 0) continue;
    for (bool more = true; more;) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      ASSERT_GE(zmq_msg_recv(&msg, sub, 0), 0);
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      more = zmq_msg_more(&msg) != 0;
      zmq_msg_close(&msg);
    }
  }
  ASSERT_EQ(frames.size(), 3U);
  EXPECT_EQ(frames[0], "kv");
  ASSERT_EQ(frames[1].size(), 8U);
  uint64_t seq = 0;
  for (const char c : frames[1]) seq = (seq << 8) | static_cast<uint8_t>(c);
  EXPECT_LT(seq, sent);
  EXPECT_EQ(Hex(frames[2]),
            Hex(*EncodeKVEventBatch(One(seq), 1.0, std::vector<int32_t>{16}, Local())));
  zmq_close(sub);
  zmq_ctx_term(ctx);
}

TEST(KVEventPublisherTest, AFullQueueDropsAndCountsWithoutBlocking) {
  Result<std::unique_ptr<KVEventPublisher>> p =
      KVEventPublisher::Create(Local(/*max_queue_size=*/2), {16});
  ASSERT_OK(p);
  (*p)->PauseForTesting(true);
  EXPECT_TRUE((*p)->Publish(One(0), 0.0));
  EXPECT_TRUE((*p)->Publish(One(1), 0.0));
  std::vector<CacheEvent> three = One(2);
  three.emplace_back(AllCleared{});
  three.emplace_back(AllCleared{});
  EXPECT_FALSE((*p)->Publish(std::move(three), 0.0));
  KVEventsStats s = (*p)->stats();
  EXPECT_EQ(s.batches_queued, 2U);
  EXPECT_EQ(s.batches_dropped, 1U);
  EXPECT_EQ(s.events_dropped, 3U);
  (*p)->PauseForTesting(false);
  (*p)->Flush();
  s = (*p)->stats();
  EXPECT_EQ(s.batches_published, 2U);
  // Sequence numbers are the published batches': no gap for the dropped one.
  ReplayClient client((*p)->replay_endpoint());
  const auto all = client.Replay(0);
  ASSERT_EQ(all.size(), 2U);
  EXPECT_EQ(all[1].first, 1);
}

// ---- the state manager ------------------------------------------------------------------------

KVCacheConfig Model() {
  return KVCacheConfig{.block_size = 4,
                       .cache_shape = {1, 1, 8},
                       .cache_dtype = DType::kFloat16,
                       .max_blocks_per_allocation_group = 16};
}

StateManagerConfig ManagerConfig(std::optional<KVEventsConfig> events, bool prefix = true) {
  StateManagerConfig c;
  c.max_tracked_sequences = 8;
  c.max_ragged_batch_size = 256;
  c.max_ragged_sequence_count = 8;
  c.memory_config = {.mode = AllocationMode::kAllocate, .size = 32};
  c.prefix_cache.enabled = prefix;
  c.kv_events = std::move(events);
  return c;
}

TEST(StateManagerKVEventsTest, KVEventsWithoutPrefixCachingIsInvalidAndStartsNothing) {
  auto m = StateManager::Create(ManagerConfig(Local(), /*prefix=*/false), {Model()}, CpuDevice());
  ASSERT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("kv_events needs prefix_cache.enabled"), std::string::npos);
}

TEST(StateManagerKVEventsTest, AnEndpointInUseFailsCreate) {
  Result<std::unique_ptr<KVEventPublisher>> holder = KVEventPublisher::Create(Local(), {4});
  ASSERT_OK(holder);
  KVEventsConfig c = Local();
  c.replay_endpoint = (*holder)->replay_endpoint();
  auto m = StateManager::Create(ManagerConfig(c), {Model()}, CpuDevice());
  ASSERT_EQ(m.status().code(), StatusCode::kAlreadyExists) << m.status();
  EXPECT_NE(
      m.status().message().find("StateManagerConfig.kv_events: KVEventsConfig.replay_endpoint"),
      std::string::npos)
      << m.status();
}

void Prefill(StateManager& mgr, SeqId uid, TokenId first) {
  std::vector<TokenId> prompt(9);
  std::iota(prompt.begin(), prompt.end(), first);
  ASSERT_OK(mgr.AddSequence(uid, prompt, {}));
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {9};
  ASSERT_OK(mgr.Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_OK(mgr.PostForward(uids));
}

TEST(StateManagerKVEventsTest, EachStepPublishesOneBatchAndADropLeadsToOneResync) {
  auto m = StateManager::Create(ManagerConfig(Local(/*max_queue_size=*/1)), {Model()}, CpuDevice());
  ASSERT_OK(m);
  StateManager& mgr = **m;
  KVEventPublisher* publisher = mgr.kv_event_publisher();
  ASSERT_NE(publisher, nullptr);
  Prefill(mgr, 1, 100);  // PostForward publishes blocks 0 and 1
  publisher->Flush();
  EXPECT_EQ(publisher->stats().batches_published, 1U);
  EXPECT_TRUE(mgr.DrainCacheEvents().events.empty());  // the manager drained them itself

  publisher->PauseForTesting(true);
  Prefill(mgr, 2, 200);  // queued
  Prefill(mgr, 3, 300);  // the queue is full: dropped
  KVEventsStats s = publisher->stats();
  EXPECT_EQ(s.batches_dropped, 1U);
  EXPECT_EQ(s.events_dropped, 2U);
  publisher->PauseForTesting(false);
  publisher->Flush();
  mgr.PublishKVEvents();  // nothing new queued, but a resync is owed
  publisher->Flush();
  s = publisher->stats();
  EXPECT_EQ(s.resyncs, 1U);
  EXPECT_EQ(s.batches_published, 3U);
  mgr.PublishKVEvents();  // nothing to send: no batch
  publisher->Flush();
  EXPECT_EQ(publisher->stats().batches_published, 3U);
  // The resync (seq 2) is [ts, [["AllBlocksCleared"], BlockStored...], 0], covering the 6 keys
  // cached now (the subscriber test checks it key by key).
  EXPECT_EQ(mgr.cached_keys(0).size(), 6U);
  ReplayClient client(publisher->replay_endpoint());
  const auto replayed = client.Replay(2);
  ASSERT_EQ(replayed.size(), 1U);
  EXPECT_EQ(replayed[0].first, 2);
  const std::string& resync = replayed[0].second;
  ASSERT_GT(resync.size(), 29U);
  EXPECT_EQ(resync.substr(11, 18), Bytes({0x91, 0xb0}) + "AllBlocksCleared");
}

}  // namespace
}  // namespace blockkv
