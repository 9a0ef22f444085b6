// SPDX-License-Identifier: Apache-2.0
// internal::TransferEndpoint: one engine's UCX side of sequence transfer (docs/transfer.md). It
// owns a ucp context, one worker, the registrations of the KV cache's memory (mapped and their
// rkeys packed once) and the thread that progresses the worker. Only that thread touches the
// worker: an import is handed to it and the caller waits for its result.
//
// The protocol, besides the one-sided gets: the receiver sends CLAIM(transfer id) to the
// sender; the sender answers CLAIMED(id, accepted): accepted when the id is a pending export (it
// becomes claimed: the StateManager flushes the sequence at its next call), refused when it was
// cancelled or is unknown. The receiver commits the imported sequence only when accepted, so the
// blocks are never held twice and never freed while they are still being read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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
  // Forgets a pending export: true when it was pending (no receiver will be accepted for it
  // now), false when a receiver claimed it already (the caller completes it instead).
  bool CancelExport(uint64_t id);
  // The exports claimed since the last call (each is then forgotten).
  std::vector<uint64_t> TakeClaimed();
  // Cheap: whether TakeClaimed has anything (an atomic load).
  bool has_claimed() const;

  // ---- receiver ----
  // Connects to the worker at `peer_address`, unpacks `rkeys`, runs every get (all in flight at
  // once), then claims `transfer_id`. OK only when every get completed and the sender accepted
  // the claim. Otherwise every get has finished or been cancelled before it returns (nothing
  // writes to the local memory afterwards): kUnavailable naming what failed (the peer's death
  // included), kUnavailable "timed out" after timeout_ms, kFailedPrecondition when the sender
  // refused the claim (cancelled, or imported by another receiver), kInvalidArgument for a
  // get naming a region that `rkeys` lacks.
  Status Import(std::string_view peer_address, std::span<const std::string> rkeys,
                std::span<const TransferGet> gets, uint64_t transfer_id, int32_t timeout_ms);

  class Impl;

 private:
  explicit TransferEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockkv::internal
