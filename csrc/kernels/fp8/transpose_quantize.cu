// The block-FP8 weight gradients' operands (grouped_weight_grad.cu) that dh's epilogue does not make
// itself: a pool [rows, cols] bf16 transposed and quantised along its rows, the weight gradient's K,
// with the rounding of e4m3.cuh; or, from token rows [T, cols] (x), the pool the plan's dispatch would
// make of them (row r = token slot_to_route[r] / K, zeros for a padding row), without making it. The
// source may itself be e4m3 rows with 1 x 128 scales (dy as dispatched for dh): each value is
// dequantised to bf16 (e4m3.cuh) as it is staged, so the pass reads half the bytes of a bf16 copy.
//   MEGAMOE_FP8_ALONG_ROWS: one scale per column and 128 rows (1 x 128 blocks along the tokens),
//                           scales [rows / 128, cols]
//   MEGAMOE_FP8_IN_BLOCKS:  one scale per 128 x 128 block, scales [cols / 128, rows / 128]
// One CTA per 128 x 128 tile of the live pool blocks, in three steps through one shared buffer:
//   1. stage: the tile's rows, each 16-byte chunk loaded once (all of a thread's loads in flight
//      together), into rows 65 words apart as bf16 pairs;
//   2. quantise: thread t holds column pair t % 64 over rows [32 (t / 64), +32) in registers; the 4
//      threads of a column meet in shared memory for its amax (the whole CTA for the tile's);
//   3. write: the e4m3 tile, transposed, goes back into the buffer as 128 columns of 128 bytes (a
//      column's 16-byte chunks permuted by its index, so a warp's stores spread over the banks), and
//      the CTA stores it as whole 128-byte lines of q_t (a warp writes 4 columns' lines).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cutlass/fast_math.h>

#include "common/status.h"
#include "kernels/fp8/e4m3.cuh"
#include "megamoe/megamoe.h"
#include "routing/routing.h"

