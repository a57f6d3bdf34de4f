// GEMMs of the fused backward: dx per route with an MN-major B (dz · w13[e]), dh with the SwiGLU
// backward in its epilogue, the K-grouped weight gradients and the dp reduction. Every real row
// against a host fp32 reference, poison where nothing may be read or written, and argument
// validation (no GPU needed).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gemm_test_util.h"
#include "megamoe/megamoe.h"

namespace {

using namespace megamoe_test;

// ---------------------------------------------------------------------------------------------
// dx per route: out_rows[route] = A[slot] · B[e], B [E, K, N] (MN-major B).
// ---------------------------------------------------------------------------------------------

std::vector<FusedCase> scatter_mn_cases() {
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 31},
      {"n384_k640_partial_rank", 200, 3, 8, 2, 4, 384, 640, 32},  // N % 256 != 0: 128-wide tile
      {"many_tiles", 10000, 4, 8, 0, 8, 256, 128, 33},
      {"qwen3_30b_dx", 500, 8, 16, 4, 8, 2048, 1536, 34},  // n = H = 2048, k = 2I = 1536
      {"partial_n200_k400", 300, 2, 4, 0, 4, 200, 400, 35},    // n = H, k = 2I not multiples of the tile
      {"small_pool", 300, 2, 16, 0, 16, 256, 256, 36},  // half-padding blocks skip their second half
  };
}

class ScatterMnTest : public FusedTest {};

TEST_P(ScatterMnTest, EveryRouteRowWrittenOnce) { check_scatter(MEGAMOE_B_K_BY_N); }  // w13 [E, K, N]

INSTANTIATE_TEST_SUITE_P(Shapes, ScatterMnTest, ::testing::ValuesIn(scatter_mn_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(GroupedGemmScatterMnValidation, RejectsBadArguments) { expect_scatter_rejections(MEGAMOE_B_K_BY_N, 256, 1 << 20); }


// Runs fn(i) for i in [0, n) on up to 32 host threads.
template <class Fn>
void parallel_for(int64_t n, Fn fn) {
  const int threads = int(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < n; i += threads) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

// ‖got − want‖ / ‖want‖ over float vectors (NaN in got counts as infinite error).
double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double e = 0, s = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    e += (got[i] - want[i]) * (got[i] - want[i]);
    s += want[i] * want[i];
  }
  return std::sqrt(e / std::max(s, 1e-30));
}

// ---------------------------------------------------------------------------------------------
// dh = dy_pool · w2[e] with the SwiGLU backward epilogue, then dp reduce.
// ---------------------------------------------------------------------------------------------

std::vector<FusedCase> swiglu_backward_cases() {  // n = intermediate, k = hidden
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 41},
      {"i384_h640_partial_rank", 200, 3, 8, 2, 4, 384, 640, 42},  // 10 k-blocks, odd tile count
      {"many_tiles", 10000, 4, 8, 0, 8, 128, 128, 43},
      {"qwen3_30b", 500, 8, 16, 4, 8, 768, 2048, 44},  // I = 768, H = 2048, ~2700 rows
      // I and H not multiples of the tile: z's halves and dz stop at I, dp's last partial is short.
      {"partial_i200_h136", 300, 2, 4, 0, 4, 200, 136, 45},
      {"partial_i328_h392", 300, 3, 8, 2, 4, 328, 392, 46},
      {"small_pool", 300, 2, 16, 0, 16, 256, 256, 47},  // half-padding blocks skip their second half
  };
}

class SwigluBackwardTest : public FusedTest {};

