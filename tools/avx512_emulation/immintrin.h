// <immintrin.h> for the AVX-512 emulation build (plugin.py beside it): the
// kernels' AVX-512 and AVX512-BF16 intrinsics from SIMDe's portable code, so that their
// AVX-512 builds run, slowly, on a CPU without AVX-512. Never used by the real build.
//
// SIMDe 0.7.4 (Debian 12's libsimde-dev) lacks a few of the intrinsics the kernels use; they
// are written out below where SIMDe does not define them. Each follows Intel's description
// of its instruction.
#pragma once
#define SIMDE_NO_NATIVE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jllm_emulation {
template <typename To, typename From>
inline To bits(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}
// A lane-wise conversion of N lanes: load `from` as In[N], store Out[N] by `f`.
template <typename Out, typename In, int N, typename To, typename From, typename F>
inline To lanes(const From& from, F f) {
  In in[N];
  Out out[N] = {};
  std::memcpy(in, &from, sizeof(in));
  for (int i = 0; i < N; ++i) out[i] = f(in[i]);
  To to;
  std::memset(&to, 0, sizeof(to));
  std::memcpy(&to, out, sizeof(out));
  return to;
}
}  // namespace jllm_emulation

#ifndef __mmask16
#define __mmask16 simde__mmask16
#endif
#ifndef __mmask32
#define __mmask32 simde__mmask32
#endif
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

// name(a): each of a's 16 In lanes converted to an Out lane by `expr` of v.
#define JLLM_LANEWISE(name, To, From, Out, In, expr)                              \
  inline To name(From a) {                                                        \
    return jllm_emulation::lanes<Out, In, 16, To>(a, [](In v) { return Out(expr); }); \
  }
#ifndef _mm512_cvtepu8_epi32
JLLM_LANEWISE(_mm512_cvtepu8_epi32, simde__m512i, simde__m128i, int32_t, uint8_t, v)
#endif
#ifndef _mm512_cvtepi8_epi32
JLLM_LANEWISE(_mm512_cvtepi8_epi32, simde__m512i, simde__m128i, int32_t, int8_t, v)
#endif
#ifndef _mm512_cvtepu16_epi32
JLLM_LANEWISE(_mm512_cvtepu16_epi32, simde__m512i, simde__m256i, int32_t, uint16_t, v)
#endif
#ifndef _mm512_cvtepi32_epi16  // truncating
JLLM_LANEWISE(_mm512_cvtepi32_epi16, simde__m256i, simde__m512i, int16_t, int32_t, v)
#endif
#ifndef _mm512_cvtepi32_ps
JLLM_LANEWISE(_mm512_cvtepi32_ps, simde__m512, simde__m512i, float, int32_t, v)
#endif
#ifndef _mm512_cvtps_epi32  // to nearest even, the default rounding mode
JLLM_LANEWISE(_mm512_cvtps_epi32, simde__m512i, simde__m512, int32_t, float,
              __builtin_nearbyintf(v))
#endif
#ifndef _mm512_cvtph_ps
inline simde__m512 _mm512_cvtph_ps(simde__m256i a) {  // IEEE half to float, exactly
  return jllm_emulation::lanes<float, uint16_t, 16, simde__m512>(a, [](uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    const int exponent = (h >> 10) & 0x1f;
    const uint32_t mantissa = h & 0x3ff;
    float magnitude;
    if (exponent == 0x1f) {
      magnitude = jllm_emulation::bits<float>(0x7f800000u | (mantissa << 13));
    } else if (exponent == 0) {
      magnitude = float(mantissa) * 0x1p-24f;
    } else {
      magnitude = jllm_emulation::bits<float>(uint32_t(exponent + 112) << 23 | mantissa << 13);
    }
    return jllm_emulation::bits<float>(jllm_emulation::bits<uint32_t>(magnitude) | sign);
  });
}
#endif
#ifndef _mm512_i32gather_ps
// VGATHERDPS: lane i from base + index[i] * scale bytes.
inline simde__m512 _mm512_i32gather_ps(simde__m512i index, const void* base, int scale) {
  int32_t at[16];
  float lane[16];
  std::memcpy(at, &index, sizeof(at));
  for (int i = 0; i < 16; ++i)
    std::memcpy(&lane[i], static_cast<const char*>(base) + int64_t(at[i]) * scale, 4);
  return jllm_emulation::bits<simde__m512>(lane);
}
#endif
#ifndef _mm512_shuffle_f32x4
// VSHUFF32X4: the 128-bit lanes of shuffle_i32x4, on floats.
#define _mm512_shuffle_f32x4(a, b, imm)                                          \
  _mm512_castsi512_ps(                                                          \
      _mm512_shuffle_i32x4(_mm512_castps_si512(a), _mm512_castps_si512(b), imm))
