// The quantized weights' kernel of x @ w[layer] (quantized.py; cpu_kernel.cc's QuantizedMatmulCpu): x float32
// times int8 / 4-bit quants dequantized in registers. Included by cpu_kernel.cc alone, after float_panels.h
// (whose register tiles it multiplies dequantized panels with).
//
// A packed quantized layer is, per panel of kPanel columns, its quants [rows, kPanel] (int8: K rows; 4-bit:
// K / 2 rows of bytes, row 16 b + j holding k = 32 b + j in its low nibble and 32 b + 16 + j in its high one)
// and its float16 scales (and mins) [K / G, kPanel], each array panel-major like the float weights. Weight
// (k, c) of group g is d q (8-bit), d q + m (4-bit with mins) or d (q - 8) (4-bit without). Two regimes:
// - few rows (T <= kQuantStreamRows: a decode step): bound by reading the weights. Per panel and group,
//   sum_k x[r, k] q[k, c] accumulates in registers, the quants widened straight from memory, then folds
//   into y at the group's end:
//   y[r, c] += d[g, c] blk[r, c] + m[g, c] xsum[r, g] (m = -8 d without mins, no m term for 8-bit), with
//   xsum[r, g] the sum of x's row r over group g, computed once per call. One widened byte u of 4-bit
//   quants holds k's (u & 15) and k + 16's (u >> 4): converted as lo = u & 15 and u itself, x[k] lo +
//   x[k + 16] (u >> 4) = (x[k] - x[k + 16] / 16) lo + (x[k + 16] / 16) u, with x's row refolded that way
//   once per call (FoldNibblePairs): a shift fewer per 16 weights (q4_1 gate-up, one row, one thread: 103
//   -> 93 us). A panel's whole width is one tile where registers allow (kPanelVecs, one or two rows), else
//   half-panel strips of more rows.
// - more rows: each panel is dequantized into a thread-local float32 [K, kPanel] buffer (in L2) and
//   multiplied by the float32 register tiles above (PanelRows), which prefetch the next panel's quants as
//   PackedPanels' tiles prefetch its next panel: the dequantization is amortized over the rows, so from a few
//   dozen rows on it runs at the float32 packed kernel's rate.
// Panels are shared out by TeamSize as in PackedPanels, the weights counted at their float32 size: the
// dequantization is arithmetic a second core shares even for one row.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../cpu_simd.h"
#include "../cpu_team.h"
#include "float_panels.h"

