// How fast can a GEMM producer stream expert weights through TMA when every expert gets few rows
// (30B at 1024 tokens), and what of the GEMM's own structure slows the stream? One CTA per SM reads
// the 30B GEMM1's w13 [128 * 1536, 2048] bf16 tile by tile, each once as GEMM1 reads it (a tile: 128
// gate rows and the matching 128 up rows over the whole K; an expert's 6 tiles on consecutive CTAs),
// with no math, and is timed against a device copy of the same bytes. Kinds of stage:
//   k64    2 boxes of 128 rows x 64 columns (128B swizzle), as the GEMM's ring: 32 KB
//   k128   4 such boxes, columns k and k + 64 of gate and up: 64 KB
//   bulk   2 contiguous 16 KB pieces of the gate and up blocks (a bulk copy ignores the row layout,
//          so this streams the same bytes in the largest pieces TMA takes)
// Then, as the GEMM does: hold (stages each consumer warp keeps before releasing one, as a wgmma
// batch in flight and the one waited for hold 2), spin (clock cycles a consumer spends on each stage,
// as the math: about 1100 for a 128 x 256 x 64 bf16 k-block at the full rate of an H100 or H200 SM)
// and pool (1: each stage also loads the tile's 128-row block of a pool of x [128 * 128, 2048], as
// the GEMM's A: 16 KB more per k-block, read by the expert's 6 tiles).
// Built with the tests (CMakeLists.txt): <build dir>/weight_stream_rate k64|k128|bulk <ring stages>
// [hold] [spin] [pool]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tma_ring.cuh"

