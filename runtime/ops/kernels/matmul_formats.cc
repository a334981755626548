// Matrix products for XLA:CPU on weights kept in the format they were stored in, packed once
// at load (runtime/ops/matmul.py): y [M, N] float32 = x [M, K] float32 . W, with W [K, N] in
// panels of 16 output columns as matmul.cc packs float32 (packed[p, k, :] holds row k of
// columns 16 p .. 16 p + 15), each panel row in one of these formats:
//
// - bf16: 16 bfloat16 (32 bytes); widened to float32 exactly (a 16-bit shift), or, where the
//         CPU has AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake and Sapphire Rapids), multiplied
//         as stored by vdpbf16ps with x rounded to bfloat16 (MultiplyBf16Pairs below).
// - i8:   16 int8 (16 bytes) and one float32 scale per column for each group of `group`
//         consecutive k (scales [N/16, K/group, 16]): w = q * scale. One group spanning K is
//         a per-channel scale (quantization "int8"); groups of 32 are GGUF's Q8_0 as stored.
// - u4:   16 unsigned 4-bit values in 8 bytes (byte j: column j in its low nibble, column
//         j + 8 in its high one) with a scale and an offset per column and group:
//         w = q * scale + offset. GGUF's Q4_0 (offset -8 scale), Q4_1 and Q4_K (per 32-block
//         scale and min, from the super-block's 6-bit codes) are all this form, value for
//         value as llama.cpp dequantizes them.
//
// Decode is bound by how fast the weights stream in: each format is read as stored and
// widened to float32 in registers, 16 columns at a time, right before its multiply-adds
// (float32 accumulation); a panel row is read once per row block of x. The row blocks and
// the task split follow matmul.cc's 256-bit form. Only the first `valid_rows` rows of x are
// multiplied (a step padded to its bucket pays for its real tokens). Packed operands may be one
// layer of a stack [L, ...] (panels.h LayerView).
//
// Two more handlers take a decode step's small operations into these products (NormMatmul: an
// RMSNorm before one; MlpBlock: the second half of a decoder layer; layer_fusions.h), at the end.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "layer_fusions.h"
#include "panels.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SERVAX_FORMATS_AVX2 1
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define SERVAX_FORMATS_DPBF16 1
#endif
#endif

namespace ffi = xla::ffi;

namespace {

using servax::kPanel;

#ifdef __AVX512F__
constexpr int kMaxRows = 8;  // 16 accumulators of 32 vector registers
#else
constexpr int kMaxRows = 6;  // 12 accumulators, the panel row and a broadcast in 16
#endif
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead the first row block prefetches its panel

// One panel row: 16 weights of one k, as two 8-float halves (columns 0-7, 8-15).
struct Float {  // a panel already widened (see Widen)
  using T = float;
  static constexpr int64_t kRow = 16;
  static constexpr bool kScaled = false, kOffset = false;
  static float At(const T* row, int j) { return row[j]; }
#ifdef SERVAX_FORMATS_AVX2
  static void Load(const T* row, __m256& lo, __m256& hi) { lo = _mm256_loadu_ps(row), hi = _mm256_loadu_ps(row + 8); }
#endif
};

struct Bf16 {
  using T = uint16_t;
  static constexpr int64_t kRow = 16;  // elements of T per panel row
  static constexpr bool kScaled = false, kOffset = false;
  static float At(const T* row, int j) {
    const uint32_t bits = static_cast<uint32_t>(row[j]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
#ifdef SERVAX_FORMATS_AVX2
  static void Load(const T* row, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
  }
#endif
};

struct Int8 {
  using T = int8_t;
  static constexpr int64_t kRow = 16;
  static constexpr bool kScaled = true, kOffset = false;
  static float At(const T* row, int j) { return static_cast<float>(row[j]); }
#ifdef SERVAX_FORMATS_AVX2
  static void Load(const T* row, __m256& lo, __m256& hi) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  }
#endif
};

struct UInt4 {
  using T = uint8_t;
  static constexpr int64_t kRow = 8;
  static constexpr bool kScaled = true, kOffset = true;
  static float At(const T* row, int j) { return static_cast<float>(j < 8 ? row[j] & 15 : row[j - 8] >> 4); }
#ifdef SERVAX_FORMATS_AVX2
  static void Load(const T* row, __m256& lo, __m256& hi) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row));
    const __m128i nib = _mm_set1_epi8(15);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, nib)));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nib)));
  }
