// x @ w[layer], reading the layer's weights in place inside the stacked [L, K, ...] array:
// an XLA FFI custom call (see __init__.py for why XLA's own dot cannot).
//
// x [T, K] float32, w [L, K, N...] float32 (trailing dims flattened to N), layer [1] int32,
// out [T, N] float32. Two regimes:
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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "../cpu_simd.h"
#include "../cpu_team.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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
#if defined(__AVX512BF16__)
// With the bfloat16 dot product: x holds each row's K as pairs too (one 32-bit word: k even in the
// low half, odd in the high half), multiplied pair by pair with vdpbf16ps.
template <int ROWS, int VECS>
__attribute__((always_inline)) inline void Step(const uint32_t* x, int64_t ldx, const uint16_t* b,
                                                VecF (*acc)[VECS]) {
  static_assert(kLanes == 16, "vdpbf16ps takes 512-bit vectors here");
  __m512bh bv[VECS];
  for (int v = 0; v < VECS; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + v * 2 * kLanes);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx]));
    for (int v = 0; v < VECS; ++v) acc[r][v] = (VecF)_mm512_dpbf16_ps((__m512)acc[r][v], a, bv[v]);
  }
}
using Bf16X = uint32_t;  // what the bfloat16 tile reads x as
#else
// Without it: x widened to float32 beforehand (WidenRows), the weights widened in registers (a
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
using Bf16X = float;
#endif

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

// x's bfloat16 values as float32, in a buffer reused across calls (see Step: the tile without a
// bfloat16 dot product reads x widened)
[[maybe_unused]] const float* WidenRows(const uint16_t* x, int64_t size) {
  static thread_local std::vector<float> wide;
  if (wide.size() < static_cast<size_t>(size)) wide.resize(size);
  for (int64_t i = 0; i < size; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(wide.data() + i, &bits, sizeof bits);
  }
  return wide.data();
}

// `packed`: w as `pack` (__init__.py) lays it out, read by PackedPanels whatever the row count.
// x and w both float32, or (packed only) both bfloat16; the output is float32.
ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                bool packed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() < 3 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("stacked_matmul_cpu: x must be [T, K] and w [L, K, ...]");
  const int64_t rows = xd[0], k_dim = xd[1], num_layers = wd[0];
  int64_t n = 1;
  for (size_t i = 2; i < wd.size(); ++i) n *= wd[i];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("stacked_matmul_cpu: layer out of range");
  const bool f32 = x.element_type() == ffi::F32 && w.element_type() == ffi::F32;
  const bool bf16 = x.element_type() == ffi::BF16 && w.element_type() == ffi::BF16;
  if (!f32 && !(bf16 && packed && k_dim % 2 == 0))
    return ffi::Error::InvalidArgument("stacked_matmul_cpu: x and w float32, or bfloat16 packed with K even");
  if (packed && n % kPanel != 0) return ffi::Error::InvalidArgument("stacked_matmul_cpu: packed N must divide by 32");
  float* y = out->typed_data();
  const Team team(pool);
  if (bf16) {
    const auto* w16 = static_cast<const uint16_t*>(w.untyped_data()) + l * k_dim * n;
#if defined(__AVX512BF16__)
    PackedPanels(team, static_cast<const Bf16X*>(x.untyped_data()), rows, k_dim / 2, w16, n, y);
#else
    PackedPanels(team, WidenRows(static_cast<const uint16_t*>(x.untyped_data()), rows * k_dim), rows, k_dim / 2, w16, n, y);
#endif
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data<float>();
  const float* wl = w.typed_data<float>() + l * k_dim * n;
  if (packed)
    PackedPanels(team, xp, rows, k_dim, wl, n, y);
  else if (rows <= kStreamRows)
    Stream(xp, rows, k_dim, wl, n, y);
  else
    Panels(team, xp, rows, k_dim, wl, n, y);
  return ffi::Error::Success();
}

// ---- Quantized weights (quantized.py): x float32 times int8 / 4-bit quants dequantized in registers ----
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

// Up to this many rows of x: quants dequantized in registers. Measured on AVX2 (Zen 2, gate_up 576 x 3072, one
// thread): 1.6-1.9x faster than the dequantized panel at 2-4 rows, even at 6, 1.2x slower at 8.
constexpr int64_t kQuantStreamRows = 4;

using jaxllm_simd::kVecBytes;
typedef int32_t VecI __attribute__((vector_size(kVecBytes)));

