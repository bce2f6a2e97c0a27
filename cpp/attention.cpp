// Scaled dot-product attention, FlashAttention-2 style (Dao, 2023, arXiv:2307.08691): memory grows with L, not
// L * S. The forward walks key blocks with an online softmax and saves only out and logsumexp; the backward
// recomputes each block of weights from logsumexp. Every product is a `gemm` on blocks that stay in cache, its B
// operand (a block of K^T, V, V^T, K, Q or dO) packed in a per-thread buffer first (gemm.hpp): the temporaries
// are a few blocks per thread, whatever L and S.
#include "attention.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_products.hpp"
#include "peak.hpp"
#include "vector_exp.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

// The backward's blocks: kBackwardRows query rows against kBackwardKeys keys (128 under a window: key_block). Each key
// block walks every row block that sees it, reading its queries, output gradients and rows of dq again: larger blocks
// read them less often, and on the causal diagonal the chunks (kDiagonalRows, below) keep the hidden part computed
// small at any size. Against 64 rows x 128 keys (causal) and x 256 (not), AMD Zen 3 at AVX2, medians of 5 to 21 calls
// alternating in one process: causal (1,32,8192,128) 0.93 of the time, (1,32,4096,128) 0.91 and 0.94, (1,12,4096,64)
// 0.95, (1,12,1024,64) 0.97, (8,12,256,64) 0.97; not causal 0.97 to 0.99. Blocks of 64 rows x 64 keys took 1.25 times
// the time, of 64 rows x 192 or 256 keys 0.93 to 1.01. AMD Zen 5, the same way: at AVX-512 causal (1,32,4096,128)
// 0.91 of the time, (1,12,4096,64) 0.97, (1,12,1024,64) 0.96, but (8,12,256,64) 1.05; not causal 1.00 to 1.01; at
// AVX2 causal 0.96, 0.98 and 1.00 ((8,12,256,64)), not causal 0.99.
constexpr int64_t kBackwardRows = 96, kBackwardKeys = 192;
// Query rows per task of the forward and the weights: each task packs every key block it sees, so that copy is
// amortized over this many rows (64 rows: 15% of the forward's time at AVX2; 256, as PyTorch's CPU flash
// attention for long sequences: 4%).
constexpr int64_t kForwardRows = 256;
// Under a sliding window a block of R rows computes R x (R + window) scores for R x window visible ones: the
// forward's task walks the keys in sub-blocks of this many rows, each over its own keys, all of them taken from
// the task's keys packed once (up to kSharedPack elements of K and V: they stay in the L2 cache).
constexpr int64_t kWindowRows = 64, kSharedPack = int64_t(1) << 17;
// Elsewhere a task takes several row blocks when that leaves this many tasks a thread, and packs their keys once
// when there are at most kHeadPack elements of K and V (16 MiB in float: a whole head of (1, 12, 32768, 64) or of
// (1, 32, 16384, 128); AMD Zen 3 at AVX2: at 8 MiB, (1, 12, 16384, 64) and (1, 32, 8192, 128) causal 6% and 5-9%
// faster than at 4 MiB, where each row block packed every key block it saw; at 16 MiB, (1, 12, 32768, 64) and
// (1, 32, 16384, 128) 2-9% faster than at 8 MiB, median of paired calls 3-4%; AMD Zen 5: 2-6% at AVX-512, 0-1% at
// AVX2).
constexpr int64_t kTasksPerThread = 4, kHeadPack = int64_t(1) << 22;
// Keys per block of the forward where they are hidden from some of the block's rows (the causal diagonal, a window's
// right end). The chunks below keep the hidden part computed the same at any width, so the diagonal of a block of
// kForwardRows rows (256) is one block: each row's maximum, exponentials and rescaling of its output run once over its
// keys there, not once per 64 keys (the width before; against it, AMD Zen 5, medians of 11 to 101 calls alternating
// in one process, causal: (8,12,256,64) 0.93 to 0.96 of the time at AVX-512 and 0.97 at AVX2, (1,12,1024,64) 0.97
// to 0.98 and 0.99, (1,12,4096,64) 0.98 and 0.98 to 0.99, (1,32,2048,128) 1.00 and 1.00 to 1.01). A multiple of
// every product's panel width.
constexpr int64_t kEdgeKeys = kForwardRows;
// In such a block the rows that see only its first keys go kDiagonalRows at a time, each chunk over the block's
// first columns up to its last row's last key, rounded up to kDiagonalCols (a multiple of every level's vector
// width, and even for bfloat16 pairs): a 256-key block on the causal diagonal then computes 34,816 of its 65,536
// scores (32,896 visible), and takes the exponential and the maximum over those alone. With blocks of 64 keys, the
// chunks took the (8,12,256,64) causal forward's time to 0.95 of what it was at AVX-512, 0.89 at AVX2 and 0.88 at
// the baseline ((1,12,1024,64) causal: 0.96 to 0.99). The backward's row blocks take the same chunks: its forward +
// backward 0.97 at AVX-512 and 0.95 at AVX2 ((1,12,1024,64) causal: 0.98); chunks of 32 were 1 to 2% slower than 16.
// There dk and dv then sum a block's rows chunk by chunk, which rounds them differently (float32: up to 6e-7 of the
// largest gradient).
constexpr int64_t kDiagonalRows = 16, kDiagonalCols = 16;

// The next chunk of query rows [c0, end) against the key block [j0, j0 + cols): rows [c0, .end) over the block's
// first .cols columns, kDiagonalRows rows while they see fewer than cols keys, else all of [c0, end); .cols <= 0
// where the chunk's rows see none of the block's keys.
struct Chunk {
  int64_t end, cols;
};
inline Chunk diagonal_chunk(const Visible& vis, int64_t c0, int64_t end, int64_t j0, int64_t cols) {
  const int64_t c1 = std::min(end, c0 + kDiagonalRows);
  const int64_t w = std::min(cols, ceil_div(vis.last_key(c1 - 1) + 1 - j0, kDiagonalCols) * kDiagonalCols);
  return {w == cols ? end : c1, w};
}

// A task that covers a whole (n, key/value head) pair (short sequences: (8,12,256,64) has 96 of them) reads its
// queries, keys and values from memory once, and sampling found the packing of its K^T stalled on those loads: the
// next task's are requested into the L2 cache as a task runs, when they take at most kPrefetchBytes (the running
// task's blocks fit beside them; at 768 KiB, (1,12,1024,64)'s heads, no gain). Requested all at once as the task
// started, they took the (8,12,256,64) forward to 0.98 of its time at AVX-512 and AVX2, 0.94 to 0.96 causal (medians
// over 200 calls with and without, alternating in one process; at the baseline 1.00 and 0.98); yet the next task's
// packing of its keys still ran at the speed of a copy from memory (AMD Zen 4: 7.8 us a head at AVX-512, 1.2 to 1.7
// from the caches): of 3,072 requests in a row, many were lost. A share after each of the task's rows (NextHead),
// all of them by its middle row, took it to 0.94 to 0.99 of that time causal at AVX-512 and 0.95 to 0.96 at AVX2,
// 0.96 to 0.99 not causal (medians of 8 to 12 processes alternating, in several runs; bfloat16, whose rows are half
// as long, 0.98 to 1.01).
constexpr int64_t kPrefetchBytes = int64_t(1) << 18;

