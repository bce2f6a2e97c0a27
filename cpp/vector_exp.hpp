// A vectorized exp for the softmaxes (attention.cpp, cross_entropy.cpp), on Eigen's packets of the CPU level.
#pragma once

#include <type_traits>

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// exp(x) on Eigen's packets, for x <= 0 (a score or a logit minus its row's max or log-sum-exp; -inf gives 0) or
// NaN (which propagates). float below AVX-512 (AVX2 and the x86-64 baseline): Eigen's pexp_float (Cephes'
// polynomial) with one fast ldexp by the exponent bits, instead of Eigen's generic ldexp, whose four dependent
// multiplications (for exponents of any size) took a third of the softmax's time at AVX2 (0.59 -> 0.46 ns per
// element, single thread), or of two fast ones (for results below 2^-126). The results below 2^-126 (x < -87.3) are
// 0 instead of subnormal: at most 1.2e-38 on a term that its row's largest, 1, dwarfs in any float sum. At the
// baseline, whose SSE2 has no rounding instruction (Eigen's floor there takes ten), the floor comes from a
// truncation to integers, exact for |x| < 2^31. Elsewhere Eigen's pexp: AVX-512's ldexp is one instruction (as
// fast).
template <typename P>
P exp_nonpositive(const P& x) {
  namespace ei = Eigen::internal;
#if defined(__SSE2__) && !defined(__AVX512F__)  // (AVX2 implies SSE2)
  constexpr bool fast_ldexp = std::is_same_v<typename ei::unpacket_traits<P>::type, float>;
#else
  constexpr bool fast_ldexp = false;
#endif
  if constexpr (!fast_ldexp) {
    return ei::pexp(x);
  } else {
    const auto c = [](float v) { return ei::pset1<P>(v); };
    const P xc = ei::pmax(x, c(-120.f));
    const P t = ei::pmadd(xc, c(1.44269504088896341f), c(0.5f));
#if defined(__AVX2__)
    const P m = ei::pfloor(t);  // x = m ln 2 + r
#else
    const P trunc = _mm_cvtepi32_ps(_mm_cvttps_epi32(t));  // toward 0: one above the floor where t < 0 is not whole
    const P m = ei::psub(trunc, ei::pand(ei::pcmp_lt(t, trunc), c(1.f)));
#endif
    P r = ei::pmadd(m, c(-0.693359375f), xc);
    r = ei::pmadd(m, c(2.12194440e-4f), r);
    const P r2 = ei::pmul(r, r), r3 = ei::pmul(r2, r);
    P y = ei::pmadd(c(1.9875691500E-4f), r, c(1.3981999507E-3f));
    P y1 = ei::pmadd(c(4.1665795894E-2f), r, c(1.6666665459E-1f));
    y = ei::pmadd(y, r, c(8.3334519073E-3f));
    y1 = ei::pmadd(y1, r, c(5.0000001201E-1f));
    y = ei::pmadd(y, r3, y1);
    y = ei::pmadd(y, r2, ei::padd(r, c(1.f)));  // exp(r)
    // exp(r) 2^m, 0 when 2^m is below float's normal range (m < -126); NaN propagates (as pexp_float ends)
    return ei::pmax(ei::pldexp_fast_impl<P>::run(y, m), x);
  }
}

// Whether exp_nonpositive gives exactly 0 at -inf: float on x86-64 (below AVX-512 the fast ldexp above; at AVX-512
// Eigen's pexp builds 2^m from its bits: 0 below -88.4); not Eigen's generic pexp (double; NEON), whose clamped
// exp(-inf) is a subnormal.
template <typename P>
constexpr bool exp_zero_at_neg_inf() {
#if defined(__SSE2__)
  return std::is_same_v<typename Eigen::internal::unpacket_traits<P>::type, float>;
#else
  return false;
#endif
}

}  // namespace attnpp::ATTNPP_CPU_NS
