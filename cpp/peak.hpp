// The multiply-add peak of a CPU level, the ceiling the bench (attnpp.bench) sets each case's GFLOP/s against.
#pragma once

#include <utility>

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// Runs 8 tasks a thread (thread_count()) of `steps` steps each, a step one multiply-add on each of 14 float vector
// accumulators (30 with AVX-512), independent of each other, with nothing loaded; returns the flops done (2 a
// multiply-add and lane). Timed from the caller, flops / seconds is the fastest rate at which any
// kernel of the level can multiply and add floats on those threads.
double multiply_add_peak(int64_t steps);

// The bench's loops (the peak, the forward's products: attention.hpp): task(t) for t in [0, 8 * thread_count()), 8
// tasks a thread so that a thread the machine holds up leaves its remaining ones to the others; returns
// flops_per_task times the number of tasks.
template <typename F>
double bench_tasks(double flops_per_task, F&& task) {
  const int64_t tasks = 8 * int64_t(thread_count());
  parallel_for(tasks, int64_t(1) << 40, std::forward<F>(task));  // (work enough for the threads, always)
  return flops_per_task * double(tasks);
}

}  // namespace attnpp::ATTNPP_CPU_NS
