// Peer access between the GPUs of an expert-parallel group. The pull kernels and the barrier read and
// write other ranks' memory through pointers mapped from their CUDA IPC handles; a kernel on this
// device may dereference a pointer into another GPU's memory only once this device's context has
// peer access to that GPU (NVLink or PCIe P2P).
#include <cuda_runtime.h>

#include <string>

#include "common/status.h"

extern "C" int megamoe_enable_peer_access(int32_t peer_device) {
  using namespace megamoe;
  const std::string fn = "megamoe_enable_peer_access: ";
  int device = 0, count = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (peer_device < 0 || peer_device >= count) {
    return invalid_argument(fn + "peer_device must be in [0, " + std::to_string(count) + "), got " +
                            std::to_string(peer_device));
  }
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
