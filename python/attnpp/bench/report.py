"""The report: the header (setup and method), the table, the peers' table (--against), the cases' own lines, the
targets, the GEMM lines and the multiply-add peak's."""
from __future__ import annotations

import os

import numpy as np
import torch

import attnpp

from .case import Result, Skipped, fmt_time
from .machine import cpu_model, numpy_openblas
from .config import CAPABILITY_VARS, MEMORY_PAIRS, SGEMM_SAMPLES, SGEMM_TARGET


def attnpp_gflops(result):
    """attnpp's GFLOP/s in a case with a flop count (its median call), else None."""
    return None if result.case.flops is None else result.case.flops / np.median(result.times[0]) / 1e9


def gemm_products(level=None, forced=None, rates=None):
    """The products of sgemm_gflops whose rates are the limits, by the case's dtype: {"float32": name, "bfloat16":
    name}, names of its rates.

    float32 (and float16, which attnpp computes in float32): the faster of PyTorch's and NumPy's sgemm in ``rates``
    (NumPy's is measured at attnpp's level: measure.numpy_sgemm_gflops), PyTorch's without ``rates``; but NumPy's
    alone where a level is forced (``ATTNPP_CPU_CAPABILITY`` set, as ``--capability`` does) and NumPy's BLAS is
    OpenBLAS, which takes the level on any CPU while MKL keeps its own on a non-Intel one (config.py). bfloat16:
    PyTorch's bfloat16 product at attnpp's avx512_bf16 level, where attnpp multiplies bfloat16 pairs; below it
    attnpp computes bfloat16 in float32: the float32 product. ``level`` (attnpp's) and ``forced`` default to this
    process's.
    """
    level = attnpp.cpu_capability() if level is None else level
    forced = "ATTNPP_CPU_CAPABILITY" in os.environ if forced is None else forced
    if forced:
        sgemm = "NumPy" if numpy_openblas() else "PyTorch"
    else:
        sgemm = "PyTorch" if rates is None else max(("PyTorch", "NumPy"), key=lambda name: rates[name])
    return {"float32": sgemm, "bfloat16": "PyTorch bfloat16" if level == "avx512_bf16" else sgemm}


def gemm_product(dtype, rates, products=None):
    """The name of the same run's GEMM product a case of ``dtype`` is held against (``rates``: sgemm_gflops';
    ``products``: gemm_products')."""
    products = gemm_products(rates=rates) if products is None else products
    return products["bfloat16" if dtype == "bfloat16" else "float32"]


def gemm_rate(dtype, rates, products=None):
    """The same run's GEMM rate a case of ``dtype`` is held against (gemm_product's)."""
    return rates[gemm_product(dtype, rates, products)]


def gemm_share(result, rates, products=None):
    """attnpp's GFLOP/s in a case as a share of gemm_rate (a fraction), or None without a flop count."""
    gflops = attnpp_gflops(result)
    return None if gflops is None else gflops / gemm_rate(result.case.dtype, rates, products)


def peak_share(result, rates, peak):
    """attnpp's GFLOP/s in a case as a share of the run's multiply-add ``peak`` (a fraction; measure.peak_gflops),
    or None without a flop count, and for a case whose limit is not a float product (bfloat16 at avx512_bf16, whose
    pairs do twice the flops of a float multiply-add)."""
    gflops = attnpp_gflops(result)
    if gflops is None or gemm_product(result.case.dtype, rates) == "PyTorch bfloat16":
        return None
    return gflops / peak


def ratio_quartiles(result, peer=None):
    """25th, 50th and 75th percentiles of the ratios t_PyTorch / t_attnpp, one per alternating pair; with ``peer``
    (a PeerResult of the case), of t_peer / t_attnpp, one per round."""
    a, t = (np.asarray(x) for x in result.times)
    other = t if peer is None else np.asarray(peer.times)
    return np.percentile(other / a, [25, 50, 75])


