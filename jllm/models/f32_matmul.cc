// A float32 matrix product for x86 CPUs with FMA (AVX2 or AVX-512), as an XLA FFI custom call.
//
// y[M, N] = x[M, K] @ w[layer][K, N]: x float32 row-major, w one layer of a stacked float32
// weight [L, K, N] (or [K, N] with layer 0), read in place; y float32. The contract of
// f32_matmul.py. `live` is one byte per row of x (or none): rows marked 0, a step's padding,
// are not computed and come out zero.
//
// Why not XLA's product: inside the model's layer scan XLA copies each layer's weights out
// of the stack before multiplying (a dynamic slice into a new buffer, then the product).
// For a decode step's few rows that copy is most of the work: it reads and writes every
// weight once more than the product reads it. A single-stream SmolLM2 step on a 2-core Zen 3
// spent about two thirds of its traced thunk time in those copies.
//
// The loop: a tile is up to kMaxRows rows of x by one panel of kPanel columns of w, with
// the tile's rows x kPanel columns of accumulators in registers (in two passes of half a
// panel for 3-6 rows on AVX2, whose 16 registers hold 12 accumulators, the weight vectors
// and one broadcast). Per input k it loads the panel's row of w and, per row of the tile,
// broadcasts x[m][k] and issues one FMA per vector. Work items are blocks of up to
// kBlockTiles tiles by runs of panels, shared over XLA's intra-op pool; a block of several
// tiles first packs each panel into a buffer of its own, which its tiles then read from
// cache (a decode step's single tile reads the panel in place). Columns past the last full
// panel take a plain loop.
//
// Sums run in order of k with one FMA per term (XLA's products block and reorder their
// sums), so results match XLA's to float32 rounding, not bit for bit.
//
// Built at run time with GCC (g++ -O3 -march=native) by the CPU attention kernel's
// machinery; without FMA it builds to a handler that returns an error, and f32_matmul.py
// never calls it there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__FMA__) && (defined(__AVX512F__) || defined(__AVX2__))
#define JLLM_F32_MATMUL 1
#include <immintrin.h>
#endif

#include "cpu_pool.h"  // pallas_kernels/: share_items
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Product {
  const float* x;  // [M, K]
  const float* w;  // [K, N], this layer's
  float* y;        // [M, N]
  int64_t M, N, K;
};

#ifdef JLLM_F32_MATMUL

#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;
constexpr bool kManyRegisters = true;  // 32 vector registers
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr bool kManyRegisters = false;  // 16 vector registers
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

constexpr int kPanelVecs = 4;
constexpr int64_t kPanel = kPanelVecs * kLanes;  // columns per panel: 32 (AVX2) or 64
constexpr int kMaxRows = 6;
constexpr int64_t kBlockTiles = 32;  // tiles per work item (192 rows when full)

// Rows m0 .. m0 + R - 1 by the V vectors of columns from w's column 0 (w and y already
// offset to the panel's first column; w's rows ldw floats apart): y = x @ w over all K.
template <int R, int V>
__attribute__((always_inline)) inline void vectors(const Product& p, const float* w,
                                                   int64_t ldw, int64_t m0, float* y) {
  const int64_t K = p.K, N = p.N;
  Vec acc[R][V];
  // Unrolled by pragma so that GCC keeps the arrays in registers.
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  const float* x = p.x + m0 * K;
  for (int64_t k = 0; k < K; ++k, w += ldw) {
    Vec b[V];
    _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) b[v] = vload(w + v * kLanes);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const Vec a = vbroadcast(x + r * K + k);
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
          vstore(y + (m0 + r) * N + v * kLanes, acc[r][v]);
}

// One full panel (columns n0 .. n0 + kPanel - 1, read from `panel`, rows ldw floats apart)
// of rows m0 .. m0 + R - 1: in one pass, or in two of half a panel where the registers do
// not hold R x 4 accumulators.
template <int R>
void tile(const Product& p, const float* panel, int64_t ldw, int64_t m0, int64_t n0) {
  constexpr bool halves = !kManyRegisters && R > 2;
  constexpr int V = halves ? kPanelVecs / 2 : kPanelVecs;
  for (int64_t c = 0; c < kPanel; c += V * kLanes)
    vectors<R, V>(p, panel + c, ldw, m0, p.y + n0 + c);
}

