// The values of jaxllm's two C++ CPU kernels on the target this file is compiled for, against a
// float64 oracle computed here with plain loops. Standalone (no Python, no jaxlib at run time), so
// it runs where there is no machine: tests/kernels/test_cross_targets.py cross-compiles it for
// aarch64 and runs the NEON code under qemu-aarch64, and runs it natively too.
//
// Both kernel sources are included whole (with the job headers they include), each in a namespace
// of its own, so their internal functions (anonymous namespace) are callable here. Prints one line per case, then
// "N passed, M failed"; exits 1 on any failure.
//
// Build: g++ -O3 -ffast-math -std=c++17 -fopenmp-simd -pthread -march=... -I$(jax.ffi.include_dir()) harness.cc

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "../../../pallas_kernels/cpu_simd.h"
#include "../../../pallas_kernels/cpu_team.h"
#include "xla/ffi/api/ffi.h"

// Every header the kernels include is already included above (include guards make theirs no-ops),
// so each namespace holds only that kernel's own code: names may repeat (kTileRows is in both).
namespace matmul {
#include "../../../pallas_kernels/stacked_matmul/cpu_kernel.cc"
}  // namespace matmul
namespace attention {
#include "../../../pallas_kernels/ragged_paged_attention/cpu_kernel.cc"
}  // namespace attention

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// The kernels' helper tasks each on a thread of its own (in the engine: XLA's intra-op pool), joined at exit
struct Helpers {
  std::mutex mu;
  std::vector<std::thread> threads;
  void Start(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu);
    threads.emplace_back(std::move(task));
  }
  void Join() {
    for (std::thread& t : threads) t.join();
  }
} helpers;
// four threads whatever the machine: shared panels and the long row's slices are exercised
const jaxllm_team::Team kTeam(4, [](std::function<void()> task) { helpers.Start(std::move(task)); });

struct Rng {  // splitmix64: the same numbers on every target
  uint64_t s;
  float Uniform() {  // in [-1, 1)
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return static_cast<float>((z ^ (z >> 31)) >> 40) * 0x1p-23f - 1.f;
  }
  int64_t Below(int64_t n) { return static_cast<int64_t>((Uniform() + 1.f) * 0.5f * n) % n; }
};

uint16_t ToBf16(float f) {  // round to nearest even, as jnp's astype (NaN stays NaN)
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
float Widen(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
float Widen(float f) { return f; }
template <typename T>
std::vector<T> Stored(const std::vector<float>& v) {  // v as the kernel stores it: float32 or bfloat16
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, float>)
      out[i] = v[i];
    else
      out[i] = ToBf16(v[i]);
  }
  return out;
}
template <typename T>
std::vector<float> Widened(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Widen(v[i]);
  return out;
}

// By its bits: -ffast-math (which the kernels need, so this file has it too) lets the compiler
// assume no value is NaN, and fold std::isnan or a comparison with a NaN away.
bool Finite(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return (b & 0x7f800000u) != 0x7f800000u;
}

int passed = 0, failed = 0;

void Report(const std::string& name, bool ok, const std::string& detail) {
  std::printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  ++(ok ? passed : failed);
}

// --- stacked matmul: y = x @ w[layer] -------------------------------------------------------------

constexpr int64_t kLayers = 3, kLayer = 1;  // every other layer NaN: a kernel reading outside its layer fails
constexpr int64_t kK = 66;                  // even (bfloat16 pairs), not a multiple of any vector
constexpr int64_t kN = 105;                 // unpacked: a last panel narrower than 32 columns
constexpr int64_t kNPacked = 96;            // packed: whole panels

std::vector<float> Stack(Rng& rng, int64_t k, int64_t n) {
  std::vector<float> w(kLayers * k * n, kNaN);
  for (int64_t i = 0; i < k * n; ++i) w[kLayer * k * n + i] = 0.05f * rng.Uniform();
  return w;
}

// Each layer [K, N] as `pack` (pallas_kernels/stacked_matmul/__init__.py) lays it out: panels of 32
// columns, [N / 32, K / pair, 32, pair] (pair 2 for bfloat16: the two of each pair of K side by side).
template <typename W>
std::vector<W> Pack(const std::vector<W>& w, int64_t k, int64_t n, int pair) {
  std::vector<W> out(w.size());
  size_t i = 0;
  for (int64_t l = 0; l < kLayers; ++l)
    for (int64_t p = 0; p < n / matmul::kPanel; ++p)
      for (int64_t kk = 0; kk < k / pair; ++kk)
        for (int64_t c = 0; c < matmul::kPanel; ++c)
          for (int j = 0; j < pair; ++j) out[i++] = w[(l * k + kk * pair + j) * n + p * matmul::kPanel + c];
  return out;
}

