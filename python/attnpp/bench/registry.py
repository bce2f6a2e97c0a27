"""The registry of case families: each family's module builds its cases from the run's sizes; ``make_cases``
lists them in the table's order. A new family is a module with a function returning its cases and one entry in
FAMILIES."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import (articles, causal_length, context_parallel, decode_length, fine_tune, fused_loss, half, huggingface,
               kernel, variants)
from .config import SIZES


@dataclass(frozen=True)
class Family:
    """A case family: its name (what ``--list`` groups under it) and ``build(size, quick, repeats, shared)``, which
    returns its cases for the run's ``size`` (a value of SIZES); ``shared`` carries the figures one family's case
    records for another's line (the float32 memory growth and decode step, which the bfloat16 lines compare)."""
    name: str
    build: Callable


FAMILIES = (
    Family("kernel", lambda size, quick, repeats, shared: kernel.kernel_cases(size, repeats,
                                                                              shared["float32_growth"])),
    Family("causal-length", lambda size, quick, repeats, shared: causal_length.causal_length_cases(size)),
    Family("variants", lambda size, quick, repeats, shared: variants.variant_cases(size, quick,
                                                                                   shared["float32_decode"])),
    Family("decode-length", lambda size, quick, repeats, shared: decode_length.decode_length_cases(size)),
    Family("MultiheadAttention", lambda size, quick, repeats, shared: kernel.mha_cases(size)),
    Family("half precision", lambda size, quick, repeats, shared: half.half_cases(size, repeats,
                                                                                  shared["float32_growth"],
                                                                                  shared["float32_decode"])),
    Family("fused loss", lambda size, quick, repeats, shared: fused_loss.linear_cross_entropy_cases(size)),
    Family("transformers", lambda size, quick, repeats, shared: huggingface.transformers_cases(size, quick)),
    Family("fine-tune", lambda size, quick, repeats, shared: fine_tune.fine_tune_cases(size, quick)),
    Family("context parallel", lambda size, quick, repeats, shared: context_parallel.context_parallel_cases(size)),
    Family("articles", lambda size, quick, repeats, shared: articles.article_cases(size, repeats)),
)


def make_cases(quick, repeats):
    """Every case of the run (``quick``: the --quick sizes), family by family in FAMILIES' order."""
    size, shared = SIZES[quick], {"float32_growth": {}, "float32_decode": {}}
    return [case for family in FAMILIES for case in family.build(size, quick, repeats, shared)]
