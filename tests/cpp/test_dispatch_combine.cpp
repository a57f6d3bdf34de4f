// Dispatch and combine on one rank against host references: every live pool row copied (padding
// rows zeroed, rows past the live blocks untouched), and the fixed-order weighted sum over k.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "megamoe/megamoe.h"
#include "status_util.h"

namespace {

constexpr uint16_t kPoison = 0xffff;  // a bf16 NaN

int cuda_devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* ptr = nullptr;
  EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(host.size(), 1) * sizeof(T)), cudaSuccess);
  if (!host.empty()) EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return ptr;
}

template <typename T>
std::vector<T> to_host(const T* ptr, size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

float bf16_to_float(uint16_t bits) {
  uint32_t word = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &word, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t word;
  std::memcpy(&word, &f, 4);
  return uint16_t((word + 0x7fff + ((word >> 16) & 1)) >> 16);
}

struct Problem {
  int64_t tokens;
  int top_k, experts, hidden;
  std::vector<int32_t> ids;
  std::vector<uint16_t> x;
  std::vector<float> weights;
};

Problem make_problem(int64_t tokens, int top_k, int experts, int hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> expert(0, experts - 1);
  std::normal_distribution<float> normal;
  Problem p{tokens, top_k, experts, hidden, std::vector<int32_t>(tokens * top_k),
            std::vector<uint16_t>(tokens * hidden), std::vector<float>(tokens * top_k)};
  for (auto& id : p.ids) id = rng() % 9 == 0 ? -1 : expert(rng);  // some masked routes
  for (auto& v : p.x) v = float_to_bf16(normal(rng));
  for (auto& w : p.weights) w = std::abs(normal(rng));
  return p;
}

class DispatchCombineTest : public ::testing::TestWithParam<int> {};

TEST_P(DispatchCombineTest, MatchesHostReference) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const int hidden = GetParam();
  Problem p = make_problem(333, 4, 6, hidden, 7);
  megamoe_routing_shape shape{p.tokens, p.top_k, p.experts, 0, p.experts};
  const int64_t capacity = megamoe_routing_capacity(&shape), max_blocks = megamoe_routing_max_blocks(&shape);

  std::vector<int32_t> counts(p.experts), offsets(p.experts + 1), route_to_slot(p.ids.size()),
      slot_to_route(capacity), block_expert(max_blocks);
  int32_t num_blocks = 0, num_invalid = 0;
  megamoe_routing_plan host_plan{counts.data(), offsets.data(), route_to_slot.data(), slot_to_route.data(),
                                 block_expert.data(), &num_blocks, &num_invalid, nullptr};
  ASSERT_EQ(megamoe_build_routing_host(p.ids.data(), &shape, &host_plan), MEGAMOE_OK);

  auto* d_x = to_device(p.x);
  auto* d_slot_to_route = to_device(slot_to_route);
  auto* d_route_to_slot = to_device(route_to_slot);
  auto* d_num_blocks = to_device(std::vector<int32_t>{num_blocks});
  auto* d_weights = to_device(p.weights);
  auto* d_pool = to_device(std::vector<uint16_t>(capacity * hidden, kPoison));
  auto* d_weights_pool = to_device(std::vector<float>(capacity, -7.f));
  ASSERT_EQ(megamoe_dispatch_bf16(d_x, d_pool, d_route_to_slot, d_slot_to_route, d_num_blocks, p.tokens,
                                  max_blocks, p.top_k, hidden, d_weights, d_weights_pool, nullptr),
            MEGAMOE_OK) << megamoe_last_error();
  const auto pool = to_host(d_pool, capacity * hidden);
  const auto weights_pool = to_host(d_weights_pool, capacity);
  for (int64_t row = 0; row < capacity; ++row) {
    const int32_t route = slot_to_route[row];
    const float want_weight = row >= int64_t(num_blocks) * 128 ? -7.f : route < 0 ? 0.f : p.weights[route];
    ASSERT_EQ(weights_pool[row], want_weight) << "row " << row;
    for (int c = 0; c < hidden; ++c) {
      const uint16_t want = row >= int64_t(num_blocks) * 128 ? kPoison
                            : route < 0                       ? uint16_t(0)
                                                              : p.x[(route / p.top_k) * hidden + c];
      ASSERT_EQ(pool[row * hidden + c], want) << "row " << row << " col " << c;
    }
  }

  // Combine over route rows that hold a recognisable value; masked routes' rows stay NaN.
  std::vector<uint16_t> routed(p.ids.size() * hidden, kPoison);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (size_t r = 0; r < p.ids.size(); ++r) {
    if (route_to_slot[r] < 0) continue;
    for (int c = 0; c < hidden; ++c) routed[r * hidden + c] = float_to_bf16(normal(rng));
  }
  auto* d_routed = to_device(routed);
  auto* d_y = to_device(std::vector<uint16_t>(p.tokens * hidden, kPoison));
  ASSERT_EQ(megamoe_combine_bf16(d_routed, d_weights, d_route_to_slot, d_y, p.tokens, p.top_k, hidden, nullptr),
            MEGAMOE_OK) << megamoe_last_error();
  const auto y = to_host(d_y, p.tokens * hidden);
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int c = 0; c < hidden; ++c) {
      float acc = 0;
      for (int k = 0; k < p.top_k; ++k) {
        const int64_t r = t * p.top_k + k;
        if (route_to_slot[r] >= 0) acc = std::fma(p.weights[r], bf16_to_float(routed[r * hidden + c]), acc);
      }
      ASSERT_EQ(y[t * hidden + c], float_to_bf16(acc)) << "token " << t << " col " << c;  // same order, same rounding
    }
  }
  for (void* ptr : std::initializer_list<void*>{d_x, d_slot_to_route, d_route_to_slot, d_num_blocks, d_weights,
                                                d_pool, d_weights_pool, d_routed, d_y}) {
    cudaFree(ptr);
  }
}