// The queries, keys and values of a task's (n, key/value head hk) when they take at most kPrefetchBytes (else
// nothing), requested into the L2 cache (not the L1, whose lines the running task's blocks need) a few rows at a
// time: the keys' rows, then the values', then each query head's of the group. Its functions are inlined where they
// are called: GCC takes __builtin_prefetch for free of side effects, and a call to a function made only of
// prefetches was deleted as dead code.
template <typename T, typename Q>
class NextHead {
 public:
  NextHead() = default;  // (none)
  // For a task of task_rows rows, each of which calls after_row() once it is done (a row may call it again, for
  // another block of keys), then rest() at the task's end.
  NextHead(const View4<const Q>& q, const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg,
           int64_t n, int64_t hk, int64_t task_rows)
      : q_(&q), k_(&k), v_(&v), cfg_(&cfg), n_(n), hk_(hk), vis_(cfg.seq(n)) {
    const int64_t g = cfg.group();
    if (vis_.S * (cfg.D + cfg.Dv) * int64_t(sizeof(T)) + g * vis_.L * cfg.D * int64_t(sizeof(Q)) <= kPrefetchBytes)
      rows_ = 2 * vis_.S + g * vis_.L, per_row_ = ceil_div(2 * rows_, std::max<int64_t>(1, task_rows));
  }
  // A share of the rows: all of them requested by the task's middle row.
  __attribute__((always_inline)) inline void after_row() { request(per_row_); }
  // Those that the task's rows left (a row that sees no key requests none).
  __attribute__((always_inline)) inline void rest() { request(rows_); }

 private:
  __attribute__((always_inline)) inline void request(int64_t count) {
    for (; row_ < rows_ && count > 0; --count) {
      const int64_t S = vis_.S, r = row_++;
      if (r < S)
        lines(k_->at(n_, hk_, vis_.k0 + r), cfg_->D);
      else if (r < 2 * S)
        lines(v_->at(n_, hk_, vis_.k0 + r - S), cfg_->Dv);
      else
        lines(q_->at(n_, hk_ * cfg_->group() + (r - 2 * S) / vis_.L, vis_.q0 + (r - 2 * S) % vis_.L), cfg_->D);
    }
  }
  template <typename A>
  __attribute__((always_inline)) static void lines(const A* row, int64_t cols) {
    const auto first = reinterpret_cast<std::uintptr_t>(row) / kCacheLine * kCacheLine;
    const auto end = reinterpret_cast<std::uintptr_t>(row + cols);
    for (std::uintptr_t line = first; line < end; line += kCacheLine)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 1);
  }
  const View4<const Q>* q_ = nullptr;
  const View4<const T>* k_ = nullptr;
  const View4<const T>* v_ = nullptr;
  const AttnConfig<T>* cfg_ = nullptr;
  int64_t n_ = 0, hk_ = 0;
  int64_t row_ = 0, rows_ = 0, per_row_ = 0;  // the next row to request (keys, values, queries), of rows_
  Visible vis_{};
};

// Keys per block: 256 halves the forward's per-block work outside the products (rescaling the accumulated rows,
// packing) against 128 (sdpa fwd (1,12,1024,64) against PyTorch at AVX2: 0.96 -> 1.01); 128 under a window, and
// for the weights (sdpa_weights) under the causal mask: their blocks on the edges compute their hidden part too. The
// forward takes blocks of kEdgeKeys on the causal diagonal, and 512 elsewhere where the block's keys and values fit
// in kForwardPack elements (D = Dv = 64), halving that work again (AMD Zen 3 at AVX2: (1,12,4096,64) causal 6%
// faster, (1,12,1024,64) 1-3%); at D = 128, whose blocks of 512 outgrew its 512 KiB L2 cache, they were 5% slower.
// The backward takes kBackwardKeys.
constexpr int64_t kForwardPack = int64_t(1) << 16;
enum class Pass { forward, backward, weights };
inline int64_t forward_keys(int64_t D, int64_t Dv) { return 512 * (D + Dv) <= kForwardPack ? 512 : 256; }
template <typename T>
int64_t key_block(const AttnConfig<T>& cfg, Pass pass) {
  if (cfg.window_left >= 0 || cfg.window_right >= 0) return 128;
  if (pass == Pass::backward) return kBackwardKeys;
  if (pass == Pass::weights && cfg.causal != Causal::none) return 128;
  return pass == Pass::forward ? forward_keys(cfg.D, cfg.Dv) : 256;
}

// A block of query rows of sequence n: heads [h0, h0 + heads) x queries [i0, i0 + rows), row r being head
// h0 + r / rows, query i0 + r % rows. Several query heads of one key/value head share a block when the
// sequences are short (GQA decoding: the group's rows read each key block once).
struct RowBlock {
  int64_t n, h0, heads, i0, rows;
  int64_t count() const { return heads * rows; }
  int64_t head(int64_t r) const { return h0 + r / rows; }
  int64_t query(int64_t r) const { return i0 + r % rows; }
};

// Adds acc (rows, cols), contiguous, into rows [r0, r0 + rows) of head (n, h) of a, each sum rounded once into T.
template <typename T>
void add_rows(const View4<T>& a, int64_t n, int64_t h, int64_t r0, const compute_t<T>* acc, int64_t rows,
              int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = a.at(n, h, r0 + r);
    const compute_t<T>* src = acc + r * cols;
    for (int64_t c = 0; c < cols; ++c) dst[c] = store<T>(load(dst[c]) + src[c]);
  }
}

