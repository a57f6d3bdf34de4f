// Shared by the GEMM GoogleTests: bf16 conversion, device buffers, routing plans built on the GPU,
// host fp32 references compared per 128-column tile, and the plans of the fused-epilogue tests.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/megamoe.h"
#include "status_util.h"

namespace megamoe_test {

constexpr uint16_t kNaNPoison = 0x7FC0;  // A rows the kernel must not mix into real rows
constexpr uint16_t kCPoison = 0xFFFF;    // a NaN pattern: unwritten C shows as NaN

// A gated GEMM's activation checks (args: good arguments): an unknown activation, and the clamped
// SwiGLU without a positive finite limit.
template <class Args>
void expect_activation_rejections(PlanEntry<Args> entry, const Args& args) {
  const auto limited = [](float limit) {
    return [=](megamoe_routing_plan&, Args& a) {
      a.activation = MEGAMOE_ACTIVATION_SWIGLU_LIMIT;
      a.activation_limit = limit;
    };
  };
  const std::string needs = "MEGAMOE_ACTIVATION_SWIGLU_LIMIT needs a positive finite activation_limit, got ";
  expect_rejections<Args>(entry, unread_plan(), args,
                          {
                              {[](auto&, auto& a) { a.activation = 7; }, "unknown activation 7"},
                              {[](auto&, auto& a) { a.activation = -1; }, "unknown activation -1"},
                              {limited(0.f), (needs + "0").c_str()},
                              {limited(-1.f), (needs + "-1").c_str()},
                              {limited(INFINITY), (needs + "inf").c_str()},
                              {limited(NAN), (needs + "nan").c_str()},
                          });
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (inputs here are finite)
  return uint16_t(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int cuda_devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), count);
    if (count) {
      ASSERT_EQ(cudaMemcpy(ptr, v.data(), count * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> download() const {
    std::vector<T> out(count);
    if (count) {
      EXPECT_EQ(cudaMemcpy(out.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }
};

// Host copies of a routing plan, for building inputs and references.
struct Plan {
  std::vector<int32_t> counts, offsets, compact_offsets, block_expert, route_to_slot, slot_to_route;
  int32_t num_blocks = 0;
  int64_t max_blocks = 0;
};

// A routing plan on the device, its arrays sized for the shape's worst case, and `plan`: the
// megamoe_routing_plan over them, shape included, that every plan-consuming entry point takes.
struct DevicePlan {
  explicit DevicePlan(const megamoe_routing_shape& s)
      : max_blocks(megamoe_routing_max_blocks(&s)),
        counts(s.num_local_experts),
        offsets(s.num_local_experts + 1),
        compact_offsets(s.num_local_experts + 1),
        route_to_slot(s.num_tokens * s.top_k),
        slot_to_route(megamoe_routing_capacity(&s)),
        block_expert(max_blocks),
        num_blocks(1),
        num_invalid(1),
        workspace(megamoe_routing_workspace_bytes(&s)),
        plan{counts.ptr,       offsets.ptr,       compact_offsets.ptr, route_to_slot.ptr, slot_to_route.ptr,
             block_expert.ptr, num_blocks.ptr,    num_invalid.ptr,     workspace.ptr,     s} {}
  int64_t max_blocks;
  DeviceBuffer<int32_t> counts, offsets, compact_offsets, route_to_slot, slot_to_route, block_expert, num_blocks,
      num_invalid;
  DeviceBuffer<char> workspace;
  megamoe_routing_plan plan;
};

// Builds d's plan from topk_ids on the GPU (as the real pipeline does) and returns host copies.
inline Plan build_plan(const std::vector<int32_t>& ids, DevicePlan& d) {
  DeviceBuffer<int32_t> ids_dev(ids.size());
  ids_dev.upload(ids);
  EXPECT_EQ(megamoe_build_routing_cuda(ids_dev.ptr, 4, &d.plan, nullptr), MEGAMOE_OK) << megamoe_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Plan p;
  p.counts = d.counts.download();
  p.offsets = d.offsets.download();
  p.compact_offsets = d.compact_offsets.download();
  p.block_expert = d.block_expert.download();
  p.route_to_slot = d.route_to_slot.download();
  p.slot_to_route = d.slot_to_route.download();
  p.num_blocks = d.num_blocks.download()[0];
  p.max_blocks = d.max_blocks;
  return p;
}

// A plan whose pool rows (128 + 2^31) exceed TMA's 32-bit coordinates: 2^24 local experts.
constexpr megamoe_routing_shape kHugePoolShape{1, 1, 1 << 24, 0, 1 << 24};

inline bool is_real_row(const Plan& p, int64_t row) {
  const int32_t e = p.block_expert[row / MEGAMOE_BLOCK_M];
  return row - p.offsets[e] < p.counts[e];
}

inline std::vector<float> to_float(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = from_bf16(v[i]);
  return f;
}

// fp32 dot product in a fixed order (8 partial sums), as close to the tensor cores as a host gets.
inline double dot(const float* x, const float* w, int k) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < k; i += 8) {
    for (int j = 0; j < 8; ++j) s[j] += x[i + j] * w[i + j];
  }
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// The kernel's output against a host reference, per 128-column tile of each pool block; reports
// the worst tiles.
struct Comparison {
  double rel_error = 0;
  int64_t non_finite = 0;
  std::string worst;
};

// A row to check: the pool row it comes from, and the row of `out` (n columns) holding it.
struct CheckedRow {
  int64_t pool_row;
  int64_t out_row;
};

// ref(pool_row, col) is the reference value; rows are checked on up to 32 host threads.
inline Comparison compare_rows(const Plan& p, int n, const std::vector<CheckedRow>& rows,
                        const std::function<double(int64_t, int)>& ref, const std::vector<uint16_t>& out) {
  const int col_tiles = (n + 127) / 128;  // the last one partial where n is not a multiple of 128
  const int64_t tiles = int64_t(p.num_blocks) * col_tiles;
  std::vector<double> err2(tiles, 0), ref2(tiles, 0);
  std::vector<int64_t> bad(tiles, 0);
  // Each thread owns whole pool blocks, so the per-tile sums need no locking.
  auto work = [&](int64_t first_block, int64_t stride) {
    for (const CheckedRow& r : rows) {
      const int64_t blk = r.pool_row / MEGAMOE_BLOCK_M;
      if (blk % stride != first_block) continue;
      for (int col = 0; col < n; ++col) {
        const double want = ref(r.pool_row, col);
        const double got = from_bf16(out[r.out_row * n + col]);
        const int64_t t = blk * col_tiles + col / 128;
        if (!std::isfinite(got)) {
          ++bad[t];
        } else {
          err2[t] += (got - want) * (got - want);
        }
        ref2[t] += want * want;
      }
    }
  };
  const int threads = int(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t, threads);
  for (auto& th : pool) th.join();

  Comparison r;
  double e = 0, s = 0;
  std::vector<std::pair<double, int64_t>> per_tile;
  for (int64_t t = 0; t < tiles; ++t) {
    e += err2[t];
    s += ref2[t];
    r.non_finite += bad[t];
    const double tile_rel = bad[t] ? INFINITY : std::sqrt(err2[t] / std::max(ref2[t], 1e-30));
    per_tile.push_back({tile_rel, t});
  }
  r.rel_error = r.non_finite ? INFINITY : std::sqrt(e / std::max(s, 1e-30));
  std::sort(per_tile.rbegin(), per_tile.rend());
  std::ostringstream os;
  for (size_t i = 0; i < std::min<size_t>(4, per_tile.size()); ++i) {
    const int64_t t = per_tile[i].second;
    os << " [block " << t / col_tiles << " (expert " << p.block_expert[t / col_tiles] << "), cols "
       << (t % col_tiles) * 128 << "..+128: rel " << per_tile[i].first << ", non-finite " << bad[t] << "]";
  }
  r.worst = os.str();
  return r;
}

// The row of compact z (megamoe.h) that holds real pool row `row`.
inline int64_t compact_row(const Plan& p, int64_t row) {
  const int32_t e = p.block_expert[row / MEGAMOE_BLOCK_M];
  return row - p.offsets[e] + p.compact_offsets[e];
}

// Every real row of the live blocks with its row of compact z (GEMM1's z).
inline std::vector<CheckedRow> compact_rows(const Plan& p) {
  std::vector<CheckedRow> rows;
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    if (is_real_row(p, row)) rows.push_back({row, compact_row(p, row)});
  }
  return rows;
}

// Every real row of the live blocks, written in place (plain GEMM, SwiGLU).
inline std::vector<CheckedRow> real_rows(const Plan& p) {
  std::vector<CheckedRow> rows;
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    if (is_real_row(p, row)) rows.push_back({row, row});
  }
  return rows;
}

// Pool: real rows uniform in [-1, 1], padding rows of live blocks and every row past them NaN.
inline std::vector<uint16_t> make_pool(const Plan& p, int k, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<uint16_t> a(p.max_blocks * MEGAMOE_BLOCK_M * k, kNaNPoison);
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    if (!is_real_row(p, row)) continue;
    for (int i = 0; i < k; ++i) a[row * k + i] = to_bf16(dist(rng));
  }
  return a;
}

// The pool a dispatch makes of token rows x [T, k]: real row r holds token row slot_to_route[r] /
// top_k; padding rows of live blocks and every row past them NaN (as make_pool).
inline std::vector<uint16_t> pool_of_tokens(const Plan& p, const std::vector<uint16_t>& x, int k, int top_k) {
  std::vector<uint16_t> a(p.max_blocks * MEGAMOE_BLOCK_M * k, kNaNPoison);
  for (int64_t row = 0; row < int64_t(p.num_blocks) * MEGAMOE_BLOCK_M; ++row) {
    if (!is_real_row(p, row)) continue;
    const int64_t token = p.slot_to_route[row] / top_k;
    std::copy(x.begin() + token * k, x.begin() + (token + 1) * k, a.begin() + row * k);
  }
  return a;
}


// A rank's view: global experts, of which [local_begin, local_begin + local_experts) are local.
// n, k are the GEMM's (SwiGLU: n = intermediate, k = hidden; scatter: n = hidden, k = intermediate).
struct FusedCase {
  std::string name;
  int64_t tokens;
  int top_k;
  int experts;
  int local_begin, local_experts;
  int n, k;
  uint32_t seed;
};

inline void PrintTo(const FusedCase& c, std::ostream* os) { *os << c.name; }

inline megamoe_routing_shape fused_shape(const FusedCase& c) {
  return {c.tokens, c.top_k, c.experts, c.local_begin, c.local_experts};
}
inline int fused_hot(const FusedCase& c) { return c.local_begin; }                            // ~40% of routes
inline int fused_empty(const FusedCase& c) { return c.local_begin + c.local_experts / 2; }  // no routes

// 5% masked routes (-1), ~40% to the hot local expert, the rest uniform over the other global
// experts (so some are not local) except the empty one.
inline std::vector<int32_t> make_fused_ids(const FusedCase& c) {
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<int> other(0, c.experts - 2);
  std::vector<int32_t> ids(c.tokens * c.top_k);
  for (auto& id : ids) {
    const double x = u(rng);
    const int e = other(rng);
    id = x < 0.05 ? -1 : x < 0.45 ? fused_hot(c) : (e >= fused_empty(c) ? e + 1 : e);
  }
  return ids;
}

// Weights uniform in [-s, s] with s = 6 / sqrt(k): outputs of std ~2, so SwiGLU sees both the
// linear and the saturated part of the sigmoid.
inline std::vector<uint16_t> make_weights(int64_t count, int k, std::mt19937& rng) {
  const float s = 6.f / std::sqrt(float(k));
  std::uniform_real_distribution<float> dist(-s, s);
  std::vector<uint16_t> w(count);
  for (auto& v : w) v = to_bf16(dist(rng));
  return w;
}

// [E, rows, cols] -> [E, cols, rows] (so a column of B is a contiguous row for dot()).
inline std::vector<float> transpose_experts(const std::vector<float>& b, int experts, int rows, int cols) {
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

// Builds the plan and asserts it covers what the fused tests are for; holds the scatter test body
// shared by both B layouts.
class FusedTest : public ::testing::TestWithParam<FusedCase> {
 protected:
  Plan plan_for(const FusedCase& c, DevicePlan& d) {
    const Plan p = build_plan(make_fused_ids(c), d);
    const int hot = fused_hot(c) - c.local_begin, empty = fused_empty(c) - c.local_begin;
    EXPECT_EQ(p.counts[empty], 0) << "an empty expert";
    EXPECT_GE((p.counts[hot] + MEGAMOE_BLOCK_M - 1) / MEGAMOE_BLOCK_M, 2) << "an expert with several blocks";
    EXPECT_TRUE(std::any_of(p.counts.begin(), p.counts.end(), [](int32_t n) { return n % MEGAMOE_BLOCK_M != 0; }))
        << "a partially filled block";
    EXPECT_LT(p.num_blocks, p.max_blocks) << "blocks past num_blocks to keep untouched";
    EXPECT_TRUE(std::any_of(p.route_to_slot.begin(), p.route_to_slot.end(), [](int32_t s) { return s < 0; }))
        << "masked or non-local routes";
    // The plan is a bijection between live routes and real pool rows: a kernel that writes each
    // real pool row r to slot_to_route[r] only then writes every live route exactly once.
    for (size_t r = 0; r < p.route_to_slot.size(); ++r) {
      const int32_t slot = p.route_to_slot[r];
      if (slot >= 0) {
        EXPECT_EQ(p.slot_to_route[slot], int32_t(r)) << "route " << r;
      }
    }
    return p;
  }

  // out_rows[route] = A[slot] · B[e] for the B layout (MEGAMOE_B_N_BY_K: w2 [E, N, K];
  // MEGAMOE_B_K_BY_N: w13 [E, K, N]): every live route written exactly once against the host
  // reference, masked / non-local routes untouched, and num_out_rows = half giving bit-identical
  // rows below it (determinism) and untouched rows above. The first run scatters by the plan's
  // slot_to_route (row_of_slot null), the second passes the same map explicitly.
  void check_scatter(int32_t b_layout) {
    if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
    const FusedCase& c = GetParam();
    DevicePlan d(fused_shape(c));
    const Plan p = plan_for(c, d);
    if (HasFailure()) return;

    const bool mn = b_layout == MEGAMOE_B_K_BY_N;
    const int n = c.n, k = c.k;
    const int64_t routes = c.tokens * c.top_k;
    std::mt19937 rng(c.seed * 7919u);
    const std::vector<uint16_t> a = make_pool(p, k, rng);
    const std::vector<uint16_t> b = make_weights(int64_t(c.local_experts) * n * k, k, rng);  // [E, N, K] or [E, K, N]
    DeviceBuffer<uint16_t> a_dev(a.size()), b_dev(b.size()), out_dev(routes * n);
    a_dev.upload(a);
    b_dev.upload(b);
    auto run = [&](int64_t num_out_rows, const int32_t* row_of_slot) {
      EXPECT_EQ(cudaMemset(out_dev.ptr, 0xFF, out_dev.count * 2), cudaSuccess);  // kCPoison everywhere
      const megamoe_scatter_gemm_args args{a_dev.ptr, b_dev.ptr, out_dev.ptr, row_of_slot,
                                           num_out_rows, n,         k,           b_layout};
      EXPECT_EQ(megamoe_grouped_gemm_scatter_bf16(&d.plan, &args, nullptr), MEGAMOE_OK)
          << megamoe_last_error();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return out_dev.download();
    };
    auto poison_row = [&](const std::vector<uint16_t>& out, int64_t route) {
      return std::all_of(out.begin() + route * n, out.begin() + (route + 1) * n,
                         [](uint16_t v) { return v == kCPoison; });
    };

    const std::vector<uint16_t> out = run(routes, nullptr);
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
    // B as [E, N, K] on the host either way, so a column of B[e] is a contiguous row for dot().
    const std::vector<float> af = to_float(a);
    const std::vector<float> bf = mn ? transpose_experts(to_float(b), c.local_experts, k, n) : to_float(b);
    const Comparison r = compare_rows(
        p, n, rows,
        [&](int64_t slot, int col) {
          const int64_t e = p.block_expert[slot / MEGAMOE_BLOCK_M];
          return dot(af.data() + slot * k, bf.data() + (e * n + col) * k, k);
        },
        out);
    EXPECT_EQ(r.non_finite, 0) << "worst tiles:" << r.worst;
    EXPECT_LE(r.rel_error, 1e-2) << "worst tiles:" << r.worst;
    std::cout << (mn ? "  scatter_mn " : "  scatter ") << c.name << ": " << p.num_blocks << " blocks, " << rows.size()
              << " routes written, " << untouched << " untouched, rel error " << r.rel_error << "\n";

    // The guard: with num_out_rows = half, routes past it stay poison and the rest are bit-identical.
    const int64_t half = routes / 2;
    const std::vector<uint16_t> again = run(half, d.plan.slot_to_route);
    ASSERT_FALSE(HasFailure());
    EXPECT_TRUE(std::equal(again.begin(), again.begin() + half * n, out.begin()))
        << "rows below num_out_rows differ (or the kernel is not deterministic)";
    for (int64_t route = half; route < routes; ++route) {
      EXPECT_TRUE(poison_row(again, route)) << "route " << route << " >= num_out_rows was written";
      if (HasFailure()) break;
    }
  }
};

// The scatter GEMM's argument checks for one B layout; the 32-bit row-range check of B covers the
// dimension B is laid out by (overflow_n x overflow_k with 4096 local experts: 2^32 rows of B).
// Validation happens before any CUDA call, so this runs without a GPU; the pointers are never read.
inline void expect_scatter_rejections(int32_t b_layout, int32_t overflow_n, int32_t overflow_k) {
  using Args = megamoe_scatter_gemm_args;
  void* p = check_buf;
  const megamoe_routing_plan plan = unread_plan();
  const Args args{p, p, p, nullptr, 8, 256, 256, b_layout};
  const char* plan_arrays = "the plan's block_expert and num_blocks must be non-null";
  expect_rejections<Args>(
      megamoe_grouped_gemm_scatter_bf16, plan, args,
      {
          {[](auto&, auto& a) { a.a = nullptr; }, "a must be non-null"},
          {[](auto&, auto& a) { a.b = nullptr; }, "b must be non-null"},
          {[](auto&, auto& a) { a.out_rows = nullptr; }, "out_rows must be non-null"},
          {[](auto& pl, auto&) { pl.slot_to_route = nullptr; }, "row_of_slot must be non-null"},  // and none given
          {[](auto& pl, auto&) { pl.block_expert = nullptr; }, plan_arrays},
          {[](auto& pl, auto&) { pl.num_blocks = nullptr; }, plan_arrays},
          {[](auto&, auto& a) { a.n = 100; }, "n must be a positive multiple of 8 (16-byte bf16 rows), got 100"},
          {[](auto&, auto& a) { a.k = 60; }, "k must be a positive multiple of 8 (16-byte bf16 rows), got 60"},
          {[](auto&, auto& a) { a.num_out_rows = -1; }, "num_out_rows must be >= 0, got -1"},
          {[](auto&, auto& a) { a.b = check_buf + 8; }, "b must be 16-byte aligned"},
          {[](auto&, auto& a) { a.out_rows = check_buf + 8; }, "out_rows must be 16-byte aligned"},
          {[](auto& pl, auto&) { pl.shape = kHugePoolShape; }, "the plan's pool rows = 2147483776 exceeds"},
          {[=](auto& pl, auto& a) {
             pl.shape.num_experts = pl.shape.num_local_experts = 4096;
             a.n = overflow_n;
             a.k = overflow_k;
           },
           "the rows of b = 4294967296 exceeds the 32-bit row range"},
          {[](auto&, auto& a) { a.b_layout = 2; }, "b_layout must be MEGAMOE_B_N_BY_K or MEGAMOE_B_K_BY_N, got 2"},
          {[](auto&, auto& a) { a.b_layout = -1; }, "b_layout must be MEGAMOE_B_N_BY_K or MEGAMOE_B_K_BY_N, got -1"},
      });
  Args none = args;
  none.num_out_rows = 0;
  EXPECT_EQ(megamoe_grouped_gemm_scatter_bf16(&plan, &none, nullptr), MEGAMOE_OK)
      << "no output rows is a no-op: " << megamoe_last_error();
}

}  // namespace megamoe_test
