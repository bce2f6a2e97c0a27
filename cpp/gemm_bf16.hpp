// Products of bfloat16 operands into float on AVX512_BF16 (the avx512_bf16 level): vdpbf16ps multiplies 16 pairs
// of bfloat16 by 16 pairs and adds each pair's two products into a float lane, 32 multiply-adds per instruction
// where a float FMA does 16.
//
// C (M, N) (+)= alpha * A (M, K) B (K, N), in float, from bfloat16 operands taken two by two along k: the 32-bit
// "pair" (x[2p], x[2p + 1]) is the unit. A is read pair by pair with any strides (a row of bfloat16 in place, or
// a transposed view of a matrix of pairs); B is packed (PackedPairs) in panels as wide as the micro-kernel's row
// of vectors, each panel's pair rows contiguous. The micro-kernel is gemm.hpp's (6 rows x 4 vectors, each step
// of p one broadcast pair per row of A into 4 vectors of B), with vdpbf16ps for the FMA. The products round
// nothing but their inputs: each sum is in float, in a fixed order (p ascending), so the result depends neither
// on the alignment nor on the thread count. The operands that are float in the attention (the weights P and their
// gradient dS) are rounded to bfloat16 first (to_pair_rows, to_pair_columns), as PyTorch's CPU flash attention
// does for bfloat16 inputs.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gemm.hpp"
#include "half.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace pairs_detail {

constexpr int kMR = 6, kNV = 4, kLanes = 16;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The pair of bfloat16 at x[0], x[1] as one 32-bit word (x[1] in the high half).
inline uint32_t pair(const bfloat16* x) {
  uint32_t w;
  std::memcpy(&w, x, 4);
  return w;
}
inline uint32_t pair(bfloat16 lo, bfloat16 hi) { return uint32_t(lo.bits) | uint32_t(hi.bits) << 16; }

}  // namespace pairs_detail

// Whether bfloat16 data can be read as pairs (32-bit words): 4-byte aligned.
inline bool pair_aligned(const bfloat16* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

namespace pairs_detail {

// C (MR, NV * 16) (+)= alpha * A (MR, K2 pairs) B (K2 pairs, NV * 16); columns at and past n_valid not stored.
template <int MR, int NV>
inline void tile(float* C, int64_t ldc, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B, int64_t ldb,
                 int64_t K2, float alpha, bool accumulate, int64_t n_valid) {
  __m512 acc[MR][NV];
  ATTNPP_UNROLL for (int i = 0; i < MR; ++i)
    ATTNPP_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh b[NV];
    ATTNPP_UNROLL for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + v * kLanes);
    ATTNPP_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(A[i * ars + p * acs]));
      ATTNPP_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  ATTNPP_UNROLL for (int v = 0; v < NV; ++v) {
    const int64_t left = n_valid - v * kLanes;
    const __mmask16 m = left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
    ATTNPP_UNROLL for (int i = 0; i < MR; ++i) {
      float* c = C + i * ldc + v * kLanes;
      __m512 out = _mm512_mul_ps(va, acc[i][v]);
      if (accumulate) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(m, c));
      _mm512_mask_storeu_ps(c, m, out);
    }
  }
}

template <int NV, int MR = kMR>
inline void tile_rows(int m, float* C, int64_t ldc, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B,
                      int64_t ldb, int64_t K2, float alpha, bool accumulate, int64_t n_valid) {
  if constexpr (MR > 0) {
    if (m == MR)
      tile<MR, NV>(C, ldc, A, ars, acs, B, ldb, K2, alpha, accumulate, n_valid);
    else
      tile_rows<NV, MR - 1>(m, C, ldc, A, ars, acs, B, ldb, K2, alpha, accumulate, n_valid);
  }
}

template <int NV = kNV>
inline void panel_vectors(int nv, float* C, int64_t ldc, const uint32_t* A, int64_t ars, int64_t acs,
                          const uint32_t* B, int64_t ldb, int64_t M, int64_t K2, float alpha, bool accumulate,
                          int64_t n_valid) {
  if constexpr (NV > 0) {
    if (nv == NV) {
      for (int64_t i = 0; i < M; i += kMR)
        tile_rows<NV>(int(std::min<int64_t>(kMR, M - i)), C + i * ldc, ldc, A + i * ars, ars, acs, B, ldb, K2, alpha,
                      accumulate, n_valid);
    } else {
      panel_vectors<NV - 1>(nv, C, ldc, A, ars, acs, B, ldb, M, K2, alpha, accumulate, n_valid);
    }
  }
}

}  // namespace pairs_detail

// The A operand of gemm_pairs, (M, K2 pairs): pair (i, p) at data[i * rs + p * cs].
struct PairOperand {
  const uint32_t* data;
  int64_t rs, cs;
};

