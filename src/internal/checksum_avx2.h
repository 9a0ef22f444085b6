// SPDX-License-Identifier: Apache-2.0
// checksum_avx2.cc's entry points, for checksum.cc alone: call them only on a CPU with AVX2.
// `state` is an XXH3_state_t.
#pragma once

#include <cstddef>
#include <cstdint>

namespace blockkv::internal {

uint64_t Checksum64Avx2(const void* data, size_t size);
void Checksum64UpdateAvx2(void* state, const void* data, size_t size);
uint64_t Checksum64DigestAvx2(const void* state);

}  // namespace blockkv::internal