// scores (R, cols) = the scores of the rows of `b` against keys [j0, j0 + cols) of sequence `vis`: scale * q_blk
// k_blk^T (products P: attention_products.hpp), soft-capped, plus the masks and the ALiBi bias, -inf outside each
// row's visible keys; q_blk (R, D), kt = k_blk^T (D, >= cols) packed, or (`keys`, at most kFewRows rows) k_blk's rows
// read where they lie, keys[c * keys_ld..]. With a soft cap and `dcap`, also dcap (R, cols) = 1 - tanh^2, the cap's
// derivative. Returns false when every score is -inf.
// kt_col0: the block's first column in kt (a multiple of the panel width).
template <typename P, typename T>
bool score_block(RowMat<compute_t<T>>& scores, RowMat<compute_t<T>>* dcap, typename P::Rows q_blk,
                 const typename P::Packed& kt, const RowBlock& b, int64_t cols, const AttnConfig<T>& cfg,
                 const Visible& vis, int64_t j0, int64_t kt_col0 = 0, const T* keys = nullptr,
                 int64_t keys_ld = 0) {
  using C = compute_t<T>;
  const int64_t R = b.count();
  scores.resize(R, cols);
  if (keys)
    P::product_in_place(scores.data(), cols, q_blk, keys, keys_ld, R, cols, cfg.D, cfg.scale);
  else
    P::product(scores.data(), cols, q_blk, kt, R, cols, cfg.D, cfg.scale, Write::assign, 0, kt_col0);
  if (cfg.softcap > 0) {  // s = softcap * tanh(s / softcap)
    scores.array() = (scores.array() / cfg.softcap).tanh();
    if (dcap) dcap->array() = C(1) - scores.array().square();
    scores.array() *= cfg.softcap;
  }
  bool any = false;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = b.head(r), i = b.query(r);
    C* row = &scores(r, 0);
    for (const auto& m : cfg.masks)
      for (int64_t c = 0; c < cols; ++c) row[c] += m.at(b.n, h, i, j0 + c);
    if (cfg.alibi) {  // -slope * |i + S - L - j|
      const C slope = cfg.alibi[b.n * cfg.alibi_n + h];
      const int64_t pos = i + vis.diag() - j0;
      for (int64_t c = 0; c < cols; ++c) row[c] -= slope * C(std::abs(pos - c));
    }
    // the row sees columns [lo, hi)
    const int64_t lo = std::clamp<int64_t>(vis.first_key(i) - j0, 0, cols);
    const int64_t hi = std::clamp<int64_t>(vis.last_key(i) + 1 - j0, lo, cols);
    std::fill(row, row + lo, neg_inf<C>());
    std::fill(row + hi, row + cols, neg_inf<C>());
    if (cfg.masks.empty())
      any = any || hi > lo;
    else
      for (int64_t c = lo; c < hi && !any; ++c) any = row[c] != neg_inf<C>();
  }
  return any;
}

// p_blk *= keep / (1 - p), the dropout of the weights of block rows b against keys j0.. (kRounded: each result
// rounded to bfloat16, as the forward's weights under flash numerics).
template <bool kRounded = false, typename T, typename C = compute_t<T>>
void apply_dropout(RowMat<C>& p_blk, const AttnConfig<T>& cfg, const RowBlock& b, int64_t j0) {
  const C inv_keep = C(1) / C(1 - cfg.dropout_p);
  for (int64_t r = 0; r < p_blk.rows(); ++r) {
    const uint64_t row = ((uint64_t(b.n) * cfg.Hq + b.head(r)) * cfg.L + b.query(r)) * cfg.S + j0;
    for (int64_t c = 0; c < p_blk.cols(); ++c) {
      p_blk(r, c) = dropout_keep(cfg.seed, row + c, cfg.dropout_p) ? p_blk(r, c) * inv_keep : C(0);
      if constexpr (kRounded) p_blk(r, c) = load(store<bfloat16>(p_blk(r, c)));
    }
  }
}

// The largest of row[0, n), NaN when one of them is NaN (so that the row comes out NaN, as in PyTorch): a
// vectorized max over two chains of packets (Eigen's maxCoeff reduced its packets through the stack: 2% of the
// forward at AVX-512), which may pass over a NaN, then a scan for NaN when that max is -inf. Only there does a NaN
// passed over matter: beside a finite max, the NaN makes the row's sum of exponentials NaN all the same.
template <typename T>
T row_max(const T* row, int64_t n) {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int64_t W = ei::unpacket_traits<P>::size;
  P m0 = ei::pset1<P>(neg_inf<T>()), m1 = m0;
  int64_t c = 0;
  for (; c + 2 * W <= n; c += 2 * W) {
    m0 = ei::pmax(m0, ei::ploadu<P>(row + c));
    m1 = ei::pmax(m1, ei::ploadu<P>(row + c + W));
  }
  if (c + W <= n) {
    m0 = ei::pmax(m0, ei::ploadu<P>(row + c));
    c += W;
  }
  T max = ei::predux_max(ei::pmax(m0, m1));
  for (; c < n; ++c) max = std::max(max, row[c]);
  const auto x = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(row, n);
  return max == neg_inf<T>() && x.isNaN().any() ? std::numeric_limits<T>::quiet_NaN() : max;
}

// row = exp(row - shift), exactly 0 where row is -inf; returns the row's sum. One pass over Eigen's packets. Where
// shifter_exp (float on x86-64), as 2^((row - shift) log2(e)), exp2_nonpositive being the cheaper (vector_exp.hpp);
// the scores, the max and the log-sum-exp stay natural, as PyTorch's (docs/design.md: scores scaled by log2(e) in
// the product doubled the log-sum-exp's error), and a row's largest weight is exactly 1. Where the exp gives exactly
// 0 at -inf (shifter_exp) and the shift is finite, -inf - shift is -inf and needs nothing more; else (a NaN shift,
// Eigen's generic exp, whose -inf gives a subnormal) -inf is selected to 0. The sum is in a fixed order: one partial
// sum per lane. kRounded (float): the row is left rounded to bfloat16 (round_to_bfloat16, in the registers), its
// sum taken before, as the flash numerics' P and l.
template <typename T, bool kRounded = false>
T exp_shifted_in_place(T* row, int64_t n, T shift) {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int64_t W = ei::unpacket_traits<P>::size;
  constexpr bool base2 = shifter_exp<P>();
  const P vshift = ei::pset1<P>(shift), vninf = ei::pset1<P>(neg_inf<T>()), zero = ei::pset1<P>(T(0));
  const P log2e = ei::pset1<P>(T(M_LOG2E));
  P vsum = zero;
  int64_t c = 0;
  const auto exp_packet = [&](const P& x) {
    if constexpr (base2)
      return exp2_nonpositive(ei::pmul(x, log2e));
    else
      return exp_nonpositive(x);
  };
  const auto walk = [&](auto plain) {  // (two loops: the test inside one took a slot of the exp's vector ports)
    for (; c + W <= n; c += W) {
      const P x = ei::ploadu<P>(row + c);
      const P y = exp_packet(ei::psub(x, vshift));
      const P e = plain ? y : ei::pselect(ei::pcmp_eq(x, vninf), zero, y);
      if constexpr (kRounded)
        ei::pstoreu(row + c, round_to_bfloat16(e));
      else
        ei::pstoreu(row + c, e);
      vsum = ei::padd(vsum, e);
    }
  };
  if (shifter_exp<P>() && std::isfinite(shift))
    walk(std::true_type{});
  else
    walk(std::false_type{});
  T sum = ei::predux(vsum);
  for (; c < n; ++c) {
    const T x = row[c] - shift;
    row[c] = row[c] == neg_inf<T>() ? T(0) : base2 ? std::exp2(x * T(M_LOG2E)) : std::exp(x);
    sum += row[c];
    if constexpr (kRounded) row[c] = load(store<bfloat16>(row[c]));
  }
  return sum;
}

