// SPDX-License-Identifier: Apache-2.0
// TransferEndpoint over UCX's ucp API (transfer.h, docs/transfer.md).
#include "transfer.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <csignal>
#include <cstdlib>
#include <optional>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>

#include "internal/strings.h"

namespace blockkv::internal {
namespace {

// Active message ids (docs/transfer.md, "Ownership").
constexpr unsigned kClaimId = 0x424b;   // receiver -> sender: ClaimHeader
constexpr unsigned kAnswerId = 0x424c;  // sender -> receiver: AnswerHeader (a verdict, an ack)
constexpr unsigned kDoneId = 0x424d;    // receiver -> sender: Ticket (it committed)
constexpr unsigned kAbortId = 0x424e;   // receiver -> sender: Ticket (it gave up before a grant)
constexpr unsigned kPingId = 0x424f;    // receiver -> sender: Ticket (before any get)
constexpr int kIdleWaitMs = 50;         // the thread's longest sleep (it also wakes on events)
constexpr int kCloseGraceMs = 1000;     // how long a close (or DONE's ack) waits for the peer
constexpr size_t kEndedKept = 4096;     // ended exports remembered, to say why a claim is refused

// One claim: the export's id and the receiver's nonce for this try.
struct Ticket {
  uint64_t id = 0;
  uint64_t nonce = 0;
};
struct ClaimHeader {
  uint64_t id = 0;
  uint64_t nonce = 0;
  uint64_t receiver = 0;  // the receiving endpoint (a random id): its own grant it may renew
};
// Verdicts of AnswerHeader.
enum Verdict : uint64_t {
  kRefusedUnknown = 0,    // no such export (ended long ago, or never)
  kGranted = 1,           // the receiver may commit; the sender holds its copy until DONE
  kRefusedGranted = 2,    // granted to another receiver that has not confirmed
  kRefusedExpired = 3,    // detail: the sender's export_timeout_ms
  kRefusedCancelled = 4,  // CancelExport
  kRefusedImported = 5,   // another receiver's DONE arrived
  kDoneAck = 6,           // detail 1: the sender will free its copy; 0: it keeps it (cancelled)
  kPong = 7,              // the answer to PING
};
struct AnswerHeader {
  uint64_t id = 0;
  uint64_t nonce = 0;
  uint64_t verdict = kRefusedUnknown;
  uint64_t detail = 0;
};

// What one import's callbacks update (on the progress thread).
struct ImportState {
  size_t outstanding = 0;
  ucs_status_t first_error = UCS_OK;
  ucs_status_t peer_error = UCS_OK;  // the endpoint's error handler

  void Done(ucs_status_t status) {
    --outstanding;
    if (status != UCS_OK && first_error == UCS_OK) first_error = status;
  }
};

// Test hook (docs/transfer.md, "Tests"): BLOCKKV_TRANSFER_TEST_STOP names a point at which the
// process stops itself (SIGSTOP), once, so that tests can kill or resume it exactly there.
enum class StopAt : uint8_t { kNever, kSenderBeforeGrant, kReceiverAfterGrant };

StopAt StopHookFromEnv() {
  const char* v = std::getenv("BLOCKKV_TRANSFER_TEST_STOP");  // NOLINT(concurrency-mt-unsafe)
  if (v == nullptr) return StopAt::kNever;
  const std::string_view s(v);
  if (s == "sender_before_grant") return StopAt::kSenderBeforeGrant;
  if (s == "receiver_after_grant") return StopAt::kReceiverAfterGrant;
  return StopAt::kNever;
}

// Sends an active message and lets the request free itself: DONE, ABORT, the claim and the
// answers are best effort (a lost one leaves the sequence with the sender).
ucs_status_t SendAm(ucp_ep_h ep, unsigned id, const void* header, size_t length, bool reply) {
  ucp_request_param_t rp{};
  if (reply) {
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
  }
  const ucs_status_ptr_t req = ucp_am_send_nbx(ep, id, header, length, nullptr, 0, &rp);
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  if (req != nullptr) ucp_request_free(req);
  return UCS_OK;
}

Status UcxError(std::string_view call, ucs_status_t status) {
  return UnavailableError(StrCat("UCX ", call, ": ", ucs_status_string(status)));
}

using Clock = std::chrono::steady_clock;

std::string Hex64(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x0000000000000000";
  for (int i = 17; i >= 2; --i, v >>= 4) s[static_cast<size_t>(i)] = kDigits[v & 15];
  return s;
}

}  // namespace

class TransferEndpoint::Impl {
 public:
  ~Impl() { Close(); }

