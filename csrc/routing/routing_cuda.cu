// CUDA routing plan in three deterministic passes (no atomics whose order shows in the result):
//   1. count:  one warp per chunk of routes counts routes per local expert (shared-memory atomics:
//              a count does not depend on their order) and the invalid ids for that chunk; the grid
//              also resets slot_to_route and block_expert to -1, so no memset launches precede it;
//   2. scan:   one CTA turns chunk counts into per-chunk bases, expert offsets (padded and
//              compact) and the block list (each expert's chunks in 8 ranges: sums side by side,
//              then bases), and sums the chunks' invalid ids;
//   3. assign: each warp walks its chunk again in route order and hands out pool slots.
// A small plan (routing.h: builds_in_one_cluster) is one launch of a cluster of up to 8 CTAs, a
// thread per route: each warp ranks its routes per expert, each CTA scans its warps' counts per
// expert in shared memory, and every CTA reads the others' per-expert counts across the cluster
// (distributed shared memory) to find its routes' slots, so a small batch pays one launch, no
// workspace and no wait between passes.
// Routes that hit the same expert inside one 32-route step are ranked by one ballot per bit of the
// expert id, faster here than __match_any_sync. Count and assign keep each warp's per-expert counters
// in shared memory and load the chunk's ids first: assign's walk is a chain of read-modify-writes,
// which in global memory would wait for L2 at every step.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <string>

#include "common/status.h"
#include "routing/routing.h"