// B (K, N) of bfloat16 packed for gemm_pairs: K2 = ceil(K / 2) rows of pairs, pair (p, j) = (B[2p, j], B[2p + 1,
// j]) (B[K, j] = 0 when K is odd), in panels of kPanel columns, each panel K2 rows of its width rounded up to 16
// (zeros past N).
struct PackedPairs {
  static constexpr int64_t kPanel = pairs_detail::kNV * pairs_detail::kLanes;
  PoolArray<uint32_t> data;
  int64_t K2 = 0, N = 0, capacity = 0;

  void resize(int64_t K, int64_t N_) {
    K2 = (K + 1) / 2, N = N_;
    const int64_t need = K2 * pairs_detail::round_up(N, pairs_detail::kLanes);
    if (capacity < need) {
      data.reset();
      data = pool_array<uint32_t>(std::size_t(capacity = need));
    }
  }
  // The padded width of the panel of columns [j, ...).
  int64_t width(int64_t j) const { return std::min(kPanel, pairs_detail::round_up(N - j, pairs_detail::kLanes)); }
  const uint32_t* panel(int64_t j, int64_t p0 = 0) const { return data.get() + j * K2 + p0 * width(j); }
  uint32_t* panel_mut(int64_t j) { return data.get() + j * K2; }

  // B = rows^T: B (K, N) from N rows of K bfloat16 each (row j at src + j * ld), pairs along the rows (a block of
  // K^T or V^T from the rows of K or V). ld even and src 4-byte aligned when K > 1 (checked by the caller).
  void pack_transposed(const bfloat16* src, int64_t ld, int64_t N_, int64_t K) {
    resize(K, N_);
    const int64_t full = K / 2, ldw = ld / 2;  // pairs wholly inside a row; the row stride in words
    const uint32_t* words = reinterpret_cast<const uint32_t*>(src);
    for (int64_t j0 = 0; j0 < N; j0 += kPanel) {
      const int64_t w = width(j0), cols = std::min(kPanel, N - j0);
      uint32_t* dst = panel_mut(j0);
      int64_t p = 0;
      if (cols == w) {  // 16 x 16 blocks of words transposed in registers, 16 rows read through at a time
        for (int64_t j = 0; j < w; j += 16)
          for (p = 0; p + 16 <= full; p += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(words + (j0 + j + i) * ldw + p);
            transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p + i) * w + j, r[i]);
          }
      }
      for (; p < K2; ++p)
        for (int64_t j = 0; j < w; ++j) {
          const bfloat16* x = src + (j0 + j) * ld + 2 * p;
          dst[p * w + j] = j >= cols      ? 0
                           : 2 * p + 1 < K ? pairs_detail::pair(x)
                                           : pairs_detail::pair(x[0], bfloat16{0});
        }
    }
  }

  // B (K, N) from K rows of N bfloat16 (row k at src + k * ld), pairs across two rows (a block of V, K, Q or dO).
  void pack_rows(const bfloat16* src, int64_t ld, int64_t K, int64_t N_) {
    resize(K, N_);
    // words (x[c], y[c]) for c in [0, 16) and [16, 32) of two rows' 32 elements x, y
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t j0 = 0; j0 < N; j0 += kPanel) {
      const int64_t w = width(j0), cols = std::min(kPanel, N - j0);
      uint32_t* dst = panel_mut(j0);
      for (int64_t p = 0; p < K2; ++p) {
        const bfloat16* x = src + 2 * p * ld + j0;
        const bfloat16* y = 2 * p + 1 < K ? x + ld : nullptr;
        for (int64_t c = 0; c < w; c += 32) {
          const int64_t n = std::clamp<int64_t>(cols - c, 0, 32);
          const __mmask32 m = n == 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1);
          const __m512i a = _mm512_maskz_loadu_epi16(m, x + c);
          const __m512i b = y ? _mm512_maskz_loadu_epi16(m, y + c) : _mm512_setzero_si512();
          _mm512_storeu_si512(dst + p * w + c, _mm512_permutex2var_epi16(a, lo, b));
          if (c + 16 < w) _mm512_storeu_si512(dst + p * w + c + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
      }
    }
  }

 private:
  // r[i] <- column i of the 16 x 16 matrix of words whose row i is r[i].
  static void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i + 4, i + 8, i + 12 hold lane groups
      t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
      t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
      r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
      r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
  }
};

