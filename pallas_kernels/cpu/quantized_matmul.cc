// A few rows times a quantized weight, for the CPU, as an XLA FFI custom call.
//
// y[t, o] = sum_i x[t, i] * (code[o, i] * scale[o, i / g] + offset[o, i / g])
//
// x [T, In] float32 or bfloat16; codes [Out, In] int8 (kind 0) or float8_e4m3fn (kind 2), or
// [Out, In / 2] bytes of two 4-bit codes 0..15 (kind 1: within each run of `pack` inputs the
// low nibbles hold the run's first half, the high nibbles its second half); scale and
// offset [Out, G] float32 (offset [1, 1] and unused when has_offset is 0); y [T, Out]
// float32. The contract of jllm/quantization/weights.py's `matmul`.
//
// Decode multiplies a few rows by every weight once per step, so the product is bound by
// reading the weights: this reads the codes once, in place, turns 16 (AVX-512) or 8 of them
// at a time into floats in registers (scale and offset applied), and accumulates each row's
// vector of sums, reduced once per output. Blocks of output rows are shared out over XLA's
// intra-op pool.
//
// Built at run time with GCC (g++ -O3 -march=native; GCC's vector extension) by build.py,
// like every CPU kernel.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_bf16.h"  // this folder: bfloat16 conversions
#include "cpu_fp8.h"   // this folder: float8 decoding
#include "cpu_pool.h"  // this folder: share_items
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jllm_cpu::F32s;  // kLanes floats: 16 with AVX-512, 8 otherwise (see cpu_fp8.h)
using jllm_cpu::I32s;
using jllm_cpu::kLanes;

constexpr int64_t kRowsPerItem = 32;
constexpr int kMaxRows = 16;

struct Problem {
  const float* x;  // [T, In] float32 (converted once per call)
  const uint8_t* codes;
  const float* scale;
  const float* offset;  // nullptr: none
  float* out;           // [T, Out]
  int64_t T, In, Out, G, pack;
  int kind;
};

// kLanes signed bytes as floats.
inline F32s signed_bytes_to_floats(const uint8_t* p) {
#ifdef __AVX512F__
  __m128i raw;
  std::memcpy(&raw, p, 16);
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t i8s __attribute__((vector_size(kLanes)));
  i8s b;
  std::memcpy(&b, p, kLanes);
  const F32s f = __builtin_convertvector(__builtin_convertvector(b, I32s), F32s);
#endif
  F32s v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}

