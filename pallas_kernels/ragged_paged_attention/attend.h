// One work unit of the CPU attention kernel (cpu_kernel.cc spreads the units over the cores): a tile of query
// rows of one sequence (`attend_tile`), or one query row over a range of its keys (`attend_decode`, vector
// code from cpu_simd.h), and the merge of a row's slices (`merge_states`). Included by cpu_kernel.cc alone
// (one translation unit per kernel, cpu_ffi.py): its definitions stay internal to the kernel.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../cpu_simd.h"

namespace {

constexpr int kTileRows = 16;
constexpr int64_t kPrefetch = 2;  // blocks ahead: one block of compute hides less than one block of latency
constexpr float kMask = -3.0e38f;

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16 -> float32: the high half of the bits
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Shape {
  int64_t num_blocks, block_size, kv_heads, head_dim, q_heads, max_blocks;
};

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * load(k[d]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * load(v[d]);
}

// One work unit: rows [row0, row0 + nrows) of a sequence whose first row is at position pos0.
template <typename T>
void attend_tile(const float* q, const T* k_layer, const T* v_layer, const int32_t* table,
                 const Shape& sh, int64_t row0, int64_t nrows, int64_t pos0, float sm_scale,
                 int32_t window, float soft_cap, const float* sinks, float* out, std::vector<float>& scratch) {
  const int64_t D = sh.head_dim, Hq = sh.q_heads, Hkv = sh.kv_heads, B = sh.block_size;
  const int64_t G = Hq / Hkv, heads = nrows * Hq;
  scratch.assign(heads * (D + 2 + B), 0.f);
  float* acc = scratch.data();          // [rows, Hq, D]
  float* m = acc + heads * D;           // [rows, Hq]
  float* l = m + heads;                 // [rows, Hq]
  float* s = l + heads;                 // [rows, Hq, B] scores of one block
  std::fill(m, m + heads, kMask);
  std::vector<float> qs(heads * D);
  for (int64_t i = 0; i < heads * D; ++i) qs[i] = q[row0 * Hq * D + i] * sm_scale;

  const int64_t key_hi = pos0 + nrows;  // one past the last row's position
  const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const int64_t blk_lo = key_lo / B, blk_hi = (key_hi - 1) / B;
  const int64_t block_elems = B * Hkv * D, line = 64 / sizeof(T);
  auto prefetch = [&](int64_t b) {  // blocks are scattered: ask for them before they are read
    if (b > blk_hi || b >= sh.max_blocks) return;
    const int64_t block = table[b];
    if (block < 0 || block >= sh.num_blocks) return;
    for (int64_t e = 0; e < block_elems; e += line) {
      __builtin_prefetch(k_layer + block * block_elems + e);
      __builtin_prefetch(v_layer + block * block_elems + e);
    }
  };
  for (int64_t b = blk_lo; b < blk_lo + kPrefetch; ++b) prefetch(b);
  for (int64_t b = blk_lo; b <= blk_hi && b < sh.max_blocks; ++b) {
    const int64_t block = table[b];
    if (block < 0 || block >= sh.num_blocks) continue;  // a bad table entry reads nothing
    const T* kb = k_layer + block * block_elems;
    const T* vb = v_layer + block * block_elems;
    prefetch(b + kPrefetch);
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t pos = pos0 + r;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t t_lo = std::max<int64_t>(0, lo - b * B), t_hi = std::min<int64_t>(B, pos + 1 - b * B);
      if (t_lo >= t_hi) continue;
      float* sr = s + r * Hq * B;  // [Hq, B]
      for (int64_t t = t_lo; t < t_hi; ++t)  // keys in address order; each row serves G heads
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
          const T* kt = kb + (t * Hkv + kvh) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            sr[h * B + t] = dot(qs.data() + (r * Hq + h) * D, kt, D);
          }
        }
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t i = r * Hq + h;
        float* si = sr + h * B;
        if (soft_cap > 0.f)
          for (int64_t t = t_lo; t < t_hi; ++t) si[t] = soft_cap * std::tanh(si[t] / soft_cap);
        float mx = m[i];
        for (int64_t t = t_lo; t < t_hi; ++t) mx = std::max(mx, si[t]);
        const float alpha = std::exp(m[i] - mx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = t_lo; t < t_hi; ++t) {
          si[t] = std::exp(si[t] - mx);
          sum += si[t];
        }
        l[i] = l[i] * alpha + sum;
        m[i] = mx;
        if (alpha != 1.f) {
          float* ai = acc + i * D;
          for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
        }
      }
      for (int64_t t = t_lo; t < t_hi; ++t)  // values in address order
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
          const T* vt = vb + (t * Hkv + kvh) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kvh * G + g;
            axpy(sr[h * B + t], vt, acc + (r * Hq + h) * D, D);
          }
        }
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    const float li = l[i] + (sinks ? std::exp(sinks[i % Hq] - m[i]) : 0.f);  // a sink: the denominator only
    const float inv = li > 0.f ? 1.f / li : 0.f;
    for (int64_t d = 0; d < D; ++d) out[row0 * Hq * D + i * D + d] = acc[i * D + d] * inv;
  }
}

