// attnpp._core: one named entry point per operation, each a function of NumPy arrays (outputs first, as the
// kernels write them) that checks the buffers (arrays.hpp), takes their pointers and strides, releases the GIL
// and calls the CPU level's kernel. The dtype dispatch happens once in each body (dispatch), which is written for
// both dtypes as a generic lambda. User-facing validation lives in python/attnpp/_checks.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "arrays.hpp"
#include "attention_params.hpp"
#include "buffer_pool.hpp"
#include "kernels.hpp"

namespace py = pybind11;
using namespace attnpp;
using namespace attnpp::bindings;

namespace {

constexpr int64_t kMaxThreads = 256;  // set_num_threads' bound: far more makes libgomp fail to start them

// ------------------------------------------------------------------------------------------------- attention
// The dtype of key and value (T) decides; query and out are of T, or float32 over a half-precision key and value
// (a KV cache in half precision with float32 queries).
void sdpa_forward(const py::array& out, const py::array& logsumexp, const py::array& query, const py::array& key,
                  const py::array& value, const AttentionParams& params) {
  dispatch(key, "key", [&](auto t) {
    using T = typename decltype(t)::type;
    using C = compute_t<T>;
    const auto k = view4<T, const T>(key, "key", false), v = view4<T, const T>(value, "value", false);
    const Problem<T> p(query, key, value.shape(3), params);
    const int64_t N = query.shape(0), Hq = query.shape(1), L = query.shape(2), Dv = value.shape(3);
    expect_shape(value, "value", {N, key.shape(1), key.shape(2), Dv});
    expect_shape(out, "out", {N, Hq, L, Dv});
    expect_shape(logsumexp, "logsumexp", {N, Hq, L});
    auto* lse = contiguous_ptr<C>(logsumexp, "logsumexp", true);
    if (is_half<T> && query.dtype().equal(dtype_of<C>())) {
      const auto q = view4<C, const C>(query, "query", false);
      const auto o = view4<C, C>(out, "out", true);
      py::gil_scoped_release release;
      kernels<T>().sdpa_forward_wide_queries(p.rows_of(o, true), lse, p.rows_of(q, true), p.rows_of(k, false),
                                             p.rows_of(v, false), p.cfg);
      return;
    }
    const auto q = view4<T, const T>(query, "query", false);
    const auto o = view4<T, T>(out, "out", true);
    py::gil_scoped_release release;
    kernels<T>().sdpa_forward(p.rows_of(o, true), lse, p.rows_of(q, true), p.rows_of(k, false),
                              p.rows_of(v, false), p.cfg);
  });
}

void sdpa_backward(const py::array& grad_query, const py::array& grad_key, const py::array& grad_value,
                   const py::array& grad_output, const py::array& out, const py::array& logsumexp,
                   const py::array& query, const py::array& key, const py::array& value,
                   const AttentionParams& params, const py::object& grad_sinks) {
  dispatch(query, "query", [&](auto t) {
    using T = typename decltype(t)::type;
    const auto q = view4<T, const T>(query, "query", false), k = view4<T, const T>(key, "key", false);
    const auto v = view4<T, const T>(value, "value", false);
    const Problem<T> p(query, key, value.shape(3), params);
    const int64_t N = query.shape(0), Hq = query.shape(1), L = query.shape(2), D = query.shape(3);
    const int64_t Hk = key.shape(1), S = key.shape(2), Dv = value.shape(3);
    expect_shape(value, "value", {N, Hk, S, Dv});
    expect_shape(out, "out", {N, Hq, L, Dv});
    expect_shape(grad_output, "grad_output", {N, Hq, L, Dv});
    expect_shape(logsumexp, "logsumexp", {N, Hq, L});
    expect_shape(grad_query, "grad_query", {N, Hq, L, D});
    expect_shape(grad_key, "grad_key", {N, Hk, S, D});
    expect_shape(grad_value, "grad_value", {N, Hk, S, Dv});
    const auto o = view4<T, const T>(out, "out", false), dout = view4<T, const T>(grad_output, "grad_output", false);
    const auto* lse = contiguous_ptr<compute_t<T>>(logsumexp, "logsumexp", false);
    const auto dq = view4<T, T>(grad_query, "grad_query", true), dk = view4<T, T>(grad_key, "grad_key", true);
    const auto dv = view4<T, T>(grad_value, "grad_value", true);
    auto* dsinks = optional_ptr<compute_t<T>>(grad_sinks, "grad_sinks", {Hq}, true);
    py::gil_scoped_release release;
    kernels<T>().sdpa_backward(p.rows_of(dq, true), p.rows_of(dk, false), p.rows_of(dv, false), dsinks,
                               p.rows_of(dout, true), p.rows_of(o, true), lse, p.rows_of(q, true),
                               p.rows_of(k, false), p.rows_of(v, false), p.cfg);
  });
}

void sdpa_weights(const py::array& weights, const py::array& logsumexp, const py::array& query,
                  const py::array& key, const AttentionParams& params, bool average_heads) {
  dispatch(query, "query", [&](auto t) {
    using T = typename decltype(t)::type;
    const auto q = view4<T, const T>(query, "query", false), k = view4<T, const T>(key, "key", false);
    const Problem<T> p(query, key, 0, params);
    const auto& cfg = p.cfg;
    if (cfg.cu_q || cfg.seqlens_k) throw py::value_error("sdpa_weights: not for packed sequences or a KV cache");
    expect_shape(logsumexp, "logsumexp", {cfg.N, cfg.Hq, cfg.L});
    if (average_heads)
      expect_shape(weights, "weights", {cfg.N, cfg.L, cfg.S});
    else
      expect_shape(weights, "weights", {cfg.N, cfg.Hq, cfg.L, cfg.S});
    const auto* lse = contiguous_ptr<compute_t<T>>(logsumexp, "logsumexp", false);
    T* w = contiguous_ptr<T>(weights, "weights", true);
    py::gil_scoped_release release;
    kernels<T>().sdpa_weights(w, lse, q, k, cfg, average_heads);
  });
}

// ----------------------------------------------------------------------------------------------------- rotary
// Rotary embedding forward into dst = out, or backward (the opposite angles) added into dst = grad_input, from
// src (N, H, L, D), cos, sin (P, R2), position_offsets (N,): ValueError unless every table row read,
// position_offsets[n] + l for l < L, lies in [0, P) and 2 * R2 <= D.
void rotary(const py::array& dst, const py::array& src, const py::array& cos, const py::array& sin,
            const py::array& position_offsets, bool interleaved, bool backward) {
  const char* dst_name = backward ? "grad_input" : "out";
  const char* src_name = backward ? "grad_output" : "input";
  dispatch(src, src_name, [&](auto t) {
    using T = typename decltype(t)::type;
    const auto sv = view4<T, const T>(src, src_name, false);
    const int64_t N = src.shape(0), H = src.shape(1), L = src.shape(2), D = src.shape(3);
    expect_shape(dst, dst_name, {N, H, L, D});
    expect_ndim(cos, "cos", 2);
    const int64_t P = cos.shape(0), R2 = cos.shape(1);
    expect_shape(sin, "sin", {P, R2});
    if (R2 > D / 2)
      throw py::value_error("cos: rotary_dim 2 * " + std::to_string(R2) + " exceeds the head width D = " +
                            std::to_string(D));
    expect_shape(position_offsets, "position_offsets", {N});
    const auto off = int64_copy(position_offsets, "position_offsets");  // (a copy: read with the GIL released)
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
  });
}

void rotary_forward(const py::array& out, const py::array& input, const py::array& cos, const py::array& sin,
                    const py::array& position_offsets, bool interleaved) {
  rotary(out, input, cos, sin, position_offsets, interleaved, false);
}

void rotary_backward(const py::array& grad_input, const py::array& grad_output, const py::array& cos,
                     const py::array& sin, const py::array& position_offsets, bool interleaved) {
  rotary(grad_input, grad_output, cos, sin, position_offsets, interleaved, true);
}

// ----------------------------------------------------------------------------------------------------- linear
void linear_forward(const py::array& out, const py::array& input, const py::array& weight, const py::object& bias) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    expect_ndim(input, "input", 2), expect_ndim(weight, "weight", 2);
    const int64_t M = input.shape(0), Fin = input.shape(1), Fout = weight.shape(0);
    expect_shape(weight, "weight", {Fout, Fin});
    expect_shape(out, "out", {M, Fout});
    const T* b = optional_ptr<T>(bias, "bias", {Fout}, false);
    T* y = contiguous_ptr<T>(out, "out", true);
    const T *x = contiguous_ptr<T>(input, "input", false), *w = contiguous_ptr<T>(weight, "weight", false);
    py::gil_scoped_release release;
    kernels<T>().linear_forward(y, x, w, b, M, Fin, Fout);
  });
}

