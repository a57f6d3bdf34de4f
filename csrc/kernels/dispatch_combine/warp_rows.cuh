// What the dispatch and combine kernels share: one warp per row (a token's, or a pool slot's), its
// lanes over the row's 16-byte chunks, the grid's warps striding over the rows.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/device.h"
#include "common/status.h"
#include "common/vec16.cuh"
#include "routing/routing.h"

namespace megamoe {

constexpr int kWarpsPerCta = 8;

// The grid for `warps` warps, at most 8 CTAs per SM (the warps then stride over the rest).
inline int warp_grid(int64_t warps, int* grid) {
  int sms = 0;
  MEGAMOE_RETURN_IF_ERROR(current_sm_count(&sms));
  *grid = int(std::min<int64_t>(int64_t(sms) * 8, (warps + kWarpsPerCta - 1) / kWarpsPerCta));
  return MEGAMOE_OK;
}

// y[t] = Σ_k topk_weights[t K + k] · route_row(t K + k) over the routes that have a row (route_row
// gives nullptr for the others), in ascending k, in fp32, rounded once; null topk_weights weighs every
// route 1 (a gradient's sum over its routes). Every combine (one rank, W ranks) is this sum, whatever
// holds the rows, so W ranks give bit for bit what one rank gives.
// The rows of kBatch routes are loaded before any is added, so a lane keeps that many loads in flight.
template <class RouteRow>
__device__ __forceinline__ void combine_tokens(const RouteRow& route_row, const float* __restrict__ topk_weights,
                                               Bf16x8* __restrict__ y, int64_t num_tokens, int32_t top_k,
                                               int32_t vecs_per_row) {
  constexpr int kBatch = 8;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; t < num_tokens; t += warps) {
    for (int c = lane; c < vecs_per_row; c += 32) {
      float acc[kBf16PerVec] = {};
      for (int k0 = 0; k0 < top_k; k0 += kBatch) {
        Bf16x8 rows[kBatch];
        bool routed[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const Bf16x8* row = k0 + j < top_k ? route_row(t * top_k + k0 + j) : nullptr;
          routed[j] = row != nullptr;
          if (routed[j]) rows[j] = load_readonly(row + c);
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (routed[j]) add_scaled(acc, rows[j], topk_weights ? topk_weights[t * top_k + k0 + j] : 1.f);
        }
      }
      store(y + t * vecs_per_row + c, round_to_bf16(acc));
    }
  }
}

}  // namespace megamoe