  Status Start(const TransferConfig& config, std::span<const Memory> memory);
  void Close();
  std::shared_future<Status> Import(std::string peer_address, std::vector<std::string> rkeys,
                                    std::vector<TransferGet> gets, uint64_t transfer_id,
                                    int32_t timeout_ms);

  uint64_t AddExport() {
    std::lock_guard lock(mu_);
    uint64_t id = 0;
    do {
      id = rng_();
    } while (id == 0 || exports_.contains(id) || ended_.contains(id));
    exports_.emplace(id, ExportState{});
    return id;
  }
  Cancelled CancelExport(uint64_t id) {
    std::lock_guard lock(mu_);
    const auto it = exports_.find(id);
    if (it == exports_.end()) {
      // Done and not taken yet: the caller completes it.
      return std::find(done_.begin(), done_.end(), id) != done_.end() ? Cancelled::kDone
                                                                      : Cancelled::kUnknown;
    }
    const bool granted = it->second.granted;
    exports_.erase(it);
    RememberEnded(id, kRefusedCancelled, 0);
    return granted ? Cancelled::kGranted : Cancelled::kPending;
  }
  bool ExpireExport(uint64_t id, int32_t after_ms) {
    std::lock_guard lock(mu_);
    const auto it = exports_.find(id);
    if (it == exports_.end() || it->second.granted) return false;
    exports_.erase(it);
    RememberEnded(id, kRefusedExpired, static_cast<uint64_t>(after_ms));
    return true;
  }
  std::vector<uint64_t> TakeDone() {
    std::lock_guard lock(mu_);
    std::vector<uint64_t> out;
    out.swap(done_);
    has_done_.store(false, std::memory_order_relaxed);
    return out;
  }
  bool has_done() const { return has_done_.load(std::memory_order_relaxed); }

  std::string address_;
  std::vector<TransferRegion> regions_;

