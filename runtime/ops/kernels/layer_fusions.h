// A decode step's small operations run between a decoder layer's packed products, shared by the
// products that quantize the activations to int8 (matmul_dot.cc) and those that take them as float
// (matmul_formats.cc: bfloat16, int8, 4-bit and float32 weights): each library's two handlers are
// MlpBlockHandler and NormMatmulHandler over its own products.
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

namespace ffi = xla::ffi;

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

// The two handlers, for a library `P` of products: P::Product(pool, x, rows, valid, K, N,
// panels, scales, offsets, meta, c) multiplies x [rows, K] by one matrix given as its three
// operands (scales and offsets empty where its format has none) into c [rows, N]; P::kName names
// them in the errors. Each library binds them with MlpBlockBinding / NormMatmulBinding.
template <class P>
ffi::Error MlpBlockHandler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> attn, ffi::Buffer<ffi::F32> residual,
                           ffi::AnyBuffer o, ffi::AnyBuffer o_scales, ffi::AnyBuffer o_offsets,
                           ffi::Buffer<ffi::F32> norm, ffi::AnyBuffer gate_up, ffi::AnyBuffer gate_up_scales,
                           ffi::AnyBuffer gate_up_offsets, ffi::AnyBuffer down, ffi::AnyBuffer down_scales,
                           ffi::AnyBuffer down_offsets, ffi::Buffer<ffi::S32> meta, float eps, int64_t intermediate,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto ad = attn.dimensions(), xd = residual.dimensions(), od = out->dimensions();
  if (ad.size() != 2 || xd.size() != 2 || ad[0] != xd[0] || norm.element_count() != xd[1] || od.size() != 2 ||
      od[0] != xd[0] || od[1] != xd[1] || intermediate <= 0 || meta.element_count() < 1)
    return ffi::Error::InvalidArgument(std::string(P::kName) + " MLP block: attn [M, A], residual and out [M, D], "
                                       "norm [D], intermediate > 0, meta [valid rows(, layer)]");
  const int64_t M = xd[0], valid = std::clamp<int64_t>(meta.typed_data()[0], 0, M);
  auto product = [&](BlockMatrix which, const float* a, int64_t K, int64_t N, float* c) {
    if (which == BlockMatrix::kO) return P::Product(pool, a, M, valid, K, N, o, o_scales, o_offsets, meta, c);
    if (which == BlockMatrix::kGateUp)
      return P::Product(pool, a, M, valid, K, N, gate_up, gate_up_scales, gate_up_offsets, meta, c);
    return P::Product(pool, a, M, valid, K, N, down, down_scales, down_offsets, meta, c);
  };
  return MlpBlock(attn.typed_data(), ad[1], residual.typed_data(), M, xd[1], valid, intermediate, norm.typed_data(),
                  eps, product, out->typed_data());
}

template <class P>
ffi::Error NormMatmulHandler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm,
                             ffi::AnyBuffer panels, ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                             ffi::Buffer<ffi::S32> meta, float eps, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || norm.element_count() != xd[1] || od.size() != 2 || od[0] != xd[0] ||
      od[1] % kPanel != 0 || meta.element_count() < 1)
    return ffi::Error::InvalidArgument(std::string(P::kName) + " norm and matmul: x [M, D], norm [D], out [M, N] "
                                       "(N whole panels), meta [valid rows(, layer)]");
  const int64_t M = xd[0], D = xd[1], valid = std::clamp<int64_t>(meta.typed_data()[0], 0, M);
  return NormThenProduct(x.typed_data(), norm.typed_data(), M, D, valid, eps, [&](const float* h) {
    return P::Product(pool, h, M, valid, D, od[1], panels, scales, offsets, meta, out->typed_data());
  });
}

inline auto MlpBlockBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // attn [M, A]: the attention's output, heads joined
      .Arg<ffi::Buffer<ffi::F32>>()  // residual x [M, D]
      .Arg<ffi::AnyBuffer>()         // o panels [(L,) D/16, A (or A/4: quads), ..]
      .Arg<ffi::AnyBuffer>()         // o scales [(L,) D/16, G, 16] (quantized; else empty)
      .Arg<ffi::AnyBuffer>()         // o offsets (4-bit; else empty)
      .Arg<ffi::Buffer<ffi::F32>>()  // the post-attention RMSNorm's weight [D]
      .Arg<ffi::AnyBuffer>()         // gate_up panels [(L,) 2F/16, D (or D/4), ..]: gate, then up
      .Arg<ffi::AnyBuffer>()         // gate_up scales
      .Arg<ffi::AnyBuffer>()         // gate_up offsets
      .Arg<ffi::AnyBuffer>()         // down panels [(L,) D/16, F (or F/4), ..]
      .Arg<ffi::AnyBuffer>()         // down scales
      .Arg<ffi::AnyBuffer>()         // down offsets
      .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
      .Attr<float>("eps")
      .Attr<int64_t>("intermediate")  // F
      .Ret<ffi::Buffer<ffi::F32>>();  // out [M, D]: x1 + the MLP of x1
}

inline auto NormMatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // x [M, D]: a layer's residual
      .Arg<ffi::Buffer<ffi::F32>>()  // the RMSNorm's weight [D]
      .Arg<ffi::AnyBuffer>()         // panels [(L,) N/16, D (or D/4: quads), ..]
      .Arg<ffi::AnyBuffer>()         // scales [(L,) N/16, G, 16] (quantized; else empty)
      .Arg<ffi::AnyBuffer>()         // offsets (4-bit; else empty)
      .Arg<ffi::Buffer<ffi::S32>>()  // meta: [valid rows] or [valid rows, layer]
      .Attr<float>("eps")
      .Ret<ffi::Buffer<ffi::F32>>();  // out [M, N]
}

}  // namespace servax

#endif  // SERVAX_KERNELS_LAYER_FUSIONS_H_