namespace {

using jaxllm_simd::LoadHalf;
using jaxllm_simd::VecI;
using jaxllm_simd::WidenBytes;

// Up to this many rows of x: quants dequantized in registers. Measured on AVX2 (Zen 2, gate_up 576 x 3072, one
// thread): 1.6-1.9x faster than the dequantized panel at 2-4 rows, even at 6, 1.2x slower at 8.
constexpr int64_t kQuantStreamRows = 4;

// Quants as float32 (the bytes widened by cpu_simd.h's WidenBytes).
inline VecF WidenQ8(const int8_t* p) { return __builtin_convertvector(WidenBytes<true>(p), VecF); }
inline void WidenQ4Folded(const uint8_t* p, VecF& lo, VecF& whole) {  // u & 15 and u (see FoldNibblePairs)
  const VecI u = WidenBytes<false>(p);
  lo = __builtin_convertvector(u & 15, VecF);
  whole = __builtin_convertvector(u, VecF);
}

// The same without a conversion instruction, for DequantPanel: the float whose bits are 2^23's plus i is
// exactly 2^23 + i (0 <= i < 2^23), so an integer or / add and a float subtract give i exactly. The
// conversion (vcvtdq2ps) issues on one port of Zen 2's four, once a cycle.
constexpr int32_t kTwo23Bits = 0x4B000000;  // 2^23 as float32 bits
inline VecF WidenQ8Exact(const int8_t* p) {  // 2^23 + 128 + q, q in [-128, 128)
  return (VecF)(WidenBytes<true>(p) + (kTwo23Bits + 128)) - 8388736.f;
}
inline void WidenQ4Exact(const uint8_t* p, VecF& lo, VecF& hi) {
  const VecI u = WidenBytes<false>(p);
  lo = (VecF)((u & 15) | kTwo23Bits) - 8388608.f;
  hi = (VecF)((u >> 4) | kTwo23Bits) - 8388608.f;
}

// Registers a strip of VECS vectors of quants takes widened (4-bit: the low and the high nibbles), and the
// rows of x that fit beside it: accumulators, a broadcast or two of x and a temporary.
template <int BITS>
constexpr int QuantRowsFor(int vecs) {
  return std::max(0, std::min(8, (kVecRegs - (BITS == 4 ? 2 : 1) * vecs - 3) / vecs));
}
template <int BITS>
constexpr int kQuantWideRows = QuantRowsFor<BITS>(kPanelVecs);
template <int BITS>
constexpr int kQuantStripRows = QuantRowsFor<BITS>(kTileVecs);
static_assert(QuantRowsFor<4>(kTileVecs) > 0, "a half-panel strip fits the registers on every target");

// How far ahead a few-row quantized matmul prefetches: its quants kQuantAheadBytes ahead, a line every two
// rows of the panel as the strip reads them (past the panel's end: the next panel's, the same claim's next),
// and its scales and mins kQuantAhead groups ahead. The hardware prefetcher alone left the core stalled on
// memory. Gate-up `[1, 576] @ [576, 3072]`, 30 layers in a jitted scan, two threads, per call: q4_1 83 ->
// 70-72 us, int8 (one group of 576) 150 -> 87 us; 1, 2 and 4 KB ahead within a few percent.
constexpr int64_t kQuantAhead = 4;
constexpr int64_t kQuantAheadBytes = 4096;

struct QuantLayer {  // one packed layer
  const void* qs;
  const uint16_t* scales;
  const uint16_t* mins;  // null: none
  int64_t k_dim, group, n;
};

// Group g of the panel at `q` (its quants' first row for this group), columns [c, c + VECS * kLanes), rows
// [0, ROWS) of x (`ldx` apart, already at the group's first k): y[r, c + ...] += d blk + m xsum[r] (see above).
template <int ROWS, int VECS, int BITS, bool MIN>
inline void QuantStrip(const float* x, int64_t ldx, int64_t group, const void* q, int c, const uint16_t* d16,
                       const uint16_t* m16, const float* xsum, int64_t groups, float* y, int64_t ldy) {
  VecF acc[ROWS][VECS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = VecF{};
  if constexpr (BITS == 8) {
    const int8_t* qp = static_cast<const int8_t*>(q) + c;
    int64_t k = 0;
    for (; k + 2 <= group; k += 2) {
      if (c == 0) __builtin_prefetch(qp + k * kPanel + kQuantAheadBytes);  // one line: two rows of 32 columns
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        VecF w[VECS];
#pragma GCC unroll 8
        for (int v = 0; v < VECS; ++v) w[v] = WidenQ8(qp + (k + h) * kPanel + v * kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          const float a = x[r * ldx + k + h];
#pragma GCC unroll 8
          for (int v = 0; v < VECS; ++v) acc[r][v] += a * w[v];
        }
      }
    }
    if (k < group) {  // an odd group (int8, G = K)
      VecF w[VECS];
      for (int v = 0; v < VECS; ++v) w[v] = WidenQ8(qp + k * kPanel + v * kLanes);
      for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECS; ++v) acc[r][v] += x[r * ldx + k] * w[v];
    }
  } else {
    // One or two rows, where registers allow (AVX-512's 32): the low nibbles and the whole bytes accumulate apart,
    // two FMAs a vector on chains of their own instead of a multiply, an FMA and an add on one chain (q4_1 gate-up,
    // one thread, Zen 4: 74 -> 67.5 us one row, 117 -> 105 us two). Not for more rows (4 rows: 190 -> 231 us), nor
    // on AVX2's 16 registers for one row (Zen 2: spills, 93 -> 105 us; benchmarks/NOTES.md)
    constexpr bool kSplit = ROWS <= 2 && 2 * ROWS <= QuantRowsFor<4>(VECS);  // twice the accumulators fit
    VecF acc_whole[kSplit ? ROWS : 1][VECS];
#pragma GCC unroll 8
    for (int r = 0; r < (kSplit ? ROWS : 1); ++r)
      for (int v = 0; v < VECS; ++v) acc_whole[r][v] = VecF{};
    const uint8_t* qp = static_cast<const uint8_t*>(q) + c;
    for (int64_t b = 0; b < group; b += 32) {
      for (int j = 0; j < 16; ++j) {
        if (c == 0 && j % 2 == 0) __builtin_prefetch(qp + ((b >> 1) + j) * kPanel + kQuantAheadBytes);
        VecF lo[VECS], whole[VECS];
#pragma GCC unroll 8
        for (int v = 0; v < VECS; ++v) WidenQ4Folded(qp + ((b >> 1) + j) * kPanel + v * kLanes, lo[v], whole[v]);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {  // x folded: x[k] - x[k + 16] / 16 and x[k + 16] / 16
          const float a_lo = x[r * ldx + b + j], a_whole = x[r * ldx + b + 16 + j];
#pragma GCC unroll 8
          for (int v = 0; v < VECS; ++v) {
            if constexpr (kSplit) {
              acc[r][v] += a_lo * lo[v];
              acc_whole[r][v] += a_whole * whole[v];
            } else {
              acc[r][v] += a_lo * lo[v] + a_whole * whole[v];
            }
          }
        }
      }
    }
    if constexpr (kSplit)
      for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECS; ++v) acc[r][v] += acc_whole[r][v];
  }