TEST_P(SwigluBackwardTest, MatchesHostReference) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const FusedCase& c = GetParam();
  DevicePlan d(fused_shape(c));
  const Plan p = plan_for(c, d);
  if (HasFailure()) return;

  const int inter = c.n, hidden = c.k, cols = MEGAMOE_DP_PARTIAL_COLS(c.n);
  const int64_t rows = d.max_blocks * MEGAMOE_BLOCK_M, live_rows = int64_t(p.num_blocks) * MEGAMOE_BLOCK_M;
  std::mt19937 rng(c.seed * 7919u);
  // dy: the pool of random token rows, its padding rows and rows past the live blocks NaN (the kernel
  // must not mix them into real rows, nor let them into the zero dz / hp of padding rows).
  std::uniform_real_distribution<float> dydist(-1.f, 1.f);
  std::vector<uint16_t> dy_tokens(c.tokens * hidden);
  for (auto& v : dy_tokens) v = to_bf16(dydist(rng));
  const std::vector<uint16_t> dy = pool_of_tokens(p, dy_tokens, hidden, c.top_k);
  const std::vector<uint16_t> w2 = make_weights(int64_t(c.local_experts) * hidden * inter, hidden, rng);  // [E, H, I]
  // z, compact (one row per route): the local routes' rows uniform in [-6, 6] (linear and saturated
  // sigmoid), the rows past them NaN (a block's padding rows read the next expert's rows, or these).
  // p: real rows in (0, 1], ~5% exactly 0 (a zero weight must give exact zeros too); padding rows 0;
  // past: NaN.
  std::uniform_real_distribution<float> zdist(-6.f, 6.f), pdist(0.f, 1.f);
  std::vector<uint16_t> z(int64_t(c.tokens) * c.top_k * 2 * inter, kNaNPoison);
  std::vector<float> pw(rows, std::nanf(""));
  for (int64_t r = 0; r < live_rows; ++r) {
    pw[r] = 0.f;
    if (!is_real_row(p, r)) continue;
    for (int i = 0; i < 2 * inter; ++i) z[compact_row(p, r) * 2 * inter + i] = to_bf16(zdist(rng));
    const float x = pdist(rng);
    pw[r] = x < 0.05f ? 0.f : x;
  }
  DeviceBuffer<uint16_t> dy_dev(dy.size()), w2_dev(w2.size()), z_dev(z.size()), dz_dev(rows * 2 * inter),
      hp_dev(rows * inter);
  DeviceBuffer<float> p_dev(rows), dpp_dev(rows * cols), dp_dev(c.tokens * c.top_k);
  dy_dev.upload(dy);
  w2_dev.upload(w2);
  z_dev.upload(z);
  p_dev.upload(pw);
  ASSERT_EQ(cudaMemset(dz_dev.ptr, 0xFF, dz_dev.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(hp_dev.ptr, 0xFF, hp_dev.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(dpp_dev.ptr, 0xFF, dpp_dev.count * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(dp_dev.ptr, 0xFF, dp_dev.count * 4), cudaSuccess);
  const megamoe_gated_backward_args args{dy_dev.ptr, w2_dev.ptr, z_dev.ptr,   p_dev.ptr,
                                         dz_dev.ptr, hp_dev.ptr, dpp_dev.ptr, inter,
                                         hidden,     MEGAMOE_ACTIVATION_SWIGLU};
  ASSERT_EQ(megamoe_grouped_gemm_gated_backward_bf16(&d.plan, &args, nullptr), MEGAMOE_OK) << megamoe_last_error();
  const megamoe_dp_reduce_args reduce{dpp_dev.ptr, dp_dev.ptr, inter};
  ASSERT_EQ(megamoe_dp_reduce(&d.plan, &reduce, nullptr), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> dz = dz_dev.download(), hp = hp_dev.download();
  const std::vector<float> dpp = dpp_dev.download(), dp = dp_dev.download();

  // Host reference: dh for every real row (fp32 dots), then the epilogue's math in double.
  const std::vector<float> dyf = to_float(dy), zf = to_float(z);
  const std::vector<float> w2t = transpose_experts(to_float(w2), c.local_experts, hidden, inter);  // [E, I, H]
  std::vector<float> dh(rows * inter, 0.f);
  parallel_for(live_rows, [&](int64_t r) {
    if (!is_real_row(p, r)) return;
    const int64_t e = p.block_expert[r / MEGAMOE_BLOCK_M];
    for (int i = 0; i < inter; ++i) {
      dh[r * inter + i] = float(dot(dyf.data() + r * hidden, w2t.data() + (e * inter + i) * hidden, hidden));
    }
  });
  struct Ref {
    double dg, du, hp, h;
  };
  auto ref = [&](int64_t r, int i) {
    const int64_t zr = compact_row(p, r);
    const double g = zf[zr * 2 * inter + i], u = zf[zr * 2 * inter + inter + i], d = dh[r * inter + i], pr = pw[r];
    const double sig = 1.0 / (1.0 + std::exp(-g)), silu = g * sig, h = silu * u;
    return Ref{pr * d * u * sig * (1.0 + g * (1.0 - sig)), pr * d * silu, pr * h, h};
  };
  const std::vector<CheckedRow> real = real_rows(p);
  const Comparison rz = compare_rows(
      p, 2 * inter, real,
      [&](int64_t r, int col) { return col < inter ? ref(r, col).dg : ref(r, col - inter).du; }, dz);
  const Comparison rh = compare_rows(p, inter, real, [&](int64_t r, int col) { return ref(r, col).hp; }, hp);
  EXPECT_EQ(rz.non_finite, 0) << "dz worst tiles:" << rz.worst;
  EXPECT_LE(rz.rel_error, 1e-2) << "dz worst tiles:" << rz.worst;
  EXPECT_EQ(rh.non_finite, 0) << "hp worst tiles:" << rh.worst;
  EXPECT_LE(rh.rel_error, 1e-2) << "hp worst tiles:" << rh.worst;

  // dp partials of real rows, and dp per route after the reduction (0 for routes without a slot).
  std::vector<double> got_part, want_part;
  for (const CheckedRow& row : real) {
    for (int t = 0; t < cols; ++t) {
      double s = 0;
      for (int i = 128 * t; i < std::min(128 * t + 128, inter); ++i)
        s += ref(row.pool_row, i).h * dh[row.pool_row * inter + i];
      want_part.push_back(s);
      got_part.push_back(dpp[row.pool_row * cols + t]);
    }
  }
  const double rp = rel_error(got_part, want_part);
  EXPECT_LE(rp, 1e-2) << "dp_partial";
  std::vector<double> got_dp, want_dp;
  for (size_t route = 0; route < p.route_to_slot.size(); ++route) {
    const int32_t slot = p.route_to_slot[route];
    if (slot < 0) {
      EXPECT_EQ(dp[route], 0.f) << "route without a slot " << route;
      continue;
    }
    double s = 0;
    for (int t = 0; t < cols; ++t) s += dpp[int64_t(slot) * cols + t];
    want_dp.push_back(s);
    got_dp.push_back(dp[route]);
  }
  EXPECT_LE(rel_error(got_dp, want_dp), 1e-6) << "dp is the fixed-order sum of the partials";

  // Padding rows: exact zeros in dz and hp. Rows past the live blocks: untouched.
  int64_t nonzero_padding = 0;
  for (int64_t r = 0; r < live_rows; ++r) {
    if (is_real_row(p, r)) continue;
    for (int i = 0; i < 2 * inter; ++i) nonzero_padding += dz[r * 2 * inter + i] != 0;
    for (int i = 0; i < inter; ++i) nonzero_padding += hp[r * inter + i] != 0;
  }
  EXPECT_EQ(nonzero_padding, 0) << "padding rows of dz / hp must be exact zeros";
  EXPECT_TRUE(std::all_of(dz.begin() + live_rows * 2 * inter, dz.end(), [](uint16_t v) { return v == kCPoison; }))
      << "dz rows past num_blocks were written";
  EXPECT_TRUE(std::all_of(hp.begin() + live_rows * inter, hp.end(), [](uint16_t v) { return v == kCPoison; }))
      << "hp rows past num_blocks were written";
  EXPECT_TRUE(std::all_of(dpp.begin() + live_rows * cols, dpp.end(), [](float v) { return std::isnan(v); }))
      << "dp_partial rows past num_blocks were written";
  std::cout << "  swiglu_backward " << c.name << ": " << p.num_blocks << " blocks, rel error dz " << rz.rel_error
            << ", hp " << rh.rel_error << ", dp_partial " << rp << "\n";

  // Deterministic: a second run gives the same bits.
  ASSERT_EQ(megamoe_grouped_gemm_gated_backward_bf16(&d.plan, &args, nullptr), MEGAMOE_OK);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(dz_dev.download() == dz && hp_dev.download() == hp) << "not deterministic";
  const std::vector<float> dpp2 = dpp_dev.download();
  EXPECT_EQ(std::memcmp(dpp2.data(), dpp.data(), dpp.size() * 4), 0) << "dp_partial not deterministic";
  EXPECT_TRUE(z_dev.download() == z) << "z was written";

  // dy's rows read from its token rows by the producer (gather_a) instead of the pool: the same bits
  // (dp_partial on the real rows: a pool's NaN padding rows give NaN partials there, never read).
  DeviceBuffer<uint16_t> dy_tokens_dev(dy_tokens.size());
  dy_tokens_dev.upload(dy_tokens);
  megamoe_gated_backward_args gathered = args;
  gathered.dy_pool = dy_tokens_dev.ptr;
  gathered.gather_a = 1;
  ASSERT_EQ(cudaMemset(dz_dev.ptr, 0xFF, dz_dev.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(hp_dev.ptr, 0xFF, hp_dev.count * 2), cudaSuccess);
  ASSERT_EQ(megamoe_grouped_gemm_gated_backward_bf16(&d.plan, &gathered, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(dz_dev.download() == dz && hp_dev.download() == hp) << "gathered dy: dz or hp differ from the pool's";
  const std::vector<float> dpp_gathered = dpp_dev.download();
  int64_t dpp_differ = 0;
  for (const CheckedRow& row : real) {
    dpp_differ += std::memcmp(&dpp_gathered[row.pool_row * cols], &dpp[row.pool_row * cols], cols * 4) != 0;
  }
  EXPECT_EQ(dpp_differ, 0) << "gathered dy: dp_partial differs from the pool's on real rows";
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluBackwardTest, ::testing::ValuesIn(swiglu_backward_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(GroupedGemmSwigluBackwardValidation, RejectsBadArguments) {
  using Args = megamoe_gated_backward_args;
  void* p = check_buf;
  auto* fp = reinterpret_cast<float*>(check_buf);
  const Args args{p, p, p, fp, p, p, fp, 256, 256, MEGAMOE_ACTIVATION_SWIGLU};
  expect_rejections<Args>(
      megamoe_grouped_gemm_gated_backward_bf16, unread_plan(), args,
      {
          {[](auto&, auto& a) { a.dy_pool = nullptr; }, "dy_pool must be non-null"},
          {[](auto&, auto& a) { a.w2 = nullptr; }, "w2 must be non-null"},
          {[](auto&, auto& a) { a.z = nullptr; }, "z must be non-null"},
          {[](auto&, auto& a) { a.p_pool = nullptr; }, "p_pool must be non-null"},
          {[](auto&, auto& a) { a.dz = nullptr; }, "dz must be non-null"},
          {[](auto&, auto& a) { a.hp = nullptr; }, "hp must be non-null"},
          {[](auto&, auto& a) { a.dp_partial = nullptr; }, "dp_partial must be non-null"},
          {[](auto& pl, auto&) { pl.block_expert = nullptr; },
           "the plan's block_expert and num_blocks must be non-null"},
          {[](auto&, auto& a) { a.intermediate = 204; },
           "intermediate must be a positive multiple of 8 (16-byte bf16 rows), got 204"},
          {[](auto&, auto& a) { a.hidden = 100; },
           "hidden must be a positive multiple of 8 (16-byte bf16 rows), got 100"},
          {[](auto&, auto& a) { a.z = check_buf + 4; }, "z must be 16-byte aligned"},
          {[](auto&, auto& a) { a.gather_a = 2; },
           "gather_a must be 0 (dy_pool is the pool) or 1 (the token rows), got 2"},
          {[](auto& pl, auto& a) {
             a.gather_a = 1;
             pl.slot_to_route = nullptr;
           },
           "gather_a needs the plan's slot_to_route"},
          {[](auto& pl, auto&) { pl.compact_offsets = nullptr; },
           "the plan's expert_offsets and compact_offsets must be non-null (z is compact)"},
          {[](auto&, auto& a) { a.dp_partial = reinterpret_cast<float*>(check_buf) + 1; },
           "dp_partial must be 16-byte aligned"},
          {[](auto& pl, auto&) { pl.shape = kHugePoolShape; }, "the plan's pool rows = 2147483776 exceeds"},
          {[](auto& pl, auto& a) {  // 4096 experts x 2^20 rows (K = hidden) of w2
             pl.shape.num_experts = pl.shape.num_local_experts = 4096;
             a.hidden = 1 << 20;
           },
           "the rows of w2 = 4294967296 exceeds the 32-bit row range"},
      });
  expect_activation_rejections<Args>(megamoe_grouped_gemm_gated_backward_bf16, args);
}

TEST(GroupedGemmSwigluBackwardValidation, Fp8RejectsBadArguments) {
  using Args = megamoe_gated_backward_fp8_args;
  void* p = check_buf;
  auto* fp = reinterpret_cast<float*>(check_buf);
  const Args args{p, fp, p, fp, p, fp, p, p, fp, p, fp, p, fp, p, fp, 256, 256, MEGAMOE_ACTIVATION_SWIGLU};
  expect_rejections<Args>(
      megamoe_grouped_gemm_gated_backward_fp8, unread_plan(), args,
      {
          {[](auto&, auto& a) { a.dy_pool = nullptr; }, "dy_pool must be non-null"},
          {[](auto&, auto& a) { a.w2t = nullptr; }, "w2t must be non-null"},
          {[](auto&, auto& a) { a.z = nullptr; }, "z must be non-null"},
          {[](auto&, auto& a) { a.dz = check_buf + 8; }, "dz must be 16-byte aligned"},  // optional in FP8
          {[](auto&, auto& a) { a.hp = check_buf + 8; }, "hp must be 16-byte aligned"},  // optional in FP8
          {[](auto&, auto& a) { a.dz_q = nullptr; }, "dz_q must be non-null"},
          {[](auto&, auto& a) { a.dz_scales = reinterpret_cast<float*>(check_buf) + 1; },
           "dz_scales must be 16-byte aligned"},
          {[](auto&, auto& a) { a.dz_t = nullptr; }, "dz_t must be non-null"},
          {[](auto&, auto& a) { a.dz_t_scales = reinterpret_cast<float*>(check_buf) + 1; },
           "dz_t_scales must be 16-byte aligned"},
          {[](auto&, auto& a) { a.hp_t = nullptr; }, "hp_t must be non-null"},
          {[](auto&, auto& a) { a.hp_t_scales = reinterpret_cast<float*>(check_buf) + 1; },
           "hp_t_scales must be 16-byte aligned"},
          {[](auto&, auto& a) { a.intermediate = 200; },
           "intermediate must be a positive multiple of 128 (block-FP8 scale blocks), got 200"},
      });
  expect_activation_rejections<Args>(megamoe_grouped_gemm_gated_backward_fp8, args);
}

TEST(DpReduceValidation, RejectsBadArguments) {
  using Args = megamoe_dp_reduce_args;
  auto* fp = reinterpret_cast<float*>(check_buf);
  const char* null_message = "dp_partial, dp and the plan's route_to_slot must be non-null";
  expect_rejections<Args>(megamoe_dp_reduce, unread_plan(), Args{fp, fp, 256},
                          {
                              {[](auto& pl, auto&) { pl.shape.num_tokens = -1; }, "num_tokens must be >= 0"},
                              {[](auto&, auto& a) { a.intermediate = 204; },
                               "intermediate must be a positive multiple of 8, got 204"},
                              {[](auto&, auto& a) { a.dp_partial = nullptr; }, null_message},
                              {[](auto&, auto& a) { a.dp = nullptr; }, null_message},
                              {[](auto& pl, auto&) { pl.route_to_slot = nullptr; }, null_message},
                          });
  megamoe_routing_plan no_routes{};  // T = 0: nothing to reduce, no array read
  no_routes.shape = {0, 8, 2, 0, 2};
  const Args nothing{nullptr, nullptr, 256};
  EXPECT_EQ(megamoe_dp_reduce(&no_routes, &nothing, nullptr), MEGAMOE_OK) << "no routes: a no-op";
}


// ---------------------------------------------------------------------------------------------
// Weight gradients: out[e] (+)= A[rows of e]ᵀ · B[rows of e], K-grouped over each expert's rows.
// ---------------------------------------------------------------------------------------------

// FusedCase fields n, k are the output's m (rows of out[e]) and n (columns) here.
std::vector<FusedCase> weight_grad_cases() {
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 51},
      {"m384_n384_partial_rank", 200, 3, 8, 2, 4, 384, 384, 52},  // N % 256 != 0: 128-wide tile
      {"long_k", 10000, 4, 8, 0, 8, 128, 256, 53},                // ~16000 rows on the hot expert
      {"qwen3_30b_dw13", 500, 8, 16, 4, 8, 1536, 2048, 54},       // m = 2I, n = H
      {"qwen3_30b_dw2", 500, 8, 16, 4, 8, 2048, 768, 55},         // m = H, n = I
      {"partial_m400_n136", 300, 2, 4, 0, 4, 400, 136, 56},       // m = 2I, n = H not multiples of the tile
      {"partial_m136_n200", 300, 3, 8, 2, 4, 136, 200, 57},       // m = H, n = I
  };
}

class WeightGradTest : public FusedTest {};

TEST_P(WeightGradTest, MatchesHostReference) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const FusedCase& c = GetParam();
  DevicePlan d(fused_shape(c));
  const Plan p = plan_for(c, d);
  if (HasFailure()) return;

  const int m = c.n, n = c.k, experts = c.local_experts;
  const int64_t rows = d.max_blocks * MEGAMOE_BLOCK_M, live_rows = int64_t(p.num_blocks) * MEGAMOE_BLOCK_M;
  const int64_t out_count = int64_t(experts) * m * n;
  // Real rows random; padding rows zero in the 64-row k-block of an expert's last real row (as
  // dispatch and the dh epilogue leave them) and NaN past it, like the rows past the live blocks:
  // outside every expert's K range, never read.
  std::mt19937 rng(c.seed * 7919u);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<bool> in_k_range(live_rows, false);
  for (int e = 0; e < experts; ++e) {
    const int64_t end = p.offsets[e] + (int64_t(p.counts[e]) + 63) / 64 * 64;
    for (int64_t r = p.offsets[e]; r < end; ++r) in_k_range[r] = true;
  }
  auto make = [&](int cols) {
    std::vector<uint16_t> v(rows * cols, kNaNPoison);
    for (int64_t r = 0; r < live_rows; ++r) {
      if (!in_k_range[r]) continue;
      for (int i = 0; i < cols; ++i) v[r * cols + i] = is_real_row(p, r) ? to_bf16(dist(rng)) : uint16_t(0);
    }
    return v;
  };
  const std::vector<uint16_t> a = make(m);
  // b's real rows are token rows of x [T, n], as the dispatch of x makes dW13's pool.
  std::vector<uint16_t> x(c.tokens * n);
  for (auto& v : x) v = to_bf16(dist(rng));
  std::vector<uint16_t> b(rows * n, kNaNPoison);
  for (int64_t r = 0; r < live_rows; ++r) {
    if (!in_k_range[r]) continue;
    const int64_t token = is_real_row(p, r) ? p.slot_to_route[r] / c.top_k : -1;
    for (int j = 0; j < n; ++j) b[r * n + j] = token >= 0 ? x[token * n + j] : uint16_t(0);
  }
  DeviceBuffer<uint16_t> a_dev(a.size()), b_dev(b.size()), out16(out_count);
  DeviceBuffer<float> out32(out_count);
  a_dev.upload(a);
  b_dev.upload(b);
  auto grad = [&](void* out, int32_t output) {
    const megamoe_weight_grad_args args{a_dev.ptr, b_dev.ptr, out, m, n, output};
    return megamoe_grouped_weight_grad_bf16(&d.plan, &args, nullptr);
  };

  // Host reference per expert over its real rows (fp32 dots, rows padded to a multiple of 8).
  const std::vector<float> af = to_float(a), bf = to_float(b);
  std::vector<float> want(out_count, 0.f);
  for (int e = 0; e < experts; ++e) {
    const int64_t r0 = p.offsets[e], cnt = p.counts[e], k8 = (cnt + 7) / 8 * 8;
    if (cnt == 0) continue;
    std::vector<float> at(m * k8, 0.f), bt(n * k8, 0.f);
    for (int64_t r = 0; r < cnt; ++r) {
      for (int i = 0; i < m; ++i) at[i * k8 + r] = af[(r0 + r) * m + i];
      for (int j = 0; j < n; ++j) bt[j * k8 + r] = bf[(r0 + r) * n + j];
    }
    parallel_for(m, [&](int64_t i) {
      for (int j = 0; j < n; ++j) {
        want[(int64_t(e) * m + i) * n + j] = float(dot(at.data() + i * k8, bt.data() + j * k8, int(k8)));
      }
    });
  }
  const int empty = fused_empty(c) - c.local_begin;
  auto check = [&](const std::vector<double>& got, const std::vector<float>& base, const char* what) {
    std::vector<double> g, w;
    double worst = 0;
    int worst_e = -1;
    for (int e = 0; e < experts; ++e) {
      std::vector<double> ge, we;
      for (int64_t x = int64_t(e) * m * n; x < int64_t(e + 1) * m * n; ++x) {
        ge.push_back(got[x] - (base.empty() ? 0.0 : base[x]));
        we.push_back(want[x]);
      }
      if (e == empty) {
        for (int64_t x = int64_t(e) * m * n; x < int64_t(e + 1) * m * n; ++x) {
          if (got[x] != (base.empty() ? 0.0 : base[x])) {
            ADD_FAILURE() << what << ": the empty expert's gradient must be " << (base.empty() ? "zero" : "unchanged");
            break;
          }
        }
        continue;
      }
      const double r = rel_error(ge, we);
      if (!(r <= worst)) worst = r, worst_e = e;
      g.insert(g.end(), ge.begin(), ge.end());
      w.insert(w.end(), we.begin(), we.end());
    }
    const double r = rel_error(g, w);
    EXPECT_LE(r, 1e-2) << what << ": worst expert " << worst_e << " rel " << worst;
    std::cout << "  weight_grad " << c.name << " " << what << ": rel error " << r << " (worst expert " << worst_e
              << ": " << worst << ")\n";
  };

  // bf16 out.
  ASSERT_EQ(cudaMemset(out16.ptr, 0xFF, out16.count * 2), cudaSuccess);
  ASSERT_EQ(grad(out16.ptr, MEGAMOE_GRAD_BF16), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> o16 = out16.download();
  {
    std::vector<double> got(out_count);
    for (int64_t x = 0; x < out_count; ++x) got[x] = from_bf16(o16[x]);
    check(got, {}, "bf16");
  }
  // fp32 out, overwrite (out poisoned with NaN).
  ASSERT_EQ(cudaMemset(out32.ptr, 0xFF, out32.count * 4), cudaSuccess);
  ASSERT_EQ(grad(out32.ptr, MEGAMOE_GRAD_FP32), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> o32 = out32.download();
  check(std::vector<double>(o32.begin(), o32.end()), {}, "fp32");
  // fp32 accumulate into an existing gradient.
  std::vector<float> base(out_count);
  for (auto& v : base) v = dist(rng);
  out32.upload(base);
  ASSERT_EQ(grad(out32.ptr, MEGAMOE_GRAD_FP32_ADD), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> acc = out32.download();
  check(std::vector<double>(acc.begin(), acc.end()), base, "fp32 accumulate");
  // Deterministic: the same bits again.
  ASSERT_EQ(grad(out32.ptr, MEGAMOE_GRAD_FP32), MEGAMOE_OK);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> again = out32.download();
  EXPECT_EQ(std::memcmp(again.data(), o32.data(), o32.size() * 4), 0) << "not deterministic";

  // Into columns [8, 8 + n) of a wider gradient (out_ld = n + 72): the same bits there as above, the
  // other columns untouched.
  const int ld = n + 72, col = 8;
  const int64_t wide_count = int64_t(experts) * m * ld;
  DeviceBuffer<uint16_t> wide16(wide_count);
  DeviceBuffer<float> wide32(wide_count);
  ASSERT_EQ(cudaMemset(wide16.ptr, 0x7F, wide_count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(wide32.ptr, 0x7F, wide_count * 4), cudaSuccess);
  for (auto [out, output] : {std::pair<void*, int32_t>{wide16.ptr + col, MEGAMOE_GRAD_BF16},
                             std::pair<void*, int32_t>{wide32.ptr + col, MEGAMOE_GRAD_FP32}}) {
    const megamoe_weight_grad_args args{a_dev.ptr, b_dev.ptr, out, m, n, output, ld};
    ASSERT_EQ(megamoe_grouped_weight_grad_bf16(&d.plan, &args, nullptr), MEGAMOE_OK) << megamoe_last_error();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> w16 = wide16.download();
  const std::vector<float> w32 = wide32.download();
  int64_t differ = 0, touched = 0;
  for (int64_t r = 0; r < int64_t(experts) * m; ++r) {
    for (int j = 0; j < ld; ++j) {
      const int64_t x = r * ld + j;
      uint32_t bits32;
      std::memcpy(&bits32, &w32[x], 4);
      if (j < col || j >= col + n) {
        touched += w16[x] != 0x7F7F || bits32 != 0x7F7F7F7Fu;
      } else {
        const int64_t y = r * n + (j - col);
        differ += w16[x] != o16[y] || std::memcmp(&w32[x], &o32[y], 4) != 0;
      }
    }
  }
  EXPECT_EQ(differ, 0) << "columns of a wider gradient differ from the gradient alone";
  EXPECT_EQ(touched, 0) << "columns outside [col, col + n) were written";

  // B's rows read from the token rows by the producer (gather_b) instead of the pool: the same bits.
  DeviceBuffer<uint16_t> x_dev(x.size());
  x_dev.upload(x);
  ASSERT_EQ(cudaMemset(out16.ptr, 0xFF, out16.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(out32.ptr, 0xFF, out32.count * 4), cudaSuccess);
  for (auto [out, output] : {std::pair<void*, int32_t>{out16.ptr, MEGAMOE_GRAD_BF16},
                             std::pair<void*, int32_t>{out32.ptr, MEGAMOE_GRAD_FP32}}) {
    const megamoe_weight_grad_args args{a_dev.ptr, x_dev.ptr, out, m, n, output, 0, 1};
    ASSERT_EQ(megamoe_grouped_weight_grad_bf16(&d.plan, &args, nullptr), MEGAMOE_OK) << megamoe_last_error();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(out16.download() == o16) << "bf16 gradient from gathered rows differs from the pool's";
  const std::vector<float> g32 = out32.download();
  EXPECT_EQ(std::memcmp(g32.data(), o32.data(), o32.size() * 4), 0)
      << "fp32 gradient from gathered rows differs from the pool's";

  // A's rows gathered the same way (gather_a, as dW2 reads dy): x_poolᵀ · x_pool [n, n] from the
  // token rows of A against both operands from the pool, the same bits.
  DeviceBuffer<float> square_pool(int64_t(experts) * n * n), square_gathered(int64_t(experts) * n * n);
  ASSERT_EQ(cudaMemset(square_gathered.ptr, 0xFF, square_gathered.count * 4), cudaSuccess);
  const megamoe_weight_grad_args from_pool{b_dev.ptr, b_dev.ptr, square_pool.ptr, n, n, MEGAMOE_GRAD_FP32};
  const megamoe_weight_grad_args from_rows{x_dev.ptr, b_dev.ptr, square_gathered.ptr, n, n, MEGAMOE_GRAD_FP32,
                                           0,         0,        1};
  ASSERT_EQ(megamoe_grouped_weight_grad_bf16(&d.plan, &from_pool, nullptr), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(megamoe_grouped_weight_grad_bf16(&d.plan, &from_rows, nullptr), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> sq_pool = square_pool.download(), sq_rows = square_gathered.download();
  EXPECT_EQ(std::memcmp(sq_rows.data(), sq_pool.data(), sq_pool.size() * 4), 0)
      << "gradient from gathered A rows differs from the pool's";
}

INSTANTIATE_TEST_SUITE_P(Shapes, WeightGradTest, ::testing::ValuesIn(weight_grad_cases()),
                         [](const auto& info) { return info.param.name; });

// No pool rows at all (a plan with no tokens): every expert is empty, so out is all zeros (no operand
// is read).
TEST(WeightGrad, EmptyPoolWritesZeros) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const int experts = 3, m = 256, n = 128;
  DevicePlan d(megamoe_routing_shape{0, 2, experts, 0, experts});
  const Plan p = build_plan({}, d);
  ASSERT_EQ(p.offsets, std::vector<int32_t>(experts + 1, 0));
  ASSERT_EQ(p.counts, std::vector<int32_t>(experts, 0));
  const int64_t rows = d.max_blocks * MEGAMOE_BLOCK_M;
  DeviceBuffer<uint16_t> a(rows * m), b(rows * n);
  DeviceBuffer<float> out(int64_t(experts) * m * n);
  ASSERT_EQ(cudaMemset(out.ptr, 0xFF, out.count * 4), cudaSuccess);
  const megamoe_weight_grad_args args{a.ptr, b.ptr, out.ptr, m, n, MEGAMOE_GRAD_FP32};
  ASSERT_EQ(megamoe_grouped_weight_grad_bf16(&d.plan, &args, nullptr), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto o = out.download();
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return v == 0.f; }));
}

TEST(WeightGradValidation, RejectsBadArguments) {
  using Args = megamoe_weight_grad_args;
  void* p = check_buf;
  const char* plan_arrays = "the plan's expert_offsets and expert_counts must be non-null";
  expect_rejections<Args>(
      megamoe_grouped_weight_grad_bf16, unread_plan(), Args{p, p, p, 256, 256, MEGAMOE_GRAD_FP32},
      {
          {[](auto&, auto& a) { a.a_pool = nullptr; }, "a_pool must be non-null"},
          {[](auto&, auto& a) { a.b_pool = nullptr; }, "b_pool must be non-null"},
          {[](auto&, auto& a) { a.out = nullptr; }, "out must be non-null"},
          {[](auto& pl, auto&) { pl.expert_offsets = nullptr; }, plan_arrays},
          {[](auto& pl, auto&) { pl.expert_counts = nullptr; }, plan_arrays},
          {[](auto&, auto& a) { a.m = 0; }, "m must be a positive multiple of 8 (16-byte bf16 rows), got 0"},
          {[](auto&, auto& a) { a.n = 196; }, "n must be a positive multiple of 8 (16-byte bf16 rows), got 196"},
          {[](auto&, auto& a) { a.gather_b = 3; },
           "gather_b must be 0 (b_pool is the pool) or 1 (the token rows), got 3"},
          {[](auto&, auto& a) { a.gather_a = -1; },
           "gather_a must be 0 (a_pool is the pool) or 1 (the token rows), got -1"},
          {[](auto&, auto& a) { a.gather_a = a.gather_b = 1; },
           "gather_a and gather_b cannot both be 1 (one operand is gathered at most)"},
          {[](auto& pl, auto& a) {
             a.gather_a = 1;
             pl.slot_to_route = nullptr;
           },
           "gather_a needs the plan's slot_to_route"},
          {[](auto& pl, auto& a) {
             a.gather_b = 1;
             pl.slot_to_route = nullptr;
           },
           "gather_b needs the plan's slot_to_route"},
          {[](auto& pl, auto&) { pl.shape = kHugePoolShape; }, "the plan's pool rows = 2147483776 exceeds"},
          {[](auto& pl, auto& a) {
             pl.shape.num_experts = pl.shape.num_local_experts = 4096;
             a.m = 1 << 20;
           },
           "num_local_experts * m (the rows of out) = 4294967296 exceeds"},
          {[](auto&, auto& a) { a.output = 3; },
           "output must be MEGAMOE_GRAD_BF16, MEGAMOE_GRAD_FP32 or MEGAMOE_GRAD_FP32_ADD, got 3"},
          {[](auto&, auto& a) { a.output = -1; },
           "output must be MEGAMOE_GRAD_BF16, MEGAMOE_GRAD_FP32 or MEGAMOE_GRAD_FP32_ADD, got -1"},
          {[](auto&, auto& a) { a.out_ld = 248; },
           "out_ld must be 0 (n) or a multiple of 8 no smaller than n = 256, got 248"},
          {[](auto&, auto& a) { a.out_ld = 260; },
           "out_ld must be 0 (n) or a multiple of 8 no smaller than n = 256, got 260"},
          {[](auto&, auto& a) { a.a_pool = check_buf + 2; }, "a_pool must be 16-byte aligned"},
          {[](auto&, auto& a) { a.out = check_buf + 8; }, "out must be 16-byte aligned"},
      });
}

TEST(WeightGradValidation, Fp8RejectsBadArguments) {
  using Args = megamoe_weight_grad_fp8_args;
  void* p = check_buf;
  auto* fp = reinterpret_cast<float*>(check_buf);
  const char* fp8_sizes = " must be a positive multiple of 128 (block-FP8 scale blocks), got ";
  const std::string m_message = std::string("m") + fp8_sizes + "200";
  const std::string n_message = std::string("n") + fp8_sizes + "72";
  expect_rejections<Args>(
      megamoe_grouped_weight_grad_fp8, unread_plan(), Args{p, fp, p, fp, p, 256, 256, MEGAMOE_GRAD_FP32},
      {
          {[](auto&, auto& a) { a.a_t = nullptr; }, "a_t must be non-null"},
          {[](auto&, auto& a) { a.b_t = nullptr; }, "b_t must be non-null"},
          {[](auto&, auto& a) { a.a_scales = nullptr; }, "a_scales must be non-null"},
          {[](auto&, auto& a) { a.b_scales = nullptr; }, "b_scales must be non-null"},
          {[](auto&, auto& a) { a.out = nullptr; }, "out must be non-null"},
          {[](auto& pl, auto&) { pl.expert_offsets = nullptr; }, "the plan's expert_offsets and expert_counts"},
          {[](auto&, auto& a) { a.m = 200; }, m_message.c_str()},
          {[](auto&, auto& a) { a.n = 72; }, n_message.c_str()},
          {[](auto&, auto& a) { a.output = 3; }, "output must be MEGAMOE_GRAD_BF16"},
          {[](auto&, auto& a) { a.b_t = check_buf + 8; }, "b_t must be 16-byte aligned"},
      });
}

}  // namespace