// The kernel's y against x @ w[kLayer] in float64: |y - want| <= 2e-4 |want| + 2e-5 everywhere. bfloat16
// cases pass the rounded values, so only the float32 accumulation may differ.
void CheckMatmul(const std::string& name, const std::vector<float>& x, int64_t rows, const std::vector<float>& w,
                 int64_t n, const std::vector<float>& y, int64_t k_dim = kK) {
  double worst = 0;  // largest |y - want| / tolerance
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double want = 0;
      for (int64_t k = 0; k < k_dim; ++k) want += double(x[r * k_dim + k]) * w[(kLayer * k_dim + k) * n + c];
      const float got = y[r * n + c];
      const double e = std::fabs(got - want) / (2e-5 + 2e-4 * std::fabs(want));
      if (!Finite(got) || e > 1) ++bad;
      if (Finite(got)) worst = std::max(worst, e);
    }
  char detail[128];
  std::snprintf(detail, sizeof detail, "%lld of %lld outside tolerance, worst error/tolerance %.3f", (long long)bad,
                (long long)(rows * n), worst);
  Report(name, bad == 0, detail);
}

void MatmulCases(Rng& rng) {
  const std::vector<float> w = Stack(rng, kK, kN);
  const std::vector<float> w32 = Stack(rng, kK, kNPacked);
  const std::vector<uint16_t> w16 = Stored<uint16_t>(w32);
  const std::vector<float> packed32 = Pack(w32, kK, kNPacked, 1);
  const std::vector<uint16_t> packed16 = Pack(w16, kK, kNPacked, 2);
  const int64_t layer = kLayer * kK * kN, layer_packed = kLayer * kK * kNPacked;
  for (int64_t rows : {1, 3, 8, 13, 37}) {  // every tile remainder, one thread and a team (>= 16 rows)
    std::vector<float> x(rows * kK);
    for (float& v : x) v = rng.Uniform();
    const std::string r = " rows=" + std::to_string(rows);
    std::vector<float> y(rows * kN, kNaN);
    matmul::Stream(x.data(), rows, kK, w.data() + layer, kN, y.data());
    CheckMatmul("matmul Stream float32" + r, x, rows, w, kN, y);
    std::fill(y.begin(), y.end(), kNaN);
    matmul::Panels(kTeam, x.data(), rows, kK, w.data() + layer, kN, y.data());
    CheckMatmul("matmul Panels float32" + r, x, rows, w, kN, y);

    std::vector<float> yp(rows * kNPacked, kNaN);
    matmul::PackedPanels(kTeam, x.data(), rows, kK, packed32.data() + layer_packed, kNPacked, yp.data());
    CheckMatmul("matmul PackedPanels float32" + r, x, rows, w32, kNPacked, yp);

    const std::vector<uint16_t> x16 = Stored<uint16_t>(x);  // as Impl passes bfloat16 x
    std::fill(yp.begin(), yp.end(), kNaN);
    matmul::PackedPanels(kTeam, matmul::Bf16Rows(x16.data(), rows * kK), rows, kK / 2, packed16.data() + layer_packed,
                         kNPacked, yp.data());
    CheckMatmul("matmul PackedPanels bfloat16" + r, Widened(x16), rows, Widened(w16), kNPacked, yp);
  }
}

// --- quantized matmul: y = x @ dequantized w[layer] (quantized.py's formats, packed) ---------------

float HalfToFloat(uint16_t h) {  // exact, by the formula: sign, 5-bit exponent, 10-bit mantissa
  const int e = (h >> 10) & 31, m = h & 1023;
  const float mag = e ? std::ldexp(1.f + m / 1024.f, e - 15) : std::ldexp(m / 1024.f, -14);
  return (h & 0x8000) ? -mag : mag;
}

struct QuantCase {
  const char* name;
  int bits;
  int64_t group;  // 0: K (one scale per column)
  bool has_min;
};
constexpr QuantCase kQuantCases[] = {
    {"q8_0", 8, 32, false}, {"int8", 8, 0, false}, {"q4_0", 4, 32, false}, {"q4_1", 4, 32, true}, {"q4 G=64", 4, 64, false},
};
constexpr int64_t kQK = 192, kQN = 96;  // K: several groups of 32 and of 64; N: three panels