namespace megamoe::routing {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kScanExperts = 128;  // experts per pass of the scan CTA
constexpr int kScanGroups = 8;     // chunk ranges per expert, scanned side by side
constexpr int kScanThreads = kScanExperts * kScanGroups;
constexpr int kStepsPerChunk = kRoutesPerChunk / 32;
constexpr int kScanBatch = 16;
constexpr int kClusterThreads = int(kClusterRoutesPerCta);  // a thread per route
constexpr int kClusterWarps = kClusterThreads / 32;
static_assert(kClusterMaxExperts <= kClusterThreads, "the cluster build's scan gives each expert a thread");
// Per local expert in a cluster CTA's shared memory, a row of kClusterRowInts: its count in each of
// the CTA's warps (then their exclusive prefix), then the CTA's first slot of the expert; the padding
// to 33 lets a thread walk one expert's row while its warp's other lanes walk theirs in other banks.
constexpr int kClusterRowInts = kClusterWarps + 1;
// Dynamic shared memory up to this size fits beside the cluster build's static storage within the
// default 48 KB; more (up to 1024 experts' rows) opts in.
constexpr size_t kClusterDefaultSharedBytes = 32 * 1024;

struct WarpGroupOfExpert {
  unsigned peers;  // lanes whose route goes to the same local expert (or the same "none")
  int leader;      // lowest such lane
  int rank;        // this lane's position among its peers
};

// Lanes with equal keys expert + 1 (0 for none, at most num_local_experts, which fits in key_bits).
__device__ WarpGroupOfExpert group_lanes_by_expert(int32_t expert, int key_bits) {
  const unsigned key = unsigned(expert + 1);
  unsigned peers = 0xffffffffu;
  for (int b = 0; b < key_bits; ++b) {
    const bool bit = (key >> b) & 1u;
    const unsigned lanes_with_bit = __ballot_sync(0xffffffffu, bit);
    peers &= bit ? lanes_with_bit : ~lanes_with_bit;
  }
  const int lane = threadIdx.x % 32;
  return {peers, __ffs(peers) - 1, __popc(peers & ((1u << lane) - 1u))};
}

// The workspace: per-chunk, per-expert counters, then one invalid-id count per chunk.
__device__ __forceinline__ int32_t* chunk_invalid_counts(int32_t* chunk_counts, const megamoe_routing_shape& s) {
  return chunk_counts + num_chunks(s) * s.num_local_experts;
}

// The chunk's ids (plan_id: int32 or int64 ids), lane l holding route chunk * kRoutesPerChunk + 32 step + l
// in ids[step] (-1 past the routes: no expert, not invalid).
template <typename Id>
__device__ __forceinline__ void load_chunk_ids(const Id* __restrict__ topk_ids, const megamoe_routing_shape& s,
                                               int64_t chunk, int32_t (&ids)[kStepsPerChunk]) {
  const int64_t routes = num_routes(s);
  const int lane = threadIdx.x % 32;
  // Every load is issued before any id is narrowed: narrowing an int64 id as it arrives would wait
  // for each load in turn.
  Id raw[kStepsPerChunk];
#pragma unroll
  for (int step = 0; step < kStepsPerChunk; ++step) {
    const int64_t r = chunk * kRoutesPerChunk + step * 32 + lane;
    raw[step] = r < routes ? topk_ids[r] : Id(-1);
  }
#pragma unroll
  for (int step = 0; step < kStepsPerChunk; ++step) ids[step] = plan_id(raw[step], s);
}

// This warp's chunk (a warp per chunk, blockDim.x / 32 warps per CTA) and its counters in the
// dynamic shared memory (one int32 per local expert per warp).
struct WarpChunk {
  int64_t chunk;
  int32_t* counters;
};

__device__ __forceinline__ WarpChunk warp_chunk(int32_t* shared_counters, const megamoe_routing_shape& s) {
  const int warp = threadIdx.x / 32;
  return {int64_t(blockIdx.x) * (blockDim.x / 32) + warp, shared_counters + int64_t(warp) * s.num_local_experts};
}

// Every pool row and block starts unassigned (-1): the pool's rows [first, capacity) by `stride`.
__device__ __forceinline__ void reset_pool(const megamoe_routing_plan& plan, int64_t capacity, int64_t first,
                                           int64_t stride) {
  for (int64_t i = first; i < capacity; i += stride) {
    plan.slot_to_route[i] = -1;
    if (i < capacity / kBlockM) plan.block_expert[i] = -1;
  }
}

// The warp's count of its chunk's routes per local expert, into counts (shared memory, one int32 per
// expert); returns the chunk's invalid ids (every lane).
template <typename Id>
__device__ int32_t count_chunk(const Id* __restrict__ topk_ids, const megamoe_routing_shape& shape,
                               int64_t chunk, int32_t* counts) {
  const int lane = threadIdx.x % 32;
  for (int32_t e = lane; e < shape.num_local_experts; e += 32) counts[e] = 0;
  int32_t ids[kStepsPerChunk];
  load_chunk_ids(topk_ids, shape, chunk, ids);
  __syncwarp();
  int invalid = 0;
#pragma unroll
  for (int step = 0; step < kStepsPerChunk; ++step) {
    invalid += is_invalid_id(ids[step], shape);
    const int32_t expert = local_expert(ids[step], shape);
    if (expert >= 0) atomicAdd(&counts[expert], 1);
  }
  __syncwarp();
  return __reduce_add_sync(0xffffffffu, invalid);
}

template <typename Id>
__global__ void count_chunks(const Id* __restrict__ topk_ids, megamoe_routing_shape shape,
                             int32_t* __restrict__ chunk_counts, megamoe_routing_plan plan, int64_t capacity) {
  extern __shared__ int32_t shared_counters[];
  reset_pool(plan, capacity, int64_t(blockIdx.x) * blockDim.x + threadIdx.x, int64_t(gridDim.x) * blockDim.x);
  const auto [chunk, counts] = warp_chunk(shared_counters, shape);
  const int lane = threadIdx.x % 32;
  if (chunk >= num_chunks(shape)) return;
  const int32_t experts = shape.num_local_experts;
  const int32_t invalid = count_chunk(topk_ids, shape, chunk, counts);
  int32_t* out = chunk_counts + chunk * experts;
  for (int32_t e = lane; e < experts; e += 32) out[e] = counts[e];
  if (lane == 0) chunk_invalid_counts(chunk_counts, shape)[chunk] = invalid;
}

// kScanBatch consecutive chunks' counts of expert e (0 past end_chunk), loaded together so that
// kScanBatch loads are in flight per thread.
__device__ __forceinline__ void load_count_batch(const int32_t* __restrict__ chunk_counts, int64_t c0,
                                                 int64_t end_chunk, int32_t experts, int32_t e,
                                                 int32_t (&counts)[kScanBatch]) {
#pragma unroll
  for (int i = 0; i < kScanBatch; ++i) counts[i] = c0 + i < end_chunk ? chunk_counts[(c0 + i) * experts + e] : 0;
}

// The plan's count of invalid ids, also to pinned host memory where the plan has a slot there.
__device__ __forceinline__ void write_invalid_count(const megamoe_routing_plan& plan, int32_t count) {
  *plan.num_invalid = count;
  if (plan.num_invalid_host != nullptr) {
    *plan.num_invalid_host = count;
    __threadfence_system();  // the host reads it once an event after this kernel has completed
  }
}

// The scan, one CTA of kScanThreads over the workspace's chunk_counts (count's layout): the counts
// become per-chunk bases, and the plan gets its offsets, block list and counts.
__global__ void __launch_bounds__(kScanThreads)
scan_chunks(megamoe_routing_shape shape, int32_t* __restrict__ chunk_counts, megamoe_routing_plan plan) {
  using BlockScan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage, routes_scan_storage;
  __shared__ int32_t group_sums[kScanGroups][kScanExperts];
  __shared__ int32_t blocks_before_tile, routes_before_tile;
  const int64_t chunks = num_chunks(shape);
  const int64_t chunks_per_group = ceil_div(chunks, kScanGroups);
  const int32_t experts = shape.num_local_experts;
  // Thread (group, expert): group-major, so consecutive threads read consecutive experts' counts.
  const int group = threadIdx.x / kScanExperts;
  const int64_t first_chunk = group * chunks_per_group;
  const int64_t end_chunk = first_chunk + chunks_per_group < chunks ? first_chunk + chunks_per_group : chunks;
  int32_t invalid = 0;
  for (int64_t c = threadIdx.x; c < chunks; c += kScanThreads) invalid += chunk_invalid_counts(chunk_counts, shape)[c];
  int32_t unused, total_invalid;
  BlockScan(scan_storage).ExclusiveSum(invalid, unused, total_invalid);
  if (threadIdx.x == 0) {
    blocks_before_tile = routes_before_tile = 0;
    write_invalid_count(plan, total_invalid);
  }
  __syncthreads();  // also before scan_storage is used again
  for (int32_t tile = 0; tile < experts; tile += kScanExperts) {
    const int expert_in_tile = threadIdx.x % kScanExperts;
    const int32_t e = tile + expert_in_tile;
    const bool live = e < experts;
    // 1. Each group sums its range of chunks.
    int32_t sum = 0;
    for (int64_t c0 = first_chunk; live && c0 < end_chunk; c0 += kScanBatch) {
      int32_t counts[kScanBatch];
      load_count_batch(chunk_counts, c0, end_chunk, experts, e, counts);
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) sum += counts[i];
    }
    group_sums[group][expert_in_tile] = sum;
    __syncthreads();
    // 2. The expert's routes before this group's chunks, and its total.
    int32_t base = 0, total = 0;
    for (int g = 0; g < kScanGroups; ++g) {
      const int32_t s = group_sums[g][expert_in_tile];
      base += g < group ? s : 0;
      total += s;
    }
    // 3. Chunk counts -> exclusive per-chunk bases, in chunk order within the group.
    for (int64_t c0 = first_chunk; live && c0 < end_chunk; c0 += kScanBatch) {
      int32_t counts[kScanBatch];
      load_count_batch(chunk_counts, c0, end_chunk, experts, e, counts);
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) {
        if (c0 + i < end_chunk) chunk_counts[(c0 + i) * experts + e] = base;
        base += counts[i];
      }
    }
    // 4. Expert offsets and the block list: group 0 holds the experts of this tile in order, and
    // the other groups add 0, so one block-wide scan gives each expert's first block (and one its
    // first compact row).
    const bool owner = live && group == 0;
    const int32_t expert_blocks = owner ? int32_t(ceil_div(total, kBlockM)) : 0;
    int32_t first_block, tile_blocks, first_route, tile_routes;
    BlockScan(scan_storage).ExclusiveSum(expert_blocks, first_block, tile_blocks);
    BlockScan(routes_scan_storage).ExclusiveSum(owner ? total : 0, first_route, tile_routes);
    first_block += blocks_before_tile;
    if (owner) {
      plan.expert_counts[e] = total;
      plan.expert_offsets[e] = first_block * kBlockM;
      plan.compact_offsets[e] = routes_before_tile + first_route;
      for (int32_t b = 0; b < expert_blocks; ++b) plan.block_expert[first_block + b] = e;
    }
    __syncthreads();  // everyone has read the tile counters, group_sums and the scan storage
    if (threadIdx.x == 0) {
      blocks_before_tile += tile_blocks;
      routes_before_tile += tile_routes;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    plan.expert_offsets[experts] = blocks_before_tile * kBlockM;
    plan.compact_offsets[experts] = routes_before_tile;
    *plan.num_blocks = blocks_before_tile;
  }
}

