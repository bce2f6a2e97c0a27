// Rotary position embeddings (RoPE; Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
// 2021): the features of each row turned, pair by pair, by angles that grow with the row's position.
#pragma once

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// out (N, H, L, D) = x (N, H, L, D) with the first R = 2 * R2 features of row l of sequence n rotated by the
// angles of position p = offsets[n] + l, and the features R.. copied. For each pair (a, b) of features d < R2
// (interleaved: (2d, 2d + 1), as GPT-J; else (d, d + R2), as GPT-NeoX and Llama), with c = cos[p, d] and
// s = sin[p, d]:  out[a] = x[a] c - x[b] s,  out[b] = x[b] c + x[a] s.
// cos, sin (P, R2) contiguous; offsets (N), each with 0 <= offsets[n] and offsets[n] + L <= P (unchecked);
// 2 * R2 <= D. out may be x itself (each pair is read before it is written), not a shifted view of it.
template <typename T>
void rotary_forward(const View4<T>& out, const View4<const T>& x, const T* cos, const T* sin, const int64_t* offsets,
                    int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2, bool interleaved);

// Accumulates (+=) the gradient of rotary_forward into dx (N, H, L, D): dout (N, H, L, D) rotated by the opposite
// angles (sin -> -sin, the rotation's transpose), its features R.. as they are.
template <typename T>
void rotary_backward(const View4<T>& dx, const View4<const T>& dout, const T* cos, const T* sin,
                     const int64_t* offsets, int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2,
                     bool interleaved);

}  // namespace attnpp::ATTNPP_CPU_NS
