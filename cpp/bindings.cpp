// Python bindings of the attnpp core. Thin: check that buffers agree, take their pointers and strides, release
// the GIL, call the kernel. User-facing validation (argument names, broadcasting) lives in python/attnpp.
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "buffer_pool.hpp"
#include "kernels.hpp"

namespace py = pybind11;
using namespace attnpp;

namespace {

constexpr int64_t kMaxThreads = 256;  // set_num_threads' bound: far more makes libgomp fail to start them

// The bytes of a C-contiguous array of `shape`: ValueError for a negative dimension, std::bad_alloc (MemoryError)
// when the product of the nonzero dimensions exceeds what a pointer difference holds (pybind's and NumPy's
// strides, products of the later dimensions, would overflow, even when another dimension is 0).
std::size_t array_bytes(const std::vector<py::ssize_t>& shape, std::size_t itemsize, const char* name) {
  const auto most = std::size_t(std::numeric_limits<py::ssize_t>::max());
  std::size_t strided = itemsize;
  bool empty = false;
  for (const auto s : shape) {
    if (s < 0) throw py::value_error(std::string(name) + ": negative dimension in shape");
    empty = empty || s == 0;
    if (s != 0 && strided > most / std::size_t(s)) throw std::bad_alloc();
    strided *= s != 0 ? std::size_t(s) : 1;
  }
  return empty ? 0 : strided;
}

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

template <typename T>
void check_dtype(const py::array& a, const char* name) {
  if (!a.dtype().equal(py::dtype::of<T>()))
    throw py::type_error(std::string(name) + ": expected dtype " + std::string(py::str(py::dtype::of<T>())) +
                         ", got " + std::string(py::str(a.dtype())));
}

// A 4-D array as (N, H, rows, cols) with its last dimension contiguous.
void check_aligned(const py::array& a, const char* name) {
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
    throw py::value_error(std::string(name) + ": array not aligned to its item size");
}

template <typename T, typename A>
View4<A> view4(const py::array& a, const char* name, bool writeable) {
  check_dtype<T>(a, name);
  if (a.ndim() != 4) throw py::value_error(std::string(name) + ": expected 4 dimensions, got " + shape_str(a));
  if (a.size() > 0) {  // (NumPy gives empty arrays any strides; nothing of them is read)
    check_aligned(a, name);
    if (a.shape(3) > 1 && a.strides(3) != py::ssize_t(sizeof(T)))
      throw py::value_error(std::string(name) + ": the last dimension must be contiguous");
    for (int d = 0; d < 3; ++d)
      if (a.strides(d) % py::ssize_t(sizeof(T)))
        throw py::value_error(std::string(name) + ": strides must be multiples of the item size");
  }
  if (writeable && !a.writeable()) throw py::value_error(std::string(name) + ": output array is read-only");
  A* data = static_cast<A*>(const_cast<void*>(a.data()));  // written only when `writeable` was checked
  const auto st = [&](int d) { return int64_t(a.strides(d) / py::ssize_t(sizeof(T))); };
  return View4<A>{data, st(0), st(1), st(2)};
}

void expect_ndim(const py::array& a, const char* name, py::ssize_t ndim) {
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " +
                          shape_str(a));
}

void expect_shape(const py::array& a, const char* name, std::initializer_list<int64_t> shape) {
  bool ok = a.ndim() == py::ssize_t(shape.size());
  int d = 0;
  for (int64_t s : shape) ok = ok && a.shape(d++) == s;
  if (!ok) {
    std::string want = "(";
    d = 0;
    for (int64_t s : shape) want += (d++ ? ", " : "") + std::to_string(s);
    throw py::value_error(std::string(name) + ": expected shape " + want + "), got " + shape_str(a));
  }
}

template <typename T>
T* contiguous_ptr(const py::array& a, const char* name, bool writeable) {
  check_dtype<T>(a, name);
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": must be C-contiguous");
  check_aligned(a, name);
  if (writeable && !a.writeable()) throw py::value_error(std::string(name) + ": output array is read-only");
  return static_cast<T*>(const_cast<void*>(a.data()));
}

// An optional array argument: empty for None, else the ndarray passed (never a temporary converted from a list,
// whose memory would be gone by the time the kernel writes it), TypeError for anything else.
std::optional<py::array> optional_array(const py::object& o, const char* name) {
  if (o.is_none()) return std::nullopt;
  if (!py::isinstance<py::array>(o))
    throw py::type_error(std::string(name) + ": expected a numpy.ndarray or None, got " +
                         std::string(py::str(o.get_type().attr("__name__"))));
  return py::reinterpret_borrow<py::array>(o);
}

// Copies of an int64 array's values: indices and offsets are checked, then used with the GIL released, when
// another Python thread could change the array in between.
std::vector<int64_t> int64_copy(const py::array& a, const char* name) {
  if (!a.dtype().equal(py::dtype::of<int64_t>()) || !(a.flags() & py::array::c_style))
    throw py::type_error(std::string(name) + ": expected a C-contiguous int64 array");
  std::vector<int64_t> values(a.size());
  if (!values.empty()) std::memcpy(values.data(), a.data(), values.size() * sizeof(int64_t));
  return values;
}

// Masks arrive as (array, batch_offsets (N,) int64, h_stride, l_stride, s_stride), strides in elements.
using MaskArg = std::tuple<py::array, py::array_t<int64_t, py::array::c_style>, int64_t, int64_t, int64_t>;

