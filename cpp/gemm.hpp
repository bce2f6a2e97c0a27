// The dense products of the core.
//
// gemm: C (M, N) (+)= alpha * A (M, K) B (K, N), where A has any strides (so A may be a transposed view) and B is
// packed (PackedB): copied into panels as wide as the micro-kernel's row of vectors, each panel's rows contiguous,
// the order in which the kernel streams it. Packing costs one copy of B for M / 6 reads of it, and keeps its rows
// out of the cache-set conflicts of a large row stride (MultiheadAttention's 3 KiB puts a block of V in 4 of L1's
// 64 sets). The micro-kernel is register-tiled without packing A: each step of k broadcasts one element from each
// of MR rows of A and multiplies it into NV vectors of one row of B. Its tile is chosen per CPU level so that the
// accumulators, the row of B and the broadcast fill the vector registers without spilling. On the attention blocks
// it runs at Eigen's packed GEMM's rate or above at every level (single thread, 256 x 128 x 64 float: 98 vs 100
// GFLOP/s at AVX2, 110 vs 101 at AVX-512, 34 vs 29 at the x86-64 baseline). gemm_parallel: the same, blocked
// for the caches and spread over the threads, for the projections. dot_products: for outputs narrower than one
// vector. Every element is summed over k in a fixed order by one thread, so results depend neither on the
// buffers' alignment nor on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "buffer_pool.hpp"
#include "level.hpp"

// Unrolls the loop that follows completely: a micro-kernel's loops over its tile's rows and vectors. Without it
// GCC 12 kept the accumulators in an array on the stack, zeroed there before the loop over k and stored there after
// it (at AVX-512, 63 stack accesses per tile of 6 x 4 vectors: about the time of its multiply-adds at the k = 5 of
// article 001's logits).
#define ATTNPP_UNROLL _Pragma("GCC unroll 16")

namespace attnpp::ATTNPP_CPU_NS {

// c + a * b as the micro-kernel's vector `acc += a * b` computes each lane: one rounding where the target has FMA
// (GCC and Clang contract that expression to it there), two elsewhere. The products' scalar tails and the attention
// backward's softmax term sum with it, so that a sum over k has the same bits whichever path computes it: where a
// row sees a single key (P = 1, out = v), dP - rowsum(dO * out) is then exactly 0, as in PyTorch's math, instead of
// a rounding of |dO| |v| carried into dq and dk.
template <typename T>
inline T mul_add(T a, T b, T c) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, c);
#else
  return c + a * b;
#endif
}

namespace gemm_detail {

// Register budget: MR * NV accumulators plus NV row vectors of B and one broadcast.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64, kMR = 6, kNV = 4;  // 32 registers
#elif defined(__AVX__)
constexpr int kVecBytes = 32, kMR = 6, kNV = 2;  // 15 of 16 registers
#elif defined(__SSE2__)
// 8 accumulators, 4 row vectors, the broadcast and a product (no FMA): 14 of 16 registers. Two rows, not four: SSE2
// broadcasts an element of A with a load and a shuffle, which takes one of the ports of the adds and multiplies, and
// 2 x 4 vectors shuffle half as often per multiply as 4 x 2 (the forward's two products on a 256 x 512 x 64 block,
// alternately in one process on an AMD Zen 3: 1.07 to 1.14 times 4 x 2's rate; 5 or 6 x 2 the same as 4 x 2).
constexpr int kVecBytes = 16, kMR = 2, kNV = 4;
#else
constexpr int kVecBytes = 16, kMR = 4, kNV = 2;  // 11 of NEON's 32 registers
#endif

template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(kVecBytes)));
  static constexpr int width = kVecBytes / sizeof(T);
};

// A vector of W = Vec<T>::width elements of B (of T, or of a half-precision type whose compute type is T: read into
// T; a decoding step's value rows, read in place).
template <typename T, typename TB>
inline typename Vec<T>::type load_vector(const TB* B) {
  typename Vec<T>::type v;
  if constexpr (std::is_same_v<TB, T>) {
    std::memcpy(&v, B, sizeof(v));
  } else {
    T wide[Vec<T>::width];
    load_n(wide, B, Vec<T>::width);
    std::memcpy(&v, wide, sizeof(v));
  }
  return v;
}

