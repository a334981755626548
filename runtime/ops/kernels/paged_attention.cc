// Ragged paged attention for XLA:CPU, called from JAX as an FFI custom call
// (runtime/ops/cpu_kernels.py builds this file with the machine's C++ compiler and registers it;
// runtime/ops/attention_cpu.py calls it).
//
// Same contract as runtime.ops.attention_xla.ragged_paged_attention: token t of sequence s attends to
// the cached positions p with p <= positions[t], p < seq_lens[s] and, with a window W,
// positions[t] - p < W; the cache already holds this step's keys and values. The cache is
// [num_layers, num_blocks, kv_heads, block_size, row] and is read in place, a block at a time,
// through the sequence's row of the block table: no gathered copy of the context. A row holds
// head_dim (q's last dim) floats, or more where the cache's rows are wider than this layer's
// heads (Gemma 4's sliding layers in a cache shaped for its global ones): their first head_dim
// are read.
//
// Work is split into (sequence, kv head, query tile) items shared by the caller and XLA's
// intra-op thread pool. One item keeps its queries (tile tokens x the heads that read the kv
// head), their running max / denominator and their output accumulators in local buffers and
// folds the context in one block at a time (online softmax, as flash attention does). With
// AVX-512, an item of several tokens (a prefill tile) keeps its rows in vector lanes instead
// (RunItemRowsInLanes: scores, softmax and values on whole vectors, no horizontal sums), and a
// decode's rows of a group share each load of a key or value (RunDecode).
//
// PagedAttentionWrite (servax_paged_attention_write) takes a layer from its joined q/k/v product
// instead: it rotates q and k, writes the step's K/V into the cache (its results aliased to the
// cache operands) and then attends as PagedAttention does.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "half.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -1e30f;  // finite: exp() and max() stay free of NaNs
constexpr int64_t kRowsPerItem = 32;  // query rows (tokens x heads of a group) per work item
constexpr int64_t kRowsPerLanesItem = 48;  // the same in the rows-in-lanes form (three vectors of 16)
constexpr int64_t kItemsPerThread = 4;  // work items a thread, for few decodes (split-KV)
constexpr int64_t kMinPartBlocks = 4;   // the fewest blocks of context a split decode's part reads

// How the cache stores its values: float32; int8 / float8 e4m3 with a float32 scale per token
// and head (value = stored * scale; runtime/ops/step.py KVCache.k_scale); or bfloat16 / float16
// as they are (no scales).
enum class Stored { kF32, kS8, kF8E4M3, kBF16, kF16 };

struct Problem {
  const float* q;        // [T, H, D]
  const float* k_cache;  // [L, NB, KVH, BS, D] (float32 caches)
  const float* v_cache;
  Stored stored = Stored::kF32;
  const uint8_t* k_bytes = nullptr;  // any other cache's values, [L, NB, KVH, BS, D] of `bytes` each
  const uint8_t* v_bytes = nullptr;
  int64_t bytes = 4;                 // bytes a stored value: 1 (int8, float8) or 2 (bfloat16, float16)
  const float* k_scale = nullptr;  // [L, NB, KVH, BS] (int8 and float8 caches)
  const float* v_scale = nullptr;
  const int32_t* block_tables;  // [S, MB]
  const int32_t* seq_lens;      // [S]
  const int32_t* query_start;   // [S + 1]
  const int32_t* positions;     // [T]
  float* out;                   // [T, H, DV]
  float* partials = nullptr;    // [parts, H, DV + 2]: a split decode's per-part max, denominator and sums
  int64_t layer, num_blocks, kv_heads, block_size, head_dim, max_blocks, num_heads, group;
  int64_t row;  // floats a cached key (value) row holds: head_dim, or more where the cache's rows are
                // wider than this layer's heads (their first head_dim are read)
  int64_t value_dims;  // DV: D, or the leading dims of each key where the values are in the keys (v_cache = k_cache)
  int64_t window;  // <= 0: none
  float scale, soft_cap;  // soft_cap <= 0: none
};

struct Item {
  int32_t seq, h0, h1, t0, t1;  // tokens [t0, t1) of sequence seq, KV heads [h0, h1)
  int32_t g0 = 0, g1 = -1;      // the query heads [g0, g1) of each KV head's group (g1 < 0: all of them)
  // A decode's context split among items (split-KV): this item's keys [k0, k1) (block-aligned),
  // its rows' unnormalized results kept in partial slot `part` for MergeParts. part < 0: whole.
  int32_t k0 = 0, k1 = INT32_MAX, part = -1;
};

// Dot products of one query row with a block's keys, sr[j] = q . k_j (k: [BS, D]).
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t b) { return servax::BFloat16ToFloat(b); }
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 Load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 Load8(const uint16_t* x) { return servax::Load8BFloat16(x); }
#endif

// E: the keys' element, float or bfloat16 bits (uint16_t, widened as read).
template <int kBS, int kD, class E = float>
inline void Scores(const float* __restrict q, const E* __restrict k, float* __restrict sr, int64_t BS,
                   int64_t D, int64_t row) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kBS > 0 && kD > 0 && kBS % 8 == 0 && kD % 8 == 0) {
    // Eight keys at a time: eight accumulators over D, then one transposing reduction.
    __m256 qv[kD / 8];
    for (int c = 0; c < kD / 8; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
    for (int j0 = 0; j0 < kBS; j0 += 8) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) {
        const E* kj = k + (j0 + j) * kD;
        __m256 x = _mm256_mul_ps(qv[0], Load8(kj));
        for (int c = 1; c < kD / 8; ++c) x = _mm256_fmadd_ps(qv[c], Load8(kj + 8 * c), x);
        a[j] = x;
      }
      const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
      const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
      const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
      const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
      _mm256_storeu_ps(sr + j0, _mm256_add_ps(lo, hi));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < BS; ++j) {
    const E* __restrict kj = k + j * row;
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * ToFloat(kj[d]);
    sr[j] = dot;
  }
}

// exp(x) = 2^n e^r with n = round(x log2 e) and r = x - n ln 2 (ln 2 in two parts, for
// precision), e^r = 1 + r + r^2 p(r) with p's coefficients from highest to lowest degree.
constexpr float kExpMin = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0 (scores minus their running max), to ~2 ulp; x below -87 gives 0.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef __AVX512F__
// exp(x) for x <= 0, 16 lanes: Exp's polynomial and constants.
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

// sr[j] = exp(sr[j] - mx) (0 for masked keys); returns their sum.
template <int kBS>
inline float ExpShifted(float* __restrict sr, float mx, int64_t BS) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kBS > 0 && kBS % 8 == 0) {
    const __m256 m = _mm256_set1_ps(mx), masked = _mm256_set1_ps(0.5f * kMaskValue);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < kBS; j += 8) {
      const __m256 x = _mm256_loadu_ps(sr + j);
      const __m256 e = _mm256_and_ps(Exp(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, masked, _CMP_GT_OQ));
      _mm256_storeu_ps(sr + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(h);
  }
#endif
  float sum = 0.0f;
  // A masked key adds nothing, also while the row has seen no visible key yet.
  for (int64_t j = 0; j < BS; ++j) {
    const float e = std::exp(sr[j] - mx);
    sr[j] = sr[j] <= 0.5f * kMaskValue ? 0.0f : e;
    sum += sr[j];
  }
  return sum;
}

