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
#include <string>
#include <vector>

#include "gemm_test_util.h"
#include "megamoe/megamoe.h"

namespace {

using namespace megamoe_test;

// [E, rows, cols] -> [E, cols, rows] (so a column of B is a contiguous row for dot()).
std::vector<float> transpose_experts(const std::vector<float>& b, int experts, int rows, int cols) {
  std::vector<float> t(b.size());
  for (int64_t e = 0; e < experts; ++e) {
    const float* src = b.data() + e * rows * cols;
    float* dst = t.data() + e * rows * cols;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) dst[int64_t(c) * rows + r] = src[int64_t(r) * cols + c];
    }
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// dx per route: out_rows[route] = A[slot] · B[e], B [E, K, N] (MN-major B).
// ---------------------------------------------------------------------------------------------

std::vector<FusedCase> scatter_mn_cases() {
  return {
      {"small", 300, 2, 4, 0, 4, 256, 256, 31},
      {"n384_k640_partial_rank", 200, 3, 8, 2, 4, 384, 640, 32},  // N % 256 != 0: 128-wide tile
      {"many_tiles", 10000, 4, 8, 0, 8, 256, 128, 33},
      {"qwen3_30b_dx", 500, 8, 16, 4, 8, 2048, 1536, 34},  // n = H = 2048, k = 2I = 1536
  };
}

class ScatterMnTest : public FusedTest {};

TEST_P(ScatterMnTest, EveryRouteRowWrittenOnce) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const FusedCase& c = GetParam();
  const megamoe_routing_shape shape = fused_shape(c);
  const int64_t max_blocks = megamoe_routing_max_blocks(&shape);
  DeviceBuffer<int32_t> block_expert(max_blocks), num_blocks(1), slot_to_route(megamoe_routing_capacity(&shape));
  const Plan p = plan_for(c, block_expert, num_blocks, slot_to_route);
  if (HasFailure()) return;

  const int n = c.n, k = c.k;
  const int64_t routes = c.tokens * c.top_k;
  std::mt19937 rng(c.seed * 7919u);
  const std::vector<uint16_t> a = make_pool(p, k, rng);
  const std::vector<uint16_t> b = make_weights(int64_t(c.local_experts) * k * n, k, rng);  // [E, K, N]
  DeviceBuffer<uint16_t> a_dev(a.size()), b_dev(b.size()), out_dev(routes * n);
  a_dev.upload(a);
  b_dev.upload(b);
  auto run = [&](int64_t num_out_rows) {
    EXPECT_EQ(cudaMemset(out_dev.ptr, 0xFF, out_dev.count * 2), cudaSuccess);  // kCPoison everywhere
    EXPECT_EQ(megamoe_grouped_gemm_scatter_mn_bf16(a_dev.ptr, b_dev.ptr, out_dev.ptr, slot_to_route.ptr,
                                                   block_expert.ptr, num_blocks.ptr, max_blocks, n, k,
                                                   c.local_experts, num_out_rows, nullptr),
              MEGAMOE_OK)
        << megamoe_last_error();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return out_dev.download();
  };
  auto poison_row = [&](const std::vector<uint16_t>& out, int64_t route) {
    return std::all_of(out.begin() + route * n, out.begin() + (route + 1) * n,
                       [](uint16_t v) { return v == kCPoison; });
  };

  const std::vector<uint16_t> out = run(routes);
  ASSERT_FALSE(HasFailure());
  std::vector<CheckedRow> rows;
  int64_t untouched = 0;
  for (int64_t route = 0; route < routes; ++route) {
    const int32_t slot = p.route_to_slot[route];
    if (slot >= 0) {
      rows.push_back({slot, route});
    } else {
      ++untouched;
      EXPECT_TRUE(poison_row(out, route)) << "masked / non-local route " << route << " was written";
    }
  }
  const std::vector<float> af = to_float(a), bt = transpose_experts(to_float(b), c.local_experts, k, n);
  const Comparison r = compare_rows(
      p, n, rows,
      [&](int64_t slot, int col) {
        const int64_t e = p.block_expert[slot / MEGAMOE_BLOCK_M];
        return dot(af.data() + slot * k, bt.data() + (e * n + col) * k, k);
      },
      out);
  EXPECT_EQ(r.non_finite, 0) << "worst tiles:" << r.worst;
  EXPECT_LE(r.rel_error, 1e-2) << "worst tiles:" << r.worst;
  std::cout << "  scatter_mn " << c.name << ": " << p.num_blocks << " blocks, " << rows.size()
            << " routes written, " << untouched << " untouched, rel error " << r.rel_error << "\n";

