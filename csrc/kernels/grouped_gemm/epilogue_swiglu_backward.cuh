// dh epilogue of the backward: dh = dy_pool · w2[e] (fp32 accumulators, MN-major B), then per pool
// row r (topk weight p = p_pool[r]) and column i of the tile, with g, u from z_pool (bf16 -> fp32):
//   σ = sigmoid(g), silu = g σ, h = silu · u
//   dp_partial[r, n_tile] = Σ_i h · dh              (this tile's 128 columns, fixed order)
//   dh_w = p · dh,  dg = dh_w · u · σ (1 + g (1 − σ)),  du = dh_w · silu,  hp = p · h
//   dz[r, n0 + i] = dg, dz[r, I + n0 + i] = du, hp[r, n0 + i] = hp   (bf16, one rounding each)
// Rows with p == 0 (padding rows, or a zero weight) get dz = hp = 0 exactly, whatever z holds.
//
// BLOCK_N = 128: one tile's dh columns [n0, n0 + 128) are the same columns of g and u. Before the
// main loop each thread loads the g and u pairs at its own fragment positions (epilogue.cuh: lane l
// of warp w holds rows 16w + l/4 (+8), columns 8j + 2(l%4) + {0,1}): 4-byte loads that complete
// while the tile's k-loop runs, so the epilogue does not wait for memory. Outputs are packed to
// bf16 pairs chunk by chunk (64 columns) and leave through the swizzled chunk buffers by TMA:
// dg, du, hp per chunk, 6 stores per tile alternating the two buffers.
// dp: each thread sums its 32 columns of each of its 2 rows, then the 4 lanes sharing a row add in
// a fixed butterfly; lane l % 4 == 0 writes the row's partial. No atomics: deterministic.
#pragma once

#include <cuda_bf16.h>

#include "kernels/grouped_gemm/epilogue.cuh"

namespace megamoe::grouped_gemm {

struct SwigluBackwardEpilogue {
  using Cfg = Config<128, 1, Major::K, Major::MN>;
  static constexpr int kGroups = Cfg::kBlockN / 8;  // 8-column groups per tile: 16
  static constexpr int kChunks = Cfg::kBlockN / kEpiCols;
  static_assert(Cfg::kAccumulators == 4 * kGroups);
  static_assert(kEpiBuffers == 2 && (3 * kChunks) % 2 == 0, "stores alternate the two chunk buffers");
  struct Params {
    CUtensorMap dz;  // [max_blocks * 128, 2I], 64 x 64 boxes
    CUtensorMap hp;  // [max_blocks * 128, I], 64 x 64 boxes
    const __nv_bfloat16* z;  // [max_blocks * 128, 2I]
    const float* p;          // [max_blocks * 128]
    float* dp_partial;       // [max_blocks * 128, I / 128]
    int intermediate;
  };
  struct Rows {
    uint32_t g[kGroups][2];  // bf16 pairs at the thread's fragment positions, row half 0 / 1
    uint32_t u[kGroups][2];
    float p[2];
  };

  __device__ static int fragment_row(int warpgroup) {  // pool row offset of the thread's row half 0
    return warpgroup * kWarpgroupRows + int((threadIdx.x / 32) % 4) * 16 + int(threadIdx.x % 32) / 4;
  }

  __device__ static void prefetch(const Params& p) {
    cute::prefetch_tma_descriptor(&p.dz);
    cute::prefetch_tma_descriptor(&p.hp);
  }

  __device__ static Rows prepare(const Params& p, const PoolTile& t, int warpgroup) {
    const int64_t row = int64_t(t.block) * kBlockM + fragment_row(warpgroup);
    const int col = t.n_tile * Cfg::kBlockN + 2 * int(threadIdx.x % 4);
    const int64_t ld = 2 * int64_t(p.intermediate);
    Rows r;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_bfloat16* zr = p.z + (row + 8 * h) * ld + col;
      r.p[h] = __ldg(p.p + row + 8 * h);
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
        r.g[j][h] = __ldg(reinterpret_cast<const unsigned int*>(zr + 8 * j));
        r.u[j][h] = __ldg(reinterpret_cast<const unsigned int*>(zr + p.intermediate + 8 * j));
      }
    }
    return r;
  }

  __device__ static float2 unpack(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }

  __device__ static void store(const float (&acc)[Cfg::kAccumulators], const Params& p,
                               const SharedStorage<Cfg>& smem, int warpgroup, const PoolTile& t, const Rows& rows) {
    const int row0 = t.block * kBlockM + warpgroup * kWarpgroupRows;
    const int col0 = t.n_tile * Cfg::kBlockN;
    float dp[2] = {0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      uint32_t dg[16], du[16], hp[16];  // [2 j + h] for the chunk's 8 groups
#pragma unroll
      for (int jl = 0; jl < 8; ++jl) {
        const int j = c * 8 + jl;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 g = unpack(rows.g[j][h]);
          const float2 u = unpack(rows.u[j][h]);
          const float pw = rows.p[h];
          float out_dg[2], out_du[2], out_hp[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float gi = i ? g.y : g.x, ui = i ? u.y : u.x;
            const float dh = acc[4 * j + 2 * h + i];
            const float sig = __fdividef(1.0f, 1.0f + __expf(-gi));  // e^-g = inf -> 0, the limit
            const float silu = gi * sig;
            const float hv = silu * ui;
            dp[h] = fmaf(hv, dh, dp[h]);
            const float dhw = pw * dh;
            const bool live = pw != 0.f;
            out_dg[i] = live ? dhw * ui * sig * fmaf(gi, 1.0f - sig, 1.0f) : 0.f;
            out_du[i] = live ? dhw * silu : 0.f;
            out_hp[i] = live ? pw * hv : 0.f;
          }
          dg[2 * jl + h] = pack_bf16x2(out_dg[0], out_dg[1]);
          du[2 * jl + h] = pack_bf16x2(out_du[0], out_du[1]);
          hp[2 * jl + h] = pack_bf16x2(out_hp[0], out_hp[1]);
        }
      }
      const int col = col0 + c * kEpiCols;
      // Store s = 3 c + o uses buffer s % 2: strictly alternating (6 stores per tile, so tiles agree).
      tma_store_packed_chunk(dg, &p.dz, smem, warpgroup, (3 * c + 0) % kEpiBuffers, row0, col);
      tma_store_packed_chunk(du, &p.dz, smem, warpgroup, (3 * c + 1) % kEpiBuffers, row0, p.intermediate + col);
      tma_store_packed_chunk(hp, &p.hp, smem, warpgroup, (3 * c + 2) % kEpiBuffers, row0, col);
    }
    // The 4 lanes of a row hold disjoint columns: add them in a fixed order.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 1);
      dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 2);
    }
    if (threadIdx.x % 4 == 0) {
      const int n_tiles = p.intermediate / Cfg::kBlockN;
      const int64_t row = int64_t(t.block) * kBlockM + fragment_row(warpgroup);
      p.dp_partial[row * n_tiles + t.n_tile] = dp[0];
      p.dp_partial[(row + 8) * n_tiles + t.n_tile] = dp[1];
    }
  }
  __device__ static void drain() { drain_stores(); }
};

}  // namespace megamoe::grouped_gemm
