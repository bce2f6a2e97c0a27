// The training pieces the articles need: dropout, embedding, cross-entropy, SGD and AdamW. Each takes float,
// double and the half-precision types, which it computes in float and rounds once when it writes (half.hpp); the
// cross-entropy's row statistics and row weights are in the compute type.
// Each forward sits above its backward in its own file (dropout.cpp, embedding.cpp, cross_entropy.cpp,
// optim.cpp).
#pragma once

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// out (n) = x * keep / (1 - p), keep = dropout_keep(seed, i, p) for element i (C order).
template <typename T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed);
// dx (n) += dout * keep / (1 - p), the forward's mask for the same seed.
template <typename T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed);
// keep (n): true where element i is kept for `seed` and `p` (the mask of dropout_* and of the attention).
void dropout_mask(bool* keep, int64_t n, double p, uint64_t seed);

// out (N, E) = weight[index] for index (N) in [0, V); weight (V, E).
template <typename T>
void embedding_forward(T* out, const int64_t* index, const T* weight, int64_t N, int64_t E);
// dweight (V, E) += scatter of dout (N, E) by index (N).
template <typename T>
void embedding_backward(T* dweight, const T* dout, const int64_t* index, int64_t N, int64_t E);

// Per-row losses (N) = logsumexp(input[i]) - input[i, target[i]] (0 where target == ignore_index) and the
// row statistics stats (N, 2) = (max_c input[i, c], log sum_c exp(input[i, c] - max)), both in the compute type;
// input (N, C).
template <typename T>
void cross_entropy_forward(compute_t<T>* losses, compute_t<T>* stats, const T* input, const int64_t* target, int64_t N,
                           int64_t C, int64_t ignore_index);
// dinput (N, C) = (softmax(input) - onehot(target)) * row_weight[i] (row_weight: dloss_i, 0 for ignored rows).
template <typename T>
void cross_entropy_backward(T* dinput, const compute_t<T>* row_weight, const compute_t<T>* stats, const T* input,
                            const int64_t* target, int64_t N, int64_t C);

// The fused linear + cross-entropy (linear_cross_entropy.cpp): cross_entropy(x w^T + b, target) with label
// smoothing, over chunks of rows, never the (N, V) logits. x (N, E), w (V, E), b (V) or nullptr, target (N)
// in [0, V) or ignore_index. The forward writes each row's loss (N) (0 where ignored) and logsumexp (N) (the
// compute type); with row_weight (N) (dloss / dloss_i; nullptr: none), it also accumulates the gradients dx
// (N, E) (skipped when nullptr), dw (V, E) and db (V) (skipped when nullptr) in the same pass over the chunks.
// softcap > 0: the logits soft-capped first, softcap * tanh(z / softcap) (Gemma 2's final logits); 0: not.
template <typename T>
void linear_cross_entropy(compute_t<T>* losses, compute_t<T>* logsumexp, T* dx, T* dw, T* db,
                          const compute_t<T>* row_weight, const T* x, const T* w, const T* b, const int64_t* target,
                          int64_t N, int64_t E, int64_t V, int64_t ignore_index, double label_smoothing,
                          double softcap);
// The backward: each chunk's logits recomputed from the forward's logsumexp (N), the gradients weighted by
// row_weight (N) accumulated into dx (N, E) (skipped when nullptr), dw (V, E) and db (V) (skipped when nullptr).
template <typename T>
void linear_cross_entropy_backward(const compute_t<T>* logsumexp, T* dx, T* dw, T* db,
                                   const compute_t<T>* row_weight, const T* x, const T* w, const T* b,
                                   const int64_t* target, int64_t N, int64_t E, int64_t V, int64_t ignore_index,
                                   double label_smoothing, double softcap);

// SGD with momentum, dampening, weight decay and Nesterov, as torch.optim.SGD (the momentum buffer starts as the
// gradient on its first step).
template <typename T>
void sgd_step(const OptimizerSlot<T>* slots, int64_t count, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov);
// AdamW as torch.optim.AdamW (decoupled weight decay, bias-corrected moments).
template <typename T>
void adamw_step(const OptimizerSlot<T>* slots, int64_t count, double lr, double beta1, double beta2, double eps,
                double weight_decay);

}  // namespace attnpp::ATTNPP_CPU_NS
