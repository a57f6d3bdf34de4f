// dh epilogue of the backward: dh = dy_pool · w2[e] (fp32 accumulators, MN-major B), then per pool
// row r (topk weight p = p_pool[r]) and column i of the tile, with g, u from z (bf16 -> fp32, compact:
// compact_rows.cuh) and the gate's activation Act (activation.cuh):
//   h = act(g) · u
//   dp_partial[r, q] = Σ_i h · dh over i in [128 q, 128 q + 128)   (fixed order)
//   dh_w = p · dh,  dg = dh_w · u · act'(g),  du = dh_w · act(g),  hp = p · h
//   dz[r, n0 + i] = dg, dz[r, I + n0 + i] = du, hp[r, n0 + i] = hp   (bf16, one rounding each)
// Rows with p == 0 (padding rows, or a zero weight) get dz = hp = 0 exactly, whatever z holds: a
// block's padding rows read the next expert's rows of z (or zeros past its end).
//
// The tile's dh columns [n0, n0 + BLOCK_N) need the same columns of g and u: 2 x BLOCK_N bf16 per row,
// too many to hold in registers next to 128 x 256 accumulators. So z comes through the operand ring:
// after the tile's k-blocks the producer loads, per 64-column chunk c, the 128 x 64 boxes of g and u
// (one stage per chunk: g in its A slot, u in its B slot, both 128B-swizzled), already in flight while
// the last k-blocks run. Each math warpgroup reads its 64 rows of a chunk 16 columns at a time with
// ldmatrix, straight into the accumulator fragment's layout (epilogue.cuh), and writes dg and du in
// place of g and u (and hp into a chunk buffer) with stmatrix; then each warp stores its own 16 rows
// by TMA (16-row boxes), so no warp waits for another: the epilogue holds no barrier wider than a
// warp. The outputs never sit in registers as a whole chunk, which keeps the 256-wide tile within
// 168 registers. BLOCK_N is 256 when I allows it (the wide tile's main loop streams half the L2 bytes
// per FLOP), 128 otherwise.
// dp: each thread sums its 32 columns of each 128-column partial for each of its 2 rows, then the 4
// lanes sharing a row add in a fixed butterfly; lane l % 4 == 0 writes the row's partial. No atomics:
// deterministic, and the same sums in the same order for either BLOCK_N.
// Block FP8 stores dz in e4m3 twice and hp once, after each odd chunk, from the 128-column block of
// it and the chunk before as staged in bf16 (quantize_block.cuh), so no pass of its own reads them:
//   dz for dz·w13 (dx), one scale per row and 128 columns: each row's amax is kept while the chunks
//   are computed, and each warp quantises its own rows;
//   dz transposed for dW13 = dzᵀ·x, one scale per column and 128 rows (the pool block), and hp
//   transposed for dW2 = dyᵀ·hp, one scale per 128 x 128 block: the 4 lanes of a quad take a column
//   pair of their warpgroup's 64 rows, and the two warpgroups meet at a named barrier to exchange
//   their amaxes (hp's kept from the values staged); the e4m3 columns go straight to global
//   memory, 64 contiguous bytes per column and quad.
// Its bf16 dz and hp are stored only when asked for.
#pragma once

#include <cuda_bf16.h>

#include "kernels/grouped_gemm/activation.cuh"
#include "kernels/grouped_gemm/compact_rows.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/operand.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/quantize_block.cuh"