#endif
#ifndef _mm512_cmpeq_epi16_mask
// VPCMPEQW: bit i set where a's and b's 16-bit lanes i are equal.
inline simde__mmask32 _mm512_cmpeq_epi16_mask(simde__m512i a, simde__m512i b) {
  uint16_t x[32], y[32];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  simde__mmask32 k = 0;
  for (int i = 0; i < 32; ++i) k |= simde__mmask32(x[i] == y[i]) << i;
  return k;
}
#endif
#ifndef _mm512_cvtneps_pbh
// VCVTNEPS2BF16: round to nearest even; denormal inputs read as zero; NaN stays NaN, quieted.
inline simde__m256bh _mm512_cvtneps_pbh(simde__m512 a) {
  return jllm_emulation::lanes<uint16_t, uint32_t, 16, simde__m256bh>(a, [](uint32_t u) {
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  });
}
#endif
#ifndef _mm512_cvtne2ps_pbh
// VCVTNE2PS2BF16: b's 16 lanes to the low half, a's to the high half, each as cvtneps_pbh.
inline simde__m512bh _mm512_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  const simde__m256bh lo = _mm512_cvtneps_pbh(b), hi = _mm512_cvtneps_pbh(a);
  uint16_t lane[32];
  std::memcpy(lane, &lo, 32);
  std::memcpy(lane + 16, &hi, 32);
  return jllm_emulation::bits<simde__m512bh>(lane);
}
#endif

// Fused multiply-adds, rounded once as the instructions are (SIMDe's portable form multiplies
// and adds, two roundings where the kernels are built with -ffp-contract=off).
namespace jllm_emulation {
template <typename V, int N, typename F>
inline V fused(V a, V b, V c, F f) {
  float x[N], y[N], z[N], r[N];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  std::memcpy(z, &c, sizeof(z));
  for (int i = 0; i < N; ++i) r[i] = f(x[i], y[i], z[i]);
  V out;
  std::memcpy(&out, r, sizeof(r));
  return out;
}
inline float fma_lane(float a, float b, float c) { return std::fma(a, b, c); }
inline float fms_lane(float a, float b, float c) { return std::fma(a, b, -c); }
}  // namespace jllm_emulation
#undef _mm512_fmadd_ps
#undef _mm512_fmsub_ps
#undef _mm256_fmadd_ps
#define _mm512_fmadd_ps(a, b, c) \
  jllm_emulation::fused<simde__m512, 16>(a, b, c, jllm_emulation::fma_lane)
#define _mm512_fmsub_ps(a, b, c) \
  jllm_emulation::fused<simde__m512, 16>(a, b, c, jllm_emulation::fms_lane)
#define _mm256_fmadd_ps(a, b, c) \
  jllm_emulation::fused<simde__m256, 8>(a, b, c, jllm_emulation::fma_lane)

// Masked loads and stores touch only the lanes their mask selects, as the instructions do.
// SIMDe's own read and write back the whole vector, which races with another thread writing
// the bytes past a row's end (the next row's first columns), and reads past a buffer's end.
namespace jllm_emulation {
// The N lanes of type T at p that mask k selects, the others zero, as vector V.
template <typename V, typename T, int N, typename M>
inline V maskz_loadu(M k, const void* p) {
  T lane[N] = {};
  for (int i = 0; i < N; ++i)
    if (k >> i & 1) std::memcpy(&lane[i], static_cast<const T*>(p) + i, sizeof(T));
  return bits<V>(lane);
}
// a's N lanes of type T that mask k selects, to p.
template <typename T, int N, typename M, typename V>
inline void mask_storeu(void* p, M k, V a) {
  T lane[N];
  std::memcpy(lane, &a, sizeof(lane));
  for (int i = 0; i < N; ++i)
    if (k >> i & 1) std::memcpy(static_cast<T*>(p) + i, &lane[i], sizeof(T));
}
// The sum of a's 16 lanes in GCC's order: halves, then quarters, pairs, and the last two.
inline float reduce_add_ps(simde__m512 a) {
  float v[16];
  std::memcpy(v, &a, sizeof(v));
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] = v[i] + v[i + w];
  return v[0];
}
}  // namespace jllm_emulation
#undef _mm512_maskz_loadu_epi16
#undef _mm512_mask_storeu_epi16
#undef _mm512_mask_storeu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#undef _mm512_maskz_loadu_ps
#undef _mm512_reduce_add_ps
#define _mm512_maskz_loadu_epi16 \
  jllm_emulation::maskz_loadu<simde__m512i, uint16_t, 32, simde__mmask32>
#define _mm512_mask_storeu_epi16 \
  jllm_emulation::mask_storeu<uint16_t, 32, simde__mmask32, simde__m512i>
