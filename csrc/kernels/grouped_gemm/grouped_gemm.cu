// Persistent, warp-specialised BF16 grouped GEMM over a routing plan's expert-major pool (sm_90a).
//
// One CTA per SM, 384 threads:
//   warpgroup 0  producer: one thread issues the TMA loads of every tile's A and B k-blocks into a
//                multi-stage ring; the warpgroup gives most of its registers back (setmaxnreg).
//   warpgroups 1-2  math: each owns 64 rows of the 128 x BLOCK_N tile, issues wgmma from shared
//                memory, then converts and stores its rows (epilogue.cuh) while the producer is
//                already filling the ring with the next tile.
// See config.cuh (tile shape and shared memory), pipeline.cuh (barriers), scheduler.cuh (tile
// order), mainloop.cuh (TMA + wgmma), epilogue.cuh (stores).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include <cutlass/arch/reg_reconfig.h>

#include "common/status.h"
#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/mainloop.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

// Without the sm_90a feature set the CuTe wrappers compile to traps and setmaxnreg to nothing;
// fail the build instead of shipping a kernel that cannot run.
#if defined(__CUDA_ARCH__) && \
    !(defined(CUTE_ARCH_MMA_SM90A_ENABLED) && defined(CUTE_ARCH_TMA_SM90_ENABLED) && \
      defined(CUTE_ARCH_STSM_SM90_ENABLED) && defined(CUDA_CTA_RECONFIG_ACTIVATED))
#error "megamoe grouped GEMM needs sm_90a (wgmma, TMA, stmatrix, setmaxnreg)"
#endif

namespace megamoe::grouped_gemm {
namespace {

template <int BlockN>
__global__ void __launch_bounds__(kThreads, 1)
grouped_gemm_bf16_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                         const __grid_constant__ CUtensorMap tma_c, const int32_t* __restrict__ block_expert,
                         const int32_t* __restrict__ num_blocks, int max_blocks, int n, int k) {
  using Cfg = Config<BlockN>;
  extern __shared__ uint8_t smem_raw[];
  const SharedStorage<Cfg> smem(smem_raw);
  const int warpgroup = int(threadIdx.x / 128);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(&tma_a);
    cute::prefetch_tma_descriptor(&tma_b);
    cute::prefetch_tma_descriptor(&tma_c);
    init_pipeline_barriers<SharedStorage<Cfg>, Cfg::kStages>(smem, kMathWarps);
  }
  __syncthreads();

  const TileScheduler sched(num_blocks, max_blocks, n / BlockN);
  const int k_blocks = k / kBlockK;

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x == 0) produce_operands<Cfg>(&tma_a, &tma_b, smem, sched, block_expert, n, k_blocks);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
  const int math_wg = warpgroup - 1;
  PipelineState<Cfg::kStages> state;
  float acc[Cfg::kAccumulators];
  for (TileScheduler tiles = sched; tiles.valid(); tiles.advance()) {
    mma_tile<Cfg>(acc, smem, state, k_blocks, math_wg);
    store_tile<Cfg>(acc, &tma_c, smem, math_wg, tiles.block() * kBlockM + math_wg * kWarpgroupRows,
                    tiles.n_tile() * BlockN);
  }
  drain_stores();
}

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link-time libcuda dependency.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// 2-D bf16 row-major [rows, cols] matrix, boxes of box_rows x 64 columns, 128-byte swizzle.
int make_tensor_map(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols, uint32_t box_rows,
                    const char* what) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) {
    cudaGetLastError();  // the failed lookup is reported here, not left for the caller's next check
    return set_error(MEGAMOE_ERROR_CUDA, "megamoe_grouped_gemm_bf16: cuTensorMapEncodeTiled not available "
                                         "(driver too old for TMA?)");
  }
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};
  const cuuint32_t box[2] = {uint32_t(kBlockK), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return set_error(MEGAMOE_ERROR_CUDA, std::string("megamoe_grouped_gemm_bf16: cuTensorMapEncodeTiled(") +
                                             what + ") failed with CUresult " + std::to_string(int(r)));
  }
  return MEGAMOE_OK;
}

