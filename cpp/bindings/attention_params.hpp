// What an attention call passes besides its arrays: _core.AttentionParams (scale, causal alignment, dropout,
// masks as _core.AttentionMask, the variants' options), and Problem, the AttnConfig the kernels read, built from
// the params and the arrays' shapes with the guards memory safety needs (see arrays.hpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "arrays.hpp"
#include "common.hpp"

namespace attnpp::bindings {

// An additive mask broadcast to (N, H, L, S): element (n, h, i, j) is
// data.flat[batch_offsets[n] + h * h_stride + i * l_stride + j * s_stride] (offsets and strides in elements of the
// array's own layout, from its first element: MaskView in common.hpp).
struct AttentionMask {
  py::array data;
  py::array batch_offsets;  // (N,) int64
  int64_t h_stride = 0, l_stride = 0, s_stride = 0;
};

// The parameters of one sdpa_forward / sdpa_backward / sdpa_weights call. Adding one: a field here, its
// def_readwrite in module.cpp, its use in Problem below (and in AttnConfig when the kernels read it).
struct AttentionParams {
  double scale = 1.0;
  Causal causal = Causal::none;
  double dropout_p = 0.0;
  uint64_t seed = 0;
  std::vector<AttentionMask> masks;             // summed into the scores
  int64_t window_left = -1, window_right = -1;  // keys [i + S - L - left, i + S - L + right]; -1 unbounded
  double softcap = 0.0;                         // 0: none
  Bfloat16Numerics bfloat16_numerics = Bfloat16Numerics::pytorch;  // see flash_numerics() in common.hpp
  bool accumulate = false;                      // the forward merges into out and logsumexp's partial result
  py::object alibi_slopes = py::none();         // (1 or N, Hq) of the compute dtype (float32 for the halves)
  py::object sinks = py::none();                // (Hq,) of the compute dtype
  py::object cu_seqlens_q = py::none(), cu_seqlens_k = py::none();  // (N + 1,) int64: packed sequences
  py::object seqlens_k = py::none();            // (N,) int64: keys per batch entry (a KV cache)
};

// An attention problem: the config and the copies of the small arrays it points into (offsets and lengths are
// checked, then used with the GIL released, when another Python thread could change the arrays: see int64_copy).
template <typename T>
struct Problem {
  AttnConfig<T> cfg;
  std::vector<std::vector<int64_t>> offsets;
  std::vector<int64_t> cu_q, cu_k, seqlens_k;
  std::vector<compute_t<T>> alibi, sinks;
  Problem(const Problem&) = delete;  // cfg points into the vectors

  // From query (N, Hq, L, D) and key (N, Hk, S, D) (N = 1 for packed sequences: L and S are then the total
  // lengths), value's width Dv and the params.
  Problem(const py::array& q, const py::array& k, int64_t Dv, const AttentionParams& p) {
    cfg.N = q.shape(0), cfg.Hq = q.shape(1), cfg.L = q.shape(2), cfg.D = q.shape(3);
    cfg.Hk = k.shape(1), cfg.S = k.shape(2), cfg.Dv = Dv;
    expect_shape(k, "key", {cfg.N, cfg.Hk, cfg.S, cfg.D});
    if (cfg.Hk == 0 ? cfg.Hq != 0 : cfg.Hq % cfg.Hk != 0)  // (a query head's key head h / group must exist)
      throw py::value_error("query heads (" + std::to_string(cfg.Hq) + ") must be a multiple of key heads (" +
                            std::to_string(cfg.Hk) + ")");
    if (p.causal != Causal::none && p.causal != Causal::top_left && p.causal != Causal::bottom_right)
      throw py::value_error("causal: not a Causal value");
    cfg.scale = compute_t<T>(p.scale), cfg.causal = p.causal, cfg.dropout_p = p.dropout_p, cfg.seed = p.seed;
    cfg.window_left = p.window_left, cfg.window_right = p.window_right, cfg.softcap = compute_t<T>(p.softcap);
    cfg.flash_numerics = std::is_same_v<T, bfloat16> && flash_numerics(p.bfloat16_numerics, cfg.D, cfg.Dv, p.dropout_p);
    cfg.accumulate = p.accumulate;
    for (const auto& m : p.masks) add_mask(m);
    if (!p.alibi_slopes.is_none()) {
      const auto a = *optional_array(p.alibi_slopes, "alibi_slopes");
      if (a.ndim() != 2 || a.shape(1) != cfg.Hq || (a.shape(0) != 1 && a.shape(0) != cfg.N))
        throw py::value_error("alibi_slopes: expected shape (1 or " + std::to_string(cfg.N) + ", " +
                              std::to_string(cfg.Hq) + "), got " + shape_str(a));
      alibi = copy_of(a, "alibi_slopes", a.size());
      cfg.alibi = alibi.data(), cfg.alibi_n = a.shape(0) == 1 ? 0 : cfg.Hq;
    }
    if (const auto a = optional_array(p.sinks, "sinks")) {
      sinks = copy_of(*a, "sinks", cfg.Hq);
      cfg.sinks = sinks.data();
      if (cfg.accumulate) throw py::value_error("accumulate: not with sinks (each call would count them again)");
    }
    const auto cu_seqlens_q = optional_array(p.cu_seqlens_q, "cu_seqlens_q");
    const auto cu_seqlens_k = optional_array(p.cu_seqlens_k, "cu_seqlens_k");
    const auto lengths_k = optional_array(p.seqlens_k, "seqlens_k");
    if (cu_seqlens_q || cu_seqlens_k) {
      if (!cu_seqlens_q || !cu_seqlens_k || lengths_k)
        throw py::value_error("cu_seqlens_q and cu_seqlens_k go together, without seqlens_k");
      if (cfg.N != 1 || !cfg.masks.empty())
        throw py::value_error("packed sequences: expected one batch entry and no mask");
      cu_q = int64_copy(*cu_seqlens_q, "cu_seqlens_q"), cu_k = int64_copy(*cu_seqlens_k, "cu_seqlens_k");
      if (cu_q.size() != cu_k.size())
        throw py::value_error("cu_seqlens_q and cu_seqlens_k: expected the same number of sequences");
      const int64_t L = longest(cu_q, cfg.L, "cu_seqlens_q");
      cfg.S = longest(cu_k, cfg.S, "cu_seqlens_k"), cfg.L = L;
      cfg.N = int64_t(cu_q.size()) - 1, cfg.cu_q = cu_q.data(), cfg.cu_k = cu_k.data();
    } else if (lengths_k) {
      seqlens_k = int64_copy(*lengths_k, "seqlens_k");
      if (int64_t(seqlens_k.size()) != cfg.N) throw py::value_error("seqlens_k: expected one length per batch entry");
      for (const auto s : seqlens_k)
        if (s < 0 || s > cfg.S) throw py::value_error("seqlens_k: lengths must be in [0, S]");
      if (!cfg.masks.empty()) throw py::value_error("seqlens_k: no mask with a KV cache");
      cfg.seqlens_k = seqlens_k.data();
    }
  }

