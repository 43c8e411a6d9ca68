// LoRA's two low-rank products, added into a projection's output in one call (cpu_kernel.cc's AddLoraCpu, punica's
// fused shrink and expand): y[t] += (x[t] @ A[slot_t]) @ B[slot_t] for every token t whose slot is not 0, each
// token's adapter read in place in the stacked slots, every part of a fused projection (q/k/v, gate/up) in the
// same call. Included by cpu_kernel.cc alone (one translation unit per kernel, cpu_ffi.py).
//
// Layouts (one layer's slot of model/lora.py's arrays): A [Rw, K] (PEFT's own [r, in] per part, parts stacked),
// each part's B [r, outer, cols] (the fused output seen as [outer, sum of cols]: q/k/v interleaved per KV head,
// gate/up side by side), float32, float16 or bfloat16 (each widened to float32 as it is read). Tokens are grouped by slot (a counting sort: slots are few), and each
// group runs in blocks of up to kLoraRows tokens, so a block reads its adapter's weights once:
// - shrink: h[t, j] = x[t] . A[j], A's rows being contiguous in K; items are (block, kRankRows rows of A);
// - expand: y[t, o, part's columns] += h[t, part's ranks] @ B, vectorized over the columns; items are (block,
//   kColChunk columns of one part of one outer index).
// The two phases are one team dispatch each (cpu_team.h); a small call stays on the calling thread.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../cpu_simd.h"
#include "../cpu_team.h"

