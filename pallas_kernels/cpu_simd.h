// The vector width and register budget of the CPU a kernel is compiled for, shared by jaxllm's C++
// kernels (cpu_ffi.py builds each with `-march=$JAXLLM_CPU_MARCH`, default native).
//
// A kernel's vectors are GCC/Clang generic vectors of exactly the target's register width: a
// vector wider than the hardware's (the 64-byte ones these kernels once used everywhere) is lowered
// through the stack on AVX2, 30-100x slower than XLA's dot. Tile shapes are derived from
// kVecRegs, the named registers the target has, so accumulators stay in registers:
//   AVX-512 (x86-64-v4)      64-byte vectors, 32 registers
//   AVX2 + FMA (x86-64-v3)   32-byte vectors, 16 registers
//   ARM64 NEON               16-byte vectors, 32 registers
//   SSE (x86-64-v2, other)   16-byte vectors, 16 registers
//
// Every decision a kernel makes by instruction set lives here (ggml's layout: one home for the per-ISA
// helpers, each with a generic fallback in plain vector code), so a kernel source holds no `#if
// defined(__AVX2__)`: it calls Load, LoadHalf, WidenBytes, the bfloat16 pair dot product or Pause, and
// asks kBf16Dot where the fast path differs in shape.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace jaxllm_simd {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64, kVecRegs = 32;
constexpr const char* kIsa = "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kVecBytes = 32, kVecRegs = 16;
constexpr const char* kIsa = "AVX2+FMA";
#elif defined(__AVX__)
constexpr int kVecBytes = 32, kVecRegs = 16;
constexpr const char* kIsa = "AVX";
#elif defined(__aarch64__)
constexpr int kVecBytes = 16, kVecRegs = 32;
constexpr const char* kIsa = "NEON";
#elif defined(__SSE2__)
constexpr int kVecBytes = 16, kVecRegs = 16;
constexpr const char* kIsa = "SSE";
#else
constexpr int kVecBytes = 16, kVecRegs = 16;
constexpr const char* kIsa = "generic";
#endif

constexpr int kLanes = kVecBytes / 4;  // float32 lanes per vector
typedef float VecF __attribute__((vector_size(kVecBytes)));
typedef uint32_t VecU __attribute__((vector_size(kVecBytes)));
typedef uint16_t VecH __attribute__((vector_size(kVecBytes / 2)));  // kLanes bfloat16 values
typedef int32_t VecI __attribute__((vector_size(kVecBytes)));

