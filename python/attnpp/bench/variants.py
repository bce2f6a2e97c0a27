"""Issue 14's case family, the attention variants: the causal sliding window (against FlexAttention and a dense
mask), one decode step with a KV cache, and a variable-length batch against its padded twin."""
from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as TF

from attnpp import functional as F
from attnpp.torch import from_numpy

from .calls import Sides, attention_calls, forward_only, random_inputs, sdpa_sides
from .case import Case, Unavailable, attention_flops, fmt_shape, fmt_time


def sliding_window(q_idx, kv_idx, window):
    """Causal sliding window: query i sees key j iff i - window <= j <= i (attnpp's is_causal=True,
    window=(window, 0) when L == S). The one mask of the window cases: FlexAttention's mask_mod on index tensors, and
    PyTorch's dense bool mask on NumPy index grids."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)


def window_pairs(L, window):
    """(query, key) pairs a causal sliding window of L x L shows: the window cases' flop count is of these only."""
    return int(np.minimum(np.arange(L), window).sum()) + L


def flex_forward(L, S, window, info):
    """PyTorch's FlexAttention, compiled (torch.compile), with the sliding window's block mask: (q, k, v) ->
    output. The block mask is built here, once, as a FlexAttention user builds it per shape; its time goes to
    ``info["block_mask"]``. Unavailable if this PyTorch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        raise Unavailable(f"this PyTorch has no FlexAttention ({error})") from error
    start = time.perf_counter()
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: sliding_window(q_idx, kv_idx, window), None, None,
                                   L, S, device="cpu")
    info["block_mask"] = time.perf_counter() - start
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def window_sides(shape, window, reference, info=None):
    """attnpp's causal sliding window (is_causal=True, window=(window, 0)) on random (B, H, L, D) inputs, against
    PyTorch's ``reference``: "flex" (FlexAttention, see flex_forward) or "dense" (scaled_dot_product_attention with
    the window's (L, L) bool mask, True = takes part)."""
    L = shape[2]
    if reference == "flex":
        torch_forward = flex_forward(L, L, window, info)
    else:
        idx = np.arange(L)
        mask = torch.from_numpy(sliding_window(idx[:, None], idx[None, :], window))
        torch_forward = partial(TF.scaled_dot_product_attention, attn_mask=mask)
    return sdpa_sides(random_inputs(shape), torch_forward, is_causal=True, window=(window, 0))


def compile_first_call(call, info):
    """Run ``call`` once, the call that compiles (torch.compile), and put its time in ``info["compile"]``, with
    the hits and misses of inductor's on-disk FX graph cache meanwhile (hits: an earlier run compiled the same graphs,
    so this compile was shorter). Unavailable, with the error, if it fails: FlexAttention needs inductor's C++
    compiler and a vector ISA on the CPU (PyTorch 2.13 lowers it for AVX2 and AVX-512, not for the baseline that
    ``--capability default`` forces), and has no backward on the CPU."""
    from torch._dynamo.utils import counters
    before = {key: counters["inductor"][f"fxgraph_cache_{key}"] for key in ("hit", "miss")}
    start = time.perf_counter()
    try:
        call()
    except Exception as error:  # whatever stops it (no compiler, no backward), the other cases go on
        # the first line that says something (inductor's errors open with "backend='inductor' raised:"), and the
        # C++ compiler's first error if there is one
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = next((line for line in lines if not line.endswith(":")), "")
        compiler = next((line.split(" error: ", 1)[1] for line in lines if " error: " in line), None)
        reason += f" ({compiler})" if compiler else ""
        raise Unavailable(f"FlexAttention does not run here: {type(error).__name__}: {reason}") from error
    info["compile"] = time.perf_counter() - start
    info.update({key: counters["inductor"][f"fxgraph_cache_{key}"] - n for key, n in before.items()})


