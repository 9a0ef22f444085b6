// SPDX-License-Identifier: Apache-2.0
#include "internal/checksum.h"

#include <new>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "internal/checksum_avx2.h"

namespace blockkv::internal {
namespace {

static_assert(sizeof(XXH3_state_t) <= sizeof(Checksum64Stream) &&
                  alignof(XXH3_state_t) <= alignof(Checksum64Stream),
              "XXH3_state_t outgrew Checksum64Stream's storage");

XXH3_state_t* State(unsigned char* bytes) {
  return std::launder(reinterpret_cast<XXH3_state_t*>(bytes));
}
const XXH3_state_t* State(const unsigned char* bytes) {
  return std::launder(reinterpret_cast<const XXH3_state_t*>(bytes));
}

#if defined(BLOCKKV_CHECKSUM_AVX2)
// Set by this file's static initializer; a checksum taken by another's before it uses SSE2 (the
// same value). __builtin_cpu_init first: it may not have run yet when initializers do.
bool DetectAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}
const bool kAvx2 = DetectAvx2();
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

Checksum64Stream::Checksum64Stream() { XXH3_64bits_reset(new (state_) XXH3_state_t); }

void Checksum64Stream::Update(const void* data, size_t size) {
#if defined(BLOCKKV_CHECKSUM_AVX2)
  if (kAvx2) return Checksum64UpdateAvx2(State(state_), data, size);
#endif
  XXH3_64bits_update(State(state_), data, size);
}

uint64_t Checksum64Stream::Digest() const {
#if defined(BLOCKKV_CHECKSUM_AVX2)
  if (kAvx2) return Checksum64DigestAvx2(State(state_));
#endif
  return XXH3_64bits_digest(State(state_));
}

}  // namespace blockkv::internal
