// SiLU on vector registers for the gated layer products (jllm/models/{bf16,f32}_matmul.cc):
// silu(g) * u on 16 lanes (AVX-512) or 8 (AVX2 with FMA). ragged_paged_attention/cpu.py
// builds the kernels with this folder on the include path and hashes it into the cached
// libraries' names.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jllm_cpu {

// exp(x) for x <= 0 (SiLU's exp(-|g|)): 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error below 2e-7), 2^n built in the exponent field. Below
// -87 it is exp(-87) (about 1.6e-38, the smallest such 2^n that is a normal float), where
// SiLU's sigmoid is below float32's resolution of it anyway.
#ifdef __AVX512F__
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145752f), x);  // x - n ln2, high part
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.42860677e-6f), r);       // and its low part
  __m512 e = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

// silu(g) * u = g * u * sigmoid(g), sigmoid from exp(-|g|) so that nothing overflows.
inline __m512 silu_times(__m512 g, __m512 u) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __m512 e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
  const __m512 positive = _mm512_div_ps(one, _mm512_add_ps(e, one));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_mask_mul_ps(positive, negative, positive, e);  // e / (1 + e)
  return _mm512_mul_ps(_mm512_mul_ps(g, u), sigmoid);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145752f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860677e-6f), r);
  __m256 e = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

inline __m256 silu_times(__m256 g, __m256 u) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
  const __m256 positive = _mm256_div_ps(one, _mm256_add_ps(e, one));
  const __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_blendv_ps(positive, _mm256_mul_ps(positive, e), negative);
  return _mm256_mul_ps(_mm256_mul_ps(g, u), sigmoid);
}
#endif

}  // namespace jllm_cpu
