// Scaled dot-product attention, FlashAttention-2 style (Dao, 2023, arXiv:2307.08691): memory grows with L, not
// L * S. The forward walks key blocks with an online softmax and saves only out and logsumexp; the backward
// recomputes each block of weights from logsumexp. Every product is a `gemm` on blocks that stay in cache, its B
// operand (a block of K^T, V, V^T, K, Q or dO) packed in a per-thread buffer first (gemm.hpp): the temporaries
// are a few blocks per thread, whatever L and S.
#include "attention.hpp"

#include <algorithm>

#include "gemm.hpp"
#include "vector_exp.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

constexpr int64_t kBlockL = 64;     // query rows per block of the backward
// Query rows per task of the forward and the weights: each task packs every key block it sees, so that copy is
// amortized over this many rows (64 rows: 15% of the forward's time at AVX2; 256, as PyTorch's CPU flash
// attention for long sequences: 4%).
constexpr int64_t kForwardL = 256;

// Keys per block: 256 halves the forward's per-block work outside the products (rescaling the accumulated rows,
// packing) against 128 (sdpa fwd (1,12,1024,64) against PyTorch at AVX2: 0.96 -> 1.01); 128 under the causal
// mask, whose blocks on the diagonal compute their hidden part too.
template <typename T>
int64_t key_block(const AttnConfig<T>& cfg) {
  return cfg.causal == Causal::none ? 256 : 128;
}

// Packs rows [r0, r0 + rows) of head (n, h) of a (rows, cols), or their transpose (cols, rows).
template <typename T>
void pack_block(PackedB<T>& b, const View4<const T>& a, int64_t n, int64_t h, int64_t r0, int64_t rows,
                int64_t cols, bool transposed) {
  if (transposed)
    b.pack(a.at(n, h, r0), 1, a.row, cols, rows);
  else
    b.pack(a.at(n, h, r0), a.row, 1, rows, cols);
}

// scores (rows, cols) = scale * q_blk k_blk^T + masks, with -inf above the causal diagonal; q_blk (rows, D) with
// row stride ldq, kt = k_blk^T (D, >= cols) of the key block starting at j0, packed. Returns false when every
// score is -inf.
template <typename T>
bool score_block(RowMat<T>& scores, const T* q_blk, int64_t ldq, const PackedB<T>& kt, int64_t rows, int64_t cols,
                 const AttnConfig<T>& cfg, int64_t n, int64_t h, int64_t i0, int64_t j0) {
  scores.resize(rows, cols);
  gemm(scores.data(), cols, q_blk, ldq, int64_t(1), kt, rows, cols, cfg.D, cfg.scale, false);
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

// row = exp(row - shift), exactly 0 where row is -inf; returns the row's sum. One pass over Eigen's packets (the
// exp of -inf would be a tiny number instead of 0: the select fixes that). The sum is in a fixed order: one
// partial sum per lane.
template <typename T>
T exp_shifted(T* row, int64_t n, T shift) {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int64_t W = ei::unpacket_traits<P>::size;
  const P vshift = ei::pset1<P>(shift), vninf = ei::pset1<P>(neg_inf<T>()), zero = ei::pset1<P>(T(0));
  P vsum = zero;
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    const P x = ei::ploadu<P>(row + c);
    const P e = ei::pselect(ei::pcmp_eq(x, vninf), zero, exp_nonpositive(ei::psub(x, vshift)));
    ei::pstoreu(row + c, e);
    vsum = ei::padd(vsum, e);
  }
  T sum = ei::predux(vsum);
  for (; c < n; ++c) {
    row[c] = row[c] == neg_inf<T>() ? T(0) : std::exp(row[c] - shift);
    sum += row[c];
  }
  return sum;
}

// p_blk = exp(scores - logsumexp) row by row; rows with logsumexp = -inf (fully masked) are 0.
template <typename T>
void probs_from_lse(RowMat<T>& p_blk, const T* lse) {
  for (int64_t r = 0; r < p_blk.rows(); ++r) {
    if (lse[r] == neg_inf<T>())
      p_blk.row(r).setZero();
    else
      exp_shifted(&p_blk(r, 0), p_blk.cols(), lse[r]);
  }
}

