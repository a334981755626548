// Matrix products for XLA:CPU on int8 and 4-bit weights with the activations quantized to int8:
// integer dot products (AVX2's vpmaddubsw, as llama.cpp multiplies its Q8_0/Q4 blocks), where
// matmul_formats.cc widens every weight to float32 before a float multiply-add.
//
// y [M, N] float32 = x [M, K] float32 . W. Each row of x is quantized per block of `block`
// inputs (32, or K where 32 does not divide K): xq = round(x / d), d = max|x| / 127, and the
// block's sum d * sum(xq) kept. W [K, N] is packed (runtime/ops/matmul.py PackedWeight.dot) in panels
// of 16 output columns whose k run in quads: a quad holds the 16 columns x 4 consecutive k,
// column-major (byte 4 j + i: column j, input 4 q + i), so one 32-byte register holds 8
// columns x 4 inputs, which vpmaddubsw multiplies with the row's 4 int8 inputs broadcast and
// vpmaddwd sums to 8 int32 column partials:
//
// - i8 quads [N/16, K/4, 64] int8, scales [N/16, G, 16]: w = q * scale (G groups of K/G inputs;
//   vpmaddubsw's unsigned operand is |q|, its sign moved onto the inputs);
// - u4 quads [N/16, K/4, 32] uint8: byte b holds element b of columns 0-7 in its low nibble and
//   element b of columns 8-15 in its high one, with scales and offsets [N/16, G, 16]:
//   w = q * scale + offset, so a block adds scale * d * sum(q xq) + offset * d * sum(xq);
// - u5 quads [N/16, K/4, 40] uint8: a u4 quad and the values' fifth bits (struct U5), as u4;
// - u6 quads [N/16, K/4, 48] uint8: a u5 quad and the values' sixth bits (struct U6), with scales
//   [N/16, K/16, 16] and no offsets: w = (q - 32) * scale, a scale per 16 inputs (GGUF's Q6_K).
//
// Scales and offsets are float32, or float16 where the blocks came so from a GGUF file (Q8_0,
// Q4_0, Q4_1: the half scales as stored), or a K-quant's codes under its float16 super-scales
// (Q4_K, Q5_K, Q6_K: uint8 or int8 [N/16, G + 2 K / 256, 16], CodedScales), as the file keeps
// them. Per block of inputs the integer partials become
// float: y += d * scale * partial (+ offset * d * sum(xq)). Weight groups must be whole blocks. No
// int16 sum can saturate: int8 weights (|q| <= 128 against |xq| <= 127) widen each quad's
// pairs to int32 at once; 4-bit ones (q <= 15) sum 8 quads' pairs in int16 first, so a 4-bit
// block costs one vpmaddwd a row and half of the quad's columns, not eight.
//
// Integer products win most where few rows share each weight (decode: unpacking the weights is
// most of matmul_formats.cc's work); with many rows (a prefill) they about match its widened
// float panels (benchmarks/RESULTS.md, stop 43), and keep one arithmetic for every step. From 33
// rows the 512-bit form unpacks each panel's 4- to 6-bit quads once into bytes that all its row
// blocks read (DotTile; int8 quads are read in place), where fewer rows read the packed quads
// (DotRows512).
//
// Two more handlers take a decode step's small operations into these products (DotNormMatmul:
// an RMSNorm before one; DotMlpBlock: the second half of a decoder layer; layer_fusions.h), at
// the end of the file.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "half.h"
#include "layer_fusions.h"
#include "panels.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SERVAX_DOT_AVX2 1
// VNNI (AVX-512 VNNI with VL on Intel since Cascade Lake and on AMD Zen 4, or AVX-VNNI): one
// vpdpbusd multiplies 4 unsigned bytes by 4 signed ones and adds them to an int32 lane, where
// AVX2 takes vpmaddubsw, vpmaddwd and an add (and 4-bit runs their int16 sums).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SERVAX_DOT_VNNI(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SERVAX_DOT_VNNI(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#endif
// AVX-512 VNNI with BW (Intel since Cascade Lake, AMD Zen 4): DotRows512 multiplies 64 bytes of
// quads a vpdpbusd and keeps each row's 16 float sums in a register across the blocks.
// -DSERVAX_DOT_NO_512 builds the 256-bit VNNI form instead (what AVX-VNNI CPUs take), for A/B.
#if defined(SERVAX_DOT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(SERVAX_DOT_NO_512)
#define SERVAX_DOT_512 1
#endif
#ifdef SERVAX_DOT_VNNI
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

namespace ffi = xla::ffi;

namespace {

using servax::kPanel;
constexpr int64_t kBlock = 32;  // inputs per activation scale, where it divides K
constexpr int kRows = 4;        // rows of x per block: 8 int32 accumulators
// DotRows512's rows per block: 16 int32 accumulators and 8 float sums of the 32 registers, each
// panel's quads unpacked once for up to 8 rows.
#ifndef SERVAX_DOT_ROWS512
#define SERVAX_DOT_ROWS512 8
#endif
constexpr int kRows512 = SERVAX_DOT_ROWS512;
static_assert(kRows512 >= 1 && kRows512 <= 8, "RowsFns holds DotRows512 for 1 to 8 rows");
// How far ahead of the quad it multiplies the first row block prefetches its panel (the next
// panel follows in memory): with few rows the quads are read faster than the hardware
// prefetcher alone brings them in (1 row: 10-20% faster, benchmarks/RESULTS.md, stop 47).
#ifndef SERVAX_DOT_PREFETCH_BYTES
#define SERVAX_DOT_PREFETCH_BYTES 1024
#endif
constexpr int64_t kPrefetchBytes = SERVAX_DOT_PREFETCH_BYTES;

// x [M, K] quantized per block: q [M, K] int8, d, the sum d * sum(q) and the integer sum(q)
// [M, blocks]; for centred weights (U6), the integer sums of q per 16 inputs [M, K / 16] (what the
// centre multiplies); for signed weights in 512-bit registers (I8), q + 128 as unsigned bytes
// (`shifted`, vpdpbusd's unsigned operand).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<uint8_t> shifted;
  std::vector<float> d, sum;
  std::vector<int32_t> qsum, sum16;
  int64_t K = 0, block = 0, blocks = 0;
};

