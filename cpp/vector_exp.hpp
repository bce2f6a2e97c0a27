// A vectorized exp for the softmaxes (attention.cpp, cross_entropy.cpp), on Eigen's packets of the CPU level.
#pragma once

#include <type_traits>

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// exp(x) on Eigen's packets, for x <= 0 (a score or a logit minus its row's max or log-sum-exp; -inf gives 0) or
// NaN (which propagates). float on x86-64, every level: Cephes' polynomial (Eigen's pexp_float's), with
// - k = round(x log2(e)) by the shifter 1.5 * 2^23 + 127 added in the same multiply-add: t's low bits then hold
//   k + 127, and shifted by 23 they are 2^k's bits. Eigen's pexp takes a floor (two instructions at AVX2, ten at
//   the baseline, whose SSE2 has no rounding instruction), a conversion to integers and, below AVX-512, an ldexp
//   with a clamp of its exponent;
// - x clamped at -88 first, so that k >= -127, whose 2^k is built as 0: x < -87.7 gives 0 instead of a subnormal,
//   at most 1.2e-38 on a term that its row's largest, 1, dwarfs in any float sum;
// - the polynomial by Horner's rule, 1 + r (1 + r P(r)): no r^2 or r^3 to form.
// On Intel's cores nearly every one of these instructions takes one of the two vector ports that the multiply-adds
// of the products use: 14 of them per vector instead of 19 to 23 (an Intel Xeon at AVX2: the softmax's exp was 14%
// of the forward's time; 6% less time with this one). Within 0.9 ulp of exp where FMA is, 1.2 at the baseline
// (Eigen's pexp at AVX-512: 4.5). Elsewhere (double; NEON) Eigen's pexp.
template <typename P>
P exp_nonpositive(const P& x) {
  namespace ei = Eigen::internal;
#if defined(__SSE2__)
  constexpr bool shifter = std::is_same_v<typename ei::unpacket_traits<P>::type, float>;
#else
  constexpr bool shifter = false;
#endif
  if constexpr (!shifter) {
    return ei::pexp(x);
  } else {
    using PI = typename ei::unpacket_traits<P>::integer_packet;
    const auto c = [](float v) { return ei::pset1<P>(v); };
    const P xc = ei::pmax(x, c(-88.f));  // (Eigen's pmax returns x when either is NaN)
    const P t = ei::pmadd(xc, c(1.44269504088896341f), c(12582912.f + 127.f));
    const P k = ei::psub(t, c(12582912.f + 127.f));  // x = k ln 2 + r
    P r = ei::pmadd(k, c(-0.693359375f), xc);
    r = ei::pmadd(k, c(2.12194440e-4f), r);
    P y = ei::pmadd(c(1.9875691500E-4f), r, c(1.3981999507E-3f));
    y = ei::pmadd(y, r, c(8.3334519073E-3f));
    y = ei::pmadd(y, r, c(4.1665795894E-2f));
    y = ei::pmadd(y, r, c(1.6666665459E-1f));
    y = ei::pmadd(y, r, c(5.0000001201E-1f));
    y = ei::pmadd(y, r, c(1.f));
    y = ei::pmadd(y, r, c(1.f));  // exp(r)
    return ei::pmul(y, ei::preinterpret<P>(ei::plogical_shift_left<23>(ei::preinterpret<PI>(t))));  // exp(r) 2^k
  }
}

// Whether exp_nonpositive gives exactly 0 at -inf: float on x86-64 (the shifter above); not Eigen's generic pexp
// (double; NEON), whose clamped exp(-inf) is a subnormal.
template <typename P>
constexpr bool exp_zero_at_neg_inf() {
#if defined(__SSE2__)
  return std::is_same_v<typename Eigen::internal::unpacket_traits<P>::type, float>;
#else
  return false;
#endif
}

}  // namespace attnpp::ATTNPP_CPU_NS
