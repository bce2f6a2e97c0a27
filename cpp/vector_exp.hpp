// A vectorized exp for the softmaxes (attention.cpp, cross_entropy.cpp), on Eigen's packets of the CPU level.
#pragma once

#include <type_traits>

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// Whether the exponentials below are the shifter's for packets P: float on x86-64. Those give exactly 0 at -inf,
// not Eigen's generic pexp (double; NEON), whose clamped exp(-inf) is a subnormal; exp2_nonpositive exists only there.
template <typename P>
constexpr bool shifter_exp() {
#if defined(__SSE2__)
  return std::is_same_v<typename Eigen::internal::unpacket_traits<P>::type, float>;
#else
  return false;
#endif
}

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
  if constexpr (!shifter_exp<P>()) {
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

// 2^x on Eigen's packets, for x <= 0 (a score in base-2 units minus its row's max; -inf gives 0) or NaN: the
// attention's softmax, whose scores the product scales by log2(e) for nothing (FlashAttention-2's exp2). float on
// x86-64: k = round(x) by the shifter in an add, r = x - k exact (Sterbenz: |r| <= 1/2), 2^r by a degree-6 minimax
// polynomial (relative error 2e-9 on [-1/2, 1/2]), times 2^k built from the shifter's bits; x clamped at -127,
// whose 2^k is built as 0 (x < -126.5 gives 0). 12 instructions against exp_nonpositive's 14, 7 of them
// multiplies or multiply-adds against 11 (its range reduction takes two more, its polynomial one more degree; an
// AMD Zen's two other vector ports take the adds): on a Zen 3 at AVX2 the softmax's exponentials were 11% of the
// forward's time. Within 1 ulp of 2^x with FMA, 1.2 ulp at the baseline. Only there (shifter_exp): elsewhere the
// softmax stays in base e.
template <typename P>
P exp2_nonpositive(const P& x) {
  static_assert(shifter_exp<P>(), "exp2_nonpositive: float on x86-64 only");
  namespace ei = Eigen::internal;
  using PI = typename ei::unpacket_traits<P>::integer_packet;
  const auto c = [](float v) { return ei::pset1<P>(v); };
  const P xc = ei::pmax(x, c(-127.f));  // (Eigen's pmax returns x when either is NaN)
  const P t = ei::padd(xc, c(12582912.f + 127.f));
  const P r = ei::psub(xc, ei::psub(t, c(12582912.f + 127.f)));  // x - k
  P y = ei::pmadd(c(1.535326155e-4f), r, c(1.339882961e-3f));
  y = ei::pmadd(y, r, c(9.618436918e-3f));
  y = ei::pmadd(y, r, c(5.550332740e-2f));
  y = ei::pmadd(y, r, c(2.402264774e-1f));
  y = ei::pmadd(y, r, c(6.931471825e-1f));
  y = ei::pmadd(y, r, c(1.f));  // 2^r
  return ei::pmul(y, ei::preinterpret<P>(ei::plogical_shift_left<23>(ei::preinterpret<PI>(t))));
}

// x rounded to bfloat16 (8 significant bits), as a float, for x in [0, 1] or NaN (which stays NaN): the softmax's
// weights under bfloat16's flash numerics (attention.cpp). Veltkamp's split (Dekker, "A floating-point technique for
// extending the available precision", 1971): g = x (2^16 + 1), then g + (x - g), 3 instructions on the float units
// against 11 on x's bits in round_n (half.hpp). Round to nearest, ties to even, for every normal x there (all
// checked once; tests/cpp/test_kernels.cpp checks the ties); a weight under 2^-126 (subnormal) keeps 8 significant
// bits where bfloat16's subnormals keep fewer, less than 2^-133 (their step) apart. g is a multiply-add with 0 so
// that the compiler cannot contract x - g into one unrounded x - x (2^16 + 1), which the split relies on.
template <typename P>
P round_to_bfloat16(const P& x) {
  namespace ei = Eigen::internal;
  const P g = ei::pmadd(x, ei::pset1<P>(65537.f), ei::pset1<P>(0.f));
  return ei::padd(g, ei::psub(x, g));
}

}  // namespace attnpp::ATTNPP_CPU_NS
