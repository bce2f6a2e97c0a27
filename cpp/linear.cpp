// Linear layer: y = x w^T + b. The products run on gemm.hpp's tiled kernel, which wants the output at least one
// vector wide; a narrower side (the 3- to 5-wide embeddings of article 001's model, whose vocabulary projection
// is 50257 wide) is handled by dot products or by computing the transposed product instead.
#include "linear.hpp"

#include "gemm.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

template <typename T>
bool narrow(int64_t n) {
  return n < gemm_detail::Vec<T>::width;
}

}  // namespace

template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout) {
  if (narrow<T>(Fout)) {  // y[i, j] = x[i, :] . w[j, :]
    dot_products(y, x, Fin, w, Fin, M, Fout, Fin, false);
  } else {  // y = x w^T (w^T: element (f, o) at w[o * Fin + f])
    gemm_parallel(y, Fout, x, Fin, int64_t(1), w, int64_t(1), Fin, M, Fout, Fin, T(1), false);
  }
  if (b)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < Fout; ++c) y[r * Fout + c] += b[c];
}

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                     int64_t Fout) {
  if (narrow<T>(Fin)) {
    // dx[i, f] += dy[i, :] . w^T[f, :]     <- y = x w^T
    if (dx) {
      const auto wt = transpose(w, Fout, Fin);
      dot_products(dx, dy, Fout, wt.get(), Fout, M, Fin, Fout, true);
    }
    // dw^T = x^T dy (Fin, Fout), wide, then dw += (dw^T)^T
    std::unique_ptr<T[]> dwt(new T[Fin * Fout]);
    gemm_parallel(dwt.get(), Fout, x, int64_t(1), Fin, dy, Fout, int64_t(1), Fin, Fout, M, T(1), false);
    for (int64_t o = 0; o < Fout; ++o)
      for (int64_t f = 0; f < Fin; ++f) dw[o * Fin + f] += dwt[f * Fout + o];
  } else {
    // dx += dy w                            <- y = x w^T
    if (dx) gemm_parallel(dx, Fin, dy, Fout, int64_t(1), w, Fin, int64_t(1), M, Fin, Fout, T(1), true);
    // dw += dy^T x                          <- y = x w^T
    gemm_parallel(dw, Fin, dy, int64_t(1), Fout, x, Fin, int64_t(1), Fout, Fin, M, T(1), true);
  }
  // db += sum over rows of dy               <- y += b
  // (a plain loop: Eigen's reductions over unaligned maps change order with the buffer's alignment)
  if (db)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < Fout; ++c) db[c] += dy[r * Fout + c];
}

template void linear_forward<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);
template void linear_forward<double>(double*, const double*, const double*, const double*, int64_t, int64_t,
                                     int64_t);
template void linear_backward<float>(float*, float*, float*, const float*, const float*, const float*, int64_t,
                                     int64_t, int64_t);
template void linear_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                      int64_t, int64_t, int64_t);

}  // namespace attnpp::ATTNPP_CPU_NS