 private:
  // The thread's loop: jobs, then progress, then sleep on the worker's event fd.
  void Run();
  void Post(std::function<void()> job);
  // On the thread: the sender's handlers of CLAIM, DONE and ABORT, and the receiver's of the
  // sender's answers.
  static ucs_status_t OnClaim(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnDone(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAbort(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnPing(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAnswer(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param);
  // Under mu_: why a claim of `id` is refused from now on.
  void RememberEnded(uint64_t id, uint64_t verdict, uint64_t detail) {
    if (ended_.size() >= kEndedKept) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
    if (ended_.insert_or_assign(id, std::pair{verdict, detail}).second) ended_order_.push_back(id);
  }
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void MaybeStop(StopAt at) {
    if (stop_at_ == at && !stopped_.exchange(true)) std::raise(SIGSTOP);
  }
  // On the thread.
  Status RunImport(std::string_view peer_address, std::span<const std::string> rkeys,
                   std::span<const TransferGet> gets, uint64_t transfer_id, int32_t timeout_ms);
  ucp_mem_h LocalMemh(const void* p, uint64_t length) const;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<ucp_mem_h> memh_;
  std::vector<Memory> memory_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex jobs_mu_;
  std::deque<std::function<void()>> jobs_;

  // Sender: the exports not done nor ended, by id. Guarded by mu_ (the caller's thread and the
  // progress thread), as the rest of the sender's state.
  struct ExportState {
    bool granted = false;
    uint64_t nonce = 0;     // the granted claim's
    uint64_t receiver = 0;  // the granted receiver
  };
  std::mutex mu_;
  std::unordered_map<uint64_t, ExportState> exports_;
  std::vector<uint64_t> done_;  // DONE arrived: the StateManager flushes them
  std::atomic<bool> has_done_{false};
  // Ended exports (cancelled, expired, imported): id -> {verdict, detail}, the last kEndedKept.
  std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> ended_;
  std::deque<uint64_t> ended_order_;
  std::mt19937_64 rng_{std::random_device{}()};

  StopAt stop_at_ = StopAt::kNever;
  std::atomic<bool> stopped_{false};

  // Receiver, on the thread only: whether endpoints ask for peer failure detection (until a
  // transport set without it refused one).
  bool peer_errors_ = true;
  // Receiver, on the thread only: this endpoint's id in its claims, the nonces of its tries,
  // the nonce of the import in progress (0: none) and the answers to it.
  uint64_t receiver_id_ = 0;
  ImportState* import_ = nullptr;  // the import in progress and its endpoint
  ucp_ep_h import_ep_ = nullptr;
  std::mt19937_64 nonce_rng_{std::random_device{}()};
  uint64_t awaiting_ = 0;
  std::optional<AnswerHeader> verdict_;
  std::optional<AnswerHeader> done_ack_;
  bool pong_ = false;
};

Status TransferEndpoint::Impl::Start(const TransferConfig& config, std::span<const Memory> memory) {
  stop_at_ = StopHookFromEnv();
  receiver_id_ = rng_();
  ucp_config_t* ucp_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &ucp_config);
  if (st != UCS_OK) return UcxError("ucp_config_read", st);
  const auto modify = [&](const char* name, const std::string& value) -> Status {
    if (value.empty()) return Status::Ok();
    const ucs_status_t s = ucp_config_modify(ucp_config, name, value.c_str());
    if (s != UCS_OK) {
      return InvalidArgumentError(
          StrCat("TransferConfig: UCX rejects ", name, "=\"", value, "\": ", ucs_status_string(s)));
    }
    return Status::Ok();
  };
  Status modified = modify("TLS", config.transports);
  if (modified.ok()) modified = modify("NET_DEVICES", config.devices);
  if (!modified.ok()) {
    ucp_config_release(ucp_config);
    return modified;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "blockkv";
  st = ucp_init(&params, ucp_config, &context_);
  ucp_config_release(ucp_config);
  if (st != UCS_OK) {
    context_ = nullptr;
    return UcxError(StrCat("ucp_init (transports \"", config.transports, "\", devices \"",
                           config.devices, "\")"),
                    st);
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread uses it
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return UcxError(StrCat("ucp_worker_create (transports \"", config.transports, "\", devices \"",
                           config.devices, "\")"),
                    st);
  }
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  st = ucp_worker_get_address(worker_, &address, &address_length);
  if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
  address_.assign(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker_, address);
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return UcxError("ucp_worker_get_efd", st);

  for (const Memory& m : memory) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = m.data;
    mp.length = m.length;
    ucp_mem_h memh = nullptr;
    st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK) {
      return UcxError(
          StrCat("ucp_mem_map of ", HumanBytes(static_cast<long double>(m.length)), " of KV cache"),
          st);
    }
    memh_.push_back(memh);
    memory_.push_back(m);
    void* rkey = nullptr;
    size_t rkey_length = 0;
    st = ucp_rkey_pack(context_, memh, &rkey, &rkey_length);
    if (st != UCS_OK) return UcxError("ucp_rkey_pack", st);
    regions_.push_back({.base = reinterpret_cast<uint64_t>(m.data),
                        .length = m.length,
                        .rkey = std::string(static_cast<const char*>(rkey), rkey_length)});
    ucp_rkey_buffer_release(rkey);
  }

  const std::pair<unsigned, ucp_am_recv_callback_t> handlers[] = {{kClaimId, &OnClaim},
                                                                  {kDoneId, &OnDone},
                                                                  {kAbortId, &OnAbort},
                                                                  {kPingId, &OnPing},
                                                                  {kAnswerId, &OnAnswer}};
  for (const auto& [id, cb] : handlers) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &hp);
    if (st != UCS_OK) return UcxError("ucp_worker_set_am_recv_handler", st);
  }
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

void TransferEndpoint::Impl::Close() {
  if (thread_.joinable()) {
    stop_.store(true);
    ucp_worker_signal(worker_);
    thread_.join();
  }
  for (ucp_mem_h memh : memh_) ucp_mem_unmap(context_, memh);
  memh_.clear();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  worker_ = nullptr;
  if (context_ != nullptr) ucp_cleanup(context_);
  context_ = nullptr;
}

void TransferEndpoint::Impl::Post(std::function<void()> job) {
  {
    std::lock_guard lock(jobs_mu_);
    jobs_.push_back(std::move(job));
  }
  ucp_worker_signal(worker_);
}

void TransferEndpoint::Impl::Run() {
  while (!stop_.load()) {
    std::deque<std::function<void()>> jobs;
    {
      std::lock_guard lock(jobs_mu_);
      jobs.swap(jobs_);
    }
    for (auto& job : jobs) job();
    if (ucp_worker_progress(worker_) != 0) continue;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    pollfd fd{.fd = efd_, .events = POLLIN, .revents = 0};
    poll(&fd, 1, kIdleWaitMs);
  }
}

ucs_status_t TransferEndpoint::Impl::OnClaim(void* arg, const void* header, size_t header_length,
                                             void* /*data*/, size_t /*length*/,
                                             const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  if (header_length != sizeof(ClaimHeader) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    return UCS_OK;  // not ours: nothing to answer
  }
  ClaimHeader claim;
  std::memcpy(&claim, header, sizeof(claim));
  AnswerHeader answer{.id = claim.id, .nonce = claim.nonce};
  {
    std::lock_guard lock(self->mu_);
    const auto it = self->exports_.find(claim.id);
    if (it == self->exports_.end()) {
      const auto ended = self->ended_.find(claim.id);
      if (ended != self->ended_.end()) {
        answer.verdict = ended->second.first;
        answer.detail = ended->second.second;
      }
    } else if (!it->second.granted || it->second.receiver == claim.receiver) {
      // Pending, or granted to this same receiver, which gave up on that grant (a receiver that
      // committed does not claim again: the uid is tracked there): the new claim replaces it.
      it->second = {.granted = true, .nonce = claim.nonce, .receiver = claim.receiver};
      answer.verdict = kGranted;
    } else {
      answer.verdict = kRefusedGranted;
    }
  }
  if (answer.verdict == kGranted) self->MaybeStop(StopAt::kSenderBeforeGrant);
  SendAm(param->reply_ep, kAnswerId, &answer, sizeof(answer), /*reply=*/false);
  return UCS_OK;
}

ucs_status_t TransferEndpoint::Impl::OnDone(void* arg, const void* header, size_t header_length,
                                            void* /*data*/, size_t /*length*/,
                                            const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  if (header_length != sizeof(Ticket)) return UCS_OK;
  Ticket done;
  std::memcpy(&done, header, sizeof(done));
  AnswerHeader ack{.id = done.id, .nonce = done.nonce, .verdict = kDoneAck, .detail = 0};
  {
    std::lock_guard lock(self->mu_);
    const auto it = self->exports_.find(done.id);
    if (it != self->exports_.end() && it->second.granted && it->second.nonce == done.nonce) {
      self->exports_.erase(it);
      self->RememberEnded(done.id, kRefusedImported, 0);
      self->done_.push_back(done.id);
      self->has_done_.store(true, std::memory_order_relaxed);
      ack.detail = 1;
    }
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) {
    SendAm(param->reply_ep, kAnswerId, &ack, sizeof(ack), /*reply=*/false);
  }
  return UCS_OK;
}

ucs_status_t TransferEndpoint::Impl::OnAbort(void* arg, const void* header, size_t header_length,
                                             void* /*data*/, size_t /*length*/,
                                             const ucp_am_recv_param_t* /*param*/) {
  auto* self = static_cast<Impl*>(arg);
  if (header_length != sizeof(Ticket)) return UCS_OK;
  Ticket abort;
  std::memcpy(&abort, header, sizeof(abort));
  std::lock_guard lock(self->mu_);
  const auto it = self->exports_.find(abort.id);
  // Only the grant it names: an older try's ABORT arriving late leaves a newer grant alone.
  if (it != self->exports_.end() && it->second.granted && it->second.nonce == abort.nonce) {
    it->second = ExportState{};  // pending again
  }
  return UCS_OK;
}

ucs_status_t TransferEndpoint::Impl::OnPing(void* arg, const void* header, size_t header_length,
                                            void* /*data*/, size_t /*length*/,
                                            const ucp_am_recv_param_t* param) {
  if (header_length != sizeof(Ticket) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    return UCS_OK;
  }
  auto* self = static_cast<Impl*>(arg);
  Ticket ping;
  std::memcpy(&ping, header, sizeof(ping));
  AnswerHeader pong{.id = ping.id, .nonce = ping.nonce, .verdict = kPong, .detail = 0};
  {
    // Under mu_, which ExportSequence's AddExport released after the KV was written: the gets this
    // thread serves next read that KV after it (a happens-before ThreadSanitizer sees too). An
    // export that ended is refused now, before the receiver reads anything.
    std::lock_guard lock(self->mu_);
    if (!self->exports_.contains(ping.id)) {
      pong.verdict = kRefusedUnknown;
      const auto ended = self->ended_.find(ping.id);
      if (ended != self->ended_.end()) {
        pong.verdict = ended->second.first;
        pong.detail = ended->second.second;
      }
    }
  }
  SendAm(param->reply_ep, kAnswerId, &pong, sizeof(pong), /*reply=*/false);
  return UCS_OK;
}

ucs_status_t TransferEndpoint::Impl::OnAnswer(void* arg, const void* header, size_t header_length,
                                              void* /*data*/, size_t /*length*/,
                                              const ucp_am_recv_param_t* /*param*/) {
  auto* self = static_cast<Impl*>(arg);
  if (header_length != sizeof(AnswerHeader)) return UCS_OK;
  AnswerHeader answer;
  std::memcpy(&answer, header, sizeof(answer));
  // Answers to an import that gave up already (it stopped waiting) are dropped.
  if (self->awaiting_ == 0 || answer.nonce != self->awaiting_) return UCS_OK;
  if (answer.verdict == kPong) {
    self->pong_ = true;
  } else if (answer.verdict == kDoneAck) {
    self->done_ack_ = answer;
  } else {
    self->verdict_ = answer;
  }
  return UCS_OK;
}

std::shared_future<Status> TransferEndpoint::Impl::Import(std::string peer_address,
                                                          std::vector<std::string> rkeys,
                                                          std::vector<TransferGet> gets,
                                                          uint64_t transfer_id,
                                                          int32_t timeout_ms) {
  // The job owns what the import reads (a std::function must be copyable: the promise is shared).
  auto done = std::make_shared<std::promise<Status>>();
  std::shared_future<Status> result = done->get_future().share();
  Post([this, done, peer_address = std::move(peer_address), rkeys = std::move(rkeys),
        gets = std::move(gets), transfer_id, timeout_ms] {
    done->set_value(RunImport(peer_address, rkeys, gets, transfer_id, timeout_ms));
  });
  return result;
}

ucp_mem_h TransferEndpoint::Impl::LocalMemh(const void* p, uint64_t length) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < memory_.size(); ++i) {
    const auto base = reinterpret_cast<uintptr_t>(memory_[i].data);
    if (at >= base && at - base <= memory_[i].length && length <= memory_[i].length - (at - base)) {
      return memh_[i];
    }
  }
  return nullptr;
}

