"""Rotary position embeddings (RoPE): the tables, the rotation and its backward.

Shape letters: B... batch dimensions, H heads, L sequence length, D head width, P positions, R rotary_dim.
"""
import functools
import math
import numbers

import numpy as np

from .. import _core
from .._checks import (as_ndarray, check_array, check_bool, check_dtype, check_int, check_rotary_base,
                       check_rotary_dim)
from .._pool import empty as _empty, zeros as _zeros

ROTARY_BASE = 10000.0  # the default base of RoPE's frequencies (RoFormer, Llama's rope_theta)


def rotary_tables(max_positions, rotary_dim, base=ROTARY_BASE, dtype=np.float32):
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
    rotary_dim = check_rotary_dim(rotary_dim)
    base = check_rotary_base(base, "base")
    dtype = check_dtype(dtype)
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # (R/2,)
    angle = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq                     # (P, R/2)
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)



@functools.lru_cache(maxsize=16)
def _shared_tables(size, rotary_dim, base, dtype):
    cos, sin = rotary_tables(size, rotary_dim, base, dtype)
    cos.flags.writeable = sin.flags.writeable = False  # (shared by every caller)
    return cos, sin


def cached_rotary_tables(positions, rotary_dim, base, dtype):
    """``rotary_tables`` for at least ``positions`` positions (rounded up to a power of two >= 64), computed once
    per (size, rotary_dim, base, dtype) and shared read-only: the tables of layers and of ``attnpp.torch``'s
    operator, so that decoding token by token computes them a few times only."""
    return _shared_tables(max(64, 1 << (int(positions) - 1).bit_length()), rotary_dim, float(base), np.dtype(dtype))


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
