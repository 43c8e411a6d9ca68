// The quantized kernel's integer path (QuantMatmul with `int8_min_rows`): x quantized to int8 once per call, then
// multiplied by the quants with integer dot instructions (cpu_simd.h's DotBytes: vpdpbusd, pmaddubsw, sdot), as
// llama.cpp's CPU backend does. Float32 multiply-adds cap a compute-bound matmul (a batch of 64, a prefill
// chunk) at the float roof; one vpdpbusd does four times an FMA's multiply-adds. QuantMatmul, at the end, picks
// between this path and quant_panels.h's.
//
// - x: each row's blocks of 32 to int8, symmetric and round-to-nearest-even, with the block's scale a =
//   max|x| / 127 and s = a * (the sum of its int8 values), llama.cpp's Q8_1 (QuantizeRows; quantized.py's
//   quantize_rows is the same in numpy). Every panel and row strip reuses them.
// - w: each panel rearranged, per thread, into a buffer of "quads" (RepackPanel): the 4 quants of k = 4i .. 4i + 3
//   side by side per column, [K / 4, kPanel, 4] bytes, the order the dot instructions sum in; its float16
//   scales widened, and the min term's coefficients m' (the min; -8 d for Q4_0; minus kQ8Bias d for a biased
//   8-bit panel). Like DequantPanel's float panel, amortized over the rows, and one copy of the weights stays in
//   memory: nothing new is packed at load.
// - per block b of 32 k and group g: y[r, c] += a[r, b] d[g, c] I[r, c, b] + s[r, b] m'[g, c], with I the exact
//   int32 dot of the block (at most 32 * 255 * 127 in magnitude).
// Register tiles: kIntRows rows by kTileVecs vectors of columns, float accumulators over K and int32 ones per block.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../cpu_simd.h"
#include "../cpu_team.h"
#include "float_panels.h"
#include "quant_panels.h"