// kLanes float16 values (scales, mins) as float32: one vcvtph2ps (F16C, AVX-512), NEON's fcvtl, else by their
// bits. By intrinsics: GCC lowers __builtin_convertvector of a _Float16 vector lane by lane (a vpinsrw and a
// vcvtph2ps each), which made the scales a third of a 4-bit decode matmul's instructions (benchmarks/NOTES.md).
inline VecF LoadHalf(const uint16_t* p) {
#if defined(__AVX512F__)
  return (VecF)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (VecF)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__aarch64__)
  static_assert(kLanes == 4, "NEON vectors hold 4 float32");
  return (VecF)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#else
  jaxllm_simd::VecH h16;
  std::memcpy(&h16, p, sizeof h16);
  const VecU h = __builtin_convertvector(h16, VecU);
  // normal halves: exponent and mantissa moved into place, the exponent rebiased (+112); subnormal ones (and
  // zero) are their mantissa times 2^-24, in float arithmetic (-ffast-math flushes a float32 denormal input to
  // zero, so no denormal float may stand in between); infinities and NaN get the all-ones exponent; then the sign
  const VecU em = h & 0x7fffu, exponent = h & 0x7c00u;
  const VecU is_subnormal = (VecU)(exponent == 0u), is_inf_nan = (VecU)(exponent == 0x7c00u);
  const VecU normal = (em << 13) + (112u << 23);
  const VecU subnormal = (VecU)(__builtin_convertvector((VecI)em, VecF) * 0x1p-24f);
  const VecU bits = (normal & ~is_subnormal) | (subnormal & is_subnormal) | (is_inf_nan & 0x7f800000u);
  return (VecF)(bits | ((h & 0x8000u) << 16));
#endif
}

// kLanes bytes widened to int32 lanes, sign- or zero-extended: one vpmovsxbd / vpmovzxbd (pmov*xbd, two
// NEON widenings). GCC lowers __builtin_convertvector of a vector this narrow byte by byte, hence the intrinsics.
template <bool SIGNED>
inline VecI WidenBytes(const void* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return (VecI)(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return (VecI)(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#elif defined(__SSE4_1__) && !defined(__AVX__)
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  const __m128i b = _mm_cvtsi32_si128(word);
  return (VecI)(SIGNED ? _mm_cvtepi8_epi32(b) : _mm_cvtepu8_epi32(b));
#elif defined(__aarch64__)
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  if constexpr (SIGNED) return (VecI)vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(word))));
  return (VecI)vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(word))));
#else
  using Byte = std::conditional_t<SIGNED, int8_t, uint8_t>;
  VecI out;
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<const Byte*>(p)[i];
  return out;
#endif
}

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

void QuantMatmul(const Team& team, const float* xp, int64_t rows, const QuantLayer& w, int bits, float* y) {
  if (bits == 8) return QuantPanels<8, false>(team, xp, rows, w, y);
  if (w.mins) return QuantPanels<4, true>(team, xp, rows, w, y);
  QuantPanels<4, false>(team, xp, rows, w, y);
}

// x float32 [T, K]; qs int8 [L, K, N...] or uint8 [L, K / 2, N...]; scales float16 [L, K / G, N...]; mins
// float16 like scales, or size 0 (none); layer [1]; out [T, N]. Every weight array packed (quantized.py).
ffi::Error QuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer qs, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scales.dimensions();
  const int bits = qs.element_type() == ffi::S8 ? 8 : qs.element_type() == ffi::U8 ? 4 : 0;
  if (!bits || scales.element_type() != ffi::F16 || mins.element_type() != ffi::F16)
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: qs int8 or uint8, scales and mins float16");
  if (xd.size() != 2 || qd.size() < 3 || sd.size() != qd.size() || sd[0] != qd[0])
    return ffi::Error::InvalidArgument("quantized_matmul_cpu: x [T, K], qs [L, Kq, ...], scales [L, K / G, ...]");
  const int64_t rows = xd[0], k_dim = xd[1], num_layers = qd[0], groups = sd[1];
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
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("quantized_matmul_cpu: layer out of range");
  const int64_t q_layer = qd[1] * n, s_layer = groups * n;
  QuantLayer w{static_cast<const int8_t*>(qs.untyped_data()) + l * q_layer,
               static_cast<const uint16_t*>(scales.untyped_data()) + l * s_layer,
               has_min ? static_cast<const uint16_t*>(mins.untyped_data()) + l * s_layer : nullptr,
               k_dim,
               group,
               n};
  QuantMatmul(Team(pool), x.typed_data(), rows, w, bits, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

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
                                  .Ret<ffi::Buffer<ffi::F32>>());
