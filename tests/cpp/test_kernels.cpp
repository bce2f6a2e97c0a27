// Standalone test of ONE CPU level's kernels (the namespace attnpp::ATTNPP_CPU_NS, through its table `kernels`)
// against naive references in double: sdpa forward (out, logsumexp) and backward (dq, dk, dv), linear forward
// and backward, the fused linear + cross-entropy (losses, dx, dw, db), rotary embedding forward and backward, in
// float32, float64, bfloat16 and float16 (the references
// computed from the same rounded inputs; the halves within two roundings of their dtype). No Python, no
// framework: one line per check, then "N passed, N failed".
// Built and run per level (natively, and under qemu for aarch64 and an old x86-64) by tools/cross_check.sh, e.g.
//   g++ -O3 -fno-math-errno -fopenmp -std=c++17 -march=x86-64-v3 -DATTNPP_CPU_NS=cpu_avx2
//       -DEIGEN_GEMM_TO_COEFFBASED_THRESHOLD=0 -Icpp -I<eigen3> tests/cpp/test_kernels.cpp cpp/{attention,...}.cpp
//       cpp/threads.cpp cpp/buffer_pool.cpp
// (without -fopenmp, threads.cpp runs the parallel loops on its std::thread pool).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "gemm.hpp"
#include "kernels.hpp"
#include "vector_exp.hpp"

using namespace attnpp;

// kernels.hpp declares a level's table only when the build has that level (ATTNPP_HAS_LEVEL_*); this test builds
// exactly one, whichever it is.
namespace attnpp::ATTNPP_CPU_NS {
extern const KernelSet kernels;
}

#define STR2(x) #x
#define STR(x) STR2(x)

static int passed = 0, failed = 0;
static const int kThreads = thread_count();  // (threads.cpp's default: OMP_NUM_THREADS, else the CPUs)

template <typename T> const Kernels<T>& table();
template <> const Kernels<float>& table<float>() { return ATTNPP_CPU_NS::kernels.f32; }
template <> const Kernels<double>& table<double>() { return ATTNPP_CPU_NS::kernels.f64; }
template <> const Kernels<bfloat16>& table<bfloat16>() { return ATTNPP_CPU_NS::kernels.bf16; }
template <> const Kernels<float16>& table<float16>() { return ATTNPP_CPU_NS::kernels.f16; }
template <typename T> const char* dtype_name() {
  return std::is_same_v<T, float> ? "float32" : std::is_same_v<T, double> ? "float64"
       : std::is_same_v<T, bfloat16> ? "bfloat16" : "float16";
}
// float32 and float64: their parity tolerances; the halves: two unit roundoffs of the dtype (the output's rounding,
// and one more), 2 * 2^-8 for bfloat16 and 2 * 2^-11 for float16; bfloat16 under flash numerics (the weights and
// their gradient rounded for their products, delta from the rounded output): four (`units`).
template <typename T> double tolerance(int units = 2) {
  return std::is_same_v<T, float> ? 1e-5 : std::is_same_v<T, double> ? 1e-12
       : std::is_same_v<T, bfloat16> ? units * 0x1p-8 : units * 0x1p-11;
}
// A value of T as double, and a double as T (rounded to nearest for the halves).
template <typename T> double dbl(T x) { return double(load(x)); }
template <typename T> T from_double(double x) { return store<T>(compute_t<T>(x)); }

// One check's line: its largest error against its tolerance.
void check_error(const std::string& what, double err, double tol) {
  const bool ok = err <= tol;
  (ok ? passed : failed)++;
  std::printf("%s %-58s max rel err %.2e (tol %.0e)\n", ok ? "PASS" : "FAIL", what.c_str(), err, tol);
}

// Max error relative to max(1, |ref|); infinities must match exactly, NaN never does.
template <typename T>
void check(const std::string& what, const std::vector<T>& got, const std::vector<double>& ref,
           double tol = tolerance<T>()) {
  double err = got.size() == ref.size() ? 0 : INFINITY;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    const double g = dbl(got[i]), r = ref[i];
    const double e = (std::isinf(g) || std::isinf(r)) ? (g == r ? 0 : INFINITY)
                                                       : std::fabs(g - r) / std::max(1.0, std::fabs(r));
    err = std::isnan(e) ? INFINITY : std::max(err, e);
  }
  check_error(what, err, tol);
}

void check_true(const std::string& what, bool ok) {
  (ok ? passed : failed)++;
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
}

// Deterministic inputs in [lo, hi) on every platform (SplitMix64 from common.hpp, not <random>).
template <typename T>
std::vector<T> uniform(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = from_double<T>(lo + (hi - lo) * double(mix64(seed * 1000003 + i) >> 11) * 0x1p-53);
  return v;
}
template <typename T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> w(v.size());
  std::transform(v.begin(), v.end(), w.begin(), [](T x) { return dbl(x); });
  return w;
}

