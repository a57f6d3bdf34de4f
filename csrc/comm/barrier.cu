// A barrier across the W ranks of an expert-parallel group, with a timeout instead of a hang.
//
// Each rank owns W int32 signals in memory every rank can write (symmetric memory across GPUs;
// buffers of one device for virtual ranks). One warp: lane d stores the epoch into rank d's signal
// for this rank (release, system scope), then waits (acquire) until this rank's signal from rank d
// reaches the epoch, or until the timeout passes. The status tells the host which rank did not
// arrive at which phase; the kernel itself always returns.
#include <string>

#include "common/status.h"

namespace megamoe {
namespace {

struct SignalPeers {
  int32_t* signals[MEGAMOE_MAX_PEERS];
};

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t load_acquire(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__global__ void barrier_warp(const __grid_constant__ SignalPeers peers, int32_t world, int32_t rank, int32_t epoch,
                             int32_t phase, int64_t timeout_ns, int32_t* status) {
  const int lane = int(threadIdx.x);
  bool arrived = true;
  if (lane < world) {
    store_release(peers.signals[lane] + rank, epoch);
    const int32_t* mine = peers.signals[rank] + lane;
    const uint64_t start = global_time_ns();
    while (load_acquire(mine) < epoch) {
      if (global_time_ns() - start > uint64_t(timeout_ns)) {
        arrived = false;
        break;
      }
      __nanosleep(128);
    }
  }
  const unsigned missing = __ballot_sync(~0u, !arrived);
  if (lane == 0) {
    status[0] = missing ? phase : 0;
    status[1] = missing ? __ffs(missing) : 0;  // 1 + the first rank that did not arrive
  }
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_barrier(void* const* signal_peers, int32_t world, int32_t rank, int32_t epoch, int32_t phase,
                               int64_t timeout_ns, int32_t* status, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_barrier: ";
  if (world < 1 || world > MEGAMOE_MAX_PEERS) {
    return invalid_argument(fn + "world must be in [1, " + std::to_string(MEGAMOE_MAX_PEERS) + "], got " +
                            std::to_string(world));
  }
  if (rank < 0 || rank >= world) {
    return invalid_argument(fn + "rank must be in [0, world), got " + std::to_string(rank));
  }
  if (epoch < 1) return invalid_argument(fn + "epoch must be >= 1 (and grow from call to call)");
  if (phase < 1) return invalid_argument(fn + "phase must be >= 1 (0 means every rank arrived)");
  if (timeout_ns <= 0) return invalid_argument(fn + "timeout_ns must be > 0");
  if (signal_peers == nullptr || status == nullptr) {
    return invalid_argument(fn + "signal_peers and status must be non-null");
  }
  SignalPeers peers{};
  for (int d = 0; d < world; ++d) {
    if (signal_peers[d] == nullptr) {
      return invalid_argument(fn + "signal_peers[" + std::to_string(d) + "] must be non-null");
    }
    peers.signals[d] = static_cast<int32_t*>(signal_peers[d]);
  }
  barrier_warp<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(peers, world, rank, epoch, phase, timeout_ns, status);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

extern "C" int megamoe_barrier_check(const int32_t* status, int32_t rank, int64_t timeout_ns) {
  using namespace megamoe;
  if (status == nullptr) return invalid_argument("megamoe_barrier_check: status must be non-null");
  if (status[0] == 0) return MEGAMOE_OK;
  return set_error(MEGAMOE_ERROR_TIMEOUT,
                   "rank " + std::to_string(rank) + " waited " + std::to_string(timeout_ns / 1000000) +
                       " ms at barrier phase " + std::to_string(status[0]) + " and rank " +
                       std::to_string(status[1] - 1) +
                       " did not arrive: it stopped, crashed or runs a different number of MoE calls");
}