// p_blk = exp(scores - logsumexp) row by row; rows with logsumexp = -inf (fully masked) are 0.
template <typename T>
void probs_from_lse(RowMat<T>& p_blk, const T* lse) {
  for (int64_t r = 0; r < p_blk.rows(); ++r) {
    if (lse[r] == neg_inf<T>())
      p_blk.row(r).setZero();
    else
      exp_shifted_in_place(&p_blk(r, 0), p_blk.cols(), lse[r]);
  }
}

// log(exp(a) + exp(b)), -inf when both are.
template <typename T>
T log_add_exp(T a, T b) {
  const T hi = std::max(a, b), lo = std::min(a, b);
  return hi == neg_inf<T>() ? hi : hi + std::log1p(std::exp(lo - hi));
}

// The forward with queries and output of Q: T, or T's compute type (float queries over a half-precision KV cache).
// The scores q k^T are P's products, the weighted values p v Weights' (attention_products.hpp). Where Weights
// rounds the weights to bfloat16 for its float products (flash numerics), the forward hands P to them rounded
// already: the exponentials round it as they write it (a pass of its own took 3% of the forward at AVX2), or the
// dropout once it has scaled it; its products W are then plain ones.
template <typename P, typename Weights, typename T, typename Q>
void forward(const View4<Q>& out, compute_t<T>* logsumexp, const View4<const Q>& q, const View4<const T>& k,
             const View4<const T>& v, const AttnConfig<T>& cfg) {
  using C = compute_t<T>;
  constexpr bool kRoundP = Weights::kRoundsWeights;
  using W = std::conditional_t<kRoundP, BlockProducts<T>, Weights>;
  // bl: rows per task; bs: keys per block (the causal diagonal takes edge blocks, below)
  const int64_t bl = kForwardRows, bs = key_block(cfg, Pass::forward);
  const int64_t g = cfg.group();
  // One task: a block of query rows of (n, key/value head) for some of the group's query heads. Short sequences:
  // the heads' rows stacked into one block of rows for the products (`stacked`: a decoding step's single rows need
  // it). Long ones: the whole group when that leaves 8 tasks a thread, each head's rows in turn against each key
  // block, whose K and V are packed once for all of them (GQA: at (1,12,2048,64) causal over 4 key/value heads, 3%
  // of the time was repacking); else one head a task.
  const int64_t row_blocks = ceil_div(cfg.L, bl), group = std::max<int64_t>(g, 1);
  const int64_t stack = cfg.L < bl ? std::clamp<int64_t>(bl / std::max<int64_t>(cfg.L, 1), 1, group) : 1;
  const bool stacked = stack > 1;
  const bool grouped = !stacked && cfg.N * cfg.Hk * row_blocks >= 8 * int64_t(thread_count());
  const int64_t heads_per_block = stacked ? stack : grouped ? group : 1;
  const int64_t head_blocks = ceil_div(g, heads_per_block);
  // Without a window's left end, a task takes several row blocks of its heads in turn (as many as leave
  // kTasksPerThread tasks a thread), and packs the keys they see once for all of them when they fit
  // (kHeadPack): each row block packed every key block it saw (at (1,12,1024,64), 7% of the time at AVX2).
  const bool windowed = cfg.window_left >= 0 && !stacked;
  const int64_t head_tasks = std::max<int64_t>(1, cfg.N * cfg.Hk * head_blocks);  // (>= 1: empty arrays)
  const int64_t per_task = windowed ? 1 : std::max<int64_t>(1, ceil_div(row_blocks, std::clamp<int64_t>(ceil_div(
      kTasksPerThread * int64_t(thread_count()), head_tasks), 1, std::max<int64_t>(row_blocks, 1))));
  const int64_t row_groups = ceil_div(row_blocks, per_task), tasks_per_n = cfg.Hk * head_blocks * row_groups;
  const bool round_in_exp = kRoundP && cfg.dropout_p == 0;
  parallel_for(
      cfg.N * tasks_per_n, cfg.work(),
      [&](int64_t task) {
        const int64_t n = task / tasks_per_n, hk = task % tasks_per_n / (head_blocks * row_groups);
        // (the row groups last first: under the causal mask they have the most keys, and the threads then share the
        // smaller ones at the end)
        const int64_t hb = task / row_groups % head_blocks, rg = row_groups - 1 - task % row_groups;
        const Visible vis = cfg.seq(n);
        const int64_t first_row = rg * per_task * bl, end_row = std::min(vis.L, (rg + 1) * per_task * bl);
        if (first_row >= end_row) return;
        const int64_t h0 = hk * g + hb * heads_per_block, heads = std::min(heads_per_block, (hk + 1) * g - h0);
        NextHead<T, Q> next_head;  // a task a head: the next one's rows, requested as this one's rows go
        if (head_blocks * row_groups == 1 && task + 1 < cfg.N * tasks_per_n)
          next_head = NextHead<T, Q>(q, k, v, cfg, (task + 1) / tasks_per_n, (task + 1) % tasks_per_n,
                                     heads * (end_row - first_row));
        thread_local typename P::Packed kt;               // (D, Bc) k_blk^T
        thread_local typename W::Packed vb;               // (Bc, Dv) v_blk
        thread_local typename P::Buffer q_buf;            // the block's queries
        thread_local typename W::Buffer w_buf;            // the weights as an operand
        thread_local RowMat<C> s_blk, acc;                // (Br, Bc) scores then weights; (Br, Dv) output
        thread_local Eigen::Matrix<C, Eigen::Dynamic, 1> m, l;  // (Br) running max and running sum
        thread_local Eigen::Matrix<C, Eigen::Dynamic, 1> m_new, alpha;  // (rows of a key block) the max's update
        // the group's keys packed once (keys [0, last_key + 1): first_key is 0 without a window's left end)
        const int64_t group_keys = std::min(vis.S, vis.last_key(end_row - 1) + 1);
        const bool group_shared = !windowed && end_row - first_row > bl && group_keys > 0 &&
                                  group_keys * (cfg.D + cfg.Dv) <= kHeadPack;
        if (group_shared) {
          P::pack(kt, k, n, hk, vis.k0, group_keys, cfg.D, true);
          W::pack(vb, v, n, hk, vis.k0, group_keys, cfg.Dv, false);
        }
        for (int64_t i0 = first_row; i0 < end_row; i0 += bl) {
          const RowBlock b{n, h0, heads, i0, std::min(bl, vis.L - i0)};
          const int64_t R = b.count();
          // the block's query rows (row r: head b.head(r), query b.query(r)): in place for one head (converted for
          // halves), gathered for several
          const auto query_row = [&](int64_t r) { return q.at(n, b.head(r), vis.q0 + b.query(r)); };
          const auto q_blk = b.heads == 1 ? P::rows(q_buf, q, n, h0, vis.q0 + i0, R, cfg.D)
                                          : P::gather(q_buf, query_row, R, cfg.D);
          acc.setZero(R, cfg.Dv);
          m.setConstant(R, neg_inf<C>());
          l.setZero(R);
          // rows [s0, s0 + sub_rows) walk keys [first_key(s0), last_key(s0 + sub_rows - 1)] (windowed: sub-blocks,
          // their keys in kt and vb packed once for the task when they fit: `shared`)
          const int64_t sub_rows = windowed ? kWindowRows : b.rows;
          const int64_t span0 = group_shared ? 0 : vis.first_key(i0);
          const int64_t span1 = group_shared ? group_keys : std::min(vis.S, vis.last_key(i0 + b.rows - 1) + 1);
          const bool shared = group_shared ||
                              (windowed && span1 > span0 && (span1 - span0) * (cfg.D + cfg.Dv) <= kSharedPack);
          // a few rows (a decoding step's) read the keys in place, as they do the values (attention_products.hpp)
          const bool keys_in_place = !shared && R <= kFewRows;
          if (shared && !group_shared) {
            P::pack(kt, k, n, hk, vis.k0 + span0, span1 - span0, cfg.D, true);
            W::pack(vb, v, n, hk, vis.k0 + span0, span1 - span0, cfg.Dv, false);
          }
          for (int64_t s0 = 0; s0 < b.rows; s0 += sub_rows) {
            const int64_t s1 = std::min(b.rows, s0 + sub_rows);
            int64_t j_begin = vis.first_key(i0 + s0);
            const int64_t j_end = std::min(vis.S, vis.last_key(i0 + s1 - 1) + 1);
            if (shared) j_begin = span0 + (j_begin - span0) / P::kPanel * P::kPanel;  // from a panel's start (even)
            // from `edge` on, the keys are hidden from some of the rows (the causal diagonal, a window's right end):
            // blocks of kEdgeKeys there, so that less of the hidden part is computed
            const int64_t seen_by_all = std::max<int64_t>(0, vis.last_key(i0 + s0) + 1 - j_begin);
            const int64_t edge = j_begin + seen_by_all / kEdgeKeys * kEdgeKeys;
            for (int64_t j0 = j_begin, cols; j0 < j_end; j0 += cols) {
              cols = std::min(j0 < edge ? std::min(bs, edge - j0) : kEdgeKeys, j_end - j0);
              // this key block's rows: all R rows of a stacked block, else each head's rows [r0, r0 + rows) that see
              // keys of the block (the others are hidden from it), head after head
              const int64_t r_first = std::clamp<int64_t>(vis.first_query(j0) - i0, s0, s1);
              const int64_t r_rows = std::clamp<int64_t>(vis.last_query(j0 + cols - 1) + 1 - i0, r_first, s1) - r_first;
              if (!stacked && r_rows == 0) continue;
              if (!shared && !keys_in_place) P::pack(kt, k, n, hk, vis.k0 + j0, cols, cfg.D, true);
              // v_blk packed: for the task (shared), else at the first of several heads (offset: its first row's)
              bool values_packed = shared;
              const int64_t v_row0 = shared ? j0 - span0 : 0;
              // each head's rows [r_first, r_end) in chunks (but stacked): rows that see only the block's first keys
              // (the causal diagonal, a window's right end), kDiagonalRows at a time, take only the columns up to
              // their last key's, rounded up to kDiagonalCols; the rest of the rows take all of them at once
              const int64_t r_end = r_first + r_rows;
              for (int64_t hh = 0; hh < (stacked ? 1 : b.heads); ++hh)
                for (int64_t c0 = r_first, c1; c0 < r_end; c0 = c1) {
                  // (every row of [r_first, r_end) sees keys of the block: w >= 1)
                  const Chunk chunk = stacked ? Chunk{i0 + r_end, cols}
                                              : diagonal_chunk(vis, i0 + c0, i0 + r_end, j0, cols);
                  const int64_t w = chunk.cols;
                  c1 = chunk.end - i0;
                  const RowBlock sub = stacked ? b : RowBlock{n, b.h0 + hh, 1, i0 + c0, c1 - c0};
                  const int64_t r0 = stacked ? 0 : hh * b.rows + c0, br = sub.count();
                  if (!score_block<P>(s_blk, nullptr, offset(q_blk, r0), kt, sub, w, cfg, vis, j0,
                                      shared ? j0 - span0 : 0, keys_in_place ? k.at(n, hk, vis.k0 + j0) : nullptr,
                                      k.row))
                    continue;
                  // each row's new running max, and alpha = exp(m_old - m_new), which rescales what was summed under
                  // the old max (one vectorized exp for the block's rows)
                  m_new.resize(br);
                  alpha.resize(br);
                  for (int64_t r = 0; r < br; ++r) {
                    const C blk_max = row_max(&s_blk(r, 0), w), m_old = m(r0 + r);
                    m_new(r) = std::isnan(blk_max) || blk_max > m_old ? blk_max : m_old;
                    alpha(r) = m_new(r) == neg_inf<C>() ? C(0) : m_old - m_new(r);
                  }
                  exp_shifted_in_place(alpha.data(), br, C(0));
                  for (int64_t r = 0; r < br; ++r) {
                    if (m_new(r) == neg_inf<C>()) {  // nothing visible yet in this row
                      s_blk.row(r).setZero();
                      continue;
                    }
                    C* p_row = &s_blk(r, 0);
                    const C sum = round_in_exp ? exp_shifted_in_place<C, kRoundP>(p_row, w, m_new(r))
                                               : exp_shifted_in_place(p_row, w, m_new(r));
                    l(r0 + r) = l(r0 + r) * alpha(r) + sum;
                    next_head.after_row();
                    acc.row(r0 + r) *= alpha(r);
                    m(r0 + r) = m_new(r);
                  }
                  if (cfg.dropout_p > 0) apply_dropout<kRoundP>(s_blk, cfg, sub, j0);
                  // acc += p v_blk (v_blk packed once where several heads or chunks use it)
                  C* acc_rows = acc.data() + r0 * cfg.Dv;
                  if (!values_packed && !stacked && (b.heads > 1 || c0 > r_first || c1 < r_end)) {
                    W::pack(vb, v, n, hk, vis.k0 + j0, cols, cfg.Dv, false);
                    values_packed = true;
                  }
                  if (values_packed)
                    W::weights_product(acc_rows, cfg.Dv, s_blk, w_buf, vb, cfg.Dv, C(1), Write::accumulate, v_row0);
                  else
                    W::add_weighted_values(acc_rows, s_blk, w_buf, vb, v, n, hk, vis.k0 + j0, cfg.Dv);
                }
            }
          }
          for (int64_t r = 0; r < R; ++r) {
            const int64_t h = b.head(r), i = b.query(r);
            C& lse = logsumexp[cfg.lse_index(n, h, i)];
            const C lse_prev = cfg.accumulate ? lse : neg_inf<C>();
            const C lse_keys = l(r) == 0 ? neg_inf<C>() : m(r) + std::log(l(r));
            // the output row: acc's row scaled in place (an Eigen row temporary per row was 2.9% of the
            // (8,12,256,64) causal forward at AVX-512), 0 where no key is visible (never NaN)
            C* o_row = acc.data() + r * cfg.Dv;  // (not &acc(r, 0): a reference to nothing when Dv = 0)
            C scale = 0;
            if (cfg.sinks) {  // the sink joins the denominator as a key would: l + exp(sink - m), both from mx
              const C sink = cfg.sinks[h];
              if (l(r) == 0) {
                lse = sink;
              } else {  // (not exp(lse_keys - lse): the rounding of two log-sum-exps doubled the output's error)
                const C mx = std::max(m(r), sink), keys = std::exp(m(r) - mx);
                const C denominator = l(r) * keys + std::exp(sink - mx);
                scale = keys / denominator;
                lse = mx + std::log(denominator);
              }
            } else if (l(r) == 0) {  // fully masked row
              lse = neg_inf<C>();
            } else {  // (NaN in the row's scores makes l NaN: the row's output is NaN)
              // times 1 / l, as PyTorch's CPU flash kernel: a vector division per Dv / W outputs was 2% of the
              // (8,12,256,64) forward at AVX-512, whose rows see only 256 keys
              scale = C(1) / l(r);
              lse = lse_keys;
            }
            if (l(r) == 0)
              std::fill(o_row, o_row + cfg.Dv, C(0));
            else
              for (int64_t c = 0; c < cfg.Dv; ++c) o_row[c] *= scale;
            Q* dst = out.at(n, h, vis.q0 + i);
            if (cfg.accumulate && lse_prev != neg_inf<C>()) {  // o = (o_prev e^lse_prev + o_keys e^lse_keys) / e^lse
              lse = log_add_exp(lse_prev, lse);
              const C w_prev = std::exp(lse_prev - lse), w_keys = l(r) == 0 ? C(0) : std::exp(lse_keys - lse);
              for (int64_t c = 0; c < cfg.Dv; ++c) o_row[c] = w_prev * load(dst[c]) + w_keys * o_row[c];
            }
            store_n(dst, o_row, cfg.Dv);  // rounded once, for halves
          }
        }
        next_head.rest();
      });
}

