// SPDX-License-Identifier: Apache-2.0
// Shared by transfer_test.cc and its peer process (transfer_peer.cc): the engines' layout, the
// bytes a sender writes into a sequence's KV, and the hex form descriptors travel in on a pipe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockkv/state_manager.h"

namespace blockkv_test {

struct TransferLayout {
  int64_t layers = 3;
  int64_t heads = 2;
  int64_t head_size = 8;
  int32_t block_size = 4;
  int32_t num_blocks = 64;
  bool prefix = false;
  // More cache groups after group 0: a second attention group (the same rows, blocks of this
  // many tokens; 0: none; with second_window > 0, sliding-window attention over that many
  // tokens), then a STATE group (Mamba-like: one slot per sequence).
  int32_t second_block_size = 0;
  int64_t second_window = 0;
  bool state = false;
  // TransferConfig's
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  int32_t export_timeout_ms = 120000;
};

inline blockkv::Result<std::unique_ptr<blockkv::StateManager>> MakeTransferManager(
    const TransferLayout& l, const std::string& transports, int32_t timeout_ms = 10000) {
  blockkv::StateManagerConfig config;
  config.max_tracked_sequences = 8;
  config.max_ragged_sequence_count = 8;
  config.max_ragged_batch_size = 4096;
  config.max_context = 4096;
  config.memory_config = {.mode = blockkv::AllocationMode::kAllocate, .size = l.num_blocks};
  config.prefix_cache.enabled = l.prefix;
  config.transfer = blockkv::TransferConfig{.transports = transports,
                                            .timeout_ms = timeout_ms,
                                            .export_timeout_ms = l.export_timeout_ms,
                                            .tp_rank = l.tp_rank,
                                            .tp_size = l.tp_size};
  std::vector<blockkv::KVCacheConfig> kv = {
      {.block_size = l.block_size, .cache_shape = {l.layers, l.heads, l.head_size}}};
  if (l.second_block_size > 0) {
    kv.push_back(
        {.block_size = l.second_block_size,
         .cache_shape = {l.layers, l.heads, l.head_size},
         .type = l.second_window > 0 ? blockkv::KVCacheType::kLocal : blockkv::KVCacheType::kDense,
         .local_window = l.second_window});
  }
  if (l.state) {
    kv.push_back({.cache_shape = {l.layers, 1, 6},
                  .cache_dtype = blockkv::DType::kFloat32,
                  .type = blockkv::KVCacheType::kState,
                  .state_bytes = 24});
  }
  return blockkv::StateManager::Create(config, std::move(kv), blockkv::CpuDevice());
}

// The byte `j` of token `t`'s row (K and V of every head) in layer `layer`, for `seed`.
inline uint8_t PatternByte(uint32_t seed, int64_t layer, int64_t t, int64_t j) {
  uint32_t x = seed * 0x9E3779B1u ^ static_cast<uint32_t>(layer << 24) ^
               static_cast<uint32_t>(t << 10) ^ static_cast<uint32_t>(j);
  x *= 2654435761u;
  x ^= x >> 15;
  return static_cast<uint8_t>(x >> 24);
}

// The attention groups (every group but a STATE one): the groups the pattern is written into.
inline std::vector<int> AttentionGroups(const blockkv::StateManager& m) {
  std::vector<int> groups;
  for (int g = 0; g < m.kv_cache().num_groups(); ++g) {
    if (m.kv_cache().config(g).type != blockkv::KVCacheType::kState) groups.push_back(g);
  }
  return groups;
}

// Group g's seed: group 0 has `seed` itself.
inline uint32_t GroupSeed(uint32_t seed, int g) { return seed ^ (static_cast<uint32_t>(g) << 20); }

// Bytes of one token's row in one layer of `group`.
inline int64_t RowBytes(const blockkv::StateManager& m, int group = 0) {
  const blockkv::KVCacheConfig& c = m.kv_cache().config(group);
  return 2 * c.cache_shape[1] * c.cache_shape[2] * 2;  // K and V, fp16
}

// Token t's row of `uid` in `layer` of `group`; nullptr when its block was released (out of a
// sliding window).
inline std::byte* Row(const blockkv::StateManager& m, blockkv::SeqId uid, int64_t layer, int64_t t,
                      int group = 0) {
  const blockkv::Sequence* seq = m.GetSequence(uid);
  const int32_t bs = m.kv_block_size(group);
  const blockkv::TensorView view = *m.GetCache(layer, group);
  const blockkv::BlockId block = seq->block_table(group)[static_cast<size_t>(t / bs)];
  if (block == blockkv::kNoBlock) return nullptr;
  return static_cast<std::byte*>(view.data) + ((int64_t{block} * bs + t % bs) * RowBytes(m, group));
}

// Writes the pattern into every layer of every seen token of `uid`, in every attention group.
inline void WritePattern(const blockkv::StateManager& m, blockkv::SeqId uid, uint32_t seed) {
  for (const int g : AttentionGroups(m)) {
    const int64_t layers = m.kv_cache().config(g).cache_shape[0];
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t t = 0; t < m.GetSequence(uid)->seen_tokens(); ++t) {
        std::byte* row = Row(m, uid, l, t, g);
        if (row == nullptr) continue;
        for (int64_t j = 0; j < RowBytes(m, g); ++j) {
          row[j] = std::byte{PatternByte(GroupSeed(seed, g), l, t, j)};
        }
      }
    }
  }
}

