"""attnpp inside PyTorch: attention on CPU tensors, with torch autograd running attnpp's hand-written backward.

``import attnpp.torch`` (``import attnpp`` alone never imports torch). Each operation is a
``torch.autograd.Function`` whose forward and backward are attnpp's C++ (``attnpp.functional``); the tensors'
memory is read as NumPy views (no copy, non-contiguous tensors included; bfloat16 through ``ml_dtypes.bfloat16``)
and the results are wrapped without a copy either. Double backward is not supported (the backward is not itself
differentiable).

- ``scaled_dot_product_attention``: as ``torch.nn.functional.scaled_dot_product_attention``.
- ``linear`` and ``Linear``: as ``torch.nn.functional.linear`` and ``torch.nn.Linear``.
- ``linear_cross_entropy``: ``cross_entropy(linear(...))`` fused, without the (N, V) logits.
- ``MultiheadAttention``: as ``torch.nn.MultiheadAttention`` (its subclass: same parameters, state dict and
  initialisation), attnpp's compute.
- ``Attention``: ``attnpp.nn.Attention`` with torch parameters.
- ``from_numpy``, ``to_numpy``: ``torch.from_numpy`` and ``Tensor.numpy`` (no copy) for every dtype attnpp takes,
  bfloat16 included (NumPy's bfloat16 is ``ml_dtypes.bfloat16``).

Shape letters: B... batch dimensions, H heads (Hq of the query, Hk of key and value), L query length, S key/value
length, D query/key head width, Dv value head width, E embedding width.

Tensors: float32, float64, float16 or bfloat16 (masks may be bool), on the CPU; half precision is computed and
accumulated in float32 and rounded once per output, as PyTorch's CPU kernels do, and the log-sum-exp is float32.
Masks follow PyTorch's conventions, which differ between functions: in ``scaled_dot_product_attention`` a bool
``attn_mask`` is True where a key *takes part*; in ``MultiheadAttention`` and ``Attention`` a bool mask is True
where a key is *masked out*. Float masks are added to the scores everywhere; masks get no gradient.

Dropout: the seed of each call with dropout is drawn from torch's default CPU generator (one
``torch.randint`` per call), so ``torch.manual_seed(s)`` makes a run reproducible, whatever the thread count;
the backward reuses the forward's mask. The mask of seed ``seed`` is ``attnpp.functional.dropout_mask``'s.

Raises (every function and module): ValueError for a tensor not on the CPU ("attnpp runs on the CPU: move the
tensors with .cpu()"); TypeError for another dtype than float32, float64, float16 or bfloat16, mixed dtypes, or
a non-tensor; ValueError/TypeError from ``attnpp.functional`` for
shapes, masks and arguments that do not agree.

Method: Vaswani et al., "Attention Is All You Need" (2017); computed as FlashAttention-2 (Dao, 2023): only the
output and the log-sum-exp are saved for the backward, memory grows with L, not L*S.
"""
import math

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .. import functional as AF
from .._checks import BFLOAT16, bfloat16_tensor_as_ndarray, check_attention_layer_shapes, check_probability
from ..nn.attention import attention_config_of, rotary_tables, variant_args

