// The CPU level picked at import. Built for the baseline, like the bindings: this file runs before anything knows
// what the CPU has.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <stdexcept>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "kernels.hpp"

namespace attnpp {
namespace {

#if defined(__x86_64__)
// The CPU's features, read with cpuid (GCC's and Clang's <cpuid.h>), and which register states the operating
// system saves (xgetbv's XCR0). Read directly rather than with __builtin_cpu_supports, whose names differ between
// compilers (Clang 14 knows neither "x86-64-v3" nor "f16c").
struct X86Features {
  unsigned l1c = 0, l7b = 0, l7d = 0, l71a = 0, ext1c = 0;  // leaf 1 ECX, leaf 7 EBX/EDX, 7.1 EAX, 0x80000001 ECX
  uint64_t xcr0 = 0;
  X86Features() {
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) l1c = c;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) l7b = b, l7d = d;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) l71a = a;
    if (__get_cpuid(0x80000001, &a, &b, &c, &d)) ext1c = c;
    if (l1c & (1u << 27)) {  // OSXSAVE: xgetbv is there
      unsigned lo, hi;
      __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      xcr0 = (uint64_t(hi) << 32) | lo;
    }
  }
  static bool all(unsigned reg, std::initializer_list<int> bits) {
    for (int b : bits)
      if (!(reg & (1u << b))) return false;
    return true;
  }
  // -march=x86-64-v3: x86-64-v2 (SSE3, SSSE3, SSE4.1, SSE4.2, POPCNT, CMPXCHG16B, LAHF) and AVX, AVX2, BMI1, BMI2,
  // F16C, FMA, LZCNT, MOVBE, with the AVX state saved by the system
  bool v3() const {
    return all(l1c, {0, 9, 12, 13, 19, 20, 22, 23, 27, 28, 29}) && all(l7b, {3, 5, 8}) && all(ext1c, {0, 5}) &&
           (xcr0 & 0x6) == 0x6;
  }
  // -march=x86-64-v4: v3 and AVX-512 F, DQ, CD, BW, VL, with the AVX-512 state (opmask, ZMM) saved
  bool v4() const { return v3() && all(l7b, {16, 17, 28, 30, 31}) && (xcr0 & 0xe6) == 0xe6; }
  bool f16c() const { return all(l1c, {29}); }
  bool avx512_bf16() const { return all(l71a, {5}); }
  bool avx512_fp16() const { return all(l7d, {23}); }
  bool amx_bf16() const { return all(l7d, {22}); }
};
const X86Features& x86() {
  static const X86Features features;
  return features;
}
#endif

// Whether the CPU (and the operating system, which must save the wider registers) runs a level's code: exactly the
// features of the -march the level is built with. (Unused where only the baseline is built: aarch64.)
[[maybe_unused]] bool cpu_supports(const std::string& level) {
#if defined(__x86_64__)
  if (level == "avx2") return x86().v3();
  if (level == "avx512") return x86().v4();
  if (level == "avx512_bf16") return x86().v4() && x86().avx512_bf16();
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

std::vector<std::string> cpu_half_features() {
  std::vector<std::string> found;
#if defined(__x86_64__)
  if (x86().f16c()) found.push_back("F16C");
  if (x86().avx512_bf16()) found.push_back("AVX512_BF16");
  if (x86().avx512_fp16()) found.push_back("AVX512_FP16");
  if (x86().amx_bf16()) found.push_back("AMX-BF16");
#endif
  return found;
}

const char* build_compiler() { return ATTNPP_COMPILER; }
const char* build_flags() { return ATTNPP_BUILD_FLAGS; }

}  // namespace attnpp
