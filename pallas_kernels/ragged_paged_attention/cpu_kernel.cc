// Ragged paged attention for the CPU, as an XLA FFI custom call.
//
// The same contract as the Pallas kernel and the jnp reference in this folder: a flat
// ragged batch of queries q [T, N, H] (request r owns rows query_start[r] ..
// query_start[r] + query_lens[r] - 1, which sit at the last query_lens[r] of its kv_lens[r]
// positions) attends causally over its own pages of one layer of the stacked cache
// [L, B, S, 2K, H] (K of kv head k at head index 2k, V at 2k + 1). Rows no request owns come
// out zero. float32 and bfloat16 q, with a cache of the same dtype or of float8 (e4m3fn or
// e5m2, scale 1, decoded through a 256-entry table; as float8 buffers, or as uint8 bytes with
// the `fp8` attribute naming the format); accumulation in float32. Three options, each 0 when
// off: `sliding_window` W (a query at position p sees keys p - W + 1 .. p; only the pages
// that hold some of those are read), `chunk_size` C (Llama 4's chunked local attention: keys
// from floor(p / C) * C, likewise) and `soft_cap` c (scaled scores s become c * tanh(s / c)
// before the mask and the softmax). An optional q_horizon [T] (a [0] buffer for none: causal)
// moves each query's last key from its position p to max(p, q_horizon[t]), clipped to its
// request's kv_len - 1 (bidirectional spans, Gemma 3's images); a window still counts back
// from p. Optional sinks [N] float32 (gpt-oss; a [0] buffer for none): each query head's
// softmax starts as if it had seen one key of score sinks[n] (neither scaled nor capped) and
// value zero, its running max sinks[n] and its denominator 1; every routine takes them. A
// latent cache [L, B, S, H] (MLA's absorbed form, a rank-4 cache) holds one vector per token:
// the key of one kv head that every query head reads, and in its first `v_head_dim` lanes the
// value; out is then [T, N, v_head_dim].
//
// One work item is one request's block of up to kQueryBlock queries with all its heads,
// reading the request's pages front to back. Items are shared out over XLA's intra-op thread
// pool. Decode rows (one query) are bound by reading the cache (run_decode, for block size 16
// and head dims 64 and 128, prefetching the next page; run_decode_bf16 for a bf16 q and cache
// where the CPU has AVX512-BF16); prefill blocks by arithmetic, which runs on 16-lane
// vectors (GCC's vector extension) with a block's rows as the lanes (run_prefill, the same
// shapes, and a latent's rows of every kind: its lane count a multiple of 16, its value lanes
// of 8; run_prefill_bf16 for a bf16 q and cache with AVX512-BF16). run_item, scalar, takes
// every other shape.
//
// Built at run time by pallas_kernels/cpu/build.py with GCC (g++ -O3 -march=native; it uses GCC's vector
// extension, __builtin_shuffle and __builtin_shufflevector).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "cpu_bf16.h"  // pallas_kernels/cpu/: bfloat16 conversions
#include "cpu_fp8.h"   // pallas_kernels/cpu/: float8 decoding
#include "cpu_pool.h"  // pallas_kernels/cpu/: share_items
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 16 floats as one value. With AVX-512: GCC's vector extension, one register. Without it,
// two 8-lane halves (Two, below): GCC keeps a 64-byte vector-extension value in memory when
// the target has no 64-byte registers, storing and reloading it around every operation, and
// lowers its comparisons, selects and shuffles lane by lane, with a branch per lane; an AVX2
// Zen 3 ran this file's prefill 6x and its decode 3.6x slower for it (docs/performance.md,
// the Zen 3 sections).
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16i to_int(v16 v) { return __builtin_convertvector(v, v16i); }  // toward zero
inline v16 to_float(v16i v) { return __builtin_convertvector(v, v16); }
#else
template <typename H, typename E>  // H: the half (a vector-extension type), E: its element
struct Two {
  H lo, hi;
  E operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  Two& operator+=(const Two& o) { return *this = *this + o; }
  Two& operator*=(const Two& o) { return *this = *this * o; }
  friend Two operator+(const Two& a, const Two& b) { return {a.lo + b.lo, a.hi + b.hi}; }
  friend Two operator-(const Two& a, const Two& b) { return {a.lo - b.lo, a.hi - b.hi}; }
  friend Two operator*(const Two& a, const Two& b) { return {a.lo * b.lo, a.hi * b.hi}; }
  friend Two operator/(const Two& a, const Two& b) { return {a.lo / b.lo, a.hi / b.hi}; }
  friend Two operator+(const Two& a, E b) { return {a.lo + b, a.hi + b}; }
  friend Two operator-(const Two& a, E b) { return {a.lo - b, a.hi - b}; }
  friend Two operator*(const Two& a, E b) { return {a.lo * b, a.hi * b}; }
  friend Two operator*(E a, const Two& b) { return {a * b.lo, a * b.hi}; }
  friend Two operator<<(const Two& a, int b) { return {a.lo << b, a.hi << b}; }
};
typedef Two<v8, float> v16;
typedef Two<v8i, int32_t> v16i;

inline v16i to_int(v16 v) {  // toward zero
  return {__builtin_convertvector(v.lo, v8i), __builtin_convertvector(v.hi, v8i)};
}
inline v16 to_float(v16i v) {
  return {__builtin_convertvector(v.lo, v8), __builtin_convertvector(v.hi, v8)};
}
#endif
static_assert(sizeof(v16) == 64 && sizeof(v16i) == 64, "16 lanes of 4 bytes");

// Loads and stores; without AVX-512 also halves. There each half moves on its own: a 64-byte
// copy of the pair goes through a stack slot in 16-byte pieces, and the 32-byte loads after
// it wait for the stores (the store-to-load forwarding fails).
#ifdef __AVX512F__
inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
#else
inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v.lo, p, sizeof(v8));
  std::memcpy(&v.hi, p + 8, sizeof(v8));
  return v;
}
inline void store16(float* p, v16 v) {
  std::memcpy(p, &v.lo, sizeof(v8));
  std::memcpy(p + 8, &v.hi, sizeof(v8));
}
inline v8 half(v16 v, int i) { return i ? v.hi : v.lo; }
inline v8i half(v16i v, int i) { return i ? v.hi : v.lo; }
inline v16 join(v8 lo, v8 hi) { return {lo, hi}; }
#endif

// A float8 decoder's 16 floats (cpu_fp8.h's vector type) as a v16.
inline v16 as_v16(jllm_cpu::f32x16 f) {
#ifdef __AVX512F__
  return f;
#else
  float lanes[16];
  std::memcpy(lanes, &f, sizeof(lanes));
  return load16(lanes);
#endif
}