// ValueError unless every element (n, h, i, j) < (N, H, L, S) the mask view reads lies within the mask array's
// own elements (its offsets and strides come from Python; a wrong one would read outside the array).
template <typename T>
void check_mask_bounds(const py::array& a, const std::vector<int64_t>& offsets, int64_t N, int64_t H, int64_t L,
                       int64_t S, int64_t h_stride, int64_t l_stride, int64_t s_stride) {
  if (N == 0 || H == 0 || L == 0 || S == 0) return;
  check_aligned(a, "attn_mask");
  using Wide = __int128;  // no overflow from int64 strides times int64 sizes
  Wide lo = 0, hi = 0;    // the array's elements lie in [data + lo, data + hi]
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (a.shape(d) == 0) throw py::value_error("attn_mask: empty mask array for a non-empty attention");
    if (a.strides(d) % py::ssize_t(sizeof(T))) throw py::value_error("attn_mask: strides must be multiples of the item size");
    const Wide reach = Wide(a.shape(d) - 1) * (a.strides(d) / py::ssize_t(sizeof(T)));
    (reach < 0 ? lo : hi) += reach;
  }
  Wide span_lo = 0, span_hi = 0;  // reach of (h, i, j) from a batch offset
  for (const auto& [size, stride] : {std::pair{H, h_stride}, {L, l_stride}, {S, s_stride}}) {
    const Wide reach = Wide(size - 1) * stride;
    (reach < 0 ? span_lo : span_hi) += reach;
  }
  for (int64_t n = 0; n < N; ++n)
    if (offsets[n] + span_lo < lo || offsets[n] + span_hi > hi)
      throw py::value_error("attn_mask: batch offsets and strides reach outside the mask array");
}

// The options of the attention variants (_core.AttentionVariants), one object so that the sdpa entry points keep
// one signature: sliding window, soft cap, ALiBi slopes (N or 1, Hq), sinks (Hq), packed sequences
// (cu_seqlens_q, cu_seqlens_k (N + 1) int64) or a KV cache's key counts (seqlens_k (N) int64).
struct Variants {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  py::object alibi_slopes = py::none(), sinks = py::none();
  py::object cu_seqlens_q = py::none(), cu_seqlens_k = py::none(), seqlens_k = py::none();
};

// An attention problem: the config and the copies of the small arrays it points into (offsets and lengths are
// checked, then used with the GIL released, when another Python thread could change the arrays: see int64_copy).
template <typename T>
struct Problem {
  AttnConfig<T> cfg;
  std::vector<std::vector<int64_t>> offsets;
  std::vector<int64_t> cu_q, cu_k, seqlens_k;
  std::vector<T> alibi, sinks;
  Problem() = default;
  Problem(const Problem&) = delete;  // cfg points into the vectors

  // From query (N, Hq, L, D) and key (N, Hk, S, D) (N = 1 for packed sequences: L and S are then the total
  // lengths), value's width Dv and the options.
  Problem(const py::array& q, const py::array& k, int64_t Dv, const std::vector<MaskArg>& masks, double scale,
          int causal, double dropout_p, uint64_t seed, const Variants* var) {
    cfg.N = q.shape(0), cfg.Hq = q.shape(1), cfg.L = q.shape(2), cfg.D = q.shape(3);
    cfg.Hk = k.shape(1), cfg.S = k.shape(2), cfg.Dv = Dv;
    expect_shape(k, "key", {cfg.N, cfg.Hk, cfg.S, cfg.D});
    if (cfg.Hk == 0 ? cfg.Hq != 0 : cfg.Hq % cfg.Hk != 0)
      throw py::value_error("query heads (" + std::to_string(cfg.Hq) + ") must be a multiple of key heads (" +
                            std::to_string(cfg.Hk) + ")");
    if (causal < 0 || causal > 2) throw py::value_error("causal must be 0, 1 or 2");
    if (!(dropout_p >= 0 && dropout_p < 1)) throw py::value_error("dropout_p must be in [0, 1)");
    cfg.scale = T(scale), cfg.causal = Causal(causal), cfg.dropout_p = dropout_p, cfg.seed = seed;
    for (const auto& m : masks) {
      const auto& batch_offsets = std::get<1>(m);
      if (batch_offsets.ndim() != 1 || batch_offsets.shape(0) != cfg.N)
        throw py::value_error("mask batch offsets: expected shape (" + std::to_string(cfg.N) + ",)");
      check_dtype<T>(std::get<0>(m), "attn_mask");
      offsets.push_back(int64_copy(batch_offsets, "mask batch offsets"));
      check_mask_bounds<T>(std::get<0>(m), offsets.back(), cfg.N, cfg.Hq, cfg.L, cfg.S, std::get<2>(m),
                           std::get<3>(m), std::get<4>(m));
      cfg.masks.push_back(MaskView<T>{static_cast<const T*>(std::get<0>(m).data()), offsets.back().data(),
                                      std::get<2>(m), std::get<3>(m), std::get<4>(m)});
    }
    if (var) add_variants(*var);
  }

  // The views of packed sequences read rows cu[n].. of the one batch entry.
  template <typename A>
  View4<A> rows_of(View4<A> v, bool queries) const {
    if (queries ? cfg.cu_q : cfg.cu_k) v.n = 0;
    return v;
  }

 private:
  // A small array of T copied, of `count` elements (any shape), else TypeError/ValueError.
  static std::vector<T> copy_of(const py::object& o, const char* name, int64_t count) {
    const auto a = *optional_array(o, name);
    const T* p = contiguous_ptr<T>(a, name, false);
    if (a.size() != count) throw py::value_error(std::string(name) + ": expected " + std::to_string(count) +
                                                 " values, got shape " + shape_str(a));
    return std::vector<T>(p, p + count);
  }