// --- Decode: one query row per unit, kGroup keys at a time ----------------------------------
//
// A unit that scores one row (every decode sequence) takes this path when head_dim is a
// multiple of 16. kGroup is the target's float32 lanes (16 on AVX-512, 8 on AVX2, 4 on NEON; see
// cpu_simd.h). For each KV head and each group of up to kGroup keys of a block it forms, per query
// head, kGroup vectors of partial dot products (one per key, FMAs over head_dim) and folds them
// with a transpose-add tree into one vector holding the kGroup scores (`LaneSums`: 45 shuffle/add
// ops per 16 scores instead of 16 horizontal sums, ~128 ops). Values accumulate from the same rows
// with the G heads' accumulators kept in registers per vector of head_dim. Rows past a group's
// last valid key re-read its last valid row and get probability 0, so no unused (possibly
// NaN) cache row is ever read. Blocks are prefetched ahead (`Prefetch`); without that the
// scattered blocks, not the arithmetic, set the speed.

using jaxllm_simd::kLanes;
using jaxllm_simd::Load;
using jaxllm_simd::VecF;
constexpr int kGroup = kLanes;        // keys scored at a time: one vector of scores
constexpr int64_t kMaxHeadDim = 256;  // the decode path's limit (bfloat16 keys widened on the stack)

// Prefetches the lines of a block kPrefetch ahead a few at a time, spread over the current
// block's compute. Measured (benchmarks/NOTES.md): one burst of the whole block's prefetches per
// block hid nothing (it stalls on the core's few miss buffers); spread out, 1.2x less CPU time;
// spread and into L2 (prefetcht1) instead of L1, 1.6x.
struct Prefetch {
  const char *k = nullptr, *v = nullptr;
  int64_t next = 0, lines = 0, per_step = 0;
  void step() {
    for (int64_t end = std::min(lines, next + per_step); next < end; ++next) {
      __builtin_prefetch(k + next * 64, 0, 2);  // locality 2: prefetcht1
      __builtin_prefetch(v + next * 64, 0, 2);
    }
  }
  void finish() { per_step = lines; step(); }
};

// The prefetches of block b of a walk that ends at block blk_hi, spread over `steps` steps (none past the end or
// for a bad table entry).
template <typename T>
Prefetch BlockPrefetch(const T* k_layer, const T* v_layer, const int32_t* table, const Shape& sh, int64_t b,
                       int64_t blk_hi, int64_t steps) {
  const int64_t block_elems = sh.block_size * sh.kv_heads * sh.head_dim, lines = block_elems * sizeof(T) / 64;
  if (b > blk_hi) return Prefetch{};
  const int64_t block = table[b];
  if (block < 0 || block >= sh.num_blocks) return Prefetch{};
  return Prefetch{reinterpret_cast<const char*>(k_layer + block * block_elems),
                  reinterpret_cast<const char*>(v_layer + block * block_elems), 0, lines, (lines + steps - 1) / steps};
}

