// The fused linear + cross-entropy: cross_entropy(x w^T + b, target) over chunks of rows, never holding the
// (N, V) logits (Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024; Liger Kernel's
// fused linear cross-entropy). A chunk's logits (rows x V, at most kLogitsBytes) are computed once, turned into
// their losses and, when the gradient's row weights are known, into the logits' gradient in place, which then
// feeds the two gradient products: the three products of the unfused pair, no more. The input gradient's product,
// whose B operand is the weight, goes a block of the vocabulary at a time (gemm_parallel packs its B operand
// whole: a block of the weight, at most kPackBytes, not all of it), so that memory stays one chunk of logits and
// one such block. With soft-capping (Gemma 2's final logits) the losses are those of y = c tanh(z / c), and the
// logits' gradient takes the cap's derivative, 1 - (y / c)^2.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "gemm.hpp"
#include "linear.hpp"
#include "row_softmax.hpp"
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

// One chunk's logits: 256 rows at V = 50,257 in float. Larger chunks read the weight and add into its gradient
// fewer times. Forward with gradients at N = 4,096, E = 768 (medians of 4, one process): chunks of 192 rows 5.31 s,
// 256 rows 5.05 s (blocks of 4 MiB below).
constexpr int64_t kLogitsBytes = int64_t(50) << 20;
// The block of the weight the input gradient's product packs at a time: smaller blocks stay in the L3 cache
// until the product reads them (at 256 rows: 12 MiB 5.27 s, 4 MiB 5.05 s).
constexpr int64_t kPackBytes = int64_t(4) << 20;

// A row's loss, lse - (1 - eps) z_t - eps mean_j z_j, from its max m, log_sum = log sum_j exp(z_j - m), the
// target's logit and the sum of the logits (for the smoothing), as log_sum + (1 - eps)(m - z_t) + eps (m - mean z):
// non-negative terms, none lost next to m. 0 for an ignored row.
template <typename C>
C row_loss(bool ignored, C m, double log_sum, C z_target, double z_sum, C eps, int64_t V) {
  if (ignored) return C(0);
  double loss = log_sum + (1 - double(eps)) * double(m - z_target);
  if (eps > 0) loss += double(eps) * (double(m) - z_sum / double(V));
  return C(loss);
}

// The logits' gradient at the target, w_i (p_t - 1 + eps - eps / V), p_t - 1 taken as expm1(z_t - lse): exact even
// when p_t is within an ulp of 1.
template <typename C>
C target_gradient(C wi, C z_target, C lse, C eps, C smooth) {
  return wi * (std::expm1(z_target - lse) + (eps - smooth));
}

// Logit soft-capping in place, y = c tanh(z / c) over n logits (Eigen's vectorized tanh); c = 0: no cap.
template <typename C>
void soft_cap(C* z, int64_t n, C c) {
  if (c > 0) {
    Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>> a(z, n);
    a = (a / c).tanh() * c;
  }
}

// The cap's derivative at a capped logit y, dy/dz = 1 - (y / c)^2; 1 without a cap.
template <typename C>
C cap_slope(C y, C c) {
  return c > 0 ? C(1) - (y / c) * (y / c) : C(1);
}

// Vocabulary rows per block of fused's statistics and gradient passes: a block of the chunk's logits (these rows
// by the chunk's) stays in the L2 cache from one pass to the next.
constexpr int64_t kStatRows = 128;

