"""Optimizers with PyTorch's update rules, run in the C++ core on each parameter's buffers in place."""
import math
import numbers

import numpy as np

from . import _core
from .nn import Parameter


class Optimizer:
    """Base class: holds the parameters (``attnpp.nn.Parameter``) and their per-parameter state."""

    def __init__(self, params, defaults):
        if isinstance(params, (Parameter, np.ndarray)) or not hasattr(params, "__iter__"):
            hint = " (pass layer.parameters())" if hasattr(params, "parameters") else ""
            raise TypeError(f"params: expected an iterable of attnpp.nn.Parameter, got {type(params).__name__}"
                            f"{hint}")
        self.params = list(params)
        if not self.params:
            raise ValueError("params: optimizer got an empty parameter list")
        for p in self.params:
            if not isinstance(p, Parameter):
                raise TypeError(f"params: expected attnpp.nn.Parameter, got {type(p).__name__}")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("params: a parameter appears more than once (it would be updated twice per step)")
        for name, value in defaults.items():
            _check_hyper(value, name)
        self.defaults = defaults
        self.state = [dict() for _ in self.params]

    def zero_grad(self):
        """Set every parameter's gradient to zero."""
        for p in self.params:
            p.zero_grad()


def _check_hyper(value, name):
    """``value`` as a finite float >= 0, else TypeError/ValueError naming ``name``."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value}")
    return float(value)


class SGD(Optimizer):
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    ``d = grad + weight_decay * param``; with momentum ``buf = momentum * buf + (1 - dampening) * d`` (``buf = d``
    on the first step) and ``d = buf`` (or ``d + momentum * buf`` with Nesterov); ``param -= lr * d``.

    Args:
        params (iterable of Parameter): e.g. ``model.parameters()``.
        lr (float): learning rate. momentum (float): Default 0. dampening (float): Default 0.
        weight_decay (float): L2 penalty. Default 0. nesterov (bool): Default False.

    Raises:
        ValueError: a negative or non-finite hyper-parameter, an empty parameter list or one with a parameter
        twice, Nesterov without momentum.
        TypeError: something other than attnpp parameters, a hyper-parameter that is not a number.
    """

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.lr, self.momentum, self.dampening = float(lr), float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)

    def step(self):
        """Update every parameter from its gradient."""
        for p, state in zip(self.params, self.state):
            first = "momentum_buffer" not in state
            if self.momentum != 0 and first:
                state["momentum_buffer"] = np.zeros(p.shape, p.dtype)
            _core.sgd_step(p.data, p.grad, state.get("momentum_buffer"), self.lr, self.momentum, self.dampening,
                           self.weight_decay, self.nesterov, first)


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), as
    ``torch.optim.AdamW``.

    ``param *= 1 - lr * weight_decay``; ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v + (1 - beta2) g^2``;
    ``param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

    Args:
        params (iterable of Parameter): e.g. ``model.parameters()``.
        lr (float): Default 1e-3. betas (float, float): Default (0.9, 0.999). eps (float): Default 1e-8.
        weight_decay (float): Default 1e-2.

    Raises:
        ValueError: a negative or non-finite hyper-parameter, betas outside [0, 1), an empty parameter list or
        one with a parameter twice.
        TypeError: something other than attnpp parameters, hyper-parameters that are not numbers.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        if not isinstance(betas, (tuple, list)):
            raise TypeError(f"betas: expected two floats in [0, 1), got {type(betas).__name__}")
        if len(betas) != 2:
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        for b in betas:
            if not isinstance(b, numbers.Real) or isinstance(b, (bool, np.bool_)):
                raise TypeError(f"betas: expected two floats in [0, 1), got {betas!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas}")
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), tuple(map(float, betas)), float(eps), \
            float(weight_decay)

    def step(self):
        """Update every parameter from its gradient."""
        for p, state in zip(self.params, self.state):
            if not state:
                state.update(step=0, exp_avg=np.zeros(p.shape, p.dtype), exp_avg_sq=np.zeros(p.shape, p.dtype))
            state["step"] += 1
            _core.adamw_step(p.data, p.grad, state["exp_avg"], state["exp_avg_sq"], self.lr, *self.betas, self.eps,
                             self.weight_decay, state["step"])
