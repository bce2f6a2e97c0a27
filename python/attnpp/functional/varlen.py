"""Attention over packed sequences of different lengths (varlen) and one decoding step over a KV cache.

Shape letters: T packed tokens (Tq of the queries, Tk of the keys), B sequences, H heads (Hq, Hk), L new queries,
S_max the cache's length, D query/key head width, Dv value head width.
"""
import numbers

import numpy as np

from .. import _core
from .._checks import (as_ndarray, check_array, check_bool, check_cache_dtype, check_cumulative,
                       check_probability, check_query_heads, check_seed, compute_dtype)
from .._pool import empty as _empty, zeros as _zeros
from ._args import (attention_params, causal_mode, check_saved, last_dim_contiguous,
                    score_scale)
from .attention import AttentionForward


class _Varlen:
    """A validated call on packed sequences: query (Tq, Hq, D), key (Tk, Hk, D), value (Tk, Hk, Dv), as the
    core's (1, H, T, width) views, and its options."""

    def __init__(self, query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, seed,
                 causal_alignment, window, alibi_slopes, softcap, sinks, need_seed=False):
        query = check_array(query, "query", ndim=3)
        self.dtype = dt = query.dtype
        key = check_array(key, "key", ndim=3, dtype=dt)
        value = check_array(value, "value", ndim=3, dtype=dt)
        (self.Tq, self.Hq, self.D), (self.Tk, self.Hk, _), self.Dv = query.shape, key.shape, value.shape[2]
        if key.shape[2] != self.D or value.shape[:2] != key.shape[:2]:
            raise ValueError(f"query (Tq, Hq, D), key (Tk, Hk, D) and value (Tk, Hk, Dv) do not agree: query "
                             f"{query.shape}, key {key.shape}, value {value.shape}")
        check_query_heads((query.shape, self.Hq), key=(key.shape, self.Hk))
        cu_q = check_cumulative(cu_seqlens_q, "cu_seqlens_q", self.Tq)
        cu_k = check_cumulative(cu_seqlens_k, "cu_seqlens_k", self.Tk)
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k: expected the same number of sequences, got "
                             f"{cu_q.shape} and {cu_k.shape}")
        self.B = cu_q.shape[0] - 1
        check_probability(dropout_p, "dropout_p")
        causal = causal_mode(check_bool(is_causal, "is_causal"), causal_alignment)
        self.seed = check_seed(seed, used=dropout_p > 0, backward=need_seed and "dropout_p")
        self.params = attention_params(
            (self.B,), self.Hq, dt, scale=score_scale(scale, self.D), causal=causal, dropout_p=float(dropout_p),
            seed=self.seed, window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        self.q4, self.k4, self.v4 = (self.heads(x) for x in (query, key, value))

    @staticmethod
    def heads(x):
        """(T, H, width) as the core's (1, H, T, width) view, the last dimension contiguous."""
        x = last_dim_contiguous(x)
        return x.transpose(1, 0, 2)[None]


def scaled_dot_product_attention_varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p=0.0,
                                                is_causal=False, scale=None, *, seed=None,
                                                causal_alignment="top_left", window=None, alibi_slopes=None,
                                                softcap=None, sinks=None):
    """Attention over a batch of sequences of different lengths packed end to end, without padding
    (FlashAttention's ``flash_attn_varlen_func``): sequence b's queries are rows ``cu_seqlens_q[b]`` to
    ``cu_seqlens_q[b + 1]`` of ``query`` and attend only to its keys, rows ``cu_seqlens_k[b]`` to
    ``cu_seqlens_k[b + 1]`` of ``key`` and ``value``. Each sequence is computed as
    ``scaled_dot_product_attention`` computes one batch entry, with its own L and S (causal alignment, window and
    ALiBi positions included); nothing is computed for padding, and memory grows with the tokens, not L * S.

    Args:
        query (ndarray): (Tq, Hq, D), the sequences' queries packed, float32, float64, float16 or bfloat16.
        key (ndarray): (Tk, Hk, D), same dtype; Hq a multiple of Hk (grouped-query attention).
        value (ndarray): (Tk, Hk, Dv), same dtype.
        cu_seqlens_q, cu_seqlens_k (ndarray): (B + 1,) integers, the cumulative lengths: 0, L_0, L_0 + L_1, ...,
            Tq (resp. Tk).
        dropout_p, is_causal, scale, seed, causal_alignment, window, alibi_slopes, softcap, sinks: as in
            ``scaled_dot_product_attention``, per sequence; alibi_slopes (Hq,) or (B, Hq). With dropout, the
            weight (b, h, i, j) of sequence b is kept where ``dropout_mask((B, Hq, Lmax, Smax), p, seed)[b, h, i,
            j]`` is (Lmax, Smax: the longest lengths).

    Returns:
        ``AttentionForward(output, logsumexp, seed)``: output (Tq, Hq, Dv); logsumexp (Hq, Tq) (FlashAttention's
            layout); seed as in ``scaled_dot_product_attention_forward``.

    Raises:
        TypeError: arrays that are not float ndarrays of one dtype, integer offsets of another type.
        ValueError: shapes that do not agree, offsets that do not run from 0 to Tq (Tk) without decreasing, or
            other numbers of sequences; the option errors of ``scaled_dot_product_attention``.
    """
    p = _Varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, seed, causal_alignment,
                window, alibi_slopes, softcap, sinks)
    out = _empty((p.Tq, p.Hq, p.Dv), p.dtype)
    lse = np.empty((p.Hq, p.Tq), compute_dtype(p.dtype))
    _core.sdpa_forward(p.heads(out), lse[None], p.q4, p.k4, p.v4, p.params)
    return AttentionForward(out, lse, p.seed if p.params.dropout_p > 0 else None)


