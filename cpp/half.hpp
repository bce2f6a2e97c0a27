// The half-precision storage types, bfloat16 and float16, and their conversions to and from float.
//
// Half-precision arrays are stored as they come (NumPy's float16, ml_dtypes' bfloat16: two bytes each) and
// computed in float, as PyTorch's CPU kernels do (its "opmath" type): every kernel reads an element with load()
// (exact: float holds every bfloat16 and float16 value), computes and accumulates in compute_t<T>, and writes
// its result once with store<T>() (round to nearest, ties to even; NaN stays NaN, overflow becomes inf). float and
// double are their own compute types, and load/store are the identity for them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace attnpp {

// The bits of a bfloat16 (the top half of a float32: 8 exponent bits, 7 mantissa bits) and of an IEEE float16
// (binary16: 5 exponent bits, 10 mantissa bits).
struct bfloat16 {
  uint16_t bits;
};
struct float16 {
  uint16_t bits;
};

// Bitwise equality (tests compare results bit for bit).
inline bool operator==(bfloat16 a, bfloat16 b) { return a.bits == b.bits; }
inline bool operator==(float16 a, float16 b) { return a.bits == b.bits; }

template <typename T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<bfloat16> {
  using type = float;
};
template <>
struct compute_type<float16> {
  using type = float;
};
// The type a kernel computes and accumulates in for arrays of T: T itself for float and double, float for halves.
template <typename T>
using compute_t = typename compute_type<T>::type;
template <typename T>
constexpr bool is_half = !std::is_same_v<T, compute_t<T>>;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float load(bfloat16 x) { return bits_to_float(uint32_t(x.bits) << 16); }
inline float load(float16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16, exponent = (x.bits >> 10) & 0x1f, mantissa = x.bits & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = float(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}
inline float load(float x) { return x; }
inline double load(double x) { return x; }

template <typename T>
T store(compute_t<T> x);
template <>
inline float store<float>(float x) {
  return x;
}
template <>
inline double store<double>(double x) {
  return x;
}
template <>
inline bfloat16 store<bfloat16>(float x) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN, kept quiet
  return {uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16)};                  // nearest, ties to even
}
template <>
inline float16 store<float16>(float x) {
#if defined(__F16C__)
  return {_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)};
#else
  const uint32_t u = float_to_bits(x), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {uint16_t(sign | 0x7e00 | ((a >> 13) & 0x3ff))};  // NaN, kept quiet
  if (a >= 0x477ff000u) return {uint16_t(sign | 0x7c00)};  // rounds to 65520 or more: inf
  if (a >= 0x38800000u) {                                  // normal: drop 13 mantissa bits, nearest even
    const uint32_t r = a - 0x38000000u;                    // exponent rebased from 127 to 15
    return {uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1)) >> 13))};
  }
  // subnormal or zero: the magnitude in units of 2^-24, rounded to nearest even by float's own addition
  const float scaled = bits_to_float(a) + 0.5f;  // 0.5 = 2^-1 puts the 2^-24 units in the low mantissa bits
  return {uint16_t(sign | (float_to_bits(scaled) - 0x3f000000u))};
#endif
}

// dst[i] = load(src[i]) and dst[i] = store<T>(src[i]) for i < n: the bulk conversions of packing and writing.
template <typename T>
inline void load_n(compute_t<T>* dst, const T* src, int64_t n) {
  if constexpr (!is_half<T>) {
    if (n > 0) std::memcpy(dst, src, sizeof(T) * std::size_t(n));  // (an empty row's pointers may be null)
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, float16>)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = load(src[i]);
  }
}
template <typename T>
inline void store_n(T* dst, const compute_t<T>* src, int64_t n) {
  if constexpr (!is_half<T>) {
    if (n > 0) std::memcpy(dst, src, sizeof(T) * std::size_t(n));
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, float16>)
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) dst[i] = store<T>(src[i]);
  }
}

// dst[i] = src[i] rounded to T, as a float (load(store<T>(src[i]))), for i < n. bfloat16: on the float's bits, in
// one pass, vectorized by hand under AVX2 (GCC's vectorizer left the loop scalar where the forward inlines it, and
// the flash numerics' P rounding then took 17% of the bfloat16 forward at avx2).
template <typename T>
inline void round_n(compute_t<T>* dst, const compute_t<T>* src, int64_t n) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7fff);
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u)), magnitude = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x00400000);
    for (; i + 8 <= n; i += 8) {
      const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i nearest = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, half_ulp), odd), high);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, magnitude), inf);  // (both below 2^31)
      const __m256i quiet_nan = _mm256_and_si256(_mm256_or_si256(u, quiet), high);
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_blendv_epi8(nearest, quiet_nan, nan)));
    }
#endif
    for (; i < n; ++i) {
      const uint32_t u = float_to_bits(src[i]);
      const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1)) & 0xffff0000u;  // nearest, ties to even
      dst[i] = bits_to_float((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : nearest);  // NaN
    }
  } else {
    constexpr int64_t kChunk = 64;
    T rounded[kChunk];
    for (int64_t i = 0; i < n; i += kChunk) {
      const int64_t m = std::min(kChunk, n - i);
      store_n(rounded, src + i, m);
      load_n(dst + i, rounded, m);
    }
  }
}

}  // namespace attnpp
