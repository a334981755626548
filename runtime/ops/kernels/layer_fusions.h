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
// input norm, the joined q/k/v product and the rotary embedding of q and k in one call
// (NormThenProduct).

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

// The rotary embedding as transformers applies it ("rotate half") to the first `heads` heads
// (head_dim hd) of each of the first `rows` rows of y [., ld]: a head's halves x1, x2 become
// x1 cos[:hd/2] - x2 sin[:hd/2] and x2 cos[hd/2:] + x1 sin[hd/2:], cos and sin [rows, hd].
inline void RotateHalves(float* y, int64_t ld, int64_t rows, int64_t heads, int64_t hd, const float* cos,
                         const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * hd;
    const float* s = sin + r * hd;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = y + r * ld + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

// A fused call's rotary embedding: none (heads 0), or cos and sin [M, head_dim] for the first
// `heads` heads of its result.
struct Rope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t heads = 0, head_dim = 0;
};

// Whether a fused call's rope operands fit a result of M rows and N columns: none, or cos and sin
// [M, head_dim] (head_dim even) with heads * head_dim <= N.
inline bool RopeShaped(xla::ffi::Buffer<xla::ffi::F32>& cos, xla::ffi::Buffer<xla::ffi::F32>& sin, int64_t heads,
                       int64_t M, int64_t N, Rope& rope) {
  if (heads == 0) return true;
  const auto cd = cos.dimensions(), sd = sin.dimensions();
  if (heads < 0 || cd.size() != 2 || sd.size() != 2 || cd[0] != M || sd[0] != M || cd[1] != sd[1] || cd[1] % 2 ||
      heads * cd[1] > N)
    return false;
  rope = Rope{cos.typed_data(), sin.typed_data(), heads, cd[1]};
  return true;
}

// product(h, c) of h = rmsnorm(x) * norm for the first `valid` rows of x [M, D] into c [M, N] (a
// layer's joined q/k/v on its residual), then `rope` on its leading heads (the queries' and the
// keys'): the norm's small programs and the rotary embedding's run here, around the product.
template <class Product>
xla::ffi::Error NormThenProduct(const float* x, const float* norm, int64_t M, int64_t D, int64_t N, int64_t valid,
                                float eps, const Rope& rope, float* c, Product&& product) {
  thread_local std::vector<float> h;
  h.resize(M * D);
  RmsNorm(x, norm, valid, D, eps, h.data());
  if (auto e = product(h.data()); e.failure()) return e;
  if (rope.heads > 0) RotateHalves(c, N, valid, rope.heads, rope.head_dim, rope.cos, rope.sin);
  return xla::ffi::Error::Success();
}

}  // namespace servax

#endif  // SERVAX_KERNELS_LAYER_FUSIONS_H_