def scaled_dot_product_attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p=0.0,
                                        is_causal=False, scale=None, *, seed=None, causal_alignment="top_left",
                                        window=None, alibi_slopes=None, softcap=None, sinks=None):
    """``scaled_dot_product_attention_varlen_forward``'s output alone: (Tq, Hq, Dv)."""
    return scaled_dot_product_attention_varlen_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, seed=seed,
        causal_alignment=causal_alignment, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
        sinks=sinks)[0]


def scaled_dot_product_attention_varlen_backward(grad_output, query, key, value, output, logsumexp, cu_seqlens_q,
                                                 cu_seqlens_k, dropout_p=0.0, is_causal=False, scale=None, *,
                                                 seed=None, causal_alignment="top_left", window=None,
                                                 alibi_slopes=None, softcap=None, sinks=None):
    """Gradients of ``scaled_dot_product_attention_varlen_forward``.

    Args:
        grad_output (ndarray): (Tq, Hq, Dv), the gradient of the loss with respect to ``output``.
        output (ndarray): (Tq, Hq, Dv), logsumexp (Hq, Tq): what the forward returned.
        the others: exactly as given to the forward (seed: the forward's, required when dropout_p > 0).

    Returns:
        (grad_query (Tq, Hq, D), grad_key (Tk, Hk, D), grad_value (Tk, Hk, Dv)), and grad_sinks (Hq,) with sinks.

    Raises:
        as the forward; and TypeError/ValueError: a grad_output, output or logsumexp of another dtype or shape.
    """
    p = _Varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, seed, causal_alignment,
                window, alibi_slopes, softcap, sinks, need_seed=True)
    grad_output, output, logsumexp = check_saved(p.dtype, (grad_output, (p.Tq, p.Hq, p.Dv)),
                                                 (output, (p.Tq, p.Hq, p.Dv)), (logsumexp, (p.Hq, p.Tq)))
    dq, dk, dv = (_zeros(shape, p.dtype) for shape in ((p.Tq, p.Hq, p.D), (p.Tk, p.Hk, p.D), (p.Tk, p.Hk, p.Dv)))
    dsinks = None if p.params.sinks is None else np.zeros(p.Hq, compute_dtype(p.dtype))
    _core.sdpa_backward(p.heads(dq), p.heads(dk), p.heads(dv), p.heads(grad_output), p.heads(output),
                        np.ascontiguousarray(logsumexp)[None], p.q4, p.k4, p.v4, p.params,
                        grad_sinks=dsinks)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks.astype(p.dtype))