  // The views of packed sequences read rows cu[n].. of the one batch entry.
  template <typename A>
  View4<A> rows_of(View4<A> v, bool queries) const {
    if (queries ? cfg.cu_q : cfg.cu_k) v.n = 0;
    return v;
  }

 private:
  // ValueError unless every element (n, h, i, j) < (N, Hq, L, S) the mask view reads lies within the mask array's
  // own elements (its offsets and strides come from Python; a wrong one would read outside the array).
  void add_mask(const AttentionMask& m) {
    const py::array& a = m.data;
    if (m.batch_offsets.ndim() != 1 || m.batch_offsets.shape(0) != cfg.N)
      throw py::value_error("mask batch offsets: expected shape (" + std::to_string(cfg.N) + ",)");
    check_dtype<T>(a, "attn_mask");
    offsets.push_back(int64_copy(m.batch_offsets, "mask batch offsets"));
    if (cfg.N > 0 && cfg.Hq > 0 && cfg.L > 0 && cfg.S > 0) {
      check_aligned(a, "attn_mask");
      using Wide = __int128;  // no overflow from int64 strides times int64 sizes
      Wide lo = 0, hi = 0;    // the array's elements lie in [data + lo, data + hi]
      for (py::ssize_t d = 0; d < a.ndim(); ++d) {
        if (a.shape(d) == 0) throw py::value_error("attn_mask: empty mask array for a non-empty attention");
        if (a.strides(d) % py::ssize_t(sizeof(T)))
          throw py::value_error("attn_mask: strides must be multiples of the item size");
        const Wide reach = Wide(a.shape(d) - 1) * (a.strides(d) / py::ssize_t(sizeof(T)));
        (reach < 0 ? lo : hi) += reach;
      }
      Wide span_lo = 0, span_hi = 0;  // reach of (h, i, j) from a batch offset
      for (const auto& [size, stride] : {std::pair{cfg.Hq, m.h_stride}, {cfg.L, m.l_stride}, {cfg.S, m.s_stride}}) {
        const Wide reach = Wide(size - 1) * stride;
        (reach < 0 ? span_lo : span_hi) += reach;
      }
      for (const int64_t offset : offsets.back())
        if (offset + span_lo < lo || offset + span_hi > hi)
          throw py::value_error("attn_mask: batch offsets and strides reach outside the mask array");
    }
    cfg.masks.push_back(MaskView<T>{static_cast<const T*>(a.data()), offsets.back().data(), m.h_stride, m.l_stride,
                                    m.s_stride});
  }

  // A small array of T's compute type (float32 for the halves) copied, of `count` elements (any shape), else
  // TypeError/ValueError.
  static std::vector<compute_t<T>> copy_of(const py::array& a, const char* name, int64_t count) {
    const compute_t<T>* p = contiguous_ptr<compute_t<T>>(a, name, false);
    if (a.size() != count)
      throw py::value_error(std::string(name) + ": expected " + std::to_string(count) + " values, got shape " +
                            shape_str(a));
    return std::vector<compute_t<T>>(p, p + count);
  }

  // Cumulative lengths (N + 1), from 0, non-decreasing, to `total`: the longest sequence, else ValueError.
  static int64_t longest(const std::vector<int64_t>& cu, int64_t total, const char* name) {
    int64_t most = 0;
    bool ok = !cu.empty() && cu.front() == 0 && cu.back() == total;
    for (size_t n = 1; ok && n < cu.size(); ++n) {
      ok = cu[n] >= cu[n - 1];
      most = std::max(most, cu[n] - cu[n - 1]);
    }
    if (!ok)
      throw py::value_error(std::string(name) + ": expected non-decreasing offsets from 0 to " +
                            std::to_string(total));
    return most;
  }
};

}  // namespace attnpp::bindings
