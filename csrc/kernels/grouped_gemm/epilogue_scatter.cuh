// GEMM2 epilogue: pool row r of the tile goes to out_rows[slot_to_route[r]] (its (token, k)
// combine slot). Rows are scattered, so whole-tile TMA stores do not apply.
//
// Each 64-column chunk is staged bf16 in the swizzled chunk buffer (the plain epilogue's stmatrix
// path; deferred like it, under the next tile's first wgmma batch), then read back 16 bytes per
// thread: 8 consecutive threads take the 8 16-byte pieces of one row (one 128-byte row segment,
// contiguous and 128-byte aligned in global memory) and a warp
// covers 4 rows, so every st.global.v4 of a warp writes 4 whole 128-byte lines; the shared reads
// of 8 threads cover one 128-byte row, all 32 banks (conflict-free whatever the swizzle).
// Each warp reads back only the 16 rows it staged, 4 per pass, 4 passes per chunk, so the warps of
// a warpgroup never wait for each other; each thread's 4 routes are loaded before the tile's main
// loop. Padding rows (route -1) and routes >= num_out_rows are skipped, and so are the 16-byte
// pieces past N (the last tile of an N that is not a multiple of 128).
//
// Buffer reuse: chunk c + 2 overwrites chunk c's buffer only after the warp's __syncwarp of chunk
// c + 1, which each of its threads reaches after its reads of chunk c; chunks per tile are even, so
// this holds across tiles. Generic-proxy writes and reads: __syncwarp orders them, no async-proxy fence.
#pragma once

#include <cuda_bf16.h>

#include "kernels/grouped_gemm/epilogue.cuh"

namespace megamoe::grouped_gemm {

struct ScatterArguments {
  void* out_rows;               // [num_out_rows, N] bf16
  const int32_t* row_of_slot;   // [pool rows]: out row of each pool row, -1: none; null: the plan's slot_to_route
  int64_t num_out_rows;
};

// BMajor: MN-major B for the backward's dx = dz · w13[e] (w13[e] read as [K = 2I, N = H]). C: the
// main loop's config, BF16 (config.cuh) or block FP8 (config_fp8.cuh, K-major B only).
template <int BlockN, Major BMajor = Major::K, class C = Config<BlockN, 1, Major::K, BMajor>>
struct ScatterEpilogue {
  using Cfg = C;
  static_assert(Cfg::kBMajor == BMajor && Cfg::kBlockN == BlockN, "the config's B layout and tile width");
  static constexpr int kChunks = BlockN / kEpiCols;
  static constexpr int kPieces = kEpiCols * 2 / 16;         // 16-byte pieces per chunk row: 8
  static constexpr int kRowsPerPass = 32 / kPieces;         // 4 per warp
  static constexpr int kPasses = kWarpRows / kRowsPerPass;  // 4
  static_assert(kChunks % kEpiBuffers == 0, "chunk buffers must line up with tiles");
  static constexpr int kTileN = BlockN;
  using Arguments = ScatterArguments;
  struct Params {
    __nv_bfloat16* out;            // [num_out_rows, ld]
    const int32_t* slot_to_route;  // [max_blocks * 128]
    int64_t num_out_rows;
    int ld;                        // N
  };
  struct Rows {
    int32_t route[kPasses];  // output row of each pass's row, or -1: not written
  };

  static const int32_t* row_of_slot(const PoolProblem& p, const Arguments& args) {
    return args.row_of_slot != nullptr ? args.row_of_slot : p.plan->slot_to_route;
  }

  // TMA serves the operands; the epilogue's 16-byte row stores need an aligned out_rows.
  static int can_implement(const PoolProblem& p, const Arguments& args) {
    if (row_of_slot(p, args) == nullptr) {
      return invalid_argument(p.fn + "row_of_slot must be non-null when the plan has no slot_to_route");
    }
    if (args.num_out_rows < 0) {
      return invalid_argument(p.fn + "num_out_rows must be >= 0, got " + std::to_string(args.num_out_rows));
    }
    return check_pointers(p.fn, {{args.out_rows, "out_rows"}});
  }
  static int to_params(const PoolProblem& p, const Arguments& args, Params* params) {
    *params = Params{static_cast<__nv_bfloat16*>(args.out_rows), row_of_slot(p, args), args.num_out_rows, p.n};
    return MEGAMOE_OK;
  }

  // This thread's row of pass 0 within the warpgroup's 64: its warp's 16 rows, 4 per pass.
  __device__ static int first_row() {
    return (int(threadIdx.x) / 32) % 4 * kWarpRows + int(threadIdx.x) % 32 / kPieces;
  }

  __device__ static void prefetch(const Params&) {}
  __device__ static Rows prepare(const Params& p, const PoolTile& t, int warpgroup) {
    const int row0 = t.block * kBlockM + warpgroup * kWarpgroupRows + first_row();
    Rows r;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int32_t route = __ldg(p.slot_to_route + row0 + pass * kRowsPerPass);
      r.route[pass] = (route >= 0 && route < p.num_out_rows) ? route : -1;
    }
    return r;
  }
  // Deferred (kernel.cuh): the tile's bf16 values and rows wait in registers, and are stored while
  // the next tile's first wgmma batch runs.
  static constexpr bool kDeferred = true;
  struct Pending {
    uint32_t packed[Cfg::kAccumulators / 2];
    Rows rows;
    int col0;
  };

  __device__ static Pending retire(const float (&acc)[Cfg::kAccumulators], const Params&, const SharedStorage<Cfg>&,
                                   int, const PoolTile& tile, const Rows& rows) {
    Pending pending;
    pack_fragment(acc, pending.packed);
    pending.rows = rows;
    pending.col0 = tile.n_tile * BlockN;
    return pending;
  }

  __device__ static void store(const Pending& pending, const Params& p, const SharedStorage<Cfg>& smem,
                               int warpgroup) {
    const int piece = int(threadIdx.x) % kPieces;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      uint8_t* chunk = smem.epi(warpgroup, c % kEpiBuffers);
      stage_packed_chunk(pending.packed, c, chunk);
      __syncwarp();
      const int col = pending.col0 + c * kEpiCols + piece * 8;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int row = first_row() + pass * kRowsPerPass;
        // Only a 128-wide tile can reach past N (256-wide tiles serve N that are multiples of 256).
        if (pending.rows.route[pass] >= 0 && (BlockN == 256 || col < p.ld)) {
          const uint4 v = load_shared_16(chunk + row * kSwizzleBytes + ((piece ^ (row % 8)) * 16));
          *reinterpret_cast<uint4*>(p.out + int64_t(pending.rows.route[pass]) * p.ld + col) = v;
        }
      }
    }
  }
  __device__ static void drain() {}
};

}  // namespace megamoe::grouped_gemm