// The backward: the products of two inputs (q k^T, dO v^T) are P's, those of the weights or their gradient (P^T dO,
// dS k, dS^T q) W's (attention_products.hpp).
template <typename P, typename W, typename T>
void backward(const View4<T>& dq, const View4<T>& dk, const View4<T>& dv, compute_t<T>* dsinks,
              const View4<const T>& dout, const View4<const T>& out, const compute_t<T>* logsumexp,
              const View4<const T>& q, const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg) {
  using C = compute_t<T>;
  // The softmax backward's term delta = rowsum(dout * out) = sum_j P_ij dP_ij (dropout included), per row: from
  // dout and out for float and double, and for bfloat16 under flash numerics (as PyTorch's CPU flash kernel); else
  // for the halves from the blocks' P and dP, in a first walk over the task's blocks: the output was rounded to half
  // precision, and delta from it would carry that rounding into every dS = P (dP - delta), dq and dk (up to 5 times
  // the error of PyTorch's float32-internal math backend). Summed in a fixed order, so results are reproducible,
  // and with mul_add, as the products sum dP: where a row sees one key, dP - delta is exactly 0.
  const bool delta_from_blocks = is_half<T> && !cfg.flash_numerics;
  const int64_t bs = key_block(cfg, Pass::backward), g = cfg.group();
  std::vector<C> dsink_nh(cfg.sinks && dsinks ? cfg.N * cfg.Hq : 0);  // each (n, h)'s share of the sinks' gradient
  // One thread owns a (n, key/value head) pair: it alone writes that pair's dk, dv and, since each query head
  // belongs to one key/value head, its query heads' dq. Each is summed in the compute type (dq over the task, dk and
  // dv over a key block) and added to the output once, rounded once for halves.
  parallel_for(
      cfg.N * cfg.Hk, cfg.work(),
      [&](int64_t task) {
        const int64_t n = task / cfg.Hk, hk = task % cfg.Hk;
        const Visible vis = cfg.seq(n);
        thread_local typename P::Packed kt, vt;            // k_blk^T, v_blk^T
        thread_local typename W::Packed kp, qp, dop;       // k_blk, q_blk, dout_blk
        thread_local typename P::Buffer q_buf, do_buf;     // the blocks' rows
        thread_local typename W::Buffer w_buf;             // the weights or their gradient as an operand
        thread_local RowMat<C> p_blk, dp_blk, pd_blk, dcap;  // (Br, Bc)
        thread_local RowMat<C> dq_acc, dk_acc, dv_acc;     // (g * L, D) the group's dq; (Bc, D), (Bc, Dv)
        thread_local std::vector<C> delta;                 // (g * L) the group's rows' delta
        delta.assign(std::size_t(g * vis.L), C(0));
        if (!delta_from_blocks)
          for (int64_t r = 0; r < g * vis.L; ++r) {
            const T *do_row = dout.at(n, hk * g + r / vis.L, vis.q0 + r % vis.L);
            const T *o_row = out.at(n, hk * g + r / vis.L, vis.q0 + r % vis.L);
            for (int64_t c = 0; c < cfg.Dv; ++c) delta[r] = mul_add(load(do_row[c]), load(o_row[c]), delta[r]);
          }
        // One walk over the task's blocks: with delta_walk, it sums its rows' delta; else the gradients.
        const auto walk = [&](bool delta_walk) {
          for (int64_t j0 = 0; j0 < vis.S; j0 += bs) {
            const int64_t width = std::min(bs, vis.S - j0);
            // the query rows [i_begin, i_end) that see keys of this block
            const int64_t i_begin = std::max<int64_t>(0, vis.first_query(j0));
            const int64_t i_end = std::min(vis.L, vis.last_query(j0 + width - 1) + 1);
            if (i_begin >= i_end) continue;
            P::pack(kt, k, n, hk, vis.k0 + j0, width, cfg.D, true);
            P::pack(vt, v, n, hk, vis.k0 + j0, width, cfg.Dv, true);
            if (!delta_walk) {
              W::pack(kp, k, n, hk, vis.k0 + j0, width, cfg.D, false);
              dk_acc.setZero(width, cfg.D);
              dv_acc.setZero(width, cfg.Dv);
            }
            // each row block in chunks, as the forward's: rows that see only the key block's first keys (the causal
            // diagonal), kDiagonalRows at a time, over those keys rounded up to kDiagonalCols; the rest at once
            for (int64_t h = hk * g; h < (hk + 1) * g; ++h)
              for (int64_t i0 = i_begin / kBackwardRows * kBackwardRows; i0 < i_end; i0 += kBackwardRows) {
                const int64_t i1 = std::min(i0 + kBackwardRows, vis.L);
                const int64_t cols = std::min(width, vis.last_key(i1 - 1) + 1 - j0);
                for (int64_t c0 = i0, c1; c0 < i1; c0 = c1) {
                  const Chunk chunk = diagonal_chunk(vis, c0, i1, j0, cols);
                  const int64_t w = chunk.cols;
                  c1 = chunk.end;
                  if (w <= 0) continue;  // (rows above the block's first key)
                  const RowBlock b{n, h, 1, c0, c1 - c0};
                  const int64_t rows = b.rows;
                  const auto q_blk = P::rows(q_buf, q, n, h, vis.q0 + c0, rows, cfg.D);
                  const C* lse = logsumexp + cfg.lse_index(n, h, c0);
                  C* dlt = delta.data() + (h - hk * g) * vis.L + c0;
                  // s = softcap(scale * q k^T) + bias;  p = exp(s - lse)
                  if (!score_block<P>(p_blk, delta_walk ? nullptr : &dcap, q_blk, kt, b, w, cfg, vis, j0)) continue;
                  probs_from_lse(p_blk, lse);
                  // dp_dropped = dout v^T            <- out = p_dropped v
                  const auto do_blk = P::rows(do_buf, dout, n, h, vis.q0 + c0, rows, cfg.Dv);
                  dp_blk.resize(rows, w);
                  P::product(dp_blk.data(), w, do_blk, vt, rows, w, cfg.Dv, C(1), Write::assign);
                  const RowMat<C>* p_used = &p_blk;  // the weights that multiplied v in the forward
                  if (cfg.dropout_p > 0) {
                    pd_blk = p_blk;
                    apply_dropout(pd_blk, cfg, b, j0);
                    apply_dropout(dp_blk, cfg, b, j0);  // dp = dp_dropped * keep / (1 - p)
                    p_used = &pd_blk;
                  }
                  if (delta_walk) {  // delta += rowsum(p * dp) over this block's keys
                    for (int64_t r = 0; r < rows; ++r)
                      for (int64_t c = 0; c < w; ++c) dlt[r] += p_blk(r, c) * dp_blk(r, c);
                    continue;
                  }
                  // dv += p_used^T dout
                  W::pack(dop, dout, n, h, vis.q0 + c0, rows, cfg.Dv, false);
                  W::weights_t_product(dv_acc.data(), cfg.Dv, *p_used, w_buf, dop, cfg.Dv, C(1), Write::accumulate);
                  // ds = p * (dp - delta)            <- p = softmax(s)
                  for (int64_t r = 0; r < rows; ++r) p_blk.row(r).array() *= dp_blk.row(r).array() - dlt[r];
                  // ds_raw = ds * (1 - tanh^2)       <- s = softcap * tanh(s_raw / softcap)
                  if (cfg.softcap > 0) p_blk.array() *= dcap.array();
                  // dq += scale * ds k;  dk += scale * ds^T q   <- s_raw = scale * q k^T
                  W::weights_product(dq_acc.data() + ((h - hk * g) * vis.L + c0) * cfg.D, cfg.D, p_blk, w_buf, kp,
                                     cfg.D, cfg.scale, Write::accumulate);
                  W::pack(qp, q, n, h, vis.q0 + c0, rows, cfg.D, false);
                  W::weights_t_product(dk_acc.data(), cfg.D, p_blk, w_buf, qp, cfg.D, cfg.scale, Write::accumulate);
                }
              }
            if (!delta_walk) {
              add_rows(dk, n, hk, vis.k0 + j0, dk_acc.data(), width, cfg.D);
              add_rows(dv, n, hk, vis.k0 + j0, dv_acc.data(), width, cfg.Dv);
            }
          }
        };
        if (delta_from_blocks) walk(true);
        // the sinks' gradient: dsink_h = -sum_(n, i) P_(n,h,i),sink delta_(n,h,i)  <- the sink takes no value
        if (!dsink_nh.empty())
          for (int64_t h = hk * g; h < (hk + 1) * g; ++h)
            for (int64_t i = 0; i < vis.L; ++i) {
              const C lse = logsumexp[cfg.lse_index(n, h, i)];
              if (lse != neg_inf<C>())
                dsink_nh[n * cfg.Hq + h] -= std::exp(cfg.sinks[h] - lse) * delta[(h - hk * g) * vis.L + i];
            }
        dq_acc.setZero(g * vis.L, cfg.D);
        walk(false);
        for (int64_t h = 0; h < g; ++h)
          add_rows(dq, n, hk * g + h, vis.q0, dq_acc.data() + h * vis.L * cfg.D, vis.L, cfg.D);
      });
  for (std::size_t nh = 0; nh < dsink_nh.size(); ++nh) dsinks[nh % cfg.Hq] += dsink_nh[nh];
}

