// The fused linear + cross-entropy: cross_entropy(x w^T + b, target) over chunks of rows, never holding the
// (N, V) logits (Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024; Liger Kernel's
// fused linear cross-entropy). A chunk's logits (rows x V, at most kLogitsBytes) are computed once, turned into
// their losses and, when the gradient's row weights are known, into the logits' gradient in place, which then
// feeds the two gradient products: the three products of the unfused pair, no more. The products that read the
// weight go a block of the vocabulary at a time (gemm_parallel packs its B operand whole: a block of the weight,
// at most kPackBytes, not all of it), so that memory stays one chunk of logits and two such blocks.
#include <algorithm>
#include <cmath>
#include <memory>

#include "gemm.hpp"
#include "linear.hpp"
#include "row_softmax.hpp"
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

constexpr int64_t kLogitsBytes = int64_t(32) << 20;  // one chunk's logits
constexpr int64_t kPackBytes = int64_t(12) << 20;   // the block of the weight a product packs at a time

// In the compute type C (float or double): see linear_cross_entropy in training.hpp.
template <typename C>
void fused(C* losses, C* logsumexp, C* dx, C* dw, C* db, const C* row_weight, const C* x, const C* w, const C* b,
           const int64_t* target, int64_t N, int64_t E, int64_t V, int64_t ignore_index, C eps) {
  const int64_t rows = std::clamp<int64_t>(kLogitsBytes / (V * int64_t(sizeof(C))), 1, std::max<int64_t>(N, 1));
  const std::unique_ptr<C[]> z(new C[std::size_t(std::min(rows, N) * V)]);  // (uninitialized: the product writes it)
  const C smooth = eps / C(V);  // each class's share of the smoothing
  // vocabulary rows per block: 4096 at E = 768 in float; the whole vocabulary for a narrow E (fewer, larger
  // parallel loops)
  const int64_t block = std::max<int64_t>(1, kPackBytes / (std::max<int64_t>(E, 1) * int64_t(sizeof(C))));
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t R = std::min(rows, N - r0);
    const C* xc = x + r0 * E;
    for (int64_t v0 = 0; v0 < V; v0 += block)  // z = x w^T (+ b below)
      gemm_parallel(z.get() + v0, V, row_major(xc, E), transposed(w + v0 * E, E), R, std::min(block, V - v0), E,
                    C(1), Write::assign);
    parallel_for(R, R * V, [&](int64_t r) {
      const int64_t i = r0 + r;
      C* zr = z.get() + r * V;
      if (b)
        for (int64_t j = 0; j < V; ++j) zr[j] += b[j];
      const bool ignored = target[i] == ignore_index;
      const C wi = row_weight && !ignored ? row_weight[i] : C(0);
      const C z_target = ignored ? C(0) : zr[target[i]];
      if (losses || wi != C(0)) {
        // m, the row's max, and sum = sum_j exp(z_j - m); the terms kept in place for the gradient (one exp per
        // logit, the same whether the forward or the backward computes the gradient)
        const C m = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>(zr, V).maxCoeff();  // (vectorized)
        double z_sum = 0;  // (label smoothing's mean of the logits, taken before the exp overwrites them)
        if (losses && eps > 0 && !ignored)
          for (int64_t j = 0; j < V; ++j) z_sum += double(zr[j]);
        const double sum = sum_exp_shifted(zr, V, m, wi != C(0) ? zr : nullptr), log_sum = std::log(sum);
        if (losses) {
          // loss_i = lse - (1 - eps) z_t - eps mean_j z_j, as log_sum + (1 - eps)(m - z_t) + eps (m - mean z):
          // non-negative terms, none lost next to m
          logsumexp[i] = C(double(m) + log_sum);
          double loss = 0;
          if (!ignored) {
            loss = log_sum + (1 - double(eps)) * double(m - z_target);
            if (eps > 0) loss += double(eps) * (double(m) - z_sum / double(V));
          }
          losses[i] = C(loss);
        }
        if (wi != C(0)) {
          // dz_j = w_i (softmax(z)_j - eps / V - (1 - eps) [j = t]), softmax(z)_j = exp(z_j - m) / sum
          //   <- loss_i = -sum_j q_j log softmax(z)_j
          const C inv_sum = C(1 / sum);
          for (int64_t j = 0; j < V; ++j) zr[j] = wi * (zr[j] * inv_sum - smooth);
          // at the target, p - 1 = expm1(z_t - lse): exact even when p is within an ulp of 1
          zr[target[i]] = wi * (std::expm1(z_target - logsumexp[i]) + (eps - smooth));
        }
      }
      if (row_weight && wi == C(0)) std::fill(zr, zr + V, C(0));
    });
    if (!row_weight) continue;
    // dw += dz^T x, db += the column sums of dz; dx += dz w   <- z = x w^T + b (a narrow E: linear_backward's
    // dot products, which pack nothing of the weight)
    const bool narrow = E < gemm_detail::Vec<C>::width;
    linear_backward<C>(narrow && dx ? dx + r0 * E : nullptr, dw, db, z.get(), xc, w, R, E, V);
    if (dx && !narrow)
      for (int64_t v0 = 0; v0 < V; v0 += block)
        gemm_parallel(dx + r0 * E, E, row_major(z.get() + v0, V), row_major(w + v0 * E, E), R, E,
                      std::min(block, V - v0), C(1), Write::accumulate);
  }
}

// A zeroed array of n elements of T's compute type, or nullptr unless `want`.
template <typename T>
std::unique_ptr<compute_t<T>[]> zeros(bool want, int64_t n) {
  return want ? std::unique_ptr<compute_t<T>[]>(new compute_t<T>[n]()) : nullptr;
}

}  // namespace

template <typename T>
void linear_cross_entropy(compute_t<T>* losses, compute_t<T>* logsumexp, T* dx, T* dw, T* db,
                          const compute_t<T>* row_weight, const T* x, const T* w, const T* b, const int64_t* target,
                          int64_t N, int64_t E, int64_t V, int64_t ignore_index, double label_smoothing) {
  using C = compute_t<T>;
  if constexpr (is_half<T>) {  // in float on float copies, each gradient added (and rounded) once
    const auto xc = converted(x, N * E), wc = converted(w, V * E), bc = converted(b, V);
    const bool grads = row_weight != nullptr;
    const auto dxc = zeros<T>(grads && dx, N * E), dwc = zeros<T>(grads, V * E), dbc = zeros<T>(grads && db, V);
    fused<C>(losses, logsumexp, dxc.get(), dwc.get(), dbc.get(), row_weight, xc.get(), wc.get(), bc.get(), target,
             N, E, V, ignore_index, C(label_smoothing));
    if (dxc) add_rounded(dx, dxc.get(), N * E);
    if (dwc) add_rounded(dw, dwc.get(), V * E);
    if (dbc) add_rounded(db, dbc.get(), V);
  } else {
    fused<C>(losses, logsumexp, dx, dw, db, row_weight, x, w, b, target, N, E, V, ignore_index, C(label_smoothing));
  }
}

#define INSTANTIATE(T)                                                                                          \
  template void linear_cross_entropy<T>(compute_t<T>*, compute_t<T>*, T*, T*, T*, const compute_t<T>*, const T*, \
                                        const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,  \
                                        double);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
