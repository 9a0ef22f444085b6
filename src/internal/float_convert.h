// SPDX-License-Identifier: Apache-2.0
// Scalar conversions between fp32 and the cache's narrow storage types, bit-exact and portable
// (no F16C, no compiler _Float16): fp16 (IEEE binary16) and bf16 round to nearest even; fp8 e4m3
// ("e4m3fn": bias 7, no infinities, ±448 largest, 0x7F / 0xFF NaN) decodes through a 256-entry
// table and encodes with round-to-nearest-even, saturating at ±448. Shared by the CPU kernels
// and the tests' reference (the CUDA kernels use CUDA's own conversions, which round the same
// way).
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>

namespace blockkv::internal {

inline float FloatFromBits(uint32_t bits) {
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t BitsFromFloat(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float Bf16ToFloat(uint16_t h) { return FloatFromBits(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  const uint32_t bits = BitsFromFloat(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);  // nearest, ties to even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return FloatFromBits(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return FloatFromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa · 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign != 0 ? -magnitude : magnitude;
}

inline uint16_t FloatToFp16(float f) {
  const uint32_t bits = BitsFromFloat(f);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (abs < 0x38800000u) {  // below 2^-14: subnormal; 2^-24 units, ties to even
    const float scaled = FloatFromBits(abs) * 16777216.0f;  // exact
    const float rounded = __builtin_nearbyintf(scaled);     // default mode: ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded));
  }
  const uint32_t rounding = 0xFFFu + ((abs >> 13) & 1u);
  const uint32_t rebiased = abs - (112u << 23) + rounding;  // exponent 127 → 15
  return static_cast<uint16_t>(sign | (rebiased >> 13));
}

// fp8 e4m3 → float, computed (the table below is built from it).
constexpr float Fp8E4M3ToFloatSlow(uint8_t b) {
  const bool negative = (b & 0x80u) != 0;
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 0x7;
  float magnitude = 0.0f;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = __builtin_nanf("");
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) / 512.0f;  // m · 2^-9
  } else {
    float scale = 1.0f;
    for (int e = exponent; e < 7; ++e) scale /= 2.0f;
    for (int e = 7; e < exponent; ++e) scale *= 2.0f;
    magnitude = (1.0f + static_cast<float>(mantissa) / 8.0f) * scale;
  }
  return negative ? -magnitude : magnitude;
}

inline constexpr std::array<float, 256> kFp8E4M3Table = [] {
  std::array<float, 256> table{};
  for (int i = 0; i < 256; ++i) table[i] = Fp8E4M3ToFloatSlow(static_cast<uint8_t>(i));
  return table;
}();

inline float Fp8E4M3ToFloat(uint8_t b) { return kFp8E4M3Table[b]; }

inline constexpr float kFp8E4M3Max = 448.0f;

// Round to nearest even, saturating: |f| > 448 (and ±inf) → ±448; NaN → 0x7F.
inline uint8_t FloatToFp8E4M3(float f) {
  const auto sign = static_cast<uint8_t>((BitsFromFloat(f) >> 24) & 0x80u);
  const float a = __builtin_fabsf(f);
  if (a != a) return 0x7F;
  if (a >= kFp8E4M3Max) return static_cast<uint8_t>(sign | 0x7Eu);
  if (a < 0.015625f) {  // below 2^-6: subnormal, 2^-9 units (8 units is the smallest normal)
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(__builtin_nearbyintf(a * 512.0f)));
  }
  const uint32_t bits = BitsFromFloat(a);
  int exponent = static_cast<int>(bits >> 23) - 127;                            // a is normal here
  const float significand = FloatFromBits((bits & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
  const float mantissa = __builtin_nearbyintf((significand - 1.0f) * 8.0f);     // exact, ties even
  int m = static_cast<int>(mantissa);
  if (m == 8) {
    m = 0;
    ++exponent;
  }
  const int code = ((exponent + 7) << 3) | m;
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(code > 0x7E ? 0x7E : code));
}

}  // namespace blockkv::internal
