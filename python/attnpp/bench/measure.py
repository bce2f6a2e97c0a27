"""Measurement: the warm-up, the memory of one call (the growth of the peak resident set), the alternating timed
samples of each case (its peers' in the same rounds) and the reference rates: the GEMMs' and the multiply-add peak."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

import attnpp
from attnpp import _core

from .case import Result
from .config import PEAK_MIN_SAMPLE, PEAK_STEPS, PRODUCT_HEAD_DIMS, PRODUCT_STEPS, SGEMM_SAMPLES
from .machine import numpy_level_core


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _malloc_trim():
    """Give freed heap pages back to the OS (glibc): pages malloc keeps after earlier calls would be reused by the
    measured call without raising the resident set, hiding part of its growth."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_growth_mib(call):
    """Growth of the peak resident set during one ``call`` (MiB), or None where it cannot be reset (not Linux)."""
    gc.collect()
    attnpp.empty_cache()  # memory recycled by attnpp is resident already: count what a cold call needs
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        before = _status_kib("VmRSS")
    except OSError:
        return None
    call()
    return (_status_kib("VmHWM") - before) / 1024


def growth_mib(call):
    """peak_growth_mib of one call, or the call's own measure where it has one: a call that frees the last call's
    gradients first (calls.FreshGradients), one that other processes run (their growth)."""
    return call.peak_growth_mib() if hasattr(call, "peak_growth_mib") else peak_growth_mib(call)


def sample(call, n):
    """Seconds per call, the mean over ``n`` calls in a row; the garbage collector off meanwhile, as timeit does."""
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - start) / n
    finally:
        gc.enable()


def calibrate(call, min_sample, first):
    """Calls per sample so that a sample lasts at least ``min_sample`` seconds, from the warm-up call's time
    ``first``, refined by timing a batch (a first call is often slower than the next ones). A slow call is left
    at one per sample without being run again."""
    n, per_call = 1, first
    for _ in range(2):
        if n * per_call >= min_sample:
            break
        n = math.ceil(min_sample / max(per_call, 1e-9))
        per_call = sample(call, n)
    return n

def measure(case, repeats, min_sample, peers=None):
    """Warm up each side, measure the memory of one call per side, then time the sides alternately; with ``peers``
    (a peers.Peers) and a case that has a ``peer_problem``, each peer engine that passes its check (its first call
    is its warm-up) joins the rounds after the two sides: a, t, peer, ..., a, t, peer, ... A case with its own
    measurement (``Case.run``) runs it."""
    if case.run is not None:
        return Result(case, *case.run())
    sides = case.build()
    # warm-up: first-call costs (lazy initialisation, thread start, first allocations) stay out of the timings
    first = [sample(call, 1) for call in sides]
    memory = tuple(growth_mib(call) for call in sides)
    ready, peer_results = {}, {}
    if peers is not None and case.peer_problem is not None:
        ready, peer_results = peers.prepare(case.peer_problem())
    timed = list(sides) + [call for call, _, _ in ready.values()]
    first += [seconds for _, seconds, _ in ready.values()]
    calls = [case.calls_per_sample or calibrate(call, min_sample, t) for call, t in zip(timed, first)]
    times = [[] for _ in timed]
    for _ in range(case.pairs or repeats):
        for call, n, out in zip(timed, calls, times):
            out.append(sample(call, n))
    for (title, (_, _, result)), peer_times, n in zip(ready.items(), times[2:], calls[2:]):
        result.times, result.calls = peer_times, n
        peer_results[title] = result
    order = [engine.title for engine in peers.engines] if peers is not None else []
    return Result(case, tuple(times[:2]), tuple(calls[:2]), memory,
                  {title: peer_results[title] for title in order if title in peer_results})


def rate_gflops(call, flops, min_sample, samples):
    """GFLOP/s of ``call``, which does ``flops`` (an (n, n) @ (n, n) product: 2 n^3): the median of ``samples``
    samples (a batch lasting at least ``min_sample`` each) after a warm-up call."""
    calls = calibrate(call, min_sample, sample(call, 1))  # the first call: the warm-up
    return flops / np.median([sample(call, calls) for _ in range(samples)]) / 1e9


