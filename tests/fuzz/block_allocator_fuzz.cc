// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: BlockedAllocator against its reference model, driven by the fuzzer's bytes.
// The driver is the one block_allocator_model_test.cc runs on a PRNG (tests/unit/
// block_allocator_model.h); any disagreement or failed CheckInvariants() aborts with a
// description of the operation. Keep each crash found as a named regression test in
// tests/unit/block_allocator_model_test.cc.
//
//   block_allocator_fuzz -max_total_time=60 corpus_dir/
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "unit/block_allocator_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  blockkv_test::ByteSource source(data, size);
  const std::string failure = blockkv_test::RunAllocatorModel(source, /*max_ops=*/100'000);
  if (!failure.empty()) {
    std::fprintf(stderr, "BlockedAllocator disagrees with the reference: %s\n", failure.c_str());
    std::abort();
  }
  return 0;
}