// C (MR, NV * width) (+)= alpha * A (MR, K) B (K, NV * width).
template <typename T, int MR, int NV, typename TB>
inline void tile(T* C, int64_t ldc, const T* A, int64_t ars, int64_t acs, const TB* B, int64_t ldb, int64_t K,
                 T alpha, bool accumulate) {
  using V = typename Vec<T>::type;
  constexpr int W = Vec<T>::width;
  V acc[MR][NV];
  ATTNPP_UNROLL for (int i = 0; i < MR; ++i)
    ATTNPP_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = V{};
  _Pragma("GCC unroll 2") for (int64_t k = 0; k < K; ++k) {
    V b[NV];
    ATTNPP_UNROLL for (int v = 0; v < NV; ++v) b[v] = load_vector<T>(B + k * ldb + v * W);
    ATTNPP_UNROLL for (int i = 0; i < MR; ++i) {
      const T a = A[i * ars + k * acs];
      ATTNPP_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] += a * b[v];
    }
  }
  ATTNPP_UNROLL for (int i = 0; i < MR; ++i)
    ATTNPP_UNROLL for (int v = 0; v < NV; ++v) {
      T* c = C + i * ldc + v * W;
      V out = alpha * acc[i][v];
      if (accumulate) {
        V old;
        std::memcpy(&old, c, sizeof(V));
        out += old;
      }
      std::memcpy(c, &out, sizeof(V));
    }
}

// Runtime row count m in [1, MR] -> tile<T, m, NV>.
template <typename T, int NV, int MR = kMR, typename TB>
inline void tile_rows(int m, T* C, int64_t ldc, const T* A, int64_t ars, int64_t acs, const TB* B, int64_t ldb,
                      int64_t K, T alpha, bool accumulate) {
  if constexpr (MR > 0) {
    if (m == MR)
      tile<T, MR, NV>(C, ldc, A, ars, acs, B, ldb, K, alpha, accumulate);
    else
      tile_rows<T, NV, MR - 1>(m, C, ldc, A, ars, acs, B, ldb, K, alpha, accumulate);
  }
}

// The shortest k for which panel requests the next tile's rows of C ahead.
constexpr int64_t kPrefetchDepth = 32;

// The next panel of B, `lines` cache lines from `data` (none: lines = 0), which a panel requests into the cache as
// its tiles run (gemm).
struct Ahead {
  const char* data = nullptr;
  int64_t lines = 0;
};

// Columns [j0, j0 + NV * width) of all M rows; the lines of `next` requested a share after each tile.
template <typename T, int NV, typename TB>
inline void panel(T* C, int64_t ldc, const T* A, int64_t ars, int64_t acs, const TB* B, int64_t ldb, int64_t M,
                  int64_t K, T alpha, bool accumulate, Ahead next) {
  const int64_t per_tile = ceil_div(next.lines, std::max<int64_t>(1, ceil_div(M, kMR)));
  for (int64_t i = 0, line = 0; i < M; i += kMR) {
    // the next tile's rows of C, requested now so that they arrive while this tile computes: a projection's output
    // (the fused loss's 154 MB weight gradient, added into block by block) is in memory, not in cache, and its rows
    // are too far apart for the hardware's prefetchers. Not for a short k (article 001's E = 5), whose tile is over
    // before the lines could arrive and whose output is in cache.
    if (K >= kPrefetchDepth)
      for (int64_t r = i + kMR; r < std::min(M, i + 2 * kMR); ++r)
        for (int v = 0; v < NV; ++v) __builtin_prefetch(C + r * ldc + v * Vec<T>::width, 1);
    tile_rows<T, NV>(static_cast<int>(std::min<int64_t>(kMR, M - i)), C + i * ldc, ldc, A + i * ars, ars, acs, B,
                     ldb, K, alpha, accumulate);
    for (const int64_t end = std::min(next.lines, line + per_tile); line < end; ++line)
      __builtin_prefetch(next.data + line * kCacheLine, 0, 1);
  }
}

