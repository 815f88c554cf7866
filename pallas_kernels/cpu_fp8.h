// float8 codes as float32, 16 at a time: the CPU kernels' common decoder. Included by
// pallas_kernels/ragged_paged_attention/cpu_kernel.cc (a float8 KV cache) and
// jllm/quantization/cpu_matmul.cc (fp8 weights); built and hashed like cpu_pool.h.
//
// GCC lowers a vector conversion from bytes to floats element by element, so with AVX-512
// the bytes are widened with its instructions; other targets take the generic conversion.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace jllm_cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

// 16 bytes zero-extended to 32-bit lanes.
inline i32x16 widen_u8(u8x16 b) {
#ifdef __AVX512F__
  __m128i raw;
  std::memcpy(&raw, &b, 16);
  const __m512i w = _mm512_cvtepu8_epi32(raw);
  i32x16 v;
  std::memcpy(&v, &w, 64);
  return v;
#else
  return __builtin_convertvector(b, i32x16);
#endif
}

// float8_e4m3fn: |v| * 2^9 = (8 * [e > 0] + m) << max(e - 1, 0) for exponent e and mantissa
// m, all in integer lanes. 0x7F / 0xFF (NaN) come out NaN when `nan` is set (the weights'
// path leaves them out: quantization never produces them).
template <bool kNan = true>
inline f32x16 e4m3_to_floats(u8x16 b) {
  const i32x16 u = widen_u8(b);
  const i32x16 e = (u >> 3) & 15, m = u & 7;
  const i32x16 normal = e > 0;  // -1 where true
  const i32x16 magnitude = (m + (normal & 8)) << ((e - 1) & normal);
  const i32x16 sign = -((u >> 7) & 1);
  f32x16 v = __builtin_convertvector((magnitude ^ sign) - sign, f32x16) * (1.0f / 512.0f);
  if constexpr (kNan) {
    const i32x16 nan = (u & 0x7F) == 0x7F;
    const f32x16 q = f32x16{} + NAN;
    i32x16 bits, qbits;
    std::memcpy(&bits, &v, 64);
    std::memcpy(&qbits, &q, 64);
    bits = (bits & ~nan) | (qbits & nan);
    std::memcpy(&v, &bits, 64);
  }
  return v;
}

// float8_e5m2 is the high byte of a float16: shifted into place and converted (subnormals,
// infinities and NaN included).
inline f32x16 e5m2_to_floats(u8x16 b) {
  const i32x16 u = widen_u8(b);
#ifdef __AVX512F__
  __m512i wide;
  std::memcpy(&wide, &u, 64);
  const __m512i halves = _mm512_slli_epi32(wide, 8);
  const __m256i packed = _mm512_cvtepi32_epi16(halves);
  const __m512 f = _mm512_cvtph_ps(packed);
  f32x16 v;
  std::memcpy(&v, &f, 64);
  return v;
#else
  // float32 bits from the half's: exponent rebiased by 112, mantissa moved up 13 bits;
  // exponent 0 (zero, subnormals) as m * 2^-16, exponent 31 (inf, NaN) to 255.
  const i32x16 e = (u >> 2) & 31, m = u & 3, s = (u >> 7) << 31;
  const i32x16 normal_bits = s | ((e + 112) << 23) | (m << 21);
  const i32x16 special_bits = s | (255 << 23) | (m << 21);
  i32x16 bits = (e == 31) ? special_bits : normal_bits;
  f32x16 v;
  std::memcpy(&v, &bits, 64);
  const f32x16 sub = __builtin_convertvector(m, f32x16) * (1.0f / 65536.0f);
  const f32x16 signed_sub = (s != 0) ? -sub : sub;
  return (e == 0) ? signed_sub : v;
#endif
}

}  // namespace jllm_cpu
