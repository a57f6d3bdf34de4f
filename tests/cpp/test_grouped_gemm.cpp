// Grouped GEMM over a routing plan's pool: every real row of every live block against a host fp32
// reference, poison where nothing may be read or written, and argument validation (no GPU needed).
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/megamoe.h"
#include "gemm_test_util.h"

namespace {

using namespace megamoe_test;

struct GemmCase {
  std::string name;
  int64_t tokens;
  int top_k;
  int experts;
  int n, k;
  uint32_t seed;
};

void PrintTo(const GemmCase& c, std::ostream* os) { *os << c.name; }

// Expert 0 takes ~40% of the routes (many blocks), expert E/2 none (an empty expert between
// others, so block_expert skips it), the rest share the remainder; counts are random, so last
// blocks are partially filled.
int empty_expert(const GemmCase& c) { return c.experts / 2; }

std::vector<int32_t> make_ids(const GemmCase& c) {
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<int> other(1, c.experts - 2);  // skips the empty expert below
  std::vector<int32_t> ids(c.tokens * c.top_k);
  for (auto& id : ids) {
    const int e = other(rng);
    id = u(rng) < 0.4 ? 0 : (e >= empty_expert(c) ? e + 1 : e);
  }
  return ids;
}

std::vector<GemmCase> cases() {
  return {
      {"small_k128", 300, 2, 4, 256, 128, 1},
      {"small_k512", 300, 2, 4, 256, 512, 2},
      {"small_k640", 200, 3, 4, 256, 640, 3},  // 10 k-blocks: not a multiple of the stage count
      {"n384_block_n128", 300, 2, 4, 384, 256, 4},  // N % 256 != 0: the 128-wide tile
      // More tiles than SMs with few k-blocks each: the stage ring wraps across tiles many times.
      {"many_tiles", 10000, 4, 8, 256, 128, 5},
      {"many_tiles_n384", 10000, 4, 8, 384, 128, 6},
      {"qwen3_30b_gemm1", 1000, 3, 8, 1536, 2048, 7},  // target-like: N=1536, K=2048
      // N and K not multiples of the tile: the last n-tile and k-block reach past them.
      {"partial_n200_k136", 300, 2, 4, 200, 136, 8},
      // At most 128 routes per expert: the blocks whose rows 64..127 are all padding skip them.
      {"small_pool", 300, 2, 16, 256, 256, 9},
  };
}

// A case's routing plan, built on the GPU before each test (skipped without one): host copies in p,
// the plan the kernels take in d->plan.
class PoolGemmTest : public ::testing::TestWithParam<GemmCase> {
 protected:
  void SetUp() override {
    if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
    const GemmCase& c = GetParam();
    d.emplace(megamoe_routing_shape{c.tokens, c.top_k, c.experts, 0, c.experts});
    max_blocks = d->max_blocks;
    p = build_plan(make_ids(c), *d);
    if (HasFailure()) GTEST_FAIL() << "building the routing plan failed";
  }

  int64_t max_blocks = 0;
  std::optional<DevicePlan> d;
  Plan p;
};

class GroupedGemmTest : public PoolGemmTest {};

TEST_P(GroupedGemmTest, MatchesHostReference) {
  const GemmCase& c = GetParam();

  // The routing must give what this test is meant to cover.
  const int64_t hot_blocks = (p.counts[0] + MEGAMOE_BLOCK_M - 1) / MEGAMOE_BLOCK_M;
  ASSERT_EQ(p.counts[empty_expert(c)], 0) << "an empty expert";
  ASSERT_GE(hot_blocks, 2) << "an expert with several blocks";
  ASSERT_TRUE(std::any_of(p.counts.begin(), p.counts.end(), [](int32_t n) { return n % MEGAMOE_BLOCK_M != 0; }))
      << "a partially filled block";
  ASSERT_LT(p.num_blocks, max_blocks) << "blocks past num_blocks to keep untouched";

  // A: real rows random, padding rows of live blocks and every row past them NaN. B random.
  const int n = c.n, k = c.k;
  std::mt19937 rng(c.seed * 7919u);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> a(max_blocks * MEGAMOE_BLOCK_M * k, kNaNPoison);
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    if (!is_real_row(p, row)) continue;
    for (int i = 0; i < k; ++i) a[row * k + i] = to_bf16(dist(rng));
  }
  std::vector<uint16_t> b(int64_t(c.experts) * n * k);
  for (auto& v : b) v = to_bf16(dist(rng));
  DeviceBuffer<uint16_t> a_dev(a.size()), b_dev(b.size()), c_dev(max_blocks * MEGAMOE_BLOCK_M * n);
  a_dev.upload(a);
  b_dev.upload(b);
  ASSERT_EQ(cudaMemset(c_dev.ptr, 0xFF, c_dev.count * 2), cudaSuccess);  // kCPoison everywhere