// In the compute type C (float or double): see linear_cross_entropy in training.hpp. A chunk's logits are held
// transposed, zt (V, R) with row stride ld (R rounded up to whole vectors): the first product, zt = w x^T, then
// reads the weight in place (z = x w^T read it as a transposed operand, which gemm packs: a transposing copy of
// all of w per chunk), the weight gradient dw += zt x reads zt's rows in place, and the softmax runs across the
// chunk's rows, a vector of rows per instruction: per block of kStatRows vocabulary rows each row's max m_b and
// sum_b = sum exp(z - m_b) (in double), then per row m = max_b m_b and sum = sum_b sum_b exp(m_b - m), then per
// block dz = w_i (exp(z - m_b) exp(m_b - m) / sum - eps / V) (and the target's). One exp per logit; every sum in a
// fixed order, whatever the thread count.
template <typename C>
void fused(C* losses, C* logsumexp, C* dx, C* dw, C* db, const C* row_weight, const C* x, const C* w, const C* b,
           const int64_t* target, int64_t N, int64_t E, int64_t V, int64_t ignore_index, C eps, C cap) {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<C>::type;
  constexpr int64_t W = ei::unpacket_traits<P>::size;
  // rows per chunk (<= its ld): whole panels of the products' widest tile where they fit (at AVX-512, 160 rows
  // left a last panel of 32 to a tile of half the width: 5% of the time)
  constexpr int64_t kPanel = PackedB<C>::kPanel;
  const int64_t fit = kLogitsBytes / (V * int64_t(sizeof(C)));
  const int64_t rows = std::min(fit >= kPanel ? fit / kPanel * kPanel : std::max<int64_t>(W, fit / W * W),
                                ceil_div(std::max<int64_t>(N, 1), W) * W);
  // (zeroed once: the columns past a chunk's R hold finite values, unused)
  const std::unique_ptr<C[]> zt(new C[std::size_t(V * rows)]());
  const C smooth = eps / C(V);  // each class's share of the smoothing
  // vocabulary rows per block of the input gradient's product: 1,365 at E = 768 in float
  const int64_t block = std::max<int64_t>(1, kPackBytes / (std::max<int64_t>(E, 1) * int64_t(sizeof(C))));
  const int64_t blocks = ceil_div(V, kStatRows);
  // per (block, row): m_b, sum_b, and the block's sum of logits (label smoothing); per row: its figures
  const std::size_t cells = std::size_t(blocks * rows), row_count = std::size_t(rows);
  std::vector<C> block_max(cells), weight(row_count), offset(row_count), z_target(row_count), row_max(row_count),
      lse(row_count);
  std::vector<double> block_sum(cells), block_zsum(eps > 0 ? cells : 0), sum(row_count);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t R = std::min(rows, N - r0), ld = ceil_div(R, W) * W;
    const C* xc = x + r0 * E;
    for (int64_t r = 0; r < ld; ++r) {
      const bool ignored = r >= R || target[r0 + r] == ignore_index;
      weight[r] = row_weight && !ignored ? row_weight[r0 + r] : C(0);
      z_target[r] = C(0);
      offset[r] = weight[r] * smooth;  // (dz's smoothing term, the same in every block)
    }
    gemm_parallel(zt.get(), ld, row_major(w, E), transposed(xc, E), V, R, E, C(1), Write::assign);  // zt = w x^T
    // (1) per block: the bias, each row's target logit, max m_b, sum_b and sum of logits (terms kept for dz)
    parallel_for(blocks, V * ld * 24, [&](int64_t bl) {
      const int64_t v0 = bl * kStatRows, v1 = std::min(V, v0 + kStatRows);
      C* m = block_max.data() + bl * ld;
      double* s = block_sum.data() + bl * ld;
      double* zs = block_zsum.empty() ? nullptr : block_zsum.data() + bl * ld;
      std::fill(m, m + ld, neg_inf<C>());
      std::fill(s, s + ld, 0.0);
      if (zs) std::fill(zs, zs + ld, 0.0);
      for (int64_t v = v0; v < v1; ++v) {
        C* z = zt.get() + v * ld;
        if (b)
          for (int64_t r = 0; r < ld; ++r) z[r] += b[v];
        soft_cap(z, ld, cap);
        for (int64_t r = 0; r < ld; ++r) m[r] = std::max(m[r], z[r]);
        if (zs)
          for (int64_t r = 0; r < ld; ++r) zs[r] += double(z[r]);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = target[r0 + r];
        if (t != ignore_index && t >= v0 && t < v1) z_target[r] = zt[t * ld + r];
      }
      const bool keep = row_weight != nullptr && !(cap > 0);  // (capped: (3) needs the logits, not their terms)
      for (int64_t v = v0; v < v1; ++v) {
        C* z = zt.get() + v * ld;
        C* e = keep ? z : nullptr;
        for (int64_t r = 0; r < ld; r += W) {
          const P terms = exp_nonpositive(ei::psub(ei::ploadu<P>(z + r), ei::ploadu<P>(m + r)));
          alignas(64) C lanes[W];
          ei::pstore(lanes, terms);
          for (int64_t l = 0; l < W; ++l) s[r + l] += double(lanes[l]);
          if (e) ei::pstoreu(e + r, terms);
        }
      }
    });
    // (2) per row: m, sum, the log-sum-exp and the loss, the blocks' figures taken in order
    parallel_for(R, R * blocks * 16, [&](int64_t r) {
      C m = block_max[r];
      for (int64_t bl = 1; bl < blocks; ++bl) m = std::max(m, block_max[bl * ld + r]);
      double total = 0, z_sum = 0;
      for (int64_t bl = 0; bl < blocks; ++bl) {
        total += block_sum[bl * ld + r] * std::exp(double(block_max[bl * ld + r] - m));
        if (eps > 0) z_sum += block_zsum[bl * ld + r];
      }
      const double log_sum = std::log(total);
      row_max[r] = m, sum[r] = total, lse[r] = C(double(m) + log_sum);
      if (losses) {
        const int64_t i = r0 + r;
        logsumexp[i] = lse[r];
        losses[i] = row_loss(target[i] == ignore_index, m, log_sum, z_target[r], z_sum, eps, V);
      }
    });
    if (!row_weight) continue;
    // (3) per block: dz_j = w_i (softmax(z)_j - eps / V - (1 - eps) [j = t]), softmax(z)_j = exp(z_j - m_b)
    // exp(m_b - m) / sum   <- loss_i = -sum_j q_j log softmax(z)_j; and db += its sums over the rows
    parallel_for(blocks, V * ld * 4, [&](int64_t bl) {
      const int64_t v0 = bl * kStatRows, v1 = std::min(V, v0 + kStatRows);
      thread_local std::vector<C> factor;
      factor.resize(std::size_t(ld));
      for (int64_t r = 0; r < ld; ++r)
        factor[r] = weight[r] != C(0) ? C(weight[r] * std::exp(double(block_max[bl * ld + r] - row_max[r])) / sum[r])
                                      : C(0);
      if (cap > 0) {  // z holds the capped logits y: dz = (exp(y - m_b) factor - offset) (1 - (y / c)^2)
        const C* m = block_max.data() + bl * ld;
        for (int64_t v = v0; v < v1; ++v) {
          C* z = zt.get() + v * ld;
          for (int64_t r = 0; r < ld; r += W) {
            const P y = ei::ploadu<P>(z + r), e = exp_nonpositive(ei::psub(y, ei::ploadu<P>(m + r)));
            const P u = ei::pdiv(y, ei::pset1<P>(cap));
            const P dy = ei::psub(ei::pmul(e, ei::ploadu<P>(factor.data() + r)), ei::ploadu<P>(offset.data() + r));
            ei::pstoreu(z + r, ei::pmul(dy, ei::psub(ei::pset1<P>(C(1)), ei::pmul(u, u))));
          }
          for (int64_t r = 0; r < ld; ++r)
            if (weight[r] == C(0)) z[r] = C(0);
        }
      } else {
        for (int64_t v = v0; v < v1; ++v) {
          C* z = zt.get() + v * ld;
          for (int64_t r = 0; r < ld; ++r) z[r] = weight[r] != C(0) ? z[r] * factor[r] - offset[r] : C(0);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = target[r0 + r];
        if (weight[r] != C(0) && t >= v0 && t < v1)
          zt[t * ld + r] = target_gradient(weight[r], z_target[r], lse[r], eps, smooth) * cap_slope(z_target[r], cap);
      }
      if (db)
        for (int64_t v = v0; v < v1; ++v) {
          const C* z = zt.get() + v * ld;
          C total = 0;
          for (int64_t r = 0; r < R; ++r) total += z[r];
          db[v] += total;
        }
    });
    // dw += dz^T x; dx += dz w   <- z = x w^T + b
    gemm_parallel(dw, E, row_major(zt.get(), ld), row_major(xc, E), V, E, R, C(1), Write::accumulate);
    if (dx)
      for (int64_t v0 = 0; v0 < V; v0 += block)
        gemm_parallel(dx + r0 * E, E, transposed(zt.get() + v0 * ld, ld), row_major(w + v0 * E, E), R, E,
                      std::min(block, V - v0), C(1), Write::accumulate);
  }
}