// The warp walks its chunk in route order and hands out pool slots: next_slot (shared memory, one
// int32 per local expert) holds the chunk's base within each expert on entry.
template <typename Id>
__device__ void assign_chunk(const Id* __restrict__ topk_ids, const megamoe_routing_shape& shape, int64_t chunk,
                             int32_t* next_slot, const megamoe_routing_plan& plan) {
  const int lane = threadIdx.x % 32;
  for (int32_t e = lane; e < shape.num_local_experts; e += 32) next_slot[e] += plan.expert_offsets[e];
  int32_t ids[kStepsPerChunk];
  load_chunk_ids(topk_ids, shape, chunk, ids);
  __syncwarp();
  const int64_t routes = num_routes(shape);
  const int key_bits = 32 - __clz(shape.num_local_experts);
#pragma unroll
  for (int step = 0; step < kStepsPerChunk; ++step) {
    const int32_t expert = local_expert(ids[step], shape);
    const auto group = group_lanes_by_expert(expert, key_bits);
    int32_t first = 0;
    if (lane == group.leader && expert >= 0) {
      first = next_slot[expert];
      next_slot[expert] = first + __popc(group.peers);
    }
    first = __shfl_sync(0xffffffffu, first, group.leader);
    __syncwarp();
    const int64_t r = chunk * kRoutesPerChunk + step * 32 + lane;
    if (r < routes) {
      const int32_t slot = expert >= 0 ? first + group.rank : -1;
      plan.route_to_slot[r] = slot;
      if (slot >= 0) plan.slot_to_route[slot] = int32_t(r);
    }
  }
}