namespace megamoe::grouped_gemm {

// The kernel parameter, the same for either tile width and activation.
struct GatedBackwardParams {
  CUtensorMap dz;     // [max_blocks * 128, 2I] as its two halves (tensor_map.h), 16-row x 64-column boxes
  bool store_dz;      // false in block FP8 without a bf16 dz
  CUtensorMap hp;     // [max_blocks * 128, I], 16-row x 64-column boxes
  bool store_hp;      // false in block FP8 without a bf16 hp
  CUtensorMap z;      // [T·K, 2I] as its two halves, 128 x 64 boxes (read through the ring)
  CompactRows z_rows;  // where a pool block's rows are in z
  CUtensorMap dz_q;   // block FP8: [max_blocks * 128, 2I] e4m3, 16-row x 128-byte boxes
  float* dz_scales;   // block FP8: [2I / 128, max_blocks * 128]
  uint8_t* dz_t;      // block FP8: [2I, max_blocks * 128] e4m3, dz transposed
  float* dz_t_scales;  // block FP8: [max_blocks, 2I]
  uint8_t* hp_t;      // block FP8: [I, max_blocks * 128] e4m3, hp transposed
  float* hp_t_scales;  // block FP8: [I / 128, max_blocks]
  const float* p;     // [max_blocks * 128]
  float* dp_partial;  // [max_blocks * 128, MEGAMOE_DP_PARTIAL_COLS(I)]
  int intermediate;
  int pool_rows;
  float activation_limit;  // the C API's (activation.cuh)
};

// The problem's N is I (columns of dh), its K the hidden size. C: the main loop's config, BF16
// reading w2 as it is (MN-major B), or block FP8 reading a transposed copy (K-major B,
// config_fp8.cuh); its stages hold the z chunks either way.
template <class Act, int BlockN, class C = Config<BlockN, 1, Major::K, Major::MN>>
struct GatedBackwardEpilogue {
  using Cfg = C;
  static_assert(Cfg::kBlockN == BlockN, "the config's tile width");
  static constexpr int kChunks = BlockN / kEpiCols;
  static constexpr int kRingChunks = kChunks;                // one ring stage of z per chunk
  static constexpr int kZBoxBytes = kBlockM * kEpiCols * 2;  // g or u of one chunk: 16 KB
  static constexpr int kChunksPerPartial = 128 / kEpiCols;   // dp partials cover 128 columns
  static_assert(Cfg::kABytes == kZBoxBytes && Cfg::kBBytes >= kZBoxBytes, "a chunk of g and u fits a stage");
  static_assert(kEpiBuffers == 2 && kChunks % 2 == 0, "chunk c reuses chunk c - 2's hp buffer");
  static_assert(Cfg::kStages > 2, "the epilogue holds two stages while it waits for a third");
  static constexpr int kTileN = BlockN;
  static constexpr bool kQuantizeDz = Cfg::kFp8;
  using Params = GatedBackwardParams;
  struct Arguments {
    const void* z;           // [T·K, 2I] bf16: the forward's gate | up, compact
    const float* p;          // [pool rows]
    void* dz;                // [pool rows, 2I] bf16 (block FP8: optional)
    void* hp;                // [pool rows, I] bf16 (block FP8: optional)
    float* dp_partial;       // [pool rows, MEGAMOE_DP_PARTIAL_COLS(I)]
    void* dz_q;              // block FP8: [pool rows, 2I] e4m3
    float* dz_scales;        // block FP8: [2I / 128, pool rows]
    void* dz_t;              // block FP8: [2I, pool rows] e4m3
    float* dz_t_scales;      // block FP8: [pool rows / 128, 2I]
    void* hp_t;              // block FP8: [I, pool rows] e4m3
    float* hp_t_scales;      // block FP8: [I / 128, pool rows / 128]
    float activation_limit;
  };