// Calls f(P{}, W{}) with the product policies of a call on arrays of T (attention_products.hpp): the products of
// two inputs P's, those of the weights or their gradient W's; bfloat16 pairs at the avx512_bf16 level when the
// arrays can be read as pairs, else in float with the weights rounded to bfloat16 under flash numerics.
template <typename T, typename F>
void with_products(const AttnConfig<T>& cfg, [[maybe_unused]] std::initializer_list<const View4<const T>*> arrays,
                   F&& f) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bfloat16>)
    if (PairProducts::fit(arrays, {cfg.D, cfg.Dv}))
      return cfg.flash_numerics ? f(PairProducts{}, PairProducts{}) : f(PairProducts{}, BlockProducts<T>{});
#endif
  if constexpr (std::is_same_v<T, bfloat16>)
    if (cfg.flash_numerics) return f(BlockProducts<T>{}, BlockProducts<T, true>{});
  f(BlockProducts<T>{}, BlockProducts<T>{});
}

}  // namespace

template <typename T>
void sdpa_forward(const View4<T>& out, compute_t<T>* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const View4<const T>& v, const AttnConfig<T>& cfg) {
  with_products(cfg, {&q, &k, &v}, [&](auto p, auto w) {
    forward<decltype(p), decltype(w)>(out, logsumexp, q, k, v, cfg);
  });
}