template <typename Id>
__global__ void assign_slots(const Id* __restrict__ topk_ids, megamoe_routing_shape shape,
                             const int32_t* __restrict__ chunk_bases, megamoe_routing_plan plan) {
  extern __shared__ int32_t shared_counters[];
  const auto [chunk, next_slot] = warp_chunk(shared_counters, shape);
  if (chunk >= num_chunks(shape)) return;
  const int32_t* bases = chunk_bases + chunk * shape.num_local_experts;
  for (int32_t e = threadIdx.x % 32; e < shape.num_local_experts; e += 32) next_slot[e] = bases[e];
  __syncwarp();
  assign_chunk(topk_ids, shape, chunk, next_slot, plan);
}

// The plan of up to kClusterMaxCtas * kClusterThreads routes (builds_in_one_cluster): CTA c's thread
// t takes route c * kClusterThreads + t. Dynamic shared memory: a row of kClusterRowInts per local
// expert, then each expert's count in this CTA (which the other CTAs read).
template <typename Id>
__global__ void __launch_bounds__(kClusterThreads, 1)
build_in_one_cluster(const Id* __restrict__ topk_ids, megamoe_routing_shape shape, megamoe_routing_plan plan,
                     int64_t capacity) {
  using BlockScan = cub::BlockScan<int32_t, kClusterThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int32_t cta_invalid;
  extern __shared__ int32_t expert_rows[];
  const int32_t experts = shape.num_local_experts;
  int32_t* cta_counts = expert_rows + int64_t(experts) * kClusterRowInts;
  const auto cluster = cooperative_groups::this_cluster();
  const int cta = int(cluster.block_rank()), ctas = int(cluster.num_blocks());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  reset_pool(plan, capacity, int64_t(cta) * kClusterThreads + threadIdx.x, int64_t(ctas) * kClusterThreads);
  for (int i = threadIdx.x; i < experts * kClusterRowInts; i += kClusterThreads) expert_rows[i] = 0;
  if (threadIdx.x == 0) cta_invalid = 0;

  // 1. The route's expert, its rank among the warp's routes to that expert, the warp's invalid ids.
  const int64_t routes = num_routes(shape);
  const int64_t route = int64_t(cta) * kClusterThreads + threadIdx.x;
  const int32_t id = route < routes ? plan_id(topk_ids[route], shape) : -1;
  const int32_t expert = local_expert(id, shape);
  const int invalid = __reduce_add_sync(0xffffffffu, int(is_invalid_id(id, shape)));
  const auto group = group_lanes_by_expert(expert, 32 - __clz(experts));
  __syncthreads();  // the rows are zero
  if (lane == group.leader && expert >= 0) expert_rows[expert * kClusterRowInts + warp] = __popc(group.peers);
  if (lane == 0 && invalid > 0) atomicAdd(&cta_invalid, invalid);  // a sum: its order does not show
  __syncthreads();

  // 2. Per expert: the warps' counts become their exclusive prefix, and the CTA's count.
  for (int32_t e = threadIdx.x; e < experts; e += kClusterThreads) {
    int32_t* row = expert_rows + e * kClusterRowInts;
    int32_t sum = 0;
    for (int w = 0; w < kClusterWarps; ++w) {
      const int32_t count = row[w];
      row[w] = sum;
      sum += count;
    }
    cta_counts[e] = sum;
  }
  cluster.sync();  // every CTA's counts, and every CTA's part of the pool reset

  // 3. Thread e: expert e's routes in the CTAs before this one and in all; the block list and offsets
  // (every CTA scans the same totals; CTA 0 writes them).
  const int32_t e = threadIdx.x;
  int32_t before = 0, total = 0;
  for (int c = 0; e < experts && c < ctas; ++c) {
    const int32_t count = cluster.map_shared_rank(cta_counts, c)[e];
    before += c < cta ? count : 0;
    total += count;
  }
  const int32_t expert_blocks = e < experts ? int32_t(ceil_div(total, kBlockM)) : 0;
  int32_t first_block, num_blocks, first_route, num_compact;
  BlockScan(scan_storage).ExclusiveSum(expert_blocks, first_block, num_blocks);
  __syncthreads();  // scan_storage again
  BlockScan(scan_storage).ExclusiveSum(e < experts ? total : 0, first_route, num_compact);
  if (e < experts) {
    expert_rows[e * kClusterRowInts + kClusterWarps] = first_block * kBlockM + before;
    if (cta == 0) {
      plan.expert_counts[e] = total;
      plan.expert_offsets[e] = first_block * kBlockM;
      plan.compact_offsets[e] = first_route;
      for (int32_t b = 0; b < expert_blocks; ++b) plan.block_expert[first_block + b] = e;
    }
  }
  if (cta == 0 && threadIdx.x == 0) {
    plan.expert_offsets[experts] = num_blocks * kBlockM;
    plan.compact_offsets[experts] = num_compact;
    *plan.num_blocks = num_blocks;
    int32_t invalid_ids = 0;
    for (int c = 0; c < ctas; ++c) invalid_ids += *cluster.map_shared_rank(&cta_invalid, c);
    write_invalid_count(plan, invalid_ids);
  }
  __syncthreads();  // the CTA's first slots

  // 4. The route's slot: the CTA's first of its expert, the warps before, its rank in the warp.
  if (route < routes) {
    const int32_t* row = expert_rows + expert * kClusterRowInts;
    const int32_t slot = expert >= 0 ? row[kClusterWarps] + row[warp] + group.rank : -1;
    plan.route_to_slot[route] = slot;
    if (slot >= 0) plan.slot_to_route[slot] = int32_t(route);
  }
  cluster.sync();  // no CTA leaves while another reads its shared memory
}