struct HeadState {  // one KV head's G query heads: scaled queries, running max/sum, accumulators
  const float* q;   // [G, D]
  float* m;         // [G]
  float* l;         // [G]
  float* acc;       // [G, D]
};

// Keys k[min(t, nk - 1) * k_stride], values likewise, t < kGroup; FULL: nk == kGroup.
template <bool FULL, typename TK, typename TV>
inline void attend_group(const HeadState& st, const TK* k, int64_t k_stride, const TV* v, int64_t v_stride, int nk,
                         int64_t G, int64_t D, float soft_cap, Prefetch& pf) {
  alignas(64) float p[8 * kGroup];  // probabilities [G, kGroup] (G <= 8 here; see the caller)
  const int64_t C = D / kLanes;
  auto row = [&](int t) { return FULL ? t : std::min(t, nk - 1); };
  for (int64_t g = 0; g < G; ++g) {
    pf.step();
    VecF part[kGroup] = {};
    for (int64_t c = 0; c < C; ++c) {
      const VecF qv = Load(st.q + g * D + c * kLanes);
#pragma GCC unroll 16
      for (int t = 0; t < kGroup; ++t) part[t] += qv * Load(k + row(t) * k_stride + c * kLanes);
    }
    alignas(64) float s[kGroup];
    const VecF sv = jaxllm_simd::LaneSums(part);
    std::memcpy(s, &sv, sizeof s);
    if (soft_cap > 0.f)
      for (int t = 0; t < kGroup; ++t) s[t] = soft_cap * std::tanh(s[t] / soft_cap);
    if (!FULL)
      for (int t = nk; t < kGroup; ++t) s[t] = kMask;
    float mx = st.m[g];
    for (int t = 0; t < kGroup; ++t) mx = std::max(mx, s[t]);
    const float alpha = std::exp(st.m[g] - mx);
    float* pg = p + g * kGroup;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < kGroup; ++t) {
      pg[t] = std::exp(s[t] - mx);
      sum += pg[t];
    }
    st.l[g] = st.l[g] * alpha + sum;
    st.m[g] = mx;
    if (alpha != 1.f)
      for (int64_t d = 0; d < D; ++d) st.acc[g * D + d] *= alpha;
  }
  for (int64_t c = 0; c < C; ++c) {
    pf.step();
    VecF vr[kGroup];
#pragma GCC unroll 16
    for (int t = 0; t < kGroup; ++t) vr[t] = Load(v + row(t) * v_stride + c * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      VecF a = Load(st.acc + g * D + c * kLanes);
      const float* pg = p + g * kGroup;
#pragma GCC unroll 16
      for (int t = 0; t < kGroup; ++t) a += pg[t] * vr[t];
      jaxllm_simd::Store(st.acc + g * D + c * kLanes, a);
    }
  }
}

// bfloat16 rows: widen the group's key rows once into float32 (L1-resident) rather than once
// per query head; value rows are widened as they are read (once each anyway).
template <bool FULL>
inline void attend_group_bf16(const HeadState& st, const uint16_t* k, const uint16_t* v, int64_t stride, int nk,
                              int64_t G, int64_t D, float soft_cap, Prefetch& pf) {
  alignas(64) float kf[kGroup * kMaxHeadDim];
  for (int t = 0; t < kGroup; ++t) {
    const uint16_t* row = k + (FULL ? t : std::min(t, nk - 1)) * stride;
    for (int64_t c = 0; c < D; c += kLanes) jaxllm_simd::Store(kf + t * D + c, Load(row + c));
  }
  attend_group<FULL>(st, kf, D, v, stride, nk, G, D, soft_cap, pf);
}