void linear_backward(const py::object& grad_input, const py::array& grad_weight, const py::object& grad_bias,
                     const py::array& grad_output, const py::array& input, const py::array& weight) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    expect_ndim(input, "input", 2), expect_ndim(weight, "weight", 2);
    const int64_t M = input.shape(0), Fin = input.shape(1), Fout = weight.shape(0);
    expect_shape(weight, "weight", {Fout, Fin});
    expect_shape(grad_output, "grad_output", {M, Fout});
    expect_shape(grad_weight, "grad_weight", {Fout, Fin});
    T* dx = optional_ptr<T>(grad_input, "grad_input", {M, Fin}, true);
    T* db = optional_ptr<T>(grad_bias, "grad_bias", {Fout}, true);
    T* dw = contiguous_ptr<T>(grad_weight, "grad_weight", true);
    const T *dy = contiguous_ptr<T>(grad_output, "grad_output", false), *x = contiguous_ptr<T>(input, "input", false);
    const T* w = contiguous_ptr<T>(weight, "weight", false);
    py::gil_scoped_release release;
    kernels<T>().linear_backward(dx, dw, db, dy, x, w, M, Fin, Fout);
  });
}

// ---------------------------------------------------------------------------------------------------- dropout
py::array dropout_mask(const std::vector<py::ssize_t>& shape, double p, uint64_t seed) {
  array_bytes(shape, sizeof(bool), "dropout_mask");  // (before pybind computes strides that would overflow)
  py::array_t<bool> keep(shape);
  bool* ptr = keep.mutable_data();
  const int64_t count = keep.size();
  py::gil_scoped_release release;
  cpu_level().kernels->dropout_mask(ptr, count, p, seed);
  return keep;
}

