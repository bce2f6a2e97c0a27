from .. import _checks as checks
from .. import functional as F
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