// The same for a narrow E (fewer than one vector: article 001's 5-wide model), where the products are cheap and
// the logits' round trips through memory were the cost (the (30, 50,257) logits written, then read by the row
// softmax, the weight gradient and the input gradient: ~40 MB a step). Here each block of the vocabulary (all the
// chunk's rows, kVocabBlock columns: in the L2 cache) is taken through the whole pipeline while it is hot, in
// three phases: (1) per block, in parallel: its logits, and for each row its max m_b and sum_b = sum exp(z - m_b)
// (the terms kept in place); (2) per row: m = max_b m_b, sum = sum_b sum_b exp(m_b - m), the log-sum-exp and the
// loss; (3) per block, in parallel: dz = w_i (exp(z - m_b) exp(m_b - m) / sum - eps / V) (and the target's), then
// the block's rows of dw and db, and its share of dx (summed over the blocks in order afterwards). One exp per
// logit; every sum in a fixed order, whatever the thread count.
constexpr int64_t kVocabBlock = 1024;  // vocabulary columns per block
// a block's row stride: not 4 KiB (1024 floats), whose rows' loads and stores alias in the L1 cache (the block's
// product ran at a third of its rate)
constexpr int64_t kBlockStride = kVocabBlock + 16;
constexpr int64_t kNarrowRows = 128;   // rows per chunk (a block's logits: at most 512 KiB in float)

