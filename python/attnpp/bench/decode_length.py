"""Issue 37's decoding steps: one query row (B, Hq, 1, D) over the S + 1 keys of a grouped-query cache (Hk key and
value heads), S from 4,096 to 32,768 (--quick: tiny), in float32 and bfloat16, through attnpp's plain call
(``scaled_dot_product_attention`` with ``enable_gqa=True`` on the S + 1 keys) and through its KV-cache call
(``scaled_dot_product_attention_with_kvcache``, writing the new key and value at position S first: variants'
decode_steps), each against the same step in PyTorch, forward only; the peers (--against) compute the plain
attention over the same S + 1 keys in both."""
from __future__ import annotations

import numpy as np
import torch.nn.functional as TF

from attnpp import functional as F
from attnpp.torch import from_numpy

from .calls import forward_only
from .case import Case, attention_flops, fmt_shape
from .config import HALVES
from .peers import Problem
from .variants import decode_steps


def decode_problem(B, Hq, Hk, D, S, dtype=np.float32):
    """A query row (B, Hq, 1, D) and the key and value (B, Hk, S + 1, D) it attends to: standard normal, drawn in
    float32 from a fixed seed, then rounded to ``dtype``."""
    rng = np.random.default_rng(0)
    draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return Problem(draw(B, Hq, 1, D), draw(B, Hk, S + 1, D), draw(B, Hk, S + 1, D))


def plain_decode_calls(problem):
    """(attnpp call, PyTorch call) of the plain step: scaled_dot_product_attention(enable_gqa=True) on both sides,
    each under its no_grad."""
    q, k, v = problem.query, problem.key, problem.value
    tq, tk, tv = map(from_numpy, (q, k, v))
    return forward_only(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                        lambda: TF.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))


def decode_length_cases(size):
    """The cases of ``size["decode_length"]`` = ((B, Hq, Hk, D), lengths S): for each dtype (float32, bfloat16) and
    S, the plain call then the KV-cache call."""
    (B, Hq, Hk, D), lengths = size["decode_length"]
    cases = []
    for dtype in ("float32", "bfloat16"):
        np_dtype = HALVES[dtype][0] if dtype in HALVES else np.dtype(np.float32)
        suffix = "" if dtype == "float32" else f" {dtype}"
        for S in lengths:
            sizes, flops = (B, Hq, Hk, D, S), attention_flops(B * Hq * (S + 1), D, False)
            problem = lambda n=sizes, d=np_dtype: decode_problem(*n, dtype=d)
            head = f"decode-length {{}} {fmt_shape((B, Hq, 1, D))} GQA {Hk} kv heads"
            cases.append(Case(head.format("plain") + f", {S}+1 keys{suffix}",
                              lambda p=problem: plain_decode_calls(p()), flops=flops, dtype=dtype,
                              peer_problem=problem))
            cases.append(Case(head.format("kvcache") + f", cache {S}+1{suffix}",
                              lambda n=sizes, d=np_dtype: forward_only(*decode_steps(*n, dtype=d)), flops=flops,
                              dtype=dtype, peer_problem=problem))
    return cases
