// SPDX-License-Identifier: Apache-2.0
// TransferEndpoint over UCX's ucp API (transfer.h, docs/transfer.md).
#include "transfer.h"

#include <poll.h>
#include <ucp/api/ucp.h>

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

// Active message ids.
constexpr unsigned kClaimId = 0x424b;    // receiver -> sender: header {transfer id}
constexpr unsigned kClaimedId = 0x424c;  // sender -> receiver: header {transfer id, accepted}
constexpr int kIdleWaitMs = 50;          // the thread's longest sleep (it also wakes on events)
constexpr int kCloseGraceMs = 1000;      // how long a graceful close waits for the peer

struct ClaimedHeader {
  uint64_t id = 0;
  uint64_t accepted = 0;
};

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
  Status Import(std::string_view peer_address, std::span<const std::string> rkeys,
                std::span<const TransferGet> gets, uint64_t transfer_id, int32_t timeout_ms);

  uint64_t AddExport() {
    std::lock_guard lock(mu_);
    uint64_t id = 0;
    do {
      id = rng_();
    } while (id == 0 || exports_.contains(id));
    exports_.emplace(id, false);
    return id;
  }
  bool CancelExport(uint64_t id) {
    std::lock_guard lock(mu_);
    const auto it = exports_.find(id);
    if (it == exports_.end()) {
      // Claimed and taken already, or never: the caller completes it by what TakeClaimed gave.
      for (const uint64_t c : claimed_) {
        if (c == id) return false;
      }
      return true;
    }
    if (it->second) return false;  // claimed: the receiver was accepted
    exports_.erase(it);
    return true;
  }
  std::vector<uint64_t> TakeClaimed() {
    std::lock_guard lock(mu_);
    std::vector<uint64_t> out;
    out.swap(claimed_);
    for (const uint64_t id : out) exports_.erase(id);
    has_claimed_.store(false, std::memory_order_relaxed);
    return out;
  }
  bool has_claimed() const { return has_claimed_.load(std::memory_order_relaxed); }

  std::string address_;
  std::vector<TransferRegion> regions_;

 private:
  // The thread's loop: jobs, then progress, then sleep on the worker's event fd.
  void Run();
  void Post(std::function<void()> job);
  // On the thread: the sender's handler of CLAIM, and the receiver's of CLAIMED.
  static ucs_status_t OnClaim(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnClaimed(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
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

  // Exports: id -> claimed. Guarded by mu_ (the caller's thread and the progress thread).
  std::mutex mu_;
  std::unordered_map<uint64_t, bool> exports_;
  std::vector<uint64_t> claimed_;
  std::atomic<bool> has_claimed_{false};
  std::mt19937_64 rng_{std::random_device{}()};

  // Receiver, on the thread only: whether endpoints ask for peer failure detection (until a
  // transport set without it refused one).
  bool peer_errors_ = true;
  // Receiver, on the thread only: CLAIMED answers by transfer id (1 accepted, 0 refused).
  std::unordered_map<uint64_t, int> answers_;
};

Status TransferEndpoint::Impl::Start(const TransferConfig& config, std::span<const Memory> memory) {
  if (config.timeout_ms <= 0) {
    return InvalidArgumentError(
        StrCat("TransferConfig.timeout_ms is ", config.timeout_ms, "; it must be > 0"));
  }
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
                                                                  {kClaimedId, &OnClaimed}};
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
  if (header_length != sizeof(uint64_t) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    return UCS_OK;  // not ours: nothing to answer
  }
  ClaimedHeader answer;
  std::memcpy(&answer.id, header, sizeof(answer.id));
  {
    std::lock_guard lock(self->mu_);
    const auto it = self->exports_.find(answer.id);
    if (it != self->exports_.end() && !it->second) {
      it->second = true;
      self->claimed_.push_back(answer.id);
      self->has_claimed_.store(true, std::memory_order_relaxed);
      answer.accepted = 1;
    }
  }
  // The header is copied before the call returns; the request (if any) frees itself.
  ucp_request_param_t rp{};
  const ucs_status_ptr_t req =
      ucp_am_send_nbx(param->reply_ep, kClaimedId, &answer, sizeof(answer), nullptr, 0, &rp);
  if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
  return UCS_OK;
}

