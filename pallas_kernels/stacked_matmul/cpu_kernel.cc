// x @ w[layer] for a few rows of x, reading the layer's weights in place inside the stacked
// [L, K, ...] array: an XLA FFI custom call (see __init__.py for why XLA's own dot cannot).
//
// x [T, K] float32, w [L, K, N...] float32 (trailing dims flattened to N), layer [1] int32,
// out [T, N] float32. Decode steps have few rows, so the product is bound by reading the
// weights: each thread takes a contiguous range of K and streams its rows of w front to back
// (whole rows: the hardware prefetcher follows them), accumulating T partial output rows in
// its own buffer; the partial sums are then added up, each thread a share of the outputs.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinRowsPerThread = 64;  // fewer K rows than this per thread: not worth a thread

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 3 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("stacked_matmul_cpu: x must be [T, K] and w [L, K, ...]");
  const int64_t rows = xd[0], k_dim = xd[1], num_layers = wd[0];
  int64_t n = 1;
  for (size_t i = 2; i < wd.size(); ++i) n *= wd[i];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("stacked_matmul_cpu: layer out of range");
  const float* wl = w.typed_data() + l * k_dim * n;
  const float* xp = x.typed_data();
  float* y = out->typed_data();
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), k_dim / kMinRowsPerThread)));
  std::vector<float> partial(static_cast<size_t>(threads - 1) * rows * n);
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t k0 = k_dim * id / team, k1 = k_dim * (id + 1) / team;
    float* acc = id == 0 ? y : partial.data() + static_cast<size_t>(id - 1) * rows * n;
    std::memset(acc, 0, sizeof(float) * rows * n);
    for (int64_t k = k0; k < k1; ++k) {
      const float* wrow = wl + k * n;
      for (int64_t t = 0; t < rows; ++t) {
        const float a = xp[t * k_dim + k];
        float* o = acc + t * n;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) o[c] += a * wrow[c];
      }
    }
#pragma omp barrier
    const int64_t e0 = rows * n * id / team, e1 = rows * n * (id + 1) / team;
    for (int p = 0; p + 1 < team; ++p) {
      const float* src = partial.data() + static_cast<size_t>(p) * rows * n;
#pragma omp simd
      for (int64_t e = e0; e < e1; ++e) y[e] += src[e];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