__all__ = ["scaled_dot_product_attention", "linear", "linear_cross_entropy", "Linear", "MultiheadAttention",
           "Attention", "from_numpy", "to_numpy"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_FLOAT_NAMES = "float32, float64, float16 or bfloat16"


# ------------------------------------------------------------------------------------------------- tensors
def _check_tensor(t, name, mask=False):
    """``t`` if it is a CPU tensor of a float dtype attnpp computes in (or bool for a ``mask``), else
    ValueError/TypeError."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:  # (not t.device.type: a device object per call, ~5 us of a decoding step's attention)
        raise ValueError(f"{name}: attnpp runs on the CPU: move the tensors with .cpu() (got device {t.device})")
    if t.dtype not in _FLOATS and not (mask and t.dtype == torch.bool):
        raise TypeError(f"{name}: attnpp computes in {_FLOAT_NAMES}{' (masks may be bool)' if mask else ''}, "
                        f"got {t.dtype}")
    return t


def _check_dtype(dtype):
    """A module's dtype: torch's default for None; TypeError unless float32, float64, float16 or bfloat16."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _FLOATS:
        raise TypeError(f"dtype: attnpp computes in {_FLOAT_NAMES}, got {dtype}")
    return dtype


def to_numpy(tensor):
    """The NumPy array sharing the memory of a CPU tensor (detached), as ``tensor.detach().numpy()``, which also
    takes torch.bfloat16 (as an array of ``ml_dtypes.bfloat16``, which NumPy lacks). None stays None."""
    if tensor is None:
        return None
    if tensor.requires_grad:  # (detach() makes a new tensor object: a few microseconds a call where it is not needed)
        tensor = tensor.detach()
    return bfloat16_tensor_as_ndarray(tensor) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def from_numpy(array):
    """The tensor sharing the memory of an ndarray, as ``torch.from_numpy``, which also takes arrays of
    ``ml_dtypes.bfloat16`` (as torch.bfloat16)."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _draw_seed():
    """A dropout seed from torch's default generator, so that ``torch.manual_seed`` fixes it."""
    return int(torch.randint(0, 2**63 - 1, ()))


# ---------------------------------------------------------------------------------------------- functions
class _LinearFunction(torch.autograd.Function):
    """``attnpp.functional.linear`` and ``linear_backward``."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight, bias)
        return from_numpy(AF.linear(to_numpy(input), to_numpy(weight), to_numpy(bias)))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad
        # linear_backward accumulates into these (the weight's is computed even when not needed)
        grad_weight = torch.zeros(weight.shape, dtype=weight.dtype)
        grad_bias = torch.zeros(bias.shape, dtype=bias.dtype) if need_bias else None
        grad_input = AF.linear_backward(to_numpy(grad_output), to_numpy(input), to_numpy(weight), to_numpy(grad_weight),
                                        to_numpy(grad_bias), need_input_grad=need_input)
        return (None if grad_input is None else from_numpy(grad_input),
                grad_weight if need_weight else None, grad_bias)


class _AttentionFunction(torch.autograd.Function):
    """``attnpp.functional.scaled_dot_product_attention_forward`` and ``_backward``; returns (output, logsumexp),
    the log-sum-exp without gradient. ``sinks`` (a tensor or None) gets a gradient; ``options`` holds the other
    variants (window, alibi_slopes as an array, softcap), which get none."""

    @staticmethod
    def compute(query, key, value, attn_mask, sinks, args, seed, causal_alignment, options):
        """The forward without autograd (also the no-gradient path): the output tensor and the log-sum-exp
        array."""
        output, lse, _ = AF.scaled_dot_product_attention_forward(
            *map(to_numpy, (query, key, value, attn_mask)), *args, seed=seed, causal_alignment=causal_alignment,
            sinks=to_numpy(sinks), **options)
        return from_numpy(output), lse

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, sinks, dropout_p, is_causal, scale, enable_gqa, seed,
                causal_alignment, options):
        args = (dropout_p, is_causal, scale, enable_gqa)
        output, lse = _AttentionFunction.compute(query, key, value, attn_mask, sinks, args, seed, causal_alignment,
                                                 options)
        lse = from_numpy(lse)
        ctx.save_for_backward(query, key, value, attn_mask, sinks, output, lse)
        ctx.args, ctx.seed, ctx.causal_alignment, ctx.options = args, seed, causal_alignment, options
        ctx.mark_non_differentiable(lse)
        return output, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, _grad_lse):
        query, key, value, attn_mask, sinks, output, lse = ctx.saved_tensors
        nones = (None,) * 7  # the non-tensor arguments
        needs = ctx.needs_input_grad
        if not (any(needs[:3]) or needs[4]):
            return (None,) * 5 + nones
        grads = AF.scaled_dot_product_attention_backward(
            *map(to_numpy, (grad_output, query, key, value, output, lse, attn_mask)), *ctx.args, seed=ctx.seed,
            causal_alignment=ctx.causal_alignment, sinks=to_numpy(sinks), **ctx.options)
        grad_sinks = from_numpy(grads[3]) if needs[4] else None
        grads = [from_numpy(g) if need else None for g, need in zip(grads[:3], needs[:3])]
        return (*grads, None, grad_sinks) + nones


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """``attnpp.functional.linear_cross_entropy_forward`` and ``_backward``: for the scalar reductions the forward
    computes the gradients (when one is needed) and the backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, options):
        needed = any(ctx.needs_input_grad[i] for i in (0, 1, 3))
        out = AF.linear_cross_entropy_forward(
            *map(to_numpy, (input, weight, target, bias)),
            compute_grads=needed and options["reduction"] != "none", **options)
        ctx.save_for_backward(input, weight, target, bias)
        ctx.logsumexp, ctx.grads, ctx.options = out.logsumexp, out.grads, options
        return from_numpy(out.loss)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, target, bias = ctx.saved_tensors
        grads = AF.linear_cross_entropy_backward(to_numpy(grad_output), *map(to_numpy, (input, weight, target)),
                                                 ctx.logsumexp, to_numpy(bias), grads=ctx.grads, **ctx.options)
        ctx.grads = None  # (scaled in place: a second backward would scale them again)
        need = ctx.needs_input_grad
        grad_input, grad_weight, grad_bias = (from_numpy(g) if g is not None and need[i] else None
                                              for g, i in zip(grads, (0, 1, 3)))
        return grad_input, grad_weight, None, grad_bias, None


