"""The results file (``python -m attnpp.bench --json PATH``): the run as data, from which the documentation's
performance page is built (docs/hooks/performance.py renders docs/results/*.json).

One JSON object::

    {"format": FORMAT, "date": ISO 8601 in UTC, "command": the options,
     "machine": machine.describe()'s (CPU model, SIMD flags, each library's level and threads, versions, the other
                processes' load, the run's --note),
     "run": {"quick", "repeats", "min_sample_s"},
     "cases": [one record per case, in the table's order (case_record)],
     "sgemm": {"n", "gflops": {"PyTorch", "NumPy", "PyTorch bfloat16" (where it is a limit)}, "numpy_threads",
               "limits": {"float32", "bfloat16"}: the names of the gflops the cases' gemm_share are of},
     "peak": {"gflops": the multiply-add peak (measure.peak_gflops), "level": attnpp's CPU level, "threads",
              "forward_products": {head_dim as a string: the forward's products' GFLOP/s}
                                  (measure.forward_products_gflops)},
     "peers": {"versions": {engine title: version}, "missing": [a line per engine not installed]}, or null without
              --against}

Fields are only ever added (a reader of the first files still reads the new ones): ``gemm_share`` and ``peers`` in
the case records, the run's ``peers`` and the sgemm's ``limits`` came with issue 37 (a file without ``limits``
held every case against PyTorch's rates), and later the run's ``peak`` and the cases' ``peak_share``, then the
peak's ``forward_products``.
"""
from __future__ import annotations

import datetime
import json

import numpy as np

import attnpp

from .case import Skipped
from .machine import describe
from .report import attnpp_gflops, gemm_products, gemm_share, peak_share, ratio_quartiles

FORMAT = "attnpp-bench-results/1"


def _quartiles(values):
    """(25th, 50th, 75th percentile) of ``values`` as floats."""
    return tuple(float(v) for v in np.percentile(np.asarray(values, dtype=float), [25, 50, 75]))


def peer_record(result, peer):
    """A peer engine on a case as data: like a side's figures (median, IQR, samples, calls per sample), the ratios
    t_peer / t_attnpp of the rounds, the error of its output against float64 and the tolerance, its note; or
    ``"skipped": reason`` (with the error where its check failed)."""
    check = {"error": peer.error, "tolerance": peer.tolerance, "note": peer.note or None}
    if peer.skipped:
        return {"skipped": peer.skipped, **check}
    q1, median, q3 = _quartiles(peer.times)
    r1, ratio, r3 = (float(v) for v in ratio_quartiles(result, peer))
    return {"median_s": median, "iqr_s": [q1, q3], "samples_s": [float(t) for t in peer.times],
            "calls_per_sample": int(peer.calls), "ratio": {"median": ratio, "iqr": [r1, r3]}, **check}


def case_record(result, rates, peak):
    """One case as data: its name, dtype, target (and the issue that set it), and, if measured, for each side
    ("attnpp", "torch") the median seconds per call with the interquartile range of the samples, the calls per
    sample, the peak memory growth (MiB, None where it cannot be measured), then the ratio t_torch / t_attnpp of the
    alternating pairs (median and quartiles), attnpp's GFLOP/s and their share of the GEMM rate of the case's dtype
    (``rates``: sgemm_gflops') and of the multiply-add ``peak`` (report.peak_share), whether the target was met,
    the case's own line under the table, and its peers (peer_record, by engine title; {} without --against). A
    skipped case has ``"skipped": reason`` instead of the figures."""
    case = result.case
    record = {"name": case.name, "dtype": case.dtype, "target": case.target,
              "issue": case.issue if case.target is not None else None}
    if isinstance(result, Skipped):
        return {**record, "skipped": result.reason}
    sides = {}
    for side, times, calls, memory in zip(("attnpp", "torch"), result.times, result.calls, result.memory):
        q1, median, q3 = _quartiles(times)
        sides[side] = {"median_s": median, "iqr_s": [q1, q3], "samples_s": [float(t) for t in times],
                       "calls_per_sample": int(calls), "memory_mib": memory}
        if case.total:  # the training: all its steps, the sum of the chunks
            sides[side]["total_s"] = float(np.sum(times)) * calls
    q1, ratio, q3 = (float(v) for v in ratio_quartiles(result))
    line = case.summary(result) if case.summary else ""
    share, of_peak = gemm_share(result, rates), peak_share(result, rates, peak)
    return {**record, **sides, "ratio": {"median": ratio, "iqr": [q1, q3]},
            "attnpp_gflops": None if case.flops is None else float(attnpp_gflops(result)),
            "gemm_share": None if share is None else float(share),
            "peak_share": None if of_peak is None else float(of_peak),
            "target_met": None if case.target is None else ratio >= case.target,
            "line": line or None, "peers": {title: peer_record(result, peer) for title, peer in result.peers.items()}}


def write(path, results, *, argv, quick, repeats, min_sample, load, sgemm, peak, products, note=None, peers=None):
    """Write the run (``results``: a Result or Skipped per case; ``sgemm``: (n, rates, NumPy's threads); ``peak``:
    the multiply-add peak's GFLOP/s; ``products``: the forward's products' {head_dim: GFLOP/s}; ``peers``: the
    run's peers.Peers, None without --against) to ``path`` as JSON."""
    n, rates, numpy_threads = sgemm
    data = {"format": FORMAT,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": ["python", "-m", "attnpp.bench", *argv],
            "machine": describe(load, note),
            "run": {"quick": quick, "repeats": repeats, "min_sample_s": min_sample},
            "cases": [case_record(r, rates, peak) for r in results],
            "sgemm": {"n": n, "gflops": {k: float(v) for k, v in rates.items()}, "numpy_threads": numpy_threads,
                      "limits": gemm_products(rates=rates)},
            "peak": {"gflops": float(peak), "level": attnpp.cpu_capability(), "threads": attnpp.get_num_threads(),
                     "forward_products": {str(D): float(rate) for D, rate in products.items()}},
            "peers": None if peers is None else {"versions": peers.versions, "missing": peers.missing}}
    with open(path, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
