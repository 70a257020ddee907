#pragma once
// The random generators a step draws from (the CPU's, and the training
// device's when it is a GPU: dropout and randn on CUDA draw from it), read
// and set as a whole: what a checkpoint saves, and what activation
// checkpointing replays so that a recomputed dropout drops the same units.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <mutex>
#include <vector>

namespace accel::device {

inline std::vector<at::Generator> generators(at::Device device) {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  if (!device.is_cpu() && !device.is_meta()) out.push_back(at::globalContext().defaultGenerator(device));
  return out;
}

/// The generators' states, CPU first.
inline std::vector<at::Tensor> random_states(at::Device device) {
  std::vector<at::Tensor> states;
  for (auto generator : generators(device)) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back(generator.get_state());
  }
  return states;
}

/// Sets what `states` holds (from random_states): states saved on another
/// device type restore what they have, the CPU's at least.
inline void restore_random_states(at::Device device, const std::vector<at::Tensor>& states) {
  auto targets = generators(device);
  for (std::size_t i = 0; i < targets.size() && i < states.size(); ++i) {
    std::lock_guard<std::mutex> lock(targets[i].mutex());
    targets[i].set_state(states[i]);
  }
}

}  // namespace accel::device
