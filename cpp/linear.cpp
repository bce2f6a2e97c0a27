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

// A half-precision array of n elements read into a new array of its compute type (nullptr for nullptr).
template <typename T>
std::unique_ptr<compute_t<T>[]> converted(const T* a, int64_t n) {
  if (!a) return nullptr;
  std::unique_ptr<compute_t<T>[]> c(new compute_t<T>[n]);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) { load_n(c.get() + begin, a + begin, end - begin); });
  return c;
}

// a (n) += c (n), each sum rounded once into T.
template <typename T>
void add_rounded(T* a, const compute_t<T>* c, int64_t n) {
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = store<T>(load(a[i]) + c[i]);
  });
}

}  // namespace

template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout) {
  if constexpr (is_half<T>) {  // in float on float copies, the output rounded once
    using C = compute_t<T>;
    const auto xc = converted(x, M * Fin), wc = converted(w, Fout * Fin), bc = converted(b, Fout);
    const std::unique_ptr<C[]> yc(new C[M * Fout]);
    linear_forward<C>(yc.get(), xc.get(), wc.get(), bc.get(), M, Fin, Fout);
    parallel_for_chunks(M * Fout, [&](int64_t begin, int64_t end) {
      store_n(y + begin, yc.get() + begin, end - begin);
    });
  } else {
    if (narrow<T>(Fout)) {  // y[i, j] = x[i, :] . w[j, :]
      dot_products(y, x, Fin, w, Fin, M, Fout, Fin, false);
    } else {  // y = x w^T
      gemm_parallel(y, Fout, row_major(x, Fin), transposed(w, Fin), M, Fout, Fin, T(1), Write::assign);
    }
    if (b)
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < Fout; ++c) y[r * Fout + c] += b[c];
  }
}

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                     int64_t Fout) {
  if constexpr (is_half<T>) {  // in float on float copies, each gradient added (and rounded) once
    using C = compute_t<T>;
    const auto dyc = converted(dy, M * Fout), xc = converted(x, M * Fin), wc = converted(w, Fout * Fin);
    const std::unique_ptr<C[]> dxc(dx ? new C[M * Fin]() : nullptr), dwc(new C[Fout * Fin]()),
        dbc(db ? new C[Fout]() : nullptr);
    linear_backward<C>(dxc.get(), dwc.get(), dbc.get(), dyc.get(), xc.get(), wc.get(), M, Fin, Fout);
    if (dx) add_rounded(dx, dxc.get(), M * Fin);
    add_rounded(dw, dwc.get(), Fout * Fin);
    if (db) add_rounded(db, dbc.get(), Fout);
  } else {
    if (narrow<T>(Fin)) {
      // dx[i, f] += dy[i, :] . w^T[f, :]     <- y = x w^T
      if (dx) {
        const auto wt = transpose(w, Fout, Fin);
        dot_products(dx, dy, Fout, wt.get(), Fout, M, Fin, Fout, true);
      }
      // dw^T = x^T dy (Fin, Fout), wide, then dw += (dw^T)^T
      std::unique_ptr<T[]> dwt(new T[Fin * Fout]);
      gemm_parallel(dwt.get(), Fout, transposed(x, Fin), row_major(dy, Fout), Fin, Fout, M, T(1), Write::assign);
      for (int64_t o = 0; o < Fout; ++o)
        for (int64_t f = 0; f < Fin; ++f) dw[o * Fin + f] += dwt[f * Fout + o];
    } else {
      // dx += dy w                            <- y = x w^T
      if (dx) gemm_parallel(dx, Fin, row_major(dy, Fout), row_major(w, Fin), M, Fin, Fout, T(1), Write::accumulate);
      // dw += dy^T x                          <- y = x w^T
      gemm_parallel(dw, Fin, transposed(dy, Fout), row_major(x, Fin), Fout, Fin, M, T(1), Write::accumulate);
    }
    // db += sum over rows of dy               <- y += b
    // (a plain loop: Eigen's reductions over unaligned maps change order with the buffer's alignment)
    if (db)
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < Fout; ++c) db[c] += dy[r * Fout + c];
  }
}

#define INSTANTIATE(T)                                                                             \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t); \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