// ------------------------------------------------------------------------------------------------ attention
struct Case {
  const char* name;
  int64_t N, Hq, Hk, L, S, D, Dv;
  Causal causal = Causal::none;
  bool masks = false;       // an additive (N, 1, L, S) mask with -inf holes and a fully masked row, plus an (N, S) one
  double dropout_p = 0;
  bool interleaved = false; // buffers laid out (N, rows, H, cols), as MultiheadAttention passes them
  int64_t window_left = -1, window_right = -1;  // sliding window, keys [i + S - L - left, i + S - L + right]
  double softcap = 0;       // scores -> softcap * tanh(scores / softcap)
  bool alibi = false;       // slopes 0.5, 0.25, ... per query head: score -= slope * |i + S - L - j|
  bool sinks = false;       // a logit per head in the softmax's denominator: 0.5, -0.5, 1.5, ...
};

// A (N, H, rows, cols) tensor in either layout: its View4 strides and element (n, h, r, c)'s offset.
struct Layout {
  int64_t N, H, rows, cols;
  bool interleaved;
  int64_t sn() const { return H * rows * cols; }
  int64_t sh() const { return interleaved ? cols : rows * cols; }
  int64_t sr() const { return interleaved ? H * cols : cols; }
  size_t size() const { return size_t(N * H * rows * cols); }
  size_t at(int64_t n, int64_t h, int64_t r, int64_t c) const { return size_t(n * sn() + h * sh() + r * sr() + c); }
  template <typename T> View4<T> view(T* p) const { return {p, sn(), sh(), sr()}; }
};

// The additive masks: values in [-2, 2), every 7th -inf, all of row (0, 5) -inf; keys S-3.. padded out for n = 1.
template <typename T>
void make_masks(const Case& c, std::vector<T>& full, std::vector<T>& pad) {
  full = uniform<T>(size_t(c.N * c.L * c.S), 99, -2, 2);
  const T hole = from_double<T>(-INFINITY);
  for (size_t i = 0; i < full.size(); i += 7) full[i] = hole;
  for (int64_t j = 0; j < c.S; ++j) full[size_t(5 * c.S + j)] = hole;
  pad.assign(size_t(c.N * c.S), from_double<T>(0));
  for (int64_t j = std::max<int64_t>(0, c.S - 3); j < c.S && c.N > 1; ++j) pad[size_t(c.S + j)] = hole;
}

// Naive attention in double: forward (out, lse) and backward (+= into dq, dk, dv) from the same inputs.
struct Reference {
  std::vector<double> out, lse, dq, dk, dv, dsinks;
};
template <typename T>
Reference reference(const Case& c, const AttnConfig<T>& cfg, const Layout& lq, const Layout& lk, const Layout& lv,
                    const Layout& lo, const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                    const std::vector<T>& dout, const std::vector<T>& dq0, const std::vector<T>& dk0,
                    const std::vector<T>& dv0) {
  Reference R{std::vector<double>(lo.size()), std::vector<double>(size_t(c.N * c.Hq * c.L)), widen(dq0), widen(dk0),
              widen(dv0), std::vector<double>(size_t(c.Hq))};
  std::vector<double> s(c.S), p(c.S), keep(c.S), dcap(c.S, 1.0);
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t h = 0; h < c.Hq; ++h) {
      const int64_t hk = h / (c.Hq / c.Hk);
      for (int64_t i = 0; i < c.L; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j < c.S; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < c.D; ++d) dot += dbl(q[lq.at(n, h, i, d)]) * dbl(k[lk.at(n, hk, j, d)]);
          s[j] = double(cfg.scale) * dot;
          if (c.softcap > 0) {
            const double t = std::tanh(s[j] / c.softcap);
            s[j] = c.softcap * t, dcap[j] = 1 - t * t;
          }
          for (const auto& mv : cfg.masks) s[j] += double(mv.at(n, h, i, j));
          if (c.alibi) s[j] -= double(cfg.alibi[h]) * std::abs(double(i + c.S - c.L - j));
          const int64_t diag = c.S - c.L;
          const bool hidden = (c.causal != Causal::none && j > i + (c.causal == Causal::bottom_right ? diag : 0)) ||
                              (c.window_left >= 0 && j < i + diag - c.window_left) ||
                              (c.window_right >= 0 && j > i + diag + c.window_right);
          if (hidden) s[j] = -INFINITY;
          m = std::max(m, s[j]);
          const uint64_t index = uint64_t(((n * c.Hq + h) * c.L + i) * c.S + j);
          keep[j] = c.dropout_p == 0 ? 1 : dropout_keep(cfg.seed, index, c.dropout_p) / (1 - c.dropout_p);
        }
        double& lse = R.lse[size_t((n * c.Hq + h) * c.L + i)];
        const double sink = c.sinks ? double(cfg.sinks[h]) : -INFINITY;
        if (m == -INFINITY) {  // fully masked row: out 0 (already), lse -inf (or the sink's), no gradient
          lse = sink;
          continue;
        }
        double sum = std::exp(sink - m);
        for (int64_t j = 0; j < c.S; ++j) sum += std::exp(s[j] - m);
        lse = m + std::log(sum);
        for (int64_t j = 0; j < c.S; ++j) p[j] = std::exp(s[j] - lse);
        // out = (p * keep) v;  dp = (dout . v_j) * keep;  ds = p (dp - sum_j p dp);  s = scale q k^T
        std::vector<double> dp(c.S);
        double delta = 0;
        for (int64_t j = 0; j < c.S; ++j) {
          double g = 0;
          for (int64_t e = 0; e < c.Dv; ++e) {
            R.out[lo.at(n, h, i, e)] += p[j] * keep[j] * dbl(v[lv.at(n, hk, j, e)]);
            R.dv[lv.at(n, hk, j, e)] += p[j] * keep[j] * dbl(dout[lo.at(n, h, i, e)]);
            g += dbl(dout[lo.at(n, h, i, e)]) * dbl(v[lv.at(n, hk, j, e)]);
          }
          dp[j] = g * keep[j];
          delta += p[j] * dp[j];
        }
        if (c.sinks) R.dsinks[h] -= std::exp(sink - lse) * delta;  // the sink's p times (0 - delta)
        for (int64_t j = 0; j < c.S; ++j) {
          const double ds = double(cfg.scale) * p[j] * (dp[j] - delta) * dcap[j];
          for (int64_t d = 0; d < c.D; ++d) {
            R.dq[lq.at(n, h, i, d)] += ds * dbl(k[lk.at(n, hk, j, d)]);
            R.dk[lk.at(n, hk, j, d)] += ds * dbl(q[lq.at(n, h, i, d)]);
          }
        }
      }
    }
  return R;
}