class _RotaryFunction(torch.autograd.Function):
    """``attnpp.functional.rotary_embedding`` of (B, H, T, d) heads at positions 0 .. T - 1 and its backward."""

    @staticmethod
    def forward(ctx, input, cos, sin, interleaved):
        ctx.tables, ctx.interleaved = (cos, sin), interleaved
        return from_numpy(AF.rotary_embedding(to_numpy(input), cos, sin, interleaved=interleaved))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad = AF.rotary_embedding_backward(to_numpy(grad_output), *ctx.tables, interleaved=ctx.interleaved)
        return from_numpy(grad), None, None, None


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment,
               need_weights=False, window=None, alibi_slopes=None, softcap=None, sinks=None, key_padding_mask=None):
    """The checked attention call of every public entry: (output, weights or None, the dropout seed or None)."""
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, name)
    if attn_mask is not None:
        _check_tensor(attn_mask, "attn_mask", mask=True)
    if sinks is not None:
        _check_tensor(sinks, "sinks")
    if isinstance(alibi_slopes, torch.Tensor):  # (slopes are constants: no gradient)
        alibi_slopes = to_numpy(_check_tensor(alibi_slopes, "alibi_slopes"))
    if key_padding_mask is not None:  # (a constant too)
        key_padding_mask = to_numpy(_check_tensor(key_padding_mask, "key_padding_mask", mask=True))
    options = dict(window=window, alibi_slopes=alibi_slopes, softcap=softcap, key_padding_mask=key_padding_mask)
    if check_probability(dropout_p, "dropout_p") > 0 and seed is None:
        seed = _draw_seed()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
        output, lse = _AttentionFunction.apply(query, key, value, attn_mask, sinks, dropout_p, is_causal, scale,
                                               enable_gqa, seed, causal_alignment, options)
        lse = to_numpy(lse)
    else:  # nothing to differentiate (no_grad, inference): no autograd node, ~10 us less a call
        output, lse = _AttentionFunction.compute(query, key, value, attn_mask, sinks,
                                                 (dropout_p, is_causal, scale, enable_gqa), seed, causal_alignment,
                                                 options)
    weights = None
    if need_weights:
        weights = from_numpy(AF.scaled_dot_product_attention_weights(
            to_numpy(query), to_numpy(key), to_numpy(attn_mask), dropout_p, is_causal, scale, enable_gqa, seed=seed,
            causal_alignment=causal_alignment, logsumexp=lse, sinks=to_numpy(sinks), **options))
    return output, weights, seed if dropout_p > 0 else None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, seed=None, causal_alignment="top_left", window=None,
                                 alibi_slopes=None, softcap=None, sinks=None, key_padding_mask=None):
    """Scaled dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``, differentiable
    in ``query``, ``key``, ``value`` (and ``sinks``) through attnpp's backward.

    ``softmax(scale * query key^T + attn_mask) value``, with dropout on the weights.

    Args:
        query (Tensor): (B..., Hq, L, D), or (L, D) unbatched; float32, float64, float16 or bfloat16, on the CPU.
        key (Tensor): (B..., Hk, S, D), same dtype. B... broadcasts against the query's.
        value (Tensor): (B..., Hv, S, Dv), same dtype; Hv = Hk unless ``enable_gqa``.
        attn_mask (Tensor, optional): broadcastable to (B..., Hq, L, S). Bool: True where a key *takes part*
            (False masks it out). Float (the query's dtype): added to the scores. Gets no gradient. Default: None.
        dropout_p (float): probability of zeroing each attention weight, in [0, 1); the kept ones are scaled by
            1 / (1 - dropout_p). Applied whenever > 0 (no training flag, as PyTorch's). Default: 0.0.
        is_causal (bool): query i sees keys j <= i (top-left when L != S, as PyTorch). Needs
            ``attn_mask=None``. Default: False.
        scale (float, optional): factor on q k^T. Default: 1 / sqrt(D).
        enable_gqa (bool): grouped-query attention: Hq a multiple of Hk and Hv, query head h uses key head
            h // (Hq // Hk), as PyTorch. Default: False.
        seed (int, optional, keyword-only, attnpp's): the dropout seed, mask
            ``attnpp.functional.dropout_mask((*B, Hq, L, S), dropout_p, seed)``. Default: None, one drawn from
            torch's default generator (``torch.manual_seed`` makes it reproducible).
        causal_alignment (str, keyword-only, attnpp's): ``"top_left"`` (default, PyTorch's) or
            ``"bottom_right"`` (query i sees keys j <= i + S - L).
        window (tuple of 2 ints, optional, keyword-only): sliding window ``(left, right)``, -1 unbounded,
            positions aligned bottom-right (FlashAttention's ``window_size``). Default: None.
        alibi_slopes (Tensor or ndarray, optional, keyword-only): ALiBi slopes (Hq,) or (B..., Hq), any float
            dtype, on the CPU; they get no gradient (constants, as in FlashAttention). Default: None.
        softcap (float, optional, keyword-only): logit soft-capping, ``softcap * tanh(scores / softcap)``.
            Default: None.
        sinks (Tensor, optional, keyword-only): attention sinks (Hq,), the query's dtype: a logit per head in
            every softmax's denominator, without value; differentiable (its gradient flows through autograd like
            the inputs'). Default: None.
        key_padding_mask (Tensor, optional, keyword-only, attnpp's): (B..., S) or (S,), bool (True where a key is
            *masked out*, as ``torch.nn.MultiheadAttention``'s) or float (added to every query's scores); unlike
            ``attn_mask`` it combines with ``is_causal``, without an (L, S) tensor. Default: None.
        (The definitions and sources of the variants: ``attnpp.functional.scaled_dot_product_attention``.)

    Returns:
        Tensor (B..., Hq, L, Dv), or (L, Dv) unbatched. A query whose keys are all masked gives 0 (as
        PyTorch >= 2.5), with gradient 0.

    Raises:
        ValueError: a tensor not on the CPU; shapes that do not agree or broadcast, dropout_p outside [0, 1),
        attn_mask with is_causal=True, the variants' bad values (a window side below -1, a negative softcap,
        alibi_slopes or sinks of another shape). TypeError: dtypes other than float32, float64, float16 or
        bfloat16 (bool for the mask) or mixed, a non-tensor (sinks included).
    """
    if attn_mask is None and sinks is None and window is None and alibi_slopes is None and softcap is None \
            and key_padding_mask is None:
        output = _plain_attention(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
        if output is not None:
            return output
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
                      causal_alignment, window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                      key_padding_mask=key_padding_mask)[0]