def window_calls(shape, window, backward, reference, compile_flex=True, info=None):
    """(attnpp call, PyTorch call) of the sliding-window case. Against FlexAttention, the first call compiles
    (compile_first_call; its time, kept out of the timings, goes to ``info``); ``compile_flex=False`` (--quick)
    skips it as Unavailable rather than spend about 15 s (a cold compile here) on a tiny case."""
    if reference == "flex" and not compile_flex:
        raise Unavailable("--quick does not compile FlexAttention (torch.compile takes about 15 s here, cold)")
    calls = attention_calls(window_sides(shape, window, reference, info), backward)
    if reference == "flex":
        compile_first_call(calls[1], info)
    return calls


def flex_summary(name, info):
    """The line of a FlexAttention case: its compile time, kept out of the timings."""
    def line(result):
        cache = ("a cold compile" if not info["hit"] else
                 "compiled graphs found on disk: a second run's compile" if not info["miss"] else "a partial hit")
        return (f"FlexAttention compile: {info['compile']:.1f} s ({name}: torch.compile's first call, excluded from "
                f"the timings; inductor's FX graph cache {info['hit']} hits, {info['miss']} misses: {cache}); "
                f"create_block_mask {info['block_mask']:.2f} s")
    return line


def decode_steps(B, Hq, Hk, D, S, room=256, dtype=np.float32):
    """(attnpp step, PyTorch step) of one decode step, each returning its output (B, Hq, 1, D): a new token's query
    attends to a KV cache holding S tokens and the new token's key and value, written into the cache first.

    Both caches (B, Hk, S + room, D) are preallocated with room to grow and hold the same S past tokens. attnpp:
    scaled_dot_product_attention_with_kvcache with cache_seqlens = S and the new key/value (it writes them at
    position S and attends to [0, S + 1)). PyTorch: the new key/value assigned into the cache slice [S, S + 1), then
    scaled_dot_product_attention with enable_gqa over the visible prefix [0, S + 1) (L = 1: no causal mask needed).
    Each step writes the same position again, so the cache length stays S. Every array of ``dtype``."""
    rng = np.random.default_rng(0)
    draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    q = draw(B, Hq, 1, D)
    k, v = (draw(B, Hk, 1, D) for _ in range(2))
    caches = [draw(B, Hk, S + room, D) for _ in range(2)]
    seqlens = np.full(B, S, dtype=np.int64)
    tq, tk, tv = map(from_numpy, (q, k, v))
    tcaches = [from_numpy(c.copy()) for c in caches]  # PyTorch's own caches: each side writes its own

    def attnpp_step():
        return F.scaled_dot_product_attention_with_kvcache(q, *caches, seqlens, k, v)

    def torch_step():
        key_cache, value_cache = tcaches
        key_cache[:, :, S:S + 1] = tk
        value_cache[:, :, S:S + 1] = tv
        return TF.scaled_dot_product_attention(tq, key_cache[:, :, :S + 1], value_cache[:, :, :S + 1], enable_gqa=True)

    return attnpp_step, torch_step


