// Memory the ranks of an expert-parallel group share. Each rank allocates its shared buffers with
// cudaMalloc (a buffer of its own, not a caching allocator's segment that also holds unrelated
// tensors) and exports a CUDA IPC handle; every other rank opens the handle with its own device
// current, which maps the peer's memory into this GPU's address space. A handle opened with the
// peer's device current would map it for that device only, and a kernel here would fault on it.
// Kernels here then dereference the peer's memory over NVLink or PCIe P2P (peer access).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/status.h"

namespace megamoe {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == MEGAMOE_IPC_HANDLE_BYTES, "megamoe.h's IPC handle size is CUDA's");

// Makes `device` current for the runtime calls of one entry point, then restores the caller's device.
class DeviceScope {
 public:
  int enter(int32_t device) {
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous_));
    entered_ = true;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    return MEGAMOE_OK;
  }
  ~DeviceScope() {
    if (entered_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool entered_ = false;
};

// MEGAMOE_OK when `device` (an argument called `name`) is a device of this process.
int check_device(const std::string& fn, const char* name, int32_t device) {
  int count = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    return invalid_argument(fn + name + " must be in [0, " + std::to_string(count) + "), got " +
                            std::to_string(device));
  }
  return MEGAMOE_OK;
}

// Runs call() with `device` current, after checking that it exists.
template <typename Call>
int on_device(const std::string& fn, int32_t device, Call call) {
  MEGAMOE_RETURN_IF_ERROR(check_device(fn, "device", device));
  DeviceScope scope;
  MEGAMOE_RETURN_IF_ERROR(scope.enter(device));
  return call();
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_enable_peer_access(int32_t peer_device) {
  using namespace megamoe;
  const std::string fn = "megamoe_enable_peer_access: ";
  MEGAMOE_RETURN_IF_ERROR(check_device(fn, "peer_device", peer_device));
  int device = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (peer_device == device) return MEGAMOE_OK;
  int can_access = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can_access, device, peer_device));
  if (!can_access) {
    return invalid_argument(fn + "GPU " + std::to_string(device) + " cannot access the memory of GPU " +
                            std::to_string(peer_device) +
                            " (no NVLink or PCIe peer-to-peer path): expert parallelism needs peer access between "
                            "the GPUs of a group");
  }
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer_device, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // not sticky: clear it, or a later cudaGetLastError would report it
    return MEGAMOE_OK;
  }
  return cuda_status(err, "cudaDeviceEnablePeerAccess");
}

extern "C" int megamoe_shared_alloc(int32_t device, int64_t bytes, void** ptr, void* ipc_handle) {
  using namespace megamoe;
  const std::string fn = "megamoe_shared_alloc: ";
  return on_device(fn, device, [&]() -> int {
    if (bytes <= 0) return invalid_argument(fn + "bytes must be > 0, got " + std::to_string(bytes));
    if (ptr == nullptr || ipc_handle == nullptr) return invalid_argument(fn + "ptr and ipc_handle must be non-null");
    void* memory = nullptr;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&memory, size_t(bytes)));
    const cudaError_t err = cudaIpcGetMemHandle(static_cast<cudaIpcMemHandle_t*>(ipc_handle), memory);
    if (err != cudaSuccess) {
      cudaFree(memory);
      return cuda_status(err, "cudaIpcGetMemHandle");
    }
    *ptr = memory;
    return MEGAMOE_OK;
  });
}

extern "C" int megamoe_shared_free(int32_t device, void* ptr) {
  using namespace megamoe;
  return on_device("megamoe_shared_free: ", device, [&] { return cuda_status(cudaFree(ptr), "cudaFree"); });
}

extern "C" int megamoe_shared_open(int32_t device, const void* ipc_handle, void** ptr) {
  using namespace megamoe;
  const std::string fn = "megamoe_shared_open: ";
  return on_device(fn, device, [&]() -> int {
    if (ptr == nullptr || ipc_handle == nullptr) return invalid_argument(fn + "ptr and ipc_handle must be non-null");
    cudaIpcMemHandle_t handle;
    memcpy(&handle, ipc_handle, sizeof(handle));
    return cuda_status(cudaIpcOpenMemHandle(ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  });
}

extern "C" int megamoe_shared_close(int32_t device, void* ptr) {
  using namespace megamoe;
  return on_device("megamoe_shared_close: ", device,
                   [&] { return cuda_status(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle"); });
}

extern "C" int megamoe_copy_async(void* dst, const void* src, int64_t bytes, void* stream) {
  using namespace megamoe;
  if (bytes < 0) return invalid_argument("megamoe_copy_async: bytes must be >= 0");
  if (bytes == 0) return MEGAMOE_OK;
  if (dst == nullptr || src == nullptr) return invalid_argument("megamoe_copy_async: dst and src must be non-null");
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
  return MEGAMOE_OK;
}
