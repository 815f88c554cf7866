// A matrix product in float32 arithmetic for x86 CPUs with FMA (AVX2 or AVX-512), as an XLA
// FFI custom call.
//
// y[M, N] = x[M, K] @ w[layer][K, N]: x row-major, w one layer of a stacked weight [L, K, N]
// (or [K, N] with layer 0), read in place; each of x, w and y float32 or bfloat16, the sums
// in float32 (bf16 operands are widened, exactly; a bf16 y is rounded once, to nearest even,
// as XLA converts). The contract of f32_matmul.py. `live` is one byte per row of x (or
// none): rows marked 0, a step's padding, are not computed and come out zero. With the
// attribute w_transposed, w is [L, N, K] or [N, K] (a tied embedding table as the LM head)
// and y = x @ w[layer]^T; with batch_invariant, every row's sums run in one order whatever
// the number of rows (the batch-invariant mode: no dot-product path for a few rows). A second
// entry point takes two weights of one shape and writes silu(x @ gate) * (x @ up) (a gated
// MLP's first half), the SiLU taken on the float32 sums.
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
// bf16 operands, for CPUs without bf16 instructions (AVX2, or AVX-512 without AVX512-BF16):
// x is widened to float32 up front, w as it is packed or read (a shift of each 16-bit
// value into the high half of a float), so the tiles run on float32 as above while reading
// half the weight bytes. XLA's CPU products convert bf16 operands to float32 the same way.
//
// Sums run in order of k with one FMA per term (XLA's products block and reorder their
// sums), so results match XLA's to float32 rounding, not bit for bit.
//
// Built at run time with GCC (g++ -O3 -march=native) by build.py; without FMA it builds to
// a handler that returns an error, and f32_matmul.py never calls it there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__FMA__) && (defined(__AVX512F__) || defined(__AVX2__))
#define JLLM_F32_MATMUL 1
#include <immintrin.h>

#include "cpu_silu.h"  // this folder: silu_times
#endif

#include "cpu_bf16.h"  // this folder: bfloat16 conversions
#include "cpu_pool.h"  // this folder: share_items
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bf16 = uint16_t;  // a bfloat16's bits

// x is float32 by the time a Product is run (a bf16 x is widened first); TW and TY are w's
// and y's element types, float or bf16.
template <typename TW, typename TY>
struct Product {
  const float* x;           // [M, K]
  const TW* w;              // [K, N], this layer's
  const TW* up = nullptr;   // [K, N], this layer's, or none: y = silu(x @ w) * (x @ up)
  TY* y;                    // [M, N]
  int64_t M, N, K;
};

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return jllm_cpu::bf16_to_float(v); }

// Rounded to nearest even, NaN kept a (quiet) NaN: XLA's conversion.
inline void narrow(float v, float* to) { *to = v; }
inline void narrow(float v, bf16* to) { *to = jllm_cpu::float_to_bf16(v); }

#ifdef JLLM_F32_MATMUL

#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;
constexpr bool kManyRegisters = true;  // 32 vector registers
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void vstore(bf16* p, Vec v);  // two store8 below
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr bool kManyRegisters = false;  // 16 vector registers
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const bf16* p);  // load8 below
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void vstore(bf16* p, Vec v);  // store8 below
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// Eight values widened to float32, and eight float32 stored as T: 256-bit on every build.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {  // as narrow(), 8 lanes at once
  const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  // Every lane is below 2^16, so the signed-to-unsigned pack keeps it as it is.
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
#ifdef __AVX512F__
inline void vstore(bf16* p, Vec v) {  // the rounding written once, in store8
  store8(p, _mm512_castps512_ps256(v));
  store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
inline Vec vload(const bf16* p) { return load8(p); }
inline void vstore(bf16* p, Vec v) { store8(p, v); }
#endif

constexpr int kPanelVecs = 4;
constexpr int64_t kPanel = kPanelVecs * kLanes;  // columns per panel: 32 (AVX2) or 64
constexpr int kMaxRows = 6;
constexpr int64_t kBlockTiles = 32;  // tiles per work item (192 rows when full)

using jllm_cpu::silu_times;

// Rows 0 .. R - 1 of x by the V vectors of columns from w's column 0 (w's rows ldw elements
// apart, float32 when packed, the weight's own type in place), summed over all K into acc.
template <int R, int V, typename TP>
__attribute__((always_inline)) inline void accumulate(const float* x, int64_t K, const TP* w,
                                                      int64_t ldw, Vec (&acc)[R][V]) {
  // Unrolled by pragma so that GCC keeps the arrays in registers.
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k, w += ldw) {
    Vec b[V];
    _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) b[v] = vload(w + v * kLanes);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const Vec a = vbroadcast(x + r * K + k);
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
}

