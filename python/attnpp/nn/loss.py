from .. import _checks as checks
from .. import functional as F
from ..grad_mode import is_grad_enabled
from .module import Module, locked


class CrossEntropyLoss(Module):
    """Cross-entropy of logits against class indices, as ``torch.nn.CrossEntropyLoss``.

    Args:
        ignore_index (int): target value that contributes neither loss nor gradient. Default: -100.
        reduction (str): ``"mean"`` (over rows not ignored) | ``"sum"`` | ``"none"``. Default: ``"mean"``.

    ``forward(input (N, C) or (C,), target (N,) or ())`` returns the loss (a 0-d array, or (N,) for "none");
    ``backward(grad_output=1.0)`` returns the gradient of the input (N, C): grad_output is a number or an array
    of the loss's shape and the input's dtype. See ``attnpp.functional.cross_entropy`` for the errors of the
    forward.

    Raises:
        TypeError: ignore_index not an int. ValueError: an unknown reduction. The backward raises as every
            layer's (see ``attnpp.nn.Module``): ValueError with no forward context left or a grad_output of another
            shape than the loss's, TypeError for one of another type or dtype.
    """

    def __init__(self, ignore_index=-100, reduction="mean"):
        super().__init__()
        self.ignore_index = checks.check_ignore_index(ignore_index)
        self.reduction = checks.check_reduction(reduction)

    @locked
    def forward(self, input, target):
        loss, stats = F.cross_entropy_forward(input, target, self.ignore_index, self.reduction)
        self._save_context(input=input, target=target, stats=stats, out_shape=loss.shape, dtype=loss.dtype)
        return loss

    @locked
    def backward(self, grad_output=1.0):
        ctx = self._consume_context(grad_output, number_for_0d=True)
        return F.cross_entropy_backward(grad_output, ctx["input"], ctx["target"], ctx["stats"], self.ignore_index,
                                        self.reduction)

    def extra_repr(self):
        return self._format_args(ignore_index=(self.ignore_index, -100), reduction=(self.reduction, "mean"))


class LinearCrossEntropyLoss(Module):
    """The output projection and the cross-entropy fused, ``attnpp.functional.linear_cross_entropy``: the loss of
    ``CrossEntropyLoss()(Linear's logits, target)`` without ever holding the (N, V) logits.

    Args:
        ignore_index (int): target value that contributes neither loss nor gradient. Default: -100.
        reduction (str): ``"mean"`` (over rows not ignored) | ``"sum"`` | ``"none"``. Default: ``"mean"``.
        label_smoothing (float): in [0, 1], as ``torch.nn.CrossEntropyLoss``'s. Default: 0.0.

    ``forward(input (*, E), weight (V, E), target (*,), bias=None)`` returns the loss (a 0-d array, or the
    target's shape for "none"); the weight (and bias) are the projection's, e.g. a ``Linear``'s or a tied
    embedding's. For "mean" and "sum" the forward computes the gradients too (one pass over the chunks), unless
    under ``attnpp.no_grad()``. ``backward(grad_output=1.0)`` returns (grad_input, grad_weight, grad_bias or None)
    without adding them anywhere: add grad_weight to the owner's gradient (``linear.weight.grad += ...``).

    Raises:
        TypeError: ignore_index not an int, label_smoothing not a number. ValueError: an unknown reduction,
            label_smoothing outside [0, 1]. The forward raises as ``attnpp.functional.linear_cross_entropy``; the
            backward as every layer's (see ``attnpp.nn.Module``).
    """

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        super().__init__()
        self.ignore_index = checks.check_ignore_index(ignore_index)
        self.reduction = checks.check_reduction(reduction)
        self.label_smoothing = checks.check_label_smoothing(label_smoothing)

    def _options(self):
        return dict(ignore_index=self.ignore_index, reduction=self.reduction, label_smoothing=self.label_smoothing)

    @locked
    def forward(self, input, weight, target, bias=None):
        out = F.linear_cross_entropy_forward(input, weight, target, bias, compute_grads=is_grad_enabled(),
                                             **self._options())
        self._save_context(input=input, weight=weight, target=target, bias=bias, logsumexp=out.logsumexp,
                           grads=out.grads, out_shape=out.loss.shape, dtype=out.loss.dtype)
        return out.loss

    @locked
    def backward(self, grad_output=1.0):
        ctx = self._consume_context(grad_output, number_for_0d=True)
        return F.linear_cross_entropy_backward(grad_output, ctx["input"], ctx["weight"], ctx["target"],
                                               ctx["logsumexp"], ctx["bias"], grads=ctx["grads"], **self._options())

    def extra_repr(self):
        return self._format_args(ignore_index=(self.ignore_index, -100), reduction=(self.reduction, "mean"),
                                 label_smoothing=(self.label_smoothing, 0.0))
