"""A trainable array and its gradient, as ``torch.nn.Parameter`` on NumPy."""
import numpy as np

from .._checks import FLOAT_NAMES, is_float


class Parameter:
    """A trainable array with its gradient beside it.

    ``data`` is a NumPy array (float32, float64, float16 or bfloat16) that the layers and optimizers update in
    place; ``grad`` is None until a backward accumulates into it (as in PyTorch), then an array of the same shape
    and dtype. Assigning an array to ``data`` (or ``grad``) copies it into the existing buffer, so views taken
    earlier (``state_dict()``'s, for instance) stay valid. ``np.asarray(p)`` and ``p.numpy()`` give ``data``
    without a copy. Copies (``copy.deepcopy``, pickle) share no memory with the original.

    Args:
        data (array_like): the initial value, copied; a float32, float64, float16 or bfloat16 array.

    Raises:
        TypeError: data that is not such an array; an assignment of something that is not an array
        of real numbers. ValueError: an assignment of another shape.
    """

    def __init__(self, data):
        data = np.array(data, copy=True, order="C")
        if not is_float(data.dtype):
            raise TypeError(f"data: expected dtype {FLOAT_NAMES}, got {data.dtype}")
        self._data, self._grad = data, None

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data[...] = _checked(value, self._data, "data")

    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, value):
        if value is None:
            self._grad = None
        elif self._grad is None:
            self._grad = np.array(_checked(value, self._data, "grad"), dtype=self.dtype, order="C")
        else:
            self._grad[...] = _checked(value, self._data, "grad")

    @property
    def shape(self):
        return self._data.shape

    @property
    def dtype(self):
        return self._data.dtype

    def grad_buffer(self):
        """``grad``, created zeroed first if it is None: where a backward accumulates (+=)."""
        if self._grad is None:
            self._grad = np.zeros_like(self._data)
        return self._grad

    def zero_grad(self, set_to_none=True):
        """Reset the gradient: to None (default, as PyTorch), or to zeros in place with ``set_to_none=False``."""
        if set_to_none:
            self._grad = None
        elif self._grad is not None:
            self._grad.fill(0)

    def numpy(self):
        """``data`` itself (no copy), as ``torch.Tensor.numpy`` on a parameter's detached value."""
        return self._data

    def __array__(self, dtype=None, copy=None):
        if copy:
            return np.array(self._data, dtype=dtype, copy=True)
        return self._data if dtype is None else self._data.astype(dtype, copy=False)

    def __repr__(self):
        return f"Parameter containing:\n{self._data!r}"


def _checked(value, like, name):
    """``value`` as an array of ``like``'s shape, of real numbers castable to its dtype, else TypeError/ValueError."""
    array = np.asarray(value)
    if array.dtype.kind not in "fiub" and not is_float(array.dtype):
        raise TypeError(f"{name}: expected an array of real numbers, got "
                        f"{array.dtype if isinstance(value, np.ndarray) else type(value).__name__}")
    if array.shape != like.shape:
        raise ValueError(f"{name}: expected shape {like.shape}, got {array.shape}")
    if not np.can_cast(array.dtype, like.dtype, "same_kind"):
        raise TypeError(f"{name}: cannot cast {array.dtype} to {like.dtype}")
    return array
