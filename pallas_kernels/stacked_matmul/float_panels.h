// The float weights' kernel of x @ w[layer] (cpu_kernel.cc's StackedMatmulCpu): float32 weights as they
// are stacked, or packed ahead of time in float32 or bfloat16. Included by cpu_kernel.cc alone (one
// translation unit per kernel, cpu_ffi.py): its definitions stay internal to the kernel, as before the split.
//
// x [T, K] float32, w [L, K, N...] float32 (trailing dims flattened to N), out [T, N] float32. Two regimes:
// - few rows (decode of a tiny batch, T <= kStreamRows): bound by reading the weights. One
//   thread streams w's rows front to back (whole rows: the hardware prefetcher follows them),
//   accumulating T output rows.
// - more rows: bound by arithmetic. N is split into panels of kPanel columns, shared out among
//   threads from kMinTeamRows rows of x or kMinTeamBytes of weights (see TeamSize); a panel's
//   K x kPanel weights are copied once into a contiguous buffer that stays in L2 (read straight
//   from w, K rows kPanel floats apart by N floats, they would all fall into a few cache sets),
//   then every register tile (rows of x by columns of the panel, sized for the target's registers:
//   cpu_simd.h, kTileRows) is multiplied against it with its outputs held in registers: one
//   broadcast of x and a vector FMA per (row, k, vector). The next panel's rows are prefetched
//   while the tiles run (measured 3-13 % faster from 8 to 128 rows).
// Weights packed ahead of time (`pack` in __init__.py) skip the panel copy, in float32 or in
// bfloat16: the bfloat16 tile multiplies pairs of K with one dot-product instruction where the CPU
// has it (vdpbf16ps: x bfloat16 too, twice the float32 FMA rate), else widens the pairs in
// registers (x widened once); both accumulate in float32. This is the engine's path at every row
// count (a pure-Python self-check, pallas_kernels/cpu_choice.py, hands row counts where XLA's dot
// is faster to XLA).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../cpu_simd.h"
#include "../cpu_team.h"

namespace {

using jaxllm_simd::kLanes;
using jaxllm_simd::kVecRegs;
using jaxllm_simd::Load;
using jaxllm_simd::LoadU;
using jaxllm_simd::Store;
using jaxllm_simd::VecF;
using jaxllm_simd::VecU;
using jaxllm_team::Team;

// Fewer rows of x than this, and a small matrix (kMinTeamBytes): one thread. Such a matmul is bound by
// reading the weights, and a helper task (cpu_team.h) costs more than it saves on it. From 16 rows up
// the arithmetic pays for the team.
constexpr int64_t kMinTeamRows = 16;
constexpr int64_t kStreamRows = 4;  // up to this many rows of x: the streaming regime (measured crossover)
constexpr int64_t kPanel = 32;      // columns of w per packed panel, on every target (PANEL in __init__.py)

// A register tile is kTileRows rows of x by kTileVecs vectors of columns (kTileCols), its outputs held
// in kTileRows x kTileVecs accumulators; a panel is kPanel / kTileCols such tiles side by side. Rows
// fill the registers left after the panel's row (kTileVecs vectors, two of them per vector for
// bfloat16 widened in registers) and a broadcast of x, at most 8: AVX-512 8 x 32 columns (16
// accumulators), AVX2 6 x 16 (12: the 6x16 float32 kernel of BLIS and llama.cpp), NEON 8 x 8.
// One or two rows of x (a decode of one or two sequences) take the panel's whole width in one tile
// (kPanelVecs vectors) where registers allow (kWideRows), so that the weights stream through in
// address order rather than in two interleaved halves.
constexpr int kTileVecs = 2;
constexpr int kTileCols = kTileVecs * kLanes;
constexpr int kPanelVecs = kPanel / kLanes;
static_assert(kPanel % kTileCols == 0, "a panel is whole tiles");
// bfloat16 weights take twice the registers where they are widened (no bfloat16 dot product)
template <typename X, typename W>
constexpr int kWeightRegsPerVec = sizeof(W) == 2 && std::is_same_v<X, float> ? 2 : 1;
template <typename X, typename W>
constexpr int RowsFor(int vecs) {
  return std::max(0, std::min(8, (kVecRegs - kWeightRegsPerVec<X, W> * vecs - 2) / vecs));
}
template <typename X, typename W>
constexpr int kTileRows = RowsFor<X, W>(kTileVecs);
template <typename X, typename W>
constexpr int kWideRows = kPanelVecs > kTileVecs ? std::min(2, RowsFor<X, W>(kPanelVecs)) : 0;

// How many threads for a matmul of `rows` rows of x reading `bytes` of weights: few rows and a small
// matrix, one (see kMinTeamRows); a larger matrix (qkv, the MLP, the LM head) is streamed by the team
// even for one row: one core reads memory at about half what two do on some machines (16.8 against
// 30 GB/s on a 2-core Zen 2). Measured there, the default model's T=1 float32 matmul chain: 47.9 ms with
// one thread, 28.2 ms from 2 MB up, 26.4 ms from 1 MB up (o_proj's 1.3 MB shared: 107 -> 63 us a call, the
// float32 model's batch 1 38-38.5 -> 39-40 tok/s); every matrix shared (no threshold) made the Q4_1 model's
// batch 1 slower, 97-101 against 104-114 tok/s (a helper for a 0.2 MB matrix costs more than it saves).
constexpr int64_t kMinTeamBytes = int64_t{1} << 20;
int TeamSize(const Team& team, int64_t rows, int64_t bytes) {
  return rows < kMinTeamRows && bytes < kMinTeamBytes ? 1 : team.max_threads();
}
// Items (panels) per claim: a few claims per thread, so that one that starts late still takes a share.
int64_t ChunkFor(int64_t items, int threads) { return std::max<int64_t>(1, items / (4 * threads)); }

// One step of k of a register tile: x's ROWS rows at this k (`x`, rows `ldx` apart) times the panel's
// row b (the tile's kTileCols columns), added to each row's accumulators. Float32 weights: x float32.
template <int ROWS, int VECS>
__attribute__((always_inline)) inline void Step(const float* x, int64_t ldx, const float* b, VecF (*acc)[VECS]) {
  VecF bv[VECS];
#pragma GCC unroll 8
  for (int v = 0; v < VECS; ++v) bv[v] = Load(b + v * kLanes);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    const float a = x[r * ldx];
#pragma GCC unroll 8
    for (int v = 0; v < VECS; ++v) acc[r][v] += a * bv[v];
  }
}

