#!/usr/bin/env bash
# attnpp's kernels on CPUs other than this one: every CPU level that CMakeLists.txt builds, checked against naive
# references, on aarch64 and on an x86-64 without AVX (both emulated by qemu-user).
#
#   tools/cross_check.sh
#
#   a. tests/cpp/test_kernels.cpp + the kernel sources, cross-compiled for aarch64 (its one level, "default":
#      the baseline, NEON), run under qemu-aarch64.
#   b. the same test built natively once per x86-64 level (default -march=x86-64, avx2 -march=x86-64-v3,
#      avx512 -march=x86-64-v4, avx512_bf16 -march=x86-64-v4 -mavx512bf16, each in its namespace cpu_<level>),
#      each run if this CPU has the level; the default level's binary also under qemu-x86_64 -cpu Nehalem (SSE4.2,
#      no AVX). Each checks float32, float64, bfloat16 and float16.
#   c. the INSTALLED attnpp package (pip install . first; this script never installs it) under
#      qemu-x86_64 -cpu Nehalem: tools/emulated_check.py.
#   d. the same test at the best level this CPU runs, built by Clang (clang++ -fopenmp: LLVM's libomp) and by GCC
#      without OpenMP (cpp/threads.cpp's std::thread pool), each checked against the references and on 1 and 2
#      threads bit for bit.
# Every build with -Wall -Wextra -Werror (CMakeLists.txt's warnings; ATTNPP_WERROR).
#
# Environment:
#   PYTHON=python   interpreter whose Eigen (cmeel-eigen) and attnpp are used; its real executable is what runs
#                   under qemu (pyenv's `python` is a shell shim, which qemu cannot run)
#   KEEP=1          keep the temporary directory (binaries, build and run logs) even when everything passed
#   VARIANTS=0      skip d. (CI, whose step 3 builds the whole core by Clang and without OpenMP and runs parity
#                   tests and a bitwise comparison against each: two of this script's five builds, 2.5 minutes)
#
# Installs only what is missing: the Debian packages qemu-user, g++-aarch64-linux-gnu, clang and libomp-dev, and
# cmeel-eigen (pip). Takes 4 to 8 minutes on 2 cores, most of it compiling (5 to 7 builds of the kernels, 1 to 2
# minutes of one core each).
# Exit status: 0 only if every part that ran passed (a level this CPU lacks is skipped with a note).
set -euo pipefail
start=$SECONDS
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

PY=$("${PYTHON:-python}" -c 'import sys; print(sys.executable)') || { echo "cross_check.sh: no python" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/attnpp-cross.XXXXXX")
results=()  # one line per part: PASS/FAIL/SKIP, what, its test summary
n_pass=0 n_fail=0 n_skip=0
record() {  # record STATUS WHAT DETAIL
    results+=("$(printf '%-4s %-49s %s' "$1" "$2" "$3")")
    case $1 in PASS) n_pass=$((n_pass + 1)) ;; FAIL) n_fail=$((n_fail + 1)) ;; *) n_skip=$((n_skip + 1)) ;; esac
}

variants=${VARIANTS:-1}  # d.'s two builds, unless 0

# ---- tools (only what is absent) ------------------------------------------------------------------------------
apt=()
command -v qemu-aarch64 >/dev/null && command -v qemu-x86_64 >/dev/null || apt+=(qemu-user)
command -v aarch64-linux-gnu-g++ >/dev/null || apt+=(g++-aarch64-linux-gnu)
if [[ $variants != 0 ]]; then
    command -v clang++ >/dev/null || apt+=(clang)
    dpkg -s libomp-dev >/dev/null 2>&1 || apt+=(libomp-dev)
