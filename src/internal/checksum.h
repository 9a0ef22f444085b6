// SPDX-License-Identifier: Apache-2.0
// Checksum64: XXH3-64, the checksum of every copy of cache bytes that blockkv keeps or sends out
// of the cache (offloaded blocks, snapshot sections, remote-tier values). Computed with AVX2
// where the CPU has it (chosen once, as the library loads) and with SSE2 otherwise: the same value
// on every CPU, so that a copy written on one machine verifies on another.
#pragma once

#include <cstddef>
#include <cstdint>

namespace blockkv::internal {

uint64_t Checksum64(const void* data, size_t size);

// Whether Checksum64 and Checksum64Stream use AVX2 on this CPU.
bool Checksum64UsesAvx2();

// Checksum64 of bytes given a piece at a time: Update(a), Update(b) then Digest() equals
// Checksum64 of a followed by b. Feeding each piece as it arrives, while it is still in cache,
// saves reading it from memory again.
class Checksum64Stream {
 public:
  Checksum64Stream();
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  // XXH3's state (XXH3_state_t, 576 bytes in xxHash 0.8), kept here so that a stream costs no
  // allocation; checksum.cc checks that it fits.
  alignas(64) unsigned char state_[640] = {};
};

}  // namespace blockkv::internal
