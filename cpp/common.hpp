// Shared pieces of the attnpp core: strided views, masks, the dropout hash.
#pragma once

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <vector>

#include <Eigen/Dense>

namespace attnpp {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using MapRows = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;  // rows strided, columns contiguous

// A 4-D array (N, H, rows, cols) whose last dimension is contiguous; strides in elements.
template <typename T>
struct View4 {
  T* data = nullptr;
  int64_t n = 0, h = 0, row = 0;  // strides of the batch, head and row dimensions
  T* at(int64_t in, int64_t ih, int64_t ir) const { return data + in * n + ih * h + ir * row; }
};

// An additive mask broadcast to (N, H, L, S): element (n, h, i, j) is
// data[batch_offset[n] + h * h_stride + i * l_stride + j * s_stride]. Any stride may be 0.
template <typename T>
struct MaskView {
  const T* data = nullptr;
  const int64_t* batch_offset = nullptr;  // (N)
  int64_t h_stride = 0, l_stride = 0, s_stride = 0;
  T at(int64_t n, int64_t h, int64_t i, int64_t j) const {
    return data[batch_offset[n] + h * h_stride + i * l_stride + j * s_stride];
  }
};

// The number of blocks of b that cover n.
inline int64_t ceil_div(int64_t n, int64_t b) { return (n + b - 1) / b; }

// Whether a loop of `work` multiply-adds (or elements) is worth waking the OpenMP threads for: a parallel region
// costs microseconds (tens when the threads have gone to sleep), as much as the whole of a small layer's call.
inline bool worth_threads(int64_t work) { return work >= (int64_t(1) << 17); }

// The number of threads of attnpp's parallel loops, one setting for the whole process and every CPU level
// (OpenMP's own setting belongs to the calling thread: a Python thread started later would not see
// set_num_threads). Defined in dispatch.cpp.
int thread_count();
void set_thread_count(int n);

// body(i) for i in [0, n): on the OpenMP threads when `work` is worth it, else in a plain loop (an OpenMP region
// with a false `if` still sets up a team, about a microsecond). dynamic: tasks of uneven cost. An exception in
// a body (std::bad_alloc from a block buffer) stops the remaining tasks and is rethrown here: one escaping an
// OpenMP region would terminate the process.
template <typename F>
void parallel_for(int64_t n, int64_t work, F&& body, bool dynamic = false) {
  const int threads = thread_count();
  if (threads == 1 || !worth_threads(work)) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  const auto guarded = [&](int64_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
#pragma omp critical(attnpp_parallel_for_error)
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  if (dynamic) {
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) guarded(i);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) guarded(i);
  }
  if (error) std::rethrow_exception(error);
}

enum class Causal : int { none = 0, top_left = 1, bottom_right = 2 };

// Everything that defines one attention problem besides its buffers.
template <typename T>
struct AttnConfig {
  int64_t N = 0, Hq = 0, Hk = 0, L = 0, S = 0, D = 0, Dv = 0;
  T scale = 1;
  Causal causal = Causal::none;
  double dropout_p = 0.0;
  uint64_t seed = 0;
  std::vector<MaskView<T>> masks;  // summed into the scores

  int64_t group() const { return Hq / Hk; }  // query heads per key/value head (GQA)
  int64_t work() const { return N * Hq * L * S * (D + Dv); }  // multiply-adds of a forward without masking
  // Under the causal mask query row i sees the keys up to i + causal_offset().
  int64_t causal_offset() const { return causal == Causal::bottom_right ? S - L : 0; }
  // Last key a query row may see under the causal mask (inclusive); S - 1 when not causal.
  int64_t last_key(int64_t i) const {
    return causal == Causal::none ? S - 1 : std::min<int64_t>(S - 1, i + causal_offset());
  }
  // First query row that may see key j under the causal mask; 0 when not causal.
  int64_t first_query(int64_t j) const {
    return causal == Causal::none ? 0 : std::max<int64_t>(0, j - causal_offset());
  }
};

// Counter-based dropout: the decision for element `index` of the (N, H, L, S) weights depends only on
// (seed, index), so it is the same whatever the thread count or the tiling, and the backward recomputes
// exactly the mask of the forward. The hash is SplitMix64's finalizer.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
inline bool dropout_keep(uint64_t seed, uint64_t index, double p) {
  const uint64_t r = mix64(mix64(seed) ^ index);
  const double u = static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
  return u >= p;
}

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

}  // namespace attnpp