// Width of key block [j0, ..) seen by query rows [i0, i0 + rows): the block cut at the causal diagonal, so that
// the blocks on the diagonal compute no more columns than their last row can see.
template <typename T>
int64_t visible_cols(const AttnConfig<T>& cfg, int64_t i0, int64_t rows, int64_t j0) {
  return std::min(std::min(key_block(cfg), cfg.S - j0), cfg.last_key(i0 + rows - 1) + 1 - j0);
}

// Key blocks [0, end) a query block [i0, i0 + rows) can see under the causal mask.
template <typename T>
int64_t key_blocks_for(const AttnConfig<T>& cfg, int64_t i0, int64_t rows) {
  const int64_t last = cfg.last_key(i0 + rows - 1);
  return last < 0 ? 0 : ceil_div(last + 1, key_block(cfg));
}

}  // namespace

template <typename T>
void sdpa_forward(const View4<T>& out, T* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const View4<const T>& v, const AttnConfig<T>& cfg) {
  const int64_t q_blocks = ceil_div(cfg.L, kForwardL), bs = key_block(cfg);  // bs: keys per block
  parallel_for(
      cfg.N * cfg.Hq * q_blocks, cfg.work(),
      [&](int64_t task) {
        const int64_t n = task / (cfg.Hq * q_blocks), h = task / q_blocks % cfg.Hq, qb = task % q_blocks;
        thread_local PackedB<T> kt, vb;        // (D, Bc) k_blk^T, (Bc, Dv) v_blk
        thread_local RowMat<T> s_blk, acc;      // (Br, Bc) scores then weights; (Br, Dv) output
        thread_local Eigen::Matrix<T, Eigen::Dynamic, 1> m, l;  // (Br) running max and running sum
        const int64_t hk = h / cfg.group(), i0 = qb * kForwardL, rows = std::min(kForwardL, cfg.L - i0);
        acc.setZero(rows, cfg.Dv);
        m.setConstant(rows, neg_inf<T>());
        l.setZero(rows);
        const int64_t k_blocks = key_blocks_for(cfg, i0, rows);
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          // rows [r0, rows) see keys of this block: the causal mask hides it from the rows before r0
          const int64_t j0 = kb * bs, cols = visible_cols(cfg, i0, rows, j0);
          const int64_t r0 = std::clamp<int64_t>(cfg.first_query(j0) - i0, 0, rows), br = rows - r0;
          pack_block(kt, k, n, hk, j0, cols, cfg.D, true);
          if (!score_block(s_blk, q.at(n, h, i0 + r0), q.row, kt, br, cols, cfg, n, h, i0 + r0, j0)) continue;
          for (int64_t r = 0; r < br; ++r) {
            // the new running max; NaN once a score is NaN, so that the row comes out NaN as in PyTorch
            const T blk_max = s_blk.row(r).template maxCoeff<Eigen::PropagateNaN>();
            const T m_old = m(r0 + r), m_new = std::isnan(blk_max) || blk_max > m_old ? blk_max : m_old;
            if (m_new == neg_inf<T>()) {  // nothing visible yet in this row
              s_blk.row(r).setZero();
              continue;
            }
            const T alpha = std::exp(m_old - m_new);  // rescales what was summed under the old max
            l(r0 + r) = l(r0 + r) * alpha + exp_shifted(&s_blk(r, 0), cols, m_new);
            acc.row(r0 + r) *= alpha;
            m(r0 + r) = m_new;
          }
          if (cfg.dropout_p > 0) apply_dropout(s_blk, cfg, n, h, i0 + r0, j0);
          // acc += p v_blk
          pack_block(vb, v, n, hk, j0, cols, cfg.Dv, false);
          gemm(acc.data() + r0 * cfg.Dv, cfg.Dv, s_blk.data(), cols, int64_t(1), vb, br, cfg.Dv, cols, T(1),
               true);
        }
        auto o_blk = MapRows<T>(out.at(n, h, i0), rows, cfg.Dv, Eigen::OuterStride<>(out.row));
        T* lse = logsumexp + (n * cfg.Hq + h) * cfg.L + i0;
        for (int64_t r = 0; r < rows; ++r) {
          if (l(r) == 0) {  // fully masked row: output 0, never NaN
            o_blk.row(r).setZero();
            lse[r] = neg_inf<T>();
          } else {  // (NaN in the row's scores makes l NaN: the row's output is NaN)
            o_blk.row(r) = acc.row(r) / l(r);
            lse[r] = m(r) + std::log(l(r));
          }
        }
      },
      true);
}