  // Cumulative lengths (N + 1), from 0, non-decreasing, to `total`; returns the longest sequence.
  static int64_t check_cumulative(const std::vector<int64_t>& cu, int64_t total, const char* name) {
    int64_t longest = 0;
    bool ok = !cu.empty() && cu.front() == 0 && cu.back() == total;
    for (size_t n = 1; ok && n < cu.size(); ++n) {
      ok = cu[n] >= cu[n - 1];
      longest = std::max(longest, cu[n] - cu[n - 1]);
    }
    if (!ok)
      throw py::value_error(std::string(name) + ": expected non-decreasing offsets from 0 to " +
                            std::to_string(total));
    return longest;
  }

  void add_variants(const Variants& var) {
    cfg.window_left = var.window_left, cfg.window_right = var.window_right;
    if (!(var.softcap >= 0 && std::isfinite(var.softcap))) throw py::value_error("softcap must be >= 0 and finite");
    cfg.softcap = T(var.softcap);
    if (!var.alibi_slopes.is_none()) {
      const auto a = *optional_array(var.alibi_slopes, "alibi_slopes");
      if (a.ndim() != 2 || a.shape(1) != cfg.Hq || (a.shape(0) != 1 && a.shape(0) != cfg.N))
        throw py::value_error("alibi_slopes: expected shape (1 or " + std::to_string(cfg.N) + ", " +
                              std::to_string(cfg.Hq) + "), got " + shape_str(a));
      alibi = copy_of(var.alibi_slopes, "alibi_slopes", a.size());
      cfg.alibi = alibi.data(), cfg.alibi_n = a.shape(0) == 1 ? 0 : cfg.Hq;
    }
    if (!var.sinks.is_none()) {
      sinks = copy_of(var.sinks, "sinks", cfg.Hq);
      cfg.sinks = sinks.data();
    }
    if (!var.cu_seqlens_q.is_none() || !var.cu_seqlens_k.is_none()) {
      if (var.cu_seqlens_q.is_none() || var.cu_seqlens_k.is_none() || !var.seqlens_k.is_none())
        throw py::value_error("cu_seqlens_q and cu_seqlens_k go together, without seqlens_k");
      if (cfg.N != 1 || !cfg.masks.empty())
        throw py::value_error("packed sequences: expected one batch entry and no mask");
      cu_q = int64_copy(*optional_array(var.cu_seqlens_q, "cu_seqlens_q"), "cu_seqlens_q");
      cu_k = int64_copy(*optional_array(var.cu_seqlens_k, "cu_seqlens_k"), "cu_seqlens_k");
      if (cu_q.size() != cu_k.size())
        throw py::value_error("cu_seqlens_q and cu_seqlens_k: expected the same number of sequences");
      const int64_t L = check_cumulative(cu_q, cfg.L, "cu_seqlens_q");
      cfg.S = check_cumulative(cu_k, cfg.S, "cu_seqlens_k"), cfg.L = L;
      cfg.N = int64_t(cu_q.size()) - 1, cfg.cu_q = cu_q.data(), cfg.cu_k = cu_k.data();
    } else if (!var.seqlens_k.is_none()) {
      seqlens_k = int64_copy(*optional_array(var.seqlens_k, "seqlens_k"), "seqlens_k");
      if (int64_t(seqlens_k.size()) != cfg.N) throw py::value_error("seqlens_k: expected one length per batch entry");
      for (const auto s : seqlens_k)
        if (s < 0 || s > cfg.S) throw py::value_error("seqlens_k: lengths must be in [0, S]");
      if (!cfg.masks.empty()) throw py::value_error("seqlens_k: no mask with a KV cache");
      cfg.seqlens_k = seqlens_k.data();
    }
  }
};

template <typename T>
void sdpa_forward_t(const py::array& out, const py::array& lse, const py::array& q, const py::array& k,
                    const py::array& v, const std::vector<MaskArg>& masks, double scale, int causal,
                    double dropout_p, uint64_t seed, const Variants* var) {
  auto qv = view4<T, const T>(q, "query", false), kv = view4<T, const T>(k, "key", false);
  auto vv = view4<T, const T>(v, "value", false);
  const Problem<T> p(q, k, v.shape(3), masks, scale, causal, dropout_p, seed, var);
  expect_shape(v, "value", {k.shape(0), k.shape(1), k.shape(2), v.shape(3)});
  expect_shape(out, "out", {q.shape(0), q.shape(1), q.shape(2), v.shape(3)});
  expect_shape(lse, "logsumexp", {q.shape(0), q.shape(1), q.shape(2)});
  const auto ov = p.rows_of(view4<T, T>(out, "out", true), true);
  T* lse_p = contiguous_ptr<T>(lse, "logsumexp", true);
  py::gil_scoped_release release;
  kernels<T>().sdpa_forward(ov, lse_p, p.rows_of(qv, true), p.rows_of(kv, false), p.rows_of(vv, false), p.cfg);
}