void Quantize(const float* x, int64_t M, int64_t K, int64_t block, bool sums16, bool shifted, QuantizedRows& out) {
  out.K = K, out.block = block, out.blocks = K / block;
  out.q.resize(M * K), out.d.resize(M * out.blocks), out.sum.resize(M * out.blocks), out.qsum.resize(M * out.blocks);
  out.shifted.resize(shifted ? M * K : 0);
  sums16 = sums16 && K % 16 == 0;
  out.sum16.resize(sums16 ? M * K / 16 : 0);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < out.blocks; ++b) {
      const float* in = x + r * K + b * block;
      int8_t* q = out.q.data() + r * K + b * block;
      uint8_t* u = shifted ? out.shifted.data() + r * K + b * block : nullptr;
      float d;
      int32_t qsum = 0;
#ifdef SERVAX_DOT_512
      if (block == kBlock) {  // the same numbers in two registers (cvtps rounds to nearest even, as nearbyint)
        const __m512 lo = _mm512_loadu_ps(in), hi = _mm512_loadu_ps(in + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        const __m256i bytes = _mm256_set_m128i(_mm512_cvtepi32_epi8(qhi), _mm512_cvtepi32_epi8(qlo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
        if (u != nullptr)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_xor_si256(bytes, _mm256_set1_epi8(-128)));
        d = amax / 127.0f, qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      } else
#endif
      {
        float amax = 0.0f;
        for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(in[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d = amax / 127.0f;
        for (int64_t i = 0; i < block; ++i) {
          q[i] = static_cast<int8_t>(std::nearbyint(in[i] * inv)), qsum += q[i];
          if (u != nullptr) u[i] = static_cast<uint8_t>(q[i]) ^ 0x80;
        }
      }
      // The sum of the block as quantized (as llama.cpp's Q8_1 keeps it): the offsets then multiply
      // the same inputs as the values do, and a block's error is that of the weights' products with
      // the rounded inputs. With the float sum, the values' rounding error (their mean is far from
      // zero, the offset holding the weights' centre) went uncancelled: ~3x the logprob error.
      out.d[r * out.blocks + b] = d, out.sum[r * out.blocks + b] = d * static_cast<float>(qsum);
      out.qsum[r * out.blocks + b] = qsum;
    }
    if (!sums16) continue;
    for (int64_t i = 0; i < K / 16; ++i) {
      const int8_t* q = out.q.data() + r * K + 16 * i;
      int32_t s = 0;
      for (int k = 0; k < 16; ++k) s += q[k];
      out.sum16[r * (K / 16) + i] = s;
    }
  }
}

struct I8 {
  using T = int8_t;
  static constexpr int64_t kQuad = 64;  // bytes per quad
  static constexpr bool kOffset = false;
  static constexpr bool kTileInPlace = true;  // DotTile reads its quads as they are packed (see Bytes)
#ifdef SERVAX_DOT_512
  static constexpr bool kShifted = true;  // the 512-bit Step multiplies the inputs shifted to unsigned bytes
#else
  static constexpr bool kShifted = false;
#endif
  // Quads per run: pairs of |q| <= 128 times |xq| <= 127 fill an int16 lane, so every quad's
  // are widened to int32 (a run is the whole block).
  static constexpr bool kInt16 = false;
  static constexpr int64_t kSpan = int64_t{1} << 40;
  // Inputs per scale within a block (a block's quads are multiplied in runs of kSub / 4 at most,
  // each scaled on its own), and the value subtracted from each weight (U6's 32).
  static constexpr int64_t kSub = kBlock;
  static constexpr int kCentre = 0;
  static int Value(const T* quad, int e) { return quad[e]; }  // element e = 4 j + i
#ifdef SERVAX_DOT_AVX2
  // The quad's two halves (columns 0-7, 8-15), and what each row's inputs are multiplied with.
  static void Load(const T* quad, __m256i& w0, __m256i& w1) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32));
  }
  static __m256i Products(__m256i w, __m256i x) {  // 16 int16: pairs of |w| * (x signed as w)
    return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  }
#ifdef SERVAX_DOT_VNNI
  static __m256i Dot(__m256i acc, __m256i w, __m256i x) {  // acc + 8 int32: quads of |w| * (x signed as w)
    return SERVAX_DOT_VNNI(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  }
#endif
#ifdef SERVAX_DOT_512
  // A step is one quad (16 columns x 4 inputs, 64 bytes): acc[0] (even quads) and acc[1] (odd
  // ones) each gain 16 int32 column partials, two chains of half the block's length. x4: the
  // row's 4 inputs of the quad shifted to unsigned (QuantizedRows::shifted, x + 128: vpdpbusd
  // multiplies unsigned bytes with signed ones), so row r gains x . w + 128 * sum(w); acc[MR]
  // gains the sums of the weights (times ones), which DotRows512 takes off 128 times per block:
  // one instruction a quad for all rows where moving the weights' signs onto each row's inputs
  // took one a row.
  template <int MR>
  static void Step(const T* quad, int64_t q, const uint8_t* const x4[MR], __m512i acc[][2]) {
    const __m512i w = _mm512_loadu_si512(quad);
    acc[MR][q & 1] = _mm512_dpbusd_epi32(acc[MR][q & 1], _mm512_set1_epi8(1), w);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, x4[r], 4);
      acc[r][q & 1] = _mm512_dpbusd_epi32(acc[r][q & 1], _mm512_set1_epi32(four), w);
    }
  }
  static __m512i Columns(__m512i even, __m512i odd) { return _mm512_add_epi32(even, odd); }
  // The quad as DotTile multiplies it: unsigned bytes q + 128 (lane j: column j's 4 inputs), 128
  // times the inputs' sum taken off each block's partials; one instruction, so DotTile reads the
  // packed quads in place (kTileInPlace) where the others' are unpacked once a panel.
  static constexpr int kTileCentre = 128;
  static __m512i Bytes(const T* quad) { return _mm512_xor_si512(_mm512_loadu_si512(quad), _mm512_set1_epi8(-128)); }
#endif
#endif
};

struct U4 {
  using T = uint8_t;
  static constexpr int64_t kQuad = 32;
  static constexpr bool kOffset = true;
  static constexpr bool kShifted = false;
  static constexpr bool kTileInPlace = false;  // DotTile unpacks its quads once a panel (Bytes)
  // Pairs of q <= 15 times |xq| <= 127 are at most 3810: 8 quads' sum in int16 (<= 30480).
  static constexpr bool kInt16 = true;
  static constexpr int64_t kSpan = 8;
  static constexpr int64_t kSub = kBlock;
  static constexpr int kCentre = 0;
  static int Value(const T* quad, int e) { return e < 32 ? quad[e] & 15 : quad[e - 32] >> 4; }
#ifdef SERVAX_DOT_AVX2
  static void Load(const T* quad, __m256i& w0, __m256i& w1) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
    const __m256i nib = _mm256_set1_epi8(15);
    w0 = _mm256_and_si256(v, nib), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  }
  static __m256i Products(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }
#ifdef SERVAX_DOT_VNNI
  static __m256i Dot(__m256i acc, __m256i w, __m256i x) { return SERVAX_DOT_VNNI(acc, w, x); }