template <typename T>
void sdpa_backward(const View4<T>& dq, const View4<T>& dk, const View4<T>& dv, const View4<const T>& dout,
                   const View4<const T>& out, const T* logsumexp, const View4<const T>& q,
                   const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg) {
  // delta (N, Hq, L) = rowsum(dout * out): the softmax backward's sum_j P_ij dP_ij, dropout included.
  // Summed in a fixed order (not Eigen's alignment-dependent reduction) so that results are reproducible.
  std::vector<T> delta(cfg.N * cfg.Hq * cfg.L);
  parallel_for(cfg.N * cfg.Hq, cfg.N * cfg.Hq * cfg.L * cfg.Dv, [&](int64_t nh) {
    const int64_t n = nh / cfg.Hq, h = nh % cfg.Hq;
    for (int64_t i = 0; i < cfg.L; ++i) {
      const T *do_row = dout.at(n, h, i), *o_row = out.at(n, h, i);
      T sum = 0;
      for (int64_t c = 0; c < cfg.Dv; ++c) sum += do_row[c] * o_row[c];
      delta[nh * cfg.L + i] = sum;
    }
  });
  const int64_t bs = key_block(cfg), k_blocks = ceil_div(cfg.S, bs), q_blocks = ceil_div(cfg.L, kBlockL);
  // One thread owns a (n, key/value head) pair: it alone writes that pair's dk, dv and, since each query
  // head belongs to one key/value head, its query heads' dq.
  parallel_for(
      cfg.N * cfg.Hk, cfg.work(),
      [&](int64_t task) {
        const int64_t n = task / cfg.Hk, hk = task % cfg.Hk;
        thread_local PackedB<T> kt, vt, kp, qp, dop;  // k_blk^T, v_blk^T, k_blk; q_blk, dout_blk
        thread_local RowMat<T> p_blk, dp_blk, pd_blk;   // (Br, Bc)
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          const int64_t j0 = kb * bs, width = std::min(bs, cfg.S - j0);
          pack_block(kt, k, n, hk, j0, width, cfg.D, true);
          pack_block(vt, v, n, hk, j0, width, cfg.Dv, true);
          pack_block(kp, k, n, hk, j0, width, cfg.D, false);
          for (int64_t h = hk * cfg.group(); h < (hk + 1) * cfg.group(); ++h)
            for (int64_t qb = 0; qb < q_blocks; ++qb) {
              const int64_t i0 = qb * kBlockL, rows = std::min(kBlockL, cfg.L - i0);
              if (key_blocks_for(cfg, i0, rows) <= kb) continue;  // block wholly above the causal diagonal
              const int64_t cols = visible_cols(cfg, i0, rows, j0);
              const T* q_blk = q.at(n, h, i0);
              const T* do_blk = dout.at(n, h, i0);
              const T* lse = logsumexp + (n * cfg.Hq + h) * cfg.L + i0;
              const T* dlt = delta.data() + (n * cfg.Hq + h) * cfg.L + i0;
              // s = scale * q k^T + mask;  p = exp(s - lse)
              if (!score_block(p_blk, q_blk, q.row, kt, rows, cols, cfg, n, h, i0, j0)) continue;
              probs_from_lse(p_blk, lse);
              // dp_dropped = dout v^T            <- out = p_dropped v
              dp_blk.resize(rows, cols);
              gemm(dp_blk.data(), cols, do_blk, dout.row, int64_t(1), vt, rows, cols, cfg.Dv, T(1), false);
              const RowMat<T>* p_used = &p_blk;  // the weights that multiplied v in the forward
              if (cfg.dropout_p > 0) {
                pd_blk = p_blk;
                apply_dropout(pd_blk, cfg, n, h, i0, j0);
                apply_dropout(dp_blk, cfg, n, h, i0, j0);  // dp = dp_dropped * keep / (1 - p)
                p_used = &pd_blk;
              }
              // dv += p_used^T dout
              pack_block(dop, dout, n, h, i0, rows, cfg.Dv, false);
              gemm(dv.at(n, hk, j0), dv.row, p_used->data(), int64_t(1), cols, dop, cols, cfg.Dv, rows, T(1), true);
              // ds = p * (dp - delta)            <- p = softmax(s)
              for (int64_t r = 0; r < rows; ++r) p_blk.row(r).array() *= dp_blk.row(r).array() - dlt[r];
              // dq += scale * ds k;  dk += scale * ds^T q   <- s = scale * q k^T
              gemm(dq.at(n, h, i0), dq.row, p_blk.data(), cols, int64_t(1), kp, rows, cfg.D, cols, cfg.scale, true);
              pack_block(qp, q, n, h, i0, rows, cfg.D, false);
              gemm(dk.at(n, hk, j0), dk.row, p_blk.data(), int64_t(1), cols, qp, cols, cfg.D, rows, cfg.scale, true);
            }
        }
      },
      true);
}

