// The block-FP8 weight gradients' operands (grouped_weight_grad.cu) that dh's epilogue does not make
// itself: a pool [rows, cols] bf16 transposed and quantised along its rows, the weight gradient's K,
// with the rounding of e4m3.cuh; or, from token rows [T, cols] (x), the pool the plan's dispatch would
// make of them (row r = token slot_to_route[r] / K, zeros for a padding row), without making it. The
// source may itself be e4m3 rows with 1 x 128 scales (dy as dispatched for dh): each value is
// dequantised to bf16 (e4m3.cuh) as it is read, so the pass reads half the bytes of a bf16 copy.
//   MEGAMOE_FP8_ALONG_ROWS: one scale per column and 128 rows (1 x 128 blocks along the tokens),
//                           scales [rows / 128, cols]
//   MEGAMOE_FP8_IN_BLOCKS:  one scale per 128 x 128 block, scales [cols / 128, rows / 128]
// Persistent CTAs, each taking 128 x 128 tiles of the live pool blocks in turn (a column tile's row
// blocks one after the other, so x's column slice stays in L2), with the next tile's copy in flight
// while the current one is quantised, through two shared buffers:
//   1. copy: the tile's source rows by cp.async, 16-byte units, unit u of row r at u ^ (r % 8) so
//      the column reads of step 2 fall in distinct banks (a padding row's units are zero-filled);
//      for token rows a tile's routes are loaded one tile before its copy, so no copy waits on them;
//   2. quantise: thread t holds column pair t % 64 over rows [32 (t / 64), +32) in registers (e4m3
//      sources dequantised with their row scales as they are read); the 4 threads of a column meet
//      in shared memory for its amax (the whole CTA for the tile's);
//   3. write: the e4m3 tile, transposed, replaces the source in its buffer as 128 columns of 128
//      bytes (a column's 16-byte chunks permuted by its index, so a warp's stores spread over the
//      banks), and the CTA stores it as whole 128-byte lines of q_t (a warp writes 4 columns' lines).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cute/arch/copy_sm80.hpp>
#include <cutlass/fast_math.h>

#include "common/device.h"
#include "common/status.h"
#include "kernels/fp8/e4m3.cuh"
#include "megamoe/megamoe.h"
#include "routing/routing.h"

namespace megamoe {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kCtasPerSm = 2;
constexpr int kBuffers = 2;  // the tile quantised and the next one being copied (a third: e4m3 rows slower)
constexpr int kQuarters = kThreads / (kTile / 2);                     // threads per column pair: 4
constexpr int kQuarterRows = kTile / kQuarters;                       // rows per thread: 32
constexpr int kOutChunks = kTile * kTile / 16 / kThreads;              // a thread's 16-byte output chunks: 4

// A source tile as it is copied: 128 rows of 128 values, bf16 or e4m3 (with one scale per row).
template <bool E4m3>
struct SourceTile {
  static constexpr int kRowBytes = E4m3 ? kTile : 2 * kTile;
  static constexpr int kUnitsPerRow = kRowBytes / 16;
  // Step 1 copies a row by 8 threads (bf16: two units each), so a thread holds the routes of 4 rows.
  static constexpr int kCopyThreadsPerRow = 8;
  static constexpr int kCopyRowsPerPass = kThreads / kCopyThreadsPerRow;
  static constexpr int kCopyRows = kTile / kCopyRowsPerPass;
  static constexpr int kBytes = kTile * kRowBytes;
  static_assert(kBytes >= kTile * kTile, "the e4m3 tile fits where its source was");
  // Shared memory: the buffers, each with its rows' scales (e4m3), then the column amaxes' exchange.
  static constexpr int kScaleBytes = E4m3 ? kTile * 4 : 0;
  static constexpr int kBufferBytes = kBytes + kScaleBytes;
  static constexpr int kSmemBytes = kBuffers * kBufferBytes + kQuarters * kTile * 4;