  const int64_t half = routes / 2;
  const std::vector<uint16_t> again = run(half);
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(std::equal(again.begin(), again.begin() + half * n, out.begin()))
      << "rows below num_out_rows differ (or the kernel is not deterministic)";
  for (int64_t route = half; route < routes; ++route) {
    EXPECT_TRUE(poison_row(again, route)) << "route " << route << " >= num_out_rows was written";
    if (HasFailure()) break;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ScatterMnTest, ::testing::ValuesIn(scatter_mn_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(GroupedGemmScatterMnValidation, RejectsBadArguments) {
  alignas(16) static char buf[64];
  void* p = buf;
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  struct Bad {
    const void* a;
    const void* b;
    void* out;
    const int32_t* slot_to_route;
    const int32_t* block_expert;
    int64_t max_blocks;
    int32_t n, k, experts;
    int64_t out_rows;
    const char* message;
  };
  const Bad bad[] = {
      {nullptr, p, p, ip, ip, 4, 256, 256, 2, 8, "a, b, out_rows and slot_to_route must be non-null"},
      {p, nullptr, p, ip, ip, 4, 256, 256, 2, 8, "a, b, out_rows and slot_to_route must be non-null"},
      {p, p, nullptr, ip, ip, 4, 256, 256, 2, 8, "a, b, out_rows and slot_to_route must be non-null"},
      {p, p, p, nullptr, ip, 4, 256, 256, 2, 8, "a, b, out_rows and slot_to_route must be non-null"},
      {p, p, p, ip, nullptr, 4, 256, 256, 2, 8, "block_expert and num_blocks must be non-null"},
      {p, p, p, ip, ip, 4, 100, 256, 2, 8, "n must be a positive multiple of 128, got 100"},
      {p, p, p, ip, ip, 4, 256, 64, 2, 8, "k must be a positive multiple of 128, got 64"},
      {p, p, p, ip, ip, 4, 256, 256, 0, 8, "num_local_experts must be >= 1"},
      {p, p, p, ip, ip, -2, 256, 256, 2, 8, "max_blocks must be >= 0"},
      {p, p, p, ip, ip, 4, 256, 256, 2, -1, "num_out_rows must be >= 0"},
      {p, buf + 8, p, ip, ip, 4, 256, 256, 2, 8, "a, b and out_rows must be 16-byte aligned"},
      {p, p, p, ip, ip, int64_t(1) << 25, 256, 256, 2, 8, "exceeds the 32-bit row range"},
      {p, p, p, ip, ip, 4, 256, 1 << 20, 4096, 8, "num_local_experts * k exceeds"},
  };
  for (const auto& x : bad) {
    EXPECT_EQ(megamoe_grouped_gemm_scatter_mn_bf16(x.a, x.b, x.out, x.slot_to_route, x.block_expert, ip,
                                                   x.max_blocks, x.n, x.k, x.experts, x.out_rows, nullptr),
              MEGAMOE_ERROR_INVALID_ARGUMENT)
        << x.message;
    EXPECT_NE(std::string(megamoe_last_error()).find(x.message), std::string::npos) << megamoe_last_error();
  }
  EXPECT_EQ(megamoe_grouped_gemm_scatter_mn_bf16(p, p, p, ip, ip, ip, 0, 256, 256, 2, 8, nullptr), MEGAMOE_OK)
      << "an empty pool is a no-op: " << megamoe_last_error();
}

}  // namespace
