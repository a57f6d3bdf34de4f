// Static persistent tile scheduler over the routing plan's block list (the pool GEMMs).
//
// Tiles are (block, n-tile) pairs, numbered in groups of kGroupBlocks consecutive pool blocks (about
// one expert's at 16384 tokens, top-8 of 128): within a group, block fastest, then n-tile. Tiles in
// flight together then share B panels (one n-tile of one expert, read by the group's blocks) and the
// group's A blocks, and an expert's weights are split between two waves of CTAs only at a panel
// boundary. (Numbered n-tile fastest over all blocks, a wave of 132 CTAs covered ~1.4 experts' whole
// B, so most experts' weights were fetched from HBM by two waves.) CTA i takes tiles i, i + grid, ...
// The number of live blocks is read on the device, so the host never synchronises; the producer
// and the math warpgroups each walk the same sequence independently.
//
// A scheduler policy gives the host to_params(...) -> Params and the tile count the launch is sized
// for (max_tiles), and the kernel: Params (a kernel parameter), a constructor from them,
// valid() / advance(), kMayBeEmpty (whether a tile can have no k-blocks), tile() (what the math
// warpgroups and the epilogue need: k_blocks and the tile's place) and origin<Cfg>(tile) (the
// producer's TMA coordinates of the tile's first k-block).
// scheduler_expert.cuh is the K-grouped policy of the weight gradients.
#pragma once

#include <cstdint>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/problem.h"

namespace megamoe::grouped_gemm {

// TMA coordinates of a tile's first k-block: M/N index and K index of A and of B (operand.cuh),
// and the row distance between the boxes of a split K-major B tile.
struct TileOrigin {
  int a_mn, a_k;
  int b_mn, b_k;
  int b_box_stride;
};

// Where an expert's B is: B is addressed as one 2-D matrix over all experts, rows_per_expert rows
// each. K-major B ([E_local * N, K]): box i of n-tile t of expert e starts at row
// e * rows_per_expert + i * box_stride + t * kBBoxRows (box_stride is unused with one box).
// MN-major B ([E_local * K, N]): n-tile t of expert e is columns [t * BLOCK_N, +BLOCK_N) of rows
// e * rows_per_expert + k (rows_per_expert = K).
struct BRows {
  int rows_per_expert;
  int box_stride;
};

struct PoolTile {
  int block;
  int n_tile;
  int k_blocks;
};

// The FP8 main loop's B scales of a tile (mainloop_fp8.cuh): its first 128-column block's, one per
// k-block, and how far on those of its second 128-column half start (BLOCK_N 256).
struct Fp8TileScales {
  const float* first;
  int second_half;
};

struct PoolScheduler {
  static constexpr bool kMayBeEmpty = false;  // K > 0
  static constexpr int kGroupBlocks = 8;
  struct Params {
    const int32_t* block_expert;
    const int32_t* num_blocks;
    int max_blocks;
    int n_tiles;   // per pool block
    int k_blocks;  // K / the k-block depth, rounded up (TMA fills the last one's columns past K with zeros)
    BRows b_rows;
  };

  // Tiles of tile_n columns of N per pool block (the last may reach past N); Cfg's k-block depth.
  template <class Cfg>
  static Params to_params(const PoolProblem& p, int tile_n, BRows b_rows) {
    return {p.plan->block_expert, p.plan->num_blocks, int(p.max_blocks), (p.n + tile_n - 1) / tile_n,
            (p.k + Cfg::kKBlock - 1) / Cfg::kKBlock, b_rows};
  }
  static int64_t max_tiles(const Params& p) { return int64_t(p.max_blocks) * p.n_tiles; }

  const int32_t* block_expert;
  BRows b_rows;
  int n_tiles;
  int k_blocks;
  int num_blocks;
  int num_tiles;
  int tile_index;

  __device__ explicit PoolScheduler(const Params& p)
      : block_expert(p.block_expert), b_rows(p.b_rows), n_tiles(p.n_tiles), k_blocks(p.k_blocks),
        tile_index(int(blockIdx.x)) {
    int blocks = *p.num_blocks;
    num_blocks = blocks < 0 ? 0 : (blocks > p.max_blocks ? p.max_blocks : blocks);  // never past the pool
    num_tiles = num_blocks * n_tiles;  // the launcher checks max_blocks * n_tiles fits in int
  }

  __device__ bool valid() const { return tile_index < num_tiles; }
  __device__ void advance() { tile_index += int(gridDim.x); }
  __device__ PoolTile tile() const {
    const int first_block = tile_index / (kGroupBlocks * n_tiles) * kGroupBlocks;
    const int rest = num_blocks - first_block;
    const int group_blocks = rest < kGroupBlocks ? rest : kGroupBlocks;  // the last group may be short
    const int in_group = tile_index - first_block * n_tiles;
    return {first_block + in_group % group_blocks, in_group / group_blocks, k_blocks};
  }

  // An expert id outside [0, E_local) would read out of bounds, which TMA fills with zeros.
  __device__ int expert(const PoolTile& t) const { return block_expert[t.block]; }

  // B in 128 x 128 blocks per expert: scales [E_local, B rows per expert / 128, K / 128].
  template <class Cfg>
  __device__ Fp8TileScales fp8_b_scales(const PoolTile& t, const typename Cfg::MainloopParams& m) const {
    constexpr int kTileBlocks = Cfg::kBBoxes == 2 ? 1 : Cfg::kBlockN / 128;  // 128-row blocks a tile starts apart
    const int64_t b_block = int64_t(expert(t)) * m.n_blocks + t.n_tile * kTileBlocks;
    return {m.b_scales + b_block * t.k_blocks, (Cfg::kBBoxes == 2 ? m.half_blocks : 1) * t.k_blocks};
  }

  template <class Cfg>
  __device__ TileOrigin origin(const PoolTile& t) const {
    static_assert(Cfg::kAMajor == Major::K, "pool rows are the M of a K-major A");
    const int e = expert(t);
    if constexpr (Cfg::kBMajor == Major::K) {
      return {t.block * kBlockM, 0, e * b_rows.rows_per_expert + t.n_tile * Cfg::kBBoxRows, 0, b_rows.box_stride};
    } else {
      return {t.block * kBlockM, 0, t.n_tile * Cfg::kBlockN, e * b_rows.rows_per_expert, 0};
    }
  }
};

}  // namespace megamoe::grouped_gemm