void tile_rows(const Product& p, const float* panel, int64_t ldw, int rows, int64_t m0,
               int64_t n0) {
  switch (rows) {
#define JLLM_TILE(R) \
  case R:            \
    return tile<R>(p, panel, ldw, m0, n0);
    JLLM_TILE(1) JLLM_TILE(2) JLLM_TILE(3) JLLM_TILE(4) JLLM_TILE(5) JLLM_TILE(6)
#undef JLLM_TILE
  }
}

// Columns n0 .. N - 1 (fewer than a panel) of rows m0 .. m0 + rows - 1, term by term.
void edge(const Product& p, int rows, int64_t m0, int64_t n0) {
  const int64_t K = p.K, N = p.N, cols = N - n0;
  float acc[kPanel];
  for (int r = 0; r < rows; ++r) {
    std::fill(acc, acc + cols, 0.0f);
    const float* x = p.x + (m0 + r) * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < cols; ++c) acc[c] = std::fma(x[k], p.w[k * N + n0 + c], acc[c]);
    std::copy(acc, acc + cols, p.y + (m0 + r) * N + n0);
  }
}

// This thread's buffer for one packed panel of K rows, 64-byte aligned, kept between calls.
float* panel_scratch(int64_t K) {
  thread_local std::vector<float> scratch;
  const size_t floats = size_t(K * kPanel) + 16;
  if (scratch.size() < floats) scratch.resize(floats);
  const uintptr_t at = reinterpret_cast<uintptr_t>(scratch.data());
  return scratch.data() + ((64 - at % 64) % 64) / sizeof(float);
}

ffi::Error Run(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  if (live) {  // padding rows: zeros, which every later op takes as it took XLA's products
    for (int64_t m = 0; m < p.M; ++m)
      if (!live[m]) std::fill(p.y + m * p.N, p.y + (m + 1) * p.N, 0.0f);
  }
  const std::vector<jllm_cpu::RowTile> tiles = jllm_cpu::live_tiles(live, p.M, kMaxRows);
  const int64_t full = p.N / kPanel;                 // full panels
  const int64_t panels = full + (p.N % kPanel != 0);  // and the edge, if any
  const auto item = [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel) {  // the block's rows reuse it
      const int64_t n0 = panel * kPanel;
      if (panel == full) {
        for (int64_t t = t0; t < t1; ++t) edge(p, tiles[t].rows, tiles[t].m0, n0);
        continue;
      }
      // Several tiles: the panel packed first, its rows next to each other. In place, a
      // panel's rows lie N floats apart, a stride that maps them onto a few cache sets (N =
      // 1536: two of L1's 64), so the panel would not stay in cache from one tile to the next.
      const float* w = p.w + n0;
      int64_t ldw = p.N;
      if (t1 - t0 > 1) {
        float* packed = panel_scratch(p.K);
        for (int64_t k = 0; k < p.K; ++k)
          std::memcpy(packed + k * kPanel, w + k * p.N, kPanel * sizeof(float));
        w = packed;
        ldw = kPanel;
      }
      for (int64_t t = t0; t < t1; ++t) tile_rows(p, w, ldw, tiles[t].rows, tiles[t].m0, n0);
    }
  };
  const int64_t count = int64_t(tiles.size());
  const bool ok = jllm_cpu::share_tile_panels(pool, count, panels, kBlockTiles, item);
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a float32 matmul work item failed");
}

#else

ffi::Error Run(ffi::ThreadPool&, const Product&, const int8_t*) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "the float32 matmul kernel needs an x86 CPU with FMA");
}

#endif  // JLLM_F32_MATMUL

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                     ffi::ResultBuffer<ffi::F32> y) {
  jllm_cpu::ProductShape shape;
  const ffi::Error bad =
      jllm_cpu::product_shape(x.dimensions(), w.dimensions(), y->dimensions(), live.element_count(),
                              layer.element_count(), layer.typed_data(), shape);
  if (bad.failure()) return bad;
  Product p;
  p.M = shape.M;
  p.N = shape.N;
  p.K = shape.K;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  p.x = x.typed_data();
  p.w = w.typed_data() + shape.offset;
  p.y = y->typed_data();
  return Run(pool, p, live.element_count() ? live.typed_data() : nullptr);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmF32Matmul, F32Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, K, N] or [K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // live [M] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