#endif
#ifdef SERVAX_DOT_512
  // A step is one quad, as I8's: its 64 bytes (Bytes) against the row's 4 inputs broadcast, each
  // accumulator lane one column (Columns adds the even and odd quads' accumulators).
  template <int MR>
  static void Step(const T* quad, int64_t q, const int8_t* const x4[MR], __m512i acc[MR][2]) {
    Rows<MR>(Bytes(quad), q, x4, acc);
  }
  // Quad q's bytes w against each row's 4 inputs (U5's and U6's Step too).
  template <int MR>
  static void Rows(__m512i w, int64_t q, const int8_t* const x4[MR], __m512i acc[MR][2]) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, x4[r], 4);
      acc[r][q & 1] = _mm512_dpbusd_epi32(acc[r][q & 1], w, _mm512_set1_epi32(four));
    }
  }
  static __m512i Columns(__m512i even, __m512i odd) { return _mm512_add_epi32(even, odd); }
  // One quad as unsigned bytes, lane j column j's 4 inputs: the low nibbles (columns 0-7) in bytes
  // 0-31, the high ones (columns 8-15) in 32-63 (what Step, DotTile and U5's Step multiply): the
  // quad in both halves, the upper half's 16-bit words shifted down by 4.
  static constexpr int kTileCentre = 0;
  static __m512i Bytes(const T* quad) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(15));
  }
#endif
#endif
};

// 5-bit values (GGUF's Q5_0, Q5_1 and Q5_K as stored; 4-bit ones where a weight mixes both): a U4
// quad's 32 bytes of nibbles, then the values' fifth bits, 64 bits little-endian: bit b of the
// first 32 the fifth bit of the low-nibble value of byte b, bit b of the next 32 the high one's.
// Pairs of q <= 31 times |xq| <= 127 are at most 7874: 4 quads' sum in int16 (<= 31496).
struct U5 : U4 {  // T, kOffset, kInt16, Products and Dot as U4's
  static constexpr int64_t kQuad = 40;
  static constexpr int64_t kSpan = 4;
  static int Value(const T* quad, int e) { return U4::Value(quad, e) | (((quad[32 + e / 8] >> (e % 8)) & 1) << 4); }
  static uint32_t Bits(const T* p) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    return bits;
  }
#ifdef SERVAX_DOT_AVX2
  // `value` at byte b of 32 where bit b of `bits` is set, else 0.
  static __m256i Plane(uint32_t bits, char value) {
    const __m256i spread = _mm256_shuffle_epi8(  // byte b of the result: byte b / 8 of `bits`
        _mm256_set1_epi32(static_cast<int>(bits)), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(value));
  }
  static void Load(const T* quad, __m256i& w0, __m256i& w1) {
    U4::Load(quad, w0, w1);
    w0 = _mm256_or_si256(w0, Plane(Bits(quad + 32), 16)), w1 = _mm256_or_si256(w1, Plane(Bits(quad + 36), 16));
  }
#ifdef SERVAX_DOT_512
  // A step is one quad, as U4's: U4's Bytes, each higher bit added under its 64-bit mask (the
  // fields after the nibbles, kPlanes of them).
  template <int kPlanes = 1>
  static __m512i Bytes(const T* quad) {
    __m512i w = U4::Bytes(quad);
#pragma GCC unroll 2
    for (int plane = 0; plane < kPlanes; ++plane) {
      uint64_t bits;
      std::memcpy(&bits, quad + 32 + 8 * plane, 8);
      w = _mm512_mask_add_epi8(w, bits, w, _mm512_set1_epi8(static_cast<char>(16 << plane)));
    }
    return w;
  }
  template <int MR, int kPlanes = 1>
  static void Step(const T* quad, int64_t q, const int8_t* const x4[MR], __m512i acc[MR][2]) {
    Rows<MR>(Bytes<kPlanes>(quad), q, x4, acc);
  }
#endif
#endif
};

// 6-bit values (GGUF's Q6_K as stored): a U5 quad, then the values' sixth bits as the fifth ones
// (bytes 40-43 the low nibbles' values', 44-47 the high ones'). A weight is (q - 32) * scale, a scale
// per 16 inputs: each run of 4 quads is scaled on its own, 32 times its inputs' sum taken off its
// integer partials first (no offsets to read). Pairs of q <= 63 times |xq| <= 127 are at most
// 16002: AVX2 widens each quad's pairs to int32.
struct U6 : U5 {
  static constexpr int64_t kQuad = 48;
  static constexpr bool kOffset = false;
  static constexpr bool kInt16 = false;
  static constexpr int64_t kSpan = 4;
  static constexpr int64_t kSub = 16;
  static constexpr int kCentre = 32;
  static int Value(const T* quad, int e) { return U5::Value(quad, e) | (((quad[40 + e / 8] >> (e % 8)) & 1) << 5); }
#ifdef SERVAX_DOT_AVX2
  static void Load(const T* quad, __m256i& w0, __m256i& w1) {
    U5::Load(quad, w0, w1);
    w0 = _mm256_or_si256(w0, Plane(Bits(quad + 40), 32)), w1 = _mm256_or_si256(w1, Plane(Bits(quad + 44), 32));
  }
#ifdef SERVAX_DOT_512
  template <int MR>
  static void Step(const T* quad, int64_t q, const int8_t* const x4[MR], __m512i acc[MR][2]) {
    U5::Step<MR, 2>(quad, q, x4, acc);
  }
  static constexpr int kTileCentre = kCentre;
  static __m512i Bytes(const T* quad) { return U5::Bytes<2>(quad); }
#endif
#endif
};

// Inputs per scale within a block of `block` inputs: W::kSub for 6-bit values, else the block.
template <class W>
constexpr int64_t Sub(int64_t block) {
  return W::kSub < kBlock ? W::kSub : block;
}

// Scales and offsets as stored: float32, or float16 (GGUF's blocks keep their half-precision
// scales: a quarter fewer bytes to read per 4-bit block than with float32 ones), or the codes of
// GGUF's K-quants (CodedScales). Each reads group g of a panel's scales.
struct F32Scales {
  using T = float;
  static constexpr bool kCoded = false;
  static int64_t PanelSize(int64_t groups) { return groups * kPanel; }
  static float At(const T* p, int64_t g, int j) { return p[g * kPanel + j]; }
#ifdef SERVAX_DOT_AVX2
  static __m256 Load8(const T* p, int64_t g, int half) { return _mm256_loadu_ps(p + g * kPanel + 8 * half); }
#endif
#ifdef SERVAX_DOT_512
  static __m512 Load16(const T* p, int64_t g) { return _mm512_loadu_ps(p + g * kPanel); }
  static __m512 Super16(const T*, int64_t) { return _mm512_setzero_ps(); }  // (no super-scales)
  static __m512 Load16(const T* p, int64_t g, __m512) { return Load16(p, g); }
#endif
};

