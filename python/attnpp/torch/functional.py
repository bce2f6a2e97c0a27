"""attnpp.torch's functions: ``scaled_dot_product_attention``, ``linear`` and ``linear_cross_entropy``, as
PyTorch's, and ``scaled_dot_product_attention_varlen`` (packed sequences, as FlashAttention's), computed by
attnpp's operators (``attnpp.torch._ops``), their backward through autograd.

Every tensor argument is checked first (``_convert.check_tensor``: plain strided tensors on the CPU, or meta and
tracing tensors for shapes; PyTorch's ``CausalBias`` masks read as causal flags, never as memory), then the
operator runs. ValueError and TypeError are raised as ``TorchValueError`` and ``TorchTypeError``, which are also
RuntimeErrors (PyTorch's class for the same bad input).
"""
import torch

from .. import functional as AF
from .._checks import (check_bool, check_choice, check_ignore_index, check_label_smoothing, check_probability,
                       check_reduction, check_scale, check_seed, check_softcap, check_window)
from ..functional._args import ALIGNMENTS
from . import _ops
from ._convert import (FLOATS, causal_bias_flags, check_plain, check_same_device, check_tensor, draw_seed, from_numpy,
                       to_numpy, torch_errors)

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_varlen", "linear", "linear_cross_entropy"]
_check_seed = torch_errors(check_seed)


def _check_scalars(is_causal, scale, window, softcap, causal_alignment):
    """The attention's scalar options checked by functional's checks, before the operator, whose schema would
    raise RuntimeError for a wrong type or take an int for a bool: (is_causal, scale, window, softcap)."""
    check_choice(causal_alignment, "causal_alignment", ALIGNMENTS)
    return check_bool(is_causal, "is_causal"), check_scale(scale), check_window(window), check_softcap(softcap)


def _check_sinks_and_slopes(sinks, alibi_slopes):
    """Checks ``sinks``; returns ``alibi_slopes`` as a checked tensor without gradient (the slopes are constants,
    as in FlashAttention), or None."""
    if sinks is not None:
        check_tensor(sinks, "sinks")
    if alibi_slopes is None:
        return None
    return check_tensor(alibi_slopes if isinstance(alibi_slopes, torch.Tensor) else torch.as_tensor(alibi_slopes),
                        "alibi_slopes").detach()


def _dropout_seed(dropout_p, seed):
    """The seed of a call: with dropout and none given, one drawn from torch's default generator."""
    return draw_seed() if check_probability(dropout_p, "dropout_p") > 0 and seed is None else seed


