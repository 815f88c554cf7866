// The elementwise work around a bf16 layer's products on the CPU, in one pass each
// (jllm/models/layer_ops.py calls them as XLA FFI targets): RMSNorm over the last axis of
// bfloat16 rows, the residual add before it, and the rotary embedding of q and k.
//
//   y = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w)      Llama's RMSNorm
//   y = bf16(x * rsqrt(mean(x^2) + eps) * (1 + w))       unit_offset (Gemma's)
//
// in float32, as layers.py's RMSNorm writes it; the add's form first rounds x + h to bf16
// (the residual stream the layer carries, written to `sum`) and normalises that. The rotary
// embedding (rope.py's `apply_rope`, rotate-half layout) takes each token's cos and sin,
// which the step computes once for every layer: [x1 c - x2 s, x2 c + x1 s] over the first 2
// half dims of each head, rounded to bf16; the dims past them are copied. Each is one fused
// multiply-add of the first product and the rounded second, fma(x1, c, -(x2 s)) and
// fma(x2, c, x1 s): XLA's CPU backend contracts the jnp form so (the same bits).
//
// XLA's CPU backend ran each norm as three passes over the rows (a bf16 -> float32 copy, the
// sum of squares, the scaling), the add as a fourth, and the rotary embedding as five (two
// halves, their concatenation, the bf16 copy, k's into the cache layout): a prefill step of
// 2048 tokens of SmolLM2 spent about 250 ms of its 1.5 s on them on the 2-core AMX Xeon. Here
// a row is read once and finished while it is in L1.
//
// A row's result depends on that row only (the same sum order at any row count). 1 / sqrt
// is correctly rounded; XLA's rsqrt (an estimate and a Newton step) may differ in the last
// bit of the float32 scale. With AVX512-BF16, 16 lanes and vcvtneps2bf16; elsewhere plain
// loops that GCC vectorizes (build.py's -O3 -march=native, with reassociation for the sum
// of squares).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_bf16.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float widen(uint16_t v) { return jllm_cpu::bf16_to_float(v); }
inline uint16_t narrow(float f) { return jllm_cpu::float_to_bf16(f); }

struct Norm {
  int64_t rows, dim;
  const uint16_t *x, *h, *w;  // h: null for the norm alone
  uint16_t *sum, *y;          // sum: x + h, null for the norm alone
  float eps;
  bool unit_offset;
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 16 lanes at a time, the conversions to bf16 by vcvtneps2bf16 (the same rounding as
// `narrow`); the sum of squares in 16 lanes, then across them.
inline __m512 widen16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The lanes of elements i .. min(i + 16, n) - 1.
inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
}

void norm_rows(const Norm& n, int64_t r0, int64_t r1, float* s) {
  const int64_t D = n.dim;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* x = n.x + r * D;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
      const __mmask16 m = lanes(i, D);
      __m512 v = widen16(_mm256_maskz_loadu_epi16(m, x + i));
      if (n.h) {
        const __m256i total =
            narrow16(_mm512_add_ps(v, widen16(_mm256_maskz_loadu_epi16(m, n.h + r * D + i))));
        _mm256_mask_storeu_epi16(n.sum + r * D + i, m, total);
        v = widen16(total);
      }
      _mm512_storeu_ps(s + i, v);  // s holds D rounded up to 16
      squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
    }
    const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / float(D) + n.eps);
    const __m512 k = _mm512_set1_ps(scale), one = _mm512_set1_ps(1.0f);
    uint16_t* y = n.y + r * D;
    for (int64_t i = 0; i < D; i += 16) {
      const __mmask16 m = lanes(i, D);
      const __m512 w = widen16(_mm256_maskz_loadu_epi16(m, n.w + i));
      const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(s + i), k);
      const __m512 out = n.unit_offset ? _mm512_mul_ps(normed, _mm512_add_ps(one, w))
                                       : _mm512_mul_ps(widen16(narrow16(normed)), w);
      _mm256_mask_storeu_epi16(y + i, m, narrow16(out));
    }
  }
}
#else
void norm_rows(const Norm& n, int64_t r0, int64_t r1, float* s) {
  const int64_t D = n.dim;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* x = n.x + r * D;
    float squares = 0.0f;
    if (n.h) {
      const uint16_t* h = n.h + r * D;
      uint16_t* sum = n.sum + r * D;
      for (int64_t i = 0; i < D; ++i) {
        const uint16_t v = narrow(widen(x[i]) + widen(h[i]));
        sum[i] = v;
        s[i] = widen(v);
      }
    } else {
      for (int64_t i = 0; i < D; ++i) s[i] = widen(x[i]);
    }
    for (int64_t i = 0; i < D; ++i) squares += s[i] * s[i];
    const float scale = 1.0f / std::sqrt(squares / float(D) + n.eps);
    uint16_t* y = n.y + r * D;
    if (n.unit_offset) {
      for (int64_t i = 0; i < D; ++i) y[i] = narrow(s[i] * scale * (1.0f + widen(n.w[i])));
    } else {
      for (int64_t i = 0; i < D; ++i) y[i] = narrow(widen(narrow(s[i] * scale)) * widen(n.w[i]));
    }
  }
}
#endif

struct Rope {
  int64_t tokens, heads, dim, half;  // x [tokens, heads, dim]; cos, sin [tokens, half]
  const uint16_t* x;
  const float *cos, *sin;
  uint16_t* y;
};

