// bfloat16 <-> float32 one value at a time, as XLA converts: widening is exact (the bits
// become the float32's high half); narrowing rounds to nearest even and keeps a NaN a
// (quiet) NaN. Shared by the C++ kernels (attention, the float32, bf16 and quantized products,
// the norms and the rotary embedding); their vector paths widen and narrow 16 at a time.
#pragma once

#include <cstdint>
#include <cstring>

namespace jllm_cpu {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits | 0x400000u) >> 16);  // NaN
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace jllm_cpu