void dropout_forward(const py::array& out, const py::array& input, double p, uint64_t seed) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    expect_size(out, "out", input.size());
    T* o = contiguous_ptr<T>(out, "out", true);
    const T* x = contiguous_ptr<T>(input, "input", false);
    py::gil_scoped_release release;
    kernels<T>().dropout_forward(o, x, input.size(), p, seed);
  });
}

void dropout_backward(const py::array& grad_input, const py::array& grad_output, double p, uint64_t seed) {
  dispatch(grad_output, "grad_output", [&](auto t) {
    using T = typename decltype(t)::type;
    expect_size(grad_input, "grad_input", grad_output.size());
    T* dx = contiguous_ptr<T>(grad_input, "grad_input", true);
    const T* dy = contiguous_ptr<T>(grad_output, "grad_output", false);
    py::gil_scoped_release release;
    kernels<T>().dropout_backward(dx, dy, grad_output.size(), p, seed);
  });
}

// -------------------------------------------------------------------------------------------------- embedding
// Embedding forward (out (N, E) = the rows `index` of table = weight (V, E)) or backward (the rows of
// grad_output (N, E) added into table = grad_weight at `index`): N int64 values in [0, V).
void embedding(const py::array& table, const py::array& rows, const py::array& index, bool backward) {
  const char* table_name = backward ? "grad_weight" : "weight";
  const char* rows_name = backward ? "grad_output" : "out";
  dispatch(table, table_name, [&](auto t) {
    using T = typename decltype(t)::type;
    expect_ndim(table, table_name, 2);
    const int64_t N = index.size(), E = table.shape(1);
    expect_shape(rows, rows_name, {N, E});
    T* table_p = contiguous_ptr<T>(table, table_name, backward);
    T* rows_p = contiguous_ptr<T>(rows, rows_name, !backward);
    const auto idx = indices(index, "input", table.shape(0));
    py::gil_scoped_release release;
    if (backward)
      kernels<T>().embedding_backward(table_p, rows_p, idx.data(), N, E);
    else
      kernels<T>().embedding_forward(rows_p, idx.data(), table_p, N, E);
  });
}

void embedding_forward(const py::array& out, const py::array& index, const py::array& weight) {
  embedding(weight, out, index, false);
}

void embedding_backward(const py::array& grad_weight, const py::array& grad_output, const py::array& index) {
  embedding(grad_weight, grad_output, index, true);
}

// ---------------------------------------------------------------------------------------------- cross entropy
void cross_entropy_forward(const py::array& losses, const py::array& stats, const py::array& input,
                           const py::array& target, int64_t ignore_index) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    expect_ndim(input, "input", 2);
    const int64_t N = input.shape(0), C = input.shape(1);
    if (C == 0 && N > 0) throw py::value_error("input: expected at least one class, got shape " + shape_str(input));
    expect_shape(losses, "losses", {N});
    expect_shape(stats, "stats", {N, 2});
    expect_shape(target, "target", {N});
    auto* l = contiguous_ptr<compute_t<T>>(losses, "losses", true);
    auto* s = contiguous_ptr<compute_t<T>>(stats, "stats", true);
    const T* x = contiguous_ptr<T>(input, "input", false);
    const auto tg = indices(target, "target", C, &ignore_index);
    py::gil_scoped_release release;
    kernels<T>().cross_entropy_forward(l, s, x, tg.data(), N, C, ignore_index);
  });
}

void cross_entropy_backward(const py::array& grad_input, const py::array& row_weight, const py::array& stats,
                            const py::array& input, const py::array& target) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    expect_ndim(input, "input", 2);
    const int64_t N = input.shape(0), C = input.shape(1);
    expect_shape(grad_input, "grad_input", {N, C});
    expect_shape(row_weight, "row_weight", {N});
    expect_shape(stats, "stats", {N, 2});
    expect_shape(target, "target", {N});
    T* d = contiguous_ptr<T>(grad_input, "grad_input", true);
    using F = compute_t<T>;
    const F* s = contiguous_ptr<F>(stats, "stats", false);
    const T* x = contiguous_ptr<T>(input, "input", false);
    // copies (see int64_copy): the targets of rows of nonzero weight are written to, the others not read
    const F* wp = contiguous_ptr<F>(row_weight, "row_weight", false);
    const std::vector<F> w(wp, wp + N);
    const auto tg = int64_copy(target, "target");
    for (int64_t i = 0; i < N; ++i)
      if (w[i] != F(0) && (tg[i] < 0 || tg[i] >= C))
        throw py::index_error("target: value " + std::to_string(tg[i]) + " out of range [0, " + std::to_string(C) +
                              ") on a row of nonzero weight");
    py::gil_scoped_release release;
    kernels<T>().cross_entropy_backward(d, w.data(), s, x, tg.data(), N, C);
  });
}

// ------------------------------------------------------------------------------------- linear + cross entropy
// The arrays both entries share: input (N, E), weight (V, E), bias (V,) or None, target (N,) checked against V,
// the gradients grad_input (N, E) or None, grad_weight (V, E), grad_bias (V,) or None (written), row_weight (N,)
// or None (copied, see int64_copy). A grad_weight is required with row_weight.
template <typename T>
struct FusedLossArrays {
  using C = compute_t<T>;
  int64_t N, E, V;
  std::vector<C> weights;
  const C* rw;
  T *dx, *dw, *db;
  const T *b, *x, *w;
  std::vector<int64_t> tg;

