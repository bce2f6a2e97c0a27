// Scaled dot-product attention, FlashAttention-2 style (Dao, 2023, arXiv:2307.08691): memory grows with L, not
// L * S. The forward walks key blocks with an online softmax and saves only out and logsumexp; the backward
// recomputes each block of weights from logsumexp.
#include "attention.hpp"

#include <algorithm>

#include <omp.h>

namespace attnpp {
namespace {

constexpr int64_t kBlockL = 64;   // query rows per block
constexpr int64_t kBlockS = 128;  // keys per block

int64_t num_blocks(int64_t n, int64_t b) { return (n + b - 1) / b; }

// scores (rows, cols) = scale * q_blk k_blk^T + masks, with -inf above the causal diagonal.
// Returns false when every score of the block is -inf (the block contributes nothing).
template <typename T>
bool score_block(RowMat<T>& scores, const MapRowsC<T>& q_blk, const MapRowsC<T>& k_blk, const AttnConfig<T>& cfg,
                 int64_t n, int64_t h, int64_t i0, int64_t j0) {
  const int64_t rows = q_blk.rows(), cols = k_blk.rows();
  scores.resize(rows, cols);
  scores.noalias() = q_blk * k_blk.transpose();
  scores *= cfg.scale;
  for (const auto& m : cfg.masks)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) scores(r, c) += m.at(n, h, i0 + r, j0 + c);
  bool any = cfg.masks.empty();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first_hidden = std::max<int64_t>(0, cfg.last_key(i0 + r) + 1 - j0);
    for (int64_t c = first_hidden; c < cols; ++c) scores(r, c) = neg_inf<T>();
    if (!any)
      for (int64_t c = 0; c < std::min(first_hidden, cols); ++c) any = any || scores(r, c) != neg_inf<T>();
  }
  return any;
}

// p_blk *= keep / (1 - p), the dropout of weights (n, h, i0.., j0..).
template <typename T>
void apply_dropout(RowMat<T>& p_blk, const AttnConfig<T>& cfg, int64_t n, int64_t h, int64_t i0, int64_t j0) {
  const T inv_keep = T(1) / T(1 - cfg.dropout_p);
  for (int64_t r = 0; r < p_blk.rows(); ++r) {
    const uint64_t row = ((uint64_t(n) * cfg.Hq + h) * cfg.L + i0 + r) * cfg.S + j0;
    for (int64_t c = 0; c < p_blk.cols(); ++c)
      p_blk(r, c) = dropout_keep(cfg.seed, row + c, cfg.dropout_p) ? p_blk(r, c) * inv_keep : T(0);
  }
}

// exp(row - shift), exactly 0 where row is -inf: Eigen's vectorized exp clamps its argument, so exp(-inf)
// would give a denormal (about 5e-309 in double) instead of 0.
template <typename Row, typename T>
auto masked_exp(const Row& row, T shift) {
  return (row.array() == neg_inf<T>()).select(T(0), (row.array() - shift).exp());
}

// p_blk = exp(scores - logsumexp) row by row; rows with logsumexp = -inf (fully masked) are 0.
template <typename T>
void probs_from_lse(RowMat<T>& p_blk, const T* lse) {
  for (int64_t r = 0; r < p_blk.rows(); ++r) {
    if (lse[r] == neg_inf<T>())
      p_blk.row(r).setZero();
    else
      p_blk.row(r) = masked_exp(p_blk.row(r), lse[r]);
  }
}

// Key blocks [0, end) a query block [i0, i0 + rows) can see under the causal mask.
template <typename T>
int64_t key_blocks_for(const AttnConfig<T>& cfg, int64_t i0, int64_t rows) {
  const int64_t last = cfg.last_key(i0 + rows - 1);
  return last < 0 ? 0 : num_blocks(last + 1, kBlockS);
}

template <typename T>
MapRowsC<T> rows_of(const View4<const T>& a, int64_t n, int64_t h, int64_t r0, int64_t rows, int64_t cols) {
  return MapRowsC<T>(a.at(n, h, r0), rows, cols, Eigen::OuterStride<>(a.row));
}
template <typename T>
MapRows<T> rows_of(const View4<T>& a, int64_t n, int64_t h, int64_t r0, int64_t rows, int64_t cols) {
  return MapRows<T>(a.at(n, h, r0), rows, cols, Eigen::OuterStride<>(a.row));
}

}  // namespace

