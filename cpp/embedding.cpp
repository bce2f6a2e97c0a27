// Embedding lookup, as torch.nn.Embedding.
#include <algorithm>

#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {

template <typename T>
void embedding_forward(T* out, const int64_t* index, const T* weight, int64_t N, int64_t E) {
  parallel_for(N, N * E, [&](int64_t i) {
    std::copy(weight + index[i] * E, weight + (index[i] + 1) * E, out + i * E);
  });
}

template <typename T>
void embedding_backward(T* dweight, const T* dout, const int64_t* index, int64_t N, int64_t E) {
  // dweight[index[i]] += dout[i]     <- out[i] = weight[index[i]]
  // Sequential over i: repeated indices add into the same row, in a fixed order (in half precision each sum is
  // rounded, as PyTorch's index_add_ on a half-precision gradient does).
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < E; ++e) {
      T& d = dweight[index[i] * E + e];
      d = store<T>(load(d) + load(dout[i * E + e]));
    }
}

#define INSTANTIATE(T)                                                                      \
  template void embedding_forward<T>(T*, const int64_t*, const T*, int64_t, int64_t); \
  template void embedding_backward<T>(T*, const T*, const int64_t*, int64_t, int64_t);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