#endif
};

// Weight j of a panel row of W, scaled and offset by group g's values where the format is.
template <class W>
inline float DequantizedAt(const typename W::T* row, int j, const float* scale, const float* offset, int64_t g) {
  const float w = W::At(row, j);
  if (!W::kScaled) return w;
  const float scaled = w * scale[g * kPanel + j];
  return W::kOffset ? scaled + offset[g * kPanel + j] : scaled;
}

#ifdef SERVAX_FORMATS_AVX2
// A panel row of W as two float32 halves, scaled (and offset) by its group's vectors where the
// format is.
template <class W>
inline void Dequantized(const typename W::T* row, __m256 s_lo, __m256 s_hi, __m256 o_lo, __m256 o_hi, __m256& lo,
                        __m256& hi) {
  W::Load(row, lo, hi);
  if (W::kOffset) {
    lo = _mm256_fmadd_ps(lo, s_lo, o_lo), hi = _mm256_fmadd_ps(hi, s_hi, o_hi);
  } else if (W::kScaled) {
    lo = _mm256_mul_ps(lo, s_lo), hi = _mm256_mul_ps(hi, s_hi);
  }
}
#endif

// c[r, 0:16] = sum_k a[r, k] * w[k, 0:16] for MR rows of a, w one panel in format W with its
// scales/offsets [K / group, 16] (unused for unscaled formats).
template <class W, int MR, bool kPrefetch>
void RowBlock(const float* a, int64_t lda, const typename W::T* panel, const float* scale, const float* offset,
              int64_t group, int64_t K, float* c, int64_t ldc, const typename W::T* next) {
#ifndef SERVAX_FORMATS_AVX2
  // Portable loops (runtime/ops/matmul.py uses the kernel only where AVX2 and FMA are there).
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = k / group;
    for (int j = 0; j < kPanel; ++j) {
      const float w = DequantizedAt<W>(panel + k * W::kRow, j, scale, offset, g);
      for (int r = 0; r < MR; ++r) acc[r][j] += a[r * lda + k] * w;
    }
  }
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + kPanel, c + r * ldc);
#else
  constexpr int64_t ahead = kPrefetchBytes / (W::kRow * sizeof(typename W::T));
  // Few rows leave the multiply-adds waiting on each other (each accumulator's chain is one
  // add a k): then S accumulators a row, each taking every S-th k, summed at the end.
  constexpr int S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m256 lo[S][MR], hi[S][MR];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) lo[s][r] = hi[s][r] = _mm256_setzero_ps();
  __m256 s_lo = _mm256_setzero_ps(), s_hi = s_lo, o_lo = s_lo, o_hi = s_lo;
  auto step = [&](int64_t k, int s) __attribute__((always_inline)) {
    if (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + ahead) * W::kRow), _MM_HINT_T0);
    } else if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * W::kRow), _MM_HINT_T1);
    }
    __m256 b0, b1;
    Dequantized<W>(panel + k * W::kRow, s_lo, s_hi, o_lo, o_hi, b0, b1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      lo[s][r] = _mm256_fmadd_ps(x, b0, lo[s][r]);
      hi[s][r] = _mm256_fmadd_ps(x, b1, hi[s][r]);
    }
  };
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    if (W::kScaled) {
      const float* sc = scale + (g0 / group) * kPanel;
      s_lo = _mm256_loadu_ps(sc), s_hi = _mm256_loadu_ps(sc + 8);
      if (W::kOffset) {
        const float* o = offset + (g0 / group) * kPanel;
        o_lo = _mm256_loadu_ps(o), o_hi = _mm256_loadu_ps(o + 8);
      }
    }
    const int64_t end = std::min(K, g0 + group);
    int64_t k = g0;
    for (; k + S <= end; k += S) {
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) step(k + s, s);
    }
    for (; k < end; ++k) step(k, 0);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int s = 1; s < S; ++s) lo[0][r] = _mm256_add_ps(lo[0][r], lo[s][r]), hi[0][r] = _mm256_add_ps(hi[0][r], hi[s][r]);
    _mm256_storeu_ps(c + r * ldc, lo[0][r]);
    _mm256_storeu_ps(c + r * ldc + 8, hi[0][r]);
  }