template <typename T>
void test_sdpa(const Case& c) {
  const Layout lq{c.N, c.Hq, c.L, c.D, c.interleaved}, lk{c.N, c.Hk, c.S, c.D, c.interleaved},
      lv{c.N, c.Hk, c.S, c.Dv, c.interleaved}, lo{c.N, c.Hq, c.L, c.Dv, c.interleaved};
  const auto q = uniform<T>(lq.size(), 1), k = uniform<T>(lk.size(), 2), v = uniform<T>(lv.size(), 3),
             dout = uniform<T>(lo.size(), 4);
  // the backward accumulates: start from nonzero gradients
  const auto dq0 = uniform<T>(lq.size(), 5), dk0 = uniform<T>(lk.size(), 6), dv0 = uniform<T>(lv.size(), 7);
  AttnConfig<T> cfg;
  cfg.N = c.N, cfg.Hq = c.Hq, cfg.Hk = c.Hk, cfg.L = c.L, cfg.S = c.S, cfg.D = c.D, cfg.Dv = c.Dv;
  using C = compute_t<T>;
  cfg.scale = C(1 / std::sqrt(double(c.D)));
  cfg.causal = c.causal;
  cfg.dropout_p = c.dropout_p;
  cfg.seed = 12345;
  cfg.window_left = c.window_left, cfg.window_right = c.window_right, cfg.softcap = C(c.softcap);
  std::vector<C> slopes, sinks;
  for (int64_t h = 0; h < c.Hq; ++h) {
    slopes.push_back(C(std::ldexp(1.0, int(-1 - h))));
    sinks.push_back(C(0.5 - (h % 2) + h));
  }
  if (c.alibi) cfg.alibi = slopes.data();
  if (c.sinks) cfg.sinks = sinks.data();
  std::vector<T> full, pad;
  std::vector<int64_t> full_offset, pad_offset;
  if (c.masks) {
    make_masks(c, full, pad);
    for (int64_t n = 0; n < c.N; ++n) full_offset.push_back(n * c.L * c.S), pad_offset.push_back(n * c.S);
    cfg.masks.push_back({full.data(), full_offset.data(), 0, c.S, 1});  // (N, 1, L, S)
    cfg.masks.push_back({pad.data(), pad_offset.data(), 0, 0, 1});      // (N, 1, 1, S): key padding
  }

  // The kernels' results at a given thread count (the OpenMP path and the plain loop must agree bitwise).
  struct Got {
    std::vector<T> out;
    std::vector<C> lse;
    std::vector<T> dq, dk, dv;
    std::vector<C> dsinks;
  };
  const auto run = [&](int threads) {
    set_thread_count(threads);
    Got g{std::vector<T>(lo.size()), std::vector<C>(size_t(c.N * c.Hq * c.L)), dq0, dk0, dv0,
          std::vector<C>(size_t(c.Hq))};
    const auto& K = table<T>();
    K.sdpa_forward(lo.view(g.out.data()), g.lse.data(), lq.view(q.data()), lk.view(k.data()), lv.view(v.data()),
                   cfg);
    K.sdpa_backward(lq.view(g.dq.data()), lk.view(g.dk.data()), lv.view(g.dv.data()), g.dsinks.data(),
                    lo.view(dout.data()), lo.view<const T>(g.out.data()), g.lse.data(), lq.view(q.data()), lk.view(k.data()),
                    lv.view(v.data()), cfg);
    return g;
  };
  const Reference R = reference(c, cfg, lq, lk, lv, lo, q, k, v, dout, dq0, dk0, dv0);
  // bfloat16: the float32 numerics, then the flash numerics (AttnConfig::flash_numerics)
  for (const bool flash : {false, true}) {
    if (flash && !std::is_same_v<T, bfloat16>) break;
    cfg.flash_numerics = flash;
    const Got g = run(std::max(2, kThreads));
    const std::string tag = std::string("sdpa ") + c.name + " " + dtype_name<T>() + (flash ? " flash " : " ");
    // (the log-sum-exp and the sinks' gradient are of the compute type; the latter takes delta from the rounded
    // output under flash numerics)
    const double tol = tolerance<T>(flash ? 4 : 2);
    check(tag + "out", g.out, R.out, tol);
    check(tag + "logsumexp", g.lse, R.lse);
    check(tag + "dq", g.dq, R.dq, tol);
    check(tag + "dk", g.dk, R.dk, tol);
    check(tag + "dv", g.dv, R.dv, tol);
    if (c.sinks) check(tag + "dsinks", g.dsinks, R.dsinks, flash ? tol : tolerance<C>());
    const Got one = run(1);
    check_true(tag + "1 thread == " + std::to_string(std::max(2, kThreads)) + " threads, bitwise",
               one.out == g.out && one.lse == g.lse && one.dq == g.dq && one.dk == g.dk && one.dv == g.dv &&
                   one.dsinks == g.dsinks);
  }
}

