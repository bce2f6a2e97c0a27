"""Issue 21's case family, half precision: the kernel, memory, MultiheadAttention and decode cases in bfloat16
and float16."""
from __future__ import annotations

import attnpp

from .calls import forward_only, kernel_calls, kernel_problem, mha_calls
from .case import Case, attention_flops, fmt_shape, kernel_flops
from .config import HALF_FORWARD_TARGETS, HALF_TARGETS, HALVES, MEMORY_PAIRS
from .kernel import memory_summary
from .variants import decode_steps, decode_summary


def half_cases(size, repeats, float32_growth, float32_decode):
    """Issue 21's cases, in bfloat16 and float16: the kernel cases (target HALF_TARGETS, or for the forward ones
    issue 37's HALF_FORWARD_TARGETS where it has one; the forward ones timed against the peers; bfloat16's forward
    + backward also under set_bfloat16_attention("float32"), without a target), the memory case in bfloat16,
    MultiheadAttention and the decode step (bfloat16's target: 2 against PyTorch)."""
    cases = []
    level = attnpp.cpu_capability()
    for dtype, (np_dtype, _) in HALVES.items():
        for backward, numerics in ((False, None), (True, None), (True, "float32")):
            if numerics and dtype != "bfloat16":
                continue
            target, issue = ((HALF_FORWARD_TARGETS[level], 37) if not backward and level in HALF_FORWARD_TARGETS
                             else (HALF_TARGETS.get(level), 21))
            kind = "fwd+bwd" if backward else "fwd"
            for shape, causal in size["kernel"]:
                cases.append(Case(f"sdpa {kind} {fmt_shape(shape)}{' causal' if causal else ''} {dtype}"
                                  f"{f' {numerics} numerics' if numerics else ''}",
                                  lambda s=shape, c=causal, b=backward, d=np_dtype, n=numerics:
                                  kernel_calls(s, c, b, d, n),
                                  flops=kernel_flops(shape, causal, backward),
                                  target=None if numerics else target, issue=issue, dtype=dtype,
                                  peer_problem=None if backward else
                                  lambda s=shape, c=causal, d=np_dtype: kernel_problem(s, c, d)))
        if dtype == "bfloat16":
            mem = size["memory"]
            cases.append(Case(f"memory sdpa fwd+bwd {fmt_shape(mem)} causal {dtype}",
                              lambda d=np_dtype: kernel_calls(mem, True, True, d), flops=kernel_flops(mem, True, True),
                              pairs=min(repeats, MEMORY_PAIRS), summary=memory_summary(mem, float32_growth),
                              dtype=dtype))
        B, L, E, H = size["mha"]
        cases.append(Case(f"MultiheadAttention fwd+bwd {fmt_shape((B, L, E))} H={H} need_weights=False {dtype}",
                          lambda d=dtype: mha_calls(B, L, E, H, False, d), dtype=dtype))
        B, Hq, Hk, D, S = size["decode"]
        cases.append(Case(f"decode fwd {fmt_shape((B, Hq, 1, D))} GQA {Hk} kv heads, cache {S}+1 {dtype}",
                          lambda sizes=size["decode"], d=np_dtype: forward_only(*decode_steps(*sizes, dtype=d)),
                          flops=attention_flops(B * Hq * (S + 1), D, False), dtype=dtype,
                          target=2.0 if dtype == "bfloat16" else None, issue=21,
                          summary=decode_summary(float32_decode) if dtype == "bfloat16" else None))
    return cases
