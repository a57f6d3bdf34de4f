// Static persistent tile scheduler over the routing plan's block list.
//
// Tiles are (block, n-tile) pairs numbered n-tile fastest: CTAs that run at the same time share the
// A block (read once from HBM, then from L2) and the few experts whose blocks are in flight, so
// each expert's B tiles are fetched from HBM about once. CTA i takes tiles i, i + grid, ...
// The number of live blocks is read on the device, so the host never synchronises; the producer
// and the math warpgroups each walk the same sequence independently.
#pragma once

#include <cstdint>

namespace megamoe::grouped_gemm {

struct TileScheduler {
  int n_tiles;
  int num_tiles;
  int tile;

  __device__ TileScheduler(const int32_t* num_blocks, int max_blocks, int n_tiles_per_block)
      : n_tiles(n_tiles_per_block), tile(int(blockIdx.x)) {
    int blocks = *num_blocks;
    blocks = blocks < 0 ? 0 : (blocks > max_blocks ? max_blocks : blocks);  // never past the pool
    num_tiles = blocks * n_tiles;  // the launcher checks max_blocks * n_tiles fits in int
  }

  __device__ bool valid() const { return tile < num_tiles; }
  __device__ int block() const { return tile / n_tiles; }
  __device__ int n_tile() const { return tile % n_tiles; }
  __device__ void advance() { tile += int(gridDim.x); }
};

}  // namespace megamoe::grouped_gemm