@torch_errors
def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment,
               need_weights=False, window=None, alibi_slopes=None, softcap=None, sinks=None, key_padding_mask=None):
    """The checked attention call of every public entry: (output, weights or None, the dropout seed or None)."""
    is_causal, scale, window, softcap = _check_scalars(is_causal, scale, window, softcap, causal_alignment)
    enable_gqa = check_bool(enable_gqa, "enable_gqa")
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        check_tensor(t, name)
    if attn_mask is not None:
        flags = causal_bias_flags(attn_mask, query.shape[-2], key.shape[-2], is_causal)
        if flags is None:
            check_tensor(attn_mask, "attn_mask", mask=True)
        else:  # PyTorch's CausalBias: its meaning is the causal flag, its storage nothing
            (is_causal, causal_alignment), attn_mask = flags, None
    alibi_slopes = _check_sinks_and_slopes(sinks, alibi_slopes)
    if key_padding_mask is not None:  # (a constant too)
        check_tensor(key_padding_mask, "key_padding_mask", mask=True)
    check_same_device(query, ("key", key), ("value", value), ("attn_mask", attn_mask), ("sinks", sinks),
                      ("alibi_slopes", alibi_slopes), ("key_padding_mask", key_padding_mask))
    seed = _dropout_seed(dropout_p, seed)
    options = (float(dropout_p), is_causal, scale, enable_gqa, seed, causal_alignment,
               None if window is None else list(window), softcap)
    output, lse = _ops.apply_sdpa(query, key, value, attn_mask, sinks, alibi_slopes, key_padding_mask, *options)
    weights = None
    if need_weights:
        weights = _ops.sdpa_weights(query.detach(), key.detach(), attn_mask, None if sinks is None else sinks.detach(),
                                    alibi_slopes, key_padding_mask, lse.detach(), *options)
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
            (False masks it out). Float (the query's dtype): added to the scores. Gets no gradient (refused
            when it requires grad under grad mode, where PyTorch would give it one). Or PyTorch's
            ``torch.nn.attention.bias.CausalBias`` of (L, S): ``causal_upper_left`` is ``is_causal=True``,
            ``causal_lower_right`` is ``is_causal=True`` with ``causal_alignment="bottom_right"`` (no dense mask
            made). Any other tensor subclass is refused. Default: None.
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

    Tensors on the ``meta`` device (and torch.compile's and torch.export's fake tensors) give an output of the
    right shape and dtype without compute.

    Raises:
        TorchValueError (a ValueError and a RuntimeError): a tensor not on the CPU; shapes that do not agree or
            broadcast, dropout_p outside [0, 1), attn_mask with is_causal=True (a CausalBias included), a CausalBias
            of another (L, S), a mask that requires grad, the variants' bad values (a window side below -1, a
            negative softcap, alibi_slopes or sinks of another shape). TorchTypeError (a TypeError and a
            RuntimeError): dtypes other than float32, float64, float16 or bfloat16 (bool for the mask) or mixed, a
            non-tensor (sinks included), a tensor subclass or a sparse tensor.
    """
    _check_seed(seed, used=False)  # (checked even where the plain path needs none, as functional's)
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
    which takes _attention's path (and its errors): tensor subclasses, functorch's wrapped tensors (vmap, grad),
    torch.compile's tracing."""
    if torch.compiler.is_compiling():  # (traced: the operator, which torch.compile and torch.export see)
        return None
    for t in (query, key, value):
        if (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter) or not t.is_cpu \
                or t.layout != torch.strided or t.dtype not in FLOATS \
                or torch._C._functorch.is_functorch_wrapped_tensor(t):
            return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    plain = AF._plain_forward(to_numpy(query), to_numpy(key), to_numpy(value), dropout_p, is_causal, scale,
                              enable_gqa, causal_alignment)
    return None if plain is None else from_numpy(plain[0])


@torch_errors
def scaled_dot_product_attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, dropout_p=0.0,
                                        is_causal=False, scale=None, *, seed=None, causal_alignment="top_left",
                                        window=None, alibi_slopes=None, softcap=None, sinks=None):
    """Attention over sequences of different lengths packed end to end, without padding, as FlashAttention's
    ``flash_attn_varlen_func``, differentiable in ``query``, ``key``, ``value`` (and ``sinks``) through attnpp's
    backward: sequence b's queries, rows ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1]``, attend only to its keys,
    rows ``cu_seqlens_k[b]`` to ``cu_seqlens_k[b + 1]``; no work and no memory for pairs across sequences.

    Args:
        query (Tensor): (Tq, Hq, D), float32, float64, float16 or bfloat16, on the CPU.
        key (Tensor): (Tk, Hk, D), same dtype; Hq a multiple of Hk (grouped-query attention).
        value (Tensor): (Tk, Hk, Dv), same dtype.
        cu_seqlens_q, cu_seqlens_k (Tensor): (B + 1,) integers, the cumulative lengths 0, L_0, L_0 + L_1, ..., Tq
            (resp. Tk).
        dropout_p, is_causal, scale, seed, causal_alignment, window, alibi_slopes, softcap, sinks: as in
            ``scaled_dot_product_attention``, per sequence (each one's own L and S; alibi_slopes (Hq,) or (B, Hq)).

    Returns:
        Tensor (Tq, Hq, Dv).

    Raises:
        TorchValueError, TorchTypeError: as ``attnpp.functional.scaled_dot_product_attention_varlen`` (offsets
            that do not run from 0 to Tq (Tk) without decreasing, shapes that do not agree, bad options), and for
            tensors off the CPU, of another dtype, or of a subclass.
    """
    _check_seed(seed, used=False)
    is_causal, scale, window, softcap = _check_scalars(is_causal, scale, window, softcap, causal_alignment)
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        check_tensor(t, name)
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        check_plain(t, name)
    alibi_slopes = _check_sinks_and_slopes(sinks, alibi_slopes)
    check_same_device(query, ("key", key), ("value", value), ("cu_seqlens_q", cu_seqlens_q),
                      ("cu_seqlens_k", cu_seqlens_k), ("sinks", sinks), ("alibi_slopes", alibi_slopes))
    seed = _dropout_seed(dropout_p, seed)
    return _ops.apply_sdpa_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes,
                                  float(dropout_p), is_causal, scale, seed, causal_alignment,
                                  None if window is None else list(window), softcap)[0]