// BLOCK_N 256 halves the L2 traffic per FLOP against 128 (A is re-read once per n-tile) and issues
// the largest wgmma; 128 serves N that is not a multiple of 256. MEGAMOE_GROUPED_GEMM_BLOCK_N=128
// forces the narrow tile, for timing comparisons.
int choose_block_n(int32_t n) {
  static const int forced = [] {
    const char* env = std::getenv("MEGAMOE_GROUPED_GEMM_BLOCK_N");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  if (forced == 128) return 128;
  return n % 256 == 0 ? 256 : 128;
}

template <int BlockN>
int launch(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& c, const int32_t* block_expert,
           const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k, cudaStream_t stream) {
  using Cfg = Config<BlockN>;
  auto kernel = grouped_gemm_bf16_kernel<BlockN>;
  int device = 0, sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int64_t max_tiles = max_blocks * (n / BlockN);
  const int grid = int(max_tiles < sms ? max_tiles : sms);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(a, b, c, block_expert, num_blocks, int(max_blocks), n, k);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int validate(const void* a, const void* b, const void* c, const int32_t* block_expert, const int32_t* num_blocks,
             int64_t max_blocks, int32_t n, int32_t k, int32_t num_local_experts) {
  const std::string fn = "megamoe_grouped_gemm_bf16: ";
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  if (a == nullptr || b == nullptr || c == nullptr) return invalid_argument(fn + "a, b and c must be non-null");
  if (block_expert == nullptr || num_blocks == nullptr) {
    return invalid_argument(fn + "block_expert and num_blocks must be non-null (device pointers from the routing plan)");
  }
  if (n <= 0 || n % 128 != 0) {
    return invalid_argument(fn + "n must be a positive multiple of 128, got " + std::to_string(n));
  }
  if (k <= 0 || k % 128 != 0) {
    return invalid_argument(fn + "k must be a positive multiple of 128, got " + std::to_string(k));
  }
  if (num_local_experts < 1) {
    return invalid_argument(fn + "num_local_experts must be >= 1, got " + std::to_string(num_local_experts));
  }
  if (max_blocks < 0) return invalid_argument(fn + "max_blocks must be >= 0, got " + std::to_string(max_blocks));
  if (!aligned16(a) || !aligned16(b) || !aligned16(c)) {
    return invalid_argument(fn + "a, b and c must be 16-byte aligned (TMA)");
  }
  // TMA coordinates and the tile counter are 32-bit.
  if (max_blocks * kBlockM > kIntMax || max_blocks * (n / 128) > kIntMax) {
    return invalid_argument(fn + "max_blocks = " + std::to_string(max_blocks) + " exceeds the 32-bit row range");
  }
  if (int64_t(num_local_experts) * n > kIntMax) {
    return invalid_argument(fn + "num_local_experts * n exceeds the 32-bit row range of B");
  }
  return MEGAMOE_OK;
}

}  // namespace
}  // namespace megamoe::grouped_gemm

using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_bf16(const void* a, const void* b, void* c, const int32_t* block_expert,
                                         const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
                                         int32_t num_local_experts, void* stream) {
  if (int s = validate(a, b, c, block_expert, num_blocks, max_blocks, n, k, num_local_experts); s != MEGAMOE_OK) {
    return s;
  }
  if (max_blocks == 0) return MEGAMOE_OK;  // an empty pool: nothing to compute or store
  const int block_n = choose_block_n(n);
  const uint64_t rows = uint64_t(max_blocks) * kBlockM;
  CUtensorMap map_a, map_b, map_c;
  if (int s = make_tensor_map(&map_a, a, rows, uint64_t(k), kBlockM, "A"); s != MEGAMOE_OK) return s;
  if (int s = make_tensor_map(&map_b, b, uint64_t(num_local_experts) * n, uint64_t(k), uint32_t(block_n), "B");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&map_c, c, rows, uint64_t(n), kWarpgroupRows, "C"); s != MEGAMOE_OK) return s;
  auto st = static_cast<cudaStream_t>(stream);
  return block_n == 256 ? launch<256>(map_a, map_b, map_c, block_expert, num_blocks, max_blocks, n, k, st)
                        : launch<128>(map_a, map_b, map_c, block_expert, num_blocks, max_blocks, n, k, st);
}
