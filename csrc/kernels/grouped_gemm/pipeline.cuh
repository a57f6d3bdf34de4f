// The operand pipeline: a ring of shared-memory stages guarded by two mbarriers per stage.
//
//   full[s]:  the producer arms it with the stage's byte count (arrive + expect_tx); TMA completes
//             the transaction (a gathering producer's cp.async copies arrive too: gathered_rows.cuh).
//             Consumers wait on it before reading stage s.
//   empty[s]: every math warp arrives once its wgmmas reading stage s have completed; the producer
//             waits on it before overwriting stage s.
//
// Both sides walk the ring in the same order and track the barrier phase they expect: parity flips
// each time the ring wraps. The producer starts one phase "behind" (it waits on parity 1 of a fresh
// barrier, which counts as already completed), so the first pass over the ring does not block.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

namespace megamoe::grouped_gemm {

using Barrier = cutlass::arch::ClusterTransactionBarrier;

template <int Stages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ void advance() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

template <class Smem, int Stages>
__device__ inline void init_pipeline_barriers(const Smem& smem, int producer_arrivals, int consumer_arrivals) {
  for (int s = 0; s < Stages; ++s) {
    Barrier::init(smem.full(s), producer_arrivals);  // arrive_and_expect_tx (and cp.async arrivals)
    Barrier::init(smem.empty(s), consumer_arrivals);  // one arrive per math warp
  }
  cutlass::arch::fence_barrier_init();  // make the inits visible to the async proxy (TMA)
}

}  // namespace megamoe::grouped_gemm
