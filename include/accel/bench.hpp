#pragma once
// Microbenchmarking strategies on your own model (NOTE [Strategy comparison]
// in bench/compare.hpp): accel::bench::compare, its results as a table and
// JSON lines. For Google Benchmark, include <accel/bench/google_benchmark.hpp>.
#include "accel/bench/compare.hpp"
#include "accel/bench/result.hpp"
#include "accel/bench/traffic_model.hpp"