// One full panel (columns n0 .. n0 + kPanel - 1, read from `panel`, and from `up_panel` if
// the product is gated; rows ldw elements apart) of rows m0 .. m0 + R - 1: in one pass, or
// in two of half a panel where the registers do not hold R x 4 accumulators.
template <int R, typename TW, typename TY, typename TP>
void tile(const Product<TW, TY>& p, const TP* panel, const TP* up_panel, int64_t ldw,
          int64_t m0, int64_t n0) {
  constexpr bool halves = !kManyRegisters && R > 2;
  constexpr int V = halves ? kPanelVecs / 2 : kPanelVecs;
  const float* x = p.x + m0 * p.K;
  for (int64_t c = 0; c < kPanel; c += V * kLanes) {
    TY* y = p.y + m0 * p.N + n0 + c;
    Vec acc[R][V];
    accumulate<R, V>(x, p.K, panel + c, ldw, acc);
    if (up_panel) {
      Vec up[R][V];
      accumulate<R, V>(x, p.K, up_panel + c, ldw, up);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
          _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
              acc[r][v] = silu_times(acc[r][v], up[r][v]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
            vstore(y + r * p.N + v * kLanes, acc[r][v]);
  }
}

template <typename TW, typename TY, typename TP>
void tile_rows(const Product<TW, TY>& p, const TP* panel, const TP* up_panel, int64_t ldw,
               int rows, int64_t m0, int64_t n0) {
  switch (rows) {
#define JLLM_TILE(R) \
  case R:            \
    return tile<R>(p, panel, up_panel, ldw, m0, n0);
    JLLM_TILE(1) JLLM_TILE(2) JLLM_TILE(3) JLLM_TILE(4) JLLM_TILE(5) JLLM_TILE(6)
#undef JLLM_TILE
  }
}

// Columns n0 .. N - 1 (fewer than a panel) of rows m0 .. m0 + rows - 1, term by term.
template <typename TW, typename TY>
void edge(const Product<TW, TY>& p, int rows, int64_t m0, int64_t n0) {
  const int64_t K = p.K, N = p.N, cols = N - n0;
  float acc[kPanel], up[kPanel];
  for (int r = 0; r < rows; ++r) {
    std::fill(acc, acc + cols, 0.0f);
    std::fill(up, up + cols, 0.0f);
    const float* x = p.x + (m0 + r) * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < cols; ++c) {
        acc[c] = std::fma(x[k], widen(p.w[k * N + n0 + c]), acc[c]);
        if (p.up) up[c] = std::fma(x[k], widen(p.up[k * N + n0 + c]), up[c]);
      }
    if (p.up) {  // the same silu_times as the panels', a vector's worth at a time
      float g[kLanes], u[kLanes];
      for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, cols - c0);
        std::fill(g, g + kLanes, 0.0f);
        std::fill(u, u + kLanes, 0.0f);
        std::copy(acc + c0, acc + c0 + n, g);
        std::copy(up + c0, up + c0 + n, u);
        vstore(g, silu_times(vload(g), vload(u)));
        std::copy(g, g + n, acc + c0);
      }
    }
    for (int64_t c = 0; c < cols; ++c) narrow(acc[c], p.y + (m0 + r) * N + n0 + c);
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
template <int R, int C, typename TW, typename TY>
void dots(const Product<TW, TY>& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, body = K - K % 8;
  const float* x = p.x + m0 * K;
  const TW* w = p.w + n0 * K;
  __m256 acc[R][C];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < body; k += 8) {
    __m256 a[R];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(x + r * K + k);
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {
      const __m256 b = load8(w + c * K + k);
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
      for (int64_t k = body; k < K; ++k) sum = std::fma(x[r * K + k], widen(w[c * K + k]), sum);
      narrow(sum, p.y + (m0 + r) * p.N + n0 + c);
    }
  }
}