def _plain_attention(query, key, value, dropout_p, is_causal, scale, enable_gqa, causal_alignment):
    """The output of the commonest call when nothing takes a gradient (inference, a decoding step): CPU tensors of
    attnpp's dtypes straight to ``functional._plain_forward`` (one call of the core), without _attention's checks
    and autograd; ~30 us less of Python a decoding step's call in a transformers model. None for any other call,
    which takes _attention's path (and its errors)."""
    for t in (query, key, value):
        if not isinstance(t, torch.Tensor) or not t.is_cpu or t.dtype not in _FLOATS:
            return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    plain = AF._plain_forward(to_numpy(query), to_numpy(key), to_numpy(value), dropout_p, is_causal, scale,
                              enable_gqa, causal_alignment)
    return None if plain is None else from_numpy(plain[0])


def linear(input, weight, bias=None):
    """``input @ weight.T + bias``, as ``torch.nn.functional.linear``, differentiable through attnpp's backward.

    Args:
        input (Tensor): (*, Fin), float32, float64, float16 or bfloat16, on the CPU.
        weight (Tensor): (Fout, Fin), same dtype.
        bias (Tensor, optional): (Fout,). Default: None.

    Returns:
        Tensor (*, Fout).

    Raises:
        ValueError: a tensor not on the CPU, shapes that do not agree. TypeError: other or mixed dtypes.
    """
    for t, name in ((input, "input"), (weight, "weight"), (bias, "bias")):
        if t is not None:
            _check_tensor(t, name)
    return _LinearFunction.apply(input, weight, bias)


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0):
    """``torch.nn.functional.cross_entropy(torch.nn.functional.linear(input, weight, bias), target, ...)`` fused:
    attnpp's ``linear_cross_entropy``, differentiable in input, weight and bias, without the (N, V) logits.

    Args:
        input (Tensor): (*, E), float32, float64, float16 or bfloat16, on the CPU.
        weight (Tensor): (V, E), the same dtype (the output projection's, ``torch.nn.Linear`` layout).
        target (Tensor): (*,) the input's shape without E, int64 class indices in [0, V) or ``ignore_index``.
        bias (Tensor, optional): (V,). Default: None.
        ignore_index, reduction, label_smoothing: as ``torch.nn.functional.cross_entropy``'s (defaults -100,
            ``"mean"``, 0.0).

    Returns:
        Tensor: the loss, 0-d (mean, sum) or of the target's shape (none), the input's dtype.

    For the "mean" and "sum" reductions the forward computes the gradients with the loss (one pass over chunks
    of rows, Liger Kernel's approach) and keeps them until the backward, which scales them by grad_output: memory
    of the gradients, never of the logits. Method and errors: ``attnpp.functional.linear_cross_entropy``; and
    ValueError for a tensor not on the CPU, TypeError for one of another dtype.
    """
    for t, name in ((input, "input"), (weight, "weight"), (bias, "bias")):
        if t is not None:
            _check_tensor(t, name)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    options = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    return _LinearCrossEntropyFunction.apply(input, weight, target, bias, options)