#endif
}

template <class W>
using RowBlockFn = void (*)(const float*, int64_t, const typename W::T*, const float*, const float*, int64_t, int64_t,
                            float*, int64_t, const typename W::T*);

// Rows one block of format W multiplies: with AVX2's 16 registers a scaled format gives up a
// row for its scale (and offset) registers.
template <class W>
constexpr int MaxRows() {
#ifdef __AVX512F__
  return kMaxRows;
#else
  return W::kScaled ? kMaxRows - 1 : kMaxRows;
#endif
}

// fns[kPrefetch][rows], rows 1..MaxRows<W>().
template <class W>
struct RowBlocks {
  RowBlockFn<W> fns[2][kMaxRows + 1];
  RowBlocks() {
    Fill<1>(std::false_type{});
    Fill<1>(std::true_type{});
  }
  template <int MR, class P>
  void Fill(P) {
    fns[P::value][MR] = RowBlock<W, MR, P::value>;
    if constexpr (MR < MaxRows<W>()) Fill<MR + 1>(P{});
  }
};

// One panel of W widened to float32 [K, 16] in `out`, scales and offsets applied.
template <class W>
void Widen(const typename W::T* panel, const float* scale, const float* offset, int64_t group, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = k / group;
#ifdef SERVAX_FORMATS_AVX2
    const __m256 none = _mm256_setzero_ps();
    const float* s = W::kScaled ? scale + g * kPanel : nullptr;
    const float* o = W::kOffset ? offset + g * kPanel : nullptr;
    __m256 lo, hi;
    Dequantized<W>(panel + k * W::kRow, s ? _mm256_loadu_ps(s) : none, s ? _mm256_loadu_ps(s + 8) : none,
                   o ? _mm256_loadu_ps(o) : none, o ? _mm256_loadu_ps(o + 8) : none, lo, hi);
    _mm256_storeu_ps(out + k * kPanel, lo);
    _mm256_storeu_ps(out + k * kPanel + 8, hi);
#else
    for (int j = 0; j < kPanel; ++j) out[k * kPanel + j] = DequantizedAt<W>(panel + k * W::kRow, j, scale, offset, g);
#endif
  }
}

// The rows of a [M, K] times panels [first, last) of W into c [M, N] (matmul.cc's MultiplyPanels).
// Rows in one block read each panel row once, widening it in registers; more rows (a prefill)
// widen the panel once into a float32 scratch panel that every row block then reads from cache.
template <class W>
void MultiplyPanels(const float* a, int64_t M, int64_t K, const typename W::T* b, const float* scales,
                    const float* offsets, int64_t groups, int64_t first, int64_t last, float* c, int64_t N) {
  static const RowBlocks<W> form;
  static const RowBlocks<Float> widened;
  thread_local std::vector<float> scratch;
  // One block of rows reads the panel as stored; more widen it (then in blocks of Float's rows).
  const bool widen = M > MaxRows<W>();
  const int64_t rows_per_block = widen ? MaxRows<Float>() : MaxRows<W>();
  const int64_t blocks = (M + rows_per_block - 1) / rows_per_block, group = K / groups;
  for (int64_t p = first; p < last; ++p) {
    const typename W::T* panel = b + p * K * W::kRow;
    const float* s = W::kScaled ? scales + p * groups * kPanel : nullptr;
    const float* o = W::kOffset ? offsets + p * groups * kPanel : nullptr;
    if (widen) {
      scratch.resize(K * kPanel);
      Widen<W>(panel, s, o, group, K, scratch.data());
    }
    for (int64_t blk = 0, r0 = 0; blk < blocks; ++blk) {
      const int64_t rows = M / blocks + (blk < M % blocks);
      if (widen) {
        widened.fns[0][rows](a + r0 * K, K, scratch.data(), nullptr, nullptr, K, K, c + r0 * N + p * kPanel, N,
                             nullptr);
      } else {
        form.fns[1][rows](a + r0 * K, K, panel, s, o, group, K, c + r0 * N + p * kPanel, N, nullptr);
      }
      r0 += rows;
    }
  }
}