def varlen_lengths(count, shortest, longest):
    """``count`` sequence lengths from ``shortest`` to ``longest`` (both included), the others drawn between them
    from a fixed seed, in a fixed shuffled order."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[shortest, longest], rng.integers(shortest, longest + 1, count - 2)])
    return rng.permutation(lengths).astype(np.int64)


def varlen_sides(lengths, H, D):
    """A causal variable-length batch: attnpp's scaled_dot_product_attention_varlen_forward/_backward on the packed
    sequences (T, H, D) with cu_seqlens (FlashAttention's varlen layout), against PyTorch's
    scaled_dot_product_attention on the batch padded to the longest (B, H, Lmax, D), as a PyTorch user holds it,
    with a (B, 1, Lmax, Lmax) bool mask: causal, and only the sequence's own keys (a padded query row still sees the
    sequence's keys, so no row is fully masked). The output gradient is zero on the padding on PyTorch's side."""
    B, longest = len(lengths), int(max(lengths))
    rng = np.random.default_rng(0)
    padded = [rng.standard_normal((B, longest, H, D), dtype=np.float32) for _ in range(4)]  # q, k, v, g
    valid = np.arange(longest)[None, :] < np.asarray(lengths)[:, None]                   # (B, Lmax)
    padded[3][~valid] = 0.0
    packed = tuple(np.ascontiguousarray(x[valid]) for x in padded)                        # (T, H, D), in order
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tensors = tuple(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in padded)
    mask = torch.from_numpy(np.tril(np.ones((longest, longest), dtype=bool))[None] & valid[:, None, :])[:, None]
    options = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, is_causal=True)
    return Sides(packed, partial(F.scaled_dot_product_attention_varlen_forward, **options),
                 partial(F.scaled_dot_product_attention_varlen_backward, **options),
                 partial(TF.scaled_dot_product_attention, attn_mask=mask), tensors,
                 unpad=lambda t: t.transpose(1, 2)[torch.from_numpy(valid)])

def decode_summary(float32_time):
    """The decode step's line: the float32 case records attnpp's median step in ``float32_time`` (a dict) and
    prints nothing; the bfloat16 case sets its own against it (issue 21's target: at least 1.7 times faster)."""
    def line(result):
        step = float(np.median(result.times[0]))
        if result.case.dtype == "float32":
            float32_time["attnpp"] = step
            return ""
        if "attnpp" not in float32_time:
            return f"{result.case.name}: the float32 decode case did not run"
        speedup = float32_time["attnpp"] / step
        return (f"{result.case.name}: attnpp {fmt_time(step)} per step, {speedup:.2f} times as fast as its float32 "
                f"step ({fmt_time(float32_time['attnpp'])}); issue 21's target >= 1.7: "
                f"{'met' if speedup >= 1.7 else 'NOT met'}")
    return line


def variant_cases(size, quick, float32_decode=None):
    """Issue 14's cases: the causal sliding window against FlexAttention and against a dense mask, the decode step
    with a KV cache, the variable-length batch against its padded twin; each with its target ratio. Every build
    takes its sizes as default arguments: the names below are reused from case to case."""
    cases = []
    shape, window = size["window"]
    B, H, L, D = shape
    references = {"flex": ("FlexAttention", 1.5), "dense": ("dense mask", 5.0)}
    for backward in (False, True):
        for reference, (title, target) in references.items():
            name = f"window {'fwd+bwd' if backward else 'fwd'} {fmt_shape(shape)} causal w={window} vs {title}"
            info = {}  # FlexAttention's compile time, from its build to its line under the table
            cases.append(Case(name, lambda b=backward, r=reference, i=info, s=shape, w=window:
                              window_calls(s, w, b, r, not quick, i),
                              flops=attention_flops(B * H * window_pairs(L, window), D, backward), target=target,
                              summary=flex_summary(name, info) if reference == "flex" else None))
    B, Hq, Hk, D, S = size["decode"]
    cases.append(Case(f"decode fwd {fmt_shape((B, Hq, 1, D))} GQA {Hk} kv heads, cache {S}+1",
                      lambda sizes=size["decode"]: forward_only(*decode_steps(*sizes)),
                      flops=attention_flops(B * Hq * (S + 1), D, False), target=1.5,
                      summary=None if float32_decode is None else decode_summary(float32_decode)))
    count, shortest, longest, H, D = size["varlen"]
    lengths = varlen_lengths(count, shortest, longest)
    for backward in (False, True):
        cases.append(Case(f"varlen {'fwd+bwd' if backward else 'fwd'} {count} seqs {shortest}..{longest} "
                          f"({lengths.sum()} tokens) H={H} D={D} causal vs padded",
                          lambda b=backward, n=lengths, h=H, d=D: attention_calls(varlen_sides(n, h, d), b),
                          flops=attention_flops(H * (lengths * (lengths + 1) // 2).sum(), D, backward),
                          target=1.5))
    return cases
