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
  };
}

// A case's routing plan, built on the GPU before each test (skipped without one): host copies in p,
// block_expert and num_blocks on the device for the kernels.
class PoolGemmTest : public ::testing::TestWithParam<GemmCase> {
 protected:
  void SetUp() override {
    if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
    const GemmCase& c = GetParam();
    const megamoe_routing_shape s{c.tokens, c.top_k, c.experts, 0, c.experts};
    max_blocks = megamoe_routing_max_blocks(&s);
    block_expert.emplace(max_blocks);
    num_blocks.emplace(1);
    DeviceBuffer<int32_t> slot_to_route(megamoe_routing_capacity(&s));
    p = build_plan(s, make_ids(c), *block_expert, *num_blocks, slot_to_route);
    if (HasFailure()) GTEST_FAIL() << "building the routing plan failed";
  }

  int64_t max_blocks = 0;
  std::optional<DeviceBuffer<int32_t>> block_expert, num_blocks;
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

  ASSERT_EQ(megamoe_grouped_gemm_bf16(a_dev.ptr, b_dev.ptr, c_dev.ptr, block_expert->ptr, num_blocks->ptr,
                                      max_blocks, n, k, c.experts, nullptr),
            MEGAMOE_OK)
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
  ASSERT_EQ(cudaMemset(c_dev.ptr, 0xFF, c_dev.count * 2), cudaSuccess);
  ASSERT_EQ(megamoe_grouped_gemm_bf16(a_dev.ptr, b_dev.ptr, c_dev.ptr, block_expert->ptr, fewer.ptr, max_blocks,
                                      n, k, c.experts, nullptr),
            MEGAMOE_OK)
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
  ASSERT_EQ(megamoe_grouped_gemm_fp8(a_dev.ptr, a_scales_dev.ptr, b_dev.ptr, b_scales_dev.ptr, c_dev.ptr,
                                     block_expert->ptr, num_blocks->ptr, max_blocks, n, k, c.experts, nullptr),
            MEGAMOE_OK)
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

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmFp8Test, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(GroupedGemm, ZeroLiveBlocksWritesNothing) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t max_blocks = 3;
  const int n = 256, k = 128;
  DeviceBuffer<uint16_t> a(max_blocks * 128 * k), b(n * k), c(max_blocks * 128 * n);
  DeviceBuffer<int32_t> block_expert(max_blocks), num_blocks(1);
  block_expert.upload({-1, -1, -1});
  num_blocks.upload({0});
  ASSERT_EQ(cudaMemset(c.ptr, 0xFF, c.count * 2), cudaSuccess);
  ASSERT_EQ(megamoe_grouped_gemm_bf16(a.ptr, b.ptr, c.ptr, block_expert.ptr, num_blocks.ptr, max_blocks, n, k, 1,
                                      nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto out = c.download();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint16_t v) { return v == kCPoison; }));
}

// Validation happens before any CUDA call, so these run without a GPU. The pointers are never
// dereferenced.
TEST(GroupedGemmValidation, RejectsBadArguments) {
  alignas(16) static char buf[64];
  void* p = buf;
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  struct Bad {
    const void* a;
    const void* b;
    void* c;
    const int32_t* block_expert;
    const int32_t* num_blocks;
    int64_t max_blocks;
    int32_t n, k, experts;
    const char* message;
  };
  const Bad bad[] = {
      {nullptr, p, p, ip, ip, 4, 256, 256, 2, "a, b and c must be non-null"},
      {p, nullptr, p, ip, ip, 4, 256, 256, 2, "a, b and c must be non-null"},
      {p, p, nullptr, ip, ip, 4, 256, 256, 2, "a, b and c must be non-null"},
      {p, p, p, nullptr, ip, 4, 256, 256, 2, "block_expert and num_blocks must be non-null"},
      {p, p, p, ip, nullptr, 4, 256, 256, 2, "block_expert and num_blocks must be non-null"},
      {p, p, p, ip, ip, 4, 0, 256, 2, "n must be a positive multiple of 128, got 0"},
      {p, p, p, ip, ip, 4, 100, 256, 2, "n must be a positive multiple of 128, got 100"},
      {p, p, p, ip, ip, 4, -128, 256, 2, "n must be a positive multiple of 128, got -128"},
      {p, p, p, ip, ip, 4, 256, 0, 2, "k must be a positive multiple of 128, got 0"},
      {p, p, p, ip, ip, 4, 256, 96, 2, "k must be a positive multiple of 128, got 96"},
      {p, p, p, ip, ip, 4, 256, 256, 0, "num_local_experts must be >= 1"},
      {p, p, p, ip, ip, -1, 256, 256, 2, "max_blocks must be >= 0"},
      {buf + 2, p, p, ip, ip, 4, 256, 256, 2, "16-byte aligned"},
      {p, p, buf + 8, ip, ip, 4, 256, 256, 2, "16-byte aligned"},
      {p, p, p, ip, ip, int64_t(1) << 25, 256, 256, 2, "exceeds the 32-bit row range"},
      {p, p, p, ip, ip, 4, 1 << 20, 256, 4096, "num_local_experts * n exceeds"},
  };
  for (const auto& x : bad) {
    expect_rejected(megamoe_grouped_gemm_bf16(x.a, x.b, x.c, x.block_expert, x.num_blocks, x.max_blocks, x.n, x.k,
                                              x.experts, nullptr),
                    x.message);
  }
}

