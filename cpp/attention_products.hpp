// The products of the attention's blocks, two ways (attention.cpp's forward and backward are written once over
// either):
// - BlockProducts<T>: in T's compute type (float for the halves, read into float as they are packed), on gemm.hpp's
//   micro-kernel;
// - PairProducts (the avx512_bf16 level, bfloat16 arrays): on bfloat16 pairs with vdpbf16ps (gemm_bf16.hpp), the
//   queries, keys, values and output gradients read as they lie; twice the multiply-adds per instruction of
//   float's FMA. The products of two inputs (q k^T, dO v^T) are exact; a float operand (the weights P, their
//   gradient dS) is rounded to bfloat16 first, as PyTorch's CPU flash attention does in bfloat16.
// The forward and the backward take the products of two inputs from one policy and those of P or dS from another
// (attention.cpp), PairProducts for both under flash numerics (AttnConfig::flash_numerics), else BlockProducts for
// the latter: P rounded to bfloat16 costs P v and P^T dO about PyTorch's flash kernel's error, which is up to 1.8
// times that of PyTorch's float32-internal math backend, and dS = P (dP - delta), a difference of nearly equal
// terms, twice dq's and dk's.
// Each has: Rows, an A operand of rows of an input (a query block, an output-gradient block); Packed, a packed B
// operand; Buffer, a thread's scratch for either; and the products the attention needs.
#pragma once

#include <cstring>
#include <initializer_list>
#include <vector>

#include "gemm.hpp"
#include "gemm_bf16.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// Rows r0.. of an A operand (either policy's Rows).
template <typename Rows>
Rows offset(Rows a, int64_t r0) {
  return {a.data + r0 * a.ld, a.ld};
}

// At most this many rows of queries or weights (a decoding step's) read the keys and values where they lie: a
// packed copy would serve too few rows to pay.
constexpr int64_t kFewRows = 16;

// acc (rows of w, Dv) += w v_blk, v_blk = rows [r0, r0 + w.cols()) of head (n, hk) of v read in place (into the
// compute type), when w has a few rows (decode step of the benchmark, (8, 32 heads, 1, 128) over a cache of 4096:
// 15% faster in float32, 1.5 to 1.8 times in bfloat16). Returns whether it did.
template <typename T>
bool values_in_place(compute_t<T>* acc, const RowMat<compute_t<T>>& w, const View4<const T>& v, int64_t n,
                     int64_t hk, int64_t r0, int64_t Dv) {
  if (w.rows() > kFewRows) return false;
  gemm_unpacked(acc, Dv, row_major(w.data(), w.cols()), v.at(n, hk, r0), v.row, w.rows(), Dv, w.cols(),
                compute_t<T>(1), Write::accumulate);
  return true;
}

// kRounded: the weights (P or dS) rounded to T before their products (bfloat16's flash numerics where the products
// are in float: those of PyTorch's CPU flash kernel, which rounds them to the input dtype for its GEMMs).
template <typename T, bool kRounded = false>
struct BlockProducts {
  static constexpr bool kRoundsWeights = kRounded;  // (the forward rounds P itself: attention.cpp)
  using C = compute_t<T>;
  using Packed = PackedB<C>;
  using Buffer = RowMat<C>;
  struct Rows {
    const C* data;
    int64_t ld;  // row stride
  };
  static constexpr int64_t kPanel = Packed::kPanel;  // packed columns start at multiples of this

  // Rows [r0, r0 + rows) of head (n, h) of a (each of `cols` elements; of T or of the compute type): the array's
  // own rows in the compute type, a converted copy in buf for the half-precision types.
  template <typename A>
  static Rows rows(Buffer& buf, const View4<const A>& a, int64_t n, int64_t h, int64_t r0, int64_t rows,
                   int64_t cols) {
    if constexpr (is_half<A>) {
      buf.resize(rows, cols);
      for (int64_t r = 0; r < rows; ++r) load_n(buf.data() + r * cols, a.at(n, h, r0 + r), cols);
      return {buf.data(), cols};
    } else {
      return {a.at(n, h, r0), a.row};
    }
  }
  // The rows at the pointers row(0), ..., row(count - 1) gathered into buf.
  template <typename RowAt>
  static Rows gather(Buffer& buf, RowAt&& row, int64_t count, int64_t cols) {
    buf.resize(count, cols);
    for (int64_t r = 0; r < count; ++r) load_n(buf.data() + r * cols, row(r), cols);
    return {buf.data(), cols};
  }
  // Packs rows [r0, r0 + rows) of head (n, h) of a (rows, cols), or their transpose (cols, rows) (half-precision
  // rows converted first, then transposed in registers like float's).
  static void pack(Packed& b, const View4<const T>& a, int64_t n, int64_t h, int64_t r0, int64_t rows, int64_t cols,
                   bool transposed) {
    if (!transposed) {
      if constexpr (std::is_same_v<T, C>)  // (an input's rows, alive and unchanged through the call)
        b.pack_or_refer(a.at(n, h, r0), a.row, rows, cols);
      else
        b.pack(a.at(n, h, r0), a.row, 1, rows, cols);
    } else {
      thread_local Buffer converted;
      const Rows x = BlockProducts::rows(converted, a, n, h, r0, rows, cols);
      b.pack(x.data, 1, x.ld, cols, rows);
    }
  }

