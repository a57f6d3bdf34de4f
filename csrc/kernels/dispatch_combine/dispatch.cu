// Dispatch (one rank): copy each routed token row into its slots of the expert-major pool.
// One warp per token: the row's 16-byte chunks are spread over the lanes and loaded once, then
// stored to each of the token's K slots. Token-major order reads x once from DRAM; walking the pool
// instead re-reads each row K times, far apart in time, and x rarely fits in L2 next to the
// streaming pool writes. Padding rows of live blocks are zeroed so the GEMMs never read stale data;
// rows past the live blocks are not touched. With weights, each route's weight goes to its slot
// of weights_pool the same way (0 on padding rows): the backward's per-row p.
// The FP8 dispatch quantises each token row once on the way (kernels/fp8/quantize_row.cuh, 1 x 128
// blocks); the slots get e4m3 rows and the scales go straight to the k-block-major layout the FP8
// GEMMs read; with weights, it moves them too (the FP8 backward's dy and p in one launch).
#include <algorithm>

#include "kernels/dispatch_combine/warp_rows.cuh"
#include "kernels/fp8/quantize_row.cuh"

namespace megamoe {
namespace {
constexpr int kMaxVecsPerLane = 16;  // 32 lanes * 16 * 16 bytes = 8 KB of a row kept in registers at a time

// Calls store_slot(slot) with the whole warp for each of token t's routes that has a slot here (not
// masked, not another rank's expert), in route order. The warp loads up to 32 of the token's slots at
// once (lane l: route k0 + l), rather than one dependent load per route.
template <class StoreSlot>
__device__ __forceinline__ void for_token_slots(const int32_t* __restrict__ route_to_slot, int64_t t, int32_t top_k,
                                                const StoreSlot& store_slot) {
  for (int k0 = 0; k0 < top_k; k0 += 32) {
    const int k_lane = k0 + int(threadIdx.x % 32);
    const int32_t lane_slot = k_lane < top_k ? route_to_slot[t * top_k + k_lane] : -1;
    for (int k = k0; k < top_k && k < k0 + 32; ++k) {
      const int64_t slot = __shfl_sync(0xffffffffu, lane_slot, k - k0);
      if (slot >= 0) store_slot(slot);
    }
  }
}

// Each lane stores its routes' weights of token t to their slots.
__device__ __forceinline__ void store_token_weights(const int32_t* __restrict__ route_to_slot,
                                                    const float* __restrict__ weights, float* __restrict__ weights_pool,
                                                    int64_t t, int32_t top_k) {
  for (int k = int(threadIdx.x % 32); k < top_k; k += 32) {
    const int32_t slot = route_to_slot[t * top_k + k];
    if (slot >= 0) weights_pool[slot] = weights[t * top_k + k];
  }
}

// A row longer than 8 KB is copied in segments of that size (its slots read once per segment).
template <int kVecsPerLane>
__device__ void copy_token_rows(const Bf16x8* __restrict__ x, Bf16x8* __restrict__ pool,
                                const int32_t* __restrict__ route_to_slot, const float* __restrict__ weights,
                                float* __restrict__ weights_pool, int64_t num_tokens, int32_t top_k,
                                int32_t vecs_per_row, int32_t x_vecs_per_row, int64_t warp, int64_t warps) {
  constexpr int kSegment = 32 * kVecsPerLane;
  const int lane = threadIdx.x % 32;
  for (int64_t t = warp; t < num_tokens; t += warps) {
    if (weights_pool != nullptr) store_token_weights(route_to_slot, weights, weights_pool, t, top_k);
    for (int segment = 0; segment < vecs_per_row; segment += kSegment) {
      Bf16x8 v[kVecsPerLane];
#pragma unroll
      for (int i = 0; i < kVecsPerLane; ++i) {
        const int c = segment + i * 32 + lane;
        if (c < vecs_per_row) v[i] = load_readonly(x + t * x_vecs_per_row + c);
      }
      for_token_slots(route_to_slot, t, top_k, [&](int64_t slot) {
#pragma unroll
        for (int i = 0; i < kVecsPerLane; ++i) {
          const int c = segment + i * 32 + lane;
          if (c < vecs_per_row) store(pool + slot * vecs_per_row + c, v[i]);
        }
      });
    }
  }
}

// Padding rows of the live blocks, found 32 at a time: each lane looks at one row, and the warp
// calls zero_row(row) for each padding one.
template <class ZeroRow>
__device__ void for_padding_rows(const int32_t* __restrict__ slot_to_route, const int32_t* __restrict__ num_blocks,
                                 int64_t max_rows, int64_t warp, int64_t warps, const ZeroRow& zero_row) {
  const int64_t blocks_rows = int64_t(*num_blocks) * MEGAMOE_BLOCK_M;
  const int64_t live_rows = blocks_rows < max_rows ? blocks_rows : max_rows;
  const int lane = threadIdx.x % 32;
  for (int64_t base = warp * 32; base < live_rows; base += warps * 32) {
    const int64_t row = base + lane;
    unsigned padding = __ballot_sync(~0u, row < live_rows && slot_to_route[row] < 0);
    while (padding) {
      const int64_t pad_row = base + __ffs(padding) - 1;
      padding &= padding - 1;
      zero_row(pad_row);
    }
  }
}

__device__ void zero_row(Bf16x8* __restrict__ pool, int64_t row, int32_t vecs_per_row) {
  for (int c = threadIdx.x % 32; c < vecs_per_row; c += 32) store(pool + row * vecs_per_row + c, Bf16x8{});
}

template <int kVecsPerLane>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
dispatch_rows(const Bf16x8* __restrict__ x, Bf16x8* __restrict__ pool,
              const int32_t* __restrict__ route_to_slot, const int32_t* __restrict__ slot_to_route,
              const int32_t* __restrict__ num_blocks, const float* __restrict__ weights,
              float* __restrict__ weights_pool, int64_t num_tokens, int64_t max_rows, int32_t top_k,
              int32_t vecs_per_row, int32_t x_vecs_per_row) {
  const int64_t warp = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  copy_token_rows<kVecsPerLane>(x, pool, route_to_slot, weights, weights_pool, num_tokens, top_k, vecs_per_row,
                                x_vecs_per_row, warp, warps);
  for_padding_rows(slot_to_route, num_blocks, max_rows, warp, warps, [&](int64_t row) {
    if (weights_pool != nullptr && threadIdx.x % 32 == 0) weights_pool[row] = 0.f;
    zero_row(pool, row, vecs_per_row);
  });
}

// x [T, hidden] bf16 -> pool [rows, hidden] e4m3 and pool_scales [hidden / 128, rows]: each token row
// quantised once (quantize_row.cuh), then stored to its K slots, and to token_rows / token_scales
// ([T, hidden], [hidden / 128, T]) where those are not null; weights (or null) as dispatch_rows.
__global__ void __launch_bounds__(kWarpsPerCta * 32)
dispatch_rows_fp8(const Bf16x8* __restrict__ x, uint2* __restrict__ pool, float* __restrict__ pool_scales,
                  const int32_t* __restrict__ route_to_slot, const int32_t* __restrict__ slot_to_route,
                  const int32_t* __restrict__ num_blocks, const float* __restrict__ weights,
                  float* __restrict__ weights_pool, uint2* __restrict__ token_rows, float* __restrict__ token_scales,
                  int64_t num_tokens, int64_t max_rows, int32_t top_k, int32_t vecs_per_row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  const int64_t first_warp = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  for (int64_t t = first_warp; t < num_tokens; t += warps) {
    for (int pass = 0; pass < vecs_per_row; pass += 32 * fp8::kRowChunksPerLane) {
      const fp8::RowPass quantised = fp8::quantize_row_pass(x + t * vecs_per_row, vecs_per_row, pass);
      // The pass's chunks as row `row` of `rows`, their scales as column `row` of `scales` [.., columns].
      const auto store = [&](uint2* rows, float* scales, int64_t row, int64_t columns) {
#pragma unroll
        for (int i = 0; i < fp8::kRowChunksPerLane; ++i) {
          const int c = pass + 32 * i + lane;
          if (c >= vecs_per_row) break;
          rows[row * vecs_per_row + c] = quantised.q[i];
          if (lane % 16 == 0) scales[int64_t(c / 16) * columns + row] = quantised.scale[i];
        }
      };
      if (token_rows != nullptr) store(token_rows, token_scales, t, num_tokens);
      for_token_slots(route_to_slot, t, top_k, [&](int64_t slot) { store(pool, pool_scales, slot, max_rows); });
    }
  }
  if (weights_pool != nullptr) {  // a loop of its own: inside the rows' loop it made that loop spill
    for (int64_t t = first_warp; t < num_tokens; t += warps) {
      store_token_weights(route_to_slot, weights, weights_pool, t, top_k);
    }
  }
  for_padding_rows(slot_to_route, num_blocks, max_rows, first_warp, warps, [&](int64_t row) {
    if (weights_pool != nullptr && lane == 0) weights_pool[row] = 0.f;
    zero_row(reinterpret_cast<Bf16x8*>(pool), row, vecs_per_row / 2);  // e4m3: half the bf16 row's bytes
    for (int b = lane; b < vecs_per_row / 16; b += 32) pool_scales[int64_t(b) * max_rows + row] = 0.f;
  });
}

struct DispatchArgs {
  const Bf16x8* x;
  Bf16x8* pool;
  const int32_t *route_to_slot, *slot_to_route, *num_blocks;
  const float* weights;
  float* weights_pool;
  int64_t num_tokens, max_rows;
  int32_t top_k, vecs_per_row, x_vecs_per_row;
};

template <int kVecsPerLane>
void launch(const DispatchArgs& a, int grid, cudaStream_t stream) {
  dispatch_rows<kVecsPerLane><<<grid, kWarpsPerCta * 32, 0, stream>>>(
      a.x, a.pool, a.route_to_slot, a.slot_to_route, a.num_blocks, a.weights, a.weights_pool, a.num_tokens,
      a.max_rows, a.top_k, a.vecs_per_row, a.x_vecs_per_row);
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_dispatch_bf16(const megamoe_routing_plan* plan, const megamoe_dispatch_args* args,
                                     void* stream_handle) {
  using namespace megamoe;
  const std::string fn = "megamoe_dispatch_bf16: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_dispatch_args& a = *args;
  constexpr int kVecBytes = int(sizeof(Bf16x8));
  const bool weights_alone = a.x == nullptr && a.pool == nullptr && a.weights != nullptr;
  if (weights_alone ? a.row_bytes != 0 : (a.row_bytes <= 0 || a.row_bytes % kVecBytes)) {
    return invalid_argument(fn + "row_bytes " + std::to_string(a.row_bytes) +
                            (weights_alone ? " must be 0 without rows (x and pool null)"
                                           : " must be a positive multiple of 16 (bf16 rows: a hidden size that "
                                             "is a multiple of 8)"));
  }
  if (a.x_stride != 0 && (a.x_stride < a.row_bytes || a.x_stride % kVecBytes)) {
    return invalid_argument(fn + "x_stride " + std::to_string(a.x_stride) +
                            " must be 0 (row_bytes) or a multiple of 16 no smaller than row_bytes = " +
                            std::to_string(a.row_bytes));
  }
  const int64_t num_tokens = plan->shape.num_tokens;
  const int64_t max_rows = routing::pool_rows(*plan);
  if ((!weights_alone && (!a.x || !a.pool)) || !plan->route_to_slot || !plan->slot_to_route || !plan->num_blocks) {
    return invalid_argument(fn + "x, pool (both null only with weights) and the plan's route_to_slot, slot_to_route "
                            "and num_blocks must be non-null");
  }
  if ((a.weights == nullptr) != (a.weights_pool == nullptr)) {
    return invalid_argument(fn + "weights and weights_pool go together (both null, or both set)");
  }
  if (!aligned16(a.x) || !aligned16(a.pool)) return invalid_argument(fn + "x and pool must be 16-byte aligned");
  int grid = 0;  // a warp per token for the copies, per 32 pool rows for the padding
  MEGAMOE_RETURN_IF_ERROR(warp_grid(std::max(num_tokens, (max_rows + 31) / 32), &grid));
  const DispatchArgs launch_args{static_cast<const Bf16x8*>(a.x), static_cast<Bf16x8*>(a.pool), plan->route_to_slot,
                                 plan->slot_to_route, plan->num_blocks, a.weights, a.weights_pool, num_tokens,
                                 max_rows, plan->shape.top_k, a.row_bytes / kVecBytes,
                                 (a.x_stride ? a.x_stride : a.row_bytes) / kVecBytes};
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int vecs_per_lane = (launch_args.vecs_per_row + 31) / 32;
  if (vecs_per_lane <= 4) {
    launch<4>(launch_args, grid, stream);
  } else if (vecs_per_lane <= 8) {
    launch<8>(launch_args, grid, stream);
  } else {
    launch<kMaxVecsPerLane>(launch_args, grid, stream);
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

extern "C" int megamoe_dispatch_fp8(const megamoe_routing_plan* plan, const megamoe_dispatch_fp8_args* args,
                                    void* stream_handle) {
  using namespace megamoe;
  const std::string fn = "megamoe_dispatch_fp8: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_dispatch_fp8_args& a = *args;
  if (a.hidden <= 0 || a.hidden % 128) {
    return invalid_argument(fn + "hidden must be a positive multiple of 128 (1 x 128 scale blocks), got " +
                            std::to_string(a.hidden));
  }
  if (!a.x || !a.pool || !a.pool_scales || !plan->route_to_slot || !plan->slot_to_route || !plan->num_blocks) {
    return invalid_argument(fn + "x, pool, pool_scales and the plan's route_to_slot, slot_to_route and num_blocks "
                            "must be non-null");
  }
  if ((a.weights == nullptr) != (a.weights_pool == nullptr)) {
    return invalid_argument(fn + "weights and weights_pool go together (both null, or both set)");
  }
  if ((a.rows == nullptr) != (a.row_scales == nullptr)) {
    return invalid_argument(fn + "rows and row_scales go together (both null, or both set)");
  }
  if (!aligned16(a.x) || !aligned16(a.pool) || !aligned16(a.rows)) {
    return invalid_argument(fn + "x, pool and rows must be 16-byte aligned");
  }
  const int64_t num_tokens = plan->shape.num_tokens;
  const int64_t max_rows = routing::pool_rows(*plan);
  int grid = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid(std::max(num_tokens, (max_rows + 31) / 32), &grid));
  dispatch_rows_fp8<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream_handle)>>>(
      static_cast<const Bf16x8*>(a.x), static_cast<uint2*>(a.pool), a.pool_scales, plan->route_to_slot,
      plan->slot_to_route, plan->num_blocks, a.weights, a.weights_pool, static_cast<uint2*>(a.rows), a.row_scales,
      num_tokens, max_rows, plan->shape.top_k, a.hidden / kBf16PerVec);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
