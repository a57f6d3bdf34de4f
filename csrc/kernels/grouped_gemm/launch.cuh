// Host side shared by the grouped GEMM entry points: the operand maps and the launch of a kernel
// put together from its policies (each policy builds its own parameters: to_params).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/device.h"
#include "common/status.h"
#include "kernels/grouped_gemm/kernel.cuh"
#include "kernels/grouped_gemm/problem.h"
#include "kernels/grouped_gemm/tensor_map.h"

namespace megamoe::grouped_gemm {

// BLOCK_N 256 halves the L2 traffic per FLOP against 128 (A is re-read once per n-tile) and issues
// the largest wgmma; 128 serves N that is not a multiple of 256.
constexpr bool wide_tiles(int32_t n) { return n % 256 == 0; }

// One CTA per SM (fewer if there are fewer tiles).
template <class Epi, class Sched>
int launch(const CUtensorMap& a, const CUtensorMap& b, const typename Epi::Params& epi,
           const typename Sched::Params& sched, void* stream, const typename Epi::Cfg::MainloopParams& mainloop = {}) {
  using Cfg = typename Epi::Cfg;
  auto kernel = grouped_gemm_kernel<Epi, Sched>;
  int sms = 0;
  MEGAMOE_RETURN_IF_ERROR(current_sm_count(&sms));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int64_t max_tiles = Sched::max_tiles(sched);
  const int grid = int(max_tiles < sms ? max_tiles : sms);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(a, b, mainloop, epi, sched);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

// A pool GEMM's operands: A = the pool [rows, K] (K-major), or the token rows its rows are gathered
// from (gathered_rows.cuh); B = the experts' matrices, K-major
// [E_local * rows_per_expert, K] or MN-major [E_local * K, N] (scheduler.cuh, BRows).
struct PoolOperands {
  const void* a;
  const char* a_name;
  const void* b;
  const char* b_name;
  BRows b_rows;
};

inline int64_t b_row_count(const PoolProblem& p, const PoolOperands& o) {
  return int64_t(p.num_local_experts) * o.b_rows.rows_per_expert;
}

// Everything a pool GEMM checks of its arguments, before any CUDA call (so a bad argument is
// reported as one, with or without a device): the operands, then the epilogue's can_implement.
template <class Epi>
int check_pool_gemm(const PoolProblem& p, const PoolOperands& o, const typename Epi::Arguments& args) {
  MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{o.a, o.a_name}, {o.b, o.b_name}}));
  MEGAMOE_RETURN_IF_ERROR(
      check_row_range(p.fn, b_row_count(p, o), (std::string("the rows of ") + o.b_name).c_str()));
  return Epi::can_implement(p, args);
}

// The operand maps of a checked problem (check_pool_gemm).
template <class Cfg>
int make_operand_maps(const PoolProblem& p, const PoolOperands& o, CUtensorMap* map_a, CUtensorMap* map_b) {
  const int64_t b_rows = b_row_count(p, o);
  if constexpr (Cfg::kFp8) {
    MEGAMOE_RETURN_IF_ERROR(make_fp8_tensor_map(map_a, o.a, p.rows, uint64_t(p.k), kBlockM, p.fn, o.a_name));
    return make_fp8_tensor_map(map_b, o.b, uint64_t(b_rows), uint64_t(p.k), Cfg::kBBoxRows, p.fn, o.b_name);
  } else {
    if constexpr (Cfg::kGathered == Gathered::kA) {  // A's rows are copied by the producer, not TMA: no map of A
      *map_a = CUtensorMap{};
    } else {
      MEGAMOE_RETURN_IF_ERROR(make_tensor_map(map_a, o.a, p.rows, uint64_t(p.k), kBlockM, p.fn, o.a_name));
    }
    if constexpr (Cfg::kBMajor == Major::K) {
      return make_tensor_map(map_b, o.b, uint64_t(b_rows), uint64_t(p.k), Cfg::kBBoxRows, p.fn, o.b_name);
    } else {  // 64 x 64 boxes (operand.cuh, MN-major)
      return make_tensor_map(map_b, o.b, uint64_t(b_rows), uint64_t(p.n), kBlockK, p.fn, o.b_name);
    }
  }
}

// A pool GEMM with epilogue policy Epi: the checks (check_pool_gemm), the epilogue's parameters,
// the operand maps and the pool scheduler's parameters, then the launch. A caller that builds
// main-loop parameters (FP8) runs check_pool_gemm before it does.
template <class Epi>
int run_pool_gemm(const PoolProblem& p, const PoolOperands& operands, const typename Epi::Arguments& args,
                  void* stream, const typename Epi::Cfg::MainloopParams& mainloop = {}) {
  using Cfg = typename Epi::Cfg;
  MEGAMOE_RETURN_IF_ERROR(check_pool_gemm<Epi>(p, operands, args));
  typename Epi::Params epi;
  MEGAMOE_RETURN_IF_ERROR(Epi::to_params(p, args, &epi));
  CUtensorMap map_a, map_b;
  MEGAMOE_RETURN_IF_ERROR(make_operand_maps<Cfg>(p, operands, &map_a, &map_b));
  const auto sched = PoolScheduler::to_params<Cfg>(p, Epi::kTileN, operands.b_rows);
  return launch<Epi, PoolScheduler>(map_a, map_b, epi, sched, stream, mainloop);
}

// The same with block-FP8 operands: the main loop also takes their scales (config_fp8.cuh).
template <class Epi>
int run_pool_gemm_fp8(const PoolProblem& p, const PoolOperands& operands, const typename Epi::Arguments& args,
                      const typename Epi::Cfg::MainloopArguments& scales, void* stream) {
  MEGAMOE_RETURN_IF_ERROR(check_pool_gemm<Epi>(p, operands, args));  // before the scales' map (CUDA)
  typename Epi::Cfg::MainloopParams mainloop;
  MEGAMOE_RETURN_IF_ERROR(Epi::Cfg::to_params(p, scales, operands.b_rows, &mainloop));
  return run_pool_gemm<Epi>(p, operands, args, stream, mainloop);
}

}  // namespace megamoe::grouped_gemm