struct F16Scales {
  using T = uint16_t;
  static constexpr bool kCoded = false;
  static int64_t PanelSize(int64_t groups) { return groups * kPanel; }
  static float At(const T* p, int64_t g, int j) { return servax::HalfToFloat(p[g * kPanel + j]); }
#ifdef SERVAX_DOT_AVX2
  static __m256 Load8(const T* p, int64_t g, int half) { return servax::Load8Half(p + g * kPanel + 8 * half); }
#endif
#ifdef SERVAX_DOT_512
  static __m512 Load16(const T* p, int64_t g) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g * kPanel)));
  }
  static __m512 Super16(const T*, int64_t) { return _mm512_setzero_ps(); }
  static __m512 Load16(const T* p, int64_t g, __m512) { return Load16(p, g); }
#endif
};

// GGUF's K-quant scales (and offsets) as the file codes them: an integer code per group (Q4_K's
// and Q5_K's 6-bit scale and min codes per 32 inputs as uint8, Q6_K's int8 scales per 16) under a
// float16 super-scale per 256 inputs, scale = code * super. A panel holds, for each super-block,
// its kPer groups' rows of 16 codes, then the 16 columns' super-scales (32 bytes): 1.06 bytes a
// column per 32 inputs where float16 scales take 2.
constexpr int64_t kSuperBlock = 256;  // inputs per super-scale

template <class C, int64_t kPer>
struct CodedScales {
  using T = C;
  static constexpr bool kCoded = true;
  static int64_t PanelSize(int64_t groups) { return groups / kPer * (kPer + 2) * kPanel; }
  static const T* Super(const T* p, int64_t g) { return p + g / kPer * (kPer + 2) * kPanel; }
  static float At(const T* p, int64_t g, int j) {
    const T* s = Super(p, g);
    uint16_t half;
    std::memcpy(&half, s + kPer * kPanel + 2 * j, 2);
    return static_cast<float>(s[(g % kPer) * kPanel + j]) * servax::HalfToFloat(half);
  }
#ifdef SERVAX_DOT_AVX2
  static __m256 Load8(const T* p, int64_t g, int half) {
    const T* s = Super(p, g);
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + (g % kPer) * kPanel + 8 * half));
    const __m256i wide = std::is_signed_v<C> ? _mm256_cvtepi8_epi32(codes) : _mm256_cvtepu8_epi32(codes);
    const __m128i supers = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kPer * kPanel + 16 * half));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_cvtph_ps(supers));
  }
#endif
#ifdef SERVAX_DOT_512
  // Group g's super-scales, then its scales given them (DotRows512 converts each super-block's once).
  static __m512 Super16(const T* p, int64_t g) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Super(p, g) + kPer * kPanel)));
  }
  static __m512 Load16(const T* p, int64_t g, __m512 super) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Super(p, g) + (g % kPer) * kPanel));
    const __m512i wide = std::is_signed_v<C> ? _mm512_cvtepi8_epi32(codes) : _mm512_cvtepu8_epi32(codes);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), super);
  }
#endif
  // The panel's `groups` scales as float32 [groups, 16], for the row blocks that share them: each
  // super-block's super-scales converted once, its codes widened and multiplied.
  static void Decode(const T* p, int64_t groups, float* out) {
    for (int64_t g0 = 0; g0 < groups; g0 += kPer) {
#if defined(SERVAX_DOT_512)
      const __m512 super = Super16(p, g0);
#pragma GCC unroll 16
      for (int64_t g = g0; g < g0 + kPer; ++g) _mm512_storeu_ps(out + g * kPanel, Load16(p, g, super));
#else
      for (int64_t g = g0; g < g0 + kPer; ++g)
        for (int j = 0; j < kPanel; ++j) out[g * kPanel + j] = At(p, g, j);
#endif
    }
  }
};

// c[r, 0:16] = x[r] . W[:, panel] for MR rows from row r0: integer dot products over the
// quads of each run of W::kSpan quads (a 4-bit run sums its vpmaddubsw pairs in int16, one
// vpmaddwd per run; int8 and 6-bit weights widen every quad's pairs to int32), each run then
// scaled into float (d * scale, its centre's products taken off first; per block of inputs,
// + offset * d * sum(xq)).
template <class W, class S, int MR>
void DotRows(const QuantizedRows& x, int64_t r0, const typename W::T* panel, const typename S::T* scale,
             const typename S::T* offset, int64_t group, float* c, int64_t ldc) {
  const int64_t K = x.K, block = x.block, block_quads = x.block / 4;
  for (int r = 0; r < MR; ++r) std::fill(c + r * ldc, c + r * ldc + kPanel, 0.0f);
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t g = b * block / group;
    const typename W::T* quads = panel + (b * block / 4) * W::kQuad;
#ifdef SERVAX_DOT_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t q0 = 0; q0 < block_quads; q0 += W::kSpan) {  // a run lies in one group (Multiply)
      const int64_t q1 = std::min(block_quads, q0 + W::kSpan), at = b * block + 4 * q0;
      const __m256 s_lo = S::Load8(scale, at / group, 0), s_hi = S::Load8(scale, at / group, 1);
      __m256i acc[MR][2];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int64_t q = q0; q < q1; ++q) {
        if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(quads + q * W::kQuad) + kPrefetchBytes, _MM_HINT_T0);
        __m256i w0, w1;
        W::Load(quads + q * W::kQuad, w0, w1);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          int32_t four;
          std::memcpy(&four, x.q.data() + (r0 + r) * K + b * block + 4 * q, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          if constexpr (kVnni) {
            acc[r][0] = W::Dot(acc[r][0], w0, xb);
            acc[r][1] = W::Dot(acc[r][1], w1, xb);
          } else if constexpr (W::kInt16) {
            acc[r][0] = _mm256_add_epi16(acc[r][0], W::Products(w0, xb));
            acc[r][1] = _mm256_add_epi16(acc[r][1], W::Products(w1, xb));
          } else {
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(W::Products(w0, xb), ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(W::Products(w1, xb), ones));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        __m256i lo = acc[r][0], hi = acc[r][1];
        if constexpr (W::kInt16 && !kVnni) lo = _mm256_madd_epi16(lo, ones), hi = _mm256_madd_epi16(hi, ones);
        if constexpr (W::kCentre != 0) {  // the run is 16 inputs (W::kSpan quads)
          const __m256i centre = _mm256_set1_epi32(W::kCentre * x.sum16[(r0 + r) * (K / 16) + at / 16]);
          lo = _mm256_sub_epi32(lo, centre), hi = _mm256_sub_epi32(hi, centre);
        }
        const __m256 d = _mm256_set1_ps(x.d[(r0 + r) * x.blocks + b]);
        float* out = c + r * ldc;
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s_lo, d), _mm256_loadu_ps(out)));
        _mm256_storeu_ps(out + 8,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s_hi, d), _mm256_loadu_ps(out + 8)));
      }
    }
    if constexpr (W::kOffset) {
      const __m256 o_lo = S::Load8(offset, g, 0), o_hi = S::Load8(offset, g, 1);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256 sum = _mm256_set1_ps(x.sum[(r0 + r) * x.blocks + b]);
        float* out = c + r * ldc;
        _mm256_storeu_ps(out, _mm256_fmadd_ps(o_lo, sum, _mm256_loadu_ps(out)));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(o_hi, sum, _mm256_loadu_ps(out + 8)));
      }
    }
