// 16-bit floats as float32, for the servax kernels that read them as stored: bfloat16 (the top
// half of a float32's bits) and IEEE half (float16). Scalar forms for the portable loops, and
// eight at a time with AVX2 (float16 through F16C's vcvtph2ps).

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
