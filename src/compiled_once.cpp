// The one translation unit of accel's code compiled once, for the programs
// this project builds with `accel_compiled_dep` (NOTE [Compiled once] in
// include/accel/core/compiled_once.hpp). A program of your own does the same
// in one of its .cpp files, with ACCEL_SEPARATE_COMPILATION defined for all.
#include <accel/compiled_once.hpp>
