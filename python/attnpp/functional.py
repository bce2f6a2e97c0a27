"""Stateless attention functions: each forward with its hand-written backward, on NumPy arrays.

Shape letters: B... any leading (batch) dimensions, H heads (Hq of the query, Hk of key and value), L query
length, S key/value length, D query/key head width, Dv value head width.
"""
import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from . import _core
from ._checks import (HALVES, MAX_ELEMENTS, as_ndarray, broadcast_shape, check_alibi_slopes, check_array,
                      check_bool, check_choice, check_cumulative, check_dtype, check_ignore_index, check_index,
                      check_int, check_label_smoothing, check_loss_grad, check_probability, check_reduction,
                      check_scale, check_seed, check_sinks, check_softcap, check_window, compute_dtype, is_real)

__all__ = [
    "dropout", "dropout_backward", "embedding", "embedding_backward",
    "cross_entropy", "cross_entropy_forward", "cross_entropy_backward",
    "linear_cross_entropy", "linear_cross_entropy_forward", "linear_cross_entropy_backward",
    "LinearCrossEntropyForward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_forward", "AttentionForward",
    "scaled_dot_product_attention_backward",
    "scaled_dot_product_attention_weights",
    "scaled_dot_product_attention_varlen", "scaled_dot_product_attention_varlen_forward",
    "scaled_dot_product_attention_varlen_backward", "scaled_dot_product_attention_with_kvcache",
    "get_alibi_slopes",
    "dropout_mask",
    "linear",
    "linear_backward",
    "rotary_embedding", "rotary_embedding_backward", "rotary_tables",
]

_CAUSAL = {"top_left": _core.Causal.top_left, "bottom_right": _core.Causal.bottom_right}
_ALIGNMENTS = tuple(_CAUSAL)


_POOLED_BYTES = 1 << 20  # outputs at least this large come from the core's recycled buffers
_BFLOAT16_NUMERICS = _core.Bfloat16Numerics.pytorch  # the setting of attnpp.set_bfloat16_attention


def _empty(shape, dtype):
    """``np.empty``, from the core's pool of recycled blocks when large (see cpp/buffer_pool.hpp: fresh memory
    costs a page fault per 4 KiB, which dominated a training step that allocates its logits anew each time)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _POOLED_BYTES:
        return np.empty(shape, dtype)
    try:
        return _core.empty(list(shape), dtype)
    except MemoryError:  # (the core says only std::bad_alloc; NumPy's own wording, with the shape and bytes)
        raise MemoryError(f"Unable to allocate {nbytes / 2**30:.3g} GiB ({nbytes} bytes) for an array with shape "
                          f"{tuple(shape)} and data type {dtype}") from None


def _zeros(shape, dtype):
    """``np.zeros`` on ``_empty``'s recycled blocks (np.zeros maps fresh zero pages, faulted in one by one)."""
    out = _empty(shape, dtype)
    out.fill(0)
    return out


# ------------------------------------------------------------------------------------ the core's arguments
def score_scale(scale, D):
    """The factor on q k^T: ``scale`` (checked), 1 / sqrt(D) by default; 1 when D = 0, where every q k^T is the
    empty sum 0 whatever the scale (PyTorch: uniform weights, not NaN)."""
    scale = check_scale(scale)
    return 1.0 if D == 0 else (1.0 / math.sqrt(D) if scale is None else scale)


def causal_mode(is_causal, causal_alignment):
    """The core's ``Causal`` value (none, top_left, bottom_right); ValueError for an unknown alignment."""
    alignment = check_choice(causal_alignment, "causal_alignment", _ALIGNMENTS)
    return _CAUSAL[alignment] if is_causal else _core.Causal.none


def get_alibi_slopes(num_heads, dtype=np.float32):
    """The standard ALiBi slopes for ``num_heads`` heads (Press et al., "Train Short, Test Long: Attention with
    Linear Biases Enables Input Length Extrapolation", 2022): the geometric sequence 2^(-8/n), 2^(-16/n), ... for
    a power of two n; otherwise those of the power of two m below n, then every other slope of 2m, as the
    paper's code (and BLOOM) does.

    Returns:
        ndarray (num_heads,) of ``dtype``, to pass as ``alibi_slopes``.

    Raises:
        TypeError: num_heads not an int. ValueError: num_heads < 1.
    """
    n = check_int(num_heads, "num_heads", minimum=1)
    dtype = check_dtype(dtype)

    def power_of_two(m):
        start = 2.0 ** (-8.0 / m)
        return [start ** (i + 1) for i in range(m)]

    m = 2 ** int(math.floor(math.log2(n)))
    slopes = power_of_two(m) + power_of_two(2 * m)[0::2][: n - m]
    return np.array(slopes, dtype=dtype)


def additive_mask(mask, dtype, name, true_means_masked):
    """A boolean or float mask as a float mask to add to the scores (0 or -inf for booleans)."""
    mask = as_ndarray(mask, name)
    if mask.dtype == np.bool_:
        hidden = mask if true_means_masked else ~mask
        return np.where(hidden, -np.inf, 0.0).astype(dtype)
    if mask.dtype != dtype:
        raise TypeError(f"{name}: expected dtype bool or {np.dtype(dtype)} (the query's), got {mask.dtype}")
    return mask


def mask_arg(mask, full_shape):
    """The core's view of an additive mask broadcast to ``full_shape`` = (B..., H, L, S): an
    ``_core.AttentionMask`` (the mask, batch_offsets (N,), h_stride, l_stride, s_stride, strides in elements), no
    copy."""
    view = np.broadcast_to(mask, full_shape)
    strides = np.array(view.strides, dtype=np.int64) // view.itemsize
    batch = full_shape[:-3]
    if batch:
        idx = np.indices(batch).reshape(len(batch), -1)
        offsets = (strides[: len(batch), None] * idx).sum(axis=0)
    else:
        offsets = np.zeros(1, dtype=np.int64)
    return _core.AttentionMask(view, np.ascontiguousarray(offsets, dtype=np.int64), int(strides[-3]),
                               int(strides[-2]), int(strides[-1]))


