// Error reporting behind the C API: a thread-local message and helpers that set it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "megamoe/megamoe.h"

namespace megamoe {

// Stores `message` as the calling thread's last error and returns `code`.
int set_error(int code, const std::string& message);

inline int invalid_argument(const std::string& message) {
  return set_error(MEGAMOE_ERROR_INVALID_ARGUMENT, message);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return MEGAMOE_OK;
  return set_error(MEGAMOE_ERROR_CUDA, std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace megamoe

// Returns the status of `expr` from the enclosing function unless it is MEGAMOE_OK.
#define MEGAMOE_RETURN_IF_ERROR(expr)                            \
  do {                                                           \
    const int megamoe_status_ = (expr);                          \
    if (megamoe_status_ != MEGAMOE_OK) return megamoe_status_;   \
  } while (0)

// Returns from the enclosing C API function when a CUDA call fails.
#define MEGAMOE_CUDA_RETURN_IF_ERROR(expr) MEGAMOE_RETURN_IF_ERROR(::megamoe::cuda_status((expr), #expr))