// --------------------------------------------------------------------------------------------------- linear
template <typename T>
void test_linear(int64_t M, int64_t Fin, int64_t Fout, bool bias, bool need_dx) {
  const auto x = uniform<T>(size_t(M * Fin), 11), w = uniform<T>(size_t(Fout * Fin), 12),
             b = uniform<T>(size_t(Fout), 13), dy = uniform<T>(size_t(M * Fout), 14);
  auto dx = uniform<T>(size_t(M * Fin), 15), dw = uniform<T>(size_t(Fout * Fin), 16), db = uniform<T>(size_t(Fout), 17);
  std::vector<double> y_ref(size_t(M * Fout)), dx_ref = widen(dx), dw_ref = widen(dw), db_ref = widen(db);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t o = 0; o < Fout; ++o) {
      double acc = bias ? dbl(b[o]) : 0;
      for (int64_t f = 0; f < Fin; ++f) {
        acc += dbl(x[r * Fin + f]) * dbl(w[o * Fin + f]);
        dx_ref[r * Fin + f] += dbl(dy[r * Fout + o]) * dbl(w[o * Fin + f]);
        dw_ref[o * Fin + f] += dbl(dy[r * Fout + o]) * dbl(x[r * Fin + f]);
      }
      y_ref[r * Fout + o] = acc;
      db_ref[o] += dbl(dy[r * Fout + o]);
    }
  std::vector<T> y(size_t(M * Fout));
  table<T>().linear_forward(y.data(), x.data(), w.data(), bias ? b.data() : nullptr, M, Fin, Fout);
  const auto dx0 = dx, db0 = db;
  table<T>().linear_backward(need_dx ? dx.data() : nullptr, dw.data(), bias ? db.data() : nullptr, dy.data(), x.data(),
                             w.data(), M, Fin, Fout);
  char tag[96];
  std::snprintf(tag, sizeof tag, "linear M=%lld Fin=%lld Fout=%lld%s%s %s ", (long long)M, (long long)Fin,
                (long long)Fout, bias ? "" : " no-bias", need_dx ? "" : " no-dx", dtype_name<T>());
  check(std::string(tag) + "y", y, y_ref);
  check(std::string(tag) + "dw", dw, dw_ref);
  if (need_dx) check(std::string(tag) + "dx", dx, dx_ref);
  else check_true(std::string(tag) + "dx=nullptr left alone", dx == dx0);
  if (bias) check(std::string(tag) + "db", db, db_ref);
  else check_true(std::string(tag) + "db=nullptr left alone", db == db0);
}

