// The block-FP8 recipe's rounding (DeepSeek-V3; megamoe.fp8): one fp32 scale per block of values,
// scale = amax / 448 (1 for an all-zero block, whose values are 0 either way; NaN when the block holds
// a NaN, so the block stays non-finite), q = value · (1 / scale) rounded to e4m3, nearest even,
// saturating: one division per block, and a product per value that megamoe.fp8's torch ops compute
// the same way. Shared by the quantisation kernels and the epilogues that quantise, so all give the
// same bytes. Every amax is taken with max_nan, so it is NaN exactly when its block holds a NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe::fp8 {

constexpr float kE4m3Max = 448.0f;

// max(a, b), NaN when either is (PTX max.NaN): one instruction per value of an amax.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Two running amaxes at once, over bf16 pairs: each half of the result is max(|acc|, |v|) of that
// half, NaN when either is (PTX max.NaN.xorsign.abs: one instruction per two values). The halves'
// signs are meaningless (the xor of the inputs'); abs_halves reads the magnitudes.
__device__ __forceinline__ uint32_t abs_max_nan_bf16x2(uint32_t acc, uint32_t v) {
  uint32_t r;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(acc), "r"(v));
  return r;
}

// |low| and |high| half of a bf16 pair, in fp32.
__device__ __forceinline__ float2 abs_halves(uint32_t pair) {
  return make_float2(fabsf(__uint_as_float(pair << 16)), fabsf(__uint_as_float(pair & 0xffff0000u)));
}

// max_nan of v over each group of Lanes adjacent lanes (Lanes a power of two up to 32, groups
// aligned to Lanes): every lane gets its group's. Every lane of the warp calls it.
template <int Lanes>
__device__ __forceinline__ float lanes_max_nan(float v) {
  static_assert(Lanes >= 1 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "a power of two up to a warp");
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset /= 2) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// amax / 448, 1 for an amax of 0, NaN for a NaN one. Branch-free: a branch around the division puts
// its out-of-line slow path where it spills the callers' registers.
__device__ __forceinline__ float block_scale(float amax) { return amax / kE4m3Max + float(amax == 0.f); }

__device__ __forceinline__ float inverse(float scale) { return 1.f / scale; }

// The scale of one block held by a whole CTA of Threads threads (1-D), each passing the amax of its
// part: reduced within each warp, then across the warps through shared memory. Every thread of the
// CTA calls it (it holds a barrier) and gets the scale; a second call needs a barrier between them,
// as its scratch is reused.
template <int Threads>
__device__ __forceinline__ float cta_block_scale(float amax) {
  static_assert(Threads % 32 == 0, "whole warps");
  __shared__ float warp_amax[Threads / 32];
  amax = lanes_max_nan<32>(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < Threads / 32; ++w) amax = max_nan(amax, warp_amax[w]);
  return block_scale(amax);
}

// Two values as two e4m3 bytes (the first in the low byte), given their block's inverse(scale).
__device__ __forceinline__ uint16_t to_e4m3x2(float a, float b, float inverse) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * inverse, b * inverse), __NV_SATFINITE, __NV_E4M3);
}

// Four values as four e4m3 bytes of one word (the first in the low byte).
__device__ __forceinline__ uint32_t to_e4m3x4(float a, float b, float c, float d, float inverse) {
  return uint32_t(to_e4m3x2(a, b, inverse)) | (uint32_t(to_e4m3x2(c, d, inverse)) << 16);
}

// Two e4m3 bytes (the first in the low byte) times their block's scale, rounded to bf16: what
// megamoe.fp8.dequantize_rows gives in bf16 (e4m3 -> half is exact, the product is fp32's).
__device__ __forceinline__ __nv_bfloat162 dequantize_e4m3x2(uint16_t pair, float scale) {
  const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3)));
  return __floats2bfloat162_rn(f.x * scale, f.y * scale);
}

}  // namespace megamoe::fp8
