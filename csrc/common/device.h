// What the launches ask of the runtime on every call, asked once per device instead: a device
// attribute (the SM count that sizes the grids), and a kernel's opt-in to more dynamic shared memory.
// At small batches the host's work per launch is on the layer's critical path.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <mutex>

#include "common/status.h"

namespace megamoe {

constexpr int kMaxCachedDevices = 64;  // devices past this are asked on every call

// *value = attribute Attr of `device`.
template <cudaDeviceAttr Attr>
int device_attribute(int device, int* value) {
  static std::atomic<int> cached[kMaxCachedDevices] = {};  // 0: not asked yet
  const bool cacheable = device >= 0 && device < kMaxCachedDevices;
  if (cacheable && (*value = cached[device].load(std::memory_order_relaxed)) != 0) return MEGAMOE_OK;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(value, Attr, device));
  if (cacheable) cached[device].store(*value, std::memory_order_relaxed);
  return MEGAMOE_OK;
}

// The current device and its SM count.
inline int current_device_sms(int* device, int* sms) {
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(device));
  return device_attribute<cudaDevAttrMultiProcessorCount>(*device, sms);
}

// Lets Kernel launch with `bytes` of dynamic shared memory on `device` (the current one): the limit
// is raised when a launch needs more than any before it on that device.
template <auto Kernel>
int allow_dynamic_smem(int device, int bytes) {
  static std::atomic<int> allowed[kMaxCachedDevices] = {};
  static std::mutex raising;
  const bool cacheable = device >= 0 && device < kMaxCachedDevices;
  if (cacheable && allowed[device].load(std::memory_order_acquire) >= bytes) return MEGAMOE_OK;
  const std::lock_guard<std::mutex> lock(raising);  // never lowered by a smaller request racing this one
  if (cacheable && allowed[device].load(std::memory_order_relaxed) >= bytes) return MEGAMOE_OK;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (cacheable) allowed[device].store(bytes, std::memory_order_release);
  return MEGAMOE_OK;
}

}  // namespace megamoe
