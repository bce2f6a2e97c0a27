// The multiply-add peak (peak.hpp): acc += acc * c on as many independent vector accumulators as the registers
// hold beside c and a spare, nothing loaded. Where the level has FMA (AVX2, AVX-512, aarch64) that is one fused
// multiply-add into acc, the micro-kernel's instruction (gemm.hpp), whose latency times pipes (4 x 2 on AMD Zen 3
// and Intel since Skylake) is under the 14 (30 with AVX-512's 32 registers) accumulators; at the x86-64 baseline a
// multiply then an add, 3 + 3 cycles x 2 pipes each on a Zen 3, also under 14. (acc = acc * a + b, whose addend is
// not acc, took a move beside each fused multiply-add on aarch64.) The sgemm rates the bench shows beside the peak
// are a BLAS's, which attnpp's attention forward can pass (AMD Zen 3 at AVX2: up to 110% of NumPy's sgemm).
#include "peak.hpp"

#include "gemm.hpp"

namespace attnpp::ATTNPP_CPU_NS {

double multiply_add_peak(int64_t steps) {
  using V = gemm_detail::Vec<float>::type;
#if defined(__AVX512F__)
  constexpr int kAccumulators = 30;
#else
  constexpr int kAccumulators = 14;
#endif
  constexpr int W = gemm_detail::Vec<float>::width;
  return bench_tasks(2.0 * kAccumulators * W * double(steps), [&](int64_t task) {
    // acc grows by 2^-20 a step from 2 or more: never a subnormal (slow on x86-64), infinity (as fast as a number)
    // only after 10^8 steps. Its start is unknown to the compiler (the task's number is in it): a start that GCC
    // found to be a fixed point of the step was left out of the loop, and the peak came out 7% high.
    const V c = V{} + 0x1p-20f;
    V acc[kAccumulators];
    ATTNPP_UNROLL for (int i = 0; i < kAccumulators; ++i) acc[i] = V{} + (float(i + 2) + float(task) * 0x1p-20f);
    for (int64_t s = 0; s < steps; ++s)
      _Pragma("GCC unroll 32") for (int i = 0; i < kAccumulators; ++i) acc[i] += acc[i] * c;
    asm volatile("" : : "r"(acc) : "memory");  // (the sums, which nothing reads, must still be computed)
  });
}

}  // namespace attnpp::ATTNPP_CPU_NS