def _additive_mask(mask, dtype, name):
    """A bool mask (True = masked out) or float mask of ``dtype`` as the float mask added to the scores."""
    _check_tensor(mask, name, mask=True)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask, -math.inf)
    if mask.dtype != dtype:
        raise TypeError(f"{name}: expected dtype torch.bool or {dtype} (the query's), got {mask.dtype}")
    return mask


# ------------------------------------------------------------------------------------------------- modules
class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (same arguments, parameters, initialisation and state dict) whose forward and
    backward are attnpp's: input (*, Fin) -> (*, Fout), float32, float64, float16 or bfloat16 on the CPU."""

    def forward(self, input):
        return linear(input, self.weight, self.bias)


class MultiheadAttention(torch.nn.MultiheadAttention):
    r"""``torch.nn.MultiheadAttention`` computed by attnpp (projections, attention and their backward).

    A subclass of ``torch.nn.MultiheadAttention``: the same constructor (embed_dim, num_heads, dropout=0.0,
    bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
    dtype=None), parameters (``in_proj_weight`` or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``,
    ``in_proj_bias``, ``bias_k``, ``bias_v``, ``out_proj.weight``, ``out_proj.bias``), state-dict keys and
    initialisation (the same draws from torch's generator), so state dicts load either way. Only ``forward``
    differs: see there. Default dtype: torch's (float32); float32, float64, float16 or bfloat16 only, on the CPU.

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_O^T + b_O``,
    ``head_h = softmax((Q W_Q^h)(K W_K^h)^T / sqrt(E / H) + mask) (V W_V^h)`` (Vaswani et al., 2017).

    Attribute ``last_seed``: the dropout seed of the last forward (None without dropout); the kept weights
    are ``attnpp.functional.dropout_mask((B, H, L, S'), dropout, last_seed)``, S' = S plus one per
    ``add_bias_kv`` and ``add_zero_attn``.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
                         device, dtype)
        self.last_seed = None

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """Returns (batched, seq_first, B, L, S), or ValueError for shapes that do not agree."""
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            _check_tensor(t, name)
        if query.dim() not in (2, 3) or not query.dim() == key.dim() == value.dim():
            raise ValueError(f"query, key and value must all be batched (3-D) or all unbatched (2-D), got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        for name, t, width, wname in (("query", query, self.embed_dim, "embed_dim"), ("key", key, self.kdim, "kdim"),
                                      ("value", value, self.vdim, "vdim")):
            if t.shape[-1] != width:
                raise ValueError(f"{name}: expected last dimension {wname}={width}, got shape {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key and value must have the same batch and sequence dimensions, got key "
                             f"{tuple(key.shape)} and value {tuple(value.shape)}")
        batched = query.dim() == 3
        seq_first = batched and not self.batch_first
        b, t = (1, 0) if seq_first else (0, 1)
        B, L, S = (query.shape[b], query.shape[t], key.shape[t]) if batched else (1, query.shape[0], key.shape[0])
        if batched and key.shape[b] != B:
            raise ValueError(f"query and key must have the same batch size, got query {tuple(query.shape)} and "
                             f"key {tuple(key.shape)} (batch_first={self.batch_first})")
        if key_padding_mask is not None:
            _check_tensor(key_padding_mask, "key_padding_mask", mask=True)
            want = (B, S) if batched else (S,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"key_padding_mask: expected shape {want}, got {tuple(key_padding_mask.shape)}")
        if attn_mask is not None:
            _check_tensor(attn_mask, "attn_mask", mask=True)
            want = [(L, S), (B * self.num_heads, L, S)]
            if tuple(attn_mask.shape) not in want:
                raise ValueError(f"attn_mask: expected shape (L, S) = {want[0]} or (B * num_heads, L, S) = "
                                 f"{want[1]}, got {tuple(attn_mask.shape)}")
        elif is_causal:
            raise ValueError("is_causal=True is a hint that attn_mask is the causal mask: attn_mask is required, "
                             "as in PyTorch")
        return batched, seq_first, B, L, S

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """Attend from ``query`` to ``key``/``value``, as ``torch.nn.MultiheadAttention.forward``.

        Args:
            query (Tensor): (L, B, E), (B, L, E) when ``batch_first``, or (L, E) unbatched.
            key (Tensor): (S, B, kdim), (B, S, kdim) when ``batch_first``, or (S, kdim) unbatched.
            value (Tensor): (S, B, vdim), (B, S, vdim) when ``batch_first``, or (S, vdim) unbatched.
            key_padding_mask (Tensor, optional): (B, S) or (S,) unbatched. Bool: True where a key is *ignored*
                (padding). Float: added to the scores. Default: None.
            need_weights (bool): also return the attention weights (materialises (B, H, L, S') memory; they
                carry no gradient: a loss on them does not reach the parameters). Default: True.
            attn_mask (Tensor, optional): (L, S) or (B * num_heads, L, S) ((num_heads, L, S) unbatched). Bool:
                True where attention is *not allowed*. Float: added to the scores. Default: None.
            average_attn_weights (bool): average the returned weights over heads. Default: True.
            is_causal (bool): a hint that ``attn_mask`` is the causal mask (required with it); without
                ``key_padding_mask`` and ``need_weights``, the causal kernel is used instead of ``attn_mask``,
                as in PyTorch. Default: False.

        Returns:
            (attn_output, attn_weights): attn_output (L, B, E), (B, L, E) when ``batch_first``, or (L, E);
            attn_weights (B, L, S') averaged or (B, H, L, S') per head ((L, S') or (H, L, S') unbatched), after
            dropout as in PyTorch, without gradient; None when ``need_weights=False``. A query whose keys are
            all masked gives 0 (PyTorch's weights path gives NaN there).

        Raises:
            ValueError: tensors not on the CPU, shapes that do not agree, is_causal without attn_mask.
            TypeError: dtypes other than the query's (masks may be bool), float16 and bfloat16.
        """
        self_attention = query is key is value
        batched, seq_first, B, L, S = self._check_inputs(query, key, value, key_padding_mask, attn_mask, is_causal)
        E, H, D, dtype = self.embed_dim, self.num_heads, self.head_dim, query.dtype
        if not batched:  # as a batch of one, batch first
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        if self_attention and self._qkv_same_embed_dim:  # one product for the three projections
            q, k, v = linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            q, k, v = (linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))

        def heads(x):  # (T, B, E) or (B, T, E) -> (B, H, T, D), a view
            x = x.unflatten(-1, (H, D))
            return x.permute(1, 2, 0, 3) if seq_first else x.transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        # add_bias_kv, add_zero_attn: extra keys and values after the S given, taking part everywhere
        extra = [] if self.bias_k is None else [(self.bias_k, self.bias_v)]
        if self.add_zero_attn:
            zero = torch.zeros(1, 1, E, dtype=dtype)
            extra.append((zero, zero))
        if extra:
            k = torch.cat([k] + [ek.view(1, H, 1, D).expand(B, H, 1, D) for ek, _ in extra], dim=2)
            v = torch.cat([v] + [ev.view(1, H, 1, D).expand(B, H, 1, D) for _, ev in extra], dim=2)
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None
        if attn_mask is not None and not causal:
            mask = _additive_mask(attn_mask, dtype, "attn_mask")
            mask = mask if mask.dim() == 2 else mask.view(B, H, L, S)
        if key_padding_mask is not None:
            kpm = _additive_mask(key_padding_mask, dtype, "key_padding_mask").view(B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        if mask is not None and extra:
            mask = torch.nn.functional.pad(mask, (0, len(extra)))
        p = self.dropout if self.training else 0.0
        out, attn_weights, self.last_seed = _attention(q, k, v, mask, p, causal, None, False, None, "top_left",
                                                       need_weights)
        out = out.permute(2, 0, 1, 3) if seq_first else out.transpose(1, 2)  # (L, B, H, D) or (B, L, H, D)
        out = linear(out.reshape(out.shape[:2] + (E,)), self.out_proj.weight, self.out_proj.bias)
        if attn_weights is not None and average_attn_weights:
            attn_weights = attn_weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0)
            attn_weights = None if attn_weights is None else attn_weights.squeeze(0)
        return out, attn_weights


class Attention(torch.nn.Module):
    r"""``attnpp.nn.Attention`` as a ``torch.nn.Module``: torch parameters, attnpp's compute.

    ``out = out_dropout(Concat_h(softmax(scale * Q_h K_h^T + mask) V_h) W_O^T + b_O)`` with ``Q = x W_Q^T + b_Q``,
    ``K = c W_K^T + b_K``, ``V = c W_V^T + b_V`` and ``c = context`` (cross-attention) or ``x`` (self-attention),
    attention dropout on the weights (Vaswani et al., "Attention Is All You Need", 2017).

    Shape letters: B batch, L query length, S key/value (context) length, E ``embed_dim``, H ``num_heads``.

    Args: those of ``attnpp.nn.Attention`` (embed_dim, num_heads=1, and keyword-only qk_dim, v_dim, kv_dim,
    out_dim, bias=True, out_proj=True, out_bias, causal=False, causal_alignment="top_left", attn_dropout=0.0,
    out_dropout=0.0, scale, context_length, and the variants window, alibi=False, softcap, sinks=False,
    rotary=False, rotary_dim, rotary_base=10000.0, rotary_interleaved=False; checked by the same
    ``attention_config``, documented there), except ``dtype`` (torch.dtype, optional): float32, float64, float16
    or bfloat16, default torch's default dtype; the output dropout is a ``torch.nn.Dropout``. And:

    - ``context_parallel_group`` (ProcessGroup, optional): context parallelism: the layer's input ``x`` is this
      rank's shard of the sequence (``attnpp.torch.distributed.shard_sequence``), the projections run on it
      locally and the attention over the whole sequence runs as ``attnpp.torch.distributed.ring_attention``
      over the group (every rank of the group calls the layer, and its backward). Self-attention without
      ``key_padding_mask``, ``need_weights``, attention dropout in training, ``alibi``, ``softcap`` or
      ``sinks``; rotary positions are those of the whole sequence. Default: None (one process).
    - ``context_parallel_layout`` (str): the shards' layout, ``"contiguous"`` or ``"zigzag"`` (balanced under
      the causal mask). Default: ``"contiguous"``.

    Sub-modules (``attnpp.torch.Linear``, weight (out, in), torch.nn.Linear's initialisation): ``q_proj``
    (E -> qk_dim), ``k_proj`` (kv_dim -> qk_dim), ``v_proj`` (kv_dim -> v_dim), ``out_proj`` (v_dim -> out_dim,
    or None); ``out_drop`` (``torch.nn.Dropout``). Parameter ``sinks`` (H,) (zeros at first) with
    ``sinks=True``, else None; ``alibi_slopes`` a float64 ndarray (H,) or None (a constant, not in the state
    dict). Attribute ``last_seed``: the attention-dropout seed of the last forward (None without), mask
    ``attnpp.functional.dropout_mask((B, H, L, S), attn_dropout, last_seed)``.

    Raises:
        ValueError: H not dividing qk_dim or v_dim, a non-positive width, dropout outside [0, 1), an unknown
        causal_alignment. TypeError: a dtype other than float32, float64, float16 or bfloat16, widths that are
        not ints. And the variants' errors, as ``attnpp.nn.Attention`` lists them; ValueError: a
        ``context_parallel_group`` with a variant it does not take (alibi, softcap, sinks) or an unknown layout.
    """

    def __init__(self, embed_dim, num_heads=1, *, qk_dim=None, v_dim=None, kv_dim=None, out_dim=None, bias=True,
                 out_proj=True, out_bias=None, causal=False, causal_alignment="top_left", attn_dropout=0.0,
                 out_dropout=0.0, scale=None, context_length=None, window=None, alibi=False, softcap=None,
                 sinks=False, rotary=False, rotary_dim=None, rotary_base=10000.0, rotary_interleaved=False,
                 dtype=None, context_parallel_group=None, context_parallel_layout="contiguous"):
        super().__init__()
        dtype = _check_dtype(dtype)
        config = attention_config_of(locals())
        if context_parallel_group is not None:
            from .distributed import check_layout
            check_layout(context_parallel_layout)
            for name, given in (("alibi", config["alibi_slopes"] is not None),
                                ("softcap", config["softcap"] is not None), ("sinks", config["sinks"])):
                if given:
                    raise ValueError(f"context_parallel_group: not with {name} (ring attention takes the causal mask, "
                                     f"a window and rotary positions only)")
        self.context_parallel_group, self.context_parallel_layout = context_parallel_group, context_parallel_layout
        out_dropout, sinks = config.pop("out_dropout"), config.pop("sinks")
        self.__dict__.update(config)
        self.sinks = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=dtype)) if sinks else None
        self.q_proj = Linear(self.embed_dim, self.qk_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(self.kv_dim, self.qk_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(self.kv_dim, self.v_dim, bias=bias, dtype=dtype)
        self.out_proj = Linear(self.v_dim, self.out_dim, bias=bias if out_bias is None else out_bias,
                               dtype=dtype) if out_proj else None
        self.out_drop = torch.nn.Dropout(out_dropout)
        self.last_seed = None

    def _check(self, x, context, key_padding_mask):
        """The context (``x`` for self-attention), after checking the inputs."""
        for t, name in ((x, "x"), (context, "context")):
            if t is not None:
                _check_tensor(t, name)
        if key_padding_mask is not None:
            _check_tensor(key_padding_mask, "key_padding_mask", mask=True)
        return check_attention_layer_shapes(x, context, key_padding_mask, self.embed_dim, self.kv_dim,
                                            self.context_length)

    def forward(self, x, context=None, key_padding_mask=None, need_weights=False):
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x (Tensor): (B, L, E) or (L, E) unbatched, the layer's dtype: the queries' input.
            context (Tensor, optional): (B, S, kv_dim) or (S, kv_dim): the keys' and values' input
                (cross-attention). Default: None, self-attention on ``x``.
            key_padding_mask (Tensor, optional): (B, S) or (S,). Bool: True where a key is *masked out*
                (padding). Float: added to the scores. Combined with the causal mask. Default: None.
            need_weights (bool): also return the (B, H, L, S) attention weights (after dropout, without
                gradient). Default: False.

        Returns:
            out (Tensor): (B, L, out_dim) or (L, out_dim); with ``need_weights``, ``(out, weights)``. A query
            whose keys are all masked attends to nothing: its attention output is 0.

        Raises:
            ValueError: tensors not on the CPU, shapes that do not agree, a sequence longer than
            context_length. TypeError: dtypes other than float32, float64, float16 or bfloat16, or mixed (masks
            may be bool).
        """
        context = self._check(x, context, key_padding_mask)
        batched = x.dim() == 3
        x3, c3 = (x, context) if batched else (x.unsqueeze(0), context.unsqueeze(0))
        B, L, S = x3.shape[0], x3.shape[1], c3.shape[1]
        heads = lambda t: t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, T, H * d) -> (B, H, T, d)
        q, k, v = heads(self.q_proj(x3)), heads(self.k_proj(c3)), heads(self.v_proj(c3))
        if self.rotary:
            q, k = self._rotary(q), self._rotary(k)
        if self.context_parallel_group is not None:
            out, weights = self._context_parallel(q, k, v, context is not x, key_padding_mask, need_weights), None
        else:
            mask, causal = None, self.causal
            if key_padding_mask is not None:
                mask = _additive_mask(key_padding_mask, x.dtype, "key_padding_mask").reshape(B, 1, 1, S)
                if causal:  # the kernel takes a mask or is_causal: the causal mask joins the padding one
                    diagonal = S - L if self.causal_alignment == "bottom_right" else 0
                    hidden = torch.ones(L, S, dtype=torch.bool).triu(diagonal + 1)
                    mask, causal = mask + _additive_mask(hidden, x.dtype, "causal mask"), False
            p = self.attn_dropout if self.training else 0.0
            out, weights, self.last_seed = _attention(q, k, v, mask, p, causal, self.scale, False, None,
                                                      self.causal_alignment, need_weights, self.window,
                                                      self.alibi_slopes, self.softcap, self.sinks)
        y = out.transpose(1, 2).reshape(B, L, self.v_dim)
        y = self.out_drop(y if self.out_proj is None else self.out_proj(y))
        if not batched:
            y, weights = y[0], None if weights is None else weights[0]
        return (y, weights) if need_weights else y

    def _rotary(self, t):
        """RoPE of (B, H, T, d) heads at their positions in the sequence: 0 .. T - 1, or with
        ``context_parallel_group`` the positions of this rank's shard (its segments, each at its own offset)."""
        T = t.shape[2]
        if self.context_parallel_group is None:
            segments = [(0, 0, T)]
        else:
            from .distributed import shard_segments
            segments = shard_segments(self.context_parallel_group, self.context_parallel_layout, T)
        cos, sin = rotary_tables(self, max(start + rows for start, _, rows in segments), to_numpy(t).dtype)
        parts = [_RotaryFunction.apply(t[:, :, local:local + rows], cos[start:start + rows], sin[start:start + rows],
                                       self.rotary_interleaved) for start, local, rows in segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _context_parallel(self, q, k, v, cross, key_padding_mask, need_weights):
        """The attention of this rank's shard (B, H, n, d) of q, k, v over the group's whole sequence."""
        from . import distributed
        for given, what in ((cross, "a context (cross-attention)"), (key_padding_mask is not None, "key_padding_mask"),
                            (need_weights, "need_weights"),
                            (self.training and self.attn_dropout > 0, "attention dropout in training")):
            if given:
                raise ValueError(f"context_parallel_group: not with {what}")
        return distributed.ring_attention(q, k, v, self.context_parallel_group, is_causal=self.causal,
                                          scale=self.scale, window=self.window, layout=self.context_parallel_layout)

    def extra_repr(self):
        variants = "".join(f", {name}={value!r}" for name, (value, default) in
                           variant_args(self).items() if value != default)
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, qk_dim={self.qk_dim}, v_dim={self.v_dim}, "
                f"kv_dim={self.kv_dim}, out_dim={self.out_dim}, causal={self.causal}, "
                f"attn_dropout={self.attn_dropout}{variants}")