// bfloat16 weights: the panel's row b holds pairs of K ([columns, 2]), so one step covers two of K.
// Same outputs as the float32 step on the bfloat16 values, to float32 rounding.
// With a bfloat16 dot product (cpu_simd.h: kBf16Dot): x holds each row's K as pairs too (one 32-bit word: k
// even in the low half, odd in the high half), multiplied pair by pair.
template <int ROWS, int VECS>
__attribute__((always_inline)) inline void Step(const uint32_t* x, int64_t ldx, const uint16_t* b,
                                                VecF (*acc)[VECS]) {
  jaxllm_simd::VecBf16Pairs bv[VECS];
  for (int v = 0; v < VECS; ++v) bv[v] = jaxllm_simd::LoadBf16Pairs(b + v * 2 * kLanes);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    const jaxllm_simd::VecBf16Pairs a = jaxllm_simd::SplatBf16Pair(x[r * ldx]);
    for (int v = 0; v < VECS; ++v) acc[r][v] = jaxllm_simd::DotBf16Pairs(acc[r][v], a, bv[v]);
  }
}
// Without it: x widened to float32 beforehand (Bf16Rows), the weights widened in registers (a
// bfloat16 is the top half of a float32: the even of a pair shifted up, the odd masked), then
// two FMAs per pair.
template <int ROWS, int VECS>
__attribute__((always_inline)) inline void Step(const float* x, int64_t ldx, const uint16_t* b,
                                                VecF (*acc)[VECS]) {
  VecF even[VECS], odd[VECS];
#pragma GCC unroll 8
  for (int v = 0; v < VECS; ++v) {
    const VecU u = LoadU(b + v * 2 * kLanes);
    even[v] = (VecF)(u << 16);
    odd[v] = (VecF)(u & 0xffff0000u);
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    const float a_even = x[r * ldx], a_odd = x[r * ldx + 1];
#pragma GCC unroll 8
    for (int v = 0; v < VECS; ++v) acc[r][v] += a_even * even[v] + a_odd * odd[v];
  }
}
using Bf16X = std::conditional_t<jaxllm_simd::kBf16Dot, uint32_t, float>;  // what the bfloat16 tile reads x as