template <typename T>
void sdpa_backward_t(const py::array& dq, const py::array& dk, const py::array& dv, const py::array& dout,
                     const py::array& out, const py::array& lse, const py::array& q, const py::array& k,
                     const py::array& v, const std::vector<MaskArg>& masks, double scale, int causal,
                     double dropout_p, uint64_t seed, const Variants* var, const py::object& dsinks) {
  const auto qv = view4<T, const T>(q, "query", false), kv = view4<T, const T>(k, "key", false);
  const auto vv = view4<T, const T>(v, "value", false);
  const Problem<T> p(q, k, v.shape(3), masks, scale, causal, dropout_p, seed, var);
  const int64_t N = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3), Dv = v.shape(3);
  const int64_t Hk = k.shape(1), S = k.shape(2);
  expect_shape(v, "value", {N, Hk, S, Dv});
  expect_shape(out, "out", {N, Hq, L, Dv});
  expect_shape(dout, "grad_output", {N, Hq, L, Dv});
  expect_shape(lse, "logsumexp", {N, Hq, L});
  expect_shape(dq, "grad_query", {N, Hq, L, D});
  expect_shape(dk, "grad_key", {N, Hk, S, D});
  expect_shape(dv, "grad_value", {N, Hk, S, Dv});
  const auto ov = view4<T, const T>(out, "out", false), dov = view4<T, const T>(dout, "grad_output", false);
  const T* lse_p = contiguous_ptr<T>(lse, "logsumexp", false);
  const auto dqv = view4<T, T>(dq, "grad_query", true), dkv = view4<T, T>(dk, "grad_key", true);
  const auto dvv = view4<T, T>(dv, "grad_value", true);
  T* dsinks_p = nullptr;
  if (const auto a = optional_array(dsinks, "grad_sinks")) {
    expect_shape(*a, "grad_sinks", {Hq});
    dsinks_p = contiguous_ptr<T>(*a, "grad_sinks", true);
  }
  py::gil_scoped_release release;
  kernels<T>().sdpa_backward(p.rows_of(dqv, true), p.rows_of(dkv, false), p.rows_of(dvv, false), dsinks_p,
                             p.rows_of(dov, true), p.rows_of(ov, true), lse_p, p.rows_of(qv, true),
                             p.rows_of(kv, false), p.rows_of(vv, false), p.cfg);
}

template <typename T>
void sdpa_weights_t(const py::array& weights, const py::array& lse, const py::array& q, const py::array& k,
                    const std::vector<MaskArg>& masks, double scale, int causal, double dropout_p,
                    uint64_t seed, bool average_heads, const Variants* var) {
  const auto qv = view4<T, const T>(q, "query", false), kv = view4<T, const T>(k, "key", false);
  const Problem<T> p(q, k, 0, masks, scale, causal, dropout_p, seed, var);
  const auto& cfg = p.cfg;
  if (cfg.cu_q || cfg.seqlens_k) throw py::value_error("sdpa_weights: not for packed sequences or a KV cache");
  expect_shape(lse, "logsumexp", {cfg.N, cfg.Hq, cfg.L});
  if (average_heads)
    expect_shape(weights, "weights", {cfg.N, cfg.L, cfg.S});
  else
    expect_shape(weights, "weights", {cfg.N, cfg.Hq, cfg.L, cfg.S});
  const T* lse_p = contiguous_ptr<T>(lse, "logsumexp", false);
  T* w = contiguous_ptr<T>(weights, "weights", true);
  py::gil_scoped_release release;
  kernels<T>().sdpa_weights(w, lse_p, qv, kv, cfg, average_heads);
}

template <typename T>
void linear_forward_t(const py::array& y, const py::array& x, const py::array& w, const py::object& b) {
  expect_ndim(x, "input", 2), expect_ndim(w, "weight", 2);
  const int64_t M = x.shape(0), Fin = x.shape(1), Fout = w.shape(0);
  expect_shape(w, "weight", {Fout, Fin});
  expect_shape(y, "out", {M, Fout});
  const T* bp = nullptr;
  if (const auto ba = optional_array(b, "bias")) {
    expect_shape(*ba, "bias", {Fout});
    bp = contiguous_ptr<T>(*ba, "bias", false);
  }
  T* yp = contiguous_ptr<T>(y, "out", true);
  const T *xp = contiguous_ptr<T>(x, "input", false), *wp = contiguous_ptr<T>(w, "weight", false);
  py::gil_scoped_release release;
  kernels<T>().linear_forward(yp, xp, wp, bp, M, Fin, Fout);
}

template <typename T>
void linear_backward_t(const py::object& dx, const py::array& dw, const py::object& db, const py::array& dy,
                       const py::array& x, const py::array& w) {
  expect_ndim(x, "input", 2), expect_ndim(w, "weight", 2);
  const int64_t M = x.shape(0), Fin = x.shape(1), Fout = w.shape(0);
  expect_shape(w, "weight", {Fout, Fin});
  expect_shape(dy, "grad_output", {M, Fout});
  expect_shape(dw, "grad_weight", {Fout, Fin});
  T *dxp = nullptr, *dbp = nullptr;
  if (const auto a = optional_array(dx, "grad_input")) {
    expect_shape(*a, "grad_input", {M, Fin});
    dxp = contiguous_ptr<T>(*a, "grad_input", true);
  }
  if (const auto a = optional_array(db, "grad_bias")) {
    expect_shape(*a, "grad_bias", {Fout});
    dbp = contiguous_ptr<T>(*a, "grad_bias", true);
  }
  T* dwp = contiguous_ptr<T>(dw, "grad_weight", true);
  const T *dyp = contiguous_ptr<T>(dy, "grad_output", false), *xp = contiguous_ptr<T>(x, "input", false);
  const T* wp = contiguous_ptr<T>(w, "weight", false);
  py::gil_scoped_release release;
  kernels<T>().linear_backward(dxp, dwp, dbp, dyp, xp, wp, M, Fin, Fout);
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<float>{}) or f(Tag<double>{}) by the dtype of `a`.
template <typename F>
void dispatch(const py::array& a, const char* name, F&& f) {
  if (a.dtype().equal(py::dtype::of<float>()))
    f(Tag<float>{});
  else if (a.dtype().equal(py::dtype::of<double>()))
    f(Tag<double>{});
  else
    throw py::type_error(std::string(name) + ": expected dtype float32 or float64, got " +
                         std::string(py::str(a.dtype())));
}