// Runtime vector count nv in [1, NV] -> panel<T, nv>.
template <typename T, int NV = kNV, typename TB>
inline void panel_vectors(int nv, T* C, int64_t ldc, const T* A, int64_t ars, int64_t acs, const TB* B,
                          int64_t ldb, int64_t M, int64_t K, T alpha, bool accumulate, Ahead next) {
  if constexpr (NV > 0) {
    if (nv == NV)
      panel<T, NV>(C, ldc, A, ars, acs, B, ldb, M, K, alpha, accumulate, next);
    else
      panel_vectors<T, NV - 1>(nv, C, ldc, A, ars, acs, B, ldb, M, K, alpha, accumulate, next);
  }
}

// C (M, N) = alpha * A B (accumulate = false) or C += alpha * A B (accumulate = true).
// A (M, K): element (i, k) at A[i * ars + k * acs]; B (K, N): element (k, j) at B[k * ldb + j] (of T, or read into
// T from a half-precision type); C row stride ldc. next: requested into the cache as the panels run (panel).
template <typename T, typename TB>
void gemm_rows(T* C, int64_t ldc, const T* A, int64_t ars, int64_t acs, const TB* B, int64_t ldb, int64_t M,
               int64_t N, int64_t K, T alpha, bool accumulate, Ahead next = {}) {
  constexpr int W = Vec<T>::width;
  int64_t j = 0;
  while (j + W <= N) {  // panels of kNV vectors, the last one possibly narrower
    const int nv = static_cast<int>(std::min<int64_t>(kNV, (N - j) / W));
    panel_vectors<T>(nv, C + j, ldc, A, ars, acs, B + j, ldb, M, K, alpha, accumulate, next);
    j += nv * W;
  }
  for (int64_t i = 0; i < M; ++i)  // the last N % W columns
    for (int64_t jj = j; jj < N; ++jj) {
      T sum = 0;
      for (int64_t k = 0; k < K; ++k) sum = mul_add(A[i * ars + k * acs], load(B[k * ldb + jj]), sum);
      C[i * ldc + jj] = accumulate ? C[i * ldc + jj] + alpha * sum : alpha * sum;
    }
}

}  // namespace gemm_detail

// The A operand of a product, (M, K): element (i, k) at data[i * rs + k * cs]. row_major(p, ld): a row-major
// matrix with row stride ld; transposed(p, ld): the transpose of one (its element (i, k) is the matrix's (k, i)).
template <typename T>
struct Operand {
  const T* data;
  int64_t rs, cs;
};
template <typename T>
Operand<T> row_major(const T* data, int64_t ld) {
  return {data, ld, 1};
}
template <typename T>
Operand<T> transposed(const T* data, int64_t ld) {
  return {data, 1, ld};
}

// Whether a product overwrites its output (C = alpha A B) or adds into it (C += alpha A B).
enum class Write { assign, accumulate };

// The B operand of gemm, packed: B (K, N) in panels of kPanel columns (the last one narrower), panel j (the
// columns [j, j + width(j))) being K rows of width(j) contiguous elements.
template <typename T>
struct PackedB {
  static constexpr int64_t kPanel = gemm_detail::kNV * gemm_detail::Vec<T>::width;
  // From the recycled blocks (buffer_pool.hpp): a projection packs megabytes at every call (MultiheadAttention's
  // weight gradient at (4, 512, 768) packs its 6 MiB input), whose fresh pages would cost more than the packing.
  PoolArray<T> data;
  int64_t K = 0, N = 0, capacity = 0;
  // B itself where it already lies as its packed copy would (pack_or_refer): then data is not used.
  const T* view = nullptr;

