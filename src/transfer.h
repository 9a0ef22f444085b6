// SPDX-License-Identifier: Apache-2.0
// internal::TransferEndpoint: one engine's UCX side of sequence transfer (docs/transfer.md). It
// owns a ucp context, one worker, the registrations of the KV cache's memory (mapped and their
// rkeys packed once) and the thread that progresses the worker. Only that thread touches the
// worker: an import is handed to it and the caller waits for its result.
//
// The protocol, besides the one-sided gets (docs/transfer.md, "Ownership"): after its gets the
// receiver sends CLAIM(id, nonce, receiver); the sender answers GRANT (the export becomes granted:
// still pinned, its blocks held, other receivers refused) or a refusal naming why. The receiver
// commits on GRANT and sends DONE(id, nonce), which the sender acknowledges and only then lets
// the StateManager flush the sequence. A receiver that gives up before the grant sends ABORT,
// which makes a granted export pending again. Every message may be lost or its peer stop or die
// at any point: the sequence stays with the sender until DONE arrives, so it is never lost (a
// lost DONE leaves it on both engines until the sender's CancelExport).
#pragma once

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockkv/status.h"
#include "blockkv/transfer.h"

namespace blockkv::internal {

// One registered memory range: where it is in this process and its packed remote key.
struct TransferRegion {
  uint64_t base = 0;
  uint64_t length = 0;
  std::string rkey;
};

// One get of an import: `length` bytes at `remote` (inside the sender's region `region`) into
// `local` (inside the receiver's registered memory).
struct TransferGet {
  void* local = nullptr;
  uint64_t remote = 0;
  uint64_t length = 0;
  uint32_t region = 0;
};

// kInvalidArgument naming the field, its value and the limit: timeout_ms > 0,
// export_timeout_ms >= 0, 0 <= tp_rank < tp_size. (state_manager_transfer.cc)
Status ValidateTransferConfig(const TransferConfig& config);

class TransferEndpoint {
 public:
  // A memory range to register: [data, data + length).
  struct Memory {
    void* data = nullptr;
    size_t length = 0;
  };
  // Creates the context (features RMA, AM, WAKEUP; config's transports and devices), the worker,
  // registers `memory` and starts the progress thread. kUnavailable naming the UCX call and its
  // status text when UCX cannot start (no transport, a device that does not exist), or
  // kInvalidArgument for a bad config.
  static Result<std::unique_ptr<TransferEndpoint>> Open(const TransferConfig& config,
                                                        std::span<const Memory> memory);
  TransferEndpoint(const TransferEndpoint&) = delete;
  TransferEndpoint& operator=(const TransferEndpoint&) = delete;
  ~TransferEndpoint();  // stops the thread, then releases the worker, registrations and context

  // The worker's address (opaque bytes a peer connects to).
  const std::string& address() const;
  // The registrations, in the order of Open's `memory`.
  const std::vector<TransferRegion>& regions() const;

  // ---- sender ----
  // A new, random transfer id, recorded as a pending export.
  uint64_t AddExport();
  // What CancelExport found.
  enum class Cancelled : uint8_t {
    kPending,  // no receiver granted: forgotten, later claims are refused as cancelled
    kGranted,  // granted, no DONE yet: forgotten likewise; the receiver may hold the sequence
    kDone,     // its receiver's DONE arrived: the caller completes it (TakeDone has it)
    kUnknown,  // not an export of this endpoint
  };
  Cancelled CancelExport(uint64_t id);
  // Ends a pending export that no receiver was granted: true when it was pending (forgotten;
  // later claims are refused as expired after `after_ms`), false when it is granted or done.
  bool ExpireExport(uint64_t id, int32_t after_ms);
  // The exports whose receiver's DONE arrived since the last call (each is then forgotten).
  std::vector<uint64_t> TakeDone();
  // Cheap: whether TakeDone has anything (an atomic load).
  bool has_done() const;

  // ---- receiver ----
  // Connects to the worker at `peer_address`, unpacks `rkeys`, runs every get (all in flight at
  // once), then claims `transfer_id`. OK only when every get completed and the sender granted
  // the claim: the caller must then commit the sequence (it cannot fail), because DONE has been
  // sent (the sender frees its copy on it). Otherwise every get has finished or been cancelled
  // before it returns (nothing writes to the local memory afterwards) and, when the claim was
  // sent, ABORT too: kUnavailable naming what failed (the peer's death included), kUnavailable
  // "timed out" after timeout_ms, kFailedPrecondition when the sender refused the claim
  // (cancelled, expired, granted to another receiver, or imported already), kInvalidArgument
  // for a get naming a region that `rkeys` lacks.
  //
  // It runs on the progress thread (after any import started before it) and this returns at
  // once: its status once it is done. An import not started when the endpoint closes never
  // completes (its future is left broken).
  std::shared_future<Status> Import(std::string peer_address, std::vector<std::string> rkeys,
                                    std::vector<TransferGet> gets, uint64_t transfer_id,
                                    int32_t timeout_ms);

  class Impl;

 private:
  explicit TransferEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockkv::internal
