// SPDX-License-Identifier: Apache-2.0
// The few msgpack types the KV events use (https://github.com/msgpack/msgpack/blob/master/spec.md),
// each in its shortest form, as msgspec writes them: nil, integers, float64, str, bin and array
// headers. Appends to a std::string; big-endian throughout.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace blockkv::internal {

class MsgpackWriter {
 public:
  explicit MsgpackWriter(std::string* out) : out_(out) {}

  void Nil() { Byte(0xc0); }
  void Bool(bool b) { Byte(b ? 0xc3 : 0xc2); }
  void Uint(uint64_t v) {
    if (v < 0x80) {
      Byte(static_cast<uint8_t>(v));
    } else if (v <= 0xff) {
      Byte(0xcc);
      Be(v, 1);
    } else if (v <= 0xffff) {
      Byte(0xcd);
      Be(v, 2);
    } else if (v <= 0xffffffff) {
      Byte(0xce);
      Be(v, 4);
    } else {
      Byte(0xcf);
      Be(v, 8);
    }
  }
  void Int(int64_t v) {
    if (v >= 0) return Uint(static_cast<uint64_t>(v));
    const auto u = static_cast<uint64_t>(v);
    if (v >= -32) {
      Byte(static_cast<uint8_t>(u));  // negative fixint: 111xxxxx
    } else if (v >= INT8_MIN) {
      Byte(0xd0);
      Be(u, 1);
    } else if (v >= INT16_MIN) {
      Byte(0xd1);
      Be(u, 2);
    } else if (v >= INT32_MIN) {
      Byte(0xd2);
      Be(u, 4);
    } else {
      Byte(0xd3);
      Be(u, 8);
    }
  }
  void Float64(double d) {
    uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    Byte(0xcb);
    Be(bits, 8);
  }
  void Str(std::string_view s) {
    const size_t n = s.size();
    if (n < 32) {
      Byte(static_cast<uint8_t>(0xa0 | n));
    } else if (n <= 0xff) {
      Byte(0xd9);
      Be(n, 1);
    } else if (n <= 0xffff) {
      Byte(0xda);
      Be(n, 2);
    } else {
      Byte(0xdb);
      Be(n, 4);
    }
    out_->append(s);
  }
  void Bin(std::string_view b) {
    const size_t n = b.size();
    if (n <= 0xff) {
      Byte(0xc4);
      Be(n, 1);
    } else if (n <= 0xffff) {
      Byte(0xc5);
      Be(n, 2);
    } else {
      Byte(0xc6);
      Be(n, 4);
    }
    out_->append(b);
  }
  void Array(size_t n) {
    if (n < 16) {
      Byte(static_cast<uint8_t>(0x90 | n));
    } else if (n <= 0xffff) {
      Byte(0xdc);
      Be(n, 2);
    } else {
      Byte(0xdd);
      Be(n, 4);
    }
  }

 private:
  void Byte(uint8_t b) { out_->push_back(static_cast<char>(b)); }
  void Be(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) Byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::string* out_;
};

}  // namespace blockkv::internal