#pragma GCC unroll 8
  for (int v = 0; v < VECS; ++v) {
    const VecF d = LoadHalf(d16 + c + v * kLanes);
    VecF m{};
    if constexpr (BITS == 4) m = MIN ? LoadHalf(m16 + c + v * kLanes) : -8.f * d;
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      float* o = y + r * ldy + c + v * kLanes;
      VecF out = Load(o) + d * acc[r][v];
      if constexpr (BITS == 4) out += m * xsum[r * groups];
      Store(o, out);
    }
  }
}

template <int ROWS, int VECS, int BITS, bool MIN>
void QuantStripRemainder(int rows, const float* x, int64_t ldx, int64_t group, const void* q, int c,
                         const uint16_t* d16, const uint16_t* m16, const float* xsum, int64_t groups, float* y,
                         int64_t ldy) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return QuantStrip<ROWS, VECS, BITS, MIN>(x, ldx, group, q, c, d16, m16, xsum, groups, y, ldy);
    QuantStripRemainder<ROWS - 1, VECS, BITS, MIN>(rows, x, ldx, group, q, c, d16, m16, xsum, groups, y, ldy);
  }
}

// x's rows [rows, K] as the 4-bit strips take them: per block of 32, k < 16 becomes x[k] - x[k + 16] / 16 and
// k + 16 becomes x[k + 16] / 16 (see the regimes above).
std::vector<float> FoldNibblePairs(const float* x, int64_t rows, int64_t k_dim) {
  std::vector<float> folded(rows * k_dim);
  for (int64_t b = 0; b < rows * k_dim; b += 32)
    for (int j = 0; j < 16; ++j) {
      const float whole = x[b + 16 + j] * (1.f / 16);
      folded[b + j] = x[b + j] - whole;
      folded[b + 16 + j] = whole;
    }
  return folded;
}

// y[0:rows, panel p's columns] = x @ panel p, dequantizing in registers (rows <= kQuantStreamRows); x folded
// (FoldNibblePairs) for 4-bit quants.
template <int BITS, bool MIN>
void QuantPanelStream(const float* xp, int64_t rows, const QuantLayer& w, int64_t p, const float* xsum, float* y) {
  const int64_t k_dim = w.k_dim, group = w.group, groups = k_dim / group;
  const int64_t q_rows = BITS == 4 ? k_dim / 2 : k_dim, q_group = BITS == 4 ? group / 2 : group;
  const auto* q = static_cast<const int8_t*>(w.qs) + p * q_rows * kPanel;
  const uint16_t* d16 = w.scales + p * groups * kPanel;
  const uint16_t* m16 = MIN ? w.mins + p * groups * kPanel : nullptr;
  float* yp = y + p * kPanel;
  for (int64_t r = 0; r < rows; ++r) std::memset(yp + r * w.n, 0, sizeof(float) * kPanel);
  for (int64_t g = 0; g < groups; ++g) {
    const void* qg = q + g * q_group * kPanel;
    const uint16_t* dg = d16 + g * kPanel;
    const uint16_t* mg = MIN ? m16 + g * kPanel : nullptr;
    // group g + kQuantAhead's scales and mins (the quants: in QuantStrip)
    __builtin_prefetch(dg + kQuantAhead * kPanel);
    if (MIN) __builtin_prefetch(mg + kQuantAhead * kPanel);
    if (rows <= kQuantWideRows<BITS>) {
      QuantStripRemainder<kQuantWideRows<BITS>, kPanelVecs, BITS, MIN>(static_cast<int>(rows), xp + g * group, k_dim,
                                                                       group, qg, 0, dg, mg, xsum + g, groups, yp, w.n);
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kQuantStripRows<BITS>) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kQuantStripRows<BITS>, rows - r0));
      for (int c = 0; c < kPanel; c += kTileCols)
        QuantStripRemainder<kQuantStripRows<BITS>, kTileVecs, BITS, MIN>(n_rows, xp + r0 * k_dim + g * group, k_dim,
                                                                         group, qg, c, dg, mg, xsum + r0 * groups + g,
                                                                         groups, yp + r0 * w.n, w.n);
    }
  }
}