namespace {

using jaxllm_simd::DotBytes;
using jaxllm_simd::DotNibbles;
using jaxllm_simd::FinishNibbleDots;
using jaxllm_simd::kNibbleSteps;
using jaxllm_simd::kQ8Bias;
using jaxllm_simd::kQ8Symmetric;
using jaxllm_simd::kVecBytes;
using jaxllm_simd::Bytes16;
using jaxllm_simd::Load16;
using jaxllm_simd::Quads4x16;
using jaxllm_simd::QuadsOf4Rows;
using jaxllm_simd::RoundToInt;
using jaxllm_simd::kQuadsInRegisters;

constexpr int64_t kQ8Block = 32;  // x's values per scale
// Up to this many rows the integer path streams the weights where quads fit registers (IntStreamPanels, in groups
// of kQuantStreamRows rows against each panel), past it each panel is repacked once for its row tiles (IntPanels).
// The default model's 30 Q4_1 layers and Q8_0 head, two threads, Zen 4 (median ms, streamed vs repacked): 5 rows
// 7.3-9.3 vs 12.9-15.9, 8 rows 9.3-9.8 vs 15.7-20.1, 16 rows 12.8-15.6 vs 18.6-21.3, 32 rows 25.5-27.6 vs 30-35.7,
// 64 rows even (benchmarks/NOTES.md).
constexpr int64_t kIntStreamRows = 32;

struct QuantizedRows {  // x as llama.cpp's Q8_1 blocks, [rows, K] and [rows, K / 32]
  std::vector<int8_t> q;
  std::vector<float> a;  // the block's scale
  std::vector<float> s;  // a times the sum of the block's q
};

// x's rows [rows, K] as int8 blocks, the rows shared out over the team (a row of K = 1536 takes about a microsecond).
QuantizedRows QuantizeRows(const Team& team, const float* x, int64_t rows, int64_t k_dim) {
  typedef int8_t VecB __attribute__((vector_size(kLanes)));
  constexpr int kVecs = kQ8Block / kLanes;
  const int64_t blocks_per_row = k_dim / kQ8Block;
  QuantizedRows out{std::vector<int8_t>(rows * k_dim), std::vector<float>(rows * blocks_per_row),
                    std::vector<float>(rows * blocks_per_row)};
  const int threads = rows >= 16 ? team.max_threads() : 1;
  team.ForEach(threads, rows, ChunkFor(rows, threads), [&](int64_t row) {
    for (int64_t b = row * blocks_per_row; b < (row + 1) * blocks_per_row; ++b) {
      VecF v[kVecs];
      VecF amax{};
      for (int i = 0; i < kVecs; ++i) {
        v[i] = Load(x + b * kQ8Block + i * kLanes);
        const VecF magnitude = (VecF)((VecU)v[i] & 0x7fffffffu);
        amax = amax > magnitude ? amax : magnitude;
      }
      float m = 0;
      for (int l = 0; l < kLanes; ++l) m = std::max(m, amax[l]);
      const float inv = m > 0 ? 127.f / m : 0.f;
      VecI sum{};
      for (int i = 0; i < kVecs; ++i) {
        const VecI q = RoundToInt(v[i] * inv);
        sum += q;
        const VecB narrow = __builtin_convertvector(q, VecB);
        std::memcpy(out.q.data() + b * kQ8Block + i * kLanes, &narrow, sizeof narrow);
      }
      int32_t total = 0;
      for (int l = 0; l < kLanes; ++l) total += sum[l];
      out.a[b] = m / 127.f;
      out.s[b] = out.a[b] * static_cast<float>(total);
    }
  });
  return out;
}

inline void Store16(uint8_t* p, Bytes16 v) { std::memcpy(p, &v, sizeof v); }

// 8-bit quants (any vector of bytes) as the dot instructions take them: plus kQ8Bias, and -128 read as -127 where
// the sign trick needs it.
template <class V>
inline V StoredQ8(V v) {
  typedef uint8_t U8 __attribute__((vector_size(sizeof(V))));
  U8 u = (U8)v;
  if constexpr (kQ8Symmetric) u = u == 0x80 ? U8{} + 0x81 : u;
  return (V)(u ^ static_cast<uint8_t>(kQ8Bias));
}

// Rows r0 .. r3 of a panel's quants (kPanel bytes each, `ld` apart), each byte through `f`, as 32 quads:
// out[4 c + j] = f(r_j[c]).
template <class F>
inline void InterleaveQuads(const uint8_t* src, int64_t ld, uint8_t* out, F f) {
  for (int h = 0; h < 2; ++h) {
    Bytes16 quads[4];
    Quads4x16(f(Load16(src + h * 16)), f(Load16(src + ld + h * 16)), f(Load16(src + 2 * ld + h * 16)),
              f(Load16(src + 3 * ld + h * 16)), quads);
    // stored one by one: gathered into one 64-byte store, they missed store forwarding (half the repack's time)
    for (int t = 0; t < 4; ++t) Store16(out + h * 64 + 16 * t, quads[t]);
  }
}

struct IntPanel {  // one panel as the integer tiles read it (see the top)
  std::vector<uint8_t> quads;  // [K / 4, kPanel, 4]
  std::vector<float> d, m;     // [groups, kPanel]
};

template <int BITS, bool MIN>
void RepackPanel(const QuantLayer& w, int64_t p, IntPanel& out) {
  const int64_t k_dim = w.k_dim, groups = k_dim / w.group, q_rows = BITS == 4 ? k_dim / 2 : k_dim;
  out.quads.resize(k_dim * kPanel);
  out.d.resize(groups * kPanel);
  out.m.resize(groups * kPanel);
  const auto* q = static_cast<const uint8_t*>(w.qs) + p * q_rows * kPanel;
  constexpr int64_t kQuad = 4 * kPanel;
  if constexpr (BITS == 8) {
    for (int64_t i = 0; i < k_dim / 4; ++i)
      InterleaveQuads(q + 4 * i * kPanel, kPanel, out.quads.data() + i * kQuad, StoredQ8<Bytes16>);
  } else {  // byte row 16 b + j holds k = 32 b + j (low nibble) and 32 b + 16 + j (high): quads 8 b + i and 8 b + 4 + i
    const auto low = [](Bytes16 v) { return v & 15; };
    const auto high = [](Bytes16 v) { return v >> 4; };
    for (int64_t b = 0; b < k_dim / 32; ++b)
      for (int64_t i = 0; i < 4; ++i) {
        const uint8_t* rows = q + (16 * b + 4 * i) * kPanel;
        InterleaveQuads(rows, kPanel, out.quads.data() + (8 * b + i) * kQuad, low);
        InterleaveQuads(rows, kPanel, out.quads.data() + (8 * b + 4 + i) * kQuad, high);
      }
  }
  const int64_t s0 = p * groups * kPanel;
  for (int64_t i = 0; i < groups * kPanel; i += kLanes) {
    const VecF d = LoadHalf(w.scales + s0 + i);
    VecF m = MIN ? LoadHalf(w.mins + s0 + i) : VecF{};
    if constexpr (BITS == 4 && !MIN) m = -8.f * d;
    if constexpr (BITS == 8) m = -static_cast<float>(kQ8Bias) * d;
    Store(out.d.data() + i, d);
    Store(out.m.data() + i, m);
  }
}

// Rows that fit the registers beside a strip of kTileVecs vectors: float and int32 accumulators, the quads and x.
// At least 4: the float accumulators are touched once a block, so the compiler may spill them at little cost, while
// a tile of 2 rows (16 registers) reloads the quads for every pair of rows (measured on AVX2, the default model's
// layer chain at 64 rows, with the int16 block sums: 2.5 -> 2.2 ms; 6 rows no better).
constexpr int kIntRows = std::max(4, std::min(8, (kVecRegs - kTileVecs - 3) / (2 * kTileVecs)));

// Blocks of 32 k a strip runs through at a time: 16 KB of a panel's quads, which stay in L1 while every row strip
// of the panel reads them (a whole down_proj panel, K = 1536, is 48 KB: 1.35x the float path at 64 rows, 1.6x so).
constexpr int64_t kIntSpanBlocks = 16;

struct IntOperands {  // what every strip of one panel reads
  const QuantizedRows& xq;
  const IntPanel& pw;
  int64_t k_dim, group;
};

// y[0:ROWS, c0 + kTileCols) of the panel += (or, from block 0, =) x's quantized rows from `x_row` on times its
// blocks [b0, b1).
template <int ROWS, int BITS>
void IntStrip(const IntOperands& o, int64_t x_row, int c0, int64_t b0, int64_t b1, float* y, int64_t ldy) {
  const int64_t blocks = o.k_dim / kQ8Block, per_group = o.group / kQ8Block;
  VecF acc[ROWS][kTileVecs];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = b0 ? Load(y + r * ldy + c0 + v * kLanes) : VecF{};
  for (int64_t b = b0; b < b1; ++b) {
    VecI dots[ROWS][kTileVecs];
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < kTileVecs; ++v) dots[r][v] = VecI{};
    const uint8_t* wb = o.pw.quads.data() + (b * 8 * kPanel + c0) * 4;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      VecI w[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) std::memcpy(&w[v], wb + j * 4 * kPanel + v * kVecBytes, sizeof w[v]);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        int32_t x4;
        std::memcpy(&x4, o.xq.q.data() + (x_row + r) * o.k_dim + b * kQ8Block + 4 * j, sizeof x4);
        const VecI xs = VecI{} + x4;
        for (int v = 0; v < kTileVecs; ++v)
          dots[r][v] = BITS == 4 ? DotNibbles(dots[r][v], w[v], xs) : DotBytes<BITS>(dots[r][v], w[v], xs);
      }
    }
    static_assert(kNibbleSteps >= 8, "a block's 8 steps of 4-bit dots summed in int16");
    if constexpr (BITS == 4)
      for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < kTileVecs; ++v) dots[r][v] = FinishNibbleDots(dots[r][v]);
    const int64_t g = b / per_group;
    VecF d[kTileVecs], m[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) {
      d[v] = Load(o.pw.d.data() + g * kPanel + c0 + v * kLanes);
      m[v] = Load(o.pw.m.data() + g * kPanel + c0 + v * kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const float a = o.xq.a[(x_row + r) * blocks + b], s = o.xq.s[(x_row + r) * blocks + b];
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] += __builtin_convertvector(dots[r][v], VecF) * (d[v] * a) + m[v] * s;
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < kTileVecs; ++v) Store(y + r * ldy + c0 + v * kLanes, acc[r][v]);
}

