// Dropout with a counter-based mask (see dropout_keep in common.hpp): the same seed gives the same mask on
// any thread count, and the backward recomputes it instead of storing it.
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

template <typename T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed) {
  const T scale = T(1) / T(1 - p);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = dropout_keep(seed, uint64_t(i), p) ? x[i] * scale : T(0);
  });
}

template <typename T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed) {
  const T scale = T(1) / T(1 - p);
  // dx += dout * keep / (1 - p)      <- out = x * keep / (1 - p)
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      if (dropout_keep(seed, uint64_t(i), p)) dx[i] += dout[i] * scale;
  });
}

void dropout_mask(bool* keep, int64_t n, double p, uint64_t seed) {
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) keep[i] = dropout_keep(seed, uint64_t(i), p);
  });
}

#define INSTANTIATE(T)                                                            \
  template void dropout_forward<T>(T*, const T*, int64_t, double, uint64_t); \
  template void dropout_backward<T>(T*, const T*, int64_t, double, uint64_t);
ATTNPP_FOR_BOTH_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