template <int R, typename TW, typename TY>
void dots_cols(const Product<TW, TY>& p, int64_t m0, int64_t n0, int cols) {
  switch (cols) {
    case 1: return dots<R, 1>(p, m0, n0);
    case 2: return dots<R, 2>(p, m0, n0);
    case 3: return dots<R, 3>(p, m0, n0);
    case 4: return dots<R, 4>(p, m0, n0);
  }
}

template <typename TW, typename TY>
void dot_tile(const Product<TW, TY>& p, int rows, int64_t m0, int64_t n0, int cols) {
  switch (rows) {
    case 1: return dots_cols<1>(p, m0, n0, cols);
    case 2: return dots_cols<2>(p, m0, n0, cols);
    case 3: return dots_cols<3>(p, m0, n0, cols);
  }
}

// Rows m0 .. m0 + rows - 1 (any number) by columns n0 .. n1 - 1.
template <typename TW, typename TY>
void dot_block(const Product<TW, TY>& p, int rows, int64_t m0, int64_t n0, int64_t n1) {
  for (int r = 0; r < rows; r += kDotRows)
    for (int64_t n = n0; n < n1; n += kDotCols) {
      const int cols = int(std::min<int64_t>(kDotCols, n1 - n));
      dot_tile(p, std::min(kDotRows, rows - r), m0 + r, n, cols);
    }
}

// A step of at most kMaxRows live rows with w transposed: dot tiles over runs of kDotRun
// groups of outputs, the rows of w read once, in place.
template <typename TW, typename TY>
ffi::Error run_dots(ffi::ThreadPool& pool, const Product<TW, TY>& p,
                    const jllm_cpu::RowTile& tile) {
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

// n values of `from` as float32 in `to`.
inline void widen_run(const float* from, float* to, int64_t n) {
  std::memcpy(to, from, n * sizeof(float));
}
inline void widen_run(const bf16* from, float* to, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, load8(from + i));
  for (; i < n; ++i) to[i] = widen(from[i]);
}

// Full panel `panel` of `weight` (p.w or p.up; columns n0 .. n0 + kPanel - 1) packed into
// `to` as float32: K rows of kPanel floats. [K, N]: row by row; transposed, [N, K]: the
// panel's kPanel rows, 8 by 8.
template <typename TW, typename TY>
void pack_panel(const Product<TW, TY>& p, const TW* weight, int64_t panel, bool transposed,
                float* to) {
  const int64_t K = p.K, n0 = panel * kPanel;
  if (!transposed) {
    for (int64_t k = 0; k < K; ++k) widen_run(weight + k * p.N + n0, to + k * kPanel, kPanel);
    return;
  }
  const TW* w = weight + n0 * K;
  const int64_t body = K - K % 8;
  for (int64_t j0 = 0; j0 < kPanel; j0 += 8) {
    for (int64_t k0 = 0; k0 < body; k0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(w + (j0 + i) * K + k0);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(to + (k0 + i) * kPanel + j0, r[i]);
    }
    for (int64_t k = body; k < K; ++k)
      for (int i = 0; i < 8; ++i) to[k * kPanel + j0 + i] = widen(w[(j0 + i) * K + k]);
  }
}

// A thread's buffer of at least `floats` floats, 64-byte aligned, kept between calls: one
// packed panel (panel_scratch, any thread), or a call's whole packed weight or widened x
// (the calling thread's own, which no other call uses while this one waits for its items).
float* scratch(std::vector<float>& buffer, size_t floats) {
  if (buffer.size() < floats + 16) buffer.resize(floats + 16);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(float);
}

// Room for two panels: w's, and up's in a gated product.
float* panel_scratch(int64_t K) {
  thread_local std::vector<float> buffer;
  return scratch(buffer, size_t(2 * K * kPanel));
}

// The full panels of w (and of up, after them) packed one after another, in parallel over
// the pool; null if a pool task failed.
template <typename TW, typename TY>
const float* pack_weight(ffi::ThreadPool& pool, const Product<TW, TY>& p, int64_t full,
                         bool transposed) {
  thread_local std::vector<float> buffer;
  const int64_t weights = p.up ? 2 : 1, panel_floats = p.K * kPanel;
  float* packed = scratch(buffer, size_t(weights * full * panel_floats));
  const bool ok = jllm_cpu::share_items(pool, weights * full, [&](int64_t i) {
    const TW* weight = i < full ? p.w : p.up;
    pack_panel(p, weight, i % full, transposed, packed + i * panel_floats);
  });
  return ok ? packed : nullptr;
}

