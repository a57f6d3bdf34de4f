// Routing plan: the host reference is checked against the plan's definition, and the CUDA plan
// against the host reference, on random, skewed and edge-case routings.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "megamoe/megamoe.h"
#include "status_util.h"

namespace {

struct Case {
  std::string name;
  megamoe_routing_shape shape;
  std::vector<int32_t> ids;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct HostPlan {
  megamoe_routing_shape shape;
  std::vector<int32_t> counts, offsets, compact_offsets, route_to_slot, slot_to_route, block_expert;
  int32_t num_blocks = -1, num_invalid = -1;

  explicit HostPlan(const megamoe_routing_shape& s)
      : shape(s), counts(s.num_local_experts, -7), offsets(s.num_local_experts + 1, -7),
        compact_offsets(s.num_local_experts + 1, -7), route_to_slot(s.num_tokens * s.top_k, -7),
        slot_to_route(megamoe_routing_capacity(&s), -7), block_expert(megamoe_routing_max_blocks(&s), -7) {}

  megamoe_routing_plan view() {
    return {counts.data(),       offsets.data(), compact_offsets.data(), route_to_slot.data(), slot_to_route.data(),
            block_expert.data(), &num_blocks,    &num_invalid,           nullptr,              shape};
  }
};

int cuda_devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Routing with `hot_fraction` of routes on expert 0 and the rest uniform; ids unique per token
// only where the sampler allows (duplicates are legal input and must be handled).
Case make_case(std::string name, int64_t tokens, int k, int experts, int begin, int local,
               double hot_fraction, double masked_fraction, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<int> expert(0, experts - 1);
  Case c{std::move(name), {tokens, k, experts, begin, local}, {}};
  c.ids.resize(tokens * k);
  for (auto& id : c.ids) {
    const double x = u(rng);
    id = x < masked_fraction ? -1 : (x < masked_fraction + hot_fraction ? 0 : expert(rng));
  }
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back(make_case("random", 1000, 8, 64, 0, 64, 0.0, 0.0, 1));
  out.push_back(make_case("skewed", 4096, 8, 128, 0, 128, 0.3, 0.0, 2));
  out.push_back(make_case("masked", 777, 4, 16, 0, 16, 0.0, 0.25, 3));
  out.push_back(make_case("one_expert_takes_all", 1500, 2, 8, 0, 8, 1.0, 0.0, 4));
  out.push_back(make_case("all_masked", 300, 8, 8, 0, 8, 0.0, 1.0, 5));
  out.push_back(make_case("no_tokens", 0, 8, 128, 0, 128, 0.0, 0.0, 6));
  out.push_back(make_case("one_token", 1, 8, 128, 0, 128, 0.0, 0.0, 7));
  out.push_back(make_case("top1", 513, 1, 4, 0, 4, 0.0, 0.0, 8));
  out.push_back(make_case("local_slice", 2048, 8, 128, 32, 32, 0.1, 0.05, 9));
  // One expert per rank (8 experts over 8 ranks): a route's key is 0 or 1, one bit to rank by.
  out.push_back(make_case("one_local_expert", 700, 2, 8, 5, 1, 0.0, 0.1, 15));
  out.push_back(make_case("many_experts", 3000, 6, 2000, 0, 2000, 0.0, 0.0, 10));
  // Around the one-cluster build (up to 8 CTAs of 1024 routes, up to 1024 local experts): 8 CTAs,
  // one route more, more experts, the most experts (shared memory past the default 48 KB), and a
  // CTA's routes ending inside a warp.
  out.push_back(make_case("largest_one_cluster", 1024, 8, 128, 0, 128, 0.2, 0.05, 16));
  out.push_back(make_case("past_one_cluster", 1025, 8, 128, 0, 128, 0.2, 0.0, 12));
  out.push_back(make_case("few_routes_many_experts", 1000, 6, 2000, 0, 2000, 0.0, 0.0, 13));
  out.push_back(make_case("one_cluster_most_experts", 1500, 4, 1024, 0, 1024, 0.1, 0.1, 14));
  out.push_back(make_case("one_cluster_partial_warp", 1111, 3, 60, 0, 60, 0.1, 0.02, 17));
  auto invalid = make_case("invalid_ids", 200, 4, 16, 0, 16, 0.0, 0.0, 11);
  invalid.ids[3] = 16;
  invalid.ids[17] = -5;
  out.push_back(invalid);
  return out;
}

// The plan's definition, checked on the host output.
void expect_valid_plan(const Case& c, const HostPlan& p) {
  const auto& s = c.shape;
  const int64_t routes = s.num_tokens * s.top_k;
  std::vector<int32_t> expected_counts(s.num_local_experts, 0);
  int32_t invalid = 0;
  for (int32_t id : c.ids) {
    invalid += (id < -1 || id >= s.num_experts);
    const int32_t e = id - s.expert_begin;
    if (e >= 0 && e < s.num_local_experts) ++expected_counts[e];
  }
  EXPECT_EQ(p.counts, expected_counts);
  EXPECT_EQ(p.num_invalid, invalid);
  EXPECT_EQ(p.offsets[0], 0);
  EXPECT_EQ(p.compact_offsets[0], 0);
  for (int e = 0; e < s.num_local_experts; ++e) {
    const int32_t padded = (expected_counts[e] + 127) / 128 * 128;
    EXPECT_EQ(p.offsets[e + 1] - p.offsets[e], padded) << "expert " << e;
    EXPECT_EQ(p.compact_offsets[e + 1] - p.compact_offsets[e], expected_counts[e]) << "expert " << e;
  }
  EXPECT_EQ(p.num_blocks * MEGAMOE_BLOCK_M, p.offsets[s.num_local_experts]);
  ASSERT_LE(p.offsets[s.num_local_experts], megamoe_routing_capacity(&s));
  for (int64_t b = 0; b < int64_t(p.block_expert.size()); ++b) {
    if (b >= p.num_blocks) {
      EXPECT_EQ(p.block_expert[b], -1);
      continue;
    }
    const int32_t e = p.block_expert[b];
    ASSERT_GE(e, 0);
    EXPECT_GE(b * 128, p.offsets[e]);
    EXPECT_LT(b * 128, p.offsets[e + 1]);
  }
  std::vector<int32_t> last_route(s.num_local_experts, -1);
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = c.ids[r] - s.expert_begin;
    const int32_t slot = p.route_to_slot[r];
    if (e < 0 || e >= s.num_local_experts) {
      EXPECT_EQ(slot, -1) << "route " << r;
      continue;
    }
    ASSERT_GE(slot, p.offsets[e]);
    ASSERT_LT(slot, p.offsets[e] + expected_counts[e]);
    EXPECT_EQ(p.slot_to_route[slot], r);
    EXPECT_GT(r, last_route[e]);  // route order kept inside each expert
    last_route[e] = int32_t(r);
  }
  int64_t used = std::count_if(p.slot_to_route.begin(), p.slot_to_route.end(),
                               [](int32_t r) { return r >= 0; });
  int64_t local_routes = 0;
  for (int32_t n : expected_counts) local_routes += n;
  EXPECT_EQ(used, local_routes);
}

class RoutingTest : public ::testing::TestWithParam<Case> {};

std::vector<int64_t> widened(const std::vector<int32_t>& ids) { return {ids.begin(), ids.end()}; }

void expect_same_plan(const HostPlan& a, const HostPlan& b) {
  EXPECT_EQ(a.counts, b.counts);
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_EQ(a.compact_offsets, b.compact_offsets);
  EXPECT_EQ(a.route_to_slot, b.route_to_slot);
  EXPECT_EQ(a.slot_to_route, b.slot_to_route);
  EXPECT_EQ(a.block_expert, b.block_expert);
  EXPECT_EQ(a.num_blocks, b.num_blocks);
  EXPECT_EQ(a.num_invalid, b.num_invalid);
}

TEST_P(RoutingTest, HostPlanMatchesDefinition) {
  const Case& c = GetParam();
  HostPlan plan(c.shape), from_int64(c.shape);
  auto view = plan.view(), int64_view = from_int64.view();
  ASSERT_EQ(megamoe_build_routing_host(c.ids.data(), 4, &view), MEGAMOE_OK) << megamoe_last_error();
  expect_valid_plan(c, plan);
  const auto ids64 = widened(c.ids);
  ASSERT_EQ(megamoe_build_routing_host(ids64.data(), 8, &int64_view), MEGAMOE_OK) << megamoe_last_error();
  expect_same_plan(from_int64, plan);
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count;
  explicit DeviceBuffer(size_t n) : count(n) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr, 0x5a, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);  // poison
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  std::vector<T> to_host() const {
    std::vector<T> out(count);
    if (count) EXPECT_EQ(cudaMemcpy(out.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// The CUDA plan of `ids` (int32 or int64, as the host holds them) against the host plan `expected`.
template <typename Id>
void expect_cuda_plan(const megamoe_routing_shape& s, const std::vector<Id>& host_ids, const HostPlan& expected) {
  DeviceBuffer<Id> ids(host_ids.size());
  DeviceBuffer<int32_t> counts(s.num_local_experts), offsets(s.num_local_experts + 1),
      compact_offsets(s.num_local_experts + 1), route_to_slot(host_ids.size()),
      slot_to_route(megamoe_routing_capacity(&s)), block_expert(megamoe_routing_max_blocks(&s)), scalars(2);
  DeviceBuffer<char> workspace(megamoe_routing_workspace_bytes(&s));
  if (!host_ids.empty()) {
    ASSERT_EQ(cudaMemcpy(ids.ptr, host_ids.data(), host_ids.size() * sizeof(Id), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  megamoe_routing_plan plan{counts.ptr,       offsets.ptr,      compact_offsets.ptr, route_to_slot.ptr,
                            slot_to_route.ptr, block_expert.ptr, scalars.ptr,         scalars.ptr + 1,
                            workspace.ptr,     s};
  ASSERT_EQ(megamoe_build_routing_cuda(ids.ptr, int32_t(sizeof(Id)), &plan, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_EQ(counts.to_host(), expected.counts);
  EXPECT_EQ(offsets.to_host(), expected.offsets);
  EXPECT_EQ(compact_offsets.to_host(), expected.compact_offsets);
  EXPECT_EQ(route_to_slot.to_host(), expected.route_to_slot);
  EXPECT_EQ(slot_to_route.to_host(), expected.slot_to_route);
  EXPECT_EQ(block_expert.to_host(), expected.block_expert);
  const auto both = scalars.to_host();
  EXPECT_EQ(both[0], expected.num_blocks);
  EXPECT_EQ(both[1], expected.num_invalid);
}

TEST_P(RoutingTest, CudaPlanMatchesHost) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  HostPlan expected(c.shape);
  auto expected_view = expected.view();
  ASSERT_EQ(megamoe_build_routing_host(c.ids.data(), 4, &expected_view), MEGAMOE_OK);
  expect_cuda_plan(c.shape, c.ids, expected);
  expect_cuda_plan(c.shape, widened(c.ids), expected);
}

INSTANTIATE_TEST_SUITE_P(Routings, RoutingTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// int64 ids outside [-1, E), past int32's range included, are counted as invalid, never narrowed onto
// an expert: the plan is the one of int32 ids with -2 in their place. In one CTA and in three launches.
TEST(RoutingInt64Ids, OutOfRangeIdsAreCountedNotWrapped) {
  const int64_t two_to_32 = int64_t(1) << 32;
  const int64_t far[] = {two_to_32 + 1, -two_to_32 + 1, two_to_32 * 3, INT64_MAX, INT64_MIN, 16, -2};
  for (const int64_t tokens : {200, 3000}) {
    Case c = make_case("int64", tokens, 4, 16, 0, 16, 0.1, 0.05, 17);
    std::vector<int64_t> ids64 = widened(c.ids);
    for (size_t i = 0; i < std::size(far); ++i) {
      ids64[7 + 97 * i] = far[i];
      c.ids[7 + 97 * i] = -2;
    }
    HostPlan expected(c.shape), from_int64(c.shape);
    auto expected_view = expected.view(), int64_view = from_int64.view();
    ASSERT_EQ(megamoe_build_routing_host(c.ids.data(), 4, &expected_view), MEGAMOE_OK);
    ASSERT_EQ(megamoe_build_routing_host(ids64.data(), 8, &int64_view), MEGAMOE_OK) << megamoe_last_error();
    EXPECT_EQ(expected.num_invalid, int32_t(std::size(far)));
    expect_same_plan(from_int64, expected);
    if (cuda_devices() > 0) expect_cuda_plan(c.shape, ids64, expected);
  }
}

TEST(RoutingValidation, RejectsBadShapes) {
  std::vector<int32_t> buf(4096, 0);
  int32_t scalar[2];
  megamoe_routing_plan plan{buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                            scalar,     scalar + 1, buf.data(), {}};
  struct Bad {
    megamoe_routing_shape shape;
    const char* message;
  };
  const Bad bad[] = {
      {{-1, 8, 16, 0, 16}, "num_tokens must be >= 0"},
      {{4, 0, 16, 0, 16}, "top_k must be >= 1"},
      {{4, 8, 16, 8, 16}, "must lie inside [0, 16)"},
      {{4, 8, 16, 0, 0}, "must lie inside"},
      {{int64_t(1) << 30, 8, 16, 0, 16}, "exceeds the 32-bit slot index range"},
  };
  // The shape is checked before any CUDA call, so the CUDA plan rejects them without a GPU too.
  for (const auto& b : bad) {
    plan.shape = b.shape;
    expect_rejected(megamoe_build_routing_host(buf.data(), 4, &plan), b.message);
    expect_rejected(megamoe_build_routing_cuda(buf.data(), 4, &plan, nullptr), b.message);
  }
}

TEST(RoutingValidation, RejectsIdsOtherThanInt32OrInt64) {
  std::vector<int32_t> buf(4096, 0);
  int32_t scalar[2];
  megamoe_routing_plan plan{buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                            scalar,     scalar + 1, buf.data(), {4, 8, 16, 0, 16}};
  // Checked before any CUDA call, so without a GPU too.
  for (const int32_t id_bytes : {0, 2, 16}) {
    expect_rejected(megamoe_build_routing_host(buf.data(), id_bytes, &plan), "id_bytes must be 4");
    expect_rejected(megamoe_build_routing_cuda(buf.data(), id_bytes, &plan, nullptr), "id_bytes must be 4");
  }
  expect_rejected(megamoe_build_routing_host(nullptr, 4, &plan), "topk_ids is null");
  expect_rejected(megamoe_build_routing_cuda(nullptr, 8, &plan, nullptr), "topk_ids is null");
}

TEST(RoutingValidation, RejectsNullPlan) {
  const int32_t ids[8] = {};
  expect_rejected(megamoe_build_routing_host(ids, 4, nullptr), "routing: null plan");
  expect_rejected(megamoe_build_routing_cuda(ids, 4, nullptr, nullptr), "routing: null plan");
  std::vector<int32_t> buf(4096, 0);
  int32_t scalar[2];
  megamoe_routing_plan plan{buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), nullptr,
                            scalar,     scalar + 1, nullptr,    {4, 8, 16, 0, 16}};
  expect_rejected(megamoe_build_routing_host(ids, 4, &plan), "a plan output pointer is null");
  plan.slot_to_route = buf.data();
  plan.compact_offsets = nullptr;
  expect_rejected(megamoe_build_routing_host(ids, 4, &plan), "a plan output pointer is null");
}

TEST(RoutingValidation, WorkspaceOnlyPastOneCluster) {
  const megamoe_routing_shape small{1024, 8, 128, 0, 128}, more_chunks{1025, 8, 128, 0, 128},
      more_experts{1000, 6, 2000, 0, 2000}, most_experts{1500, 4, 1024, 0, 1024};
  EXPECT_EQ(megamoe_routing_workspace_bytes(&small), 0u);
  EXPECT_EQ(megamoe_routing_workspace_bytes(&most_experts), 0u);
  EXPECT_EQ(megamoe_routing_workspace_bytes(&more_chunks), 17u * 129 * 4);
  EXPECT_EQ(megamoe_routing_workspace_bytes(&more_experts), 12u * 2001 * 4);
  // Checked before any CUDA call, so without a GPU too: a plan that needs a workspace must have one.
  std::vector<int32_t> buf(1 << 16, 0);
  int32_t scalar[2];
  megamoe_routing_plan plan{buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                            scalar,     scalar + 1, nullptr,    more_chunks};
  expect_rejected(megamoe_build_routing_cuda(buf.data(), 4, &plan, nullptr), "a plan output pointer is null");
}

TEST(RoutingValidation, CapacityBoundsEveryRouting) {
  // Worst case: every expert gets one route, each padded to a full block.
  megamoe_routing_shape s{16, 8, 128, 0, 128};
  EXPECT_EQ(megamoe_routing_capacity(&s), 128 + 128 * 128);
  EXPECT_EQ(megamoe_routing_max_blocks(&s), 1 + 128);
}

}  // namespace