// ------------------------------------------------------------------------------------- linear + cross-entropy
// losses and the gradients of x (N, E), w (V, E) and b (V) for row weights g (the backward of sum_i g_i loss_i),
// with label smoothing eps and one ignored row (the second), the logits soft-capped by cap > 0 (y = cap tanh(z /
// cap)); E narrow (vocabulary blocks) or wide (row chunks)
template <typename T>
void test_linear_cross_entropy(int64_t N, int64_t E, int64_t V, double eps, double cap = 0) {
  using C = compute_t<T>;
  const auto x = uniform<T>(size_t(N * E), 21, -2, 2), w = uniform<T>(size_t(V * E), 22), b = uniform<T>(size_t(V), 23);
  const size_t n = size_t(N), nv = size_t(V);  // (`target(size_t(N))` would declare a function)
  std::vector<int64_t> target(n);
  for (int64_t i = 0; i < N; ++i) target[i] = i == 1 ? -100 : int64_t(mix64(uint64_t(31 + i)) % uint64_t(V));
  std::vector<C> g(n);
  for (int64_t i = 0; i < N; ++i) g[i] = C(0.5 + 0.25 * double(i % 3));
  std::vector<double> loss_ref(n), dx_ref(size_t(N * E)), dw_ref(size_t(V * E)), db_ref(nv);
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> z(nv);
    double m = -INFINITY, s = 0, zsum = 0;
    for (int64_t j = 0; j < V; ++j) {
      z[j] = dbl(b[j]);
      for (int64_t f = 0; f < E; ++f) z[j] += dbl(x[i * E + f]) * dbl(w[j * E + f]);
      if (cap > 0) z[j] = cap * std::tanh(z[j] / cap);
      m = std::max(m, z[j]), zsum += z[j];
    }
    for (int64_t j = 0; j < V; ++j) s += std::exp(z[j] - m);
    const double lse = m + std::log(s);
    if (target[i] < 0) continue;
    loss_ref[i] = lse - (1 - eps) * z[target[i]] - eps * zsum / double(V);
    for (int64_t j = 0; j < V; ++j) {
      const double slope = cap > 0 ? 1 - (z[j] / cap) * (z[j] / cap) : 1;  // dy/dz
      const double dz =
          double(g[i]) * (std::exp(z[j] - lse) - eps / double(V) - (j == target[i] ? 1 - eps : 0)) * slope;
      db_ref[j] += dz;
      for (int64_t f = 0; f < E; ++f) {
        dx_ref[i * E + f] += dz * dbl(w[j * E + f]);
        dw_ref[j * E + f] += dz * dbl(x[i * E + f]);
      }
    }
  }
  std::vector<C> losses(n), lse(n);
  const T zero = from_double<T>(0);
  std::vector<T> dx(size_t(N * E), zero), dw(size_t(V * E), zero), db(size_t(V), zero);
  table<T>().linear_cross_entropy(losses.data(), lse.data(), dx.data(), dw.data(), db.data(), g.data(), x.data(),
                                  w.data(), b.data(), target.data(), N, E, V, -100, eps, cap);
  char tag[160];
  std::snprintf(tag, sizeof tag, "linear_cross_entropy N=%lld E=%lld V=%lld eps=%g cap=%g %s ", (long long)N,
                (long long)E, (long long)V, eps, cap, dtype_name<T>());
  check(std::string(tag) + "losses", losses, loss_ref, tolerance<C>());
  check(std::string(tag) + "dx", dx, dx_ref);
  check(std::string(tag) + "dw", dw, dw_ref);
  check(std::string(tag) + "db", db, db_ref);
}

// --------------------------------------------------------------------------------------------------- rotary
// x (N, H, L, D) laid out (N, L, H, D) when `strided` (the heads of a projection's output), cos, sin (P, R2),
// offsets (N): forward, backward (added into a nonzero dx), and the forward in place (out = x).
template <typename T>
void test_rotary(int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2, bool interleaved, bool strided) {
  const int64_t P = L + 9;
  const Layout lay{N, H, L, D, strided};
  const auto x = uniform<T>(lay.size(), 21), dout = uniform<T>(lay.size(), 22);
  const auto cos = uniform<T>(size_t(P * R2), 23), sin = uniform<T>(size_t(P * R2), 24);
  std::vector<int64_t> offsets(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) offsets[n] = (n * 5) % 10;  // 0, 5, 0, ...: up to P - L
  auto dx = uniform<T>(lay.size(), 25);
  std::vector<double> out_ref = widen(x), dx_ref = widen(dx);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t p = offsets[n] + l;
        for (int64_t d = 0; d < 2 * R2; ++d) out_ref[lay.at(n, h, l, d)] = dx_ref[lay.at(n, h, l, d)] = 0;
        for (int64_t d = 0; d < R2; ++d) {
          const size_t a = lay.at(n, h, l, interleaved ? 2 * d : d);
          const size_t b = lay.at(n, h, l, interleaved ? 2 * d + 1 : d + R2);
          const double c = dbl(cos[p * R2 + d]), s = dbl(sin[p * R2 + d]);
          const double xa = dbl(x[a]), xb = dbl(x[b]), ga = dbl(dout[a]), gb = dbl(dout[b]);
          out_ref[a] = xa * c - xb * s, out_ref[b] = xb * c + xa * s;
          dx_ref[a] = dbl(dx[a]) + ga * c + gb * s, dx_ref[b] = dbl(dx[b]) + gb * c - ga * s;
        }
        for (int64_t d = 2 * R2; d < D; ++d) dx_ref[lay.at(n, h, l, d)] += dbl(dout[lay.at(n, h, l, d)]);
      }
  std::vector<T> out(lay.size()), inplace = x;
  table<T>().rotary_forward(lay.view(out.data()), lay.view(x.data()), cos.data(), sin.data(), offsets.data(), N, H, L,
                            D, R2, interleaved);
  table<T>().rotary_backward(lay.view(dx.data()), lay.view(dout.data()), cos.data(), sin.data(), offsets.data(), N, H,
                             L, D, R2, interleaved);
  table<T>().rotary_forward(lay.view(inplace.data()), lay.view<const T>(inplace.data()), cos.data(), sin.data(),
                            offsets.data(), N, H, L, D, R2, interleaved);
  char tag[96];
  std::snprintf(tag, sizeof tag, "rotary N=%lld H=%lld L=%lld D=%lld R=%lld%s%s %s ", (long long)N, (long long)H,
                (long long)L, (long long)D, (long long)(2 * R2), interleaved ? " interleaved" : "",
                strided ? " strided" : "", dtype_name<T>());
  check(std::string(tag) + "out", out, out_ref);
  check(std::string(tag) + "dx", dx, dx_ref);
  check_true(std::string(tag) + "in place == out of place, bitwise", inplace == out);
}

