#pragma once
// CPU threads per process. A rank forked from a process sized for the whole
// machine keeps its thread pools; `accel launch` gives each rank
// OMP_NUM_THREADS instead. LibTorch's intra-op pool follows
// at::set_num_threads, but a pthread OpenBLAS (Debian's) keeps its own, which
// only openblas_set_num_threads reaches: found at run time, so nothing
// links against OpenBLAS directly.

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace accel::device {

/// `threads` intra-op threads for LibTorch and, where it is loaded, OpenBLAS.
inline void limit_cpu_threads(int threads) {
  at::set_num_threads(threads);
  using set_threads = void (*)(int);
  if (auto f = reinterpret_cast<set_threads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(threads);
}

}  // namespace accel::device
