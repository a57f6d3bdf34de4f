// Host side shared by the grouped GEMM entry points: TMA descriptors, argument checks, launch.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "common/status.h"
#include "kernels/grouped_gemm/kernel.cuh"

namespace megamoe::grouped_gemm {

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link-time libcuda dependency.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
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

// 2-D row-major [rows, cols] matrix of element_bytes-sized elements, boxes of box_rows x box_cols.
// `fn` ("megamoe_...: ", the API function) prefixes error messages.
inline int encode_tensor_map(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, uint32_t element_bytes,
                             uint64_t rows, uint64_t cols, uint32_t box_cols, uint32_t box_rows,
                             CUtensorMapSwizzle swizzle, const std::string& fn, const char* what) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) {
    cudaGetLastError();  // the failed lookup is reported here, not left for the caller's next check
    return set_error(MEGAMOE_ERROR_CUDA, fn + "cuTensorMapEncodeTiled not available (driver too old for TMA?)");
  }
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * element_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(ptr), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return set_error(MEGAMOE_ERROR_CUDA, fn + "cuTensorMapEncodeTiled(" + what + ") failed with CUresult " +
                                             std::to_string(int(r)));
  }
  return MEGAMOE_OK;
}

// bf16 [rows, cols], boxes of box_rows x 64 columns (one 128-byte swizzle row).
inline int make_tensor_map(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols, uint32_t box_rows,
                           const std::string& fn, const char* what) {
  return encode_tensor_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, cols, kBlockK, box_rows,
                           CU_TENSOR_MAP_SWIZZLE_128B, fn, what);
}

// BLOCK_N 256 halves the L2 traffic per FLOP against 128 (A is re-read once per n-tile) and issues
// the largest wgmma; 128 serves N that is not a multiple of 256. MEGAMOE_GROUPED_GEMM_BLOCK_N=128
// forces the narrow tile, for timing comparisons.
inline int choose_block_n(int32_t n) {
  static const int forced = [] {
    const char* env = std::getenv("MEGAMOE_GROUPED_GEMM_BLOCK_N");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  if (forced == 128) return 128;
  return n % 256 == 0 ? 256 : 128;
}

// Checks shared by every entry point: the plan pointers, the pool size, the expert count and the
// GEMM's own N (columns of the B matrix per tile row range) and K. `fn` prefixes the message;
// n_name / k_name are the caller's names for N and K.
inline int validate_pool_gemm(const std::string& fn, const int32_t* block_expert, const int32_t* num_blocks,
                              int64_t max_blocks, int32_t n, const char* n_name, int32_t k, const char* k_name,
                              int32_t num_local_experts) {
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  if (block_expert == nullptr || num_blocks == nullptr) {
    return invalid_argument(fn + "block_expert and num_blocks must be non-null (device pointers from the routing plan)");
  }
  if (n <= 0 || n % 128 != 0) {
    return invalid_argument(fn + n_name + " must be a positive multiple of 128, got " + std::to_string(n));
  }
  if (k <= 0 || k % 128 != 0) {
    return invalid_argument(fn + k_name + " must be a positive multiple of 128, got " + std::to_string(k));
  }
  if (num_local_experts < 1) {
    return invalid_argument(fn + "num_local_experts must be >= 1, got " + std::to_string(num_local_experts));
  }
  if (max_blocks < 0) return invalid_argument(fn + "max_blocks must be >= 0, got " + std::to_string(max_blocks));
  // TMA coordinates and the tile counter are 32-bit.
  if (max_blocks * kBlockM > kIntMax || max_blocks * (n / 128) > kIntMax) {
    return invalid_argument(fn + "max_blocks = " + std::to_string(max_blocks) + " exceeds the 32-bit row range");
  }
  return MEGAMOE_OK;
}

// One CTA per SM (fewer if there are fewer tiles); max_tiles bounds the scheduler's tile count.
template <class Epi, class Sched>
int launch(const CUtensorMap& a, const CUtensorMap& b, const typename Epi::Params& epi,
           const typename Sched::Params& sched, int64_t max_tiles, void* stream,
           const typename Epi::Cfg::MainloopParams& mainloop = {}) {
  using Cfg = typename Epi::Cfg;
  auto kernel = grouped_gemm_kernel<Epi, Sched>;
  int device = 0, sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int grid = int(max_tiles < sms ? max_tiles : sms);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(a, b, mainloop, epi, sched);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

// The pool GEMMs: tiles = live blocks x n_tiles, K fixed.
template <class Epi>
int launch_pool(const CUtensorMap& a, const CUtensorMap& b, const typename Epi::Params& epi,
                const int32_t* block_expert, const int32_t* num_blocks, int64_t max_blocks, int n_tiles, BRows b_rows,
                int32_t k, void* stream, const typename Epi::Cfg::MainloopParams& mainloop = {}) {
  const PoolScheduler::Params sched{block_expert, num_blocks, int(max_blocks), n_tiles, k / Epi::Cfg::kKBlock, b_rows};
  return launch<Epi, PoolScheduler>(a, b, epi, sched, max_blocks * n_tiles, stream, mainloop);
}

}  // namespace megamoe::grouped_gemm
