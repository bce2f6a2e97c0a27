// One CPU level's table of kernels (compiled once per level, like the kernels themselves; see kernels.hpp).
#include "kernels.hpp"

#include "attention.hpp"
#include "linear.hpp"
#include "peak.hpp"
#include "rotary.hpp"
#include "training.hpp"

namespace attnpp::ATTNPP_CPU_NS {
namespace {

template <typename T>
constexpr Kernels<T> table() {
  return {&sdpa_forward<T>,       &sdpa_forward_wide_queries<T>, &sdpa_backward<T>,
          &sdpa_weights<T>,       &linear_forward<T>,            &linear_backward<T>,
          &dropout_forward<T>,    &dropout_backward<T>,          &embedding_forward<T>,
          &embedding_backward<T>, &cross_entropy_forward<T>,     &cross_entropy_backward<T>,
          &linear_cross_entropy<T>, &linear_cross_entropy_backward<T>,
          &sgd_step<T>,           &adamw_step<T>,                &rotary_forward<T>,
          &rotary_backward<T>};
}

}  // namespace

extern const KernelSet kernels = {table<float>(), table<double>(), table<bfloat16>(), table<float16>(), &dropout_mask,
                                   &multiply_add_peak, &forward_products};

}  // namespace attnpp::ATTNPP_CPU_NS
