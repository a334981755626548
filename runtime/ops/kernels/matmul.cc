// Matrix products for XLA:CPU on pre-packed weights (runtime/ops/matmul.py): y [M, N] = x [M, K] . W,
// where W [K, N] was packed once, at load, into panels of 16 output columns: packed[p, k, j] =
// W[k, 16 p + j], shape [N / 16, K, 16] (N padded to a multiple of 16 with zero columns).
//
// Why: a decode step multiplies a few rows (one per sequence) by every weight of the model,
// read once a step. XLA:CPU's GEMM repacks its weight operand on every call; here each panel
// is read from memory once, in the order it is used, and multiplied with up to kMaxRows rows
// of x per pass while 2 x kMaxRows AVX accumulators stay in registers (outer-product
// micro-kernel: per k, two loads of the panel and one broadcast per row); later row blocks
// find the panel in cache. With full-width AVX-512 (Intel) two panels go together, 32
// columns in two 512-bit registers per row (benchmarks/RESULTS.md, stop 38). Work is split
// by panels over XLA's intra-op pool. Only the first `valid_rows` rows of x are multiplied
// (a step padded to its bucket pays for its real tokens). The packed matrix may be one layer
// of a stack [L, N / 16, K, 16] (panels.h LayerView).

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "panels.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SERVAX_MATMUL_AVX2 1
#endif

// 512-bit registers: one per panel row. Intel cores with AVX-512 run 512-bit FMAs at full
// width (twice the 256-bit rate on two ports); AMD Zen 4 splits them in two halves, and there
// the 256-bit form measured faster. SERVAX_MATMUL_WIDTH=256 or 512 (compiler flag -D...) forces
// one form; by default the CPU's vendor picks, at load.
#if defined(__AVX512F__) && (!defined(SERVAX_MATMUL_WIDTH) || SERVAX_MATMUL_WIDTH == 512)
#define SERVAX_MATMUL_ZMM 1
#endif

namespace ffi = xla::ffi;

namespace {

using servax::kPanel;  // output columns per panel: two 8-float AVX registers, or one 16-float
using servax::PanelsPerTask;
#ifdef __AVX512F__
constexpr int kMaxRows = 8;  // 16 accumulators: AVX-512 has 32 vector registers
#else
constexpr int kMaxRows = 6;  // 12 accumulators of 16 registers
#endif
#ifdef SERVAX_MATMUL_ZMM
constexpr int kMaxRowsZmm = 16;  // one panel: 16 accumulators, one per row
constexpr int kMaxPairRows = 12;  // two panels: 24 accumulators, two per row, of 32 registers
constexpr int64_t kPrefetchRowsZmm = 32;  // k rows ahead (one 64-byte line each): faster than 16 or 64
#endif
constexpr int64_t kPrefetchRows = 16;  // how far ahead (in k) the first row block prefetches its panel

// c[r, 0:16] = sum_k a[r, k] * panel[k, 0:16] for MR rows of a. With kPrefetch the block
// prefetches its own panel as it goes (it comes from memory); else, given `next`, it fetches
// rows of the panel after it into L2 for the next pass: `next` points at the first row this
// block fetches, and it fetches every `every`-th row from there, one every `every` k, so the
// blocks of a pass share the fetch and spread it over the whole pass (one row per k in one
// block asks more of memory than it gives while that block runs, and leaves the others idle).
template <int MR, bool kPrefetch>
void RowBlock(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc, const float* next,
              int64_t every) {
#ifndef SERVAX_MATMUL_AVX2
  // Portable loops (runtime/ops/matmul.py uses the kernel only where AVX2 and FMA are there).
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kPanel; ++j) acc[r][j] += a[r * lda + k] * panel[k * kPanel + j];
  for (int r = 0; r < MR; ++r) std::copy(acc[r], acc[r] + kPanel, c + r * ldc);
#else
  __m256 lo[MR], hi[MR];
  // GCC keeps the accumulators in registers only when these loops are unrolled explicitly
  // (otherwise it spills them to the stack on every k).
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  int64_t due = 0;  // the next k at which this block fetches a row of `next`
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    } else if (next != nullptr && k == due) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      next += every * kPanel, due += every;
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

#ifdef SERVAX_MATMUL_ZMM
// The same with one 512-bit accumulator per row: per k one load of the panel row and, per
// row of a, one FMA with its element broadcast from memory.
template <int MR, bool kPrefetch>
void RowBlockZmm(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
                 const float* next, int64_t every) {
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  int64_t due = 0;  // the next k at which this block fetches a row of `next`
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRowsZmm) * kPanel), _MM_HINT_T0);
    } else if (next != nullptr && k == due) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      next += every * kPanel, due += every;
    }
    const __m512 b = _mm512_loadu_ps(panel + k * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), b, acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + r * ldc, acc[r]);
}

