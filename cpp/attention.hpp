// Scaled dot-product attention: tiled forward with an online softmax, backward that recomputes the weights.
#pragma once

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// out = softmax(softcap(scale * q k^T) + masks + alibi, hidden keys -inf, sink) (with dropout) v.
// T: float, double, or a half-precision type (bfloat16, float16), which is read into float, computed and
// accumulated in float, and rounded once when written; logsumexp, the slopes, the sinks and dsinks are in
// compute_t<T> (half.hpp).
// out (N, Hq, L, Dv), logsumexp (N, Hq, L) contiguous, q (N, Hq, L, D), k (N, Hk, S, D), v (N, Hk, S, Dv); with
// packed sequences (cfg.cu_q, cu_k) the arrays have batch stride 0 and rows cu[n].., logsumexp is (Hq, total L).
// A query row whose keys are all masked gets out = 0 and logsumexp = -inf (the sink's logit with sinks).
template <typename T>
void sdpa_forward(const View4<T>& out, compute_t<T>* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const View4<const T>& v, const AttnConfig<T>& cfg);

// sdpa_forward with queries and output in T's compute type: float32 queries over a half-precision KV cache (for
// float and double, sdpa_forward itself).
template <typename T>
void sdpa_forward_wide_queries(const View4<compute_t<T>>& out, compute_t<T>* logsumexp,
                               const View4<const compute_t<T>>& q, const View4<const T>& k, const View4<const T>& v,
                               const AttnConfig<T>& cfg);

// Gradients of sdpa_forward, accumulated (+=) into dq (N, Hq, L, D), dk (N, Hk, S, D), dv (N, Hk, S, Dv) and,
// with cfg.sinks and when not null, dsinks (Hq).
template <typename T>
void sdpa_backward(const View4<T>& dq, const View4<T>& dk, const View4<T>& dv, compute_t<T>* dsinks,
                   const View4<const T>& dout, const View4<const T>& out, const compute_t<T>* logsumexp,
                   const View4<const T>& q,
                   const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg);

// The attention weights (N, Hq, L, S), contiguous, after dropout when cfg.dropout_p > 0:
// P = exp(scale * q k^T + masks - logsumexp), recomputed from the forward's logsumexp. With average_heads, their
// mean over the heads instead, (N, L, S), without building the per-head weights.
template <typename T>
void sdpa_weights(T* weights, const compute_t<T>* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const AttnConfig<T>& cfg, bool average_heads = false);

// The forward's two products alone, on the blocks it takes for a head of width D (D = Dv) away from the causal
// diagonal: the scores q_blk k_blk^T (kForwardRows x keys x D), then acc += p v_blk (kForwardRows x D x keys), k_blk^T
// and v_blk packed once; `steps` of each per task, 8 tasks a thread, each thread on blocks of its own. Returns the flops
// done: timed from the caller, flops / seconds is the most the forward's products reach on these threads without
// the softmax between them (attnpp.bench sets the forward's GFLOP/s against it).
double forward_products(int64_t D, int64_t steps);

}  // namespace attnpp::ATTNPP_CPU_NS
