// SPDX-License-Identifier: Apache-2.0
#include <cstdio>

#include "blockkv/blockkv.h"

int main() {
  blockkv::KVCacheConfig config;
  config.block_size = 16;
  config.cache_shape = {2, 4, 64};
  blockkv::MemoryConfig memory;
  memory.mode = blockkv::AllocationMode::kAllocate;
  memory.size = 8;
  auto cache = blockkv::BlockedKVCache::Create({config}, memory, blockkv::CpuDevice(1 << 20));
  if (!cache.ok()) {
    std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
    return 1;
  }
  auto blocks = (*cache)->Reserve(3);
  const bool ok = blocks.ok() && (*cache)->free_blocks()[0] == 5 && (*cache)->Free(*blocks).ok();
  std::printf("installed blockkv works: %s\n", ok ? "yes" : "no");
  return ok ? 0 : 1;
}