  // c (M, N) (+)= alpha a (M, K) b, b being rows [k0, k0 + K) and columns [j0, j0 + N) of a packed matrix.
  static void product(C* c, int64_t ldc, Rows a, const Packed& b, int64_t M, int64_t N, int64_t K, C alpha,
                      Write write, int64_t k0 = 0, int64_t j0 = 0) {
    gemm(c, ldc, row_major(a.data, a.ld), b, M, N, K, alpha, write, k0, j0);
  }
  // c (M, N) = alpha a k^T, k (N, K) rows of T with row stride ldk, read where they lie: for at most kFewRows rows
  // of a (gemm_nt_rows).
  static void product_in_place(C* c, int64_t ldc, Rows a, const T* k, int64_t ldk, int64_t M, int64_t N, int64_t K,
                               C alpha) {
    gemm_nt_rows(c, ldc, a.data, a.ld, k, ldk, M, N, K, alpha);
  }
  // c (M, N) (+)= alpha w b and c (+)= alpha w^T b, w weights (M, K) (resp. (K, M)), contiguous.
  static void weights_product(C* c, int64_t ldc, const RowMat<C>& w, Buffer& buf, const Packed& b, int64_t N,
                              C alpha, Write write, int64_t k0 = 0) {
    const RowMat<C>& a = weights(w, buf);
    gemm(c, ldc, row_major(a.data(), a.cols()), b, a.rows(), N, a.cols(), alpha, write, k0);
  }
  static void weights_t_product(C* c, int64_t ldc, const RowMat<C>& w, Buffer& buf, const Packed& b, int64_t N,
                                C alpha, Write write) {
    const RowMat<C>& a = weights(w, buf);
    gemm(c, ldc, transposed(a.data(), a.cols()), b, a.cols(), N, a.rows(), alpha, write);
  }
  // acc (rows of w, Dv) += w v_blk, v_blk rows [r0, r0 + w.cols()) of head (n, hk) of v, packed into vb first
  // but for a few rows (values_in_place).
  static void add_weighted_values(C* acc, const RowMat<C>& w, Buffer& buf, Packed& vb, const View4<const T>& v,
                                  int64_t n, int64_t hk, int64_t r0, int64_t Dv) {
    const RowMat<C>& a = weights(w, buf);
    if (values_in_place(acc, a, v, n, hk, r0, Dv)) return;
    pack(vb, v, n, hk, r0, a.cols(), Dv, false);
    gemm(acc, Dv, row_major(a.data(), a.cols()), vb, a.rows(), Dv, a.cols(), C(1), Write::accumulate);
  }

 private:
  // The weights as the products take them: w itself, or (kRounded) w rounded to T in buf.
  static const RowMat<C>& weights(const RowMat<C>& w, Buffer& buf) {
    if constexpr (!kRounded) {
      return w;
    } else {
      buf.resize(w.rows(), w.cols());
      round_n<T>(buf.data(), w.data(), w.size());
      return buf;
    }
  }
};