// 256: one chunk per lane and row; 2048 and 4096: the model sizes and the largest supported.
INSTANTIATE_TEST_SUITE_P(HiddenSizes, DispatchCombineTest, ::testing::Values(256, 2048, 4096));

TEST(DispatchCombineValidation, RejectsBadArguments) {
  alignas(16) static uint16_t buf[64];
  int32_t ints[8] = {};
  expect_rejected(megamoe_dispatch_bf16(buf, buf, ints, ints, ints, 1, 1, 1, 4104, nullptr, nullptr, nullptr),
                  "at most 4096");
  expect_rejected(megamoe_dispatch_bf16(buf + 1, buf, ints, ints, ints, 1, 1, 1, 64, nullptr, nullptr, nullptr),
                  "16-byte aligned");
  expect_rejected(megamoe_dispatch_bf16(buf, buf, ints, ints, ints, 1, 1, 1, 64, reinterpret_cast<float*>(ints),
                                        nullptr, nullptr),
                  "go together");
  EXPECT_EQ(megamoe_combine_bf16(buf, nullptr, ints, buf, 4, 2, 64, nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  expect_rejected(megamoe_combine_bf16(buf, reinterpret_cast<float*>(ints), ints, buf, 4, 2, 60, nullptr),
                  "multiple of 8");
  EXPECT_EQ(megamoe_combine_bf16(nullptr, nullptr, nullptr, nullptr, 0, 2, 64, nullptr), MEGAMOE_OK);  // T = 0
}

// Expert parallelism's pull kernels: argument checks run before any CUDA call (no GPU needed).
TEST(PeersValidation, RejectsBadArguments) {
  alignas(16) static uint16_t buf[64];
  int32_t ints[8] = {};
  const void* x[2] = {buf, buf};
  const int64_t offsets[3] = {0, 8, 12};  // K = 4: 2 tokens on rank 0, 1 on rank 1
  expect_rejected(megamoe_dispatch_peers_bf16(x, offsets, 0, buf, ints, ints, 1, 4, 64, nullptr, nullptr, nullptr),
                  "world must be in");
  expect_rejected(megamoe_dispatch_peers_bf16(x, offsets, MEGAMOE_MAX_PEERS + 1, buf, ints, ints, 1, 4, 64, nullptr,
                                              nullptr, nullptr),
                  "world must be in");
  expect_rejected(megamoe_dispatch_peers_bf16(x, offsets, 2, buf, ints, ints, 1, 3, 64, nullptr, nullptr, nullptr),
                  "ascend by multiples of top_k");
  const int64_t descending[3] = {0, 8, 4};
  expect_rejected(megamoe_dispatch_peers_bf16(x, descending, 2, buf, ints, ints, 1, 4, 64, nullptr, nullptr, nullptr),
                  "ascend by multiples of top_k");
  const void* missing[2] = {buf, nullptr};
  expect_rejected(
      megamoe_dispatch_peers_bf16(missing, offsets, 2, buf, ints, ints, 1, 4, 64, nullptr, nullptr, nullptr),
      "x_peers[1] must be 16-byte aligned and non-null");
  const int64_t empty_rank1[3] = {0, 8, 8};  // rank 1 has no tokens: its x may be null
  EXPECT_EQ(megamoe_dispatch_peers_bf16(missing, empty_rank1, 2, buf, ints, ints, 0, 4, 64, nullptr, nullptr, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  expect_rejected(megamoe_dispatch_peers_bf16(x, offsets, 2, buf, ints, ints, 1, 4, 60, nullptr, nullptr, nullptr),
                  "multiple of 8");
  expect_rejected(megamoe_dispatch_peers_bf16(x, offsets, 2, nullptr, ints, ints, 1, 4, 64, nullptr, nullptr, nullptr),
                  "non-null");
  const float* weights_peers[2] = {reinterpret_cast<const float*>(ints), nullptr};
  auto* weights_pool = reinterpret_cast<float*>(ints);
  expect_rejected(
      megamoe_dispatch_peers_bf16(x, offsets, 2, buf, ints, ints, 1, 4, 64, weights_peers, nullptr, nullptr),
      "go together");
  expect_rejected(
      megamoe_dispatch_peers_bf16(x, offsets, 2, buf, ints, ints, 1, 4, 64, weights_peers, weights_pool, nullptr),
      "weights_peers[1] must be non-null");

  const int32_t* slots[2] = {ints, ints};
  const auto* weights = reinterpret_cast<const float*>(ints);
  expect_rejected(megamoe_combine_peers_bf16(x, slots, 2, weights, 0, buf, 2, 0, 64, nullptr), "top_k must be >= 1");
  expect_rejected(megamoe_combine_peers_bf16(missing, slots, 2, weights, 0, buf, 2, 4, 64, nullptr),
                  "out_peers[1] and route_to_slot_peers[1] must be non-null");
  expect_rejected(megamoe_combine_peers_bf16(x, slots, 2, weights, 0, buf + 1, 2, 4, 64, nullptr), "16-byte aligned");
  EXPECT_EQ(megamoe_combine_peers_bf16(nullptr, nullptr, 2, nullptr, 0, nullptr, 0, 4, 64, nullptr), MEGAMOE_OK)
      << "a rank without tokens combines nothing";
}

}  // namespace
