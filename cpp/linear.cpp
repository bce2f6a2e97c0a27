#include "linear.hpp"

namespace attnpp {

template <typename T>
using CMap = Eigen::Map<const RowMat<T>>;
template <typename T>
using Map = Eigen::Map<RowMat<T>>;

template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout) {
  Map<T> y_m(y, M, Fout);
  y_m.noalias() = CMap<T>(x, M, Fin) * CMap<T>(w, Fout, Fin).transpose();
  if (b) y_m.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(b, Fout);
}

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                     int64_t Fout) {
  const CMap<T> dy_m(dy, M, Fout);
  // dx += dy w                <- y = x w^T
  if (dx) Map<T>(dx, M, Fin).noalias() += dy_m * CMap<T>(w, Fout, Fin);
  // dw += dy^T x              <- y = x w^T
  Map<T>(dw, Fout, Fin).noalias() += dy_m.transpose() * CMap<T>(x, M, Fin);
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
