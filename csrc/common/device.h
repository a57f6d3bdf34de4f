// The current device's facts that size the kernels' grids.
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"

namespace megamoe {

// The current device's number of SMs (grids of persistent CTAs, or a few CTAs per SM).
inline int current_sm_count(int* sms) {
  int device = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device));
  return MEGAMOE_OK;
}

}  // namespace megamoe