template <int ROWS, int BITS>
void IntStripRemainder(int rows, const IntOperands& o, int64_t x_row, int c0, int64_t b0, int64_t b1, float* y,
                       int64_t ldy) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return IntStrip<ROWS, BITS>(o, x_row, c0, b0, b1, y, ldy);
    IntStripRemainder<ROWS - 1, BITS>(rows, o, x_row, c0, b0, b1, y, ldy);
  }
}

template <int BITS, bool MIN>
void IntPanels(const Team& team, const float* xp, int64_t rows, const QuantLayer& w, float* y) {
  const QuantizedRows xq = QuantizeRows(team, xp, rows, w.k_dim);
  const int64_t panels = w.n / kPanel, blocks = w.k_dim / kQ8Block;
  const int threads = TeamSize(team, rows, w.k_dim * w.n * kQuantTeamBytesPerWeight);
  team.ForEach(threads, panels, ChunkFor(panels, threads), [&](int64_t p) {
    static thread_local IntPanel panel;  // reused across calls, as QuantPanels' float panel
    RepackPanel<BITS, MIN>(w, p, panel);
    const IntOperands o{xq, panel, w.k_dim, w.group};
    for (int64_t b0 = 0; b0 < blocks; b0 += kIntSpanBlocks) {
      const int64_t b1 = std::min(blocks, b0 + kIntSpanBlocks);
      for (int64_t r0 = 0; r0 < rows; r0 += kIntRows) {
        const int n_rows = static_cast<int>(std::min<int64_t>(kIntRows, rows - r0));
        for (int c = 0; c < kPanel; c += kTileCols)
          IntStripRemainder<kIntRows, BITS>(n_rows, o, r0, c, b0, b1, y + r0 * w.n + p * kPanel, w.n);
      }
    }
  });
}

