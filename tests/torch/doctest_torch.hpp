#pragma once
// doctest after LibTorch: Debian's c10 logs through glog, whose CHECK* macros
// abort the process; doctest's must win. Include this instead of doctest in
// every LibTorch test file, after the LibTorch headers it needs.
#include <accel/accel.hpp>

#include "helpers.hpp"

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LE
#undef CHECK_LT
#undef CHECK_GE
#undef CHECK_GT
#include "../support/doctest.hpp"

#include <initializer_list>

namespace accel::testing {

/// Runs `fn(world, rank)` on every rank of a spawn of each size in `worlds`,
/// one after the other, with the world size CAPTUREd. Here rather than in
/// helpers.hpp because it needs doctest, which must come after LibTorch.
template <class Fn>
void spawn_each(std::initializer_list<int> worlds, Fn&& fn, const accel::SpawnOptions& options = bounded()) {
  for (int world : worlds) {
    CAPTURE(world);
    accel::spawn(world, [&](int rank) { fn(world, rank); }, options);
  }
}

}  // namespace accel::testing
