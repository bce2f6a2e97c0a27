"""Benchmark: attnpp against PyTorch on the CPU, in one table.

The command line of ``python -m attnpp.bench``: select the cases, run them at a forced CPU level in a child
process if asked, measure, print the report and write the results file (``--json``)."""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import torch

import attnpp

from .case import Skipped, Unavailable
from .config import MEMORY_PAIRS, MKL_INSTRUCTIONS, SIZES, capability_env
from .machine import background_load, cpu_seconds
from .measure import forward_products_gflops, measure, peak_gflops, sgemm_gflops
from .peers import ENGINES, Peers
from . import results as results_file
from .registry import make_cases
from .report import gemm_products, print_report


def select(cases, pattern):
    """Cases whose name matches ``pattern`` (a regular expression, or a plain substring if it is not one)."""
    if pattern is None:
        return cases
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error:
        regex = re.compile(re.escape(pattern), re.IGNORECASE)
    return [c for c in cases if regex.search(c.name)]


def run_at_capability(level, argv):
    """Run this benchmark with ``argv`` in a child process whose libraries load at ``level``; its exit status.

    A child, because each library picks its level once, at import, and this process has imported both. The child
    inherits stdout and stderr (its progress and table appear as they come) and its environment forces the level
    (capability_env), so its own ``--capability`` is already met and it runs the table itself. A level the CPU
    cannot run makes ``import attnpp`` raise ImportError, which ``python -m attnpp.bench`` reports as a traceback
    before this module runs: a probe imports attnpp in the same environment first, and its message ends this
    process instead.
    """
    env = {**os.environ, **capability_env(level)}
    # (the probe without OpenBLAS's core type: forced above the CPU, it kills `import numpy` with SIGILL before
    # attnpp can say what the CPU lacks. At a level attnpp runs, OpenBLAS's core type runs too, but for "default"
    # on a CPU without SSE4.2, from before 2008: Nehalem's, as MKL's and oneDNN's caps for it, config.py)
    probe_env = {var: value for var, value in env.items() if var != "OPENBLAS_CORETYPE"}
    probe = subprocess.run([sys.executable, "-c", "import attnpp"], env=probe_env, capture_output=True, text=True)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
        sys.exit(f"--capability {level}: {lines[-1]}")  # the exception's line, e.g. "ImportError: ..."
    sys.stdout.flush()
    child = subprocess.run([sys.executable, "-m", "attnpp.bench", *argv], env=env)
    if child.returncode < 0:  # killed by a signal (SIGILL: an instruction this CPU lacks); exit as a shell would
        print(f"--capability {level}: the benchmark died of signal {-child.returncode} "
              f"({signal.strsignal(-child.returncode)})", file=sys.stderr)
        return 128 - child.returncode
    return child.returncode


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m attnpp.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help="run the cases whose name matches this regular expression (or substring)")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads of both libraries (default: %(default)s)")
    p.add_argument("--repeats", type=int, help="alternating pairs per case, and training chunks (default 10, "
                                               f"--quick 3; the memory case at most {MEMORY_PAIRS})")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats, 9 training steps: checks that "
                                                        "every case kind runs, in seconds")
    p.add_argument("--capability", choices=list(MKL_INSTRUCTIONS),
                   help="run the benchmark (the other options passed on) in a child process with attnpp, PyTorch and "
                        "MKL at this CPU level, e.g. avx2 on an AVX-512 host (default: each library's best level)")
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON: the machine (CPU, flags, "
                                                  "levels, threads, versions) and each case's medians, interquartile "
                                                  "ranges and ratios (attnpp.bench.results)")
    p.add_argument("--note", help="a note on the run stored in the --json file's machine record (e.g. a loaded host)")
    p.add_argument("--against", metavar="ENGINES", type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
                   default=[], help="also time these engines, comma-separated, on the forward cases of the kernel, "
                                    "causal-length and decode-length families, each checked against float64 first: "
                                    f"{', '.join(ENGINES)} (attnpp.bench.peers; an engine not installed is skipped "
                                    "with a line saying so)")
    args = p.parse_args(argv)
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--threads and --repeats must be >= 1")
    unknown = [name for name in args.against if name not in ENGINES]
    if unknown:
        p.error(f"--against: unknown engine {', '.join(map(repr, unknown))} (choose from {', '.join(ENGINES)})")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    # the child of run_at_capability gets the same argv: its environment already forces the level, so it runs here
    if args.capability and any(os.environ.get(var) != value for var, value in capability_env(args.capability).items()):
        sys.exit(run_at_capability(args.capability, argv))
    size = SIZES[args.quick]
    repeats = args.repeats or size["repeats"]
    cases = select(make_cases(args.quick, repeats), args.cases)
    if args.list:
        print("\n".join(c.name for c in cases))
        return
    if not cases:
        sys.exit(f"no case matches {args.cases!r} (see --list)")
    torch.set_num_threads(args.threads)
    attnpp.set_num_threads(args.threads)
    peers = Peers(dict.fromkeys(args.against), args.threads) if args.against else None
    for line in peers.missing if peers else ():
        print(line, file=sys.stderr)  # now, and in the report

    start, cpu_before = time.perf_counter(), cpu_seconds()
    results = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        try:
            results.append(measure(case, repeats, size["min_sample"], peers))
        except Unavailable as missing:  # e.g. the training without tiktoken: the other cases still count
            results.append(Skipped(case, str(missing)))

    # the limits, measured after the cases so that they run on the same, already warm machine
    print(f"[sgemm] float32 {size['sgemm']}^3 through torch.mm and np.matmul ({time.perf_counter() - start:.0f} s)",
          file=sys.stderr, flush=True)
    rates, numpy_threads = sgemm_gflops(size["sgemm"], size["min_sample"],
                                        bfloat16=gemm_products()["bfloat16"] == "PyTorch bfloat16")
    print(f"[peak] multiply-add peak and the forward's products at {attnpp.cpu_capability()} "
          f"({time.perf_counter() - start:.0f} s)",
          file=sys.stderr, flush=True)
    peak, products = peak_gflops(size["min_sample"]), forward_products_gflops(size["min_sample"])
    load, sgemm = background_load(cpu_before), (size["sgemm"], rates, numpy_threads)
    print_report(results, repeats, size["min_sample"], args.quick, load, sgemm, peak, products, peers)
    if args.json:
        results_file.write(args.json, results, argv=argv, quick=args.quick, repeats=repeats,
                           min_sample=size["min_sample"], load=load, sgemm=sgemm, peak=peak, products=products,
                           note=args.note, peers=peers)
        print(f"results written to {args.json}", file=sys.stderr)
    print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
