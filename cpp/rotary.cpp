// Rotary position embeddings: the forward rotates each pair of features by its angle, the backward rotates the
// gradient back by the opposite angle. Both are one routine, `rotate`, with the sign of the sine and whether it
// writes or adds. Memory-bound: one pass over the rows, in parallel (no two rows share an output element), so the
// result is the same on any thread count.
#include "rotary.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

// dst = value or dst += value (Add), computed in the compute type and rounded once into T.
template <bool Add, typename T>
inline void put(T& dst, compute_t<T> value) {
  if constexpr (Add)
    dst = store<T>(load(dst) + value);
  else
    dst = store<T>(value);
}

// One row: the R2 pairs (d * Step, d * Step + gap) of x (D) turned by the angles of c, s (R2), sin's sign
// flipped by `sign` (exact: +-1), into y (D); then y[R..] = x[R..]. Step and gap are 2 and 1 (interleaved) or 1
// and R2 (half-split): compile-time steps let GCC vectorize both. Each pair is read before it is written.
template <bool Add, int Step, typename T>
inline void rotate_row(T* y, const T* x, const T* c, const T* s, compute_t<T> sign, int64_t gap, int64_t R2,
                       int64_t D) {
  using C = compute_t<T>;
  for (int64_t d = 0; d < R2; ++d) {
    const int64_t ia = d * Step, ib = d * Step + gap;
    const C a = load(x[ia]), b = load(x[ib]), cd = load(c[d]), sd = sign * load(s[d]);
    put<Add>(y[ia], a * cd - b * sd);
    put<Add>(y[ib], b * cd + a * sd);
  }
  for (int64_t d = 2 * R2; d < D; ++d) put<Add>(y[d], load(x[d]));
}

// dst (N, H, L, D) = (Add: +=) src (N, H, L, D) rotated by the angles of rows offsets[n] + l of cos and sin
// (P, R2), sin times `sign`.
template <bool Add, typename T>
void rotate(const View4<T>& dst, const View4<const T>& src, const T* cos, const T* sin, compute_t<T> sign,
            const int64_t* offsets, int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2, bool interleaved) {
  const int64_t rows = N * H * L;
  parallel_for(rows, rows * D, [&](int64_t i) {
    const int64_t n = i / (H * L), h = i / L % H, l = i % L;
    const int64_t p = offsets[n] + l;  // the row's position: its row of the tables
    const T *x = src.at(n, h, l), *c = cos + p * R2, *s = sin + p * R2;  // x (D), c, s (R2)
    T* y = dst.at(n, h, l);                                               // (D)
    if (interleaved)
      rotate_row<Add, 2>(y, x, c, s, sign, 1, R2, D);
    else
      rotate_row<Add, 1>(y, x, c, s, sign, R2, R2, D);
  });
}

}  // namespace

template <typename T>
void rotary_forward(const View4<T>& out, const View4<const T>& x, const T* cos, const T* sin, const int64_t* offsets,
                    int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2, bool interleaved) {
  // out[a] = x[a] c - x[b] s, out[b] = x[b] c + x[a] s; out[R..] = x[R..]
  rotate<false>(out, x, cos, sin, compute_t<T>(1), offsets, N, H, L, D, R2, interleaved);
}

template <typename T>
void rotary_backward(const View4<T>& dx, const View4<const T>& dout, const T* cos, const T* sin,
                     const int64_t* offsets, int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2,
                     bool interleaved) {
  // dx[a] += dout[a] c + dout[b] s     <- out[a] = x[a] c - x[b] s  and  out[b] = x[b] c + x[a] s
  // dx[b] += dout[b] c - dout[a] s     <- the same two lines (the transpose of the rotation: sin -> -sin)
  // dx[R..] += dout[R..]               <- out[R..] = x[R..]
  rotate<true>(dx, dout, cos, sin, compute_t<T>(-1), offsets, N, H, L, D, R2, interleaved);
}

#define INSTANTIATE(T)                                                                                     \
  template void rotary_forward<T>(const View4<T>&, const View4<const T>&, const T*, const T*, const int64_t*,    \
                                  int64_t, int64_t, int64_t, int64_t, int64_t, bool);                           \
  template void rotary_backward<T>(const View4<T>&, const View4<const T>&, const T*, const T*, const int64_t*,   \
                                   int64_t, int64_t, int64_t, int64_t, int64_t, bool);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
