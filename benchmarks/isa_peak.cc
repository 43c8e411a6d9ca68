// The CPU's own instruction ceilings, apart from any kernel: how many int8 dot products (the integer path's
// DotBytes instruction: vpdpbusd, pmaddubsw + pmaddwd, sdot) and float32 FMAs a core retires a second, each with
// 12 independent accumulators in registers and no memory traffic. machine_ceilings.py builds this with the
// kernels' compiler and -march (JAXLLM_CPU_MARCH) and runs it on every core at once; the kernels' own ceilings
// (`matmul_int8_gflops`, `matmul_float32_gflops`) are then stated against it.
//
//   c++ -O2 -march=native -pthread benchmarks/isa_peak.cc -o isa_peak && ./isa_peak 2
//
// `int8_tile_gops`: the same instruction in the integer path's register tile with its per-block float scaling
// (Tile, below), operands in L1. Prints one JSON object: operations a second (a multiply-add counts 2), over all
// threads.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define VREG "+v"  // any vector register (xmm/ymm/zmm 0-31)
#elif defined(__aarch64__)
#include <arm_neon.h>
#define VREG "+w"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr long kSteps = 20'000'000;  // per accumulator: ~0.1-0.3 s a run
constexpr int kAcc = 12;

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
using VecI = __m512i;
constexpr const char* kDot = "vpdpbusd zmm (AVX512-VNNI)";
constexpr int kDotMacs = 64;
inline VecI Dot(VecI acc, VecI w, VecI x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline VecI Splat(int v) { return _mm512_set1_epi32(v); }
inline long Sum(VecI v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
using VecI = __m256i;
constexpr int kDotMacs = 32;
inline VecI Splat(int v) { return _mm256_set1_epi32(v); }
inline long Sum(VecI v) {
  alignas(32) int lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  long s = 0;
  for (int lane : lanes) s += lane;
  return s;
}
#if defined(__AVXVNNI__)
constexpr const char* kDot = "vpdpbusd ymm (AVX-VNNI)";
inline VecI Dot(VecI acc, VecI w, VecI x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
constexpr const char* kDot = "pmaddubsw + pmaddwd + paddd ymm (AVX2)";
inline VecI Dot(VecI acc, VecI w, VecI x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
// 4-bit quants (0..15) by int8 x: a block's 8 steps fit int16 lanes, widened once a block (cpu_simd.h's DotNibbles)
#define HAS_NIBBLE_DOTS 1
inline VecI NibbleDot(VecI acc16, VecI w, VecI x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x)); }
inline VecI FinishNibbles(VecI acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
#endif
#elif defined(__ARM_FEATURE_DOTPROD)
using VecI = int32x4_t;
constexpr const char* kDot = "sdot (armv8.2-a+dotprod)";
constexpr int kDotMacs = 16;
inline VecI Dot(VecI acc, VecI w, VecI x) { return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(x)); }
inline VecI Splat(int v) { return vdupq_n_s32(v); }
inline long Sum(VecI v) { return vaddvq_s32(v); }
#endif
#if defined(__AVX2__) || defined(__ARM_FEATURE_DOTPROD)
#define HAS_DOT 1
#endif
#if defined(HAS_DOT) && !defined(HAS_NIBBLE_DOTS)
inline VecI NibbleDot(VecI acc, VecI w, VecI x) { return Dot(acc, w, x); }
inline VecI FinishNibbles(VecI acc) { return acc; }
#endif

#if defined(__AVX512F__)
constexpr int kFloatBytes = 64;
#elif defined(__AVX__)
constexpr int kFloatBytes = 32;
#else
constexpr int kFloatBytes = 16;
#endif
typedef float VecF __attribute__((vector_size(kFloatBytes)));
constexpr int kFloatLanes = kFloatBytes / 4;

// One thread's run; the empty asm keeps the operands opaque, so the compiler can neither fold the chains nor
// hoist them out of the loop.
double Fma() {
  VecF acc[kAcc], x = VecF{} + 0.999f, w = VecF{} + 1e-7f;
  for (int a = 0; a < kAcc; ++a) acc[a] = VecF{} + static_cast<float>(a);
  for (long i = 0; i < kSteps; ++i) {
    asm volatile("" : VREG(x), VREG(w));
#pragma GCC unroll 12
    for (int a = 0; a < kAcc; ++a) acc[a] = acc[a] * x + w;
  }
  double s = 0;
  for (auto& v : acc) s += v[0];
  return s;
}

#ifdef HAS_DOT
double Dots() {
  VecI acc[kAcc], x = Splat(0x01020304), w = Splat(0x05060708);
  for (int a = 0; a < kAcc; ++a) acc[a] = Splat(a);
  for (long i = 0; i < kSteps; ++i) {
    asm volatile("" : VREG(x), VREG(w));
#pragma GCC unroll 12
    for (int a = 0; a < kAcc; ++a) acc[a] = Dot(acc[a], w, x);
  }
  long s = 0;
  for (auto& v : acc) s += Sum(v);
  return static_cast<double>(s);
}

// The integer path's register tile for 4-bit quants (int_panels.h's IntStrip: 6 rows by 2 vectors of columns, 4
// rows on 16-register targets; AVX2 sums a block's steps in int16 as DotNibbles does), its operands in L1: per 4 k,
// 2 vectors of weights and each row's 4 bytes of x broadcast, 2 dots a row; per block of 32 k, each int32 sum
// converted and scaled as a Q4_1 weight against Q8_1 x needs (acc += I * (d a) + m s: a multiply and two FMAs).
// What a format with a float scale per 32 k can reach on this core, before any memory traffic.
typedef int32_t VecI32 __attribute__((vector_size(sizeof(VecI))));
typedef float VecT __attribute__((vector_size(sizeof(VecI))));
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kTileRows = 6;  // 32 vector registers: int_panels.h's kIntRows
#else
constexpr int kTileRows = 4;  // 16
#endif
constexpr int kTileVecs = 2, kTileBlocks = 16;
constexpr long kTileDotsPerBlock = 8L * kTileRows * kTileVecs;

double Tile() {
  static thread_local int8_t x[kTileRows][kTileBlocks * 32];
  static thread_local uint8_t w[kTileBlocks * 8][kTileVecs][sizeof(VecI)];
  std::memset(x, 3, sizeof x);
  std::memset(w, 5, sizeof w);
  VecT acc[kTileRows][kTileVecs] = {}, d = VecT{} + 0.5f, m = VecT{} + 0.1f;
  for (long i = 0; i < kSteps / 8; ++i) {
    const long b = i % kTileBlocks;
    VecI dots[kTileRows][kTileVecs];
    for (auto& row : dots)
      for (auto& v : row) v = Splat(0);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      VecI wv[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) std::memcpy(&wv[v], w[b * 8 + j][v], sizeof(VecI));
#pragma GCC unroll 8
      for (int r = 0; r < kTileRows; ++r) {
        int32_t x4;
        std::memcpy(&x4, &x[r][b * 32 + 4 * j], 4);
        const VecI xs = Splat(x4);
        for (int v = 0; v < kTileVecs; ++v) dots[r][v] = NibbleDot(dots[r][v], wv[v], xs);
      }
    }
    for (auto& row : dots)
      for (auto& v : row) v = FinishNibbles(v);
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const float a = 0.01f * (r + 1), s = 0.02f * (r + b);
      for (int v = 0; v < kTileVecs; ++v)
        acc[r][v] += __builtin_convertvector((VecI32)dots[r][v], VecT) * (d * a) + m * s;
    }
  }
  double s = 0;
  for (auto& row : acc)
    for (auto& v : row) s += v[0];
  return s;
}
#endif

// Operations a second over `threads` threads running `body` at once (best of 3 runs).
template <class Body>
double Rate(int threads, long ops_per_thread, Body body) {
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    std::vector<std::thread> team;
    std::vector<double> sink(threads);
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) team.emplace_back([&, t] { sink[t] = body(); });
    for (auto& t : team) t.join();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, threads * static_cast<double>(ops_per_thread) / seconds);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  const double fma = Rate(threads, 2L * kSteps * kAcc * kFloatLanes, Fma);
  std::printf("{\"threads\": %d, \"fma_vector_bits\": %d, \"fma_float32_gflops\": %.1f", threads, 8 * kFloatBytes,
              fma / 1e9);
#ifdef HAS_DOT
  const double dot = Rate(threads, 2L * kSteps * kAcc * kDotMacs, Dots);
  const double tile = Rate(threads, 2L * (kSteps / 8) * kTileDotsPerBlock * kDotMacs, Tile);
  std::printf(", \"int8_dot\": \"%s\", \"int8_dot_gops\": %.1f, \"int8_tile_gops\": %.1f", kDot, dot / 1e9,
              tile / 1e9);
#endif
  std::printf("}\n");
}