  const megamoe_gemm_args args{a_dev.ptr, b_dev.ptr, c_dev.ptr, n, k};
  ASSERT_EQ(megamoe_grouped_gemm_bf16(&d->plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> out = c_dev.download();

  const std::vector<float> af = to_float(a), bf = to_float(b);
  const Comparison r = compare_rows(
      p, n, real_rows(p),
      [&](int64_t row, int col) {
        return dot(af.data() + row * k, bf.data() + (int64_t(p.block_expert[row / MEGAMOE_BLOCK_M]) * n + col) * k, k);
      },
      out);
  EXPECT_EQ(r.non_finite, 0) << "worst tiles:" << r.worst;
  EXPECT_LE(r.rel_error, 1e-2) << "worst tiles:" << r.worst;
  RecordProperty("rel_error", std::to_string(r.rel_error));
  std::cout << "  " << c.name << ": " << p.num_blocks << " blocks, rel error " << r.rel_error << "\n";

  const size_t live = size_t(p.num_blocks) * MEGAMOE_BLOCK_M * n;
  EXPECT_TRUE(std::all_of(out.begin() + live, out.end(), [](uint16_t v) { return v == kCPoison; }))
      << "rows past num_blocks were written";

  // num_blocks is read on the device: one block fewer leaves the last live block untouched and
  // the others bit-identical (the kernel is deterministic).
  DeviceBuffer<int32_t> fewer(1);
  fewer.upload({p.num_blocks - 1});
  megamoe_routing_plan fewer_plan = d->plan;
  fewer_plan.num_blocks = fewer.ptr;
  ASSERT_EQ(cudaMemset(c_dev.ptr, 0xFF, c_dev.count * 2), cudaSuccess);
  ASSERT_EQ(megamoe_grouped_gemm_bf16(&fewer_plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> again = c_dev.download();
  const size_t kept = size_t(p.num_blocks - 1) * MEGAMOE_BLOCK_M * n;
  EXPECT_TRUE(std::equal(again.begin(), again.begin() + kept, out.begin())) << "not deterministic";
  EXPECT_TRUE(std::all_of(again.begin() + kept, again.end(), [](uint16_t v) { return v == kCPoison; }))
      << "a block at or past *num_blocks was written";
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Block FP8: e4m3 operands drawn from [-8, 8] (so every k-block mixes magnitudes), per-(row,
// k-block) A scales and per-(128 x 128 block) B scales from [0.01, 0.1]. The reference sums the
// exact products of the same e4m3 values in double, so the error is the kernel's fp32 sums and
// its one bf16 rounding. Padding rows and rows past the live blocks hold e4m3 NaN with NaN scales.
constexpr uint8_t kFp8NaN = 0x7F;

uint8_t to_e4m3(float f) { return __nv_fp8_e4m3(f).__x; }
float from_e4m3(uint8_t bits) {
  __nv_fp8_e4m3 v;
  v.__x = bits;
  return float(v);
}

class GroupedGemmFp8Test : public PoolGemmTest {};

TEST_P(GroupedGemmFp8Test, MatchesHostReference) {
  const GemmCase& c = GetParam();

  const int n = c.n, k = c.k, k_blocks = k / 128;
  const int64_t rows = max_blocks * MEGAMOE_BLOCK_M;
  std::mt19937 rng(c.seed * 104729u);
  std::uniform_real_distribution<float> value(-8.f, 8.f), scale(0.01f, 0.1f);
  std::vector<uint8_t> a(rows * k, kFp8NaN);
  std::vector<float> a_scales(int64_t(k_blocks) * rows, NAN);
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    if (!is_real_row(p, row)) continue;
    for (int i = 0; i < k; ++i) a[row * k + i] = to_e4m3(value(rng));
    for (int j = 0; j < k_blocks; ++j) a_scales[j * rows + row] = scale(rng);
  }
  std::vector<uint8_t> b(int64_t(c.experts) * n * k);
  for (auto& v : b) v = to_e4m3(value(rng));
  std::vector<float> b_scales(int64_t(c.experts) * (n / 128) * k_blocks);
  for (auto& s : b_scales) s = scale(rng);
  DeviceBuffer<uint8_t> a_dev(a.size()), b_dev(b.size());
  DeviceBuffer<float> a_scales_dev(a_scales.size()), b_scales_dev(b_scales.size());
  DeviceBuffer<uint16_t> c_dev(rows * n);
  a_dev.upload(a);
  b_dev.upload(b);
  a_scales_dev.upload(a_scales);
  b_scales_dev.upload(b_scales);
  ASSERT_EQ(cudaMemset(c_dev.ptr, 0xFF, c_dev.count * 2), cudaSuccess);
  const megamoe_gemm_fp8_args args{a_dev.ptr, a_scales_dev.ptr, b_dev.ptr, b_scales_dev.ptr, c_dev.ptr, n, k};
  ASSERT_EQ(megamoe_grouped_gemm_fp8(&d->plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> out = c_dev.download();

  std::vector<float> af(a.size()), bf(b.size());
  for (size_t i = 0; i < a.size(); ++i) af[i] = from_e4m3(a[i]);
  for (size_t i = 0; i < b.size(); ++i) bf[i] = from_e4m3(b[i]);
  const Comparison r = compare_rows(
      p, n, real_rows(p),
      [&](int64_t row, int col) {
        const int64_t e = p.block_expert[row / MEGAMOE_BLOCK_M];
        const float* x = af.data() + row * k;
        const float* w = bf.data() + (e * n + col) * k;
        double sum = 0;
        for (int j = 0; j < k_blocks; ++j) {
          double block = 0;
          for (int i = 128 * j; i < 128 * (j + 1); ++i) block += double(x[i]) * w[i];
          sum += block * a_scales[j * rows + row] * b_scales[(e * (n / 128) + col / 128) * k_blocks + j];
        }
        return sum;
      },
      out);
  EXPECT_EQ(r.non_finite, 0) << "worst tiles:" << r.worst;
  EXPECT_LE(r.rel_error, 1e-2) << "worst tiles:" << r.worst;
  std::cout << "  fp8 " << c.name << ": " << p.num_blocks << " blocks, rel error " << r.rel_error << "\n";
  const size_t live = size_t(p.num_blocks) * MEGAMOE_BLOCK_M * n;
  EXPECT_TRUE(std::all_of(out.begin() + live, out.end(), [](uint16_t v) { return v == kCPoison; }))
      << "rows past num_blocks were written";
}

// Block FP8 takes whole 128 x 128 scale blocks only; other sizes are refused (Fp8RejectsBadArguments).
std::vector<GemmCase> fp8_cases() {
  std::vector<GemmCase> out;
  for (const GemmCase& c : cases())
    if (c.n % 128 == 0 && c.k % 128 == 0) out.push_back(c);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmFp8Test, ::testing::ValuesIn(fp8_cases()),
                         [](const auto& info) { return info.param.name; });

// A plan with no tokens: 3 pool blocks (one per local expert), none live.
TEST(GroupedGemm, ZeroLiveBlocksWritesNothing) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  DevicePlan d(megamoe_routing_shape{0, 1, 3, 0, 3});
  const Plan p = build_plan({}, d);
  ASSERT_EQ(p.num_blocks, 0);
  ASSERT_EQ(p.block_expert, std::vector<int32_t>(3, -1));
  const int64_t max_blocks = d.max_blocks;
  const int n = 256, k = 128;
  DeviceBuffer<uint16_t> a(max_blocks * 128 * k), b(3 * n * k), c(max_blocks * 128 * n);
  ASSERT_EQ(cudaMemset(c.ptr, 0xFF, c.count * 2), cudaSuccess);
  const megamoe_gemm_args args{a.ptr, b.ptr, c.ptr, n, k};
  ASSERT_EQ(megamoe_grouped_gemm_bf16(&d.plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto out = c.download();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint16_t v) { return v == kCPoison; }));
}

// Validation happens before any CUDA call, so these run without a GPU. The pointers are never
// dereferenced.
TEST(GroupedGemmValidation, RejectsBadArguments) {
  using Args = megamoe_gemm_args;
  void* p = check_buf;
  const char* plan_arrays = "the plan's block_expert and num_blocks must be non-null";
  expect_rejections<Args>(
      megamoe_grouped_gemm_bf16, unread_plan(), Args{p, p, p, 256, 256},
      {
          {[](auto&, auto& a) { a.a = nullptr; }, "a must be non-null"},
          {[](auto&, auto& a) { a.b = nullptr; }, "b must be non-null"},
          {[](auto&, auto& a) { a.c = nullptr; }, "c must be non-null"},
          {[](auto& pl, auto&) { pl.block_expert = nullptr; }, plan_arrays},
          {[](auto& pl, auto&) { pl.num_blocks = nullptr; }, plan_arrays},
          {[](auto&, auto& a) { a.n = 0; }, "n must be a positive multiple of 8 (16-byte bf16 rows), got 0"},
          {[](auto&, auto& a) { a.n = 100; }, "n must be a positive multiple of 8 (16-byte bf16 rows), got 100"},
          {[](auto&, auto& a) { a.n = -128; }, "n must be a positive multiple of 8 (16-byte bf16 rows), got -128"},
          {[](auto&, auto& a) { a.k = 0; }, "k must be a positive multiple of 8 (16-byte bf16 rows), got 0"},
          {[](auto&, auto& a) { a.k = 92; }, "k must be a positive multiple of 8 (16-byte bf16 rows), got 92"},
          {[](auto&, auto& a) { a.a = check_buf + 2; }, "a must be 16-byte aligned"},
          {[](auto&, auto& a) { a.c = check_buf + 8; }, "c must be 16-byte aligned"},
          {[](auto& pl, auto&) { pl.shape = kHugePoolShape; }, "the plan's pool rows = 2147483776 exceeds"},
          // 2^22 + 2 blocks (T = 2^29) x 1024 n-tiles: the tile counter's 32 bits.
          {[](auto& pl, auto& a) {
             pl.shape.num_tokens = 1 << 29;
             pl.shape.top_k = 1;
             a.n = 1 << 17;
           },
           "the plan's blocks x n-tiles = 4294969344 exceeds"},
          {[](auto& pl, auto& a) {
             pl.shape.num_experts = pl.shape.num_local_experts = 4096;
             a.n = 1 << 20;
           },
           "the rows of b = 4294967296 exceeds the 32-bit row range"},
      });
}

TEST(GroupedGemmValidation, Fp8RejectsBadArguments) {
  using Args = megamoe_gemm_fp8_args;
  void* p = check_buf;
  const auto* fp = reinterpret_cast<const float*>(check_buf);
  expect_rejections<Args>(
      megamoe_grouped_gemm_fp8, unread_plan(), Args{p, fp, p, fp, p, 256, 256},
      {
          {[](auto&, auto& a) { a.a_scales = nullptr; }, "a_scales must be non-null"},
          {[](auto&, auto& a) { a.b_scales = nullptr; }, "b_scales must be non-null"},
          {[](auto&, auto& a) { a.a = nullptr; }, "a must be non-null"},
          {[](auto&, auto& a) { a.c = nullptr; }, "c must be non-null"},
          {[](auto&, auto& a) { a.k = 192; }, "k must be a positive multiple of 128 (block-FP8 scale blocks), got 192"},
          {[](auto&, auto& a) { a.a_scales = reinterpret_cast<const float*>(check_buf + 4); },
           "a_scales must be 16-byte aligned"},
      });
}

// A plan with no tokens has no live block (its pool still has one block per local expert): every
// pool GEMM accepts it and writes nothing. num_blocks is read on the device, so this needs a GPU.
TEST(GroupedGemmValidation, EmptyPoolIsANoOp) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  DevicePlan d(megamoe_routing_shape{0, 2, 2, 0, 2});
  const Plan plan = build_plan({}, d);
  ASSERT_EQ(plan.num_blocks, 0);
  const int n = 256, k = 256, experts = 2;
  const int64_t rows = d.max_blocks * MEGAMOE_BLOCK_M;
  // Inputs (never read) and outputs (all must stay kCPoison), sized for the largest use.
  DeviceBuffer<uint16_t> in(std::max(rows, int64_t(experts) * 2 * n) * 2 * k), out(rows * 2 * n), out2(rows * 2 * n);
  DeviceBuffer<float> scales(rows * (k / 128)), dp_partial(rows * MEGAMOE_DP_PARTIAL_COLS(n));
  void* x = in.ptr;
  const float* f = scales.ptr;
  auto expect_no_op = [&](const char* what, int status) {
    EXPECT_EQ(status, MEGAMOE_OK) << what << ": " << megamoe_last_error();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    const std::vector<uint16_t> o = out.download(), o2 = out2.download();
    const std::vector<float> dpp = dp_partial.download();
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](uint16_t v) { return v == kCPoison; })) << what << " wrote";
    EXPECT_TRUE(std::all_of(o2.begin(), o2.end(), [](uint16_t v) { return v == kCPoison; })) << what << " wrote";
    EXPECT_TRUE(std::all_of(dpp.begin(), dpp.end(), [](float v) { return std::isnan(v); })) << what << " wrote";
  };
  ASSERT_EQ(cudaMemset(out.ptr, 0xFF, out.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(out2.ptr, 0xFF, out2.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(dp_partial.ptr, 0xFF, dp_partial.count * 4), cudaSuccess);

  const megamoe_gemm_args gemm{x, x, out.ptr, n, k};
  expect_no_op("bf16", megamoe_grouped_gemm_bf16(&d.plan, &gemm, nullptr));
  const megamoe_gemm_fp8_args fp8{x, f, x, f, out.ptr, n, k};
  expect_no_op("fp8", megamoe_grouped_gemm_fp8(&d.plan, &fp8, nullptr));
  const megamoe_gated_gemm_args gated{x, x, out.ptr, out2.ptr, n, k, MEGAMOE_ACTIVATION_SWIGLU};
  expect_no_op("gated", megamoe_grouped_gemm_gated_bf16(&d.plan, &gated, nullptr));
  const megamoe_gated_backward_args backward{x, x, x, f, out2.ptr, out.ptr, dp_partial.ptr, n, k,
                                             MEGAMOE_ACTIVATION_SWIGLU};
  expect_no_op("gated backward", megamoe_grouped_gemm_gated_backward_bf16(&d.plan, &backward, nullptr));
  for (const int32_t layout : {MEGAMOE_B_N_BY_K, MEGAMOE_B_K_BY_N}) {
    const megamoe_scatter_gemm_args scatter{x, x, out.ptr, nullptr, 8, n, k, layout};
    expect_no_op("scatter", megamoe_grouped_gemm_scatter_bf16(&d.plan, &scatter, nullptr));
  }
}

// ---------------------------------------------------------------------------------------------
// Fused epilogues: GEMM1 + SwiGLU, GEMM2 + scatter to combine slots.
// ---------------------------------------------------------------------------------------------


std::vector<FusedCase> swiglu_cases() {
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 11},
      {"i384_h640_partial_rank", 200, 3, 8, 2, 4, 384, 640, 12},  // odd tile count, 10 k-blocks
      {"many_tiles", 10000, 4, 8, 0, 8, 128, 128, 13},
      {"qwen3_30b", 500, 8, 16, 4, 8, 768, 2048, 14},  // I = 768, H = 2048, ~2700 rows
      // I and H not multiples of the tile: the last tile's gate box reaches into the up rows.
      {"partial_i200_h136", 300, 2, 4, 0, 4, 200, 136, 15},
      {"partial_i328_h392", 300, 3, 8, 2, 4, 328, 392, 16},
      {"small_pool", 300, 2, 16, 0, 16, 256, 256, 17},  // half-padding blocks skip their second half
  };
}

std::vector<FusedCase> scatter_cases() {
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 21},
      {"n384_k640_partial_rank", 200, 3, 8, 2, 4, 384, 640, 22},  // N % 256 != 0: 128-wide tile
      {"many_tiles", 10000, 4, 8, 0, 8, 256, 128, 23},
      {"qwen3_30b", 500, 8, 16, 4, 8, 2048, 768, 24},  // H = 2048, I = 768
      {"partial_n200_k136", 300, 2, 4, 0, 4, 200, 136, 25},  // N and K not multiples of the tile
      {"small_pool", 300, 2, 16, 0, 16, 256, 256, 26},  // half-padding blocks skip their second half
  };
}

