// SPDX-License-Identifier: Apache-2.0
// Helpers shared by snapshot_test.cc and tests/fuzz/snapshot_fuzz.cc (no GoogleTest here): a
// small two-group manager with prefix caching, a random workload that leaves it in every kind of
// state a snapshot holds, and Reseal, which recomputes a snapshot's checksums after a test
// changed its bytes, so that the change gets past them to the loader's structural checks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/state_manager.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace blockkv_test {

// Group 0: blocks of 2 tokens, 2 fp16 layers; group 1: blocks of 4 tokens, 1 fp32 layer, a
// sliding window of 8 tokens. 40 blocks, 8 slots, 64 tokens a sequence.
inline std::vector<blockkv::KVCacheConfig> SnapshotGroups() {
  using blockkv::DType;
  return {{.block_size = 2,
           .cache_shape = {2, 1, 4},
           .cache_dtype = DType::kFloat16,
           .max_blocks_per_allocation_group = 32},
          {.block_size = 4,
           .cache_shape = {1, 2, 2},
           .cache_dtype = DType::kFloat32,
           .max_blocks_per_allocation_group = 16}};
}

inline blockkv::StateManagerConfig SnapshotConfig(bool prefix = true) {
  blockkv::StateManagerConfig c;
  c.max_tracked_sequences = 8;
  c.max_ragged_batch_size = 256;
  c.max_ragged_sequence_count = 8;
  c.max_context = 64;
  c.memory_config = {.mode = blockkv::AllocationMode::kAllocate, .size = 40};
  c.prefix_cache = {.enabled = prefix, .hash_seed = 7, .sliding_windows = {0, 8}};
  return c;
}

// Aborts when the manager cannot be created: every caller passes a valid config.
inline std::unique_ptr<blockkv::StateManager> MakeSnapshotManager(
    blockkv::StateManagerConfig config = SnapshotConfig(),
    std::vector<blockkv::KVCacheConfig> groups = SnapshotGroups()) {
  auto m = blockkv::StateManager::Create(std::move(config), std::move(groups),
                                         blockkv::CpuDevice(/*memory_budget=*/64 << 20));
  if (!m.ok()) {
    std::fprintf(stderr, "MakeSnapshotManager: %s\n", m.status().ToString().c_str());
    std::abort();
  }
  return std::move(m).value();
}

// Random operations on a manager: prompts sharing prefixes in two namespaces, with adapters,
// priorities and per-block bytes; twins computing the same prompt in one batch (exact copies);
// chunked prefill and decode; forks; released leading blocks; flushes (cached blocks become
// evictable) and resets. No operation leaves tokens in flight, so a snapshot can be taken
// between any two.
class SnapshotWorkload {
 public:
  SnapshotWorkload(blockkv::StateManager& m, uint64_t seed, blockkv::SeqId first_uid = 1)
      : m_(m), rng_(seed), next_uid_(first_uid) {}

  void Run(int steps) {
    for (int i = 0; i < steps; ++i) Step();
  }

  // Random bytes in every block of every group, free ones included.
  void FillContents() {
    for (int g = 0; g < m_.num_groups(); ++g) {
      const blockkv::TensorView storage = m_.kv_cache().GetGroupStorage(g).value();
      auto* bytes = static_cast<unsigned char*>(storage.data);
      const auto n = static_cast<size_t>(storage.numel()) * blockkv::ElementSize(storage.dtype);
      for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(rng_());
    }
  }

  const std::vector<blockkv::SeqId>& live() const { return live_; }
  blockkv::SeqId next_uid() const { return next_uid_; }
  std::vector<blockkv::TokenId> Prompt() {
    static constexpr int kTemplateLengths[] = {12, 9, 0};
    const int t = static_cast<int>(rng_() % 3);
    std::vector<blockkv::TokenId> prompt;
    for (int i = 0; i < kTemplateLengths[t]; ++i) prompt.push_back(100 * (t + 1) + i);
    const int tail = static_cast<int>(rng_() % 9);
    for (int i = 0; i < tail; ++i) prompt.push_back(static_cast<blockkv::TokenId>(rng_() % 50));
    return prompt;
  }

 private:
  void Step() {
    switch (rng_() % 9) {
      case 0:
      case 1:
        Add(/*twins=*/false);
        break;
      case 2:
        Add(/*twins=*/true);
        break;
      case 3:
      case 4:
        if (!live_.empty()) Continue(Pick());
        break;
      case 5:
        if (!live_.empty()) {
          const blockkv::SeqId parent = Pick();
          if (m_.Fork(parent, next_uid_).ok()) {
            known_[next_uid_] = known_[parent];
            live_.push_back(next_uid_);
          }
          ++next_uid_;
        }
        break;
      case 6:
        if (!live_.empty()) {
          m_.FreeLeadingBlocks(Pick(), 1 + static_cast<int32_t>(rng_() % 2),
                               static_cast<int>(rng_() % 2))
              .IgnoreError();
        }
        break;
      case 7:
        if (!live_.empty()) {
          const size_t i = rng_() % live_.size();
          Check(m_.FlushSequence(live_[i]), "FlushSequence");
          live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
        }
        break;
      default:
        if (rng_() % 8 == 0) {
          m_.ResetPrefixCache();
        } else if (!live_.empty()) {
          Continue(Pick());
        }
        break;
    }
  }

