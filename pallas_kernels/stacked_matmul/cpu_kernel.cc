// x @ w[layer], reading the layer's weights in place inside the stacked [L, K, ...] array:
// XLA FFI custom calls (see __init__.py for why XLA's own dot cannot). `layer` holds S indices and x
// S tiles of T / S rows, tile s multiplied by w[layer[s]]: S = 1 is one layer's matmul, S > 1 the
// grouped matmul of a mixture of experts (each tile of rows against its own expert, model/moe.py).
// This file holds the two handlers, which check their buffers and call a kernel once per tile:
// - StackedMatmulCpu: float32 weights, stacked or packed, or packed bfloat16 (float_panels.h);
// - QuantizedMatmulCpu: packed int8 / 4-bit quants with float16 scales (quant_panels.h, quantized.py), from
//   `int8_min_rows` rows on against x quantized to int8 by integer dot instructions (int_panels.h);
// - AddLoraCpu: LoRA adapters' products added into a projection's output, each token's slot (lora_rows.h).
// Every choice by instruction set is cpu_simd.h's; the threads are XLA's own pool (cpu_team.h).
// cpu_ffi.py compiles this file alone: the kernels are headers it includes (one translation unit),
// and the build is keyed by every file it includes.

#include <cstdint>

#include "float_panels.h"
#include "int_panels.h"
#include "lora_rows.h"
#include "quant_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The end of the run of tiles from `s` that all name the same layer (a grouped matmul's tiles of one expert or
// adapter are consecutive): the run is multiplied as one block of rows, the weights read once.
int64_t RunEnd(ffi::Buffer<ffi::S32> layer, int64_t s) {
  const int32_t* ids = layer.typed_data();
  int64_t end = s + 1;
  while (end < static_cast<int64_t>(layer.element_count()) && ids[end] == ids[s]) ++end;
  return end;
}

// Every index in `layer` names one of the stack's `num_layers` layers.
bool InRange(ffi::Buffer<ffi::S32> layer, int64_t num_layers) {
  for (size_t s = 0; s < layer.element_count(); ++s)
    if (layer.typed_data()[s] < 0 || layer.typed_data()[s] >= num_layers) return false;
  return true;
}

// `packed`: w as `pack` (__init__.py) lays it out, read by PackedPanels whatever the row count.
// x and w both float32, or (packed only) both bfloat16; the output is float32.
ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                bool packed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 3 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("stacked_matmul_cpu: x must be [T, K] and w [L, K, ...]");
  const int64_t k_dim = xd[1], num_layers = wd[0], num_tiles = layer.element_count();
  if (num_tiles < 1 || xd[0] % num_tiles) return ffi::Error::InvalidArgument("stacked_matmul_cpu: T must be whole tiles");
  const int64_t rows = xd[0] / num_tiles;
  int64_t n = 1;
  for (size_t i = 2; i < wd.size(); ++i) n *= wd[i];
  if (!InRange(layer, num_layers)) return ffi::Error::InvalidArgument("stacked_matmul_cpu: layer out of range");
  const bool f32 = x.element_type() == ffi::F32 && w.element_type() == ffi::F32;
  const bool bf16 = x.element_type() == ffi::BF16 && w.element_type() == ffi::BF16;
  if (!f32 && !(bf16 && packed && k_dim % 2 == 0))
    return ffi::Error::InvalidArgument("stacked_matmul_cpu: x and w float32, or bfloat16 packed with K even");
  if (packed && n % kPanel != 0) return ffi::Error::InvalidArgument("stacked_matmul_cpu: packed N must divide by 32");
  const Team team(pool);
  for (int64_t s = 0, end; s < num_tiles; s = end) {
    const int64_t l = layer.typed_data()[s], x_off = s * rows * k_dim, w_off = l * k_dim * n;
    end = RunEnd(layer, s);
    const int64_t run_rows = (end - s) * rows;  // consecutive tiles of one layer: one matmul, one team dispatch
    float* y = out->typed_data() + s * rows * n;
    if (bf16) {
      const auto* w16 = static_cast<const uint16_t*>(w.untyped_data()) + w_off;
      const auto* x16 = static_cast<const uint16_t*>(x.untyped_data()) + x_off;
      PackedPanels(team, Bf16Rows(x16, run_rows * k_dim), run_rows, k_dim / 2, w16, n, y);
      continue;
    }
    const float* xp = x.typed_data<float>() + x_off;
    const float* wl = w.typed_data<float>() + w_off;
    if (packed)
      PackedPanels(team, xp, run_rows, k_dim, wl, n, y);
    else if (run_rows <= kStreamRows)
      Stream(xp, run_rows, k_dim, wl, n, y);
    else
      Panels(team, xp, run_rows, k_dim, wl, n, y);
  }
  return ffi::Error::Success();
}