fi
if [[ ${#apt[@]} -gt 0 ]]; then
    echo "cross_check.sh: installing ${apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt[@]}" >/dev/null
fi
# Eigen's headers from the cmeel-eigen wheel, as CMakeLists.txt finds them (`python -m cmeel cmake` = its prefix).
eigen_dir() {
    local p
    p=$("$PY" -m cmeel cmake 2>/dev/null) && [[ -f $p/include/eigen3/Eigen/Dense ]] && echo "$p/include/eigen3"
}
eigen=$(eigen_dir) || { "$PY" -m pip install -q cmeel-eigen && eigen=$(eigen_dir); } \
    || { echo "cross_check.sh: no Eigen (cmeel-eigen)" >&2; exit 2; }

# ---- builds: all at once in the background (each compiles its files one by one) ---------------------------
# The flags of CMakeLists.txt's kernels (ATTNPP_FLAGS, ATTNPP_DEFINITIONS) plus the level's -march. No dispatch.cpp:
# the test defines thread_count() itself (dispatch.cpp's level table needs the default level linked in too).
# buffer_pool.cpp: the packed operands of the products come from it.
# The kernel sources are CMakeLists.txt's ATTNPP_KERNEL_SOURCES (one list, read from there).
mapfile -t kernel_sources < <(sed -n '/^set(ATTNPP_KERNEL_SOURCES/,/)/p' CMakeLists.txt | grep -o 'cpp/[A-Za-z0-9_]*\.cpp')
sources=(tests/cpp/test_kernels.cpp "${kernel_sources[@]}" cpp/threads.cpp cpp/buffer_pool.cpp)
flags=(-O3 -fno-math-errno -std=c++17 -DEIGEN_GEMM_TO_COEFFBASED_THRESHOLD=0 -Icpp -isystem "$eigen"
       -Wall -Wextra -Wno-ignored-attributes -Werror)
# GCC 12's AVX-512 intrinsics warn through Eigen (GCC bug 105593; CMakeLists.txt silences them the same way)
gcc_avx512=()
[[ $(g++ -dumpversion | cut -d. -f1) -lt 13 ]] && gcc_avx512=(-Wno-uninitialized -Wno-maybe-uninitialized)
declare -A pid
build() {  # build NAME COMPILER FLAGS...: the binary $work/NAME, its compiler output in $work/NAME.build.log
    local name=$1 cxx=$2; shift 2
    "$cxx" "${flags[@]}" "$@" "${sources[@]}" -o "$work/$name" >"$work/$name.build.log" 2>&1 &
    pid[$name]=$!
}
# Which levels this CPU runs: GCC's x86-64-v3/v4 tests, exactly those -march's features (as dispatch.cpp's test).
g++ -x c++ - -o "$work/cpu_has" <<'EOF'
#include <cstring>
int main(int, char** argv) {  // cpu_has avx2|avx512|avx512_bf16: exit 0 if this CPU runs that level
  __builtin_cpu_init();
  if (std::strcmp(argv[1], "avx2") == 0) return !__builtin_cpu_supports("x86-64-v3");
  if (std::strcmp(argv[1], "avx512") == 0) return !__builtin_cpu_supports("x86-64-v4");
  return !(__builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16"));
}
EOF
# The levels this CPU runs: b. builds no other (the package's own build compiles every level, CI's with -Werror);
# d. takes the best of them.
declare -A march=([default]="-march=x86-64" [avx2]="-march=x86-64-v3" [avx512]="-march=x86-64-v4"
                  [avx512_bf16]="-march=x86-64-v4 -mavx512bf16")
runs=(default)
for level in avx2 avx512 avx512_bf16; do "$work/cpu_has" "$level" && runs+=("$level"); done
best=${runs[-1]}
echo "cross_check.sh: building the test for aarch64, for x86-64 at ${runs[*]} (the levels this CPU runs)" \
     "$([[ $variants != 0 ]] && echo "and at $best by Clang and without OpenMP ")in $work"
build aarch64 aarch64-linux-gnu-g++ -fopenmp -DATTNPP_CPU_NS=cpu_default  # no -march: the aarch64 baseline has NEON
gcc_level() {  # gcc_flags = GCC's flags for level $1: its -march, GCC 12's silencers where AVX-512 intrinsics need them
    gcc_flags=(${march[$1]})
    if [[ $1 == avx512* ]]; then gcc_flags+=("${gcc_avx512[@]}"); fi
}
for level in "${runs[@]}"; do
    gcc_level "$level"
    build "$level" g++ -fopenmp "${gcc_flags[@]}" -DATTNPP_CPU_NS=cpu_$level
done
if [[ $variants != 0 ]]; then
    build clang clang++ -fopenmp ${march[$best]} -DATTNPP_CPU_NS=cpu_$best
    gcc_level "$best"
    build no_openmp g++ "${gcc_flags[@]}" -DATTNPP_CPU_NS=cpu_$best
fi
for name in "${!pid[@]}"; do
    wait "${pid[$name]}" && echo "cross_check.sh: built $name ($((SECONDS - start))s)" \
        || { echo "cross_check.sh: build $name FAILED:"; grep -E "error|Error" "$work/$name.build.log" | head -20; }
done

# ---- runs ----------------------------------------------------------------------------------------------------------
# run WHAT LOG COMMAND...: the command's output to LOG; its FAIL lines and closing "N passed, N failed" shown.
run() {
    local what=$1 log=$2; shift 2
    local t0=$SECONDS status=0
    "$@" >"$log" 2>&1 || status=$?
    local summary
    summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -n1) || summary="no summary line"
    grep -E '^FAIL' "$log" | head -20 | sed "s/^/    $what: /" || true
    if [[ $status -eq 0 ]]; then record PASS "$what" "$summary ($((SECONDS - t0))s)"
    else record FAIL "$what" "$summary, exit $status ($((SECONDS - t0))s; log $log)"; fi
    [[ $summary != "no summary line" ]] || tail -n5 "$log" | sed 's/^/    /'  # a crash: its last words
    echo "cross_check.sh: ${results[-1]}"
}
built() {  # built NAME WHAT: whether $work/NAME exists; if not, WHAT fails
    [[ -x $work/$1 ]] && return
    record FAIL "$2" "not built (see $work/$1.build.log)"
    echo "cross_check.sh: ${results[-1]}"
    false
}

# a. aarch64 under emulation, with the cross toolchain's libraries as its root (-L)
what="a. aarch64 default (qemu-aarch64)"
built aarch64 "$what" && run "$what" "$work/aarch64.log" qemu-aarch64 -L /usr/aarch64-linux-gnu "$work/aarch64"

# b. each x86-64 level natively, if this CPU has it; the baseline under an emulated Nehalem too
for level in default avx2 avx512 avx512_bf16; do
    what="b. x86-64 $level (native)"
    if [[ " ${runs[*]} " != *" $level "* ]]; then
        record SKIP "$what" "this CPU lacks $level"; echo "cross_check.sh: ${results[-1]}"; continue
    fi
    built "$level" "$what" && run "$what" "$work/$level.log" "$work/$level"
done
what="b. x86-64 default (qemu-x86_64 -cpu Nehalem)"
built default "$what" && run "$what" "$work/nehalem.log" qemu-x86_64 -cpu Nehalem "$work/default"

# d. Clang (libomp) and no OpenMP, at the best level; each test checks 1 thread against 2 (bitwise) itself
for name in clang no_openmp; do
    what="d. x86-64 $best ($([[ $name == clang ]] && echo "clang++, libomp" || echo "g++, no OpenMP"))"
    if [[ $variants == 0 ]]; then
        record SKIP "$what" "VARIANTS=0"; echo "cross_check.sh: ${results[-1]}"; continue
    fi
    built "$name" "$what" && run "$what" "$work/$name.log" env OMP_NUM_THREADS=2 "$work/$name"
done

# c. the installed package on a Nehalem. emulated_check.py starts its child (the forced level) with EMULATOR:
#    qemu-user hands a guest's execve to the host, so a plain child would run natively. OpenBLAS's core type is the
#    emulated CPU's: a host's OPENBLAS_CORETYPE (Haswell on some) kills `import numpy` there with SIGILL.
export EMULATOR="qemu-x86_64 -cpu Nehalem"
if (cd "$work" && "$PY" -c 'import attnpp' 2>/dev/null); then
    run "c. installed attnpp (qemu-x86_64 -cpu Nehalem)" "$work/python.log" \
        env -u ATTNPP_CPU_CAPABILITY OPENBLAS_CORETYPE=Nehalem qemu-x86_64 -cpu Nehalem "$PY" tools/emulated_check.py
else
    record FAIL "c. installed attnpp (qemu-x86_64 -cpu Nehalem)" "attnpp not importable by $PY (pip install . first)"
    echo "cross_check.sh: ${results[-1]}"
fi

# ---- summary -------------------------------------------------------------------------------------------------------
t=$((SECONDS - start))
echo "cross_check.sh: ================ summary ($((t / 60))m$((t % 60))s)"
printf 'cross_check.sh: %s\n' "${results[@]}"
echo "cross_check.sh: $n_pass passed, $n_fail failed, $n_skip skipped"
if [[ $n_fail -eq 0 && -z ${KEEP:-} ]]; then rm -rf "$work"
else echo "cross_check.sh: binaries and logs kept in $work"; fi
[[ $n_fail -eq 0 ]]