  // One or two new sequences with the same prompt, prefilled (a first chunk) in one batch.
  void Add(bool twins) {
    const std::vector<blockkv::TokenId> prompt = Prompt();
    static constexpr int32_t kPriorities[] = {10, 35, 80};
    blockkv::SequenceOptions options{
        .keys = {.ns = rng_() % 4 == 0 ? "tenant" : "",
                 .adapter_id = rng_() % 5 == 0 ? 7 : 0,
                 .block_bytes = rng_() % 6 == 0 ? std::vector<std::string>{"img0", "", "img2"}
                                                : std::vector<std::string>{}},
        .priority = kPriorities[rng_() % 3]};
    std::vector<blockkv::SeqId> uids;
    for (int i = 0; i < (twins ? 2 : 1); ++i) {
      if (!m_.AddSequence(next_uid_, prompt, options).ok()) break;
      known_[next_uid_] = static_cast<int64_t>(prompt.size());
      live_.push_back(next_uid_);
      uids.push_back(next_uid_++);
    }
    if (uids.empty() || rng_() % 4 == 0) return;  // some wait unscheduled
    const auto chunk = std::max<int64_t>(1, std::min<int64_t>(std::ssize(prompt), 1 + rng_() % 16));
    std::vector<int64_t> lengths(uids.size(), chunk);
    if (m_.Schedule({.uids = uids, .lengths = lengths}).ok())
      Check(m_.PostForward(uids), "PostForward");
  }

  // The next prefill chunk, or one decoded token.
  void Continue(blockkv::SeqId uid) {
    const blockkv::Sequence* seq = m_.GetSequence(uid);
    int64_t n = known_[uid] - seq->seen_tokens();
    if (n <= 0) {
      const blockkv::TokenId token = static_cast<blockkv::TokenId>(rng_() % 50);
      if (!m_.AppendTokens(uid, std::span(&token, 1)).ok()) return;
      ++known_[uid];
      n = 1;
    }
    const blockkv::SeqId uids[] = {uid};
    const int64_t lengths[] = {std::min<int64_t>(n, 1 + static_cast<int64_t>(rng_() % 8))};
    if (m_.Schedule({.uids = uids, .lengths = lengths}).ok())
      Check(m_.PostForward(uids), "PostForward");
  }

  blockkv::SeqId Pick() { return live_[rng_() % live_.size()]; }

  static void Check(const blockkv::Status& s, const char* what) {
    if (s.ok()) return;
    std::fprintf(stderr, "SnapshotWorkload: %s: %s\n", what, s.ToString().c_str());
    std::abort();
  }

  blockkv::StateManager& m_;
  std::mt19937_64 rng_;
  blockkv::SeqId next_uid_;
  std::vector<blockkv::SeqId> live_;
  std::map<blockkv::SeqId, int64_t> known_;  // tokens the workload gave each sequence
};

// ---- the snapshot format, as far as tests need it (src/snapshot_codec.h) ----

inline constexpr size_t kSnapshotHeaderBytes = 24;

inline uint64_t Load64(const std::vector<std::byte>& bytes, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, bytes.data() + at, sizeof(v));
  return v;
}
inline void Store64(std::vector<std::byte>& bytes, size_t at, uint64_t v) {
  std::memcpy(bytes.data() + at, &v, sizeof(v));
}

// Offset and length of the payload of each section whose framing is intact (CONF, BLKS, SEQS,
// PRFX in that order); `trailer` gets the trailer's offset when all four are.
inline std::vector<std::pair<size_t, size_t>> SnapshotSections(const std::vector<std::byte>& bytes,
                                                               size_t* trailer = nullptr) {
  std::vector<std::pair<size_t, size_t>> sections;
  size_t at = kSnapshotHeaderBytes;
  for (int i = 0; i < 4; ++i) {
    if (bytes.size() < at + 24) return sections;
    const uint64_t length = Load64(bytes, at + 8);
    if (length > bytes.size() - at - 24) return sections;
    sections.emplace_back(at + 16, static_cast<size_t>(length));
    at += 16 + static_cast<size_t>(length) + 8;
  }
  if (trailer != nullptr && bytes.size() >= at + 24) *trailer = at;
  return sections;
}

// Recomputes the checksum of every section and of the file, where the framing allows.
inline void Reseal(std::vector<std::byte>& bytes) {
  size_t trailer = 0;
  for (const auto& [payload, length] : SnapshotSections(bytes, &trailer)) {
    Store64(bytes, payload + length, XXH3_64bits(bytes.data() + payload - 16, 16 + length));
  }
  if (trailer != 0) Store64(bytes, trailer + 16, XXH3_64bits(bytes.data(), trailer + 16));
}

}  // namespace blockkv_test