// Two adjacent panels at once (32 output columns, two accumulators per row): per k two panel
// loads and one broadcast per row feed two FMAs, half the broadcasts per FMA of the above.
// `panel` and `panel + K * kPanel` are the pair; `next` the pair after it.
template <int MR, bool kPrefetch>
void RowBlockZmm2(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
                  const float* next, int64_t every) {
  const float* panel2 = panel + K * kPanel;
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  int64_t due = 0;  // the next k at which this block fetches a row of `next`
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRowsZmm) * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(panel2 + (k + kPrefetchRowsZmm) * kPanel), _MM_HINT_T0);
    } else if (next != nullptr && k == due) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + K * kPanel), _MM_HINT_T1);
      next += every * kPanel, due += every;
    }
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel), b1 = _mm512_loadu_ps(panel2 + k * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc0[r] = _mm512_fmadd_ps(x, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, b1, acc1[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc0[r]);
    _mm512_storeu_ps(c + r * ldc + kPanel, acc1[r]);
  }
}
#endif

using RowBlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, int64_t);

// The row-block functions of one form: fns[kPrefetch][rows], rows 1..max_rows.
struct RowBlocks {
  int max_rows;
  RowBlockFn fns[2][17];
  int max_pair_rows = 0;  // 0: no two-panel form
  RowBlockFn pairs[2][17] = {};
};

RowBlocks Ymm() {
  RowBlocks b{kMaxRows, {}};
  auto fill = [&](auto prefetch) {
    constexpr bool p = decltype(prefetch)::value;
    RowBlockFn* f = b.fns[p];
    f[1] = RowBlock<1, p>, f[2] = RowBlock<2, p>, f[3] = RowBlock<3, p>;
    f[4] = RowBlock<4, p>, f[5] = RowBlock<5, p>, f[6] = RowBlock<6, p>;
#ifdef __AVX512F__
    f[7] = RowBlock<7, p>, f[8] = RowBlock<8, p>;
#endif
  };
  fill(std::false_type{});
  fill(std::true_type{});
  return b;
}

#ifdef SERVAX_MATMUL_ZMM
RowBlocks Zmm() {
  RowBlocks b{kMaxRowsZmm, {}};
  auto fill = [&](auto prefetch) {
    constexpr bool p = decltype(prefetch)::value;
    RowBlockFn* f = b.fns[p];
    f[1] = RowBlockZmm<1, p>, f[2] = RowBlockZmm<2, p>, f[3] = RowBlockZmm<3, p>, f[4] = RowBlockZmm<4, p>;
    f[5] = RowBlockZmm<5, p>, f[6] = RowBlockZmm<6, p>, f[7] = RowBlockZmm<7, p>, f[8] = RowBlockZmm<8, p>;
    f[9] = RowBlockZmm<9, p>, f[10] = RowBlockZmm<10, p>, f[11] = RowBlockZmm<11, p>, f[12] = RowBlockZmm<12, p>;
    f[13] = RowBlockZmm<13, p>, f[14] = RowBlockZmm<14, p>, f[15] = RowBlockZmm<15, p>;
    f[16] = RowBlockZmm<16, p>;
    RowBlockFn* g = b.pairs[p];
    g[1] = RowBlockZmm2<1, p>, g[2] = RowBlockZmm2<2, p>, g[3] = RowBlockZmm2<3, p>, g[4] = RowBlockZmm2<4, p>;
    g[5] = RowBlockZmm2<5, p>, g[6] = RowBlockZmm2<6, p>, g[7] = RowBlockZmm2<7, p>, g[8] = RowBlockZmm2<8, p>;
    g[9] = RowBlockZmm2<9, p>, g[10] = RowBlockZmm2<10, p>, g[11] = RowBlockZmm2<11, p>, g[12] = RowBlockZmm2<12, p>;
  };
  b.max_pair_rows = kMaxPairRows;
  fill(std::false_type{});
  fill(std::true_type{});
  return b;
}
#endif

// The form this CPU runs best (see SERVAX_MATMUL_ZMM), chosen once.
const RowBlocks& Chosen() {
#if defined(SERVAX_MATMUL_ZMM) && defined(SERVAX_MATMUL_WIDTH)
  static const RowBlocks blocks = Zmm();
#elif defined(SERVAX_MATMUL_ZMM)
  static const RowBlocks blocks = __builtin_cpu_is("amd") ? Ymm() : Zmm();
#else
  static const RowBlocks blocks = Ymm();
#endif
  return blocks;
}

