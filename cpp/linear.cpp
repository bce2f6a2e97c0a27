// Linear layer: y = x w^T + b. The products run on gemm.hpp's tiled kernel, which wants the output at least one
// vector wide; a narrower side (the 3- to 5-wide embeddings of article 001's model, whose vocabulary projection
// is 50257 wide) is handled by dot products or by computing the transposed product instead.
#include "linear.hpp"

#include <cstdint>
#include <vector>

#include "gemm.hpp"
#include "gemm_bf16.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

template <typename T>
bool narrow(int64_t n) {
  return n < gemm_detail::Vec<T>::width;
}

#if defined(__AVX512BF16__)
// bfloat16 on the avx512_bf16 level: the products with vdpbf16ps on the operands' pairs as they lie (inputs and
// weights are bfloat16 already: the products are exact, the sums float), each output rounded once. Each returns
// false, having done nothing, unless the widths whose pairs it reads are even and the arrays 4-byte aligned.
const uint32_t* words(const bfloat16* a) { return reinterpret_cast<const uint32_t*>(a); }

// y = x w^T + b: x's rows and w's rows as pairs along Fin.
bool linear_forward_pairs(bfloat16* y, const bfloat16* x, const bfloat16* w, const bfloat16* b, int64_t M,
                          int64_t Fin, int64_t Fout) {
  if (Fin % 2 || Fin == 0 || !pair_aligned(x) || !pair_aligned(w)) return false;
  PackedPairs wt;
  wt.pack_transposed(w, Fin, Fout, Fin);
  gemm_pairs_parallel({words(x), Fin / 2, 1}, wt, M, Fout, Fin / 2,
                      [&](int64_t i0, int64_t j0, int64_t rows, int64_t cols, const float* tile, int64_t ld) {
                        for (int64_t r = 0; r < rows; ++r)
                          for (int64_t c = 0; c < cols; ++c)
                            y[(i0 + r) * Fout + j0 + c] =
                                store<bfloat16>(tile[r * ld + c] + (b ? load(b[j0 + c]) : 0.f));
                      });
  return true;
}

// dx += dy w (dy's rows as pairs along Fout, w's pairs across its rows), dw += dy^T x (pairs across the rows of dy
// and of x), db += the column sums of dy (in float).
bool linear_backward_pairs(bfloat16* dx, bfloat16* dw, bfloat16* db, const bfloat16* dy, const bfloat16* x,
                           const bfloat16* w, int64_t M, int64_t Fin, int64_t Fout) {
  if (Fout % 2 || Fout == 0 || !pair_aligned(dy) || !pair_aligned(x) || !pair_aligned(w)) return false;
  const auto add_into = [](bfloat16* a, int64_t lda) {
    return [a, lda](int64_t i0, int64_t j0, int64_t rows, int64_t cols, const float* tile, int64_t ld) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          bfloat16& e = a[(i0 + r) * lda + j0 + c];
          e = store<bfloat16>(load(e) + tile[r * ld + c]);
        }
    };
  };
  PackedPairs b;
  if (dx) {
    b.pack_rows(w, Fin, Fout, Fin);
    gemm_pairs_parallel({words(dy), Fout / 2, 1}, b, M, Fin, Fout / 2, add_into(dx, Fin));
  }
  std::vector<uint32_t> dyt(std::size_t((M + 1) / 2 * Fout));
  to_pair_columns(dyt.data(), dy, Fout, M, Fout);
  b.pack_rows(x, Fin, M, Fin);
  gemm_pairs_parallel({dyt.data(), 1, Fout}, b, Fout, Fin, (M + 1) / 2, add_into(dw, Fin));
  if (db) {
    std::vector<float> sums(std::size_t(Fout), 0.f);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < Fout; ++c) sums[c] += load(dy[r * Fout + c]);
    for (int64_t c = 0; c < Fout; ++c) db[c] = store<bfloat16>(load(db[c]) + sums[c]);
  }
  return true;
}
#endif

}  // namespace

template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout) {
  if constexpr (is_half<T>) {  // in float on float copies, the output rounded once
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bfloat16>)
      if (linear_forward_pairs(y, x, w, b, M, Fin, Fout)) return;
#endif
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
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bfloat16>)
      if (linear_backward_pairs(dx, dw, db, dy, x, w, M, Fin, Fout)) return;
#endif
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
      parallel_for_chunks(Fout, [&](int64_t begin, int64_t end) {
        for (int64_t o = begin; o < end; ++o)
          for (int64_t f = 0; f < Fin; ++f) dw[o * Fin + f] += dwt[f * Fout + o];
      });
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
