"""The layer base class: parameters, gradients, modes and state dicts, as in torch.nn.Module."""
import functools
import threading
import warnings
from collections import namedtuple
from collections.abc import Mapping

import numpy as np

from .. import _checks as checks
from ..grad_mode import is_grad_enabled
from .parameter import Parameter

# what load_state_dict(strict=False) returns, as PyTorch's
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

# a layer with this many contexts saved and not consumed, in one thread, warns once (forwards outside no_grad
# whose backward never comes: evaluation loops, generation)
PENDING_CONTEXTS_WARNING = 1000


def to_numpy(value, name):
    """A state-dict value (NumPy array or torch tensor, without importing torch) as a NumPy array."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        value = checks.bfloat16_tensor_as_ndarray(value) if str(value.dtype) == "torch.bfloat16" else value.numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"state_dict[{name!r}]: expected an array or tensor, got {type(value).__name__}")
    return value


def locked(method):
    """Decorator for a layer's ``forward`` and ``backward``: the call runs under the layer's lock, and a call that
    raises leaves no context saved by it, in the layer or its sub-layers.

    Why: a layer may be shared between Python threads, and its saved contexts and parameters (the gradients a
    backward accumulates with ``+=``) must not be changed by two threads at once: a lost update would lose a
    gradient. One lock per layer (reentrant: a layer's forward may call its own methods), so different layers
    still run at the same time, the core releasing the GIL. The clean-up on error serves composite layers: a
    forward that fails half-way, after its sub-layers saved their contexts, would otherwise leave contexts that
    no backward consumes (a backward only consumes contexts, so for it the clean-up does nothing).

    Every ``forward`` and ``backward`` of attnpp's layers carries it; a subclass of ``Module`` that may be called
    from several threads writes ``@locked`` on its own.
    """
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            depths = [(m, len(m._contexts)) for m in self.modules()]
            try:
                return method(self, *args, **kwargs)
            except BaseException:
                for m, depth in depths:
                    del m._contexts[depth:]
                raise
    return call


class Module:
    """Base class of attnpp's layers.

    Subclasses create their parameters with ``self.register_parameter(name, shape)`` and sub-layers by plain
    attribute assignment, implement ``forward(...)`` and ``backward(grad_output)``; ``backward`` returns the
    gradients of the inputs and accumulates (+=) into each parameter's ``grad``.

    Contexts (the rule of every layer): each forward run with gradients enabled (outside ``attnpp.no_grad()``, in
    training and evaluation mode alike, as PyTorch records its graph in both) saves what its backward needs as a
    context of its own. ``backward(grad_output)`` consumes the most recent context not yet consumed: backwards
    run in the reverse order of the forwards, as reverse-mode differentiation runs, so a layer applied twice
    (weight sharing) gets both contributions summed in its parameters' ``grad``. A backward with no context left,
    or a ``grad_output`` whose shape is not its context's output's, raises ValueError (the context stays for a
    correct retry). Forwards under ``attnpp.no_grad()`` save nothing and leave the saved contexts as they are.
    Contexts that no backward consumes are memory held: a layer with 1000 of them in one thread warns once.

    Threads: a layer may be called from several Python threads. Its ``forward`` and ``backward`` calls take turns
    (a lock per layer, taken by the ``@locked`` written on each of them; different layers run at the same time,
    the core releasing the GIL), so gradients accumulate without lost updates; and each thread has its own
    contexts: a thread's ``backward`` consumes what that thread's forwards saved, whatever other threads did in
    between. A subclass gets the lock by writing ``@locked`` on its ``forward`` and ``backward`` (see
    ``locked``).
    """

    def __init__(self, dtype=None):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_lock", threading.RLock())
        object.__setattr__(self, "_local", threading.local())  # holds this thread's contexts
        self.dtype = checks.check_dtype(dtype)
        self.training = True

    @property
    def _contexts(self):
        """This thread's saved contexts, oldest first (see "Contexts" in the class docstring)."""
        local = self._local
        if not hasattr(local, "contexts"):
            local.contexts, local.warned = [], False
        return local.contexts

    def _save_context(self, **ctx):
        """Save a context for the backward (a dict with the user-visible ``out_shape`` and, when it is not the
        layer's, the output ``dtype``), unless gradients are disabled."""
        if not is_grad_enabled():
            return
        contexts = self._contexts
        contexts.append(ctx)
        if len(contexts) >= PENDING_CONTEXTS_WARNING and not self._local.warned:
            self._local.warned = True
            warnings.warn(f"{type(self).__name__}: {len(contexts)} forwards saved a context that no backward "
                          f"consumed; run forwards that need no backward under attnpp.no_grad()",
                          RuntimeWarning, stacklevel=5)

    def __getstate__(self):  # (copy and pickle: a lock and contexts are not copied)
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
        try:
            data = np.zeros(shape, self.dtype)
        except ValueError:  # (NumPy's "array is too big": more bytes than an address space holds)
            raise MemoryError(f"Unable to allocate parameter {name!r} with shape {tuple(shape)} and data type "
                              f"{self.dtype}") from None
        param = Parameter(data)
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

    def _consume_context(self, grad_output, number_for_0d=False):
        """The most recent context not yet consumed, after checking ``grad_output`` against it: an array of the
        context's ``out_shape`` and dtype (see ``_save_context``), or with ``number_for_0d`` (a loss's
        ``backward(1.0)``) a real number when the output is 0-d. A refused call leaves the context in place for a
        correct retry."""
        contexts = self._contexts
        if not contexts:
            raise ValueError(f"{type(self).__name__}.backward: no forward context left to consume in this thread "
                             f"(each backward consumes one forward run outside attnpp.no_grad(), most recent "
                             f"first)")
        ctx = contexts[-1]
        out_shape = ctx["out_shape"]
        if number_for_0d and checks.is_real(grad_output):
            got = () if out_shape == () else "a scalar"
        else:
            checks.check_array(grad_output, "grad_output", dtype=ctx.get("dtype", self.dtype))
            got = grad_output.shape
        if got != out_shape:
            raise ValueError(f"grad_output: expected the output's shape {out_shape} (of the most recent forward not "
                             f"yet consumed), got {got}")
        contexts.pop()
        return ctx

    def modules(self):
        """Yield this layer and every sub-layer, recursively (as ``torch.nn.Module.modules``)."""
        yield self
        for m in self._modules.values():
            yield from m.modules()

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

    def zero_grad(self, set_to_none=True):
        """Reset every parameter's gradient: to None (default, as PyTorch), or to zeros with
        ``set_to_none=False``."""
        for p in self.parameters():
            p.zero_grad(set_to_none)

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

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)``, two lists of names, as PyTorch's (empty when
                strict, which raises instead).

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
            if name in params and not checks.is_float(v.dtype) and v.dtype.kind != "f":
                raise TypeError(f"state_dict[{name!r}]: expected a floating dtype, got {v.dtype}")
            if v.shape != arr.shape:
                raise ValueError(f"state_dict[{name!r}]: expected shape {arr.shape}, got {v.shape}")
            values[name] = v
        for name, v in values.items():
            own[name][...] = v
        return IncompatibleKeys(missing, unexpected)

    def __repr__(self):
        """PyTorch's layout: the layer's own arguments, then each sub-layer on its own line, indented."""
        children = [f"({name}): " + repr(m).replace("\n", "\n  ") for name, m in self._modules.items()]
        extra = self.extra_repr()
        if not children:
            return f"{type(self).__name__}({extra})"
        lines = (extra.split("\n") if extra else []) + children
        return f"{type(self).__name__}(\n  " + "\n  ".join(lines) + "\n)"

    def extra_repr(self):
        """The layer's arguments for ``repr``: see ``_format_args``."""
        return ""

    def _format_args(self, *required, **optional):
        """``"a, b, name=value, ..."``: the ``required`` values, then each ``optional`` given as ``(value,
        default)`` whose value differs from its default, and the dtype when it is not float32."""
        parts = [f"{v}" for v in required]
        parts += [f"{name}={value!r}" for name, (value, default) in optional.items() if value != default]
        if self.dtype != np.float32:
            parts.append(f"dtype={self.dtype}")
        return ", ".join(parts)