// Per step of k, in elements: of a panel's row (128 bytes: kPanel floats or kPanel pairs of
// bfloat16), of one column in it, and of a row of x.
template <typename X, typename W>
constexpr int64_t kRowElems = kPanel * (sizeof(W) == 2 ? 2 : 1);
template <typename X, typename W>
constexpr int64_t kColElems = sizeof(W) == 2 ? 2 : 1;
template <typename X, typename W>
constexpr int64_t kXElems = sizeof(W) == 2 && std::is_same_v<X, float> ? 2 : 1;  // widened bfloat16 pairs

// Rows of the next panel to fetch into cache while a tile runs: `count` rows `stride` elements apart
// from `first`, spread evenly over the tile's steps of k (a burst of them stalls on the core's few
// outstanding misses; spread out, the weights arrive from memory while the tile computes).
template <typename W>
struct Ahead {
  const W* first = nullptr;
  int64_t count = 0, stride = 0;
};

// Whether panel p + 1 is the same claim's next (ChunkFor's claims: `chunk` panels in a row), the one to prefetch.
inline bool NextInClaim(int64_t p, int64_t chunk, int64_t panels) { return (p + 1) % chunk && p + 1 < panels; }

// Row tile `tile` of `tiles`'s share of the next panel (`units` rows `stride` elements apart from `next`; null:
// none): each tile prefetches its share (the first tile's reads come from memory, the others' from cache: spread
// over all of them, the next panel is in cache when its first tile starts).
template <typename W>
Ahead<W> TileShare(const W* next, int64_t units, int64_t stride, int64_t tile, int64_t tiles) {
  if (!next) return {};
  const int64_t lo = units * tile / tiles, hi = units * (tile + 1) / tiles;
  return {next + lo * stride, hi - lo, stride};
}

// y[r, 0:kTileCols] = x[r, :] @ tile for r < ROWS; `tile` is a panel's columns [c, c + kTileCols), its
// `k_steps` rows kRowElems apart; x's rows are `ldx` elements apart; `ahead` is prefetched on the way.
template <int ROWS, int VECS, typename X, typename W>
inline void Tile(const X* x, int64_t ldx, int64_t k_steps, const W* tile, float* y, int64_t ldy, Ahead<W> ahead) {
  VecF acc[ROWS][VECS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = VecF{};
  const int64_t every = ahead.count ? std::max<int64_t>(1, k_steps / ahead.count) : 0;
  int64_t fetched = 0, fetch_at = 0;
  for (int64_t k = 0; k < k_steps; ++k) {
    if (k == fetch_at && fetched < ahead.count) {
      const char* row = reinterpret_cast<const char*>(ahead.first + fetched++ * ahead.stride);
      __builtin_prefetch(row);
      __builtin_prefetch(row + 64);
      fetch_at += every;
    }
    Step<ROWS, VECS>(x + k * kXElems<X, W>, ldx, tile + k * kRowElems<X, W>, acc);
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) Store(y + r * ldy + v * kLanes, acc[r][v]);
}

template <int ROWS, int VECS, typename X, typename W>
void TileRemainder(int rows, const X* x, int64_t ldx, int64_t k_steps, const W* tile, float* y, int64_t ldy,
                   Ahead<W> ahead) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return Tile<ROWS, VECS, X, W>(x, ldx, k_steps, tile, y, ldy, ahead);
    TileRemainder<ROWS - 1, VECS, X, W>(rows, x, ldx, k_steps, tile, y, ldy, ahead);
  }
}

// y[0:rows, 0:kPanel] = x[0:rows] @ panel (rows <= kTileRows<X, W>), tile by tile across the panel;
// the first tile prefetches `ahead`.
template <typename X, typename W>
inline void PanelRows(int rows, const X* x, int64_t k_steps, const W* panel, float* y, int64_t ldy, Ahead<W> ahead) {
  const int64_t ldx = k_steps * kXElems<X, W>;
  if (rows <= kWideRows<X, W>)
    return TileRemainder<kWideRows<X, W>, kPanelVecs>(rows, x, ldx, k_steps, panel, y, ldy, ahead);
  for (int c = 0; c < kPanel; c += kTileCols) {
    TileRemainder<kTileRows<X, W>, kTileVecs>(rows, x, ldx, k_steps, panel + c * kColElems<X, W>, y + c, ldy, ahead);
    ahead = {};
  }
}

// One thread (rows < kMinTeamRows): streams w's rows front to back, x's rows accumulated side by side.
void Stream(const float* xp, int64_t rows, int64_t k_dim, const float* wl, int64_t n, float* y) {
  static_assert(kStreamRows < kMinTeamRows, "the streaming regime runs on one thread");
  std::memset(y, 0, sizeof(float) * rows * n);
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* wrow = wl + k * n;
    for (int64_t t = 0; t < rows; ++t) {
      const float a = xp[t * k_dim + k];
      float* o = y + t * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] += a * wrow[c];
    }
  }
}