TEST(GroupedGemmValidation, Fp8RejectsBadArguments) {
  alignas(16) static char buf[64];
  void* p = buf;
  const auto* fp = reinterpret_cast<const float*>(buf);
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  expect_rejected(megamoe_grouped_gemm_fp8(p, nullptr, p, fp, p, ip, ip, 4, 256, 256, 2, nullptr),
                  "a, a_scales, b, b_scales and c must be non-null");
  expect_rejected(megamoe_grouped_gemm_fp8(p, fp, p, nullptr, p, ip, ip, 4, 256, 256, 2, nullptr),
                  "a, a_scales, b, b_scales and c must be non-null");
  expect_rejected(megamoe_grouped_gemm_fp8(p, fp, p, fp, p, ip, ip, 4, 256, 192, 2, nullptr),
                  "k must be a positive multiple of 128, got 192");
  expect_rejected(megamoe_grouped_gemm_fp8(p, reinterpret_cast<const float*>(buf + 4), p, fp, p, ip, ip, 4, 256,
                                           256, 2, nullptr),
                  "16-byte aligned");
  EXPECT_EQ(megamoe_grouped_gemm_fp8(p, fp, p, fp, p, ip, ip, 0, 256, 256, 2, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
}

TEST(GroupedGemmValidation, EmptyPoolIsANoOp) {
  alignas(16) static char buf[64];
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  EXPECT_EQ(megamoe_grouped_gemm_bf16(buf, buf, buf, ip, ip, 0, 256, 256, 2, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
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
  };
}

std::vector<FusedCase> scatter_cases() {
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 21},
      {"n384_k640_partial_rank", 200, 3, 8, 2, 4, 384, 640, 22},  // N % 256 != 0: 128-wide tile
      {"many_tiles", 10000, 4, 8, 0, 8, 256, 128, 23},
      {"qwen3_30b", 500, 8, 16, 4, 8, 2048, 768, 24},  // H = 2048, I = 768
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
  const std::vector<uint16_t> a = make_pool(p, hidden, rng);
  const std::vector<uint16_t> w13 = make_weights(int64_t(c.local_experts) * 2 * inter * hidden, hidden, rng);
  DeviceBuffer<uint16_t> a_dev(a.size()), w_dev(w13.size()), h_dev(d.max_blocks * MEGAMOE_BLOCK_M * inter);
  a_dev.upload(a);
  w_dev.upload(w13);
  ASSERT_EQ(cudaMemset(h_dev.ptr, 0xFF, h_dev.count * 2), cudaSuccess);  // kCPoison everywhere
  ASSERT_EQ(megamoe_grouped_gemm_swiglu_bf16(a_dev.ptr, w_dev.ptr, h_dev.ptr, nullptr, d.block_expert.ptr,
                                             d.num_blocks.ptr, d.max_blocks, inter, hidden, c.local_experts, nullptr),
            MEGAMOE_OK)
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

  // Keeping z for the backward: the same h bit for bit, and z = g | u.
  DeviceBuffer<uint16_t> z_dev(d.max_blocks * MEGAMOE_BLOCK_M * 2 * inter);
  ASSERT_EQ(cudaMemset(h_dev.ptr, 0xFF, h_dev.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(z_dev.ptr, 0xFF, z_dev.count * 2), cudaSuccess);
  ASSERT_EQ(megamoe_grouped_gemm_swiglu_bf16(a_dev.ptr, w_dev.ptr, h_dev.ptr, z_dev.ptr, d.block_expert.ptr,
                                             d.num_blocks.ptr, d.max_blocks, inter, hidden, c.local_experts, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(h_dev.download() == out) << "h changed when z is kept";
  const std::vector<uint16_t> z = z_dev.download();
  const Comparison rz = compare_rows(p, 2 * inter, real_rows(p), z_ref, z);
  EXPECT_EQ(rz.non_finite, 0) << "worst tiles:" << rz.worst;
  EXPECT_LE(rz.rel_error, 1e-2) << "worst tiles:" << rz.worst;
  EXPECT_TRUE(std::all_of(z.begin() + 2 * live, z.end(), [](uint16_t v) { return v == kCPoison; }))
      << "z rows past num_blocks were written";
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluTest, ::testing::ValuesIn(swiglu_cases()),
                         [](const auto& info) { return info.param.name; });

class ScatterTest : public FusedTest {};

TEST_P(ScatterTest, EveryRouteRowWrittenOnce) { check_scatter(ScatterB::kNK); }  // w2 [E, N, K]

INSTANTIATE_TEST_SUITE_P(Shapes, ScatterTest, ::testing::ValuesIn(scatter_cases()),
                         [](const auto& info) { return info.param.name; });

// Validation happens before any CUDA call, so these run without a GPU.
TEST(GroupedGemmSwigluValidation, RejectsBadArguments) {
  alignas(16) static char buf[64];
  void* p = buf;
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  struct Bad {
    const void* a;
    const void* w;
    void* h;
    const int32_t* block_expert;
    int64_t max_blocks;
    int32_t inter, hidden, experts;
    const char* message;
  };
  const Bad bad[] = {
      {nullptr, p, p, ip, 4, 256, 256, 2, "a, w13 and h must be non-null"},
      {p, nullptr, p, ip, 4, 256, 256, 2, "a, w13 and h must be non-null"},
      {p, p, nullptr, ip, 4, 256, 256, 2, "a, w13 and h must be non-null"},
      {p, p, p, nullptr, 4, 256, 256, 2, "block_expert and num_blocks must be non-null"},
      {p, p, p, ip, 4, 0, 256, 2, "intermediate must be a positive multiple of 128, got 0"},
      {p, p, p, ip, 4, 200, 256, 2, "intermediate must be a positive multiple of 128, got 200"},
      {p, p, p, ip, 4, 256, 96, 2, "hidden must be a positive multiple of 128, got 96"},
      {p, p, p, ip, 4, 256, -128, 2, "hidden must be a positive multiple of 128, got -128"},
      {p, p, p, ip, 4, 256, 256, 0, "num_local_experts must be >= 1"},
      {p, p, p, ip, -1, 256, 256, 2, "max_blocks must be >= 0"},
      {p, buf + 4, p, ip, 4, 256, 256, 2, "16-byte aligned"},
      {p, p, p, ip, int64_t(1) << 25, 256, 256, 2, "exceeds the 32-bit row range"},
      {p, p, p, ip, 4, 1 << 20, 256, 2048, "num_local_experts * 2 * intermediate exceeds"},
  };
  for (const auto& x : bad) {
    expect_rejected(megamoe_grouped_gemm_swiglu_bf16(x.a, x.w, x.h, nullptr, x.block_expert, ip, x.max_blocks, x.inter,
                                                     x.hidden, x.experts, nullptr),
                    x.message);
  }
  EXPECT_EQ(megamoe_grouped_gemm_swiglu_bf16(p, p, p, buf + 4, ip, ip, 4, 256, 256, 2, nullptr),
            MEGAMOE_ERROR_INVALID_ARGUMENT)
      << "a misaligned z is rejected";
  EXPECT_EQ(megamoe_grouped_gemm_swiglu_bf16(p, p, p, p, ip, ip, 0, 256, 256, 2, nullptr), MEGAMOE_OK)
      << "an empty pool is a no-op: " << megamoe_last_error();
}

TEST(GroupedGemmScatterValidation, RejectsBadArguments) {
  expect_scatter_rejections(megamoe_grouped_gemm_scatter_bf16,
                            {"h, w2, out_rows and slot_to_route must be non-null",
                             "h, w2 and out_rows must be 16-byte aligned", 1 << 20, 256,
                             "num_local_experts * n exceeds"});
}

}  // namespace
