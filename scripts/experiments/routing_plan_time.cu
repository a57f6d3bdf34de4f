// How long does the GPU routing plan take at the Qwen3-30B-A3B routing (128 experts, top-8, each token's
// experts distinct and uniform) for 256 to 16384 tokens, from int32 and from int64 ids? Each plan is
// checked against the host plan, then 200 builds captured in one CUDA graph are replayed six times and the
// fastest replay gives the time per build (the launch included, as in a layer's stream of kernels).
// Built with the tests (CMakeLists.txt): <build dir>/routing_plan_time
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "megamoe/megamoe.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

void check_megamoe(int status, const char* what) {
  if (status == MEGAMOE_OK) return;
  std::fprintf(stderr, "%s: %s\n", what, megamoe_last_error());
  std::exit(1);
}

// The plan's arrays, on the device or the host, in the plan's field order.
struct PlanArrays {
  std::vector<int64_t> sizes;
  std::vector<std::vector<int32_t>> host;
  std::vector<int32_t*> device;
  megamoe_routing_plan plan{};

  PlanArrays(const megamoe_routing_shape& s, bool on_device)
      : sizes{s.num_local_experts,     s.num_local_experts + 1,       s.num_local_experts + 1,
              s.num_tokens * s.top_k,  megamoe_routing_capacity(&s), megamoe_routing_max_blocks(&s),
              1,                       1} {
    int32_t* arrays[8];
    for (int i = 0; i < 8; ++i) {
      if (on_device) {
        check_cuda(cudaMalloc(&arrays[i], size_t(std::max<int64_t>(sizes[i], 1)) * sizeof(int32_t)), "cudaMalloc");
        device.push_back(arrays[i]);
      } else {
        host.emplace_back(size_t(sizes[i]));
        arrays[i] = host.back().data();
      }
    }
    plan = {arrays[0], arrays[1], arrays[2], arrays[3], arrays[4], arrays[5], arrays[6], arrays[7], nullptr, s};
    const size_t workspace = megamoe_routing_workspace_bytes(&s);
    if (on_device && workspace > 0) check_cuda(cudaMalloc(&plan.workspace, workspace), "cudaMalloc");
  }
  PlanArrays(const PlanArrays&) = delete;
  PlanArrays& operator=(const PlanArrays&) = delete;
  ~PlanArrays() {
    for (int32_t* array : device) cudaFree(array);
    cudaFree(plan.workspace);
  }

  // Every array as the host sees it.
  std::vector<std::vector<int32_t>> read() const {
    if (device.empty()) return host;
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < 8; ++i) {
      out.emplace_back(size_t(sizes[i]));
      check_cuda(cudaMemcpy(out.back().data(), device[i], out.back().size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                 "cudaMemcpy");
    }
    return out;
  }
};

// The fastest time per build of `ids` (held as Id on the device: int32 or int64) in µs, or -1 where the
// plan differs from the host plan of the same ids.
template <typename Id>
float time_plans(const megamoe_routing_shape& shape, const std::vector<int32_t>& ids, cudaStream_t stream,
                 int32_t* host_count) {
  constexpr int kBuilds = 200;
  const std::vector<Id> wide(ids.begin(), ids.end());
  const int32_t id_bytes = int32_t(sizeof(Id));
  Id* device_ids;
  check_cuda(cudaMalloc(&device_ids, wide.size() * sizeof(Id)), "cudaMalloc");
  check_cuda(cudaMemcpy(device_ids, wide.data(), wide.size() * sizeof(Id), cudaMemcpyHostToDevice), "cudaMemcpy");
  PlanArrays on_device(shape, true), on_host(shape, false);
  on_device.plan.num_invalid_host = host_count;
  check_megamoe(megamoe_build_routing_cuda(device_ids, id_bytes, &on_device.plan, stream), "build_routing_cuda");
  check_cuda(cudaStreamSynchronize(stream), "build");
  check_megamoe(megamoe_build_routing_host(ids.data(), 4, &on_host.plan), "build_routing_host");
  const bool matches = on_device.read() == on_host.read();

  cudaGraph_t graph;
  cudaGraphExec_t replay;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < kBuilds; ++i) {
    check_megamoe(megamoe_build_routing_cuda(device_ids, id_bytes, &on_device.plan, stream), "build_routing_cuda");
  }
  check_cuda(cudaStreamEndCapture(stream, &graph), "capture");
  check_cuda(cudaGraphInstantiate(&replay, graph, 0), "instantiate");
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "event");
  check_cuda(cudaEventCreate(&stop), "event");
  float fastest_ms = 1e30f;
  for (int round = 0; round < 7; ++round) {  // the first round warms up
    check_cuda(cudaEventRecord(start, stream), "record");
    check_cuda(cudaGraphLaunch(replay, stream), "replay");
    check_cuda(cudaEventRecord(stop, stream), "record");
    check_cuda(cudaEventSynchronize(stop), "replay");
    float ms;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    if (round > 0) fastest_ms = std::min(fastest_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(replay);
  cudaGraphDestroy(graph);
  cudaFree(device_ids);
  return matches ? fastest_ms * 1e3f / kBuilds : -1.0f;
}

}  // namespace

int main() {
  constexpr int kExperts = 128, kTopK = 8;
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  int32_t* host_count;  // the pinned slot the layer's plans write their invalid-id count to
  check_cuda(cudaHostAlloc(&host_count, sizeof(int32_t), cudaHostAllocDefault), "cudaHostAlloc");
  for (const int64_t tokens : {256, 512, 1024, 2048, 4096, 16384}) {
    const megamoe_routing_shape shape{tokens, kTopK, kExperts, 0, kExperts};
    std::mt19937 rng{uint32_t(tokens)};
    std::vector<int32_t> ids(size_t(tokens * kTopK)), experts(kExperts);
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      std::copy(experts.begin(), experts.begin() + kTopK, ids.begin() + t * kTopK);
    }
    const float int32_us = time_plans<int32_t>(shape, ids, stream, host_count);
    const float int64_us = time_plans<int64_t>(shape, ids, stream, host_count);
    if (int32_us < 0 || int64_us < 0) {
      std::printf("tokens %6lld: the plan DIFFERS from the host plan\n", static_cast<long long>(tokens));
      return 1;
    }
    std::printf("tokens %6lld: %6.2f us per plan of int32 ids, %6.2f of int64 ids, equal to the host plan\n",
                static_cast<long long>(tokens), int32_us, int64_us);
  }
  cudaFreeHost(host_count);
  cudaStreamDestroy(stream);
  return 0;
}
