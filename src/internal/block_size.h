// SPDX-License-Identifier: Apache-2.0
// BlockSize: token ↔ block arithmetic for one block size. Block sizes are almost always powers of
// two, and then an index is a shift and an offset a mask: a 64-bit division costs tens of cycles,
// and a decode step does a few per sequence. Other sizes divide.
#pragma once

#include <bit>
#include <cstdint>

namespace blockkv::internal {

class BlockSize {
 public:
  BlockSize() = default;
  // REQUIRES: size > 0.
  explicit BlockSize(int32_t size)
      : size_(size),
        shift_(std::has_single_bit(static_cast<uint32_t>(size))
                   ? std::countr_zero(static_cast<uint32_t>(size))
                   : -1) {}

  int32_t value() const { return size_; }
  // The block of token position `pos` (>= 0) and its offset there.
  int64_t Index(int64_t pos) const { return shift_ >= 0 ? pos >> shift_ : pos / size_; }
  int64_t Offset(int64_t pos) const { return shift_ >= 0 ? pos & (size_ - 1) : pos % size_; }
  // Blocks that hold `tokens` (>= 0) tokens: ceil(tokens / size).
  int64_t BlocksFor(int64_t tokens) const { return Index(tokens + size_ - 1); }

 private:
  int32_t size_ = 1;
  int shift_ = 0;
};

}  // namespace blockkv::internal
