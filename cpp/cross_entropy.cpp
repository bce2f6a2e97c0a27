// Cross-entropy of logits against class indices, as torch.nn.functional.cross_entropy. The forward reads the
// logits in place and keeps only the per-row log-sum-exp; the backward writes the one gradient array.
#include <algorithm>
#include <cmath>

#include "training.hpp"

namespace attnpp {

template <typename T>
void cross_entropy_forward(T* losses, T* stats, const T* input, const int64_t* target, int64_t N, int64_t C,
                           int64_t ignore_index) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T* row = input + i * C;
    const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> x(row, C);
    const T m = x.maxCoeff();
    // Vectorized exp, summed in double: in float32 a confident row (one logit far above 50,256 others) would
    // add terms below half an ulp of the running sum and lose them all.
    const double log_sum = std::log((x - m).exp().template cast<double>().sum());
    stats[2 * i] = m, stats[2 * i + 1] = T(log_sum);
    // loss_i = logsumexp_i - input[i, target_i] = (m - input[i, target_i]) + log_sum, in that order so that a
    // small loss is not lost next to a large m
    losses[i] = target[i] == ignore_index ? T(0) : T(double(m - row[target[i]]) + log_sum);
  }
}

template <typename T>
void cross_entropy_backward(T* dinput, const T* row_weight, const T* stats, const T* input, const int64_t* target,
                            int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T *row = input + i * C, w = row_weight[i], m = stats[2 * i], log_sum = stats[2 * i + 1];
    T* drow = dinput + i * C;
    // dinput[i] = w * (softmax(input[i]) - onehot(target_i))   <- loss_i = logsumexp_i - input[i, target_i]
    if (w == T(0)) {
      std::fill(drow, drow + C, T(0));
      continue;
    }
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(drow, C) =
        w * ((Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(row, C) - m) - log_sum).exp();
    // at the target, p - 1 = expm1(log p): exact even when p is within an ulp of 1
    drow[target[i]] = w * std::expm1((row[target[i]] - m) - log_sum);
  }
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int64_t*, int64_t, int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int64_t*, int64_t, int64_t,
                                            int64_t);
template void cross_entropy_backward<float>(float*, const float*, const float*, const float*, const int64_t*,
                                            int64_t, int64_t);
template void cross_entropy_backward<double>(double*, const double*, const double*, const double*,
                                             const int64_t*, int64_t, int64_t);

}  // namespace attnpp
