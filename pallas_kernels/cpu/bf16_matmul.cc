// A bfloat16 matrix product for CPUs with AVX512-BF16, as an XLA FFI custom call.
//
// y[M, N] = x[M, K] @ w[layer][K, N]: x bfloat16 row-major, w one layer of a stacked
// bfloat16 weight [L, K, N] (or [K, N] with layer 0), read in place; y bfloat16 or float32
// (the result buffer's type), accumulated in float32. The contract of bf16_matmul.py. A
// second entry point takes two weights of one shape and writes silu(x @ gate) * (x @ up)
// (a gated MLP's first half), the SiLU taken on the float32 accumulators. Both take `live`,
// one byte per row of x (or none): rows marked 0, a step's padding, are not computed and
// come out zero.
//
// Why not XLA's product: inside the model's layer scan XLA copies each layer's weights out
// of the stack before multiplying, and its CPU products of these shapes (SmolLM2's, 64 and
// 2048 rows) ran at 96-346 GFLOP/s where this loop runs at 219-406 on the 2-core Zen 4
// (one core's vdpbf16ps loop measured at 227-234 GFLOP/s).
//
// The loop: one tile is up to kMaxRows rows of x by 32 columns of w, 2 * rows accumulators
// of 16 floats in registers. Per pair of inputs k, k+1 it loads the two weight rows' 32
// columns, interleaves them into the (w[k][n], w[k+1][n]) pairs `vdpbf16ps` takes (the
// unpack instructions work within 128-bit lanes, so columns come out permuted and are put
// back in order once, at the store), broadcasts each row's (x[m][k], x[m][k+1]) pair and
// issues two dot instructions per row. Work items are blocks of up to 8 tiles by runs of
// 32-column panels, shared over XLA's intra-op pool; a block's tiles reuse each panel from
// cache.
//
// Like XLA's own bf16 products on this hardware (which use the same instruction), the dot
// instruction treats denormal inputs as zero and flushes denormal results.
//
// Built at run time with GCC (g++ -O3 -march=native) by build.py; without AVX512-BF16 it
// builds to a handler that returns an error, and bf16_matmul.py never calls it there.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>

#include "cpu_silu.h"  // this folder: silu_times
#endif

#include "cpu_pool.h"  // this folder: share_items
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512BF16__

constexpr int64_t kPanel = 32;    // columns per tile
constexpr int kMaxRows = 14;      // 28 accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t kBlockTiles = 8;  // tiles per work item (112 rows when full)

struct Product {
  const uint16_t* x;   // [M, K]
  const uint16_t* w;   // [K, N], this layer's
  const uint16_t* up;  // [K, N], this layer's, or nullptr: y = silu(x @ w) * (x @ up)
  void* y;             // [M, N]
  int64_t M, N, K;
  bool f32_out;
};

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// The products of rows m0 .. m0 + R - 1 with columns n0 .. n0 + 31 of w (fewer at the
// right edge: masked), in float32, columns in order: y0 holds 0-15, y1 16-31.
template <int R>
__attribute__((always_inline)) inline void products(const Product& p, const uint16_t* w,
                                                    int64_t m0, __mmask32 cols, __m512 (&y0)[R],
                                                    __m512 (&y1)[R]) {
  const int64_t K = p.K, N = p.N;
  // Unrolled by pragma so that GCC keeps the arrays in registers (without it, it stores
  // every accumulator to the stack on every step).
  __m512 lo[R], hi[R];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m0 * K;
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const __m512i w0 = _mm512_maskz_loadu_epi16(cols, w + k * N);
    const __m512i w1 = _mm512_maskz_loadu_epi16(cols, w + (k + 1) * N);
    const __m512bh b0 = (__m512bh)_mm512_unpacklo_epi16(w0, w1);
    const __m512bh b1 = (__m512bh)_mm512_unpackhi_epi16(w0, w1);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const __m512bh a = broadcast_pair(x + r * K + k);
      lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
      hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
    }
  }
  if (k < K) {  // odd K: the last input paired with zeros
    const __m512i w0 = _mm512_maskz_loadu_epi16(cols, w + k * N);
    const __m512i zero = _mm512_setzero_si512();
    const __m512bh b0 = (__m512bh)_mm512_unpacklo_epi16(w0, zero);
    const __m512bh b1 = (__m512bh)_mm512_unpackhi_epi16(w0, zero);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * K + k]));
      lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
      hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
    }
  }
  // lo holds columns 0-3, 8-11, 16-19, 24-27 (one group of four per 128-bit lane), hi the
  // groups between them: two permutes put them in order.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    y0[r] = _mm512_permutex2var_ps(lo[r], first, hi[r]);
    y1[r] = _mm512_permutex2var_ps(lo[r], second, hi[r]);
  }
}

using jllm_cpu::silu_times;

