// Dispatch and combine over W ranks (expert parallelism), pull model: every rank reads what it
// needs from its peers through a table of device pointers, one per rank, that are valid on this
// device (peer memory over NVLink; other buffers of the same device for virtual ranks, which is
// how one GPU tests the protocol).
//
// Routes are numbered globally, rank by rank: rank r's route t K + k is route_offsets[r] + t K + k.
// A rank's routing plan covers every rank's routes (the topk_ids of all ranks, gathered) and its
// own experts, so its pool holds rows from all ranks and its route_to_slot tells, for any route,
// where in this rank's pool the route's row is (or -1).
//   dispatch (on the experts' owner): pool row s of a live block = x_r[t] for its route (r, t, k),
//            zeros on padding rows; one warp per row, in pool order. With weights, also the route's
//            topk weight per pool row (0 on padding rows): the backward's p.
//   combine (on the tokens' rank): y[t] = Σ_k p[t, k] · out_d[slot_d(route)] over the one rank d
//            whose plan gives the route a slot, ascending k, fp32, rounded once: the same sums as
//            megamoe_combine_bf16, so W ranks give bit for bit the result of one.
#include <algorithm>

#include "kernels/dispatch_combine/warp_rows.cuh"

namespace megamoe {
namespace {

struct DispatchPeers {
  const Bf16x8* x[MEGAMOE_MAX_PEERS];
  const float* weights[MEGAMOE_MAX_PEERS];  // all null, or each rank's topk weights [T_r, K]
  int64_t route_offsets[MEGAMOE_MAX_PEERS + 1];
  int32_t world;
};

struct CombinePeers {
  const Bf16x8* out[MEGAMOE_MAX_PEERS];
  const int32_t* route_to_slot[MEGAMOE_MAX_PEERS];
  int32_t world;
};

__global__ void __launch_bounds__(kWarpsPerCta * 32)
dispatch_peer_rows(const __grid_constant__ DispatchPeers peers, Bf16x8* __restrict__ pool,
                   float* __restrict__ weights_pool, const int32_t* __restrict__ slot_to_route,
                   const int32_t* __restrict__ num_blocks, int64_t max_rows, int32_t top_k, int32_t vecs_per_row) {
  const int lane = threadIdx.x % 32;
  const int64_t live_rows = std::min<int64_t>(int64_t(*num_blocks) * MEGAMOE_BLOCK_M, max_rows);
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; row < live_rows; row += warps) {
    const int64_t route = slot_to_route[row];
    const Bf16x8* src = nullptr;
    float weight = 0.f;
    for (int r = 0; r < peers.world && route >= 0; ++r) {
      if (route < peers.route_offsets[r + 1]) {
        const int64_t local_route = route - peers.route_offsets[r];
        src = peers.x[r] + local_route / top_k * vecs_per_row;
        if (weights_pool != nullptr) weight = peers.weights[r][local_route];
        break;
      }
    }
    if (weights_pool != nullptr && lane == 0) weights_pool[row] = weight;
    Bf16x8* dst = pool + row * vecs_per_row;
    for (int c = lane; c < vecs_per_row; c += 32) store(dst + c, src != nullptr ? load_readonly(src + c) : Bf16x8{});
  }
}

__global__ void __launch_bounds__(kWarpsPerCta * 32)
combine_peer_rows(const __grid_constant__ CombinePeers peers, const float* __restrict__ topk_weights,
                  int64_t route_offset, Bf16x8* __restrict__ y, int64_t num_tokens, int32_t top_k,
                  int32_t vecs_per_row) {
  const auto route_row = [&](int64_t local_route) -> const Bf16x8* {
    for (int d = 0; d < peers.world; ++d) {  // a route has a slot in one plan at most: its expert's owner
      const int32_t slot = peers.route_to_slot[d][route_offset + local_route];
      if (slot >= 0) return peers.out[d] + int64_t(slot) * vecs_per_row;
    }
    return nullptr;
  };
  combine_tokens(route_row, topk_weights, y, num_tokens, top_k, vecs_per_row);
}

int check_world(const std::string& fn, int32_t world, int32_t top_k) {
  if (world < 1 || world > MEGAMOE_MAX_PEERS) {
    return invalid_argument(fn + "world must be in [1, " + std::to_string(MEGAMOE_MAX_PEERS) + "], got " +
                            std::to_string(world));
  }
  if (top_k < 1) return invalid_argument(fn + "top_k must be >= 1, got " + std::to_string(top_k));
  return MEGAMOE_OK;
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_dispatch_peers_bf16(const megamoe_routing_plan* plan, const megamoe_dispatch_peers_args* args,
                                           void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_dispatch_peers_bf16: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_dispatch_peers_args& a = *args;
  const int32_t top_k = plan->shape.top_k;
  MEGAMOE_RETURN_IF_ERROR(check_world(fn, a.world, top_k));
  if (a.row_bytes <= 0 || a.row_bytes % int(sizeof(Bf16x8))) {
    return invalid_argument(fn + "row_bytes " + std::to_string(a.row_bytes) +
                            " must be a positive multiple of 16 (bf16 rows: 2 * hidden)");
  }
  if (a.x_peers == nullptr || a.route_offsets == nullptr || a.pool == nullptr || plan->slot_to_route == nullptr ||
      plan->num_blocks == nullptr) {
    return invalid_argument(fn + "x_peers, route_offsets, pool and the plan's slot_to_route and num_blocks must be "
                                 "non-null");
  }
  DispatchPeers peers{};
  peers.world = a.world;
  for (int r = 0; r <= a.world; ++r) {
    peers.route_offsets[r] = a.route_offsets[r];
    if (r > 0 &&
        (a.route_offsets[r] < a.route_offsets[r - 1] || (a.route_offsets[r] - a.route_offsets[r - 1]) % top_k)) {
      return invalid_argument(fn + "route_offsets must ascend by multiples of top_k (each rank's T * K routes)");
    }
  }
  if (a.route_offsets[0] != 0) return invalid_argument(fn + "route_offsets[0] must be 0");
  if (a.route_offsets[a.world] != int64_t(plan->shape.num_tokens) * top_k) {
    return invalid_argument(fn + "route_offsets[world] must be the plan's T * K (the plan covers every rank's routes)");
  }
  if ((a.weights_peers == nullptr) != (a.weights_pool == nullptr)) {
    return invalid_argument(fn + "weights_peers and weights_pool go together (both null, or both set)");
  }
  for (int r = 0; r < a.world; ++r) {
    const bool has_tokens = a.route_offsets[r + 1] > a.route_offsets[r];
    if (a.weights_peers != nullptr) {
      if (a.weights_peers[r] == nullptr && has_tokens) {
        return invalid_argument(fn + "weights_peers[" + std::to_string(r) + "] must be non-null when that rank "
                                     "has tokens");
      }
      peers.weights[r] = a.weights_peers[r];
    }
    if (!aligned16(a.x_peers[r]) || (a.x_peers[r] == nullptr && has_tokens)) {
      return invalid_argument(fn + "x_peers[" + std::to_string(r) + "] must be 16-byte aligned and non-null "
                                   "when that rank has tokens");
    }
    peers.x[r] = static_cast<const Bf16x8*>(a.x_peers[r]);
  }
  if (!aligned16(a.pool)) return invalid_argument(fn + "pool must be 16-byte aligned");
  const int64_t max_rows = routing::pool_rows(*plan);
  int grid = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid(max_rows, &grid));
  dispatch_peer_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      peers, static_cast<Bf16x8*>(a.pool), a.weights_pool, plan->slot_to_route, plan->num_blocks, max_rows, top_k,
      a.row_bytes / int(sizeof(Bf16x8)));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

extern "C" int megamoe_combine_peers_bf16(const megamoe_combine_peers_args* args, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_combine_peers_bf16: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_combine_peers_args& a = *args;
  MEGAMOE_RETURN_IF_ERROR(check_world(fn, a.world, a.top_k));
  if (a.hidden <= 0 || a.hidden % kBf16PerVec) {
    return invalid_argument(fn + "hidden size " + std::to_string(a.hidden) + " must be a positive multiple of 8");
  }
  if (a.num_tokens < 0 || a.route_offset < 0) return invalid_argument(fn + "num_tokens and route_offset must be >= 0");
  if (a.num_tokens == 0) return MEGAMOE_OK;
  if (a.out_peers == nullptr || a.route_to_slot_peers == nullptr || a.y == nullptr) {
    return invalid_argument(fn + "out_peers, route_to_slot_peers and y must be non-null");
  }
  CombinePeers peers{};
  peers.world = a.world;
  for (int d = 0; d < a.world; ++d) {
    if (a.out_peers[d] == nullptr || a.route_to_slot_peers[d] == nullptr || !aligned16(a.out_peers[d])) {
      return invalid_argument(fn + "out_peers[" + std::to_string(d) + "] and route_to_slot_peers[" +
                              std::to_string(d) + "] must be non-null, out_peers 16-byte aligned");
    }
    peers.out[d] = static_cast<const Bf16x8*>(a.out_peers[d]);
    peers.route_to_slot[d] = a.route_to_slot_peers[d];
  }
  if (!aligned16(a.y)) return invalid_argument(fn + "y must be 16-byte aligned");
  int grid = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid(a.num_tokens, &grid));
  combine_peer_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      peers, a.topk_weights, a.route_offset, static_cast<Bf16x8*>(a.y), a.num_tokens, a.top_k,
      a.hidden / kBf16PerVec);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