template <typename T>
void sdpa_forward(const View4<T>& out, T* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const View4<const T>& v, const AttnConfig<T>& cfg) {
  const int64_t q_blocks = num_blocks(cfg.L, kBlockL);
#pragma omp parallel
  {
    RowMat<T> s_blk, acc;                       // (Br, Bc) scores then weights; (Br, Dv) running output
    Eigen::Matrix<T, Eigen::Dynamic, 1> m, l;   // (Br) running max and running sum
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t n = 0; n < cfg.N; ++n)
      for (int64_t h = 0; h < cfg.Hq; ++h)
        for (int64_t qb = 0; qb < q_blocks; ++qb) {
          const int64_t hk = h / cfg.group(), i0 = qb * kBlockL, rows = std::min(kBlockL, cfg.L - i0);
          const auto q_blk = rows_of(q, n, h, i0, rows, cfg.D);  // (Br, D)
          acc.setZero(rows, cfg.Dv);
          m.setConstant(rows, neg_inf<T>());
          l.setZero(rows);
          const int64_t k_blocks = key_blocks_for(cfg, i0, rows);
          for (int64_t kb = 0; kb < k_blocks; ++kb) {
            const int64_t j0 = kb * kBlockS, cols = std::min(kBlockS, cfg.S - j0);
            const auto k_blk = rows_of(k, n, hk, j0, cols, cfg.D);   // (Bc, D)
            const auto v_blk = rows_of(v, n, hk, j0, cols, cfg.Dv);  // (Bc, Dv)
            if (!score_block(s_blk, q_blk, k_blk, cfg, n, h, i0, j0)) continue;
            for (int64_t r = 0; r < rows; ++r) {
              const T m_new = std::max(m(r), s_blk.row(r).maxCoeff());
              if (m_new == neg_inf<T>()) {  // nothing visible yet in this row
                s_blk.row(r).setZero();
                continue;
              }
              const T alpha = std::exp(m(r) - m_new);  // rescales what was summed under the old max
              s_blk.row(r) = masked_exp(s_blk.row(r), m_new);
              l(r) = l(r) * alpha + s_blk.row(r).sum();
              acc.row(r) *= alpha;
              m(r) = m_new;
            }
            if (cfg.dropout_p > 0) apply_dropout(s_blk, cfg, n, h, i0, j0);
            acc.noalias() += s_blk * v_blk;
          }
          auto o_blk = rows_of(out, n, h, i0, rows, cfg.Dv);
          T* lse = logsumexp + (n * cfg.Hq + h) * cfg.L + i0;
          for (int64_t r = 0; r < rows; ++r) {
            if (l(r) > 0) {
              o_blk.row(r) = acc.row(r) / l(r);
              lse[r] = m(r) + std::log(l(r));
            } else {  // fully masked row: output 0, never NaN
              o_blk.row(r).setZero();
              lse[r] = neg_inf<T>();
            }
          }
        }
  }
}