  static int can_implement(const PoolProblem& p, const Arguments& args) {
    MEGAMOE_RETURN_IF_ERROR(
        check_pointers(p.fn, {{args.z, "z"}, {args.p, "p_pool"}, {args.dp_partial, "dp_partial"}}));
    if (!kQuantizeDz || args.dz != nullptr) MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{args.dz, "dz"}}));
    if (!kQuantizeDz || args.hp != nullptr) MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{args.hp, "hp"}}));
    if constexpr (kQuantizeDz) {
      MEGAMOE_RETURN_IF_ERROR(check_pointers(p.fn, {{args.dz_q, "dz_q"},
                                                    {args.dz_scales, "dz_scales"},
                                                    {args.dz_t, "dz_t"},
                                                    {args.dz_t_scales, "dz_t_scales"},
                                                    {args.hp_t, "hp_t"},
                                                    {args.hp_t_scales, "hp_t_scales"}}));
    }
    return CompactRows::check(p.fn, *p.plan);
  }
  static int to_params(const PoolProblem& p, const Arguments& args, Params* params) {
    const uint64_t i = uint64_t(p.n);
    params->store_dz = args.dz != nullptr;
    if (params->store_dz) {
      MEGAMOE_RETURN_IF_ERROR(make_halves_tensor_map(&params->dz, args.dz, p.rows, i, kWarpRows, p.fn, "dz"));
    }
    params->store_hp = args.hp != nullptr;
    if (params->store_hp) {
      MEGAMOE_RETURN_IF_ERROR(make_tensor_map(&params->hp, args.hp, p.rows, i, kWarpRows, p.fn, "hp"));
    }
    const uint64_t z_rows = CompactRows::rows(*p.plan);
    MEGAMOE_RETURN_IF_ERROR(make_halves_tensor_map(&params->z, args.z, z_rows, i, kBlockM, p.fn, "z"));
    params->z_rows = CompactRows::of(*p.plan);
    params->p = args.p;
    params->dp_partial = args.dp_partial;
    params->intermediate = p.n;
    params->pool_rows = int(p.rows);
    params->activation_limit = args.activation_limit;
    if constexpr (kQuantizeDz) {
      params->dz_scales = args.dz_scales;
      params->dz_t = static_cast<uint8_t*>(args.dz_t);
      params->dz_t_scales = args.dz_t_scales;
      params->hp_t = static_cast<uint8_t*>(args.hp_t);
      params->hp_t_scales = args.hp_t_scales;
      return make_fp8_tensor_map(&params->dz_q, args.dz_q, p.rows, 2 * i, kWarpRows, p.fn, "dz_q");
    }
    return MEGAMOE_OK;
  }

  struct Rows {
    float p[2];  // the topk weights of the thread's two fragment rows
    // A dead row (a padding row or a zero weight) gets zeros for dz and hp, whatever was computed.
    __device__ bool live(int half) const { return p[half] != 0.f; }
  };

  __device__ static void prefetch(const Params& p) {
    if (p.store_dz) cute::prefetch_tma_descriptor(&p.dz);
    if (p.store_hp) cute::prefetch_tma_descriptor(&p.hp);
    cute::prefetch_tma_descriptor(&p.z);
    if constexpr (kQuantizeDz) cute::prefetch_tma_descriptor(&p.dz_q);
  }

  __device__ static Rows prepare(const Params& p, const PoolTile& t, int warpgroup) {
    const int64_t row = int64_t(t.block) * kBlockM + fragment_row(warpgroup);
    return {{__ldg(p.p + row), __ldg(p.p + row + 8)}};
  }

  // Producer side: the tile's z chunks, g into the stage's A slot and u into its B slot.
  template <class Smem, int Stages>
  __device__ static void load_ring(const Params& p, const PoolTile& t, const Smem& smem, PipelineState<Stages>& state) {
    const int z_row = t.block * kBlockM - p.z_rows.block(t.block).shift;
#pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
      uint64_t* full = smem.full(state.stage);
      Barrier::arrive_and_expect_tx(full, 2 * kZBoxBytes);
      const int col = t.n_tile * BlockN + c * kEpiCols;
      cute::SM90_TMA_LOAD_3D::copy(&p.z, full, kTmaCacheHint, smem.a(state.stage), col, 0, z_row);
      cute::SM90_TMA_LOAD_3D::copy(&p.z, full, kTmaCacheHint, smem.b(state.stage), col, 1, z_row);
      state.advance();
    }
  }

  __device__ static float2 unpack(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }

  // Chunk c's stage is held until the TMA stores that read dg and du from it are done: released
  // at chunk c + 2 (whose hp buffer is chunk c's) or, for the last two, at the end of the tile. In
  // block FP8 an even chunk's stage also holds its block's e4m3 dz, stored after the odd chunk's
  // bf16 stores: the next even chunk waits for every store before it releases the stage. Each warp
  // stages, stores and waits for its own rows only (lane 0 issues and tracks the warp's stores),
  // and releases a stage with one arrive of its own.
  template <class Smem, int Stages>
  __device__ static void store(const float (&acc)[Cfg::kAccumulators], const Params& p, const Smem& smem, int warpgroup,
                               const PoolTile& t, const Rows& rows, PipelineState<Stages>& state) {
    const bool leader = threadIdx.x % 32 == 0;  // issues and tracks this warp's TMA stores
    const uint32_t rows_offset = warpgroup * kWarpgroupRows * kSwizzleBytes;  // the warpgroup's 64 rows
    const int first_stage = state.stage;  // the tile's chunks come through consecutive stages
    const auto stage_of = [&](int c) { return (first_stage + c) % Stages; };
    const Act act = Act::of(p.activation_limit);
    float dp[2] = {0.f, 0.f};
    RowAmaxBf16 dg_amax, du_amax, hp_amax;  // block FP8: over the current 128-column block
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      Barrier::wait(smem.full(state.stage), state.phase);
      state.advance();
      if (c >= 2) {
        if (leader) {  // chunk c - 2's stores have read their shared memory (and in FP8 its block's e4m3 dz)
          if (kQuantizeDz && c % 2 == 0) {
            cute::tma_store_wait<0>();
          } else {
            cute::tma_store_wait<1>();
          }
        }
        __syncwarp();
        if (leader) Barrier::arrive(smem.empty(stage_of(c - 2)));
      }
      uint8_t* g_dg = smem.a(stage_of(c)) + rows_offset;  // g in, dg out
      uint8_t* u_du = smem.b(stage_of(c)) + rows_offset;  // u in, du out
      uint8_t* hp_chunk = smem.epi(warpgroup, c % kEpiBuffers);
#pragma unroll
      for (int pair = 0; pair < kEpiCols / 16; ++pair) {
        uint32_t g[4], u[4], dg[4], du[4], hp[4];
        load_packed_pair(g, g_dg, pair);
        load_packed_pair(u, u_du, pair);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = c * (kEpiCols / 8) + 2 * pair + q / 2;  // 8-column group of the tile
          const int h = q % 2;                                  // row half
          const float2 gv = unpack(g[q]);
          const float2 uv = unpack(u[q]);
          const float pw = rows.p[h];
          float out_dg[2], out_du[2], out_hp[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float gi = i ? gv.y : gv.x, ui = i ? uv.y : uv.x;
            const float dh = acc[4 * j + 2 * h + i];
            const auto a = act.at(gi, ui);
            const float hv = a.value * a.up;
            dp[h] = fmaf(hv, dh, dp[h]);
            const float dhw = pw * dh;
            out_dg[i] = act.chain(dhw * a.up, a);
            out_du[i] = act.up_chain(dhw * a.value, a);
            out_hp[i] = pw * hv;
          }
          const uint32_t keep = rows.live(h) ? ~0u : 0u;  // a dead row's values are zeroed as packed pairs
          dg[q] = pack_bf16x2(out_dg[0], out_dg[1]) & keep;
          du[q] = pack_bf16x2(out_du[0], out_du[1]) & keep;
          hp[q] = pack_bf16x2(out_hp[0], out_hp[1]) & keep;
          if constexpr (kQuantizeDz) {  // over the staged values: a dead row's zeros
            dg_amax.add(h, dg[q]);
            du_amax.add(h, du[q]);
            hp_amax.add(h, hp[q]);
          }
        }
        stage_packed_pair(dg, g_dg, pair);  // the same addresses this warp just read: no other warp's rows
        stage_packed_pair(du, u_du, pair);
        stage_packed_pair(hp, hp_chunk, pair);
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> visible to TMA
      __syncwarp();
      const int col = t.n_tile * BlockN + c * kEpiCols;
      if (leader) {  // the warp's 16 rows
        const int row0 = t.block * kBlockM + warp_row(warpgroup);
        const uint32_t box = warp_box_offset();
        if (!kQuantizeDz || p.store_dz) {
          InHalf{0}.store(&p.dz, g_dg + box, col, row0);
          InHalf{1}.store(&p.dz, u_du + box, col, row0);
        }
        if (p.store_hp) cute::SM90_TMA_STORE_2D::copy(&p.hp, hp_chunk + box, col, row0);
        cute::tma_store_arrive();  // one bulk group per chunk
      }
      if (c % kChunksPerPartial == kChunksPerPartial - 1) write_dp_partial(p, dp, t, warpgroup, col / 128);
      if constexpr (kQuantizeDz) {
        if (c % 2 == 1) {
          store_columns_fp8(p, smem, stage_of(c - 1), stage_of(c), warpgroup, t, c / 2, col - kEpiCols, hp_amax);
          store_dz_fp8(p, smem, stage_of(c - 1), stage_of(c), warpgroup, t, col - kEpiCols, dg_amax, du_amax);
          dg_amax = du_amax = hp_amax = RowAmaxBf16{};
        }
      }
    }
    if (leader) cute::tma_store_wait<0>();
    __syncwarp();
