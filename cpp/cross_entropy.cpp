// Cross-entropy of logits against class indices, as torch.nn.functional.cross_entropy. The forward reads the
// logits in place and keeps only the per-row log-sum-exp; the backward writes the one gradient array.
#include <algorithm>
#include <cmath>

#include "row_softmax.hpp"
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

namespace {

// Row i of input (C) in the compute type: in place for float and double, converted into a per-thread buffer for
// the half-precision types.
template <typename T>
const compute_t<T>* compute_row(const T* input, int64_t i, int64_t C) {
  if constexpr (is_half<T>) {
    thread_local std::vector<compute_t<T>> row;
    row.resize(C);
    load_n(row.data(), input + i * C, C);
    return row.data();
  } else {
    return input + i * C;
  }
}

}  // namespace

template <typename T>
void cross_entropy_forward(compute_t<T>* losses, compute_t<T>* stats, const T* input, const int64_t* target, int64_t N,
                           int64_t C, int64_t ignore_index) {
  using F = compute_t<T>;
  parallel_for(N, N * C, [&](int64_t i) {
    const F* row = compute_row(input, i, C);
    const F m = Eigen::Map<const Eigen::Array<F, Eigen::Dynamic, 1>>(row, C).maxCoeff();
    const double log_sum = std::log(sum_exp_shifted(row, C, m));
    stats[2 * i] = m, stats[2 * i + 1] = F(log_sum);
    // loss_i = logsumexp_i - input[i, target_i] = (m - input[i, target_i]) + log_sum, in that order so that a
    // small loss is not lost next to a large m
    losses[i] = target[i] == ignore_index ? F(0) : F(double(m - row[target[i]]) + log_sum);
  });
}

template <typename T>
void cross_entropy_backward(T* dinput, const compute_t<T>* row_weight, const compute_t<T>* stats, const T* input,
                            const int64_t* target, int64_t N, int64_t C) {
  using F = compute_t<T>;
  parallel_for(N, N * C, [&](int64_t i) {
    const F w = row_weight[i], m = stats[2 * i], log_sum = stats[2 * i + 1];
    T* drow = dinput + i * C;
    // dinput[i] = w * (softmax(input[i]) - onehot(target_i))   <- loss_i = logsumexp_i - input[i, target_i]
    if (w == F(0)) {
      std::fill(drow, drow + C, store<T>(F(0)));
      return;
    }
    const F* row = compute_row(input, i, C);
    exp_shifted_chunks(row, C, m, log_sum, [&](int64_t c0, const F* p, int64_t len) {
      for (int64_t j = 0; j < len; ++j) drow[c0 + j] = store<T>(w * p[j]);
    });
    // at the target, p - 1 = expm1(log p): exact even when p is within an ulp of 1
    drow[target[i]] = store<T>(w * std::expm1((row[target[i]] - m) - log_sum));
  });
}

#define INSTANTIATE(T)                                                                                         \
  template void cross_entropy_forward<T>(compute_t<T>*, compute_t<T>*, const T*, const int64_t*, int64_t,    \
                                         int64_t, int64_t);                                                    \
  template void cross_entropy_backward<T>(T*, const compute_t<T>*, const compute_t<T>*, const T*,             \
                                          const int64_t*, int64_t, int64_t);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
