// Optimizer updates, element by element in the order and arithmetic of PyTorch's single-tensor
// implementations (torch/optim/sgd.py and adamw.py), so that training runs follow PyTorch's closely.
#include <cmath>

#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

template <typename T>
void sgd_step(T* param, const T* grad, T* momentum_buffer, int64_t n, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool first) {
  using C = compute_t<T>;  // (half-precision parameters and buffers: computed in float, each rounded once)
  const C wd = C(weight_decay), mu = C(momentum), damp = C(1 - dampening), step = C(lr);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const C p = load(param[i]);
      C d = load(grad[i]);
      if (weight_decay != 0) d += wd * p;        // d_p = grad + weight_decay * param
      if (momentum != 0) {
        T& buf = momentum_buffer[i];
        buf = store<T>(first ? d : mu * load(buf) + damp * d);  // buf = momentum * buf + (1 - dampening) * d_p
        d = nesterov ? d + mu * load(buf) : load(buf);
      }
      param[i] = store<T>(p - step * d);         // param -= lr * d_p
    }
  });
}

template <typename T>
void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step) {
  const double bias_correction1 = 1 - std::pow(beta1, double(step));
  const double bias_correction2_sqrt = std::pow(1 - std::pow(beta2, double(step)), 0.5);
  using C = compute_t<T>;  // (half-precision parameters and moments: computed in float, each rounded once)
  const C decay = C(1 - lr * weight_decay), w1 = C(1 - beta1), b2 = C(beta2), w2 = C(1 - beta2);
  const C step_size = C(lr / bias_correction1), bc2 = C(bias_correction2_sqrt), e = C(eps);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const C g = load(grad[i]);
      C p = load(param[i]) * decay;                       // param *= 1 - lr * weight_decay
      C m = load(exp_avg[i]);
      m += w1 * (g - m);                                  // exp_avg.lerp_(grad, 1 - beta1)
      const C v = load(exp_avg_sq[i]) * b2 + w2 * g * g;  // exp_avg_sq * beta2 + (1 - beta2) * grad^2
      const C denom = std::sqrt(v) / bc2 + e;             // sqrt(v) / sqrt(1 - beta2^t) + eps
      p += -step_size * m / denom;                        // param.addcdiv_(m, denom, -lr / (1 - beta1^t))
      param[i] = store<T>(p), exp_avg[i] = store<T>(m), exp_avg_sq[i] = store<T>(v);
    }
  });
}

#define INSTANTIATE(T)                                                                                     \
  template void sgd_step<T>(T*, const T*, T*, int64_t, double, double, double, double, bool, bool);       \
  template void adamw_step<T>(T*, const T*, T*, T*, int64_t, double, double, double, double, double, int64_t);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