// Multiplies the rows of a [M, K] by panels [first, last) of one packed matrix b into c [M, N].
void MultiplyPanels(const RowBlocks& form, const float* a, int64_t M, int64_t K, const float* b, int64_t first,
                    int64_t last, float* c, int64_t N) {
  const bool pairs = form.max_pair_rows > 0;
  for (int64_t p = first, width; p < last; p += width) {
    width = pairs && p + 1 < last ? 2 : 1;
    const int64_t max_rows = width == 2 ? form.max_pair_rows : form.max_rows;
    const RowBlockFn(*fns)[17] = width == 2 ? form.pairs : form.fns;
    // Rows in as few blocks as the registers allow, of even sizes (8 rows: one block, not 6 + 2).
    const int64_t blocks = (M + max_rows - 1) / max_rows;
    const float* panel = b + p * K * kPanel;
    for (int64_t blk = 0, r0 = 0; blk < blocks; ++blk) {
      const int64_t rows = M / blocks + (blk < M % blocks);
      // Rows in several blocks: each panel is fetched into L2 while the previous one is
      // multiplied, by all its blocks but one that fetches its own, each a share of the rows
      // spread over its pass (stop 45; one block fetching it all: stop 39, both in
      // benchmarks/RESULTS.md).
      const bool fetch_own = blocks == 1 || p == first;
      const int64_t fetchers = blocks - fetch_own, j = blk - fetch_own;  // blocks that fetch the next panel
      const float* next = j >= 0 && p + width < last ? panel + (width * K + j) * kPanel : nullptr;
      fns[blk == 0 && fetch_own][rows](a + r0 * K, K, panel, K, c + r0 * N + p * kPanel, N, next, fetchers);
      r0 += rows;
    }
  }
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed_all,
                        ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::F32> out) {
  servax::LayerView layer;
  const bool viewed = servax::ViewLayer(packed_all.dimensions(), meta, layer);
  auto xd = x.dimensions(), pd = layer.dims, od = out->dimensions();
  if (!viewed || xd.size() != 2 || pd[2] != kPanel || pd[1] != xd[1] || od.size() != 2 || od[0] != xd[0] ||
      od[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument(
        "packed matmul: x [M, K], packed [N/16, K, 16] with meta [rows] (or [L, N/16, K, 16] with meta [rows, "
        "layer < L]), out [M, N]");
  const float* packed = packed_all.typed_data() + layer.offset;
  const int64_t K = xd[1], panels = pd[0], N = panels * kPanel;
  float* c = out->typed_data();
  // Rows past valid_rows (a step's bucket padding) are not multiplied: their results are zeros.
  const int64_t M = servax::ValidRows(xd[0], meta.typed_data()[0], N, c);
  if (M == 0 || panels == 0) return ffi::Error::Success();
  const RowBlocks& form = Chosen();
  servax::ForPanelRanges(pool, panels, form.max_pair_rows > 0 ? 2 : 1, [&](int64_t first, int64_t last) {
    MultiplyPanels(form, x.typed_data(), M, K, packed, first, last, c, N);
  });
  return ffi::Error::Success();
}

// Experts' products (runtime/ops/matmul.py PackedExperts): the rows of x come sorted by
// expert, group_sizes[e] of them for expert e, and each group is multiplied by its own
// expert's packed matrix only; rows past the last group are zeros. Tasks are (expert, panel
// range) pairs of the experts that have rows, so a decode step reads only its active experts.
ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), pd = packed.dimensions(), gd = group_sizes.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || pd[3] != kPanel || pd[2] != xd[1] || gd.size() != 1 || gd[0] != pd[0] ||
      od.size() != 2 || od[0] != xd[0] || od[1] != pd[1] * kPanel)
    return ffi::Error::InvalidArgument(
        "grouped matmul: x [M, K], packed [E, N/16, K, 16], group_sizes [E], out [M, N]");
  const int64_t M = xd[0], K = xd[1], experts = pd[0], panels = pd[1], N = panels * kPanel;
  const int32_t* sizes = group_sizes.typed_data();
  std::vector<int64_t> begin(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) begin[e + 1] = std::min<int64_t>(M, begin[e] + std::max<int32_t>(sizes[e], 0));
  float* c = out->typed_data();
  std::fill(c + begin[experts] * N, c + M * N, 0.0f);
  if (begin[experts] == 0 || panels == 0) return ffi::Error::Success();
  const RowBlocks& form = Chosen();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_task = PanelsPerTask(panels, form.max_pair_rows > 0 ? 2 : 1, threads);
  const int64_t chunks = (panels + per_task - 1) / per_task;
  std::vector<int64_t> task_expert;
  for (int64_t e = 0; e < experts; ++e)
    if (begin[e + 1] > begin[e]) task_expert.push_back(e);
  const float* a = x.typed_data();
  const float* b = packed.typed_data();
  servax::ParallelFor(pool, static_cast<int64_t>(task_expert.size()) * chunks, threads - 1, [&](int64_t t) {
    const int64_t e = task_expert[t / chunks], first = (t % chunks) * per_task, rows = begin[e + 1] - begin[e];
    MultiplyPanels(form, a + begin[e] * K, rows, K, b + e * panels * K * kPanel, first,
                   std::min(panels, first + per_task), c + begin[e] * N, N);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // packed W [N / 16, K, 16], or [L, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] (rows of x to
                                                                 // multiply), or [valid rows, layer]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ServaxGroupedMatmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::F32>>()  // packed experts [E, N / 16, K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]: rows of each expert, in order
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
