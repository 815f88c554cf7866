// A float32 matrix product for x86 CPUs with FMA (AVX2 or AVX-512), as an XLA FFI custom call.
//
// y[M, N] = x[M, K] @ w[layer][K, N]: x float32 row-major, w one layer of a stacked float32
// weight [L, K, N] (or [K, N] with layer 0), read in place; y float32. The contract of
// f32_matmul.py. `live` is one byte per row of x (or none): rows marked 0, a step's padding,
// are not computed and come out zero. With the attribute w_transposed, w is [L, N, K] or
// [N, K] (a tied embedding table as the LM head) and y = x @ w[layer]^T.
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
// kBlockTiles tiles by runs of panels, shared over XLA's intra-op pool. With one block, a
// work item of several tiles first packs its panel into a buffer of its own, which its tiles
// then read from cache (a decode step's single tile reads the panel in place); with several
// blocks, the whole weight is packed once, up front, in parallel. Columns past the last full
// panel take a plain loop. A transposed w is packed the same way, 8 x 8 blocks transposed in
// registers; one tile of it (a few rows) takes dot products over w's rows in place instead.
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

// ---- w transposed: y[M, N] = x[M, K] @ w[N, K]^T --------------------------------------------
// The [Out, In] layout of a tied embedding table used as the LM head. Each output is the dot
// product of a row of x and a row of w, both contiguous: a tile is up to kDotRows rows of x
// by kDotCols rows of w, with one 8-lane accumulator per pair (kDotRows x kDotCols of them,
// the x rows' vectors and one w vector in AVX2's 16 registers), summed across lanes at the
// end, with no packing. Used for a step of one tile of live rows (at most kMaxRows), which is
// bound by reading w, and for the columns past a transposed w's last full panel; more rows
// go through the packed panels. 256-bit vectors on every build, AVX-512 ones included (the
// only width this code is tested at).

constexpr int kDotRows = 3;
constexpr int kDotCols = 4;
constexpr int64_t kDotRun = 64;  // groups of kDotCols outputs per work item of run_dots

// The four 8-lane sums a0..a3 as one 4-lane vector.
inline __m128 lane_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Rows m0 .. m0 + R - 1 of x by rows n0 .. n0 + C - 1 of w.
template <int R, int C>
void dots(const Product& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, body = K - K % 8;
  const float* x = p.x + m0 * K;
  const float* w = p.w + n0 * K;
  __m256 acc[R][C];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < body; k += 8) {
    __m256 a[R];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(x + r * K + k);
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
      const __m256 b = _mm256_loadu_ps(w + c * K + k);
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_fmadd_ps(a[r], b, acc[r][c]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    float sums[4];
    _mm_storeu_ps(sums, lane_sums(acc[r][0], C > 1 ? acc[r][1 % C] : zero,
                                  C > 2 ? acc[r][2 % C] : zero, C > 3 ? acc[r][3 % C] : zero));
    for (int c = 0; c < C; ++c) {
      float sum = sums[c];
      for (int64_t k = body; k < K; ++k) sum = std::fma(x[r * K + k], w[c * K + k], sum);
      p.y[(m0 + r) * p.N + n0 + c] = sum;
    }
  }
}

template <int R>
void dots_cols(const Product& p, int64_t m0, int64_t n0, int cols) {
  switch (cols) {
    case 1: return dots<R, 1>(p, m0, n0);
    case 2: return dots<R, 2>(p, m0, n0);
    case 3: return dots<R, 3>(p, m0, n0);
    case 4: return dots<R, 4>(p, m0, n0);
  }
}

void dot_tile(const Product& p, int rows, int64_t m0, int64_t n0, int cols) {
  switch (rows) {
    case 1: return dots_cols<1>(p, m0, n0, cols);
    case 2: return dots_cols<2>(p, m0, n0, cols);
    case 3: return dots_cols<3>(p, m0, n0, cols);
  }
}

// Rows m0 .. m0 + rows - 1 (any number) by columns n0 .. n1 - 1.
void dot_block(const Product& p, int rows, int64_t m0, int64_t n0, int64_t n1) {
  for (int r = 0; r < rows; r += kDotRows)
    for (int64_t n = n0; n < n1; n += kDotCols) {
      const int cols = int(std::min<int64_t>(kDotCols, n1 - n));
      dot_tile(p, std::min(kDotRows, rows - r), m0 + r, n, cols);
    }
}

// A step of at most kMaxRows live rows with w transposed: dot tiles over runs of kDotRun
// groups of outputs, the rows of w read once, in place.
ffi::Error run_dots(ffi::ThreadPool& pool, const Product& p, const jllm_cpu::RowTile& tile) {
  const int64_t span = kDotRun * kDotCols;
  const bool ok = jllm_cpu::share_items(pool, (p.N + span - 1) / span, [&](int64_t i) {
    dot_block(p, tile.rows, tile.m0, i * span, std::min(p.N, (i + 1) * span));
  });
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a float32 matmul work item failed");
}