  FusedLossArrays(const py::object& grad_input, const py::object& grad_weight, const py::object& grad_bias,
                  const py::object& row_weight, const py::array& input, const py::array& weight,
                  const py::object& bias, const py::array& target, int64_t* ignore_index) {
    expect_ndim(input, "input", 2), expect_ndim(weight, "weight", 2);
    N = input.shape(0), E = input.shape(1), V = weight.shape(0);
    if (V == 0) throw py::value_error("weight: expected at least one class, got shape " + shape_str(weight));
    expect_shape(weight, "weight", {V, E});
    expect_shape(target, "target", {N});
    const C* given = optional_ptr<C>(row_weight, "row_weight", {N}, false);
    weights = given ? std::vector<C>(given, given + N) : std::vector<C>();
    rw = given ? weights.data() : nullptr;
    dx = optional_ptr<T>(grad_input, "grad_input", {N, E}, true);
    dw = optional_ptr<T>(grad_weight, "grad_weight", {V, E}, true);
    db = optional_ptr<T>(grad_bias, "grad_bias", {V}, true);
    if (rw && !dw) throw py::value_error("grad_weight: required with row_weight");
    b = optional_ptr<T>(bias, "bias", {V}, false);
    x = contiguous_ptr<T>(input, "input", false), w = contiguous_ptr<T>(weight, "weight", false);
    tg = indices(target, "target", V, ignore_index);
  }
};

void linear_cross_entropy(const py::array& losses, const py::array& logsumexp, const py::object& grad_input,
                          const py::object& grad_weight, const py::object& grad_bias, const py::object& row_weight,
                          const py::array& input, const py::array& weight, const py::object& bias,
                          const py::array& target, int64_t ignore_index, double label_smoothing, double softcap) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    using C = compute_t<T>;
    FusedLossArrays<T> a(grad_input, grad_weight, grad_bias, row_weight, input, weight, bias, target,
                         &ignore_index);
    expect_shape(losses, "losses", {a.N});
    expect_shape(logsumexp, "logsumexp", {a.N});
    C* l = contiguous_ptr<C>(losses, "losses", true);
    C* lse = contiguous_ptr<C>(logsumexp, "logsumexp", true);
    py::gil_scoped_release release;
    kernels<T>().linear_cross_entropy(l, lse, a.dx, a.dw, a.db, a.rw, a.x, a.w, a.b, a.tg.data(), a.N, a.E, a.V,
                                      ignore_index, label_smoothing, softcap);
  });
}

void linear_cross_entropy_backward(const py::array& logsumexp, const py::object& grad_input,
                                   const py::object& grad_weight, const py::object& grad_bias,
                                   const py::array& row_weight, const py::array& input, const py::array& weight,
                                   const py::object& bias, const py::array& target, int64_t ignore_index,
                                   double label_smoothing, double softcap) {
  dispatch(input, "input", [&](auto t) {
    using T = typename decltype(t)::type;
    using C = compute_t<T>;
    FusedLossArrays<T> a(grad_input, grad_weight, grad_bias, row_weight, input, weight, bias, target,
                         &ignore_index);
    expect_shape(logsumexp, "logsumexp", {a.N});
    const C* lse = contiguous_ptr<C>(logsumexp, "logsumexp", false);
    py::gil_scoped_release release;
    kernels<T>().linear_cross_entropy_backward(lse, a.dx, a.dw, a.db, a.rw, a.x, a.w, a.b, a.tg.data(), a.N, a.E,
                                               a.V, ignore_index, label_smoothing, softcap);
  });
}

// ------------------------------------------------------------------------------------------------- optimizers
// An entry of a list argument as an ndarray (never a converted copy: the kernels write into it).
py::array array_entry(const py::handle& o, const char* name) {
  const auto a = optional_array(py::reinterpret_borrow<py::object>(o), name);
  if (!a) throw py::type_error(std::string(name) + ": expected an ndarray, got None");
  return *a;
}

// The optimizer slots of parallel lists of arrays (one entry per parameter, all of params[0]'s dtype T, each
// C-contiguous and of its parameter's size): `states` the optimizer's state lists (SGD one, AdamW two), a null
// state where a list holds None.
template <typename T>
std::vector<OptimizerSlot<T>> optimizer_slots(const py::list& params, const py::list& grads,
                                              const std::vector<py::list>& states, const std::vector<int64_t>& steps) {
  const size_t count = params.size();
  if (grads.size() != count) throw py::value_error("grads: expected one entry per parameter");
  for (const auto& list : states)
    if (list.size() != count) throw py::value_error("optimizer states: expected one entry per parameter");
  if (steps.size() != count) throw py::value_error("steps: expected one entry per parameter");
  std::vector<OptimizerSlot<T>> slots(count);
  for (size_t i = 0; i < count; ++i) {
    const auto param = array_entry(params[i], "param");
    OptimizerSlot<T>& s = slots[i];
    s.n = param.size(), s.step = steps[i];
    s.param = contiguous_ptr<T>(param, "param", true);
    const auto grad = array_entry(grads[i], "grad");
    expect_size(grad, "grad", s.n);
    s.grad = contiguous_ptr<T>(grad, "grad", false);
    T** state_ptrs[2] = {&s.state0, &s.state1};
    for (size_t k = 0; k < states.size(); ++k) {
      if (const auto a = optional_array(py::reinterpret_borrow<py::object>(states[k][i]), "optimizer state")) {
        expect_size(*a, "optimizer state", s.n);
        *state_ptrs[k] = contiguous_ptr<T>(*a, "optimizer state", true);
      }
    }
  }
  return slots;
}