#pragma unroll
    for (int c = kChunks - 2; c < kChunks; ++c) {
      if (leader) Barrier::arrive(smem.empty(stage_of(c)));
    }
  }

  // Block FP8: dg and du of the 128 columns from col0 (chunk stages first and second) in e4m3, in
  // the first stage, stored with their row scales. Each warp reads, writes and stores its own 16
  // rows: only its first chunk's bf16 dz stores, if any, have to have left that stage.
  template <class Smem>
  __device__ static void store_dz_fp8(const Params& p, const Smem& smem, int first, int second, int warpgroup,
                                      const PoolTile& t, int col0, RowAmaxBf16 dg_amax, RowAmaxBf16 du_amax) {
    const bool leader = threadIdx.x % 32 == 0;
    if (p.store_dz) {  // the first chunk's bf16 dz stores are done (the second's may not be)
      if (leader) cute::tma_store_wait<1>();
      __syncwarp();
    }
    const uint32_t rows_offset = warpgroup * kWarpgroupRows * kSwizzleBytes;
    uint8_t* g_q = smem.a(first) + rows_offset;
    uint8_t* u_q = smem.b(first) + rows_offset;
    const float2 g_scales = quantize_block_e4m3(g_q, smem.a(second) + rows_offset, g_q, dg_amax);
    const float2 u_scales = quantize_block_e4m3(u_q, smem.b(second) + rows_offset, u_q, du_amax);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> visible to TMA
    __syncwarp();
    if (leader) {  // the warp's 16 rows
      const int row0 = t.block * kBlockM + warp_row(warpgroup);
      cute::SM90_TMA_STORE_2D::copy(&p.dz_q, g_q + warp_box_offset(), col0, row0);
      cute::SM90_TMA_STORE_2D::copy(&p.dz_q, u_q + warp_box_offset(), p.intermediate + col0, row0);
      cute::tma_store_arrive();
    }
    if (threadIdx.x % 4 == 0) {
      const int64_t row = int64_t(t.block) * kBlockM + fragment_row(warpgroup);
      float* g_column = p.dz_scales + int64_t(col0 / 128) * p.pool_rows;
      float* u_column = p.dz_scales + int64_t((p.intermediate + col0) / 128) * p.pool_rows;
      g_column[row] = g_scales.x;
      g_column[row + 8] = g_scales.y;
      u_column[row] = u_scales.x;
      u_column[row + 8] = u_scales.y;
    }
  }

  // Block FP8: the 128-column block from col0 (block `block` of the tile) transposed: dz (dg in the
  // chunk stages' A slots, du in their B slots) quantised along its 128 rows, hp (the chunk buffers)
  // in one 128 x 128 block. A warpgroup's 64 rows hold 128 column pairs of dz and 64 of hp, taken 8
  // at a time (a word block) by a warp (StagedColumnGroup): dz's word block b is half b / 8 (dg or
  // du) of chunk (b / 4) % 2, hp's chunk b / 4. The warpgroups exchange dz's amaxes through the two
  // stages' A-scale slots, which a z chunk's stage does not use, and each warp's hp amax (hp_part:
  // the thread's, over the pairs it staged) through the exchange words.
  template <class Smem>
  __device__ static void store_columns_fp8(const Params& p, const Smem& smem, int first, int second, int warpgroup,
                                           const PoolTile& t, int block, int col0, RowAmaxBf16 hp_part) {
    constexpr int kMathBarrier = 1, kWarpgroupBarrier = 2;  // named barriers: both warpgroups, one (+ warpgroup)
    constexpr int kDzBlocks = 16, kHpBlocks = 8, kWordsPerChunkRow = kEpiCols / 2;
    const int warp = int(threadIdx.x / 32) % 4, lane = int(threadIdx.x % 32);
    const uint32_t rows_offset = warpgroup * kWarpgroupRows * kSwizzleBytes;
    const auto dz_columns = [&](int b) {
      const int stage = (b / 4) % 2 ? second : first;
      return StagedColumnGroup((b / 8 ? smem.b(stage) : smem.a(stage)) + rows_offset, b % 4 * 8);
    };
    const auto dz_slot = [&](int wg, int b) {  // the amax of the lane's column pair in word block b
      return cute::cast_smem_ptr_to_uint(smem.a_scales(wg == 0 ? first : second)) + (8 * b + lane / 4) * 4;
    };
    // Two sets of exchange words, one per block of a 256-wide tile; with one block per tile, a barrier
    // first, so every warp has read the last tile's.
    if constexpr (kChunks == 2) sync_threads(kMathBarrier, 256);
    const uint32_t hp_words = cute::cast_smem_ptr_to_uint(smem.exchange() + block % 2 * kMathWarps);
    const float hp_amax = fp8::lanes_max_nan<32>(hp_part.of_thread());
    sync_threads(kWarpgroupBarrier + warpgroup, 128);  // every warp of the warpgroup has staged its rows
#pragma unroll 1
    for (int b = warp * (kDzBlocks / 4); b < (warp + 1) * (kDzBlocks / 4); ++b) {
      const uint32_t amax = dz_columns(b).amax();
      if (lane % 4 == 0) store_shared_u32(dz_slot(warpgroup, b), amax);
    }
    if (lane == 0) store_shared_u32(hp_words + (warpgroup * 4 + warp) * 4, __float_as_uint(hp_amax));
    sync_threads(kMathBarrier, 256);
    float hp_block_amax = 0.f;
#pragma unroll
    for (int w = 0; w < kMathWarps; ++w) {
      hp_block_amax = fp8::max_nan(hp_block_amax, __uint_as_float(load_shared_u32(hp_words + w * 4)));
    }
    const float hp_scale = fp8::block_scale(hp_block_amax);
    const int64_t row0 = int64_t(t.block) * kBlockM + warpgroup * kWarpgroupRows;
    // A word block's two column scales and their inverses. The next block's are taken after this
    // one's columns are stored, in the same straight-line code, so that the divisions' latency (each
    // ends in a branch to its slow path) overlaps the stores instead of following them.
    const auto dz_scales = [&](int b) {
      const float2 column_amax = fp8::abs_halves(
          fp8::abs_max_nan_bf16x2(load_shared_u32(dz_slot(0, b)), load_shared_u32(dz_slot(1, b))));
      const float2 scale = make_float2(fp8::block_scale(column_amax.x), fp8::block_scale(column_amax.y));
      return make_float4(scale.x, scale.y, fp8::inverse(scale.x), fp8::inverse(scale.y));
    };
    const int first_b = warp * (kDzBlocks / 4), last_b = first_b + kDzBlocks / 4;
    float4 dz_scale = dz_scales(first_b);
#pragma unroll 1
    for (int b = first_b; b < last_b; ++b) {
      const int pair = (b / 4) % 2 * kWordsPerChunkRow + b % 4 * 8 + lane / 4;
      const int dz_column = b / 8 * p.intermediate + col0 + 2 * pair;
      uint8_t* dz_out = p.dz_t + int64_t(dz_column) * p.pool_rows + row0;
      dz_columns(b).store_e4m3(dz_scale.z, dz_scale.w, dz_out, dz_out + p.pool_rows);
      if (warpgroup == 0 && lane % 4 == 0) {
        *reinterpret_cast<float2*>(p.dz_t_scales + int64_t(t.block) * 2 * p.intermediate + dz_column) =
            make_float2(dz_scale.x, dz_scale.y);
      }
      dz_scale = dz_scales(min(b + 1, last_b - 1));  // the last block's again after the last one
    }
    const float hp_inverse = fp8::inverse(hp_scale);
#pragma unroll 1
    for (int b = warp * (kHpBlocks / 4); b < (warp + 1) * (kHpBlocks / 4); ++b) {
      const int pair = b / 4 * kWordsPerChunkRow + b % 4 * 8 + lane / 4;
      uint8_t* hp_out = p.hp_t + int64_t(col0 + 2 * pair) * p.pool_rows + row0;
      StagedColumnGroup(smem.epi(warpgroup, b / 4), b % 4 * 8)
          .store_e4m3(hp_inverse, hp_inverse, hp_out, hp_out + p.pool_rows);
    }
    if (warpgroup == 0 && warp == 0 && lane == 0) {
      p.hp_t_scales[int64_t(col0 / 128) * (p.pool_rows / kBlockM) + t.block] = hp_scale;
    }
    sync_threads(kWarpgroupBarrier + warpgroup, 128);  // ... and read them, before e4m3 rows replace them
  }

  // The 4 lanes of a row hold disjoint columns: add them in a fixed order; then start the next partial.
  __device__ static void write_dp_partial(const Params& p, float (&dp)[2], const PoolTile& t, int warpgroup,
                                          int partial) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 1);
      dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 2);
    }
    if (threadIdx.x % 4 == 0) {
      const int partials = MEGAMOE_DP_PARTIAL_COLS(p.intermediate);
      const int64_t row = int64_t(t.block) * kBlockM + fragment_row(warpgroup);
      p.dp_partial[row * partials + partial] = dp[0];
      p.dp_partial[(row + 8) * partials + partial] = dp[1];
    }
    dp[0] = dp[1] = 0.f;
  }
  __device__ static void drain() { drain_stores(); }
};

}  // namespace megamoe::grouped_gemm