namespace {

constexpr int kHidden = 2048, kIntermediate = 768, kExperts = 128;
constexpr int64_t kWeightRows = int64_t(kExperts) * 2 * kIntermediate;
constexpr int kTilesPerExpert = kIntermediate / 128;
constexpr int kTiles = kExperts * kTilesPerExpert;
constexpr int kBoxBytes = 128 * 64 * 2;
constexpr int kMaxRing = 8;
enum Kind { kK64, kK128, kBulk };

struct Stream {
  Kind kind;
  int ring, hold, spin;
  bool pool;
  __host__ __device__ int weight_bytes() const { return kind == kK128 ? 4 * kBoxBytes : 2 * kBoxBytes; }
  __host__ __device__ int columns() const { return weight_bytes() / (2 * 128 * 2); }  // K per stage
  __host__ __device__ int stage_bytes() const { return weight_bytes() + (pool ? columns() / 64 * kBoxBytes : 0); }
};

__global__ void __launch_bounds__(160, 1)
stream_weights(const __grid_constant__ CUtensorMap weights, const __grid_constant__ CUtensorMap pool,
               const uint8_t* __restrict__ w, Stream p, int* sink) {
  extern __shared__ __align__(1024) uint8_t ring[];
  __shared__ uint64_t full[kMaxRing], empty[kMaxRing];
  const int stage_bytes = p.stage_bytes(), columns = p.columns();
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.ring; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], 4);  // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32);
  int i = 0;  // stages so far
  if (warp == 0) {
    if (lane != 0) return;
    for (int t = int(blockIdx.x); t < kTiles; t += int(gridDim.x)) {
      const int expert = t / kTilesPerExpert;
      const int gate = expert * 2 * kIntermediate + t % kTilesPerExpert * 128, up = gate + kIntermediate;
      for (int k = 0; k < kHidden; k += columns, ++i) {
        const int s = i % p.ring;
        barrier_wait(&empty[s], ((i / p.ring) & 1) ^ 1);
        barrier_expect(&full[s], uint32_t(stage_bytes));
        uint8_t* stage = ring + s * stage_bytes;
        if (p.kind == kBulk) {
          const int piece = p.weight_bytes() / 2;
          const int64_t offset = int64_t(k / columns) * piece;
          bulk_copy(stage, w + int64_t(gate) * kHidden * 2 + offset, uint32_t(piece), &full[s]);
          bulk_copy(stage + piece, w + int64_t(up) * kHidden * 2 + offset, uint32_t(piece), &full[s]);
        } else {
          for (int c = 0; c < columns; c += 64, stage += 2 * kBoxBytes) {
            box_copy(stage, &weights, k + c, gate, &full[s]);
            box_copy(stage + kBoxBytes, &weights, k + c, up, &full[s]);
          }
        }
        for (int c = 0; p.pool && c < columns; c += 64, stage += kBoxBytes) {
          box_copy(stage, &pool, k + c, expert * 128, &full[s]);
        }
      }
    }
  } else if (lane == 0) {  // consumers: one arrive per warp and stage, `hold` stages behind
    int seen = 0;
    for (int t = int(blockIdx.x); t < kTiles; t += int(gridDim.x)) {
      for (int k = 0; k < kHidden; k += columns, ++i) {
        barrier_wait(&full[i % p.ring], (i / p.ring) & 1);
        seen += ring[i % p.ring * stage_bytes + warp * 64];
        for (const long long start = clock64(); clock64() - start < p.spin;) {
        }
        if (i >= p.hold) barrier_arrive(&empty[(i - p.hold) % p.ring]);
      }
    }
    for (int j = i > p.hold ? i - p.hold : 0; j < i; ++j) barrier_arrive(&empty[j % p.ring]);
    if (seen == -1) *sink = seen;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* names[] = {"k64", "k128", "bulk"};
  int kind = -1;
  for (int k = 0; argc > 1 && k < 3; ++k) kind = std::strcmp(argv[1], names[k]) == 0 ? k : kind;
  Stream p{Kind(kind), argc > 2 ? std::atoi(argv[2]) : 0, argc > 3 ? std::atoi(argv[3]) : 0,
           argc > 4 ? std::atoi(argv[4]) : 0, argc > 5 && std::atoi(argv[5]) != 0};
  const int smem = p.ring * p.stage_bytes();
  if (argc < 3 || argc > 6 || kind < 0 || p.ring < 2 || p.ring > kMaxRing || p.hold < 0 || p.hold >= p.ring ||
      p.spin < 0 || smem > 227 * 1024 || (p.pool && p.kind == kBulk)) {
    std::printf("usage: %s k64|k128|bulk <ring stages> [hold] [spin] [pool]: 2 to 8 stages within 227 KB, hold "
                "below the ring, pool with k64 or k128\n",
                argv[0]);
    return 2;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t weight_bytes = size_t(kWeightRows) * kHidden * 2, pool_bytes = size_t(kExperts) * 128 * kHidden * 2;
  uint8_t *w = nullptr, *x = nullptr, *copy = nullptr, *flush = nullptr;
  int* sink = nullptr;
  CHECK(cudaMalloc(&w, weight_bytes));
  CHECK(cudaMalloc(&copy, weight_bytes));
  CHECK(cudaMalloc(&x, pool_bytes));
  CHECK(cudaMalloc(&flush, size_t(256) << 20));  // larger than L2: each run starts from HBM
  CHECK(cudaMalloc(&sink, sizeof(int)));
  CHECK(cudaMemset(w, 1, weight_bytes));
  CHECK(cudaMemset(x, 2, pool_bytes));
  const CUtensorMap weights = bf16_boxes(w, uint64_t(kWeightRows), kHidden, kHidden * 2, 128, 64,
                                         CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap pool = bf16_boxes(x, uint64_t(kExperts) * 128, kHidden, kHidden * 2, 128, 64,
                                      CU_TENSOR_MAP_SWIZZLE_128B);
  CHECK(cudaFuncSetAttribute(stream_weights, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const auto time = [&](const auto& launch, int runs) {
    float best = 1e30f;
    for (int run = 0; run < runs + 1; ++run) {  // the first warms up
      CHECK(cudaMemsetAsync(flush, run, size_t(256) << 20));
      CHECK(cudaEventRecord(start));
      launch();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      CHECK(cudaGetLastError());
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (run > 0 && ms < best) best = ms;
    }
    return best * 1e-3;
  };
  const double seconds = time([&] { stream_weights<<<sms, 160, smem>>>(weights, pool, w, p, sink); }, 20);
  const double copy_seconds =
      time([&] { CHECK(cudaMemcpyAsync(copy, w, weight_bytes, cudaMemcpyDeviceToDevice)); }, 5);
  std::printf("%-4s ring %d (%3d KB) hold %d spin %4d pool %d: %.1f us, weights at %.2f TB/s; a device copy "
              "moves %.2f TB/s (read + write)\n",
              names[kind], p.ring, smem / 1024, p.hold, p.spin, int(p.pool), seconds * 1e6,
              weight_bytes / seconds / 1e12, 2 * weight_bytes / copy_seconds / 1e12);
  return 0;
}
