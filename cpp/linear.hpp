// Linear layer: y = x w^T + b, as torch.nn.Linear (weight (out, in)).
#pragma once

#include <memory>

#include "level.hpp"

namespace attnpp::ATTNPP_CPU_NS {

// y (M, Fout) = x (M, Fin) w^T + b; w (Fout, Fin); b (Fout) or nullptr. All contiguous.
template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout);

// Accumulates dx (M, Fin) (skipped when nullptr), dw (Fout, Fin) and db (Fout) (skipped when nullptr).
template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                     int64_t Fout);

// For the half-precision types' float copies (linear.cpp, linear_cross_entropy.cpp):
// a (n) read into a new array of its compute type (nullptr for nullptr);
template <typename T>
std::unique_ptr<compute_t<T>[]> converted(const T* a, int64_t n) {
  if (!a) return nullptr;
  std::unique_ptr<compute_t<T>[]> c(new compute_t<T>[n]);
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) { load_n(c.get() + begin, a + begin, end - begin); });
  return c;
}

// a (n) += c (n), each sum rounded once into T.
template <typename T>
void add_rounded(T* a, const compute_t<T>* c, int64_t n) {
  parallel_for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = store<T>(load(a[i]) + c[i]);
  });
}

}  // namespace attnpp::ATTNPP_CPU_NS