  // Packs B (K, N), element (k, j) at B[k * brs + j * bcs] (a transposed view has brs = 1), of T or of a
  // half-precision type whose compute type is T (converted as it is copied). B with contiguous rows (bcs = 1) is
  // read in its memory order, row after row, which the hardware prefetches (a panel at a time reads a strip of each
  // row: from memory, one stall per row); a transposed view, panel by panel.
  template <typename S>
  void pack(const S* B, int64_t brs, int64_t bcs, int64_t K_, int64_t N_) {
    resize(K_, N_);
    if (bcs == 1)
      copy_rows(B, brs, 0, K);
    else
      for (int64_t j = 0; j < N; j += kPanel) pack_panel(B, brs, bcs, j);
  }
  // The same, the copy shared among the threads: by blocks of rows, or panel by panel.
  template <typename S>
  void pack_parallel(const S* B, int64_t brs, int64_t bcs, int64_t K_, int64_t N_) {
    resize(K_, N_);
    constexpr int64_t kRows = 64;
    if (bcs == 1)
      parallel_for(ceil_div(K, kRows), K * N,
                   [&](int64_t t) { copy_rows(B, brs, t * kRows, std::min(K, (t + 1) * kRows)); });
    else
      parallel_for(ceil_div(N, kPanel), K * N, [&](int64_t p) { pack_panel(B, brs, bcs, p * kPanel); });
  }
  // Packs B (K, N) of T with contiguous rows, row stride brs, or takes it where it lies when it is one panel wide
  // with its rows back to back (brs = N <= kPanel), its memory being then the packed copy's. The caller keeps B
  // alive and unchanged while it uses the product's B: an input array, never a scratch buffer that the next pack
  // refills. A head's values or keys at D = 64 at AVX-512: their copies were 2 to 4% of the (8,12,256,64) forward
  // and backward.
  void pack_or_refer(const T* B, int64_t brs, int64_t K_, int64_t N_) {
    if (N_ > kPanel || brs != N_) {
      pack(B, brs, 1, K_, N_);
    } else {
      K = K_, N = N_, view = B;
    }
  }
  void resize(int64_t K_, int64_t N_) {
    K = K_, N = N_, view = nullptr;
    if (capacity < K * N) {
      data.reset();
      data = pool_array<T>(std::size_t(capacity = K * N));
    }
  }
  // Rows [k0, k1) of every panel, from B with contiguous rows (element (k, j) at B[k * brs + j]). A full panel's row
  // of T is copied by a copy of constant size, a few vector moves: GCC made the copy of a row's runtime width a
  // `rep movsq`, whose start-up costs more than the copy (at AVX2, (8,12,256,64)'s values: 6% of the forward).
  template <typename S>
  void copy_rows(const S* B, int64_t brs, int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t j = 0; j < N; j += kPanel) {
        T* dst = data.get() + j * K + k * width(j);
        if (std::is_same_v<S, T> && width(j) == kPanel)
          std::memcpy(dst, B + k * brs + j, sizeof(T) * kPanel);
        else
          load_n(dst, B + k * brs + j, width(j));
      }
  }
  // The panel of columns [j0, j0 + width(j0)) of B with bcs != 1.
  template <typename S>
  void pack_panel(const S* B, int64_t brs, int64_t bcs, int64_t j0) {
    static_assert(std::is_same_v<compute_t<S>, T>);
    const int64_t w = width(j0);
    T* dst = data.get() + j0 * K;
    const S* src = B + j0 * bcs;
    int64_t k = 0;
    if (brs == 1 && w == kPanel) {  // a transposed view (K^T, V^T): square blocks
      namespace ei = Eigen::internal;  // of one vector's width transposed in registers by Eigen (ptranspose)
      using P = typename ei::packet_traits<T>::type;
      constexpr int W = ei::unpacket_traits<P>::size;
      if constexpr (W == gemm_detail::Vec<T>::width && W > 1 && std::is_same_v<S, T>) {
        for (; k + W <= K; k += W)
          for (int64_t j = 0; j < w; j += W) {
            ei::PacketBlock<P, W> block;
            for (int i = 0; i < W; ++i) block.packet[i] = ei::ploadu<P>(src + (j + i) * bcs + k);
            ei::ptranspose(block);
            for (int i = 0; i < W; ++i) ei::pstoreu(dst + (k + i) * w + j, block.packet[i]);
          }
      }
    }
    for (; k < K; ++k)  // the rest, element by element
      for (int64_t j = 0; j < w; ++j) dst[k * w + j] = load(src[k * brs + j * bcs]);
  }
  int64_t width(int64_t j) const { return std::min(kPanel, N - j); }
  const T* panel(int64_t j, int64_t k0 = 0) const {  // from row k0
    return (view ? view : data.get()) + j * K + k0 * width(j);
  }
};