// A random nonzero float16 scale or min: exponent in [-9, -5], a random mantissa and sign; now and then a
// subnormal (the conversions' other case).
uint16_t RandomHalf(Rng& rng, bool positive) {
  const uint16_t mantissa = static_cast<uint16_t>(rng.Below(1024));
  const uint16_t bits = rng.Below(16) == 0 ? static_cast<uint16_t>(mantissa | 1)
                                           : static_cast<uint16_t>(((6 + rng.Below(5)) << 10) | mantissa);
  return static_cast<uint16_t>(bits | (!positive && rng.Below(2) ? 0x8000 : 0));
}

void QuantCases(Rng& rng) {
  for (const QuantCase& c : kQuantCases) {
    const int64_t group = c.group ? c.group : kQK, groups = kQK / group, q_rows = c.bits == 4 ? kQK / 2 : kQK;
    // each layer's quants [q_rows, N] and scales / mins [groups, N] in the logical layout, other layers' scales NaN
    std::vector<uint8_t> qs(kLayers * q_rows * kQN);
    std::vector<uint16_t> d(kLayers * groups * kQN, 0x7e00), m(c.has_min ? d.size() : 0, 0x7e00);
    for (auto& q : qs) {
      q = static_cast<uint8_t>(rng.Below(256));
      if (c.bits == 8 && (q == 0 || q == 0x80)) q = 1;  // 8-bit quants in [-127, 127], the formats' range
    }
    for (int64_t i = kLayer * groups * kQN; i < (kLayer + 1) * groups * kQN; ++i) {
      d[i] = RandomHalf(rng, c.has_min);
      if (c.has_min) m[i] = static_cast<uint16_t>(RandomHalf(rng, true) | 0x8000);
    }
    // the float weights of kLayer ([K, N], kK rows as CheckMatmul reads them: laid out as a [kLayers, K, N] stack)
    std::vector<float> w(kLayers * kQK * kQN, 0.f);
    for (int64_t k = 0; k < kQK; ++k)
      for (int64_t n = 0; n < kQN; ++n) {
        const int64_t g = k / group, s = (kLayer * groups + g) * kQN + n;
        int q;
        if (c.bits == 8) {
          q = static_cast<int8_t>(qs[(kLayer * q_rows + k) * kQN + n]);
        } else {
          const int64_t b = k / 32, j = k % 32;
          const uint8_t byte = qs[(kLayer * q_rows + 16 * b + j % 16) * kQN + n];
          q = j < 16 ? byte & 15 : byte >> 4;
        }
        const float dv = HalfToFloat(d[s]);
        w[(kLayer * kQK + k) * kQN + n] = c.bits == 8 ? dv * q : c.has_min ? dv * q + HalfToFloat(m[s]) : dv * (q - 8);
      }
    const std::vector<uint8_t> qp = Pack(qs, q_rows, kQN, 1);
    // scales and mins packed alike: stacks of [groups, N]
    std::vector<uint16_t> dp(d.size()), mp(m.size());
    for (int64_t l = 0, i = 0; l < kLayers; ++l)
      for (int64_t p = 0; p < kQN / matmul::kPanel; ++p)
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t col = 0; col < matmul::kPanel; ++col, ++i) {
            const int64_t from = (l * groups + g) * kQN + p * matmul::kPanel + col;
            dp[i] = d[from];
            if (c.has_min) mp[i] = m[from];
          }
    const matmul::QuantLayer layer{qp.data() + kLayer * q_rows * kQN, dp.data() + kLayer * groups * kQN,
                                   c.has_min ? mp.data() + kLayer * groups * kQN : nullptr, kQK, group, kQN};
    for (int64_t rows : {1, 2, 3, 5, 8, 9, 17, 37}) {  // both regimes, every strip remainder, a team
      std::vector<float> x(rows * kQK);
      for (float& v : x) v = rng.Uniform();
      std::vector<float> y(rows * kQN, kNaN);
      matmul::QuantMatmul(kTeam, x.data(), rows, layer, c.bits, y.data());
      CheckMatmul(std::string("quantized ") + c.name + " rows=" + std::to_string(rows), x, rows, w, kQN, y, kQK);
      // the integer path: against x as its int8 blocks hold it (the integer sums exact, the scales float32); few
      // rows take it where the target arranges quads in registers
      if (rows <= matmul::kQuantStreamRows && !jaxllm_simd::kQuadsInRegisters) continue;
      std::fill(y.begin(), y.end(), kNaN);
      matmul::QuantMatmul(kTeam, x.data(), rows, layer, c.bits, y.data(), 1);
      const matmul::QuantizedRows xq = matmul::QuantizeRows(kTeam, x.data(), rows, kQK);
      std::vector<float> x8(x.size());
      for (size_t i = 0; i < x.size(); ++i) x8[i] = xq.a[i / matmul::kQ8Block] * xq.q[i];
      CheckMatmul(std::string("quantized int8-dot ") + c.name + " rows=" + std::to_string(rows), x8, rows, w, kQN, y,
                  kQK);
    }
  }
}