template <typename T>
void sdpa_forward_wide_queries(const View4<compute_t<T>>& out, compute_t<T>* logsumexp,
                               const View4<const compute_t<T>>& q, const View4<const T>& k, const View4<const T>& v,
                               const AttnConfig<T>& cfg) {
  forward<BlockProducts<T>, BlockProducts<T>>(out, logsumexp, q, k, v, cfg);
}

template <typename T>
void sdpa_backward(const View4<T>& dq, const View4<T>& dk, const View4<T>& dv, compute_t<T>* dsinks,
                   const View4<const T>& dout, const View4<const T>& out, const compute_t<T>* logsumexp,
                   const View4<const T>& q, const View4<const T>& k, const View4<const T>& v,
                   const AttnConfig<T>& cfg) {
  with_products(cfg, {&q, &k, &v, &dout}, [&](auto p, auto w) {
    backward<decltype(p), decltype(w)>(dq, dk, dv, dsinks, dout, out, logsumexp, q, k, v, cfg);
  });
}

template <typename T>
void sdpa_weights(T* weights, const compute_t<T>* logsumexp, const View4<const T>& q, const View4<const T>& k,
                  const AttnConfig<T>& cfg, bool average_heads) {
  using C = compute_t<T>;
  using P = BlockProducts<T>;  // (the weights are for inspection: computed in the compute type)
  const int64_t bs = key_block(cfg, Pass::weights), q_blocks = ceil_div(cfg.L, kForwardRows);
  const int64_t k_blocks = ceil_div(cfg.S, bs);
  const int64_t heads_out = average_heads ? 1 : cfg.Hq;
  parallel_for(
      cfg.N * heads_out * q_blocks, cfg.work(),
      [&](int64_t task) {
        const int64_t n = task / (heads_out * q_blocks), ho = task / q_blocks % heads_out, qb = task % q_blocks;
        const Visible vis = cfg.seq(n);
        thread_local typename P::Packed kt;  // (D, Bc) k_blk^T
        thread_local typename P::Buffer q_buf;
        thread_local RowMat<C> p_blk, w;     // (Br, Bc) weights, their sum over heads
        const int64_t i0 = qb * kForwardRows, rows = std::min(kForwardRows, cfg.L - i0);
        // one head, or all of them summed in order (then divided by Hq, as PyTorch's mean over heads)
        const int64_t h_begin = average_heads ? 0 : ho, h_end = average_heads ? cfg.Hq : ho + 1;
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          const int64_t j0 = kb * bs, cols = std::min(bs, cfg.S - j0);
          for (int64_t h = h_begin; h < h_end; ++h) {
            const RowBlock b{n, h, 1, i0, rows};
            P::pack(kt, k, n, h / cfg.group(), j0, cols, cfg.D, true);
            score_block<P>(p_blk, nullptr, P::rows(q_buf, q, n, h, i0, rows, cfg.D), kt, b, cols, cfg, vis, j0);
            probs_from_lse(p_blk, logsumexp + cfg.lse_index(n, h, i0));
            if (cfg.dropout_p > 0) apply_dropout(p_blk, cfg, b, j0);
            if (h == h_begin)
              w = p_blk;
            else
              w += p_blk;
          }
          if (h_begin == h_end)  // the mean over no heads (Hq = 0), NaN as in PyTorch
            w.setConstant(rows, cols, std::numeric_limits<C>::quiet_NaN());
          else if (average_heads)
            w /= C(cfg.Hq);
          for (int64_t r = 0; r < rows; ++r)
            store_n(weights + ((n * heads_out + ho) * cfg.L + i0 + r) * cfg.S + j0, w.data() + r * cols, cols);
        }
      });
}

