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
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int64_t W = ei::unpacket_traits<P>::size, kLanes = 8;
  constexpr int64_t kStep = W > kLanes ? W : kLanes;  // whole packets and whole groups of lanes
  Lanes8 lanes;
  alignas(64) T local[kStep];
  const P vm = ei::pset1<P>(m);
  const auto exp_at = [&](int64_t i) { return exp_nonpositive(ei::psub(ei::ploadu<P>(x + i), vm)); };
  int64_t j = 0;
  for (; j + kStep <= n; j += kStep) {
    T* e = kept ? kept + j : local;
    for (int64_t p = 0; p < kStep; p += W) ei::pstoreu(e + p, exp_at(j + p));
    for (int64_t g = 0; g < kStep; g += kLanes) lanes.add(e + g);
  }
  T* e = kept ? kept + j : local;  // the last n - j < kStep terms
  const int64_t len = n - j;
  int64_t k = 0;
  for (; k + W <= len; k += W) ei::pstoreu(e + k, exp_at(j + k));
  for (; k < len; ++k) e[k] = std::exp(x[j + k] - m);
  for (k = 0; k + kLanes <= len; k += kLanes) lanes.add(e + k);
  double sum = 0;
  for (; k < len; ++k) sum += double(e[k]);
  return lanes.total(sum);
}

}  // namespace attnpp::ATTNPP_CPU_NS