// x [M, K] as float32: itself, or widened from bf16 (its live rows, in parallel) into the
// calling thread's buffer; null if a pool task failed.
const float* widen_x(ffi::ThreadPool&, const float* x, int64_t, int64_t, const int8_t*) {
  return x;
}
const float* widen_x(ffi::ThreadPool& pool, const bf16* x, int64_t M, int64_t K,
                     const int8_t* live) {
  thread_local std::vector<float> buffer;
  float* to = scratch(buffer, size_t(M * K));
  constexpr int64_t kRows = 64;  // per work item
  const bool ok = jllm_cpu::share_items(pool, (M + kRows - 1) / kRows, [&](int64_t i) {
    for (int64_t m = i * kRows; m < std::min(M, (i + 1) * kRows); ++m)
      if (!live || live[m]) widen_run(x + m * K, to + m * K, K);
  });
  return ok ? to : nullptr;
}

// Padding rows come out zero, which every later op takes as it took XLA's products.
template <typename TW, typename TY>
void zero_padding_rows(const Product<TW, TY>& p, const int8_t* live) {
  if (!live) return;
  for (int64_t m = 0; m < p.M; ++m)
    if (!live[m]) std::memset(p.y + m * p.N, 0, p.N * sizeof(TY));
}

template <typename TW, typename TY>
ffi::Error Run(ffi::ThreadPool& pool, const Product<TW, TY>& p, const int8_t* live,
               bool transposed, bool invariant) {
  zero_padding_rows(p, live);
  const std::vector<jllm_cpu::RowTile> tiles = jllm_cpu::live_tiles(live, p.M, kMaxRows);
  const int64_t count = int64_t(tiles.size());
  if (count == 0) return ffi::Error::Success();
  // One tile of a transposed w (single-stream decode, say): the product is bound by
  // reading w, which the dot tiles read once, in place, with no transposing. Not in the
  // batch-invariant mode: the dot tiles sum each output in eight lanes, the panels in order
  // of k, so a row's result would depend on how many rows share its step.
  if (transposed && count == 1 && !invariant) return run_dots(pool, p, tiles[0]);
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
      // Packed, the panel's rows lie next to each other. In place, they lie N elements
      // apart, a stride that maps them onto a few cache sets (N = 1536 floats: two of L1's
      // 64), so the panel would not stay in cache from one tile to the next.
      const int64_t panel_floats = p.K * kPanel;
      const float *w = nullptr, *up = nullptr;
      if (packed) {
        w = packed + panel * panel_floats;
        if (p.up) up = packed + (full + panel) * panel_floats;
      } else if (transposed || t1 - t0 > 1) {
        float* own = panel_scratch(p.K);
        pack_panel(p, p.w, panel, transposed, own);
        w = own;
        if (p.up) {
          pack_panel(p, p.up, panel, transposed, own + panel_floats);
          up = own + panel_floats;
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        const jllm_cpu::RowTile& tile = tiles[t];
        if (w)
          tile_rows(p, w, up, kPanel, tile.rows, tile.m0, n0);
        else
          tile_rows(p, p.w + n0, p.up ? p.up + n0 : nullptr, p.N, tile.rows, tile.m0, n0);
      }
    }
  };
  const bool ok = jllm_cpu::share_tile_panels(pool, count, panels, kBlockTiles, item);
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a float32 matmul work item failed");
}

// Widens x if it is bf16, then runs.
template <typename TX, typename TW, typename TY>
ffi::Error Widened(ffi::ThreadPool& pool, const TX* x, Product<TW, TY>& p, const int8_t* live,
                   bool transposed, bool invariant) {
  p.x = widen_x(pool, x, p.M, p.K, live);
  if (!p.x) return ffi::Error::Internal("widening a bf16 x failed");
  return Run(pool, p, live, transposed, invariant);
}

#else

template <typename TX, typename TW, typename TY>
ffi::Error Widened(ffi::ThreadPool&, const TX*, Product<TW, TY>&, const int8_t*, bool, bool) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "the float32 matmul kernel needs an x86 CPU with FMA");
}

#endif  // JLLM_F32_MATMUL

// The operands, checked: w's dimensions (up's too, in a gated product) and every dtype.
struct Operands {
  jllm_cpu::ProductShape shape;
  const void *x, *w, *up;
  void* y;
  const int8_t* live;
  bool transposed;
  bool invariant;  // the batch-invariant mode: one summation order whatever the rows
};

template <typename TX, typename TW, typename TY>
ffi::Error Typed(ffi::ThreadPool& pool, const Operands& o) {
  Product<TW, TY> p;
  p.M = o.shape.M;
  p.N = o.shape.N;
  p.K = o.shape.K;
  p.w = static_cast<const TW*>(o.w) + o.shape.offset;
  p.up = o.up ? static_cast<const TW*>(o.up) + o.shape.offset : nullptr;
  p.y = static_cast<TY*>(o.y);
  return Widened(pool, static_cast<const TX*>(o.x), p, o.live, o.transposed, o.invariant);
}

bool float32_or_bf16(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
}

// Checks the operands (up: the second weight of a gated product, or nullptr) and runs the
// instance for their dtypes.
ffi::Error Checked(ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
                   const ffi::AnyBuffer* up, ffi::Buffer<ffi::S32>& layer,
                   ffi::Buffer<ffi::S8>& live, ffi::Result<ffi::AnyBuffer>& y, bool transposed,
                   bool invariant) {
  const ffi::DataType wt = w.element_type();
  if (!float32_or_bf16(x.element_type()) || !float32_or_bf16(wt) ||
      !float32_or_bf16(y->element_type()))
    return ffi::Error::InvalidArgument("x, w and y must each be float32 or bfloat16");
  const auto wdims = w.dimensions();
  if (up && (up->element_type() != wt ||
             !std::equal(wdims.begin(), wdims.end(), up->dimensions().begin(),
                         up->dimensions().end())))
    return ffi::Error::InvalidArgument("up must be of gate's dtype and shape");
  // Transposed, w is [L, N, K] or [N, K]: checked as the [.., K, N] it stands for.
  std::vector<int64_t> wd(wdims.begin(), wdims.end());
  if (transposed && wd.size() >= 2) std::swap(wd[wd.size() - 1], wd[wd.size() - 2]);
  Operands o;
  const ffi::Error bad =
      jllm_cpu::product_shape(x.dimensions(), wd, y->dimensions(), live.element_count(),
                              layer.element_count(), layer.typed_data(), o.shape);
  if (bad.failure()) return bad;
  if (o.shape.M == 0 || o.shape.N == 0) return ffi::Error::Success();
  if (o.shape.K == 0) {  // silu(0) * 0 is 0 too
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  o.x = x.untyped_data();
  o.w = w.untyped_data();
  o.up = up ? up->untyped_data() : nullptr;
  o.y = y->untyped_data();
  o.live = live.element_count() ? live.typed_data() : nullptr;
  o.transposed = transposed;
  o.invariant = invariant;
  const bool x32 = x.element_type() == ffi::DataType::F32;
  const bool w32 = wt == ffi::DataType::F32, y32 = y->element_type() == ffi::DataType::F32;
  // Every combination of the three dtypes, each an instance of the loops above.
  if (x32 && w32)
    return y32 ? Typed<float, float, float>(pool, o) : Typed<float, float, bf16>(pool, o);
  if (x32)
    return y32 ? Typed<float, bf16, float>(pool, o) : Typed<float, bf16, bf16>(pool, o);
  if (w32)
    return y32 ? Typed<bf16, float, float>(pool, o) : Typed<bf16, float, bf16>(pool, o);
  return y32 ? Typed<bf16, bf16, float>(pool, o) : Typed<bf16, bf16, bf16>(pool, o);
}

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                     ffi::Result<ffi::AnyBuffer> y, bool w_transposed, bool batch_invariant) {
  return Checked(pool, x, w, nullptr, layer, live, y, w_transposed, batch_invariant);
}

ffi::Error F32GatedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate,
                          ffi::AnyBuffer up, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S8> live, ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, gate, &up, layer, live, y, false, false);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmF32Matmul, F32Matmul,
                              jllm_cpu::product_binding()
                                  .Attr<bool>("w_transposed")
                                  .Attr<bool>("batch_invariant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmF32GatedMatmul, F32GatedMatmul,
                              jllm_cpu::gated_product_binding());