template <class W>
ffi::Error Multiply(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K,
                    const typename W::T* packed, int64_t panels, const float* scales, const float* offsets,
                    int64_t groups, float* c) {
  const int64_t N = panels * kPanel, M = servax::ValidRows(rows, valid, N, c);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  servax::ForPanelRanges(pool, panels, 1, [&](int64_t first, int64_t last) {
    MultiplyPanels<W>(x, M, K, packed, scales, offsets, groups, first, last, c, N);
  });
  return ffi::Error::Success();
}

#ifdef SERVAX_FORMATS_DPBF16
// bfloat16 weights times x rounded to bfloat16, by AVX-512 BF16's vdpbf16ps: each 32-bit lane
// gains the sum of two products of bfloat16 pairs, in float32 (the products are exact; x's
// rounding is the only one beyond float32 accumulation's, as in a bfloat16 model's own
// activations). A panel's rows k and k + 1 are interleaved in registers (vpunpck{l,h}wd:
// columns 0-3 and 8-11 in one register, 4-7 and 12-15 in the other), each x pair broadcast as
// one 32-bit lane: per two k and row, two dot-product instructions where the float32 form
// widens both rows and takes four multiply-adds. Every step's products take this form (one
// arithmetic whatever the batch), batch 1 included: it is bound by reading the weights either way.
constexpr int kPairRows = 12;  // 24 accumulators of AVX-512's 32 vector registers
// A single row block of at least this many rows also fetches the thread's next panel into L2 as it
// multiplies (it computes long enough per panel to wait on memory otherwise); fewer rows are bound
// by reading their own panel, which the next one's lines would only compete with.
constexpr int64_t kNextPanelRows = 9;

// x [M, K] rounded to bfloat16 (nearest even) into rows of ld = K rounded up to even elements,
// a last odd column padded with zero.
void RoundRows(const float* x, int64_t M, int64_t K, int64_t ld, uint16_t* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* in = x + r * K;
    uint16_t* o = out + r * ld;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + k)));
    if (k < K) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, in + k));
      _mm256_mask_storeu_epi16(o + k, static_cast<__mmask16>((1u << (ld - k)) - 1), v);
    }
  }
}