inline F32s load_lanes(const float* p) {
  F32s v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes codes starting at input i of one output row, as floats (before scale and offset).
// Vectors of kLanes, never 16 lanes without AVX-512: GCC keeps a 64-byte vector in memory
// on such a target (cpu_fp8.h).
template <int kKind, int kPack>
inline F32s codes_lanes(const uint8_t* row, int64_t i) {
  if constexpr (kKind == 0) {
    return signed_bytes_to_floats(row + i);
  } else if constexpr (kKind == 1) {
    constexpr int64_t half = kPack / 2;
    const int64_t j = i % kPack;
    const I32s b = jllm_cpu::widen_u8(row + (i / kPack) * half + (j < half ? j : j - half));
    return __builtin_convertvector(j < half ? (b & 15) : (b >> 4), F32s);
  } else {
    return jllm_cpu::e4m3_lanes<false>(row + i);  // 0x7F, NaN, never comes from quantizing
  }
}

// kR output rows at a time share each load of x's rows; kR * kT accumulators and kT rows of
// x stay in registers (at most 32 with AVX-512, 16 with AVX2).
template <int kT, int kKind, int kPack>
void run_rows(const Problem& pb, int64_t first, int64_t last) {
  constexpr bool kWide = kLanes == 16;
  constexpr int kR = kT <= (kWide ? 4 : 2) ? 4 : (kT <= (kWide ? 8 : 4) ? 2 : 1);
  const int64_t In = pb.In, G = pb.G, g = In / G;
  const int64_t row_bytes = kKind == 1 ? In / 2 : In;
  for (int64_t o = first; o < last; o += kR) {
    const uint8_t* rows[kR];
    for (int r = 0; r < kR; ++r) rows[r] = pb.codes + (o + r) * row_bytes;
    F32s acc[kR][kT];
    for (int r = 0; r < kR; ++r)
      for (int t = 0; t < kT; ++t) acc[r][t] = F32s{};
    for (int64_t gi = 0; gi < G; ++gi) {
      float s[kR], m[kR];
      for (int r = 0; r < kR; ++r) {
        s[r] = pb.scale[(o + r) * G + gi];
        m[r] = pb.offset ? pb.offset[(o + r) * G + gi] : 0.0f;
      }
      for (int64_t i = gi * g; i < (gi + 1) * g; i += kLanes) {
        F32s xv[kT];
        for (int t = 0; t < kT; ++t) xv[t] = load_lanes(pb.x + t * In + i);
        for (int r = 0; r < kR; ++r) {
          const F32s w = codes_lanes<kKind, kPack>(rows[r], i) * s[r] + m[r];
          for (int t = 0; t < kT; ++t) acc[r][t] += xv[t] * w;
        }
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int t = 0; t < kT; ++t) {
        float sum = 0.0f;
        for (int k = 0; k < kLanes; ++k) sum += acc[r][t][k];
        pb.out[t * pb.Out + o + r] = sum;
      }
  }
}

template <int kT>
void run_kind(const Problem& pb, int64_t first, int64_t last) {
  if (pb.kind == 0) return run_rows<kT, 0, 0>(pb, first, last);
  if (pb.kind == 2) return run_rows<kT, 2, 0>(pb, first, last);
  if (pb.pack == 32) return run_rows<kT, 1, 32>(pb, first, last);
  return run_rows<kT, 1, 64>(pb, first, last);
}

// x is padded to a whole number of rows kT (1, 2, 4, 8 or 16) by the caller.
void run(const Problem& pb, int64_t first, int64_t last) {
  // int8 at 16 rows on AVX2: two passes of 8 (16 rows' accumulators spill out of the 16
  // registers: 0.57 against 0.32 ms for a 1536 x 576 weight on a Zen 3). The other kinds
  // would decode their codes twice, which costs them more than the spills (0.88 -> 0.97 ms).
  if (kLanes == 8 && pb.T == 16 && pb.kind == 0) {
    Problem half = pb;
    half.T = 8;
    run_kind<8>(half, first, last);
    half.x += 8 * pb.In;
    half.out += 8 * pb.Out;
    return run_kind<8>(half, first, last);
  }
  switch (pb.T) {
    case 1: return run_kind<1>(pb, first, last);
    case 2: return run_kind<2>(pb, first, last);
    case 4: return run_kind<4>(pb, first, last);
    case 8: return run_kind<8>(pb, first, last);
    default: return run_kind<16>(pb, first, last);
  }
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t kind, int64_t pack,
                           int64_t has_offset) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scale must be 2-D");
  Problem pb;
  pb.T = xd[0];
  pb.In = xd[1];
  pb.Out = cd[0];
  pb.G = sd[1];
  pb.pack = pack;
  pb.kind = int(kind);
  const int64_t width = kind == 1 ? pb.In / 2 : pb.In;
  if (kind < 0 || kind > 2 || cd[1] != width || sd[0] != pb.Out || pb.T > kMaxRows ||
      pb.Out % 4 || pb.In % pb.G || (pb.In / pb.G) % 16 ||
      (kind == 1 && ((pack != 32 && pack != 64) || pb.In % pack)))
    return ffi::Error::InvalidArgument("inconsistent quantized matmul shapes");
  const int64_t rows = pb.T;
  if (rows == 0 || pb.Out == 0) return ffi::Error::Success();  // nothing to write
  pb.T = rows <= 2 ? rows : (rows <= 4 ? 4 : (rows <= 8 ? 8 : 16));  // padded with zeros
  const auto od = offset.dimensions();
  if (has_offset && (od.size() != 2 || od[0] != sd[0] || od[1] != sd[1]))
    return ffi::Error::InvalidArgument("offset must have scale's shape");
  std::vector<float> xf(pb.T * pb.In, 0.0f);
  std::vector<float> padded_out;
  const int64_t n = rows * pb.In;
  if (x.element_type() == ffi::DataType::F32) {
    std::memcpy(xf.data(), x.untyped_data(), n * 4);
  } else if (x.element_type() == ffi::DataType::BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t k = 0; k < n; ++k) xf[k] = jllm_cpu::bf16_to_float(src[k]);
  } else {
    return ffi::Error::InvalidArgument("x must be float32 or bfloat16");
  }
  pb.x = xf.data();
  pb.codes = static_cast<const uint8_t*>(codes.untyped_data());
  pb.scale = scale.typed_data();
  pb.offset = has_offset ? offset.typed_data() : nullptr;
  pb.out = out->typed_data();
  if (pb.T != rows) {  // the padding rows' results go to scratch
    padded_out.resize(pb.T * pb.Out);
    pb.out = padded_out.data();
  }

  const int64_t total = (pb.Out + kRowsPerItem - 1) / kRowsPerItem;
  jllm_cpu::share_items(pool, total, [&pb](int64_t i) {
    run(pb, i * kRowsPerItem, std::min(pb.Out, (i + 1) * kRowsPerItem));
  });
  if (pb.T != rows) std::memcpy(out->typed_data(), pb.out, rows * pb.Out * 4);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, In]
                                  .Arg<ffi::AnyBuffer>()         // codes [Out, In or In / 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [Out, G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offset [Out, G] or [1, 1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, Out]
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("pack")
                                  .Attr<int64_t>("has_offset"));