void sgd_step(const py::list& params, const py::list& grads, const py::list& momentum_buffers,
              const std::vector<int64_t>& steps, double lr, double momentum, double dampening, double weight_decay,
              bool nesterov) {
  if (params.empty()) return;
  dispatch(array_entry(params[0], "param"), "param", [&](auto t) {
    using T = typename decltype(t)::type;
    const auto slots = optimizer_slots<T>(params, grads, {momentum_buffers}, steps);
    for (const auto& s : slots)  // (the kernel writes the buffer when momentum != 0)
      if (momentum != 0 && !s.state0) throw py::value_error("momentum_buffers: required when momentum != 0");
    py::gil_scoped_release release;
    kernels<T>().sgd_step(slots.data(), int64_t(slots.size()), lr, momentum, dampening, weight_decay, nesterov);
  });
}

void adamw_step(const py::list& params, const py::list& grads, const py::list& exp_avgs,
                const py::list& exp_avg_sqs, const std::vector<int64_t>& steps, double lr, double beta1, double beta2,
                double eps, double weight_decay) {
  if (params.empty()) return;
  dispatch(array_entry(params[0], "param"), "param", [&](auto t) {
    using T = typename decltype(t)::type;
    const auto slots = optimizer_slots<T>(params, grads, {exp_avgs, exp_avg_sqs}, steps);
    for (const auto& s : slots)
      if (!s.state0 || !s.state1) throw py::value_error("exp_avgs, exp_avg_sqs: an array per parameter");
    py::gil_scoped_release release;
    kernels<T>().adamw_step(slots.data(), int64_t(slots.size()), lr, beta1, beta2, eps, weight_decay);
  });
}

// ---------------------------------------------------------------------------------------- memory, threads, build
py::array empty(const std::vector<py::ssize_t>& shape, const py::dtype& dtype) {
  const char kind = dtype.kind();  // numbers only: objects (and records holding them) need initialized memory
  if ((std::string("biufc").find(kind) == std::string::npos || dtype.has_fields()) &&
      !is_bfloat16(dtype))
    throw py::type_error("empty: expected a numeric dtype, got " + std::string(py::str(dtype)));
  void* data = pool_acquire(array_bytes(shape, dtype.itemsize(), "empty"));
  py::capsule owner(data, [](void* p) { pool_release(p); });
  return py::array(dtype, shape, data, owner);
}

// sdpa_forward of the commonest call, its checks and allocations in one step (functional's plain path): a
// decoding step calls the attention once per layer per token, its Python code gone cold from the caches in
// between; in a transformers model's decoding, the Python path's checks and allocations took ~60 us of attnpp's
// ~200 us attention call. The call: query (N, Hq, L, D), key (N, Hk, S, D), value (N, Hk, S, Dv) ndarrays (not
// subclasses) of one dtype of the four, their rows contiguous; Hk = Hq, or a divisor of it with enable_gqa (a
// bool); dropout_p 0 (a float or an int). The scale and the causal mode are functional's (score_scale,
// causal_mode: decided there, not restated here). Returns (out, logsumexp), out from the pool; None for any other
// call, which takes functional's general path (and its errors).
py::object sdpa_forward_plain(const py::object& query, const py::object& key, const py::object& value,
                              const py::object& dropout_p, Causal causal, double scale, const py::object& enable_gqa,
                              Bfloat16Numerics bfloat16_numerics) {
  PyTypeObject* ndarray = py::detail::npy_api::get().PyArray_Type_;
  for (const py::object* x : {&query, &key, &value})
    if (Py_TYPE(x->ptr()) != ndarray) return py::none();
  const auto q = py::reinterpret_borrow<py::array>(query), k = py::reinterpret_borrow<py::array>(key);
  const auto v = py::reinterpret_borrow<py::array>(value);
  const py::dtype dtype = q.dtype();
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || !k.dtype().equal(dtype) || !v.dtype().equal(dtype))
    return py::none();
  const bool half = dtype.equal(dtype_of<float16>()) || is_bfloat16(dtype);
  if (!half && !dtype.equal(dtype_of<float>()) && !dtype.equal(dtype_of<double>())) return py::none();
  const int64_t N = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int64_t Hk = v.shape(1), S = v.shape(2), Dv = v.shape(3);
  const bool gqa = enable_gqa.ptr() == Py_True;
  if (k.shape(0) != N || k.shape(1) != Hk || k.shape(2) != S || k.shape(3) != D || v.shape(0) != N ||
      !(Hk == Hq || (gqa && Hk > 0 && Hq % Hk == 0)))
    return py::none();
  if (!(PyFloat_CheckExact(dropout_p.ptr()) || PyLong_CheckExact(dropout_p.ptr())) ||
      PyObject_IsTrue(dropout_p.ptr()) != 0 || !PyBool_Check(enable_gqa.ptr()))
    return py::none();
  for (const py::array* x : {&q, &k, &v})
    if (x->shape(3) > 1 && x->strides(3) != x->itemsize()) return py::none();
  // (more elements than any array holds: the general path raises numpy's MemoryError)
  const __int128 elements = __int128(N) * Hq * std::max(L, S) * std::max({L, S, D, Dv, int64_t(1)});
  if (elements > std::numeric_limits<py::ssize_t>::max() / 8) return py::none();
  AttentionParams params;
  params.scale = scale;
  params.causal = causal;
  params.bfloat16_numerics = bfloat16_numerics;
  py::array out = empty({N, Hq, L, Dv}, dtype);
  py::array logsumexp(half ? dtype_of<float>() : dtype, std::vector<py::ssize_t>{N, Hq, L});
  sdpa_forward(out, logsumexp, q, k, v, params);
  return py::make_tuple(out, logsumexp);
}

