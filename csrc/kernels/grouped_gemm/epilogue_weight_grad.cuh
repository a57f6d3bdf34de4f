// Weight-gradient epilogue (K-grouped GEMM, scheduler_expert.cuh): the 128 x BLOCK_N tile (m-tile,
// n-tile) of out[e] = A[rows of e]ᵀ · B[rows of e], out [E_local, M, N] row-major with ld elements
// between rows (N, or more for N columns of a wider gradient).
//   bf16: one rounding, swizzled chunk + TMA store (epilogue.cuh), through a map of out as E planes
//         of [M, N] (so a tile past M or N stops at the expert's edge), deferred to the next tile's
//         first wgmma batch.
//   fp32: each thread stores its fragment pairs straight from registers as float2 (4 lanes cover 32
//         contiguous bytes of a row: whole sectors), those past M or N left out; with accumulate,
//         out += tile (read, add, write: every element is owned by exactly one thread of one tile, so
//         no atomics, deterministic).
// A tile without k-blocks (an expert without rows) skips the main loop; the kernel retires or stores
// it from a zero fragment, so it writes zeros (fp32 accumulating: adds nothing).
#pragma once

#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/scheduler_expert.cuh"

namespace megamoe::grouped_gemm {

// C: the main loop's config, BF16 on token-major operands or block FP8 on transposed ones
// (config_fp8.cuh); the accumulator fragment is the same.
template <int BlockN, bool Fp32, class C = Config<BlockN, 1, Major::MN, Major::MN>>
struct WeightGradEpilogue {
  using Cfg = C;
  static_assert(Cfg::kBlockN == BlockN, "the config's tile width");
  struct Params {
    CUtensorMap c;  // bf16: out as E planes [M, N], 16-row x 64-column boxes (unused for fp32)
    float* out;     // fp32: [E, M, ld]
    int m, n;
    int64_t ld;
    int accumulate;  // fp32 only: out += tile
  };
  struct Arguments {
    void* out;       // [E_local, m, ld], bf16 or fp32
    int64_t ld;      // >= n
    int accumulate;  // fp32 only: out += the gradient
  };
  struct Rows {};

  // fn prefixes the messages; out [E_local, m, ld].
  static int can_implement(const std::string& fn, const Arguments& args) {
    if (args.accumulate && !Fp32) {
      return invalid_argument(fn + "accumulation into a bf16 gradient is not supported (use MEGAMOE_GRAD_FP32_ADD)");
    }
    return check_pointers(fn, {{args.out, "out"}});
  }
  static int to_params(const std::string& fn, const megamoe_routing_plan& plan, int m, int n, const Arguments& args,
                       Params* params) {
    *params = Params{};
    if constexpr (!Fp32) {
      MEGAMOE_RETURN_IF_ERROR(make_planes_tensor_map(&params->c, args.out, uint64_t(plan.shape.num_local_experts),
                                                     uint64_t(m), uint64_t(n), uint64_t(args.ld), kWarpRows, fn,
                                                     "out"));
    }
    params->out = static_cast<float*>(args.out);
    params->m = m;
    params->n = n;
    params->ld = args.ld;
    params->accumulate = args.accumulate;
    return MEGAMOE_OK;
  }

  __device__ static void prefetch(const Params& p) {
    if constexpr (!Fp32) cute::prefetch_tma_descriptor(&p.c);
  }
  __device__ static Rows prepare(const Params&, const ExpertTile&, int) { return {}; }

  // bf16 is deferred (kernel.cuh): the packed tile is stored under the next tile's first wgmma batch
  // (in FP8 beside the main loop's fragment, before the sum is live). fp32 stores its 128 values per
  // thread right away: they do not fit beside the next accumulators.
  static constexpr bool kDeferred = !Fp32;
  struct Pending {
    uint32_t packed[Cfg::kAccumulators / 2];
    int expert, row0, col0;  // row0: of the expert's M
  };

  __device__ static Pending retire(const float (&acc)[Cfg::kAccumulators], const Params& p, const SharedStorage<Cfg>&,
                                   int warpgroup, const ExpertTile& t, Rows) {
    Pending pending;
    pack_fragment(acc, pending.packed);
    pending.expert = t.expert;
    pending.row0 = t.m_tile * kBlockM + warpgroup * kWarpgroupRows;
    pending.col0 = t.n_tile * BlockN;
    return pending;
  }
  __device__ static void store(const Pending& pending, const Params& p, const SharedStorage<Cfg>& smem,
                               int warpgroup) {
    tma_store_chunks<BlockN / kEpiCols>(pending.packed, &p.c, smem, warpgroup, pending.row0, pending.col0,
                                        InPlane{pending.expert});
  }

  __device__ static void store(const float (&acc)[Cfg::kAccumulators], const Params& p, const SharedStorage<Cfg>&,
                               int warpgroup, const ExpertTile& t, Rows) {
    static_assert(Fp32, "a bf16 tile is deferred: stored from its Pending");
    const int col0 = t.n_tile * BlockN + 2 * (threadIdx.x % 4);  // this thread's first column
    const int row = t.m_tile * kBlockM + fragment_row(warpgroup);  // of the expert's M; the other is row + 8
    const bool in_m[2] = {row < p.m, row + 8 < p.m};
    float* base = p.out + (int64_t(t.expert) * p.m + row) * p.ld + col0;
    // Batches of 8 column groups: the batch's 16 old values are loaded before any store, so the
    // read-add-write costs one memory round trip per batch, not one per element.
    constexpr int kBatch = 8;
#pragma unroll
    for (int j0 = 0; j0 < BlockN / 8; j0 += kBatch) {
      float2 old[kBatch][2];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool inside = in_m[h] && col0 + 8 * (j0 + j) < p.n;
          old[j][h] = p.accumulate && inside
                          ? *reinterpret_cast<const float2*>(base + 8 * h * p.ld + 8 * (j0 + j))
                          : make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int x = 4 * (j0 + j) + 2 * h;
          float2 v = make_float2(acc[x], acc[x + 1]);
          v.x += old[j][h].x;
          v.y += old[j][h].y;
          if (in_m[h] && col0 + 8 * (j0 + j) < p.n) {
            *reinterpret_cast<float2*>(base + 8 * h * p.ld + 8 * (j0 + j)) = v;
          }
        }
      }
    }
  }
  __device__ static void drain() {
    if constexpr (!Fp32) drain_stores();
  }
};

}  // namespace megamoe::grouped_gemm
