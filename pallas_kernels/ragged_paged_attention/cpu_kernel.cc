// Ragged paged attention for CPUs: an XLA FFI custom call (the CPU counterpart of the
// Pallas kernel; see cpu.py for why XLA's own ops cannot reach memory speed here).
//
// Same contract as the jnp reference: q [T, Hq, D] (float32), caches [L, N, B, Hkv, D] in
// float32 or bfloat16, sequence i owns query rows cu_q_lens[i]:cu_q_lens[i+1], its last row
// sits at position kv_lens[i]-1, its keys live in block_tables[i]. Rows of padding get zeros.
//
// Work unit: up to kTileRows query rows of one sequence, all heads. A unit walks its keys
// block by block through the table, from the first block its rows need to the last, so every
// K/V byte is read once per unit from its contiguous [B, Hkv, D] block (all heads at once),
// and the rows of a prefill tile share each block while it is in cache. Softmax is online
// (running max and sum per row and head) in float32. Units run in parallel (OpenMP).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
void run(const float* q, const T* k, const T* v, const int32_t* kv_lens, const int32_t* tables,
         const int32_t* cu, int64_t num_seqs, int64_t layer, const Shape& sh, int64_t num_tokens,
         float sm_scale, int32_t window, float soft_cap, float* out) {
  std::memset(out, 0, sizeof(float) * num_tokens * sh.q_heads * sh.head_dim);
  // Units: (sequence, tile of rows), flattened so OpenMP can balance them.
  std::vector<int64_t> seq_of, row_of, nrows_of, pos_of;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t start = cu[i], q_len = std::max<int64_t>(0, std::min<int64_t>(cu[i + 1], num_tokens) - start);
    const int64_t kv_len = kv_lens[i];
    if (q_len <= 0 || kv_len <= 0 || q_len > kv_len) continue;
    for (int64_t r = 0; r < q_len; r += kTileRows) {
      seq_of.push_back(i);
      row_of.push_back(start + r);
      nrows_of.push_back(std::min<int64_t>(kTileRows, q_len - r));
      pos_of.push_back(kv_len - q_len + r);
    }
  }
  const int64_t layer_elems = sh.num_blocks * sh.block_size * sh.kv_heads * sh.head_dim;
  const T* k_layer = k + layer * layer_elems;
  const T* v_layer = v + layer * layer_elems;
  const int64_t units = static_cast<int64_t>(seq_of.size());
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      attend_tile(q, k_layer, v_layer, tables + seq_of[u] * sh.max_blocks, sh, row_of[u], nrows_of[u],
                  pos_of[u], sm_scale, window, soft_cap, out, scratch);
    }
  }
}

ffi::Error Impl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
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
  switch (k_cache.element_type()) {
    case ffi::DataType::F32:
      run(qp, static_cast<const float*>(k_cache.untyped_data()), static_cast<const float*>(v_cache.untyped_data()),
          kv_lens.typed_data(), block_tables.typed_data(), cu_q_lens.typed_data(), n, lay, sh, qd[0], sm_scale,
          sliding_window, soft_cap, op);
      break;
    case ffi::DataType::BF16:
      run(qp, static_cast<const uint16_t*>(k_cache.untyped_data()),
          static_cast<const uint16_t*>(v_cache.untyped_data()), kv_lens.typed_data(), block_tables.typed_data(),
          cu_q_lens.typed_data(), n, lay, sh, qd[0], sm_scale, sliding_window, soft_cap, op);
      break;
    default:
      return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: cache dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionCpu, Impl,
                              ffi::Ffi::Bind()
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
