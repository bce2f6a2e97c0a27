"""The layer base class: parameters, gradients, modes and state dicts, as in torch.nn.Module."""
import functools
import threading
from collections.abc import Mapping

import numpy as np

from .._core import Parameter
from ..functional import check_array

_DTYPES = {np.dtype(np.float32): np.float32, np.dtype(np.float64): np.float64}


def check_dtype(dtype):
    """``dtype`` (None means float32) as a NumPy float dtype, else TypeError."""
    try:
        dt = np.dtype(np.float32 if dtype is None else getattr(dtype, "numpy_dtype", dtype))
    except TypeError:
        dt = None
    if dt is None and dtype is not None and str(dtype) in ("torch.float32", "torch.float64"):
        dt = np.dtype(str(dtype)[6:])
    if dt not in _DTYPES:
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    return dt


def to_numpy(value, name):
    """A state-dict value (NumPy array or torch tensor, without importing torch) as a NumPy array."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"state_dict[{name!r}]: expected an array or tensor, got {type(value).__name__}")
    return value


def _serialized(method):
    """``method`` run under the layer's lock (see ``Module``)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    call.serialized = True
    return call


class Module:
    """Base class of attnpp's layers.

    Subclasses create their parameters with ``self.register_parameter(name, shape)`` and sub-layers by plain
    attribute assignment, implement ``forward(...)`` and ``backward(grad_output)``; ``backward`` returns the
    gradients of the inputs and accumulates (+=) into each parameter's ``grad``.

    Threads: a layer may be called from several Python threads. Its ``forward`` and ``backward`` calls take turns
    (a lock per layer; different layers run at the same time, the core releasing the GIL), so gradients
    accumulate without lost updates; and each thread's ``backward`` uses what that thread's last ``forward``
    saved, whatever other threads did in between.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("forward", "backward"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "serialized", False):
                setattr(cls, name, _serialized(method))

    def __init__(self, dtype=None):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_lock", threading.RLock())
        object.__setattr__(self, "_local", threading.local())  # holds _ctx, one per thread
        self.dtype = check_dtype(dtype)
        self.training = True

    @property
    def _ctx(self):
        """What this thread's last forward saved for its backward (None when consumed or never made)."""
        return getattr(self._local, "ctx", None)

    @_ctx.setter
    def _ctx(self, value):
        self._local.ctx = value

    def __getstate__(self):  # (copy and pickle: a lock and thread-local state are not copied)
        state = self.__dict__.copy()
        del state["_lock"], state["_local"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        object.__setattr__(self, "_lock", threading.RLock())
        object.__setattr__(self, "_local", threading.local())

    def __setattr__(self, name, value):
        if isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def register_parameter(self, name, shape):
        """Create a zeroed parameter of ``shape`` in the layer's dtype, reachable as ``self.<name>``."""
        param = Parameter(list(shape), self.dtype)
        self._parameters[name] = param
        object.__setattr__(self, name, param)
        return param

    def register_buffer(self, name, value):
        """Keep ``value`` (copied to an ndarray) as state that is not trained, reachable as ``self.<name>``:
        it is part of ``state_dict()`` and loaded by ``load_state_dict``, like a PyTorch buffer (e.g. the
        articles' ``causal_mask``)."""
        value = np.array(to_numpy(value, name))
        self._buffers[name] = value
        object.__setattr__(self, name, value)
        return value

    def named_buffers(self, prefix=""):
        """Yield ``(name, array)`` for every buffer, own first, then sub-layers'."""
        for name, b in self._buffers.items():
            yield prefix + name, b
        for mname, m in self._modules.items():
            yield from m.named_buffers(prefix + mname + ".")

    def _named_state(self, prefix=""):
        """(name, array) of parameters and buffers in PyTorch's state-dict order."""
        for name, p in self._parameters.items():
            yield prefix + name, p.data
        for name, b in self._buffers.items():
            yield prefix + name, b
        for mname, m in self._modules.items():
            yield from m._named_state(prefix + mname + ".")

    def _consume_context(self, grad_output):
        """The context the last forward saved (a dict with the user-visible ``out_shape`` and, when it is not the
        layer's, the output ``dtype``), after checking
        ``grad_output`` against it; a refused call leaves it in place for a correct retry."""
        ctx = self._ctx
        if ctx is None:
            raise ValueError("backward: call forward first (in this thread; backward runs once per forward)")
        check_array(grad_output, "grad_output", dtype=ctx.get("dtype", self.dtype))
        if grad_output.shape != ctx["out_shape"]:
            raise ValueError(f"grad_output: expected the output's shape {ctx['out_shape']}, got "
                             f"{grad_output.shape}")
        self._ctx = None
        return ctx

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_parameters(self, prefix=""):
        """Yield ``(name, param)`` for every parameter, own first, then sub-layers', as PyTorch orders them."""
        for name, p in self._parameters.items():
            yield prefix + name, p
        for mname, m in self._modules.items():
            yield from m.named_parameters(prefix + mname + ".")

    def parameters(self):
        """Yield every parameter (``attnpp.nn.Parameter``: ``.data`` and ``.grad`` are NumPy arrays)."""
        for _, p in self.named_parameters():
            yield p

    def zero_grad(self):
        """Set every parameter's gradient to zero."""
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode=True):
        """Training mode (dropout active) for this layer and its sub-layers; returns self."""
        self.training = bool(mode)
        for m in self._modules.values():
            m.train(mode)
        return self

    def eval(self):
        """Evaluation mode (no dropout); returns self."""
        return self.train(False)

    def state_dict(self):
        """``{name: array}`` for every parameter and buffer, in PyTorch's order; the arrays share memory with
        the layer, like PyTorch's."""
        return dict(self._named_state())

    def load_state_dict(self, state_dict, strict=True):
        """Copy values from ``state_dict`` (NumPy arrays or torch tensors, e.g. a PyTorch layer's state dict).

        Every key is checked before anything is copied, so a failed load leaves the layer unchanged.

        Args:
            state_dict (Mapping[str, array]): names as in ``state_dict()`` (PyTorch's keys: parameters and
                buffers).
            strict (bool): refuse missing and unexpected keys. Default: True.

        Raises:
            ValueError: missing or unexpected keys (when strict), or a value of another shape.
            TypeError: a state_dict that is not a mapping, a value that is not an array or tensor, or not of a
            floating dtype.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        own = dict(self._named_state())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        params = dict(self.named_parameters())
        values = {}
        for name, arr in own.items():
            if name not in state_dict:
                continue
            v = to_numpy(state_dict[name], name)
            if name in params and v.dtype.kind != "f":
                raise TypeError(f"state_dict[{name!r}]: expected a floating dtype, got {v.dtype}")
            if v.shape != arr.shape:
                raise ValueError(f"state_dict[{name!r}]: expected shape {arr.shape}, got {v.shape}")
            values[name] = v
        for name, v in values.items():
            own[name][...] = v

    def __repr__(self):
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self):
        return ""
