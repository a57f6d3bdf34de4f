// GEMM1 epilogue: h = act(g) * u from the fp32 accumulators (Act: activation.cuh), one rounding to
// bf16, TMA store.
//
// The B tile of n-tile t is 256 rows: gate rows [128 t, 128 t + 128) of the expert, then up rows
// [I + 128 t, I + 128 t + 128) (two TMA boxes, Config<256, 2>). So fragment column c < 128 is gate
// column 128 t + c and column c + 128 the matching up column. In the m64n256 fragment
// (epilogue.cuh) acc[4j + i] holds column 8j + 2(l%4) + (i%2) of row 16w + l/4 + 8(i/2); adding
// 128 to the column adds 16 to j, i.e. 64 to the index, and keeps the row. Hence every thread holds
// its gate values in acc[0, 64) and the matching up values in acc[64, 128), same position for same
// (row, column): h for acc[x] is act(acc[x]) * acc[x + 64], and acc[0, 64) is then exactly an
// m64n128 fragment of the 128-column h tile, which the plain chunk store writes (deferred: below).
//
// KeepZ (training): the same halves, rounded to bf16 before the activation, are also stored as z = gate | up
// [T·K, 2I], the backward's input, so the backward does not recompute x·w13ᵀ; through a map of its
// two halves (tensor_map.h), so the last tile of an I that is not a multiple of 128 stops at I. z is
// compact (compact_rows.cuh): a block's rows go to z shifted, and its padding rows nowhere.
//
// When I is not a multiple of 128, the last tile's gate box reaches into the expert's up rows and its
// up box into the next expert's gate rows (or past w13, zeros): those columns of the tile are past I,
// and the stores of h and z leave them out.
#pragma once

#include "kernels/grouped_gemm/activation.cuh"
#include "kernels/grouped_gemm/compact_rows.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"

namespace megamoe::grouped_gemm {

// What the gated epilogues (bf16 h here, e4m3 h in epilogue_gated_fp8.cuh) share: the tile's
// shape, where w13's two halves are, z (KeepZ) and h in fp32. The problem's N is I (columns of h),
// its K the hidden size.
template <class Act, bool KeepZ, class C>
struct GatedTile {
  using Cfg = C;
  static constexpr int kHCols = Cfg::kBlockN / 2;  // h columns per tile
  static constexpr int kTileN = kHCols;
  static constexpr int kHalf = Cfg::kAccumulators / 2;
  static constexpr bool kKeepZ = KeepZ;

  // Box 0 of a stage's B tile = gate rows [128 t, +128), box 1 = up rows [I + 128 t, +128) of the
  // expert's 2I rows of w13.
  static BRows b_rows(const PoolProblem& p) { return {2 * p.n, p.n}; }