// Rows m0 .. m0 + R - 1 by columns n0 .. n0 + 31 of the output: x @ w, or with `p.up`,
// silu(x @ w) * (x @ up).
template <int R>
void tile(const Product& p, int64_t m0, int64_t n0) {
  const int64_t N = p.N;
  const __mmask32 cols = n0 + kPanel <= N ? ~__mmask32(0) : (__mmask32(1) << (N - n0)) - 1;
  __m512 y0[R], y1[R];
  products<R>(p, p.w + n0, m0, cols, y0, y1);
  if (p.up) {
    __m512 u0[R], u1[R];
    products<R>(p, p.up + n0, m0, cols, u0, u1);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      y0[r] = silu_times(y0[r], u0[r]);
      y1[r] = silu_times(y1[r], u1[r]);
    }
  }
  const __mmask16 cols0 = __mmask16(cols), cols1 = __mmask16(cols >> 16);
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    if (p.f32_out) {
      float* y = static_cast<float*>(p.y) + (m0 + r) * N + n0;
      _mm512_mask_storeu_ps(y, cols0, y0[r]);
      _mm512_mask_storeu_ps(y + 16, cols1, y1[r]);
    } else {  // rounded to nearest even, as XLA converts
      const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(y0[r]);
      const __m256i h1 = (__m256i)_mm512_cvtneps_pbh(y1[r]);
      uint16_t* y = static_cast<uint16_t*>(p.y) + (m0 + r) * N + n0;
      _mm512_mask_storeu_epi16(y, cols, _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
    }
  }
}

void tile_rows(const Product& p, int rows, int64_t m0, int64_t n0) {
  switch (rows) {
#define JLLM_TILE(R) \
  case R:            \
    return tile<R>(p, m0, n0);
    JLLM_TILE(1) JLLM_TILE(2) JLLM_TILE(3) JLLM_TILE(4) JLLM_TILE(5) JLLM_TILE(6) JLLM_TILE(7)
    JLLM_TILE(8) JLLM_TILE(9) JLLM_TILE(10) JLLM_TILE(11) JLLM_TILE(12) JLLM_TILE(13)
    JLLM_TILE(14)
#undef JLLM_TILE
  }
}

ffi::Error Run(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  if (live) {  // padding rows: zeros, which every later op takes as it took XLA's products
    const int64_t row_bytes = p.N * (p.f32_out ? 4 : 2);
    for (int64_t m = 0; m < p.M; ++m)
      if (!live[m]) std::memset(static_cast<char*>(p.y) + m * row_bytes, 0, row_bytes);
  }
  const std::vector<jllm_cpu::RowTile> tiles = jllm_cpu::live_tiles(live, p.M, kMaxRows);
  const int64_t panels = (p.N + kPanel - 1) / kPanel;
  const auto item = [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel)  // the block's rows reuse it
      for (int64_t t = t0; t < t1; ++t) tile_rows(p, tiles[t].rows, tiles[t].m0, panel * kPanel);
  };
  const int64_t count = int64_t(tiles.size());
  const bool ok = jllm_cpu::share_tile_panels(pool, count, panels, kBlockTiles, item);
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a bf16 matmul work item failed");
}

#else

struct Product {
  const uint16_t* x;
  const uint16_t* w;
  const uint16_t* up;
  void* y;
  int64_t M, N, K;
  bool f32_out;
};

ffi::Error Run(ffi::ThreadPool&, const Product&, const int8_t*) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "the bf16 matmul kernel needs a CPU with AVX512-BF16");
}

#endif  // __AVX512BF16__

// Checks the operands (up: the second weight of a gated product, or nullptr) and runs.
ffi::Error Checked(ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
                   const ffi::AnyBuffer* up, ffi::Buffer<ffi::S32>& layer,
                   ffi::Buffer<ffi::S8>& live, ffi::Result<ffi::AnyBuffer>& y) {
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("x and w must be bfloat16");
  if (y->element_type() != ffi::DataType::BF16 && y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("y must be bfloat16 or float32");
  jllm_cpu::ProductShape shape;
  const ffi::Error bad =
      jllm_cpu::product_shape(x.dimensions(), wd, y->dimensions(), live.element_count(),
                              layer.element_count(), layer.typed_data(), shape);
  if (bad.failure()) return bad;
  if (up && (up->element_type() != ffi::DataType::BF16 ||
             !std::equal(wd.begin(), wd.end(), up->dimensions().begin(),
                         up->dimensions().end())))
    return ffi::Error::InvalidArgument("up must be bfloat16 of w's shape");
  Product p;
  p.M = shape.M;
  p.N = shape.N;
  p.K = shape.K;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {  // silu(0) * 0 is 0 too
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.w = static_cast<const uint16_t*>(w.untyped_data()) + shape.offset;
  p.up = up ? static_cast<const uint16_t*>(up->untyped_data()) + shape.offset : nullptr;
  p.y = y->untyped_data();
  p.f32_out = y->element_type() == ffi::DataType::F32;
  return Run(pool, p, live.element_count() ? live.typed_data() : nullptr);
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                      ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, w, nullptr, layer, live, y);
}

ffi::Error Bf16GatedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate,
                           ffi::AnyBuffer up, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S8> live, ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, gate, &up, layer, live, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16Matmul, Bf16Matmul, jllm_cpu::product_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16GatedMatmul, Bf16GatedMatmul,
                              jllm_cpu::gated_product_binding());
