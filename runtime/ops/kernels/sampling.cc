// The sampler's top-k / top-p cut for XLA:CPU (runtime/engine/sampler.py, `_truncate`), and its
// argmax (`_argmax`).
//
// For each row of temperature-scaled logits [S, V] it finds the smallest sortable key
// (runtime/engine/sampler.py `_sortable`: float32 bits mapped so that unsigned order is float order)
// that the row keeps; the sampler then masks every token whose key is below it. Same
// definition as the XLA path's bisection:
//   top-k: keep the k largest keys (ties with the k-th included);
//   top-p: over the softmax of what top-k kept, keep each token whose key is at least the
//          smallest key c with mass(keys > c) < top_p.
// A row asking for neither gets 0 (keeps all). The XLA path searches 32 passes over the row;
// here each cut takes one pass building a 4096-bin histogram by the key's top 12 bits (of
// counts for top-k, of probability mass for top-p), then a selection or sort within the one
// bin the cut falls in. Masses are summed in
// double, not in XLA's float32 order, so a cut exactly at a float rounding of top_p may land
// one token apart from the XLA path's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;

inline uint32_t Sortable(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits >> 31) ? ~bits : (bits | 0x80000000u);
}

// exp(x) for x <= 0 to ~2 float32 ulps (2^x: a degree-6 polynomial of the fraction, the
// integer part into the exponent bits); written so that the row loops vectorize, where the
// scalar libm call would be most of the kernel's time.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 1.5252733804059840e-5f;
  p = p * f + 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = uint32_t(int32_t(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The key cut of one row (see the file comment).
uint32_t RowCut(const float* logits, int64_t V, int32_t top_k, float top_p, std::vector<uint32_t>& keys,
                std::vector<float>& probs) {
  const int64_t k = (top_k > 0) ? std::min<int64_t>(top_k, V) : V;
  const bool use_p = top_p < 1.0f;
  if (k == V && !use_p) return 0;
  keys.resize(V);
  for (int64_t v = 0; v < V; ++v) keys[v] = Sortable(logits[v]);
  uint32_t kth = 0;
  if (k < V) {  // the k-th largest key: count keys per bin, then select within the bin holding it
    int64_t count[kBins] = {0};
    for (int64_t v = 0; v < V; ++v) ++count[keys[v] >> (32 - kBinBits)];
    int64_t above = 0;
    int bin = kBins - 1;
    for (; bin > 0 && above + count[bin] < k; --bin) above += count[bin];
    std::vector<uint32_t> members;
    members.reserve(count[bin]);
    for (int64_t v = 0; v < V; ++v)
      if (int(keys[v] >> (32 - kBinBits)) == bin) members.push_back(keys[v]);
    const int64_t rank = k - above - 1;  // within the bin, largest first
    std::nth_element(members.begin(), members.begin() + rank, members.end(), std::greater<uint32_t>());
    kth = members[rank];
  }
  if (!use_p) return kth;

  // Softmax over the kept tokens (key >= kth), in double.
  float top = -INFINITY;
  for (int64_t v = 0; v < V; ++v)
    if (keys[v] >= kth) top = std::max(top, logits[v]);
  if (!std::isfinite(top)) return kth;  // nothing finite to weigh: top-p has no say
  probs.resize(V);
  double total = 0.0;
  float* pr = probs.data();
  const uint32_t* ky = keys.data();
  for (int64_t v = 0; v < V; ++v) pr[v] = ky[v] >= kth ? ExpNonPositive(logits[v] - top) : 0.0f;
  for (int64_t v = 0; v < V; ++v) total += pr[v];
  const double inv = 1.0 / total;
  double mass[kBins] = {0.0};
  for (int64_t v = 0; v < V; ++v)
    if (probs[v] > 0.0f) mass[keys[v] >> (32 - kBinBits)] += probs[v] * inv;

  // The bin (from the top) where the mass reaches top_p; the cut lies in it.
  double above = 0.0;
  int bin = -1;
  for (int b = kBins - 1; b >= 0; --b) {
    if (above + mass[b] >= top_p) {
      bin = b;
      break;
    }
    above += mass[b];
  }
  std::vector<std::pair<uint32_t, double>> members;
  for (int64_t v = 0; v < V; ++v) {
    if (probs[v] <= 0.0f) continue;
    if (bin < 0 || int(keys[v] >> (32 - kBinBits)) == bin) members.push_back({keys[v], probs[v] * inv});
  }
  if (bin < 0) above = 0.0;  // the whole kept mass is below top_p (rounding): scan everything
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  // Groups of equal keys, largest first: the cut is the last group whose mass above is < top_p.
  uint32_t cut = kth;
  for (size_t i = 0; i < members.size();) {
    if (above >= top_p) break;
    cut = members[i].first;
    size_t j = i;
    double group = 0.0;
    for (; j < members.size() && members[j].first == members[i].first; ++j) group += members[j].second;
    above += group;
    i = j;
  }
  return std::max(cut, kth);
}

ffi::Error TruncationCut(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> top_k,
                         ffi::Buffer<ffi::F32> top_p, ffi::ResultBuffer<ffi::U32> out) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || top_k.element_count() != dims[0] || top_p.element_count() != dims[0])
    return ffi::Error::InvalidArgument("truncation_cut: logits [S,V], top_k [S], top_p [S]");
  const int64_t rows = dims[0], V = dims[1];
  const float* rows_logits = logits.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* p = top_p.typed_data();
  uint32_t* cut = out->typed_data();
  // Rows that ask for nothing are answered on this thread; the pool helps with the rest.
  const bool busy = std::any_of(k, k + rows, [](int32_t v) { return v > 0; }) ||
                    std::any_of(p, p + rows, [](float v) { return v < 1.0f; });
  servax::ParallelFor(pool, rows, busy ? pool.num_threads() - 1 : 0, [&](int64_t r) {
    thread_local std::vector<uint32_t> keys;
    thread_local std::vector<float> probs;
    cut[r] = RowCut(rows_logits + r * V, V, k[r], p[r], keys, probs);
  });
  return ffi::Error::Success();
}

// The first index of the row's maximum; V where the row holds a NaN (as the XLA form's max
// then min over the indices equal to it): a pass for the maximum (NaNs found from the bits:
// -ffast-math assumes there are none), then one to its first occurrence.
int32_t RowArgmax(const float* x, int64_t V) {
  float top = x[0];
  int64_t i = 0;
#if defined(__AVX2__)
  if (V >= 32) {
    __m256 m[4] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x), _mm256_loadu_ps(x), _mm256_loadu_ps(x)};
    __m256i bad = _mm256_setzero_si256();
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 32 <= V; i += 32)
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
        m[j] = _mm256_max_ps(m[j], v);
        bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), magnitude), inf));
      }
    if (!_mm256_testz_si256(bad, bad)) return static_cast<int32_t>(V);
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    for (float v : lanes) top = std::max(top, v);
  }
#endif
  for (int64_t j = i; j < V; ++j) {
    uint32_t bits;
    std::memcpy(&bits, x + j, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<int32_t>(V);
    top = std::max(top, x[j]);
  }
  i = 0;
#if defined(__AVX2__)
  const __m256 t = _mm256_set1_ps(top);
  for (; i + 8 <= V; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
    if (hits) return static_cast<int32_t>(i + __builtin_ctz(hits));
  }
#endif
  for (; i < V; ++i)
    if (x[i] == top) return static_cast<int32_t>(i);
  return 0;
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || out->element_count() != dims[0])
    return ffi::Error::InvalidArgument("argmax: logits [S, V], out [S]");
  const int64_t rows = dims[0], V = dims[1];
  const float* x = logits.typed_data();
  int32_t* ids = out->typed_data();
  if (V == 0) {
    std::fill(ids, ids + rows, 0);
    return ffi::Error::Success();
  }
  // A row is a few microseconds: one row stays on this thread.
  servax::ParallelFor(pool, rows, rows > 1 ? pool.num_threads() - 1 : 0,
                      [&](int64_t r) { ids[r] = RowArgmax(x + r * V, V); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [S, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // first index of each row's maximum [S]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxTruncationCut, TruncationCut,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p [S]
                                  .Ret<ffi::Buffer<ffi::U32>>());  // key cut [S]