// out[f] = sum_j z[j] w^T(f, j0 + j) for f < E (fewer than one vector) and j < width, w^T's columns from a whole
// number of its packed panels (PackedB): one pass over z and the panels, one vector accumulator per row of w^T
// (E a template argument, so that they stay in registers), summed in a fixed order. Against E dot products (one
// per row of w^T, z read E times): 1 + E loads for E multiply-adds instead of 2 E.
template <typename C, int E>
void times_wt_rows(C* out, const C* z, const PackedB<C>& wt, int64_t j0, int64_t width) {
  using namespace gemm_detail;
  using Vc = typename Vec<C>::type;
  constexpr int W = Vec<C>::width;
  static_assert(E < W);
  Vc acc[W] = {};  // (rows E.. stay 0 for lane_sums)
  C tail[E] = {};
  for (int64_t j = 0; j < width; j += wt.kPanel) {
    const int64_t pw = wt.width(j0 + j);
    const C* p = wt.panel(j0 + j);
    int64_t u = 0;
    for (; u + W <= pw; u += W) {
      const Vc zv = load_vector<C>(z + j + u);
      ATTNPP_UNROLL for (int f = 0; f < E; ++f) acc[f] += zv * load_vector<C>(p + f * pw + u);
    }
    for (; u < pw; ++u)
      for (int f = 0; f < E; ++f) tail[f] += z[j + u] * p[f * pw + u];
  }
  const Vc sums = lane_sums<C>(acc);
  for (int f = 0; f < E; ++f) out[f] = sums[f] + tail[f];
}

