// Dispatch and combine on one rank against host references: every live pool row copied (padding
// rows zeroed, rows past the live blocks untouched), and the fixed-order weighted sum over k.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <utility>
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

  std::vector<int32_t> counts(p.experts), offsets(p.experts + 1), compact_offsets(p.experts + 1),
      route_to_slot(p.ids.size()), slot_to_route(capacity), block_expert(max_blocks);
  int32_t num_blocks = 0, num_invalid = 0;
  megamoe_routing_plan host_plan{counts.data(),       offsets.data(), compact_offsets.data(), route_to_slot.data(),
                                 slot_to_route.data(), block_expert.data(), &num_blocks, &num_invalid, nullptr, shape};
  ASSERT_EQ(megamoe_build_routing_host(p.ids.data(), 4, &host_plan), MEGAMOE_OK);

  // The arrays dispatch and combine read, on the device.
  megamoe_routing_plan plan{};
  plan.shape = shape;
  plan.slot_to_route = to_device(slot_to_route);
  plan.route_to_slot = to_device(route_to_slot);
  plan.num_blocks = to_device(std::vector<int32_t>{num_blocks});
  auto* d_x = to_device(p.x);
  auto* d_weights = to_device(p.weights);
  auto* d_pool = to_device(std::vector<uint16_t>(capacity * hidden, kPoison));
  auto* d_weights_pool = to_device(std::vector<float>(capacity, -7.f));
  const megamoe_dispatch_args dispatch{d_x, d_pool, d_weights, d_weights_pool, 2 * hidden};
  ASSERT_EQ(megamoe_dispatch_bf16(&plan, &dispatch, nullptr), MEGAMOE_OK) << megamoe_last_error();
  const auto pool = to_host(d_pool, capacity * hidden);
  const auto weights_pool = to_host(d_weights_pool, capacity);
  // The weights alone (no rows): the same weights pool.
  auto* d_weights_alone = to_device(std::vector<float>(capacity, -7.f));
  const megamoe_dispatch_args weights_alone{nullptr, nullptr, d_weights, d_weights_alone, 0};
  ASSERT_EQ(megamoe_dispatch_bf16(&plan, &weights_alone, nullptr), MEGAMOE_OK) << megamoe_last_error();
  EXPECT_TRUE(to_host(d_weights_alone, capacity) == weights_pool) << "the weights alone differ from the weights";
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

  // The right half of each row of x (x_stride: rows of the whole x apart) into a pool half as wide.
  const int half = hidden / 2;
  auto* d_half_pool = to_device(std::vector<uint16_t>(capacity * half, kPoison));
  const megamoe_dispatch_args columns{d_x + half, d_half_pool, nullptr, nullptr, 2 * half, 2 * hidden};
  ASSERT_EQ(megamoe_dispatch_bf16(&plan, &columns, nullptr), MEGAMOE_OK) << megamoe_last_error();
  const auto half_pool = to_host(d_half_pool, capacity * half);
  cudaFree(d_half_pool);
  for (int64_t row = 0; row < capacity; ++row) {
    for (int c = 0; c < half; ++c) {
      ASSERT_EQ(half_pool[row * half + c], pool[row * hidden + half + c]) << "columns: row " << row << " col " << c;
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
  // With the weights, then without (a gradient's sum over its routes: every weight 1): the host's
  // sums in the same order with the same rounding.
  for (const bool weighted : {true, false}) {
    const megamoe_combine_args combine{d_routed, weighted ? d_weights : nullptr, d_y, hidden};
    ASSERT_EQ(megamoe_combine_bf16(&plan, &combine, nullptr), MEGAMOE_OK) << megamoe_last_error();
    const auto y = to_host(d_y, p.tokens * hidden);
    for (int64_t t = 0; t < p.tokens; ++t) {
      for (int c = 0; c < hidden; ++c) {
        float acc = 0;
        for (int k = 0; k < p.top_k; ++k) {
          const int64_t r = t * p.top_k + k;
          const float w = weighted ? p.weights[r] : 1.f;
          if (route_to_slot[r] >= 0) acc = std::fma(w, bf16_to_float(routed[r * hidden + c]), acc);
        }
        ASSERT_EQ(y[t * hidden + c], float_to_bf16(acc)) << "weighted " << weighted << " token " << t << " col " << c;
      }
    }
  }
  for (void* ptr : std::initializer_list<void*>{d_x, plan.slot_to_route, plan.route_to_slot, plan.num_blocks,
                                                d_weights, d_pool, d_weights_pool, d_weights_alone, d_routed, d_y}) {
    cudaFree(ptr);
  }
}

// 256: one chunk per lane and row; 2048, 4096, 7168: model sizes; 4096 the largest row kept whole in
// registers, 7168 and 8192 copied in 8 KB segments.
INSTANTIATE_TEST_SUITE_P(HiddenSizes, DispatchCombineTest, ::testing::Values(256, 2048, 4096, 7168, 8192));

TEST(DispatchCombineValidation, RejectsBadArguments) {
  using Dispatch = megamoe_dispatch_args;
  using Combine = megamoe_combine_args;
  void* p = check_buf;
  const auto* fp = reinterpret_cast<const float*>(check_buf);
  const char* dispatch_null =
      "x, pool (both null only with weights) and the plan's route_to_slot, slot_to_route and num_blocks must be "
      "non-null";
  expect_rejections<Dispatch>(
      megamoe_dispatch_bf16, unread_plan({1, 1, 1, 0, 1}), Dispatch{p, p, nullptr, nullptr, 128},
      {
          {[](auto&, auto& a) { a.row_bytes = 0; }, "row_bytes 0 must be a positive multiple of 16"},
          {[](auto&, auto& a) { a.row_bytes = -16; }, "row_bytes -16 must be a positive multiple of 16"},
          {[](auto&, auto& a) { a.row_bytes = 120; }, "row_bytes 120 must be a positive multiple of 16"},
          {[](auto&, auto& a) { a.x = check_buf + 2; }, "x and pool must be 16-byte aligned"},
          {[](auto&, auto& a) { a.x_stride = 112; },
           "x_stride 112 must be 0 (row_bytes) or a multiple of 16 no smaller than row_bytes = 128"},
          {[](auto&, auto& a) { a.x_stride = 136; },
           "x_stride 136 must be 0 (row_bytes) or a multiple of 16 no smaller than row_bytes = 128"},
          {[=](auto&, auto& a) { a.weights = fp; }, "weights and weights_pool go together"},
          {[](auto&, auto& a) { a.pool = nullptr; }, dispatch_null},
          {[](auto&, auto& a) { a.x = a.pool = nullptr; }, dispatch_null},
          {[=](auto&, auto& a) {
             a.x = a.pool = nullptr;
             a.weights = fp;
             a.weights_pool = reinterpret_cast<float*>(check_buf);
           },
           "row_bytes 128 must be 0 without rows (x and pool null)"},
          {[](auto& pl, auto&) { pl.route_to_slot = nullptr; }, dispatch_null},
          {[](auto& pl, auto&) { pl.num_blocks = nullptr; }, dispatch_null},
      });

  using DispatchFp8 = megamoe_dispatch_fp8_args;
  auto* scales = reinterpret_cast<float*>(check_buf);
  const char* fp8_null = "x, pool, pool_scales and the plan's route_to_slot, slot_to_route and num_blocks";
  expect_rejections<DispatchFp8>(
      megamoe_dispatch_fp8, unread_plan({1, 1, 1, 0, 1}), DispatchFp8{p, p, scales, 256},
      {
          {[](auto&, auto& a) { a.hidden = 0; },
           "hidden must be a positive multiple of 128 (1 x 128 scale blocks), got 0"},
          {[](auto&, auto& a) { a.hidden = 200; },
           "hidden must be a positive multiple of 128 (1 x 128 scale blocks), got 200"},
          {[](auto&, auto& a) { a.pool_scales = nullptr; }, fp8_null},
          {[](auto&, auto& a) { a.weights_pool = reinterpret_cast<float*>(a.pool); },
           "weights and weights_pool go together (both null, or both set)"},
          {[](auto& pl, auto&) { pl.slot_to_route = nullptr; }, fp8_null},
          {[](auto&, auto& a) { a.pool = check_buf + 8; }, "x, pool and rows must be 16-byte aligned"},
          {[](auto&, auto& a) { a.rows = check_buf; }, "rows and row_scales go together (both null, or both set)"},
          {[](auto&, auto& a) {
             a.rows = check_buf + 8;
             a.row_scales = reinterpret_cast<float*>(check_buf);
           },
           "x, pool and rows must be 16-byte aligned"},
      });

  const char* combine_null = "routed, y and the plan's route_to_slot must be non-null";
  expect_rejections<Combine>(
      megamoe_combine_bf16, unread_plan({4, 2, 2, 0, 2}), Combine{p, fp, p, 64},
      {
          {[](auto&, auto& a) { a.y = nullptr; }, combine_null},
          {[](auto& pl, auto&) { pl.route_to_slot = nullptr; }, combine_null},
          {[](auto&, auto& a) { a.hidden = 60; }, "multiple of 8"},
          {[](auto&, auto& a) { a.y = check_buf + 8; }, "routed and y must be 16-byte aligned"},
      });
  megamoe_routing_plan no_tokens{};  // T = 0: nothing to combine, no array read
  no_tokens.shape = {0, 2, 2, 0, 2};
  const Combine nothing{nullptr, nullptr, nullptr, 64};
  EXPECT_EQ(megamoe_combine_bf16(&no_tokens, &nothing, nullptr), MEGAMOE_OK) << megamoe_last_error();
}

// Expert parallelism's pull kernels: argument checks run before any CUDA call (no GPU needed).
TEST(PeersValidation, RejectsBadArguments) {
  using Dispatch = megamoe_dispatch_peers_args;
  using Combine = megamoe_combine_peers_args;
  const auto* ints = reinterpret_cast<const int32_t*>(check_buf);
  const auto* weights = reinterpret_cast<const float*>(check_buf);
  const void* x[2] = {check_buf, check_buf};
  const void* missing[2] = {check_buf, nullptr};
  const int64_t offsets[3] = {0, 8, 12};  // K = 4: 2 tokens on rank 0, 1 on rank 1
  const int64_t descending[3] = {0, 8, 4};
  const int64_t shifted[3] = {4, 8, 12};
  const float* weights_peers[2] = {weights, nullptr};
  auto* weights_pool = reinterpret_cast<float*>(check_buf);
  // The owner's plan covers every rank's routes: T = 3 tokens of K = 4.
  const megamoe_routing_plan plan = unread_plan({3, 4, 2, 0, 2});
  const char* dispatch_null =
      "x_peers, route_offsets, pool and the plan's slot_to_route and num_blocks must be non-null";
  expect_rejections<Dispatch>(
      megamoe_dispatch_peers_bf16, plan, Dispatch{x, offsets, nullptr, check_buf, nullptr, 2, 128},
      {
          {[](auto&, auto& a) { a.world = 0; }, "world must be in"},
          {[](auto&, auto& a) { a.world = MEGAMOE_MAX_PEERS + 1; }, "world must be in"},
          {[](auto& pl, auto&) { pl.shape.top_k = 3; }, "ascend by multiples of top_k"},
          {[&](auto&, auto& a) { a.route_offsets = descending; }, "ascend by multiples of top_k"},
          {[&](auto&, auto& a) { a.route_offsets = shifted; }, "route_offsets[0] must be 0"},
          {[](auto& pl, auto&) { pl.shape.num_tokens = 2; }, "route_offsets[world] must be the plan's T * K"},
          {[&](auto&, auto& a) { a.x_peers = missing; }, "x_peers[1] must be 16-byte aligned and non-null"},
          {[](auto&, auto& a) { a.row_bytes = 120; }, "multiple of 16"},
          {[](auto&, auto& a) { a.pool = nullptr; }, dispatch_null},
          {[](auto& pl, auto&) { pl.slot_to_route = nullptr; }, dispatch_null},
          {[&](auto&, auto& a) { a.weights_peers = weights_peers; }, "go together"},
          {[&](auto&, auto& a) {
             a.weights_peers = weights_peers;
             a.weights_pool = weights_pool;
           },
           "weights_peers[1] must be non-null"},
      });

  // Rank 1 has no tokens: its x may be null. Validation passes it; the kernel then runs over the
  // plan's pool (num_blocks 0 here: nothing to copy), so with a GPU the plan is on the device, and
  // without one it is the launch that fails.
  {
    const int64_t empty_rank1[3] = {0, 8, 8};
    megamoe_routing_plan tokenless = unread_plan({2, 4, 2, 0, 2});
    Dispatch args{missing, empty_rank1, nullptr, check_buf, nullptr, 2, 128};
    if (cuda_devices() == 0) {
      EXPECT_EQ(megamoe_dispatch_peers_bf16(&tokenless, &args, nullptr), MEGAMOE_ERROR_CUDA) << megamoe_last_error();
    } else {
      const int64_t rows = megamoe_routing_capacity(&tokenless.shape);
      tokenless.slot_to_route = to_device(std::vector<int32_t>(rows, -1));
      tokenless.num_blocks = to_device(std::vector<int32_t>{0});
      args.pool = to_device(std::vector<uint16_t>(rows * args.row_bytes / 2, kPoison));
      EXPECT_EQ(megamoe_dispatch_peers_bf16(&tokenless, &args, nullptr), MEGAMOE_OK) << megamoe_last_error();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (void* ptr : std::initializer_list<void*>{tokenless.slot_to_route, tokenless.num_blocks, args.pool}) {
        cudaFree(ptr);
      }
    }
  }

  const int32_t* slots[2] = {ints, ints};
  const Combine combine{x, slots, weights, check_buf, 0, 2, 4, 2, 64};
  expect_rejected(megamoe_combine_peers_bf16(nullptr, nullptr), "args must be non-null");
  const std::pair<std::function<void(Combine&)>, const char*> bad_combine[] = {
      {[](Combine& a) { a.top_k = 0; }, "top_k must be >= 1"},
      {[](Combine& a) { a.world = 0; }, "world must be in"},
      {[](Combine& a) { a.num_tokens = -1; }, "num_tokens and route_offset must be >= 0"},
      {[&](Combine& a) { a.out_peers = missing; }, "out_peers[1] and route_to_slot_peers[1] must be non-null"},
      {[](Combine& a) { a.y = check_buf + 8; }, "y must be 16-byte aligned"},
  };
  for (const auto& [change, message] : bad_combine) {
    Combine a = combine;
    change(a);
    expect_rejected(megamoe_combine_peers_bf16(&a, nullptr), message);
  }
  const Combine no_tokens{nullptr, nullptr, nullptr, nullptr, 0, 0, 4, 2, 64};
  EXPECT_EQ(megamoe_combine_peers_bf16(&no_tokens, nullptr), MEGAMOE_OK) << "a rank without tokens combines nothing";
}

}  // namespace
