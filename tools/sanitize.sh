#!/usr/bin/env bash
# Build attnpp's C++ core with AddressSanitizer + UndefinedBehaviorSanitizer and run the whole test suite
# (notebooks and the benchmark subprocess included) against that build.
#
#   tools/sanitize.sh [pytest arguments...]        e.g.  tools/sanitize.sh -k sdpa -x
#   tools/sanitize.sh --run COMMAND...             any command instead of pytest, e.g. the long fuzz run:
#                                                  tools/sanitize.sh --run python tools/fuzz.py --calls 1000000
#
# Environment:
#   PYTHON=python     interpreter to build for and test with (a venv's python, ...)
#   CXX=g++           compiler; its own libasan is the runtime that gets preloaded
#   BUILD_DIR=dir     build directory (kept, so reruns are incremental); default: a temporary one
#   KEEP=1            keep the temporary directory (build, staged package, logs) even when the run is clean
#   ATTNPP_CPU_LEVELS=  the CPU levels to build besides default, a ;-list (CMakeLists.txt's option of that name);
#                     empty: all. Levels this CPU lacks only cost build time: pytest runs none of them.
#   TIMEOUT_FACTOR=4  notebook cells get this many times the tests' own timeout (1800 s): see the plugin
#   KEEP_GOING=1      recoverable sanitizers (-fsanitize-recover=all, halt_on_error=0): every report of the run
#                     is collected instead of the first one aborting its process (and with it pytest)
#
# Nothing is installed as attnpp: the package is staged in a temporary directory (python/attnpp/ + the
# sanitized _core*.so) and put first on PYTHONPATH, which subprocesses and notebook kernels inherit.
# Missing build/test requirements (pybind11, cmeel-eigen, numpy, the [test] extra's packages) are
# pip-installed, never attnpp itself.
# Exit status: 0 only if pytest passed AND no sanitizer report was written by any process.
set -uo pipefail
start=$SECONDS
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

