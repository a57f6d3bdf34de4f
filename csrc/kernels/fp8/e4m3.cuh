// The block-FP8 recipe's rounding (DeepSeek-V3; megamoe.fp8): one fp32 scale per block of values,
// scale = amax / 448 (1 for an all-zero block, whose values are 0 either way; NaN when the block holds
// a NaN, so the block stays non-finite), q = value · (1 / scale) rounded to e4m3, nearest even,
// saturating: one division per block, and a product per value that megamoe.fp8's torch ops compute
// the same way. Shared by the quantisation kernels and the epilogues that quantise, so all give the
// same bytes.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe::fp8 {

constexpr float kE4m3Max = 448.0f;

__device__ __forceinline__ float block_scale(float amax, bool nan) {
  return nan ? __int_as_float(0x7fffffff) : (amax > 0.f ? amax / kE4m3Max : 1.f);
}

__device__ __forceinline__ float inverse(float scale) { return 1.f / scale; }

// Two values as two e4m3 bytes (the first in the low byte), given their block's inverse(scale).
__device__ __forceinline__ uint16_t to_e4m3x2(float a, float b, float inverse) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * inverse, b * inverse), __NV_SATFINITE, __NV_E4M3);
}

// Four values as four e4m3 bytes of one word (the first in the low byte).
__device__ __forceinline__ uint32_t to_e4m3x4(float a, float b, float c, float d, float inverse) {
  return uint32_t(to_e4m3x2(a, b, inverse)) | (uint32_t(to_e4m3x2(c, d, inverse)) << 16);
}

}  // namespace megamoe::fp8