template <typename T>
void sdpa_backward(const View4<T>& dq, const View4<T>& dk, const View4<T>& dv, const View4<const T>& dout,
                   const View4<const T>& out, const T* logsumexp, const View4<const T>& q,
                   const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg) {
  // delta (N, Hq, L) = rowsum(dout * out): the softmax backward's sum_j P_ij dP_ij, dropout included.
  // Summed in a fixed order (not Eigen's alignment-dependent reduction) so that results are reproducible.
  std::vector<T> delta(cfg.N * cfg.Hq * cfg.L);
#pragma omp parallel for collapse(2)
  for (int64_t n = 0; n < cfg.N; ++n)
    for (int64_t h = 0; h < cfg.Hq; ++h)
      for (int64_t i = 0; i < cfg.L; ++i) {
        const T *do_row = dout.at(n, h, i), *o_row = out.at(n, h, i);
        T sum = 0;
        for (int64_t c = 0; c < cfg.Dv; ++c) sum += do_row[c] * o_row[c];
        delta[(n * cfg.Hq + h) * cfg.L + i] = sum;
      }
  const int64_t k_blocks = num_blocks(cfg.S, kBlockS), q_blocks = num_blocks(cfg.L, kBlockL);
  // One thread owns a (n, key/value head) pair: it alone writes that pair's dk, dv and, since each query
  // head belongs to one key/value head, its query heads' dq.
#pragma omp parallel
  {
    RowMat<T> p_blk, dp_blk;  // (Br, Bc)
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t n = 0; n < cfg.N; ++n)
      for (int64_t hk = 0; hk < cfg.Hk; ++hk)
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          const int64_t j0 = kb * kBlockS, cols = std::min(kBlockS, cfg.S - j0);
          const auto k_blk = rows_of(k, n, hk, j0, cols, cfg.D);   // (Bc, D)
          const auto v_blk = rows_of(v, n, hk, j0, cols, cfg.Dv);  // (Bc, Dv)
          auto dk_blk = rows_of(dk, n, hk, j0, cols, cfg.D);
          auto dv_blk = rows_of(dv, n, hk, j0, cols, cfg.Dv);
          for (int64_t h = hk * cfg.group(); h < (hk + 1) * cfg.group(); ++h)
            for (int64_t qb = 0; qb < q_blocks; ++qb) {
              const int64_t i0 = qb * kBlockL, rows = std::min(kBlockL, cfg.L - i0);
              if (key_blocks_for(cfg, i0, rows) <= kb) continue;  // block wholly above the causal diagonal
              const auto q_blk = rows_of(q, n, h, i0, rows, cfg.D);
              const auto do_blk = rows_of(dout, n, h, i0, rows, cfg.Dv);
              auto dq_blk = rows_of(dq, n, h, i0, rows, cfg.D);
              const T* lse = logsumexp + (n * cfg.Hq + h) * cfg.L + i0;
              const T* dlt = delta.data() + (n * cfg.Hq + h) * cfg.L + i0;
              // s = scale * q k^T + mask;  p = exp(s - lse)
              if (!score_block(p_blk, q_blk, k_blk, cfg, n, h, i0, j0)) continue;
              probs_from_lse(p_blk, lse);
              // dp_dropped = dout v^T            <- out = p_dropped v
              dp_blk.noalias() = do_blk * v_blk.transpose();
              if (cfg.dropout_p > 0) {
                RowMat<T> pd_blk = p_blk;
                apply_dropout(pd_blk, cfg, n, h, i0, j0);
                dv_blk.noalias() += pd_blk.transpose() * do_blk;  // dv += p_dropped^T dout
                apply_dropout(dp_blk, cfg, n, h, i0, j0);         // dp = dp_dropped * keep / (1 - p)
              } else {
                dv_blk.noalias() += p_blk.transpose() * do_blk;   // dv += p^T dout
              }
              // ds = p * (dp - delta)            <- p = softmax(s)
              for (int64_t r = 0; r < rows; ++r)
                p_blk.row(r).array() *= dp_blk.row(r).array() - dlt[r];
              // dq += scale * ds k;  dk += scale * ds^T q   <- s = scale * q k^T
              dq_blk.noalias() += cfg.scale * (p_blk * k_blk);
              dk_blk.noalias() += cfg.scale * (p_blk.transpose() * q_blk);
            }
        }
  }
}

template <typename T>
void sdpa_weights(T* weights, const T* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const AttnConfig<T>& cfg) {
  const int64_t q_blocks = num_blocks(cfg.L, kBlockL);
  const View4<T> w{weights, cfg.Hq * cfg.L * cfg.S, cfg.L * cfg.S, cfg.S};
#pragma omp parallel
  {
    RowMat<T> p_blk;
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t n = 0; n < cfg.N; ++n)
      for (int64_t h = 0; h < cfg.Hq; ++h)
        for (int64_t qb = 0; qb < q_blocks; ++qb) {
          const int64_t i0 = qb * kBlockL, rows = std::min(kBlockL, cfg.L - i0);
          const auto q_blk = rows_of(q, n, h, i0, rows, cfg.D);
          const auto k_all = rows_of(k, n, h / cfg.group(), 0, cfg.S, cfg.D);
          score_block(p_blk, q_blk, k_all, cfg, n, h, i0, 0);
          probs_from_lse(p_blk, logsumexp + (n * cfg.Hq + h) * cfg.L + i0);
          if (cfg.dropout_p > 0) apply_dropout(p_blk, cfg, n, h, i0, 0);
          rows_of(w, n, h, i0, rows, cfg.S) = p_blk;
        }
  }
}

#define ATTNPP_INSTANTIATE(T)                                                                                  \
  template void sdpa_forward<T>(const View4<T>&, T*, const View4<const T>&, const View4<const T>&,            \
                                const View4<const T>&, const AttnConfig<T>&);                                 \
  template void sdpa_backward<T>(const View4<T>&, const View4<T>&, const View4<T>&, const View4<const T>&,    \
                                 const View4<const T>&, const T*, const View4<const T>&,                      \
                                 const View4<const T>&, const View4<const T>&, const AttnConfig<T>&);         \
  template void sdpa_weights<T>(T*, const T*, const View4<const T>&, const View4<const T>&,                   \
                                const AttnConfig<T>&);
ATTNPP_INSTANTIATE(float)
ATTNPP_INSTANTIATE(double)

}  // namespace attnpp
