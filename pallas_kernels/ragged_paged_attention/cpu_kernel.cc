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
//   FMAs and a transpose-add reduction (`attend_group`). A prefill chunk's rows go up to
//   kChunkRows to a unit, each over its causal prefix, the rows innermost (`attend_rows`): each
//   group of keys is read once per unit, from L1 by all but the first row (one unit per row
//   re-read a long prompt's prefix from L3 row by row; both measured 1.5-2x faster than the
//   row-by-row tile, attend.h, on prefill and mixed batches).
// - otherwise, a tile of up to kTileRows query rows of one sequence, all heads, row by row.
// Either walks its blocks through the table in order, so every K/V byte is read once per unit
// from its contiguous [B, Hkv, D] block (all heads at once). Softmax is online (running max
// and sum per row and head) in float32.
//
// This file holds the unit planning (`run`) and the FFI handlers (attention, and the KV write);
// the units' attention is attend.h's. cpu_ffi.py compiles this file alone, keyed by every file it
// includes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../cpu_team.h"
#include "attend.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxllm_team::Team;

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
// A prefill chunk's rows per unit (attend_rows), while each thread still gets kChunkUnitsPerThread units: a unit
// per row re-read its whole prefix per row (from L3 for a long prompt).
constexpr int64_t kChunkRows = 8, kChunkUnitsPerThread = 2;

template <typename T>
void run(const Team& team, const float* q, const T* k, const T* v, const int32_t* kv_lens, const int32_t* tables,
         const int32_t* cu, int64_t num_seqs, int64_t layer, const Shape& sh, int64_t num_tokens,
         float sm_scale, int32_t window, float soft_cap, const float* sinks, float* out) {
  const int64_t Hq = sh.q_heads, D = sh.head_dim, B = sh.block_size;
  std::memset(out, 0, sizeof(float) * num_tokens * Hq * D);
  const bool decode_path = D % 16 == 0 && D <= kMaxHeadDim && Hq / sh.kv_heads <= 8;
  std::vector<Unit> units;
  std::vector<int64_t> split_rows, split_first;  // per split row: its query row, its first slot
  int64_t total_keys = 0, chunk_rows = 0;
  const auto q_len_of = [&](int64_t i) { return std::max<int64_t>(0, std::min<int64_t>(cu[i + 1], num_tokens) - cu[i]); };
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = q_len_of(i);
    if (q_len > 1 && q_len <= kv_lens[i]) chunk_rows += q_len;
  }
  // rows of a prefill chunk per unit (attend_rows): up to kChunkRows, as long as each thread gets a few units
  const int64_t rows_per_unit =
      window > 0 ? 1 : std::clamp<int64_t>(chunk_rows / (kChunkUnitsPerThread * team.max_threads()), 1, kChunkRows);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t start = cu[i], q_len = q_len_of(i);
    const int64_t kv_len = kv_lens[i];
    if (q_len <= 0 || kv_len <= 0 || q_len > kv_len) continue;
    if (decode_path && q_len > 1 && rows_per_unit > 1) {  // a chunk's rows a few at a time, each over its prefix
      for (int64_t r = 0; r < q_len; r += rows_per_unit) {
        const int64_t nrows = std::min(rows_per_unit, q_len - r), pos = kv_len - q_len + r;
        units.push_back({i, start + r, nrows, pos, 0, pos + nrows, -1, nrows * (pos + nrows)});
      }
    } else if (decode_path) {  // every row on its own: its keys are the sequence's first pos + 1
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
    if (!whole.decode() || whole.nrows > 1 || threads == 1 || whole.key_hi - whole.key_lo <= slice_keys) continue;
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
      attend_tile(q, k_layer, v_layer, table, sh, w.row, w.nrows, w.pos, sm_scale, window, soft_cap, sinks, out,
                  scratch);
    } else if (w.nrows > 1) {
      state.resize(w.nrows * state_size);
      attend_rows(q + w.row * Hq * D, w.nrows, w.pos, k_layer, v_layer, table, sh, sm_scale, soft_cap, state.data(),
                  scratch);
      for (int64_t r = 0; r < w.nrows; ++r)
        merge_states(state.data() + r * state_size, 1, Hq, D, sinks, out + (w.row + r) * Hq * D);
    } else if (w.slice >= 0) {
      attend_decode(q + w.row * Hq * D, k_layer, v_layer, table, sh, w.key_lo, w.key_hi, sm_scale, soft_cap,
                    states.data() + w.slice * state_size, scratch);
    } else {
      state.resize(state_size);
      attend_decode(q + w.row * Hq * D, k_layer, v_layer, table, sh, w.key_lo, w.key_hi, sm_scale, soft_cap,
                    state.data(), scratch);
      merge_states(state.data(), 1, Hq, D, sinks, out + w.row * Hq * D);
    }
  });
  team.ForEach(threads, n_split, 1, [&](int64_t i) {
    merge_states(states.data() + split_first[i] * state_size, split_first[i + 1] - split_first[i], Hq, D, sinks,
                 out + split_rows[i] * Hq * D);
  });
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                float sm_scale, int32_t sliding_window, float soft_cap) {
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
  if (sinks.element_count() != 0 && sinks.element_count() != qd[1])
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: sinks must hold one logit per query head");
  const float* sp = sinks.element_count() ? sinks.typed_data() : nullptr;  // none: an empty buffer
  float* op = out->typed_data();
  const Team team(pool);
  switch (k_cache.element_type()) {
    case ffi::DataType::F32:
      run(team, qp, static_cast<const float*>(k_cache.untyped_data()), static_cast<const float*>(v_cache.untyped_data()),
          kv_lens.typed_data(), block_tables.typed_data(), cu_q_lens.typed_data(), n, lay, sh, qd[0], sm_scale,
          sliding_window, soft_cap, sp, op);
      break;
    case ffi::DataType::BF16:
      run(team, qp, static_cast<const uint16_t*>(k_cache.untyped_data()),
          static_cast<const uint16_t*>(v_cache.untyped_data()), kv_lens.typed_data(), block_tables.typed_data(),
          cu_q_lens.typed_data(), n, lay, sh, qd[0], sm_scale, sliding_window, soft_cap, sp, op);
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
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks: [Hq], or empty
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