// Same number of elements, else ValueError.
void expect_size(const py::array& a, const char* name, py::ssize_t n) {
  if (a.size() != n)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(n) + " elements, got shape " +
                          shape_str(a));
}

// A copy of the indices of `a` (C-contiguous int64), each in [0, size) or equal to *allowed when given, else
// IndexError.
std::vector<int64_t> indices(const py::array& a, const char* name, int64_t size, const int64_t* allowed = nullptr) {
  auto idx = int64_copy(a, name);
  for (const int64_t i : idx)
    if ((i < 0 || i >= size) && !(allowed && i == *allowed))
      throw py::index_error(std::string(name) + ": value " + std::to_string(i) + " out of range [0, " +
                            std::to_string(size) + ")");
  return idx;
}

// Rotary embedding forward into dst = out, or backward (the opposite angles) added into dst = grad_input, from
// src (N, H, L, D), cos, sin (P, R2), position_offsets (N,): ValueError unless every table row read,
// position_offsets[n] + l for l < L, lies in [0, P) and 2 * R2 <= D.
template <typename T>
void rotary_t(const py::array& dst, const py::array& src, const py::array& cos, const py::array& sin,
              const py::array& offsets, bool interleaved, bool backward) {
  const char* dst_name = backward ? "grad_input" : "out";
  const char* src_name = backward ? "grad_output" : "input";
  const auto sv = view4<T, const T>(src, src_name, false);
  const int64_t N = src.shape(0), H = src.shape(1), L = src.shape(2), D = src.shape(3);
  expect_shape(dst, dst_name, {N, H, L, D});
  expect_ndim(cos, "cos", 2);
  const int64_t P = cos.shape(0), R2 = cos.shape(1);
  expect_shape(sin, "sin", {P, R2});
  if (R2 > D / 2)
    throw py::value_error("cos: rotary_dim 2 * " + std::to_string(R2) + " exceeds the head width D = " +
                          std::to_string(D));
  expect_shape(offsets, "position_offsets", {N});
  const auto off = int64_copy(offsets, "position_offsets");  // (a copy: read with the GIL released)
  if (H > 0 && L > 0)
    for (int64_t n = 0; n < N; ++n)
      if (off[n] < 0 || off[n] > P - L)
        throw py::value_error("position_offsets: offset " + std::to_string(off[n]) + " of sequence " +
                              std::to_string(n) + " with L = " + std::to_string(L) +
                              " reads rows outside the P = " + std::to_string(P) + " rows of cos and sin");
  const T *c = contiguous_ptr<T>(cos, "cos", false), *s = contiguous_ptr<T>(sin, "sin", false);
  const auto dv = view4<T, T>(dst, dst_name, true);
  const auto kernel = backward ? kernels<T>().rotary_backward : kernels<T>().rotary_forward;
  py::gil_scoped_release release;
  kernel(dv, sv, c, s, off.data(), N, H, L, D, R2, interleaved);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attnpp's C++ core. Use attnpp.functional and attnpp.nn instead of calling this directly.";

  // The CPU level, once, before any kernel runs: the best the CPU supports, or the one ATTNPP_CPU_CAPABILITY
  // forces (an exception here is the ImportError the user sees).
  const char* forced = std::getenv("ATTNPP_CPU_CAPABILITY");
  select_cpu_level(forced ? forced : "");
  m.def(
      "cpu_capability", []() { return std::string(cpu_level().name); },
      "The CPU level the kernels run at: 'default', 'avx2' or 'avx512' (the last two on x86-64 only).");
  m.def(
      "build_config",
      []() {
        py::list levels, supported;
        for (const auto& l : cpu_levels()) {
          levels.append(l.name);
          if (l.supported) supported.append(l.name);
        }
        py::dict config;
        config["cpu_capability"] = cpu_level().name;
        config["levels_built"] = levels;
        config["levels_supported"] = supported;
        config["compiler"] = build_compiler();
        config["flags"] = build_flags();
        config["eigen"] = std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
                          std::to_string(EIGEN_MINOR_VERSION);
        config["openmp"] = _OPENMP;
        return config;
      },
      "The build: dict of cpu_capability, levels_built, levels_supported, compiler, flags, eigen, openmp.");

  m.def(
      "set_num_threads",
      [](int64_t n) {
        if (n < 1 || n > kMaxThreads)
          throw py::value_error("set_num_threads: n must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                                std::to_string(n));
        set_thread_count(int(n));
      },
      "Set the number of OpenMP threads the kernels use, n in [1, 256].", py::arg("n"));
  m.def("get_num_threads", []() { return thread_count(); }, "The number of OpenMP threads the kernels use.");

  py::class_<Variants>(m, "AttentionVariants",
                       "Options of the attention variants for sdpa_forward/backward/weights: window_left, "
                       "window_right (-1 unbounded; keys [i + S - L - left, i + S - L + right]), softcap (0 none), "
                       "alibi_slopes (1 or N, Hq), sinks (Hq,), cu_seqlens_q and cu_seqlens_k ((N + 1,) int64: "
                       "packed sequences in the arrays' one batch entry), seqlens_k ((N,) int64: keys per "
                       "batch entry, a KV cache).")
      .def(py::init([](int64_t window_left, int64_t window_right, double softcap, py::object alibi_slopes,
                       py::object sinks, py::object cu_seqlens_q, py::object cu_seqlens_k, py::object seqlens_k) {
             return Variants{window_left, window_right, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                             seqlens_k};
           }),
           "The options; each argument as the attribute of its name (arrays are checked by the sdpa call).",
           py::kw_only(), py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
           py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("cu_seqlens_q") = py::none(),
           py::arg("cu_seqlens_k") = py::none(), py::arg("seqlens_k") = py::none())
      .def_readonly("window_left", &Variants::window_left)
      .def_readonly("window_right", &Variants::window_right)
      .def_readonly("softcap", &Variants::softcap)
      .def_readonly("alibi_slopes", &Variants::alibi_slopes)
      .def_readonly("sinks", &Variants::sinks)
      .def_readonly("cu_seqlens_q", &Variants::cu_seqlens_q)
      .def_readonly("cu_seqlens_k", &Variants::cu_seqlens_k)
      .def_readonly("seqlens_k", &Variants::seqlens_k);

  m.def(
      "sdpa_forward",
      [](const py::array& out, const py::array& lse, const py::array& q, const py::array& k, const py::array& v,
         const std::vector<MaskArg>& masks, double scale, int causal, double dropout_p, uint64_t seed,
         const Variants* variants) {
        dispatch(q, "query", [&](auto t) {
          sdpa_forward_t<typename decltype(t)::type>(out, lse, q, k, v, masks, scale, causal, dropout_p, seed,
                                                     variants);
        });
      },
      "Attention forward into out (N, Hq, L, Dv) and logsumexp (N, Hq, L), of query (N, Hq, L, D), "
      "key (N, Hk, S, D), value (N, Hk, S, Dv), all float32 or all float64; masks: additive (mask, "
      "batch_offsets (N,) int64, h_stride, l_stride, s_stride), strides in elements; causal: 0 none, "
      "1 top-left, 2 bottom-right aligned; variants: an AttentionVariants or None.",
      py::arg("out"), py::arg("logsumexp"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("masks"),
      py::arg("scale"), py::arg("causal"), py::arg("dropout_p"), py::arg("seed"), py::arg("variants") = nullptr);
  m.def(
      "sdpa_backward",
      [](const py::array& dq, const py::array& dk, const py::array& dv, const py::array& dout, const py::array& out,
         const py::array& lse, const py::array& q, const py::array& k, const py::array& v,
         const std::vector<MaskArg>& masks, double scale, int causal, double dropout_p, uint64_t seed,
         const Variants* variants, const py::object& grad_sinks) {
        dispatch(q, "query", [&](auto t) {
          sdpa_backward_t<typename decltype(t)::type>(dq, dk, dv, dout, out, lse, q, k, v, masks, scale, causal,
                                                      dropout_p, seed, variants, grad_sinks);
        });
      },
      "Attention backward: adds the gradients into grad_query (N, Hq, L, D), grad_key (N, Hk, S, D), grad_value "
      "(N, Hk, S, Dv) and grad_sinks (Hq,) or None, from grad_output and out (N, Hq, L, Dv), logsumexp (N, Hq, L) "
      "and sdpa_forward's inputs.",
      py::arg("grad_query"), py::arg("grad_key"), py::arg("grad_value"), py::arg("grad_output"), py::arg("out"),
      py::arg("logsumexp"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("masks"), py::arg("scale"),
      py::arg("causal"), py::arg("dropout_p"), py::arg("seed"), py::arg("variants") = nullptr,
      py::arg("grad_sinks") = py::none());
  m.def(
      "sdpa_weights",
      [](const py::array& weights, const py::array& lse, const py::array& q, const py::array& k,
         const std::vector<MaskArg>& masks, double scale, int causal, double dropout_p, uint64_t seed,
         bool average_heads, const Variants* variants) {
        dispatch(q, "query", [&](auto t) {
          sdpa_weights_t<typename decltype(t)::type>(weights, lse, q, k, masks, scale, causal, dropout_p, seed,
                                                     average_heads, variants);
        });
      },
      "The attention weights (after dropout) into weights (N, Hq, L, S), or (N, L, S) averaged over heads, from "
      "sdpa_forward's logsumexp (N, Hq, L), query and key.",
      py::arg("weights"), py::arg("logsumexp"), py::arg("query"), py::arg("key"), py::arg("masks"),
      py::arg("scale"), py::arg("causal"), py::arg("dropout_p"), py::arg("seed"), py::arg("average_heads") = false,
      py::arg("variants") = nullptr);
  m.def(
      "linear_forward",
      [](const py::array& y, const py::array& x, const py::array& w, const py::object& b) {
        dispatch(x, "input", [&](auto t) { linear_forward_t<typename decltype(t)::type>(y, x, w, b); });
      },
      "out (M, Fout) = input (M, Fin) @ weight (Fout, Fin).T + bias (Fout,) or None; all C-contiguous.",
      py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias"));
  m.def(
      "linear_backward",
      [](const py::object& dx, const py::array& dw, const py::object& db, const py::array& dy, const py::array& x,
         const py::array& w) {
        dispatch(x, "input", [&](auto t) { linear_backward_t<typename decltype(t)::type>(dx, dw, db, dy, x, w); });
      },
      "Linear backward: adds the gradients into grad_input (M, Fin) or None, grad_weight (Fout, Fin), grad_bias "
      "(Fout,) or None, from grad_output (M, Fout), input and weight.",
      py::arg("grad_input"), py::arg("grad_weight"), py::arg("grad_bias"), py::arg("grad_output"), py::arg("input"),
      py::arg("weight"));

  m.def(
      "empty",
      [](const std::vector<py::ssize_t>& shape, const py::dtype& dtype) {
        const char kind = dtype.kind();  // numbers only: objects (and records holding them) need initialized memory
        if (std::string("biufc").find(kind) == std::string::npos || dtype.has_fields())
          throw py::type_error("empty: expected a numeric dtype, got " + std::string(py::str(dtype)));
        void* data = pool_acquire(array_bytes(shape, dtype.itemsize(), "empty"));
        py::capsule owner(data, [](void* p) { pool_release(p); });
        return py::array(dtype, shape, data, owner);
      },
      "An uninitialized C-contiguous array of a numeric dtype, its memory recycled by attnpp's pool.",
      py::arg("shape"), py::arg("dtype"));
  m.def("empty_cache", &pool_empty, "Free the pool's cached blocks; returns their size in bytes.");
  m.def(
      "dropout_mask",
      [](std::vector<py::ssize_t> shape, double p, uint64_t seed) {
        array_bytes(shape, sizeof(bool), "dropout_mask");  // (before pybind computes strides that would overflow)
        py::array_t<bool> keep(shape);
        bool* ptr = keep.mutable_data();
        const int64_t count = keep.size();
        py::gil_scoped_release release;
        cpu_level().kernels->dropout_mask(ptr, count, p, seed);
        return keep;
      },
      "The keep mask (bool, of the given shape) of dropout with probability p and seed.", py::arg("shape"),
      py::arg("p"), py::arg("seed"));
  m.def(
      "dropout_forward",
      [](const py::array& out, const py::array& x, double p, uint64_t seed) {
        dispatch(x, "input", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_size(out, "out", x.size());
          T* o = contiguous_ptr<T>(out, "out", true);
          const T* xp = contiguous_ptr<T>(x, "input", false);
          py::gil_scoped_release release;
          kernels<T>().dropout_forward(o, xp, x.size(), p, seed);
        });
      },
      "Dropout of input into out (same size, C-contiguous), kept elements scaled by 1 / (1 - p).", py::arg("out"),
      py::arg("input"), py::arg("p"), py::arg("seed"));
  m.def(
      "dropout_backward",
      [](const py::array& dx, const py::array& dout, double p, uint64_t seed) {
        dispatch(dout, "grad_output", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_size(dx, "grad_input", dout.size());
          T* d = contiguous_ptr<T>(dx, "grad_input", true);
          const T* g = contiguous_ptr<T>(dout, "grad_output", false);
          py::gil_scoped_release release;
          kernels<T>().dropout_backward(d, g, dout.size(), p, seed);
        });
      },
      "Dropout backward: adds into grad_input from grad_output (same size), by the mask of the same p and seed.",
      py::arg("grad_input"), py::arg("grad_output"), py::arg("p"), py::arg("seed"));
  m.def(
      "rotary_forward",
      [](const py::array& out, const py::array& x, const py::array& cos, const py::array& sin,
         const py::array& offsets, bool interleaved) {
        dispatch(x, "input", [&](auto t) {
          rotary_t<typename decltype(t)::type>(out, x, cos, sin, offsets, interleaved, false);
        });
      },
      "Rotary position embedding of input (N, H, L, D) into out (N, H, L, D): the first R = 2 * R2 features of "
      "row l of sequence n rotated by the angles of row position_offsets[n] + l of cos and sin (P, R2, "
      "C-contiguous), pairs (d, d + R2), or (2d, 2d + 1) when interleaved; the features R.. copied. "
      "position_offsets: (N,) int64, each in [0, P - L].",
      py::arg("out"), py::arg("input"), py::arg("cos"), py::arg("sin"), py::arg("position_offsets"),
      py::arg("interleaved"));
  m.def(
      "rotary_backward",
      [](const py::array& dx, const py::array& dout, const py::array& cos, const py::array& sin,
         const py::array& offsets, bool interleaved) {
        dispatch(dout, "grad_output", [&](auto t) {
          rotary_t<typename decltype(t)::type>(dx, dout, cos, sin, offsets, interleaved, true);
        });
      },
      "Rotary embedding backward: adds into grad_input (N, H, L, D) grad_output (N, H, L, D) rotated by the "
      "opposite angles (sin -> -sin), its features R.. as they are; the other arguments as rotary_forward's.",
      py::arg("grad_input"), py::arg("grad_output"), py::arg("cos"), py::arg("sin"), py::arg("position_offsets"),
      py::arg("interleaved"));
  m.def(
      "embedding_forward",
      [](const py::array& out, const py::array& index, const py::array& weight) {
        dispatch(weight, "weight", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_ndim(weight, "weight", 2);
          const int64_t N = index.size(), E = weight.shape(1);
          expect_shape(out, "out", {N, E});
          T* o = contiguous_ptr<T>(out, "out", true);
          const T* w = contiguous_ptr<T>(weight, "weight", false);
          const auto idx = indices(index, "input", weight.shape(0));
          py::gil_scoped_release release;
          kernels<T>().embedding_forward(o, idx.data(), w, N, E);
        });
      },
      "out (N, E) = weight (V, E)[index], index: N int64 values in [0, V).", py::arg("out"), py::arg("index"),
      py::arg("weight"));
  m.def(
      "embedding_backward",
      [](const py::array& dweight, const py::array& dout, const py::array& index) {
        dispatch(dweight, "grad_weight", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_ndim(dweight, "grad_weight", 2);
          const int64_t N = index.size(), E = dweight.shape(1);
          expect_shape(dout, "grad_output", {N, E});
          T* dw = contiguous_ptr<T>(dweight, "grad_weight", true);
          const T* g = contiguous_ptr<T>(dout, "grad_output", false);
          const auto idx = indices(index, "input", dweight.shape(0));
          py::gil_scoped_release release;
          kernels<T>().embedding_backward(dw, g, idx.data(), N, E);
        });
      },
      "Adds the rows of grad_output (N, E) into grad_weight (V, E) at index (N int64 values).",
      py::arg("grad_weight"), py::arg("grad_output"), py::arg("index"));
  m.def(
      "cross_entropy_forward",
      [](const py::array& losses, const py::array& stats, const py::array& input, const py::array& target,
         int64_t ignore_index) {
        dispatch(input, "input", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_ndim(input, "input", 2);
          const int64_t N = input.shape(0), C = input.shape(1);
          if (C == 0 && N > 0)
            throw py::value_error("input: expected at least one class, got shape " + shape_str(input));
          expect_shape(losses, "losses", {N});
          expect_shape(stats, "stats", {N, 2});
          expect_shape(target, "target", {N});
          T *l = contiguous_ptr<T>(losses, "losses", true), *s = contiguous_ptr<T>(stats, "stats", true);
          const T* x = contiguous_ptr<T>(input, "input", false);
          const auto tg = indices(target, "target", C, &ignore_index);
          py::gil_scoped_release release;
          kernels<T>().cross_entropy_forward(l, s, x, tg.data(), N, C, ignore_index);
        });
      },
      "Per-row cross entropy of input (N, C) logits and target (N,) int64 into losses (N,) and stats (N, 2) for "
      "the backward; rows whose target is ignore_index get loss 0.",
      py::arg("losses"), py::arg("stats"), py::arg("input"), py::arg("target"), py::arg("ignore_index"));
  m.def(
      "cross_entropy_backward",
      [](const py::array& dinput, const py::array& row_weight, const py::array& stats, const py::array& input,
         const py::array& target) {
        dispatch(input, "input", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_ndim(input, "input", 2);
          const int64_t N = input.shape(0), C = input.shape(1);
          expect_shape(dinput, "grad_input", {N, C});
          expect_shape(row_weight, "row_weight", {N});
          expect_shape(stats, "stats", {N, 2});
          expect_shape(target, "target", {N});
          T* d = contiguous_ptr<T>(dinput, "grad_input", true);
          const T* s = contiguous_ptr<T>(stats, "stats", false);
          const T* x = contiguous_ptr<T>(input, "input", false);
          // copies (see int64_copy): the targets of rows of nonzero weight are written to, the others not read
          const T* wp = contiguous_ptr<T>(row_weight, "row_weight", false);
          const std::vector<T> w(wp, wp + N);
          const auto tg = int64_copy(target, "target");
          for (int64_t i = 0; i < N; ++i)
            if (w[i] != T(0) && (tg[i] < 0 || tg[i] >= C))
              throw py::index_error("target: value " + std::to_string(tg[i]) + " out of range [0, " +
                                    std::to_string(C) + ") on a row of nonzero weight");
          py::gil_scoped_release release;
          kernels<T>().cross_entropy_backward(d, w.data(), s, x, tg.data(), N, C);
        });
      },
      "grad_input (N, C) of the losses weighted by row_weight (N,), from cross_entropy_forward's stats (N, 2), "
      "input and target.",
      py::arg("grad_input"), py::arg("row_weight"), py::arg("stats"), py::arg("input"), py::arg("target"));
  m.def(
      "sgd_step",
      [](const py::array& param, const py::array& grad, const py::object& buf, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, bool first) {
        dispatch(param, "param", [&](auto t) {
          using T = typename decltype(t)::type;
          expect_size(grad, "grad", param.size());
          T* b = nullptr;
          if (const auto ba = optional_array(buf, "momentum_buffer")) {
            expect_size(*ba, "momentum_buffer", param.size());
            b = contiguous_ptr<T>(*ba, "momentum_buffer", true);
          } else if (momentum != 0) {
            throw py::value_error("momentum_buffer: required when momentum != 0");
          }
          T* p = contiguous_ptr<T>(param, "param", true);
          const T* g = contiguous_ptr<T>(grad, "grad", false);
          py::gil_scoped_release release;
          kernels<T>().sgd_step(p, g, b, param.size(), lr, momentum, dampening, weight_decay, nesterov, first);
        });
      },
      "One SGD step on param in place (torch.optim.SGD's update); momentum_buffer (param's size) or None when "
      "momentum is 0; first: the buffer's first step.",
      py::arg("param"), py::arg("grad"), py::arg("momentum_buffer"), py::arg("lr"), py::arg("momentum"),
      py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("first"));
  m.def(
      "adamw_step",
      [](const py::array& param, const py::array& grad, const py::array& exp_avg, const py::array& exp_avg_sq,
         double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
        dispatch(param, "param", [&](auto t) {
          using T = typename decltype(t)::type;
          for (const auto* a : {&grad, &exp_avg, &exp_avg_sq}) expect_size(*a, "optimizer state", param.size());
          T *p = contiguous_ptr<T>(param, "param", true), *m1 = contiguous_ptr<T>(exp_avg, "exp_avg", true);
          T* m2 = contiguous_ptr<T>(exp_avg_sq, "exp_avg_sq", true);
          const T* g = contiguous_ptr<T>(grad, "grad", false);
          py::gil_scoped_release release;
          kernels<T>().adamw_step(p, g, m1, m2, param.size(), lr, beta1, beta2, eps, weight_decay, step);
        });
      },
      "One AdamW step (torch.optim.AdamW's update) on param, exp_avg and exp_avg_sq in place; step counts from 1.",
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"));
}
