"""The core's arguments of an attention call, shared by every attention function and layer: the score scale, the
causal mode, the masks, the variants' options (``attention_params``) and the ALiBi slopes.

Shape letters: B... batch dimensions, H heads (Hq of the query), L query length, S key/value length, D head width.
"""
import math

import numpy as np

from .. import _core
from .._checks import (as_ndarray, check_alibi_slopes, check_array, check_choice, check_dtype, check_int,
                       check_scale, check_sinks, check_softcap, check_window, compute_dtype)

_CAUSAL = {"top_left": _core.Causal.top_left, "bottom_right": _core.Causal.bottom_right}
ALIGNMENTS = tuple(_CAUSAL)
_BFLOAT16_NUMERICS = _core.Bfloat16Numerics.pytorch  # the setting of attnpp.set_bfloat16_attention


def score_scale(scale, D):
    """The factor on q k^T: ``scale`` (checked), 1 / sqrt(D) by default; 1 when D = 0, where every q k^T is the
    empty sum 0 whatever the scale (PyTorch: uniform weights, not NaN)."""
    scale = check_scale(scale)
    return 1.0 if D == 0 else (1.0 / math.sqrt(D) if scale is None else scale)


def causal_mode(is_causal, causal_alignment):
    """The core's ``Causal`` value (none, top_left, bottom_right); ValueError for an unknown alignment."""
    alignment = check_choice(causal_alignment, "causal_alignment", ALIGNMENTS)
    return _CAUSAL[alignment] if is_causal else _core.Causal.none


def plain_causal_mode(is_causal, causal_alignment):
    """``causal_mode`` of a bool ``is_causal`` and a known alignment, without raising: None for any other value
    (the plain call's test; the general path then raises ``causal_mode``'s and ``check_bool``'s errors)."""
    if type(is_causal) is not bool or type(causal_alignment) is not str:
        return None
    causal = _CAUSAL.get(causal_alignment)
    return None if causal is None else causal if is_causal else _core.Causal.none


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


def check_saved(dtype, grad_output, output, logsumexp):
    """An attention backward's grad_output, output and logsumexp, each given as (array, expected shape): arrays of
    ``dtype`` (logsumexp of its compute dtype) and of those shapes, else TypeError/ValueError naming them."""
    arrays = []
    for name, (arr, shape) in (("grad_output", grad_output), ("output", output), ("logsumexp", logsumexp)):
        arrays.append(check_array(arr, name, dtype=compute_dtype(dtype) if name == "logsumexp" else dtype))
        if arrays[-1].shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {arrays[-1].shape}")
    return arrays