class SwigluTest : public FusedTest {};

TEST_P(SwigluTest, MatchesHostReference) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const FusedCase& c = GetParam();
  DevicePlan d(fused_shape(c));
  const Plan p = plan_for(c, d);
  if (HasFailure()) return;

  const int inter = c.n, hidden = c.k;
  std::mt19937 rng(c.seed * 7919u);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> x(c.tokens * hidden);  // token rows, dispatched into the pool here on the host
  for (auto& v : x) v = to_bf16(dist(rng));
  const std::vector<uint16_t> a = pool_of_tokens(p, x, hidden, c.top_k);
  const std::vector<uint16_t> w13 = make_weights(int64_t(c.local_experts) * 2 * inter * hidden, hidden, rng);
  DeviceBuffer<uint16_t> a_dev(a.size()), w_dev(w13.size()), h_dev(d.max_blocks * MEGAMOE_BLOCK_M * inter);
  a_dev.upload(a);
  w_dev.upload(w13);
  ASSERT_EQ(cudaMemset(h_dev.ptr, 0xFF, h_dev.count * 2), cudaSuccess);  // kCPoison everywhere
  megamoe_gated_gemm_args args{a_dev.ptr, w_dev.ptr, h_dev.ptr, nullptr, inter, hidden, MEGAMOE_ACTIVATION_SWIGLU};
  ASSERT_EQ(megamoe_grouped_gemm_gated_bf16(&d.plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> out = h_dev.download();

  const std::vector<float> af = to_float(a), wf = to_float(w13);
  // z[row, col]: col < I is gate column col, col >= I up column col - I (both fp32 dots).
  const auto z_ref = [&](int64_t row, int col) {
    const float* x = af.data() + row * hidden;
    const float* w = wf.data() + int64_t(p.block_expert[row / MEGAMOE_BLOCK_M]) * 2 * inter * hidden;
    return float(dot(x, w + int64_t(col) * hidden, hidden));
  };
  const Comparison r = compare_rows(
      p, inter, real_rows(p),
      [&](int64_t row, int col) {
        const float g = z_ref(row, col), u = z_ref(row, inter + col);
        return double(g / (1.0f + std::exp(-g)) * u);
      },
      out);
  EXPECT_EQ(r.non_finite, 0) << "worst tiles:" << r.worst;
  EXPECT_LE(r.rel_error, 1e-2) << "worst tiles:" << r.worst;
  std::cout << "  swiglu " << c.name << ": " << p.num_blocks << " blocks, rel error " << r.rel_error << "\n";
  const size_t live = size_t(p.num_blocks) * MEGAMOE_BLOCK_M * inter;
  EXPECT_TRUE(std::all_of(out.begin() + live, out.end(), [](uint16_t v) { return v == kCPoison; }))
      << "rows past num_blocks were written";

  // Keeping z for the backward: the same h bit for bit, and z = g | u in compact rows (one per
  // route, no padding rows), through 16-row boxes and the one-row stores of each expert's last rows.
  const int64_t routes = d.plan.shape.num_tokens * d.plan.shape.top_k;
  DeviceBuffer<uint16_t> z_dev(routes * 2 * inter);
  ASSERT_EQ(cudaMemset(h_dev.ptr, 0xFF, h_dev.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(z_dev.ptr, 0xFF, z_dev.count * 2), cudaSuccess);
  args.z = z_dev.ptr;
  ASSERT_EQ(megamoe_grouped_gemm_gated_bf16(&d.plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(h_dev.download() == out) << "h changed when z is kept";
  const std::vector<uint16_t> z = z_dev.download();
  const Comparison rz = compare_rows(p, 2 * inter, compact_rows(p), z_ref, z);
  EXPECT_EQ(rz.non_finite, 0) << "worst tiles:" << rz.worst;
  EXPECT_LE(rz.rel_error, 1e-2) << "worst tiles:" << rz.worst;
  const int64_t local_routes = p.compact_offsets.back();
  EXPECT_TRUE(std::all_of(z.begin() + 2 * inter * local_routes, z.end(), [](uint16_t v) { return v == kCPoison; }))
      << "z rows past the local routes were written";

  // A gathered from the token rows by GEMM1 itself (gather_a): the same h on every real row and the
  // same z, bit for bit; padding rows read zeros, so their h is 0; rows past the live blocks untouched.
  DeviceBuffer<uint16_t> x_dev(x.size());
  x_dev.upload(x);
  ASSERT_EQ(cudaMemset(h_dev.ptr, 0xFF, h_dev.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(z_dev.ptr, 0xFF, z_dev.count * 2), cudaSuccess);
  args.a = x_dev.ptr;
  args.gather_a = 1;
  ASSERT_EQ(megamoe_grouped_gemm_gated_bf16(&d.plan, &args, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> gathered = h_dev.download();
  int64_t differing_rows = 0, nonzero_padding_rows = 0;
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    const auto first = gathered.begin() + row * inter, last = first + inter;
    if (is_real_row(p, row)) {
      differing_rows += !std::equal(first, last, out.begin() + row * inter);
    } else {
      nonzero_padding_rows += !std::all_of(first, last, [](uint16_t v) { return v == 0; });
    }
  }
  EXPECT_EQ(differing_rows, 0) << "real rows of h differ from the pool's";
  EXPECT_EQ(nonzero_padding_rows, 0) << "padding rows of h are not zero";
  EXPECT_TRUE(std::all_of(gathered.begin() + live, gathered.end(), [](uint16_t v) { return v == kCPoison; }))
      << "rows past num_blocks were written";
  EXPECT_TRUE(z_dev.download() == z) << "z differs from the pool's";
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluTest, ::testing::ValuesIn(swiglu_cases()),
                         [](const auto& info) { return info.param.name; });

class ScatterTest : public FusedTest {};

TEST_P(ScatterTest, EveryRouteRowWrittenOnce) { check_scatter(MEGAMOE_B_N_BY_K); }  // w2 [E, N, K]

INSTANTIATE_TEST_SUITE_P(Shapes, ScatterTest, ::testing::ValuesIn(scatter_cases()),
                         [](const auto& info) { return info.param.name; });

// Validation happens before any CUDA call, so these run without a GPU.
TEST(GroupedGemmSwigluValidation, RejectsBadArguments) {
  using Args = megamoe_gated_gemm_args;
  void* p = check_buf;
  const char* plan_arrays = "the plan's block_expert and num_blocks must be non-null";
  const Args args{p, p, p, nullptr, 256, 256, MEGAMOE_ACTIVATION_SWIGLU};
  expect_rejections<Args>(
      megamoe_grouped_gemm_gated_bf16, unread_plan(), args,
      {
          {[](auto&, auto& a) { a.a = nullptr; }, "a must be non-null"},
          {[](auto&, auto& a) { a.w13 = nullptr; }, "w13 must be non-null"},
          {[](auto&, auto& a) { a.h = nullptr; }, "h must be non-null"},
          {[](auto& pl, auto&) { pl.block_expert = nullptr; }, plan_arrays},
          {[](auto&, auto& a) { a.intermediate = 0; },
           "intermediate must be a positive multiple of 8 (16-byte bf16 rows), got 0"},
          {[](auto&, auto& a) { a.intermediate = 204; },
           "intermediate must be a positive multiple of 8 (16-byte bf16 rows), got 204"},
          {[](auto&, auto& a) { a.hidden = 100; },
           "hidden must be a positive multiple of 8 (16-byte bf16 rows), got 100"},
          {[](auto&, auto& a) { a.hidden = -128; },
           "hidden must be a positive multiple of 8 (16-byte bf16 rows), got -128"},
          {[](auto&, auto& a) { a.w13 = check_buf + 4; }, "w13 must be 16-byte aligned"},
          {[](auto&, auto& a) { a.z = check_buf + 4; }, "z must be 16-byte aligned"},
          {[](auto& pl, auto& a) {
             a.z = check_buf;
             pl.compact_offsets = nullptr;
           },
           "the plan's expert_offsets and compact_offsets must be non-null (z is compact)"},
          {[](auto& pl, auto&) { pl.shape = kHugePoolShape; }, "the plan's pool rows = 2147483776 exceeds"},
          {[](auto&, auto& a) { a.gather_a = 2; },
           "gather_a must be 0 (a is the pool) or 1 (the token rows), got 2"},
          {[](auto& pl, auto& a) {
             a.gather_a = 1;
             pl.slot_to_route = nullptr;
           },
           "gather_a needs the plan's slot_to_route"},
          {[](auto&, auto& a) {
             a.gather_a = 1;
             a.a = check_buf + 4;
           },
           "a must be 16-byte aligned"},
          {[](auto& pl, auto& a) {  // 2048 experts x 2 x 2^20 rows of w13
             pl.shape.num_experts = pl.shape.num_local_experts = 2048;
             a.intermediate = 1 << 20;
           },
           "the rows of w13 = 4294967296 exceeds the 32-bit row range"},
      });
  expect_activation_rejections<Args>(megamoe_grouped_gemm_gated_bf16, args);
}

TEST(GroupedGemmScatterValidation, RejectsBadArguments) { expect_scatter_rejections(MEGAMOE_B_N_BY_K, 1 << 20, 256); }

}  // namespace