// acc = acc * correction + sum_j p[j] v_j (v: [BS, D]).
template <int kBS, int kD, class E = float>
inline void Accumulate(float* __restrict acc, float correction, const float* __restrict pr,
                       const E* __restrict v, int64_t BS, int64_t D, int64_t stride) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kBS > 0 && kD > 0 && kD % 8 == 0 && kD <= 128) {
    __m256 a[kD / 8];
    const __m256 c = _mm256_set1_ps(correction);
    for (int i = 0; i < kD / 8; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
    for (int j = 0; j < kBS; ++j) {
      const __m256 pj = _mm256_set1_ps(pr[j]);
      const E* vj = v + j * kD;
      for (int i = 0; i < kD / 8; ++i) a[i] = _mm256_fmadd_ps(pj, Load8(vj + 8 * i), a[i]);
    }
    for (int i = 0; i < kD / 8; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  for (int64_t j = 0; j < BS; ++j) {
    const float pj = pr[j];
    const E* __restrict vj = v + j * stride;  // value j: D floats of a row of `stride`
    for (int64_t d = 0; d < D; ++d) acc[d] += pj * ToFloat(vj[d]);
  }
}

// float8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities) as float.
inline float F8E4M3(uint8_t b) {
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  const float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                                        : exponent == 15 && mantissa == 7 ? NAN
                                                                          : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return b & 128 ? -magnitude : magnitude;
}

// `rows` rows of `dims` stored values (a stride of D apart; their scales, for int8 and float8) as
// float32 into out [rows, D].
inline void Dequantize(Stored stored, const uint8_t* values, const float* scale, int64_t rows, int64_t dims,
                       int64_t D, float* __restrict out) {
  static const std::array<float, 256> f8 = [] {
    std::array<float, 256> table{};
    for (int b = 0; b < 256; ++b) table[b] = F8E4M3(static_cast<uint8_t>(b));
    return table;
  }();
  if (stored == Stored::kBF16 || stored == Stored::kF16) {
    for (int64_t j = 0; j < rows; ++j) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(values) + j * D;
      float* __restrict dst = out + j * D;
      int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
      if (stored == Stored::kBF16)
        for (; d + 8 <= dims; d += 8) _mm256_storeu_ps(dst + d, servax::Load8BFloat16(row + d));
      else
        for (; d + 8 <= dims; d += 8) _mm256_storeu_ps(dst + d, servax::Load8Half(row + d));
#endif
      for (; d < dims; ++d)
        dst[d] = stored == Stored::kBF16 ? servax::BFloat16ToFloat(row[d]) : servax::HalfToFloat(row[d]);
    }
    return;
  }
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* row = values + j * D;
    const float sc = scale[j];
    float* __restrict dst = out + j * D;
    if (stored == Stored::kS8) {
      for (int64_t d = 0; d < dims; ++d) dst[d] = static_cast<float>(static_cast<int8_t>(row[d])) * sc;
    } else {
      for (int64_t d = 0; d < dims; ++d) dst[d] = f8[row[d]] * sc;
    }
  }
}

// What an item reads of its sequence: the positions of its tokens, the keys [lo, hi) they may
// see (never past the table's row), and where each block of the sequence lies in the cache.
struct ItemContext {
  ItemContext(const Problem& p, const Item& it, int64_t BS, int64_t D)
      : p(p), table(p.block_tables + it.seq * p.max_blocks), h0(it.h0), BS(BS), D(D), ctx(p.seq_lens[it.seq]) {
    for (int64_t t = it.t0; t < it.t1; ++t) {
      pmin = std::min(pmin, p.positions[t]);
      pmax = std::max(pmax, p.positions[t]);
    }
    hi = std::min<int64_t>({pmax + 1, ctx, p.max_blocks * BS, it.k1});
    lo = std::max<int64_t>(p.window > 0 ? std::max<int64_t>(0, pmin - p.window + 1) : 0, it.k0);
  }

  // Where (block b, KV head h0) starts; the item's heads follow it contiguously. Out-of-range
  // block ids are clamped (as XLA's gather does): a bad table reads wrong values, never
  // outside the cache.
  int64_t Offset(int64_t b) const {
    const int64_t block = std::clamp<int64_t>(table[b], 0, p.num_blocks - 1);
    return ((p.layer * p.num_blocks + block) * p.kv_heads + h0) * BS * D;
  }

  // Fetches block b + 1 (its `heads` heads, K and V) into L2 while block b is read.
  void PrefetchNext(int64_t b, int64_t heads) const {
    if ((b + 1) * BS >= hi) return;
    const int64_t next = Offset(b + 1);
    if (p.stored != Stored::kF32) {  // one or two bytes a value
      for (int64_t i = 0; i < heads * BS * D * p.bytes; i += 64) {
        __builtin_prefetch(p.k_bytes + next * p.bytes + i, 0, 1);
        __builtin_prefetch(p.v_bytes + next * p.bytes + i, 0, 1);
      }
      return;
    }
    for (int64_t i = 0; i < heads * BS * D; i += 16) {
      __builtin_prefetch(p.k_cache + next + i, 0, 1);
      __builtin_prefetch(p.v_cache + next + i, 0, 1);
    }
  }

  // A block's keys and values (the item's heads) as 64-byte lines, fetched into L2 a share at a
  // time; none (no lines) past the context.
  struct NextBlock {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t lines = 0;  // 64-byte lines of each

    // Share `part` of `parts` of the block's key (value) lines into L2.
    void FetchKeys(int64_t part, int64_t parts) const { Fetch(k, part, parts); }
    void FetchValues(int64_t part, int64_t parts) const { Fetch(v, part, parts); }
    void Fetch(const char* x, int64_t part, int64_t parts) const {
      for (int64_t i = part * lines / parts, end = (part + 1) * lines / parts; i < end; ++i)
        __builtin_prefetch(x + 64 * i, 0, 1);
    }
  };
  // Block b + 1's lines (none past the context), for the caller to fetch a share at a time as it
  // reads block b: a burst of a whole block's lines (PrefetchNext) stalls the loads behind it
  // until every line has been issued, where the block is not one the CPU's own prefetcher is
  // already streaming (benchmarks/RESULTS.md, stop 71).
  NextBlock Next(int64_t b, int64_t heads) const {
    if ((b + 1) * BS >= hi) return {};
    const int64_t next = Offset(b + 1) * p.bytes;
    const bool f32 = p.stored == Stored::kF32;
    return {reinterpret_cast<const char*>(f32 ? static_cast<const void*>(p.k_cache) : p.k_bytes) + next,
            reinterpret_cast<const char*>(f32 ? static_cast<const void*>(p.v_cache) : p.v_bytes) + next,
            heads * BS * D * p.bytes / 64};
  }

  // Next, but a block b + 1 that lies right after block b in the cache (a sequence's blocks as a
  // fresh cache hands them out) is fetched whole now, as PrefetchNext does: the CPU's stride
  // prefetcher is on it already, and the AVX-512 decode form reads a block faster than a share a
  // pass would bring it in. Blocks handed out again after a request freed them (in reverse, or
  // scattered) come back as Next's.
  NextBlock FetchNext(int64_t b, int64_t heads) const {
    if ((b + 1) * BS < hi && table[b + 1] == table[b] + 1) {
      PrefetchNext(b, heads);
      return {};
    }
    return Next(b, heads);
  }

  // Whether every token sees every key of the `n` keys from k0: no mask needed.
  bool Whole(int64_t k0, int64_t n) const {
    return k0 + n <= std::min<int64_t>(pmin + 1, ctx) && (p.window <= 0 || pmax - k0 < p.window);
  }

  const Problem& p;
  const int32_t* table;
  int64_t h0, BS, D, ctx;
  int32_t pmin = INT32_MAX, pmax = INT32_MIN;
  int64_t lo, hi;
};