template <bool FULL>
inline void attend_group_any(const HeadState& st, const float* k, const float* v, int64_t stride, int nk, int64_t G,
                             int64_t D, float soft_cap, Prefetch& pf) {
  attend_group<FULL>(st, k, stride, v, stride, nk, G, D, soft_cap, pf);
}
template <bool FULL>
inline void attend_group_any(const HeadState& st, const uint16_t* k, const uint16_t* v, int64_t stride, int nk,
                             int64_t G, int64_t D, float soft_cap, Prefetch& pf) {
  attend_group_bf16<FULL>(st, k, v, stride, nk, G, D, soft_cap, pf);
}

// An empty softmax state: [Hq, D] zero accumulators, [Hq] maxima at kMask, [Hq] zero sums.
inline void reset_state(float* st, int64_t Hq, int64_t D) {
  std::fill(st, st + Hq * D, 0.f);
  std::fill(st + Hq * D, st + Hq * D + Hq, kMask);
  std::fill(st + Hq * D + Hq, st + Hq * (D + 2), 0.f);
}

// One query row over keys [key_lo, key_hi): the unnormalised softmax state into `st`
// ([Hq, D] accumulators, then [Hq] running maxima, then [Hq] sums).
template <typename T>
void attend_decode(const float* q_row, const T* k_layer, const T* v_layer, const int32_t* table, const Shape& sh,
                   int64_t key_lo, int64_t key_hi, float sm_scale, float soft_cap, float* st,
                   std::vector<float>& scratch) {
  const int64_t D = sh.head_dim, Hq = sh.q_heads, Hkv = sh.kv_heads, B = sh.block_size, G = Hq / Hkv;
  scratch.resize(Hq * D);
  float* qs = scratch.data();  // [Hq, D], scaled
  for (int64_t i = 0; i < Hq * D; ++i) qs[i] = q_row[i] * sm_scale;
  reset_state(st, Hq, D);
  float* acc = st;
  float* m = acc + Hq * D;
  float* l = m + Hq;

  const int64_t blk_lo = key_lo / B, blk_hi = std::min<int64_t>((key_hi - 1) / B, sh.max_blocks - 1);
  const int64_t block_elems = B * Hkv * D, stride = Hkv * D;
  // Prefetch: the block kPrefetch ahead, spread over this block's (Hkv x (G + D / kLanes)) steps
  const int64_t steps = Hkv * (G + D / kLanes) * ((B + kGroup - 1) / kGroup);
  Prefetch pf;
  auto target = [&](int64_t b) {
    pf.finish();
    pf = BlockPrefetch(k_layer, v_layer, table, sh, b, blk_hi, steps);
  };
  for (int64_t b = blk_lo; b < blk_lo + kPrefetch; ++b) {
    target(b);
    pf.finish();
  }
  for (int64_t b = blk_lo; b <= blk_hi; ++b) {
    target(b + kPrefetch);
    const int64_t block = table[b];
    if (block < 0 || block >= sh.num_blocks) continue;  // a bad table entry reads nothing
    const T* kb = k_layer + block * block_elems;
    const T* vb = v_layer + block * block_elems;
    const int64_t t_lo = std::max<int64_t>(0, key_lo - b * B), t_hi = std::min<int64_t>(B, key_hi - b * B);
    for (int64_t t0 = t_lo; t0 < t_hi; t0 += kGroup) {
      const int nk = static_cast<int>(std::min<int64_t>(kGroup, t_hi - t0));
      for (int64_t h = 0; h < Hkv; ++h) {
        const HeadState hs{qs + h * G * D, m + h * G, l + h * G, acc + h * G * D};
        const T* kr = kb + t0 * stride + h * D;
        const T* vr = vb + t0 * stride + h * D;
        if (nk == kGroup)
          attend_group_any<true>(hs, kr, vr, stride, nk, G, D, soft_cap, pf);
        else
          attend_group_any<false>(hs, kr, vr, stride, nk, G, D, soft_cap, pf);
      }
    }
  }
}

