// 16-bit floats as float32, for the servax kernels that read them as stored: bfloat16 (the top
// half of a float32's bits) and IEEE half (float16). Scalar forms for the portable loops, and
// eight at a time with AVX2 (float16 through F16C's vcvtph2ps); and float32 as either's bits,
// rounded to nearest even (the attention's cache writes).

#ifndef SERVAX_KERNELS_HALF_H_
#define SERVAX_KERNELS_HALF_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace servax {

inline float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// x as IEEE half bits, rounded to nearest even as XLA converts (F. Giesen's float_to_half_fast3_rtne).
inline uint16_t FloatToHalfBits(float x) {
  constexpr uint32_t kInf = 255u << 23, kHalfMax = (127u + 16) << 23;
  constexpr uint32_t kDenormMagic = ((127u - 15) + (23 - 10) + 1) << 23;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= kHalfMax) {
    o = u > kInf ? 0x7e00 : 0x7c00;  // NaN, or infinity (and what rounds to it)
  } else if (u < (113u << 23)) {  // a half subnormal: float addition rounds it into place
    float f, magic;
    std::memcpy(&f, &u, 4);
    std::memcpy(&magic, &kDenormMagic, 4);
    f += magic;
    std::memcpy(&u, &f, 4);
    o = static_cast<uint16_t>(u - kDenormMagic);
  } else {
    const uint32_t odd = (u >> 13) & 1;
    u += ((15u - 127u) << 23) + 0xfff + odd;
    o = static_cast<uint16_t>(u >> 13);
  }
  return o | static_cast<uint16_t>(sign >> 16);
}

// x as bfloat16 bits, rounded to nearest even (NaNs kept quiet).
inline uint16_t FloatToBFloat16Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

#if defined(__AVX2__)
inline __m256 Load8BFloat16(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#endif

#if defined(__F16C__)
inline __m256 Load8Half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

}  // namespace servax

#endif  // SERVAX_KERNELS_HALF_H_
