// Matrix products for XLA:CPU on pre-packed weights (runtime/cpu_matmul.py): y [M, N] = x [M, K] . W,
// where W [K, N] was packed once, at load, into panels of 16 output columns: packed[p, k, j] =
// W[k, 16 p + j], shape [N / 16, K, 16] (N padded to a multiple of 16 with zero columns).
//
// Why: a decode step multiplies a few rows (one per sequence) by every weight of the model,
// read once a step. XLA:CPU's GEMM repacks its weight operand on every call; here each panel
// is read from memory once, in the order it is used, and multiplied with up to kMaxRows rows
// of x per pass while 2 x kMaxRows AVX accumulators stay in registers (outer-product
// micro-kernel: per k, two loads of the panel and one broadcast per row); later row blocks
// find the panel in cache. Work is split by panels over XLA's intra-op pool. Only the first
// `valid_rows` rows of x are multiplied (a step padded to its bucket pays for its real tokens).

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SERVAX_MATMUL_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-float AVX registers
#ifdef __AVX512F__
constexpr int kMaxRows = 8;  // 16 accumulators: AVX-512 has 32 vector registers
#else
constexpr int kMaxRows = 6;  // 12 accumulators of 16 registers
#endif
constexpr int64_t kMaxPanelsPerTask = 32;
constexpr int64_t kPrefetchRows = 16;  // how far ahead (in k) the first row block prefetches its panel

// c[r, 0:16] = sum_k a[r, k] * panel[k, 0:16] for MR rows of a. With kPrefetch the block
// prefetches its own panel as it goes (it comes from memory); else, given `next`, it fetches
// that panel (the one after it) into L2 for the next pass, one row per k.
template <int MR, bool kPrefetch>
void RowBlock(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc, const float* next) {
#ifndef SERVAX_MATMUL_AVX2
  // Portable loops (runtime/cpu_matmul.py uses the kernel only where AVX2 and FMA are there).
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kPanel; ++j) acc[r][j] += a[r * lda + k] * panel[k * kPanel + j];
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + kPanel, c + r * ldc);
#else
  __m256 lo[MR], hi[MR];
  // GCC keeps the accumulators in registers only when these loops are unrolled explicitly
  // (otherwise it spills them to the stack on every k: 2.5x slower).
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    } else if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
    }
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(c + r * ldc, lo[r]);
    _mm256_storeu_ps(c + r * ldc + 8, hi[r]);
  }
#endif
}

using RowBlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*);

template <bool kPrefetch>
RowBlockFn PickRowBlock(int64_t rows) {
  static constexpr RowBlockFn kFns[] = {nullptr,
                                        RowBlock<1, kPrefetch>,
                                        RowBlock<2, kPrefetch>,
                                        RowBlock<3, kPrefetch>,
                                        RowBlock<4, kPrefetch>,
                                        RowBlock<5, kPrefetch>,
                                        RowBlock<6, kPrefetch>,
#ifdef __AVX512F__
                                        RowBlock<7, kPrefetch>,
                                        RowBlock<8, kPrefetch>
#endif
  };
  return kFns[rows];
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                        ffi::Buffer<ffi::S32> valid_rows, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), pd = packed.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1] || od.size() != 2 ||
      od[0] != xd[0] || od[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("packed matmul: x [M, K], packed [N/16, K, 16], out [M, N]");
  const int64_t K = xd[1], panels = pd[0], N = panels * kPanel;
  float* c = out->typed_data();
  // Rows past valid_rows (a step's bucket padding) are not multiplied: their results are zeros.
  const int64_t M = std::clamp<int64_t>(valid_rows.typed_data()[0], 0, xd[0]);
  std::fill(c + M * N, c + xd[0] * N, 0.0f);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  const float* a = x.typed_data();
  const float* b = packed.typed_data();
  // Rows in as few blocks as the registers allow, of even sizes (8 rows: one block, not 6 + 2).
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  // About four tasks per thread for small matrices (balance), at most 32 panels each for large ones.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_task = std::clamp<int64_t>(panels / (4 * threads), 1, kMaxPanelsPerTask);
  const int64_t tasks = (panels + per_task - 1) / per_task;
  servax::ParallelFor(pool, tasks, threads - 1, [&](int64_t t) {
    const int64_t last = std::min(panels, (t + 1) * per_task);
    for (int64_t p = t * per_task; p < last; ++p) {
      const float* panel = b + p * K * kPanel;
      for (int64_t blk = 0, r0 = 0; blk < blocks; ++blk) {
        const int64_t rows = M / blocks + (blk < M % blocks);
        // Rows in several blocks: each panel is fetched into L2 during the previous panel's
        // second block (measured 5-15% faster at 16-32 rows than each fetching its own).
        const bool fetch_own = blocks == 1 || p == t * per_task;
        const float* next = (blk == 1 && p + 1 < last) ? panel + K * kPanel : nullptr;
        (blk == 0 && fetch_own ? PickRowBlock<true> : PickRowBlock<false>)(rows)(a + r0 * K, K, panel, K,
                                                                                   c + r0 * N + p * kPanel, N, next);
        r0 += rows;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // packed W [N / 16, K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // valid rows [1]: rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