struct Bf16 {
  using Storage = uint16_t;
  // 16 values: widened to 32-bit lanes and shifted into the float32's high half.
  static v16 load16(const uint16_t* p) {
#ifdef __AVX512F__
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
    u16x16 b;
    std::memcpy(&b, p, sizeof(b));
    const u32x16 bits = __builtin_convertvector(b, u32x16) << 16;
    v16 v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
#else
    return join(load8(p), load8(p + 8));
#endif
  }
  // 8 values likewise.
  static v8 load8(const uint16_t* p) {
    typedef uint16_t u16x8 __attribute__((vector_size(16)));
    typedef uint32_t u32x8 __attribute__((vector_size(32)));
    u16x8 b;
    std::memcpy(&b, p, sizeof(b));
    const u32x8 bits = __builtin_convertvector(b, u32x8) << 16;
    v8 v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
  static float load(uint16_t x) { return jllm_cpu::bf16_to_float(x); }
  static uint16_t store(float f) { return jllm_cpu::float_to_bf16(f); }
};

struct F32 {
  using Storage = float;
  static v16 load16(const float* p) { return ::load16(p); }
  static v8 load8(const float* p) {
    v8 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static float load(float x) { return x; }
  static float store(float f) { return f; }
};

// The 256 values of a float8 format with `mantissa` bits and exponent bias `bias`.
// e4m3fn (mantissa 3, bias 7) has no infinities and NaN only at S.1111.111; e5m2
// (mantissa 2, bias 15) is IEEE-like, with infinities and NaNs at exponent 31.
struct Fp8Table {
  float v[256];
  Fp8Table(int mantissa, int bias, bool ieee) {
    const int exp_bits = 7 - mantissa, top = (1 << exp_bits) - 1;
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> mantissa) & top, m = b & ((1 << mantissa) - 1);
      const float frac = float(m) / float(1 << mantissa);
      float x;
      if (e == 0)
        x = std::ldexp(frac, 1 - bias);
      else if (ieee && e == top)
        x = m ? NAN : INFINITY;
      else if (!ieee && e == top && m == (1 << mantissa) - 1)
        x = NAN;
      else
        x = std::ldexp(1.0f + frac, e - bias);
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};

const Fp8Table kE4M3(3, 7, false), kE5M2(2, 15, true);

// load: one code (the table); load16: 16 codes in vector registers (cpu_fp8.h), which the
// page copy uses when the head dim is a multiple of 16.
template <int kFormat>  // 1: e4m3fn, 2: e5m2 (the `fp8` attribute's values)
struct Fp8 {
  using Storage = uint8_t;
  static float load(uint8_t x) { return (kFormat == 1 ? kE4M3 : kE5M2).v[x]; }
  static v16 load16(const uint8_t* p) {
    jllm_cpu::u8x16 b;
    std::memcpy(&b, p, 16);
    if constexpr (kFormat == 1) return as_v16(jllm_cpu::e4m3_to_floats(b));
    return as_v16(jllm_cpu::e5m2_to_floats(b));
  }
};
using E4M3 = Fp8<1>;
using E5M2 = Fp8<2>;

// exp(x) for x <= 0 (Cephes' single-precision polynomial, about 1 ulp); unlike std::exp it
// vectorizes inside a loop.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x -= fx * 0.693359375f;
  x -= fx * -2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const int32_t e = (int32_t(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return y * scale;
}

inline v16 zero_vector() {
  v16 v = {};
  return v;
}

// f (a generic lambda of comparisons and selects) on v16 arguments: as is with AVX-512, else
// on their 8-lane halves.
template <typename F, typename... A>
inline v16 lanewise(F f, const A&... a) {
#ifdef __AVX512F__
  return f(a...);
#else
  return join(f(half(a, 0)...), f(half(a, 1)...));
#endif
}

// 0, 1, .., 15.
inline v16i lane_index() {
#ifdef __AVX512F__
  return v16i{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
  return v16i{v8i{0, 1, 2, 3, 4, 5, 6, 7}, v8i{8, 9, 10, 11, 12, 13, 14, 15}};
#endif
}

// Lanes t < n of a, the others of b.
inline v16 first_lanes(int32_t n, v16 a, v16 b) {
  return lanewise([n](auto lane, auto a, auto b) { return lane < n ? a : b; }, lane_index(), a,
                  b);
}

// Lanes lo <= t < hi of a, the others of b.
inline v16 lanes_between(int32_t lo, int32_t hi, v16 a, v16 b) {
  return lanewise(
      [lo, hi](auto lane, auto a, auto b) { return lane < hi ? (lane < lo ? b : a) : b; },
      lane_index(), a, b);
}

// Lane-wise max and sum over the 16 lanes, as a tree of shuffles (without AVX-512: the
// halves combined, then the tree on 8 lanes).
#ifdef __AVX512F__
inline v16 halves(v16 v, int w) {
  static const v16i masks[4] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
      {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
      {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
      {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
  };
  return __builtin_shuffle(v, masks[w]);
}

inline float max16(v16 v) {
  for (int w = 0; w < 4; ++w) {
    const v16 o = halves(v, w);
    v = o > v ? o : v;
  }
  return v[0];
}

inline float sum16(v16 v) {
  for (int w = 0; w < 4; ++w) v += halves(v, w);
  return v[0];
}
#else
inline v8 max8(v8 a, v8 b) { return a > b ? a : b; }

inline float max16(v16 v) {
  v8 m = max8(v.lo, v.hi);
  m = max8(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
  m = max8(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
  m = max8(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6));
  return m[0];
}

inline float sum16(v16 v) {
  v8 s = v.lo + v.hi;
  s += __builtin_shufflevector(s, s, 4, 5, 6, 7, 0, 1, 2, 3);
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
  return s[0];
}
#endif

// exp_nonpositive on 16 lanes.
inline v16 exp16(v16 x) {
  const v16 lo = zero_vector() - 87.0f;
  x = lanewise([](auto x, auto lo) { return x < lo ? lo : x; }, x, lo);
  v16 fx = x * 1.44269504088896341f + 0.5f;
  v16 fl = to_float(to_int(fx));
  fl = lanewise([](auto fl, auto fx) { return fl > fx ? fl - 1.0f : fl; }, fl, fx);  // floor
  x = x - fl * 0.693359375f - fl * -2.12194440e-4f;
  const v16 z = x * x;
  v16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const v16i e = (to_int(fl) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

// tanh on 16 lanes: the odd rational approximation of degrees 13/6 that Eigen and XLA use
// (a few ulp), on x clamped to where tanh rounds to +-1 in float32.
inline v16 tanh16(v16 x) {
  const v16 hi = zero_vector() + 7.90531110763549805f, lo = zero_vector() - 7.90531110763549805f;
  x = lanewise([](auto x, auto lo, auto hi) { return x < lo ? lo : (x > hi ? hi : x); }, x, lo, hi);
  const v16 x2 = x * x;
  v16 p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  v16 q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return p * x / q;
}

// The soft cap c on 16 scores: c * tanh(s / c).
inline v16 soft_cap16(v16 s, float c) { return c * tanh16(s * (1.0f / c)); }

struct Problem {
  const void* q;
  const void* cache;  // this layer's [B, S, 2K, H], or with `latent` [B, S, H]
  void* out;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start;
  const int32_t* query_lens;
  const int32_t* horizon;  // [T] q_horizon, null for causal attention
  const float* sinks;      // [N] sink logits, null for none
  int64_t S, K, G, H, P;
  int64_t Hv;  // value lanes: H, or a latent's first Hv
  bool latent;  // MLA's cache: one vector per token, the key of K = 1 head and its value
  float scale;
  int64_t window;  // sliding window W, 0 for none
  int64_t chunk;   // chunked local attention C (Llama 4), 0 for none
  float soft_cap;  // 0 for none
  bool invariant;  // the batch-invariant mode: decode rows through the prefill routine
};

// A token's elements in the cache, and where kv head k's key and value start among them: K
// and V interleaved by head ([2K, H]), or one latent that is the key and, in its first Hv
// lanes, the value.
inline int64_t row_elems(const Problem& pb) { return pb.latent ? pb.H : 2 * pb.K * pb.H; }
inline int64_t key_at(const Problem& pb, int64_t k) { return pb.latent ? 0 : 2 * k * pb.H; }
inline int64_t value_at(const Problem& pb, int64_t k) {
  return pb.latent ? 0 : (2 * k + 1) * pb.H;
}

// The online softmax's state before any key, for query head n: with a sink, the sink seen
// (a key of score sinks[n] and value zero: max sinks[n], denominator 1), else nothing seen.
inline float initial_max(const Problem& pb, int64_t n) {
  return pb.sinks ? pb.sinks[n] : -INFINITY;
}
inline float initial_sum(const Problem& pb) { return pb.sinks ? 1.0f : 0.0f; }

// The first key position a query at `pos` sees: pos - W + 1 with a window, from its chunk's
// start floor(pos / C) * C with chunked local attention, else 0. Never decreasing in pos.
inline int64_t first_key(const Problem& pb, int64_t pos) {
  int64_t lo = pb.window ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
  if (pb.chunk) lo = std::max<int64_t>(lo, pos / pb.chunk * pb.chunk);
  return lo;
}

// The last key position the query of row `q_row` at `pos` of request r sees: pos, or its
// horizon when that is later, up to the request's last position.
inline int64_t last_key(const Problem& pb, int64_t r, int64_t q_row, int64_t pos) {
  if (!pb.horizon) return pos;
  return std::clamp<int64_t>(pb.horizon[q_row], pos, int64_t(pb.kv_lens[r]) - 1);
}

constexpr int kQueryBlock = 16;

struct Item {
  int32_t request, first_query, num_queries;
};

// The page after page `pi` of a request's table, as bytes to prefetch; null after its last.
template <typename Ct>
const char* next_page(const Ct* cache, const int32_t* table, int64_t pi, int64_t num_pages,
                      int64_t page_elems) {
  if (pi + 1 >= num_pages) return nullptr;
  return reinterpret_cast<const char*>(cache + int64_t(table[pi + 1]) * page_elems);
}

// Online softmax over the request's pages for rows j = i * N + n (query i of the block,
// head n = k * G + g), one row at a time with scalar dot products: the path for shapes the
// vector paths below do not take (block sizes other than 16, head dims other than 64 and
// 128). Scratch holds the float32 queries, accumulators, one page of one kv head's keys and
// values, and one row's scores. D: q's and the output's type; C: the cache's.
template <typename D, typename C>
void run_item(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  using St = typename D::Storage;
  using Ct = typename C::Storage;
  const int64_t H = pb.H, Hv = pb.Hv, S = pb.S;
  const int64_t G = pb.G, K = pb.K, N = K * G;
  const int64_t rows = it.num_queries * N;
  scratch.resize(size_t(rows * (H + Hv + 2) + S * (H + Hv) + S));
  float* qf = scratch.data();   // [rows, H], scaled
  float* acc = qf + rows * H;   // [rows, Hv]
  float* m = acc + rows * Hv;   // [rows] running max
  float* l = m + rows;          // [rows] running denominator
  float* kf = l + rows;         // [S, H] keys
  float* vf = kf + S * H;       // [S, Hv] values
  float* sj = vf + S * Hv;      // [S] one row's scores, then probabilities
  std::fill(acc, acc + rows * Hv, 0.0f);
  for (int64_t j = 0; j < rows; ++j) m[j] = initial_max(pb, j % N);
  std::fill(l, l + rows, initial_sum(pb));

  const int64_t r = it.request;
  const int64_t q_row0 = int64_t(pb.query_start[r]) + it.first_query;
  // Position of the block's first query; query i sits at pos0 + i and sees keys up to
  // last_key (pos0 + i when causal).
  const int64_t pos0 = int64_t(pb.kv_lens[r]) - pb.query_lens[r] + it.first_query;
  const St* q = static_cast<const St*>(pb.q) + q_row0 * N * H;
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t h = 0; h < H; ++h) qf[j * H + h] = D::load(q[j * H + h]) * pb.scale;

  int64_t kv_end = 0;  // keys [kv_lo, kv_end) are read
  for (int64_t i = 0; i < it.num_queries; ++i)
    kv_end = std::max(kv_end, last_key(pb, r, q_row0 + i, pos0 + i) + 1);
  const int64_t kv_lo = first_key(pb, pos0);
  const int64_t num_pages = (kv_end + S - 1) / S;
  const int32_t* table = pb.block_tables + r * pb.P;
  const Ct* cache = static_cast<const Ct*>(pb.cache);
  const int64_t token_elems = row_elems(pb), page_elems = S * token_elems;
  const float cap = pb.soft_cap;

  for (int64_t pi = kv_lo / S; pi < num_pages; ++pi) {
    const Ct* page = cache + int64_t(table[pi]) * page_elems;
    const int64_t key0 = pi * S;
    const int64_t nt = std::min(S, kv_end - key0);
    for (int64_t k = 0; k < K; ++k) {
      // This kv head's keys and values some query sees, in float32.
      for (int64_t t = std::max<int64_t>(0, kv_lo - key0); t < nt; ++t) {
        const Ct* kp = page + t * token_elems + key_at(pb, k);
        const Ct* vp = page + t * token_elems + value_at(pb, k);
        for (int64_t h = 0; h < H; ++h) kf[t * H + h] = C::load(kp[h]);
        for (int64_t h = 0; h < Hv; ++h) vf[t * Hv + h] = C::load(vp[h]);
      }
      for (int64_t i = 0; i < it.num_queries; ++i) {
        const int64_t last = last_key(pb, r, q_row0 + i, pos0 + i);
        const int64_t visible = std::min(nt, last - key0 + 1);  // keys t < visible
        const int64_t t0 = std::max<int64_t>(0, first_key(pb, pos0 + i) - key0);  // and t >= t0
        if (visible <= t0) continue;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t j = i * N + k * G + g;
          const float* qj = qf + j * H;
          for (int64_t t = t0; t < visible; ++t) {
            float dot = 0.0f;
            for (int64_t h = 0; h < H; ++h) dot += qj[h] * kf[t * H + h];
            sj[t] = dot;
          }
          if (cap > 0.0f)
            for (int64_t t = t0; t < visible; ++t) sj[t] = cap * std::tanh(sj[t] / cap);
          float m_new = m[j], sum = 0.0f;
          for (int64_t t = t0; t < visible; ++t) m_new = std::max(m_new, sj[t]);
          for (int64_t t = t0; t < visible; ++t) {
            sj[t] = exp_nonpositive(sj[t] - m_new);
            sum += sj[t];
          }
          const float alpha = exp_nonpositive(m[j] - m_new);
          l[j] = l[j] * alpha + sum;
          m[j] = m_new;
          // acc = acc * alpha + sum_t p_t v_t, over visible keys only (a later position's
          // non-finite value times p = 0 would be NaN).
          float* aj = acc + j * Hv;
          for (int64_t h = 0; h < Hv; ++h) aj[h] *= alpha;
          for (int64_t t = t0; t < visible; ++t) {
            const float p = sj[t];
            for (int64_t h = 0; h < Hv; ++h) aj[h] += p * vf[t * Hv + h];
          }
        }
      }
    }
  }
  St* out = static_cast<St*>(pb.out) + q_row0 * N * Hv;
  for (int64_t j = 0; j < rows; ++j) {
    const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
    for (int64_t h = 0; h < Hv; ++h) out[j * Hv + h] = D::store(acc[j * Hv + h] * inv);
  }
}

// An 8 x 8 block transposed in registers (r[i][j] -> r[j][i]): pairs interleaved, then
// pairs of pairs, then the 128-bit halves.
inline void transpose8(v8* r) {
  v8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      u[i + 2 * j] = __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 2 * j + 1] =
          __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// Lanes where c <= b take a, the others z (lane-wise, on v16).
inline v16 where_le(v16 c, v16 b, v16 a, v16 z) {
  return lanewise([](auto c, auto b, auto a, auto z) { return c <= b ? a : z; }, c, b, a, z);
}

// Lanes where lo <= c <= hi take a, the others z.
inline v16 where_in(v16 c, v16 lo, v16 hi, v16 a, v16 z) {
  return lanewise(
      [](auto c, auto lo, auto hi, auto a, auto z) { return c <= hi ? (lo <= c ? a : z) : z; }, c,
      lo, hi, a, z);
}

inline v16 max_v16(v16 a, v16 b) {
  return lanewise([](auto a, auto b) { return a > b ? a : b; }, a, b);
}

// v as it is, held in registers: an operand several FMAs share is then loaded once (GCC
// otherwise folds the load into each FMA, and the loop waits on loads, not FMAs).
// (Without AVX an 8-lane half fits no register; there it is left to the compiler. The AVX-512
// emulation build, tools/avx512_emulation, has no 64-byte registers.)
inline v16 in_registers(v16 v) {
#if defined(JLLM_AVX512_EMULATION)
#elif defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v.lo), "+x"(v.hi));
#endif
  return v;
}

// Register tiles of run_prefill: keys per pass over the head dim (scores), head dims per pass
// over a page's keys (values). Each is that many 16-lane accumulators, 2 registers apiece
// without AVX-512 (16 registers in all there).
#ifdef __AVX512F__
constexpr int kKeyTile = 8, kDimTile = 8;
#else
constexpr int kKeyTile = 4, kDimTile = 4;
#endif

// Share `i` of `n` of the prefetches of the `bytes` at `p`, into L2 (`prefetcht1`). The
// decode path prefetches the next page spread evenly over a page's iterations. Issued a token
// row at a time during the first kv head's pass, into L1 (run_item's way), the fill buffers
// stalled the loop: in a 30-layer microbenchmark of 64 decode rows of 129-192 tokens (bf16,
// 2 Zen 4 cores) 30.8 ms against 17-19 ms spread into L2; two pages ahead, or the next
// request's first page as well, did no better. Prefill blocks, bound by arithmetic, gain
// nothing from it.
inline void prefetch_share(const char* p, int64_t bytes, int64_t i, int64_t n) {
  const int64_t lines = bytes / 64, per = (lines + n - 1) / n;
  for (int64_t line = i * per; line < std::min(lines, (i + 1) * per); ++line)
    __builtin_prefetch(p + line * 64, 0, 2);
}

// A prefill item's rows as the lanes of 16-lane vectors (run_prefill, run_prefill_bf16): row
// `row` of its nr = num_queries x G rows is query row / G of the block with query head
// k * G + row % G of each kv head k, ng lane groups of 16 rows per kv head, and each (kv head,
// lane group) pair has its own online-softmax state. Holds the rows' first and last keys, each
// group's least and most last key (its first and last query's positions when causal) and the
// states, all in `state` (`floats` of them).
struct PrefillBlock {
  static constexpr int64_t kS = 16, kL = 16;
  int64_t G, nr, ng, pos0, kv_lo, kv_end, num_pages;
  bool edged;  // rows whose keys start past 0 (a window, chunks)
  const int32_t* table;
  float* m;       // [K, ng, 16] running max
  float* l;       // [K, ng, 16] running denominator
  float* qlast;   // [ng, 16] the row's last key (last_key); -1 for padding lanes
  float* qfirst;  // [ng, 16] the row's first key (first_key); 0 likewise
  float* reach;   // [ng, 2] the least and the most of a group's qlast

  static int64_t lane_groups(const Problem& pb, const Item& it) {
    return (it.num_queries * pb.G + kL - 1) / kL;
  }
  static int64_t floats(const Problem& pb, const Item& it) {
    const int64_t ng = lane_groups(pb, it);
    return 2 * pb.K * ng * kL + 2 * ng * kL + 2 * ng;
  }

  PrefillBlock(const Problem& pb, const Item& it, float* state)
      : G(pb.G), nr(it.num_queries * pb.G), ng(lane_groups(pb, it)) {
    const int64_t r = it.request, groups = pb.K * ng;
    const int64_t q_row0 = int64_t(pb.query_start[r]) + it.first_query;
    pos0 = int64_t(pb.kv_lens[r]) - pb.query_lens[r] + it.first_query;
    kv_lo = first_key(pb, pos0);  // the first key some row sees
    edged = pb.window || pb.chunk;
    table = pb.block_tables + r * pb.P;
    m = state;
    l = m + groups * kL;
    qlast = l + groups * kL;
    qfirst = qlast + ng * kL;
    reach = qfirst + ng * kL;
    // Positions and keys are exact as floats below 2^24.
    kv_end = 0;  // keys before it are read
    for (int64_t gi = 0; gi < ng; ++gi) {
      int64_t lo = INT64_MAX, hi = -1;
      for (int64_t row = gi * kL; row < gi * kL + kL; ++row) {
        const int64_t i = row / G, last = row < nr ? last_key(pb, r, q_row0 + i, pos0 + i) : -1;
        qfirst[row] = row < nr ? float(first_key(pb, pos0 + i)) : 0;
        qlast[row] = float(last);
        if (row < nr) lo = std::min(lo, last);
        hi = std::max(hi, last);
      }
      reach[2 * gi] = float(lo);
      reach[2 * gi + 1] = float(hi);
      kv_end = std::max(kv_end, hi + 1);
    }
    num_pages = (kv_end + kS - 1) / kS;
    for (int64_t k = 0; k < pb.K; ++k)  // kv head k's lane `row` is query head k * G + row % G
      for (int64_t row = 0; row < ng * kL; ++row)
        m[k * ng * kL + row] = initial_max(pb, k * G + row % G);
    std::fill(l, l + groups * kL, initial_sum(pb));
  }

  // The keys of the page from key0 that lane group gi's rows see: begin <= t < nt; those
  // before `shared` lie outside the ranges of the group's later rows (the lower edge), those
  // from `full` past the last keys of some of its rows; every row sees those between. Without
  // a window or chunks, begin = shared = 0. False where the group sees none.
  bool keys(const Problem& pb, int64_t gi, int64_t key0, int64_t& begin, int64_t& shared,
            int64_t& full, int64_t& nt) const {
    // Rows go query by query: the group's first and last query's positions bound its
    // windows; its rows see keys up to `any`, and all of them the keys up to `all`.
    const int64_t first = pos0 + gi * kL / G;
    const int64_t last = pos0 + (std::min(gi * kL + kL, nr) - 1) / G;
    const int64_t all = int64_t(reach[2 * gi]), any = int64_t(reach[2 * gi + 1]);
    if (key0 > any) return false;
    nt = std::min<int64_t>(kS, any + 1 - key0);
    begin = shared = 0;
    if (edged) {
      begin = std::clamp<int64_t>(first_key(pb, first) - key0, 0, nt);
      if (begin == nt) return false;
      shared = std::clamp<int64_t>(first_key(pb, last) - key0, begin, nt);
    }
    full = std::clamp<int64_t>(all + 1 - key0, shared, nt);
    return true;
  }

  // The online softmax of (kv head, lane group) `group` (lane group gi) over the scores s[t]
  // (16 lanes a key) of the keys begin <= t < nt of the page from key0, lane by lane: keys
  // outside a row's range score -inf. s[t] becomes the probabilities (0 outside); updates the
  // group's max and denominator and returns alpha, the factor that rescales its sums.
  v16 softmax(int64_t group, int64_t gi, int64_t key0, int64_t begin, int64_t shared,
              int64_t nt, float* s) const {
    const v16 zero = zero_vector(), minus_inf = zero - INFINITY;
    const v16 upto = load16(qlast + gi * kL), from = load16(qfirst + gi * kL);
    const v16 m_old = load16(m + group * kL);
    v16 m_new = m_old;
    for (int64_t t = begin; t < shared; ++t) {  // the lower edge: rows from first_key
      const v16 st = where_in(zero + float(key0 + t), from, upto, load16(s + t * kL), minus_inf);
      store16(s + t * kL, st);
      m_new = max_v16(m_new, st);
    }
    for (int64_t t = shared; t < nt; ++t) {
      const v16 st = where_le(zero + float(key0 + t), upto, load16(s + t * kL), minus_inf);
      store16(s + t * kL, st);
      m_new = max_v16(m_new, st);
    }
    // Rows that see no key yet keep m = -inf; they subtract 0 instead (no -inf - -inf).
    const v16 base = where_le(m_new, minus_inf, zero, m_new);
    v16 sum = zero;
    for (int64_t t = begin; t < nt; ++t) {
      const v16 st = load16(s + t * kL);
      const v16 p = where_le(st, minus_inf, zero, exp16(st - base));
      store16(s + t * kL, p);
      sum += p;
    }
    const v16 alpha = exp16(m_old - base);
    store16(l + group * kL, load16(l + group * kL) * alpha + sum);
    store16(m + group * kL, m_new);
    return alpha;
  }

  // The block's rows out of the lanes of acc [K, ng, Hv, 16], 8 head dims by 8 rows at a
  // time, each divided by its denominator, to `out` (the block's first query's row).
  template <typename D>
  void store(const Problem& pb, const float* acc, int64_t Hv, typename D::Storage* out) const {
    const int64_t N = pb.K * G;
    for (int64_t k = 0; k < pb.K; ++k)
      for (int64_t row0 = 0; row0 < nr; row0 += 8) {
        const float* src = acc + (k * ng + row0 / kL) * Hv * kL + row0 % kL;
        const int rows = int(std::min<int64_t>(8, nr - row0));
        typename D::Storage* dst[8];
        float inv[8];
        for (int e = 0; e < rows; ++e) {
          const int64_t row = row0 + e;
          const float lr = l[k * ng * kL + row];
          dst[e] = out + ((row / G) * N + k * G + row % G) * Hv;
          inv[e] = lr > 0.0f ? 1.0f / lr : 0.0f;
        }
        for (int64_t h0 = 0; h0 < Hv; h0 += 8) {
          v8 b[8];
          for (int e = 0; e < 8; ++e) std::memcpy(&b[e], src + (h0 + e) * kL, sizeof(v8));
          transpose8(b);
          for (int e = 0; e < rows; ++e) {
            const v8 y = b[e] * inv[e];
            for (int c = 0; c < 8; ++c) dst[e][h0 + c] = D::store(y[c]);
          }
        }
      }
  }
};

// A block of queries (a prefill's, or one query with more than kDecodeMaxG heads per kv
// head, or a latent's), block size 16, head dim 64 or 128 (kH), or for a latent (kH = 0) the
// Problem's H, a multiple of 16, and Hv values, a multiple of 8. The rows of each kv head (query i, query head
// g: num_queries x G of them, query by query) are the lanes of 16-lane vectors (PrefillBlock), so a page's
// scores are 16 vectors, one per key, and the online softmax (max, exp, sum, rescale) runs
// lane by lane with no reductions across lanes; a key's or value's element enters as a
// broadcast scalar. Scores take kKeyTile keys per pass over the head dim, values kDimTile
// head dims per pass over the page's keys, each lane group only over the keys its rows see.
// Pages are read once per item, front to back, the next one prefetched into L2 over the
// lane groups' passes; a float32 cache is read in place, other caches are widened a page of one
// kv head at a time. Against the row-at-a-time loop it replaced (keys transposed per page,
// each row's softmax reduced across lanes): see docs/performance.md. A latent's one kv head
// is every query head's (G = N), its key all H lanes of a token, its value the first Hv: one
// widened copy of a page serves both.
template <typename D, typename C, int kH>
void run_prefill(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  using St = typename D::Storage;
  using Ct = typename C::Storage;
  constexpr int kS = 16, kL = 16;
  constexpr bool in_place = std::is_same_v<Ct, float>;
  const int64_t H = kH ? kH : pb.H, Hv = kH ? kH : pb.Hv;  // key (and query) lanes, value lanes
  const int64_t G = pb.G, K = pb.K, N = K * G;
  const int64_t nr = it.num_queries * G, ng = PrefillBlock::lane_groups(pb, it);
  const int64_t groups = K * ng;  // (kv head, lane group) pairs, each with its own state
  const int64_t block_floats = PrefillBlock::floats(pb, it);
  scratch.resize(size_t(groups * kL * (H + Hv) + block_floats + kS * kL + kS * (H + Hv)));
  float* qt = scratch.data();          // [K, ng, H, 16] queries, scaled; lane = row
  float* acc = qt + groups * H * kL;   // [K, ng, Hv, 16]
  const PrefillBlock blk(pb, it, acc + groups * Hv * kL);
  float* s = acc + groups * Hv * kL + block_floats;  // [16 keys, 16] scores, then probabilities
  float* kf = s + kS * kL;             // [16, H] a page's keys of one kv head, widened
  float* vf = kf + kS * H;             // [16, Hv] values (a latent's are kf's)

  const int64_t q_row0 = int64_t(pb.query_start[it.request]) + it.first_query;
  const Ct* cache = static_cast<const Ct*>(pb.cache);
  const int64_t token_elems = row_elems(pb), page_elems = kS * token_elems;
  const int64_t page_bytes = page_elems * int64_t(sizeof(Ct));
  const St* q = static_cast<const St*>(pb.q) + q_row0 * N * H;
  const v16 zero = zero_vector();

  // Each kv head's queries into lanes, 8 rows by 8 head dims at a time; padding rows 0.
  for (int64_t k = 0; k < K; ++k)
    for (int64_t row0 = 0; row0 < ng * kL; row0 += 8) {
      const St* src[8];
      for (int e = 0; e < 8; ++e) {
        const int64_t row = row0 + e;
        src[e] = row < nr ? q + ((row / G) * N + k * G + row % G) * H : nullptr;
      }
      float* dst = qt + (k * ng + row0 / kL) * H * kL + row0 % kL;
      for (int64_t h0 = 0; h0 < H; h0 += 8) {
        v8 b[8];
        for (int e = 0; e < 8; ++e) b[e] = src[e] ? D::load8(src[e] + h0) * pb.scale : v8{};
        transpose8(b);
        for (int e = 0; e < 8; ++e) std::memcpy(dst + (h0 + e) * kL, &b[e], sizeof(v8));
      }
    }
  std::fill(acc, acc + groups * Hv * kL, 0.0f);

  for (int64_t pi = blk.kv_lo / kS; pi < blk.num_pages; ++pi) {
    const Ct* page = cache + int64_t(blk.table[pi]) * page_elems;
    const char* next = next_page(cache, blk.table, pi, blk.num_pages, page_elems);
    const int64_t key0 = pi * kS;
    for (int64_t k = 0; k < K; ++k) {
      const float *keys, *values;
      int64_t stride;
      if constexpr (in_place) {
        keys = page + key_at(pb, k);
        values = page + value_at(pb, k);
        stride = token_elems;
      } else {  // the tokens some row sees
        const int64_t nt = std::min<int64_t>(kS, blk.kv_end - key0);
        for (int64_t t = std::max<int64_t>(0, blk.kv_lo - key0); t < nt; ++t) {
          const Ct* kp = page + t * token_elems + key_at(pb, k);
          for (int64_t h = 0; h < H; h += 16) store16(kf + t * H + h, C::load16(kp + h));
          if (pb.latent) continue;
          const Ct* vp = page + t * token_elems + value_at(pb, k);
          for (int64_t h = 0; h < Hv; h += 16) store16(vf + t * Hv + h, C::load16(vp + h));
        }
        keys = kf;
        values = pb.latent ? kf : vf;
        stride = H;
      }
      for (int64_t gi = 0; gi < ng; ++gi) {
        if (next) prefetch_share(next, page_bytes, k * ng + gi, K * ng);
        int64_t begin, shared, full, nt;
        if (!blk.keys(pb, gi, key0, begin, shared, full, nt)) continue;
        const int64_t group = k * ng + gi;
        const float* qg = qt + group * H * kL;
        float* ag = acc + group * Hv * kL;
        const v16 upto = load16(blk.qlast + gi * kL), from = load16(blk.qfirst + gi * kL);
        // Scores of keys begin <= t < nt (a tile outside reads the page's stale rows or
        // ones no row sees; never used).
        for (int64_t t0 = begin & -kKeyTile; t0 < nt; t0 += kKeyTile) {
          v16 a[kKeyTile];
          for (int u = 0; u < kKeyTile; ++u) a[u] = zero;
          const float* kt = keys + t0 * stride;
          for (int64_t h = 0; h < H; ++h) {
            const v16 qh = in_registers(load16(qg + h * kL));
            for (int u = 0; u < kKeyTile; ++u) a[u] += kt[u * stride + h] * qh;
          }
          for (int u = 0; u < kKeyTile; ++u) store16(s + (t0 + u) * kL, a[u]);
        }
        if (pb.soft_cap > 0.0f)
          for (int64_t t = begin; t < nt; ++t)
            store16(s + t * kL, soft_cap16(load16(s + t * kL), pb.soft_cap));
        const v16 alpha = blk.softmax(group, gi, key0, begin, shared, nt, s);
        // acc = acc * alpha + sum_t p_t v_t, key by key in order: the window's lower edge
        // (begin .. shared, each row its own keys) in a pass of its own, first; then the keys
        // every row sees (shared .. full) and those up to each row's last key (full .. nt). A
        // row that does not see key t keeps its sum as it was: its p is 0, but another
        // position's non-finite value times 0 would be NaN. In key order a row's sum is the
        // same bits whatever rows share its lanes (the batch-invariant mode: as a decode row
        // alone, or a chunk's middle row).
        v16 rescale = alpha;  // for the second pass: 1 after the edge's (exact)
        if (begin < shared) {
          for (int64_t h0 = 0; h0 < Hv; h0 += kDimTile) {
            v16 a[kDimTile];
            for (int u = 0; u < kDimTile; ++u) a[u] = load16(ag + (h0 + u) * kL) * alpha;
            for (int64_t t = begin; t < shared; ++t) {
              const v16 p = load16(s + t * kL);
              const v16 seen = zero + float(key0 + t);
              const float* vt = values + t * stride + h0;
              for (int u = 0; u < kDimTile; ++u)
                a[u] = where_in(seen, from, upto, a[u] + vt[u] * p, a[u]);
            }
            for (int u = 0; u < kDimTile; ++u) store16(ag + (h0 + u) * kL, a[u]);
          }
          rescale = zero + 1.0f;
        }
        for (int64_t h0 = 0; h0 < Hv; h0 += kDimTile) {
          v16 a[kDimTile];
          for (int u = 0; u < kDimTile; ++u) a[u] = load16(ag + (h0 + u) * kL) * rescale;
          for (int64_t t = shared; t < full; ++t) {
            const v16 p = in_registers(load16(s + t * kL));
            const float* vt = values + t * stride + h0;
            for (int u = 0; u < kDimTile; ++u) a[u] += vt[u] * p;
          }
          for (int64_t t = full; t < nt; ++t) {
            const v16 p = load16(s + t * kL);
            const v16 seen = zero + float(key0 + t);
            const float* vt = values + t * stride + h0;
            for (int u = 0; u < kDimTile; ++u)
              a[u] = where_le(seen, upto, a[u] + vt[u] * p, a[u]);
          }
          for (int u = 0; u < kDimTile; ++u) store16(ag + (h0 + u) * kL, a[u]);
        }
      }
    }
  }
  blk.store<D>(pb, acc, Hv, static_cast<St*>(pb.out) + q_row0 * N * Hv);
}

#ifdef __AVX512BF16__
// One 32-bit word (a pair of bf16) at p.
inline int32_t load32(const void* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The values of kv head k's tokens t_lo <= t < t_hi of a page (bf16, `stride` elements from one
// token to the next), paired token by token for the dot instruction: v2[j][h] holds
// (v[t_lo + 2j][h], v[t_lo + 2j + 1][h]) as one 32-bit word, a token at t_hi or past it zero.
// Returns whether they are all finite.
template <int kH>
bool pair_values(const uint16_t* v, int64_t stride, int64_t t_lo, int64_t t_hi, uint32_t* v2) {
  // Words 0-15 of (a, b) interleaved: a[0], b[0], a[1], b[1], ..; then words 16-31.
  static const __m512i first = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
      35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  __mmask32 bad = 0;
  for (int64_t t = t_lo, j = 0; t < t_hi; t += 2, ++j)
    for (int c = 0; c < kH / 32; ++c) {
      const __m512i r0 = _mm512_loadu_si512(v + t * stride + 32 * c);
      const __m512i r1 =
          t + 1 < t_hi ? _mm512_loadu_si512(v + (t + 1) * stride + 32 * c) : _mm512_setzero_si512();
      bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(r0, exponent), exponent) |
             _mm512_cmpeq_epi16_mask(_mm512_and_si512(r1, exponent), exponent);
      _mm512_storeu_si512(v2 + j * kH + 32 * c, _mm512_permutex2var_epi16(r0, first, r1));
      _mm512_storeu_si512(v2 + j * kH + 32 * c + 16, _mm512_permutex2var_epi16(r0, second, r1));
    }
  return bad == 0;
}

// run_prefill for a bf16 q and cache on CPUs with AVX512-BF16 (block size 16, head dim 64 or
// 128): the same lanes, pages and online softmax (PrefillBlock), with the dot instruction
// (`vdpbf16ps`: two bf16 products summed into each float32 lane) in place of float32 FMAs,
// half as many. q . k: each lane holds its row's query as pairs of head dims (h, h + 1), raw
// (the scale applies to the scores), and a key's pair is one 32-bit word of the cache,
// broadcast; p . v: each lane's probabilities of keys (t, t + 1), rounded to bf16 as the
// decode path's are, against a broadcast pair (v[t][h], v[t + 1][h]) from the page's values
// interleaved token by token (pair_values). A key a row does not see has p = 0 and adds
// exactly nothing when its value is finite, so a page whose paired values are all finite
// takes every pair whole; one with a non-finite value takes masked products, each lane adding
// only the keys it sees. Either way a row's sums run over the same pairs in the same order
// whatever rows share its lanes (the batch-invariant mode), and no value a row does not see
// reaches it.
template <int kH>
void run_prefill_bf16(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  constexpr int64_t kS = 16, kL = 16, kHp = kH / 2;  // kHp: a head's pairs of dims
  const int64_t G = pb.G, K = pb.K, N = K * G;
  const int64_t nr = it.num_queries * G, ng = PrefillBlock::lane_groups(pb, it);
  const int64_t groups = K * ng, block_floats = PrefillBlock::floats(pb, it);
  scratch.resize(size_t(groups * kL * (kHp + kH) + block_floats + kS * kL + kS / 2 * (kL + kH)));
  uint32_t* qt = reinterpret_cast<uint32_t*>(scratch.data());  // [K, ng, H / 2, 16] q pairs
  float* acc = scratch.data() + groups * kHp * kL;                // [K, ng, H, 16]
  const PrefillBlock blk(pb, it, acc + groups * kH * kL);
  float* s = acc + groups * kH * kL + block_floats;  // [16 keys, 16] scores, probabilities
  uint32_t* p2 = reinterpret_cast<uint32_t*>(s + kS * kL);  // [8 key pairs, 16]
  uint32_t* v2 = p2 + kS / 2 * kL;                          // [8 key pairs, H] (pair_values)

  const int64_t q_row0 = int64_t(pb.query_start[it.request]) + it.first_query;
  const uint16_t* cache = static_cast<const uint16_t*>(pb.cache);
  const int64_t token_elems = 2 * K * kH, page_elems = kS * token_elems;
  const uint16_t* q = static_cast<const uint16_t*>(pb.q) + q_row0 * N * kH;

  // Each kv head's query pairs into lanes, 8 rows by 8 pairs at a time; padding rows 0.
  for (int64_t k = 0; k < K; ++k)
    for (int64_t row0 = 0; row0 < ng * kL; row0 += 8) {
      const uint16_t* src[8];
      for (int e = 0; e < 8; ++e) {
        const int64_t row = row0 + e;
        src[e] = row < nr ? q + ((row / G) * N + k * G + row % G) * kH : nullptr;
      }
      uint32_t* dst = qt + (k * ng + row0 / kL) * kHp * kL + row0 % kL;
      for (int64_t h0 = 0; h0 < kHp; h0 += 8) {
        v8 w[8];  // 8 pairs of a row, as bits
        for (int e = 0; e < 8; ++e) {
          w[e] = v8{};
          if (src[e]) std::memcpy(&w[e], src[e] + 2 * h0, sizeof(v8));
        }
        transpose8(w);
        for (int e = 0; e < 8; ++e) std::memcpy(dst + (h0 + e) * kL, &w[e], sizeof(v8));
      }
    }
  std::fill(acc, acc + groups * kH * kL, 0.0f);
  // Word i of (a, b): a's bf16 i, then b's (cvtne2ps_pbh puts b's 16 first).
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  const __m512 scale = _mm512_set1_ps(pb.scale);

  for (int64_t pi = blk.kv_lo / kS; pi < blk.num_pages; ++pi) {
    const uint16_t* page = cache + int64_t(blk.table[pi]) * page_elems;
    const char* next = next_page(cache, blk.table, pi, blk.num_pages, page_elems);
    const int64_t key0 = pi * kS;
    // The page's tokens some row sees lie in t_lo .. t_hi - 1 (t_lo even: pairs from it).
    const int64_t t_hi = std::min<int64_t>(kS, blk.kv_end - key0);
    const int64_t t_lo = std::max<int64_t>(0, blk.kv_lo - key0) & -2;
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t* keys = page + 2 * k * kH;
      const bool finite = pair_values<kH>(page + (2 * k + 1) * kH, token_elems, t_lo, t_hi, v2);
      for (int64_t gi = 0; gi < ng; ++gi) {
        if (next) prefetch_share(next, page_elems * 2, k * ng + gi, K * ng);
        int64_t begin, shared, full, nt;
        if (!blk.keys(pb, gi, key0, begin, shared, full, nt)) continue;
        const int64_t group = k * ng + gi;
        const uint32_t* qg = qt + group * kHp * kL;
        float* ag = acc + group * kH * kL;
        // Scores of keys begin <= t < nt (a tile outside reads the page's stale rows or
        // ones no row sees; never used).
        for (int64_t t0 = begin & -kKeyTile; t0 < nt; t0 += kKeyTile) {
          __m512 a[kKeyTile];
          for (int u = 0; u < kKeyTile; ++u) a[u] = _mm512_setzero_ps();
          const uint16_t* kt = keys + t0 * token_elems;
          for (int64_t h = 0; h < kHp; ++h) {
            const __m512bh qh = (__m512bh)_mm512_loadu_si512(qg + h * kL);
            for (int u = 0; u < kKeyTile; ++u)
              a[u] = _mm512_dpbf16_ps(
                  a[u], qh, (__m512bh)_mm512_set1_epi32(load32(kt + u * token_elems + 2 * h)));
          }
          for (int u = 0; u < kKeyTile; ++u)
            _mm512_storeu_ps(s + (t0 + u) * kL, _mm512_mul_ps(a[u], scale));
        }
        if (pb.soft_cap > 0.0f)
          for (int64_t t = begin; t < nt; ++t)
            store16(s + t * kL, soft_cap16(load16(s + t * kL), pb.soft_cap));
        const v16 alpha_v = blk.softmax(group, gi, key0, begin, shared, nt, s);
        __m512 alpha;
        std::memcpy(&alpha, &alpha_v, sizeof(alpha));
        // Probabilities in pairs of keys (t, t + 1) from `begin` rounded down to even; keys
        // before `begin` or at `nt` and past have p = 0.
        const int64_t j0 = ((begin & -2) - t_lo) / 2, j1 = (nt + 1 - t_lo) / 2;
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t t = t_lo + 2 * j;
          const __m512 p0 = t >= begin ? _mm512_loadu_ps(s + t * kL) : _mm512_setzero_ps();
          const __m512 p1 = t + 1 < nt ? _mm512_loadu_ps(s + (t + 1) * kL) : _mm512_setzero_ps();
          const __m512i both_keys = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
          _mm512_storeu_si512(p2 + j * kL, _mm512_permutexvar_epi16(pairs, both_keys));
        }
        // acc = acc * alpha + p . v, pair by pair in key order. With a non-finite value among
        // the pairs (masked), each lane takes a pair whole where it sees both keys, one key
        // of it with the other's value zeroed where it sees one, and nothing where it sees
        // neither.
        __mmask16 both[kS / 2], only0[kS / 2], only1[kS / 2];
        if (!finite) {
          const __m512 upto = _mm512_loadu_ps(blk.qlast + gi * kL);
          const __m512 from = _mm512_loadu_ps(blk.qfirst + gi * kL);
          for (int64_t j = j0; j < j1; ++j) {
            const __m512 k0 = _mm512_set1_ps(float(key0 + t_lo + 2 * j)), k1 = k0 + 1.0f;
            const __mmask16 s0 = _mm512_cmp_ps_mask(from, k0, _CMP_LE_OQ) &
                                 _mm512_cmp_ps_mask(k0, upto, _CMP_LE_OQ);
            const __mmask16 s1 = _mm512_cmp_ps_mask(from, k1, _CMP_LE_OQ) &
                                 _mm512_cmp_ps_mask(k1, upto, _CMP_LE_OQ);
            both[j] = s0 & s1;
            only0[j] = s0 & ~s1;
            only1[j] = s1 & ~s0;
          }
        }
        const auto sums = [&](auto masked) {
          for (int64_t h0 = 0; h0 < kH; h0 += kDimTile) {
            __m512 a[kDimTile];
            for (int u = 0; u < kDimTile; ++u)
              a[u] = _mm512_mul_ps(_mm512_loadu_ps(ag + (h0 + u) * kL), alpha);
            for (int64_t j = j0; j < j1; ++j) {
              const __m512bh pj = (__m512bh)_mm512_loadu_si512(p2 + j * kL);
              const uint32_t* vj = v2 + j * kH + h0;
              for (int u = 0; u < kDimTile; ++u) {
                const int32_t w = load32(vj + u);
                if constexpr (!masked) {
                  a[u] = _mm512_dpbf16_ps(a[u], pj, (__m512bh)_mm512_set1_epi32(w));
                } else {
                  a[u] = _mm512_mask_dpbf16_ps(a[u], both[j], pj,
                                               (__m512bh)_mm512_set1_epi32(w));
                  a[u] = _mm512_mask_dpbf16_ps(a[u], only0[j], pj,
                                               (__m512bh)_mm512_set1_epi32(w & 0xffff));
                  const int32_t high = int32_t(uint32_t(w) & 0xffff0000u);
                  a[u] = _mm512_mask_dpbf16_ps(a[u], only1[j], pj,
                                               (__m512bh)_mm512_set1_epi32(high));
                }
              }
            }
            for (int u = 0; u < kDimTile; ++u) _mm512_storeu_ps(ag + (h0 + u) * kL, a[u]);
          }
        };
        if (finite)
          sums(std::false_type{});
        else
          sums(std::true_type{});
      }
    }
  }
  blk.store<Bf16>(pb, acc, kH, static_cast<uint16_t*>(pb.out) + q_row0 * N * kH);
}
#endif  // __AVX512BF16__

// 16 vectors folded into one: lane t of the result is the sum of the 16 lanes of v[t].
// With AVX-512: four rounds of two-vector shuffles and adds (45 operations for 16
// horizontal sums); each round halves the lanes per vector, which leaves the sums in
// bit-reversed order, undone last. Without it, the same on 8-lane halves (fold8).
#ifdef __AVX512F__
inline v16 fold16(const v16* v) {
  static const v16i lo[4] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
      {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
      {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
      {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
  };
  static const v16i hi[4] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
      {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
      {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
      {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
  };
  static const v16i bit_reversed = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  v16 w[16];
  for (int i = 0; i < 16; ++i) w[i] = v[i];
  for (int round = 0, n = 16; round < 4; ++round, n /= 2)
    for (int i = 0; i < n / 2; ++i)
      w[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], lo[round]) +
             __builtin_shuffle(w[2 * i], w[2 * i + 1], hi[round]);
  return __builtin_shuffle(w[0], bit_reversed);
}
#else
// Lane t of the result is the sum of the 8 lanes of w[t] (w is overwritten): three rounds
// that each pair two vectors (lane halves, then pairs in 128-bit lanes, then neighbours:
// shuffles AVX2 does in one instruction), then one permutation back to t's order.
inline v8 fold8(v8* w) {
  for (int i = 0; i < 4; ++i)
    w[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const v8 s = __builtin_shufflevector(w[0], w[1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(w[0], w[1], 1, 3, 9, 11, 5, 7, 13, 15);
  // s holds the sums of w[0], w[2], w[4], w[6], w[1], w[3], w[5], w[7].
  return __builtin_shufflevector(s, s, 0, 4, 1, 5, 2, 6, 3, 7);
}

inline v16 fold16(const v16* v) {
  v8 w[2][8];
  for (int t = 0; t < 16; ++t) w[t / 8][t % 8] = v[t].lo + v[t].hi;
  return join(fold8(w[0]), fold8(w[1]));
}
#endif

// The online softmax's step for one row over one page of a decode: the page's 16 partial
// dot products folded into scores (times `scale`, then soft-capped at `cap` unless it is 0),
// tokens outside t0 .. nt - 1 masked out (t0 > 0 only on a sliding window's first page).
// Returns the page's probabilities (0 outside), updates the row's running max m and
// denominator l, and sets alpha, the factor that rescales the row's accumulator.
inline v16 page_softmax(const v16* part, int64_t t0, int64_t nt, float scale, float cap,
                        float& m, float& l, float& alpha) {
  const v16 zero = {};
  v16 sv = fold16(part) * scale;
  if (cap > 0.0f) sv = soft_cap16(sv, cap);
  auto keys = [t0, nt](v16 a, v16 b) {
    return t0 ? lanes_between(t0, nt, a, b) : first_lanes(nt, a, b);
  };
  sv = keys(sv, zero - INFINITY);
  const float m_new = std::max(m, max16(sv));
  const v16 pv = keys(exp16(sv - m_new), zero);
  alpha = exp_nonpositive(m - m_new);
  l = l * alpha + sum16(pv);
  m = m_new;
  return pv;
}

// Most query heads per kv head the decode path takes (more take run_item).
constexpr int64_t kDecodeMaxG = 16;

// A decode item's place in its request and its rows' online-softmax state, for both decode
// paths (block size 16). The item's one query is its request's last (a decode row, or a
// prefill's last block of one): it sits at kv_lens[r] - 1 (so a horizon, clipped there, is
// its position) and sees every key from kv_lo (0, or the start of its sliding window), pages
// first_page .. num_pages - 1.
struct DecodeRow {
  static constexpr int64_t kS = 16;
  int64_t q_row, kv_lo, kv_end, first_page, num_pages, row_elems, page_elems;
  const int32_t* table;
  float* acc;  // [N, H], from `state` (N * H + 2 * N floats)
  float* m;    // [N] running max
  float* l;    // [N] running denominator
  DecodeRow(const Problem& pb, const Item& it, int64_t H, float* state) {
    const int64_t r = it.request, N = pb.K * pb.G;
    q_row = int64_t(pb.query_start[r]) + it.first_query;
    const int64_t pos = int64_t(pb.kv_lens[r]) - pb.query_lens[r] + it.first_query;
    kv_end = last_key(pb, r, q_row, pos) + 1;
    kv_lo = first_key(pb, pos);
    first_page = kv_lo / kS;
    num_pages = (kv_end + kS - 1) / kS;
    row_elems = 2 * pb.K * H;
    page_elems = kS * row_elems;
    table = pb.block_tables + r * pb.P;
    acc = state;
    m = acc + N * H;
    l = m + N;
    std::fill(acc, acc + N * H, 0.0f);
    for (int64_t j = 0; j < N; ++j) m[j] = initial_max(pb, j);
    std::fill(l, l + N, initial_sum(pb));
  }
  int64_t tokens(int64_t page) const { return std::min<int64_t>(kS, kv_end - page * kS); }
  int64_t first_token(int64_t page) const { return std::max<int64_t>(0, kv_lo - page * kS); }
  float inverse_sum(int64_t j) const { return l[j] > 0.0f ? 1.0f / l[j] : 0.0f; }
};

// Kv head k's partial dot products over one page for its G query heads: score(t) sets
// part[g][t] for each of the page's nt tokens; the rest are zero (those rows, stale or NaN,
// are never read). The next page's prefetch is spread over the loop.
template <typename Score>
inline void page_partials(v16 (&part)[kDecodeMaxG][DecodeRow::kS], int64_t G, int64_t nt,
                          int64_t k, int64_t K, const char* next, int64_t page_bytes,
                          Score score) {
  constexpr int64_t kS = DecodeRow::kS;
  for (int64_t t = 0; t < kS; ++t) {
    if (next) prefetch_share(next, page_bytes, k * kS + t, K * kS);
    if (t < nt) {
      score(t);
    } else {
      for (int64_t g = 0; g < G; ++g) part[g][t] = zero_vector();
    }
  }
}

// A decode row (one query, all N heads), block size 16: the keys are scored straight from
// the cache, with no float32 copy of the page. Per token, each of the kv head's G query heads
// gets a 16-lane partial dot product; a page's 16 partials fold into one vector of scores
// (fold16); the softmax runs on that vector; the values are summed into accumulators held
// in registers. About 70 vector operations per token and kv head, against about 130 for
// run_item's copy-then-dot loop: 14.4 against 16.8 ms with the pages in L2 in the
// microbenchmark of prefetch_share's comment. The next page is prefetched by prefetch_share,
// which is what a decode step's attention waited on. Takes G <= kDecodeMaxG (`run` sends
// larger G to run_item).
template <typename D, typename C, int kH>
void run_decode(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  using St = typename D::Storage;
  using Ct = typename C::Storage;
  constexpr int kV = kH / 16;
  const int64_t G = pb.G, K = pb.K, N = K * G;
  scratch.resize(size_t(2 * N * kH + 2 * N));
  float* qf = scratch.data();  // [N, H], scaled
  const DecodeRow row(pb, it, kH, qf + N * kH);
  float *acc = row.acc, *m = row.m, *l = row.l;
  const St* q = static_cast<const St*>(pb.q) + row.q_row * N * kH;
  for (int64_t j = 0; j < N * kH; ++j) qf[j] = D::load(q[j]) * pb.scale;

  const Ct* cache = static_cast<const Ct*>(pb.cache);
  const int64_t page_bytes = row.page_elems * int64_t(sizeof(Ct));
  v16 part[kDecodeMaxG][DecodeRow::kS];
  v16 prob[kDecodeMaxG];
  for (int64_t pi = row.first_page; pi < row.num_pages; ++pi) {
    const Ct* page = cache + int64_t(row.table[pi]) * row.page_elems;
    const char* next = next_page(cache, row.table, pi, row.num_pages, row.page_elems);
    const int64_t t0 = row.first_token(pi), nt = row.tokens(pi);
    for (int64_t k = 0; k < K; ++k) {
      const float* qk = qf + k * G * kH;
      page_partials(part, G, nt, k, K, next, page_bytes, [&](int64_t t) {
        const Ct* kp = page + t * row.row_elems + 2 * k * kH;
        v16 kc[kV];
        for (int u = 0; u < kV; ++u) kc[u] = C::load16(kp + 16 * u);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qk + g * kH;
          v16 s = load16(qg) * kc[0];
          for (int u = 1; u < kV; ++u) s += load16(qg + 16 * u) * kc[u];
          part[g][t] = s;
        }
      });
      // Scores -> probabilities, online softmax across pages.
      float alpha[kDecodeMaxG];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = k * G + g;
        // q was scaled; the soft cap applies to the scaled scores.
        prob[g] = page_softmax(part[g], t0, nt, 1.0f, pb.soft_cap, m[j], l[j], alpha[g]);
      }
      // acc = acc * alpha + sum_t p_t v_t over the page's tokens, a head at a time in
      // registers (a head's kV accumulators; the value rows come from L1 after the first).
      for (int64_t g = 0; g < G; ++g) {
        float* aj = acc + (k * G + g) * kH;
        v16 a[kV];
        for (int u = 0; u < kV; ++u) a[u] = load16(aj + 16 * u) * alpha[g];
        for (int64_t t = t0; t < nt; ++t) {
          const Ct* vp = page + t * row.row_elems + (2 * k + 1) * kH;
          const float p = prob[g][t];
          for (int u = 0; u < kV; ++u) a[u] += p * C::load16(vp + 16 * u);
        }
        for (int u = 0; u < kV; ++u) store16(aj + 16 * u, a[u]);
      }
    }
  }
  St* out = static_cast<St*>(pb.out) + row.q_row * N * kH;
  for (int64_t j = 0; j < N; ++j) {
    const float inv = row.inverse_sum(j);
    for (int64_t h = 0; h < kH; ++h) out[j * kH + h] = D::store(acc[j * kH + h] * inv);
  }
}

#ifdef __AVX512BF16__
// run_decode for a bf16 q and cache on CPUs with AVX512-BF16: the same loop, with the dot
// instruction (`vdpbf16ps`) in place of widening and multiplying. q . k takes the raw bf16
// query and key rows (the scale is applied to the scores); p . v takes the probabilities
// rounded to bf16 and a pair of value rows interleaved (v[t][h], v[t + 1][h]), which the
// unpack instructions leave in a per-128-bit-lane column order that is undone once, at the
// output. Per token and kv head about 30 vector operations against about 70 (the value rows
// were widened once per query head). A page's odd last token pairs with zeros, never with
// the stale row after it; as XLA's bf16 products here, the instruction flushes denormals.
template <int kH>
void run_decode_bf16(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  constexpr int kV = kH / 16, kP = kH / 32;  // kP: 32-value vectors per row
  const int64_t G = pb.G, K = pb.K, N = K * G;
  scratch.resize(size_t(N * kH + 2 * N));
  const DecodeRow row(pb, it, kH, scratch.data());  // acc's columns in the unpacked order
  float *acc = row.acc, *m = row.m, *l = row.l;
  const uint16_t* q = static_cast<const uint16_t*>(pb.q) + row.q_row * N * kH;
  const uint16_t* cache = static_cast<const uint16_t*>(pb.cache);
  const int64_t row_elems = row.row_elems, page_bytes = row.page_elems * 2;
  v16 part[kDecodeMaxG][DecodeRow::kS];
  alignas(64) uint16_t prob[kDecodeMaxG][DecodeRow::kS];  // bf16 probabilities
  for (int64_t pi = row.first_page; pi < row.num_pages; ++pi) {
    const uint16_t* page = cache + int64_t(row.table[pi]) * row.page_elems;
    const char* next = next_page(cache, row.table, pi, row.num_pages, row.page_elems);
    const int64_t t0 = row.first_token(pi), nt = row.tokens(pi);
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t* qk = q + k * G * kH;
      page_partials(part, G, nt, k, K, next, page_bytes, [&](int64_t t) {
        const uint16_t* kp = page + t * row_elems + 2 * k * kH;
        __m512i kr[kP];
        for (int u = 0; u < kP; ++u) kr[u] = _mm512_loadu_si512(kp + 32 * u);
        for (int64_t g = 0; g < G; ++g) {
          const uint16_t* qg = qk + g * kH;
          __m512 s = _mm512_setzero_ps();
          for (int u = 0; u < kP; ++u)
            s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qg + 32 * u), (__m512bh)kr[u]);
          std::memcpy(&part[g][t], &s, sizeof(s));
        }
      });
      float alpha[kDecodeMaxG];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = k * G + g;
        const v16 pv = page_softmax(part[g], t0, nt, pb.scale, pb.soft_cap, m[j], l[j], alpha[g]);
        __m512 pf;
        std::memcpy(&pf, &pv, sizeof(pf));
        _mm256_store_si256(reinterpret_cast<__m256i*>(prob[g]), (__m256i)_mm512_cvtneps_pbh(pf));
      }
      for (int64_t g = 0; g < G; ++g) {
        float* aj = acc + (k * G + g) * kH;
        const __m512 scale = _mm512_set1_ps(alpha[g]);
        __m512 a[kV];
        for (int u = 0; u < kV; ++u) a[u] = _mm512_mul_ps(_mm512_loadu_ps(aj + 16 * u), scale);
        if (t0 & 1) {  // a window from an odd token: it pairs with zeros (p = 0 before it)
          int32_t pair;
          std::memcpy(&pair, &prob[g][t0 - 1], 4);
          const __m512bh p2 = (__m512bh)_mm512_set1_epi32(pair);
          const uint16_t* v1 = page + t0 * row_elems + (2 * k + 1) * kH;
          for (int u = 0; u < kP; ++u) {
            const __m512i r0 = _mm512_setzero_si512(), r1 = _mm512_loadu_si512(v1 + 32 * u);
            a[2 * u] = _mm512_dpbf16_ps(a[2 * u], p2, (__m512bh)_mm512_unpacklo_epi16(r0, r1));
            a[2 * u + 1] =
                _mm512_dpbf16_ps(a[2 * u + 1], p2, (__m512bh)_mm512_unpackhi_epi16(r0, r1));
          }
        }
        for (int64_t t = (t0 + 1) & -2; t < nt; t += 2) {
          int32_t pair;
          std::memcpy(&pair, &prob[g][t], 4);  // prob[g][nt] is 0 when nt is odd
          const __m512bh p2 = (__m512bh)_mm512_set1_epi32(pair);
          const uint16_t* v0 = page + t * row_elems + (2 * k + 1) * kH;
          for (int u = 0; u < kP; ++u) {
            const __m512i r0 = _mm512_loadu_si512(v0 + 32 * u);
            const __m512i r1 =
                t + 1 < nt ? _mm512_loadu_si512(v0 + row_elems + 32 * u) : _mm512_setzero_si512();
            a[2 * u] = _mm512_dpbf16_ps(a[2 * u], p2, (__m512bh)_mm512_unpacklo_epi16(r0, r1));
            a[2 * u + 1] =
                _mm512_dpbf16_ps(a[2 * u + 1], p2, (__m512bh)_mm512_unpackhi_epi16(r0, r1));
          }
        }
        for (int u = 0; u < kV; ++u) _mm512_storeu_ps(aj + 16 * u, a[u]);
      }
    }
  }
  // Columns back in order: of each 32, a[2u] holds 0-3, 8-11, 16-19, 24-27 and a[2u + 1]
  // the groups between.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  uint16_t* out = static_cast<uint16_t*>(pb.out) + row.q_row * N * kH;
  for (int64_t j = 0; j < N; ++j) {
    const float inv = row.inverse_sum(j);
    alignas(64) float ordered[kH];
    for (int u = 0; u < kP; ++u) {
      const __m512 lo = _mm512_loadu_ps(acc + j * kH + 32 * u);
      const __m512 hi = _mm512_loadu_ps(acc + j * kH + 32 * u + 16);
      _mm512_store_ps(ordered + 32 * u, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_store_ps(ordered + 32 * u + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
    for (int64_t h = 0; h < kH; ++h) out[j * kH + h] = Bf16::store(ordered[h] * inv);
  }
}
#endif  // __AVX512BF16__

template <typename D, typename C>
void run(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  // The common shapes get inner loops of compile-time length.
  // The batch-invariant mode takes run_prefill for one query too: its lanes are queries, each
  // summing its keys page by page in one order whatever the other lanes hold (a masked key
  // adds exactly nothing), while run_decode sums a page's keys across vector lanes.
  // A latent's rows take run_prefill whatever their kind (its query heads are the lanes,
  // sharing one key stream), so its decode rows are batch-invariant in either mode.
  if (pb.latent) {
    if (pb.S == 16 && pb.H % 16 == 0 && pb.Hv % 8 == 0)
      return run_prefill<D, C, 0>(pb, it, scratch);
    return run_item<D, C>(pb, it, scratch);
  }
  const bool decode = !pb.invariant && it.num_queries == 1 && pb.G <= kDecodeMaxG;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<D, Bf16> && std::is_same_v<C, Bf16>) {
    if (pb.S == 16 && pb.H == 64 && decode) return run_decode_bf16<64>(pb, it, scratch);
    if (pb.S == 16 && pb.H == 128 && decode) return run_decode_bf16<128>(pb, it, scratch);
    if (pb.S == 16 && pb.H == 64) return run_prefill_bf16<64>(pb, it, scratch);
    if (pb.S == 16 && pb.H == 128) return run_prefill_bf16<128>(pb, it, scratch);
  }
#endif
  if (pb.S == 16 && pb.H == 64 && decode) return run_decode<D, C, 64>(pb, it, scratch);
  if (pb.S == 16 && pb.H == 128 && decode) return run_decode<D, C, 128>(pb, it, scratch);
  if (pb.S == 16 && pb.H == 64) return run_prefill<D, C, 64>(pb, it, scratch);
  if (pb.S == 16 && pb.H == 128) return run_prefill<D, C, 128>(pb, it, scratch);
  return run_item<D, C>(pb, it, scratch);
}

// The cache's type for q's type D: the same, or a float8 format.
template <typename D>
void run_cache(const Problem& pb, const Item& it, std::vector<float>& scratch, int fp8) {
  if (fp8 == 1) return run<D, E4M3>(pb, it, scratch);
  if (fp8 == 2) return run<D, E5M2>(pb, it, scratch);
  return run<D, D>(pb, it, scratch);
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> query_start,
                     ffi::Buffer<ffi::S32> query_lens, ffi::Buffer<ffi::S32> num_seqs,
                     ffi::Buffer<ffi::S32> q_horizon, ffi::Buffer<ffi::F32> sinks,
                     ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t fp8_bytes,
                     int64_t sliding_window, float soft_cap, bool batch_invariant,
                     int64_t v_head_dim, int64_t chunk_size) {
  const auto qd = q.dimensions();
  const auto cd = kv_cache.dimensions();
  const auto od = out->dimensions();
  // A latent cache [L, B, S, H] (MLA) has no head axis: one kv head, its value the first
  // v_head_dim lanes.
  const bool latent = cd.size() == 4;
  if (qd.size() != 3 || (cd.size() != 5 && !latent) || od.size() != 3)
    return ffi::Error::InvalidArgument(
        "q must be [T, N, H] and kv_cache [L, B, S, 2K, H] (or a latent's [L, B, S, H])");
  const auto dtype = q.element_type(), cache_dtype = kv_cache.element_type();
  // 1: e4m3fn, 2: e5m2; uint8 caches hold the bytes of the format `fp8_bytes` names.
  const int fp8 = cache_dtype == ffi::DataType::F8E4M3FN ? 1
                  : cache_dtype == ffi::DataType::F8E5M2 ? 2
                  : cache_dtype == ffi::DataType::U8     ? int(fp8_bytes)
                                                         : 0;
  if ((dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) || fp8 < 0 || fp8 > 2 ||
      (fp8 == 0 && dtype != cache_dtype))
    return ffi::Error::InvalidArgument(
        "q must be float32 or bfloat16 and kv_cache of q's dtype or float8 (e4m3fn, e5m2)");
  const int64_t num_layers = cd[0], B = cd[1], S = cd[2];
  const int64_t K2 = latent ? 2 : cd[3], H = cd[cd.size() - 1];
  const int64_t Hv = latent ? v_head_dim : H;
  if (qd[2] != H || !(latent ? 0 < Hv && Hv < H : v_head_dim == 0) || qd[1] % (K2 / 2) ||
      od[0] != qd[0] || od[1] != qd[1] || od[2] != Hv)
    return ffi::Error::InvalidArgument(
        "q [T, N, H] must match the cache's head dim and kv heads, a latent's v_head_dim lie "
        "in 1 .. H - 1 (0 without a latent), and out be [T, N, v_head_dim or H]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("layer out of range");
  if (sliding_window < 0 || chunk_size < 0 || !(soft_cap >= 0.0f))
    return ffi::Error::InvalidArgument(
        "sliding_window, chunk_size and soft_cap must be positive, or 0: none");
  const int64_t horizons = int64_t(q_horizon.element_count());
  if (horizons != 0 && horizons != qd[0])
    return ffi::Error::InvalidArgument("q_horizon must be [T], or [0] for causal attention");
  const int64_t num_sinks = int64_t(sinks.element_count());
  if (num_sinks != 0 && num_sinks != qd[1])
    return ffi::Error::InvalidArgument("sinks must be [N], or [0] for none");
  Problem pb;
  pb.q = q.untyped_data();
  pb.cache = static_cast<const char*>(kv_cache.untyped_data()) +
             l * B * S * (latent ? H : K2 * H) * int64_t(ffi::ByteWidth(cache_dtype));
  pb.out = out->untyped_data();
  pb.kv_lens = kv_lens.typed_data();
  pb.block_tables = block_tables.typed_data();
  pb.query_start = query_start.typed_data();
  pb.query_lens = query_lens.typed_data();
  pb.horizon = horizons ? q_horizon.typed_data() : nullptr;
  pb.sinks = num_sinks ? sinks.typed_data() : nullptr;
  pb.S = S;
  pb.K = K2 / 2;
  pb.G = qd[1] / pb.K;
  pb.H = H;
  pb.Hv = Hv;
  pb.latent = latent;
  pb.P = block_tables.dimensions()[1];
  pb.scale = sm_scale;
  pb.window = sliding_window;
  pb.chunk = chunk_size;
  pb.soft_cap = soft_cap;
  pb.invariant = batch_invariant;

  std::memset(out->untyped_data(), 0, out->size_bytes());
  const int64_t R = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  std::vector<Item> items;
  std::vector<char> owned(qd[0], 0);
  for (int32_t r = 0; r < R; ++r) {
    const int32_t q_len = pb.query_lens[r], kv_len = pb.kv_lens[r];
    const int64_t q0 = pb.query_start[r];
    // The reference's consistency rules: a bad request is an error, not a wild read or two
    // threads writing one row.
    if (q_len < 0 || q_len > kv_len || kv_len > pb.P * S || q0 < 0 || q0 + q_len > qd[0])
      return ffi::Error::InvalidArgument("inconsistent ragged metadata");
    for (int64_t row = q0; row < q0 + q_len; ++row) {
      if (owned[row]) return ffi::Error::InvalidArgument("query rows of two requests overlap");
      owned[row] = 1;
    }
    const int32_t* table = pb.block_tables + int64_t(r) * pb.P;
    for (int64_t p = 0; p < (int64_t(kv_len) + S - 1) / S; ++p)
      if (table[p] < 0 || table[p] >= B)
        return ffi::Error::InvalidArgument("block table entry out of range");
    for (int32_t first = 0; first < q_len; first += kQueryBlock)
      items.push_back({r, first, std::min(kQueryBlock, q_len - first)});
  }

  const bool bf16 = dtype == ffi::DataType::BF16;
  auto item = [&items, &pb, bf16, fp8](int64_t i) {
    thread_local std::vector<float> scratch;  // its allocation may throw
    if (bf16)
      run_cache<Bf16>(pb, items[i], scratch, fp8);
    else
      run_cache<F32>(pb, items[i], scratch, fp8);
  };
  const bool done = jllm_cpu::share_items(pool, int64_t(items.size()), item);
  if (!done) return ffi::Error::Internal("out of memory for kernel scratch");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmRaggedPagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [T, N, H]
                                  .Arg<ffi::AnyBuffer>()  // kv_cache [L, B, S, 2K, H] or
                                                          // [L, B, S, H]; q's or fp8
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [R, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_horizon [T], or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [N], or [0]
                                  .Ret<ffi::AnyBuffer>()         // out [T, N, Hv]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("fp8")              // a uint8 cache's format
                                  .Attr<int64_t>("sliding_window")   // 0: none
                                  .Attr<float>("soft_cap")           // 0: none
                                  .Attr<bool>("batch_invariant")
                                  .Attr<int64_t>("v_head_dim")      // a latent's; 0: none
                                  .Attr<int64_t>("chunk_size"));    // 0: none