#if defined(__AVX512BF16__)
struct PairProducts {
  static constexpr bool kRoundsWeights = false;  // (its products round them as they convert them to pairs)
  using T = bfloat16;
  using C = float;
  using Packed = PackedPairs;
  using Buffer = std::vector<uint32_t>;
  struct Rows {
    const uint32_t* data;  // pairs of bfloat16
    int64_t ld;            // row stride in pairs
  };
  static constexpr int64_t kPanel = Packed::kPanel;
  // c (M, N) = alpha a k^T for at most kFewRows rows of a, the keys read where they lie, in float (gemm_nt_rows,
  // the rows of a read into float first): the products of bfloat16 values are exact in float either way. A decoding
  // step (8, 32 heads, 1, 128) over 4096 keys with its keys packed as pairs was 1.54 times as fast as the float32
  // step of the same run; read in place, 1.75 to 2.35 times (four runs).
  static void product_in_place(C* c, int64_t ldc, Rows a, const T* k, int64_t ldk, int64_t M, int64_t N, int64_t K,
                               C alpha) {
    thread_local std::vector<C> rows;
    rows.resize(std::size_t(M * K));
    for (int64_t r = 0; r < M; ++r) load_n(rows.data() + r * K, reinterpret_cast<const T*>(a.data + r * a.ld), K);
    gemm_nt_rows(c, ldc, rows.data(), K, k, ldk, M, N, K, alpha);
  }

  // Whether the arrays' rows can be read as pairs: even (and nonzero) row widths and strides, 4-byte aligned data.
  static bool fit(std::initializer_list<const View4<const T>*> arrays, std::initializer_list<int64_t> widths) {
    for (const int64_t w : widths)
      if (w % 2 || w == 0) return false;
    for (const auto* a : arrays)
      if ((a->n | a->h | a->row) % 2 || !pair_aligned(a->data)) return false;
    return true;
  }

  static Rows rows(Buffer&, const View4<const T>& a, int64_t n, int64_t h, int64_t r0, int64_t, int64_t) {
    return {reinterpret_cast<const uint32_t*>(a.at(n, h, r0)), a.row / 2};
  }
  template <typename RowAt>
  static Rows gather(Buffer& buf, RowAt&& row, int64_t count, int64_t cols) {
    buf.resize(std::size_t(count * cols / 2));
    for (int64_t r = 0; r < count; ++r) std::memcpy(buf.data() + r * cols / 2, row(r), cols * sizeof(T));
    return {buf.data(), cols / 2};
  }
  static void pack(Packed& b, const View4<const T>& a, int64_t n, int64_t h, int64_t r0, int64_t rows, int64_t cols,
                   bool transposed) {
    if (transposed)
      b.pack_transposed(a.at(n, h, r0), a.row, rows, cols);
    else
      b.pack_rows(a.at(n, h, r0), a.row, rows, cols);
  }

  // (k0 and K even, but for the last block's K)
  static void product(C* c, int64_t ldc, Rows a, const Packed& b, int64_t M, int64_t N, int64_t K, C alpha,
                      Write write, int64_t k0 = 0, int64_t j0 = 0) {
    gemm_pairs(c, ldc, {a.data, a.ld, 1}, b, M, N, (K + 1) / 2, alpha, write, k0 / 2, j0);
  }
  static void weights_product(C* c, int64_t ldc, const RowMat<C>& w, Buffer& buf, const Packed& b, int64_t N,
                              C alpha, Write write, int64_t k0 = 0) {
    const int64_t M = w.rows(), K2 = (w.cols() + 1) / 2;
    buf.resize(std::size_t(M * K2));
    to_pair_rows(buf.data(), w.data(), w.cols(), M, w.cols());
    gemm_pairs(c, ldc, {buf.data(), K2, 1}, b, M, N, K2, alpha, write, k0 / 2);
  }
  static void weights_t_product(C* c, int64_t ldc, const RowMat<C>& w, Buffer& buf, const Packed& b, int64_t N,
                                C alpha, Write write) {
    const int64_t M = w.cols(), K2 = (w.rows() + 1) / 2;
    buf.resize(std::size_t(K2 * M));
    to_pair_columns(buf.data(), w.data(), M, w.rows(), M);
    gemm_pairs(c, ldc, {buf.data(), 1, M}, b, M, N, K2, alpha, write);
  }
  static void add_weighted_values(C* acc, const RowMat<C>& w, Buffer& buf, Packed& vb, const View4<const T>& v,
                                  int64_t n, int64_t hk, int64_t r0, int64_t Dv) {
    if (values_in_place(acc, w, v, n, hk, r0, Dv)) return;
    pack(vb, v, n, hk, r0, w.cols(), Dv, false);
    weights_product(acc, Dv, w, buf, vb, Dv, C(1), Write::accumulate);
  }
};
#endif

}  // namespace attnpp::ATTNPP_CPU_NS