// c[r, 0:16] = sum_k a[r, k] * w[k, 0:16] for MR rows of a (bfloat16, rows of lda elements)
// and one bfloat16 panel [K, 16]. kPrefetch: the block fetches its own panel ahead of its loads;
// given `next`, it also fetches a cache line of that panel into L2 every `every` pairs of k (one
// line of its own panel a pair), as matmul.cc's row blocks do.
template <int MR, bool kPrefetch>
void PairRowBlock(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t K, float* c, int64_t ldc,
                  const uint16_t* next, int64_t every) {
  constexpr int64_t ahead = kPrefetchBytes / sizeof(uint16_t);
  int64_t due = 0;  // the next k at which this block fetches a line of `next`
  // As RowBlock: few rows split each accumulator's chain over S accumulators.
  constexpr int S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m256 lo[S][MR], hi[S][MR];  // lo: columns 0-3, 8-11; hi: 4-7, 12-15
#pragma GCC unroll 12
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) lo[s][r] = hi[s][r] = _mm256_setzero_ps();
  auto step = [&](int64_t k, int s, __m256i r1) __attribute__((always_inline)) {
    if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(panel + k * kPanel + ahead), _MM_HINT_T0);
    if (next != nullptr && k == due) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      next += every * 2 * kPanel, due += every * 2;
    }
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel));
    const __m256bh w0 = (__m256bh)_mm256_unpacklo_epi16(r0, r1), w1 = (__m256bh)_mm256_unpackhi_epi16(r0, r1);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + k, 4);
      const __m256bh x = (__m256bh)_mm256_set1_epi32(pair);
      lo[s][r] = _mm256_dpbf16_ps(lo[s][r], w0, x);
      hi[s][r] = _mm256_dpbf16_ps(hi[s][r], w1, x);
    }
  };
  auto next_row = [&](int64_t k) __attribute__((always_inline)) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (k + 1) * kPanel));
  };
  int64_t k = 0;
  for (; k + 2 * S <= K; k += 2 * S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) step(k + 2 * s, s, next_row(k + 2 * s));
  }
  for (; k + 2 <= K; k += 2) step(k, 0, next_row(k));
  if (k < K) step(k, 0, _mm256_setzero_si256());  // odd K: x's padding column is zero
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int s = 1; s < S; ++s) lo[0][r] = _mm256_add_ps(lo[0][r], lo[s][r]), hi[0][r] = _mm256_add_ps(hi[0][r], hi[s][r]);
    _mm256_storeu_ps(c + r * ldc, _mm256_permute2f128_ps(lo[0][r], hi[0][r], 0x20));
    _mm256_storeu_ps(c + r * ldc + 8, _mm256_permute2f128_ps(lo[0][r], hi[0][r], 0x31));
  }
}

using PairRowBlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                                const uint16_t*, int64_t);

// fns[kPrefetch][rows], rows 1..kPairRows.
struct PairRowBlocks {
  PairRowBlockFn fns[2][kPairRows + 1];
  PairRowBlocks() {
    Fill<1>(std::false_type{});
    Fill<1>(std::true_type{});
  }
  template <int MR, class P>
  void Fill(P) {
    fns[P::value][MR] = PairRowBlock<MR, P::value>;
    if constexpr (MR < kPairRows) Fill<MR + 1>(P{});
  }
};

ffi::Error MultiplyBf16Pairs(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K,
                             const uint16_t* packed, int64_t panels, float* c) {
  static const PairRowBlocks form;
  const int64_t N = panels * kPanel, M = servax::ValidRows(rows, valid, N, c);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  thread_local std::vector<uint16_t> rounded;  // the calling thread's; the pool's threads only read it
  const int64_t ld = K + (K & 1);
  rounded.resize(M * ld);
  RoundRows(x, M, K, ld, rounded.data());
  const uint16_t* a = rounded.data();
  const int64_t blocks = (M + kPairRows - 1) / kPairRows;
  servax::ForPanelRanges(pool, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const uint16_t* panel = packed + p * K * kPanel;
      for (int64_t blk = 0, r0 = 0; blk < blocks; ++blk) {
        const int64_t n = M / blocks + (blk < M % blocks);
        // Rows in several blocks: each panel is fetched into L2 while the previous one is
        // multiplied, a share by each block (as matmul.cc's MultiplyPanels); the thread's first
        // panel, or a single block's, is fetched by its first block as it goes, and a single
        // block of kNextPanelRows or more fetches the next panel as well.
        const bool fetch_own = blocks == 1 || p == first;
        // How many blocks fetch the next panel, and which of them this one is (it fetches for 0 <= j < fetchers).
        const int64_t fetchers = blocks == 1 ? M >= kNextPanelRows : blocks - fetch_own;
        const int64_t j = blocks == 1 ? 0 : blk - fetch_own;
        const uint16_t* next = j >= 0 && j < fetchers && p + 1 < last ? panel + (K + 2 * j) * kPanel : nullptr;
        form.fns[blk == 0 && fetch_own][n](a + r0 * ld, ld, panel, K, c + r0 * N + p * kPanel, N, next, fetchers);
        r0 += n;
      }
    }
  });
  return ffi::Error::Success();
}
#endif