  // z [T·K, 2I] bf16 as its two halves: 16-row x 64-column boxes (tma_store_chunks), one-row boxes
  // for the rows of a warp that crosses its expert's last row, and the plan's compact offsets.
  struct ZParams {
    CUtensorMap boxes;
    CUtensorMap rows;
    CompactRows compact;
  };
  static int check_z(const PoolProblem& p, const void* z) {
    if constexpr (KeepZ) {
      MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{z, "z"}}));
      return CompactRows::check(p.fn, *p.plan);
    } else {
      return MEGAMOE_OK;
    }
  }
  static int z_params(const PoolProblem& p, void* z, ZParams* params) {
    if constexpr (KeepZ) {
      const uint64_t rows = CompactRows::rows(*p.plan);
      params->compact = CompactRows::of(*p.plan);
      MEGAMOE_RETURN_IF_ERROR(make_halves_tensor_map(&params->boxes, z, rows, uint64_t(p.n), kWarpRows, p.fn, "z"));
      return make_halves_tensor_map(&params->rows, z, rows, uint64_t(p.n), 1, p.fn, "z");
    } else {
      return MEGAMOE_OK;
    }
  }

  // Per tile (KeepZ): where its block's rows go in z.
  struct Rows {
    CompactRows::Block z;
  };

  // z's gate and up halves of the tile, rounded to bf16 (KeepZ): stored right after the main loop,
  // since their 64 packed registers would not fit beside the next tile's accumulators.
  __device__ static void store_z(const float (&acc)[Cfg::kAccumulators], const ZParams& z,
                                 const SharedStorage<Cfg>& smem, int warpgroup, int row0, int n_tile, Rows rows) {
    if constexpr (KeepZ) {
      using Half = const float(&)[kHalf];
      uint32_t packed[kHalf / 2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // gate, then up
        pack_fragment(reinterpret_cast<Half>(acc[half * kHalf]), packed);
        tma_store_chunks<kHCols / kEpiCols>(packed, &z.boxes, smem, warpgroup, row0 - rows.z.shift, n_tile * kHCols,
                                            InHalf{half}, RowsBefore{&z.rows, rows.z.end});
      }
    }
  }

  // Both read their TMA maps h and z (KeepZ) and defer h's store (kernel.cuh).
  static constexpr bool kDeferred = true;
  template <class Params>
  __device__ static void prefetch(const Params& p) {
    cute::prefetch_tma_descriptor(&p.h);
    if constexpr (KeepZ) {
      cute::prefetch_tma_descriptor(&p.z.boxes);
      cute::prefetch_tma_descriptor(&p.z.rows);
    }
  }
  template <class Params>
  __device__ static Rows prepare(const Params& p, const PoolTile& t, int) {
    if constexpr (KeepZ) {
      return {p.z.compact.block(t.block)};
    } else {
      return {};
    }
  }

  // h = act(g) · u in fp32, an m64n128 fragment of the tile's 128 h columns; activation_limit: the
  // C API's (activation.cuh).
  __device__ static void activate(const float (&acc)[Cfg::kAccumulators], float (&h)[kHalf], float activation_limit) {
    const Act act = Act::of(activation_limit);
#pragma unroll
    for (int x = 0; x < kHalf; ++x) h[x] = act.gated(acc[x], acc[x + kHalf]);
  }
};

// C: Config<256, 2>, or GatheredAConfig<256, 2> (gathered_rows.cuh) to read A's rows from token rows.
template <class Act, bool KeepZ, class C = Config<256, 2>>
struct GatedEpilogue : GatedTile<Act, KeepZ, C> {
  using Tile = GatedTile<Act, KeepZ, C>;
  using typename Tile::Cfg;
  using Tile::kHalf;
  using Tile::kHCols;
  struct Arguments {
    void* h;  // [pool rows, I] bf16
    void* z;  // [T·K, 2I] bf16, compact (KeepZ only)
    float activation_limit;
  };
  struct Params {
    CUtensorMap h;  // [max_blocks * 128, I], 16-row x 64-column boxes (tma_store_chunks)
    typename Tile::ZParams z;  // (KeepZ only)
    float activation_limit;
  };
  using typename Tile::Rows;

  static int can_implement(const PoolProblem& p, const Arguments& args) {
    MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{args.h, "h"}}));
    return Tile::check_z(p, args.z);
  }
  static int to_params(const PoolProblem& p, const Arguments& args, Params* params) {
    *params = Params{};
    params->activation_limit = args.activation_limit;
    MEGAMOE_RETURN_IF_ERROR(make_tensor_map(&params->h, args.h, p.rows, uint64_t(p.n), kWarpRows, p.fn, "h"));
    return Tile::z_params(p, args.z, &params->z);
  }

  // Deferred (kernel.cuh): z (KeepZ) is stored right after the main loop; h waits packed and is
  // stored under the next tile's first wgmma batch.
  struct Pending {
    uint32_t h[kHalf / 2];
    int row0, col0;
  };

  __device__ static Pending retire(const float (&acc)[Cfg::kAccumulators], const Params& p,
                                   const SharedStorage<Cfg>& smem, int warpgroup, const PoolTile& t, Rows rows) {
    const int row0 = t.block * kBlockM + warpgroup * kWarpgroupRows;
    Tile::store_z(acc, p.z, smem, warpgroup, row0, t.n_tile, rows);
    float h[kHalf];
    Tile::activate(acc, h, p.activation_limit);
    Pending pending;
    pack_fragment(h, pending.h);
    pending.row0 = row0;
    pending.col0 = t.n_tile * kHCols;
    return pending;
  }
  __device__ static void store(const Pending& pending, const Params& p, const SharedStorage<Cfg>& smem,
                               int warpgroup) {
    tma_store_chunks<kHCols / kEpiCols>(pending.h, &p.h, smem, warpgroup, pending.row0, pending.col0);
  }
  __device__ static void drain() { drain_stores(); }
};

}  // namespace megamoe::grouped_gemm