namespace megamoe {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kRowWords = kTile / 2 + 1;                              // a staged row: 64 words and one of padding
constexpr int kQuarters = kThreads / (kTile / 2);                     // threads per column pair: 4
constexpr int kQuarterRows = kTile / kQuarters;                       // rows per thread: 32
constexpr int kOutChunks = kTile * kTile / 16 / kThreads;              // a thread's 16-byte output chunks: 4
static_assert(kTile * kRowWords * 4 >= kTile * kTile, "the e4m3 tile fits where the bf16 tile was staged");

// slot_to_route (token rows) or null (a pool); src_scales (E4m3: [cols / 128, scale_rows], one per
// source row and 128 columns). Three CTAs per SM: their staged loads keep about 96 KB (bf16) in
// flight, and the register budget (85) holds a thread's 8 staged chunks and 32 held words.
template <bool InBlocks, bool E4m3>
__global__ void __launch_bounds__(kThreads, 3)
transpose_quantize(const uint4* __restrict__ src, const float* __restrict__ src_scales, uint4* __restrict__ q_t,
                   float* __restrict__ scales, const int32_t* __restrict__ num_blocks,
                   const int32_t* __restrict__ slot_to_route, cutlass::FastDivmod top_k, int64_t rows,
                   int64_t scale_rows,
                   int32_t cols) {
  constexpr int kValuesPerChunk = E4m3 ? 16 : 8;                         // values of a 16-byte source chunk
  constexpr int kChunksPerRow = kTile / kValuesPerChunk;                 // of a source row's 128 values
  constexpr int kStagedChunks = kTile * kChunksPerRow / kThreads;        // a thread's chunks: 4 or 8
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  const int block_row = int(blockIdx.x);  // 128-row block of the pool
  if (block_row >= *num_blocks) return;   // past the live blocks: nothing reads those rows
  const int col_tile = int(blockIdx.y);
  const int col0 = col_tile * kTile;
  __shared__ __align__(16) uint32_t tile[kTile * kRowWords];
  __shared__ float amax_part[kQuarters][kTile];

  // 1. Stage. Thread t loads chunk t % kChunksPerRow of rows t / kChunksPerRow + kRowsPerPass i:
  // first every source row, then every chunk, so the loads of each kind are in flight together.
  // Source rows and offsets in 32 bits (routes and pool rows are int32), widened by one unsigned
  // multiply per load (a real row is >= 0).
  const int row0 = block_row * kTile;
  const int chunk = int(threadIdx.x) % kChunksPerRow;
  int32_t src_row[kStagedChunks];  // -1 for a padding row
#pragma unroll
  for (int i = 0; i < kStagedChunks; ++i) {
    src_row[i] = row0 + int(threadIdx.x) / kChunksPerRow + i * kRowsPerPass;
    if (slot_to_route != nullptr) {
      const int32_t route = slot_to_route[src_row[i]];
      const int32_t token = top_k.div(max(route, 0));  // a multiply-high, not a division
      src_row[i] = route >= 0 ? token : -1;
    }
  }
  const uint4* src_tile = src + col_tile * kChunksPerRow + chunk;  // this thread's chunk of source row 0
  const float* col_scales = E4m3 ? src_scales + int64_t(col_tile) * scale_rows : nullptr;
  const int row_chunks = cols / kValuesPerChunk;
  uint4 staged[kStagedChunks];
  float row_scale[kStagedChunks];
#pragma unroll
  for (int i = 0; i < kStagedChunks; ++i) {
    const bool real = src_row[i] >= 0;
    staged[i] = real ? src_tile[uint64_t(uint32_t(src_row[i])) * uint32_t(row_chunks)] : make_uint4(0, 0, 0, 0);
    if constexpr (E4m3) row_scale[i] = real ? col_scales[src_row[i]] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < kStagedChunks; ++i) {
    const int row = int(threadIdx.x) / kChunksPerRow + i * kRowsPerPass;
    uint32_t* dst = tile + row * kRowWords + chunk * (kValuesPerChunk / 2);
    const uint32_t words[4] = {staged[i].x, staged[i].y, staged[i].z, staged[i].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (E4m3) {  // 4 e4m3 values per word, 2 bf16 per staged word
        const __nv_bfloat162 lo = fp8::dequantize_e4m3x2(uint16_t(words[w]), row_scale[i]);
        const __nv_bfloat162 hi = fp8::dequantize_e4m3x2(uint16_t(words[w] >> 16), row_scale[i]);
        dst[2 * w] = *reinterpret_cast<const uint32_t*>(&lo);
        dst[2 * w + 1] = *reinterpret_cast<const uint32_t*>(&hi);
      } else {
        dst[w] = words[w];
      }
    }
  }
  __syncthreads();

  // 2. Quantise: this thread's 32 rows of its two columns, held as bf16 pairs.
  const int pair = int(threadIdx.x) % (kTile / 2);
  const int quarter = int(threadIdx.x) / (kTile / 2);
  uint32_t held[kQuarterRows];
  uint32_t amax_pair = 0;  // both columns' amax, as bf16 (the max of bf16 values is one of them)
#pragma unroll
  for (int i = 0; i < kQuarterRows; ++i) {
    held[i] = tile[(quarter * kQuarterRows + i) * kRowWords + pair];
    amax_pair = fp8::abs_max_nan_bf16x2(amax_pair, held[i]);
  }
  const float2 amax2 = fp8::abs_halves(amax_pair);
  const float amax[2] = {amax2.x, amax2.y};
  float scale[2];
  if constexpr (InBlocks) {  // the tile's amax
    scale[0] = scale[1] = fp8::cta_block_scale<kThreads>(fp8::max_nan(amax[0], amax[1]));
  } else {  // each column's amax over the 4 quarters of its rows
#pragma unroll
    for (int c = 0; c < 2; ++c) amax_part[quarter][2 * pair + c] = amax[c];
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float column_amax = 0.f;
#pragma unroll
      for (int q = 0; q < kQuarters; ++q) column_amax = fp8::max_nan(column_amax, amax_part[q][2 * pair + c]);
      scale[c] = fp8::block_scale(column_amax);
    }
  }
  // Every thread has read its rows from the staged tile (both branches hold a barrier): the e4m3 tile replaces
  // it, column c at bytes [128 c, +128), this thread's 32 rows of each of its columns as two chunks.
  uint4* out_tile = reinterpret_cast<uint4*>(tile);
  const auto out_chunk = [&](int column, int chunk_of_column) {  // chunk q sits at q ^ (column / 2 % 8)
    return out_tile + column * (kTile / 16) + (chunk_of_column ^ (column / 2 % 8));
  };
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float inverse = fp8::inverse(scale[c]);
    uint32_t words[kQuarterRows / 4];
#pragma unroll
    for (int w = 0; w < kQuarterRows / 4; ++w) {
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of its fp32
        const uint32_t pair = held[4 * w + i];
        v[i] = __uint_as_float(c ? pair & 0xffff0000u : pair << 16);
      }
      words[w] = fp8::to_e4m3x4(v[0], v[1], v[2], v[3], inverse);
    }
    const int column = 2 * pair + c, first = quarter * (kQuarterRows / 16);
    *out_chunk(column, first) = make_uint4(words[0], words[1], words[2], words[3]);
    *out_chunk(column, first + 1) = make_uint4(words[4], words[5], words[6], words[7]);
    if constexpr (!InBlocks) {
      if (quarter == 0) scales[int64_t(block_row) * cols + col0 + 2 * pair + c] = scale[c];
    }
  }
  if constexpr (InBlocks) {
    if (threadIdx.x == 0) scales[int64_t(col_tile) * (rows / kTile) + block_row] = scale[0];
  }
  __syncthreads();

  // 3. Write: chunk j of the e4m3 tile is bytes [16 (j % 8), +16) of column j / 8's 128 rows.
  uint4* q_tile = q_t + int64_t(col0) * (rows / 16) + block_row * (kTile / 16);  // the tile's first line