// bfloat16 panels [N/16, K, 16] times x: by vdpbf16ps where the CPU has it (x rounded to
// bfloat16), else widened to float32 (Bf16Matmul's product, and the fused calls').
ffi::Error MultiplyBf16(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K,
                        const uint16_t* packed, int64_t panels, float* c) {
#ifdef SERVAX_FORMATS_DPBF16
  return MultiplyBf16Pairs(pool, x, rows, valid, K, packed, panels, c);
#else
  return Multiply<Bf16>(pool, x, rows, valid, K, packed, panels, nullptr, nullptr, 1, c);
#endif
}

// Shapes: x [M, K]; packed [N/16, K, row]; scales/offsets [N/16, G, 16] with G dividing K; each
// also as one layer of a stack [L, ...] (panels.h LayerView), all read at meta's layer.
bool Shaped(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> pd, int64_t row, ffi::Span<const int64_t> od) {
  return xd.size() == 2 && pd[2] == row && pd[1] == xd[1] && od.size() == 2 && od[0] == xd[0] &&
         od[1] == pd[0] * kPanel;
}

bool ScalesShaped(ffi::Span<const int64_t> sd, ffi::Span<const int64_t> pd) {
  return sd[0] == pd[0] && sd[2] == kPanel && sd[1] > 0 && pd[1] % sd[1] == 0;
}

// The layer meta names of each operand (all stacked or none), and whether their shapes fit.
template <class... Buffers>
bool Views(ffi::Buffer<ffi::S32>& meta, servax::LayerView* views, Buffers&... operands) {
  int i = 0;
  return (servax::ViewLayer(operands.dimensions(), meta, views[i++]) && ...);
}

constexpr char kShapes[] = "x [M, K], packed [N/16, K, row] and scales (offsets) [N/16, G, 16] (G divides K) with "
                           "meta [rows], or each [L, ...] with meta [rows, layer < L]; out [M, N]";

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> packed,
                      ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::F32> out) {
  servax::LayerView v[1];
  auto xd = x.dimensions();
  if (!Views(meta, v, packed) || !Shaped(xd, v[0].dims, Bf16::kRow, out->dimensions()))
    return ffi::Error::InvalidArgument(std::string("bf16 packed matmul: ") + kShapes);
  const uint16_t* panels = reinterpret_cast<const uint16_t*>(packed.untyped_data()) + v[0].offset;
  return MultiplyBf16(pool, x.typed_data(), xd[0], meta.typed_data()[0], xd[1], panels, v[0].dims[0],
                      out->typed_data());
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> packed,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::F32> out) {
  servax::LayerView v[2];
  auto xd = x.dimensions();
  if (!Views(meta, v, packed, scales) || !Shaped(xd, v[0].dims, Int8::kRow, out->dimensions()) ||
      !ScalesShaped(v[1].dims, v[0].dims))
    return ffi::Error::InvalidArgument(std::string("int8 packed matmul: ") + kShapes);
  return Multiply<Int8>(pool, x.typed_data(), xd[0], meta.typed_data()[0], xd[1], packed.typed_data() + v[0].offset,
                        v[0].dims[0], scales.typed_data() + v[1].offset, nullptr, v[1].dims[1], out->typed_data());
}

ffi::Error UInt4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                       ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets, ffi::Buffer<ffi::S32> meta,
                       ffi::ResultBuffer<ffi::F32> out) {
  servax::LayerView v[3];
  auto xd = x.dimensions();
  if (!Views(meta, v, packed, scales, offsets) || !Shaped(xd, v[0].dims, UInt4::kRow, out->dimensions()) ||
      !ScalesShaped(v[1].dims, v[0].dims) || !std::equal(v[1].dims.begin(), v[1].dims.end(), v[2].dims.begin()))
    return ffi::Error::InvalidArgument(std::string("4-bit packed matmul: ") + kShapes);
  return Multiply<UInt4>(pool, x.typed_data(), xd[0], meta.typed_data()[0], xd[1], packed.typed_data() + v[0].offset,
                         v[0].dims[0], scales.typed_data() + v[1].offset, offsets.typed_data() + v[2].offset,
                         v[1].dims[1], out->typed_data());
}

// ---- a decoder layer's small operations between these products (layer_fusions.h) -------------

