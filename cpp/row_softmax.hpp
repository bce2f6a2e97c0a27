// Row softmax pieces shared by the cross-entropy and the fused linear + cross-entropy: exponentials of a row
// shifted by its maximum, a chunk at a time, and their sum in double.
#pragma once

#include <algorithm>
#include <cmath>

#include "level.hpp"
#include "vector_exp.hpp"

namespace attnpp::ATTNPP_CPU_NS {

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
// terms below half an ulp of the running sum and lose them all. With `kept`, the terms are also written there
// (kept may be x itself: each chunk is read before it is written).
template <typename T>
double sum_exp_shifted(const T* x, int64_t n, T m, T* kept = nullptr) {
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  double tail = 0;
  exp_shifted_chunks(x, n, m, T(0), [&](int64_t c0, const T* buf, int64_t len) {
    if (kept) std::copy(buf, buf + len, kept + c0);
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += double(buf[j + l]);
    for (; j < len; ++j) tail += double(buf[j]);
  });
  double sum = tail;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

}  // namespace attnpp::ATTNPP_CPU_NS
