// SiLU on vector registers for the gated layer products ({bf16,f32}_matmul.cc):
// silu(g) * u on one register of the build's widest, 16 lanes (AVX-512) or 8 (AVX2 with
// FMA). build.py builds the kernels with this folder on the include path and hashes it into
// the cached libraries' names.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jllm_cpu {

#if defined(__FMA__) && (defined(__AVX512F__) || defined(__AVX2__))
#ifdef __AVX512F__
using SiluVec = __m512;
inline SiluVec silu_set(float v) { return _mm512_set1_ps(v); }
inline SiluVec silu_fma(SiluVec a, SiluVec b, SiluVec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using SiluVec = __m256;
inline SiluVec silu_set(float v) { return _mm256_set1_ps(v); }
inline SiluVec silu_fma(SiluVec a, SiluVec b, SiluVec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// exp(x) for x <= 0 (SiLU's exp(-|g|)): 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error below 2e-7), 2^n built in the exponent field. Below
// -87 it is exp(-87) (about 1.6e-38, the smallest such 2^n that is a normal float), where
// SiLU's sigmoid is below float32's resolution of it anyway.
inline SiluVec exp_nonpositive(SiluVec x) {
#ifdef __AVX512F__
  x = _mm512_max_ps(x, silu_set(-87.0f));
  const SiluVec n = _mm512_roundscale_ps(_mm512_mul_ps(x, silu_set(1.44269504f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  x = _mm256_max_ps(x, silu_set(-87.0f));
  const SiluVec n = _mm256_round_ps(_mm256_mul_ps(x, silu_set(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  SiluVec r = silu_fma(n, silu_set(-0.693145752f), x);  // x - n ln2, ln2's high part
  r = silu_fma(n, silu_set(-1.42860677e-6f), r);        // and its low part
  SiluVec e = silu_set(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = silu_fma(e, r, silu_set(c));
#ifdef __AVX512F__
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
#else
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
#endif
}

// silu(g) * u = g * u * sigmoid(g), sigmoid from exp(-|g|) so that nothing overflows.
inline SiluVec silu_times(SiluVec g, SiluVec u) {
  const SiluVec one = silu_set(1.0f);
#ifdef __AVX512F__
  const SiluVec zero = _mm512_setzero_ps();
  const SiluVec e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
  const SiluVec positive = _mm512_div_ps(one, _mm512_add_ps(e, one));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
  const SiluVec sigmoid = _mm512_mask_mul_ps(positive, negative, positive, e);  // e / (1 + e)
  return _mm512_mul_ps(_mm512_mul_ps(g, u), sigmoid);
#else
  const SiluVec zero = _mm256_setzero_ps();
  const SiluVec e = exp_nonpositive(_mm256_sub_ps(zero, _mm256_andnot_ps(silu_set(-0.0f), g)));
  const SiluVec positive = _mm256_div_ps(one, _mm256_add_ps(e, one));
  const SiluVec negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
  const SiluVec sigmoid = _mm256_blendv_ps(positive, _mm256_mul_ps(positive, e), negative);
  return _mm256_mul_ps(_mm256_mul_ps(g, u), sigmoid);
#endif
}
#endif

}  // namespace jllm_cpu