// Runtime E in [1, Vec<C>::width) -> times_wt_rows<C, E>.
template <typename C, int E = gemm_detail::Vec<C>::width - 1>
void times_wt_rows(C* out, const C* z, const PackedB<C>& wt, int64_t j0, int64_t width, int64_t e) {
  if constexpr (E > 0) {
    if (e == E)
      times_wt_rows<C, E>(out, z, wt, j0, width);
    else
      times_wt_rows<C, E - 1>(out, z, wt, j0, width, e);
  }
}

template <typename C>
void fused_narrow(C* losses, C* logsumexp, C* dx, C* dw, C* db, const C* row_weight, const C* x, const C* w,
                  const C* b, const int64_t* target, int64_t N, int64_t E, int64_t V, int64_t ignore_index, C eps,
                  C cap) {
  const int64_t blocks = ceil_div(V, kVocabBlock);
  const C smooth = eps / C(V);
  PackedB<C> wt;  // w^T (E, V), packed by the blocks of (1) in the first chunk
  wt.resize(E, V);
  for (int64_t r0 = 0; r0 < N; r0 += kNarrowRows) {
    const int64_t R = std::min(kNarrowRows, N - r0);
    const C* xc = x + r0 * E;
    // block bl's logits: R rows of its width, from z + bl * R * kBlockStride, row stride kBlockStride
    // (from the pool: 6 MB at article 001's N = 30, whose fresh pages cost more than the products writing them)
    const PoolArray<C> z = pool_array<C>(std::size_t(blocks * R * kBlockStride));
    const std::size_t cells = std::size_t(blocks * R), rows = std::size_t(R);  // (block, row) figures; row figures
    std::vector<C> block_max(cells), z_target(rows), weight(rows);
    std::vector<double> block_sum(cells), block_zsum(eps > 0 ? cells : 0);
    for (int64_t r = 0; r < R; ++r) {
      const bool ignored = target[r0 + r] == ignore_index;
      weight[r] = row_weight && !ignored ? row_weight[r0 + r] : C(0);
    }
    const auto block_of = [&](int64_t bl, int64_t& j0, int64_t& width) {
      j0 = bl * kVocabBlock, width = std::min(kVocabBlock, V - j0);
      return z.get() + bl * R * kBlockStride;
    };
    // (1) the logits z = x w^T + b, each row's max and sum of exponentials, per block
    parallel_for(
        blocks, R * V * (E + 8),
        [&](int64_t bl) {
          int64_t j0, width;
          C* zb = block_of(bl, j0, width);
          if (r0 == 0)  // the block's panels of w^T (for every chunk, and for dx's products in (3))
            for (int64_t j = j0; j < j0 + width; j += wt.kPanel) wt.pack_panel(w, 1, E, j);
          gemm(zb, kBlockStride, row_major(xc, E), wt, R, width, E, C(1), Write::assign, 0, j0);
          for (int64_t r = 0; r < R; ++r) {
            C* zr = zb + r * kBlockStride;
            if (b)
              for (int64_t j = 0; j < width; ++j) zr[j] += b[j0 + j];
            soft_cap(zr, width, cap);
            const int64_t t = target[r0 + r] - j0;
            if (t >= 0 && t < width && target[r0 + r] != ignore_index) z_target[r] = zr[t];
            if (!block_zsum.empty()) {  // (label smoothing's mean of the logits)
              double sum = 0;
              for (int64_t j = 0; j < width; ++j) sum += double(zr[j]);
              block_zsum[bl * R + r] = sum;
            }
            const C m = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>(zr, width).maxCoeff();
            block_max[bl * R + r] = m;
            // (the terms kept in place for (3), but under a cap, whose derivative needs the logits)
            block_sum[bl * R + r] = sum_exp_shifted(zr, width, m, weight[r] != C(0) && !(cap > 0) ? zr : nullptr);
          }
        });
    // (2) each row's log-sum-exp and loss, the blocks' figures taken in order
    std::vector<C> row_max(rows), lse(rows);
    std::vector<double> sum(rows);
    for (int64_t r = 0; r < R; ++r) {
      C& m = row_max[r];
      m = block_max[r];
      for (int64_t bl = 1; bl < blocks; ++bl) m = std::max(m, block_max[bl * R + r]);
      double s = 0, z_sum = 0;
      for (int64_t bl = 0; bl < blocks; ++bl) {
        s += block_sum[bl * R + r] * std::exp(double(block_max[bl * R + r] - m));
        if (!block_zsum.empty()) z_sum += block_zsum[bl * R + r];
      }
      sum[r] = s;
      const double log_sum = std::log(s);
      lse[r] = C(double(m) + log_sum);
      if (losses) {
        logsumexp[r0 + r] = lse[r];
        losses[r0 + r] = row_loss(target[r0 + r] == ignore_index, m, log_sum, z_target[r], z_sum, eps, V);
      }
    }
    if (!row_weight) continue;
    // (3) dz, then the block's dw, db and share of dx
    std::vector<C> dx_part(dx ? cells * std::size_t(E) : 0);  // (blocks, R, E)
    parallel_for(
        blocks, R * V * 3 * E,
        [&](int64_t bl) {
          int64_t j0, width;
          C* zb = block_of(bl, j0, width);
          for (int64_t r = 0; r < R; ++r) {
            C* zr = zb + r * kBlockStride;
            const C wi = weight[r];
            if (wi == C(0)) {
              std::fill(zr, zr + width, C(0));
              continue;
            }
            // softmax(z)_j = exp(z_j - m_b) exp(m_b - m) / sum
            const C factor = C(std::exp(double(block_max[bl * R + r] - row_max[r])) / sum[r]);
            if (cap > 0) {  // zr holds the capped logits y
              const C mb = block_max[bl * R + r];
              for (int64_t j = 0; j < width; ++j)
                zr[j] = wi * (std::exp(zr[j] - mb) * factor - smooth) * cap_slope(zr[j], cap);
            } else {
              for (int64_t j = 0; j < width; ++j) zr[j] = wi * (zr[j] * factor - smooth);
            }
            const int64_t t = target[r0 + r] - j0;
            if (t >= 0 && t < width)
              zr[t] = target_gradient(wi, z_target[r], lse[r], eps, smooth) * cap_slope(z_target[r], cap);
          }
          // dw[j0 + j] += sum_r dz[r, j] x[r]: dw^T (E, width) = x^T dz, added transposed
          thread_local std::vector<C> dwt;
          dwt.resize(std::size_t(E * width));
          gemm_unpacked(dwt.data(), width, transposed(xc, E), zb, kBlockStride, E, width, R, C(1), Write::assign);
          for (int64_t j = 0; j < width; ++j)
            for (int64_t f = 0; f < E; ++f) dw[(j0 + j) * E + f] += dwt[f * width + j];
          if (db)
            for (int64_t r = 0; r < R; ++r)
              for (int64_t j = 0; j < width; ++j) db[j0 + j] += zb[r * kBlockStride + j];
          if (dx)  // dx_part[bl] (R, E) = dz w_blk
            for (int64_t r = 0; r < R; ++r)
              times_wt_rows(dx_part.data() + (bl * R + r) * E, zb + r * kBlockStride, wt, j0, width, E);
        });
    if (dx)
      for (int64_t bl = 0; bl < blocks; ++bl)
        for (int64_t e = 0; e < R * E; ++e) dx[r0 * E + e] += dx_part[bl * R * E + e];
  }
}