inline VecF Load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline VecU LoadU(const void* p) {
  VecU v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline VecF Load(const uint16_t* p) {  // kLanes bfloat16 -> float32: widen and shift into the high half
  VecH h;
  std::memcpy(&h, p, sizeof h);
  return (VecF)(__builtin_convertvector(h, VecU) << 16);
}
inline void Store(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }

// Lane j of one level of a transpose-add: the result's first half comes from a, its second from b,
// each taking the source's even (or, + s, odd) chunks of s lanes.
constexpr int EvenChunkLane(int s, int j) {
  const int half = kLanes / 2, jj = j % half;
  return (j < half ? 0 : kLanes) + (jj / s) * 2 * s + jj % s;
}

template <int S, int... J>
inline VecF FoldPair(VecF a, VecF b, std::integer_sequence<int, J...>) {
  return __builtin_shufflevector(a, b, EvenChunkLane(S, J)...) + __builtin_shufflevector(a, b, (EvenChunkLane(S, J) + S)...);
}

template <int S>
inline void FoldLevel(VecF* p, int n) {
  for (int i = 0; i < n / 2; ++i) p[i] = FoldPair<S>(p[2 * i], p[2 * i + 1], std::make_integer_sequence<int, kLanes>{});
  if constexpr (S > 1) FoldLevel<S / 2>(p, n / 2);
}

// The kLanes lane-sums of p[0 .. kLanes) in one vector, lane t = the sum of p[t]'s lanes:
// log2(kLanes) levels of (two shuffles, one add) per pair instead of kLanes horizontal sums.
// Overwrites p.
inline VecF LaneSums(VecF* p) {
  FoldLevel<kLanes / 2>(p, kLanes);
  return p[0];
}

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
  VecH h16;
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

// The bfloat16 dot product of pairs: lane i of DotBf16Pairs(acc, a, b) is acc[i] + a's pair i . b's pair i, a
// pair being two bfloat16 in one 32-bit word (the even k in the low half). kBf16Dot: the target has it as one
// instruction (AVX-512 BF16's vdpbf16ps, twice the float32 FMA rate), so a kernel reads x as bfloat16 pairs too
// (SplatBf16Pair); without it a kernel does better to widen x to float32 once and the weights in registers (two
// FMAs per pair: the stacked matmul's bfloat16 tile), and the generic version here, the same arithmetic in
// plain vector code, only keeps such code compiling.
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
static_assert(kLanes == 16, "vdpbf16ps takes 512-bit vectors here");
typedef __m512bh VecBf16Pairs;  // kLanes pairs
inline VecBf16Pairs LoadBf16Pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline VecBf16Pairs SplatBf16Pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)); }
inline VecF DotBf16Pairs(VecF acc, VecBf16Pairs a, VecBf16Pairs b) {
  return (VecF)_mm512_dpbf16_ps((__m512)acc, a, b);
}
#else
constexpr bool kBf16Dot = false;
typedef VecU VecBf16Pairs;
inline VecBf16Pairs LoadBf16Pairs(const uint16_t* p) { return LoadU(p); }
inline VecBf16Pairs SplatBf16Pair(uint32_t pair) { return VecU{} + pair; }
inline VecF DotBf16Pairs(VecF acc, VecBf16Pairs a, VecBf16Pairs b) {
  return acc + (VecF)(a << 16) * (VecF)(b << 16) + (VecF)(a & 0xffff0000u) * (VecF)(b & 0xffff0000u);
}
#endif

// Each lane rounded to the nearest integer, ties to even (the conversion instructions under the default rounding
// mode). An instruction of its own, so that -ffast-math cannot fuse the product rounded here into an FMA with a
// rounding constant, which rounds once instead of twice and disagrees with llama.cpp's roundf(x * id) now and then.
inline VecI RoundToInt(VecF v) {
#if defined(__AVX512F__)
  return (VecI)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX__)
  return (VecI)_mm256_cvtps_epi32((__m256)v);
#elif defined(__SSE2__)
  return (VecI)_mm_cvtps_epi32((__m128)v);
#elif defined(__aarch64__)
  return (VecI)vcvtnq_s32_f32((float32x4_t)v);
#else
  VecI out;
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<int32_t>(__builtin_nearbyintf(v[i]));
  return out;
#endif
}

// Integer dot products of bytes, for the quantized kernels' integer path (int_panels.h): lane i of
// DotBytes<BITS>(acc, w, x) is acc[i] plus the sum over j < 4 of w's byte 4i + j times x's, x signed (int8) and w
// as an integer panel stores it: a 4-bit quant (0..15) or an 8-bit one plus kQ8Bias. kIntDot names the way:
// - AVX512-VNNI, AVX-VNNI: vpdpbusd multiplies unsigned by signed bytes in one instruction, so 8-bit quants are
//   stored biased by 128 (unsigned) and the caller takes the bias's 128 * sum(x) off with the block's scales.
// - AVX2, AVX-512BW, SSSE3: pmaddubsw (unsigned by signed bytes, pairs summed to int16) and pmaddwd by ones. 4-bit
//   quants are the unsigned operand (no int16 saturation: 2 * 15 * 127); 8-bit ones take the sign trick (|x| by w
//   with x's sign: 2 * 127 * 127 fits), exact for quants in [-127, 127] (kQ8Symmetric: the panel clamps -128).
// - NEON: sdot (armv8.2-a+dotprod), else smull and pairwise adds; elsewhere plain widened arithmetic.
// kQ8Bias: what an 8-bit quant is stored plus; kQ8Symmetric: whether -128 must be read as -127.
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
constexpr const char* kIntDot = kVecBytes == 64 ? "AVX512-VNNI" : "AVX-VNNI";
constexpr int kQ8Bias = 128;
constexpr bool kQ8Symmetric = false;
#elif defined(__AVX512BW__) || defined(__AVX2__) || (defined(__SSSE3__) && !defined(__AVX__))
constexpr const char* kIntDot = "pmaddubsw";
constexpr int kQ8Bias = 0;
constexpr bool kQ8Symmetric = true;
#else
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kIntDot = "NEON sdot";
#elif defined(__aarch64__)
constexpr const char* kIntDot = "NEON smull";
#else
constexpr const char* kIntDot = "generic";
#endif
constexpr int kQ8Bias = 0;
constexpr bool kQ8Symmetric = false;
#endif

