// A bfloat16 matrix product for CPUs with AVX512-BF16, as an XLA FFI custom call.
//
// y[M, N] = x[M, K] @ w[layer][K, N]: x bfloat16 row-major, w one layer of a stacked
// bfloat16 weight [L, K, N] (or [K, N] with layer 0), read in place; y bfloat16 or float32
// (the result buffer's type), accumulated in float32. The contract of bf16_matmul.py. A
// second entry point takes two weights of one shape and writes silu(x @ gate) * (x @ up)
// (a gated MLP's first half), the SiLU taken on the float32 accumulators. Both take `live`,
// one byte per row of x (or none): rows marked 0, a step's padding, are not computed and
// come out zero. The *Packed entry points take the weights as packed panels instead
// ([L, ceil(N / 32), 2, Kp / 2, 32], bf16_matmul.py `pack`: the layout below that the tiles
// take), packed once by the engine: read where they lie, the same products bitwise.
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
// cache. A product of 1 to 4 rows, which reads each weight once, takes items of 4 panels
// (2 at 3-4 rows) side by side instead, prefetching the weight rows ahead.
//
// With AMX (the tile instructions, `amx_bf16`; built with them where -march=native has them,
// and the process granted the tile state by the kernel), products of at least kAmxMinRows (5)
// live rows run on the tiles instead: each 32-column panel of w is packed into the pairs
// layout the tiles take (two halves of 16 columns, Kp/2 rows of (w[2k][n], w[2k+1][n]) pairs
// each, zeros past K and N), by the work item that uses it when the product has one block of
// row tiles (a decode step: items of up to 4 panels, as many as the threads share evenly),
// else once for every block first; each 32-row tile of x is multiplied by it as two A tiles
// (16 rows by 32 inputs, read in place when K is a multiple of 32 and the tile is whole, else
// from a zero-padded copy) against two B tiles into four 16x16 float32 accumulator tiles,
// stored and then written out as the vector loop writes its own. The tiles sum each 32-input
// chunk in their own order, so with AMX a row's sums depend on whether its step took the
// tiles: the batch-invariant mode uses the build without them (bf16_matmul.py,
// `-mno-amx-tile`).
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

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define JLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_pool.h"  // this folder: share_items
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per tile

struct Product {
  const uint16_t* x;   // [M, K]
  const uint16_t* w;   // [K, N], this layer's (or its packed panels: `packed`)
  const uint16_t* up;  // [K, N], this layer's, or nullptr: y = silu(x @ w) * (x @ up)
  void* y;             // [M, N]
  int64_t M, N, K;
  bool f32_out;
  bool packed = false;  // w and up are packed panels (pack_panels' layout), not [K, N]
};

constexpr int64_t kAmxK = 32;  // inputs per A tile row (64 bytes); packed panels' K pads to it

inline int64_t padded_k(int64_t K) { return (K + kAmxK - 1) / kAmxK * kAmxK; }

// A packed panel of 32 columns, as the B tiles take them: two halves of 16 columns, each
// Kp/2 rows of 64 bytes (row k2: the pairs (w[2 k2][n], w[2 k2 + 1][n]) of its 16 columns),
// the second half half_words() after the first; zeros past K and N. Each B tile is then 16
// whole cache lines: from rows of 128 bytes (both halves side by side) the tiles ran at less
// than half the rate on the AMX Xeon (717 against 1515-1665 GFLOP/s a core, loads and
// products from L1).
inline int64_t half_words(int64_t Kp) { return Kp / 2 * 16; }

// One packed panel's bfloat16 elements (both halves).
inline int64_t panel_elements(int64_t K) { return 4 * half_words(padded_k(K)); }

#ifdef __AVX512BF16__

constexpr int kMaxRows = 14;      // 28 accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t kBlockTiles = 8;  // tiles per work item (112 rows when full)
// 1 to 4 rows (a decode of one or a few sequences): wide items, whose weight reads are the
// step's cost. kWidePanels panels an item at 1-2 rows (16 accumulators; half as many at 3-4),
// so that each weight row is read 256 contiguous bytes at a time, not 64; the rows
// kPrefetchRows inputs ahead are prefetched. Measured on the 2-core AMX Xeon (SmolLM2's
// products of one decode token, 30 layers, weights from memory): one row, one panel 49-53 ms,
// four 28-34, four with the prefetch 26-28, eight no better; four rows 60-67 ms on one
// panel, 44-50 on two. A column's sums take the same order as in the tiles of the loop.
constexpr int kWideRows = 4;
// A packed panel's first tile (the one that reads it from memory; the block's other tiles
// find it in cache) prefetches the lines kStreamBytes past those it loads, in each half.
constexpr int64_t kStreamBytes = 4096;
constexpr int kWidePanels = 4;
constexpr int64_t kPrefetchRows = 16;

// The unpack instructions work within 128-bit lanes: unpacklo of two 32-value rows holds
// columns 0-3, 8-11, 16-19, 24-27 (one group of four per lane), unpackhi the groups between.
// permutex2var(lo, first, hi) gives columns 0-15 in order, with `second` 16-31.
struct ColumnOrder {
  __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
};

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// Panel n0's columns of N: all 32, or those left at the right edge.
inline __mmask32 panel_cols(int64_t N, int64_t n0) {
  return n0 + kPanel <= N ? ~__mmask32(0) : (__mmask32(1) << (N - n0)) - 1;
}