#else
    // Portable loops (runtime/ops/matmul.py uses the kernel only where AVX2 and FMA are there).
    const int64_t sub = Sub<W>(block);
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (r0 + r) * x.blocks + b;
      const int8_t* xq = x.q.data() + (r0 + r) * K + b * block;
      for (int j = 0; j < kPanel; ++j) {
        for (int64_t i0 = 0; i0 < block; i0 += sub) {
          int32_t dot = 0;
          for (int64_t i = i0; i < i0 + sub; ++i)
            dot += (W::Value(quads + (i / 4) * W::kQuad, 4 * j + i % 4) - W::kCentre) * xq[i];
          c[r * ldc + j] += x.d[at] * S::At(scale, (b * block + i0) / group, j) * dot;
        }
        if constexpr (W::kOffset) c[r * ldc + j] += S::At(offset, g, j) * x.sum[at];
      }
    }
#endif
  }
}

// Rows a DotTile call multiplies at most (one int32 accumulator and 16 float sums a row in
// registers), and the rows from which Multiply takes DotTile (DotRows512's blocks of 8 rows
// measured faster through 32 rows; from 64 DotTile at par or ahead, far ahead at 256 on 6-bit
// values; benchmarks/RESULTS.md, stop 65).
// -DSERVAX_DOT_TILE_FROM=N moves the latter (for A/B).
constexpr int kTileRows = 8;
#ifndef SERVAX_DOT_TILE_FROM
#define SERVAX_DOT_TILE_FROM 33
#endif
constexpr int64_t kTileFrom = SERVAX_DOT_TILE_FROM;

// The quantized rows as DotTile reads them, in Multiply's row blocks (n rows from row r0): a row
// block's quads row by row ([K / 4][n][4] bytes from r0 * K), its d and sum(x) per block
// ([blocks][n] from r0 * blocks) and the sums its weights' centre multiplies (per 16 inputs for
// 6-bit values, else per block: [per][n] from r0 * per). One pointer then reaches every row's
// inputs at offsets fixed at compile time.
struct TileRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> centre;
  int64_t K = 0, blocks = 0, per = 0;
};

void Interleave(const QuantizedRows& x, int64_t M, int64_t row_blocks, bool per16, TileRows& t) {
  const int64_t K = x.K, blocks = x.blocks, per = per16 ? K / 16 : blocks;
  t.K = K, t.blocks = blocks, t.per = per;
  t.q.resize(M * K), t.d.resize(M * blocks), t.sum.resize(M * blocks), t.centre.resize(M * per);
  for (int64_t blk = 0, r0 = 0; blk < row_blocks; ++blk) {
    const int64_t n = M / row_blocks + (blk < M % row_blocks);
    for (int64_t r = 0; r < n; ++r) {
      const int8_t* row = x.q.data() + (r0 + r) * K;
      for (int64_t q = 0; q < K / 4; ++q) std::memcpy(t.q.data() + r0 * K + (q * n + r) * 4, row + 4 * q, 4);
      for (int64_t b = 0; b < blocks; ++b) {
        t.d[r0 * blocks + b * n + r] = x.d[(r0 + r) * blocks + b];
        t.sum[r0 * blocks + b * n + r] = x.sum[(r0 + r) * blocks + b];
      }
      for (int64_t i = 0; i < per; ++i)
        t.centre[r0 * per + i * n + r] = per16 ? x.sum16[(r0 + r) * per + i] : x.qsum[(r0 + r) * blocks + i];
    }
    r0 += n;
  }
}

#ifdef SERVAX_DOT_512
// DotRows for blocks of 32 inputs in 512-bit registers: per block, W::Step over its 8 quads
// (64 bytes a step, int32 partials in two accumulators a row), then d * scale (+ offset *
// sum(x)) into the row's 16 float sums, which stay in a register until the panel is done.
template <class W, class S, int MR>
void DotRows512(const QuantizedRows& x, int64_t r0, const typename W::T* panel, const typename S::T* scale,
                const typename S::T* offset, int64_t group, float* c, int64_t ldc) {
  const int64_t K = x.K;
  constexpr int64_t kBlockQuads = kBlock / 4;
  using Row = std::conditional_t<W::kShifted, uint8_t, int8_t>;  // the inputs as Step multiplies them
  const Row* rows;
  if constexpr (W::kShifted) rows = x.shifted.data(); else rows = x.q.data();
  __m512 sums[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) sums[r] = _mm512_setzero_ps();
  __m512 super = _mm512_setzero_ps(), super_offset = _mm512_setzero_ps();  // K-quants': this super-block's
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t g = b * kBlock / group;
    if (S::kCoded && b % (kSuperBlock / kBlock) == 0) {
      super = S::Super16(scale, g);
      if constexpr (W::kOffset) super_offset = S::Super16(offset, g);
    }
    const typename W::T* quads = panel + b * kBlockQuads * W::kQuad;
    for (int64_t q0 = 0; q0 < kBlockQuads; q0 += W::kSub / 4) {  // a sub-block: its own scale
      __m512i acc[MR + W::kShifted][2];  // (shifted inputs: the weights' sums after the rows')
#pragma GCC unroll 9
      for (int r = 0; r < MR + W::kShifted; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t q = q0; q < q0 + W::kSub / 4; ++q) {
        if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(quads + q * W::kQuad) + kPrefetchBytes, _MM_HINT_T0);
        const Row* xs[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) xs[r] = rows + (r0 + r) * K + b * kBlock + 4 * q;
        W::template Step<MR>(quads + q * W::kQuad, q, xs, acc);
      }
      const int64_t at = b * kBlock + 4 * q0;
      const __m512 s = S::Load16(scale, at / group, super);
      __m512i shift = _mm512_setzero_si512();  // 128 times the weights' sums, what shifted inputs added
      if constexpr (W::kShifted) shift = _mm512_slli_epi32(W::Columns(acc[MR][0], acc[MR][1]), 7);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 d = _mm512_set1_ps(x.d[(r0 + r) * x.blocks + b]);
        __m512i columns = W::Columns(acc[r][0], acc[r][1]);
        if constexpr (W::kShifted) columns = _mm512_sub_epi32(columns, shift);
        if constexpr (W::kCentre != 0)
          columns = _mm512_sub_epi32(columns, _mm512_set1_epi32(W::kCentre * x.sum16[(r0 + r) * (K / 16) + at / 16]));
        sums[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(columns), _mm512_mul_ps(s, d), sums[r]);
      }
    }
    if constexpr (W::kOffset) {
      const __m512 o = S::Load16(offset, g, super_offset);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        sums[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(x.sum[(r0 + r) * x.blocks + b]), sums[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + r * ldc, sums[r]);
}

// A panel's K / 4 quads as DotTile reads them: 64 unsigned bytes each (W::Bytes).
template <class W>
void Unpack(const typename W::T* panel, int64_t quads, uint8_t* out) {
  for (int64_t q = 0; q < quads; ++q) _mm512_storeu_si512(out + 64 * q, W::Bytes(panel + q * W::kQuad));
}

// DotRows512 for many rows (a prefill, a large batch): the panel unpacked once (Unpack; int8 quads
// read in place, W::kTileInPlace) for all its row blocks, so that each quad is one load for up to
// kTileRows rows and a vpdpbusd a row (DotRows512 unpacks it again for every block of 8 rows, and
// I8's shifted inputs take a vpdpbusd more a quad); W::kTileCentre times the inputs' sum (per 16 or
// 32) taken off.
template <class W, class S, int MR>
void DotTile(const TileRows& x, int64_t r0, const uint8_t* bytes, const typename S::T* scale,
             const typename S::T* offset, int64_t group, float* c, int64_t ldc) {
  static_assert(!S::kCoded, "DotTile reads float scales (codes are decoded once a panel)");
  constexpr int64_t kBlockQuads = kBlock / 4, kSubQuads = W::kSub / 4;
  const int8_t* xq = x.q.data() + r0 * x.K;
  const float *xd = x.d.data() + r0 * x.blocks, *xs = x.sum.data() + r0 * x.blocks;
  const int32_t* xc = x.centre.data() + r0 * x.per;
  __m512 sums[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int64_t g = b * kBlock / group;
    for (int64_t q0 = 0; q0 < kBlockQuads; q0 += kSubQuads) {
      __m512i acc[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t q = q0; q < q0 + kSubQuads; ++q) {
        const uint8_t* quad = bytes + (b * kBlockQuads + q) * 64;
        __m512i w;
        if constexpr (W::kTileInPlace) w = W::Bytes(reinterpret_cast<const typename W::T*>(quad));
        else w = _mm512_loadu_si512(quad);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t four;
          std::memcpy(&four, xq + ((b * kBlockQuads + q) * MR + r) * 4, 4);
          acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(four));
        }
      }
      const int64_t at = b * kBlock + 4 * q0;
      const __m512 s = S::Load16(scale, at / group);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        __m512i columns = acc[r];
        if constexpr (W::kTileCentre != 0) {
          const int32_t n = xc[(W::kSub == 16 ? at / 16 : b) * MR + r];
          columns = _mm512_sub_epi32(columns, _mm512_set1_epi32(W::kTileCentre * n));
        }
        const __m512 d = _mm512_set1_ps(xd[b * MR + r]);
        sums[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(columns), _mm512_mul_ps(s, d), sums[r]);
      }
    }
    if constexpr (W::kOffset) {
      const __m512 o = S::Load16(offset, g);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        sums[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[b * MR + r]), sums[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + r * ldc, sums[r]);
}
#endif