def linear(input, weight, bias=None):
    """``input @ weight.T + bias``, as ``torch.nn.functional.linear``, differentiable through attnpp's backward.

    Args:
        input (Tensor): (*, Fin), float32, float64, float16 or bfloat16, on the CPU.
        weight (Tensor): (Fout, Fin), same dtype.
        bias (Tensor, optional): (Fout,). Default: None.

    Returns:
        Tensor (*, Fout).

    Raises:
        TorchValueError: a tensor not on the CPU, shapes that do not agree. TorchTypeError: other or mixed
            dtypes, a tensor subclass.
    """
    _check_linear_args(input, weight, bias)
    return _ops.apply_linear(input, weight, bias)


@torch_errors
def _check_linear_args(input, weight, bias):
    for t, name in ((input, "input"), (weight, "weight"), (bias, "bias")):
        if t is not None:
            check_tensor(t, name)
    check_same_device(input, ("weight", weight), ("bias", bias))


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=None):
    """``torch.nn.functional.cross_entropy(torch.nn.functional.linear(input, weight, bias), target, ...)`` fused:
    attnpp's ``linear_cross_entropy``, differentiable in input, weight and bias, without the (N, V) logits.

    Args:
        input (Tensor): (*, E), float32, float64, float16 or bfloat16, on the CPU.
        weight (Tensor): (V, E), the same dtype (the output projection's, ``torch.nn.Linear`` layout).
        target (Tensor): (*,) the input's shape without E, int64 class indices in [0, V) or ``ignore_index``.
        bias (Tensor, optional): (V,). Default: None.
        ignore_index, reduction, label_smoothing: as ``torch.nn.functional.cross_entropy``'s (defaults -100,
            ``"mean"``, 0.0).
        softcap (float, optional): logit soft-capping, ``softcap * tanh(logits / softcap)`` before the softmax
            (Gemma 2's final logits); None: none. Default: None.

    Returns:
        Tensor: the loss, 0-d (mean, sum) or of the target's shape (none), the input's dtype.

    For the "mean" and "sum" reductions the forward computes the gradients with the loss (one pass over chunks
    of rows, Liger Kernel's approach) and keeps them until the backward, which scales them by grad_output: memory
    of the gradients, never of the logits. Method and errors: ``attnpp.functional.linear_cross_entropy``
    (raised as TorchValueError, TorchTypeError); and TorchValueError for a tensor not on the CPU,
    TorchTypeError for one of another dtype or a tensor subclass.
    """
    loss = linear_cross_entropy_float(input, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                      label_smoothing=label_smoothing, softcap=softcap)
    return loss.to(input.dtype)


@torch_errors
def linear_cross_entropy_float(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, softcap=None):
    """``linear_cross_entropy`` with the loss in the compute dtype, float32 for half precision (the input's
    otherwise), before its rounding: as transformers' causal-LM loss, computed from float32 logits."""
    _check_linear_args(input, weight, bias)
    check_plain(target, "target")
    # (the scalars with functional's checks, before the operator's schema, which would raise RuntimeError for a
    # wrong type, or take True for an int and "0.1" for a float)
    ignore_index, reduction = check_ignore_index(ignore_index), check_reduction(reduction)
    label_smoothing = check_label_smoothing(label_smoothing)
    compute_grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias))
    loss = _ops.apply_linear_cross_entropy(input, weight, target, bias, ignore_index, reduction,
                                           float(label_smoothing), float(check_softcap(softcap) or 0.0), compute_grads)
    return loss[0]