def fmt_ratio(quartiles):
    q1, med, q3 = quartiles
    return f"{med:.2f} [{q1:.2f}-{q3:.2f}]"


def row(result, rates, peak):
    """One table row: name, times, ratio [IQR], GFLOP/s and their share of the GEMM rate (``rates``) and of the
    multiply-add ``peak``, memory of each side; a skipped case keeps its row."""
    if isinstance(result, Skipped):
        return [result.case.name, "skipped", "skipped", "-", "-", "-", "-", "-", "-"]
    a, t = (np.asarray(x) for x in result.times)
    # the training shows all its steps (sum of the chunks), the other cases the median call
    shown = [x.sum() * n if result.case.total else np.median(x) for x, n in zip((a, t), result.calls)]
    gflops = attnpp_gflops(result)
    shares = ["-" if x is None else f"{x:.0%}" for x in (gemm_share(result, rates), peak_share(result, rates, peak))]
    mem = ["n/a" if m is None else f"{m:.1f}" for m in result.memory]
    return [result.case.name, fmt_time(shown[0]), fmt_time(shown[1]), fmt_ratio(ratio_quartiles(result)),
            "-" if gflops is None else f"{gflops:.1f}", *shares, *mem]


HEADER = ["case", "attnpp time", "PyTorch time", "ratio [IQR]", "attnpp GFLOP/s", "% of GEMM", "% of peak",
          "attnpp MiB", "PyTorch MiB"]
PEER_HEADER = ["case", "peer", "peer time", "peer/attnpp [IQR]", "float64 check", "note"]
PEER_LEFT = (0, 1, 5)


def peer_rows(results):
    """The peers' table: one row per case and engine (--against): its median time, the ratios t_peer / t_attnpp of
    the rounds, its error against float64 and the tolerance met, and its note; a skipped engine keeps its row."""
    rows = []
    for r in results:
        for title, peer in getattr(r, "peers", {}).items():
            if peer.skipped:  # (its check failed: the error it had; else it did not run)
                check = "-" if peer.error is None else f"{peer.error:.1e} > {peer.tolerance:.2g}"
                rows.append([r.case.name, title, "skipped", "-", check, peer.skipped])
            else:
                rows.append([r.case.name, title, fmt_time(np.median(peer.times)), fmt_ratio(ratio_quartiles(r, peer)),
                             f"{peer.error:.1e} <= {peer.tolerance:.2g}", peer.note])
    return rows


def print_table(rows, header=HEADER, left=(0,)):
    """Columns two spaces apart: those of ``left`` (names, notes) left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())


def capability_line():
    """The CPU level each library runs at, and the variables that forced it (``--capability`` sets all four)."""
    attnpp_level, torch_level = attnpp.cpu_capability(), torch.backends.cpu.get_cpu_capability()
    line = f"CPU level: attnpp {attnpp_level}, PyTorch {torch_level}"
    forced = [f"{var}={os.environ[var]}" for var in CAPABILITY_VARS if var in os.environ]
    if forced:
        line += f" (forced: {', '.join(forced)})"
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    if aten and aten.lower() != torch_level.lower():
        # attnpp refuses a level it cannot run (its import fails); PyTorch only warns and keeps its own
        line += f"; PyTorch did NOT take ATEN_CPU_CAPABILITY={aten}"
    return line


def forward_shares(results, rate, of, after=""):
    """attnpp's attention forward GFLOP/s over the run's forward cases that are set against the sgemm (``sdpa fwd``
    and ``causal-length fwd``, as the table shows them): their best and median, each as a share of ``rate`` (``of``
    names it), then ``after``; or a phrase saying the run has no such case."""
    forward = [attnpp_gflops(r) for r in results if isinstance(r, Result) and r.case.vs_sgemm]
    if not forward:
        return "attnpp sdpa fwd: no such case in this run (see --cases)"
    best, median = max(forward), float(np.median(forward))
    return (f"attnpp sdpa fwd over {len(forward)} cases: best {best:.1f} GFLOP/s = {best / rate:.0%} of {of}, median "
            f"{median:.1f} GFLOP/s = {median / rate:.0%}{after}")


def sgemm_line(results, n, rates, numpy_threads):
    """The distance to the limit: the sgemm rates, and attnpp's attention forward GFLOP/s (forward_shares) as a
    share of the sgemm that is the limit (gemm_products)."""
    limit = gemm_products(rates=rates)["float32"]
    return (f"sgemm float32 {n}x{n} @ {n}x{n} on {torch.get_num_threads()} threads (median of {SGEMM_SAMPLES}): "
            f"PyTorch {rates['PyTorch']:.1f} GFLOP/s, NumPy {rates['NumPy']:.1f} GFLOP/s ({numpy_threads}) | "
            + forward_shares(results, rates[limit], f"{limit}'s sgemm",
                             f" (issue 37's target: >= {SGEMM_TARGET:.0%})"))


def peak_line(results, peak):
    """The hard limit: the multiply-add peak of attnpp's level on the run's threads (measure.peak_gflops), and
    attnpp's attention forward GFLOP/s (forward_shares) as a share of it."""
    return (f"multiply-add peak at {attnpp.cpu_capability()} on {attnpp.get_num_threads()} threads (independent "
            f"float multiply-adds, nothing loaded, median of {SGEMM_SAMPLES}): {peak:.1f} GFLOP/s | "
            + forward_shares(results, peak, "it"))


