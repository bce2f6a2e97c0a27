from .. import functional as F
from .._random import generator
from .module import Module


class Embedding(Module):
    """A lookup table of vectors, as ``torch.nn.Embedding``: ``output = weight[input]``.

    Args:
        num_embeddings (int): V, the number of rows (e.g. the vocabulary size).
        embedding_dim (int): E, the width of each row.
        dtype: float32 (default) or float64.

    Parameters:
        weight: (V, E), initialised N(0, 1) like PyTorch.

    Shapes:
        input (*) integer indices in [0, V) -> output (*, E); ``backward(grad_output (*, E))`` accumulates into
        ``weight.grad`` (repeated indices add up) and returns None (indices have no gradient).

    Raises:
        TypeError: non-integer indices. IndexError: an index outside [0, V). ValueError: backward before
        forward, or a grad_output of another shape.
    """

    def __init__(self, num_embeddings, embedding_dim, dtype=None):
        super().__init__(dtype)
        self.num_embeddings = F.check_int(num_embeddings, "num_embeddings")
        self.embedding_dim = F.check_int(embedding_dim, "embedding_dim")
        self.register_parameter("weight", (self.num_embeddings, self.embedding_dim))
        self.weight.data[...] = generator().standard_normal(self.weight.shape)
        self._input = None

    def forward(self, input):
        out = F.embedding(input, self.weight.data)
        self._input = input
        return out

    def backward(self, grad_output):
        if self._input is None:
            raise ValueError("backward: call forward first (backward runs once per forward)")
        F.check_array(grad_output, "grad_output", dtype=self.dtype)
        want = self._input.shape + (self.embedding_dim,)
        if grad_output.shape != want:
            raise ValueError(f"grad_output: expected shape {want}, got {grad_output.shape}")
        F.embedding_backward(grad_output, self._input, self.weight.grad)
        self._input = None

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"
