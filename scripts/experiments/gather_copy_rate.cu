// How many row copies per microsecond can an SM's TMA unit take when a GEMM producer gathers token
// rows itself (one copy per row and stage) instead of reading a dispatched pool? One CTA per SM
// fills a 4-stage shared-memory ring with `rows` copies of `bytes` each per stage from 16384 rows of
// 4 KB (x at the 30B shape), four consumer warps release the stages, and the kernel is timed over
// 196608 stages in all. The producer warp loads a stage's row indices (one per lane and 32 rows)
// before it issues any of its copies. Kinds:
//   bulk        one thread issues a cp.async.bulk per row (rows padded by 16 bytes, as ldmatrix
//               would read them), rows at random
//   bulk-seq    the same over consecutive rows
//   bulk-warp   lane l of the producer warp issues the copies of rows l, l + 32, ...
//   box         one thread issues a 2D TMA box of bytes x 1 row per row (bytes <= 512)
// With a cluster size C > 1 (bulk-warp only), CTAs sharing their rows (as a GEMM's tiles of one pool
// block would) form clusters of C: each CTA issues every C-th row's copy, multicast to all C.
// Built with the tests (CMakeLists.txt): <build dir>/gather_copy_rate 512 64 bulk-warp [C]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tma_ring.cuh"

namespace {

constexpr int kRowBytes = 4096;
constexpr int kTokens = 16384;
constexpr int kRoutes = kTokens * 8;
constexpr int kRing = 4;
constexpr int kTotalStages = 196608;
constexpr int kMaxRows = 128;
enum Kind { kBulk, kBulkSeq, kBulkWarp, kBox };

__device__ void multicast_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "h"(ctas)
      : "memory");
}
// Arrive on the barrier at bar's offset in the shared memory of the cluster's CTA `cta` (a launch
// without clusters is a cluster of one CTA).
__device__ void barrier_arrive_in(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote));
}
__device__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}
__device__ void cluster_sync() { asm volatile("barrier.cluster.arrive;\nbarrier.cluster.wait;" ::: "memory"); }

// A ring stage: `rows` rows padded by 16 bytes, rounded up to 1 KB.
__host__ __device__ int stage_bytes(int bytes, int rows) { return ((rows * (bytes + 16) + 1023) / 1024) * 1024; }

