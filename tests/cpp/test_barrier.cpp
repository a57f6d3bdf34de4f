// The expert-parallel barrier on W virtual ranks of one GPU: every rank's kernel on its own stream,
// so they run at the same time as real ranks would; a rank that never arrives turns into a timeout
// status naming it, not a hang.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gemm_test_util.h"
#include "megamoe/megamoe.h"
#include "status_util.h"

namespace {

using megamoe_test::cuda_devices;
using megamoe_test::DeviceBuffer;

constexpr int64_t kSecond = 1000000000;

struct VirtualRanks {
  explicit VirtualRanks(int world) : world(world), signals(world * world), status(world * 2), streams(world) {
    EXPECT_EQ(cudaMemset(signals.ptr, 0, signals.count * sizeof(int32_t)), cudaSuccess);
    for (int r = 0; r < world; ++r) {
      peers.push_back(signals.ptr + r * world);
      EXPECT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
    }
  }
  ~VirtualRanks() {
    for (auto s : streams) cudaStreamDestroy(s);
  }
  // Rank r enters the barrier (its kernel queued on its own stream).
  void enter(int r, int epoch, int phase, int64_t timeout_ns) {
    ASSERT_EQ(megamoe_barrier(peers.data(), world, r, epoch, phase, timeout_ns, status.ptr + 2 * r, streams[r]),
              MEGAMOE_OK)
        << megamoe_last_error();
  }
  int world;
  DeviceBuffer<int32_t> signals, status;
  std::vector<void*> peers;
  std::vector<cudaStream_t> streams;
};

TEST(Barrier, AllRanksArriveEpochAfterEpoch) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  VirtualRanks v(4);
  for (int epoch = 1; epoch <= 3; ++epoch) {
    for (int r = v.world - 1; r >= 0; --r) v.enter(r, epoch, 1, 10 * kSecond);  // the last rank first
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> status = v.status.download();
    for (int r = 0; r < v.world; ++r) {
      EXPECT_EQ(megamoe_barrier_check(status.data() + 2 * r, r, 10 * kSecond), MEGAMOE_OK)
          << "epoch " << epoch << ": " << megamoe_last_error();
    }
  }
}

TEST(Barrier, MissingRankTimesOutWithItsName) {
  if (cuda_devices() == 0) GTEST_SKIP() << "no CUDA device";
  VirtualRanks v(3);
  const int64_t timeout = kSecond / 20;
  v.enter(0, 1, 2, timeout);
  v.enter(1, 1, 2, timeout);  // rank 2 never enters
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> status = v.status.download();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[2 * r], 2) << "the phase";
    EXPECT_EQ(status[2 * r + 1], 3) << "1 + the missing rank";
    EXPECT_EQ(megamoe_barrier_check(status.data() + 2 * r, r, timeout), MEGAMOE_ERROR_TIMEOUT);
    const std::string message = megamoe_last_error();
    EXPECT_NE(message.find("barrier phase 2 and rank 2 did not arrive"), std::string::npos) << message;
  }
}

// Argument checks run before any CUDA call (no GPU needed).
TEST(BarrierValidation, RejectsBadArguments) {
  int32_t signals[4] = {}, status[2] = {};
  void* peers[2] = {signals, signals + 2};
  void* missing[2] = {signals, nullptr};
  expect_rejected(megamoe_barrier(peers, 0, 0, 1, 1, kSecond, status, nullptr), "world must be in");
  expect_rejected(megamoe_barrier(peers, MEGAMOE_MAX_PEERS + 1, 0, 1, 1, kSecond, status, nullptr), "world must be in");
  expect_rejected(megamoe_barrier(peers, 2, 2, 1, 1, kSecond, status, nullptr), "rank must be in [0, world)");
  expect_rejected(megamoe_barrier(peers, 2, 0, 0, 1, kSecond, status, nullptr), "epoch must be >= 1");
  expect_rejected(megamoe_barrier(peers, 2, 0, 1, 0, kSecond, status, nullptr), "phase must be >= 1");
  expect_rejected(megamoe_barrier(peers, 2, 0, 1, 1, 0, status, nullptr), "timeout_ns must be > 0");
  expect_rejected(megamoe_barrier(peers, 2, 0, 1, 1, kSecond, nullptr, nullptr), "must be non-null");
  expect_rejected(megamoe_barrier(missing, 2, 0, 1, 1, kSecond, status, nullptr), "signal_peers[1] must be non-null");
  const int32_t arrived[2] = {0, 0};
  EXPECT_EQ(megamoe_barrier_check(arrived, 0, kSecond), MEGAMOE_OK);
}

