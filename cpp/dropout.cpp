// Dropout with a counter-based mask (see dropout_keep in common.hpp): the same seed gives the same mask on
// any thread count, and the backward recomputes it instead of storing it.
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

template <typename T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed) {
  using C = compute_t<T>;
  const C scale = C(1) / C(1 - p);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      out[i] = store<T>(dropout_keep(seed, uint64_t(i), p) ? load(x[i]) * scale : C(0));
  });
}

template <typename T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed) {
  using C = compute_t<T>;
  const C scale = C(1) / C(1 - p);
  // dx += dout * keep / (1 - p)      <- out = x * keep / (1 - p)
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      if (dropout_keep(seed, uint64_t(i), p)) dx[i] = store<T>(load(dx[i]) + load(dout[i]) * scale);
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
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