def last_dim_contiguous(x):
    """``x`` itself when its last dimension is contiguous (what the core's views need), else a C-contiguous copy."""
    return x if x.shape[-1] <= 1 or x.strides[-1] == x.itemsize else np.ascontiguousarray(x)


def attention_params(batch, Hq, dtype, *, scale, causal=_core.Causal.none, dropout_p=0.0, seed=0, masks=(),
                     window=None, alibi_slopes=None, softcap=None, sinks=None, **sequences):
    """The core's ``AttentionParams`` of one attention call over ``batch`` (B...) and ``Hq`` query heads of
    ``dtype``, the variants' options checked here (``params.sinks``: the checked sinks or None). ``masks``:
    ``mask_arg``'s;
    ``sequences``: cu_seqlens_q and cu_seqlens_k, or seqlens_k, already checked."""
    window, softcap = check_window(window), check_softcap(softcap)
    params = _core.AttentionParams()  # (the defaults, then what differs: the cheapest way to build one)
    params.scale, params.causal = scale, causal
    if _BFLOAT16_NUMERICS != _core.Bfloat16Numerics.pytorch:
        params.bfloat16_numerics = _BFLOAT16_NUMERICS
    if dropout_p:
        params.dropout_p, params.seed = dropout_p, seed
    if masks:
        params.masks = list(masks)
    for name, value in sequences.items():
        setattr(params, name, value)
    if window is not None:
        params.window_left, params.window_right = window
    if softcap is not None:
        params.softcap = softcap
    if alibi_slopes is not None:
        params.alibi_slopes = check_alibi_slopes(alibi_slopes, batch, Hq, dtype)
    if sinks is not None:
        params.sinks = check_sinks(sinks, Hq, dtype)
    return params


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
        if need_seed and dropout_p > 0 and seed is None:
            raise ValueError("seed: the backward with dropout_p > 0 needs the seed given to the forward")
        self.seed = check_seed(seed, used=dropout_p > 0)
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
            if Hk == 0 or Hv == 0 or Hq % Hk or Hq % Hv:
                raise ValueError(f"enable_gqa=True: query heads must be a multiple of key heads and of value "
                                 f"heads; got query {query.shape}, key {key.shape}, value "
                                 f"{None if value is None else value.shape}")
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
    beyond is_causal, scale and causal_alignment, checked, allocated and run in one call of the core
    (``_core.sdpa_forward_plain``). None for any other call, which takes _Problem's path (and its errors): no call
    that path would refuse. A decoding step calls the attention once per layer per token, its Python code gone cold
    from the caches in between: in a transformers model's decoding, _Problem's path spent ~110 us of Python around
    a kernel of 110 to 210 us, Python's checks of this call ~60 us, the core's a few."""
    return _core.sdpa_forward_plain(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                                    _BFLOAT16_NUMERICS)


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
    arrays = []
    for name, arr, shape in (("grad_output", grad_output, p.out_shape(p.L, p.Dv)),
                             ("output", output, p.out_shape(p.L, p.Dv)),
                             ("logsumexp", logsumexp, p.out_shape(p.L))):
        arrays.append(check_array(arr, name, dtype=compute_dtype(p.dtype) if name == "logsumexp" else p.dtype))
        if arrays[-1].shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {arrays[-1].shape}")
    grad_output, output, logsumexp = arrays
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
        query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment, window,
            alibi_slopes, softcap, sinks, key_padding_mask: as ``scaled_dot_product_attention``'s (seed: the
            forward's, for the weights it used).
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


# ------------------------------------------------------------------------------ packed sequences, KV cache
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
        if self.Hk == 0 or self.Hq % self.Hk:
            raise ValueError(f"query heads must be a multiple of key heads (GQA), got query {query.shape} and key "
                             f"{key.shape}")
        cu_q = check_cumulative(cu_seqlens_q, "cu_seqlens_q", self.Tq)
        cu_k = check_cumulative(cu_seqlens_k, "cu_seqlens_k", self.Tk)
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k: expected the same number of sequences, got "
                             f"{cu_q.shape} and {cu_k.shape}")
        self.B = cu_q.shape[0] - 1
        check_probability(dropout_p, "dropout_p")
        causal = causal_mode(check_bool(is_causal, "is_causal"), causal_alignment)
        if need_seed and dropout_p > 0 and seed is None:
            raise ValueError("seed: the backward with dropout_p > 0 needs the seed given to the forward")
        self.seed = check_seed(seed, used=dropout_p > 0)
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
    arrays = []
    for name, arr, shape in (("grad_output", grad_output, (p.Tq, p.Hq, p.Dv)), ("output", output, (p.Tq, p.Hq, p.Dv)),
                             ("logsumexp", logsumexp, (p.Hq, p.Tq))):
        arrays.append(check_array(arr, name, dtype=compute_dtype(p.dtype) if name == "logsumexp" else p.dtype))
        if arrays[-1].shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {arrays[-1].shape}")
    grad_output, output, logsumexp = arrays
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
    if query.dtype != dt and not (dt in HALVES and query.dtype == np.float32):
        raise TypeError(f"key_cache: expected dtype {query.dtype} (the query's), or float16 or bfloat16 under "
                        f"float32 queries, got {dt}")
    value_cache = check_array(value_cache, "value_cache", ndim=4, dtype=dt, written=True)
    B, Hq, L, D = query.shape
    _, Hk, S_max, _ = key_cache.shape
    if key_cache.shape != (B, Hk, S_max, D) or value_cache.shape[:3] != (B, Hk, S_max):
        raise ValueError(f"key_cache (B, Hk, S_max, D) and value_cache (B, Hk, S_max, Dv) must agree with query "
                         f"(B, Hq, L, D); got query {query.shape}, key_cache {key_cache.shape}, value_cache "
                         f"{value_cache.shape}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query heads must be a multiple of the cache's heads (GQA), got query {query.shape} and "
                         f"key_cache {key_cache.shape}")
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


def dropout_mask(shape, p, seed):
    """The dropout keep-mask that attnpp uses for ``seed``: True where a weight is kept.

    For an attention call with broadcast batch shape B..., Hq query heads, L queries and S keys, ``shape`` is
    (*B, Hq, L, S): the weights kept are ``dropout_mask(shape, dropout_p, seed)``, each scaled by
    1 / (1 - dropout_p). Element i (in C order) is kept when a hash of (seed, i) is at least p, so the mask
    does not depend on the thread count.

    Args:
        shape (tuple of int): the weights' shape.
        p (float): dropout probability in [0, 1).
        seed (int): the seed given to (or drawn by) the forward.

    Returns:
        ndarray of bool, of ``shape``.

    Raises:
        TypeError: shape not a sequence of ints, p not a float, seed not an int. ValueError: a negative
        dimension, p outside [0, 1). MemoryError: a shape too large to allocate.
    """
    if not isinstance(shape, (tuple, list)) and not (isinstance(shape, np.ndarray) and shape.ndim == 1):
        raise TypeError(f"shape: expected a tuple of ints, got {type(shape).__name__}")
    dims = []
    for s in shape:
        if not isinstance(s, numbers.Integral) or isinstance(s, bool):
            raise TypeError(f"shape: expected a tuple of ints, got {tuple(shape)} (a {type(s).__name__})")
        if s < 0:
            raise ValueError(f"shape: expected non-negative dimensions, got {tuple(shape)}")
        dims.append(int(s))
    p = check_probability(p, "p")
    seed = check_seed(seed)
    if math.prod(dims) > MAX_ELEMENTS:
        raise MemoryError(f"dropout_mask: shape {tuple(dims)} is too large to allocate")
    return _core.dropout_mask(dims, p, seed)


def linear(input, weight, bias=None):
    """``input @ weight.T + bias``, as ``torch.nn.functional.linear``.

    Args:
        input (ndarray): (*, Fin), float32, float64, float16 or bfloat16 (half precision: the products in
            float32 on float32 copies of the operands, the output rounded once).
        weight (ndarray): (Fout, Fin), same dtype.
        bias (ndarray, optional): (Fout,). Default: None.

    Returns:
        ndarray (*, Fout).

    Raises:
        TypeError: non-float or mixed dtypes. ValueError: shapes that do not agree.
    """
    input = check_array(input, "input", min_ndim=1)
    weight = check_array(weight, "weight", ndim=2, dtype=input.dtype)
    if bias is not None:
        bias = check_array(bias, "bias", ndim=1, dtype=input.dtype)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {bias.shape}")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input: last dimension must be weight's in_features {weight.shape[1]}, got input "
                         f"{input.shape} and weight {weight.shape}")
    return _linear(input, weight, bias)


def _linear(input, weight, bias):
    """``linear`` without the checks, for layers that have made them."""
    x2 = np.ascontiguousarray(input).reshape(-1, input.shape[-1])
    out = _empty((x2.shape[0], weight.shape[0]), input.dtype)
    _core.linear_forward(out, x2, np.ascontiguousarray(weight),
                         None if bias is None else np.ascontiguousarray(bias))
    return out.reshape(input.shape[:-1] + (weight.shape[0],))


def linear_backward(grad_output, input, weight, grad_weight, grad_bias=None, need_input_grad=True):
    """Gradients of ``linear``: returns grad_input (*, Fin) (None if not ``need_input_grad``) and accumulates
    (+=) into ``grad_weight`` (Fout, Fin) and ``grad_bias`` (Fout,) when given (C-contiguous, written in place).

    Raises:
        TypeError: an argument that is not a float ndarray of the input's dtype. ValueError: shapes that do not
        agree (grad_output must be input.shape[:-1] + (Fout,)), a grad_weight or grad_bias not C-contiguous
        or read-only.
    """
    input = check_array(input, "input", min_ndim=1)
    dt = input.dtype
    weight = check_array(weight, "weight", ndim=2, dtype=dt)
    grad_output = check_array(grad_output, "grad_output", dtype=dt)
    grad_weight = check_array(grad_weight, "grad_weight", ndim=2, dtype=dt, written=True)
    if grad_bias is not None:
        grad_bias = check_array(grad_bias, "grad_bias", ndim=1, dtype=dt, written=True)
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input: last dimension must be weight's in_features {weight.shape[1]}, got input "
                         f"{input.shape} and weight {weight.shape}")
    want = input.shape[:-1] + (weight.shape[0],)
    if grad_output.shape != want:
        raise ValueError(f"grad_output: expected shape {want} (input's batch, weight's out_features), got "
                         f"{grad_output.shape}")
    for name, g, shape in (("grad_weight", grad_weight, weight.shape),
                           ("grad_bias", grad_bias, (weight.shape[0],))):
        if g is None:
            continue
        if g.shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {g.shape}")
        if not g.flags.c_contiguous or not g.flags.writeable:
            raise ValueError(f"{name}: expected a C-contiguous, writeable array (written in place)")
    return _linear_backward(grad_output, input, weight, grad_weight, grad_bias,
                            check_bool(need_input_grad, "need_input_grad"))


def _linear_backward(grad_output, input, weight, grad_weight, grad_bias=None, need_input_grad=True):
    """``linear_backward`` without the checks, for layers that have made them."""
    x2 = np.ascontiguousarray(input).reshape(-1, input.shape[-1])
    dy = np.ascontiguousarray(grad_output).reshape(x2.shape[0], weight.shape[0])
    dx = _zeros(x2.shape, x2.dtype) if need_input_grad else None
    _core.linear_backward(dx, grad_weight, grad_bias, dy, x2, np.ascontiguousarray(weight))
    return None if dx is None else dx.reshape(input.shape)


# --------------------------------------------------------------------------------------------- training pieces
def dropout(input, p=0.5, training=True, *, seed=None):
    """Zero each element with probability ``p`` and scale the rest by 1 / (1 - p), as
    ``torch.nn.functional.dropout`` (Srivastava et al., 2014).

    Args:
        input (ndarray): any shape, float32, float64, float16 or bfloat16.
        p (float): drop probability in [0, 1). Default: 0.5.
        training (bool): apply dropout; when False the input is returned as is. Default: True.
        seed (int, optional): the mask is ``dropout_mask(input.shape, p, seed)``; None draws a seed from
            attnpp's global generator (then use ``attnpp.nn.Dropout``, which keeps it for the backward).

    Returns:
        ndarray of the input's shape and dtype.

    Raises:
        TypeError: a non-float input, a non-number p, training not a bool. ValueError: p outside [0, 1).
    """
    input = check_array(input, "input")
    p = check_probability(p, "p")
    training = check_bool(training, "training")
    seed = check_seed(seed, used=training and p > 0)
    if not training or p == 0.0:
        return input
    out = _empty(input.shape, input.dtype)
    _core.dropout_forward(out, np.ascontiguousarray(input), p, seed)
    return out


def dropout_backward(grad_output, p, seed):
    """Gradient of ``dropout`` for the same ``p`` and ``seed``: grad_output * mask / (1 - p).

    Raises:
        TypeError: a non-float grad_output, a non-number p, a seed not an int. ValueError: p outside [0, 1), no
        seed (None) with p > 0: the forward's seed is needed.
    """
    grad_output = check_array(grad_output, "grad_output")
    p = check_probability(p, "p")
    if seed is None and p > 0:
        raise ValueError("seed: dropout_backward with p > 0 needs the seed given to the forward, got None")
    seed = check_seed(seed, used=p > 0)
    grad = _zeros(grad_output.shape, grad_output.dtype)
    if p == 0.0:
        return grad + grad_output
    _core.dropout_backward(grad, np.ascontiguousarray(grad_output), p, seed)
    return grad


def embedding(input, weight):
    """``weight[input]``, as ``torch.nn.functional.embedding``.

    Args:
        input (ndarray): integer indices of any shape (*), each in [0, V).
        weight (ndarray): (V, E), float32, float64, float16 or bfloat16.

    Returns:
        ndarray (*, E).

    Raises:
        TypeError: non-integer indices or a non-float weight. ValueError: a weight that is not 2-D. IndexError: an
        index outside [0, V).
    """
    weight = check_array(weight, "weight", ndim=2)
    index = check_index(input, "input", weight.shape[0])
    out = np.empty(index.shape + (weight.shape[1],), weight.dtype)
    _core.embedding_forward(out.reshape(-1, weight.shape[1]), index, np.ascontiguousarray(weight))
    return out


def embedding_backward(grad_output, input, grad_weight):
    """Accumulate (+=) the gradient of ``embedding`` into ``grad_weight`` (V, E) (rows of repeated indices add).

    Args:
        grad_output (ndarray): (*, E). input (ndarray): the forward's indices (*). grad_weight (ndarray): (V, E),
            C-contiguous, written in place.

    Raises:
        TypeError: non-integer indices, a grad_output or grad_weight not a float ndarray, or of different dtypes.
        ValueError: grad_output not of shape input.shape + (E,), grad_weight not 2-D, C-contiguous and
        writeable. IndexError: an index outside [0, V).
    """
    grad_weight = check_array(grad_weight, "grad_weight", ndim=2, written=True)
    grad_output = check_array(grad_output, "grad_output", dtype=grad_weight.dtype)
    if not grad_weight.flags.c_contiguous or not grad_weight.flags.writeable:
        raise ValueError("grad_weight: expected a C-contiguous, writeable array (written in place)")
    index = check_index(input, "input", grad_weight.shape[0])
    E = grad_weight.shape[1]
    if grad_output.shape != index.shape + (E,):
        raise ValueError(f"grad_output: expected shape {index.shape + (E,)} (input's shape, E), got "
                         f"{grad_output.shape}")
    _core.embedding_backward(grad_weight, np.ascontiguousarray(grad_output).reshape(-1, E), index)


def _cross_entropy_args(input, target, ignore_index, reduction):
    input = check_array(input, "input", ndim=(1, 2))
    check_reduction(reduction)
    check_ignore_index(ignore_index)
    logits = input if input.ndim == 2 else input[None]
    N, C = logits.shape
    target = check_index(target, "target", C, allowed=ignore_index)
    if target.shape != ((N,) if input.ndim == 2 else ()):
        raise ValueError(f"target: expected shape {(N,) if input.ndim == 2 else ()} for input {input.shape}, "
                         f"got {target.shape}")
    return np.ascontiguousarray(logits), target.reshape(N)


def cross_entropy_forward(input, target, ignore_index=-100, reduction="mean"):
    """``cross_entropy`` that also returns what its backward needs.

    Returns:
        (loss, stats): the loss as ``cross_entropy`` gives it, and stats (N, 2), each row's maximum logit and
        log-sum-exp of (logits - maximum), so that logsumexp = stats[:, 0] + stats[:, 1] (float32 for
        half-precision logits). Pass stats to ``cross_entropy_backward``.
    """
    logits, tgt = _cross_entropy_args(input, target, ignore_index, reduction)
    acc = compute_dtype(logits.dtype)  # (half-precision logits: losses, statistics and reduction in float32)
    losses = np.empty(tgt.shape, acc)
    stats = np.empty(tgt.shape + (2,), acc)
    _core.cross_entropy_forward(losses, stats, logits, tgt, int(ignore_index))
    if reduction == "none":
        loss = losses if input.ndim == 2 else losses.reshape(())
    elif reduction == "sum":
        loss = losses.sum(dtype=acc)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            loss = losses.sum(dtype=acc) / acc.type((tgt != ignore_index).sum())
    return np.asarray(loss, dtype=logits.dtype), stats


def cross_entropy(input, target, ignore_index=-100, reduction="mean"):
    """Cross-entropy of logits against class indices, as ``torch.nn.functional.cross_entropy``.

    ``loss_i = logsumexp(input[i]) - input[i, target[i]]``, then the mean over the rows whose target is not
    ``ignore_index`` (NaN when there are none, like PyTorch), the sum, or no reduction. The logits are read in
    place (C-contiguous input is not copied); each row's sum of exponentials is accumulated in double, so a
    confident float32 row over 50,257 classes keeps its small loss.

    Args:
        input (ndarray): (N, C) logits (or (C,) for one row), float32, float64, float16 or bfloat16 (half
            precision: read into float32, the losses and their reduction in float32, rounded once).
        target (ndarray): (N,) (or ()) integer class indices in [0, C) or equal to ``ignore_index``.
        ignore_index (int): target value that contributes neither loss nor gradient. Default: -100.
        reduction (str): ``"mean"`` | ``"sum"`` | ``"none"``. Default: ``"mean"``.

    Returns:
        ndarray: a 0-d array (mean, sum) or (N,) losses (none), of the input's dtype.

    Raises:
        TypeError: non-float input, non-integer target, ignore_index not an int. ValueError: shapes that do not
        agree, an unknown reduction. IndexError: a target outside [0, C) other than ignore_index.
    """
    return cross_entropy_forward(input, target, ignore_index, reduction)[0]


def cross_entropy_backward(grad_output, input, target, stats, ignore_index=-100, reduction="mean"):
    """Gradient of ``cross_entropy`` with respect to ``input``: ``(softmax(input) - onehot(target)) * w`` with
    w = grad_output / (number of rows not ignored) for the mean, grad_output for the sum, grad_output[i] for
    none; 0 on ignored rows. ``stats`` (N, 2) is what ``cross_entropy_forward`` returned. Writes one new array of
    the input's shape (no other copy of the logits).

    Args:
        grad_output (float or ndarray): the gradient of the loss: a number or a 0-d array for "mean" and "sum",
            an array of the loss's shape for "none"; arrays of the input's dtype.

    Raises:
        as ``cross_entropy``; and TypeError/ValueError: a grad_output or stats of another type, dtype or shape
        than the loss's and (N, 2).
    """
    logits, tgt = _cross_entropy_args(input, target, ignore_index, reduction)
    check_loss_grad(grad_output, logits.dtype, (tgt.shape if input.ndim == 2 else ()) if reduction == "none"
                    else ())
    stats = check_array(stats, "stats", dtype=compute_dtype(logits.dtype))
    if stats.shape != tgt.shape + (2,):
        raise ValueError(f"stats: expected shape {tgt.shape + (2,)} (N, 2), got {stats.shape}")
    kept = tgt != ignore_index
    g = np.asarray(grad_output, dtype=compute_dtype(logits.dtype))
    if reduction == "none":
        g = g.reshape(tgt.shape)
    elif reduction == "mean":
        g = g / max(kept.sum(), 1)
    row_weight = np.where(kept, g, 0)  # exactly 0 on ignored rows, even for a NaN grad_output
    grad = _empty(logits.shape, logits.dtype)
    _core.cross_entropy_backward(grad, np.ascontiguousarray(row_weight, dtype=compute_dtype(logits.dtype)),
                                 np.ascontiguousarray(stats), logits, tgt)
    return grad.reshape(input.shape)

# ------------------------------------------------------------------------------ fused linear + cross-entropy
class LinearCrossEntropyForward(NamedTuple):
    """What ``linear_cross_entropy_forward`` returns, to pass to its backward.

    Attributes:
        loss (ndarray): as ``linear_cross_entropy`` gives it.
        logsumexp (ndarray): (*,) the target's shape, each row's log-sum-exp of its logits (float32 for half
            precision).
        grads (tuple or None): (grad_input, grad_weight, grad_bias or None), the gradients of ``loss`` itself
            (a grad_output of 1), computed in the forward for the "mean" and "sum" reductions; None for "none" or
            ``compute_grads=False``.
    """
    loss: np.ndarray
    logsumexp: np.ndarray
    grads: Optional[tuple]


def _linear_cross_entropy_args(input, weight, target, bias, ignore_index, reduction, label_smoothing):
    """The checked arguments: input (N, E) and target (N,) flattened, C-contiguous weight and bias, the target's
    shape, label_smoothing as a float."""
    input = check_array(input, "input", min_ndim=1)
    weight = check_array(weight, "weight", ndim=2, dtype=input.dtype)
    E, V = input.shape[-1], weight.shape[0]
    if weight.shape[1] != E or V == 0:
        raise ValueError(f"weight: expected (V, E) with V >= 1 and E = {E}, the input's last dimension; got weight "
                         f"{weight.shape} for input {input.shape}")
    if bias is not None:
        bias = check_array(bias, "bias", ndim=1, dtype=input.dtype)
        if bias.shape != (V,):
            raise ValueError(f"bias: expected shape ({V},) (V, the weight's rows), got {bias.shape}")
        bias = np.ascontiguousarray(bias)
    check_reduction(reduction)
    check_ignore_index(ignore_index)
    label_smoothing = check_label_smoothing(label_smoothing)
    tgt = check_index(target, "target", V, allowed=ignore_index)
    if tgt.shape != input.shape[:-1]:
        raise ValueError(f"target: expected shape {input.shape[:-1]} (the input's without E), got {tgt.shape} for "
                         f"input {input.shape}")
    x = np.ascontiguousarray(input).reshape(-1, E)
    return x, np.ascontiguousarray(weight), bias, tgt.reshape(-1), tgt.shape, label_smoothing


def linear_cross_entropy_forward(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, compute_grads=True):
    """``linear_cross_entropy`` that also returns what its backward needs, and, for a scalar loss, the gradients.

    For the "mean" and "sum" reductions the gradient of the logits is known in the forward (dloss/dloss_i is
    1 / rows kept, or 1), so with ``compute_grads`` the forward computes the gradients of input, weight and bias
    in the same pass over the chunks (Liger Kernel's approach): the backward only multiplies them by
    grad_output. Without (or for "none"), the backward recomputes each chunk's logits.

    Args: those of ``linear_cross_entropy``, and
        compute_grads (bool): compute the gradients in the forward (scalar reductions only). Default: True.

    Returns:
        ``LinearCrossEntropyForward(loss, logsumexp, grads)``, a named tuple.
    """
    x, w, b, tgt, shape, eps = _linear_cross_entropy_args(input, weight, target, bias, ignore_index, reduction,
                                                          label_smoothing)
    check_bool(compute_grads, "compute_grads")
    (N, E), V, dt = x.shape, w.shape[0], x.dtype
    acc = compute_dtype(dt)  # (half precision: losses, log-sum-exp and reduction in float32)
    losses, lse = np.empty(N, acc), np.empty(N, acc)
    kept = tgt != ignore_index
    count = int(kept.sum())
    grads = row_weight = None
    if compute_grads and reduction != "none":
        row_weight = np.where(kept, acc.type(1.0 / max(count, 1) if reduction == "mean" else 1.0), acc.type(0))
        grads = (_zeros((N, E), dt), _zeros((V, E), dt), None if b is None else _zeros((V,), dt))
    _core.linear_cross_entropy(losses, lse, *(grads or (None, None, None)), row_weight, x, w, b, tgt,
                               int(ignore_index), eps)
    if reduction == "none":
        loss = losses.reshape(shape)
    elif reduction == "sum":
        loss = losses.sum(dtype=acc)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            loss = losses.sum(dtype=acc) / acc.type(count)
    if grads is not None:
        grads = (grads[0].reshape(np.shape(input)),) + grads[1:]
    return LinearCrossEntropyForward(np.asarray(loss, dtype=dt), lse.reshape(shape), grads)


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0):
    """``cross_entropy(linear(input, weight, bias), target)`` fused, as ``torch.nn.functional.cross_entropy``
    of ``torch.nn.functional.linear``'s logits, without ever holding the (N, V) logits.

    The rows go through in chunks whose logits (rows x V, at most 50 MiB) are computed once: each chunk's
    log-sum-exp (its sum of exponentials in double), its losses and, for the gradients, the logits' gradient in
    place, which feeds the products of input's and weight's gradients; three matrix products in all, as the
    unfused pair's. Memory beyond the inputs and the gradients: one chunk, whatever N and V (the unfused pair
    holds the (N, V) logits and their gradient: 3.3 GB at N = 8,192, V = 50,257 in float32). Method: Wijmans et
    al., "Cut Your Losses in Large-Vocabulary Language Models" (2024); Liger Kernel's fused linear
    cross-entropy (Hsu et al., 2024).

    ``loss_i = logsumexp(z_i) - (1 - label_smoothing) z_i[target_i] - label_smoothing * mean_j z_ij`` with
    ``z = input @ weight.T + bias``, 0 where target_i is ``ignore_index``; then the mean over the rows not
    ignored (NaN when there are none, as PyTorch), the sum, or none.

    Args:
        input (ndarray): (*, E), float32, float64, float16 or bfloat16 (half precision: computed in float32 on
            float32 copies, the loss and log-sum-exp float32, each gradient rounded once).
        weight (ndarray): (V, E), the input's dtype (torch.nn.Linear's layout: the output projection's weight).
        target (ndarray): (*,) the input's shape without E, integer class indices in [0, V) or ``ignore_index``.
        bias (ndarray, optional): (V,), the input's dtype. Default: None.
        ignore_index (int): target value that contributes neither loss nor gradient. Default: -100.
        reduction (str): ``"mean"`` | ``"sum"`` | ``"none"``. Default: ``"mean"``.
        label_smoothing (float): in [0, 1], the share of the target's probability spread evenly over the V
            classes (Szegedy et al., 2016), as PyTorch's. Default: 0.0.

    Returns:
        ndarray: a 0-d array (mean, sum) or the losses of the target's shape (none), of the input's dtype.

    Raises:
        TypeError: non-float input, weight or bias of another dtype, a non-integer target, ignore_index not an
        int, label_smoothing not a number. ValueError: a weight whose width is not the input's last dimension, a
        bias not (V,), a target not of the input's shape without E, an unknown reduction, label_smoothing outside
        [0, 1]. IndexError: a target outside [0, V) other than ignore_index. All before any compute.
    """
    return linear_cross_entropy_forward(input, weight, target, bias, ignore_index=ignore_index,
                                        reduction=reduction, label_smoothing=label_smoothing,
                                        compute_grads=False).loss


def linear_cross_entropy_backward(grad_output, input, weight, target, logsumexp, bias=None, *, ignore_index=-100,
                                  reduction="mean", label_smoothing=0.0, grads=None):
    """Gradients of ``linear_cross_entropy``: (grad_input (*, E), grad_weight (V, E), grad_bias (V,) or None).

    Args:
        grad_output (float or ndarray): the gradient of the loss: a number or a 0-d array for "mean" and "sum",
            an array of the loss's shape for "none"; arrays of the input's dtype.
        input, weight, target, bias, ignore_index, reduction, label_smoothing: as given to the forward.
        logsumexp (ndarray): the forward's (``LinearCrossEntropyForward.logsumexp``).
        grads (tuple, optional): the forward's ``grads`` (scalar reductions): multiplied by grad_output in place
            and returned, no recompute. Default: None (each chunk's logits recomputed from logsumexp).

    Raises:
        as ``linear_cross_entropy``; and TypeError/ValueError: a grad_output, logsumexp or grads of another
        type, dtype or shape than the loss's, the target's and the forward's gradients'.
    """
    x, w, b, tgt, shape, eps = _linear_cross_entropy_args(input, weight, target, bias, ignore_index, reduction,
                                                          label_smoothing)
    dt, acc = x.dtype, compute_dtype(x.dtype)
    check_loss_grad(grad_output, dt, shape if reduction == "none" else ())
    g = np.asarray(grad_output, dtype=acc)
    if grads is not None:
        if reduction == "none":
            raise ValueError('grads: the forward computes them for the "mean" and "sum" reductions only')
        want = (np.shape(input), w.shape, None if b is None else b.shape)
        layout = lambda a: None if a is None else (a.shape, a.dtype) if isinstance(a, np.ndarray) else "?"
        if not isinstance(grads, tuple) or tuple(map(layout, grads)) != tuple(
                None if s is None else (s, dt) for s in want):
            raise ValueError(f"grads: expected the forward's (grad_input, grad_weight, grad_bias) of shapes {want} "
                             f"and dtype {dt}")
        if g != 1:  # (a loss's own gradient, 1, the common case: nothing to scale)
            for a in grads:
                if a is not None:
                    np.multiply(a, g.astype(a.dtype) if a.dtype in HALVES else g, out=a, casting="unsafe")
        return grads
    lse = check_array(logsumexp, "logsumexp", dtype=acc)
    if lse.shape != shape:
        raise ValueError(f"logsumexp: expected shape {shape} (the target's), got {lse.shape}")
    kept = tgt != ignore_index
    if reduction == "none":
        g = g.reshape(-1)
    elif reduction == "mean":
        g = g / max(int(kept.sum()), 1)
    row_weight = np.ascontiguousarray(np.where(kept, g, 0), dtype=acc)  # exactly 0 on ignored rows
    (N, E), V = x.shape, w.shape[0]
    out = (_zeros((N, E), dt), _zeros((V, E), dt), None if b is None else _zeros((V,), dt))
    _core.linear_cross_entropy(None, np.ascontiguousarray(lse, dtype=acc).reshape(-1), *out, row_weight, x, w, b,
                               tgt, int(ignore_index), eps)
    return (out[0].reshape(np.shape(input)),) + out[1:]



# ----------------------------------------------------------------------------------- rotary position embeddings
def rotary_tables(max_positions, rotary_dim, base=10000.0, dtype=np.float32):
    """The cos and sin tables of rotary position embeddings (RoPE), for ``rotary_embedding``.

    ``angle[p, d] = p * base ** (-2d / rotary_dim)`` for positions p < P = ``max_positions`` and d < R/2
    (R = ``rotary_dim``), computed in float64 and then cast to ``dtype`` (so float32 tables hold correctly
    rounded values even at large positions).

    Args:
        max_positions (int): P, the number of positions (table rows), >= 0.
        rotary_dim (int): R, the number of features rotated, even and >= 2 (<= the head width D).
        base (float): the base of the geometric sequence of frequencies, > 0. Default: 10000.0 (RoFormer, Llama).
        dtype: float32, float64, float16 or bfloat16. Default: np.float32.

    Returns:
        (cos, sin): two ndarrays (P, R/2) of ``dtype``.

    Raises:
        TypeError: max_positions or rotary_dim not an int, base not a number, another dtype. ValueError: a negative
        max_positions, an odd or non-positive rotary_dim, a base that is not finite and > 0.

    Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021).
    """
    max_positions = check_int(max_positions, "max_positions")
    rotary_dim = check_int(rotary_dim, "rotary_dim", minimum=1)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (features are rotated in pairs), got {rotary_dim}")
    if not is_real(base):
        raise TypeError(f"base: expected a float, got {type(base).__name__}")
    if not (math.isfinite(base) and base > 0):
        raise ValueError(f"base must be finite and > 0, got {base!r}")
    dtype = check_dtype(dtype)
    inv_freq = float(base) ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # (R/2,)
    angle = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq                     # (P, R/2)
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def _rotary_args(input, cos, sin, interleaved, position_offset, name):
    """Validated arguments of the rotary functions: input seen as (N, H, L, D) with its last dimension
    contiguous, contiguous cos and sin, the (N,) int64 offsets and interleaved as a bool."""
    input = check_array(input, name, min_ndim=2)
    dt = input.dtype
    cos = check_array(cos, "cos", ndim=2, dtype=dt)
    sin = check_array(sin, "sin", ndim=2, dtype=dt)
    interleaved = check_bool(interleaved, "interleaved")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape (P, R/2), got cos {cos.shape} and sin {sin.shape}")
    L, D = input.shape[-2:]
    P, R = cos.shape[0], 2 * cos.shape[1]
    if R > D:
        raise ValueError(f"cos, sin: rotary_dim R = 2 * cos.shape[-1] = {R} exceeds the head width D = {D} of "
                         f"{name} {input.shape}")
    batch = input.shape[:-3]
    H = input.shape[-3] if input.ndim >= 3 else 1
    N = math.prod(batch)
    offsets = position_offset
    if not isinstance(offsets, numbers.Integral):  # an array (or tensor) of offsets, or a 0-d one
        if not hasattr(offsets, "__dlpack__") and not hasattr(offsets, "__array__"):
            raise TypeError(f"position_offset: expected an int or an integer array of shape (B,), got "
                            f"{type(offsets).__name__}")
        offsets = as_ndarray(offsets, "position_offset")
        if offsets.dtype.kind not in "iu":
            raise TypeError(f"position_offset: expected an int or an integer array, got dtype {offsets.dtype}")
        if offsets.ndim == 0:
            offsets = offsets.item()
    if isinstance(offsets, numbers.Integral):
        offset = check_int(offsets, "position_offset")
        if offset + L > P:
            raise ValueError(f"cos, sin: {P} positions (P = cos.shape[0]) are too few for position_offset "
                             f"{offset} + L {L} = {offset + L}")
        offsets = np.full(N, offset, np.int64)
    else:
        if input.ndim != 4 or offsets.shape != batch:
            raise ValueError(f"position_offset: an array of offsets needs a 4-D {name} (B, H, L, D) and has shape "
                             f"(B,), got position_offset {offsets.shape} for {name} {input.shape}")
        if offsets.size:
            if (offsets < 0).any():
                raise ValueError(f"position_offset must be >= 0, got {int(offsets.min())}")
            if int(offsets.max()) + L > P:
                raise ValueError(f"cos, sin: {P} positions (P = cos.shape[0]) are too few for position_offset "
                                 f"{int(offsets.max())} + L {L} = {int(offsets.max()) + L}")
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    x4 = input.reshape(N, H, L, D)  # (a view where the strides allow, else a copy)
    if x4.size and ((D > 1 and x4.strides[-1] != x4.itemsize) or not x4.flags.aligned or
                    any(s % x4.itemsize for s in x4.strides)):
        x4 = np.ascontiguousarray(x4)
    return x4, np.ascontiguousarray(cos), np.ascontiguousarray(sin), offsets, interleaved


def rotary_embedding(input, cos, sin, *, interleaved=False, position_offset=0):
    """Rotary position embeddings (RoPE): rotate pairs of features by angles of the position.

    For the token at position p and each pair (a, b) of its first R features, with c = cos[p, d] and
    s = sin[p, d] for pair d: ``out[a] = x[a] c - x[b] s``, ``out[b] = x[b] c + x[a] s``; ``out[R:] = x[R:]``.
    Applied to the query and key before attention, it makes q . k depend on their positions' difference only.

    Args:
        input (ndarray): (B..., H, L, D), or (L, D) unbatched; float32, float64, float16 or bfloat16 (half
            precision: rotated in float32, rounded once). Row l of each (L, D) matrix is the token at position
            ``position_offset + l``.
        cos, sin (ndarray): (P, R/2), the input's dtype: cos and sin of the angle of position p and pair d
            (``rotary_tables`` makes them). R = 2 * cos.shape[-1] is the number of features rotated (rotary_dim),
            R <= D; features R.. pass through unchanged.
        interleaved (bool): the pairs rotated together: (2d, 2d + 1) if True (GPT-J); (d, d + R/2) if False
            (GPT-NeoX, Llama; Hugging Face's ``rotate_half``). Default: False.
        position_offset (int or ndarray): the position of row 0, >= 0: an int for every sequence, or an integer
            array (B,), one per sequence, for a 4-D input (B, H, L, D) (KV-cache decoding, as FlashAttention's
            ``seqlen_offsets``). P >= position_offset + L. Default: 0.

    Returns:
        ndarray of input's shape and dtype (a new array).

    Raises:
        TypeError: a non-float input, cos or sin of another dtype than the input's, interleaved not a bool,
            position_offset neither an int nor an integer array.
        ValueError: cos and sin of different shapes or not 2-D, R > D, P < position_offset + L, a negative
            position_offset, an offset array not of shape (B,) or given with an input that is not 4-D.

    Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021); the arguments
    follow FlashAttention's ``apply_rotary_emb`` (``flash_attn.layers.rotary``).
    """
    x4, cos, sin, offsets, interleaved = _rotary_args(input, cos, sin, interleaved, position_offset, "input")
    out = _empty(x4.shape, x4.dtype)
    _core.rotary_forward(out, x4, cos, sin, offsets, interleaved)
    return out.reshape(input.shape)


def rotary_embedding_backward(grad_output, cos, sin, *, interleaved=False, position_offset=0):
    """Gradient of ``rotary_embedding`` with respect to its input.

    The rotation's transpose: grad_output rotated by the opposite angles (sin -> -sin); the features R.. pass
    through. Needs nothing saved by the forward.

    Args:
        grad_output (ndarray): (B..., H, L, D), or (L, D) unbatched, float32, float64, float16 or bfloat16: the
            gradient of the loss with respect to the forward's output.
        cos, sin (ndarray): (P, R/2), grad_output's dtype: the tables given to ``rotary_embedding``.
        interleaved (bool): as given to ``rotary_embedding``: pairs (2d, 2d + 1) if True (GPT-J), (d, d + R/2)
            if False (GPT-NeoX, Llama). Default: False.
        position_offset (int or ndarray): as given to ``rotary_embedding``: the position of row 0, an int or an
            integer array (B,) for a 4-D grad_output (B, H, L, D). Default: 0.

    Returns:
        grad_input (ndarray): grad_output's shape and dtype.

    Raises:
        TypeError: a non-float grad_output, cos or sin of another dtype than grad_output's, interleaved not a
            bool, position_offset neither an int nor an integer array.
        ValueError: cos and sin of different shapes or not 2-D, R > D, P < position_offset + L, a negative
            position_offset, an offset array not of shape (B,) or given with a grad_output that is not 4-D.

    Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021); the arguments
    follow FlashAttention's ``apply_rotary_emb`` (``flash_attn.layers.rotary``).
    """
    g4, cos, sin, offsets, interleaved = _rotary_args(grad_output, cos, sin, interleaved, position_offset,
                                                      "grad_output")
    grad = _zeros(g4.shape, g4.dtype)
    _core.rotary_backward(grad, g4, cos, sin, offsets, interleaved)
    return grad.reshape(grad_output.shape)
