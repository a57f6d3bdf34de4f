// TMA descriptors (host side): every operand and output map of the grouped GEMMs is made here.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/grouped_gemm/config.cuh"

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

// e4m3 [rows, cols], boxes of box_rows x 128 columns (one 128-byte swizzle row).
inline int make_fp8_tensor_map(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols, uint32_t box_rows,
                               const std::string& fn, const char* what) {
  return encode_tensor_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, cols, kSwizzleBytes, box_rows,
                           CU_TENSOR_MAP_SWIZZLE_128B, fn, what);
}

}  // namespace megamoe::grouped_gemm
