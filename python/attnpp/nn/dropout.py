from .. import _checks as checks
from .. import functional as F
from .module import Module, locked


class Dropout(Module):
    """Zero each element with probability ``p`` in training mode, scaling the rest by 1 / (1 - p), as
    ``torch.nn.Dropout`` (Srivastava et al., 2014). Identity in eval mode.

    Args:
        p (float): drop probability in [0, 1). Default: 0.5.

    ``forward(input, seed=None)``: input of any shape; ``seed`` picks the mask (None draws one from attnpp's
    global generator). The seed used is kept in ``last_seed``: the mask was
    ``attnpp.functional.dropout_mask(input.shape, p, last_seed)``. ``backward(grad_output)`` applies the same
    mask.

    Raises:
        TypeError/ValueError: p not a float in [0, 1); ValueError: backward with no forward context left
            (see ``attnpp.nn.Module``).
    """

    def __init__(self, p=0.5):
        super().__init__()
        self.p = checks.check_probability(p, "p")
        self.last_seed = None

    @locked
    def forward(self, input, *, seed=None):
        input = checks.check_array(input, "input")
        dropping = self.training and self.p > 0
        seed = checks.check_seed(seed, used=dropping)
        seed = seed if dropping else None  # (the context's "no dropout")
        out = F.dropout(input, self.p, dropping, seed=seed)  # (state changes only once this succeeded)
        self.last_seed = seed
        self._save_context(out_shape=input.shape, dtype=input.dtype, seed=seed)
        return out

    @locked
    def backward(self, grad_output):
        seed = self._consume_context(grad_output)["seed"]  # (not last_seed: another thread may have run since)
        if seed is None:
            return grad_output
        return F.dropout_backward(grad_output, self.p, seed)

    def extra_repr(self):
        return f"p={self.p}"
