"""Scaled dot-product attention: the forward, the backward and the weights, on NumPy arrays.

Shape letters: B... any leading (batch) dimensions, H heads (Hq of the query, Hk of key and value), L query
length, S key/value length, D query/key head width, Dv value head width.
"""
import math
from typing import NamedTuple, Optional

import numpy as np

from .. import _core
from .._checks import (MAX_ELEMENTS, broadcast_shape, check_array, check_bool, check_probability, check_query_heads,
                       check_scale, check_seed, compute_dtype)
from .._pool import empty as _empty, zeros as _zeros
from . import _args
from ._args import (additive_mask, attention_params, causal_mode, check_saved,
                    last_dim_contiguous, mask_arg, plain_causal_mode, score_scale)


class _Problem:
    """A validated attention call: the inputs seen as (N, H, rows, cols) plus everything the core needs."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
                 causal_alignment, need_seed=False, has_value=True, window=None, alibi_slopes=None, softcap=None,
                 sinks=None, key_padding_mask=None):
        query = check_array(query, "query", min_ndim=2)
        self.dtype = dtype = query.dtype
        key = check_array(key, "key", min_ndim=2, dtype=dtype)
        value = check_array(value, "value", min_ndim=2, dtype=dtype) if has_value else None  # (the weights: none)
        if query.shape[-1] != key.shape[-1]:
            raise ValueError(f"query and key must have the same last dimension (D), got query {query.shape} "
                             f"and key {key.shape}")
        if value is not None and value.shape[-2] != key.shape[-2]:
            raise ValueError(f"key and value must have the same length S (dimension -2), got key {key.shape} "
                             f"and value {value.shape}")
        dropout_p, scale = check_probability(dropout_p, "dropout_p"), check_scale(scale)
        is_causal, enable_gqa = check_bool(is_causal, "is_causal"), check_bool(enable_gqa, "enable_gqa")
        causal = causal_mode(is_causal, causal_alignment)
        if is_causal and attn_mask is not None:
            raise ValueError("attn_mask must be None when is_causal=True (as in PyTorch): pass one or the other")
        self.seed = check_seed(seed, used=dropout_p > 0, backward=need_seed and "dropout_p")
        self.unbatched = query.ndim == 2 and key.ndim == 2 and (value is None or value.ndim == 2)
        self._sizes(query, key, value, enable_gqa)
        self.q4 = self._as4(query, self.Hq, self.L, self.D)
        self.k4 = self._as4(key, self.Hk, self.S, self.D, self.k_repeat)
        self.v4 = np.zeros((self.N, self.Hk, self.S, 0), dtype) if value is None else \
            self._as4(value, self.Hk, self.S, self.Dv, self.v_repeat)
        masks = [] if attn_mask is None else [self._mask(attn_mask)]
        if key_padding_mask is not None:
            masks.append(self._key_padding(key_padding_mask))
        self.params = attention_params(
            self.batch, self.Hq, dtype, scale=score_scale(scale, self.D), causal=causal, dropout_p=dropout_p,
            seed=self.seed, masks=masks, window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)

    def _sizes(self, query, key, value, enable_gqa):
        """The broadcast batch shape B..., the heads (GQA: the key and value heads repeated to Hq when they
        differ) and L, S, D, Dv, N; MemoryError for a call too large to allocate."""
        L, D, S = query.shape[-2], query.shape[-1], key.shape[-2]
        Dv = value.shape[-1] if value is not None else 0
        lead = lambda x: x.shape[:-2] if x.ndim >= 3 else (1,)  # (B..., H)
        q_lead, k_lead = lead(query), lead(key)
        v_lead = lead(value) if value is not None else k_lead
        if enable_gqa:
            if query.ndim < 3 or key.ndim < 3 or (value is not None and value.ndim < 3):
                raise ValueError("enable_gqa=True needs a heads dimension (-3) in query, key and value")
            Hq, Hk, Hv = q_lead[-1], k_lead[-1], v_lead[-1]
            heads = {"key": (key.shape, Hk)} if value is None else {"key": (key.shape, Hk), "value": (value.shape, Hv)}
            check_query_heads((query.shape, Hq), "enable_gqa=True: ", **heads)
            batch = broadcast_shape("query, key and value batch dimensions", q_lead[:-1], k_lead[:-1],
                                    v_lead[:-1])
        else:
            full = broadcast_shape("query, key and value batch and head dimensions", q_lead, k_lead, v_lead)
            batch, Hq = full[:-1], full[-1]
            Hk = Hq
        # Key and value heads in different numbers (GQA, as PyTorch: query head h uses key head h // (Hq // Hk)
        # and value head h // (Hq // Hv)): both repeated to Hq heads, the core's key/value heads.
        self.k_repeat = self.v_repeat = 1
        if enable_gqa and v_lead[-1] != Hk:
            self.k_repeat, self.v_repeat, Hk = Hq // Hk, Hq // v_lead[-1], Hq
        self.batch, self.Hq, self.Hk, self.L, self.S, self.D, self.Dv = batch, Hq, Hk, L, S, D, Dv
        self.N = math.prod(batch)
        if self.N * Hq * max(L, S) * max(L, S, D, Dv, 1) > MAX_ELEMENTS:  # (as np.empty's MemoryError)
            raise MemoryError(f"attention of batch {tuple(batch)}, {Hq} heads, L={L}, S={S}, D={D}, Dv={Dv}: too "
                              f"large to allocate")

    def _mask(self, attn_mask):
        """``attn_mask`` (bool: True = take part; or float, added) as the core's mask over (B..., Hq, L, S)."""
        m = additive_mask(attn_mask, self.dtype, "attn_mask", true_means_masked=False)
        full_shape = tuple(self.batch) + (self.Hq, self.L, self.S)
        try:
            if np.broadcast_shapes(m.shape, full_shape) != full_shape:
                raise ValueError
        except ValueError:
            raise ValueError(f"attn_mask: shape {attn_mask.shape} does not broadcast to (B..., Hq, L, S) = "
                             f"{full_shape}") from None
        return mask_arg(m, full_shape)

    def _key_padding(self, key_padding_mask):
        """``key_padding_mask`` (B..., S) (bool: True = masked out; or float, added) as the core's mask over
        (B..., Hq, L, S), without an (L, S) array."""
        m = additive_mask(key_padding_mask, self.dtype, "key_padding_mask", true_means_masked=True)
        full_shape = tuple(self.batch) + (self.Hq, self.L, self.S)
        try:
            if m.ndim == 0 or np.broadcast_shapes(m.shape, full_shape[:-3] + (self.S,)) != full_shape[:-3] + (
                    self.S,):
                raise ValueError
        except ValueError:
            raise ValueError(f"key_padding_mask: shape {key_padding_mask.shape} does not broadcast to (B..., S) = "
                             f"{full_shape[:-3] + (self.S,)}") from None
        return mask_arg(m.reshape(m.shape[:-1] + (1, 1, self.S)), full_shape)

    def _as4(self, x, H, rows, cols, repeat=1):
        """``x`` as (N, H, rows, cols), a view where possible; its heads repeated ``repeat`` times (GQA)."""
        shape = tuple(self.batch) + (H // repeat, rows, cols)
        x4 = (x if x.shape == shape else np.broadcast_to(x, shape)).reshape(self.N, H // repeat, rows, cols)
        if repeat > 1:
            return x4.repeat(repeat, axis=1)
        return last_dim_contiguous(x4)

    def out_shape(self, *tail):
        return tuple(tail) if self.unbatched else tuple(self.batch) + (self.Hq,) + tuple(tail)

    def reduce_to(self, grad4, x, repeat=1):
        """A gradient (N, H, rows, cols) of a broadcast input (its heads repeated ``repeat`` times), summed back
        to the shape of ``x``."""
        acc = compute_dtype(grad4.dtype)  # (half-precision gradients summed in float32, rounded once)
        if repeat > 1:
            N, H, rows, cols = grad4.shape
            grad4 = grad4.reshape(N, H // repeat, repeat, rows, cols).sum(axis=2, dtype=acc)
        g = grad4.reshape(tuple(self.batch) + grad4.shape[1:])
        extra = g.ndim - x.ndim
        if extra > 0:
            g = g.sum(axis=tuple(range(extra)), dtype=acc)
        axes = tuple(i for i, (gs, xs) in enumerate(zip(g.shape, x.shape)) if xs == 1 and gs != 1)
        if axes:
            g = g.sum(axis=axes, keepdims=True, dtype=acc)
        return np.ascontiguousarray(g.reshape(x.shape), dtype=x.dtype)


def _plain_forward(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_alignment):
    """(output, logsumexp) of the commonest call, without _Problem: (N, Hq, L, D), (N, Hk, S, D) and (N, Hk, S, Dv)
    ndarrays of one dtype with contiguous rows, Hk = Hq or a divisor of it under enable_gqa, no dropout, no option
    beyond is_causal (a bool), scale (None or a float) and causal_alignment (a known name), checked, allocated and
    run in one call of the core (``_core.sdpa_forward_plain``, given the scale of ``score_scale`` and the mode of
    ``plain_causal_mode``: the rules stay here). None for any other call, which takes _Problem's path (and its
    errors): no call that path would refuse. A decoding step calls the attention once per layer per token, its
    Python code gone cold from the caches in between: in a transformers model's decoding, _Problem's path spent
    ~110 us of Python around a kernel of 110 to 210 us, Python's checks of this call ~60 us, the core's a few."""
    if type(query) is not np.ndarray or query.ndim != 4 or not (scale is None or type(scale) is float):
        return None
    causal = plain_causal_mode(is_causal, causal_alignment)
    if causal is None:
        return None
    return _core.sdpa_forward_plain(query, key, value, dropout_p, causal, score_scale(scale, query.shape[3]),
                                    enable_gqa, _args._BFLOAT16_NUMERICS)


class AttentionForward(NamedTuple):
    """What ``scaled_dot_product_attention_forward`` (and the varlen forward) returns, to pass to the backward.

    Attributes:
        output (ndarray): (B..., Hq, L, Dv), or (L, Dv) unbatched; (Tq, Hq, Dv) from the varlen forward.
        logsumexp (ndarray): (B..., Hq, L), or (L,) unbatched, the log of each row's softmax denominator (-inf
            for a fully masked row); (Hq, Tq) from the varlen forward (FlashAttention's layout).
        seed (int or None): the dropout seed used (the one given, or the one drawn when ``seed=None``); None
            without dropout.
    """
    output: np.ndarray
    logsumexp: np.ndarray
    seed: Optional[int]


def scaled_dot_product_attention_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False, *, seed=None,
                                         causal_alignment="top_left", window=None, alibi_slopes=None, softcap=None,
                                         sinks=None, key_padding_mask=None):
    """Attention forward that also returns what the backward needs.

    ``softmax(scale * query key^T + attn_mask) value``, with dropout on the weights.

    Args: those of ``scaled_dot_product_attention``, each described there.

    Returns:
        ``AttentionForward(output, logsumexp, seed)``, a named tuple: output (B..., Hq, L, Dv) (or (L, Dv)
            unbatched); logsumexp (B..., Hq, L), the log of each row's softmax denominator (-inf for a fully masked
            row); seed (int), the dropout seed used, drawn from attnpp's generator when ``seed=None`` (None when
            dropout_p is 0).

    Dropout: the kept weights are those where ``dropout_mask((*B, Hq, L, S), dropout_p, seed)`` is True (B...
    the broadcast batch shape), so a caller recovers the mask from the seed. Pass the returned seed to the
    backward: ``out, lse, seed = scaled_dot_product_attention_forward(q, k, v, dropout_p=0.1)``, then
    ``scaled_dot_product_attention_backward(grad, q, k, v, out, lse, dropout_p=0.1, seed=seed)``.

    Raises: as ``scaled_dot_product_attention``.

    Fully masked rows, NaN and inf, accuracy at large scores and the method: as ``scaled_dot_product_attention``
    says.
    """
    if attn_mask is None and seed is None and window is None and alibi_slopes is None and softcap is None \
            and sinks is None and key_padding_mask is None:
        plain = _plain_forward(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
        if plain is not None:
            return AttentionForward(*plain, None)
    p = _Problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment,
                 window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                 key_padding_mask=key_padding_mask)
    out = _empty((p.N, p.Hq, p.L, p.Dv), p.dtype)
    lse = np.empty((p.N, p.Hq, p.L), compute_dtype(p.dtype))
    _core.sdpa_forward(out, lse, p.q4, p.k4, p.v4, p.params)
    return AttentionForward(out.reshape(p.out_shape(p.L, p.Dv)), lse.reshape(p.out_shape(p.L)),
                            p.seed if p.params.dropout_p > 0 else None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, seed=None, causal_alignment="top_left", window=None,
                                 alibi_slopes=None, softcap=None, sinks=None, key_padding_mask=None):
    """Scaled dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    ``softmax(scale * query key^T + attn_mask) value``, with dropout on the weights. For training, the forward
    that also returns what the backward needs is ``scaled_dot_product_attention_forward``.

    Args:
        query (ndarray): (B..., Hq, L, D), or (L, D) unbatched; float32, float64, float16 or bfloat16
            (``ml_dtypes.bfloat16``; see "Half precision" below).
        key (ndarray): (B..., Hk, S, D), same dtype. B... broadcasts against the query's.
        value (ndarray): (B..., Hv, S, Dv), same dtype; Hv = Hk unless ``enable_gqa``.
        attn_mask (ndarray, optional): broadcastable to (B..., Hq, L, S), any number of dimensions (a 1-D mask
            (S,) applies to every query). Boolean: True where a key *takes part* (False masks it out). Float (the
            query's dtype): added to the scores. Default: None.
        dropout_p (float): probability of zeroing each attention weight, in [0, 1); the kept ones are scaled by
            1 / (1 - dropout_p). Default: 0.0.
        is_causal (bool): mask the keys after each query (upper triangle), aligned top-left when L != S, as in
            PyTorch (see ``causal_alignment``). Needs ``attn_mask=None``. Default: False.
        scale (float, optional): factor on q k^T. Default: 1 / sqrt(D).
        enable_gqa (bool): grouped-query attention: Hq a multiple of Hk and of Hv, query head h uses key head
            h // (Hq // Hk) and value head h // (Hq // Hv), as PyTorch. Default: False (then H broadcasts like
            the batch dimensions).
        seed (int, optional): dropout seed. The same seed gives the same mask, whatever the thread count. None
            draws one from attnpp's global generator (see ``attnpp.manual_seed``). Default: None.
        causal_alignment (str): ``"top_left"`` (PyTorch's ``is_causal``: query i sees keys j <= i) or
            ``"bottom_right"`` (query i sees keys j <= i + S - L, like ``causal_lower_right``). Default:
            ``"top_left"``.
        window (tuple of 2 ints, optional): sliding-window (local) attention, FlashAttention's ``window_size``
            (Beltagy et al., "Longformer", 2020; Mistral 7B): ``(left, right)``, query i sees keys j with
            i + S - L - left <= j <= i + S - L + right (positions aligned bottom-right, as FlashAttention); -1
            leaves a side unbounded. Combines with ``is_causal`` (a causal window of w: ``is_causal=True,
            window=(w, 0)``) and the masks. The key blocks outside every row's window are skipped: the work
            follows the visible area. Default: None.
        alibi_slopes (ndarray, optional): ALiBi (Press et al., "Train Short, Test Long", 2022), one slope per
            query head, (Hq,) or (B..., Hq), any float dtype (used in the query's): adds
            -slope * |i + S - L - j| to the scores (FlashAttention's convention). ``get_alibi_slopes(Hq)`` gives
            the paper's slopes. Default: None.
        softcap (float, optional): logit soft-capping (Gemma 2, Team Gemma 2024): the scores become
            ``softcap * tanh(scores / softcap)`` before the masks and ALiBi are added. Default: None (no cap).
        sinks (ndarray, optional): attention sinks (gpt-oss, OpenAI 2025; Xiao et al., "Efficient Streaming
            Language Models with Attention Sinks", 2023): (Hq,), the query's dtype, a learned logit per head that
            joins every softmax's denominator and takes no value: the weights of a row sum to
            1 - exp(sink - logsumexp). The backward returns its gradient. Default: None.
        key_padding_mask (ndarray, optional): (B..., S), or (S,): padded keys, as ``torch.nn.MultiheadAttention``'s.
            Boolean: True where a key is *masked out* (padding); float (the query's dtype): added to every
            query's scores. Unlike ``attn_mask`` it combines with ``is_causal`` and takes no (L, S) array, so a
            padded batch keeps the causal block skipping. Default: None.

    Returns:
        output (ndarray): (B..., Hq, L, Dv), or (L, Dv) unbatched.

    Raises:
        TypeError: query, key or value not an ndarray of one of those dtypes, mixed dtypes (naming the argument
            and both dtypes), a mask of another dtype than bool or the query's, is_causal or enable_gqa not a bool.
        ValueError: shapes that do not agree or broadcast (named with their shapes), a mask that does not
            broadcast to (B..., Hq, L, S) or a key_padding_mask to (B..., S), dropout_p outside [0, 1), attn_mask
            given with is_causal=True, a window side below -1, a negative or infinite softcap, alibi_slopes or sinks
            of another shape than (Hq,).
        MemoryError: a problem too large to allocate.

    A query row whose keys are all masked gives output 0 and gradient 0, never NaN (as PyTorch >= 2.5).
    NaN and inf propagate as in PyTorch's math backend (a NaN score makes its row NaN; a NaN value reaches every
    query that weights its key), with one difference: a key of weight exactly 0 multiplies its value by 0 (so a
    NaN there gives NaN, as in PyTorch) except where attnpp skips it: key blocks wholly above the causal
    diagonal or masked, and fully masked rows (output 0). PyTorch's flash backend skips other keys, so its
    backends differ there too. Large scores do not overflow (the softmax subtracts each row's maximum); the
    backward and the weights, recomputed from the rounded log-sum-exp, carry an extra relative error of about
    eps * |score| (FlashAttention-2's, and PyTorch's flash backward's): float32 scores of 1e3 give about 1e-4.

    Half precision (float16, bfloat16), as PyTorch's CPU kernels: every element is read into float32, the
    products accumulate in float32, the softmax and the log-sum-exp are float32 (the log-sum-exp is returned as
    float32), and each output and gradient is rounded once to the input dtype at the end (not per key block;
    the gradients' softmax term rowsum(dO * O) is taken from the weights in float32, not from the rounded
    output). At the ``avx512_bf16`` CPU level (``attnpp.cpu_capability()``), the bfloat16 products of queries,
    keys, values and output gradients run on ``vdpbf16ps`` (pairs of bfloat16 into float32, exact products),
    and the weights P are rounded to bfloat16 for their products with V and dO, as PyTorch's CPU flash attention
    does; the scores' gradient keeps float32. The slopes and the sinks are used in float32.

    Method: Vaswani et al., "Attention Is All You Need" (2017); computed as FlashAttention-2 (Dao, 2023): key
    blocks with an online softmax, only the output and the log-sum-exp saved, so memory grows with L, not L*S.
    """
    return scaled_dot_product_attention_forward(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                enable_gqa, seed=seed, causal_alignment=causal_alignment,
                                                window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                                                sinks=sinks, key_padding_mask=key_padding_mask)[0]


def scaled_dot_product_attention_backward(grad_output, query, key, value, output, logsumexp, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                                          seed=None, causal_alignment="top_left", window=None, alibi_slopes=None,
                                          softcap=None, sinks=None, key_padding_mask=None):
    """Gradients of ``scaled_dot_product_attention_forward``.

    Recomputes each block of attention weights from ``logsumexp`` (FlashAttention-2's backward): memory grows
    with L, not L*S.

    Args:
        grad_output (ndarray): (B..., Hq, L, Dv) (or (L, Dv) unbatched), the gradient of the loss with respect
            to ``output``; the inputs' dtype.
        query (ndarray): (B..., Hq, L, D), or (L, D) unbatched, the forward's; float32, float64, float16 or
            bfloat16.
        key (ndarray): (B..., Hk, S, D), the forward's.
        value (ndarray): (B..., Hv, S, Dv), the forward's.
        output (ndarray): (B..., Hq, L, Dv), the forward's output.
        logsumexp (ndarray): (B..., Hq, L), the forward's log-sum-exp.
        attn_mask (ndarray, optional): as given to the forward: broadcastable to (B..., Hq, L, S); boolean True
            where a key *takes part*, or float added to the scores. Default: None.
        dropout_p (float): as given to the forward, in [0, 1). Default: 0.0.
        is_causal (bool): as given to the forward. Default: False.
        scale (float, optional): as given to the forward. Default: 1 / sqrt(D).
        enable_gqa (bool): as given to the forward (grouped-query attention). Default: False.
        seed (int): the forward's dropout seed (the ``seed`` of its ``AttentionForward``); required when
            dropout_p > 0 (ValueError otherwise).
        causal_alignment (str): as given to the forward, ``"top_left"`` or ``"bottom_right"``. Default:
            ``"top_left"``.
        window (tuple of 2 ints, optional): as given to the forward (sliding window ``(left, right)``).
            Default: None.
        alibi_slopes (ndarray, optional): as given to the forward, (Hq,) or (B..., Hq). Default: None.
        softcap (float, optional): as given to the forward. Default: None.
        sinks (ndarray, optional): as given to the forward, (Hq,); its gradient is returned. Default: None.
        key_padding_mask (ndarray, optional): as given to the forward, (B..., S). Default: None.

    Returns:
        (grad_query, grad_key, grad_value), each of its input's shape (summed over broadcast dimensions); with
            ``sinks``, (grad_query, grad_key, grad_value, grad_sinks), grad_sinks (Hq,).

    Raises:
        TypeError: an input that is not a float ndarray of those dtypes, mixed dtypes (grad_output, output and
            logsumexp included), a mask of another dtype, is_causal or enable_gqa not a bool.
        ValueError: shapes that do not agree or broadcast (named with their shapes), grad_output, output or
            logsumexp not of the forward's output shapes, a mask that does not broadcast to (B..., Hq, L, S),
            dropout_p outside [0, 1), dropout without a seed, attn_mask given with is_causal=True, a window side
            below -1, a negative or infinite softcap, alibi_slopes or sinks of another shape than (Hq,).
        MemoryError: a problem too large to allocate.

    Fully masked rows, NaN and inf, accuracy at large scores and the method: as ``scaled_dot_product_attention``
    says.
    """
    p = _Problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment,
                 need_seed=True, window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                 key_padding_mask=key_padding_mask)
    grad_output, output, logsumexp = check_saved(p.dtype, (grad_output, p.out_shape(p.L, p.Dv)),
                                                 (output, p.out_shape(p.L, p.Dv)), (logsumexp, p.out_shape(p.L)))
    four = lambda a, tail: np.ascontiguousarray(a).reshape((p.N, p.Hq) + tail)
    dq = _zeros((p.N, p.Hq, p.L, p.D), p.dtype)
    dk = _zeros((p.N, p.Hk, p.S, p.D), p.dtype)
    dv = _zeros((p.N, p.Hk, p.S, p.Dv), p.dtype)
    dsinks = None if p.params.sinks is None else np.zeros(p.Hq, compute_dtype(p.dtype))
    _core.sdpa_backward(dq, dk, dv, four(grad_output, (p.L, p.Dv)), four(output, (p.L, p.Dv)),
                        four(logsumexp, (p.L,)), p.q4, p.k4, p.v4, p.params,
                        grad_sinks=dsinks)
    grads = p.reduce_to(dq, query), p.reduce_to(dk, key, p.k_repeat), p.reduce_to(dv, value, p.v_repeat)
    return grads if dsinks is None else grads + (dsinks.astype(p.dtype),)


def scaled_dot_product_attention_weights(query, key, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                         enable_gqa=False, *, seed=None, causal_alignment="top_left",
                                         logsumexp=None, window=None, alibi_slopes=None, softcap=None, sinks=None,
                                         key_padding_mask=None):
    """The attention weights ``softmax(scale * query key^T + attn_mask)``.

    Materializes (B..., Hq, L, S): for inspection and plots, not needed by the forward or backward. With
    dropout_p > 0 the weights are those after dropout (zeros and 1 / (1 - dropout_p) scaling), for ``seed``.

    Args:
        query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment: as
            ``scaled_dot_product_attention``'s (seed: the forward's, for the weights it used).
        window, alibi_slopes, softcap, sinks, key_padding_mask: as ``scaled_dot_product_attention``'s.
        logsumexp (ndarray, optional): (B..., Hq, L), the forward's, saves recomputing it. Default: None.

    Returns:
        weights (ndarray): (B..., Hq, L, S), or (L, S) unbatched; fully masked rows are 0.

    Raises:
        TypeError: query or key not a float ndarray of those dtypes, mixed dtypes (logsumexp included), a mask of
            another dtype, is_causal or enable_gqa not a bool.
        ValueError: shapes that do not agree or broadcast (named with their shapes), a logsumexp not of shape
            (B..., Hq, L), a mask that does not broadcast to (B..., Hq, L, S), dropout_p outside [0, 1),
            attn_mask given with is_causal=True, a window side below -1, a negative or infinite softcap,
            alibi_slopes or sinks of another shape than (Hq,).
        MemoryError: a problem too large to allocate (the weights are checked first, before any work).

    Fully masked rows, NaN and inf, accuracy at large scores and the method: as ``scaled_dot_product_attention``
    says.
    """
    p = _Problem(query, key, None, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment,
                 has_value=False, window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                 key_padding_mask=key_padding_mask)
    weights = _empty((p.N, p.Hq, p.L, p.S), p.dtype)  # first: a MemoryError before any work
    if logsumexp is None:  # a forward with Dv = 0 computes the log-sum-exp alone
        lse = np.empty((p.N, p.Hq, p.L), compute_dtype(p.dtype))
        _core.sdpa_forward(np.empty((p.N, p.Hq, p.L, 0), p.dtype), lse, p.q4, p.k4, p.v4, p.params)
    else:
        logsumexp = check_array(logsumexp, "logsumexp", dtype=compute_dtype(p.dtype))
        if logsumexp.shape != p.out_shape(p.L):
            raise ValueError(f"logsumexp: expected shape {p.out_shape(p.L)}, got {logsumexp.shape}")
        lse = np.ascontiguousarray(logsumexp).reshape(p.N, p.Hq, p.L)
    _core.sdpa_weights(weights, lse, p.q4, p.k4, p.params)
    return weights.reshape(p.out_shape(p.L, p.S))