template <typename T>
void sdpa_weights(T* weights, const T* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const AttnConfig<T>& cfg, bool average_heads) {
  const int64_t bs = key_block(cfg), q_blocks = ceil_div(cfg.L, kForwardL), k_blocks = ceil_div(cfg.S, bs);
  const int64_t heads_out = average_heads ? 1 : cfg.Hq;
  parallel_for(
      cfg.N * heads_out * q_blocks, cfg.work(),
      [&](int64_t task) {
        const int64_t n = task / (heads_out * q_blocks), ho = task / q_blocks % heads_out, qb = task % q_blocks;
        thread_local PackedB<T> kt;     // (D, Bc) k_blk^T
        thread_local RowMat<T> p_blk;   // (Br, Bc) weights
        const int64_t i0 = qb * kForwardL, rows = std::min(kForwardL, cfg.L - i0);
        // one head, or all of them summed in order (then divided by Hq, as PyTorch's mean over heads)
        const int64_t h_begin = average_heads ? 0 : ho, h_end = average_heads ? cfg.Hq : ho + 1;
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          const int64_t j0 = kb * bs, cols = std::min(bs, cfg.S - j0);
          auto w = MapRows<T>(weights + ((n * heads_out + ho) * cfg.L + i0) * cfg.S + j0, rows, cols,
                              Eigen::OuterStride<>(cfg.S));
          for (int64_t h = h_begin; h < h_end; ++h) {
            pack_block(kt, k, n, h / cfg.group(), j0, cols, cfg.D, true);
            score_block(p_blk, q.at(n, h, i0), q.row, kt, rows, cols, cfg, n, h, i0, j0);
            probs_from_lse(p_blk, logsumexp + (n * cfg.Hq + h) * cfg.L + i0);
            if (cfg.dropout_p > 0) apply_dropout(p_blk, cfg, n, h, i0, j0);
            if (h == h_begin)
              w = p_blk;
            else
              w += p_blk;
          }
          if (h_begin == h_end)  // the mean over no heads (Hq = 0), NaN as in PyTorch
            w.setConstant(std::numeric_limits<T>::quiet_NaN());
          else if (average_heads)
            w /= T(cfg.Hq);
        }
      },
      true);
}

#define ATTNPP_INSTANTIATE(T)                                                                                  \
  template void sdpa_forward<T>(const View4<T>&, T*, const View4<const T>&, const View4<const T>&,            \
                                const View4<const T>&, const AttnConfig<T>&);                                 \
  template void sdpa_backward<T>(const View4<T>&, const View4<T>&, const View4<T>&, const View4<const T>&,    \
                                 const View4<const T>&, const T*, const View4<const T>&,                      \
                                 const View4<const T>&, const View4<const T>&, const AttnConfig<T>&);         \
  template void sdpa_weights<T>(T*, const T*, const View4<const T>&, const View4<const T>&,                   \
                                const AttnConfig<T>&, bool);
ATTNPP_INSTANTIATE(float)
ATTNPP_INSTANTIATE(double)

}  // namespace attnpp::ATTNPP_CPU_NS