// Panel p dequantized into `out` [K, kPanel] float32, the formulas in float32.
template <int BITS, bool MIN>
void DequantPanel(const QuantLayer& w, int64_t p, float* out) {
  const int64_t k_dim = w.k_dim, group = w.group, groups = k_dim / group;
  const int64_t q_rows = BITS == 4 ? k_dim / 2 : k_dim, q_group = BITS == 4 ? group / 2 : group;
  const auto* q = static_cast<const uint8_t*>(w.qs) + p * q_rows * kPanel;
  for (int64_t g = 0; g < groups; ++g) {
    VecF d[kPanelVecs], m[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) {
      d[v] = LoadHalf(w.scales + (p * groups + g) * kPanel + v * kLanes);
      m[v] = MIN ? LoadHalf(w.mins + (p * groups + g) * kPanel + v * kLanes) : -8.f * d[v];
    }
    const uint8_t* qg = q + g * q_group * kPanel;
    float* o = out + g * group * kPanel;
    if constexpr (BITS == 8) {
      for (int64_t k = 0; k < group; ++k)
        for (int v = 0; v < kPanelVecs; ++v)
          Store(o + k * kPanel + v * kLanes, d[v] * WidenQ8Exact(reinterpret_cast<const int8_t*>(qg) + k * kPanel + v * kLanes));
    } else {
      for (int64_t b = 0; b < group; b += 32)
        for (int j = 0; j < 16; ++j)
          for (int v = 0; v < kPanelVecs; ++v) {
            VecF lo, hi;
            WidenQ4Exact(qg + ((b >> 1) + j) * kPanel + v * kLanes, lo, hi);
            Store(o + (b + j) * kPanel + v * kLanes, d[v] * lo + m[v]);
            Store(o + (b + 16 + j) * kPanel + v * kLanes, d[v] * hi + m[v]);
          }
    }
  }
}

// The weights' size TeamSize weighs a quantized matmul by, per weight: the dequantization is arithmetic a
// second core shares even for one row, so a matrix counts as large from fewer bytes of quants (the default
// model's qkv, gate-up, down and head take the team, its o_proj (0.2 MB of quants) one thread: measured the faster).
constexpr int64_t kQuantTeamBytesPerWeight = 2;

template <int BITS, bool MIN>
void QuantPanels(const Team& team, const float* xp, int64_t rows, const QuantLayer& w, float* y) {
  const int64_t panels = w.n / kPanel, k_dim = w.k_dim, groups = k_dim / w.group;
  const bool stream = rows <= kQuantStreamRows;
  // sum of each row of x over each group (the min term), once per call
  std::vector<float> xsum(BITS == 4 && stream ? rows * groups : 0);
  for (size_t i = 0; i < xsum.size(); ++i) {
    const float* xg = xp + static_cast<int64_t>(i) * w.group;  // row i / groups, group i % groups
    float s = 0;
    for (int64_t k = 0; k < w.group; ++k) s += xg[k];
    xsum[i] = s;
  }
  const std::vector<float> folded = BITS == 4 && stream ? FoldNibblePairs(xp, rows, k_dim) : std::vector<float>();
  const int threads = TeamSize(team, rows, k_dim * w.n * kQuantTeamBytesPerWeight);
  const int64_t chunk = ChunkFor(panels, threads), tiles = (rows + kTileRows<float, float> - 1) / kTileRows<float, float>;
  const int64_t q_panel_bytes = (BITS == 4 ? k_dim / 2 : k_dim) * kPanel;
  team.ForEach(threads, panels, chunk, [&](int64_t p) {
    if (stream) return QuantPanelStream<BITS, MIN>(BITS == 4 ? folded.data() : xp, rows, w, p, xsum.data(), y);
    static thread_local std::vector<float> panel;  // reused across calls (see Panels)
    if (panel.size() < static_cast<size_t>(k_dim) * kPanel) panel.resize(static_cast<size_t>(k_dim) * kPanel);
    DequantPanel<BITS, MIN>(w, p, panel.data());
    // the next panel fetched into cache while this one's row tiles run, as PackedPanels does: its quants
    // spread over the tiles in units of a float panel row (kPanel floats, the unit Tile prefetches), its
    // scales and mins (a few lines) at once, before the tiles
    const bool has_next = NextInClaim(p, chunk, panels);
    const auto* next =
        has_next ? reinterpret_cast<const float*>(static_cast<const uint8_t*>(w.qs) + (p + 1) * q_panel_bytes) : nullptr;
    const int64_t units = q_panel_bytes / (kPanel * sizeof(float));
    for (int64_t i = 0; has_next && i < groups * kPanel; i += kPanel) {
      __builtin_prefetch(w.scales + (p + 1) * groups * kPanel + i);
      if (MIN) __builtin_prefetch(w.mins + (p + 1) * groups * kPanel + i);
    }
    for (int64_t r0 = 0, tile = 0; r0 < rows; r0 += kTileRows<float, float>, ++tile) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kTileRows<float, float>, rows - r0));
      const Ahead<float> ahead = TileShare(next, units, kPanel, tile, tiles);
      PanelRows(n_rows, xp + r0 * k_dim, k_dim, panel.data(), y + r0 * w.n + p * kPanel, w.n, ahead);
    }
  });
}

}  // namespace
