#pragma once
// Errors that any room may throw (torch-free, so that lower rooms need not
// include the Trainer to use them).

#include <stdexcept>

namespace accel {

/// Thrown when the launcher's settings contradict the compiled policies, or
/// a setting cannot be read.
class ConfigurationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace accel