template <int BITS>
inline VecI DotBytes(VecI acc, VecI w, VecI x) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return (VecI)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
#elif defined(__AVXVNNI__) && !defined(__AVX512F__)
  return (VecI)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#elif defined(__AVX512BW__)
  __m512i u = (__m512i)w, s = (__m512i)x;
  if constexpr (BITS == 8) {
    const __mmask64 negative = _mm512_movepi8_mask(s);
    u = _mm512_abs_epi8(s);
    s = _mm512_mask_sub_epi8((__m512i)w, negative, _mm512_setzero_si512(), (__m512i)w);
  }
  return acc + (VecI)_mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#elif defined(__AVX2__)
  __m256i u = (__m256i)w, s = (__m256i)x;
  if constexpr (BITS == 8) u = _mm256_sign_epi8(s, s), s = _mm256_sign_epi8((__m256i)w, (__m256i)x);
  return acc + (VecI)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#elif defined(__SSSE3__) && !defined(__AVX__)
  __m128i u = (__m128i)w, s = (__m128i)x;
  if constexpr (BITS == 8) u = _mm_sign_epi8(s, s), s = _mm_sign_epi8((__m128i)w, (__m128i)x);
  return acc + (VecI)_mm_madd_epi16(_mm_maddubs_epi16(u, s), _mm_set1_epi16(1));
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return (VecI)vdotq_s32((int32x4_t)acc, (int8x16_t)w, (int8x16_t)x);
#elif defined(__aarch64__)
  const int8x16_t a = (int8x16_t)w, b = (int8x16_t)x;
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(a, b));
  return acc + (VecI)vpaddq_s32(lo, hi);
#else
  typedef int8_t VecB __attribute__((vector_size(kVecBytes)));
  const VecB a = (VecB)w, b = (VecB)x;
  for (int i = 0; i < kLanes; ++i)
    for (int j = 0; j < 4; ++j) acc[i] += static_cast<int32_t>(a[4 * i + j]) * b[4 * i + j];
  return acc;
#endif
}

// A block's dot products of 4-bit quants (0..15) by int8 x, summed in int16 where pmaddubsw is the way: a pair's
// product sum is at most 2 * 15 * 127, so up to kNibbleSteps of them fit an int16 lane (30480), and the widening to
// int32 (pmaddwd by ones) is paid once a block instead of once a step, one multiply instruction a step instead of
// two. Lane i of FinishNibbleDots(sum of kNibbleSteps DotNibbles(...)) equals the DotBytes<4> sum. Elsewhere these
// are DotBytes<4> itself and the identity.
constexpr int kNibbleSteps = 8;
inline VecI DotNibbles(VecI acc16, VecI w, VecI x) {
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
  return DotBytes<4>(acc16, w, x);
#elif defined(__AVX512BW__)
  return (VecI)_mm512_add_epi16((__m512i)acc16, _mm512_maddubs_epi16((__m512i)w, (__m512i)x));
#elif defined(__AVX2__)
  return (VecI)_mm256_add_epi16((__m256i)acc16, _mm256_maddubs_epi16((__m256i)w, (__m256i)x));
#elif defined(__SSSE3__) && !defined(__AVX__)
  return (VecI)_mm_add_epi16((__m128i)acc16, _mm_maddubs_epi16((__m128i)w, (__m128i)x));
#else
  return DotBytes<4>(acc16, w, x);
#endif
}
inline VecI FinishNibbleDots(VecI acc16) {
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
  return acc16;
#elif defined(__AVX512BW__)
  return (VecI)_mm512_madd_epi16((__m512i)acc16, _mm512_set1_epi16(1));
#elif defined(__AVX2__)
  return (VecI)_mm256_madd_epi16((__m256i)acc16, _mm256_set1_epi16(1));
#elif defined(__SSSE3__) && !defined(__AVX__)
  return (VecI)_mm_madd_epi16((__m128i)acc16, _mm_set1_epi16(1));
#else
  return acc16;
#endif
}

