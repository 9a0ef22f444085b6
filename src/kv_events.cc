// SPDX-License-Identifier: Apache-2.0
// KV events on the wire (kv_events.h, docs/kv_events.md): the msgpack encoding of a KVEventBatch
// and the ZeroMQ publisher thread, through libzmq's C API (no exceptions, as the library).
#include "blockkv/kv_events.h"

#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>

#include "internal/msgpack_writer.h"
#include "internal/strings.h"

namespace blockkv {
namespace {

using internal::MsgpackWriter;
using internal::StrCat;

bool HasTransport(std::string_view endpoint) {
  return endpoint.starts_with("tcp://") || endpoint.starts_with("ipc://") ||
         endpoint.starts_with("inproc://");
}

// vLLM's heuristic: bind a wildcard, ipc:// or inproc:// address, connect to anything else.
bool Binds(std::string_view endpoint) {
  return endpoint.find('*') != std::string_view::npos ||
         endpoint.find("::") != std::string_view::npos || endpoint.starts_with("ipc://") ||
         endpoint.starts_with("inproc://");
}

// vLLM's offset_endpoint_port: rank r > 0 publishes on port + r (tcp) or endpoint + "_dp{r}"
// (inproc), so that every data-parallel rank has its own socket.
std::string OffsetForRank(const std::string& endpoint, int32_t rank) {
  if (endpoint.empty() || rank == 0) return endpoint;
  if (endpoint.starts_with("inproc://")) return StrCat(endpoint, "_dp", rank);
  if (endpoint.starts_with("tcp://")) {
    const size_t colon = endpoint.rfind(':');
    const std::string_view port = std::string_view(endpoint).substr(colon + 1);
    if (colon > 5 && !port.empty() &&
        std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return StrCat(endpoint.substr(0, colon), ":", std::stol(std::string(port)) + rank);
    }
  }
  return endpoint;
}

void PutHash(MsgpackWriter& w, const BlockHash& h, bool as_int) {
  if (as_int) return w.Uint(h.lo);
  char bytes[16];
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    bytes[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  w.Bin(std::string_view(bytes, sizeof bytes));
}

// Whether `next` continues the BlockStored run that ends with `prev`.
bool Continues(const BlockStored& prev, const BlockStored& next) {
  return next.group == prev.group && next.medium == prev.medium &&
         next.adapter_id == prev.adapter_id && next.has_parent && next.parent == prev.hash;
}

bool SameRemoval(const BlockRemoved& a, const BlockRemoved& b) {
  return a.group == b.group && a.medium == b.medium;
}

}  // namespace

Status KVEventsConfig::Validate() const {
  if (endpoint.empty() || !HasTransport(endpoint)) {
    return InvalidArgumentError(StrCat("KVEventsConfig.endpoint = '", endpoint,
                                       "' is not a tcp://, ipc:// or inproc:// address"));
  }
  if (!replay_endpoint.empty() && !HasTransport(replay_endpoint)) {
    return InvalidArgumentError(StrCat("KVEventsConfig.replay_endpoint = '", replay_endpoint,
                                       "' is not a tcp://, ipc:// or inproc:// address"));
  }
  if (max_queue_size == 0) {
    return InvalidArgumentError("KVEventsConfig.max_queue_size = 0 must be > 0");
  }
  if (buffer_steps == 0) return InvalidArgumentError("KVEventsConfig.buffer_steps = 0 must be > 0");
  if (hwm < 0) return InvalidArgumentError(StrCat("KVEventsConfig.hwm = ", hwm, " must be >= 0"));
  if (data_parallel_rank < 0) {
    return InvalidArgumentError(
        StrCat("KVEventsConfig.data_parallel_rank = ", data_parallel_rank, " must be >= 0"));
  }
  return Status::Ok();
}

Result<std::string> EncodeKVEventBatch(std::span<const CacheEvent> events, double ts,
                                       std::span<const int32_t> block_sizes,
                                       const KVEventsConfig& config) {
  for (size_t i = 0; i < events.size(); ++i) {
    int group = 0;
    if (const auto* s = std::get_if<BlockStored>(&events[i])) group = s->group;
    if (const auto* r = std::get_if<BlockRemoved>(&events[i])) group = r->group;
    if (group < 0 || static_cast<size_t>(group) >= block_sizes.size()) {
      return InvalidArgumentError(StrCat("EncodeKVEventBatch: event ", i, " names cache group ",
                                         group, ", block_sizes has ", block_sizes.size()));
    }
  }
  // Runs [begin, end) of events that become one wire event.
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < events.size();) {
    size_t j = i + 1;
    if (const auto* s = std::get_if<BlockStored>(&events[i])) {
      for (const BlockStored* prev = s; j < events.size(); ++j) {
        const auto* next = std::get_if<BlockStored>(&events[j]);
        if (next == nullptr || !Continues(*prev, *next)) break;
        prev = next;
      }
    } else if (const auto* r = std::get_if<BlockRemoved>(&events[i])) {
      while (j < events.size()) {
        const auto* next = std::get_if<BlockRemoved>(&events[j]);
        if (next == nullptr || !SameRemoval(*r, *next)) break;
        ++j;
      }
    }
    runs.emplace_back(i, j);
    i = j;
  }
  std::string out;
  MsgpackWriter w(&out);
  w.Array(3);  // KVEventBatch: ts, events, data_parallel_rank
  w.Float64(ts);
  w.Array(runs.size());
  const bool as_int = config.int_block_hashes;
  for (const auto& [begin, end] : runs) {
    if (const auto* first = std::get_if<BlockStored>(&events[begin])) {
      w.Array(10);
      w.Str("BlockStored");
      w.Array(end - begin);  // block_hashes
      size_t tokens = 0;
      for (size_t k = begin; k < end; ++k) {
        const auto& e = std::get<BlockStored>(events[k]);
        PutHash(w, e.hash, as_int);
        tokens += e.tokens.size();
      }
      if (first->has_parent) {  // parent_block_hash
        PutHash(w, first->parent, as_int);
      } else {
        w.Nil();
      }
      w.Array(tokens);  // token_ids
      for (size_t k = begin; k < end; ++k) {
        for (const TokenId t : std::get<BlockStored>(events[k]).tokens) w.Int(t);
      }
      w.Int(block_sizes[static_cast<size_t>(first->group)]);  // block_size
      if (first->adapter_id != 0) {                           // lora_id
        w.Int(first->adapter_id);
      } else {
        w.Nil();
      }
      w.Str(CacheMediumName(first->medium));  // medium
      w.Nil();                                // lora_name
      w.Nil();                                // extra_keys
      w.Int(first->group);                    // group_idx
    } else if (const auto* removed = std::get_if<BlockRemoved>(&events[begin])) {
      w.Array(4);
      w.Str("BlockRemoved");
      w.Array(end - begin);
      for (size_t k = begin; k < end; ++k)
        PutHash(w, std::get<BlockRemoved>(events[k]).hash, as_int);
      w.Str(CacheMediumName(removed->medium));
      w.Int(removed->group);
    } else {
      w.Array(1);
      w.Str("AllBlocksCleared");
    }
  }
  w.Int(config.data_parallel_rank);
  return out;
}

// ---- the publisher ----------------------------------------------------------------------------

class KVEventPublisher::Impl {
 public:
  Impl(KVEventsConfig config, std::vector<int32_t> block_sizes)
      : config_(std::move(config)), block_sizes_(std::move(block_sizes)) {}