// --- ragged paged attention ---------------------------------------------------------------------

struct Seq {
  int64_t q_len, kv_len;
};
// a decode row, a prefill chunk continuing a context (two row tiles), a long row (split over threads)
constexpr Seq kSeqs[] = {{1, 37}, {19, 50}, {1, 3600}};
constexpr int64_t kNumSeqs = 3, kMaxSeqs = 5;  // two padded sequence entries (kv_len 0)
constexpr int64_t kCacheLayers = 2, kCacheLayer = 1;

struct AttentionCase {
  const char* name;
  int64_t head_dim, block_size, kv_heads, q_heads;
  int32_t window;  // 0: none
  float soft_cap;  // 0: none
};
constexpr AttentionCase kAttentionCases[] = {
    {"decode path", 64, 16, 2, 4, 0, 0.f},
    {"decode path, window 40, soft cap 20, group 3", 64, 8, 2, 6, 40, 20.f},
    {"row tiles (head_dim 30)", 30, 16, 2, 2, 0, 0.f},
};

// A batch over a hostile cache (as pallas_kernels/ragged_paged_attention/testing.py builds it): NaN in
// every block no sequence needs, in the other layer, in table entries outside a sequence's needed
// blocks and in q's padding rows; large stale values past each context in its last block.
template <typename T>
void CheckAttention(Rng& rng, const AttentionCase& c) {
  const int64_t D = c.head_dim, B = c.block_size, Hkv = c.kv_heads, Hq = c.q_heads, G = Hq / Hkv;
  std::vector<int64_t> need_lo, need_hi;  // each sequence's blocks [lo, hi)
  int64_t used = 0, total_rows = 0, max_blocks = 0;
  for (const Seq& s : kSeqs) {
    const int64_t first_key = c.window > 0 ? std::max<int64_t>(0, s.kv_len - s.q_len - c.window + 1) : 0;
    need_lo.push_back(first_key / B);
    need_hi.push_back((s.kv_len - 1) / B + 1);
    used += need_hi.back() - need_lo.back();
    total_rows += s.q_len;
    max_blocks = std::max(max_blocks, need_hi.back() + 2);
  }
  const int64_t num_blocks = used + 4, num_tokens = total_rows + 3, row = Hkv * D;
  std::vector<int64_t> perm(num_blocks);  // blocks in random order: real ones first, then NaN ones
  for (int64_t i = 0; i < num_blocks; ++i) perm[i] = i;
  for (int64_t i = num_blocks - 1; i > 0; --i) std::swap(perm[i], perm[rng.Below(i + 1)]);

  const int64_t layer_elems = num_blocks * B * row;
  std::vector<float> kf(kCacheLayers * layer_elems, kNaN), vf(kf.size(), kNaN);
  std::vector<int32_t> tables(kMaxSeqs * max_blocks), kv_lens(kMaxSeqs, 0), cu(kMaxSeqs + 1, int32_t(total_rows));
  for (int32_t& t : tables) t = int32_t(perm[used + rng.Below(num_blocks - used)]);  // a NaN block
  cu[0] = 0;
  for (int64_t i = 0, next = 0; i < kNumSeqs; ++i) {
    kv_lens[i] = int32_t(kSeqs[i].kv_len);
    cu[i + 1] = int32_t(cu[i] + kSeqs[i].q_len);
    for (int64_t b = need_lo[i]; b < need_hi[i]; ++b) {
      const int64_t block = perm[next++];
      tables[i * max_blocks + b] = int32_t(block);
      for (int64_t t = 0; t < B; ++t) {
        const float scale = b * B + t < kSeqs[i].kv_len ? 1.f : 100.f;  // stale past the context
        for (int64_t e = 0; e < row; ++e) {
          const int64_t at = kCacheLayer * layer_elems + (block * B + t) * row + e;
          kf[at] = scale * rng.Uniform();
          vf[at] = scale * rng.Uniform();
        }
      }
    }
  }
  const std::vector<T> k = Stored<T>(kf), v = Stored<T>(vf);
  std::vector<float> q(num_tokens * Hq * D, kNaN);
  for (int64_t i = 0; i < total_rows * Hq * D; ++i) q[i] = 2.f * rng.Uniform();

  attention::Shape sh{};
  sh.num_blocks = num_blocks;
  sh.block_size = B;
  sh.kv_heads = Hkv;
  sh.head_dim = D;
  sh.q_heads = Hq;
  sh.max_blocks = max_blocks;
  const float sm_scale = 1.f / std::sqrt(float(D));
  std::vector<float> out(num_tokens * Hq * D, kNaN);
  attention::run<T>(kTeam, q.data(), k.data(), v.data(), kv_lens.data(), tables.data(), cu.data(), kNumSeqs, kCacheLayer,
                    sh, num_tokens, sm_scale, c.window, c.soft_cap, /*sinks=*/nullptr, out.data());

  // The oracle, per real row and head: softmax over the row's keys read through the table, in float64.
  // The worst relative L2 error of a (row, head) must be <= 2e-4; padding rows must be zeros.
  double worst = 0;
  int64_t bad = 0;
  std::vector<double> p, o(D);
  for (int64_t i = 0; i < kNumSeqs; ++i)
    for (int64_t j = 0; j < kSeqs[i].q_len; ++j) {
      const int64_t tok = cu[i] + j, pos = kSeqs[i].kv_len - kSeqs[i].q_len + j;
      const int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
      for (int64_t h = 0; h < Hq; ++h) {
        auto at = [&](int64_t t) {  // key t of this row's KV head
          return kCacheLayer * layer_elems + (tables[i * max_blocks + t / B] * B + t % B) * row + (h / G) * D;
        };
        p.assign(pos + 1 - lo, 0.0);
        double mx = -1e300, sum = 0;
        for (int64_t t = lo; t <= pos; ++t) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += double(q[(tok * Hq + h) * D + d]) * Widen(k[at(t) + d]);
          s *= sm_scale;
          if (c.soft_cap > 0) s = c.soft_cap * std::tanh(s / c.soft_cap);
          mx = std::max(mx, p[t - lo] = s);
        }
        for (double& e : p) sum += (e = std::exp(e - mx));
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t t = lo; t <= pos; ++t)
          for (int64_t d = 0; d < D; ++d) o[d] += p[t - lo] / sum * Widen(v[at(t) + d]);
        double num = 0, den = 0;
        bool finite = true;
        for (int64_t d = 0; d < D; ++d) {
          const float got = out[(tok * Hq + h) * D + d];
          finite = finite && Finite(got);
          num += (got - o[d]) * (got - o[d]);
          den += o[d] * o[d];
        }
        const double err = std::sqrt(num) / std::max(std::sqrt(den), 1e-6);
        if (!finite || err > 2e-4) ++bad;
        if (finite) worst = std::max(worst, err);
      }
    }
  int64_t nonzero_padding = 0;
  for (int64_t i = total_rows * Hq * D; i < num_tokens * Hq * D; ++i) {
    uint32_t b;
    std::memcpy(&b, &out[i], sizeof b);
    nonzero_padding += b != 0;
  }
  char detail[160];
  std::snprintf(detail, sizeof detail, "%lld of %lld (row, head) outside 2e-4, worst relative error %.2e%s",
                (long long)bad, (long long)(total_rows * Hq), worst, nonzero_padding ? ", padding rows not zero" : "");
  Report(std::string("attention ") + (std::is_same_v<T, float> ? "float32 " : "bfloat16 ") + c.name,
         bad == 0 && nonzero_padding == 0, detail);
}

}  // namespace

int main() {
  std::printf("isa %s, %d float32 lanes, %d threads, integer dot %s\n", jaxllm_simd::kIsa, jaxllm_simd::kLanes,
              kTeam.max_threads(), jaxllm_simd::kIntDot);
  Rng rng{20240601};
  MatmulCases(rng);
  QuantCases(rng);
  for (const AttentionCase& c : kAttentionCases) {
    CheckAttention<float>(rng, c);
    CheckAttention<uint16_t>(rng, c);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  helpers.Join();
  return failed ? 1 : 0;
}
