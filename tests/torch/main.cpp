// The LibTorch test binary's entry point: one intra-op thread, as every rank
// of a 2-core job gets, and no thread pool for forked ranks to inherit.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/doctest.hpp"

#include <ATen/Parallel.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  doctest::Context context(argc, argv);
  return context.run();
}