// The few-row regime (a decode step, a verification of drafts) on the integer path, where the target arranges quads
// in registers: bound by reading the weights, so each panel's quants are read from memory once, arranged into quads
// as they arrive (no buffer) and multiplied by x's int8 blocks of up to kQuantStreamRows rows, where the
// float-activation strips widen and convert every quant; further groups of rows find the panel in L1 / L2. 4-bit
// quants: byte rows 16 b + 4 i .. + 3 hold k = 32 b + 4 i + j (low nibbles) and + 16 (high), split by a mask and a
// shift; 8-bit ones: byte rows 32 b + 4 i .. + 3, k = 32 b + 4 i + j, biased as StoredQ8 says.
template <int ROWS, int BITS, bool MIN>
void IntStreamPanel(const QuantizedRows& xq, int64_t x_row, const QuantLayer& w, int64_t p, float* y) {
  constexpr int kV = 4 * kPanel / kVecBytes;  // vectors of a panel's quads of 4 k
  constexpr int kSteps = BITS == 4 ? 4 : 8;   // loads of 4 byte rows per block of 32 k
  const int64_t k_dim = w.k_dim, blocks = k_dim / kQ8Block, groups = k_dim / w.group, per_group = w.group / kQ8Block;
  const uint8_t* q = static_cast<const uint8_t*>(w.qs) + p * (k_dim * BITS / 8) * kPanel;
  VecF acc[ROWS][kV] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    VecI dots[ROWS][kV] = {};
#pragma GCC unroll 8
    for (int i = 0; i < kSteps; ++i) {
      const uint8_t* rows = q + (kQ8Block * BITS / 8 * b + 4 * i) * kPanel;
      __builtin_prefetch(rows + kQuantAheadBytes);
      __builtin_prefetch(rows + kQuantAheadBytes + 64);
      VecI quads[kV];
      QuadsOf4Rows(rows, quads);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        int32_t lo4;
        std::memcpy(&lo4, xq.q.data() + (x_row + r) * k_dim + b * kQ8Block + 4 * i, sizeof lo4);
        const VecI xlo = VecI{} + lo4;
        if constexpr (BITS == 4) {
          int32_t hi4;
          std::memcpy(&hi4, xq.q.data() + (x_row + r) * k_dim + b * kQ8Block + 16 + 4 * i, sizeof hi4);
          const VecI xhi = VecI{} + hi4;
          for (int v = 0; v < kV; ++v) {
            dots[r][v] = DotNibbles(dots[r][v], quads[v] & 0x0f0f0f0f, xlo);
            dots[r][v] = DotNibbles(dots[r][v], (quads[v] >> 4) & 0x0f0f0f0f, xhi);
          }
        } else {
          for (int v = 0; v < kV; ++v) dots[r][v] = DotBytes<8>(dots[r][v], StoredQ8(quads[v]), xlo);
        }
      }
    }
    if constexpr (BITS == 4)
      for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < kV; ++v) dots[r][v] = FinishNibbleDots(dots[r][v]);  // 8 steps: whole in int16
    const int64_t s = (p * groups + b / per_group) * kPanel;
