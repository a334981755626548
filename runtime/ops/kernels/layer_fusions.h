// A decode step's small operations run between a decoder layer's packed products, shared by the
// products that quantize the activations to int8 (matmul_dot.cc) and those that take them as float
// (matmul_formats.cc: bfloat16, int8, 4-bit and float32 weights): each library's handlers are these
// bodies (MlpBlockCall, NormMatmulCall) over its own products.
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
#include <string>
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

// The handlers' bodies, for a library whose `product(pool, x, rows, valid, K, N, panels, scales,
// offsets, meta, c)` multiplies x [rows, K] by one matrix given as its three operands (scales and
// offsets empty where its format has none) into c [rows, N]; `what` names the library's
// products in the errors.
template <class Product>
xla::ffi::Error MlpBlockCall(xla::ffi::ThreadPool& pool, xla::ffi::Buffer<xla::ffi::F32>& attn,
                             xla::ffi::Buffer<xla::ffi::F32>& residual, xla::ffi::AnyBuffer o[3],
                             xla::ffi::Buffer<xla::ffi::F32>& norm, xla::ffi::AnyBuffer gate_up[3],
                             xla::ffi::AnyBuffer down[3], xla::ffi::Buffer<xla::ffi::S32>& meta, float eps,
                             int64_t intermediate, xla::ffi::ResultBuffer<xla::ffi::F32>& out, const char* what,
                             Product&& product) {
  const auto ad = attn.dimensions(), xd = residual.dimensions(), od = out->dimensions();
  if (ad.size() != 2 || xd.size() != 2 || ad[0] != xd[0] || norm.element_count() != xd[1] || od.size() != 2 ||
      od[0] != xd[0] || od[1] != xd[1] || intermediate <= 0 || meta.element_count() < 1)
    return xla::ffi::Error::InvalidArgument(std::string(what) + " MLP block: attn [M, A], residual and out [M, D], "
                                            "norm [D], intermediate > 0, meta [valid rows(, layer)]");
  const int64_t M = xd[0], valid = std::clamp<int64_t>(meta.typed_data()[0], 0, M);
  auto one = [&](BlockMatrix which, const float* a, int64_t K, int64_t N, float* c) {
    xla::ffi::AnyBuffer* m = which == BlockMatrix::kO ? o : which == BlockMatrix::kGateUp ? gate_up : down;
    return product(pool, a, M, valid, K, N, m[0], m[1], m[2], meta, c);
  };
  return MlpBlock(attn.typed_data(), ad[1], residual.typed_data(), M, xd[1], valid, intermediate, norm.typed_data(),
                  eps, one, out->typed_data());
}

template <class Product>
xla::ffi::Error NormMatmulCall(xla::ffi::ThreadPool& pool, xla::ffi::Buffer<xla::ffi::F32>& x,
                               xla::ffi::Buffer<xla::ffi::F32>& norm, xla::ffi::AnyBuffer w[3],
                               xla::ffi::Buffer<xla::ffi::S32>& meta, float eps,
                               xla::ffi::ResultBuffer<xla::ffi::F32>& out, const char* what, Product&& product) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || norm.element_count() != xd[1] || od.size() != 2 || od[0] != xd[0] ||
      od[1] % kPanel != 0 || meta.element_count() < 1)
    return xla::ffi::Error::InvalidArgument(std::string(what) + " norm and matmul: x [M, D], norm [D], out [M, N] "
                                            "(N whole panels), meta [valid rows(, layer)]");
  const int64_t M = xd[0], D = xd[1], valid = std::clamp<int64_t>(meta.typed_data()[0], 0, M);
  return NormThenProduct(x.typed_data(), norm.typed_data(), M, D, valid, eps, [&](const float* h) {
    return product(pool, h, M, valid, D, od[1], w[0], w[1], w[2], meta, out->typed_data());
  });
}

}  // namespace servax

#endif  // SERVAX_KERNELS_LAYER_FUSIONS_H_
