// poplar/HalfFloat.hpp for ipu-jax's host build of C++ codelets.
//
// Written here, for ipu-jax, from the documented semantics of Poplar's `half`
// (IEEE 754 binary16, round-to-nearest-even on conversion from float); no
// Graphcore code or header is copied. On the host (as in Poplar's IPUModel)
// a half is 16 bits of storage, laid out as numpy's float16, converted to and
// from float by the compiler's _Float16 (exact IEEE conversions). Arithmetic
// on halves converts them to float: one operation stored back into a half is
// rounded once, as on the IPU; a chain of operations keeps float
// intermediates (at least as precise as the IPU's).
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <type_traits>

namespace poplar {

class half {
 public:
  half() = default;
  // From any arithmetic value, rounded once to nearest even (implicit, as
  // Poplar's half converts).
  template <typename A, typename = std::enable_if_t<std::is_arithmetic<A>::value>>
  half(A a) : bits_(from_native(static_cast<_Float16>(a))) {}  // NOLINT
  operator float() const { return to_float(bits_); }  // NOLINT

  half& operator+=(float o) { return *this = half(float(*this) + o); }
  half& operator-=(float o) { return *this = half(float(*this) - o); }
  half& operator*=(float o) { return *this = half(float(*this) * o); }
  half& operator/=(float o) { return *this = half(float(*this) / o); }
  half operator-() const { half h; h.bits_ = bits_ ^ 0x8000u; return h; }

  // The raw binary16 bits (what the tensor holds).
  std::uint16_t bits() const { return bits_; }
  static half from_bits(std::uint16_t b) { half h; h.bits_ = b; return h; }

 private:
  static std::uint16_t from_native(_Float16 h) {
    std::uint16_t b;
    std::memcpy(&b, &h, sizeof b);
    return b;
  }
  static float to_float(std::uint16_t b) {
    _Float16 h;
    std::memcpy(&h, &b, sizeof b);
    return static_cast<float>(h);
  }
  std::uint16_t bits_;
};

static_assert(sizeof(half) == 2, "half is two bytes, as a float16 tensor element");

inline std::ostream& operator<<(std::ostream& os, half h) { return os << float(h); }

}  // namespace poplar

using poplar::half;
