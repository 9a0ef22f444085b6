// SPDX-License-Identifier: Apache-2.0
#include "internal/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "internal/checksum_avx2.h"

namespace blockkv::internal {
namespace {

static_assert(sizeof(XXH3_state_t) <= sizeof(Checksum64Stream) &&
                  alignof(XXH3_state_t) <= alignof(Checksum64Stream),
              "XXH3_state_t outgrew Checksum64Stream's storage");

#if defined(BLOCKKV_CHECKSUM_AVX2)
const bool kAvx2 = __builtin_cpu_supports("avx2") != 0;
#else
constexpr bool kAvx2 = false;
#endif

}  // namespace

bool Checksum64UsesAvx2() { return kAvx2; }

uint64_t Checksum64(const void* data, size_t size) {
#if defined(BLOCKKV_CHECKSUM_AVX2)
  if (kAvx2) return Checksum64Avx2(data, size);
#endif
  return XXH3_64bits(data, size);
}

Checksum64Stream::Checksum64Stream() {
  XXH3_64bits_reset(reinterpret_cast<XXH3_state_t*>(state_));
}

void Checksum64Stream::Update(const void* data, size_t size) {
#if defined(BLOCKKV_CHECKSUM_AVX2)
  if (kAvx2) return Checksum64UpdateAvx2(state_, data, size);
#endif
  XXH3_64bits_update(reinterpret_cast<XXH3_state_t*>(state_), data, size);
}

uint64_t Checksum64Stream::Digest() const {
#if defined(BLOCKKV_CHECKSUM_AVX2)
  if (kAvx2) return Checksum64DigestAvx2(state_);
#endif
  return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

}  // namespace blockkv::internal
