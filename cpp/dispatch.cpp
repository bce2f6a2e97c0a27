// The CPU level picked at import, and the process-wide thread count. Built for the baseline, like the bindings:
// this file runs before anything knows what the CPU has.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <stdexcept>

#include "kernels.hpp"

namespace attnpp {
namespace {

// Whether the CPU (and the operating system, which must save the wider registers) runs a level's code. GCC's
// x86-64-v3/v4 names test exactly the features of -march=x86-64-v3/v4, the flags the levels are built with.
bool cpu_supports(const std::string& level) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (level == "avx2") return __builtin_cpu_supports("x86-64-v3");
  if (level == "avx512") return __builtin_cpu_supports("x86-64-v4");
  if (level == "avx512_bf16") return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16");
#endif
  return level == "default";
}

std::vector<CpuLevel> make_levels() {
  std::vector<CpuLevel> levels{
      {"default", true, &cpu_default::kernels,
       "bfloat16 and float16 converted in software, computed in float"}};
#if defined(ATTNPP_HAS_LEVEL_avx2)
  levels.push_back({"avx2", cpu_supports("avx2"), &cpu_avx2::kernels,
                    "float16 converted with F16C, bfloat16 by shifts, computed in float (AVX2 FMA)"});
#endif
#if defined(ATTNPP_HAS_LEVEL_avx512)
  levels.push_back({"avx512", cpu_supports("avx512"), &cpu_avx512::kernels,
                    "float16 converted with F16C, bfloat16 by shifts, computed in float (AVX-512 FMA)"});
#endif
#if defined(ATTNPP_HAS_LEVEL_avx512_bf16)
  levels.push_back({"avx512_bf16", cpu_supports("avx512_bf16"), &cpu_avx512_bf16::kernels,
                    "the attention's bfloat16 products on pairs with vdpbf16ps (AVX512_BF16); float16 converted "
                    "with F16C, computed in float"});
#endif
  return levels;
}

const CpuLevel* selected = nullptr;

std::string names(bool supported_only) {
  std::string s;
  for (const auto& l : cpu_levels())
    if (l.supported || !supported_only) s += (s.empty() ? "" : ", ") + std::string(l.name);
  return s;
}

}  // namespace

const std::vector<CpuLevel>& cpu_levels() {
  static const std::vector<CpuLevel> levels = make_levels();
  return levels;
}

void select_cpu_level(const std::string& forced) {
  std::string name = forced;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  const auto& levels = cpu_levels();
  if (name.empty()) {  // the best the CPU runs
    for (const auto& l : levels)
      if (l.supported) selected = &l;
    return;
  }
  for (const auto& l : levels)
    if (name == l.name) {
      if (!l.supported)
        throw std::runtime_error("ATTNPP_CPU_CAPABILITY=" + forced + ": this CPU cannot run the " + name +
                                 " kernels; it supports " + names(true));
      selected = &l;
      return;
    }
  throw std::invalid_argument("ATTNPP_CPU_CAPABILITY=" + forced + ": unknown level; this build has " +
                              names(false) + " (unset it to pick the best one the CPU supports)");
}

const CpuLevel& cpu_level() { return *selected; }

template <>
const Kernels<float>& kernels<float>() {
  return selected->kernels->f32;
}
template <>
const Kernels<double>& kernels<double>() {
  return selected->kernels->f64;
}
template <>
const Kernels<bfloat16>& kernels<bfloat16>() {
  return selected->kernels->bf16;
}
template <>
const Kernels<float16>& kernels<float16>() {
  return selected->kernels->f16;
}

namespace {
std::atomic<int>& thread_count_setting() {
  static std::atomic<int> n{omp_get_max_threads()};
  return n;
}
}  // namespace

int thread_count() { return thread_count_setting().load(std::memory_order_relaxed); }
void set_thread_count(int n) { thread_count_setting() = n; }

std::vector<std::string> cpu_half_features() {
  std::vector<std::string> found;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("f16c")) found.push_back("F16C");
  if (__builtin_cpu_supports("avx512bf16")) found.push_back("AVX512_BF16");
  if (__builtin_cpu_supports("avx512fp16")) found.push_back("AVX512_FP16");
  if (__builtin_cpu_supports("amx-bf16")) found.push_back("AMX-BF16");
#endif
  return found;
}

const char* build_compiler() { return ATTNPP_COMPILER; }
const char* build_flags() { return ATTNPP_BUILD_FLAGS; }

}  // namespace attnpp
