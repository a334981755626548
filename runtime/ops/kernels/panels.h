// Shared by the packed-weight matmul kernels (matmul.cc: float32 panels; matmul_formats.cc:
// bfloat16, int8 and 4-bit panels): the panel width and how panels are split into tasks.

#ifndef SERVAX_KERNELS_PANELS_H_
#define SERVAX_KERNELS_PANELS_H_

#include <cstdint>
#include <cstdlib>

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

}  // namespace servax

#endif  // SERVAX_KERNELS_PANELS_H_