template <typename T>
void test_all() {
  const Case cases[] = {
      // name                          N  Hq Hk  L    S    D   Dv
      {"plain L!=S D!=Dv",             2, 4, 4, 70, 133, 24, 40},
      {"exact blocks",                 1, 2, 2, 64, 256, 16, 16},
      {"several blocks, causal",       1, 2, 1, 300, 530, 16, 8, Causal::top_left},
      {"GQA causal top_left",          2, 4, 2, 70, 133, 24, 40, Causal::top_left},
      {"GQA bottom_right L<S interl.", 2, 4, 2, 70, 133, 24, 40, Causal::bottom_right, false, 0, true},
      {"bottom_right L>S (rows masked)", 1, 2, 1, 150, 70, 8, 12, Causal::bottom_right},
      {"float masks, masked row",      2, 4, 2, 70, 133, 24, 40, Causal::none, true},
      {"dropout 0.3 causal masks",     2, 4, 2, 70, 133, 24, 40, Causal::top_left, true, 0.3},
      {"tiny L=S=D=Dv=1",              1, 1, 1, 1, 1, 1, 1},
      // the variants (issue 14): name    N  Hq Hk  L    S    D   Dv  causal       masks drop  interl. window
      {"causal window 40",             1, 2, 1, 300, 300, 16, 8, Causal::top_left, false, 0, false, 40, 0},
      {"window (7, 3) L<S GQA",        2, 4, 2, 70, 133, 24, 40, Causal::none, false, 0, false, 7, 3},
      {"window L>S, masks, dropout",   2, 4, 2, 150, 70, 8, 12, Causal::none, true, 0.3, false, 20, -1},
      {"softcap alibi sinks causal",   2, 4, 2, 70, 133, 24, 40, Causal::bottom_right, false, 0, false, -1, -1, 2.0,
       true, true},
      {"decode L=1 GQA sinks window",  3, 8, 2, 1, 300, 16, 16, Causal::bottom_right, false, 0, false, 100, -1, 0,
       true, true},
      {"all of them, dropout, masks",  2, 4, 2, 70, 133, 24, 40, Causal::none, true, 0.2, true, 30, 5, 5.0, true,
       true},
  };
  for (const auto& c : cases) test_sdpa<T>(c);
  test_linear<T>(37, 50, 3, true, true);    // narrow output: dot products
  test_linear<T>(37, 3, 50, true, true);    // narrow input: the backward's transposed path
  test_linear<T>(130, 70, 90, true, true);  // wide: the tiled gemm
  test_linear<T>(130, 70, 90, false, false);
  test_linear_cross_entropy<T>(30, 5, 3000, 0.0);  // narrow E: blocks of the vocabulary
  test_linear_cross_entropy<T>(140, 3, 1100, 0.1);  // narrow, two row chunks, label smoothing
  test_linear_cross_entropy<T>(20, 40, 300, 0.1);   // wide E: row chunks
  test_linear_cross_entropy<T>(20, 40, 300, 0.1, 1.5);  // soft-capped: wide E
  test_linear_cross_entropy<T>(30, 5, 3000, 0.0, 1.5);  // and narrow
  test_rotary<T>(3, 4, 37, 64, 32, false, false);  // R = D, half-split
  test_rotary<T>(3, 4, 37, 64, 32, true, true);    // R = D, interleaved, strided
  test_rotary<T>(2, 3, 300, 80, 16, false, true);  // R < D, enough rows for the threads
  test_rotary<T>(2, 3, 11, 13, 5, true, false);    // R < D, D odd
}