// The eight rows of r transposed in place (r[i][j] becomes r[j][i]).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// Full panel `panel` of w (columns n0 .. n0 + kPanel - 1) packed into `to`: K rows of kPanel
// floats. w [K, N]: row by row; transposed, w [N, K]: the panel's kPanel rows of w, 8 by 8.
void pack_panel(const Product& p, int64_t panel, bool transposed, float* to) {
  const int64_t K = p.K, n0 = panel * kPanel;
  if (!transposed) {
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(to + k * kPanel, p.w + k * p.N + n0, kPanel * sizeof(float));
    return;
  }
  const float* w = p.w + n0 * K;
  const int64_t body = K - K % 8;
  for (int64_t j0 = 0; j0 < kPanel; j0 += 8) {
    for (int64_t k0 = 0; k0 < body; k0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(w + (j0 + i) * K + k0);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(to + (k0 + i) * kPanel + j0, r[i]);
    }
    for (int64_t k = body; k < K; ++k)
      for (int i = 0; i < 8; ++i) to[k * kPanel + j0 + i] = w[(j0 + i) * K + k];
  }
}

// A thread's buffer of at least `floats` floats, 64-byte aligned, kept between calls: one
// packed panel (panel_scratch, any thread), or a call's whole packed weight (the calling
// thread's own, which no other call uses while this one waits for its items).
float* scratch(std::vector<float>& buffer, size_t floats) {
  if (buffer.size() < floats + 16) buffer.resize(floats + 16);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(float);
}

float* panel_scratch(int64_t K) {
  thread_local std::vector<float> buffer;
  return scratch(buffer, size_t(K * kPanel));
}

// The full panels of w packed one after another, in parallel over the pool; null if a pool
// task failed.
const float* pack_weight(ffi::ThreadPool& pool, const Product& p, int64_t full, bool transposed) {
  thread_local std::vector<float> buffer;
  float* packed = scratch(buffer, size_t(full * p.K * kPanel));
  const bool ok = jllm_cpu::share_items(pool, full, [&](int64_t panel) {
    pack_panel(p, panel, transposed, packed + panel * p.K * kPanel);
  });
  return ok ? packed : nullptr;
}

// Padding rows come out zero, which every later op takes as it took XLA's products.
void zero_padding_rows(const Product& p, const int8_t* live) {
  if (!live) return;
  for (int64_t m = 0; m < p.M; ++m)
    if (!live[m]) std::fill(p.y + m * p.N, p.y + (m + 1) * p.N, 0.0f);
}

ffi::Error Run(ffi::ThreadPool& pool, const Product& p, const int8_t* live, bool transposed) {
  zero_padding_rows(p, live);
  const std::vector<jllm_cpu::RowTile> tiles = jllm_cpu::live_tiles(live, p.M, kMaxRows);
  const int64_t count = int64_t(tiles.size());
  if (count == 0) return ffi::Error::Success();
  // One tile of a transposed w (single-stream decode, say): the product is bound by
  // reading w, which the dot tiles read once, in place, with no transposing.
  if (transposed && count == 1) return run_dots(pool, p, tiles[0]);
  const int64_t full = p.N / kPanel;                 // full panels
  const int64_t panels = full + (p.N % kPanel != 0);  // and the edge, if any
  // Several blocks of tiles: the weight is packed once for all of them, up front. One block
  // (a step of up to kBlockTiles tiles): each work item packs its own panel, if it has
  // several tiles or w is transposed, or reads it in place.
  const float* packed = nullptr;
  if (count > kBlockTiles && full > 0) {
    packed = pack_weight(pool, p, full, transposed);
    if (!packed) return ffi::Error::Internal("packing a float32 matmul weight failed");
  }
  const auto item = [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel) {  // the block's rows reuse it
      const int64_t n0 = panel * kPanel;
      if (panel == full) {
        for (int64_t t = t0; t < t1; ++t) {
          if (transposed)
            dot_block(p, tiles[t].rows, tiles[t].m0, n0, p.N);
          else
            edge(p, tiles[t].rows, tiles[t].m0, n0);
        }
        continue;
      }
      // Packed, the panel's rows lie next to each other. In place, they lie N floats apart,
      // a stride that maps them onto a few cache sets (N = 1536: two of L1's 64), so the
      // panel would not stay in cache from one tile to the next.
      const float* w = p.w + n0;
      int64_t ldw = p.N;
      if (packed) {
        w = packed + panel * p.K * kPanel;
        ldw = kPanel;
      } else if (transposed || t1 - t0 > 1) {
        float* own = panel_scratch(p.K);
        pack_panel(p, panel, transposed, own);
        w = own;
        ldw = kPanel;
      }
      for (int64_t t = t0; t < t1; ++t) tile_rows(p, w, ldw, tiles[t].rows, tiles[t].m0, n0);
    }
  };
  const bool ok = jllm_cpu::share_tile_panels(pool, count, panels, kBlockTiles, item);
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a float32 matmul work item failed");
}

#else

ffi::Error Run(ffi::ThreadPool&, const Product&, const int8_t*, bool) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "the float32 matmul kernel needs an x86 CPU with FMA");
}

#endif  // JLLM_F32_MATMUL

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                     ffi::ResultBuffer<ffi::F32> y, bool w_transposed) {
  // Transposed, w is [L, N, K] or [N, K]: checked as the [.., K, N] it stands for.
  std::vector<int64_t> wd(w.dimensions().begin(), w.dimensions().end());
  if (w_transposed && wd.size() >= 2) std::swap(wd[wd.size() - 1], wd[wd.size() - 2]);
  jllm_cpu::ProductShape shape;
  const ffi::Error bad =
      jllm_cpu::product_shape(x.dimensions(), wd, y->dimensions(), live.element_count(),
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
  const int8_t* rows = live.element_count() ? live.typed_data() : nullptr;
  return Run(pool, p, rows, w_transposed);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmF32Matmul, F32Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, K, N] or [K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // live [M] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("w_transposed"));
