// SPDX-License-Identifier: Apache-2.0
// Sequence transfer between engines (disaggregated prefill and decode) over UCX's ucp API: the
// receiver reads the sender's KV blocks by one-sided gets from memory the sender registered.
//
//   StateManagerConfig config;
//   config.transfer = TransferConfig{};            // UCX picks the transports
//   auto prefill = StateManager::Create(config, {llama}, device);       // process A
//   ... schedule uid 7's prompt, PostForward ...
//   Result<std::vector<std::byte>> d = (*prefill)->ExportSequence(7);   // opaque bytes
//   ... send *d to the decode engine by any means ...
//   Result<Sequence*> seq = decode->ImportSequence(*d);                 // process B
//   // uid 7 is now tracked by the decode engine with its seen tokens and its KV; the prefill
//   // engine flushes it at its next Schedule (or CompleteExports) once B has confirmed (DONE).
//
// Flow, descriptor format and failure semantics: docs/transfer.md.
#pragma once

#include <cstdint>
#include <future>
#include <string>

#include "blockkv/status.h"

namespace blockkv {

// Where and how this engine's transfer endpoint (a UCX context, worker and progress thread,
// created by StateManager::Create) communicates. The KV cache's memory is registered with UCX
// once, at Create.
struct TransferConfig {
  // UCX transports, as UCX_TLS: "" lets UCX choose (every transport it finds), "tcp" only TCP,
  // "posix,sysv,cma,self" only shared memory. Both engines of a transfer need one in common.
  std::string transports{};
  // Network devices, as UCX_NET_DEVICES: "" all of them, "lo" only the loopback (engines on one
  // machine), "eth0", "mlx5_0:1". This is where the engine can be reached: the descriptor
  // carries the worker's address on these devices.
  std::string devices{};
  // How long ImportSequence waits for the whole transfer (connect, gets, the sender's grant), in
  // ms; > 0. Then at most 1 s more for DONE's acknowledgement and 1 s for closing the endpoint.
  int32_t timeout_ms = 10000;
  // How long an export waits for a receiver, in ms; >= 0, 0 = forever. A pending export that no
  // receiver was granted within it is cancelled by this engine at its next Schedule,
  // ScheduleBatch, CompleteExports or transfer call: the sequence is un-pinned and stays here
  // (nothing is freed), and an import of its descriptor is refused, naming the expiry. The
  // default is vLLM's NIXL connector's (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 120 s): a decode engine
  // normally imports within milliseconds of the export, so two minutes means its router or the
  // engine gave up, and the prefill engine gets its blocks back.
  int32_t export_timeout_ms = 120000;
  // This engine's tensor-parallel rank and world size: 0 <= tp_rank < tp_size. A descriptor
  // carries the sender's; ImportSequence refuses one from another rank or world size (each rank's
  // StateManager holds its own shard of the KV, so ranks transfer rank to rank).
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  friend bool operator==(const TransferConfig&, const TransferConfig&) = default;
};

// What StateManager::CancelExport took back (docs/transfer.md, "Ownership").
enum class CancelledExport : uint8_t {
  // No receiver had been granted the sequence: it is only here.
  kUnclaimed,
  // A receiver had been granted it and its confirmation (DONE) never came: that receiver may hold
  // the sequence too (it committed and the DONE was lost, or it stopped or died after the grant)
  // or not (the grant was lost, or it gave up and its ABORT was lost). This engine keeps its copy
  // either way; the caller, who knows where the request went, decides which copy to keep.
  kGranted,
};

// What StateManager::StartImport returns: the transfer of one sequence into this engine, running
// on the transfer thread (docs/transfer.md, "Importing without waiting"). Copyable.
class ImportTicket {
 public:
  ImportTicket() = default;  // nothing to wait for: done, OK
  int64_t uid() const { return uid_; }
  // True once the transfer has finished; StateManager::CompleteImports then commits the sequence
  // (or, when it failed, drops it).
  bool Poll() const;
  // Waits until the transfer has finished and returns its status, the same on every call: OK,
  // or why the sequence could not be imported (ImportSequence's kUnavailable, kFailedPrecondition
  // ...; kCancelled when its manager was destroyed first).
  Status Wait() const;

 private:
  friend class StateManager;
  ImportTicket(int64_t uid, std::shared_future<Status> done) : uid_(uid), done_(std::move(done)) {}
  int64_t uid_ = 0;
  std::shared_future<Status> done_;
};

}  // namespace blockkv
