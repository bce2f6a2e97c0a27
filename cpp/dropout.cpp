// Dropout with a counter-based mask (see dropout_keep in common.hpp): the same seed gives the same mask on
// any thread count, and the backward recomputes it instead of storing it.
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

template <typename T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed) {
  const T scale = T(1) / T(1 - p);
#pragma omp parallel for schedule(static) if (worth_threads(n)) num_threads(thread_count())
  for (int64_t i = 0; i < n; ++i) out[i] = dropout_keep(seed, uint64_t(i), p) ? x[i] * scale : T(0);
}

template <typename T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed) {
  const T scale = T(1) / T(1 - p);
  // dx += dout * keep / (1 - p)      <- out = x * keep / (1 - p)
#pragma omp parallel for schedule(static) if (worth_threads(n)) num_threads(thread_count())
  for (int64_t i = 0; i < n; ++i)
    if (dropout_keep(seed, uint64_t(i), p)) dx[i] += dout[i] * scale;
}

void dropout_mask(bool* keep, int64_t n, double p, uint64_t seed) {
#pragma omp parallel for schedule(static) if (worth_threads(n)) num_threads(thread_count())
  for (int64_t i = 0; i < n; ++i) keep[i] = dropout_keep(seed, uint64_t(i), p);
}

template void dropout_forward<float>(float*, const float*, int64_t, double, uint64_t);
template void dropout_forward<double>(double*, const double*, int64_t, double, uint64_t);
template void dropout_backward<float>(float*, const float*, int64_t, double, uint64_t);
template void dropout_backward<double>(double*, const double*, int64_t, double, uint64_t);

}  // namespace attnpp::ATTNPP_CPU_NS
