// SPDX-License-Identifier: Apache-2.0
// quickstart: plan a KV cache for a real model shape on a host budget, create it, reserve and
// free blocks for a few sequences, and write and read one token's keys and values through the
// blocked layout.
//
//   quickstart [--budget-mib N] [--keep-free-mib N] [--block-size N]
//
// The model is Llama-3-8B's attention: 32 layers, 8 KV heads of 128 dims, fp16 — 128 KiB of
// cache per token. Exit status: 0 on success, 1 when blockkv reports an error (printed).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "blockkv/blockkv.h"

namespace {

struct Options {
  int64_t budget_mib = 2048;
  int64_t keep_free_mib = 256;
  int32_t block_size = 16;
};

bool ParseOptions(int argc, char** argv, Options* options) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return false;
    const long long value = std::strtoll(argv[++i], nullptr, 10);
    if (flag == "--budget-mib") {
      options->budget_mib = value;
    } else if (flag == "--keep-free-mib") {
      options->keep_free_mib = value;
    } else if (flag == "--block-size") {
      options->block_size = static_cast<int32_t>(value);
    } else {
      return false;
    }
  }
  return options->budget_mib >= 0;
}

int Fail(const blockkv::Status& status) {
  std::fprintf(stderr, "quickstart: %s\n", status.ToString().c_str());
  return 1;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, &options)) {
    std::fprintf(stderr,
                 "usage: quickstart [--budget-mib N] [--keep-free-mib N] "
                 "[--block-size N]\n");
    return 2;
  }
  using blockkv::BlockId;
  // blockkv never prints; route its log lines into this program's output.
  blockkv::SetLogSink([](blockkv::LogLevel level, std::string_view line) {
    std::printf("[blockkv %s] %.*s\n", blockkv::LogLevelName(level), static_cast<int>(line.size()),
                line.data());
  });

  // Llama-3-8B: 32 layers, 8 KV heads (GQA), head size 128, fp16.
  blockkv::KVCacheConfig llama;
  llama.block_size = options.block_size;
  llama.cache_shape = {32, 8, 128};
  llama.cache_dtype = blockkv::DType::kFloat16;
  llama.max_blocks_per_allocation_group =
      static_cast<int32_t>(CeilDiv(8192, std::max(options.block_size, 1)));
  blockkv::MemoryConfig memory;  // RESERVE: keep `keep_free_mib` free, use the rest
  memory.size = options.keep_free_mib << 20;

  std::shared_ptr<blockkv::Device> host = blockkv::CpuDevice(options.budget_mib << 20);
  std::printf("device: %s\n", host->name().c_str());

  const std::vector<blockkv::KVCacheConfig> configs{llama};
  blockkv::Result<blockkv::KVCachePlan> plan =
      blockkv::PlanKVCache(configs, memory, host->available_memory());
  if (!plan.ok()) return Fail(plan.status());
  std::printf("plan: %d blocks of %lld bytes (%lld bytes per token), %lld bytes in all\n",
              plan->num_blocks, static_cast<long long>(plan->bytes_per_block),
              static_cast<long long>(plan->bytes_per_block / llama.block_size),
              static_cast<long long>(plan->total_bytes));

  auto cache = blockkv::BlockedKVCache::Create(configs, memory, host);
  if (!cache.ok()) return Fail(cache.status());
  blockkv::BlockedKVCache& kv = **cache;
  std::printf("created: %d blocks, %d free, device has %lld bytes left\n", kv.num_blocks(),
              kv.free_blocks()[0], static_cast<long long>(host->available_memory()));

  // Three sequences arrive with prompts of these lengths; each gets ceil(len / block_size)
  // blocks for its block table.
  const std::vector<int64_t> prompts{100, 37, 530};
  std::vector<std::vector<BlockId>> tables;
  for (size_t s = 0; s < prompts.size(); ++s) {
    const auto blocks_needed = static_cast<int32_t>(CeilDiv(prompts[s], llama.block_size));
    auto blocks = kv.Reserve(blocks_needed);
    if (!blocks.ok()) return Fail(blocks.status());
    std::printf("sequence %zu: %lld tokens -> %d blocks, first %d last %d; %d free\n", s,
                static_cast<long long>(prompts[s]), blocks_needed, blocks->front(), blocks->back(),
                kv.free_blocks()[0]);
    tables.push_back(std::move(*blocks));
  }

  // Write the keys and values of token 42 of sequence 0, layer 5, through the blocked layout:
  // block table[42 / block_size], offset 42 % block_size.
  auto layer = kv.GetCache(5);
  if (!layer.ok()) return Fail(layer.status());
  auto planes = blockkv::SplitKV(*layer);
  if (!planes.ok()) return Fail(planes.status());
  const auto& [k, v] = *planes;  // each [num_blocks, block_size, num_kv_heads, head_size]
  const int64_t token = 42;
  const BlockId block = tables[0][token / llama.block_size];
  const int64_t offset = token % llama.block_size;
  const int64_t slot = block * k.stride(0) + offset * k.stride(1);  // elements
  const int64_t row = k.size(2) * k.size(3);                        // heads · head_size
  std::vector<uint16_t> key(static_cast<size_t>(row));
  std::vector<uint16_t> value(static_cast<size_t>(row));
  for (int64_t i = 0; i < row; ++i) {
    key[i] = static_cast<uint16_t>(i);
    value[i] = static_cast<uint16_t>(60000 - i);
  }
  std::memcpy(static_cast<uint16_t*>(k.data) + slot, key.data(), key.size() * 2);
  std::memcpy(static_cast<uint16_t*>(v.data) + slot, value.data(), value.size() * 2);
  const auto* raw = static_cast<const uint16_t*>(layer->data);
  // The same element through the 5-D index: ((block·bs + offset)·2 + kv)·H·D + h·D + d.
  const int64_t probe = int64_t{3} * 128 + 7;  // head 3, dim 7
  const int64_t token_slot = int64_t{block} * llama.block_size + offset;
  const int64_t k_index = (token_slot * 2 + 0) * row + probe;
  const int64_t v_index = (token_slot * 2 + 1) * row + probe;
  const bool round_trip = raw[k_index] == key[probe] && raw[v_index] == value[probe];
  std::printf("token %lld of sequence 0 -> block %d offset %lld; K/V read back %s\n",
              static_cast<long long>(token), block, static_cast<long long>(offset),
              round_trip ? "intact" : "CORRUPT");

  // Sequence 1 finishes; its blocks return to the free list and are reused first (LIFO).
  if (auto s = kv.Free(tables[1]); !s.ok()) return Fail(s);
  std::printf("sequence 1 finished: %zu blocks freed; %d free\n", tables[1].size(),
              kv.free_blocks()[0]);
  auto reused = kv.Reserve(1);
  if (!reused.ok()) return Fail(reused.status());
  std::printf("next reservation reuses block %d (the last one sequence 1 freed)\n",
              reused->front());

  // Asking for more than is free fails and changes nothing.
  const int32_t before = kv.free_blocks()[0];
  auto too_many = kv.Reserve(before + 1);
  std::printf("reserve %d of %d free: %s; still %d free\n", before + 1, before,
              too_many.status().ToString().c_str(), kv.free_blocks()[0]);

  for (const auto& table : {tables[0], tables[2], *reused}) {
    if (auto s = kv.Free(table); !s.ok()) return Fail(s);
  }
  if (auto s = kv.CheckInvariants(); !s.ok()) return Fail(s);
  std::printf("all sequences finished: %d of %d blocks free\n", kv.free_blocks()[0],
              kv.num_blocks());
  return round_trip && kv.free_blocks()[0] == kv.num_blocks() ? 0 : 1;
}
