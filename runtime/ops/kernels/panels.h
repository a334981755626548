// Shared by the packed-weight matmul kernels (matmul.cc: float32 panels; matmul_formats.cc:
// bfloat16, int8 and 4-bit panels; matmul_dot.cc): the panel width, which rows of x a call
// multiplies, how panels are split into tasks over the pool, and how a packed operand is read
// as one layer of a stack.

#ifndef SERVAX_KERNELS_PANELS_H_
#define SERVAX_KERNELS_PANELS_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace servax {

constexpr int64_t kPanel = 16;  // output columns per packed panel (runtime/ops/matmul.py PANEL)
constexpr int64_t kMaxPanelsPerTask = 32;

// Panels per task: a multiple of `unit` (2 where panels go in pairs), at most
// kMaxPanelsPerTask, such that the thread with the most tasks has as little work as can be
// (36 panels in pairs over 2 threads: 6 tasks of 6 panels, not 9 of 4, which leave one thread
// 5 of them); of such splits, the one nearest four tasks a thread (balance where a thread
// starts late).
inline int64_t PanelsPerTask(int64_t panels, int64_t unit, int64_t threads) {
  const int64_t units = (panels + unit - 1) / unit;
  int64_t best = 1, best_load = INT64_MAX, best_gap = INT64_MAX;
  for (int64_t per = 1; per * unit <= kMaxPanelsPerTask && per <= units; ++per) {
    const int64_t tasks = (units + per - 1) / per;
    const int64_t load = (tasks + threads - 1) / threads * per;
    const int64_t gap = std::abs(tasks - 4 * threads);
    if (load < best_load || (load == best_load && gap < best_gap)) best = per, best_load = load, best_gap = gap;
  }
  return best * unit;
}

// The rows of c [rows, N] a call multiplies: the first `valid` (a step padded to its bucket pays
// for its real tokens); the rows past them are zeroed here.
inline int64_t ValidRows(int64_t rows, int64_t valid, int64_t N, float* c) {
  const int64_t M = std::clamp<int64_t>(valid, 0, rows);
  std::fill(c + M * N, c + rows * N, 0.0f);
  return M;
}

// fn(first, last) for ranges of `panels` panels (PanelsPerTask's, in multiples of `unit`), shared
// by the calling thread and the pool's.
template <class Fn>
void ForPanelRanges(xla::ffi::ThreadPool& pool, int64_t panels, int64_t unit, Fn&& fn) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_task = PanelsPerTask(panels, unit, threads);
  ParallelFor(pool, (panels + per_task - 1) / per_task, threads - 1, [&](int64_t t) {
    fn(t * per_task, std::min(panels, (t + 1) * per_task));
  });
}

// A packed operand (panels, and their scales and offsets) comes whole, [P, K, w], or as a
// stack of every layer's, [L, P, K, w] (runtime/ops/layered.py stacks a model's packed layers:
// a step then hands XLA a few arrays, not a dozen per layer). The kernels' int32 operand
// `meta` is [valid_rows] for a whole operand and [valid_rows, layer] for a stacked one.
struct LayerView {
  xla::ffi::Span<const int64_t> dims;  // one layer's dimensions (rank 3)
  int64_t offset = 0;                  // elements before that layer's
};

// The layer `meta` names of an operand of dimensions `dims`; false where the ranks do not
// match (rank 3 with meta [rows], rank 4 with meta [rows, layer]) or the layer is not in the stack.
inline bool ViewLayer(xla::ffi::Span<const int64_t> dims, xla::ffi::Buffer<xla::ffi::S32>& meta_buffer,
                      LayerView& view) {
  const auto meta_dims = meta_buffer.dimensions();
  const int32_t* meta = meta_buffer.typed_data();
  const int64_t n = meta_dims.size() == 1 ? meta_dims[0] : -1;
  if (dims.size() == 3 && n == 1) {
    view.dims = dims, view.offset = 0;
    return true;
  }
  if (dims.size() != 4 || n != 2 || meta[1] < 0 || meta[1] >= dims[0]) return false;
  view.dims = xla::ffi::Span<const int64_t>(dims.begin() + 1, 3);
  view.offset = meta[1] * dims[1] * dims[2] * dims[3];
  return true;
}

}  // namespace servax

#endif  // SERVAX_KERNELS_PANELS_H_