// x float32 [T, K]; qs int8 [L, K, N...] or uint8 [L, K / 2, N...]; scales float16 [L, K / G, N...]; mins
// float16 like scales, or size 0 (none); layer [S] (S tiles of x); out [T, N]. Every weight array packed
// (quantized.py).
ffi::Error QuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qs, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t int8_min_rows) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scales.dimensions();
  const int bits = qs.element_type() == ffi::S8 ? 8 : qs.element_type() == ffi::U8 ? 4 : 0;
  if (!bits || scales.element_type() != ffi::F16 || mins.element_type() != ffi::F16)
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: qs int8 or uint8, scales and mins float16");
  if (xd.size() != 2 || qd.size() < 3 || sd.size() != qd.size() || sd[0] != qd[0])
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: x [T, K], qs [L, Kq, ...], scales [L, K / G, ...]");
  const int64_t k_dim = xd[1], num_layers = qd[0], groups = sd[1], num_tiles = layer.element_count();
  if (num_tiles < 1 || xd[0] % num_tiles) return ffi::Error::InvalidArgument("quantized_matmul_cpu: T must be whole tiles");
  const int64_t rows = xd[0] / num_tiles;
  int64_t n = 1, n_scales = 1;
  for (size_t i = 2; i < qd.size(); ++i) n *= qd[i], n_scales *= sd[i];
  if (qd[1] * (bits == 4 ? 2 : 1) != k_dim || n != n_scales || groups <= 0 || k_dim % groups)
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: qs and scales do not match x's K");
  const int64_t group = k_dim / groups;
  if (n % kPanel || (bits == 4 && group % 32))
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: N whole panels of 32, 4-bit groups whole blocks of 32");
  const bool has_min = mins.element_count() != 0;
  if (has_min && (bits == 8 || static_cast<int64_t>(mins.element_count()) != num_layers * groups * n))
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: mins only for 4-bit weights, shaped like scales");
  if (!InRange(layer, num_layers)) return ffi::Error::InvalidArgument("quantized_matmul_cpu: layer out of range");
  const int64_t q_layer = qd[1] * n, s_layer = groups * n;
  const Team team(pool);
  for (int64_t s = 0, end; s < num_tiles; s = end) {
    const int64_t l = layer.typed_data()[s];
    end = RunEnd(layer, s);
    QuantLayer w{static_cast<const int8_t*>(qs.untyped_data()) + l * q_layer,
                 static_cast<const uint16_t*>(scales.untyped_data()) + l * s_layer,
                 has_min ? static_cast<const uint16_t*>(mins.untyped_data()) + l * s_layer : nullptr,
                 k_dim,
                 group,
                 n};
    QuantMatmul(team, x.typed_data() + s * rows * k_dim, (end - s) * rows, w, bits, out->typed_data() + s * rows * n,
                int8_min_rows);
  }
  return ffi::Error::Success();
}

