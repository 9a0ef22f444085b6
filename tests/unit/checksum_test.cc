// SPDX-License-Identifier: Apache-2.0
// Checksum64 (src/internal/checksum.h) against XXH3-64 compiled here without SIMD: the AVX2 and
// SSE2 builds of the checksum must give the value a plain C build gives, for every length, or a
// block offloaded, snapshotted or stored in Redis on one machine fails its check on another.
#include "internal/checksum.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_SCALAR
#include <xxhash.h>

namespace blockkv::internal {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> bytes(n);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
  return bytes;
}

// XXH3's code paths change at 16, 128 and 240 bytes, at each 64-byte stripe, at each 1 KiB
// block and at its 256-byte internal buffer: lengths on both sides of each, up to a 2 MiB block.
const std::vector<size_t>& Lengths() {
  static const std::vector<size_t> lengths = {
      0,   1,   3,   4,    8,    9,    16,       17,    128,       129,        240,  241,
      255, 256, 257, 1023, 1024, 1025, 4096 + 7, 65536, 65536 + 8, 65536 + 63, 65537};
  return lengths;
}

TEST(Checksum64, MatchesPlainXxh3ForEveryLengthAndAlignment) {
  const std::vector<unsigned char> bytes = RandomBytes((size_t{2} << 20) + 64, 1);
  for (const size_t n : Lengths()) {
    for (const size_t offset : {0, 1, 8, 31}) {
      EXPECT_EQ(Checksum64(bytes.data() + offset, n), XXH3_64bits(bytes.data() + offset, n))
          << n << " bytes at offset " << offset;
    }
  }
  for (const size_t n : {size_t{2} << 20, (size_t{2} << 20) + 13}) {
    EXPECT_EQ(Checksum64(bytes.data(), n), XXH3_64bits(bytes.data(), n)) << n << " bytes";
  }
}

TEST(Checksum64, AStreamFedInAnyPiecesEqualsTheWhole) {
  const std::vector<unsigned char> bytes = RandomBytes(size_t{300} << 10, 2);
  std::mt19937 rng(3);
  for (const size_t n : {size_t{0}, size_t{200}, size_t{5000}, bytes.size()}) {
    for (int trial = 0; trial < 20; ++trial) {
      Checksum64Stream stream;
      for (size_t at = 0; at < n;) {
        // Pieces from 1 byte to 70 KiB: inside the internal buffer, across it, many blocks.
        const size_t piece = std::min(n - at, size_t{1} + rng() % (trial % 2 == 0 ? 300 : 70000));
        stream.Update(bytes.data() + at, piece);
        at += piece;
      }
      EXPECT_EQ(stream.Digest(), XXH3_64bits(bytes.data(), n)) << n << " bytes, trial " << trial;
      EXPECT_EQ(stream.Digest(), Checksum64(bytes.data(), n)) << "Digest changed the stream";
    }
  }
}

TEST(Checksum64, AStreamCopiedMidwayGoesOnFromWhereItWas) {
  const std::vector<unsigned char> bytes = RandomBytes(10000, 4);
  Checksum64Stream a;
  a.Update(bytes.data(), 3000);
  Checksum64Stream b = a;
  a.Update(bytes.data() + 3000, 7000);
  b.Update(bytes.data() + 3000, 7000);
  EXPECT_EQ(a.Digest(), b.Digest());
  EXPECT_EQ(b.Digest(), XXH3_64bits(bytes.data(), bytes.size()));
}

TEST(Checksum64, UsesAvx2WhereTheCpuHasIt) {
#if defined(__x86_64__)
  EXPECT_EQ(Checksum64UsesAvx2(), __builtin_cpu_supports("avx2") != 0);
#else
  EXPECT_FALSE(Checksum64UsesAvx2());
#endif
}

}  // namespace
}  // namespace blockkv::internal
