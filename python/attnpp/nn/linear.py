import math

from .. import _checks as checks
from ..functional.training import linear_backward_unchecked, linear_unchecked
from .._seeds import generator
from .module import Module, locked


class Linear(Module):
    """``y = x W^T + b``, as ``torch.nn.Linear``.

    Args:
        in_features (int): Fin, the width of each input row.
        out_features (int): Fout, the width of each output row.
        bias (bool): learn an additive bias. Default: True.
        dtype: float32 (default), float64, float16 or bfloat16 (NumPy, ml_dtypes or torch dtype, or its name).

    Parameters:
        weight: (Fout, Fin), initialised U(-1/sqrt(Fin), 1/sqrt(Fin)) like PyTorch.
        bias: (Fout,), same initialisation; absent when ``bias=False``.

    Shapes:
        input (*, Fin) -> output (*, Fout); ``backward(grad_output (*, Fout))`` -> grad_input (*, Fin).

    Raises:
        TypeError: input of another dtype than the layer's. ValueError: last dimension not Fin;
        backward with no forward context left (one per forward, consumed last-in first-out: see ``Module``).
    """

    def __init__(self, in_features, out_features, bias=True, dtype=None):
        super().__init__(dtype)
        self.in_features = checks.check_int(in_features, "in_features")
        self.out_features = checks.check_int(out_features, "out_features")
        self.register_parameter("weight", (out_features, in_features))
        self.bias = self.register_parameter("bias", (out_features,)) if checks.check_bool(bias, "bias") else None
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        for p in self.parameters():
            p.data[...] = generator().uniform(-bound, bound, p.shape)

    @locked
    def forward(self, input):
        """input (*, Fin) -> (*, Fout)."""
        input = checks.check_array(input, "input", min_ndim=1, dtype=self.dtype)
        if input.shape[-1] != self.in_features:
            raise ValueError(f"input: last dimension must be in_features={self.in_features}, got shape "
                             f"{input.shape}")
        out = linear_unchecked(input, self.weight.data, None if self.bias is None else self.bias.data)
        self._save_context(input=input, out_shape=out.shape)
        return out

    @locked
    def backward(self, grad_output):
        """grad_output (*, Fout) -> grad_input (*, Fin); accumulates into weight.grad and bias.grad."""
        x = self._consume_context(grad_output)["input"]
        return linear_backward_unchecked(grad_output, x, self.weight.data, self.weight.grad_buffer(),
                                  None if self.bias is None else self.bias.grad_buffer())

    def extra_repr(self):
        return self._format_args(f"in_features={self.in_features}", f"out_features={self.out_features}",
                                 f"bias={self.bias is not None}")
