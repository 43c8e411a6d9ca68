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
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

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

}  // namespace jaxllm_simd