// The fused handlers' products (layer_fusions.h): one matrix of a fused call as bfloat16 or float32
// panels [(L,) N/16, K, 16] (scales and offsets empty), int8 ones [.., K, 16] with scales [(L,) N/16,
// G, 16], or 4-bit ones [.., K, 8] with scales and offsets, read at meta's layer where stacked; what
// Bf16Matmul, Int8Matmul and UInt4Matmul multiply (float32 panels as matmul.cc packs them, by this
// file's 256-bit products: runtime/ops/matmul.py gives them only one-row steps).
struct FormatProducts {
  static constexpr const char* kName = "fused";

  static ffi::Error Product(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t valid, int64_t K, int64_t N,
                            ffi::AnyBuffer panels, ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                            ffi::Buffer<ffi::S32>& meta, float* c) {
    const auto type = panels.element_type();
    const int64_t row = type == ffi::DataType::BF16 ? Bf16::kRow : type == ffi::DataType::S8 ? Int8::kRow
                        : type == ffi::DataType::U8 ? UInt4::kRow : type == ffi::DataType::F32 ? Float::kRow : 0;
    servax::LayerView p, s, o;
    const bool scaled = type == ffi::DataType::S8 || type == ffi::DataType::U8, offset = type == ffi::DataType::U8;
    bool ok = row > 0 && servax::ViewLayer(panels.dimensions(), meta, p) && p.dims[1] == K && p.dims[2] == row &&
              p.dims[0] * kPanel == N;
    if (ok && scaled)
      ok = scales.element_type() == ffi::DataType::F32 && servax::ViewLayer(scales.dimensions(), meta, s) &&
           ScalesShaped(s.dims, p.dims);
    if (ok && offset)
      ok = offsets.element_type() == ffi::DataType::F32 && servax::ViewLayer(offsets.dimensions(), meta, o) &&
           std::equal(s.dims.begin(), s.dims.end(), o.dims.begin(), o.dims.end());
    if (!ok)
      return ffi::Error::InvalidArgument("fused layer ops: each matrix as bfloat16 or float32 panels [(L,) N/16, K, "
                                         "16], int8 ones [.., K, 16] with float32 scales [(L,) N/16, G, 16] (G "
                                         "dividing K), or 4-bit ones [.., K, 8] with float32 scales and offsets");
    switch (type) {
      case ffi::DataType::BF16:
        return MultiplyBf16(pool, x, rows, valid, K, panels.reinterpret_data<uint16_t>() + p.offset, p.dims[0], c);
      case ffi::DataType::F32:
        return Multiply<Float>(pool, x, rows, valid, K, panels.reinterpret_data<float>() + p.offset, p.dims[0], nullptr,
                               nullptr, 1, c);
      case ffi::DataType::S8:
        return Multiply<Int8>(pool, x, rows, valid, K, panels.reinterpret_data<int8_t>() + p.offset, p.dims[0],
                              scales.reinterpret_data<float>() + s.offset, nullptr, s.dims[1], c);
      default:
        return Multiply<UInt4>(pool, x, rows, valid, K, panels.reinterpret_data<uint8_t>() + p.offset, p.dims[0],
                               scales.reinterpret_data<float>() + s.offset,
                               offsets.reinterpret_data<float>() + o.offset, s.dims[1], c);
    }
  }
};

}  // namespace

// Whether this build's bfloat16 products round x to bfloat16 (vdpbf16ps); runtime/ops/matmul.py
// bfloat16_products_round_activations.
extern "C" int ServaxBf16RoundsActivations() {
#ifdef SERVAX_FORMATS_DPBF16
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // packed W [N / 16, K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()  // packed W [N / 16, K, 16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N / 16, G, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxUInt4Matmul, UInt4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()  // packed W [N / 16, K, 8]: two columns a byte
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N / 16, G, 16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offsets [N / 16, G, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxMlpBlock, servax::MlpBlockHandler<FormatProducts>,
                              servax::MlpBlockBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxNormMatmul, servax::NormMatmulHandler<FormatProducts>,
                              servax::NormMatmulBinding());