ucs_status_t TransferEndpoint::Impl::OnClaimed(void* arg, const void* header, size_t header_length,
                                               void* /*data*/, size_t /*length*/,
                                               const ucp_am_recv_param_t* /*param*/) {
  auto* self = static_cast<Impl*>(arg);
  if (header_length != sizeof(ClaimedHeader)) return UCS_OK;
  ClaimedHeader answer;
  std::memcpy(&answer, header, sizeof(answer));
  self->answers_[answer.id] = answer.accepted == 1 ? 1 : 0;
  return UCS_OK;
}

Status TransferEndpoint::Impl::Import(std::string_view peer_address,
                                      std::span<const std::string> rkeys,
                                      std::span<const TransferGet> gets, uint64_t transfer_id,
                                      int32_t timeout_ms) {
  std::promise<Status> done;
  std::future<Status> result = done.get_future();
  Post([&] { done.set_value(RunImport(peer_address, rkeys, gets, transfer_id, timeout_ms)); });
  return result.get();
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

void OnGetDone(void* request, ucs_status_t status, void* user_data) {
  static_cast<ImportState*>(user_data)->Done(status);
  ucp_request_free(request);
}

void OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* state = static_cast<ImportState*>(arg);
  if (state->peer_error == UCS_OK) state->peer_error = status;
}

}  // namespace

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
  ep_params.err_handler.arg = &state;
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
  // Claim: the sender accepts only a pending export.
  if (status.ok()) {
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
    rp.cb.send = &OnGetDone;
    rp.user_data = &state;
    const ucs_status_ptr_t req =
        ucp_am_send_nbx(ep, kClaimId, &transfer_id, sizeof(transfer_id), nullptr, 0, &rp);
    if (UCS_PTR_IS_ERR(req)) {
      status = UcxError("ucp_am_send_nbx (the claim)", UCS_PTR_STATUS(req));
    } else if (req != nullptr) {
      ++state.outstanding;
    }
    while (status.ok() && !answers_.contains(transfer_id)) {
      ucp_worker_progress(worker_);
      if (state.peer_error != UCS_OK || state.first_error != UCS_OK || timed_out()) {
        status = failed("waiting for the sender to confirm");
      }
    }
    const auto answer = answers_.find(transfer_id);
    if (status.ok() && answer->second != 1) {
      status = FailedPreconditionError(
          StrCat("the sender refused the transfer ", Hex64(transfer_id),
                 ": its export was cancelled, or another receiver imported it already"));
    }
    if (answer != answers_.end()) answers_.erase(answer);
  }

  for (ucp_rkey_h rkey : unpacked) ucp_rkey_destroy(rkey);
  // Close; a failed import forces it, which cancels what is still in flight. Either way nothing
  // of this import is outstanding once the close is done.
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = status.ok() && state.peer_error == UCS_OK ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t close = ucp_ep_close_nbx(ep, &cp);
  const Clock::time_point close_deadline = Clock::now() + std::chrono::milliseconds(kCloseGraceMs);
  if (UCS_PTR_IS_PTR(close)) {
    while (ucp_request_check_status(close) == UCS_INPROGRESS) {
      ucp_worker_progress(worker_);
      // A graceful close the peer does not answer (it stopped right after accepting): stop
      // waiting. Every get and the claim have completed, so nothing of this import is left;
      // the request frees itself when UCX is done with it.
      if (cp.flags == 0 && Clock::now() >= close_deadline) break;
    }
    ucp_request_free(close);
  }
  while (state.outstanding > 0) ucp_worker_progress(worker_);
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
bool TransferEndpoint::CancelExport(uint64_t id) { return impl_->CancelExport(id); }
std::vector<uint64_t> TransferEndpoint::TakeClaimed() { return impl_->TakeClaimed(); }
bool TransferEndpoint::has_claimed() const { return impl_->has_claimed(); }
Status TransferEndpoint::Import(std::string_view peer_address, std::span<const std::string> rkeys,
                                std::span<const TransferGet> gets, uint64_t transfer_id,
                                int32_t timeout_ms) {
  return impl_->Import(peer_address, rkeys, gets, transfer_id, timeout_ms);
}

}  // namespace blockkv::internal
