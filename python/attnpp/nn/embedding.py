from .. import _checks as checks
from .. import functional as F
from .._seeds import generator
from .module import Module, locked


class Embedding(Module):
    """A lookup table of vectors, as ``torch.nn.Embedding``: ``output = weight[input]``.

    Args:
        num_embeddings (int): V, the number of rows (e.g. the vocabulary size).
        embedding_dim (int): E, the width of each row.
        dtype: float32 (default), float64, float16 or bfloat16.

    Parameters:
        weight: (V, E), initialised N(0, 1) like PyTorch.

    Shapes:
        input (*) integer indices in [0, V) -> output (*, E); ``backward(grad_output (*, E))`` accumulates into
        ``weight.grad`` (repeated indices add up) and returns None (indices have no gradient).

    Raises:
        TypeError: non-integer indices. IndexError: an index outside [0, V). ValueError: backward with no
            forward context left (see ``attnpp.nn.Module``), or a grad_output of another shape.
    """

    def __init__(self, num_embeddings, embedding_dim, dtype=None):
        super().__init__(dtype)
        self.num_embeddings = checks.check_int(num_embeddings, "num_embeddings")
        self.embedding_dim = checks.check_int(embedding_dim, "embedding_dim")
        self.register_parameter("weight", (self.num_embeddings, self.embedding_dim))
        self.weight.data[...] = generator().standard_normal(self.weight.shape)

    @locked
    def forward(self, input):
        out = F.embedding(input, self.weight.data)
        self._save_context(input=input, out_shape=out.shape)
        return out

    @locked
    def backward(self, grad_output):
        F.embedding_backward(grad_output, self._consume_context(grad_output)["input"], self.weight.grad_buffer())

    def extra_repr(self):
        return self._format_args(self.num_embeddings, self.embedding_dim)
