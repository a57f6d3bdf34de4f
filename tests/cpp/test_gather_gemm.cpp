// GEMM1 + SwiGLU with A gathered from the token rows (megamoe_grouped_gemm_swiglu_gather_bf16):
// bit for bit what dispatch + the pool GEMM give, rows past num_blocks untouched, and argument
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

bool is_poison(uint16_t v) { return v == kCPoison; }

// h of the gathered kernel against h of the pool kernel; reports the first differing element.
void expect_bitwise_equal(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int cols) {
  ASSERT_EQ(got.size(), want.size());
  const auto diff = std::mismatch(got.begin(), got.end(), want.begin());
  if (diff.first == got.end()) return;
  const size_t i = size_t(diff.first - got.begin());
  ADD_FAILURE() << "first difference at row " << i / cols << ", column " << i % cols << ": got 0x" << std::hex
                << *diff.first << ", dispatch + pool GEMM gave 0x" << *diff.second;
}

std::vector<uint16_t> random_rows(int64_t rows, int cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> v(rows * cols);
  for (auto& e : v) e = to_bf16(dist(rng));
  return v;
}

class SwigluGatherTest : public FusedTest {};

TEST_P(SwigluGatherTest, BitwiseEqualsDispatchThenPoolGemm) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const FusedCase& c = GetParam();
  const megamoe_routing_shape shape = fused_shape(c);
  const int64_t max_blocks = megamoe_routing_max_blocks(&shape);
  DeviceBuffer<int32_t> block_expert(max_blocks), num_blocks(1), slot_to_route(megamoe_routing_capacity(&shape));
  const Plan p = plan_for(c, block_expert, num_blocks, slot_to_route);
  if (HasFailure()) return;

  const int inter = c.n, hidden = c.k;
  const size_t rows = size_t(max_blocks) * MEGAMOE_BLOCK_M;
  std::mt19937 rng(c.seed * 7919u);
  const std::vector<uint16_t> x = random_rows(c.tokens, hidden, rng);
  const std::vector<uint16_t> w13 = make_weights(int64_t(c.local_experts) * 2 * inter * hidden, hidden, rng);
  DeviceBuffer<uint16_t> x_dev(x.size()), w_dev(w13.size()), pool(rows * hidden), h_pool(rows * inter),
      h_gather(rows * inter);
  x_dev.upload(x);
  w_dev.upload(w13);
  for (auto* buffer : {&pool, &h_pool, &h_gather}) {
    ASSERT_EQ(cudaMemset(buffer->ptr, 0xFF, buffer->count * 2), cudaSuccess);  // kCPoison everywhere
  }

  ASSERT_EQ(megamoe_dispatch_bf16(x_dev.ptr, pool.ptr, slot_to_route.ptr, num_blocks.ptr, max_blocks, c.top_k,
                                  hidden, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(megamoe_grouped_gemm_swiglu_bf16(pool.ptr, w_dev.ptr, h_pool.ptr, nullptr, block_expert.ptr,
                                             num_blocks.ptr, max_blocks, inter, hidden, c.local_experts, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(megamoe_grouped_gemm_swiglu_gather_bf16(x_dev.ptr, c.tokens, c.top_k, slot_to_route.ptr, w_dev.ptr,
                                                    h_gather.ptr, block_expert.ptr, num_blocks.ptr, max_blocks, inter,
                                                    hidden, c.local_experts, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> got = h_gather.download(), want = h_pool.download();

  const size_t live = size_t(p.num_blocks) * MEGAMOE_BLOCK_M * inter;
  EXPECT_TRUE(std::none_of(got.begin(), got.begin() + live, [](uint16_t v) { return std::isnan(from_bf16(v)); }))
      << "a live row was not written";
  EXPECT_TRUE(std::all_of(got.begin() + live, got.end(), is_poison)) << "rows past num_blocks were written";
  expect_bitwise_equal(got, want, inter);
  std::cout << "  swiglu gather " << c.name << ": " << p.num_blocks << " blocks of " << max_blocks << "\n";
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluGatherTest, ::testing::ValuesIn(swiglu_cases()),
                         [](const auto& info) { return info.param.name; });

// A hand-made plan: one live block whose rows hold token 1, a route past num_tokens * top_k, a
// padding row and token 0; the gathered kernel must match the pool kernel on the pool those rows
// stand for (zeros for the out-of-range route and the padding), and leave the second block alone.
TEST(SwigluGather, OutOfRangeRoutesAndPaddingReadAsZeroRows) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t tokens = 2, max_blocks = 2;
  const int top_k = 2, inter = 128, hidden = 128;
  const size_t rows = size_t(max_blocks) * MEGAMOE_BLOCK_M;
  std::vector<int32_t> routes(rows, -1);
  routes[0] = 3;                        // token 1
  routes[1] = int32_t(tokens) * top_k;  // out of range
  routes[3] = 0;                        // token 0
  std::mt19937 rng(31);
  const std::vector<uint16_t> x = random_rows(tokens, hidden, rng);
  const std::vector<uint16_t> w13 = make_weights(2 * inter * hidden, hidden, rng);
  std::vector<uint16_t> pool(rows * hidden, 0);
  std::copy(x.begin() + hidden, x.end(), pool.begin());
  std::copy(x.begin(), x.begin() + hidden, pool.begin() + 3 * hidden);

  DeviceBuffer<int32_t> slot_to_route(rows), block_expert(max_blocks), num_blocks(1);
  DeviceBuffer<uint16_t> x_dev(x.size()), w_dev(w13.size()), pool_dev(pool.size()), h_pool(rows * inter),
      h_gather(rows * inter);
  slot_to_route.upload(routes);
  block_expert.upload({0, 0});
  num_blocks.upload({1});
  x_dev.upload(x);
  w_dev.upload(w13);
  pool_dev.upload(pool);
  ASSERT_EQ(cudaMemset(h_pool.ptr, 0xFF, h_pool.count * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(h_gather.ptr, 0xFF, h_gather.count * 2), cudaSuccess);
  ASSERT_EQ(megamoe_grouped_gemm_swiglu_bf16(pool_dev.ptr, w_dev.ptr, h_pool.ptr, nullptr, block_expert.ptr,
                                             num_blocks.ptr, max_blocks, inter, hidden, 1, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(megamoe_grouped_gemm_swiglu_gather_bf16(x_dev.ptr, tokens, top_k, slot_to_route.ptr, w_dev.ptr,
                                                    h_gather.ptr, block_expert.ptr, num_blocks.ptr, max_blocks, inter,
                                                    hidden, 1, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> got = h_gather.download();
  EXPECT_TRUE(std::all_of(got.begin() + MEGAMOE_BLOCK_M * inter, got.end(), is_poison))
      << "the block past num_blocks was written";
  expect_bitwise_equal(got, h_pool.download(), inter);
}

// Validation happens before any CUDA call, so these run without a GPU. The pointers are never
// dereferenced.
TEST(GroupedGemmSwigluGatherValidation, RejectsBadArguments) {
  alignas(16) static char buf[64];
  void* p = buf;
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  struct Bad {
    const void* x;
    int64_t tokens;
    int32_t top_k;
    const int32_t* slot_to_route;
    const void* w;
    void* h;
    const int32_t* block_expert;
    int64_t max_blocks;
    int32_t inter, hidden, experts;
    const char* message;
  };
  const char* non_null = "x, slot_to_route, w13 and h must be non-null";
  const Bad bad[] = {
      {nullptr, 8, 2, ip, p, p, ip, 4, 256, 256, 2, non_null},
      {p, 8, 2, nullptr, p, p, ip, 4, 256, 256, 2, non_null},
      {p, 8, 2, ip, nullptr, p, ip, 4, 256, 256, 2, non_null},
      {p, 8, 2, ip, p, nullptr, ip, 4, 256, 256, 2, non_null},
      {p, -1, 2, ip, p, p, ip, 4, 256, 256, 2, "num_tokens must be >= 0, got -1"},
      {p, 8, 0, ip, p, p, ip, 4, 256, 256, 2, "top_k must be >= 1, got 0"},
      {p, int64_t(1) << 30, 4, ip, p, p, ip, 4, 256, 256, 2, "num_tokens * top_k exceeds the 32-bit route range"},
      {p, 8, 2, ip, p, p, nullptr, 4, 256, 256, 2, "block_expert and num_blocks must be non-null"},
      {p, 8, 2, ip, p, p, ip, 4, 200, 256, 2, "intermediate must be a positive multiple of 128, got 200"},
      {p, 8, 2, ip, p, p, ip, 4, 256, 96, 2, "hidden must be a positive multiple of 128, got 96"},
      {p, 8, 2, ip, p, p, ip, 4, 256, 256, 0, "num_local_experts must be >= 1"},
      {p, 8, 2, ip, p, p, ip, -1, 256, 256, 2, "max_blocks must be >= 0"},
      {buf + 2, 8, 2, ip, p, p, ip, 4, 256, 256, 2, "16-byte aligned"},
      {p, 8, 2, ip, buf + 4, p, ip, 4, 256, 256, 2, "16-byte aligned"},
      {p, 8, 2, ip, p, buf + 8, ip, 4, 256, 256, 2, "16-byte aligned"},
      {p, 8, 2, ip, p, p, ip, int64_t(1) << 25, 256, 256, 2, "exceeds the 32-bit row range"},
      {p, 8, 2, ip, p, p, ip, 4, 1 << 20, 256, 2048, "num_local_experts * 2 * intermediate exceeds"},
  };
  for (const auto& b : bad) {
    EXPECT_EQ(megamoe_grouped_gemm_swiglu_gather_bf16(b.x, b.tokens, b.top_k, b.slot_to_route, b.w, b.h,
                                                      b.block_expert, ip, b.max_blocks, b.inter, b.hidden, b.experts,
                                                      nullptr),
              MEGAMOE_ERROR_INVALID_ARGUMENT)
        << b.message;
    EXPECT_NE(std::string(megamoe_last_error()).find(b.message), std::string::npos) << megamoe_last_error();
  }
  EXPECT_EQ(megamoe_grouped_gemm_swiglu_gather_bf16(p, 8, 2, ip, p, p, ip, nullptr, 4, 256, 256, 2, nullptr),
            MEGAMOE_ERROR_INVALID_ARGUMENT)
      << "a null num_blocks is rejected";
  EXPECT_EQ(megamoe_grouped_gemm_swiglu_gather_bf16(p, 8, 2, ip, p, p, ip, ip, 0, 256, 256, 2, nullptr), MEGAMOE_OK)
      << "an empty pool is a no-op: " << megamoe_last_error();
}

}  // namespace