// Panels [q0, q1) of w packed, panel q at out + (q - q0) * stride. A pair of w's rows is
// read across all the panels at once (contiguous bytes, not one 64-byte piece per row), and
// rows kPrefetchRows ahead are prefetched.
void pack_panels(const Product& p, const uint16_t* w, int64_t q0, int64_t q1, int64_t stride,
                 uint32_t* out) {
  const int64_t K = p.K, N = p.N, Kp = padded_k(K);
  const ColumnOrder order;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 2) {
    if (k + kPrefetchRows + 1 < K) {
      const uint16_t* ahead = w + (k + kPrefetchRows) * N;
      for (int64_t q = q0; q < q1; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + q * kPanel), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + N + q * kPanel), _MM_HINT_T0);
      }
    }
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t n0 = q * kPanel;
      const __mmask32 cols = panel_cols(N, n0);
      const __m512i w0 = k < K ? _mm512_maskz_loadu_epi16(cols, w + k * N + n0) : zero;
      const __m512i w1 = k + 1 < K ? _mm512_maskz_loadu_epi16(cols, w + (k + 1) * N + n0) : zero;
      const __m512i lo = _mm512_unpacklo_epi16(w0, w1), hi = _mm512_unpackhi_epi16(w0, w1);
      uint32_t* row = out + (q - q0) * stride + (k / 2) * 16;
      _mm512_storeu_si512(row, _mm512_permutex2var_epi32(lo, order.first, hi));
      _mm512_storeu_si512(row + half_words(Kp), _mm512_permutex2var_epi32(lo, order.second, hi));
    }
  }
}

// The products of rows m0 .. m0 + R - 1 with the P panels of 32 columns of w from w's
// first column (cols[j]: panel j's columns, masked at the right edge, none past it), in
// float32, columns in order: y0[r][j] holds panel j's columns 0-15, y1[r][j] 16-31. Each
// column's sum runs over k in one order whatever R and P are. kPacked: w is packed panels
// (pack_panels' layout, panel j at w + j * panel_elements(K)), which hold each pair of weight
// rows interleaved already and the columns in order; the same products, bitwise.
template <int R, int P, bool kPacked>
__attribute__((always_inline)) inline void products(const Product& p, const uint16_t* w,
                                                    int64_t m0, const __mmask32 (&cols)[P],
                                                    __m512 (&y0)[R][P], __m512 (&y1)[R][P],
                                                    bool stream = false) {
  const int64_t K = p.K, N = p.N, panel = panel_elements(K), half = 2 * half_words(padded_k(K));
  // Unrolled by pragma so that GCC keeps the arrays in registers (without it, it stores
  // every accumulator to the stack on every step).
  __m512 lo[R][P], hi[R][P];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) lo[r][j] = hi[r][j] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m0 * K;
  const __m512i zero = _mm512_setzero_si512();
  // The pairs (w[k][n], w[k + 1][n]) of panel j's columns as two vectors (k + 1 < K, or with
  // `last` the pairs (w[k][n], 0)): in the unpack's column order, or with kPacked in order.
  // Packed, panel j's first element; a panel past N (an item's last, cols[j] == 0: nothing of
  // it is stored) reads panel 0 instead of memory past the weight's.
  const uint16_t* at[P];
  _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) at[j] = cols[j] ? w + j * panel : w;
  const auto pairs = [&](int j, int64_t k, bool last, __m512bh& b0, __m512bh& b1) {
    if constexpr (kPacked) {
      const uint16_t* row = at[j] + (k / 2) * 32;
      b0 = (__m512bh)_mm512_loadu_si512(row);
      b1 = (__m512bh)_mm512_loadu_si512(row + half);
    } else {
      const __m512i w0 = _mm512_maskz_loadu_epi16(cols[j], w + k * N + j * kPanel);
      const __m512i w1 = last ? zero : _mm512_maskz_loadu_epi16(cols[j], w + (k + 1) * N + j * kPanel);
      b0 = (__m512bh)_mm512_unpacklo_epi16(w0, w1);
      b1 = (__m512bh)_mm512_unpackhi_epi16(w0, w1);
    }
  };
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    // Wide items (P > 1, at most kWideRows rows) broadcast each row's pair once for all their
    // panels; a tile (P == 1) broadcasts a row's pair just before its two dot instructions, so
    // that one register holds it: hoisted, the 14 broadcasts took 14 of the 32 registers and
    // GCC kept 12 of the 28 accumulators on the stack, a load and a store each per step.
    __m512bh a[P > 1 ? R : 1];
    if constexpr (P > 1)
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) a[r] = broadcast_pair(x + r * K + k);
    if (kPacked && P == 1 && stream) {  // the panel's first tile: the lines kStreamBytes on
      const char* ahead = reinterpret_cast<const char*>(at[0] + (k / 2) * 32) + kStreamBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + half * 2, _MM_HINT_T0);
    }
    if (P > 1 && k + kPrefetchRows + 1 < K) {  // wide items only (the tiles reuse a panel)
      _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) {
        const uint16_t* ahead = kPacked ? at[j] + (k + kPrefetchRows) / 2 * 32
                                        : w + (k + kPrefetchRows) * N + j * kPanel;
        const uint16_t* next = kPacked ? ahead + half : ahead + N;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T0);
      }
    }
    _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) {
      __m512bh b0, b1;
      pairs(j, k, false, b0, b1);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
        const __m512bh ar = P > 1 ? a[r] : broadcast_pair(x + r * K + k);
        lo[r][j] = _mm512_dpbf16_ps(lo[r][j], ar, b0);
        hi[r][j] = _mm512_dpbf16_ps(hi[r][j], ar, b1);
      }
    }
  }
  if (k < K) {  // odd K: the last input paired with zeros
    _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) {
      __m512bh b0, b1;
      pairs(j, k, true, b0, b1);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * K + k]));
        lo[r][j] = _mm512_dpbf16_ps(lo[r][j], a, b0);
        hi[r][j] = _mm512_dpbf16_ps(hi[r][j], a, b1);
      }
    }
  }
  if constexpr (kPacked) {
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) {
        y0[r][j] = lo[r][j];
        y1[r][j] = hi[r][j];
      }
  } else {
    const ColumnOrder order;  // lo and hi hold the columns in the unpack's order
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) {
        y0[r][j] = _mm512_permutex2var_ps(lo[r][j], order.first, hi[r][j]);
        y1[r][j] = _mm512_permutex2var_ps(lo[r][j], order.second, hi[r][j]);
      }
  }
}