namespace {

void OnGetDone(void* request, ucs_status_t status, void* user_data) {
  static_cast<ImportState*>(user_data)->Done(status);
  ucp_request_free(request);
}

// kFailedPrecondition: the sender refused `answer` (a refusal verdict), naming why.
Status Refusal(uint64_t transfer_id, const AnswerHeader& answer) {
  const std::string refused = StrCat("the sender refused the transfer ", Hex64(transfer_id));
  switch (answer.verdict) {
    case kRefusedGranted:
      return FailedPreconditionError(
          StrCat(refused,
                 ": it granted it to another receiver, which has not confirmed yet (the sender "
                 "keeps it until that receiver confirms or aborts, or its CancelExport)"));
    case kRefusedExpired:
      return FailedPreconditionError(StrCat(
          refused, ": its export expired, unclaimed for ", answer.detail,
          " ms (the sender's TransferConfig.export_timeout_ms); the sender kept the sequence"));
    case kRefusedCancelled:
      return FailedPreconditionError(
          StrCat(refused, ": its export was cancelled (CancelExport); the sender kept it"));
    case kRefusedImported:
      return FailedPreconditionError(StrCat(refused, ": another receiver imported it already"));
    default:
      return FailedPreconditionError(
          StrCat(refused,
                 ": it has no such export (cancelled or imported long ago, or the sender "
                 "restarted)"));
  }
}

}  // namespace