// Four rows of 16 bytes as their columns' quads: out[t] holds columns 4t .. 4t + 3, column c's bytes side by side
// (out[t][4 i + j] = r_j[4 t + i]), by two levels of byte and word interleaves (punpck on x86, zip on NEON).
typedef uint8_t Bytes16 __attribute__((vector_size(16)));
inline void Quads4x16(Bytes16 r0, Bytes16 r1, Bytes16 r2, Bytes16 r3, Bytes16 out[4]) {
  const Bytes16 lo01 = __builtin_shufflevector(r0, r1, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const Bytes16 hi01 = __builtin_shufflevector(r0, r1, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const Bytes16 lo23 = __builtin_shufflevector(r2, r3, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const Bytes16 hi23 = __builtin_shufflevector(r2, r3, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  out[0] = __builtin_shufflevector(lo01, lo23, 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
  out[1] = __builtin_shufflevector(lo01, lo23, 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
  out[2] = __builtin_shufflevector(hi01, hi23, 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
  out[3] = __builtin_shufflevector(hi01, hi23, 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
}

inline Bytes16 Load16(const void* p) {
  Bytes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Four consecutive rows of 32 bytes (128 bytes, a 32-column panel's quants of 4 k) as their 32 columns' quads in
// 128 / kVecBytes vectors, lane c of vector v holding column v * kLanes + c: in registers where the target has a
// byte permute across the whole vector (kQuadsInRegisters): AVX512-VBMI's vpermt2b, one per vector; 16-byte
// vectors (NEON, SSE) by Quads4x16. Elsewhere (AVX2's two 16-byte lanes) a kernel keeps to buffers.
#if defined(__AVX512VBMI__)
constexpr bool kQuadsInRegisters = true;
struct QuadIndex {  // byte 4 c + j of vector h: row j's byte 16 h + c, rows 0-1 in the first source, 2-3 the second
  uint8_t at[2][64];
};
constexpr QuadIndex MakeQuadIndex() {
  QuadIndex q{};
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 4; ++j) q.at[h][4 * c + j] = static_cast<uint8_t>(32 * j + 16 * h + c);
  return q;
}
inline constexpr QuadIndex kQuadIndex = MakeQuadIndex();
inline void QuadsOf4Rows(const uint8_t* rows, VecI out[2]) {
  const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + 64);
  for (int h = 0; h < 2; ++h)
    out[h] = (VecI)_mm512_permutex2var_epi8(a, _mm512_loadu_si512(kQuadIndex.at[h]), b);
}
#elif defined(__aarch64__) || (defined(__SSE2__) && !defined(__AVX__))
constexpr bool kQuadsInRegisters = true;
inline void QuadsOf4Rows(const uint8_t* rows, VecI out[8]) {
  for (int h = 0; h < 2; ++h) {
    Bytes16 quads[4];
    Quads4x16(Load16(rows + 16 * h), Load16(rows + 32 + 16 * h), Load16(rows + 64 + 16 * h), Load16(rows + 96 + 16 * h),
              quads);
    for (int t = 0; t < 4; ++t) out[4 * h + t] = (VecI)quads[t];
  }
}
#else
constexpr bool kQuadsInRegisters = false;
inline void QuadsOf4Rows(const uint8_t*, VecI*) {}
#endif

// A spin-wait's pause: x86's pause, ARM's yield, else nothing.
inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace jaxllm_simd