// Warps per CTA of count and assign, and their dynamic shared memory: up to kWarpsPerCta warps, as
// many as this GPU's shared memory holds counters for.
struct ChunkLaunch {
  int warps_per_cta;
  size_t shared_bytes;
};

template <typename Id>
int chunk_launch(const megamoe_routing_shape& s, ChunkLaunch* launch) {
  int device = 0, optin = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t per_warp = size_t(s.num_local_experts) * sizeof(int32_t);
  const int warps = int(std::min<size_t>(kWarpsPerCta, size_t(optin) / per_warp));
  if (warps < 1) {
    return invalid_argument("routing: " + std::to_string(s.num_local_experts) +
                            " local experts need more shared memory for their counters than this GPU has (" +
                            std::to_string(optin) + " bytes per CTA): use fewer experts per rank");
  }
  *launch = {warps, size_t(warps) * per_warp};
  if (launch->shared_bytes > 48 * 1024) {  // above the default limit: opt in
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(count_chunks<Id>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      int(launch->shared_bytes)));
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(assign_slots<Id>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      int(launch->shared_bytes)));
  }
  return MEGAMOE_OK;
}

// The plan's launches for ids of type Id (plan->shape and its pointers validated).
template <typename Id>
int build(const Id* topk_ids, const megamoe_routing_plan& plan, cudaStream_t stream) {
  const auto& s = plan.shape;
  if (builds_in_one_cluster(s)) {
    const int ctas = int(std::max<int64_t>(1, ceil_div(num_routes(s), kClusterRoutesPerCta)));
    const size_t shared_bytes = size_t(s.num_local_experts) * (kClusterRowInts + 1) * sizeof(int32_t);
    if (shared_bytes > kClusterDefaultSharedBytes) {
      const auto kernel = build_in_one_cluster<Id>;
      MEGAMOE_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)));
    }
    cudaLaunchAttribute cluster_dims{};
    cluster_dims.id = cudaLaunchAttributeClusterDimension;
    cluster_dims.val.clusterDim = {unsigned(ctas), 1, 1};
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(ctas);
    config.blockDim = dim3(kClusterThreads);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = &cluster_dims;
    config.numAttrs = 1;
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        cudaLaunchKernelEx(&config, build_in_one_cluster<Id>, topk_ids, s, plan, megamoe_routing_capacity(&s)));
    return MEGAMOE_OK;
  }
  auto* chunk_counts = static_cast<int32_t*>(plan.workspace);
  const int64_t chunks = num_chunks(s);
  ChunkLaunch launch{};
  MEGAMOE_RETURN_IF_ERROR(chunk_launch<Id>(s, &launch));
  const int grid = int(ceil_div(chunks, launch.warps_per_cta));
  const int threads = launch.warps_per_cta * 32;

  count_chunks<<<grid, threads, launch.shared_bytes, stream>>>(topk_ids, s, chunk_counts, plan,
                                                               megamoe_routing_capacity(&s));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  scan_chunks<<<1, kScanThreads, 0, stream>>>(s, chunk_counts, plan);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  assign_slots<<<grid, threads, launch.shared_bytes, stream>>>(topk_ids, s, chunk_counts, plan);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

}  // namespace
}  // namespace megamoe::routing

using namespace megamoe::routing;

extern "C" int megamoe_build_routing_cuda(const void* topk_ids, int32_t id_bytes, const megamoe_routing_plan* plan,
                                          void* stream_handle) {
  if (plan == nullptr) return megamoe::invalid_argument("routing: null plan");
  MEGAMOE_RETURN_IF_ERROR(validate(plan, !builds_in_one_cluster(plan->shape)));
  MEGAMOE_RETURN_IF_ERROR(check_ids(topk_ids, id_bytes, plan->shape));
  auto stream = static_cast<cudaStream_t>(stream_handle);
  if (id_bytes == 8) return build(static_cast<const int64_t*>(topk_ids), *plan, stream);
  return build(static_cast<const int32_t*>(topk_ids), *plan, stream);
}