void TransferEndpoint::Impl::OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // Only the import in progress: a closed endpoint's late error (its close was not waited for to
  // the end) has no import to fail.
  auto* self = static_cast<Impl*>(arg);
  if (self->import_ == nullptr || ep != self->import_ep_) return;
  if (self->import_->peer_error == UCS_OK) self->import_->peer_error = status;
}

Status TransferEndpoint::Impl::RunImport(std::string_view peer_address,
                                         std::span<const std::string> rkeys,
                                         std::span<const TransferGet> gets, uint64_t transfer_id,
                                         int32_t timeout_ms) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  ImportState state;
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = &OnPeerError;
  ep_params.err_handler.arg = this;
  ucp_ep_h ep = nullptr;
  ucs_status_t st = UCS_ERR_UNREACHABLE;
  if (peer_errors_) st = ucp_ep_create(worker_, &ep_params, &ep);
  if (st == UCS_ERR_UNREACHABLE) {
    peer_errors_ = false;  // once per engine: UCX logs the failed try as an ERROR
    // UCX 1.13's shared-memory transports cannot detect a peer's death (no peer failure
    // handler): without it, a dead sender shows as a failed get or the timeout.
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(worker_, &ep_params, &ep);
  }
  if (st != UCS_OK) return UcxError("ucp_ep_create (connecting to the sender)", st);
  import_ = &state;
  import_ep_ = ep;

  Status status;
  std::vector<ucp_rkey_h> unpacked;
  for (size_t i = 0; i < rkeys.size() && status.ok(); ++i) {
    ucp_rkey_h rkey = nullptr;
    st = ucp_ep_rkey_unpack(ep, rkeys[i].data(), &rkey);
    if (st != UCS_OK) {
      status = UcxError(StrCat("ucp_ep_rkey_unpack of the sender's region ", i), st);
    } else {
      unpacked.push_back(rkey);
    }
  }
  const auto timed_out = [&] { return Clock::now() >= deadline; };
  const auto failed = [&](std::string_view during) -> Status {
    if (state.peer_error != UCS_OK) {
      return UnavailableError(StrCat("the sender's endpoint failed ", during, ": ",
                                     ucs_status_string(state.peer_error)));
    }
    if (state.first_error != UCS_OK) {
      return UnavailableError(
          StrCat("a get from the sender failed: ", ucs_status_string(state.first_error)));
    }
    return UnavailableError(
        StrCat("timed out after ", timeout_ms, " ms (TransferConfig.timeout_ms) ", during));
  };

  // PING first, no get before its answer: a sender that does not answer (stopped) fails the
  // import with nothing in flight. Over shared memory without peer failure detection a get posted
  // to a sender that never answers can neither complete nor be cancelled (UCX 1.13's
  // ucp_request_cancel cancels receives only, and a forced close needs peer error handling), so
  // the import could not return; once the sender answered, cma's gets need nothing from it.
  const Ticket ticket{.id = transfer_id, .nonce = nonce_rng_() | 1};  // never 0 (0: none)
  awaiting_ = ticket.nonce;
  pong_ = false;
  verdict_.reset();
  done_ack_.reset();
  if (status.ok()) {
    st = SendAm(ep, kPingId, &ticket, sizeof(ticket), /*reply=*/true);
    if (st != UCS_OK) status = UcxError("ucp_am_send_nbx (the ping)", st);
    while (status.ok() && !pong_ && !verdict_) {
      ucp_worker_progress(worker_);
      if (pong_ || verdict_) break;
      if (state.peer_error != UCS_OK || timed_out()) {
        status = failed("waiting for the sender to answer");
      }
    }
    if (status.ok() && verdict_) status = Refusal(transfer_id, *verdict_);  // ended: no get
  }
  // Every get in flight at once.
  for (size_t i = 0; i < gets.size() && status.ok(); ++i) {
    const TransferGet& g = gets[i];
    if (g.region >= unpacked.size()) {
      status = InvalidArgumentError(
          StrCat("get ", i, " names region ", g.region, " of ", unpacked.size()));
      break;
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = &OnGetDone;
    rp.user_data = &state;
    if (ucp_mem_h memh = LocalMemh(g.local, g.length)) {
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      rp.memh = memh;
    }
    const ucs_status_ptr_t req =
        ucp_get_nbx(ep, g.local, g.length, g.remote, unpacked[g.region], &rp);
    if (UCS_PTR_IS_ERR(req)) {
      status = UcxError("ucp_get_nbx", UCS_PTR_STATUS(req));
    } else if (req != nullptr) {
      ++state.outstanding;
    }
  }
  // Wait for the gets.
  while (status.ok() && state.outstanding > 0) {
    ucp_worker_progress(worker_);
    if (state.peer_error != UCS_OK || state.first_error != UCS_OK || timed_out()) {
      status = failed("during the gets");
    }
  }
  if (status.ok() && state.first_error != UCS_OK) status = failed("during the gets");
  // Claim: the sender grants only a pending export (or renews this endpoint's own grant).
  bool claimed = false;  // the claim was sent: give up with ABORT
  bool granted = false;
  if (status.ok()) {
    const ClaimHeader claim{.id = ticket.id, .nonce = ticket.nonce, .receiver = receiver_id_};
    st = SendAm(ep, kClaimId, &claim, sizeof(claim), /*reply=*/true);
    if (st != UCS_OK) {
      status = UcxError("ucp_am_send_nbx (the claim)", st);
    } else {
      claimed = true;
    }
    while (status.ok() && !verdict_) {
      ucp_worker_progress(worker_);
      if (verdict_) break;  // a grant that arrived at the deadline still counts
      if (state.peer_error != UCS_OK || timed_out()) {
        status = failed("waiting for the sender to grant the claim");
      }
    }
    if (status.ok()) {
      if (verdict_->verdict == kGranted) {
        granted = true;
      } else {
        status = Refusal(transfer_id, *verdict_);
      }
    }
  }
  if (granted) {
    // Committed: the caller tracks the sequence (that cannot fail). DONE lets the sender free its
    // copy; its ack is waited for a while only so that a sender that is running has freed when
    // this returns. Without the ack (DONE or the ack lost, the sender stopped or dead) the sender
    // keeps a copy until its CancelExport: a duplicate, never a loss.
    MaybeStop(StopAt::kReceiverAfterGrant);
    if (SendAm(ep, kDoneId, &ticket, sizeof(ticket), /*reply=*/true) == UCS_OK) {
      const Clock::time_point ack_deadline =
          std::max(deadline, Clock::now() + std::chrono::milliseconds(kCloseGraceMs));
      while (!done_ack_ && state.peer_error == UCS_OK && Clock::now() < ack_deadline) {
        ucp_worker_progress(worker_);
      }
    }
  } else if (claimed && state.peer_error == UCS_OK) {
    // Gave up before a grant arrived: the sender may have granted already. ABORT makes the export
    // pending again (best effort: lost, the sender keeps it granted, and this receiver's next
    // claim renews the grant, another receiver's waits for the sender's CancelExport).
    SendAm(ep, kAbortId, &ticket, sizeof(ticket), /*reply=*/false);
  }
  awaiting_ = 0;

  for (ucp_rkey_h rkey : unpacked) ucp_rkey_destroy(rkey);
  // Close. With gets still in flight (a failure during them) it is forced, which cancels them;
  // otherwise it flushes the claim, DONE or ABORT. A peer that does not answer (stopped) is not
  // waited for beyond kCloseGraceMs: the request frees itself when UCX is done with it.
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // A failure before the claim has nothing to flush: forced too where the endpoint has peer error
  // handling (UCX allows a forced close only there).
  const bool nothing_to_flush =
      !status.ok() && !claimed && ep_params.err_mode == UCP_ERR_HANDLING_MODE_PEER;
  cp.flags = state.outstanding == 0 && state.peer_error == UCS_OK && !nothing_to_flush
                 ? 0
                 : UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t close = ucp_ep_close_nbx(ep, &cp);
  const Clock::time_point close_deadline = Clock::now() + std::chrono::milliseconds(kCloseGraceMs);
  if (UCS_PTR_IS_PTR(close)) {
    while (ucp_request_check_status(close) == UCS_INPROGRESS && Clock::now() < close_deadline) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(close);
  }
  // Nothing of this import writes to the local memory after it returns.
  while (state.outstanding > 0) ucp_worker_progress(worker_);
  import_ = nullptr;
  import_ep_ = nullptr;
  return status;
}