  ~Impl() {
    if (thread_.joinable()) {
      // As vLLM's shutdown: up to a second for what is queued, then stop.
      {
        std::unique_lock lock(mu_);
        paused_ = false;
        cv_.notify_all();
        done_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return queue_.empty(); });
        stop_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
    if (pub_ != nullptr) zmq_close(pub_);
    if (replay_ != nullptr) zmq_close(replay_);
    if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  }

  Status Open() {
    ctx_ = zmq_ctx_new();
    if (ctx_ == nullptr) return UnavailableError(StrCat("zmq_ctx_new: ", zmq_strerror(errno)));
    pub_ = zmq_socket(ctx_, ZMQ_PUB);
    if (pub_ == nullptr) return UnavailableError(StrCat("zmq_socket: ", zmq_strerror(errno)));
    const int linger = 0;
    zmq_setsockopt(pub_, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(pub_, ZMQ_SNDHWM, &config_.hwm, sizeof config_.hwm);
    const std::string endpoint = OffsetForRank(config_.endpoint, config_.data_parallel_rank);
    if (Binds(endpoint)) {
      BLOCKKV_RETURN_IF_ERROR(Bind(pub_, "endpoint", endpoint, &endpoint_));
    } else {
      if (zmq_connect(pub_, endpoint.c_str()) != 0) {
        return SocketError("endpoint", endpoint, "zmq_connect");
      }
      endpoint_ = endpoint;
    }
    if (!config_.replay_endpoint.empty()) {
      replay_ = zmq_socket(ctx_, ZMQ_ROUTER);
      if (replay_ == nullptr) return UnavailableError(StrCat("zmq_socket: ", zmq_strerror(errno)));
      zmq_setsockopt(replay_, ZMQ_LINGER, &linger, sizeof linger);
      // A request is three short frames: a peer sending a larger one is disconnected by ZeroMQ
      // before it is read into memory.
      const int64_t max_frame = kMaxReplayFrameBytes;
      zmq_setsockopt(replay_, ZMQ_MAXMSGSIZE, &max_frame, sizeof max_frame);
      BLOCKKV_RETURN_IF_ERROR(Bind(
          replay_, "replay_endpoint",
          OffsetForRank(config_.replay_endpoint, config_.data_parallel_rank), &replay_endpoint_));
    }
    thread_ = std::thread([this] { Run(); });
    return Status::Ok();
  }

  bool Publish(std::vector<CacheEvent> events, double ts, bool resync) {
    {
      std::lock_guard lock(mu_);
      if (queue_.size() >= config_.max_queue_size) {
        ++stats_.batches_dropped;
        // A resync's events are the state, not lost ones; its caller counts what it replaced.
        if (!resync) stats_.events_dropped += events.size();
        return false;
      }
      queue_.push_back(Batch{std::move(events), ts});
      ++stats_.batches_queued;
      if (resync) ++stats_.resyncs;
      // Waking the thread is a system call: once a millisecond at most (or when the queue is half
      // full); otherwise its own 5 ms timeout picks the batch up.
      const auto now = std::chrono::steady_clock::now();
      if (now - last_wake_ < kWakeInterval && queue_.size() * 2 < config_.max_queue_size) {
        return true;
      }
      last_wake_ = now;
    }
    cv_.notify_one();
    return true;
  }

  void CountDropped(uint64_t events) {
    std::lock_guard lock(mu_);
    stats_.events_dropped += events;
  }
  void CountDroppedBatch(uint64_t events) {
    std::lock_guard lock(mu_);
    ++stats_.batches_dropped;
    stats_.events_dropped += events;
  }
  bool has_room() const {
    std::lock_guard lock(mu_);
    return queue_.size() < config_.max_queue_size;
  }

  KVEventsStats stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }

  void Flush() {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return paused_ || (queue_.empty() && !sending_); });
  }

  void Pause(bool paused) {
    {
      std::lock_guard lock(mu_);
      paused_ = paused;
    }
    cv_.notify_all();
    done_cv_.notify_all();
  }

  const KVEventsConfig& config() const { return config_; }
  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }

 private:
  struct Batch {
    std::vector<CacheEvent> events;
    double ts = 0;
  };

  Status SocketError(const char* field, const std::string& endpoint, const char* call) const {
    const int err = zmq_errno();
    const std::string what =
        StrCat("KVEventsConfig.", field, " = '", endpoint, "': ", call, ": ", zmq_strerror(err));
    if (err == EADDRINUSE) return AlreadyExistsError(what);
    if (err == EINVAL || err == EPROTONOSUPPORT || err == ENOCOMPATPROTO || err == EADDRNOTAVAIL ||
        err == ENODEV) {
      return InvalidArgumentError(what);
    }
    return UnavailableError(what);
  }

  Status Bind(void* socket, const char* field, const std::string& endpoint, std::string* bound) {
    if (zmq_bind(socket, endpoint.c_str()) != 0) return SocketError(field, endpoint, "zmq_bind");
    char last[256] = {};
    size_t size = sizeof last;
    if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, last, &size) == 0 && last[0] != '\0') {
      *bound = last;
    } else {
      *bound = endpoint;
    }
    return Status::Ok();
  }

  void Run() {
    std::vector<Batch> taken;
    while (true) {
      {
        std::unique_lock lock(mu_);
        cv_.wait_for(lock, kPoll, [&] { return stop_ || (!paused_ && !queue_.empty()); });
        if (stop_) return;
        if (!paused_) {
          taken.assign(std::make_move_iterator(queue_.begin()),
                       std::make_move_iterator(queue_.end()));
          queue_.clear();
          sending_ = !taken.empty();
        }
      }
      uint64_t published = 0;
      for (const Batch& batch : taken) published += Send(batch) ? 1 : 0;
      taken.clear();
      {
        std::lock_guard lock(mu_);
        stats_.batches_published += published;
        sending_ = false;
      }
      ServeReplays();
      done_cv_.notify_all();
    }
  }

  static void SeqBytes(int64_t seq, char out[8]) {
    const auto u = static_cast<uint64_t>(seq);
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(u >> (56 - 8 * i));
  }

  // False when the batch could not be encoded (and was counted as dropped).
  bool Send(const Batch& batch) {
    Result<std::string> encoded = EncodeKVEventBatch(batch.events, batch.ts, block_sizes_, config_);
    if (!encoded.ok()) {  // a caller's batch naming a group without a block size: dropped
      std::lock_guard lock(mu_);
      ++stats_.batches_dropped;
      stats_.events_dropped += batch.events.size();
      return false;
    }
    std::string payload = std::move(*encoded);
    const int64_t seq = next_seq_++;
    char seq_bytes[8];
    SeqBytes(seq, seq_bytes);
    // PUB never blocks: past the high-water mark ZeroMQ drops the message for that subscriber,
    // which sees a gap in the sequence numbers and asks for a replay.
    zmq_send(pub_, config_.topic.data(), config_.topic.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(pub_, seq_bytes, sizeof seq_bytes, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(pub_, payload.data(), payload.size(), ZMQ_DONTWAIT);
    buffer_.emplace_back(seq, std::move(payload));
    if (buffer_.size() > config_.buffer_steps) buffer_.pop_front();
    return true;
  }

  static constexpr size_t kReplayFrames = 3;  // identity, "", start
  static constexpr int64_t kMaxReplayFrameBytes = 1024;
  // Answers every waiting replay request as vLLM does: for a request [identity, "", start (8
  // bytes, big-endian)], every buffered batch with seq >= start as [identity, "", seq, payload],
  // then [identity, "", -1 (8 bytes), ""]. Malformed requests are ignored.
  void ServeReplays() {
    if (replay_ == nullptr) return;
    while (true) {
      std::vector<std::string> frames;
      while (true) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, replay_, ZMQ_DONTWAIT) < 0) {
          zmq_msg_close(&msg);
          if (frames.empty()) return;
          break;
        }
        if (frames.size() <= kReplayFrames) {  // the rest of a longer request: read, not kept
          frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
        }
        const bool more = zmq_msg_more(&msg) != 0;
        zmq_msg_close(&msg);
        if (!more) break;
      }
      if (frames.size() != kReplayFrames || frames[2].size() != 8) continue;
      uint64_t start = 0;
      for (const char c : frames[2]) start = (start << 8) | static_cast<uint8_t>(c);
      const std::string& id = frames[0];
      for (const auto& [seq, payload] : buffer_) {
        if (seq < static_cast<int64_t>(start)) continue;
        char seq_bytes[8];
        SeqBytes(seq, seq_bytes);
        zmq_send(replay_, id.data(), id.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(replay_, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(replay_, seq_bytes, sizeof seq_bytes, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(replay_, payload.data(), payload.size(), ZMQ_DONTWAIT);
      }
      {
        // Counted before the end marker goes, so that a client that has it sees the count.
        std::lock_guard lock(mu_);
        ++stats_.replay_requests;
      }
      char end[8];
      SeqBytes(-1, end);
      zmq_send(replay_, id.data(), id.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(replay_, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(replay_, end, sizeof end, ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(replay_, "", 0, ZMQ_DONTWAIT);
    }
  }

  const KVEventsConfig config_;
  const std::vector<int32_t> block_sizes_;
  void* ctx_ = nullptr;
  void* pub_ = nullptr;
  void* replay_ = nullptr;
  std::string endpoint_;
  std::string replay_endpoint_;
  std::thread thread_;

  static constexpr std::chrono::microseconds kWakeInterval{1000};
  static constexpr std::chrono::milliseconds kPoll{5};  // also how often replays are served

  // Shared with the publisher thread, under mu_.
  mutable std::mutex mu_;
  std::condition_variable cv_;       // work for the publisher thread
  std::condition_variable done_cv_;  // the publisher thread emptied the queue
  std::deque<Batch> queue_;
  KVEventsStats stats_;
  bool stop_ = false;
  bool paused_ = false;
  bool sending_ = false;
  std::chrono::steady_clock::time_point last_wake_{};

  // The publisher thread's own.
  int64_t next_seq_ = 0;
  std::deque<std::pair<int64_t, std::string>> buffer_;
};

Result<std::unique_ptr<KVEventPublisher>> KVEventPublisher::Create(
    KVEventsConfig config, std::vector<int32_t> block_sizes) {
  BLOCKKV_RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>(std::move(config), std::move(block_sizes));
  BLOCKKV_RETURN_IF_ERROR(impl->Open());  // on failure ~Impl closes what was opened
  return std::unique_ptr<KVEventPublisher>(new KVEventPublisher(std::move(impl)));
}

KVEventPublisher::KVEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KVEventPublisher::~KVEventPublisher() = default;

bool KVEventPublisher::Publish(std::vector<CacheEvent> events, double ts, bool resync) {
  return impl_->Publish(std::move(events), ts, resync);
}
void KVEventPublisher::CountDropped(uint64_t events) { impl_->CountDropped(events); }
void KVEventPublisher::CountDroppedBatch(uint64_t events) { impl_->CountDroppedBatch(events); }
bool KVEventPublisher::has_room() const { return impl_->has_room(); }
KVEventsStats KVEventPublisher::stats() const { return impl_->stats(); }
const KVEventsConfig& KVEventPublisher::config() const { return impl_->config(); }
std::string KVEventPublisher::endpoint() const { return impl_->endpoint(); }
std::string KVEventPublisher::replay_endpoint() const { return impl_->replay_endpoint(); }
void KVEventPublisher::Flush() { impl_->Flush(); }
void KVEventPublisher::PauseForTesting(bool paused) { impl_->Pause(paused); }

}  // namespace blockkv