// A packed B of more bytes than this is taken to lie beyond a core's L2 cache (512 KiB to 2 MiB on the CPUs
// measured): a head's keys and values packed once at long lengths, which the forward walks a block at a time, or a
// projection's weight. Its panels come from the L3 cache or memory, and the hardware's prefetchers, which start on
// each panel's first misses, left the micro-kernel waiting on them: each panel of such a B requests the next one's
// lines as its tiles run, a share after each tile (at once before the panel, they gained nothing). The causal
// forward of (1, 4, 16384, 128) at AVX2 on an AMD Zen 4 took 0.96 of its time ((1, 8, 8192, 128): 0.96 to 0.97,
// (1, 2, 32768, 64): 0.97 to 0.98; medians of 7 to 11 processes alternating), at AVX-512, whose panels are four times
// as wide, 0.99 to 1.01. A smaller B stays in L2 from one use to the next: requesting its panels changed nothing
// measurable (the short cases, forward and backward, 0.98 to 1.02).
constexpr int64_t kStreamedBytes = int64_t(1) << 20;

// C (M, N) (+)= alpha * A (M, K) B (K, N), B being rows [k0, k0 + K) and columns [j0, j0 + N) of a packed matrix
// (a causal block uses part of the keys packed; the projections, slices of k); C row-major, row stride ldc. j0: a
// multiple of the panel width.
template <typename T>
void gemm(T* C, int64_t ldc, Operand<T> A, const PackedB<T>& B, int64_t M, int64_t N, int64_t K, T alpha,
          Write write, int64_t k0 = 0, int64_t j0 = 0) {
  const bool streamed = B.K * B.N * int64_t(sizeof(T)) > kStreamedBytes;
  for (int64_t j = 0; j < N; j += B.kPanel) {
    const int64_t w = B.width(j0 + j);
    gemm_detail::Ahead next;
    const int64_t jn = j0 + j + B.kPanel;  // the next panel's first column
    if (streamed && j + B.kPanel < N)
      next = {reinterpret_cast<const char*>(B.panel(jn, k0)), ceil_div(K * B.width(jn) * int64_t(sizeof(T)),
                                                                        kCacheLine)};
    gemm_detail::gemm_rows(C + j, ldc, A.data, A.rs, A.cs, B.panel(j0 + j, k0), w, M, std::min(w, N - j), K, alpha,
                           write == Write::accumulate, next);
  }
}

// The same product with B (K, N) row-major, row stride ldb, read where it lies: for a few rows of A, too few to
// pay for a packed copy. B of T, or of a half-precision type whose compute type is T (read into T).
template <typename T, typename TB>
void gemm_unpacked(T* C, int64_t ldc, Operand<T> A, const TB* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                   T alpha, Write write) {
  gemm_detail::gemm_rows(C, ldc, A.data, A.rs, A.cs, B, ldb, M, N, K, alpha, write == Write::accumulate);
}

// The sums of the lanes of v[0], ..., v[W - 1] (W = Vec<T>::width) as one vector, lane u holding v[u]'s: a
// transposing reduction, log2(W) levels of pairwise merges (two shuffles and an add each, W - 1 merges in all)
// instead of W horizontal sums. At the level of `Half`, lane l of a merge holds, in its block of 2 * Half lanes, the
// sum of two lanes Half apart: of the first vector in the block's first half, of the second in its second half.
namespace gemm_detail {
// Lane l of a merge at the level of `Half` takes lane merge_lane(l) of the two vectors' 2W lanes (the second's
// from W), the lower or the upper of the two lanes it sums.
template <typename T, int Half>
constexpr int merge_lane(int l, bool upper) {
  constexpr int W = Vec<T>::width;
  return (l % (2 * Half) < Half ? l : W + l - Half) + (upper ? Half : 0);
}
// Those lanes of a and b, by the compiler's shuffle builtin: __builtin_shufflevector (Clang; GCC from 12) takes
// them as constants, GCC's older __builtin_shuffle as a vector.
template <typename T, int Half, bool Upper, int... L>
inline typename Vec<T>::type merge_lanes(typename Vec<T>::type a, typename Vec<T>::type b,
                                         std::integer_sequence<int, L...>) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define ATTNPP_SHUFFLEVECTOR 1
#endif
#endif
#if defined(ATTNPP_SHUFFLEVECTOR)
  return __builtin_shufflevector(a, b, merge_lane<T, Half>(L, Upper)...);
#else
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef I Mask __attribute__((vector_size(kVecBytes)));
  return __builtin_shuffle(a, b, Mask{merge_lane<T, Half>(L, Upper)...});
#endif
}
template <typename T, int Half = 1>
inline typename Vec<T>::type lane_sums(typename Vec<T>::type* v) {
  constexpr int W = Vec<T>::width;
  if constexpr (Half == W) {
    return v[0];
  } else {
    constexpr auto lanes = std::make_integer_sequence<int, W>();
    for (int i = 0; i < W / (2 * Half); ++i)
      v[i] = merge_lanes<T, Half, false>(v[2 * i], v[2 * i + 1], lanes) +
             merge_lanes<T, Half, true>(v[2 * i], v[2 * i + 1], lanes);
    return lane_sums<T, 2 * Half>(v);
  }
}
}  // namespace gemm_detail