// The floats that decide a rounding to bfloat16, up to `last` (their bits): each bfloat16 value's upper half with the
// lower halves below, at and above the tie.
std::vector<float> bfloat16_rounding_cases(uint32_t last) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4321};
  std::vector<float> x;
  for (uint32_t high = 0; high <= last >> 16; ++high)
    for (uint32_t low : lows)
      if ((high << 16 | low) <= last) x.push_back(bits_to_float(high << 16 | low));
  return x;
}

// The reference rounding of x to bfloat16: the nearer in double of the two bfloat16 values around x (a tie to the
// even one; above the largest bfloat16 is inf, at 2^128 for the distance); inf and NaN as they are.
float nearest_bfloat16(float x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const uint32_t u = float_to_bits(x);
  const float below = bits_to_float(u & 0xffff0000u), above = bits_to_float((u & 0xffff0000u) + 0x10000u);
  const double above_at = std::isinf(above) ? std::copysign(0x1p128, above) : double(above);
  const double d_below = std::fabs(double(x) - below), d_above = std::fabs(above_at - x);
  return d_below < d_above || (d_below == d_above && !(u >> 16 & 1)) ? below : above;
}

// round_n<bfloat16> (the flash numerics' rounding of P and dS; vectorized by hand under AVX2) against
// nearest_bfloat16, NaN kept NaN: every float of bfloat16_rounding_cases, in runs whose length is not a multiple of
// the vector width.
void test_round_bfloat16() {
  std::vector<float> x = bfloat16_rounding_cases(0xffffffffu), got;
  x.resize(x.size() - 3);
  got.assign(x.size(), 0.0f);
  round_n<bfloat16>(got.data(), x.data(), int64_t(x.size()));
  int64_t wrong = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = nearest_bfloat16(x[i]);
    const bool same = std::isnan(want) ? std::isnan(got[i]) && (float_to_bits(got[i]) & 0xffffu) == 0
                                       : float_to_bits(got[i]) == float_to_bits(want);
    wrong += !same;
  }
  check_true("round_n<bfloat16> on " + std::to_string(x.size()) + " floats: " + std::to_string(wrong) + " wrong",
             wrong == 0);
}

// round_to_bfloat16 (the flash numerics' rounding of the forward's weights P, in the softmax's registers) on
// Eigen's packets of the level against nearest_bfloat16: the floats of bfloat16_rounding_cases in [0, 1], equal to
// it where normal, less than 2^-133 from it where subnormal; NaN stays NaN. (All 2^30 floats in [0, 1] were checked
// once, 2026-12-07: no normal one off.)
void test_round_weights_bfloat16() {
  namespace ei = Eigen::internal;
  using P = ei::packet_traits<float>::type;
  constexpr int64_t kW = ei::unpacket_traits<P>::size;
  std::vector<float> x = bfloat16_rounding_cases(0x3f800000u);
  x.resize((x.size() / kW + 1) * kW, std::nanf(""));
  std::vector<float> got(x.size());
  for (size_t i = 0; i < x.size(); i += kW)
    ei::pstoreu(got.data() + i, ATTNPP_CPU_NS::round_to_bfloat16(ei::ploadu<P>(&x[i])));
  int64_t wrong = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = nearest_bfloat16(x[i]);
    if (std::isnan(x[i]))
      wrong += !std::isnan(got[i]);
    else
      wrong += float_to_bits(x[i]) < 0x00800000u ? !(std::fabs(double(got[i]) - want) < 0x1p-133)
                                                 : float_to_bits(got[i]) != float_to_bits(want);
  }
  check_true("round_to_bfloat16 on " + std::to_string(x.size()) + " floats in [0, 1]: " + std::to_string(wrong) +
             " wrong", wrong == 0);
}

// gemm_nt_rows (the scores of a decoding step's few query rows against a block of keys read in place: C = alpha
// A Bt^T) against dot products in double: row counts up to kFewRows, key counts and widths below, at and past a
// vector's width (lane_sums' whole groups of keys and the tails of both), row strides past the widths, keys of T or
// of a half-precision type read into float. The columns of C past N stay untouched.
template <typename T, typename TB>
void test_gemm_nt_rows() {
  constexpr int64_t W = ATTNPP_CPU_NS::gemm_detail::Vec<T>::width;
  std::vector<T> got;
  std::vector<double> ref;
  bool untouched = true;
  for (const int64_t M : {int64_t(1), int64_t(3), int64_t(16)})
    for (const int64_t N : {int64_t(1), W - 1, W, 2 * W + 3})
      for (const int64_t K : {int64_t(1), W - 1, W, 4 * W + 5}) {
        const int64_t lda = K + 3, ldb = K + 5, ldc = N + 2;
        const auto a = uniform<T>(size_t(M * lda), uint64_t(M * 1000 + N * 10 + K));
        const auto b = uniform<TB>(size_t(N * ldb), uint64_t(M * 1000 + N * 10 + K + 7));
        std::vector<T> c(size_t(M * ldc), T(7));
        ATTNPP_CPU_NS::gemm_nt_rows(c.data(), ldc, a.data(), lda, b.data(), ldb, M, N, K, T(0.5));
        for (int64_t i = 0; i < M; ++i) {
          for (int64_t j = 0; j < N; ++j) {
            double dot = 0;
            for (int64_t k = 0; k < K; ++k) dot += dbl(a[i * lda + k]) * dbl(b[j * ldb + k]);
            got.push_back(c[i * ldc + j]);
            ref.push_back(0.5 * dot);
          }
          untouched = untouched && c[i * ldc + N] == T(7) && c[i * ldc + N + 1] == T(7);
        }
      }
  const std::string tag = std::string("gemm_nt_rows ") + dtype_name<T>() + " x " + dtype_name<TB>() + " keys";
  check(tag, got, ref);
  check_true(tag + ": columns past N untouched", untouched);
}