void Panels(const Team& team, const float* xp, int64_t rows, int64_t k_dim, const float* wl, int64_t n, float* y) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int threads = TeamSize(team, rows, k_dim * n * static_cast<int64_t>(sizeof(float)));
  team.ForEach(threads, panels, ChunkFor(panels, threads), [&](int64_t p) {
    // reused across calls: allocated per call, a down_proj panel (196 KB) is above malloc's mmap
    // threshold and every call would map it and page-fault on it afresh
    static thread_local std::vector<float> panel;
    if (panel.size() < static_cast<size_t>(k_dim) * kPanel) panel.resize(static_cast<size_t>(k_dim) * kPanel);
    float edge[kTileRows<float, float> * kPanel];  // a last panel narrower than kPanel is computed here, then copied out
    const int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
    for (int64_t k = 0; k < k_dim; ++k) std::memcpy(panel.data() + k * kPanel, wl + k * n + c0, sizeof(float) * cols);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows<float, float>) {
      const int tile = static_cast<int>(std::min<int64_t>(kTileRows<float, float>, rows - r0));
      const float* x = xp + r0 * k_dim;
      // the next panel's rows, straight from w, while the first tile runs
      const Ahead<float> ahead = r0 == 0 && c0 + kPanel < n ? Ahead<float>{wl + c0 + kPanel, k_dim, n} : Ahead<float>{};
      if (cols == kPanel) {
        PanelRows(tile, x, k_dim, panel.data(), y + r0 * n + c0, n, ahead);
      } else {
        PanelRows(tile, x, k_dim, panel.data(), edge, kPanel, ahead);
        for (int r = 0; r < tile; ++r) std::memcpy(y + (r0 + r) * n + c0, edge + r * kPanel, sizeof(float) * cols);
      }
    }
  });
}

// Weights packed ahead of time (`pack` in __init__.py): each layer is [N / kPanel, K, kPanel], the
// panels `Panels` would copy, stored contiguously (bfloat16: [N / kPanel, K / 2, kPanel, 2]). Every
// row count multiplies them in place: no copy, and the next panel is the next bytes (measured 1.33x
// more GFLOP per CPU-second than `Panels` at 64 rows, 1.06x at 512). `k_steps`: K, or K / 2 pairs.
template <typename X, typename W>
void PackedPanels(const Team& team, const X* xp, int64_t rows, int64_t k_steps, const W* wp, int64_t n, float* y) {
  const int64_t panels = n / kPanel, panel_size = k_steps * kRowElems<X, W>;
  const int64_t tiles = (rows + kTileRows<X, W> - 1) / kTileRows<X, W>;
  const int threads = TeamSize(team, rows, panels * panel_size * static_cast<int64_t>(sizeof(W)));
  const int64_t chunk = ChunkFor(panels, threads);
  team.ForEach(threads, panels, chunk, [&](int64_t p) {
    const W* panel = wp + p * panel_size;
    const W* next = NextInClaim(p, chunk, panels) ? panel + panel_size : nullptr;
    for (int64_t r0 = 0, tile = 0; r0 < rows; r0 += kTileRows<X, W>, ++tile) {
      const int n_rows = static_cast<int>(std::min<int64_t>(kTileRows<X, W>, rows - r0));
      const Ahead<W> ahead = TileShare(next, k_steps, kRowElems<X, W>, tile, tiles);
      PanelRows(n_rows, xp + r0 * k_steps * kXElems<X, W>, k_steps, panel, y + r0 * n + p * kPanel, n, ahead);
    }
  });
}

// x's bfloat16 values as the bfloat16 tile reads them (Bf16X, see Step): as they are, in pairs, where the
// target has the dot product; else widened to float32, in a buffer reused across calls.
template <typename X = Bf16X>
const X* Bf16Rows(const uint16_t* x, int64_t size) {
  if constexpr (std::is_same_v<X, float>) {
    static thread_local std::vector<float> wide;
    if (wide.size() < static_cast<size_t>(size)) wide.resize(size);
    for (int64_t i = 0; i < size; ++i) {
      const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
      std::memcpy(wide.data() + i, &bits, sizeof bits);
    }
    return wide.data();
  } else {
    return reinterpret_cast<const X*>(x);
  }
}

}  // namespace
