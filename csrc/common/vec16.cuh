// 16-byte vectors of bf16 for memory-bound kernels: one load or store instruction per 8 elements.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace megamoe {

constexpr int kBf16PerVec = 8;

struct alignas(16) Bf16x8 {
  __nv_bfloat162 pairs[4];
};

// One 16-byte load (ld.global.nc.v4) or store (st.global.v4): through Bf16x8 itself the compiler
// splits both into four 4-byte accesses, as it cannot prove the 16-byte alignment of the address.
// load_readonly is for data that nothing writes while the kernel runs (the non-coherent path).
__device__ __forceinline__ Bf16x8 load_readonly(const Bf16x8* p) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  Bf16x8 v;
  static_assert(sizeof(v) == sizeof(raw), "16 bytes");
  memcpy(&v, &raw, sizeof(v));
  return v;
}

__device__ __forceinline__ void store(Bf16x8* p, const Bf16x8& v) {
  uint4 raw;
  memcpy(&raw, &v, sizeof(raw));
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ void add_scaled(float (&acc)[kBf16PerVec], const Bf16x8& v, float scale) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(v.pairs[i]);
    acc[2 * i] = fmaf(scale, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(scale, f.y, acc[2 * i + 1]);
  }
}

__device__ __forceinline__ Bf16x8 round_to_bf16(const float (&acc)[kBf16PerVec]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return v;
}

}  // namespace megamoe