// vector_exp.hpp's exp_nonpositive against std::exp in double over x in [-120, 0] (a fine grid, the ends of float's
// normal range, -0), -inf and NaN: within 4 machine epsilons relative where exp(x) is a normal number (float on
// x86-64, Cephes' polynomial with the shifter: 0.9 ulp with FMA, 1.2 at the baseline; Eigen's pexp in double: 1.4),
// below the smallest normal (1.2e-38) under it, exactly 0 at -inf where shifter_exp says so, NaN at NaN.
// Base2: exp2_nonpositive (float on x86-64) against std::exp2 the same way, over [-174, 0] (the shifter's degree-6
// polynomial: 0.95 ulp with FMA, 1.2 at the baseline), exactly 0 at -inf.
template <typename T, bool Base2 = false>
void test_exp_nonpositive() {
  namespace ei = Eigen::internal;
  using P = typename ei::packet_traits<T>::type;
  constexpr int W = ei::unpacket_traits<P>::size;
  const double lowest = Base2 ? -174 : -120;  // (2^-174 = e^-120)
  std::vector<T> x;
  for (int i = 0; i <= 240000; ++i) x.push_back(T(lowest * i / 240000));
  const std::vector<double> edges = Base2 ? std::vector<double>{-0.0, -125.99999, -126.00001, -126.5, -127, -149.5,
                                                                 -1e-30}
                                           : std::vector<double>{-0.0, -87.33654, -87.33655, -103.97, -1e-30};
  for (const double v : edges) x.push_back(T(v));
  const T inf = std::numeric_limits<T>::infinity();
  x.push_back(-inf);
  x.push_back(std::numeric_limits<T>::quiet_NaN());
  while (x.size() % W) x.push_back(T(0));
  std::vector<T> y(x.size());
  for (size_t i = 0; i < x.size(); i += W) {
    const P v = ei::ploadu<P>(x.data() + i);
    if constexpr (Base2)
      ei::pstoreu(y.data() + i, ATTNPP_CPU_NS::exp2_nonpositive(v));
    else
      ei::pstoreu(y.data() + i, ATTNPP_CPU_NS::exp_nonpositive(v));
  }
  const bool exact_zero = Base2 || ATTNPP_CPU_NS::shifter_exp<P>();
  const double tiny = double(std::numeric_limits<T>::min());
  double worst = 0;
  bool small_ok = true, inf_ok = true, nan_ok = true;
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = Base2 ? std::exp2(double(x[i])) : std::exp(double(x[i])), got = double(y[i]);
    if (std::isnan(x[i])) {
      nan_ok = std::isnan(got);
    } else if (x[i] == -inf) {
      inf_ok = exact_zero ? got == 0 : got >= 0 && got < tiny;
    } else if (ref >= tiny) {
      worst = std::max(worst, std::fabs(got - ref) / ref);
    } else {
      small_ok = small_ok && got >= 0 && got < tiny;
    }
  }
  const std::string tag = std::string(Base2 ? "exp2_nonpositive " : "exp_nonpositive ") + dtype_name<T>();
  check_error(tag, worst, 4 * double(std::numeric_limits<T>::epsilon()));
  check_true(tag + ": below the normal range, 0 or below it", small_ok);
  check_true(tag + ": -inf gives 0 (exactly, where the level says so)", inf_ok);
  check_true(tag + ": NaN gives NaN", nan_ok);
}

int main() {
  std::printf("attnpp kernels of level %s, %d threads available (%s)\n", STR(ATTNPP_CPU_NS), kThreads,
              threading_runtime().c_str());
  test_all<float>();
  test_all<double>();
  test_all<bfloat16>();
  test_all<float16>();
  test_round_bfloat16();
  test_round_weights_bfloat16();
  test_gemm_nt_rows<float, float>();
  test_gemm_nt_rows<double, double>();
  test_gemm_nt_rows<float, bfloat16>();
  test_gemm_nt_rows<float, float16>();
  test_exp_nonpositive<float>();
  test_exp_nonpositive<double>();
#if defined(__SSE2__)
  test_exp_nonpositive<float, true>();  // (exp2_nonpositive: float on x86-64 only)
#endif
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