// C (M, N) = alpha A Bt^T, A (M, K) and Bt (N, K) row-major (row strides lda, ldbt; C's ldc), Bt of T or of a
// half-precision type whose compute type is T (read into T), read where it lies: for the few rows of a decoding
// step's queries against a block of keys, whose transposed copy (PackedB) would cost as much as the products
// (one layer's decoding step of a 125M Llama over 2,048 keys: the packing took 31% of the attention). W rows of Bt
// at a time, W = one vector's width: each row of A multiplied into one vector per row of Bt along k, then the W
// vectors' lanes summed together (lane_sums). Each element is summed in a fixed order.
template <typename T, typename TB>
void gemm_nt_rows(T* C, int64_t ldc, const T* A, int64_t lda, const TB* Bt, int64_t ldbt, int64_t M, int64_t N,
                  int64_t K, T alpha) {
  using namespace gemm_detail;
  using V = typename Vec<T>::type;
  constexpr int W = Vec<T>::width;
  const int64_t Kv = K / W * W;
  int64_t j = 0;
  for (; j + W <= N; j += W) {
    // the W rows of Bt, in T: half-precision rows converted once for all M rows of A (by each row, a decoding
    // step's float16 keys at the x86-64 baseline, without F16C, took 4 times as long)
    const T* b = nullptr;
    int64_t ldb = K;
    if constexpr (std::is_same_v<TB, T>) {
      b = Bt + j * ldbt, ldb = ldbt;
    } else {
      thread_local std::vector<T> wide;
      wide.resize(std::size_t(W * K));
      for (int u = 0; u < W; ++u) load_n(wide.data() + u * K, Bt + (j + u) * ldbt, K);
      b = wide.data();
    }
    for (int64_t i = 0; i < M; ++i) {
      const T* a = A + i * lda;
      V acc[W] = {};
      for (int64_t k = 0; k < Kv; k += W) {
        V x;
        std::memcpy(&x, a + k, sizeof(V));
        ATTNPP_UNROLL for (int u = 0; u < W; ++u) acc[u] += x * load_vector<T>(b + u * ldb + k);
      }
      V sums = lane_sums<T>(acc);
      for (int64_t k = Kv; k < K; ++k)  // (k beyond the last whole vector)
        for (int u = 0; u < W; ++u) sums[u] += a[k] * b[u * ldb + k];
      sums *= alpha;
      std::memcpy(C + i * ldc + j, &sums, sizeof(V));
    }
  }
  for (; j < N; ++j)  // the last N % W rows of Bt
    for (int64_t i = 0; i < M; ++i) {
      T sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += A[i * lda + k] * load(Bt[j * ldbt + k]);
      C[i * ldc + j] = alpha * sum;
    }
}

// a (rows, cols) contiguous -> a^T (cols, rows) contiguous, for a weight whose transpose a product wants as its B.
// Left uninitialized before (no memset), written in tiles of 32 rows so that the reads stay in cache.
template <typename T>
std::unique_ptr<T[]> transpose(const T* a, int64_t rows, int64_t cols) {
  std::unique_ptr<T[]> t(new T[rows * cols]);
  constexpr int64_t kTile = 32;
  parallel_for(ceil_div(rows, kTile), rows * cols, [&](int64_t tile) {
    const int64_t r0 = tile * kTile, r1 = std::min(rows, r0 + kTile);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < r1; ++r) t[c * rows + r] = a[r * cols + c];
  });
  return t;
}

