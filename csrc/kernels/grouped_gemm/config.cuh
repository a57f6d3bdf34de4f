// Tile shape, pipeline depth and shared-memory layout of the BF16 grouped GEMM (config_fp8.cuh: the
// block-FP8 variant, same layout plus A's scales).
//
// A CTA computes one 128 x BLOCK_N tile of C at a time: 128 rows (a pool block, one expert; or an
// m-tile of a weight gradient), split between two math warpgroups (64 rows each, one wgmma
// m64nBLOCK_Nk16 per 16 of K). Operand tiles are 64 elements deep in K. Each operand is K-major
// (K contiguous in global memory: a 64-deep k-block is one 128-byte swizzle row) or MN-major (M or
// N contiguous: 64-wide boxes of 128-byte rows, one row per k); operand.cuh has both layouts.
#pragma once

#include <cstdint>

#include "megamoe/megamoe.h"

namespace megamoe::grouped_gemm {

constexpr int kBlockM = MEGAMOE_BLOCK_M;  // one pool block per tile: one expert per tile
constexpr int kBlockK = 64;               // 64 bf16 = 128 bytes = one swizzle-atom row
constexpr int kSwizzleBytes = 128;
constexpr int kMathWarpgroups = 2;
constexpr int kWarpgroupRows = kBlockM / kMathWarpgroups;  // 64 = wgmma M
constexpr int kThreads = 128 * (1 + kMathWarpgroups);      // producer warpgroup + math warpgroups
constexpr int kMathWarps = kMathWarpgroups * 4;

// Registers per thread after setmaxnreg: the math warpgroups can only take what the producer gives
// back of the CTA's 384 x 168 (__launch_bounds__(kThreads, 1)): 128 * 40 + 256 * 232 = 64512.
constexpr int kProducerRegisters = 40;
constexpr int kMathRegisters = 232;
static_assert(128 * kProducerRegisters + 256 * kMathRegisters <= kThreads * 168, "setmaxnreg.inc would wait forever");

// Epilogue: each math warpgroup stores its 64 rows in 64-column chunks (128-byte rows, so the
// chunk can use the 128B swizzle: conflict-free stmatrix, and TMA undoes the swizzle on the way
// out). Two chunk buffers per warpgroup let one TMA store drain while the next chunk is written.
// Each warp stores its own 16 rows of a chunk (one TMA box per warp), so the warps of a warpgroup
// never wait for each other in the epilogue.
constexpr int kEpiCols = 64;
constexpr int kEpiBuffers = 2;
constexpr int kWarpRows = kWarpgroupRows / 4;  // rows of a warpgroup's fragment held by one warp
constexpr int kEpiChunkBytes = kWarpgroupRows * kEpiCols * 2;  // 8 KB

// Tile rows of a math thread's accumulator fragment (epilogue.cuh has the layout): the first row of
// its warp's 16, and its row half 0 (half 1 is 8 rows below).
__device__ __forceinline__ int warp_row(int warpgroup) {
  return warpgroup * kWarpgroupRows + int((threadIdx.x / 32) % 4) * kWarpRows;
}
__device__ __forceinline__ int fragment_row(int warpgroup) { return warp_row(warpgroup) + int(threadIdx.x % 32) / 4; }
// Where the warp's 16 rows start in a staged 128B-swizzled box of its warpgroup's 64 rows (the
// epilogues' one-box-per-warp TMA stores).
__device__ __forceinline__ uint32_t warp_box_offset() { return ((threadIdx.x / 32) % 4) * kWarpRows * kSwizzleBytes; }

// sm_90 opt-in limit of dynamic shared memory per block (227 KB).
constexpr int kSharedMemoryLimit = 232448;
constexpr int kMaxStages = 8;

// Two words per math warp, for an epilogue's reductions over the whole tile (epilogue_gated_backward.cuh).
constexpr int kExchangeBytes = 2 * kMathWarps * 4;

// Shared memory of S stages, the epilogue buffers, 2 mbarriers per stage and the exchange words (the
// kernel declares its dynamic shared memory 1024-aligned, as the swizzled tiles need, so no slack is
// reserved: at the 256-wide block-FP8 tile 1 KB of slack would cost a fourth stage).
constexpr int shared_bytes(int stages, int stage_bytes, int epi_bytes) {
  return stages * (stage_bytes + 16) + epi_bytes + kExchangeBytes;
}
// As many stages as fit next to the epilogue buffers.
constexpr int pipeline_stages(int stage_bytes, int epi_bytes) {
  int s = kMaxStages;
  while (shared_bytes(s, stage_bytes, epi_bytes) > kSharedMemoryLimit) --s;
  return s;
}

enum class Major { K, MN };  // which dimension of an operand is contiguous in global memory

// Which operand, if any, the producer warpgroup gathers from token rows instead of loading a pool
// by TMA (gathered_rows.cuh): A of GEMM1 and dh (K-major), A of dW2 or B of dW13 (MN-major).
enum class Gathered { kNone, kA, kB };

// What follows from a stage's size and the tile width, for every precision: the epilogue buffers,
// as many stages as fit next to them, the shared memory in all, and the fp32 accumulators each math
// thread holds (64 x BLOCK_N / 128). Every operand is loaded by TMA, with the register split above
// (gathered_rows.cuh's configs copy one operand's rows instead, with a split of their own).
template <int StageBytes, int BlockN>
struct StageLayout {
  static constexpr Gathered kGathered = Gathered::kNone;
  static constexpr int kProducerRegs = kProducerRegisters;
  static constexpr int kMathRegs = kMathRegisters;
  static constexpr int kStageBytes = StageBytes;
  static constexpr int kEpiBytes = kMathWarpgroups * kEpiBuffers * kEpiChunkBytes;
  static constexpr int kStages = pipeline_stages(kStageBytes, kEpiBytes);
  static_assert(kStages >= 3, "pipeline too shallow");
  static constexpr int kSmemBytes = shared_bytes(kStages, kStageBytes, kEpiBytes);
  static_assert(kSmemBytes <= kSharedMemoryLimit);
  static constexpr int kAccumulators = kWarpgroupRows * BlockN / 128;
};

// BBoxes (K-major B only): how many TMA boxes fill one stage's B tile. 1 = BLOCK_N consecutive rows of B; 2 = two
// boxes of BLOCK_N / 2 rows from different places of B, stacked in one tile (the gated GEMM1: the gate rows
// and the matching up rows), armed on the same full barrier with the same total byte count.
// An MN-major B always spans BLOCK_N consecutive columns (BLOCK_N / 64 boxes).
template <int BlockN, int BBoxes = 1, Major AMajor = Major::K, Major BMajor = Major::K>
struct Config : StageLayout<(kBlockM + BlockN) * kBlockK * 2, BlockN> {
  static_assert(BlockN == 128 || BlockN == 256, "BLOCK_N must be 128 or 256 (wgmma N <= 256)");
  static_assert(BBoxes == 1 || BBoxes == 2, "one or two B boxes per stage");
  static_assert(BBoxes == 1 || BMajor == Major::K, "split B tiles are K-major");
  static constexpr Major kAMajor = AMajor;
  static constexpr Major kBMajor = BMajor;
  static constexpr bool kFp8 = false;
  static constexpr int kKBlock = kBlockK;  // K elements per stage
  static constexpr int kScaleBytes = 0;    // per stage: block-FP8's A scales (config_fp8.cuh)
  struct MainloopParams {};                // what the main loop reads besides A and B: nothing
  static constexpr int kBlockN = BlockN;
  static constexpr int kBBoxes = BBoxes;
  static constexpr int kBBoxRows = BlockN / BBoxes;
  static constexpr int kBBoxBytes = kBBoxRows * kBlockK * 2;  // a multiple of 1024: boxes stay atom-aligned
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = BlockN * kBlockK * 2;
};

// Shared memory, carved from the start of the dynamic allocation (1024-aligned, kernel.cuh):
//   [A stage 0..S-1][B stage 0..S-1][epilogue chunks][A scales stage 0..S-1 (FP8)][full barriers][empty barriers]
//   [exchange words]
// Every tile and chunk size is a multiple of 1024, so every tile starts on a swizzle-atom boundary.
template <class Cfg>
struct SharedStorage {
  static constexpr int kTileBytes = Cfg::kStages * (Cfg::kABytes + Cfg::kBBytes);
  uint8_t* base;

  __device__ explicit SharedStorage(uint8_t* raw) : base(raw) {}

  __device__ uint8_t* a(int stage) const { return base + stage * Cfg::kABytes; }
  __device__ uint8_t* b(int stage) const { return base + Cfg::kStages * Cfg::kABytes + stage * Cfg::kBBytes; }
  __device__ uint8_t* epi(int warpgroup, int buffer) const {
    return base + kTileBytes + (warpgroup * kEpiBuffers + buffer) * kEpiChunkBytes;
  }
  __device__ float* a_scales(int stage) const {
    return reinterpret_cast<float*>(base + kTileBytes + Cfg::kEpiBytes + stage * Cfg::kScaleBytes);
  }
  __device__ uint64_t* full(int stage) const {
    return reinterpret_cast<uint64_t*>(a_scales(Cfg::kStages)) + stage;  // right after the last scales
  }
  __device__ uint64_t* empty(int stage) const { return full(Cfg::kStages) + stage; }
  __device__ uint32_t* exchange() const { return reinterpret_cast<uint32_t*>(empty(Cfg::kStages)); }
};

}  // namespace megamoe::grouped_gemm
