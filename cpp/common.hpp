// Shared pieces of the attnpp core: strided views, masks, the dropout hash.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "half.hpp"

namespace attnpp {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using MapRows = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;  // rows strided, columns contiguous

// A 4-D array (N, H, rows, cols) whose last dimension is contiguous; strides in elements.
template <typename T>
struct View4 {
  T* data = nullptr;
  int64_t n = 0, h = 0, row = 0;  // strides of the batch, head and row dimensions
  T* at(int64_t in, int64_t ih, int64_t ir) const { return data + in * n + ih * h + ir * row; }
};

// An additive mask broadcast to (N, H, L, S): element (n, h, i, j) is
// data[batch_offset[n] + h * h_stride + i * l_stride + j * s_stride], read in the compute type. Any stride may be 0.
template <typename T>
struct MaskView {
  const T* data = nullptr;
  const int64_t* batch_offset = nullptr;  // (N)
  int64_t h_stride = 0, l_stride = 0, s_stride = 0;
  compute_t<T> at(int64_t n, int64_t h, int64_t i, int64_t j) const {
    return load(data[batch_offset[n] + h * h_stride + i * l_stride + j * s_stride]);
  }
};

// The cache line of the x86-64 and Arm cores attnpp runs on: the unit of its prefetches (attention.cpp, gemm.hpp).
constexpr int64_t kCacheLine = 64;

// The number of blocks of b that cover n.
inline int64_t ceil_div(int64_t n, int64_t b) { return (n + b - 1) / b; }

// Whether a loop of `work` multiply-adds (or elements) is worth waking the OpenMP threads for: a parallel region
// costs microseconds (tens when the threads have gone to sleep), as much as the whole of a small layer's call.
inline bool worth_threads(int64_t work) { return work >= (int64_t(1) << 17); }

// The number of threads of attnpp's parallel loops, one setting for the whole process and every CPU level
// (OpenMP's own setting belongs to the calling thread: a Python thread started later would not see
// set_num_threads). Defined in threads.cpp, with the two below.
int thread_count();
void set_thread_count(int n);
// Runs task(context, t) for the members t of a team of at most `threads` threads, t = 0 on the calling thread,
// and returns when all have returned: OpenMP's team, or threads.cpp's pool in a build without OpenMP. The team
// may be smaller than asked (a loop inside a loop's body, the pool busy with another caller's loop).
using TeamTask = void (*)(void* context, int t);
void run_team(int threads, TeamTask task, void* context);
// "OpenMP <_OPENMP>" or "std::thread pool (built without OpenMP)" (show_config).
std::string threading_runtime();

// body(i) for i in [0, n): on the threads (run_team) when `work` is worth it, else in a plain loop (an OpenMP
// region with a false `if` still sets up a team, about a microsecond). Each thread owns a contiguous share of the
// tasks, [t n / T, (t + 1) n / T), as a static split gives, and takes them one by one; a thread done with its own
// share then takes the others' remaining tasks, one by one as well (dynamic scheduling's balance). Which thread
// runs task i never changes what body(i) computes: results are the same on any thread count.
// - The owned shares: thread t gets the same tasks, hence the same data, in every loop over the same tasks, within
//   a call and from call to call (the fused loss's blocks of logits, written in one phase and read in the next, and
//   again at the next training step). On this project's 2-vCPU host the two virtual CPUs sit, for tens of seconds
//   at a time, on cores that share no cache (a cache line's round trip between the threads: 310 ns instead of 51):
//   with tasks handed out first come, first served, about half of every array changed hands at each loop, and two
//   threads took longer than one (a 6.4 MB read-modify-write sweep: 145 us on two threads, 121 on one, 64 on two
//   sharing a cache).
// - The taking over: a thread that the machine holds up (another process on its core, a virtual CPU descheduled)
//   keeps only the tasks it gets to; a plain static split waits for its whole share (article 001's training step
//   on that host: 4.2 ms with a static split in such a phase, where one thread alone took 2.9).
// An exception in a body (std::bad_alloc from a block buffer) stops the remaining tasks and is rethrown here: one
// escaping an OpenMP region (or a pool thread) would terminate the process.
template <typename F>
void parallel_for(int64_t n, int64_t work, F&& body) {
  const int threads = thread_count();
  if (threads == 1 || !worth_threads(work)) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct alignas(64) Next {  // the next task of a share, each on its own cache line
    std::atomic<int64_t> i;
  };
  std::vector<Next> next(static_cast<std::size_t>(threads));
  const auto share_begin = [&](int s) { return n * s / threads; };
  for (int s = 0; s < threads; ++s) next[s].i.store(share_begin(s), std::memory_order_relaxed);
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::atomic_flag error_taken = ATOMIC_FLAG_INIT;
  // thread t of the team; a smaller team than asked for takes over the missing threads' shares
  auto member = [&](int t) {
    for (int k = 0; k < threads && !failed.load(std::memory_order_relaxed); ++k) {
      const int s = (t + k) % threads;  // its own share first, then the others'
      const int64_t end = share_begin(s + 1);
      for (int64_t i; !failed.load(std::memory_order_relaxed) &&
                      (i = next[s].i.fetch_add(1, std::memory_order_relaxed)) < end;) {
        try {
          body(i);
        } catch (...) {
          if (!error_taken.test_and_set()) error = std::current_exception();  // the first one
          failed = true;
        }
      }
    }
  };
  run_team(threads, [](void* m, int t) { (*static_cast<decltype(member)*>(m))(t); }, &member);
  if (error) std::rethrow_exception(error);
}

// body(begin, end) over the chunks of [0, n): parallel_for for element-wise loops, whose bodies stay plain
// (vectorizable) loops over a chunk.
template <typename F>
void parallel_for_chunks(int64_t n, F&& body) {
  constexpr int64_t kChunk = int64_t(1) << 14;  // elements per task
  parallel_for(ceil_div(n, kChunk), n, [&](int64_t c) { body(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

// Explicit instantiation of a kernel file's templates for every dtype (float, double and the half-precision
// storage types of half.hpp): INSTANTIATE(T) is a macro of the file's `template void f<T>(...);` lines.
#define ATTNPP_FOR_ALL_DTYPES(INSTANTIATE) \
  INSTANTIATE(float)                       \
  INSTANTIATE(double)                      \
  INSTANTIATE(bfloat16)                    \
  INSTANTIATE(float16)

// One parameter of an optimizer step: the arrays of n elements it reads and updates in place, and its step count.
// The optimizers update a list of them in one parallel loop (PyTorch's foreach implementations: one call, one
// OpenMP region, for every parameter of a group).
template <typename T>
struct OptimizerSlot {
  T* param = nullptr;
  const T* grad = nullptr;
  T* state0 = nullptr;  // SGD: the momentum buffer (null without momentum); AdamW: exp_avg
  T* state1 = nullptr;  // AdamW: exp_avg_sq
  int64_t n = 0;
  int64_t step = 1;     // AdamW: the step count, from 1; SGD: 1 on the momentum buffer's first step
};

enum class Causal : int { none = 0, top_left = 1, bottom_right = 2 };

// The keys each query row of one sequence sees: query i (of L) sees keys [first_key(i), last_key(i)] (of S), an
// empty range when last_key(i) < first_key(i). Both ends are non-decreasing in i, so a block of rows sees the
// keys from its first row's first_key to its last row's last_key, and the blocks outside are skipped. Window and
// ALiBi positions are aligned bottom-right (query i sits at key position i + S - L, FlashAttention's convention);
// the causal mask has its own alignment.
struct Visible {
  int64_t L = 0, S = 0;        // this sequence's query and key counts
  int64_t q0 = 0, k0 = 0;      // its first query and key rows in the arrays (packed sequences; else 0)
  bool causal = false;
  int64_t causal_off = 0;      // causal: query i sees keys up to i + causal_off
  int64_t left = -1, right = -1;  // window: keys [i + diag - left, i + diag + right], -1 unbounded

  int64_t diag() const { return S - L; }  // key position of query 0 (bottom-right)
  int64_t first_key(int64_t i) const { return left < 0 ? 0 : std::max<int64_t>(0, i + diag() - left); }
  int64_t last_key(int64_t i) const {
    int64_t last = S - 1;
    if (causal) last = std::min(last, i + causal_off);
    if (right >= 0) last = std::min(last, i + diag() + right);
    return last;
  }
  // The first query row whose last_key reaches key j, and the last one whose first_key does not pass it.
  int64_t first_query(int64_t j) const {
    int64_t first = 0;
    if (causal) first = std::max(first, j - causal_off);
    if (right >= 0) first = std::max(first, j - diag() - right);
    return first;
  }
  int64_t last_query(int64_t j) const { return left < 0 ? L - 1 : std::min(L - 1, j - diag() + left); }
};

// Everything that defines one attention problem besides its buffers, for arrays of T (the masks too); the
// scalars and the small arrays (slopes, sinks) in T's compute type.
template <typename T>
struct AttnConfig {
  using C = compute_t<T>;
  int64_t N = 0, Hq = 0, Hk = 0, L = 0, S = 0, D = 0, Dv = 0;  // L, S: the longest sequences when they vary
  C scale = 1;
  Causal causal = Causal::none;
  double dropout_p = 0.0;
  uint64_t seed = 0;
  std::vector<MaskView<T>> masks;  // summed into the scores
  int64_t window_left = -1, window_right = -1;  // sliding window (FlashAttention's window_size), -1 unbounded
  // bfloat16 only: PyTorch's CPU flash attention's numerics, faster and less accurate: the weights P and their
  // gradient dS rounded to bfloat16 for their products, the backward's softmax term from the rounded output. Else
  // those products in float and the softmax term from the weights in float (attention_products.hpp,
  // attention.cpp). Chosen per call by flash_numerics() below.
  bool flash_numerics = false;
  // The forward merges its keys into a partial result over other keys already in out and logsumexp (each row's
  // normalized output and log-sum-exp; 0 and -inf for none), as ring attention merges the blocks of its ring.
  bool accumulate = false;
  C softcap = 0;                   // > 0: scores become softcap * tanh(scores / softcap) (Gemma 2), before masks
  const C* alibi = nullptr;        // ALiBi slopes: score -= alibi[n * alibi_n + h] * |i + S - L - j|
  int64_t alibi_n = 0;
  const C* sinks = nullptr;        // (Hq) a logit per head in every softmax's denominator, with no value
  // Sequences of their own lengths (else L queries and S keys each):
  const int64_t* cu_q = nullptr;   // (N + 1) packed queries: sequence n's are rows [cu_q[n], cu_q[n + 1]) of the
  const int64_t* cu_k = nullptr;   // (N + 1) arrays' one batch entry (batch stride 0); same for keys and values
  const int64_t* seqlens_k = nullptr;  // (N) keys of sequence n, from row 0 (a KV cache)

  int64_t group() const { return Hk ? Hq / Hk : 0; }  // query heads per key/value head (GQA)
  // multiply-adds of a forward without masking (a KV cache: over its longest filled length, not its capacity)
  int64_t work() const {
    const int64_t keys = seqlens_k && N > 0 ? *std::max_element(seqlens_k, seqlens_k + N) : S;
    return N * Hq * L * keys * (D + Dv);
  }
  Visible seq(int64_t n) const {
    Visible v;
    v.q0 = cu_q ? cu_q[n] : 0, v.L = cu_q ? cu_q[n + 1] - cu_q[n] : L;
    v.k0 = cu_k ? cu_k[n] : 0, v.S = cu_k ? cu_k[n + 1] - cu_k[n] : seqlens_k ? seqlens_k[n] : S;
    v.causal = causal != Causal::none;
    v.causal_off = causal == Causal::bottom_right ? v.S - v.L : 0;
    v.left = window_left, v.right = window_right;
    return v;
  }
  // Index of (n, h, i) in the logsumexp: (N, Hq, L), or (Hq, total queries) for packed sequences.
  int64_t lse_index(int64_t n, int64_t h, int64_t i) const {
    return cu_q ? h * cu_q[N] + cu_q[n] + i : (n * Hq + h) * L + i;
  }
  int64_t lse_size() const { return cu_q ? Hq * cu_q[N] : N * Hq * L; }
  bool has_bias() const { return !masks.empty() || alibi || softcap > 0; }
};

// How a bfloat16 attention computes (attnpp.set_bfloat16_attention): as the PyTorch CPU kernel that
// torch.nn.functional.scaled_dot_product_attention runs for the same call (pytorch), with flash attention's
// numerics always (flash), or with float products always (float32).
enum class Bfloat16Numerics : int { pytorch = 0, flash = 1, float32 = 2 };

// Whether a bfloat16 call with query width D, value width Dv and dropout_p takes flash numerics. PyTorch 2.13 runs
// its CPU flash kernel when D = Dv and there is no dropout (GQA, masks and causal included), else its math
// backend, which computes in float32.
inline bool flash_numerics(Bfloat16Numerics mode, int64_t D, int64_t Dv, double dropout_p) {
  return mode == Bfloat16Numerics::flash || (mode == Bfloat16Numerics::pytorch && D == Dv && dropout_p == 0);
}

// Counter-based dropout: the decision for element `index` of the (N, H, L, S) weights depends only on
// (seed, index), so it is the same whatever the thread count or the tiling, and the backward recomputes
// exactly the mask of the forward. The hash is SplitMix64's finalizer.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
inline bool dropout_keep(uint64_t seed, uint64_t index, double p) {
  const uint64_t r = mix64(mix64(seed) ^ index);
  const double u = static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
  return u >= p;
}

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

}  // namespace attnpp