__global__ void __launch_bounds__(160, 1)
gather(const uint8_t* __restrict__ x, const int32_t* __restrict__ route_tokens, int bytes, int rows, int stages,
       Kind kind, int cluster, const __grid_constant__ CUtensorMap map, int* sink) {
  extern __shared__ __align__(1024) uint8_t ring[];
  __shared__ uint64_t full[kRing], empty[kRing];
  const int pitch = bytes + 16;
  const int ring_stage = stage_bytes(bytes, rows);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], 4 * cluster);  // every consumer warp of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  const int rank = cluster > 1 ? int(cluster_rank()) : 0;
  if (warp == 0) {  // producer: lane 0 issues, or every lane for bulk-warp
    for (int i = 0; i < stages; ++i) {
      const int s = i % kRing;
      const int64_t stage = int64_t(blockIdx.x / cluster) * stages + i;  // the cluster's stages
      const int segment = int(stage % (kRowBytes / bytes));
      const int64_t first_route = stage / (kRowBytes / bytes) * rows;
      int32_t token[kMaxRows / 32];  // lane l: the tokens of rows l, l + 32, ...: loaded before any copy
#pragma unroll
      for (int j = 0; j < kMaxRows / 32; ++j) {
        const int64_t route = (first_route + lane + 32 * j) % kRoutes;
        token[j] = lane + 32 * j >= rows ? 0 : kind == kBulkSeq ? int(route % kTokens) : route_tokens[route];
      }
      barrier_wait(&empty[s], ((i / kRing) & 1) ^ 1);
      if (lane == 0) barrier_expect(&full[s], uint32_t(rows * bytes));
      __syncwarp();
      const auto copy = [&](int r, int row_token) {
        if (kind == kBox) {
          box_copy(ring + s * ring_stage + r * bytes, &map, segment * bytes / 2, row_token, &full[s]);
        } else if (cluster > 1) {
          multicast_copy(ring + s * ring_stage + r * pitch, x + int64_t(row_token) * kRowBytes + segment * bytes,
                         uint32_t(bytes), &full[s], uint16_t((1u << cluster) - 1));
        } else {
          bulk_copy(ring + s * ring_stage + r * pitch, x + int64_t(row_token) * kRowBytes + segment * bytes,
                    uint32_t(bytes), &full[s]);
        }
      };
#pragma unroll
      for (int j = 0; j < kMaxRows / 32; ++j) {
        if (kind == kBulkWarp) {  // one warp instruction issues 32 rows' copies
          const int r = 32 * j + lane;
          if (r < rows && r % cluster == rank) copy(r, token[j]);  // in a cluster: every C-th row
        } else {
          for (int l = 0; l < 32 && 32 * j + l < rows; ++l) {
            const int row_token = __shfl_sync(0xffffffffu, token[j], l);
            if (lane == 0) copy(32 * j + l, row_token);
          }
        }
      }
    }
  } else if (lane == 0) {  // consumers: one arrive per warp and stage
    int seen = 0;
    for (int i = 0; i < stages; ++i) {
      const int s = i % kRing;
      barrier_wait(&full[s], (i / kRing) & 1);
      seen += ring[s * ring_stage + warp * 64];
      for (int c = 0; c < cluster; ++c) barrier_arrive_in(&empty[s], uint32_t(c));
    }
    if (seen == -1) *sink = seen;
  }
  if (cluster > 1) cluster_sync();  // no CTA leaves while a peer may still write to it
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::printf("usage: %s <bytes per copy> <rows per stage> bulk|bulk-seq|bulk-warp|box [cluster size]\n", argv[0]);
    return 2;
  }
  const int bytes = std::atoi(argv[1]), rows = std::atoi(argv[2]), cluster = argc == 5 ? std::atoi(argv[4]) : 1;
  const char* names[] = {"bulk", "bulk-seq", "bulk-warp", "box"};
  int kind = -1;
  for (int k = 0; k < 4; ++k) kind = std::strcmp(argv[3], names[k]) == 0 ? k : kind;
  const int smem = kRing * stage_bytes(bytes, rows) + 1024;
  if (kind < 0 || bytes < 16 || bytes % 16 || kRowBytes % bytes || rows < 1 || rows > kMaxRows || smem > 227 * 1024 ||
      (kind == kBox && bytes > 512) || (cluster != 1 && cluster != 2 && cluster != 4) ||
      (cluster > 1 && kind != kBulkWarp)) {
    std::printf("bytes: a multiple of 16 dividing 4096 (box: up to 512); rows up to 128; the ring of 4 stages "
                "within 227 KB; clusters of 1, 2 or 4, for bulk-warp\n");
    return 2;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* x = nullptr;
  int32_t* route_tokens = nullptr;
  int* sink = nullptr;
  CHECK(cudaMalloc(&x, size_t(kTokens) * kRowBytes));
  CHECK(cudaMemset(x, 1, size_t(kTokens) * kRowBytes));
  std::vector<int32_t> tokens(kRoutes);
  std::srand(1);
  for (int32_t& t : tokens) t = std::rand() % kTokens;
  CHECK(cudaMalloc(&route_tokens, tokens.size() * sizeof(int32_t)));
  CHECK(cudaMemcpy(route_tokens, tokens.data(), tokens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&sink, sizeof(int)));
  const CUtensorMap map = kind == kBox ? bf16_boxes(x, kTokens, kRowBytes / 2, kRowBytes, 1, uint32_t(bytes / 2),
                                                   CU_TENSOR_MAP_SWIZZLE_NONE)
                                      : CUtensorMap{};
  CHECK(cudaFuncSetAttribute(gather, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster_dims{};
  cluster_dims.id = cudaLaunchAttributeClusterDimension;
  cluster_dims.val.clusterDim.x = unsigned(cluster);
  cluster_dims.val.clusterDim.y = cluster_dims.val.clusterDim.z = 1;
  config.blockDim = dim3(160);
  config.dynamicSmemBytes = size_t(smem);
  config.attrs = &cluster_dims;
  config.numAttrs = 1;
  config.gridDim = dim3(unsigned(sms / cluster * cluster));
  int clusters = sms / cluster;  // as many as fit at once: the GPCs may not hold sms / cluster of them
  if (cluster > 1) CHECK(cudaOccupancyMaxActiveClusters(&clusters, gather, &config));
  const int ctas = std::min(clusters, sms / cluster) * cluster;
  config.gridDim = dim3(unsigned(ctas));
  const int stages = kTotalStages / ctas;
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  float ms = 0.f;
  for (int run = 0; run < 2; ++run) {  // the first warms up
    CHECK(cudaEventRecord(start));
    CHECK(cudaLaunchKernelEx(&config, gather, x, route_tokens, bytes, rows, stages, Kind(kind), cluster, map, sink));
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&ms, start, stop));
  }
  const double us_per_stage = ms * 1e3 / stages;
  std::printf("%-9s %4d B x %3d rows, clusters of %d on %d SMs: %.3f us per stage, %.1f rows received and %.1f "
              "copies issued per us and SM, %.2f TB/s received\n",
              names[kind], bytes, rows, cluster, ctas, us_per_stage, rows / us_per_stage,
              rows / cluster / us_per_stage, double(stages) * ctas * rows * bytes / (ms * 1e-3) / 1e12);
  return 0;
}