// What RunItem and RunItemTiled keep for an item's rows (KV head h0 + hh, token t0 + i, query
// head g0 + g of its group; row hh * RH + i * G + g): the scaled queries [R, D], the output
// accumulators [R, DV], a block's scores [R, BS], each row's running max, denominator and
// rescaling, and a block of one head as float32 where the cache is not float32 (K and V [BS, D]).
struct ItemRows {
  ItemRows(const Problem& p, const Item& it, int64_t D, int64_t DV, int64_t BS, std::vector<float>& scratch)
      : p(p), it(it), D(D), DV(DV), BS(BS), g0(it.g0), G((it.g1 < 0 ? p.group : it.g1) - it.g0),
        ntok(it.t1 - it.t0), heads(it.h1 - it.h0), RH(ntok * G), R(heads * RH), widened(p.stored != Stored::kF32) {
    scratch.resize(R * (D + DV) + R * BS + R * 3 + (widened ? 2 * BS * p.row : 0));
    q = scratch.data(), acc = q + R * D, s = acc + R * DV, m = s + R * BS, l = m + R, corr = l + R;
    kf = corr + R, vf = kf + BS * p.row;
    for (int64_t hh = 0; hh < heads; ++hh)
      for (int64_t i = 0; i < ntok; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict src = p.q + ((it.t0 + i) * p.num_heads + Head(hh, g)) * D;
          float* __restrict dst = q + (hh * RH + i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
        }
    std::fill(acc, acc + R * DV, 0.0f);
    std::fill(m, m + R, kMaskValue);
    std::fill(l, l + R, 0.0f);
  }

  int64_t Head(int64_t hh, int64_t g) const { return (it.h0 + hh) * p.group + g0 + g; }

  // Keys and values of the block at cache offset `at` (one KV head, [BS, D] each): read in
  // place, or any other cache's widened (and scaled) into float32 once per block and head.
  void Block(int64_t at, const float*& kb, const float*& vb) const {
    if (!widened) {
      kb = p.k_cache + at, vb = p.v_cache + at;
      return;
    }
    const bool scaled = p.k_scale != nullptr;
    Dequantize(p.stored, p.k_bytes + at * p.bytes, scaled ? p.k_scale + at / p.row : nullptr, BS, D, p.row, kf);
    kb = kf, vb = vf;
    if (p.v_bytes == p.k_bytes) {
      vb = kf;  // values in the keys
    } else {
      Dequantize(p.stored, p.v_bytes + at * p.bytes, scaled ? p.v_scale + at / p.row : nullptr, BS, DV, p.row, vf);
    }
  }

  // The block's keys from k0 that a row may not see (causal, past the context, out of the window):
  // their scores in sh (KV head hh's rows [RH, BS]) masked.
  void Mask(float* __restrict sh, int64_t k0, int64_t ctx) const {
    for (int64_t r = 0; r < RH; ++r) {
      const int64_t pos = p.positions[it.t0 + r / G];
      for (int64_t j = 0; j < BS; ++j) {
        const int64_t kp = k0 + j;
        const bool visible = kp <= pos && kp < ctx && (p.window <= 0 || pos - kp < p.window);
        if (!visible) sh[r * BS + j] = kMaskValue;
      }
    }
  }

  // Row r's scores of the block as softmax weights against its running max; keeps the max, the
  // denominator and the rescaling of what the row had (corr[r]).
  template <int kBS>
  void Softmax(int64_t r) const {
    float* __restrict sr = s + r * BS;
    float mx = m[r];
    for (int64_t j = 0; j < BS; ++j) mx = std::max(mx, sr[j]);
    corr[r] = std::exp(m[r] - mx);
    const float sum = ExpShifted<kBS>(sr, mx, BS);
    m[r] = mx;
    l[r] = l[r] * corr[r] + sum;
  }

  void Store() const {
    if (it.part >= 0) {  // a part of a split decode: its max, denominator and sums, merged later
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = hh * RH + g;
          float* __restrict dst = p.partials + (it.part * p.num_heads + Head(hh, g)) * (DV + 2);
          dst[0] = m[r], dst[1] = l[r];
          std::copy(acc + r * DV, acc + (r + 1) * DV, dst + 2);
        }
      return;
    }
    for (int64_t hh = 0; hh < heads; ++hh)
      for (int64_t i = 0; i < ntok; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = hh * RH + i * G + g;
          const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;  // no visible key: zeros
          float* __restrict dst = p.out + ((it.t0 + i) * p.num_heads + Head(hh, g)) * DV;
          for (int64_t d = 0; d < DV; ++d) dst[d] = acc[r * DV + d] * inv;
        }
  }

  const Problem& p;
  const Item& it;
  const int64_t D, DV, BS, g0, G, ntok, heads, RH, R;
  const bool widened;  // blocks are widened into kf, vf (any cache but a float32 one)
  float *q, *acc, *s, *m, *l, *corr, *kf, *vf;
};

// fn(hh, kb, vb, k0, whole) for each block of the item's context (its first key k0; `whole`:
// every row sees all of its keys) and each of the item's KV heads, with that head's keys and
// values of the block, the next block prefetched whole (kFetchNext; a caller that fetches it
// itself, ItemContext::FetchNext, passes false): as float32 (Block), or with E a 16-bit cache's
// own bits, read in place (uint16_t: bfloat16; Half: float16).
template <class E = float, bool kFetchNext = true, class Fn>
void ForEachBlock(const ItemContext& context, const ItemRows& rows, Fn&& fn) {
  for (int64_t b = context.lo / rows.BS; b * rows.BS < context.hi; ++b) {
    const int64_t offset = context.Offset(b);
    if (kFetchNext) context.PrefetchNext(b, rows.heads);
    const int64_t k0 = b * rows.BS;
    const bool whole = context.Whole(k0, rows.BS);
    for (int64_t hh = 0; hh < rows.heads; ++hh) {
      const int64_t at = offset + hh * rows.BS * rows.p.row;  // block b, head h0 + hh: [BS, row]
      if constexpr (!std::is_same_v<E, float>) {
        fn(hh, reinterpret_cast<const E*>(rows.p.k_bytes) + at, reinterpret_cast<const E*>(rows.p.v_bytes) + at, k0,
           whole);
      } else {
        const float *kb, *vb;
        rows.Block(at, kb, vb);
        fn(hh, kb, vb, k0, whole);
      }
    }
  }
}

#if defined(__AVX512F__) && !defined(SERVAX_ATTENTION_NO_DECODE_LANES)
// A decode's rows (the query heads of a group, one token) against a block in 512-bit vectors,
// the group's rows sharing each load of a key or value (RunDecode). Keys and values are read 32
// dims at a time as two vectors: float32 as stored; bfloat16 as its pairs of values, the even
// dims shifted into place and the odd ones masked (one instruction a vector, no shuffles), so
// a bfloat16 item keeps its queries and accumulators with each 32 dims' even dims first
// (Interleave32 restores them).
inline void Load32(const float* x, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(x);
  b = _mm512_loadu_ps(x + 16);
}
inline void Load32(const uint16_t* x, __m512& a, __m512& b) {
  const __m512i v = _mm512_loadu_si512(x);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))));
}
// float16 (a decode's keys and values read in place, dims in order: llama.cpp's default cache).
struct Half {
  uint16_t bits;
};
inline void Load32(const Half* x, __m512& a, __m512& b) {
  a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
}

// Row x of D dims as Load32 of bfloat16 leaves it (even dims of each 32 first), or back (!kSplit).
template <bool kSplit>
void Interleave32(float* x, int64_t D) {
  float t[32];
  for (int64_t c = 0; c < D; c += 32) {
    std::copy(x + c, x + c + 32, t);
    for (int i = 0; i < 16; ++i) {
      if (kSplit) x[c + i] = t[2 * i], x[c + 16 + i] = t[2 * i + 1];
      else x[c + 2 * i] = t[i], x[c + 2 * i + 1] = t[16 + i];
    }
  }
}

// Sums of four vectors' lanes by 128-bit quarter: quarter c of the result is (a, b, c, d)'s sums
// over their quarter c.
inline __m512 Quarters4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Four Quarters4 results (keys 4i..4i+3 in each quarter of v[i]) summed over their quarters:
// lane j of the result is key j's whole sum.
inline __m512 Sum16(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[g * kBS + j] = q_g . k_j for kG rows (q: [kG, kD]) and a block's keys (k: [kBS, kD]), four
// keys at a time: each key's 32 dims loaded once for all the rows.
template <int kBS, int kD, int kG, class E, bool kFetch>
inline void DecodeScores(const float* __restrict q, const E* __restrict k, float* __restrict s,
                         const ItemContext::NextBlock& next, int64_t part, int64_t parts) {
  for (int j0 = 0; j0 < kBS; j0 += 16) {
    __m512 quarters[4][kG];
    for (int jq = 0; jq < 4; ++jq) {
      if constexpr (kFetch) next.FetchKeys((part * kBS + j0) / 4 + jq, parts * kBS / 4);
      __m512 acc[kG][4];
      for (int g = 0; g < kG; ++g)
        for (int jj = 0; jj < 4; ++jj) acc[g][jj] = _mm512_setzero_ps();
      for (int c = 0; c < kD; c += 32)
        for (int jj = 0; jj < 4; ++jj) {
          __m512 a, b;
          Load32(k + (j0 + 4 * jq + jj) * kD + c, a, b);
          for (int g = 0; g < kG; ++g) {
            acc[g][jj] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * kD + c), a, acc[g][jj]);
            acc[g][jj] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * kD + c + 16), b, acc[g][jj]);
          }
        }
      for (int g = 0; g < kG; ++g) quarters[jq][g] = Quarters4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    }
    for (int g = 0; g < kG; ++g)
      _mm512_storeu_ps(s + g * kBS + j0, Sum16(quarters[0][g], quarters[1][g], quarters[2][g], quarters[3][g]));
  }
}

// acc_g = acc_g * corr[g] + sum_j p[g, j] v_j for kG rows (acc, p: [kG, kD], [kG, kBS]), 64 dims
// at a time: each value's dims loaded once for all the rows.
template <int kBS, int kD, int kG, class E, bool kFetch>
inline void DecodeValues(float* __restrict acc, const float* __restrict corr, const float* __restrict pr,
                         const E* __restrict v, const ItemContext::NextBlock& next, int64_t part, int64_t parts) {
  for (int d0 = 0; d0 < kD; d0 += 64) {
    __m512 a[kG][4];
    for (int g = 0; g < kG; ++g) {
      const __m512 c = _mm512_set1_ps(corr[g]);
      for (int w = 0; w < 4; ++w) a[g][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * kD + d0 + 16 * w), c);
    }
    for (int j = 0; j < kBS; ++j) {
      if constexpr (kFetch)
        if (d0 == 0) next.FetchValues(part * kBS + j, parts * kBS);
      __m512 x[4];
      Load32(v + j * kD + d0, x[0], x[1]);
      Load32(v + j * kD + d0 + 32, x[2], x[3]);
      for (int g = 0; g < kG; ++g) {
        const __m512 pj = _mm512_set1_ps(pr[g * kBS + j]);
        for (int w = 0; w < 4; ++w) a[g][w] = _mm512_fmadd_ps(pj, x[w], a[g][w]);
      }
    }
    for (int g = 0; g < kG; ++g)
      for (int w = 0; w < 4; ++w) _mm512_storeu_ps(acc + g * kD + d0 + 16 * w, a[g][w]);
  }
}

// Rows [r0, r1)'s scores of a block (masked ones at kMaskValue) as softmax weights against their
// running max, keeping the max, the denominator and the rescaling of what each row had, as
// ItemRows::Softmax does, in 16 lanes.
template <int kBS>
inline void DecodeSoftmax(const ItemRows& rows, int64_t r0, int64_t r1) {
  const __m512 half_masked = _mm512_set1_ps(0.5f * kMaskValue);
  for (int64_t r = r0; r < r1; ++r) {
    float* __restrict sr = rows.s + r * kBS;
    __m512 s[kBS / 16];
    __m512 mx = _mm512_set1_ps(rows.m[r]);
    for (int i = 0; i < kBS / 16; ++i) mx = _mm512_max_ps(mx, s[i] = _mm512_loadu_ps(sr + 16 * i));
    const float m = _mm512_reduce_max_ps(mx);
    mx = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < kBS / 16; ++i) {  // a masked key adds nothing, also before the row saw a visible one
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[i], half_masked, _CMP_GT_OQ),
                                           Exp16(_mm512_sub_ps(s[i], mx)));
      _mm512_storeu_ps(sr + 16 * i, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float corr = _mm512_cvtss_f32(Exp16(_mm512_set1_ps(rows.m[r] - m)));
    rows.corr[r] = corr;
    rows.m[r] = m;
    rows.l[r] = rows.l[r] * corr + _mm512_reduce_add_ps(sum);
  }
}

// A decode item (one token, no soft cap, values of their own) in 512-bit vectors: per block and
// KV head, the group's query heads in passes of kG rows, each pass reading the block's keys and
// values once. Same results as RunItem up to float rounding.
template <int kBS, int kD, int kG, class E>
void RunDecode(const Problem& p, const Item& it, std::vector<float>& scratch) {
  static_assert(kBS % 16 == 0 && kD % 64 == 0, "decode form: blocks of 16s, heads of 64s");
  ItemRows rows(p, it, kD, kD, kBS, scratch);
  constexpr bool kPairs = std::is_same_v<E, uint16_t>;  // bfloat16 bits: even dims first in each 32
  if constexpr (kPairs)
    for (int64_t r = 0; r < rows.R; ++r) Interleave32<true>(rows.q + r * kD, kD);
  const int64_t G = rows.G;
  const ItemContext context(p, it, kBS, kD);
  ItemContext::NextBlock next;
  auto passes = [&](int64_t hh, const E* kb, const E* vb, int64_t k0, bool whole, auto fetch) {
    constexpr bool kFetch = decltype(fetch)::value;
    const int64_t n = G / kG;  // passes a head
    for (int64_t r = hh * G; r < (hh + 1) * G; r += kG)
      DecodeScores<kBS, kD, kG, E, kFetch>(rows.q + r * kD, kb, rows.s + r * kBS, next, hh * n + (r - hh * G) / kG,
                                           rows.heads * n);
    if (!whole) rows.Mask(rows.s + hh * G * kBS, k0, context.ctx);
    DecodeSoftmax<kBS>(rows, hh * G, (hh + 1) * G);
    for (int64_t r = hh * G; r < (hh + 1) * G; r += kG)
      DecodeValues<kBS, kD, kG, E, kFetch>(rows.acc + r * kD, rows.corr + r, rows.s + r * kBS, vb, next,
                                           hh * n + (r - hh * G) / kG, rows.heads * n);
  };
  auto block = [&](int64_t hh, const E* kb, const E* vb, int64_t k0, bool whole) {
    if (hh == 0) next = context.FetchNext(k0 / kBS, rows.heads);
    if (next.lines) passes(hh, kb, vb, k0, whole, std::true_type());
    else passes(hh, kb, vb, k0, whole, std::false_type());
  };
  ForEachBlock<E, false>(context, rows, block);
  if constexpr (kPairs)
    for (int64_t r = 0; r < rows.R; ++r) Interleave32<false>(rows.acc + r * kD, kD);
  rows.Store();
}

// RunDecode for this cache and group: rows in passes of the largest of 4, 3, 2 and 1 that
// divides the group. A bfloat16 or float16 cache is read as its bits; any other (float32, or
// widened into float32 a block at a time) as float32.
template <int kBS, int kD>
void RunDecodeAvx512(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t G = (it.g1 < 0 ? p.group : it.g1) - it.g0;
  const bool bf16 = p.stored == Stored::kBF16, f16 = p.stored == Stored::kF16;
  auto run = [&](auto g) {
    constexpr int kG = decltype(g)::value;
    if (bf16) RunDecode<kBS, kD, kG, uint16_t>(p, it, scratch);
    else if (f16) RunDecode<kBS, kD, kG, Half>(p, it, scratch);
    else RunDecode<kBS, kD, kG, float>(p, it, scratch);
  };
  if (G % 4 == 0) run(std::integral_constant<int, 4>());
  else if (G % 3 == 0) run(std::integral_constant<int, 3>());
  else if (G % 2 == 0) run(std::integral_constant<int, 2>());
  else run(std::integral_constant<int, 1>());
}
#endif

// Block size and head dim as compile-time constants (kBS, kD > 0) for the common shapes,
// so the per-key dot products and the value updates vectorize fully; 0: read from `p`.
template <int kBS, int kD>
void RunItem(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t D = kD > 0 ? kD : p.head_dim, BS = kBS > 0 ? kBS : p.block_size;
  const int64_t DV = kD > 0 ? kD : p.value_dims;  // the compile-time shapes have values of their own
#if defined(__AVX512F__) && !defined(SERVAX_ATTENTION_NO_DECODE_LANES)
  if constexpr (kBS % 16 == 0 && kD % 64 == 0 && kBS > 0 && kD > 0)
    if (it.t1 - it.t0 == 1 && p.soft_cap <= 0) return RunDecodeAvx512<kBS, kD>(p, it, scratch);
#endif
  ItemRows rows(p, it, D, DV, BS, scratch);
  const int64_t RH = rows.RH;
  const ItemContext context(p, it, BS, p.row);
  ItemContext::NextBlock next;  // fetched a share a row, wherever it lies (faster here in either case)
  auto block = [&](int64_t hh, const auto* kb, const auto* vb, int64_t k0, bool whole) {
    using E = std::remove_cv_t<std::remove_pointer_t<decltype(kb)>>;
    if (hh == 0) next = context.Next(k0 / BS, rows.heads);
    float* __restrict sh = rows.s + hh * RH * BS;
    for (int64_t r = 0; r < RH; ++r) {
      Scores<kBS, kD, E>(rows.q + (hh * RH + r) * D, kb, sh + r * BS, BS, D, p.row);
      next.FetchKeys(hh * RH + r, rows.R);
    }
    if (p.soft_cap > 0)
      for (int64_t i = 0; i < RH * BS; ++i) sh[i] = p.soft_cap * std::tanh(sh[i] / p.soft_cap);
    if (!whole) rows.Mask(sh, k0, context.ctx);
    for (int64_t r = hh * RH; r < (hh + 1) * RH; ++r) {
      rows.template Softmax<kBS>(r);
      Accumulate<kBS, kD, E>(rows.acc + r * DV, rows.corr[r], rows.s + r * BS, vb, BS, DV, p.row);
      next.FetchValues(r, rows.R);
    }
  };
  // A bfloat16 cache of the compile-time shapes is widened as its keys and values are multiplied
  // (a shift a value), not into a float32 copy of each block first: its loads feed the
  // multiply-adds directly (benchmarks/RESULTS.md, stop 51). The same rule as RunDecodeAvx512's
  // (values kept in the keys are read from the keys' bits either way).
  if (kBS > 0 && kD > 0 && p.stored == Stored::kBF16)
    ForEachBlock<uint16_t, false>(context, rows, block);
  else
    ForEachBlock<float, false>(context, rows, block);
  rows.Store();
}

#if defined(__AVX2__) && defined(__FMA__)
// Scores of MR rows against two keys: s[r * BS + j] = q_r . k_j for j = j0, j0 + 1, over D
// (a multiple of 8) in registers: per 8 dims two key loads and MR query loads feed 2 MR FMAs.
template <int MR>
inline void ScoresTile(const float* __restrict q, const float* __restrict k0, const float* __restrict k1,
                       float* __restrict s, int64_t BS, int64_t D) {
  __m256 a[MR][2];
  for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
    for (int r = 0; r < MR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + d);
      a[r][0] = _mm256_fmadd_ps(qv, x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, x1, a[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 h = _mm256_hadd_ps(a[r][0], a[r][1]);  // [s0 s0 s1 s1 | s0 s0 s1 s1] partials
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s[r * BS] = _mm_cvtss_f32(_mm_hadd_ps(x, x));
    s[r * BS + 1] = _mm_cvtss_f32(_mm_shuffle_ps(_mm_hadd_ps(x, x), _mm_hadd_ps(x, x), 1));
  }
}

// acc[r] = acc[r] * correction[r] + sum_j p[r, j] v_j for MR rows, over dims [d0, d0 + 8 W)
// of the values (v_j: row j of `stride` floats): the accumulator tile stays in registers over
// the block's keys, each value load serving MR rows.
template <int MR, int W>
inline void AccumulateTile(float* __restrict acc, int64_t DV, const float* __restrict correction,
                           const float* __restrict pr, int64_t BS, const float* __restrict v, int64_t stride,
                           int64_t d0) {
  __m256 a[MR][W];
  for (int r = 0; r < MR; ++r) {
    const __m256 c = _mm256_set1_ps(correction[r]);
    for (int w = 0; w < W; ++w) a[r][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * DV + d0 + 8 * w), c);
  }
  for (int64_t j = 0; j < BS; ++j) {
    __m256 x[W];
    for (int w = 0; w < W; ++w) x[w] = _mm256_loadu_ps(v + j * stride + d0 + 8 * w);
    for (int r = 0; r < MR; ++r) {
      const __m256 pj = _mm256_set1_ps(pr[r * BS + j]);
      for (int w = 0; w < W; ++w) a[r][w] = _mm256_fmadd_ps(pj, x[w], a[r][w]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + r * DV + d0 + 8 * w, a[r][w]);
}

template <int MR>
void AccumulateRows(float* acc, int64_t DV, const float* correction, const float* pr, int64_t BS, const float* v,
                    int64_t stride) {
  int64_t d0 = 0;
  for (; d0 + 16 <= DV; d0 += 16) AccumulateTile<MR, 2>(acc, DV, correction, pr, BS, v, stride, d0);
  if (d0 < DV) AccumulateTile<MR, 1>(acc, DV, correction, pr, BS, v, stride, d0);
}

// RunItem for head dims without a compile-time form (a latent cache's 576, values in its first
// 512; multi-query or wide heads), where many rows read each KV head: its scores and value
// updates go as small matrix products over tiles of 4 rows (registers reused across the rows
// of a tile and the keys of a block), not row by row. Needs AVX2, D and DV multiples of 8, an
// even block size and no soft cap; same results as RunItem up to float rounding.
template <int kBS>
void RunItemTiled(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t D = p.head_dim, BS = kBS > 0 ? kBS : p.block_size, DV = p.value_dims;
  ItemRows rows(p, it, D, DV, BS, scratch);
  const int64_t RH = rows.RH;
  const int64_t S = p.row;
  const ItemContext context(p, it, BS, S);
  ForEachBlock(context, rows, [&](int64_t hh, const float* kb, const float* vb, int64_t k0, bool whole) {
    const float* qh = rows.q + hh * RH * D;
    float* __restrict sh = rows.s + hh * RH * BS;
    int64_t r0 = 0;
    for (; r0 + 4 <= RH; r0 += 4)
      for (int64_t j = 0; j < BS; j += 2) ScoresTile<4>(qh + r0 * D, kb + j * S, kb + (j + 1) * S, sh + r0 * BS + j, BS, D);
    for (; r0 < RH; ++r0)
      for (int64_t j = 0; j < BS; j += 2) ScoresTile<1>(qh + r0 * D, kb + j * S, kb + (j + 1) * S, sh + r0 * BS + j, BS, D);
    if (!whole) rows.Mask(sh, k0, context.ctx);
    for (int64_t r = hh * RH; r < (hh + 1) * RH; ++r) rows.template Softmax<kBS>(r);
    float* ah = rows.acc + hh * RH * DV;
    const float* ch = rows.corr + hh * RH;
    for (r0 = 0; r0 + 4 <= RH; r0 += 4) AccumulateRows<4>(ah + r0 * DV, DV, ch + r0, sh + r0 * BS, BS, vb, S);
    for (; r0 < RH; ++r0) AccumulateRows<1>(ah + r0 * DV, DV, ch + r0, sh + r0 * BS, BS, vb, S);
  });
  rows.Store();
}
#endif

#ifdef __AVX512F__
// A query tile of one KV head (a prefill or a chunk of one) with its rows in vector lanes:
// 16 rows (token, query head of the group) a group, queries and accumulators stored
// transposed, [D][16]. Per 16 keys a group's scores are 16 vectors (one a key) built by
// broadcasting the key's elements, the online softmax runs on whole vectors (a row's max,
// sum and correction in its lane), and the values are added the same way: no horizontal
// sums, and each broadcast element of K or V serves 16 rows. Same results as RunItem up to
// float rounding (the order of the sums differs).
template <int kBS, int kD>
void RunItemRowsInLanes(const Problem& p, const Item& it, std::vector<float>& scratch) {
  static_assert(kBS % 16 == 0 && kD % 16 == 0, "rows-in-lanes form: block and head sizes in 16s");
  const int64_t G = p.group, ntok = it.t1 - it.t0, R = ntok * G, groups = (R + 15) / 16;
  scratch.resize(groups * 16 * (2 * kD + 3));
  float* __restrict qt = scratch.data();          // [groups][kD][16], scaled
  float* __restrict acct = qt + groups * kD * 16;  // [groups][kD][16]
  float* __restrict m = acct + groups * kD * 16;   // [groups][16]
  float* __restrict l = m + groups * 16;           // [groups][16]
  int32_t* __restrict rpos = reinterpret_cast<int32_t*>(l + groups * 16);  // each row's position
  for (int64_t r = 0; r < groups * 16; ++r) {
    float* dst = qt + (r / 16) * kD * 16 + r % 16;
    if (r < R) {
      const int64_t i = r / G, g = r % G;
      const float* src = p.q + ((it.t0 + i) * p.num_heads + it.h0 * G + g) * kD;
      for (int64_t d = 0; d < kD; ++d) dst[d * 16] = src[d] * p.scale;
      rpos[r] = p.positions[it.t0 + i];
    } else {  // lanes past the tile: zero queries that see no key
      for (int64_t d = 0; d < kD; ++d) dst[d * 16] = 0.0f;
      rpos[r] = -1;
    }
  }
  std::fill(acct, acct + groups * kD * 16, 0.0f);
  std::fill(m, m + groups * 16, kMaskValue);
  std::fill(l, l + groups * 16, 0.0f);

  const ItemContext context(p, it, kBS, kD);
  const int64_t ctx = context.ctx;
  const __m512 masked = _mm512_set1_ps(kMaskValue), half_masked = _mm512_set1_ps(0.5f * kMaskValue);

  for (int64_t b = context.lo / kBS; b * kBS < context.hi; ++b) {
    const int64_t offset = context.Offset(b);
    context.PrefetchNext(b, 1);
    const bool whole = context.Whole(b * kBS, kBS);
    for (int64_t jc = 0; jc < kBS; jc += 16) {
      const float* __restrict kb = p.k_cache + offset + jc * kD;  // 16 keys [16, kD]
      const float* __restrict vb = p.v_cache + offset + jc * kD;
      const int64_t k0 = b * kBS + jc;
      for (int64_t grp = 0; grp < groups; ++grp) {
        const float* __restrict q = qt + grp * kD * 16;
        __m512 s[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < kD; ++d) {
          const __m512 qd = _mm512_loadu_ps(q + d * 16);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kb[j * kD + d]), s[j]);
        }
        if (!whole) {
          const __m512i pos = _mm512_loadu_si512(rpos + grp * 16);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            const int32_t kp = int32_t(k0 + j);
            __mmask16 visible = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(kp));
            if (kp >= ctx) visible = 0;
            if (p.window > 0)
              visible &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos, _mm512_set1_epi32(kp)),
                                                 _mm512_set1_epi32(int32_t(p.window)));
            s[j] = _mm512_mask_blend_ps(visible, masked, s[j]);
          }
        }
        const __m512 m_old = _mm512_loadu_ps(m + grp * 16);
        __m512 mx = m_old;
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) mx = _mm512_max_ps(mx, s[j]);
        const __m512 correction = Exp16(_mm512_sub_ps(m_old, mx));
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {  // a masked key adds nothing, also before a row saw a visible one
          const __mmask16 seen = _mm512_cmp_ps_mask(s[j], half_masked, _CMP_GT_OQ);
          s[j] = _mm512_maskz_mov_ps(seen, Exp16(_mm512_sub_ps(s[j], mx)));
          sum = _mm512_add_ps(sum, s[j]);
        }
        _mm512_storeu_ps(m + grp * 16, mx);
        _mm512_storeu_ps(l + grp * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + grp * 16), correction, sum));
        float* __restrict acc = acct + grp * kD * 16;
        for (int64_t d = 0; d < kD; ++d) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d * 16), correction);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) a = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vb[j * kD + d]), a);
          _mm512_storeu_ps(acc + d * 16, a);
        }
      }
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    const int64_t grp = r / 16, lane = r % 16, i = r / G, g = r % G;
    const float lr = l[grp * 16 + lane], inv = lr > 0 ? 1.0f / lr : 0.0f;  // no visible key: zeros
    const float* src = acct + grp * kD * 16 + lane;
    float* __restrict dst = p.out + ((it.t0 + i) * p.num_heads + it.h0 * G + g) * kD;
    for (int64_t d = 0; d < kD; ++d) dst[d] = src[d * 16] * inv;
  }
}

