"""Issue 37's long causal sequences: the kernel on (1, H, L, D), causal, forward and forward + backward, at lengths
2,048 to 32,768 for H = 12, D = 64 and H = 32, D = 128 (--quick: tiny ones); the forward cases set against the GEMM
rate and timed against the peers (--against), which have no backward."""
from __future__ import annotations

from .calls import kernel_calls, kernel_problem
from .case import Case, fmt_shape, kernel_flops


def causal_length_cases(size):
    """The cases of ``size["causal_length"]`` = ((H, D) pairs, lengths): for each pair and length, the forward then
    the forward + backward."""
    heads, lengths = size["causal_length"]
    cases = []
    for H, D in heads:
        for L in lengths:
            shape = (1, H, L, D)
            for backward in (False, True):
                cases.append(Case(f"causal-length {'fwd+bwd' if backward else 'fwd'} {fmt_shape(shape)}",
                                  lambda s=shape, b=backward: kernel_calls(s, True, b),
                                  flops=kernel_flops(shape, True, backward), vs_sgemm=not backward,
                                  peer_problem=None if backward else lambda s=shape: kernel_problem(s, True)))
    return cases
