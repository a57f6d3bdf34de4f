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

// A tensor of `rank` dimensions, innermost first: dims, byte strides of dimensions 1.. (each a
// multiple of 16, increasing), box extents. Every dimension clips: TMA loads fill what lies outside
// with zeros and stores leave it alone, so a tile may reach past the end of a dimension.
// `fn` ("megamoe_...: ", the API function) prefixes error messages.
inline int encode_tensor_map(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, uint32_t rank,
                             const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                             CUtensorMapSwizzle swizzle, const std::string& fn, const char* what) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) {
    cudaGetLastError();  // the failed lookup is reported here, not left for the caller's next check
    return set_error(MEGAMOE_ERROR_CUDA, fn + "cuTensorMapEncodeTiled not available (driver too old for TMA?)");
  }
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, type, rank, const_cast<void*>(ptr), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return set_error(MEGAMOE_ERROR_CUDA, fn + "cuTensorMapEncodeTiled(" + what + ") failed with CUresult " +
                                             std::to_string(int(r)));
  }
  return MEGAMOE_OK;
}

// 2-D row-major [rows, cols] matrix of element_bytes-sized elements, boxes of box_rows x box_cols.
inline int encode_tensor_map(CUtensorMap* map, const void* ptr, CUtensorMapDataType type, uint32_t element_bytes,
                             uint64_t rows, uint64_t cols, uint32_t box_cols, uint32_t box_rows,
                             CUtensorMapSwizzle swizzle, const std::string& fn, const char* what) {
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * element_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  return encode_tensor_map(map, ptr, type, 2, dims, strides, box, swizzle, fn, what);
}

// bf16 [rows, cols], boxes of box_rows x 64 columns (one 128-byte swizzle row).
inline int make_tensor_map(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols, uint32_t box_rows,
                           const std::string& fn, const char* what) {
  return encode_tensor_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, cols, kBlockK, box_rows,
                           CU_TENSOR_MAP_SWIZZLE_128B, fn, what);
}

// bf16 [planes, rows, cols] with ld elements between rows (e.g. a weight gradient [E, M, N], or N
// columns of a wider one) as planes that clip on their own: boxes of box_rows x 64 columns of one
// plane, coordinates (column, row, plane).
inline int make_planes_tensor_map(CUtensorMap* map, const void* ptr, uint64_t planes, uint64_t rows, uint64_t cols,
                                  uint64_t ld, uint32_t box_rows, const std::string& fn, const char* what) {
  const cuuint64_t dims[3] = {cols, rows, planes};
  const cuuint64_t strides[2] = {2 * ld, 2 * ld * rows};
  const cuuint32_t box[3] = {kBlockK, box_rows, 1};
  return encode_tensor_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, fn, what);
}

// A gated tensor [rows, 2I] bf16 (z, dz: the gate half, then the up half of each row) as [rows, 2, I],
// so a tile past column I of one half stops there instead of reaching into the other: boxes of
// box_rows x 64 columns of one half, coordinates (column, half, row).
inline int make_halves_tensor_map(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t intermediate,
                                  uint32_t box_rows, const std::string& fn, const char* what) {
  const cuuint64_t dims[3] = {intermediate, 2, rows};
  const cuuint64_t strides[2] = {2 * intermediate, 4 * intermediate};
  const cuuint32_t box[3] = {kBlockK, 1, box_rows};
  return encode_tensor_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, fn, what);
}

// e4m3 [rows, cols], boxes of box_rows x 128 columns (one 128-byte swizzle row).
inline int make_fp8_tensor_map(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols, uint32_t box_rows,
                               const std::string& fn, const char* what) {
  return encode_tensor_map(map, ptr, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, cols, kSwizzleBytes, box_rows,
                           CU_TENSOR_MAP_SWIZZLE_128B, fn, what);
}

}  // namespace megamoe::grouped_gemm
