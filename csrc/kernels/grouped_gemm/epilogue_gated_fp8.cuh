// GEMM1 epilogue in block FP8: h = act(g) * u from the fp32 accumulators (epilogue_gated.cuh),
// quantised to e4m3 with one scale per row and tile (the tile's 128 h columns are one 1 x 128 scale
// block of GEMM2's A), stored by TMA; z (KeepZ) as in the bf16 epilogue.
//
// A row's 128 h values lie with the 4 lanes of one quad, 32 each (epilogue.cuh's fragment layout):
// their amax (NaN if one of them is) comes from two shuffles (quantize_block.cuh: RowAmax); scale
// and q as every FP8 quantiser of the library computes them (kernels/fp8/e4m3.cuh). The warpgroup's
// 64 x 128 e4m3 tile is one 8 KB chunk buffer in the 128-byte swizzle of its TMA box (byte column c
// of row r at r * 128 + ((c / 16) ^ (r % 8)) * 16 + c % 16); each warp writes and stores its own 16
// rows. Lane l % 4 == 0 writes its two rows' scales to h_scales [I / 128, pool rows].
#pragma once

#include "kernels/fp8/e4m3.cuh"
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue_gated.cuh"
#include "kernels/grouped_gemm/quantize_block.cuh"

namespace megamoe::grouped_gemm {

template <class Act, bool KeepZ>
struct GatedFp8Epilogue : GatedTile<Act, KeepZ, Fp8Config<256, 2>> {
  using Tile = GatedTile<Act, KeepZ, Fp8Config<256, 2>>;
  using typename Tile::Cfg;
  using Tile::kHalf;
  using Tile::kHCols;
  static_assert(kHCols == 128 && kWarpgroupRows * kHCols == kEpiChunkBytes, "a warpgroup's e4m3 h tile is one chunk");
  struct Arguments {
    void* h;          // [pool rows, I] e4m3
    float* h_scales;  // [I / 128, pool rows]
    void* z;          // [T·K, 2I] bf16, compact (KeepZ only)
    float activation_limit;
  };
  struct Params {
    CUtensorMap h;  // [max_blocks * 128, I] e4m3, 16-row x 128-byte boxes
    typename Tile::ZParams z;  // (KeepZ only)
    float* h_scales;
    int pool_rows;
    float activation_limit;
  };
  using typename Tile::Rows;

  static int can_implement(const PoolProblem& p, const Arguments& args) {
    MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{args.h, "h"}, {args.h_scales, "h_scales"}}));
    return Tile::check_z(p, args.z);
  }
  static int to_params(const PoolProblem& p, const Arguments& args, Params* params) {
    *params = Params{};
    params->h_scales = args.h_scales;
    params->pool_rows = int(p.rows);
    params->activation_limit = args.activation_limit;
    MEGAMOE_RETURN_IF_ERROR(make_fp8_tensor_map(&params->h, args.h, p.rows, uint64_t(p.n), kWarpRows, p.fn, "h"));
    return Tile::z_params(p, args.z, &params->z);
  }

  // Deferred (kernel.cuh): h waits quantised (64 bytes) and is stored under the next tile's first
  // wgmma batch; z and the scales are stored right away.
  struct Pending {
    uint32_t q[kHalf / 4];  // q[8 h + j / 2]: e4m3 pairs of 8-column groups j, j + 1 of row half h
    int row0, col0;
  };

  __device__ static Pending retire(const float (&acc)[Cfg::kAccumulators], const Params& p,
                                   const SharedStorage<Cfg>& smem, int warpgroup, const PoolTile& t, Rows rows) {
    const int row0 = t.block * kBlockM + warpgroup * kWarpgroupRows;
    Tile::store_z(acc, p.z, smem, warpgroup, row0, t.n_tile, rows);
    float h[kHalf];
    Tile::activate(acc, h, p.activation_limit);
    RowAmax amax;
#pragma unroll
    for (int x = 0; x < kHalf; ++x) amax.add((x / 2) % 2, h[x]);
    Pending pending;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float scale = fp8::block_scale(amax.of_row(half));
      const float inverse = fp8::inverse(scale);
#pragma unroll
      for (int j = 0; j < kHalf / 4; j += 2)
        pending.q[8 * half + j / 2] = fp8::to_e4m3x4(h[4 * j + 2 * half], h[4 * j + 2 * half + 1],
                                                     h[4 * j + 4 + 2 * half], h[4 * j + 5 + 2 * half], inverse);
      if (threadIdx.x % 4 == 0) {
        const int row = t.block * kBlockM + fragment_row(warpgroup) + 8 * half;
        p.h_scales[int64_t(t.n_tile) * p.pool_rows + row] = scale;
      }
    }
    pending.row0 = row0;
    pending.col0 = t.n_tile * kHCols;
    return pending;
  }

  __device__ static void store(const Pending& pending, const Params& p, const SharedStorage<Cfg>& smem,
                               int warpgroup) {
    const int lane = int(threadIdx.x % 32);
    const int warp = int(threadIdx.x / 32) % 4;
    const bool leader = lane == 0;
    uint8_t* chunk = smem.epi(warpgroup, 0);
    if (leader) cute::tma_store_wait<0>();  // this warp's rows of the buffer are free again
    __syncwarp();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * kWarpRows + lane / 4 + 8 * half;
#pragma unroll
      for (int j = 0; j < kHalf / 4; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const uint32_t pair = pending.q[8 * half + j / 2];
        store_shared_u16(swizzled_byte(chunk, row, col), uint16_t(j % 2 ? pair >> 16 : pair & 0xffffu));
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> visible to TMA
    __syncwarp();
    if (leader) {
      cute::SM90_TMA_STORE_2D::copy(&p.h, chunk + warp_box_offset(), pending.col0,
                                    pending.row0 + warp * kWarpRows);
      cute::tma_store_arrive();
    }
  }
  __device__ static void drain() { drain_stores(); }
};

}  // namespace megamoe::grouped_gemm