using jllm_cpu::silu_times;

// 32 float32 columns (y0: 0-15, y1: 16-31) as 32 bfloat16, rounded to nearest even as XLA
// converts.
__attribute__((always_inline)) inline __m512i to_bf16(__m512 y0, __m512 y1) {
  const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(y0);
  const __m256i h1 = (__m256i)_mm512_cvtneps_pbh(y1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
}

// Stores one row's 32 float32 columns (y0: 0-15, y1: 16-31; masked at the right edge) to row
// m, columns n0.., of the output: float32, or bfloat16 (to_bf16).
__attribute__((always_inline)) inline void store_row(const Product& p, int64_t m, int64_t n0,
                                                     __mmask32 cols, __m512 y0, __m512 y1) {
  const int64_t N = p.N;
  const __mmask16 cols0 = __mmask16(cols), cols1 = __mmask16(cols >> 16);
  if (p.f32_out) {
    float* y = static_cast<float*>(p.y) + m * N + n0;
    _mm512_mask_storeu_ps(y, cols0, y0);
    _mm512_mask_storeu_ps(y + 16, cols1, y1);
  } else {
    uint16_t* y = static_cast<uint16_t*>(p.y) + m * N + n0;
    _mm512_mask_storeu_epi16(y, cols, to_bf16(y0, y1));
  }
}

// store_row past the cache (non-temporal stores) where the row's 32 columns are whole
// 64-byte lines: the head's output, [rows, vocab] float32 (12.6 MB at 64 rows of SmolLM2's),
// is written 128 bytes to a row per block, rows a vocabulary apart, and each ordinary store
// first read its line from memory. Measured on the 2-core AMX Xeon (SmolLM2's table, the kernel
// alone, two builds interleaved, three rounds): 64 rows 8.5-10.2 -> 7.1-9.3 ms (medians), 32
// rows 6.1 -> 5.5, 16 rows 4.5 -> 4.3; without any store (the bound) 6.9. The work item ends
// with a store fence, before the pool sees it done.
__attribute__((always_inline)) inline void stream_row(const Product& p, int64_t m, int64_t n0,
                                                      __mmask32 cols, __m512 y0, __m512 y1) {
  char* at = static_cast<char*>(p.y) + (m * p.N + n0) * (p.f32_out ? 4 : 2);
  if (cols != ~__mmask32(0) || reinterpret_cast<uintptr_t>(at) % 64)
    return store_row(p, m, n0, cols, y0, y1);
  if (p.f32_out) {
    _mm512_stream_ps(reinterpret_cast<float*>(at), y0);
    _mm512_stream_ps(reinterpret_cast<float*>(at) + 16, y1);
  } else {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(at), to_bf16(y0, y1));
  }
}

// Rows m0 .. m0 + R - 1 by the P panels of columns from n0 of the output: x @ w, or with
// `p.up`, silu(x @ w) * (x @ up).
template <int R, int P, bool kPacked>
void tile_from(const Product& p, int64_t m0, int64_t n0, bool stream = false) {
  __mmask32 cols[P];
  _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j)
    cols[j] = n0 + j * kPanel < p.N ? panel_cols(p.N, n0 + j * kPanel) : 0;
  // where the first panel's columns start: in w [K, N], or among the packed panels
  const int64_t at = kPacked ? n0 / kPanel * panel_elements(p.K) : n0;
  __m512 y0[R][P], y1[R][P];
  products<R, P, kPacked>(p, p.w + at, m0, cols, y0, y1, stream);
  if (p.up) {
    __m512 u0[R][P], u1[R][P];
    products<R, P, kPacked>(p, p.up + at, m0, cols, u0, u1, stream);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j) {
        y0[r][j] = silu_times(y0[r][j], u0[r][j]);
        y1[r][j] = silu_times(y1[r][j], u1[r][j]);
      }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int j = 0; j < P; ++j)
      store_row(p, m0 + r, n0 + j * kPanel, cols[j], y0[r][j], y1[r][j]);
}

template <int R, int P = 1>
void tile(const Product& p, int64_t m0, int64_t n0, bool stream = false) {
  if (p.packed) return tile_from<R, P, true>(p, m0, n0, stream);
  tile_from<R, P, false>(p, m0, n0);
}

// stream: the first tile of a packed panel (products' kStreamBytes prefetch).
void tile_rows(const Product& p, int rows, int64_t m0, int64_t n0, bool stream) {
  switch (rows) {
#define JLLM_TILE(R) \
  case R:            \
    return tile<R>(p, m0, n0, stream);
    JLLM_TILE(1) JLLM_TILE(2) JLLM_TILE(3) JLLM_TILE(4) JLLM_TILE(5) JLLM_TILE(6) JLLM_TILE(7)
    JLLM_TILE(8) JLLM_TILE(9) JLLM_TILE(10) JLLM_TILE(11) JLLM_TILE(12) JLLM_TILE(13)
    JLLM_TILE(14)
#undef JLLM_TILE
  }
}

// Rows marked not live (a step's padding) come out zero, which every later op takes as it
// took XLA's products.
void zero_padding_rows(const Product& p, const int8_t* live) {
  if (!live) return;
  const int64_t row_bytes = p.N * (p.f32_out ? 4 : 2);
  for (int64_t m = 0; m < p.M; ++m)
    if (!live[m]) std::memset(static_cast<char*>(p.y) + m * row_bytes, 0, row_bytes);
}