#pragma GCC unroll 8
    for (int v = 0; v < kV; ++v) {
      const VecF d = LoadHalf(w.scales + s + v * kLanes);
      VecF m{};  // the 4-bit min term's coefficient (8-bit: the bias's, written out below)
      if constexpr (BITS == 4) m = MIN ? LoadHalf(w.mins + s + v * kLanes) : -8.f * d;
      for (int r = 0; r < ROWS; ++r) {
        const float a = xq.a[(x_row + r) * blocks + b], sum = xq.s[(x_row + r) * blocks + b];
        // 8-bit: d factored out of the bias's term as written, where -ffast-math did so for one row and not for
        // more: a row's result must not depend on the rows beside it (drafts verified as one-row steps score)
        if constexpr (BITS == 8)
          acc[r][v] += d * (__builtin_convertvector(dots[r][v], VecF) * a - static_cast<float>(kQ8Bias) * sum);
        else
          acc[r][v] += __builtin_convertvector(dots[r][v], VecF) * (d * a) + m * sum;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < kV; ++v) Store(y + r * w.n + p * kPanel + v * kLanes, acc[r][v]);
}

template <int ROWS, int BITS, bool MIN>
void IntStreamRemainder(int rows, const QuantizedRows& xq, int64_t x_row, const QuantLayer& w, int64_t p, float* y) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return IntStreamPanel<ROWS, BITS, MIN>(xq, x_row, w, p, y + x_row * w.n);
    IntStreamRemainder<ROWS - 1, BITS, MIN>(rows, xq, x_row, w, p, y);
  }
}

template <int BITS, bool MIN>
void IntStreamPanels(const Team& team, const float* xp, int64_t rows, const QuantLayer& w, float* y) {
  const QuantizedRows xq = QuantizeRows(team, xp, rows, w.k_dim);
  const int64_t panels = w.n / kPanel;
  const int threads = TeamSize(team, rows, w.k_dim * w.n * kQuantTeamBytesPerWeight);
  team.ForEach(threads, panels, ChunkFor(panels, threads), [&](int64_t p) {
    // groups of kQuantStreamRows rows: the first reads the panel from memory, the others find it in L1 / L2
    for (int64_t r0 = 0; r0 < rows; r0 += kQuantStreamRows) {
      const int n_rows = static_cast<int>(std::min(kQuantStreamRows, rows - r0));
      IntStreamRemainder<kQuantStreamRows, BITS, MIN>(n_rows, xq, r0, w, p, y);
    }
  });
}

// y = x @ w: the integer path from `int8_min_rows` rows of x on (0: never; in the few-row regime only where the
// target arranges quads in registers), else quant_panels.h's.
void QuantMatmul(const Team& team, const float* xp, int64_t rows, const QuantLayer& w, int bits, float* y,
                 int64_t int8_min_rows = 0) {
  const bool integer = int8_min_rows > 0 && rows >= int8_min_rows && w.k_dim % kQ8Block == 0;
  if (integer && rows <= kIntStreamRows && kQuadsInRegisters) {
    if (bits == 8) return IntStreamPanels<8, false>(team, xp, rows, w, y);
    if (w.mins) return IntStreamPanels<4, true>(team, xp, rows, w, y);
    return IntStreamPanels<4, false>(team, xp, rows, w, y);
  }
  if (integer && rows > kQuantStreamRows) {
    if (bits == 8) return IntPanels<8, false>(team, xp, rows, w, y);
    if (w.mins) return IntPanels<4, true>(team, xp, rows, w, y);
    return IntPanels<4, false>(team, xp, rows, w, y);
  }
  if (bits == 8) return QuantPanels<8, false>(team, xp, rows, w, y);
  if (w.mins) return QuantPanels<4, true>(team, xp, rows, w, y);
  QuantPanels<4, false>(team, xp, rows, w, y);
}

}  // namespace