// C (M, N) (+)= alpha * A (M, K2 pairs) B, B being pair rows [p0, p0 + K2) and columns [j0, j0 + N) of a packed
// matrix (j0 a multiple of the panel width); C row-major, row stride ldc.
inline void gemm_pairs(float* C, int64_t ldc, PairOperand A, const PackedPairs& B, int64_t M, int64_t N, int64_t K2,
                       float alpha, Write write, int64_t p0 = 0, int64_t j0 = 0) {
  for (int64_t j = 0; j < N; j += B.kPanel) {
    const int64_t w = B.width(j0 + j), n = std::min(B.kPanel, N - j);
    pairs_detail::panel_vectors(int(pairs_detail::round_up(n, pairs_detail::kLanes) / pairs_detail::kLanes), C + j,
                                ldc, A.data, A.rs, A.cs, B.panel(j0 + j, p0), w, M, K2, alpha,
                                write == Write::accumulate, n);
  }
}

// The rows of a (rows, cols) float matrix (row stride lda) rounded to bfloat16 as rows of pairs along the columns:
// out (rows, ceil(cols / 2)) words, the last pair zero-padded when cols is odd. For the weights P (or their
// gradient dS) as the A operand of P V (dS K).
inline void to_pair_rows(uint32_t* out, const float* a, int64_t lda, int64_t rows, int64_t cols) {
  const int64_t c2 = (cols + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a + r * lda;
    uint32_t* o = out + r * c2;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32)
      _mm512_storeu_si512(o + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c)));
    // the last columns 16 at a time, masked (zero past the end): element by element, the rows of 16 or 48 weights
    // of the causal diagonal's chunks (attention.cpp) made (8,12,256,64) causal 3% slower
    for (; c < cols; c += 16) {
      const int n = int(std::min<int64_t>(16, cols - c));
      const __m512 v = _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), x + c);
      _mm256_mask_storeu_epi32(o + c / 2, __mmask8((1u << (n + 1) / 2) - 1), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// The same matrix rounded as rows of pairs across two rows: out (ceil(rows / 2), cols) words, word (p, c) =
// (a[2p, c], a[2p + 1, c]) (zero past the last row). Its transposed view, PairOperand{out, 1, cols}, is the A
// operand of P^T dO (dS^T Q).
inline void to_pair_columns(uint32_t* out, const float* a, int64_t lda, int64_t rows, int64_t cols) {
  for (int64_t p = 0; p < (rows + 1) / 2; ++p) {
    const float* x = a + 2 * p * lda;
    const float* y = 2 * p + 1 < rows ? x + lda : nullptr;
    uint32_t* o = out + p * cols;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + c)));
      const __m512i hi = y ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(y + c)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(o + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; c < cols; ++c) o[c] = pairs_detail::pair(store<bfloat16>(x[c]), store<bfloat16>(y ? y[c] : 0.f));
  }
}

// The same from a bfloat16 matrix, as it is (no rounding): the A operand dy^T of a linear layer's weight gradient.
inline void to_pair_columns(uint32_t* out, const bfloat16* a, int64_t lda, int64_t rows, int64_t cols) {
  for (int64_t p = 0; p < (rows + 1) / 2; ++p) {
    const bfloat16 *x = a + 2 * p * lda, *y = 2 * p + 1 < rows ? x + lda : nullptr;
    for (int64_t c = 0; c < cols; ++c) out[p * cols + c] = pairs_detail::pair(x[c], y ? y[c] : bfloat16{0});
  }
}

// C (M, N) = A (M, K2 pairs) B, in blocks of up to kRows rows and one panel of B's columns, in parallel: each block
// is computed into a float tile, then handed to out(i0, j0, rows, cols, tile, ld) to be written (rounded, biased,
// added...). Each element is summed over the pairs in order by one thread: the result does not depend on the
// thread count.
template <typename Out>
void gemm_pairs_parallel(PairOperand A, const PackedPairs& B, int64_t M, int64_t N, int64_t K2, Out&& out) {
  constexpr int64_t kRows = 120;  // (a multiple of the micro-kernel's 6)
  const int64_t m_blocks = ceil_div(M, kRows), n_blocks = ceil_div(N, B.kPanel);
  parallel_for(
      m_blocks * n_blocks, 2 * M * N * K2,
      [&](int64_t block) {
        const int64_t i0 = block / n_blocks * kRows, j0 = block % n_blocks * B.kPanel;
        const int64_t rows = std::min(kRows, M - i0), cols = std::min(B.kPanel, N - j0);
        thread_local std::vector<float> tile;
        tile.resize(std::size_t(rows * B.kPanel));
        gemm_pairs(tile.data(), B.kPanel, {A.data + i0 * A.rs, A.rs, A.cs}, B, rows, cols, K2, 1.f, Write::assign,
                   0, j0);
        out(i0, j0, rows, cols, tile.data(), B.kPanel);
      });
}

}  // namespace attnpp::ATTNPP_CPU_NS
#endif  // __AVX512BF16__