// x's rows packed as the pairs the transposed head takes (the AMX tiles' B operand, the vector
// loop's lanes): tile t's row j at packed[t][j / 16][k2][j % 16] = (x[m][2 k2], x[m][2 k2 + 1]),
// halves of Kp / 2 rows of 16 lanes, zeros past K and the tile's rows.
void pack_x_pairs(const Product& p, const std::vector<jllm_cpu::RowTile>& tiles,
                  uint32_t* out) {
  const int64_t K = p.K, Kp = padded_k(K), tile_words = Kp / 2 * kPanel;
  std::memset(out, 0, tiles.size() * tile_words * sizeof(uint32_t));
  for (size_t t = 0; t < tiles.size(); ++t)
    for (int j = 0; j < tiles[t].rows; ++j) {
      const uint16_t* x = p.x + (tiles[t].m0 + j) * K;
      uint32_t* col = out + t * tile_words + (j / 16) * half_words(Kp) + j % 16;
      for (int64_t k = 0; k < K; k += 2) {
        const uint32_t lo = x[k], hi = k + 1 < K ? x[k + 1] : 0;
        col[(k / 2) * 16] = lo | (hi << 16);
      }
    }
}

// ---- w transposed on the vector loop (AVX512-BF16 without AMX) ----
//
// A tied embedding table [N, K] as the LM head, read in place: the live rows of x are the
// lanes, up to 16 to a group, packed once as pairs of inputs (pack_x_pairs), and a table
// row's pair (w[n][2 k2], w[n][2 k2 + 1]) is one 32-bit word of the table, broadcast (the
// attention kernel's q . k, rows as lanes). 16 table rows at a time hold 16 accumulators of a
// group's 16 rows, turned into y's rows by a 16 x 16 transpose. A work item is a run of
// 32-column panels; each half panel (16 table rows, contiguous) serves every group from
// cache, and the item's first group prefetches the next half panel. Rows a step does not
// sample (`live`) cost nothing: the head of a step whose sample rows pad to a bucket reads
// the table once for the live ones.

// r (16 rows of 16 floats) transposed in place: r[i][j] -> r[j][i].
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j]: column 4L + j of rows 4i .. 4i + 3, lane L
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
    r[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
}

// Table rows n0 .. n0 + 15 (those below N; the others repeat row N - 1, never stored) against
// kGroups groups of lanes (xg[g]): each group's 16 rows of y by those 16 columns, to out[g]
// [16 rows, 16]. Each table pair broadcast serves every group: one broadcast per dot
// instruction (16 columns by one group) ran at about half the dot rate on the 2-core Zen 5,
// the broadcasts' pace. Eight columns at a time (kGroups x 8 accumulators), into `tmp` [16
// columns, 16 lanes] per group, then transposed. `ahead`: bytes to prefetch over the loop
// (the next half panel), or null.
template <int kGroups>
void lanes_half_panel(const Product& p, const uint32_t* const* xg, int64_t n0, float* const* out,
                      float* tmp, const char* ahead, int64_t ahead_bytes) {
  const int64_t K = p.K, pairs = K / 2;
  const int64_t lines = ahead ? (ahead_bytes + 63) / 64 : 0;
  const int64_t per = (lines + 2 * pairs - 1) / std::max<int64_t>(1, 2 * pairs);
  for (int sub = 0; sub < 2; ++sub) {
    __m512 acc[kGroups][8];  // acc[g][c][lane] = x[lane's row] . w[n0 + 8 sub + c]
    const uint16_t* row[8];
    for (int c = 0; c < 8; ++c) row[c] = p.w + std::min<int64_t>(n0 + 8 * sub + c, p.N - 1) * K;
    for (int g = 0; g < kGroups; ++g)
      for (int c = 0; c < 8; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
      const int64_t step = sub * pairs + k2;
      for (int64_t l = step * per; l < std::min(lines, (step + 1) * per); ++l)
        _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
      __m512bh xv[kGroups];
      for (int g = 0; g < kGroups; ++g) xv[g] = (__m512bh)_mm512_loadu_si512(xg[g] + k2 * 16);
      for (int c = 0; c < 8; ++c) {
        const __m512bh w = broadcast_pair(row[c] + 2 * k2);
        for (int g = 0; g < kGroups; ++g) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], xv[g], w);
      }
    }
    if (K % 2) {  // the last input alone: its pair's other half is zero in x and in w
      __m512bh xv[kGroups];
      for (int g = 0; g < kGroups; ++g) xv[g] = (__m512bh)_mm512_loadu_si512(xg[g] + pairs * 16);
      for (int c = 0; c < 8; ++c) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(row[c][K - 1]);
        for (int g = 0; g < kGroups; ++g) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], xv[g], w);
      }
    }
    for (int g = 0; g < kGroups; ++g)
      for (int c = 0; c < 8; ++c) _mm512_storeu_ps(tmp + (g * 16 + 8 * sub + c) * 16, acc[g][c]);
  }
  for (int g = 0; g < kGroups; ++g) {
    __m512 r[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_ps(tmp + (g * 16 + c) * 16);
    transpose16(r);  // r[lane]: the lane's row, 16 columns
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(out[g] + 16 * j, r[j]);
  }
}