// Rows [0, nrows) of one sequence at positions pos0 .. pos0 + nrows - 1 (a prefill chunk's, no sliding window), each
// over its causal prefix: attend_decode's walk, with the rows innermost so that each group of keys and values is
// read from memory (or L3) once for the nrows rows and from L1 by the others (one unit per row re-read a 1,024-token
// prefix per row). `q_rows` [nrows, Hq, D]; `st`: each row's state as attend_decode writes it, rows state_size apart.
template <typename T>
void attend_rows(const float* q_rows, int64_t nrows, int64_t pos0, const T* k_layer, const T* v_layer,
                 const int32_t* table, const Shape& sh, float sm_scale, float soft_cap, float* st,
                 std::vector<float>& scratch) {
  const int64_t D = sh.head_dim, Hq = sh.q_heads, Hkv = sh.kv_heads, B = sh.block_size, G = Hq / Hkv;
  const int64_t state_size = Hq * (D + 2);
  scratch.resize(nrows * Hq * D);
  float* qs = scratch.data();  // [nrows, Hq, D], scaled
  for (int64_t i = 0; i < nrows * Hq * D; ++i) qs[i] = q_rows[i] * sm_scale;
  for (int64_t r = 0; r < nrows; ++r) reset_state(st + r * state_size, Hq, D);
  const int64_t key_hi = pos0 + nrows, blk_hi = std::min<int64_t>((key_hi - 1) / B, sh.max_blocks - 1);
  const int64_t block_elems = B * Hkv * D, stride = Hkv * D;
  const int64_t steps = nrows * Hkv * (G + D / kLanes) * ((B + kGroup - 1) / kGroup);
  Prefetch pf;
  auto target = [&](int64_t b) {
    pf.finish();
    pf = BlockPrefetch(k_layer, v_layer, table, sh, b, blk_hi, steps);
  };
  for (int64_t b = 0; b < kPrefetch; ++b) {
    target(b);
    pf.finish();
  }
  for (int64_t b = 0; b <= blk_hi; ++b) {
    target(b + kPrefetch);
    const int64_t block = table[b];
    if (block < 0 || block >= sh.num_blocks) continue;  // a bad table entry reads nothing
    const T* kb = k_layer + block * block_elems;
    const T* vb = v_layer + block * block_elems;
    const int64_t t_hi = std::min<int64_t>(B, key_hi - b * B);
    for (int64_t t0 = 0; t0 < t_hi; t0 += kGroup) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const T* kr = kb + t0 * stride + h * D;
        const T* vr = vb + t0 * stride + h * D;
        for (int64_t r = 0; r < nrows; ++r) {  // row r sees keys up to pos0 + r
          const int64_t nk = std::min<int64_t>({kGroup, t_hi - t0, pos0 + r + 1 - (b * B + t0)});
          if (nk <= 0) continue;
          float* acc = st + r * state_size;
          const HeadState hs{qs + (r * Hq + h * G) * D, acc + Hq * D + h * G, acc + Hq * D + Hq + h * G,
                             acc + h * G * D};
          if (nk == kGroup)
            attend_group_any<true>(hs, kr, vr, stride, kGroup, G, D, soft_cap, pf);
          else
            attend_group_any<false>(hs, kr, vr, stride, static_cast<int>(nk), G, D, soft_cap, pf);
        }
      }
    }
  }
}

// out[Hq, D] from the softmax states of the n slices of one row (each as attend_decode writes it); `sinks` (a logit
// per head, or null) join the denominator.
inline void merge_states(const float* states, int64_t n, int64_t Hq, int64_t D, const float* sinks, float* out) {
  const int64_t size = Hq * (D + 2);
  for (int64_t h = 0; h < Hq; ++h) {
    float mx = kMask;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, states[i * size + Hq * D + h]);
    float l = 0.f;
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const float* st = states + i * size;
      const float w = std::exp(st[Hq * D + h] - mx);  // a slice with no keys has l = 0
      l += w * st[Hq * D + Hq + h];
      for (int64_t d = 0; d < D; ++d) o[d] += w * st[h * D + d];
    }
    if (sinks) l += std::exp(sinks[h] - mx);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

}  // namespace
