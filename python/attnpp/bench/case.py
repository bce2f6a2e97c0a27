"""The benchmark's data: a case (its name, how to build its two calls, its flop count and target), what
measuring it gives (a Result, or Skipped with the reason), and the formatting of shapes and times they share."""
from __future__ import annotations

from dataclasses import dataclass
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
    run: Optional[Callable[[], tuple]] = None  # -> (times, calls, memory): a case measured its own way (fine-tune:
    #                                            configurations one after another in fresh processes; build unused)


def fmt_shape(shape):
    return "(" + ",".join(map(str, shape)) + ")"


def attention_flops(pairs, D, backward):
    """Flops of an attention over ``pairs`` (query, key) pairs (over batch and heads) of width D: 4 D each forward
    (Q K^T and P V), the backward 2.5 times the forward."""
    return 4.0 * pairs * D * (3.5 if backward else 1.0)


def kernel_flops(shape, causal, backward):
    B, H, L, D = shape
    return attention_flops(B * H * L * L / (2 if causal else 1), D, backward)

@dataclass
class Skipped:
    case: Case
    reason: str     # what is missing, from the case's Unavailable


@dataclass
class Result:
    case: Case
    times: tuple    # (attnpp, PyTorch): seconds per call, one per sample, in the order taken
    calls: tuple    # calls per sample (attnpp, PyTorch)
    memory: tuple   # (attnpp, PyTorch) peak growth in MiB, or None

def fmt_time(seconds):
    """Three significant digits in µs, ms or s."""
    for unit, scale in (("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if seconds < 1000 * scale or unit == "s":
            v = seconds / scale
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}"