ffi::Error RunTransposedLanes(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  zero_padding_rows(p, live);
  // The live rows in groups of at most 16 lanes (tiles of near-equal height), each packed as
  // the first half of a tile (the second, empty, is never read).
  const std::vector<jllm_cpu::RowTile> tiles = jllm_cpu::live_tiles(live, p.M, 16);
  if (tiles.empty()) return ffi::Error::Success();
  const int64_t K = p.K, groups = int64_t(tiles.size()), stride = padded_k(K) / 2 * kPanel;
  std::vector<uint32_t> xp(groups * stride);
  pack_x_pairs(p, tiles, xp.data());
  const int64_t panels = (p.N + kPanel - 1) / kPanel;
  const int64_t run = jllm_cpu::balanced_run(pool, panels, 8);
  const int64_t items = (panels + run - 1) / run;
  const bool ok = jllm_cpu::share_items(pool, items, [&](int64_t i) {
    thread_local std::vector<float> out, tmp;  // [groups, 2 halves, 16 rows, 16 columns]
    out.resize(groups * 2 * 16 * 16);
    tmp.resize(2 * 16 * 16);
    const int64_t q1 = std::min(panels, (i + 1) * run);
    for (int64_t q = i * run; q < q1; ++q) {
      const int64_t n0 = q * kPanel;
      for (int half = 0; half < 2; ++half) {
        const int64_t h0 = n0 + 16 * half, next = h0 + 16;
        for (int64_t g = 0; g < groups; g += 2) {  // two groups at a time, one at the end
          const char* ahead =
              g == 0 && next < p.N ? reinterpret_cast<const char*>(p.w + next * K) : nullptr;
          const int64_t ahead_bytes = std::min<int64_t>(16, p.N - next) * K * 2;
          const bool two = g + 1 < groups;
          const uint32_t* xg[2] = {xp.data() + g * stride,
                                   two ? xp.data() + (g + 1) * stride : nullptr};
          float* dst[2] = {out.data() + (2 * g + half) * 256,
                           two ? out.data() + (2 * g + 2 + half) * 256 : nullptr};
          if (two)
            lanes_half_panel<2>(p, xg, h0, dst, tmp.data(), ahead, ahead_bytes);
          else
            lanes_half_panel<1>(p, xg, h0, dst, tmp.data(), ahead, ahead_bytes);
        }
      }
      const __mmask32 cols = panel_cols(p.N, n0);
      for (int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < tiles[g].rows; ++j)
          stream_row(p, tiles[g].m0 + j, n0, cols, _mm512_loadu_ps(&out[2 * g * 256 + 16 * j]),
                     _mm512_loadu_ps(&out[(2 * g + 1) * 256 + 16 * j]));
    }
    _mm_sfence();  // the streamed rows, before the item counts as done
  });
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a bf16 matmul work item failed");
}

// Products of 1 to 4 live rows keep the vector loop's wide items, which read each weight row
// once, in place, with prefetch; from 5 rows the tiles (a half tile of 16 rows computes 5 to
// 16). Measured on the 2-core AMX Xeon (SmolLM2's 30 layers of products, this threshold and
// 16 built side by side, interleaved in one process, 2026-12-03): [K, N] weights (each item
// packs its own panels) 5-14 rows 36-86 ms on the tiles against 81-128 in the loop; packed
// weights level at 5-9 rows (the VM's noise, 20-60 ms either way, larger than the
// difference), the tiles ahead from 10 (20-27 against 32-41 ms).
#ifndef JLLM_AMX_MIN_ROWS
#define JLLM_AMX_MIN_ROWS 5
#endif
constexpr int64_t kAmxMinRows = JLLM_AMX_MIN_ROWS;

#ifdef JLLM_AMX

constexpr int kAmxRows = 32;      // rows per tile of x: two A tiles of 16

