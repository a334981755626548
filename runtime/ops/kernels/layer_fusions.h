// A decode step's small operations run between a decoder layer's packed products, shared by the
// products that quantize the activations to int8 (matmul_dot.cc) and those that take them as float
// (matmul_formats.cc: bfloat16, int8 and 4-bit weights): each library defines its handlers with its
// own products and these bodies.
//
// A pre-norm layer ends: x1 = x + attn . Wo; out = x1 + Wdown . (silu(gate) * up), where
// [gate, up] = rmsnorm(x1) . Wgate_up. With each product a call of its own, XLA runs the residual
// adds, the norm's four small programs and the activation between them: at batch 1 a dozen thunks
// a layer that each cost about as much as their work (benchmarks/RESULTS.md, stop 55). Here they
// run on the calling thread between the products (the rows past `valid` come out as x, as the
// separate ops give them: zero products added). The layer's first half likewise starts with its
// input norm and the joined q/k/v product in one call (NormThenProduct).

#ifndef SERVAX_KERNELS_LAYER_FUSIONS_H_
#define SERVAX_KERNELS_LAYER_FUSIONS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "panels.h"
#include "xla/ffi/api/ffi.h"

namespace servax {

// Panels of 16 columns: a product's result has the columns rounded up to whole panels.
inline int64_t Padded(int64_t n) { return (n + kPanel - 1) / kPanel * kPanel; }

// out[r] = norm * x[r] / sqrt(mean(x[r]^2) + eps) for the first `rows` rows of x [., D].
inline void RmsNorm(const float* x, const float* norm, int64_t rows, int64_t D, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float ss = 0.0f;
    for (int64_t i = 0; i < D; ++i) ss += x[r * D + i] * x[r * D + i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = norm[i] * (x[r * D + i] * inv);
  }
}

// The matrices of an MLP block, for its `product` callback.
enum class BlockMatrix { kO, kGateUp, kDown };

// out [M, D] = x1 + down(silu(gate) * up) of x1 = x + attn . Wo (see the top of the file), with
// product(which, a, K, N, c) multiplying a [M, K] by matrix `which` into c [M, N] (N whole panels;
// the first `valid` rows, the rest zeros) and returning its ffi::Error. attn [M, A], F the
// intermediate size (gate_up's N is Padded(2 F), gate then up).
template <class Product>
xla::ffi::Error MlpBlock(const float* attn, int64_t A, const float* x, int64_t M, int64_t D, int64_t valid,
                         int64_t F, const float* norm, float eps, Product&& product, float* out) {
  const int64_t Dp = Padded(D), Fp = Padded(2 * F);
  thread_local std::vector<float> y, h, g, a;  // the calling thread's scratch, reused from call to call
  y.resize(M * Dp), h.resize(M * D), g.resize(M * Fp), a.resize(M * F);
  if (auto e = product(BlockMatrix::kO, attn, A, Dp, y.data()); e.failure()) return e;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = x[r * D + i] + y[r * Dp + i];
  RmsNorm(out, norm, valid, D, eps, h.data());
  if (auto e = product(BlockMatrix::kGateUp, h.data(), D, Fp, g.data()); e.failure()) return e;
  for (int64_t r = 0; r < valid; ++r)
    for (int64_t i = 0; i < F; ++i) {
      const float gate = g[r * Fp + i];
      a[r * F + i] = gate / (1.0f + std::exp(-gate)) * g[r * Fp + F + i];
    }
  if (auto e = product(BlockMatrix::kDown, a.data(), F, Dp, y.data()); e.failure()) return e;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < D; ++i) out[r * D + i] += y[r * Dp + i];
  return xla::ffi::Error::Success();
}

// product(h) of h = rmsnorm(x) * norm for the first `valid` rows of x [M, D] (a layer's joined
// q/k/v on its residual): the norm's small programs run here, before the product.
template <class Product>
xla::ffi::Error NormThenProduct(const float* x, const float* norm, int64_t M, int64_t D, int64_t valid, float eps,
                                Product&& product) {
  thread_local std::vector<float> h;
  h.resize(M * D);
  RmsNorm(x, norm, valid, D, eps, h.data());
  return product(h.data());
}

}  // namespace servax

#endif  // SERVAX_KERNELS_LAYER_FUSIONS_H_
