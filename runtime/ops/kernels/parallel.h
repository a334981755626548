// Work sharing for the servax kernels (paged_attention.cc, sampling.cc, matmul.cc): run fn(i)
// for every i in [0, n) on the calling thread and on up to `helpers` threads of XLA's intra-op
// pool, each thread taking the next unclaimed index, and return once all n are done. Header
// only and stateless (the pool is the one XLA passes each call), so every kernel's library
// carries its own copy and the kernels still share one pool.
//
// A helper may start only after the call has returned (the pool was busy and the caller did
// all the work); the shared state it touches is kept alive by the helper's own reference,
// and such a helper finds no index left, so `fn` (which may refer to the caller's stack) is
// never run after ParallelFor returns.

#ifndef SERVAX_KERNELS_PARALLEL_H_
#define SERVAX_KERNELS_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace servax {

struct ParallelWork {
  ParallelWork(int64_t n, std::function<void(int64_t)> fn) : n(n), fn(std::move(fn)) {}

  const int64_t n;
  const std::function<void(int64_t)> fn;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void Drain() {
    int64_t ran = 0;
    for (int64_t i; (i = next.fetch_add(1)) < n; ++ran) fn(i);
    if (ran && done.fetch_add(ran) + ran == n) {
      std::lock_guard<std::mutex> lock(mu);
      finished.notify_all();
    }
  }
};

constexpr std::chrono::microseconds kSpinBeforeSleep{200};

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline void ParallelFor(xla::ffi::ThreadPool pool, int64_t n, int64_t helpers, std::function<void(int64_t)> fn) {
  if (n <= 0) return;
  auto work = std::make_shared<ParallelWork>(n, std::move(fn));
  helpers = std::max<int64_t>(0, std::min(helpers, n - 1));
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  // What is left runs on a helper that has claimed it (items take microseconds): spin a while
  // before sleeping, since a futex sleep and wake-up cost about as much as a small item
  // (measured on batch-1 decode: benchmarks/RESULTS.md, stop 38).
  const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  while (work->done.load(std::memory_order_acquire) != n) {
    for (int i = 0; i < 64; ++i) Pause();
    if (std::chrono::steady_clock::now() > deadline) break;
  }
  std::unique_lock<std::mutex> lock(work->mu);
  work->finished.wait(lock, [&] { return work->done.load() == n; });
}

}  // namespace servax

#endif  // SERVAX_KERNELS_PARALLEL_H_
