"""The training pieces: dropout, linear, embedding and cross-entropy, each forward with its backward.

Shape letters: N rows, C classes, Fin/Fout a linear layer's input/output features, V vocabulary, E embedding width.
"""
import math
import numbers

import numpy as np

from .. import _core
from .._checks import (MAX_ELEMENTS, check_array, check_bool, check_ignore_index, check_index, check_loss_grad,
                       check_probability, check_reduction, check_seed, check_written, compute_dtype)
from .._pool import empty as _empty, zeros as _zeros


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


def check_linear_input(input, weight):
    """ValueError unless the input's last dimension (*, Fin) is the weight's (Fout, Fin) in_features."""
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input: last dimension must be weight's in_features {weight.shape[1]}, got input "
                         f"{input.shape} and weight {weight.shape}")


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
    check_linear_input(input, weight)
    return linear_unchecked(input, weight, bias)


def linear_unchecked(input, weight, bias):
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
    check_linear_input(input, weight)
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
        check_written(g, name)
    return linear_backward_unchecked(grad_output, input, weight, grad_weight, grad_bias,
                            check_bool(need_input_grad, "need_input_grad"))


def linear_backward_unchecked(grad_output, input, weight, grad_weight, grad_bias=None, need_input_grad=True):
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
    seed = check_seed(seed, used=p > 0, backward="p")
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
    check_written(grad_weight, "grad_weight")
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
