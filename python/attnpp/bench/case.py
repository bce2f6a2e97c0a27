"""The benchmark's data: a case (its name, how to build its two calls, its flop count and target, the problem its
peers compute), what measuring it gives (a Result with its peers' figures, or Skipped with the reason), and the
formatting of shapes and times they share."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


class Unavailable(Exception):
    """A case that cannot run on this installation (its message: what is missing and how to get it): the run
    skips it with a note and goes on with the others."""

@dataclass
class Case:
    name: str
    build: Callable[[], tuple]           # -> (attnpp call, PyTorch call): one unit of work each, inputs allocated
    flops: Optional[float] = None        # per call, for attnpp's GFLOP/s (kernel cases)
    pairs: Optional[int] = None          # pairs (or chunks) to time; default: --repeats
    calls_per_sample: Optional[int] = None   # fixed (training chunks); None: calibrated to the minimum sample
    total: bool = False                  # show the time of all samples (the whole training), not the median call
    summary: Optional[Callable] = None   # Result -> a line printed under the table
    vs_sgemm: bool = False               # an attention forward: its GFLOP/s are set against the sgemm rate
    target: Optional[float] = None       # the issue's target for the ratio (attnpp at least this many times faster)
    issue: int = 14                      # the issue that set the target
    dtype: str = "float32"               # the dtype of the inputs (a name of HALVES, or float32)
    peer_problem: Optional[Callable] = None  # -> peers.Problem: the forward the peers (--against) compute, if any
    run: Optional[Callable[[], tuple]] = None  # -> (times, calls, memory): a case measured its own way (fine-tune:
    #                                            configurations one after another in fresh processes; build unused)


def fmt_shape(shape):
    return "(" + ",".join(map(str, shape)) + ")"


def attention_flops(pairs, D, backward):
    """Flops of an attention over ``pairs`` (query, key) pairs (over batch and heads) of width D, as FlashAttention
    counts them (Dao, "FlashAttention-2", 2023, section 4.1, arXiv:2307.08691): the forward's two products Q K^T
    and P V, 2 D flops each per pair, so 4 D per pair (4 B H L S D over a full (L, S) grid); the backward 2.5 times
    the forward (its five products, Q K^T recomputed among them, against the forward's two), so forward + backward
    3.5 times. The softmax's exponentials and sums are not counted."""
    return 4.0 * pairs * D * (3.5 if backward else 1.0)


def kernel_flops(shape, causal, backward):
    """attention_flops of the kernel on (B, H, L, D) with S = L: B H L^2 pairs, halved when causal (FlashAttention's
    count: L^2 / 2, not the L (L + 1) / 2 pairs of the triangle)."""
    B, H, L, D = shape
    return attention_flops(B * H * L * L / (2 if causal else 1), D, backward)

@dataclass
class Skipped:
    case: Case
    reason: str     # what is missing, from the case's Unavailable


@dataclass
class PeerResult:
    """A peer engine (--against) on a case: its seconds per call, one per round (timed in turn with the case's two
    sides, so a round gives the ratio peer / attnpp), calls per sample, the error of its first call's output against
    float64 and the tolerance it met, a note (e.g. heads repeated for it); or only ``skipped``, the reason."""
    times: list = field(default_factory=list)
    calls: int = 0
    error: Optional[float] = None
    tolerance: Optional[float] = None
    note: str = ""
    skipped: Optional[str] = None


@dataclass
class Result:
    case: Case
    times: tuple    # (attnpp, PyTorch): seconds per call, one per sample, in the order taken
    calls: tuple    # calls per sample (attnpp, PyTorch)
    memory: tuple   # (attnpp, PyTorch) peak growth in MiB, or None
    peers: dict = field(default_factory=dict)   # engine title -> PeerResult (--against; forward cases only)

def fmt_time(seconds):
    """Three significant digits in µs, ms or s."""
    for unit, scale in (("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if seconds < 1000 * scale or unit == "s":
            v = seconds / scale
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}"
