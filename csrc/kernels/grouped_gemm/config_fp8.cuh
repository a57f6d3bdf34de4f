// Tile shape and pipeline depth of the block-FP8 grouped GEMM (DeepSeek-V3 recipe: e4m3 operands,
// one fp32 scale per row and 128 K values of A, one per 128 x 128 block of B).
//
// A stage holds a 128-deep k-block: 128 e4m3 = 128 bytes, the same swizzle-row geometry as a
// 64-deep bf16 k-block (operand.cuh's K-major layout serves both; a 32-deep fp8 k step moves 32
// bytes like a 16-deep bf16 one), plus the 128 A scales of the tile's rows for that k-block. FP8
// wgmma reads both operands K-major only.
//
// The scales change every k-block, so each k-block's wgmmas accumulate into a fresh fp32 fragment
// that is then scaled and added to the tile's sum (mainloop_fp8.cuh). At BLOCK_N 128 two such
// fragments alternate (64 + 64 + 64 registers with the sum); at BLOCK_N 256 the sum alone takes
// 128, so one 64-register fragment serves the tile's two 128-column halves in turn.
#pragma once

#include <cuda.h>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/problem.h"
#include "kernels/grouped_gemm/scheduler.cuh"
#include "kernels/grouped_gemm/tensor_map.h"

namespace megamoe::grouped_gemm {

constexpr int kFp8BlockK = 128;  // K elements (bytes) per k-block, and the scale block along K

// The caller's scales of the FP8 operands (the main loop's arguments).
struct Fp8Scales {
  const float* a_scales;  // fp32 [K / 128, pool rows]
  const float* b_scales;  // fp32 [E_local, B rows per expert / 128, K / 128]
};

// BBoxes as in Config (config.cuh): 2 = the tile's two 128-row halves of B come from different
// places of B (the gated GEMM1: gate rows, then the matching up rows), each its own scale block.
template <int BlockN, int BBoxes = 1>
struct Fp8Config : StageLayout<(kBlockM + BlockN) * kFp8BlockK + kBlockM * 4, BlockN> {
  static_assert(BlockN == 128 || BlockN == 256, "BLOCK_N must be 128 or 256");
  static_assert(BBoxes == 1 || BlockN == 256, "split B tiles are 256 wide: one 128-row half per box");
  static constexpr Major kAMajor = Major::K;
  static constexpr Major kBMajor = Major::K;
  static constexpr bool kFp8 = true;
  static constexpr int kKBlock = kFp8BlockK;
  static constexpr int kBlockN = BlockN;
  static constexpr int kBBoxes = BBoxes;
  static constexpr int kBBoxRows = BlockN / BBoxes;
  static constexpr int kABytes = kBlockM * kFp8BlockK;
  static constexpr int kBBytes = BlockN * kFp8BlockK;
  static constexpr int kScaleBytes = kBlockM * 4;
  struct MainloopParams {
    CUtensorMap a_scales;    // fp32 [K / 128, pool rows]: a k-block's scales of 128 rows are one box
    const float* b_scales;   // fp32 [E_local, B rows per expert / 128, K / 128]
    int n_blocks;            // B rows per expert / 128
    int half_blocks;         // split B tiles (BBoxes 2): 128-row blocks between a tile's two halves
  };
  using MainloopArguments = Fp8Scales;

  // b_rows: where each expert's B is (scheduler.cuh), which places its scale blocks too.
  static int to_params(const PoolProblem& p, const MainloopArguments& args, BRows b_rows, MainloopParams* params) {
    MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{args.a_scales, "a_scales"}}));
    if (args.b_scales == nullptr) return invalid_argument(p.fn + "b_scales must be non-null");
    *params = MainloopParams{};
    params->b_scales = args.b_scales;
    params->n_blocks = b_rows.rows_per_expert / 128;
    params->half_blocks = b_rows.box_stride / 128;
    return encode_tensor_map(&params->a_scales, args.a_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4,
                             uint64_t(p.k / kFp8BlockK), p.rows, kBlockM, 1, CU_TENSOR_MAP_SWIZZLE_NONE, p.fn,
                             "a_scales");
  }
};

}  // namespace megamoe::grouped_gemm