// Items of several tokens (one KV head each) take the rows-in-lanes form, decodes RunItem.
template <int kBS, int kD>
void RunItemAvx512(const Problem& p, const Item& it, std::vector<float>& scratch) {
  if (it.t1 - it.t0 > 1 && it.h1 - it.h0 == 1)
    RunItemRowsInLanes<kBS, kD>(p, it, scratch);
  else
    RunItem<kBS, kD>(p, it, scratch);
}
#endif

using ItemFn = void (*)(const Problem&, const Item&, std::vector<float>&);

// A split decode's output (token t, every head) from its parts' slots [first, first + parts):
// each part's sums rescaled to the largest running max, over the sum of their denominators
// (zeros where no part saw a key, as RunItem's rows).
void MergeParts(const Problem& p, int64_t t, int64_t first, int64_t parts) {
  const int64_t DV = p.value_dims, stride = DV + 2;
  for (int64_t h = 0; h < p.num_heads; ++h) {
    const float* part = p.partials + (first * p.num_heads + h) * stride;
    float mx = kMaskValue;
    for (int64_t i = 0; i < parts; ++i) mx = std::max(mx, part[i * p.num_heads * stride]);
    float* __restrict dst = p.out + (t * p.num_heads + h) * DV;
    std::fill(dst, dst + DV, 0.0f);
    float l = 0.0f;
    for (int64_t i = 0; i < parts; ++i) {
      const float* x = part + i * p.num_heads * stride;
      const float w = std::exp(x[0] - mx);
      l += w * x[1];
      for (int64_t d = 0; d < DV; ++d) dst[d] += w * x[2 + d];
    }
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < DV; ++d) dst[d] *= inv;
  }
}

// The item function with the rows-in-lanes form for these shapes; nullptr where there is none
// (no AVX-512, other shapes, or built with -DSERVAX_ATTENTION_NO_LANES).
ItemFn PickLanesItemFn(int64_t block_size, int64_t head_dim) {
#if defined(__AVX512F__) && !defined(SERVAX_ATTENTION_NO_LANES)
  if (block_size == 16 && head_dim == 64) return RunItemAvx512<16, 64>;
  if (block_size == 16 && head_dim == 128) return RunItemAvx512<16, 128>;
  if (block_size == 32 && head_dim == 64) return RunItemAvx512<32, 64>;
  if (block_size == 32 && head_dim == 128) return RunItemAvx512<32, 128>;
#endif
  return nullptr;
}

ItemFn PickItemFn(int64_t block_size, int64_t head_dim) {
  if (block_size == 16 && head_dim == 64) return RunItem<16, 64>;
  if (block_size == 16 && head_dim == 128) return RunItem<16, 128>;
  if (block_size == 32 && head_dim == 64) return RunItem<32, 64>;
  if (block_size == 32 && head_dim == 128) return RunItem<32, 128>;
  return RunItem<0, 0>;
}

// The batch's sequences as both handlers take them (block tables to the window operand).
struct Sequences {
  const int32_t* block_tables;
  ffi::Span<const int64_t> td;  // [S, MB]
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* positions;
  int32_t num_tokens, window;
};

inline Sequences SequencesOf(ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> positions,
                             ffi::Buffer<ffi::S32> num_tokens, ffi::Buffer<ffi::S32> window) {
  return {block_tables.typed_data(), block_tables.dimensions(), seq_lens.typed_data(), query_start_loc.typed_data(),
          positions.typed_data(), num_tokens.typed_data()[0], window.typed_data()[0]};
}

// One call's operands, as PagedAttention and PagedAttentionWrite take them from XLA.
struct AttendArgs {
  const float* q;
  ffi::Span<const int64_t> qd;  // [T, H, D]
  ffi::DataType type;  // the cache's
  const void* k_cache;
  const void* v_cache;
  ffi::Span<const int64_t> kd;  // [L, NB, KVH, BS, row]
  int64_t k_count, v_count;  // the caches' elements
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_count, v_scale_count;
  int64_t layer;
  Sequences seqs;
  float scale, soft_cap;
  int64_t value_dims, half_bits;
  float* out;
  ffi::Span<const int64_t> od;  // [T, H, value dims]
};

