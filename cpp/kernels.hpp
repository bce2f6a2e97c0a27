// The table of one CPU level's kernels, and the level in use.
//
// CMakeLists.txt compiles the kernel files once per level the architecture has (default, avx2, avx512,
// avx512_bf16 on x86-64;
// default alone elsewhere), each into its own namespace (attnpp::cpu_avx2, ...), and kernels.cpp gathers each
// level's entry points into its `kernels` table. dispatch.cpp picks one table at import; the bindings call
// through it. What the kernels compute is documented where they are declared (attention.hpp, linear.hpp,
// training.hpp, rotary.hpp).
#pragma once

#include <string>
#include <vector>

#include "common.hpp"

namespace attnpp {

template <typename T>
struct Kernels {
  using C = compute_t<T>;  // the log-sum-exp, the slopes and the sinks are in the compute type
  void (*sdpa_forward)(const View4<T>& out, C* logsumexp, const View4<const T>& q, const View4<const T>& k,
                       const View4<const T>& v, const AttnConfig<T>& cfg);
  void (*sdpa_forward_wide_queries)(const View4<C>& out, C* logsumexp, const View4<const C>& q,
                                    const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg);
  void (*sdpa_backward)(const View4<T>& dq, const View4<T>& dk, const View4<T>& dv, C* dsinks,
                        const View4<const T>& dout, const View4<const T>& out, const C* logsumexp,
                        const View4<const T>& q,
                        const View4<const T>& k, const View4<const T>& v, const AttnConfig<T>& cfg);
  void (*sdpa_weights)(T* weights, const C* logsumexp, const View4<const T>& q, const View4<const T>& k,
                       const AttnConfig<T>& cfg, bool average_heads);
  void (*linear_forward)(T* y, const T* x, const T* w, const T* b, int64_t M, int64_t Fin, int64_t Fout);
  void (*linear_backward)(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t M, int64_t Fin,
                          int64_t Fout);
  void (*dropout_forward)(T* out, const T* x, int64_t n, double p, uint64_t seed);
  void (*dropout_backward)(T* dx, const T* dout, int64_t n, double p, uint64_t seed);
  void (*embedding_forward)(T* out, const int64_t* index, const T* weight, int64_t N, int64_t E);
  void (*embedding_backward)(T* dweight, const T* dout, const int64_t* index, int64_t N, int64_t E);
  void (*cross_entropy_forward)(C* losses, C* stats, const T* input, const int64_t* target, int64_t N,
                                int64_t classes, int64_t ignore_index);
  void (*cross_entropy_backward)(T* dinput, const C* row_weight, const C* stats, const T* input,
                                 const int64_t* target, int64_t N, int64_t classes);
  void (*linear_cross_entropy)(C* losses, C* logsumexp, T* dx, T* dw, T* db, const C* row_weight, const T* x,
                               const T* w, const T* b, const int64_t* target, int64_t N, int64_t E, int64_t V,
                               int64_t ignore_index, double label_smoothing, double softcap);
  void (*linear_cross_entropy_backward)(const C* logsumexp, T* dx, T* dw, T* db, const C* row_weight, const T* x,
                                        const T* w, const T* b, const int64_t* target, int64_t N, int64_t E,
                                        int64_t V, int64_t ignore_index, double label_smoothing, double softcap);
  void (*sgd_step)(const OptimizerSlot<T>* slots, int64_t count, double lr, double momentum, double dampening,
                   double weight_decay, bool nesterov);
  void (*adamw_step)(const OptimizerSlot<T>* slots, int64_t count, double lr, double beta1, double beta2,
                     double eps, double weight_decay);
  void (*rotary_forward)(const View4<T>& out, const View4<const T>& x, const T* cos, const T* sin,
                         const int64_t* offsets, int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2,
                         bool interleaved);
  void (*rotary_backward)(const View4<T>& dx, const View4<const T>& dout, const T* cos, const T* sin,
                          const int64_t* offsets, int64_t N, int64_t H, int64_t L, int64_t D, int64_t R2,
                          bool interleaved);
};

// One level's kernels for every dtype.
struct KernelSet {
  Kernels<float> f32;
  Kernels<double> f64;
  Kernels<bfloat16> bf16;
  Kernels<float16> f16;
  void (*dropout_mask)(bool* keep, int64_t n, double p, uint64_t seed);
  double (*multiply_add_peak)(int64_t steps);  // (peak.hpp)
  double (*forward_products)(int64_t D, int64_t steps);  // (attention.hpp)
};

// Each level's table (kernels.cpp, compiled once per level).
namespace cpu_default { extern const KernelSet kernels; }
#if defined(ATTNPP_HAS_LEVEL_avx2)
namespace cpu_avx2 { extern const KernelSet kernels; }
#endif
#if defined(ATTNPP_HAS_LEVEL_avx512)
namespace cpu_avx512 { extern const KernelSet kernels; }
#endif
#if defined(ATTNPP_HAS_LEVEL_avx512_bf16)
namespace cpu_avx512_bf16 { extern const KernelSet kernels; }
#endif

// The level's name ("default", "avx2", "avx512", "avx512_bf16"), whether this CPU can run it, its table, and
// how its kernels compute in half precision.
struct CpuLevel {
  const char* name;
  bool supported;
  const KernelSet* kernels;
  const char* half_precision;
};
// The levels this build holds, lowest first.
const std::vector<CpuLevel>& cpu_levels();

// Picks the level: the best one the CPU supports, or `forced` (a level's name; "" = automatic).
// std::invalid_argument for an unknown name, std::runtime_error for a level above what the CPU has.
void select_cpu_level(const std::string& forced);
// The level picked (select_cpu_level) and its kernels.
const CpuLevel& cpu_level();
template <typename T>
const Kernels<T>& kernels();

// How _core was built: the compiler, the flags of each level.
const char* build_compiler();
const char* build_flags();
// The half-precision extensions this CPU has, among F16C, AVX512_BF16, AVX512_FP16 and AMX-BF16 (x86-64).
std::vector<std::string> cpu_half_features();

}  // namespace attnpp
