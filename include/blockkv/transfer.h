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
//   // engine flushes it at its next Schedule (or CompleteExports) once B has confirmed.
//
// Flow, descriptor format and failure semantics: docs/transfer.md.
#pragma once

#include <cstdint>
#include <string>

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
  // How long ImportSequence waits for the whole transfer (connect, gets, confirm), in ms; > 0.
  int32_t timeout_ms = 10000;
  friend bool operator==(const TransferConfig&, const TransferConfig&) = default;
};

}  // namespace blockkv