  // Value pair `pair` (columns 2 pair, 2 pair + 1) of row r is at byte
  // pair_unit(pair) ^ (r % 8) * 16 + pair_within(pair) + r * kRowBytes: one xor with a constant per
  // row once r's multiple of 8 is known.
  static constexpr int kPairsPerUnit = 16 / (kRowBytes / kTile * 2);
  __device__ static int pair_unit(int pair) { return pair / kPairsPerUnit * 16; }
  __device__ static int pair_within(int pair) { return pair % kPairsPerUnit * (16 / kPairsPerUnit); }
};

// Tokens: token rows through slot_to_route, else a pool; src_scales (E4m3: [cols / 128, scale_rows],
// one per source row and 128 columns). Two CTAs per SM: at three (85 registers) the persistent loop's
// state and the routes in flight beside a thread's 32 held words spill.
template <bool InBlocks, bool E4m3, bool Tokens>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
transpose_quantize(const uint8_t* __restrict__ src, const float* __restrict__ src_scales, uint4* __restrict__ q_t,
                   float* __restrict__ scales, const int32_t* __restrict__ num_blocks,
                   const int32_t* __restrict__ slot_to_route, cutlass::FastDivmod top_k, int64_t rows,
                   int64_t scale_rows, int32_t cols) {
  using Src = SourceTile<E4m3>;
  extern __shared__ __align__(128) uint8_t smem[];
  float* amax_part = reinterpret_cast<float*>(smem + kBuffers * Src::kBufferBytes);  // [kQuarters][kTile]
  const auto buffer = [&](int b) { return smem + b * Src::kBufferBytes; };
  const auto row_scales = [&](int b) { return reinterpret_cast<float*>(buffer(b) + Src::kBytes); };
  const int live_blocks = *num_blocks;
  const int tiles = live_blocks * (cols / kTile);
  // Tile t: row block t % live_blocks of column tile t / live_blocks (a column tile's row blocks in turn).
  struct Coords {
    int block_row, col_tile;
  };
  const auto coords = [&](int t) { return Coords{t % live_blocks, t / live_blocks}; };
  int tile = int(blockIdx.x);
  if (tile >= tiles) return;

  // Step 1. Thread t copies units t % 8 + 8 j of rows t / 8 + 32 i. For token rows `routes` holds
  // those rows' routes for the next tile to copy; a source row of -1 is a padding row. Source rows
  // and offsets in 32 bits (routes and pool rows are int32), widened by one unsigned multiply per
  // row (a real row is >= 0).
  const int unit = int(threadIdx.x) % Src::kCopyThreadsPerRow;
  const int src_row_bytes = cols * (Src::kRowBytes / kTile);
  int32_t routes[Tokens ? Src::kCopyRows : 1];
  const auto load_routes = [&](int t) {
    if constexpr (Tokens) {
#pragma unroll
      for (int i = 0; i < Src::kCopyRows; ++i) {
        routes[i] = slot_to_route[coords(t).block_row * kTile + int(threadIdx.x) / Src::kCopyThreadsPerRow +
                                  i * Src::kCopyRowsPerPass];
      }
    }
  };
  const auto copy = [&](int t, int b) {
    const auto [block_row, col_tile] = coords(t);
    const uint8_t* src_tile = src + col_tile * Src::kRowBytes + unit * 16;
#pragma unroll
    for (int i = 0; i < Src::kCopyRows; ++i) {
      const int row = int(threadIdx.x) / Src::kCopyThreadsPerRow + i * Src::kCopyRowsPerPass;
      int32_t src_row = block_row * kTile + row;
      if constexpr (Tokens) src_row = routes[i] >= 0 ? top_k.div(routes[i]) : -1;  // a multiply-high
      const bool real = src_row >= 0;
      const uint8_t* from = real ? src_tile + uint64_t(uint32_t(src_row)) * uint32_t(src_row_bytes) : src;
#pragma unroll
      for (int j = 0; j < Src::kUnitsPerRow / Src::kCopyThreadsPerRow; ++j) {
        const int u = unit + j * Src::kCopyThreadsPerRow;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
            *reinterpret_cast<const cute::uint128_t*>(real ? from + j * Src::kCopyThreadsPerRow * 16 : src),
            *reinterpret_cast<cute::uint128_t*>(buffer(b) + row * Src::kRowBytes + ((u ^ (row % 8)) * 16)), real);
      }
      if constexpr (E4m3) {
        if (unit == 0) {
          const float* scale = real ? src_scales + int64_t(col_tile) * scale_rows + src_row : src_scales;
          cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>::copy(
              *reinterpret_cast<const uint32_t*>(scale), *reinterpret_cast<uint32_t*>(row_scales(b) + row), real);
        }
      }
    }
  };