def scaled_dot_product_attention_with_kvcache(query, key_cache, value_cache, cache_seqlens, key=None, value=None,
                                              *, is_causal=True, scale=None, window=None, alibi_slopes=None,
                                              softcap=None, sinks=None):
    """One decoding step with a KV cache, as FlashAttention's ``flash_attn_with_kvcache``: writes the new keys
    and values into the preallocated caches in place, then attends the queries to each sequence's cached keys,
    without copying the caches.

    Sequence b holds ``cache_seqlens[b]`` keys before the call; ``key[b]``, ``value[b]`` (L new ones) are written
    at positions ``cache_seqlens[b]`` to ``cache_seqlens[b] + L - 1``, and its queries attend to the first
    ``cache_seqlens[b] + L`` keys (S_b), query i at position S_b - L + i: causal is aligned bottom-right, so a
    new token sees the cache and the new tokens up to itself. ``cache_seqlens`` is not changed: add L to it
    for the next step.

    Half precision: caches of float16 or bfloat16 halve the bytes a step reads (a decoding step is bound by
    memory), with queries of the same dtype or of float32; the keys and values are read into float32, the
    products and the softmax are in float32, and the output comes back in the query's dtype.

    Args:
        query (ndarray): (B, Hq, L, D), float32, float64, float16 or bfloat16.
        key_cache (ndarray): (B, Hk, S_max, D), the query's dtype, or float16/bfloat16 under float32 queries;
            written in place; Hq a multiple of Hk (GQA).
        value_cache (ndarray): (B, Hk, S_max, Dv), the key cache's dtype, written in place.
        cache_seqlens (ndarray or int): (B,) integers (or one for every sequence), keys already in the cache.
        key (ndarray, optional): (B, Hk, L, D), the new keys; value (ndarray, optional): (B, Hk, L, Dv), of the
            query's dtype (rounded into a half-precision cache) or the cache's. Both or neither (then the queries
            attend to the cache as it is).
        is_causal (bool): hide keys after each query's position (bottom-right). Default: True.
        scale, window, alibi_slopes, softcap, sinks: as in ``scaled_dot_product_attention`` (positions
            bottom-right, S = S_b per sequence).

    Returns:
        output (ndarray): (B, Hq, L, Dv), the query's dtype.

    Raises:
        TypeError: arrays that are not float ndarrays of one dtype (but for float32 queries over a half-precision
            cache), a cache that is not a writeable ndarray.
        ValueError: shapes that do not agree, a cache without room for the new keys (cache_seqlens[b] + L >
            S_max), negative lengths, key without value; the option errors of ``scaled_dot_product_attention``.
    """
    query = check_array(query, "query", ndim=4)
    key_cache = check_array(key_cache, "key_cache", ndim=4, written=True)
    dt = key_cache.dtype  # (the caches' dtype: the query's, or half precision under float32 queries)
    check_cache_dtype(dt, query.dtype, "key_cache")
    value_cache = check_array(value_cache, "value_cache", ndim=4, dtype=dt, written=True)
    B, Hq, L, D = query.shape
    _, Hk, S_max, _ = key_cache.shape
    if key_cache.shape != (B, Hk, S_max, D) or value_cache.shape[:3] != (B, Hk, S_max):
        raise ValueError(f"key_cache (B, Hk, S_max, D) and value_cache (B, Hk, S_max, Dv) must agree with query "
                         f"(B, Hq, L, D); got query {query.shape}, key_cache {key_cache.shape}, value_cache "
                         f"{value_cache.shape}")
    check_query_heads((query.shape, Hq), key_cache=(key_cache.shape, Hk))
    Dv = value_cache.shape[3]
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.array(cache_seqlens)
    lengths = np.broadcast_to(as_ndarray(cache_seqlens, "cache_seqlens"), (B,))
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"cache_seqlens: expected integers, got dtype {lengths.dtype}")
    if (key is None) != (value is None):
        raise ValueError("key and value: give both (the new tokens) or neither")
    new = 0
    if key is not None:
        key = check_array(key, "key", ndim=4)
        key = check_array(key, "key", dtype=dt if key.dtype == dt else query.dtype)
        value = check_array(value, "value", ndim=4, dtype=key.dtype)
        new = key.shape[2]
        if key.shape != (B, Hk, new, D) or value.shape != (B, Hk, new, Dv):
            raise ValueError(f"key and value: expected (B, Hk, L_new, D) = {(B, Hk, new, D)} and (B, Hk, L_new, Dv) "
                             f"= {(B, Hk, new, Dv)}, got {key.shape} and {value.shape}")
    if (lengths < 0).any() or (lengths > S_max - new).any():
        raise ValueError(f"cache_seqlens: expected lengths in [0, S_max - L_new] = [0, {S_max - new}], got "
                         f"{lengths.tolist()}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not c.flags.writeable or (c.shape[-1] > 1 and c.strides[-1] != c.itemsize):
            raise ValueError(f"{name}: expected a writeable array whose last dimension is contiguous")
    lengths = lengths.astype(np.int64)
    params = attention_params((B,), Hq, dt, scale=score_scale(scale, D),
                              causal=causal_mode(check_bool(is_causal, "is_causal"), "bottom_right"),
                              window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                              seqlens_k=lengths + new)
    if new:
        for b, s in enumerate(lengths.tolist()):  # the new tokens, in place
            key_cache[b, :, s:s + new] = key[b]
            value_cache[b, :, s:s + new] = value[b]
    out = _empty((B, Hq, L, Dv), query.dtype)
    lse = np.empty((B, Hq, L), compute_dtype(dt))
    q4 = last_dim_contiguous(query)
    _core.sdpa_forward(out, lse, q4, key_cache, value_cache, params)
    return out