def products_line(products, peak):
    """Between the peak and the forward: the GFLOP/s of attnpp's forward's two products alone on its blocks
    (``products``: measure.forward_products_gflops'), each as a share of the multiply-add ``peak``."""
    rates = ", ".join(f"D={D} {rate:.1f} GFLOP/s = {rate / peak:.0%} of the peak" for D, rate in products.items())
    return (f"attnpp's forward products alone (q k^T then p v on the forward's blocks, no softmax; median of "
            f"{SGEMM_SAMPLES}): {rates}")


def bfloat16_gemm_line(results, n, rates):
    """The bfloat16 GEMM rate through torch.mm beside attnpp's bfloat16 attention forward (best and median of the
    run's ``sdpa fwd ... bfloat16`` cases) and its share of the limit (gemm_products: the float32 product below
    avx512_bf16)."""
    limit = gemm_products(rates=rates)["bfloat16"]
    if limit == "PyTorch bfloat16":
        line, of = f"bfloat16 GEMM {n}x{n} @ {n}x{n} through torch.mm: {rates[limit]:.1f} GFLOP/s | ", "it"
    else:
        line = "bfloat16 GEMM: not measured, not the limit (below avx512_bf16 attnpp computes bfloat16 in float32) | "
        of = f"{limit}'s sgemm"
    forward = [attnpp_gflops(r) for r in results if isinstance(r, Result) and r.case.dtype == "bfloat16"
               and r.case.name.startswith("sdpa fwd ")]
    if not forward:
        return line + "attnpp sdpa fwd bfloat16: no such case in this run (see --cases)"
    return line + (f"attnpp sdpa fwd bfloat16 over {len(forward)} cases: best {max(forward):.1f} GFLOP/s = "
                   f"{max(forward) / rates[limit]:.0%} of {of}, median {float(np.median(forward)):.1f} GFLOP/s")


def target_line(result, rates=None, peak=None):
    """Whether a case with a target ratio met it; where it did not and the case has a flop count, the GFLOP/s the
    target asks of attnpp against PyTorch's median time, and their share of the multiply-add ``peak`` (with
    ``rates``, the run's GEMM rates: peak_share's cases)."""
    head = f"target {result.case.name}: "
    if isinstance(result, Skipped):
        return head + f"not measured (skipped), issue {result.case.issue}'s target >= {result.case.target}"
    ratio = ratio_quartiles(result)[1]
    verdict = "met" if ratio >= result.case.target else f"NOT met ({ratio / result.case.target:.0%} of it)"
    line = head + f"ratio {ratio:.2f}, issue {result.case.issue}'s target >= {result.case.target}: {verdict}"
    if ratio < result.case.target and peak is not None and peak_share(result, rates, peak) is not None:
        needed = result.case.flops * result.case.target / np.median(result.times[1]) / 1e9
        line += f"; it asks {needed:.1f} GFLOP/s of attnpp, {needed / peak:.0%} of the multiply-add peak"
    return line


