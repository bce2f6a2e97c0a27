"""Issue 24's case family, context parallelism: ring attention over worker processes of one thread each
(``_ring``) against attnpp's attention in this process on as many threads."""
from __future__ import annotations

from functools import partial

import numpy as np

from .calls import attention_calls, random_inputs, sdpa_sides
from .case import Case, fmt_shape, fmt_time, kernel_flops
from .config import CONTEXT_PARALLEL, MIB


def context_parallel_calls(shape, causal, layout, backward, info):
    """(ring attention over the worker ranks, attnpp's attention in this process) on random (B, H, L, D) inputs;
    ``info`` gets the inputs' MiB on each side."""
    from . import _ring
    ring = _ring.workers(CONTEXT_PARALLEL["ranks"])
    info["inputs"] = [b / MIB for b in ring.setup(shape, layout, causal, backward)]
    info["one"] = _ring.inputs_mib(shape, backward)
    one = attention_calls(sdpa_sides(random_inputs(shape), is_causal=causal), backward)[0]

    class RingCall:  # (its own per-rank figures, for this case's line: the ranks are shared between cases)
        __call__ = ring.__call__

        def peak_growth_mib(self):
            info["per_rank_mib"] = ring.peak_growth_mib()
            return None if None in info["per_rank_mib"] else max(info["per_rank_mib"])
    return RingCall(), one


def context_parallel_summary(info, forward_times, role):
    """A context-parallel case's line: each rank's peak memory, with its inputs, against the one process's; the
    non-causal forward (``role`` "record") records its ring time in ``forward_times``, and zigzag's causal forward
    (``role`` "compare") sets its own against it."""
    def line(result):
        ring_t = float(np.median(result.times[0]))
        name = result.case.name.split(":")[0]
        text = [f"{name}: ring {fmt_time(ring_t)}"]
        if result.memory[1] is not None:
            ranks = info["per_rank_mib"]
            whole = [m + i for m, i in zip(ranks, info["inputs"])]
            one = result.memory[1] + info["one"]
            share, bound = max(whole) / one, CONTEXT_PARALLEL["memory"]
            text.append(f"peak memory per rank {', '.join(f'{m:.0f}' for m in ranks)} MiB beyond its inputs, "
                        f"{', '.join(f'{m:.0f}' for m in whole)} MiB with them, against one process's "
                        f"{result.memory[1]:.0f} and {one:.0f} MiB: {share:.0%} (issue 24's target <= "
                        f"{bound:.0%}: {'met' if share <= bound else 'NOT met'})")
        if role == "record":
            forward_times["full"] = ring_t
        elif role == "compare" and "full" in forward_times:
            share, bound = ring_t / forward_times["full"], CONTEXT_PARALLEL["zigzag"]
            text.append(f"{share:.0%} of the non-causal forward's time (issue 24's target <= {bound:.0%}: "
                        f"{'met' if share <= bound else 'NOT met'})")
        return "; ".join(text)
    return line


def context_parallel_cases(size):
    """Issue 24's cases: ring attention over 2 worker processes of one thread each (attnpp.torch.distributed,
    gloo on the loopback) against attnpp in this process on 2 threads (the table's PyTorch column), forward and
    forward + backward, causal (zigzag, and contiguous forward: unbalanced) and not."""
    shape, ranks = size["context_parallel"], CONTEXT_PARALLEL["ranks"]
    forward_times, cases = {}, []
    for backward, causal, layout in ((False, False, "contiguous"), (False, True, "zigzag"), (False, True, "contiguous"),
                                     (True, False, "contiguous"), (True, True, "zigzag")):
        info = {}
        kind = "fwd+bwd" if backward else "fwd"
        balanced = layout == "zigzag" or not causal
        role = None if backward else "record" if not causal else "compare" if balanced else None
        name = (f"context-parallel {'' if causal else 'non-causal '}{kind} {fmt_shape(shape)}"
                f"{' causal ' + layout if causal else ''}: {ranks} ranks x 1 thread vs 1 process x {ranks} threads")
        build = partial(context_parallel_calls, shape, causal, layout, backward, info)
        cases.append(Case(name, build,
                          flops=kernel_flops(shape, causal, backward), pairs=CONTEXT_PARALLEL["pairs"], issue=24,
                          target=CONTEXT_PARALLEL["speed"] if balanced else None,
                          summary=context_parallel_summary(info, forward_times, role)))
    return cases