ffi::Error Attend(ffi::ThreadPool pool, const AttendArgs& a) {
  auto qd = a.qd, kd = a.kd, td = a.seqs.td;
  const int64_t value_dims = a.value_dims, half_bits = a.half_bits;
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [T,H,D], cache [L,NB,KVH,BS,row >= D], tables [S,MB]");
  Problem p;
  std::vector<Item> items;
  p.q = a.q;
  const ffi::DataType type = a.type;
  if (type == ffi::DataType::F32) {
    p.k_cache = static_cast<const float*>(a.k_cache);
    p.v_cache = static_cast<const float*>(a.v_cache);
  } else if (type == ffi::DataType::S8 || type == ffi::DataType::F8E4M3FN) {
    p.stored = type == ffi::DataType::S8 ? Stored::kS8 : Stored::kF8E4M3;
    p.k_bytes = static_cast<const uint8_t*>(a.k_cache);
    p.v_bytes = static_cast<const uint8_t*>(a.v_cache);
    p.bytes = 1;
    p.k_scale = a.k_scale;
    p.v_scale = a.v_scale;
  } else if (type == ffi::DataType::BF16 || type == ffi::DataType::F16 || type == ffi::DataType::U16) {
    // A 16-bit cache, or its bits as uint16 (how servax keeps one on XLA:CPU: half_bits says which).
    if (type == ffi::DataType::U16 && half_bits != 1 && half_bits != 2)
      return ffi::Error::InvalidArgument("paged_attention: a uint16 cache holds bfloat16 (half_bits 1) or float16 (2)");
    const bool bf16 = type == ffi::DataType::BF16 || (type == ffi::DataType::U16 && half_bits == 1);
    p.stored = bf16 ? Stored::kBF16 : Stored::kF16;
    p.k_bytes = static_cast<const uint8_t*>(a.k_cache);
    p.v_bytes = static_cast<const uint8_t*>(a.v_cache);
    p.bytes = 2;
  } else {
    return ffi::Error::InvalidArgument("paged_attention: a float32, bfloat16, float16 (or their bits as uint16), int8 or float8_e4m3fn cache");
  }
  p.block_tables = a.seqs.block_tables;
  p.seq_lens = a.seqs.seq_lens;
  p.query_start = a.seqs.query_start;
  p.positions = a.seqs.positions;
  p.out = a.out;
  p.layer = a.layer;
  p.num_blocks = kd[1];
  p.kv_heads = kd[2];
  p.block_size = kd[3];
  p.head_dim = qd[2];
  p.row = kd[4];
  p.max_blocks = td[1];
  p.num_heads = qd[1];
  p.group = qd[1] / kd[2];
  p.window = a.seqs.window;
  p.scale = a.scale;
  p.soft_cap = a.soft_cap;
  p.value_dims = value_dims > 0 ? value_dims : p.head_dim;
  if (qd[2] > kd[4] || qd[1] % kd[2] || p.layer < 0 || p.layer >= kd[0] || p.value_dims > p.head_dim)
    return ffi::Error::InvalidArgument("paged_attention: mismatched heads, head_dim, value dims or layer");
  auto od = a.od;
  if (od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] || od[2] != p.value_dims)
    return ffi::Error::InvalidArgument("paged_attention: out must be [T, H, value dims]");

  // The rows-in-lanes form where it exists, except with a soft cap (RunItem applies it); values
  // read from the keys (fewer dims than a key) take the general form.
  const bool own_values = p.value_dims == p.head_dim, plain = p.stored == Stored::kF32;
  if (p.k_scale != nullptr && (a.k_scale_count * p.row != a.k_count ||
                 (p.v_bytes != p.k_bytes && a.v_scale_count * p.row != a.v_count)))
    return ffi::Error::InvalidArgument("paged_attention: a quantized cache needs a scale per token and head");
  // Rows wider than the heads (their first head_dim read) take the general forms only.
  const bool narrow = p.row == p.head_dim;
  const ItemFn lanes_run = p.soft_cap > 0 || !own_values || !plain || !narrow
                               ? nullptr : PickLanesItemFn(p.block_size, p.head_dim);
  ItemFn run = lanes_run != nullptr ? lanes_run : own_values && narrow ? PickItemFn(p.block_size, p.head_dim)
                                                                      : RunItem<0, 0>;
#if defined(__AVX2__) && defined(__FMA__)
  // Head dims without a compile-time form take the tiled products (RunItemTiled's conditions).
  if (run == RunItem<0, 0> && p.soft_cap <= 0 && p.head_dim % 8 == 0 && p.value_dims % 8 == 0 &&
      p.block_size % 2 == 0)
    run = p.block_size == 16 ? RunItemTiled<16> : RunItemTiled<0>;