// ---- TransferEndpoint -------------------------------------------------------------------------

TransferEndpoint::TransferEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEndpoint::~TransferEndpoint() = default;

Result<std::unique_ptr<TransferEndpoint>> TransferEndpoint::Open(const TransferConfig& config,
                                                                 std::span<const Memory> memory) {
  auto impl = std::make_unique<Impl>();
  Status started = impl->Start(config, memory);
  if (!started.ok()) return started;
  return std::unique_ptr<TransferEndpoint>(new TransferEndpoint(std::move(impl)));
}

const std::string& TransferEndpoint::address() const { return impl_->address_; }
const std::vector<TransferRegion>& TransferEndpoint::regions() const { return impl_->regions_; }
uint64_t TransferEndpoint::AddExport() { return impl_->AddExport(); }
TransferEndpoint::Cancelled TransferEndpoint::CancelExport(uint64_t id) {
  return impl_->CancelExport(id);
}
bool TransferEndpoint::ExpireExport(uint64_t id, int32_t after_ms) {
  return impl_->ExpireExport(id, after_ms);
}
std::vector<uint64_t> TransferEndpoint::TakeDone() { return impl_->TakeDone(); }
bool TransferEndpoint::has_done() const { return impl_->has_done(); }
std::shared_future<Status> TransferEndpoint::Import(std::string peer_address,
                                                    std::vector<std::string> rkeys,
                                                    std::vector<TransferGet> gets,
                                                    uint64_t transfer_id, int32_t timeout_ms) {
  return impl_->Import(std::move(peer_address), std::move(rkeys), std::move(gets), transfer_id,
                       timeout_ms);
}

}  // namespace blockkv::internal