def print_report(results, repeats, min_sample, quick, load, sgemm, peak, products, peers=None):
    """The header (setup and method; the peers of ``peers``, a peers.Peers, and a line per engine not installed),
    the table (``results``: a Result or Skipped per case), the peers' table, a line per skipped case, the cases' own
    lines (memory, FlexAttention's compile), the targets met or not, the GEMM lines (``sgemm``: the arguments of
    sgemm_line after the results), the peak's line (``peak``: measure.peak_gflops'), the forward's products' line
    (``products``: measure.forward_products_gflops') and the note on the ratios."""
    print(f"attnpp {attnpp.__version__} vs PyTorch {torch.__version__} (CPU), float32 unless a case names its dtype"
          f"{' (--quick)' if quick else ''}")
    print(f"threads: attnpp {attnpp.get_num_threads()}, PyTorch {torch.get_num_threads()} | repeats: {repeats} "
          f"alternating pairs per case (memory case {min(repeats, MEMORY_PAIRS)}; training {repeats} chunks)")
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); other processes used "
          f"{'n/a' if load is None else f'{load:.0%}'} of the CPUs' time during the run")
    print(capability_line())
    print(f"times: median per call, a fast call timed as the mean of a batch lasting >= {min_sample * 1e3:.0f} ms "
          "(training: all steps); forward-only cases under no_grad on both sides (attnpp.no_grad, torch.no_grad); "
          "the articles' layers in eval mode (dropout off) on both sides")
    print("MiB: growth of the peak resident set (VmHWM) during one call after warm-up, inputs already allocated, "
          "the last call's gradients freed (temporaries + outputs + gradients)")
    n, rates, _ = sgemm
    print("GFLOP/s: attnpp's, FlashAttention's count (forward 4 B H L S D, halved when causal; backward 2.5 times the "
          "forward); % of GEMM: of the same run's GEMM rate in the arithmetic attnpp computes the case in (see the "
          "GEMM lines); % of peak: of the same run's multiply-add peak, the most any kernel of attnpp's level can do "
          "(see its line)")
    if peers is not None:
        print(peers.header() if peers.engines else "peers (--against): none installed")
        for line in peers.missing:
            print(line)
    print()
    print_table([row(r, rates, peak) for r in results])
    print()
    peer_table = peer_rows(results)
    if peer_table:
        print("peers, forward only: each engine's first call checked against float64 (the error it had, the "
              "tolerance it met), then timed in the same rounds as the case (a, t, then each peer); peer/attnpp = "
              "peer time / attnpp time of each round, median [25th-75th percentile]; above 1: attnpp faster")
        print_table(peer_table, PEER_HEADER, PEER_LEFT)
        print()
    for r in results:
        if isinstance(r, Skipped):
            print(f"skipped {r.case.name}: {r.reason}")
    for r in results:
        if isinstance(r, Result) and r.case.summary:
            line = r.case.summary(r)
            if line:  # (a case that only records a figure for another's line prints nothing)
                print(line)
    targeted = [r for r in results if r.case.target is not None]
    if quick and targeted:
        print(f"targets: not judged at --quick sizes ({len(targeted)} cases have one at full size)")
    elif targeted:
        for r in targeted:
            print(target_line(r, rates, peak))
    print(sgemm_line(results, *sgemm))
    print(bfloat16_gemm_line(results, n, rates))
    print(peak_line(results, peak))
    print(products_line(products, peak))
    print("ratio = PyTorch time / attnpp time of each alternating pair (a, t, a, t, ...): median [25th-75th "
          "percentile] over the pairs; above 1: attnpp faster")
