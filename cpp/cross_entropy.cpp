// Cross-entropy of logits against class indices, as torch.nn.functional.cross_entropy. The forward reads the
// logits in place and keeps only the per-row log-sum-exp; the backward writes the one gradient array.
#include <algorithm>
#include <cmath>

#include "training.hpp"
#include "vector_exp.hpp"

namespace attnpp::ATTNPP_CPU_NS {

namespace {

// exp((x_j - m) - s) for the n entries of x (m: the row's max, s >= 0), a chunk at a time into a buffer that
// stays in L1, each chunk given to use(c0, buf, len). Full packets with exp_nonpositive, the last len % W
// entries of a chunk with std::exp: which exp an entry takes depends on its position only, never on where the
// row or the output lies in memory (Eigen's expressions start their packets at an output's first aligned
// address, which made the gradient's last bit depend on the output's allocation).
template <typename T, typename Use>
void exp_shifted_chunks(const T* x, int64_t n, T m, T s, Use&& use) {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int64_t kChunk = 1024, W = ei::unpacket_traits<P>::size;
  alignas(64) T buf[kChunk];
  const P vm = ei::pset1<P>(m), vs = ei::pset1<P>(s);
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = std::min(kChunk, n - c0);
    int64_t j = 0;
    for (; j + W <= len; j += W)
      ei::pstoreu(buf + j, exp_nonpositive(ei::psub(ei::psub(ei::ploadu<P>(x + c0 + j), vm), vs)));
    for (; j < len; ++j) buf[j] = std::exp((x[c0 + j] - m) - s);
    use(c0, buf, len);
  }
}

// sum_j exp(x_j - m) in double. The exp runs in T on Eigen's vectors and each chunk is added in double, one
// running sum per lane (a fixed order): in float32 a confident row (one logit far above 50,256 others) would add
// terms below half an ulp of the running sum and lose them all.
template <typename T>
double sum_exp_shifted(const T* x, int64_t n, T m) {
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  double tail = 0;
  exp_shifted_chunks(x, n, m, T(0), [&](int64_t, const T* buf, int64_t len) {
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += double(buf[j + l]);
    for (; j < len; ++j) tail += double(buf[j]);
  });
  double sum = tail;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

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
