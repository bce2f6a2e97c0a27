"""The fused linear + cross-entropy: the loss of a linear layer's logits without ever holding the (N, V) logits.

Shape letters: N rows (the target's elements), E input width, V vocabulary (classes).
"""
from typing import NamedTuple, Optional

import numpy as np

from .. import _core
from .._checks import (check_array, check_bool, check_ignore_index, check_index, check_label_smoothing,
                       check_loss_grad, check_reduction, check_softcap, compute_dtype, is_half)
from .._pool import zeros as _zeros


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


def _linear_cross_entropy_args(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    """The checked arguments: input (N, E) and target (N,) flattened, C-contiguous weight and bias, the target's
    shape, label_smoothing and softcap as floats (softcap 0: none)."""
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
    softcap = check_softcap(softcap) or 0.0
    tgt = check_index(target, "target", V, allowed=ignore_index)
    if tgt.shape != input.shape[:-1]:
        raise ValueError(f"target: expected shape {input.shape[:-1]} (the input's without E), got {tgt.shape} for "
                         f"input {input.shape}")
    x = np.ascontiguousarray(input).reshape(-1, E)
    return x, np.ascontiguousarray(weight), bias, tgt.reshape(-1), tgt.shape, label_smoothing, softcap


def linear_cross_entropy_forward(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, softcap=None, compute_grads=True):
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
    out = _forward_unrounded(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap,
                             compute_grads)
    return out._replace(loss=np.asarray(out.loss, dtype=input.dtype))  # (input: checked an ndarray by then)


def _forward_unrounded(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap,
                       compute_grads):
    """``linear_cross_entropy_forward`` with the loss in the compute dtype (float32 for half precision) before its
    rounding to the input's: what attnpp.torch's operator returns (transformers' causal-LM loss is float32)."""
    x, w, b, tgt, shape, eps, cap = _linear_cross_entropy_args(input, weight, target, bias, ignore_index, reduction,
                                                               label_smoothing, softcap)
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
                               int(ignore_index), eps, cap)
    if reduction == "none":
        loss = losses.reshape(shape)
    elif reduction == "sum":
        loss = losses.sum(dtype=acc)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            loss = losses.sum(dtype=acc) / acc.type(count)
    if grads is not None:
        grads = (grads[0].reshape(np.shape(input)),) + grads[1:]
    return LinearCrossEntropyForward(np.asarray(loss, dtype=acc), lse.reshape(shape), grads)


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=None):
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
    ``z = input @ weight.T + bias`` (soft-capped with ``softcap``: ``z = softcap * tanh(z / softcap)``), 0 where
    target_i is ``ignore_index``; then the mean over the rows not ignored (NaN when there are none, as PyTorch),
    the sum, or none.

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
        softcap (float, optional): logit soft-capping, the logits ``softcap * tanh(z / softcap)`` before the
            softmax (Gemma 2's ``final_logit_softcapping``; Gemma Team, "Gemma 2", 2024); None or 0: none.
            Default: None.

    Returns:
        ndarray: a 0-d array (mean, sum) or the losses of the target's shape (none), of the input's dtype.

    Raises:
        TypeError: non-float input, weight or bias of another dtype, a non-integer target, ignore_index not an
            int, label_smoothing not a number. ValueError: a weight whose width is not the input's last dimension, a
            bias not (V,), a target not of the input's shape without E, an unknown reduction, label_smoothing outside
            [0, 1], a softcap that is negative or not finite. IndexError: a target outside [0, V) other than
            ignore_index. All before any compute.
    """
    return linear_cross_entropy_forward(input, weight, target, bias, ignore_index=ignore_index,
                                        reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
                                        compute_grads=False).loss


def linear_cross_entropy_backward(grad_output, input, weight, target, logsumexp, bias=None, *, ignore_index=-100,
                                  reduction="mean", label_smoothing=0.0, softcap=None, grads=None):
    """Gradients of ``linear_cross_entropy``: (grad_input (*, E), grad_weight (V, E), grad_bias (V,) or None).

    Args:
        grad_output (float or ndarray): the gradient of the loss: a number or a 0-d array for "mean" and "sum",
            an array of the loss's shape for "none"; arrays of the input's dtype.
        input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap: as given to the forward.
        logsumexp (ndarray): the forward's (``LinearCrossEntropyForward.logsumexp``).
        grads (tuple, optional): the forward's ``grads`` (scalar reductions): multiplied by grad_output in place
            and returned, no recompute. Default: None (each chunk's logits recomputed from logsumexp).

    Raises:
        as ``linear_cross_entropy``; and TypeError/ValueError: a grad_output, logsumexp or grads of another
            type, dtype or shape than the loss's, the target's and the forward's gradients'.
    """
    x, w, b, tgt, shape, eps, cap = _linear_cross_entropy_args(input, weight, target, bias, ignore_index, reduction,
                                                               label_smoothing, softcap)
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
                    np.multiply(a, g.astype(a.dtype) if is_half(a.dtype) else g, out=a, casting="unsafe")
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
    _core.linear_cross_entropy_backward(np.ascontiguousarray(lse, dtype=acc).reshape(-1), *out, row_weight, x, w, b,
                                        tgt, int(ignore_index), eps, cap)
    return (out[0].reshape(np.shape(input)),) + out[1:]
