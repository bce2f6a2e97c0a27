// Linear layer: y = x w^T + b. The products run on the tiled kernel of gemm.hpp when the output is at least one
// vector wide, on Eigen otherwise (Eigen vectorizes along k, which a 3-wide output, like the gradient of a
// 3-wide input, needs).
#include "linear.hpp"

#include "gemm.hpp"

namespace attnpp {
namespace {

// C (M, N) (+)= A B; A (M, K) with strides (ars, acs); B (K, N) with row stride ldb; C with row stride N.
template <typename T>
void product(T* C, const T* A, int64_t ars, int64_t acs, const T* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
             bool accumulate) {
  if (N >= gemm_detail::Vec<T>::width) {
    gemm_parallel(C, N, A, ars, acs, B, ldb, M, N, K, T(1), accumulate);
    return;
  }
  // A is a transposed view (ars == 1) or has contiguous rows (acs == 1) everywhere in this file.
  const MapRowsC<T> b(B, K, N, Eigen::OuterStride<>(ldb));
  MapRows<T> c(C, M, N, Eigen::OuterStride<>(N));
  const auto run = [&](const auto& a) {
    if (accumulate)
      c.noalias() += a * b;
    else
      c.noalias() = a * b;
  };
  if (ars == 1)
    run(Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>>(
        A, M, K, Eigen::OuterStride<>(acs)));
  else
    run(MapRowsC<T>(A, M, K, Eigen::OuterStride<>(ars)));
}

}  // namespace

template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout) {
  // y = x w^T: the kernel wants B's rows contiguous, so w^T (Fin, Fout) is built first (Fin * Fout copies
  // against M * Fin * Fout multiply-adds).
  RowMat<T> wt = Eigen::Map<const RowMat<T>>(w, Fout, Fin).transpose();
  product(y, x, Fin, int64_t(1), wt.data(), Fout, M, Fout, Fin, false);
  if (b)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < Fout; ++c) y[r * Fout + c] += b[c];
}

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                     int64_t Fout) {
  // dx += dy w                <- y = x w^T
  if (dx) product(dx, dy, Fout, int64_t(1), w, Fin, M, Fin, Fout, true);
  // dw += dy^T x              <- y = x w^T
  product(dw, dy, int64_t(1), Fout, x, Fin, Fout, Fin, M, true);
  // db += sum over rows of dy <- y += b
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

}  // namespace attnpp
