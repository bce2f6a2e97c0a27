// Optimizer updates, element by element in the order and arithmetic of PyTorch's single-tensor
// implementations (torch/optim/sgd.py and adamw.py), so that training runs follow PyTorch's closely; every
// parameter of a call in one parallel loop, as PyTorch's foreach implementations batch them.
#include <cmath>
#include <utility>
#include <vector>

#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

// body(slot, begin, end) over chunks of every slot's elements, in one parallel loop: one OpenMP region for all
// the parameters (a small model's many small ones would each wake the threads otherwise).
template <typename T, typename F>
void for_each_chunk(const OptimizerSlot<T>* slots, int64_t count, F&& body) {
  constexpr int64_t kChunk = int64_t(1) << 14;  // elements per task
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (slot, first element)
  int64_t total = 0;
  for (int64_t s = 0; s < count; ++s) {
    for (int64_t b = 0; b < slots[s].n; b += kChunk) tasks.emplace_back(s, b);
    total += slots[s].n;
  }
  parallel_for(int64_t(tasks.size()), total, [&](int64_t t) {
    const auto [s, b] = tasks[t];
    body(slots[s], b, std::min(slots[s].n, b + kChunk));
  });
}

}  // namespace

template <typename T>
void sgd_step(const OptimizerSlot<T>* slots, int64_t count, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov) {
  using C = compute_t<T>;  // (half-precision parameters and buffers: computed in float, each rounded once)
  const C wd = C(weight_decay), mu = C(momentum), damp = C(1 - dampening), step = C(lr);
  for_each_chunk(slots, count, [=](const OptimizerSlot<T>& s, int64_t begin, int64_t end) {
    // (by value and restrict: no store may alias the constants or another array, so the loop vectorizes)
    T* __restrict param = s.param;
    const T* __restrict grad = s.grad;
    T* __restrict buffer = s.state0;
    const bool first = s.step == 1;
    for (int64_t i = begin; i < end; ++i) {
      const C p = load(param[i]);
      C d = load(grad[i]);
      if (weight_decay != 0) d += wd * p;        // d_p = grad + weight_decay * param
      if (momentum != 0) {
        const C b = first ? d : mu * load(buffer[i]) + damp * d;  // buf = momentum * buf + (1 - dampening) * d_p
        buffer[i] = store<T>(b);
        d = nesterov ? d + mu * load(buffer[i]) : load(buffer[i]);
      }
      param[i] = store<T>(p - step * d);         // param -= lr * d_p
    }
  });
}

template <typename T>
void adamw_step(const OptimizerSlot<T>* slots, int64_t count, double lr, double beta1, double beta2, double eps,
                double weight_decay) {
  using C = compute_t<T>;  // (half-precision parameters and moments: computed in float, each rounded once)
  const C decay = C(1 - lr * weight_decay), w1 = C(1 - beta1), b2 = C(beta2), w2 = C(1 - beta2), e = C(eps);
  for_each_chunk(slots, count, [=](const OptimizerSlot<T>& s, int64_t begin, int64_t end) {
    const double bias_correction1 = 1 - std::pow(beta1, double(s.step));
    const double bias_correction2_sqrt = std::pow(1 - std::pow(beta2, double(s.step)), 0.5);
    const C step_size = C(lr / bias_correction1), bc2 = C(bias_correction2_sqrt);
    // (by value and restrict: no store may alias the constants or another array, so the loop vectorizes)
    T* __restrict param = s.param;
    const T* __restrict grad = s.grad;
    T* __restrict exp_avg = s.state0;
    T* __restrict exp_avg_sq = s.state1;
    for (int64_t i = begin; i < end; ++i) {
      const C g = load(grad[i]);
      C p = load(param[i]) * decay;                         // param *= 1 - lr * weight_decay
      C m = load(exp_avg[i]);
      m += w1 * (g - m);                                    // exp_avg.lerp_(grad, 1 - beta1)
      const C v = load(exp_avg_sq[i]) * b2 + w2 * g * g;    // exp_avg_sq * beta2 + (1 - beta2) * grad^2
      const C denom = std::sqrt(v) / bc2 + e;               // sqrt(v) / sqrt(1 - beta2^t) + eps
      p += -step_size * m / denom;                          // param.addcdiv_(m, denom, -lr / (1 - beta1^t))
      param[i] = store<T>(p), exp_avg[i] = store<T>(m), exp_avg_sq[i] = store<T>(v);
    }
  });
}

#define INSTANTIATE(T)                                                                                          \
  template void sgd_step<T>(const OptimizerSlot<T>*, int64_t, double, double, double, double, bool);           \
  template void adamw_step<T>(const OptimizerSlot<T>*, int64_t, double, double, double, double, double);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