  // The first tile's copy into buffer 0; each tile's copy is one commit group.
  const int stride = int(gridDim.x);
  load_routes(tile);
  copy(tile, 0);
  cute::cp_async_fence();
  if (tile + stride < tiles) load_routes(tile + stride);
  for (int b = 0; tile < tiles; b ^= 1) {
    const auto [block_row, col_tile] = coords(tile);
    const int col0 = col_tile * kTile;
    cute::cp_async_wait<0>();
    __syncthreads();  // this tile is staged in buffer b, and the last tile's stores have read buffer b ^ 1
    const int next = tile + stride;
    if (next < tiles) copy(next, b ^ 1);
    cute::cp_async_fence();
    if (next + stride < tiles) load_routes(next + stride);  // in flight while this tile is quantised

    // 2. Quantise: this thread's 32 rows of its two columns, held as bf16 pairs.
    const int pair = int(threadIdx.x) % (kTile / 2);
    const int quarter = int(threadIdx.x) / (kTile / 2);
    const uint8_t* staged = buffer(b) + quarter * kQuarterRows * Src::kRowBytes + Src::pair_within(pair);
    const int unit_offset = Src::pair_unit(pair);
    uint32_t held[kQuarterRows];
    uint32_t amax_pair = 0;  // both columns' amax, as bf16 (the max of bf16 values is one of them)
#pragma unroll
    for (int i = 0; i < kQuarterRows; ++i) {
      const int r = quarter * kQuarterRows + i;  // r % 8 == i % 8
      const uint8_t* at = staged + i * Src::kRowBytes + (unit_offset ^ (i % 8 * 16));
      if constexpr (E4m3) {
        const __nv_bfloat162 v = fp8::dequantize_e4m3x2(*reinterpret_cast<const uint16_t*>(at), row_scales(b)[r]);
        held[i] = *reinterpret_cast<const uint32_t*>(&v);
      } else {
        held[i] = *reinterpret_cast<const uint32_t*>(at);
      }
      amax_pair = fp8::abs_max_nan_bf16x2(amax_pair, held[i]);
    }
    const float2 amax2 = fp8::abs_halves(amax_pair);
    const float amax[2] = {amax2.x, amax2.y};
    float scale[2];
    if constexpr (InBlocks) {  // the tile's amax
      scale[0] = scale[1] = fp8::cta_block_scale<kThreads>(fp8::max_nan(amax[0], amax[1]));
    } else {  // each column's amax over the 4 quarters of its rows
#pragma unroll
      for (int c = 0; c < 2; ++c) amax_part[quarter * kTile + 2 * pair + c] = amax[c];
      __syncthreads();
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float column_amax = 0.f;
#pragma unroll
        for (int q = 0; q < kQuarters; ++q) column_amax = fp8::max_nan(column_amax, amax_part[q * kTile + 2 * pair + c]);
        scale[c] = fp8::block_scale(column_amax);
      }
    }
    // Every thread has read its rows from buffer b (both branches hold a barrier): the e4m3 tile
    // replaces them, column c at bytes [128 c, +128), this thread's 32 rows of each of its columns as
    // two chunks.
    uint4* out_tile = reinterpret_cast<uint4*>(buffer(b));
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
    tile += stride;
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
  int sms = 0;
  MEGAMOE_RETURN_IF_ERROR(current_sm_count(&sms));
  const int64_t max_tiles = rows / kTile * (a.cols / kTile);  // the live blocks' tiles are at most these
  const int grid = int(std::min<int64_t>(max_tiles, int64_t(sms) * kCtasPerSm));
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* src = static_cast<const uint8_t*>(a.src);
  auto* q_t = static_cast<uint4*>(a.q_t);
  const cutlass::FastDivmod top_k(plan->shape.top_k);
  const int64_t scale_rows = tokens ? int64_t(plan->shape.num_tokens) : rows;
  const auto run = [&](auto in_blocks, auto e4m3_src, auto token_rows) -> int {
    const auto kernel = transpose_quantize<decltype(in_blocks)::value, decltype(e4m3_src)::value,
                                           decltype(token_rows)::value>;
    const int smem = SourceTile<decltype(e4m3_src)::value>::kSmemBytes;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, kThreads, smem, s>>>(src, a.src_scales, q_t, a.scales, plan->num_blocks, plan->slot_to_route,
                                        top_k, rows, scale_rows, a.cols);
    return MEGAMOE_OK;
  };
  // The runtime choices as the kernel's template arguments.
  const auto with = [](bool value, auto next) { return value ? next(std::true_type{}) : next(std::false_type{}); };
  MEGAMOE_RETURN_IF_ERROR(with(a.blocks == MEGAMOE_FP8_IN_BLOCKS, [&](auto in_blocks) {
    return with(e4m3, [&](auto e4m3_src) {
      return with(tokens, [&](auto token_rows) { return run(in_blocks, e4m3_src, token_rows); });
    });
  }));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
