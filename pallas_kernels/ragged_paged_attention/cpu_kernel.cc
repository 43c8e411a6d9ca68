// Ragged paged attention for CPUs: an XLA FFI custom call (the CPU counterpart of the
// Pallas kernel; see cpu.py for why XLA's own ops cannot reach memory speed here).
//
// Same contract as the jnp reference: q [T, Hq, D] (float32), caches [L, N, B, Hkv, D] in
// float32 or bfloat16, sequence i owns query rows cu_q_lens[i]:cu_q_lens[i+1], its last row
// sits at position kv_lens[i]-1, its keys live in block_tables[i]. Rows of padding get zeros.
//
// Work units, spread over the cores (cpu_team.h: XLA's own thread pool), longest first:
// - one query row (head_dim a multiple of 16, at most 256; G <= 8): all heads, over its keys
//   or, for a row long enough to unbalance the cores, over one slice of them (flash-decoding:
//   the slices' softmax states are merged afterwards). Keys are scored a vector's width at a time with vector
//   FMAs and a transpose-add reduction (`attend_group`). A prefill chunk's rows are units of
//   their own too, each over its causal prefix: its sequence's blocks are re-read from cache
//   (measured 1.5-2x faster than the row-by-row tile below on prefill and mixed batches).
// - otherwise, a tile of up to kTileRows query rows of one sequence, all heads, row by row.
// Either walks its blocks through the table in order, so every K/V byte is read once per unit
// from its contiguous [B, Hkv, D] block (all heads at once). Softmax is online (running max
// and sum per row and head) in float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../cpu_simd.h"
#include "../cpu_team.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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
                 int32_t window, float soft_cap, float* out, std::vector<float>& scratch) {
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
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
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
using jaxllm_team::Team;
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
  float* acc = st;
  float* m = acc + Hq * D;
  float* l = m + Hq;
  std::fill(acc, acc + Hq * D, 0.f);
  std::fill(m, m + Hq, kMask);
  std::fill(l, l + Hq, 0.f);

  const int64_t blk_lo = key_lo / B, blk_hi = std::min<int64_t>((key_hi - 1) / B, sh.max_blocks - 1);
  const int64_t block_elems = B * Hkv * D, stride = Hkv * D;
  // Prefetch: the block kPrefetch ahead, spread over this block's (Hkv x (G + D / kLanes)) steps
  const int64_t lines = block_elems * sizeof(T) / 64, steps = Hkv * (G + D / kLanes) * ((B + kGroup - 1) / kGroup);
  Prefetch pf;
  auto target = [&](int64_t b) {
    pf.finish();
    pf = Prefetch{};
    if (b > blk_hi) return;
    const int64_t block = table[b];
    if (block < 0 || block >= sh.num_blocks) return;
    pf = Prefetch{reinterpret_cast<const char*>(k_layer + block * block_elems),
                  reinterpret_cast<const char*>(v_layer + block * block_elems), 0, lines, (lines + steps - 1) / steps};
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

// out[Hq, D] from the softmax states of the n slices of one row (each as attend_decode writes it).
inline void merge_states(const float* states, int64_t n, int64_t Hq, int64_t D, float* out) {
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
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

struct Unit {
  int64_t seq, row, nrows, pos;  // rows [row, row + nrows) of sequence seq, the first at position pos
  int64_t key_lo, key_hi;        // one-row units: the keys this unit reads
  int64_t slice;                 // rows split over several units: this one's state slot; else -1
  int64_t cost;                  // keys x rows, to start the longest units first
  bool decode() const { return key_hi > key_lo; }
};

// A one-row unit is split into slices of at least kMinSliceKeys keys when it holds more than
// 1 / (kSlicesPerThread * threads) of all the batch's keys: a few long sequences (a batch of
// one, a skewed batch) then still use every core. Merging costs one [Hq, D] pass per slice.
constexpr int64_t kMinSliceKeys = 512;
constexpr int64_t kSlicesPerThread = 4;
// Less work than this (keys x query rows, summed over the units): the calling thread alone. With an
// OpenMP team this was 4096, its wake-up costing more than a small step's attention; a helper task that
// starts late costs nothing (cpu_team.h), and a decode batch of 16 at 128-256 keys went 196-199 -> 216-222
// tok/s with it at 128. A batch of one stays one unit below kMinSliceKeys: slices of 64 keys made it 8 %
// slower in the engine.
constexpr int64_t kMinTeamCost = 128;

template <typename T>
void run(const Team& team, const float* q, const T* k, const T* v, const int32_t* kv_lens, const int32_t* tables,
         const int32_t* cu, int64_t num_seqs, int64_t layer, const Shape& sh, int64_t num_tokens,
         float sm_scale, int32_t window, float soft_cap, float* out) {
  const int64_t Hq = sh.q_heads, D = sh.head_dim, B = sh.block_size;
  std::memset(out, 0, sizeof(float) * num_tokens * Hq * D);
  const bool decode_path = D % 16 == 0 && D <= kMaxHeadDim && Hq / sh.kv_heads <= 8;
  std::vector<Unit> units;
  std::vector<int64_t> split_rows, split_first;  // per split row: its query row, its first slot
  int64_t total_keys = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t start = cu[i], q_len = std::max<int64_t>(0, std::min<int64_t>(cu[i + 1], num_tokens) - start);
    const int64_t kv_len = kv_lens[i];
    if (q_len <= 0 || kv_len <= 0 || q_len > kv_len) continue;
    if (decode_path) {  // every row on its own: its keys are the sequence's first pos + 1
      for (int64_t r = 0; r < q_len; ++r) {
        const int64_t pos = kv_len - q_len + r, key_lo = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
        units.push_back({i, start + r, 1, pos, key_lo, pos + 1, -1, pos + 1 - key_lo});
      }
    } else {
      for (int64_t r = 0; r < q_len; r += kTileRows) {
        const int64_t nrows = std::min<int64_t>(kTileRows, q_len - r), pos = kv_len - q_len + r;
        units.push_back({i, start + r, nrows, pos, 0, 0, -1, nrows * (pos + nrows)});
      }
    }
  }
  for (const Unit& w : units) total_keys += w.cost;
  const int threads = total_keys >= kMinTeamCost ? team.max_threads() : 1;
  const int64_t slice_keys = (std::max(kMinSliceKeys, total_keys / (kSlicesPerThread * threads)) + B - 1) / B * B;
  int64_t slots = 0;
  for (size_t u = 0, n = units.size(); u < n; ++u) {
    const Unit whole = units[u];
    if (!whole.decode() || threads == 1 || whole.key_hi - whole.key_lo <= slice_keys) continue;
    split_rows.push_back(whole.row);
    split_first.push_back(slots);
    // slices start on block boundaries, so a group of keys never spans two slices' blocks
    for (int64_t lo = whole.key_lo, first = 1; lo < whole.key_hi; first = 0) {
      const int64_t hi = std::min(whole.key_hi, (lo + slice_keys) / B * B);
      const Unit piece{whole.seq, whole.row, 1, whole.pos, lo, hi, slots++, hi - lo};
      if (first)
        units[u] = piece;
      else
        units.push_back(piece);
      lo = hi;
    }
  }
  split_first.push_back(slots);
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });

  const int64_t layer_elems = sh.num_blocks * B * sh.kv_heads * D, state_size = Hq * (D + 2);
  const T* k_layer = k + layer * layer_elems;
  const T* v_layer = v + layer * layer_elems;
  std::vector<float> states(slots * state_size);
  const int64_t n_units = static_cast<int64_t>(units.size()), n_split = static_cast<int64_t>(split_rows.size());
  team.ForEach(threads, n_units, 1, [&](int64_t u) {
    static thread_local std::vector<float> scratch, state;  // reused across calls
    const Unit& w = units[u];
    const int32_t* table = tables + w.seq * sh.max_blocks;
    if (!w.decode()) {
      attend_tile(q, k_layer, v_layer, table, sh, w.row, w.nrows, w.pos, sm_scale, window, soft_cap, out, scratch);
    } else if (w.slice >= 0) {
      attend_decode(q + w.row * Hq * D, k_layer, v_layer, table, sh, w.key_lo, w.key_hi, sm_scale, soft_cap,
                    states.data() + w.slice * state_size, scratch);
    } else {
      state.resize(state_size);
      attend_decode(q + w.row * Hq * D, k_layer, v_layer, table, sh, w.key_lo, w.key_hi, sm_scale, soft_cap,
                    state.data(), scratch);
      merge_states(state.data(), 1, Hq, D, out + w.row * Hq * D);
    }
  });
  team.ForEach(threads, n_split, 1, [&](int64_t i) {
    merge_states(states.data() + split_first[i] * state_size, split_first[i + 1] - split_first[i], Hq, D,
                 out + split_rows[i] * Hq * D);
  });
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                int32_t sliding_window, float soft_cap) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || (kd.size() != 4 && kd.size() != 5) || td.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: bad ranks");
  if (k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: k and v caches differ in dtype");
  const size_t o = kd.size() - 4;
  const int64_t num_layers = o ? kd[0] : 1;
  Shape sh{kd[o], kd[o + 1], kd[o + 2], kd[o + 3], qd[1], td[1]};
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= num_layers)
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: layer out of range");
  const int64_t max_seqs = kv_lens.dimensions()[0];
  const int64_t n = std::min<int64_t>(std::max<int32_t>(num_seqs.typed_data()[0], 0), max_seqs);
  const auto* qp = q.typed_data();
  float* op = out->typed_data();
  const Team team(pool);
  switch (k_cache.element_type()) {
    case ffi::DataType::F32:
      run(team, qp, static_cast<const float*>(k_cache.untyped_data()), static_cast<const float*>(v_cache.untyped_data()),
          kv_lens.typed_data(), block_tables.typed_data(), cu_q_lens.typed_data(), n, lay, sh, qd[0], sm_scale,
          sliding_window, soft_cap, op);
      break;
    case ffi::DataType::BF16:
      run(team, qp, static_cast<const uint16_t*>(k_cache.untyped_data()),
          static_cast<const uint16_t*>(v_cache.untyped_data()), kv_lens.typed_data(), block_tables.typed_data(),
          cu_q_lens.typed_data(), n, lay, sh, qd[0], sm_scale, sliding_window, soft_cap, op);
      break;
    default:
      return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: cache dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// --- Writing a step's keys and values --------------------------------------------------------
//
// XLA's CPU backend expands every scatter into a while loop of one dynamic-update-slice per
// index (~10 thunks an iteration): writing 64 rows into 30 layers' K and V cost ~15 ms of a
// ~170 ms decode step, 512 rows ~8x that. Here it is one row copy per token. The caches are
// aliased to the outputs, so on a donated cache this writes in place.

inline uint16_t to_bf16(float f) {  // round to nearest even, as jnp's astype
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);  // NaN stays NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}
inline void store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

template <typename T>
void write_rows(T* cache, const float* rows, const int32_t* slots, int64_t num_rows, int64_t row_elems,
                int64_t num_slots) {
  for (int64_t t = 0; t < num_rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;  // out of range: dropped, as jnp's scatter drops it
    store(cache + slot * row_elems, rows + t * row_elems, row_elems);
  }
}

ffi::Error WriteKv(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> k_out,
                   ffi::Result<ffi::AnyBuffer> v_out) {
  auto kd = k_cache.dimensions(), rd = k.dimensions();
  if ((kd.size() != 4 && kd.size() != 5) || rd.size() != 3 || v.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("write_kv_cpu: bad ranks");
  const size_t o = kd.size() - 4;
  const int64_t num_layers = o ? kd[0] : 1, num_slots = kd[o] * kd[o + 1], row_elems = kd[o + 2] * kd[o + 3];
  if (rd[1] * rd[2] != row_elems || slot_mapping.dimensions()[0] < rd[0])
    return ffi::Error::InvalidArgument("write_kv_cpu: rows do not match the cache");
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= num_layers) return ffi::Error::InvalidArgument("write_kv_cpu: layer out of range");
  if (k_out->untyped_data() != k_cache.untyped_data() || v_out->untyped_data() != v_cache.untyped_data())
    return ffi::Error::Internal("write_kv_cpu: the caches must be aliased to the outputs");
  const int64_t offset = lay * num_slots * row_elems;
  for (auto [cache, rows] : {std::pair{k_out->untyped_data(), k.typed_data()}, {v_out->untyped_data(), v.typed_data()}}) {
    switch (k_cache.element_type()) {
      case ffi::DataType::F32:
        write_rows(static_cast<float*>(cache) + offset, rows, slot_mapping.typed_data(), rd[0], row_elems, num_slots);
        break;
      case ffi::DataType::BF16:
        write_rows(static_cast<uint16_t*>(cache) + offset, rows, slot_mapping.typed_data(), rd[0], row_elems,
                   num_slots);
        break;
      default:
        return ffi::Error::InvalidArgument("write_kv_cpu: cache dtype must be float32 or bfloat16");
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteKvCpu, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
