// Included by the kernel files (attention, linear, the training pieces, gemm.hpp), which CMakeLists.txt compiles
// once per CPU level (default, avx2, avx512 on x86-64) with ATTNPP_CPU_NS naming the level's namespace
// (attnpp::cpu_avx2, ...); kernels.cpp gathers each level's entry points into its table.
#pragma once

#include "common.hpp"

#ifndef ATTNPP_CPU_NS
#error "kernel files are compiled once per CPU level, with -DATTNPP_CPU_NS=cpu_<level> (see CMakeLists.txt)"
#endif
