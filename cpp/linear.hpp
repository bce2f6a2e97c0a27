// Linear layer: y = x w^T + b, as torch.nn.Linear (weight (out, in)).
#pragma once

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// y (M, Fout) = x (M, Fin) w^T + b; w (Fout, Fin); b (Fout) or nullptr. All contiguous.
template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout);

// Accumulates dx (M, Fin) (skipped when nullptr), dw (Fout, Fin) and db (Fout) (skipped when nullptr).
template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                     int64_t Fout);

}  // namespace attnpp::ATTNPP_CPU_NS
