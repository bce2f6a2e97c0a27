// The multiply-add peak of a CPU level, the ceiling the bench (attnpp.bench) sets each case's GFLOP/s against.
#pragma once

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// Runs 8 tasks a thread (thread_count()) of `steps` steps each, a step one multiply-add on each of 14 float vector
// accumulators (30 with AVX-512), independent of each other, with nothing loaded; returns the flops done (2 a
// multiply-add and lane). Timed from the caller, flops / seconds is the fastest rate at which any
// kernel of the level can multiply and add floats on those threads.
double multiply_add_peak(int64_t steps);

}  // namespace attnpp::ATTNPP_CPU_NS