#pragma unroll
  for (int i = 0; i < kOutChunks; ++i) {
    const int j = i * kThreads + int(threadIdx.x), column = j / (kTile / 16);
    q_tile[int64_t(column) * (rows / 16) + j % (kTile / 16)] = *out_chunk(column, j % (kTile / 16));
  }
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_transpose_quantize_fp8(const megamoe_routing_plan* plan,
                                              const megamoe_transpose_quantize_fp8_args* args, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_transpose_quantize_fp8: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_transpose_quantize_fp8_args& a = *args;
  if (a.src == nullptr || a.q_t == nullptr || a.scales == nullptr || plan->num_blocks == nullptr) {
    return invalid_argument(fn + "src, q_t, scales and the plan's num_blocks must be non-null");
  }
  if (!aligned16(a.src) || !aligned16(a.q_t)) return invalid_argument(fn + "src and q_t must be 16-byte aligned");
  if (a.src_dtype != MEGAMOE_SRC_BF16 && a.src_dtype != MEGAMOE_SRC_E4M3) {
    return invalid_argument(fn + "src_dtype must be MEGAMOE_SRC_BF16 or MEGAMOE_SRC_E4M3, got " +
                            std::to_string(a.src_dtype));
  }
  const bool e4m3 = a.src_dtype == MEGAMOE_SRC_E4M3;
  if (e4m3 && a.src_scales == nullptr) return invalid_argument(fn + "an e4m3 src needs its src_scales");
  if (a.cols <= 0 || a.cols % kTile != 0) {
    return invalid_argument(fn + "cols must be a positive multiple of 128 (block-FP8 scale blocks), got " +
                            std::to_string(a.cols));
  }
  if (a.src_rows != MEGAMOE_ROWS_POOL && a.src_rows != MEGAMOE_ROWS_TOKENS) {
    return invalid_argument(fn + "src_rows must be MEGAMOE_ROWS_POOL or MEGAMOE_ROWS_TOKENS, got " +
                            std::to_string(a.src_rows));
  }
  const bool tokens = a.src_rows == MEGAMOE_ROWS_TOKENS;
  if (tokens && plan->slot_to_route == nullptr) {
    return invalid_argument(fn + "token rows need the plan's slot_to_route");
  }
  if (a.blocks != MEGAMOE_FP8_ALONG_ROWS && a.blocks != MEGAMOE_FP8_IN_BLOCKS) {
    return invalid_argument(fn + "blocks must be MEGAMOE_FP8_ALONG_ROWS or MEGAMOE_FP8_IN_BLOCKS, got " +
                            std::to_string(a.blocks));
  }
  const int64_t rows = routing::pool_rows(*plan);
  if (rows == 0) return MEGAMOE_OK;
  const dim3 grid(unsigned(rows / kTile), unsigned(a.cols / kTile));
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* src = static_cast<const uint4*>(a.src);
  auto* q_t = static_cast<uint4*>(a.q_t);
  const int32_t* slot_to_route = tokens ? plan->slot_to_route : nullptr;
  const cutlass::FastDivmod top_k(plan->shape.top_k);
  const int64_t scale_rows = tokens ? int64_t(plan->shape.num_tokens) : rows;
  const auto run = [&](auto in_blocks, auto e4m3_src) {
    transpose_quantize<decltype(in_blocks)::value, decltype(e4m3_src)::value><<<grid, kThreads, 0, s>>>(
        src, a.src_scales, q_t, a.scales, plan->num_blocks, slot_to_route, top_k, rows, scale_rows, a.cols);
  };
  const bool in_blocks = a.blocks == MEGAMOE_FP8_IN_BLOCKS;
  if (in_blocks && e4m3) {
    run(std::true_type{}, std::true_type{});
  } else if (in_blocks) {
    run(std::true_type{}, std::false_type{});
  } else if (e4m3) {
    run(std::false_type{}, std::true_type{});
  } else {
    run(std::false_type{}, std::false_type{});
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