// sum_k a[k] b[k], vectorized, in a fixed order (4 vector accumulators, then their lanes, then the tail).
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  using namespace gemm_detail;
  using V = typename Vec<T>::type;
  constexpr int W = Vec<T>::width;
  V acc[4] = {};
  int64_t k = 0;
  for (; k + 4 * W <= n; k += 4 * W)
    for (int u = 0; u < 4; ++u) {
      V x, y;
      std::memcpy(&x, a + k + u * W, sizeof(V));
      std::memcpy(&y, b + k + u * W, sizeof(V));
      acc[u] += x * y;
    }
  T sum = 0;
  if (k > 0) {  // (a dot shorter than 4 vectors, like a 3-wide embedding's, skips the lanes)
    const V v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (int l = 0; l < W; ++l) sum += v[l];
  }
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

// C (M, N) (+)= A Bt^T, A (M, K) and Bt (N, K) with contiguous rows (row strides lda, ldbt; C's is N): M * N dot
// products along k. For outputs narrower than one vector, where the tiled kernel would run scalar loops. A task
// is a few rows of C; it walks k in slices of kKC so that the slice of Bt stays in cache for all its rows. Each
// element is summed by one task, slice after slice: the result does not depend on the thread count.
template <typename T>
void dot_products(T* C, const T* A, int64_t lda, const T* Bt, int64_t ldbt, int64_t M, int64_t N, int64_t K,
                  bool accumulate) {
  constexpr int64_t kRows = 4, kKC = 2048;
  const int64_t k_slices = std::max<int64_t>(1, ceil_div(K, kKC));  // one (empty) slice when K = 0
  parallel_for(ceil_div(M, kRows), M * N * K, [&](int64_t task) {
    const int64_t i0 = task * kRows, i1 = std::min(M, i0 + kRows);
    for (int64_t s = 0; s < k_slices; ++s) {
      const int64_t k0 = s * kKC, kc = std::min(kKC, K - k0);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < N; ++j) {
          const T d = dot(A + i * lda + k0, Bt + j * ldbt + k0, kc);
          C[i * N + j] = accumulate || s > 0 ? C[i * N + j] + d : d;
        }
    }
  });
}

// The same product for large operands (the projections), B (K, N) an Operand too (element (k, j) at
// B.data[k * B.rs + j * B.cs]):
// B packed once (in parallel: PackedB::pack_parallel) unless its rows are contiguous and C has a single block of
// rows (then each row of B is read by a few tiles only, and the copy would cost more than it saves: the 30 x 50,257
// logits' gradient of article 001's training), then C cut into blocks of (kMC, kNC) elements, run in parallel, each
// walking k in slices of kKC so that its slice of A and of B stays in cache. Every element of C is written by one
// thread, which sums over k in order: the result does not depend on the thread count.
template <typename T>
void gemm_parallel(T* C, int64_t ldc, Operand<T> A, Operand<T> B, int64_t M, int64_t N, int64_t K, T alpha,
                   Write write) {
  constexpr int64_t kMC = 120, kNC = 256, kKC = 256;  // kNC: a multiple of every level's panel width
  const bool packed = B.cs != 1 || M > kMC;
  PackedB<T> b;
  if (packed) b.pack_parallel(B.data, B.rs, B.cs, K, N);
  const int64_t m_blocks = ceil_div(M, kMC), n_blocks = ceil_div(N, kNC);
  const int64_t k_slices = std::max<int64_t>(1, ceil_div(K, kKC));  // one (empty) slice when K = 0 zeroes C
  parallel_for(
      m_blocks * n_blocks, M * N * K,
      [&](int64_t block) {
        const int64_t i0 = block / n_blocks * kMC, j0 = block % n_blocks * kNC;
        const int64_t rows = std::min(kMC, M - i0), cols = std::min(kNC, N - j0);
        for (int64_t s = 0; s < k_slices; ++s) {
          const int64_t k0 = s * kKC, kc = std::min(kKC, K - k0);
          T* c = C + i0 * ldc + j0;
          const Operand<T> a{A.data + i0 * A.rs + k0 * A.cs, A.rs, A.cs};  // rows i0.., columns k0..
          const Write w = s > 0 ? Write::accumulate : write;  // (the later slices add to the first)
          if (packed)
            gemm(c, ldc, a, b, rows, cols, kc, alpha, w, k0, j0);
          else
            gemm_unpacked(c, ldc, a, B.data + k0 * B.rs + j0, B.rs, rows, cols, kc, alpha, w);
        }
      });
}

}  // namespace attnpp::ATTNPP_CPU_NS
