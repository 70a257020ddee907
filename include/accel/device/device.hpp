#pragma once
// Device policies resolved to a real at::Device: CPU, or the rank's local
// GPU, with a clear error where LibTorch has no CUDA or no GPU is visible.

#include <ATen/Context.h>
#include <c10/core/Device.h>

#include <stdexcept>
#include <string>

#include "accel/comm/communicator.hpp"
#include "accel/comm/environment.hpp"
#include "accel/core/policies.hpp"

namespace accel::device {

template <class Device>
struct traits;

template <>
struct traits<CPU> {
  static constexpr comm::BackendKind backend = comm::BackendKind::gloo;
  static at::Device resolve(const comm::WorldInfo&) { return at::Device(at::kCPU); }
};

template <>
struct traits<CUDA> {
  static constexpr comm::BackendKind backend = comm::BackendKind::nccl;
  static at::Device resolve(const comm::WorldInfo& world) {
    if (!at::hasCUDA())
      throw std::runtime_error("accel: Trainer<..., CUDA> needs a CUDA build of LibTorch and a visible GPU; this "
                               "LibTorch has no CUDA or no GPU is visible (use accel::CPU, or build with "
                               "-Dtorch_dir=<CUDA LibTorch>)");
    const int gpus = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
    if (world.local_rank >= gpus)
      throw std::runtime_error("accel: rank " + std::to_string(world.rank) + " has LOCAL_RANK=" +
                               std::to_string(world.local_rank) + " but only " + std::to_string(gpus) +
                               " GPU(s) are visible: launch at most one process per GPU");
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank));
  }
};

}  // namespace accel::device
