// One stage's operand tile in shared memory: how TMA fills it and how a wgmma descriptor reads it.
// A tile spans Rows indices of M (A) or N (B) and 64 of K; both layouts use the 128-byte swizzle
// (16-byte chunks of each 128-byte row permuted by row % 8, applied to absolute address bits, so
// every tile and box is 1024-aligned and descriptors keep base_offset 0).
//
// K-major (K contiguous in global memory, e.g. nn.Linear weights, pool activations as A):
//   row r (an M/N index) holds its 64 k values at r * 128 bytes. TMA boxes {64 k, box rows},
//   coordinates (k, row). Descriptor: B128, SBO = 1024 bytes (next 8 rows), LBO unused; a 16-deep
//   k step moves the start address 32 bytes along the rows.
//
// MN-major (M/N contiguous: w2[e] as [K = H, N = I], w13[e] as [K = 2I, N = H], token-major
//   activations as both operands of a weight gradient): Rows / 64 boxes of {64 mn (inner), 64 k},
//   box j (mn 64 j ..) at j * 8 KB; inside a box, k row k holds 64 mn values at k * 128 bytes.
//   That is CuTe's Layout_MN_SW128_Atom (64 mn x 8 k, 1 KB) tiled over k first, then mn:
//   tile_to_shape(Layout_MN_SW128_Atom<bf16>, (Rows, 64), Step<_2, _1>), canonical
//   ((8, 8, m), (8, k)) : ((1, 8, LBO), (8, SBO)) in 16-byte units (8 bf16 each), with
//   LBO = 8 KB (next 64 mn: the next box) and SBO = 1 KB (next 8 k rows); make_gmma_desc<MN> on that
//   layout gives exactly these (checked on the host). A 16-deep k step = 16 rows = 2 KB (a multiple
//   of 1 KB: the swizzle phase is unchanged). The wgmma instruction reads it with its transpose bit
//   (GMMA::Major::MN).
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdint>

#include "kernels/grouped_gemm/config.cuh"

namespace megamoe::grouped_gemm {

namespace gmma = cute::SM90::GMMA;

constexpr int kMnBoxCols = kSwizzleBytes / 2;                // 64 bf16 of M/N per MN-major box
constexpr int kMnBoxBytes = kMnBoxCols * kBlockK * 2;         // 8 KB
constexpr uint64_t kTmaCacheHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

__device__ inline uint64_t make_descriptor(const void* tile, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = uint16_t(cute::cast_smem_ptr_to_uint(tile) >> 4);
  desc.bitfield.leading_byte_offset_ = uint16_t(lbo_bytes >> 4);
  desc.bitfield.stride_byte_offset_ = uint16_t(sbo_bytes >> 4);
  desc.bitfield.base_offset_ = 0;  // tiles start on a 1024-byte boundary
  desc.bitfield.layout_type_ = uint8_t(gmma::LayoutType::B128);
  return desc.desc_;
}

template <Major M>
struct OperandLayout;

template <>
struct OperandLayout<Major::K> {
  static constexpr gmma::Major kGmma = gmma::Major::K;
  static constexpr uint32_t kKStepBytes = 32;  // 16 bf16 along a 128-byte row
  // Byte offset of M/N index `mn` (a multiple of 8) inside the tile.
  static constexpr uint32_t mn_offset(int mn) { return uint32_t(mn) * kSwizzleBytes; }
  __device__ static uint64_t descriptor(const void* tile) {
    return make_descriptor(tile, 16 /* unused: encodes 1 */, 8 * kSwizzleBytes);
  }
  // Boxes stacked in the tile: box i holds Rows / Boxes rows from row mn + i * box_stride.
  template <int Rows, int Boxes>
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* tile, int mn, int k, int box_stride) {
#pragma unroll
    for (int box = 0; box < Boxes; ++box) {
      cute::SM90_TMA_LOAD_2D::copy(map, full, kTmaCacheHint, tile + box * (Rows / Boxes) * kSwizzleBytes, k,
                                   mn + box * box_stride);
    }
  }
};

template <>
struct OperandLayout<Major::MN> {
  static constexpr gmma::Major kGmma = gmma::Major::MN;
  static constexpr uint32_t kKStepBytes = 16 * kSwizzleBytes;  // 16 k rows
  // Byte offset of M/N index `mn` (a multiple of 64) inside the tile.
  static constexpr uint32_t mn_offset(int mn) { return uint32_t(mn / kMnBoxCols) * kMnBoxBytes; }
  __device__ static uint64_t descriptor(const void* tile) {
    return make_descriptor(tile, kMnBoxBytes, 8 * kSwizzleBytes);
  }
  template <int Rows, int Boxes>
  __device__ static void load(const CUtensorMap* map, uint64_t* full, uint8_t* tile, int mn, int k, int) {
    static_assert(Boxes == 1 && Rows % kMnBoxCols == 0, "an MN-major tile is Rows / 64 consecutive boxes");
#pragma unroll
    for (int j = 0; j < Rows / kMnBoxCols; ++j) {
      cute::SM90_TMA_LOAD_2D::copy(map, full, kTmaCacheHint, tile + j * kMnBoxBytes, mn + j * kMnBoxCols, k);
    }
  }
};

}  // namespace megamoe::grouped_gemm