// The tile state must be granted to the process once (Linux's arch_prctl): false where the
// kernel refuses it, and the vector loop runs everything. (The emulated tiles,
// tools/avx512_emulation, need no grant.)
bool amx_granted() {
#ifdef JLLM_AVX512_EMULATION
  return true;
#else
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile used (0-3 accumulators, 4-5 x, 6-7 w) is 16 rows of 64 bytes.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // GCC 12 has dropped the colsb stores before ldtilecfg where this was inlined into a
  // function with no other use of config (the instruction then faults): the barrier makes
  // every store land first.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The float32 products of 32 rows by 32 columns, as the tiles store them: four blocks of 16
// rows by 16 columns, 1 KB each (whole cache lines, as the B tiles), block (row / 16) * 2 +
// column / 16.
inline float* acc_at(float* acc, int row, int col) {
  return acc + ((row / 16) * 2 + col / 16) * 256 + (row % 16) * 16 + col % 16;
}

// acc (32 x 32, acc_at's blocks) = the A rows (32 from a, a_stride elements apart) times the
// packed B columns (b: a packed panel, 32 columns), over Kp inputs; one_a: only the first 16
// A rows (acc's first 16 rows), one_b: only the first 16 B columns (acc's first 16 columns).
// Tiles 0-3 are the accumulators, 4-5 A, 6-7 B. ahead: ahead_bytes to prefetch meanwhile (the
// next block's operand, which the tile loads would otherwise wait on from memory), a share at
// each step. stream: b is read from memory (a packed weight's panels, one after another), and
// each step prefetches the lines kStreamAhead bytes past the B lines it loads (into the
// panel's second half, and from there into the next panel).
//
// The stream, measured on the 2-core AMX Xeon (SmolLM2's 30 layers of products on packed
// weights, interleaved with the next panel prefetched whole, spread over the first row
// tile's steps, which it replaced; ahead in 17 of 18 interleaved pairs, 2026-12-03; one
// run's two rounds): 5 rows 18.0-35.7 -> 16.5-33.0 ms, 8 rows 23.1-33.6 -> 19.5-24.7, 16 rows
// 26.9-27.0 -> 17.6-20.7, 32 rows 31.2-31.8 -> 25.3-26.4, 64 rows 41.7-41.9 -> 36.9-38.6,
// 128 rows 65.7-68.0 -> 63.6-65.2; 2 KB ahead about the same, 16 KB no better than the
// whole panel. Alone, one thread streaming 256 MB of panels at 16 rows (8 KB ahead):
// 9.3-10.3 GB/s, against 7.8-9.2 for the whole next panel, 9.0-9.5 a plain read.
constexpr int64_t kStreamAhead = 4096;

void tile_products(const uint16_t* a, int64_t a_stride, const uint32_t* b, int64_t Kp,
                   float* acc, bool one_a, bool one_b, const char* ahead = nullptr,
                   int64_t ahead_bytes = 0, bool stream = false) {
  const int64_t ahead_lines = (ahead_bytes / 64 + Kp / kAmxK - 1) / (Kp / kAmxK);
  _tile_zero(0);
  if (!one_b) _tile_zero(1);
  if (!one_a) _tile_zero(2);
  if (!one_a && !one_b) _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += kAmxK) {
    const uint32_t* bk = b + (k / 2) * 16;
    if (ahead)  // this step's share of the lines to prefetch
      for (int64_t l = k / kAmxK * ahead_lines, end = std::min(ahead_bytes / 64, l + ahead_lines);
           l < end; ++l)
        _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
    if (stream) {
      const char* first = reinterpret_cast<const char*>(bk) + kStreamAhead;
      const char* second = first + half_words(Kp) * 4;
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(first + l * 64, _MM_HINT_T0);
        if (!one_b) _mm_prefetch(second + l * 64, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a + k, a_stride * 2);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (!one_b) {
      _tile_loadd(7, bk + half_words(Kp), 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (!one_a) {
      _tile_loadd(5, a + 16 * a_stride + k, a_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (!one_b) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 64);
  if (!one_b) _tile_stored(1, acc + 256, 64);
  if (!one_a) _tile_stored(2, acc + 512, 64);
  if (!one_a && !one_b) _tile_stored(3, acc + 768, 64);
}

// Panels [q0, q1) of w (and of up, after each of w's) packed for the tiles into out, panel q
// at (q - q0) * gated panels.
void pack_item(const Product& p, int64_t q0, int64_t q1, uint32_t* out) {
  const int64_t panel_words = padded_k(p.K) / 2 * kPanel, gated = p.up ? 2 : 1;
  pack_panels(p, p.w, q0, q1, gated * panel_words, out);
  if (p.up) pack_panels(p, p.up, q0, q1, 2 * panel_words, out + panel_words);
}

// One work item on the tiles: tiles [t0, t1) of x by panels [p0, p1), the panels packed by
// the item itself, taken from `all` (every panel of the product, packed by pack_item), or, for
// a product of packed weights (`p.packed`), read where they are: on the item's first row tile
// the tiles stream them from memory (tile_products' `stream`).
void amx_item(const Product& p, const std::vector<jllm_cpu::RowTile>& tiles, int64_t t0,
              int64_t t1, int64_t p0, int64_t p1, const uint32_t* all) {
  const int64_t K = p.K, Kp = padded_k(K), panel_words = Kp / 2 * kPanel;
  const int64_t panels = p1 - p0, gated = p.up ? 2 : 1;
  thread_local std::vector<uint32_t> own;
  thread_local std::vector<uint16_t> padded;
  thread_local std::vector<float> acc;
  acc.resize(gated * kAmxRows * kPanel);
  // the item's first panel of w (and of up) and the words from one panel to the next
  const uint32_t* packed = all ? all + p0 * gated * panel_words : nullptr;
  int64_t stride = gated * panel_words;
  if (p.packed) {
    packed = reinterpret_cast<const uint32_t*>(p.w) + p0 * panel_words;
    stride = panel_words;
  } else if (!all) {
    own.resize(panels * gated * panel_words);
    pack_item(p, p0, p1, own.data());
    packed = own.data();
  }
  const uint32_t* up_packed = !p.up      ? nullptr
                              : p.packed ? reinterpret_cast<const uint32_t*>(p.up) + p0 * panel_words
                                         : packed + panel_words;
  configure_tiles();
  for (int64_t t = t0; t < t1; ++t) {
    const jllm_cpu::RowTile tile = tiles[t];
    const uint16_t* a = p.x + tile.m0 * K;
    int64_t a_stride = K;
    const bool half = tile.rows <= 16;
    if (tile.rows != kAmxRows || K != Kp) {  // a zero-padded copy of the tile's rows
      padded.assign((half ? 16 : kAmxRows) * Kp, 0);
      for (int r = 0; r < tile.rows; ++r)
        std::memcpy(padded.data() + r * Kp, a + r * K, K * sizeof(uint16_t));
      a = padded.data();
      a_stride = Kp;
    }
    const bool stream = p.packed && t == t0;  // later row tiles find the panels in cache
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t n0 = (p0 + j) * kPanel;
      const uint32_t* panel = packed + j * stride;
      tile_products(a, a_stride, panel, Kp, acc.data(), half, false, nullptr, 0, stream);
      float* up = acc.data() + kAmxRows * kPanel;
      if (p.up)
        tile_products(a, a_stride, up_packed + j * stride, Kp, up, half, false, nullptr, 0,
                      stream);
      const __mmask32 cols = panel_cols(p.N, n0);
      for (int r = 0; r < tile.rows; ++r) {
        __m512 y0 = _mm512_loadu_ps(acc_at(acc.data(), r, 0));
        __m512 y1 = _mm512_loadu_ps(acc_at(acc.data(), r, 16));
        if (p.up) {
          y0 = silu_times(y0, _mm512_loadu_ps(acc_at(up, r, 0)));
          y1 = silu_times(y1, _mm512_loadu_ps(acc_at(up, r, 16)));
        }
        store_row(p, tile.m0 + r, n0, cols, y0, y1);
      }
    }
  }
  _tile_release();
}

// The tiles over the live rows: each run of consecutive live rows in whole tiles of 32, then
// its remainder (the tiles compute 32 rows whatever the tile holds).
std::vector<jllm_cpu::RowTile> amx_tiles(const int8_t* live, int64_t M) {
  std::vector<jllm_cpu::RowTile> tiles;
  for (const jllm_cpu::RowTile run : jllm_cpu::live_tiles(live, M, int(M)))
    for (int64_t m = run.m0; m < run.m0 + run.rows; m += kAmxRows)
      tiles.push_back({m, int(std::min<int64_t>(kAmxRows, run.m0 + run.rows - m))});
  return tiles;
}


// ---- w transposed (a tied embedding table as the LM head): y[M, N] = x[M, K] @ w[N, K]^T ----
//
// Here w's rows are the A tiles, read in place (16 rows of it by 32 inputs: exactly a row
// block of the table), and x, small (a step's sampled rows), is packed once into the pairs
// layout as the B tiles (pack_x_pairs): packed[t][k2][j] = (x[m][2 k2], x[m][2 k2 + 1]) for the tile's j-th
// row m, zeros past K and the tile's rows. The accumulators hold y's transpose (32 columns of
// y by 32 rows), gathered into y's rows at the store. A table whose K is not a multiple of
// 32, or whose last block has fewer than 32 rows, is read through a zero-padded copy of that
// block. The tiles run at any row count (one step's LM head is a few rows: where XLA's bf16
// product of one row ran at a small fraction of the table's read rate). Each block prefetches
// the next one's rows while it multiplies: the tile loads wait on memory otherwise (2-core AMX
// Xeon, SmolLM2's table, variants interleaved: 64 rows 13.1-14.5 -> 10.9-11.4 ms, 16 rows 7.4
// -> 5.8; two or four blocks ahead no better).

// Columns n0 .. n0 + 31 of y for every tile of x's rows.
void amx_transposed_block(const Product& p, const std::vector<jllm_cpu::RowTile>& tiles,
                          const uint32_t* packed, int64_t n0, float* acc,
                          std::vector<uint16_t>& padded) {
  const int64_t K = p.K, Kp = padded_k(K), tile_words = Kp / 2 * kPanel;
  const int64_t width = std::min<int64_t>(kPanel, p.N - n0);
  const uint16_t* a = p.w + n0 * K;
  int64_t a_stride = K;
  if (width != kPanel || K != Kp) {
    padded.assign(kPanel * Kp, 0);
    for (int64_t i = 0; i < width; ++i)
      std::memcpy(padded.data() + i * Kp, a + i * K, K * sizeof(uint16_t));
    a = padded.data();
    a_stride = Kp;
  }
  const __mmask32 cols = panel_cols(p.N, n0);
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));  // acc's rows 0-15 (or 16-31) of one column
  const int64_t ahead_rows = std::min<int64_t>(kPanel, std::max<int64_t>(0, p.N - n0 - kPanel));
  for (size_t t = 0; t < tiles.size(); ++t) {
    const bool one_b = tiles[t].rows <= 16;  // one B tile holds the tile's rows
    tile_products(a, a_stride, packed + t * tile_words, Kp, acc, false, one_b,
                  t == 0 ? reinterpret_cast<const char*>(p.w + (n0 + kPanel) * K) : nullptr,
                  ahead_rows * K * 2);
    for (int j = 0; j < tiles[t].rows; ++j) {  // y's row: column j of acc
      const __m512 y0 = _mm512_i32gather_ps(lanes, acc_at(acc, 0, j), 4);
      const __m512 y1 = _mm512_i32gather_ps(lanes, acc_at(acc, 16, j), 4);
      stream_row(p, tiles[t].m0 + j, n0, cols, y0, y1);
    }
  }
}

ffi::Error RunTransposed(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  if (!amx_granted()) return RunTransposedLanes(pool, p, live);
  zero_padding_rows(p, live);
  const std::vector<jllm_cpu::RowTile> tiles = amx_tiles(live, p.M);
  if (tiles.empty()) return ffi::Error::Success();
  std::vector<uint32_t> packed(tiles.size() * padded_k(p.K) / 2 * kPanel);
  pack_x_pairs(p, tiles, packed.data());
  const int64_t blocks = (p.N + kPanel - 1) / kPanel;
  constexpr int64_t kBlocksPerItem = 16;
  const int64_t items = (blocks + kBlocksPerItem - 1) / kBlocksPerItem;
  const bool ok = jllm_cpu::share_items(pool, items, [&](int64_t i) {
    thread_local std::vector<float> acc;
    thread_local std::vector<uint16_t> padded;
    acc.resize(kPanel * kPanel);
    configure_tiles();
    const int64_t b1 = std::min(blocks, (i + 1) * kBlocksPerItem);
    for (int64_t b = i * kBlocksPerItem; b < b1; ++b)
      amx_transposed_block(p, tiles, packed.data(), b * kPanel, acc.data(), padded);
    _mm_sfence();  // the streamed rows, before the item counts as done
    _tile_release();
  });
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a bf16 matmul work item failed");
}

#endif  // JLLM_AMX

int64_t live_rows(const int8_t* live, int64_t M) {
  if (!live) return M;
  int64_t n = 0;
  for (int64_t m = 0; m < M; ++m) n += live[m] != 0;
  return n;
}

#ifndef JLLM_AMX
ffi::Error RunTransposed(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  return RunTransposedLanes(pool, p, live);
}
#endif

ffi::Error Run(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  zero_padding_rows(p, live);
  const int64_t panels = (p.N + kPanel - 1) / kPanel;
#ifdef JLLM_AMX
  if (live_rows(live, p.M) >= kAmxMinRows && amx_granted()) {
    const std::vector<jllm_cpu::RowTile> tiles = amx_tiles(live, p.M);
    const int64_t count = int64_t(tiles.size());
    const int64_t run = jllm_cpu::balanced_run(pool, panels, kWidePanels);
    // Several row blocks: every panel packed once for all of them, first.
    std::vector<uint32_t> all;
    if (count > kBlockTiles && !p.packed) {
      const int64_t words = padded_k(p.K) / 2 * kPanel * (p.up ? 2 : 1);
      all.resize(panels * words);
      const int64_t items = (panels + run - 1) / run;
      if (!jllm_cpu::share_items(pool, items, [&](int64_t i) {
            const int64_t q0 = i * run, q1 = std::min(panels, q0 + run);
            pack_item(p, q0, q1, all.data() + q0 * words);
          }))
        return ffi::Error::Internal("a bf16 matmul work item failed");
    }
    const auto item = [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
      amx_item(p, tiles, t0, t1, p0, p1, all.empty() ? nullptr : all.data());
    };
    const bool ok = jllm_cpu::share_tile_panels(pool, count, panels, kBlockTiles, item, run);
    return ok ? ffi::Error::Success() : ffi::Error::Internal("a bf16 matmul work item failed");
  }
#endif
  const std::vector<jllm_cpu::RowTile> tiles = jllm_cpu::live_tiles(live, p.M, kMaxRows);
  if (tiles.size() == 1 && tiles[0].rows <= kWideRows) {  // each item: `per` panels
    const jllm_cpu::RowTile t = tiles[0];
    constexpr int kFewer = kWidePanels / 2;
    const int64_t per = t.rows <= 2 ? kWidePanels : kFewer;
    const int64_t items = (panels + per - 1) / per;
    const bool ok = jllm_cpu::share_items(pool, items, [&](int64_t i) {
      const int64_t n0 = i * per * kPanel;
      switch (t.rows) {
        case 1: return tile<1, kWidePanels>(p, t.m0, n0);
        case 2: return tile<2, kWidePanels>(p, t.m0, n0);
        case 3: return tile<3, kFewer>(p, t.m0, n0);
        default: return tile<4, kFewer>(p, t.m0, n0);
      }
    });
    return ok ? ffi::Error::Success() : ffi::Error::Internal("a bf16 matmul work item failed");
  }
  const auto item = [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    for (int64_t panel = p0; panel < p1; ++panel)  // the block's rows reuse it
      for (int64_t t = t0; t < t1; ++t)
        tile_rows(p, tiles[t].rows, tiles[t].m0, panel * kPanel, t == t0);
  };
  const int64_t count = int64_t(tiles.size());
  const bool ok = jllm_cpu::share_tile_panels(pool, count, panels, kBlockTiles, item);
  return ok ? ffi::Error::Success() : ffi::Error::Internal("a bf16 matmul work item failed");
}

#else

ffi::Error Run(ffi::ThreadPool&, const Product&, const int8_t*) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "the bf16 matmul kernel needs a CPU with AVX512-BF16");
}

