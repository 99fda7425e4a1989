// 16-bit float types for cuda_emu.h: bit storage, round-to-nearest-even from float
// (as __float2bfloat16 / __float2half and the float constructors do), exact to float.
// Arithmetic between two of them rounds the float result back, like __hadd etc.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

template <typename To, typename From>
inline To emu_bit_cast(From v) {
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}
inline std::uint16_t emu_float_to_bf16_bits(float f) {
  auto u = emu_bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return 0x7fff;
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// GCC's _Float16 is IEEE binary16 with round-to-nearest-even conversions.
inline std::uint16_t emu_float_to_half_bits(float f) {
  return emu_bit_cast<std::uint16_t>(static_cast<_Float16>(f));
}
inline float emu_half_bits_to_float(std::uint16_t b) {
  return static_cast<float>(emu_bit_cast<_Float16>(b));
}

#define EMU_FLOAT16_TYPE(NAME, TO_BITS, FROM_BITS)                                     \
  struct NAME {                                                                        \
    std::uint16_t bits;                                                                \
    NAME() = default;                                                                  \
    NAME(float f) : bits(TO_BITS(f)) {}                                                \
    NAME(double f) : bits(TO_BITS(static_cast<float>(f))) {}                          \
    NAME(int i) : bits(TO_BITS(static_cast<float>(i))) {}                             \
    NAME(unsigned i) : bits(TO_BITS(static_cast<float>(i))) {}                        \
    operator float() const { return FROM_BITS(bits); }                                 \
    NAME& operator+=(NAME o) { return *this = NAME(float(*this) + float(o)); }         \
    NAME& operator-=(NAME o) { return *this = NAME(float(*this) - float(o)); }         \
    NAME& operator*=(NAME o) { return *this = NAME(float(*this) * float(o)); }         \
    NAME& operator/=(NAME o) { return *this = NAME(float(*this) / float(o)); }         \
  };                                                                                   \
  inline NAME operator+(NAME a, NAME b) { return NAME(float(a) + float(b)); }          \
  inline NAME operator-(NAME a, NAME b) { return NAME(float(a) - float(b)); }          \
  inline NAME operator*(NAME a, NAME b) { return NAME(float(a) * float(b)); }          \
  inline NAME operator/(NAME a, NAME b) { return NAME(float(a) / float(b)); }          \
  inline NAME operator-(NAME a) { return NAME(-float(a)); }

inline float emu_bf16_bits_to_float(std::uint16_t b) {
  return emu_bit_cast<float>(std::uint32_t(b) << 16);
}
EMU_FLOAT16_TYPE(__nv_bfloat16, emu_float_to_bf16_bits, emu_bf16_bits_to_float)
EMU_FLOAT16_TYPE(__half, emu_float_to_half_bits, emu_half_bits_to_float)
static_assert(sizeof(__nv_bfloat16) == 2 && sizeof(__half) == 2);

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }

