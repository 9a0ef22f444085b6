// SPDX-License-Identifier: Apache-2.0
// XXH3-64 compiled with -mavx2 (src/CMakeLists.txt), called only after checksum.cc has seen the
// CPU report AVX2. This file includes nothing but xxhash.h, whose functions are all static here
// (XXH_INLINE_ALL): no inline function of a shared header is compiled with AVX2 in this file,
// where the linker could pick it for callers that run on any CPU.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include "internal/checksum_avx2.h"

namespace blockkv::internal {

uint64_t Checksum64Avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }

void Checksum64UpdateAvx2(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

uint64_t Checksum64DigestAvx2(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace blockkv::internal