ffi::Error RunTransposed(ffi::ThreadPool& pool, const Product& p, const int8_t* live) {
  return Run(pool, p, live);
}

#endif  // __AVX512BF16__

// A packed weight's dimensions as a plain one's: [L, P, 2, Kp / 2, 32] (or without L), P
// panels of N = y's columns and Kp = K (x's columns) padded to the tiles' 32, as [L, K, N].
// An empty vector where they are not that.
std::vector<int64_t> unpacked_dims(const std::vector<int64_t>& wd, int64_t K, int64_t N) {
  const size_t lead = wd.size() == 5 ? 1 : 0;
  if (wd.size() != 4 + lead) return {};
  const int64_t panels = (N + kPanel - 1) / kPanel, Kp = padded_k(K);
  if (wd[lead] != panels || wd[lead + 1] != 2 || wd[lead + 2] != Kp / 2 || wd[lead + 3] != 32)
    return {};
  std::vector<int64_t> dims = {K, N};
  if (lead) dims.insert(dims.begin(), wd[0]);
  return dims;
}

// Checks the operands (up: the second weight of a gated product, or nullptr; transposed: w
// is [L, N, K] or [N, K]; packed: w (and up) packed panels, `unpacked_dims`) and runs.
ffi::Error Checked(ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
                   const ffi::AnyBuffer* up, ffi::Buffer<ffi::S32>& layer,
                   ffi::Buffer<ffi::S8>& live, ffi::Result<ffi::AnyBuffer>& y,
                   bool transposed = false, bool packed = false) {
  const auto wdims = w.dimensions();
  std::vector<int64_t> wd(wdims.begin(), wdims.end());
  if (transposed && wd.size() >= 2) std::swap(wd[wd.size() - 1], wd[wd.size() - 2]);
  if (packed) {
    const auto xd = x.dimensions(), yd = y->dimensions();
    if (xd.size() != 2 || yd.size() != 2)
      return ffi::Error::InvalidArgument("x [M, K] and y [M, N]");
    wd = unpacked_dims(wd, xd[1], yd[1]);
    if (wd.empty())
      return ffi::Error::InvalidArgument("packed w must be [L, ceil(N / 32), 2, Kp / 2, 32]");
  }
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
             !std::equal(wdims.begin(), wdims.end(), up->dimensions().begin(),
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
  // the layer's first element: shape.offset counts [K, N] layers, packed ones hold panels
  const int64_t layer_at =
      packed ? layer.typed_data()[0] * ((p.N + kPanel - 1) / kPanel) * panel_elements(p.K)
             : shape.offset;
  p.packed = packed;
  p.w = static_cast<const uint16_t*>(w.untyped_data()) + layer_at;
  p.up = up ? static_cast<const uint16_t*>(up->untyped_data()) + layer_at : nullptr;
  p.y = y->untyped_data();
  p.f32_out = y->element_type() == ffi::DataType::F32;
  const int8_t* live_rows = live.element_count() ? live.typed_data() : nullptr;
  return transposed ? RunTransposed(pool, p, live_rows) : Run(pool, p, live_rows);
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                      ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, w, nullptr, layer, live, y);
}