PY=$("${PYTHON:-python}" -c 'import sys; print(sys.executable)') || { echo "sanitize.sh: no python" >&2; exit 2; }
CXX=$(command -v "${CXX:-g++}") || { echo "sanitize.sh: no C++ compiler ${CXX:-g++}" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/attnpp-sanitize.XXXXXX")
build=${BUILD_DIR:-$work/build}
stage=$work/stage
logs=$work/logs
mkdir -p "$stage" "$logs"
verdict() {  # one line, then the elapsed time; the status decides whether the temporary directory stays
    local status=$1; shift
    local t=$((SECONDS - start))
    echo "sanitize.sh: elapsed $((t / 60))m$((t % 60))s"
    echo "sanitize.sh: VERDICT: $*"
    if [[ $status -eq 0 && -z ${KEEP:-} ]]; then rm -rf "$work"; else echo "sanitize.sh: build, staged package and logs kept in $work"; fi
    exit "$status"
}

# ---- requirements (PyPI packages; only the missing ones are installed) --------------------------------------
missing=$("$PY" - <<'EOF'
import importlib.metadata as md, re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
reqs = ["pybind11>=2.12", "cmeel-eigen>=3.4", "numpy>=1.23"] + extras["test"] + extras["notebooks"]
for r in reqs:
    name = re.match(r"[A-Za-z0-9_.-]+", r).group(0)
    if name == "attnpp":
        continue  # the self-reference "attnpp[notebooks]": never install attnpp
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(r)
EOF
) || verdict 2 "ERROR: could not read pyproject.toml's requirements"
if [[ -n $missing ]]; then
    echo "sanitize.sh: installing missing requirements:" $missing
    # shellcheck disable=SC2086
    "$PY" -m pip install $missing || verdict 2 "ERROR: pip install of the requirements failed"
fi

# ---- sanitized build ------------------------------------------------------------------------------------------
# The CMakeLists appends -O3 -fno-math-errno (and each CPU level's -march) after CMAKE_CXX_FLAGS, so the code
# checked is the code shipped (same optimizer, same vector paths, NDEBUG as in Release). The suite runs at the
# host's best CPU level (ATTNPP_CPU_CAPABILITY set by the caller picks another). On top of -fsanitize=undefined:
#   float-cast-overflow      out-of-range float->integer conversion is UB; GCC leaves it out of "undefined".
#   (float-divide-by-zero stays off: IEEE division giving inf/NaN is legitimate in the masks.)
#   -fno-sanitize-recover=all  every UBSan report aborts, like ASan's (KEEP_GOING=1: every report continues).
#   -D_GLIBCXX_SANITIZE_VECTOR  std::vector annotates its unused capacity for ASan (container-overflow):
#                               catches reads/writes between size() and capacity(). All of _core is built
#                               with it, so no mixed annotated/unannotated vectors.
#   -g1  line tables only: a report's stack still names each frame's function, file and line, and the build takes
#        11% less time than with -g (attention.cpp at avx2: 146 s against 164 s on a 2-core AMD Zen 3). The build
#        type is RelWithDebInfo with its flags cut to -DNDEBUG (CMakeLists.txt gives -O3; its -g would undo -g1):
#        pybind11 strips the module of symbols and line tables under Release.
sanflags="-fsanitize=address,undefined,float-cast-overflow"
if [[ -n ${KEEP_GOING:-} ]]; then sanflags+=" -fsanitize-recover=all"; halt=0; else sanflags+=" -fno-sanitize-recover=all"; halt=1; fi
cxxflags="$sanflags -fno-omit-frame-pointer -g1 -D_GLIBCXX_SANITIZE_VECTOR=1"
pybind11_dir=$("$PY" -m pybind11 --cmakedir) || verdict 2 "ERROR: pybind11 not importable"
echo "sanitize.sh: building in $build"
# A reused BUILD_DIR configured with another compiler: CMake would drop the whole cache (our -D's included).
if [[ -f $build/CMakeCache.txt ]] && \
   [[ $(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt") != "$CXX" ]]; then
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
fi
cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-DNDEBUG \
      -DCMAKE_CXX_COMPILER="$CXX" \
      -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$pybind11_dir" -DATTNPP_CPU_LEVELS="${ATTNPP_CPU_LEVELS:-}" \
      -DCMAKE_CXX_FLAGS="$cxxflags" -DCMAKE_SHARED_LINKER_FLAGS="$sanflags" >"$logs/cmake.log" 2>&1 \
    || { cat "$logs/cmake.log"; verdict 2 "ERROR: cmake configure failed"; }
cmake --build "$build" -j "$(nproc)" 2>&1 | tee "$logs/build.log" | grep -E "error:|Linking"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { cat "$logs/build.log"; verdict 2 "ERROR: build failed"; }
so=$(ls "$build"/_core*.so 2>/dev/null | head -n1)
[[ -n $so ]] || verdict 2 "ERROR: no _core*.so in $build"

# ---- staged package (no install) ------------------------------------------------------------------------------
cp -r python/attnpp "$stage/"
find "$stage/attnpp" \( -name '_core*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
cp "$so" "$stage/attnpp/"

# ---- runtime environment ----------------------------------------------------------------------------------------
# Python is not instrumented, so the ASan runtime must be loaded first (LD_PRELOAD). libstdc++ is preloaded
# right after it: ASan intercepts __cxa_throw and looks the real one up when it starts, before python (which
# does not link libstdc++) has loaded it; without that, the first C++ exception thrown by _core dies in
# "CHECK failed: asan_interceptors.cpp ... real___cxa_throw != 0" (bindings' argument errors throw on purpose).
# libubsan needs no preloading (it intercepts nothing): _core pulls it in, the sitecustomize below too.
libasan=$("$CXX" -print-file-name=libasan.so)
libstdcxx=$("$CXX" -print-file-name=libstdc++.so.6)
libubsan=$(ldd "$so" | awk '/libubsan/ {print $3}')
[[ -f $libasan && -f $libubsan ]] || verdict 2 "ERROR: no libasan.so from $CXX, or no libubsan in $so"
# Only the Python processes get it (they pass it on to the bench subprocess and the notebook kernels), not
# this script's tee/grep (some tools hang under a preloaded ASan).
preload="$libasan $libstdcxx${LD_PRELOAD:+ $LD_PRELOAD}"
# Reports go to files (log_path, one per process: <name>.<pid>) because stderr is not reliable: pytest
# captures it (and loses it when the process aborts), notebook kernels' stderr goes nowhere visible.
#   detect_leaks=0   CPython, numpy and torch keep their allocations until exit by design.
#   abort_on_error=1 SIGABRT: pytest's faulthandler then prints the Python stack (which test), a kernel dies
#                    (the notebook test fails with DeadKernelError), the bench subprocess exits non-zero.
#   detect_stack_use_after_return=1, check_initialization_order=1, strict_init_order=1: extra checks,
#                    effective only in instrumented code (_core).
#   allocator_may_return_null=1  tests/test_bad_input.py asks for > 1 PB on purpose and expects MemoryError:
#                    ASan's default is a fatal allocation-size-too-big report (first seen in NumPy's malloc);
#                    with this, malloc & co. return NULL as glibc's would (a "WARNING: AddressSanitizer
#                    failed to allocate" line is logged, not a report). A throwing operator new would still
#                    abort (google/sanitizers#295): the core allocates what may be huge with malloc/calloc.
asan_opts="detect_leaks=0:halt_on_error=$halt:abort_on_error=1:detect_stack_use_after_return=1:allocator_may_return_null=1"
asan_opts+=":check_initialization_order=1:strict_init_order=1:symbolize=1:log_path=$logs/asan"
if command -v llvm-symbolizer >/dev/null; then
    export ASAN_SYMBOLIZER_PATH=$(command -v llvm-symbolizer)
else
    asan_opts+=":allow_addr2line=1"
fi
export ASAN_OPTIONS="$asan_opts${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=$halt:abort_on_error=1:symbolize=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
# UBSan ignores its log_path when libasan is loaded (libubsan's call to __sanitizer_set_report_path binds to
# libasan's copy; libubsan keeps writing to stderr). So every Python process of the run (pytest, the bench
# subprocess, notebook kernels: all inherit PYTHONPATH) sets it on libubsan's own copy in a sitecustomize,
# which also records which attnpp._core the process used (checked below), then chains to the interpreter's
# own sitecustomize if there is one.
mkdir -p "$work/site"
cat >"$work/site/sitecustomize.py" <<'EOF'
# Written by attnpp's tools/sanitize.sh, for its sanitizer run only.
import atexit, ctypes, importlib.machinery, importlib.util, os, sys

_logs = os.environ["ATTNPP_SANITIZE_LOGS"]
ctypes.CDLL(os.environ["ATTNPP_SANITIZE_LIBUBSAN"]).__sanitizer_set_report_path(os.path.join(_logs, "ubsan").encode())


@atexit.register
def _record_core():
    core = sys.modules.get("attnpp._core")
    if core is not None:
        with open(os.path.join(_logs, f"core.{os.getpid()}"), "w") as f:
            f.write(f"{core.__file__}  ({' '.join(sys.argv)[:200]})\n")


_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
EOF
# The pytest plugin: notebook cells' timeout multiplied (nbclient's NotebookClient, in every notebook test).
cat >"$work/site/attnpp_sanitize_plugin.py" <<'EOF'
# Written by attnpp's tools/sanitize.sh, for its sanitizer run only.
import os

import nbclient

# Under ASan attnpp's kernels and torch run several times slower: notebook 001's six-sentence
# training cell (four 10,000-step trainings) took about 55 minutes here, beyond the test's 1800 s per cell.
FACTOR = float(os.environ.get("TIMEOUT_FACTOR") or 4)
_init = nbclient.NotebookClient.__init__


def _init_longer(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self.timeout:
        self.timeout = int(self.timeout * FACTOR)


nbclient.NotebookClient.__init__ = _init_longer
EOF
export ATTNPP_SANITIZE_LOGS=$logs ATTNPP_SANITIZE_LIBUBSAN=$libubsan
export PYTHONPATH="$stage:$work/site${PYTHONPATH:+:$PYTHONPATH}"
# OpenMP threads spinning at barriers (torch's and attnpp's share one libgomp) made the ASan-slowed training
# notebook far slower still when the 2 cores were busy with other work: idle threads sleep instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

core=$(LD_PRELOAD=$preload "$PY" -c 'import attnpp; print(attnpp._core.__file__)' 2>&1)
echo "sanitize.sh: attnpp._core.__file__ = $core"
[[ $core == "$stage/attnpp/"_core*.so ]] || verdict 2 "ERROR: python does not import the sanitized core"
rm -f "$logs"/core.*

# ---- tests ----------------------------------------------------------------------------------------------------------
if [[ ${1:-} == --run ]]; then
    shift
    command=("$@")
    [[ ${command[0]:-} == python ]] && command[0]=$PY  # (the interpreter the core was built for)
else
    command=("$PY" -m pytest -p attnpp_sanitize_plugin "$@")
fi
echo "sanitize.sh: ${command[*]}"
echo "sanitize.sh: LD_PRELOAD=$preload ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS"
LD_PRELOAD=$preload "${command[@]}" 2>&1 | tee "$logs/pytest.log"
rc=${PIPESTATUS[0]}

summary=$(grep -E '[0-9]+ (passed|failed|errors?)|no tests ran' "$logs/pytest.log" | tail -n1 | tr -d '=' | xargs)
[[ -n $summary ]] || summary="no pytest summary (exit $rc)"
[[ ${command[1]:-} == -m ]] || summary="exit $rc: $(tail -n1 "$logs/pytest.log")"

# ---- sanitizer reports: any process (pytest, the bench subprocess, notebook kernels) ----------------------------
pattern='ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|ERROR: LeakSanitizer|runtime error:|SUMMARY: UndefinedBehaviorSanitizer'
# a log file is written only when there is something to say: a report, or the warning of a failed allocation
reports=$(grep -lE "$pattern" "$logs"/asan.* "$logs"/ubsan.* 2>/dev/null)
warned=$(grep -l "WARNING: AddressSanitizer failed to allocate" "$logs"/asan.* 2>/dev/null | wc -l)
[[ $warned -eq 0 ]] || echo "sanitize.sh: $warned process(es) logged failed allocations (allocator_may_return_null=1: expected from the MemoryError tests)"
for f in "$logs"/asan.* "$logs"/ubsan.*; do  # anything else a runtime said (no report): shown, not judged
    [[ -f $f ]] && ! grep -qE "$pattern|WARNING: AddressSanitizer failed to allocate" "$f" && { echo "sanitize.sh: $f:"; cat "$f"; }
done
if [[ -n $reports ]] || grep -qE "$pattern" "$logs/pytest.log"; then
    for f in $reports; do
        echo "================ sanitizer report: $f"
        cat "$f"
    done
    grep -nE "$pattern" "$logs/pytest.log" | sed 's/^/sanitize.sh: in the pytest output: /'
    verdict 1 "FAIL: sanitizer report(s): $(echo $reports | wc -w) log file(s), $(grep -cE "$pattern" "$logs/pytest.log") line(s) in the pytest output; pytest: $summary"
fi
# Every process that imported attnpp used the staged core (atexit record: a killed process leaves none).
used=$(cat "$logs"/core.* 2>/dev/null)
echo "sanitize.sh: $(grep -c . <<<"$used") Python process(es) of the run imported attnpp._core"
grep -v "^$stage/attnpp/_core" <<<"$used" | grep . && verdict 2 "ERROR: the processes above did not use the sanitized _core"
[[ $rc -eq 0 ]] || verdict "$rc" "FAIL: no sanitizer report, but pytest failed (exit $rc): $summary"
verdict 0 "OK: no sanitizer report; pytest: $summary"