// A zeroed array of n elements of T's compute type, or nullptr unless `want`.
template <typename T>
std::unique_ptr<compute_t<T>[]> zeros(bool want, int64_t n) {
  return want ? std::unique_ptr<compute_t<T>[]>(new compute_t<T>[n]()) : nullptr;
}

// fused_narrow for a narrow E, else fused.
template <typename C>
void run(C* losses, C* logsumexp, C* dx, C* dw, C* db, const C* row_weight, const C* x, const C* w, const C* b,
         const int64_t* target, int64_t N, int64_t E, int64_t V, int64_t ignore_index, C eps, C cap) {
  if (E < gemm_detail::Vec<C>::width)
    fused_narrow(losses, logsumexp, dx, dw, db, row_weight, x, w, b, target, N, E, V, ignore_index, eps, cap);
  else
    fused(losses, logsumexp, dx, dw, db, row_weight, x, w, b, target, N, E, V, ignore_index, eps, cap);
}

// Both entries: losses (N) written, or nullptr to read logsumexp (the backward's recompute from it).
template <typename T>
void compute(compute_t<T>* losses, compute_t<T>* logsumexp, T* dx, T* dw, T* db, const compute_t<T>* row_weight,
             const T* x, const T* w, const T* b, const int64_t* target, int64_t N, int64_t E, int64_t V,
             int64_t ignore_index, double label_smoothing, double softcap) {
  using C = compute_t<T>;
  if constexpr (is_half<T>) {  // in float on float copies, each gradient added (and rounded) once
    const auto xc = converted(x, N * E), wc = converted(w, V * E), bc = converted(b, V);
    const bool grads = row_weight != nullptr;
    const auto dxc = zeros<T>(grads && dx, N * E), dwc = zeros<T>(grads, V * E), dbc = zeros<T>(grads && db, V);
    run<C>(losses, logsumexp, dxc.get(), dwc.get(), dbc.get(), row_weight, xc.get(), wc.get(), bc.get(), target,
           N, E, V, ignore_index, C(label_smoothing), C(softcap));
    if (dxc) add_rounded(dx, dxc.get(), N * E);
    if (dwc) add_rounded(dw, dwc.get(), V * E);
    if (dbc) add_rounded(db, dbc.get(), V);
  } else {
    run<C>(losses, logsumexp, dx, dw, db, row_weight, x, w, b, target, N, E, V, ignore_index, C(label_smoothing),
           C(softcap));
  }
}

}  // namespace