// w transposed: x [M, K], w [N, K] or [L, N, K] (a tied embedding table) -> y [M, N].
ffi::Error Bf16MatmulTransposed(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                                ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, w, nullptr, layer, live, y, /*transposed=*/true);
}

ffi::Error Bf16GatedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate,
                           ffi::AnyBuffer up, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S8> live, ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, gate, &up, layer, live, y);
}

// w (and gate, up) packed panels (bf16_matmul.py's `pack`): read where they are, nothing
// packed per call.
ffi::Error Bf16MatmulPacked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S8> live,
                            ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, w, nullptr, layer, live, y, false, /*packed=*/true);
}

ffi::Error Bf16GatedMatmulPacked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate,
                                 ffi::AnyBuffer up, ffi::Buffer<ffi::S32> layer,
                                 ffi::Buffer<ffi::S8> live, ffi::Result<ffi::AnyBuffer> y) {
  return Checked(pool, x, gate, &up, layer, live, y, false, /*packed=*/true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16Matmul, Bf16Matmul, jllm_cpu::product_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16MatmulTransposed, Bf16MatmulTransposed,
                              jllm_cpu::product_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16GatedMatmul, Bf16GatedMatmul,
                              jllm_cpu::gated_product_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16MatmulPacked, Bf16MatmulPacked, jllm_cpu::product_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmBf16GatedMatmulPacked, Bf16GatedMatmulPacked,
                              jllm_cpu::gated_product_binding());