void set_num_threads(int64_t n) {
  if (n < 1 || n > kMaxThreads)
    throw py::value_error("set_num_threads: n must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                          std::to_string(n));
  set_thread_count(int(n));
}

std::string cpu_capability() { return cpu_level().name; }

double multiply_add_peak(int64_t steps) {
  if (steps < 1) throw py::value_error("multiply_add_peak: steps must be >= 1, got " + std::to_string(steps));
  py::gil_scoped_release release;
  return cpu_level().kernels->multiply_add_peak(steps);
}

double forward_products(int64_t head_dim, int64_t steps) {
  if (head_dim < 1 || head_dim > 1024)
    throw py::value_error("forward_products: head_dim must be in [1, 1024], got " + std::to_string(head_dim));
  if (steps < 1) throw py::value_error("forward_products: steps must be >= 1, got " + std::to_string(steps));
  py::gil_scoped_release release;
  return cpu_level().kernels->forward_products(head_dim, steps);
}

py::dict build_config() {
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
  config["threading"] = threading_runtime();
  config["half_precision"] = cpu_level().half_precision;
  config["cpu_half_features"] = cpu_half_features();
  return config;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attnpp's C++ core. Use attnpp.functional and attnpp.nn instead of calling this directly.";

  // The CPU level, once, before any kernel runs: the best the CPU supports, or the one ATTNPP_CPU_CAPABILITY
  // forces (an exception here is the ImportError the user sees).
  const char* forced = std::getenv("ATTNPP_CPU_CAPABILITY");
  select_cpu_level(forced ? forced : "");

  py::enum_<Causal>(m, "Causal", "Which keys a causal mask hides: none; top_left (query i sees keys j <= i); "
                                 "bottom_right (query i sees keys j <= i + S - L).")
      .value("none", Causal::none)
      .value("top_left", Causal::top_left)
      .value("bottom_right", Causal::bottom_right);
  py::enum_<Bfloat16Numerics>(m, "Bfloat16Numerics",
                          "How bfloat16 attention computes: pytorch (as the PyTorch CPU kernel of the same call: "
                          "flash when D = Dv and no dropout, else float32); flash (the weights and their gradient "
                          "rounded for their products, the softmax term from the rounded output); float32 (those "
                          "products in float32, the softmax term from the weights).")
      .value("pytorch", Bfloat16Numerics::pytorch)
      .value("flash", Bfloat16Numerics::flash)
      .value("float32", Bfloat16Numerics::float32);
  py::class_<AttentionMask>(m, "AttentionMask",
                            "An additive mask broadcast to (N, H, L, S): element (n, h, i, j) is the element of data "
                            "at batch_offsets[n] + h * h_stride + i * l_stride + j * s_stride elements from its first "
                            "(in memory, whatever data's shape); data of the attention's dtype, batch_offsets (N,) "
                            "int64.")
      .def(py::init<py::array, py::array, int64_t, int64_t, int64_t>(), "The mask's fields.", py::arg("data"),
           py::arg("batch_offsets"),
           py::arg("h_stride"), py::arg("l_stride"), py::arg("s_stride"))
      .def_readwrite("data", &AttentionMask::data)
      .def_readwrite("batch_offsets", &AttentionMask::batch_offsets)
      .def_readwrite("h_stride", &AttentionMask::h_stride)
      .def_readwrite("l_stride", &AttentionMask::l_stride)
      .def_readwrite("s_stride", &AttentionMask::s_stride);
  py::class_<AttentionParams>(m, "AttentionParams",
                              "The parameters of sdpa_forward/backward/weights: scale (1.0), causal (Causal.none), "
                              "dropout_p (0.0), seed (0), masks (AttentionMask list, summed into the scores), "
                              "window_left, window_right (-1 unbounded; keys [i + S - L - left, i + S - L + right]), "
                              "softcap (0 none), bfloat16_numerics (Bfloat16Numerics.pytorch), accumulate (False; True: the "
                              "forward merges its keys into the partial result over other keys that out and logsumexp "
                              "hold), alibi_slopes ((1 or N, Hq) or None), sinks ((Hq,) or None), "
                              "cu_seqlens_q and cu_seqlens_k ((N + 1,) int64: packed sequences in the arrays' one "
                              "batch entry), seqlens_k ((N,) int64: keys per batch entry, a KV cache).")
      .def(py::init<>(), "The defaults; the fields are then set as attributes.")
      .def_readwrite("scale", &AttentionParams::scale)
      .def_readwrite("causal", &AttentionParams::causal)
      .def_readwrite("dropout_p", &AttentionParams::dropout_p)
      .def_readwrite("seed", &AttentionParams::seed)
      .def_readwrite("masks", &AttentionParams::masks)
      .def_readwrite("window_left", &AttentionParams::window_left)
      .def_readwrite("window_right", &AttentionParams::window_right)
      .def_readwrite("softcap", &AttentionParams::softcap)
      .def_readwrite("bfloat16_numerics", &AttentionParams::bfloat16_numerics)
      .def_readwrite("accumulate", &AttentionParams::accumulate)
      .def_readwrite("alibi_slopes", &AttentionParams::alibi_slopes)
      .def_readwrite("sinks", &AttentionParams::sinks)
      .def_readwrite("cu_seqlens_q", &AttentionParams::cu_seqlens_q)
      .def_readwrite("cu_seqlens_k", &AttentionParams::cu_seqlens_k)
      .def_readwrite("seqlens_k", &AttentionParams::seqlens_k);

  m.def("sdpa_forward", &sdpa_forward,
        "Attention forward into out (N, Hq, L, Dv) and logsumexp (N, Hq, L), of query (N, Hq, L, D), key (N, Hk, "
        "S, D), value (N, Hk, S, Dv), all of one dtype (query and out may be float32 with half-precision key and "
        "value; logsumexp in the compute dtype), last dimensions contiguous.",
        py::arg("out"), py::arg("logsumexp"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("params"));
  m.def("sdpa_forward_plain", &sdpa_forward_plain,
        "sdpa_forward of the commonest call in one step: (out, logsumexp) of query (N, Hq, L, D), key (N, Hk, S, D), "
        "value (N, Hk, S, Dv) ndarrays of one dtype with contiguous rows, Hk = Hq or a divisor of it with "
        "enable_gqa (a bool), dropout_p 0, with the causal mode and the scale given; None for any other call.",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("dropout_p"), py::arg("causal"),
        py::arg("scale"), py::arg("enable_gqa"), py::arg("bfloat16_numerics"));
  m.def("sdpa_backward", &sdpa_backward,
        "Attention backward: adds the gradients into grad_query (N, Hq, L, D), grad_key (N, Hk, S, D), grad_value "
        "(N, Hk, S, Dv) and grad_sinks (Hq,) or None, from grad_output and out (N, Hq, L, Dv), logsumexp (N, Hq, L) "
        "and sdpa_forward's inputs and params.",
        py::arg("grad_query"), py::arg("grad_key"), py::arg("grad_value"), py::arg("grad_output"), py::arg("out"),
        py::arg("logsumexp"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("params"),
        py::arg("grad_sinks") = py::none());
  m.def("sdpa_weights", &sdpa_weights,
        "The attention weights (after dropout) into weights (N, Hq, L, S), or (N, L, S) averaged over heads, from "
        "sdpa_forward's logsumexp (N, Hq, L), query, key and params.",
        py::arg("weights"), py::arg("logsumexp"), py::arg("query"), py::arg("key"), py::arg("params"),
        py::arg("average_heads") = false);
  m.def("rotary_forward", &rotary_forward,
        "Rotary position embedding of input (N, H, L, D) into out (N, H, L, D): the first R = 2 * R2 features of "
        "row l of sequence n rotated by the angles of row position_offsets[n] + l of cos and sin (P, R2, "
        "C-contiguous), pairs (d, d + R2), or (2d, 2d + 1) when interleaved; the features R.. copied. "
        "position_offsets: (N,) int64, each in [0, P - L].",
        py::arg("out"), py::arg("input"), py::arg("cos"), py::arg("sin"), py::arg("position_offsets"),
        py::arg("interleaved"));
  m.def("rotary_backward", &rotary_backward,
        "Rotary embedding backward: adds into grad_input (N, H, L, D) grad_output (N, H, L, D) rotated by the "
        "opposite angles (sin -> -sin), its features R.. as they are; the other arguments as rotary_forward's.",
        py::arg("grad_input"), py::arg("grad_output"), py::arg("cos"), py::arg("sin"), py::arg("position_offsets"),
        py::arg("interleaved"));
  m.def("linear_forward", &linear_forward,
        "out (M, Fout) = input (M, Fin) @ weight (Fout, Fin).T + bias (Fout,) or None; all C-contiguous.",
        py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias"));
  m.def("linear_backward", &linear_backward,
        "Linear backward: adds the gradients into grad_input (M, Fin) or None, grad_weight (Fout, Fin), grad_bias "
        "(Fout,) or None, from grad_output (M, Fout), input and weight.",
        py::arg("grad_input"), py::arg("grad_weight"), py::arg("grad_bias"), py::arg("grad_output"),
        py::arg("input"), py::arg("weight"));
  m.def("dropout_mask", &dropout_mask,
        "The keep mask (bool, of the given shape) of dropout with probability p and seed.", py::arg("shape"),
        py::arg("p"), py::arg("seed"));
  m.def("dropout_forward", &dropout_forward,
        "Dropout of input into out (same size, C-contiguous), kept elements scaled by 1 / (1 - p).", py::arg("out"),
        py::arg("input"), py::arg("p"), py::arg("seed"));
  m.def("dropout_backward", &dropout_backward,
        "Dropout backward: adds into grad_input from grad_output (same size), by the mask of the same p and seed.",
        py::arg("grad_input"), py::arg("grad_output"), py::arg("p"), py::arg("seed"));
  m.def("embedding_forward", &embedding_forward, "out (N, E) = weight (V, E)[index], index: N int64 values in [0, V).",
        py::arg("out"), py::arg("index"), py::arg("weight"));
  m.def("embedding_backward", &embedding_backward,
        "Adds the rows of grad_output (N, E) into grad_weight (V, E) at index (N int64 values).",
        py::arg("grad_weight"), py::arg("grad_output"), py::arg("index"));
  m.def("cross_entropy_forward", &cross_entropy_forward,
        "Per-row cross entropy of input (N, C) logits and target (N,) int64 into losses (N,) and stats (N, 2) for "
        "the backward; rows whose target is ignore_index get loss 0.",
        py::arg("losses"), py::arg("stats"), py::arg("input"), py::arg("target"), py::arg("ignore_index"));
  m.def("cross_entropy_backward", &cross_entropy_backward,
        "grad_input (N, C) of the losses weighted by row_weight (N,), from cross_entropy_forward's stats (N, 2), "
        "input and target.",
        py::arg("grad_input"), py::arg("row_weight"), py::arg("stats"), py::arg("input"), py::arg("target"));
  m.def("linear_cross_entropy", &linear_cross_entropy,
        "Fused cross_entropy(input (N, E) @ weight (V, E).T + bias (V,) or None, target (N,) int64) with label "
        "smoothing, over chunks of rows: writes the per-row losses (N,) (0 where ignored) and logsumexp (N,). With "
        "row_weight (N,), also adds the gradients into grad_input (N, E) or None, grad_weight (V, E) and grad_bias "
        "(V,) or None in the same pass. softcap > 0: the logits soft-capped, softcap * tanh(z / softcap).",
        py::arg("losses"), py::arg("logsumexp"), py::arg("grad_input"), py::arg("grad_weight"), py::arg("grad_bias"),
        py::arg("row_weight"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("target"),
        py::arg("ignore_index"), py::arg("label_smoothing"), py::arg("softcap") = 0.0);
  m.def("linear_cross_entropy_backward", &linear_cross_entropy_backward,
        "Backward of linear_cross_entropy: each chunk's logits recomputed from the forward's logsumexp (N,), the "
        "gradients of the losses weighted by row_weight (N,) added into grad_input (N, E) or None, grad_weight "
        "(V, E) and grad_bias (V,) or None.",
        py::arg("logsumexp"), py::arg("grad_input"), py::arg("grad_weight"), py::arg("grad_bias"),
        py::arg("row_weight"), py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("target"),
        py::arg("ignore_index"), py::arg("label_smoothing"), py::arg("softcap") = 0.0);
  m.def("sgd_step", &sgd_step,
        "One SGD step (torch.optim.SGD's update) on every param of the list in place, in one parallel loop; "
        "momentum_buffers: an array of param's size per param, or None when momentum is 0; steps: 1 on a buffer's "
        "first step.",
        py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("steps"), py::arg("lr"),
        py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"));
  m.def("adamw_step", &adamw_step,
        "One AdamW step (torch.optim.AdamW's update) on every param of the list and its exp_avg and exp_avg_sq in "
        "place, in one parallel loop; steps count from 1.",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"));
  m.def("empty", &empty, "An uninitialized C-contiguous array of a numeric dtype, its memory recycled by attnpp's pool.",
        py::arg("shape"), py::arg("dtype"));
  m.def("empty_cache", &pool_empty, "Free the pool's cached blocks; returns their size in bytes.");
  m.def("set_num_threads", &set_num_threads, "Set the number of threads the kernels use, n in [1, 256].",
        py::arg("n"));
  m.def("get_num_threads", &thread_count, "The number of threads the kernels use.");
  m.def("cpu_capability", &cpu_capability,
        "The CPU level the kernels run at: 'default', 'avx2', 'avx512' or 'avx512_bf16' (all but the first on "
        "x86-64 only).");
  m.def("multiply_add_peak", &multiply_add_peak,
        "Runs `steps` float multiply-adds on each of 14 independent vector accumulators (30 with AVX-512), 8 tasks "
        "a thread, nothing loaded, and returns the flops done: flops / seconds is the level's peak on these threads "
        "(attnpp.bench).",
        py::arg("steps"));
  m.def("forward_products", &forward_products,
        "Runs the attention forward's two products alone, q k^T then p v, on the blocks the forward takes for a head "
        "of width head_dim (in [1, 1024]), `steps` times each in 8 tasks a thread, and returns the flops done: flops "
        "/ seconds is the most the forward's products reach on these threads, without the softmax (attnpp.bench).",
        py::arg("head_dim"), py::arg("steps"));
  m.def("build_config", &build_config,
        "The build: dict of cpu_capability, levels_built, levels_supported, compiler, flags, eigen, threading, "
        "half_precision (how the level computes in it), cpu_half_features (F16C, AVX512_BF16, AVX512_FP16, "
        "AMX-BF16 when the CPU has them).");
}