// The number of bytes of `uid`'s seen tokens [begin, end) (end < 0: all), in every attention
// group (where the sequence still holds them), that differ from the pattern (0: all arrived).
inline int64_t PatternMismatches(const blockkv::StateManager& m, blockkv::SeqId uid, uint32_t seed,
                                 int64_t begin = 0, int64_t end = -1) {
  int64_t bad = 0;
  if (end < 0) end = m.GetSequence(uid)->seen_tokens();
  for (const int g : AttentionGroups(m)) {
    const int64_t layers = m.kv_cache().config(g).cache_shape[0];
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t t = begin; t < end; ++t) {
        const std::byte* row = Row(m, uid, l, t, g);
        if (row == nullptr) continue;
        for (int64_t j = 0; j < RowBytes(m, g); ++j) {
          bad += row[j] != std::byte{PatternByte(GroupSeed(seed, g), l, t, j)} ? 1 : 0;
        }
      }
    }
  }
  return bad;
}

// The STATE group (the last one), or -1.
inline int StateGroup(const blockkv::StateManager& m) {
  const int last = m.kv_cache().num_groups() - 1;
  return m.kv_cache().config(last).type == blockkv::KVCacheType::kState ? last : -1;
}

// `uid`'s state slot in `layer` of the STATE group, as bytes.
inline std::span<std::byte> StateSlot(const blockkv::StateManager& m, blockkv::SeqId uid,
                                      int64_t layer) {
  const int group = StateGroup(m);
  const blockkv::TensorView view = *m.GetCache(layer, group);
  const auto bytes = static_cast<size_t>(view.stride(0)) * blockkv::ElementSize(view.dtype);
  const blockkv::BlockId slot = m.GetSequence(uid)->block_table(group)[0];
  return {static_cast<std::byte*>(view.data) + static_cast<size_t>(slot) * bytes, bytes};
}

// Writes the pattern into `uid`'s state slot (every layer), as if its layers had run.
inline void WriteStatePattern(const blockkv::StateManager& m, blockkv::SeqId uid, uint32_t seed) {
  const int64_t layers = m.kv_cache().config(StateGroup(m)).cache_shape[0];
  for (int64_t l = 0; l < layers; ++l) {
    const std::span<std::byte> slot = StateSlot(m, uid, l);
    for (size_t j = 0; j < slot.size(); ++j) {
      slot[j] = std::byte{PatternByte(seed ^ 0x5eedu, l, -1, static_cast<int64_t>(j))};
    }
  }
}

// The bytes of `uid`'s state slot that differ from WriteStatePattern's.
inline int64_t StateMismatches(const blockkv::StateManager& m, blockkv::SeqId uid, uint32_t seed) {
  int64_t bad = 0;
  const int64_t layers = m.kv_cache().config(StateGroup(m)).cache_shape[0];
  for (int64_t l = 0; l < layers; ++l) {
    const std::span<std::byte> slot = StateSlot(m, uid, l);
    for (size_t j = 0; j < slot.size(); ++j) {
      bad += slot[j] != std::byte{PatternByte(seed ^ 0x5eedu, l, -1, static_cast<int64_t>(j))};
    }
  }
  return bad;
}

inline std::string ToHex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (const std::byte b : bytes) {
    s += kDigits[static_cast<unsigned>(b) >> 4];
    s += kDigits[static_cast<unsigned>(b) & 15];
  }
  return s;
}

inline std::vector<std::byte> FromHex(const std::string& s) {
  const auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::vector<std::byte> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = std::byte(static_cast<uint8_t>(nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1])));
  }
  return out;
}

}  // namespace blockkv_test
