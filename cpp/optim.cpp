// Optimizer updates, element by element in the order and arithmetic of PyTorch's single-tensor
// implementations (torch/optim/sgd.py and adamw.py), so that training runs follow PyTorch's closely.
#include <cmath>

#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

template <typename T>
void sgd_step(T* param, const T* grad, T* momentum_buffer, int64_t n, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool first) {
  const T wd = T(weight_decay), mu = T(momentum), damp = T(1 - dampening), step = T(lr);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T d = grad[i];
      if (weight_decay != 0) d += wd * param[i];  // d_p = grad + weight_decay * param
      if (momentum != 0) {
        T& buf = momentum_buffer[i];
        buf = first ? d : mu * buf + damp * d;     // buf = momentum * buf + (1 - dampening) * d_p
        d = nesterov ? d + mu * buf : buf;
      }
      param[i] -= step * d;                        // param -= lr * d_p
    }
  });
}

template <typename T>
void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step) {
  const double bias_correction1 = 1 - std::pow(beta1, double(step));
  const double bias_correction2_sqrt = std::pow(1 - std::pow(beta2, double(step)), 0.5);
  const T decay = T(1 - lr * weight_decay), w1 = T(1 - beta1), b2 = T(beta2), w2 = T(1 - beta2);
  const T step_size = T(lr / bias_correction1), bc2 = T(bias_correction2_sqrt), e = T(eps);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T g = grad[i];
      param[i] *= decay;                                  // param *= 1 - lr * weight_decay
      exp_avg[i] += w1 * (g - exp_avg[i]);                // exp_avg.lerp_(grad, 1 - beta1)
      exp_avg_sq[i] = exp_avg_sq[i] * b2 + w2 * g * g;    // exp_avg_sq * beta2 + (1 - beta2) * grad^2
      const T denom = std::sqrt(exp_avg_sq[i]) / bc2 + e; // sqrt(v) / sqrt(1 - beta2^t) + eps
      param[i] += -step_size * exp_avg[i] / denom;        // param.addcdiv_(m, denom, -lr / (1 - beta1^t))
    }
  });
}

#define INSTANTIATE(T)                                                                                     \
  template void sgd_step<T>(T*, const T*, T*, int64_t, double, double, double, double, bool, bool);       \
  template void adamw_step<T>(T*, const T*, T*, T*, int64_t, double, double, double, double, double, int64_t);
ATTNPP_FOR_BOTH_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
