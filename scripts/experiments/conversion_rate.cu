// How many fp32 → bf16x2 and fp32 → e4m3x2 conversions (cvt.rn.bf16x2.f32, cvt.rn.satfinite.e4m3x2.f32)
// an SM retires per clock, beside FFMA: the rate that bounds the epilogues' packing and quantising.
// One CTA per SM (each asks for all the shared memory a CTA may have), 32 warps of 8 independent
// chains; each chain feeds a conversion's output back as its next input, so the loop holds nothing
// else (e4m3x2 adds one PRMT, on another pipe, to widen its 16 bits). Prints thread-level
// instructions per clock per SM, read from clock64 in CTA 0.
// Built with the tests (CMakeLists.txt): <build dir>/conversion_rate
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kThreads = 1024, kIterations = 4096, kChains = 8;

enum class Op { kBf16x2, kE4m3x2, kFfma };

template <Op kOp>
__global__ void chains(float* sink, long long* cycles) {
  float v[kChains];
#pragma unroll
  for (int i = 0; i < kChains; ++i) v[i] = threadIdx.x * 1e-3f + i;
  __syncthreads();
  const long long start = clock64();
#pragma unroll 4
  for (int it = 0; it < kIterations; ++it) {
#pragma unroll
    for (int i = 0; i < kChains; ++i) {
      const float other = v[(i + 1) % kChains];
      if constexpr (kOp == Op::kBf16x2) {
        uint32_t out;
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(v[i]), "f"(other));
        v[i] = __uint_as_float(out);
      } else if constexpr (kOp == Op::kE4m3x2) {
        uint16_t pair;
        uint32_t out;
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(v[i]), "f"(other));
        asm("mov.b32 %0, {%1, %1};" : "=r"(out) : "h"(pair));
        v[i] = __uint_as_float(out);
      } else {
        v[i] = fmaf(v[i], 1.0001f, other);
      }
    }
  }
  __syncthreads();
  const long long stop = clock64();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kChains; ++i) sum += v[i];
  sink[blockIdx.x * kThreads + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <Op kOp>
double per_clock(int sms, float* sink, long long* cycles) {
  int smem = 0;  // unused, but it keeps a second CTA off the SM
  check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), "shared memory limit");
  check(cudaFuncSetAttribute(chains<kOp>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "shared memory");
  chains<kOp><<<sms, kThreads, smem>>>(sink, cycles);
  check(cudaDeviceSynchronize(), "chains");
  long long c = 0;
  check(cudaMemcpy(&c, cycles, sizeof c, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return double(kThreads) * kIterations * kChains / double(c);
}

}  // namespace

int main() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
  float* sink;
  long long* cycles;
  check(cudaMalloc(&sink, size_t(sms) * kThreads * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&cycles, size_t(sms) * sizeof(long long)), "cudaMalloc");
  for (int round = 0; round < 2; ++round) {  // the first round warms the clocks up
    const double bf16 = per_clock<Op::kBf16x2>(sms, sink, cycles);
    const double e4m3 = per_clock<Op::kE4m3x2>(sms, sink, cycles);
    const double ffma = per_clock<Op::kFfma>(sms, sink, cycles);
    if (round == 1) {
      std::printf("per clock and SM: cvt f32x2 -> bf16x2 %.1f, cvt f32x2 -> e4m3x2 %.1f, FFMA %.1f\n", bf16, e4m3, ffma);
    }
  }
  return 0;
}
