// Embedding lookup, as torch.nn.Embedding.
#include <algorithm>
#include <vector>

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
  // Repeated indices add into the same row in a fixed order, i ascending: the rows of each index, gathered by a
  // stable sort, are summed into the row in the compute type and written once (rounded once in half precision).
  std::vector<int64_t> order(N);
  for (int64_t i = 0; i < N; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return index[a] < index[b]; });
  std::vector<compute_t<T>> row(E);
  for (int64_t first = 0; first < N;) {
    const int64_t target = index[order[first]];
    T* d = dweight + target * E;
    load_n(row.data(), d, E);
    int64_t i = first;
    for (; i < N && index[order[i]] == target; ++i)
      for (int64_t e = 0; e < E; ++e) row[e] += load(dout[order[i] * E + e]);
    store_n(d, row.data(), E);
    first = i;
  }
}

#define INSTANTIATE(T)                                                                      \
  template void embedding_forward<T>(T*, const int64_t*, const T*, int64_t, int64_t); \
  template void embedding_backward<T>(T*, const T*, const int64_t*, int64_t, int64_t);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
