// float8 codes as float32, 16 at a time: the CPU kernels' common decoder. Included by
// pallas_kernels/ragged_paged_attention/cpu_kernel.cc (a float8 KV cache) and
// quantized_matmul.cc (fp8 weights); built and hashed like cpu_pool.h.
//
// GCC lowers a vector conversion from bytes element by element (each byte extracted and
// inserted into its lane by scalar code), so with AVX-512 or AVX2 the bytes are widened with
// their instructions; other targets take the generic conversion, 8 lanes at a time (see F32s
// below).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jllm_cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// Without AVX-512 the decoders run on two 8-lane halves: GCC keeps a 64-byte vector value
// in memory on such a target and lowers its comparisons and selects lane by lane (an AVX2
// Zen 3 decoded a float8 KV cache 18x slower than it read a float32 one for it).
#ifdef __AVX512F__
typedef f32x16 F32s;
typedef i32x16 I32s;
constexpr int kLanes = 16;
#else
typedef f32x8 F32s;
typedef i32x8 I32s;
constexpr int kLanes = 8;
#endif

// kLanes bytes zero-extended to 32-bit lanes.
inline I32s widen_u8(const uint8_t* p) {
#ifdef __AVX512F__
  __m128i raw;
  std::memcpy(&raw, p, 16);
  const __m512i w = _mm512_cvtepu8_epi32(raw);
  I32s v;
  std::memcpy(&v, &w, 64);
  return v;
#elif defined(__AVX2__)
  // GCC's conversion of an 8-byte vector took 8 byte extracts and 8 lane inserts here
  // (a Zen 3 decoded 4-bit weights at a quarter of int8's speed through it).
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  I32s v;
  std::memcpy(&v, &w, 32);
  return v;
#else
  typedef uint8_t u8x8 __attribute__((vector_size(8)));
  u8x8 b;
  std::memcpy(&b, p, 8);
  return __builtin_convertvector(b, I32s);
#endif
}

// float8_e4m3fn: |v| * 2^9 = (8 * [e > 0] + m) << max(e - 1, 0) for exponent e and mantissa
// m, all in integer lanes. 0x7F / 0xFF (NaN) come out NaN when `nan` is set (the weights'
// path leaves them out: quantization never produces them).
template <bool kNan>
inline F32s e4m3_lanes(const uint8_t* p) {
  const I32s u = widen_u8(p);
  const I32s e = (u >> 3) & 15, m = u & 7;
  const I32s normal = e > 0;  // -1 where true
  const I32s magnitude = (m + (normal & 8)) << ((e - 1) & normal);
  const I32s sign = -((u >> 7) & 1);
  F32s v = __builtin_convertvector((magnitude ^ sign) - sign, F32s) * (1.0f / 512.0f);
  if constexpr (kNan) {
    const I32s nan = (u & 0x7F) == 0x7F;
    const F32s q = F32s{} + NAN;
    I32s bits, qbits;
    std::memcpy(&bits, &v, sizeof(v));
    std::memcpy(&qbits, &q, sizeof(q));
    bits = (bits & ~nan) | (qbits & nan);
    std::memcpy(&v, &bits, sizeof(v));
  }
  return v;
}

// float8_e5m2 is the high byte of a float16: shifted into place and converted (subnormals,
// infinities and NaN included).
inline F32s e5m2_lanes(const uint8_t* p) {
  const I32s u = widen_u8(p);
#ifdef __AVX512F__
  __m512i wide;
  std::memcpy(&wide, &u, 64);
  const __m512i halves = _mm512_slli_epi32(wide, 8);
  const __m256i packed = _mm512_cvtepi32_epi16(halves);
  const __m512 f = _mm512_cvtph_ps(packed);
  F32s v;
  std::memcpy(&v, &f, 64);
  return v;
#else
  // float32 bits from the half's: exponent rebiased by 112, mantissa moved up 13 bits;
  // exponent 0 (zero, subnormals) as m * 2^-16, exponent 31 (inf, NaN) to 255.
  const I32s e = (u >> 2) & 31, m = u & 3, s = (u >> 7) << 31;
  const I32s normal_bits = s | ((e + 112) << 23) | (m << 21);
  const I32s special_bits = s | (255 << 23) | (m << 21);
  I32s bits = (e == 31) ? special_bits : normal_bits;
  F32s v;
  std::memcpy(&v, &bits, sizeof(v));
  const F32s sub = __builtin_convertvector(m, F32s) * (1.0f / 65536.0f);
  const F32s signed_sub = (s != 0) ? -sub : sub;
  return (e == 0) ? signed_sub : v;
#endif
}

// 16 codes as floats, `lanes` (e4m3_lanes or e5m2_lanes) kLanes at a time.
template <typename Lanes>
inline f32x16 sixteen_floats(u8x16 b, Lanes lanes) {
  uint8_t codes[16];
  std::memcpy(codes, &b, 16);
  f32x16 out;
  for (int i = 0; i < 16; i += kLanes) {
    const F32s v = lanes(codes + i);
    std::memcpy(reinterpret_cast<char*>(&out) + 4 * i, &v, sizeof(v));
  }
  return out;
}

template <bool kNan = true>
inline f32x16 e4m3_to_floats(u8x16 b) {
  return sixteen_floats(b, e4m3_lanes<kNan>);
}

inline f32x16 e5m2_to_floats(u8x16 b) { return sixteen_floats(b, e5m2_lanes); }

}  // namespace jllm_cpu