def numpy_sgemm(n, min_sample, samples=SGEMM_SAMPLES):
    """GFLOP/s of a float32 (n, n) @ (n, n) ``np.matmul`` in this process: the median of ``samples`` samples (a
    batch lasting at least ``min_sample`` each) after a warm-up, the output allocated once. ValueError when its
    first rows are off the float64 product by more than 1e-4 of its largest element (an OpenBLAS core type that
    this CPU runs wrongly)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    rate = rate_gflops(lambda: np.matmul(a, b, out=c), 2.0 * n ** 3, min_sample, samples)
    ref = a[:64].astype(np.float64) @ b.astype(np.float64)
    error = float(np.abs(c[:64] - ref).max() / max(1.0, np.abs(ref).max()))
    if error > 1e-4:
        raise ValueError(f"np.matmul is off the float64 product by {error:.1e} (> 1e-4)")
    return rate


_NUMPY_CHILD = ("import sys; from attnpp.bench.measure import numpy_sgemm; "
                "print(numpy_sgemm(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))")


def numpy_sgemm_gflops(n, min_sample, threads, samples=SGEMM_SAMPLES):
    """NumPy's sgemm rate (numpy_sgemm) at attnpp's CPU level, on ``threads`` threads, and how it ran, as a phrase
    for the report: (rate, phrase).

    NumPy's OpenBLAS takes its core type from ``OPENBLAS_CORETYPE`` and its threads from ``OPENBLAS_NUM_THREADS``
    at import. On x86-64 (config.OPENBLAS_LEVEL_CORE) the product runs in a child process with the core type of
    attnpp's level, ``OPENBLAS_L2_SIZE`` unset (set beside it on the same hosts) and ``OPENBLAS_NUM_THREADS`` =
    ``threads``, also where this process's core type is already that one (under ``--capability``): its OpenBLAS
    started on its own default threads, all the cores, which ``--threads 1`` does not limit; a child that fails (its
    product checked against float64 too) leaves the product to this process, and the phrase says why. In this
    process NumPy's BLAS is limited to ``threads`` through threadpoolctl if it is installed (it is not a
    dependency), else it runs on its own default; a wrong product there gives NaN (then PyTorch's sgemm is the
    limit: report.gemm_products) and the phrase says so.
    """
    core = numpy_level_core()
    fallback = ""
    if core is not None:
        env = {var: value for var, value in os.environ.items() if var != "OPENBLAS_L2_SIZE"}
        env.update(OPENBLAS_CORETYPE=core, OPENBLAS_NUM_THREADS=str(threads))
        child = subprocess.run([sys.executable, "-c", _NUMPY_CHILD, str(n), repr(min_sample), str(samples)],
                               env=env, capture_output=True, text=True)
        if child.returncode == 0:
            return (float(child.stdout.split()[-1]),
                    f"NumPy's BLAS on {threads} threads at OPENBLAS_CORETYPE={core}, in a child process")
        why = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        fallback = f"; at OPENBLAS_CORETYPE={core} in a child process it failed: {why}"
    at = f" at OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}" if "OPENBLAS_CORETYPE" in os.environ else ""
    try:
        from threadpoolctl import threadpool_limits
        limit, phrase = threadpool_limits(threads, user_api="blas"), f"NumPy's BLAS on {threads} threads{at}"
    except ImportError:
        limit = contextlib.nullcontext()
        phrase = f"NumPy's BLAS{at} on its default threads: threadpoolctl is not installed"
    with limit:
        try:
            return numpy_sgemm(n, min_sample, samples), phrase + fallback
        except ValueError as wrong:  # (no limit from a wrong product; the run's figures stand)
            return math.nan, f"{phrase}{fallback}; {wrong}"


def sgemm_gflops(n, min_sample, samples=SGEMM_SAMPLES, bfloat16=True):
    """GFLOP/s of a float32 (n, n) @ (n, n) product through ``torch.mm`` and ``np.matmul`` (numpy_sgemm_gflops: at
    attnpp's level), and (``bfloat16``) of a bfloat16 one through ``torch.mm`` (2 n^3 flops each): ({"PyTorch": rate,
    "NumPy": rate, "PyTorch bfloat16": rate}, how NumPy's product ran, as a phrase for the report). The bfloat16
    product is only the limit at the avx512_bf16 level (report.gemm_products); oneDNN capped below it took 46 s a
    product at 2048 on the 2-core EPYC.

    The ceiling the attention forward is held against, so it is measured in the same run, on the same threads
    (PyTorch's as the run set them). Each side warms up, then gives the median of ``samples`` samples (a batch
    lasting at least ``min_sample`` each) in a block of its own, PyTorch first: not alternately as the cases,
    because OpenBLAS's threads keep spinning for a while after NumPy's product and took the cores from the next
    ``torch.mm`` (on the 2-core EPYC, PyTorch's rate fell from about 175 to 115 GFLOP/s when alternated; NumPy's
    barely moved). The outputs are allocated once, so that the samples time the product, not the page faults of a
    fresh 16 MiB array.
    """
    rng = np.random.default_rng(0)
    ta, tb = (torch.from_numpy(rng.standard_normal((n, n), dtype=np.float32)) for _ in range(2))
    tc = torch.empty(n, n, dtype=torch.float32)
    sides = {"PyTorch": lambda: torch.mm(ta, tb, out=tc)}
    if bfloat16:
        ta16, tb16, tc16 = (t.to(torch.bfloat16) for t in (ta, tb, tc))
        sides["PyTorch bfloat16"] = lambda: torch.mm(ta16, tb16, out=tc16)
    rates = {name: rate_gflops(call, 2.0 * n ** 3, min_sample, samples) for name, call in sides.items()}
    rates["NumPy"], numpy_threads = numpy_sgemm_gflops(n, min_sample, torch.get_num_threads(), samples)
    return rates, numpy_threads


def loop_gflops(call, min_sample, samples):
    """GFLOP/s of one of the core's bench loops (cpp/peak.hpp's bench_tasks), ``call`` returning the flops it did,
    the same at each call: rate_gflops's median, each sample lasting at least ``min_sample`` and
    config.PEAK_MIN_SAMPLE."""
    return rate_gflops(call, call(), max(min_sample, PEAK_MIN_SAMPLE), samples)


def peak_gflops(min_sample, samples=SGEMM_SAMPLES):
    """GFLOP/s of the multiply-add peak of attnpp's CPU level on its threads: cpp/peak.cpp's loop of independent
    float multiply-adds on as many vector accumulators as the registers hold, nothing loaded, the fastest any
    kernel of the level can multiply and add. The median of ``samples`` samples (a batch lasting at least
    ``min_sample`` and config.PEAK_MIN_SAMPLE each) after a warm-up call (loop_gflops).

    The sgemm rates (sgemm_gflops) are a BLAS's, which attnpp's attention forward outruns on some CPUs (AMD Zen 3
    at AVX2: up to 110% of NumPy's sgemm); this one no kernel can, so the share of it says how far from the
    machine's limit a case runs, and what a target ratio would ask of it (report.target_line)."""
    return loop_gflops(lambda: _core.multiply_add_peak(PEAK_STEPS), min_sample, samples)


def forward_products_gflops(min_sample, samples=SGEMM_SAMPLES):
    """GFLOP/s of attnpp's attention forward's two products alone, q k^T then p v, on the blocks the forward takes
    for a head of each width of config.PRODUCT_HEAD_DIMS, on attnpp's threads (_core.forward_products): {head_dim:
    GFLOP/s}, each the median of ``samples`` samples (loop_gflops). Between the multiply-add peak and the
    forward's own rate: the peak's share that the products reach, and the share of theirs left by the softmax and
    the bookkeeping between them."""
    return {D: loop_gflops(lambda D=D: _core.forward_products(D, PRODUCT_STEPS), min_sample, samples)
            for D in PRODUCT_HEAD_DIMS}