template <class W, class S>
using DotRowsFn = void (*)(const QuantizedRows&, int64_t, const typename W::T*, const typename S::T*,
                           const typename S::T*, int64_t, float*, int64_t);

// Whether blocks of `block` inputs are multiplied by DotRows512.
constexpr bool Uses512(int64_t block) {
#ifdef SERVAX_DOT_512
  return block == kBlock;
#else
  return false;
#endif
}

// The rows functions of DotRows, or of DotRows512 where it multiplies the blocks.
template <class W, class S>
const DotRowsFn<W, S>* RowsFns(int64_t block) {
  static const DotRowsFn<W, S> fns[kRows + 1] = {nullptr, DotRows<W, S, 1>, DotRows<W, S, 2>, DotRows<W, S, 3>,
                                                 DotRows<W, S, 4>};
#ifdef SERVAX_DOT_512
  static const DotRowsFn<W, S> fns512[9] = {nullptr, DotRows512<W, S, 1>, DotRows512<W, S, 2>,
                                            DotRows512<W, S, 3>, DotRows512<W, S, 4>, DotRows512<W, S, 5>,
                                            DotRows512<W, S, 6>, DotRows512<W, S, 7>, DotRows512<W, S, 8>};
  if (Uses512(block)) return fns512;
#endif
  return fns;
}

template <class W, class S>
using DotTileFn = void (*)(const TileRows&, int64_t, const uint8_t*, const typename S::T*, const typename S::T*,
                           int64_t, float*, int64_t);

// DotTile's functions by rows (kTileRows / 2 to kTileRows: what Multiply's row blocks take from
// kTileFrom rows), or nullptr where DotRows512 does not multiply the blocks.
template <class W, class S>
const DotTileFn<W, S>* TileFns(int64_t block) {
#ifdef SERVAX_DOT_512
  static_assert(kTileRows == 8 && kTileFrom > kTileRows);
  static const DotTileFn<W, S> fns[kTileRows + 1] = {nullptr, nullptr, nullptr, nullptr, DotTile<W, S, 4>,
                                                     DotTile<W, S, 5>, DotTile<W, S, 6>, DotTile<W, S, 7>,
                                                     DotTile<W, S, 8>};
  if (Uses512(block)) return fns;
#endif
  return nullptr;
}