double forward_products(int64_t D, int64_t steps) {
  const int64_t rows = kForwardRows, keys = forward_keys(D, D);
  return bench_tasks(4.0 * double(rows * keys * D) * double(steps), [&](int64_t) {
    // the thread's blocks, allocated at its first task (a page fault per 4 KiB, not timed again); small values: no
    // subnormal (slow on x86-64), no overflow in acc's sums over the steps
    thread_local std::vector<float> q, kv, scores, acc;
    thread_local PackedB<float> kt, vb;
    q.assign(std::size_t(rows * D), 0x1p-4f);
    kv.assign(std::size_t(keys * D), 0x1p-4f);
    scores.resize(std::size_t(rows * keys));
    acc.assign(std::size_t(rows * D), 0.f);
    kt.pack(kv.data(), 1, D, D, keys);  // (D, keys): k_blk^T
    vb.pack(kv.data(), D, 1, keys, D);  // (keys, D): v_blk
    for (int64_t s = 0; s < steps; ++s) {
      gemm(scores.data(), keys, row_major(q.data(), D), kt, rows, keys, D, 0x1p-3f, Write::assign);
      gemm(acc.data(), D, row_major(scores.data(), keys), vb, rows, D, keys, 0x1p-10f, Write::accumulate);
    }
    asm volatile("" : : "r"(acc.data()) : "memory");  // (acc, which nothing reads, must still be computed)
  });
}

#define INSTANTIATE(T)                                                                                         \
  template void sdpa_forward<T>(const View4<T>&, compute_t<T>*, const View4<const T>&, const View4<const T>&, \
                                const View4<const T>&, const AttnConfig<T>&);                                 \
  template void sdpa_forward_wide_queries<T>(const View4<compute_t<T>>&, compute_t<T>*,                       \
                                             const View4<const compute_t<T>>&, const View4<const T>&,          \
                                             const View4<const T>&, const AttnConfig<T>&);                     \
  template void sdpa_backward<T>(const View4<T>&, const View4<T>&, const View4<T>&, compute_t<T>*,            \
                                 const View4<const T>&, const View4<const T>&, const compute_t<T>*,           \
                                 const View4<const T>&, const View4<const T>&, const View4<const T>&,         \
                                 const AttnConfig<T>&);                                                       \
  template void sdpa_weights<T>(T*, const compute_t<T>*, const View4<const T>&, const View4<const T>&,        \
                                const AttnConfig<T>&, bool);
ATTNPP_FOR_ALL_DTYPES(INSTANTIATE)

}  // namespace attnpp::ATTNPP_CPU_NS