#endif
  const int64_t T = qd[0], S = td[0];
  const int64_t real = std::min<int64_t>(std::max<int32_t>(a.seqs.num_tokens, 0), T);
  // The rows-in-lanes form takes tiles of about 48 rows (three vectors of 16: 16 tokens of a
  // group of 3 query heads), the other about 32.
  const int64_t tile = std::max<int64_t>(1, (lanes_run != nullptr ? kRowsPerLanesItem : kRowsPerItem) / p.group);
  std::fill(p.out + real * p.num_heads * p.value_dims, p.out + T * p.num_heads * p.value_dims, 0.0f);
  // A decode is one item over all KV heads (its blocks then read as one contiguous run per
  // block); with fewer decodes than two per thread (batch 1 would leave all but one thread
  // idle) its context is split into parts, or where it is short, its KV heads shared out.
  // Longer queries go per KV head in tiles of `tile` tokens, each tile reading the context
  // once for all its rows.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t decodes = 0;
  for (int64_t s = 0; s < S; ++s)
    decodes += std::min<int64_t>(p.query_start[s + 1], real) - p.query_start[s] == 1;
  const int64_t wanted = decodes == 0 ? 1 : (2 * threads + decodes - 1) / decodes;
  // Few decodes also split their context (split-KV, as flash-decoding does): parts of at least
  // kMinPartBlocks blocks, about kItemsPerThread items a thread in all, merged after.
  std::vector<std::pair<int32_t, int32_t>> splits;  // (token, first part slot) of each split decode
  int64_t slots = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t a = p.query_start[s], b = std::min<int64_t>(p.query_start[s + 1], real);
    if (b - a == 1) {
      int64_t parts = 1, k_lo = 0, k_hi = 0;
      if (decodes > 0 && wanted > 1) {
        const int64_t pos = p.positions[a], ctx = std::min<int64_t>(pos + 1, p.seq_lens[s]);
        k_lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) / p.block_size : 0;
        k_hi = (std::max<int64_t>(ctx, 0) + p.block_size - 1) / p.block_size;  // blocks [k_lo, k_hi)
        const int64_t target = (kItemsPerThread * threads + decodes - 1) / decodes;
        parts = std::clamp<int64_t>(target, 1, std::max<int64_t>(1, (k_hi - k_lo) / kMinPartBlocks));
      }
      // Parts over all KV heads read each block's heads as one run; where the context is too
      // short for enough parts, the KV heads are shared out (or with one KV head, a latent
      // cache or multi-query attention in the general form, the query heads).
      const int64_t per_part = (wanted + parts - 1) / parts;
      const int64_t shares = std::clamp<int64_t>(per_part, 1, p.kv_heads);
      const int64_t head_shares = p.kv_heads == 1 && lanes_run == nullptr ? std::clamp<int64_t>(per_part, 1, p.group)
                                                                          : 1;
      if (parts > 1) splits.push_back({int32_t(a), int32_t(slots)});
      for (int64_t part = 0; part < parts; ++part)
        for (int64_t i = 0; i < shares; ++i)
          for (int64_t j = 0; j < head_shares; ++j) {
            Item item{int32_t(s), int32_t(p.kv_heads * i / shares), int32_t(p.kv_heads * (i + 1) / shares),
                      int32_t(a), int32_t(b), int32_t(p.group * j / head_shares),
                      int32_t(p.group * (j + 1) / head_shares)};
            if (parts > 1) {
              item.k0 = int32_t((k_lo + (k_hi - k_lo) * part / parts) * p.block_size);
              item.k1 = int32_t((k_lo + (k_hi - k_lo) * (part + 1) / parts) * p.block_size);
              item.part = int32_t(slots + part);
            }
            items.push_back(item);
          }
      if (parts > 1) slots += parts;
      continue;
    }
    for (int64_t t0 = a; t0 < b; t0 += tile)
      for (int64_t h = 0; h < p.kv_heads; ++h)
        items.push_back({int32_t(s), int32_t(h), int32_t(h + 1), int32_t(t0), int32_t(std::min(t0 + tile, b))});
  }
  // Tokens in no sequence (cannot happen with a well-formed batch) get zeros.
  std::vector<bool> covered(real, false);
  for (const Item& it : items)
    for (int64_t t = it.t0; t < it.t1; ++t) covered[t] = true;
  for (int64_t t = 0; t < real; ++t)
    if (!covered[t])
      std::fill(p.out + t * p.num_heads * p.value_dims, p.out + (t + 1) * p.num_heads * p.value_dims, 0.0f);
  if (items.empty()) return ffi::Error::Success();
  std::vector<float> partials(slots * p.num_heads * (p.value_dims + 2));
  p.partials = partials.data();

  servax::ParallelFor(pool, int64_t(items.size()), pool.num_threads() - 1, [&](int64_t i) {
    thread_local std::vector<float> scratch;
    run(p, items[i], scratch);
  });
  for (size_t i = 0; i < splits.size(); ++i) {
    const int64_t end = i + 1 < splits.size() ? splits[i + 1].second : slots;
    MergeParts(p, splits[i].first, splits[i].second, end - splits[i].second);
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                          ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> num_tokens, ffi::Buffer<ffi::S32> window, float scale,
                          float soft_cap, int64_t value_dims, int64_t half_bits, ffi::ResultBuffer<ffi::F32> out) {
  if (k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("paged_attention: K and V caches of different types");
  return Attend(pool, {q.typed_data(), q.dimensions(), k_cache.element_type(), k_cache.untyped_data(),
                       v_cache.untyped_data(), k_cache.dimensions(), int64_t(k_cache.element_count()),
                       int64_t(v_cache.element_count()), k_scale.typed_data(), v_scale.typed_data(),
                       int64_t(k_scale.element_count()), int64_t(v_scale.element_count()), layer.typed_data()[0],
                       SequencesOf(block_tables, seq_lens, query_start_loc, positions, num_tokens, window), scale,
                       soft_cap, value_dims, half_bits, out->typed_data(), out->dimensions()});
}

// A layer's attention from its joined q/k/v product, in one call: q and k rotated (rotary
// embedding, HF's "rotate half": x cos + (-x2, x1) sin, over the head's dims), this step's K/V
// written into the layer's cache slots (tokens with a negative slot write nowhere, as
// attention_common.write_kv; into a 16-bit cache kept as its bits, rounded to it as XLA rounds),
// then PagedAttention on the rotated queries. The caches are the call's results as well, aliased
// to its operands (updated in place): in a one-token step this replaces the XLA programs that
// rotate and write between the products (benchmarks/RESULTS.md, stop 64). float32 caches, or
// uint16 ones holding bfloat16 (half_bits 1) or float16 (2) bits, with a value per key.
ffi::Error PagedAttentionWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                               ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer k_in, ffi::AnyBuffer v_in,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_mapping,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> positions,
                               ffi::Buffer<ffi::S32> num_tokens, ffi::Buffer<ffi::S32> window, float scale,
                               int64_t num_heads, int64_t half_bits, ffi::ResultBuffer<ffi::F32> out,
                               ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto xd = qkv.dimensions(), kd = k_in.dimensions(), cd = cos.dimensions();
  const ffi::DataType type = k_in.element_type();
  const bool half = type == ffi::DataType::U16;
  if (xd.size() != 2 || kd.size() != 5 || cd.size() != 2 || !(v_in.dimensions() == kd) || num_heads <= 0 ||
      num_heads % std::max<int64_t>(kd[2], 1) != 0 || v_in.element_type() != type ||
      (type != ffi::DataType::F32 && !half) || (half ? half_bits != 1 && half_bits != 2 : half_bits != 0))
    return ffi::Error::InvalidArgument("paged_attention_write: qkv [T, >= (H + 2 KVH) D], caches [L, NB, KVH, BS, D] "
                                       "of float32 (half_bits 0) or uint16 (the bits of bfloat16: 1, float16: 2)");
  const int64_t T = xd[0], H = num_heads, KVH = kd[2], BS = kd[3], D = kd[4], slots = kd[1] * BS;
  const int64_t L = layer.typed_data()[0];
  if (xd[1] < (H + 2 * KVH) * D || cd[0] != T || cd[1] != D || !(sin.dimensions() == cd) || D % 2 != 0 ||
      slot_mapping.element_count() != T || L < 0 || L >= kd[0])
    return ffi::Error::InvalidArgument("paged_attention_write: qkv [T, >= (H + 2 KVH) D], cos and sin [T, D] (D "
                                       "even), slot_mapping [T], layer < L");
  // The results are the operands' buffers (aliased); where XLA gave others, they start as copies.
  const int64_t bytes = k_in.size_bytes();
  char* k_cache = static_cast<char*>(k_out->untyped_data());
  char* v_cache = static_cast<char*>(v_out->untyped_data());
  if (k_cache != k_in.untyped_data()) std::memcpy(k_cache, k_in.untyped_data(), bytes);
  if (v_cache != v_in.untyped_data()) std::memcpy(v_cache, v_in.untyped_data(), bytes);
  thread_local std::vector<float> q, row;
  q.resize(T * H * D);
  row.resize(D);
  const int64_t h2 = D / 2;
  auto rotate = [&](const float* x, const float* c, const float* s, float* y) {
    for (int64_t j = 0; j < h2; ++j) y[j] = x[j] * c[j] + -x[j + h2] * s[j];
    for (int64_t j = h2; j < D; ++j) y[j] = x[j] * c[j] + x[j - h2] * s[j];
  };
  auto store = [&](const float* x, char* cache, int64_t at) {  // a row of D values at element `at`
    if (!half) {
      std::memcpy(reinterpret_cast<float*>(cache) + at, x, D * sizeof(float));
      return;
    }
    uint16_t* dst = reinterpret_cast<uint16_t*>(cache) + at;
    for (int64_t j = 0; j < D; ++j)
      dst[j] = half_bits == 1 ? servax::FloatToBFloat16Bits(x[j]) : servax::FloatToHalfBits(x[j]);
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* x = qkv.typed_data() + t * xd[1];
    const float* c = cos.typed_data() + t * D;
    const float* s = sin.typed_data() + t * D;
    for (int64_t h = 0; h < H; ++h) rotate(x + h * D, c, s, q.data() + (t * H + h) * D);
    const int64_t slot = slot_mapping.typed_data()[t];
    if (slot < 0 || slot >= slots) continue;
    const int64_t at = ((L * kd[1] + slot / BS) * KVH * BS + slot % BS) * D;  // head 0's row
    for (int64_t h = 0; h < KVH; ++h) {
      rotate(x + (H + h) * D, c, s, row.data());
      store(row.data(), k_cache, at + h * BS * D);
      store(x + (H + KVH + h) * D, v_cache, at + h * BS * D);
    }
  }
  const int64_t qdims[3] = {T, H, D};
  return Attend(pool, {q.data(), ffi::Span<const int64_t>(qdims, 3), type, k_cache, v_cache, kd,
                       int64_t(k_in.element_count()), int64_t(v_in.element_count()), nullptr, nullptr, 0, 0, L,
                       SequencesOf(block_tables, seq_lens, query_start_loc, positions, num_tokens, window), scale,
                       0.0f, 0, half_bits, out->typed_data(), out->dimensions()});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_cache: float32, bfloat16, float16 (or uint16 bits), int8 or float8_e4m3fn
                                  .Arg<ffi::AnyBuffer>()  // v_cache (the same buffer: values in the keys)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [L, NB, KVH, BS] (quantized caches)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("value_dims")  // 0: head_dim; else values in the keys' leading dims
                                  .Attr<int64_t>("half_bits")  // a uint16 cache's floats: 1 bfloat16, 2 float16
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxPagedAttentionWrite, PagedAttentionWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [T, >= (H + 2 KVH) D]: the joined product
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [T, D]
                                  .Arg<ffi::AnyBuffer>()  // k_cache [L, NB, KVH, BS, D]: float32, or uint16 bits
                                  .Arg<ffi::AnyBuffer>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("half_bits")  // a uint16 cache's floats: 1 bfloat16, 2 float16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
                                  .Ret<ffi::AnyBuffer>()  // k_cache (aliased to the operand)
                                  .Ret<ffi::AnyBuffer>());  // v_cache (aliased)