void rope_rows(const Rope& p, int64_t t0, int64_t t1) {
  const int64_t H = p.dim, R = p.half;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = p.cos + t * R;
    const float* s = p.sin + t * R;
    for (int64_t n = 0; n < p.heads; ++n) {
      const uint16_t* x = p.x + (t * p.heads + n) * H;
      uint16_t* y = p.y + (t * p.heads + n) * H;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      for (int64_t i = 0; i < R; i += 16) {
        const __mmask16 m = lanes(i, R);
        const __m512 a = widen16(_mm256_maskz_loadu_epi16(m, x + i));
        const __m512 b = widen16(_mm256_maskz_loadu_epi16(m, x + R + i));
        const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
        const __m512 lo = _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv));
        const __m512 hi = _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv));
        _mm256_mask_storeu_epi16(y + i, m, narrow16(lo));
        _mm256_mask_storeu_epi16(y + R + i, m, narrow16(hi));
      }
#else
      for (int64_t i = 0; i < R; ++i) {
        const float a = widen(x[i]), b = widen(x[R + i]);
        y[i] = narrow(std::fma(a, c[i], -(b * s[i])));
        y[R + i] = narrow(std::fma(b, c[i], a * s[i]));
      }
#endif
      for (int64_t i = 2 * R; i < H; ++i) y[i] = x[i];
    }
  }
}

// Rows per work item: a few dozen KB of rows, enough to pay for the hand-off.
constexpr int64_t kItemRows = 32;

ffi::Error Run(ffi::ThreadPool& pool, const Norm& n) {
  const int64_t items = (n.rows + kItemRows - 1) / kItemRows;
  const bool ok = jllm_cpu::share_items(pool, items, [&](int64_t i) {
    thread_local std::vector<float> s;
    s.resize((n.dim + 15) / 16 * 16);
    norm_rows(n, i * kItemRows, std::min(n.rows, (i + 1) * kItemRows), s.data());
  });
  return ok ? ffi::Error::Success() : ffi::Error::Internal("an RMSNorm work item failed");
}

// x [T, D], w [D] -> y [T, D], all bfloat16 (and h, sum [T, D] for the add's form).
ffi::Error Checked(ffi::ThreadPool& pool, ffi::AnyBuffer x, const ffi::AnyBuffer* h,
                   ffi::AnyBuffer w, ffi::AnyBuffer* sum, ffi::AnyBuffer* y, float eps,
                   bool unit_offset) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, D]");
  const int64_t T = xd[0], D = xd[1];
  const auto same = [&](const ffi::AnyBuffer& b) {
    const auto d = b.dimensions();
    return b.element_type() == ffi::DataType::BF16 && d.size() == 2 && d[0] == T && d[1] == D;
  };
  if (!same(x) || !same(*y) || (h && (!same(*h) || !same(*sum))))
    return ffi::Error::InvalidArgument("x, y (and h, sum) must be bfloat16 [T, D]");
  if (w.element_type() != ffi::DataType::BF16 || w.dimensions().size() != 1 ||
      w.dimensions()[0] != D)
    return ffi::Error::InvalidArgument("w must be bfloat16 [D]");
  if (T == 0 || D == 0) return ffi::Error::Success();
  Norm n;
  n.rows = T;
  n.dim = D;
  n.x = static_cast<const uint16_t*>(x.untyped_data());
  n.h = h ? static_cast<const uint16_t*>(h->untyped_data()) : nullptr;
  n.w = static_cast<const uint16_t*>(w.untyped_data());
  n.sum = sum ? static_cast<uint16_t*>(sum->untyped_data()) : nullptr;
  n.y = static_cast<uint16_t*>(y->untyped_data());
  n.eps = eps;
  n.unit_offset = unit_offset;
  return Run(pool, n);
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> y, float eps, bool unit_offset) {
  return Checked(pool, x, nullptr, w, nullptr, &*y, eps, unit_offset);
}

ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer h, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> y, float eps,
                      bool unit_offset) {
  return Checked(pool, x, &h, w, &*sum, &*y, eps, unit_offset);
}

// x [T, N, H] bfloat16, cos and sin [T, R] float32 (2 R <= H) -> y [T, N, H] bfloat16.
ffi::Error RopeCall(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> cos,
                    ffi::Buffer<ffi::F32> sin, ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions(), cd = cos.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 3)
    return ffi::Error::InvalidArgument("x must be bfloat16 [T, N, H]");
  if (y->element_type() != ffi::DataType::BF16 ||
      !std::equal(xd.begin(), xd.end(), y->dimensions().begin(), y->dimensions().end()))
    return ffi::Error::InvalidArgument("y must be bfloat16 of x's shape");
  if (cd.size() != 2 || cd[0] != xd[0] || 2 * cd[1] > xd[2] ||
      !std::equal(cd.begin(), cd.end(), sin.dimensions().begin(), sin.dimensions().end()))
    return ffi::Error::InvalidArgument("cos and sin must be [T, R] with 2 R <= H");
  Rope p{xd[0], xd[1], xd[2], cd[1], static_cast<const uint16_t*>(x.untyped_data()),
         cos.typed_data(), sin.typed_data(), static_cast<uint16_t*>(y->untyped_data())};
  if (p.tokens == 0 || p.heads == 0 || p.dim == 0) return ffi::Error::Success();
  const int64_t items = (p.tokens + kItemRows - 1) / kItemRows;
  const bool ok = jllm_cpu::share_items(pool, items, [&](int64_t i) {
    rope_rows(p, i * kItemRows, std::min(p.tokens, (i + 1) * kItemRows));
  });
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a rotary work item failed");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmRope, RopeCall,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Ret<ffi::AnyBuffer>());        // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<float>("eps")
                                  .Attr<bool>("unit_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // h
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // sum: x + h
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<float>("eps")
                                  .Attr<bool>("unit_offset"));