namespace {

using jaxllm_simd::kLanes;
using jaxllm_simd::VecF;

constexpr int kLoraRows = 4;                  // tokens of one adapter a block: its weights read once per block
constexpr int kRankRows = 8;                  // rows of A a shrink item covers
constexpr int64_t kColChunk = 8 * kLanes;     // columns an expand item covers
constexpr int64_t kLoraTeamFlops = 1 << 18;   // multiply-adds below which a phase stays on the calling thread (lora.py: TEAM_MACS)

// The adapter's element types: float32, or 16 bits (half the bytes a decode step reads) widened in registers.
struct Fp16 {
  uint16_t bits;
};
struct Bf16 {
  uint16_t bits;
};
inline VecF LoadWeight(const float* p) { return jaxllm_simd::Load(p); }
inline VecF LoadWeight(const Fp16* p) { return jaxllm_simd::LoadHalf(&p->bits); }
inline VecF LoadWeight(const Bf16* p) { return jaxllm_simd::Load(&p->bits); }

constexpr int kMaxLoraParts = 4;  // parts of a fused projection (q/k/v: 3)

// Every slot of every layer: A [L * S, rank_width, k], each part's B [L * S, r, outer, cols[p]].
template <typename W>
struct LoraWeights {
  const W* a;
  const W* b[kMaxLoraParts];
  int64_t k, rank_width, r, outer, parts;
  int64_t cols[kMaxLoraParts];  // each part's columns per outer index
  int64_t RowWidth() const {    // y's columns per outer index
    int64_t n = 0;
    for (int64_t p = 0; p < parts; ++p) n += cols[p];
    return n;
  }
  const W* A(int64_t index) const { return a + index * rank_width * k; }
  const W* B(int64_t index, int64_t p) const { return b[p] + index * r * outer * cols[p]; }
};

inline float Sum(VecF v) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Independent accumulators a step keeps per row: a few rows would otherwise wait on one FMA chain (at one row the
// chains' latency, not the bytes, set the pace).
template <int ROWS>
constexpr int kChains = ROWS == 1 ? 8 : ROWS == 2 ? 4 : 2;

// h[i, j .. j + RANKS) for ROWS rows of x (`xs`: each row's start) against A's rows j ...
template <int ROWS, int RANKS, typename W>
__attribute__((always_inline)) inline void ShrinkTile(const float* const* xs, const W* a, int64_t k, int64_t j,
                                                      int64_t rank_width, float* h) {
  VecF acc[ROWS][RANKS] = {};
  for (int64_t kk = 0; kk < k; kk += kLanes) {
    VecF xv[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) xv[r] = jaxllm_simd::Load(xs[r] + kk);
#pragma GCC unroll 8
    for (int i = 0; i < RANKS; ++i) {
      const VecF av = LoadWeight(a + (j + i) * k + kk);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][i] += xv[r] * av;
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int i = 0; i < RANKS; ++i) h[r * rank_width + j + i] = Sum(acc[r][i]);
}

// h[i, j0 .. j0 + kRankRows) (an item), kChains<ROWS> rows of A at a time.
template <int ROWS, typename W>
void ShrinkStep(const float* const* xs, const W* a, int64_t k, int64_t j0, int64_t rank_width, float* h) {
  const int64_t j_end = std::min<int64_t>(j0 + kRankRows, rank_width);
  int64_t j = j0;
  for (; j + kChains<ROWS> <= j_end; j += kChains<ROWS>) ShrinkTile<ROWS, kChains<ROWS>>(xs, a, k, j, rank_width, h);
  for (; j < j_end; ++j) ShrinkTile<ROWS, 1>(xs, a, k, j, rank_width, h);
}

// y rows (`ys`) [c, c + VECS vectors) of one part += h's part ranks (`hp`, rows rank_width apart) @ B's rows (`b`:
// the part's first column, ranks `ldb` apart).
template <int ROWS, int VECS, typename W>
__attribute__((always_inline)) inline void ExpandTile(float* const* ys, const float* hp, int64_t rank_width,
                                                      const W* b, int64_t ldb, int64_t r_dim, int64_t c) {
  VecF acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = jaxllm_simd::Load(ys[r] + c + v * kLanes);
  for (int64_t j = 0; j < r_dim; ++j) {
#pragma GCC unroll 8
    for (int v = 0; v < VECS; ++v) {
      const VecF bv = LoadWeight(b + j * ldb + c + v * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][v] += hp[r * rank_width + j] * bv;
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) jaxllm_simd::Store(ys[r] + c + v * kLanes, acc[r][v]);
}

// Columns [0, width) of an item (a multiple of kLanes), kChains<ROWS> vectors at a time.
template <int ROWS, typename W>
void ExpandStep(float* const* ys, const float* hp, int64_t rank_width, const W* b, int64_t ldb, int64_t r_dim,
                int64_t width) {
  constexpr int64_t kCols = kChains<ROWS> * kLanes;
  int64_t c = 0;
  for (; c + kCols <= width; c += kCols) ExpandTile<ROWS, kChains<ROWS>>(ys, hp, rank_width, b, ldb, r_dim, c);
  for (; c < width; c += kLanes) ExpandTile<ROWS, 1>(ys, hp, rank_width, b, ldb, r_dim, c);
}

// The ROWS dispatch: a block's row count (1 .. kLoraRows) as a template argument.
template <typename F>
void WithRows(int rows, const F& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// y [T, outer * RowWidth] += each token's LoRA product of `layer`; x [T, k] float32; slots [T] (0: none), of
// num_slots a layer. K and every part's columns multiples of kLanes (checked by the handler).
template <typename W>
void AddLora(const Team& team, const float* x, int64_t num_tokens, const int32_t* slots, int64_t num_slots,
             int64_t layer, const LoraWeights<W>& w, float* y) {
  // tokens grouped by slot (slot 0 left out): order[], and blocks of up to kLoraRows tokens of one slot
  std::vector<int64_t> count(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) ++count[slots[t] + 1];
  for (int64_t s = 1; s <= num_slots; ++s) count[s] += count[s - 1];
  std::vector<int64_t> order(num_tokens), next(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t) order[next[slots[t]]++] = t;
  struct Block {
    int64_t first, rows;  // its tokens: order[first .. first + rows)
    int32_t slot;
  };
  std::vector<Block> blocks;
  for (int64_t s = 1; s < num_slots; ++s)
    for (int64_t i = count[s]; i < count[s + 1]; i += kLoraRows)
      blocks.push_back({i, std::min<int64_t>(kLoraRows, count[s + 1] - i), static_cast<int32_t>(s)});
  if (blocks.empty()) return;
  const int64_t lora_tokens = count[num_slots] - count[1];

  const int64_t k = w.k, rw = w.rank_width, row_width = w.RowWidth(), n = w.outer * row_width;
  std::vector<float> h(lora_tokens * rw);  // row i: the token order[count[1] + i]
  auto h_row = [&](const Block& blk) { return h.data() + (blk.first - count[1]) * rw; };

  const int64_t rank_items = (rw + kRankRows - 1) / kRankRows;
  const int shrink_threads = lora_tokens * k * rw < kLoraTeamFlops ? 1 : team.max_threads();
  team.ForEach(shrink_threads, static_cast<int64_t>(blocks.size()) * rank_items, 1, [&](int64_t item) {
    const Block& blk = blocks[item / rank_items];
    const float* xs[kLoraRows];
    for (int64_t i = 0; i < blk.rows; ++i) xs[i] = x + order[blk.first + i] * k;
    WithRows(static_cast<int>(blk.rows), [&](auto rows) {
      ShrinkStep<decltype(rows)::value>(xs, w.A(layer * num_slots + blk.slot), k, (item % rank_items) * kRankRows, rw, h_row(blk));
    });
  });

  // expand items: (part, outer index, chunk of the part's columns)
  struct Segment {
    int64_t part, width, y_col, part_col;
  };
  std::vector<Segment> segments;
  for (int64_t o = 0; o < w.outer; ++o)
    for (int64_t p = 0, y_col = o * row_width; p < w.parts; y_col += w.cols[p++])
      for (int64_t c0 = 0; c0 < w.cols[p]; c0 += kColChunk)
        segments.push_back({p, std::min(kColChunk, w.cols[p] - c0), y_col + c0, o * w.cols[p] + c0});
  const int64_t num_segments = static_cast<int64_t>(segments.size());
  const int expand_threads = lora_tokens * w.r * n < kLoraTeamFlops ? 1 : team.max_threads();
  team.ForEach(expand_threads, static_cast<int64_t>(blocks.size()) * num_segments, 1, [&](int64_t item) {
    const Block& blk = blocks[item / num_segments];
    const Segment& seg = segments[item % num_segments];
    float* ys[kLoraRows];
    for (int64_t i = 0; i < blk.rows; ++i) ys[i] = y + order[blk.first + i] * n + seg.y_col;
    const int64_t ldb = w.outer * w.cols[seg.part];
    const float* hp = h_row(blk) + seg.part * w.r;
    const W* b = w.B(layer * num_slots + blk.slot, seg.part) + seg.part_col;
    WithRows(static_cast<int>(blk.rows), [&](auto rows) {
      ExpandStep<decltype(rows)::value>(ys, hp, rw, b, ldb, w.r, seg.width);
    });
  });
}

}  // namespace
