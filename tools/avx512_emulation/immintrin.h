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

// Masked loads and stores touch only the lanes their mask selects, as the instructions do.
// SIMDe's own read and write back the whole vector, which races with another thread writing
// the bytes past a row's end (the next row's first columns), and reads past a buffer's end.
namespace jllm_emulation {
inline simde__m512i maskz_loadu_epi16(simde__mmask32 k, const void* p) {
  uint16_t lane[32] = {};
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) std::memcpy(&lane[i], static_cast<const uint16_t*>(p) + i, 2);
  return bits<simde__m512i>(lane);
}
inline void mask_storeu_epi16(void* p, simde__mmask32 k, simde__m512i a) {
  uint16_t lane[32];
  std::memcpy(lane, &a, sizeof(lane));
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) std::memcpy(static_cast<uint16_t*>(p) + i, &lane[i], 2);
}
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float lane[16];
  std::memcpy(lane, &a, sizeof(lane));
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<float*>(p) + i, &lane[i], 4);
}
}  // namespace jllm_emulation
#undef _mm512_maskz_loadu_epi16
#undef _mm512_mask_storeu_epi16
#undef _mm512_mask_storeu_ps
#define _mm512_maskz_loadu_epi16 jllm_emulation::maskz_loadu_epi16
#define _mm512_mask_storeu_epi16 jllm_emulation::mask_storeu_epi16
#define _mm512_mask_storeu_ps jllm_emulation::mask_storeu_ps