template <class W, class S>
ffi::Error Multiply(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K,
                    const typename W::T* packed, int64_t panels, const typename S::T* scales,
                    const typename S::T* offsets, int64_t groups, float* c) {
  const int64_t N = panels * kPanel, M = servax::ValidRows(rows, valid, N, c);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  const int64_t group = K / groups, block = K % kBlock == 0 && group % Sub<W>(kBlock) == 0 ? kBlock : K;
  if (group % Sub<W>(block) != 0 || (W::kCentre != 0 && K % 16 != 0))
    return ffi::Error::InvalidArgument("int8-activation matmul: weight groups must be whole blocks of 32 inputs "
                                       "(of 16 for 6-bit values, whose inputs must be a multiple of 16)");
  const DotRowsFn<W, S>* rows_fns = RowsFns<W, S>(block);
  const DotRowsFn<W, F32Scales>* decoded_fns = RowsFns<W, F32Scales>(block);
  // Many rows: DotTile on the panels unpacked once each, in row blocks of up to kTileRows.
  const bool tile = M >= kTileFrom && Uses512(block);
  const DotTileFn<W, F32Scales>* decoded_tile_fns = tile ? TileFns<W, F32Scales>(block) : nullptr;
  const DotTileFn<W, S>* tile_fns = nullptr;  // (codes: decoded first)
  if constexpr (!S::kCoded) tile_fns = decoded_tile_fns == nullptr ? nullptr : TileFns<W, S>(block);
  thread_local QuantizedRows xq;  // the calling thread's; the pool's threads only read it
  Quantize(x, M, K, block, W::kCentre != 0, W::kShifted && Uses512(block) && !tile, xq);
  const int64_t per_block = tile ? kTileRows : Uses512(block) ? kRows512 : kRows;
  const int64_t row_blocks = (M + per_block - 1) / per_block;
  thread_local TileRows xt;
  if (tile) Interleave(xq, M, row_blocks, W::kSub == 16, xt);
  const QuantizedRows& shared = xq;
  const TileRows& tiles = xt;
  servax::ForPanelRanges(pool, panels, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> decoded;  // codes multiplied out where several row blocks read them
    thread_local std::vector<uint8_t> unpacked;  // DotTile's panel (4- to 6-bit quads)
    const bool decode = S::kCoded && (tile || row_blocks > 2);
    if (decode) decoded.resize(2 * groups * kPanel);
    if (tile && !W::kTileInPlace) unpacked.resize(K / 4 * 64);
    for (int64_t p = first; p < last; ++p) {
      const typename W::T* panel = packed + p * (K / 4) * W::kQuad;
      const typename S::T* s = scales + p * S::PanelSize(groups);
      const typename S::T* o = W::kOffset ? offsets + p * S::PanelSize(groups) : nullptr;
      if constexpr (S::kCoded) {
        if (decode) {
          S::Decode(s, groups, decoded.data());
          if (W::kOffset) S::Decode(o, groups, decoded.data() + groups * kPanel);
        }
      }
      const uint8_t* tile_bytes = unpacked.data();  // DotTile's panel: unpacked, or the quads in place
#ifdef SERVAX_DOT_512
      if (W::kTileInPlace) tile_bytes = reinterpret_cast<const uint8_t*>(panel);
      else if (tile) Unpack<W>(panel, K / 4, unpacked.data());
      const int64_t panel_bytes = (K / 4) * W::kQuad, chunk = (panel_bytes / row_blocks + 63) / 64 * 64;
#endif
      for (int64_t blk = 0, r0 = 0; blk < row_blocks; ++blk) {
        const int64_t n = M / row_blocks + (blk < M % row_blocks);
#ifdef SERVAX_DOT_512
        // The thread's next panel from memory while this one's row blocks multiply, a share before
        // each (Unpack would otherwise wait for all of it at once, the memory idle meanwhile).
        if (tile && p + 1 < last)
          for (int64_t i = blk * chunk; i < std::min(panel_bytes, (blk + 1) * chunk); i += 64)
            _mm_prefetch(reinterpret_cast<const char*>(panel + panel_bytes) + i, _MM_HINT_T0);
#endif
        if (tile && decode)
          decoded_tile_fns[n](tiles, r0, tile_bytes, decoded.data(), decoded.data() + groups * kPanel, group,
                              c + r0 * N + p * kPanel, N);
        else if (tile)
          tile_fns[n](tiles, r0, tile_bytes, s, o, group, c + r0 * N + p * kPanel, N);
        else if (decode)
          decoded_fns[n](shared, r0, panel, decoded.data(), decoded.data() + groups * kPanel, group,
                         c + r0 * N + p * kPanel, N);
        else
          rows_fns[n](shared, r0, panel, s, o, group, c + r0 * N + p * kPanel, N);
        r0 += n;
      }
    }
  });
  return ffi::Error::Success();
}

// Groups of inputs that a panel's `rows` of scales cover: the rows themselves, or for K-quant
// codes (uint8 or int8, CodedScales) the rows less the super-scales' two a super-block; 0 where
// they do not divide K (in whole super-blocks for codes).
int64_t ScaleGroups(ffi::DataType type, int64_t K, int64_t rows) {
  const bool coded = type == ffi::DataType::U8 || type == ffi::DataType::S8;
  const int64_t supers = K / kSuperBlock, groups = coded ? rows - 2 * supers : rows;
  if (groups <= 0 || K % groups != 0 || (coded && (K % kSuperBlock != 0 || groups % supers != 0))) return 0;
  return groups;
}

// Scales (and offsets) of any stored dtype: the products of Multiply<W, S> for the matching S.
template <class W>
ffi::Error MultiplyScaled(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K,
                          const typename W::T* packed, int64_t panels, ffi::AnyBuffer scales,
                          const ffi::AnyBuffer* offsets, int64_t at, int64_t groups, float* c) {
  // `at`: the elements of scales (and offsets) before the layer's (panels.h LayerView); `groups`:
  // ScaleGroups'.
  if (offsets != nullptr && offsets->element_type() != scales.element_type())
    return ffi::Error::InvalidArgument("int8-activation matmul: scales and offsets of different dtypes");
  switch (scales.element_type()) {
    case ffi::DataType::F32:
      return Multiply<W, F32Scales>(pool, x, rows, valid, K, packed, panels, scales.reinterpret_data<float>() + at,
                                    offsets ? offsets->reinterpret_data<float>() + at : nullptr, groups, c);
    case ffi::DataType::F16:
      return Multiply<W, F16Scales>(pool, x, rows, valid, K, packed, panels,
                                    scales.reinterpret_data<uint16_t>() + at,
                                    offsets ? offsets->reinterpret_data<uint16_t>() + at : nullptr, groups, c);
    default:
      break;
  }
  // K-quant codes: a code per W::kSub inputs (Q4_K's and Q5_K's uint8 per 32, Q6_K's int8 per 16)
  constexpr int64_t kPer = kSuperBlock / W::kSub;
  const bool coded = scales.element_type() == (W::kCentre != 0 ? ffi::DataType::S8 : ffi::DataType::U8);
  if constexpr (!std::is_same_v<W, I8>) {
    using C = std::conditional_t<W::kCentre != 0, int8_t, uint8_t>;
    if (coded && groups * W::kSub == K)
      return Multiply<W, CodedScales<C, kPer>>(pool, x, rows, valid, K, packed, panels,
                                               scales.reinterpret_data<C>() + at,
                                               offsets ? offsets->reinterpret_data<C>() + at : nullptr, groups, c);
  }
  return ffi::Error::InvalidArgument("int8-activation matmul: scales must be float32 or float16, or a K-quant's "
                                     "codes (4- and 5-bit values' uint8 per 32 inputs, 6-bit ones' int8 per 16)");
}

// A K x N matrix as quads [N/16, K/4, bytes] and scales (offsets) [N/16, G, 16], G dividing K (one
// layer's dimensions where stacked: panels.h LayerView); K-quant codes [N/16, G + 2 K / 256, 16].
bool Panels(int64_t K, int64_t N, ffi::Span<const int64_t> pd, int64_t bytes, ffi::Span<const int64_t> sd,
            ffi::DataType scale_type) {
  return pd[2] == bytes && pd[1] * 4 == K && sd[0] == pd[0] && sd[2] == kPanel &&
         ScaleGroups(scale_type, K, sd[1]) > 0 && N == pd[0] * kPanel;
}