#define _mm512_mask_storeu_ps jllm_emulation::mask_storeu<float, 16, simde__mmask16, simde__m512>
#define _mm256_maskz_loadu_epi16 \
  jllm_emulation::maskz_loadu<simde__m256i, uint16_t, 16, simde__mmask16>
#define _mm256_mask_storeu_epi16 \
  jllm_emulation::mask_storeu<uint16_t, 16, simde__mmask16, simde__m256i>
#define _mm512_maskz_loadu_ps jllm_emulation::maskz_loadu<simde__m512, float, 16, simde__mmask16>
#define _mm512_reduce_add_ps jllm_emulation::reduce_add_ps
// Streaming (non-temporal) stores: plain aligned stores here.
#ifndef _mm512_stream_ps
#define _mm512_stream_ps(p, a) _mm512_store_ps(p, a)
#endif
#ifndef _mm512_stream_si512
#define _mm512_stream_si512(p, a) _mm512_store_si512(p, a)
#endif

// The AMX tiles (AMX-TILE, AMX-BF16), for a build that emulates a CPU with them
// (JLLM_EMULATED_CPU=amx, plugin.py): eight tiles of at most 16 rows of 64 bytes in each
// thread, shaped by the last _tile_loadconfig, as the instructions are described in Intel's
// manual. The tile intrinsics take the tile's number, as the real ones do.
#if defined(__AMX_TILE__)
namespace jllm_emulation {
struct Tiles {
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};
inline Tiles& tiles() {
  thread_local Tiles t;
  return t;
}
// LDTILECFG: palette 1's 64-byte layout (byte 0 the palette, bytes 16-47 each tile's bytes
// per row, 48-63 its rows); every tile zeroed.
inline void tile_loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  Tiles& t = tiles();
  t = Tiles();
  if (c[0] != 1) return;  // palette 0: no tiles configured
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&t.colsb[i], c + 16 + 2 * i, 2);
    t.rows[i] = c[48 + i];
  }
}
// TILELOADD: the configured rows, colsb bytes each, stride bytes apart; the rest zero.
inline void tile_loadd(int i, const void* base, long stride) {
  Tiles& t = tiles();
  std::memset(t.data[i], 0, sizeof(t.data[i]));
  for (int r = 0; r < t.rows[i]; ++r)
    std::memcpy(t.data[i][r], static_cast<const uint8_t*>(base) + r * stride, t.colsb[i]);
}
inline void tile_stored(int i, void* base, long stride) {
  const Tiles& t = tiles();
  for (int r = 0; r < t.rows[i]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[i][r], t.colsb[i]);
}
inline void tile_zero(int i) { std::memset(tiles().data[i], 0, sizeof(tiles().data[i])); }
// A bfloat16 as the float32 of its bits; a denormal reads as zero (DAZ).
inline float bf16_operand(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  if ((h & 0x7f80) == 0) h &= 0x8000;
  return bits<float>(uint32_t(h) << 16);
}
inline float flush_denormal(float f) {
  const uint32_t u = bits<uint32_t>(f);
  return (u & 0x7f800000u) == 0 ? bits<float>(u & 0x80000000u) : f;
}
// TDPBF16PS: C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] over the pairs k of A's
// row, as two float32 multiply-adds in that order, round to nearest even, denormal results
// flushed to zero (FTZ).
inline void tile_dpbf16ps(int c, int a, int b) {
  Tiles& t = tiles();
  const int pairs = t.colsb[a] / 4, cols = t.colsb[c] / 4;
  for (int m = 0; m < t.rows[c]; ++m) {
    float* out = reinterpret_cast<float*>(t.data[c][m]);
    for (int k = 0; k < pairs; ++k)
      for (int n = 0; n < cols; ++n) {
        float acc = out[n];
        for (int h = 0; h < 2; ++h)
          acc = flush_denormal(std::fma(bf16_operand(t.data[a][m] + 4 * k + 2 * h),
                                        bf16_operand(t.data[b][k] + 4 * n + 2 * h), acc));
        out[n] = acc;
      }
  }
}
}  // namespace jllm_emulation
#define _tile_loadconfig(config) jllm_emulation::tile_loadconfig(config)
#define _tile_loadd(t, base, stride) jllm_emulation::tile_loadd(t, base, stride)
#define _tile_stream_loadd(t, base, stride) jllm_emulation::tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) jllm_emulation::tile_stored(t, base, stride)
#define _tile_zero(t) jllm_emulation::tile_zero(t)
#define _tile_dpbf16ps(c, a, b) jllm_emulation::tile_dpbf16ps(c, a, b)
#define _tile_release() (jllm_emulation::tiles() = jllm_emulation::Tiles())
#endif