TEST(PeerAccess, OwnDeviceIsAccessibleAndBadDevicesAreRejected) {
  if (cuda_devices() == 0) {
    EXPECT_NE(megamoe_enable_peer_access(0), MEGAMOE_OK);  // no device: an error, not a crash
    return;
  }
  int device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(megamoe_enable_peer_access(device), MEGAMOE_OK) << megamoe_last_error();
  expect_rejected(megamoe_enable_peer_access(-1), "peer_device must be in");
  expect_rejected(megamoe_enable_peer_access(cuda_devices()), "peer_device must be in");
  for (int peer = 0; peer < cuda_devices(); ++peer) {  // twice: the second finds it already on
    for (int round = 0; round < 2; ++round) {
      int can = 0;
      ASSERT_EQ(cudaDeviceCanAccessPeer(&can, device, peer), cudaSuccess);
      if (peer == device || can) {
        EXPECT_EQ(megamoe_enable_peer_access(peer), MEGAMOE_OK) << megamoe_last_error();
      } else {
        expect_rejected(megamoe_enable_peer_access(peer), "no NVLink or PCIe peer-to-peer path");
      }
    }
  }
}

TEST(SharedMemory, AllocatesExportsCopiesAndRejectsBadArguments) {
  void* ptr = nullptr;
  char handle[MEGAMOE_IPC_HANDLE_BYTES] = {};
  if (cuda_devices() == 0) {
    EXPECT_NE(megamoe_shared_alloc(0, 64, &ptr, handle), MEGAMOE_OK);  // no device: an error, not a crash
    return;
  }
  int device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  expect_rejected(megamoe_shared_alloc(-1, 64, &ptr, handle), "device must be in");
  expect_rejected(megamoe_shared_alloc(device, 0, &ptr, handle), "bytes must be > 0");
  expect_rejected(megamoe_shared_alloc(device, 64, nullptr, handle), "must be non-null");
  expect_rejected(megamoe_shared_open(cuda_devices(), handle, &ptr), "device must be in");
  expect_rejected(megamoe_copy_async(nullptr, handle, 8, nullptr), "must be non-null");
  ASSERT_EQ(megamoe_shared_alloc(device, 64, &ptr, handle), MEGAMOE_OK) << megamoe_last_error();
  EXPECT_NE(std::string(handle, sizeof(handle)), std::string(sizeof(handle), '\0'));  // a handle was written
  const std::vector<int32_t> values = {1, 2, 3, 4};
  DeviceBuffer<int32_t> source(4), copy(4);
  ASSERT_EQ(cudaMemcpy(source.ptr, values.data(), 16, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(megamoe_copy_async(ptr, source.ptr, 16, nullptr), MEGAMOE_OK) << megamoe_last_error();
  ASSERT_EQ(megamoe_copy_async(copy.ptr, ptr, 16, nullptr), MEGAMOE_OK) << megamoe_last_error();
  std::vector<int32_t> back(4);
  ASSERT_EQ(cudaMemcpy(back.data(), copy.ptr, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, values);
  EXPECT_EQ(megamoe_shared_free(device, ptr), MEGAMOE_OK) << megamoe_last_error();
}

}  // namespace
