// Grouped GEMM over a routing plan's pool: every real row of every live block against a host fp32
// reference, poison where nothing may be read or written, and argument validation (no GPU needed).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/megamoe.h"

namespace {

constexpr uint16_t kNaNPoison = 0x7FC0;  // A rows the kernel must not mix into real rows
constexpr uint16_t kCPoison = 0xFFFF;    // a NaN pattern: unwritten C shows as NaN

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (inputs here are finite)
  return uint16_t(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int cuda_devices() {
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

struct Plan {
  std::vector<int32_t> counts, offsets, block_expert;
  int32_t num_blocks = 0;
  int64_t max_blocks = 0;
};

// Builds the routing plan on the GPU (as the real pipeline does); num_blocks stays on the device in
// `num_blocks_dev`, a host copy comes back for checking.
Plan build_plan(const GemmCase& c, const std::vector<int32_t>& ids, DeviceBuffer<int32_t>& block_expert,
                DeviceBuffer<int32_t>& num_blocks_dev) {
  const megamoe_routing_shape s{c.tokens, c.top_k, c.experts, 0, c.experts};
  DeviceBuffer<int32_t> ids_dev(ids.size()), counts(c.experts), offsets(c.experts + 1),
      route_to_slot(ids.size()), slot_to_route(megamoe_routing_capacity(&s)), num_invalid(1);
  DeviceBuffer<char> workspace(megamoe_routing_workspace_bytes(&s));
  ids_dev.upload(ids);
  megamoe_routing_plan plan{counts.ptr, offsets.ptr, route_to_slot.ptr, slot_to_route.ptr,
                            block_expert.ptr, num_blocks_dev.ptr, num_invalid.ptr, workspace.ptr};
  EXPECT_EQ(megamoe_build_routing_cuda(ids_dev.ptr, &s, &plan, nullptr), MEGAMOE_OK) << megamoe_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Plan p;
  p.counts = counts.download();
  p.offsets = offsets.download();
  p.block_expert = block_expert.download();
  p.num_blocks = num_blocks_dev.download()[0];
  p.max_blocks = megamoe_routing_max_blocks(&s);
  return p;
}

bool is_real_row(const Plan& p, int64_t row) {
  const int32_t e = p.block_expert[row / MEGAMOE_BLOCK_M];
  return row - p.offsets[e] < p.counts[e];
}

// Host reference over the real rows, compared with the kernel's output; reports the worst tiles.
struct Comparison {
  double rel_error = 0;
  int64_t non_finite = 0;
  std::string worst;
};

Comparison compare(const Plan& p, const GemmCase& c, const std::vector<uint16_t>& a,
                   const std::vector<uint16_t>& b, const std::vector<uint16_t>& out) {
  const int n = c.n, k = c.k;
  std::vector<float> af(a.size()), bf(b.size());
  for (size_t i = 0; i < a.size(); ++i) af[i] = from_bf16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) bf[i] = from_bf16(b[i]);
  const int col_tiles = n / 128;
  const int64_t tiles = int64_t(p.num_blocks) * col_tiles;
  std::vector<double> err2(tiles, 0), ref2(tiles, 0);
  std::vector<int64_t> bad(tiles, 0);
  auto work = [&](int64_t first_block, int64_t stride) {
    for (int64_t blk = first_block; blk < p.num_blocks; blk += stride) {
      const float* w = bf.data() + int64_t(p.block_expert[blk]) * n * k;
      for (int64_t row = blk * MEGAMOE_BLOCK_M; row < (blk + 1) * MEGAMOE_BLOCK_M; ++row) {
        if (!is_real_row(p, row)) continue;
        const float* x = af.data() + row * k;
        for (int col = 0; col < n; ++col) {
          const float* wr = w + int64_t(col) * k;
          float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int i = 0; i < k; i += 8) {
            for (int j = 0; j < 8; ++j) s[j] += x[i + j] * wr[i + j];
          }
          const double ref = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
          const double got = from_bf16(out[row * n + col]);
          const int64_t t = blk * col_tiles + col / 128;
          if (!std::isfinite(got)) {
            ++bad[t];
          } else {
            err2[t] += (got - ref) * (got - ref);
          }
          ref2[t] += ref * ref;
        }
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

class GroupedGemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GroupedGemmTest, MatchesHostReference) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  const GemmCase& c = GetParam();
  const megamoe_routing_shape shape{c.tokens, c.top_k, c.experts, 0, c.experts};
  const int64_t max_blocks = megamoe_routing_max_blocks(&shape);
  DeviceBuffer<int32_t> block_expert(max_blocks), num_blocks(1);
  const Plan p = build_plan(c, make_ids(c), block_expert, num_blocks);
  if (HasFailure()) return;

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

  ASSERT_EQ(megamoe_grouped_gemm_bf16(a_dev.ptr, b_dev.ptr, c_dev.ptr, block_expert.ptr, num_blocks.ptr,
                                      max_blocks, n, k, c.experts, nullptr),
            MEGAMOE_OK)
      << megamoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> out = c_dev.download();

  const Comparison r = compare(p, c, a, b, out);
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
  ASSERT_EQ(megamoe_grouped_gemm_bf16(a_dev.ptr, b_dev.ptr, c_dev.ptr, block_expert.ptr, fewer.ptr, max_blocks,
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
    EXPECT_EQ(megamoe_grouped_gemm_bf16(x.a, x.b, x.c, x.block_expert, x.num_blocks, x.max_blocks, x.n, x.k,
                                        x.experts, nullptr),
              MEGAMOE_ERROR_INVALID_ARGUMENT)
        << x.message;
    EXPECT_NE(std::string(megamoe_last_error()).find(x.message), std::string::npos) << megamoe_last_error();
  }
}

TEST(GroupedGemmValidation, EmptyPoolIsANoOp) {
  alignas(16) static char buf[64];
  const auto* ip = reinterpret_cast<const int32_t*>(buf);
  EXPECT_EQ(megamoe_grouped_gemm_bf16(buf, buf, buf, ip, ip, 0, 256, 256, 2, nullptr), MEGAMOE_OK)
      << megamoe_last_error();
}

}  // namespace