// x float32 [T, K]; y float32 [T, N] (the projection's output, aliased to out); slots int32 [T]; layer int32 [1];
// a [L, S, Rw, K] and each part's b [L, S, r, outer, cols], all float32, float16 or bfloat16; out = y + the products.
ffi::Error LoraImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::S32> slots,
                    ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer a, ffi::RemainingArgs bs, ffi::ResultBuffer<ffi::F32> out,
                    int64_t outer) {
  auto xd = x.dimensions(), ad = a.dimensions();
  const int64_t parts = static_cast<int64_t>(bs.size());
  if (xd.size() != 2 || ad.size() != 4 || ad[3] != xd[1] || layer.element_count() != 1 ||
      static_cast<int64_t>(slots.element_count()) != xd[0] || parts < 1 || parts > kMaxLoraParts || outer < 1)
    return ffi::Error::InvalidArgument("add_lora_cpu: x [T, K], a [L, S, Rw, K], slots [T], layer [1], 1-4 parts");
  const ffi::DataType type = a.element_type();
  if (type != ffi::F32 && type != ffi::F16 && type != ffi::BF16)
    return ffi::Error::InvalidArgument("add_lora_cpu: a float32, float16 or bfloat16");
  const int64_t num_layers = ad[0], num_slots = ad[1], l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("add_lora_cpu: layer out of range");
  for (size_t t = 0; t < slots.element_count(); ++t)
    if (slots.typed_data()[t] < 0 || slots.typed_data()[t] >= num_slots)
      return ffi::Error::InvalidArgument("add_lora_cpu: slot out of range");
  int64_t r = 0, row_width = 0;
  int64_t cols[kMaxLoraParts];
  const void* b_data[kMaxLoraParts];
  for (int64_t p = 0; p < parts; ++p) {
    auto b = bs.get<ffi::AnyBuffer>(p);
    if (b.has_error()) return b.error();
    auto bd = b->dimensions();
    if (b->element_type() != type || bd.size() < 3 || bd[0] != num_layers || bd[1] != num_slots || bd[2] < 1 || (p > 0 && bd[2] != r))
      return ffi::Error::InvalidArgument("add_lora_cpu: each b [L, S, r, ...], typed as a");
    r = bd[2];
    const int64_t per_rank = static_cast<int64_t>(b->element_count()) / (num_layers * num_slots * r);
    if (per_rank % outer || (per_rank / outer) % kLanes)
      return ffi::Error::InvalidArgument("add_lora_cpu: each part's columns per outer index whole vectors");
    cols[p] = per_rank / outer;
    row_width += cols[p];
    b_data[p] = b->untyped_data();
  }
  const int64_t k_dim = xd[1], n = outer * row_width;
  if (k_dim % kLanes || r * parts > ad[2] || static_cast<int64_t>(y.element_count()) != xd[0] * n)
    return ffi::Error::InvalidArgument("add_lora_cpu: K whole vectors, Rw >= parts * r, y [T, outer * columns]");
  if (out->typed_data() != y.typed_data())
    std::copy(y.typed_data(), y.typed_data() + y.element_count(), out->typed_data());
  const Team team(pool);
  auto run = [&](auto* typed) {  // the weights' element type, by a null pointer of it
    using W = std::remove_pointer_t<decltype(typed)>;
    LoraWeights<W> w{static_cast<const W*>(a.untyped_data()), {}, k_dim, ad[2], r, outer, parts, {}};
    for (int64_t p = 0; p < parts; ++p) w.b[p] = static_cast<const W*>(b_data[p]), w.cols[p] = cols[p];
    AddLora(team, x.typed_data(), xd[0], slots.typed_data(), num_slots, l, w, out->typed_data());
  };
  if (type == ffi::F16)
    run(static_cast<Fp16*>(nullptr));
  else if (type == ffi::BF16)
    run(static_cast<Bf16*>(nullptr));
  else
    run(static_cast<float*>(nullptr));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddLoraCpu, LoraImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("outer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("packed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulCpu, QuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("int8_min_rows"));
