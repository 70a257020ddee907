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
#include <doctest/doctest.h>
