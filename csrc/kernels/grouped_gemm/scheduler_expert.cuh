// K-grouped tile scheduler of the weight gradients: C[e] = A[rows of e]ᵀ · B[rows of e] for every
// local expert e, where A [pool rows, M] and B [pool rows, N] are token-major (MN-major operands:
// bf16), or given transposed, Aᵀ [M, pool rows] and Bᵀ [N, pool rows] (K-major: block FP8), and K
// runs over the expert's routed rows: from expert_offsets[e], expert_counts[e] of them rounded up to
// the main loop's k-block (64 bf16, 128 FP8; the padding past that, up to the next multiple of 128,
// would only add zeros).
//
// Tiles are (expert, m-tile, n-tile) triples numbered n-tile fastest, then m-tile, then expert, so
// the CTAs running at the same time read the same expert's rows (from L2 after the first). CTA i
// takes tiles i, i + grid, ... Each tile's k-block count comes from the plan on the device (no host
// synchronisation); an expert with no rows gets tiles with k_blocks = 0, which the math warpgroups
// turn into zeros. Offsets are clamped to [0, max_rows] and must be multiples of the k-block (the
// routing plan's are multiples of 128); the k-blocks never reach past the next expert's offset.
#pragma once

#include <cstdint>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

struct ExpertTile {
  int expert;
  int m_tile;
  int n_tile;
  int k_row;     // first pool row of the expert
  int k_blocks;  // its routed rows / the k-block depth (64 bf16, 128 FP8), rounded up
};

struct ExpertScheduler {
  static constexpr bool kMayBeEmpty = true;
  struct Params {
    const int32_t* expert_offsets;  // [num_experts + 1]
    const int32_t* expert_counts;   // [num_experts]
    int num_experts;
    int m_tiles;  // M / 128, rounded up
    int n_tiles;  // N / BLOCK_N, rounded up
    int max_rows;
    int k_block;  // the main loop's k-block depth
  };

  // out[e] is [m, n], tiles 128 x Cfg's BLOCK_N (the last ones may reach past m or n).
  template <class Cfg>
  static Params to_params(const megamoe_routing_plan& plan, int m, int n) {
    return {plan.expert_offsets, plan.expert_counts, plan.shape.num_local_experts, (m + kBlockM - 1) / kBlockM,
            (n + Cfg::kBlockN - 1) / Cfg::kBlockN, int(routing::pool_rows(plan)), Cfg::kKBlock};
  }
  static int64_t max_tiles(const Params& p) { return int64_t(p.num_experts) * p.m_tiles * p.n_tiles; }

  const int32_t* expert_offsets;
  const int32_t* expert_counts;
  int m_tiles, n_tiles, max_rows, k_block;
  int num_tiles;
  int tile_index;

  __device__ explicit ExpertScheduler(const Params& p)
      : expert_offsets(p.expert_offsets),
        expert_counts(p.expert_counts),
        m_tiles(p.m_tiles), n_tiles(p.n_tiles), max_rows(p.max_rows), k_block(p.k_block),
        num_tiles(p.num_experts * p.m_tiles * p.n_tiles),  // the launcher checks it fits in int
        tile_index(int(blockIdx.x)) {}

  __device__ bool valid() const { return tile_index < num_tiles; }
  __device__ void advance() { tile_index += int(gridDim.x); }

  __device__ ExpertTile tile() const {
    const int per_expert = m_tiles * n_tiles;
    const int e = tile_index / per_expert;
    const int rest = tile_index % per_expert;
    int begin = __ldg(expert_offsets + e);
    int end = __ldg(expert_offsets + e + 1);
    begin = begin < 0 ? 0 : (begin > max_rows ? max_rows : begin);
    end = end < begin ? begin : (end > max_rows ? max_rows : end);
    const int count = __ldg(expert_counts + e);
    const int routed_blocks = count <= 0 ? 0 : (count + k_block - 1) / k_block;
    const int k_blocks = (end - begin) / k_block;
    return {e, rest / n_tiles, rest % n_tiles, begin, routed_blocks < k_blocks ? routed_blocks : k_blocks};
  }

  // (M or N index, K index) of A and B: the same numbers for token-major and transposed operands
  // (operand.cuh reads them in the operand's layout).
  template <class Cfg>
  __device__ TileOrigin origin(const ExpertTile& t) const {
    static_assert(Cfg::kAMajor == Cfg::kBMajor, "A and B both token-major (bf16) or both transposed (FP8)");
    return {t.m_tile * kBlockM, t.k_row, t.n_tile * Cfg::kBlockN, t.k_row, 0};
  }

  // Bᵀ in 128 x 128 blocks over the whole pool: scales [N / 128, pool rows / 128]; the expert's
  // k-blocks start at its first pool row.
  template <class Cfg>
  __device__ Fp8TileScales fp8_b_scales(const ExpertTile& t, const typename Cfg::MainloopParams& m) const {
    const int pool_blocks = max_rows / 128;
    return {m.b_scales + int64_t(t.n_tile * (Cfg::kBlockN / 128)) * pool_blocks + t.k_row / 128, pool_blocks};
  }
};

}  // namespace megamoe::grouped_gemm
