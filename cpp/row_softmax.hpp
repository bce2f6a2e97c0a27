// Row softmax pieces shared by the cross-entropy and the fused linear + cross-entropy: exponentials of a row
// shifted by its maximum, a chunk at a time, and their sum in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "level.hpp"
#include "vector_exp.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// out[j] = exp((x[j] - m) - s) for the n entries of x (m: the row's max, s >= 0; out may be x): full packets with
// exp_nonpositive, the last n % W entries with std::exp. Which exp an entry takes depends on its position in the
// row only (callers cut rows at multiples of W), never on where the row or the output lies in memory (Eigen's
// expressions start their packets at an output's first aligned address, which made the gradient's last bit depend
// on the output's allocation).
template <typename T>
inline void exp_shifted(const T* x, int64_t n, T m, T s, T* out) {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int64_t W = ei::unpacket_traits<P>::size;
  const P vm = ei::pset1<P>(m), vs = ei::pset1<P>(s);
  int64_t j = 0;
  for (; j + W <= n; j += W) ei::pstoreu(out + j, exp_nonpositive(ei::psub(ei::psub(ei::ploadu<P>(x + j), vm), vs)));
  for (; j < n; ++j) out[j] = std::exp((x[j] - m) - s);
}

// exp_shifted a chunk at a time into a buffer that stays in L1, each chunk given to use(c0, buf, len).
template <typename T, typename Use>
void exp_shifted_chunks(const T* x, int64_t n, T m, T s, Use&& use) {
  constexpr int64_t kChunk = 1024;
  alignas(64) T buf[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = std::min(kChunk, n - c0);
    exp_shifted(x + c0, len, m, s, buf);
    use(c0, buf, len);
  }
}

// Eight running sums in double, sum l adding the terms at positions l mod 8 in order: lanes 0-3 in lo, 4-7 in hi.
struct Lanes8 {
  typedef double D4 __attribute__((vector_size(32)));
  D4 lo = {}, hi = {};
  // sum l += e[l] for l < 8 (GCC 12 converts a vector of 8 floats to double piece by piece, through the stack)
  template <typename T>
  void add(const T* e) {
#if defined(__AVX__)
    if constexpr (std::is_same_v<T, float>) {
      lo += D4(_mm256_cvtps_pd(_mm_loadu_ps(e)));
      hi += D4(_mm256_cvtps_pd(_mm_loadu_ps(e + 4)));
      return;
    }
#endif
    for (int l = 0; l < 4; ++l) lo[l] += double(e[l]), hi[l] += double(e[4 + l]);
  }
  // start + sum 0 + ... + sum 7
  double total(double start) const {
    for (int l = 0; l < 4; ++l) start += lo[l];
    for (int l = 0; l < 4; ++l) start += hi[l];
    return start;
  }
};

// sum_j exp(x_j - m) in double. The exp runs in T on Eigen's vectors (the last n % W entries with std::exp, as in
// exp_shifted_chunks) and the terms are added in double, eight running sums (Lanes8, a fixed order): in float32 a
// confident row (one logit far above 50,256 others) would add terms below half an ulp of the running sum and lose
// them all. Each step's terms are added as soon as they are computed: a separate pass, waiting at each step on the
// previous addition, took a quarter of the time. With `kept`, the terms are also written there (kept may be x).
template <typename T>
double sum_exp_shifted(const T* x, int64_t n, T m, T* kept = nullptr) {
  constexpr int64_t W = Eigen::internal::unpacket_traits<typename Eigen::internal::packet_traits<T>::type>::size;
  constexpr int64_t kLanes = 8, kStep = W > kLanes ? W : kLanes;  // whole packets and whole groups of lanes
  Lanes8 lanes;
  double tail = 0;
  alignas(64) T local[kStep];
  for (int64_t j = 0; j < n; j += kStep) {
    const int64_t len = std::min(kStep, n - j);
    T* e = kept ? kept + j : local;
    exp_shifted(x + j, len, m, T(0), e);
    int64_t k = 0;
    for (; k + kLanes <= len; k += kLanes) lanes.add(e + k);
    for (; k < len; ++k) tail += double(e[k]);
  }
  return lanes.total(tail);
}

}  // namespace attnpp::ATTNPP_CPU_NS