template <typename T>
void linear_cross_entropy(compute_t<T>* losses, compute_t<T>* logsumexp, T* dx, T* dw, T* db,
                          const compute_t<T>* row_weight, const T* x, const T* w, const T* b, const int64_t* target,
                          int64_t N, int64_t E, int64_t V, int64_t ignore_index, double label_smoothing,
                          double softcap) {
  compute<T>(losses, logsumexp, dx, dw, db, row_weight, x, w, b, target, N, E, V, ignore_index, label_smoothing,
             softcap);
}

template <typename T>
void linear_cross_entropy_backward(const compute_t<T>* logsumexp, T* dx, T* dw, T* db,
                                   const compute_t<T>* row_weight, const T* x, const T* w, const T* b,
                                   const int64_t* target, int64_t N, int64_t E, int64_t V, int64_t ignore_index,
                                   double label_smoothing, double softcap) {
  // (without losses the kernels only read logsumexp: the const_cast writes nothing)
  compute<T>(nullptr, const_cast<compute_t<T>*>(logsumexp), dx, dw, db, row_weight, x, w, b, target, N, E, V,
             ignore_index, label_smoothing, softcap);
}

#define INSTANTIATE(T)                                                                                          \
  template void linear_cross_entropy<T>(compute_t<T>*, compute_t<T>*, T*, T*, T*, const compute_t<T>*, const T*, \
                                        const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,  \
                                        double, double);                                                         \
  template void linear_cross_entropy_backward<T>(const compute_t<T>*, T*, T*, T*, const compute_t<T>*, const T*,  \
                                                 const T*, const T*, const int64_t*, int64_t, int64_t, int64_t,   \
                                                 int64_t, double, double);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