// Shapes: x [M, K]; quads [N/16, K/4, bytes]; scales (offsets) [N/16, G, 16], G dividing K; out [M, N];
// quads, scales and offsets each also as one layer of a stack [L, ...] (panels.h LayerView).
bool Shaped(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> pd, int64_t bytes, ffi::Span<const int64_t> sd,
            ffi::DataType scale_type, ffi::Span<const int64_t> od) {
  return xd.size() == 2 && od.size() == 2 && od[0] == xd[0] && Panels(xd[1], od[1], pd, bytes, sd, scale_type);
}

ffi::Error Int8Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> packed, ffi::AnyBuffer scales,
                   ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::F32> out) {
  servax::LayerView p, s;
  auto xd = x.dimensions();
  if (!servax::ViewLayer(packed.dimensions(), meta, p) || !servax::ViewLayer(scales.dimensions(), meta, s) ||
      !Shaped(xd, p.dims, I8::kQuad, s.dims, scales.element_type(), out->dimensions()))
    return ffi::Error::InvalidArgument(
        "int8-activation int8 matmul: x [M, K], quads [N/16, K/4, 64], scales [N/16, G, 16] with meta [rows] (or "
        "each [L, ...] with meta [rows, layer < L]), out [M, N]");
  return MultiplyScaled<I8>(pool, x.typed_data(), xd[0], meta.typed_data()[0], xd[1], packed.typed_data() + p.offset,
                            p.dims[0], scales, nullptr, s.offset, s.dims[1], out->typed_data());
}

// Whether quads of `bytes` are 4-, 5- or 6-bit ones, with offsets shaped as the scales where they
// are read (not for 6-bit values).
bool UnsignedQuads(int64_t bytes, ffi::Span<const int64_t> scales, ffi::Span<const int64_t> offsets) {
  if (bytes != U4::kQuad && bytes != U5::kQuad && bytes != U6::kQuad) return false;
  return bytes == U6::kQuad || std::equal(scales.begin(), scales.end(), offsets.begin(), offsets.end());
}

// 4-, 5- or 6-bit quads (of `bytes` each) as MultiplyScaled<U4, U5 or U6> multiplies them.
ffi::Error MultiplyUnsigned(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K,
                            const uint8_t* packed, int64_t panels, int64_t bytes, ffi::AnyBuffer scales,
                            ffi::AnyBuffer& offsets, int64_t at, int64_t groups, float* c) {
  if (bytes == U6::kQuad)
    return MultiplyScaled<U6>(pool, x, rows, valid, K, packed, panels, scales, nullptr, at, groups, c);
  return (bytes == U5::kQuad ? MultiplyScaled<U5> : MultiplyScaled<U4>)(pool, x, rows, valid, K, packed, panels,
                                                                        scales, &offsets, at, groups, c);
}

ffi::Error UInt4Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer scales,
                    ffi::AnyBuffer offsets, ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::F32> out) {
  servax::LayerView p, s;
  auto xd = x.dimensions(), sd = scales.dimensions(), od = offsets.dimensions();
  const bool ok = servax::ViewLayer(packed.dimensions(), meta, p) && servax::ViewLayer(sd, meta, s);
  const int64_t bytes = ok ? p.dims[2] : 0;
  if (!ok || !UnsignedQuads(bytes, sd, od) ||
      !Shaped(xd, p.dims, bytes, s.dims, scales.element_type(), out->dimensions()))
    return ffi::Error::InvalidArgument("int8-activation 4-, 5- or 6-bit matmul: x [M, K], quads [N/16, K/4, 32, 40 "
                                       "or 48], scales and offsets [N/16, G, 16] (6-bit: offsets ignored) with meta "
                                       "[rows] (or each [L, ...] with meta [rows, layer < L]), out [M, N]");
  return MultiplyUnsigned(pool, x.typed_data(), xd[0], meta.typed_data()[0], xd[1], packed.typed_data() + p.offset,
                          p.dims[0], bytes, scales, offsets, s.offset,
                          ScaleGroups(scales.element_type(), xd[1], s.dims[1]), out->typed_data());
}

// ---- a decoder layer's small operations between these products (layer_fusions.h) -------------

// The fused handlers' products (layer_fusions.h): one matrix of a fused call as int8 quads (S8, 64
// bytes a quad) or 4-, 5- or 6-bit ones (U8, 32, 40 or 48 bytes a quad, the first two with
// offsets), scales and offsets as this file's products take them; `offsets` of an int8 or 6-bit
// matrix is ignored (an empty array).
struct DotProducts {
  static constexpr const char* kName = "int8-activation";

  static ffi::Error Product(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K, int64_t N,
                            ffi::AnyBuffer panels, ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                            ffi::Buffer<ffi::S32>& meta, float* c) {
    servax::LayerView p, s;
    const bool u4 = panels.element_type() == ffi::DataType::U8;  // or 5- or 6-bit: quads of 40 or 48 bytes
    const bool ok = servax::ViewLayer(panels.dimensions(), meta, p) && servax::ViewLayer(scales.dimensions(), meta, s);
    const int64_t bytes = !ok ? 0 : u4 ? p.dims[2] : I8::kQuad;
    if ((!u4 && panels.element_type() != ffi::DataType::S8) || !ok ||
        !Panels(K, N, p.dims, bytes, s.dims, scales.element_type()) ||
        (u4 && !UnsignedQuads(bytes, scales.dimensions(), offsets.dimensions())))
      return ffi::Error::InvalidArgument("int8-activation fused layer ops: each matrix as quads [(L,) N/16, K/4, 64] "
                                         "int8 or [(L,) N/16, K/4, 32, 40 or 48] uint8 (4-, 5- or 6-bit), scales "
                                         "(and a 4- or 5-bit one's offsets) [(L,) N/16, G, 16], G dividing K");
    if (u4)
      return MultiplyUnsigned(pool, x, rows, valid, K, panels.reinterpret_data<uint8_t>() + p.offset, p.dims[0], bytes,
                              scales, offsets, s.offset, ScaleGroups(scales.element_type(), K, s.dims[1]), c);
    return MultiplyScaled<I8>(pool, x, rows, valid, K, panels.reinterpret_data<int8_t>() + p.offset, p.dims[0], scales,
                              nullptr, s.offset, s.dims[1], c);
  }
};

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxInt8DotMatmul, Int8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()  // quads [N / 16, K / 4, 64]
                                  .Arg<ffi::AnyBuffer>()  // scales [N / 16, G, 16], float32 or float16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxUInt4DotMatmul, UInt4Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()  // quads [N / 16, K / 4, 32, 40 or 48]: 4-6 bits
                                  .Arg<ffi::AnyBuffer>()  // scales [N / 16, G, 16], float32 or float16
                                  .Arg<ffi::AnyBuffer>()  // offsets [N / 16, G, 16], as the scales (6-bit: any)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxDotMlpBlock, servax::MlpBlockHandler<DotProducts>,
                              servax::MlpBlockBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxDotNormMatmul, servax::NormMatmulHandler<DotProducts>,
                              servax::NormMatmulBinding());
