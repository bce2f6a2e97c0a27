"""Optimizers with PyTorch's update rules, run in the C++ core on each parameter's buffers in place, one call
and one parallel loop for all the parameters of a group (of a dtype), as PyTorch's foreach implementations.

As in ``torch.optim``: parameters in ``param_groups`` (a list of dicts holding ``params`` and the
hyper-parameters, which may be changed between steps, as learning-rate schedules do), per-parameter ``state``,
``state_dict()``/``load_state_dict()`` for checkpoints, ``zero_grad(set_to_none=True)``. Parameters whose
``grad`` is None are skipped by ``step`` (no update, no state change).

Half-precision parameters (float16, bfloat16) follow PyTorch's rule: their state (momentum, moments) is kept in
the parameter's dtype, and each update is computed in float32 and rounded once into the parameter and its state.
``master_weights=True`` is the usual mixed-precision recipe instead: the optimizer keeps a float32 copy of each
half-precision parameter (``state["master_param"]``) and float32 state, updates the copy from the gradient read
in float32, and writes the copy back rounded to the parameter's dtype; small updates then accumulate instead of
being rounded away. Loss scaling is left to the caller, as in PyTorch (scale the loss's gradient, unscale
``p.grad`` before ``step``).
"""
import copy
import numbers

import numpy as np

from . import _core
from ._checks import check_bool, check_hyper, is_half, is_real
from .nn import Parameter
from .nn.module import to_numpy


class Optimizer:
    """Base class, as ``torch.optim.Optimizer``: ``param_groups``, ``state``, ``zero_grad``, ``state_dict``,
    ``load_state_dict``, ``add_param_group``.

    Args:
        params: an iterable of ``attnpp.nn.Parameter``, or of dicts ``{"params": [...], "lr": ..., ...}`` (one
            parameter group each, its own hyper-parameters overriding the defaults).
        defaults (dict): the hyper-parameters of groups that do not set them.
        master_weights (bool): keep float32 copies of half-precision parameters and update those (module
            docstring). Default: False.
    """

    def __init__(self, params, defaults, master_weights=False):
        self.master_weights = check_bool(master_weights, "master_weights")
        if isinstance(params, (Parameter, np.ndarray, dict)) or not hasattr(params, "__iter__"):
            hint = " (pass layer.parameters())" if hasattr(params, "parameters") else ""
            raise TypeError(f"params: expected an iterable of attnpp.nn.Parameter or of dicts, got "
                            f"{type(params).__name__}{hint}")
        groups = list(params)
        if not groups:
            raise ValueError("params: optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.defaults = dict(defaults)
        self._check_group(self.defaults)
        self.param_groups = []
        self.state = {}  # {Parameter: {name: value}}
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, param_group):
        """Add a group of parameters with its own hyper-parameters (the defaults fill the others), as PyTorch.

        Raises:
            TypeError: a group that is not a dict, parameters that are not ``attnpp.nn.Parameter``, a
                hyper-parameter of the wrong type.
            ValueError: a parameter already in a group (it would be updated twice per step), an empty group, a
                hyper-parameter out of range, an unknown one.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group: expected a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        params = [params] if isinstance(params, Parameter) else list(params) if params is not None else []
        if not params:
            raise ValueError("params: optimizer got an empty parameter list")
        for p in params:
            if not isinstance(p, Parameter):
                raise TypeError(f"params: expected attnpp.nn.Parameter, got {type(p).__name__}")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params}) != len(params) or seen & {id(p) for p in params}:
            raise ValueError("params: a parameter appears more than once (it would be updated twice per step)")
        unknown = set(param_group) - set(self.defaults) - {"params"}
        if unknown:
            raise ValueError(f"param_group: unknown hyper-parameters {sorted(unknown)} for {type(self).__name__} "
                             f"(it has {sorted(self.defaults)})")
        group = dict(self.defaults, **{k: v for k, v in param_group.items() if k != "params"})
        self._check_group(group)
        group["params"] = params
        self.param_groups.append(group)

    def _check_group(self, group):
        """TypeError/ValueError for a hyper-parameter of ``group`` out of its domain (run at each step too, as
        a schedule may have changed them)."""
        for name in ("lr", "momentum", "dampening", "weight_decay", "eps"):
            if name in group:
                check_hyper(group[name], name)

    def zero_grad(self, set_to_none=True):
        """Reset every parameter's gradient: to None (default, as PyTorch; ``step`` then skips the parameter
        until a backward gives it a gradient), or to zeros in place with ``set_to_none=False``."""
        for group in self.param_groups:
            for p in group["params"]:
                p.zero_grad(set_to_none)

    def _master(self, p):
        """Whether ``p`` is updated through a float32 master copy."""
        return self.master_weights and is_half(p.dtype)

    def _grouped(self):
        """Yield (group, params, grads, states) for each group and dtype, over the parameters that have a
        gradient, after checking the group: ``params`` and ``grads`` the arrays the update reads and writes in
        place, the parameter's own, or with master weights its float32 copy (created on its first step) and the
        gradient read in float32; one list of each per dtype, for one call of the kernel over them all (PyTorch's
        foreach). The copies are written back into their parameters, rounded, when the caller's update of the
        group is done (the next item)."""
        for group in self.param_groups:
            self._check_group(group)
            by_dtype, masters = {}, []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.setdefault(p, {})
                if self._master(p):
                    if "master_param" not in state:
                        state["master_param"] = p.data.astype(np.float32)
                    param, grad = state["master_param"], p.grad.astype(np.float32)
                    masters.append(p)
                else:
                    param, grad = p.data, p.grad
                lists = by_dtype.setdefault(param.dtype, ([], [], []))
                for items, item in zip(lists, (param, grad, state)):
                    items.append(item)
            for params, grads, states in by_dtype.values():
                yield group, params, grads, states
            for p in masters:
                p.data[...] = self.state[p]["master_param"]

    def state_dict(self):
        """The optimizer's state as PyTorch lays it out: ``{"state": {index: {name: value}}, "param_groups":
        [{hyper-parameters..., "params": [index, ...]}]}``, parameters numbered in group order. The state's
        arrays are the optimizer's own (as PyTorch's tensors): copy or pickle the dict to keep a snapshot."""
        index, groups = {}, []
        for group in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(dict({k: v for k, v in group.items() if k != "params"}, params=ids))
        state = {index[id(p)]: s for p, s in self.state.items() if s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Load a ``state_dict()`` (this optimizer's, or one of the same layout; arrays or torch tensors),
        copying its values: hyper-parameters per group, and each parameter's state in the parameter's dtype.

        Raises:
            TypeError: not a dict with "state" and "param_groups".
            ValueError: another number of groups or of parameters in a group, a state array of another shape than
                its parameter's.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError("state_dict: expected a dict with 'state' and 'param_groups' (an optimizer's "
                            "state_dict())")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(len(s["params"]) != len(g["params"])
                                                       for s, g in zip(saved, self.param_groups)):
            raise ValueError(f"state_dict: its parameter groups have sizes {[len(s['params']) for s in saved]}, "
                             f"this optimizer's {[len(g['params']) for g in self.param_groups]}")
        params = {i: p for s, g in zip(saved, self.param_groups) for i, p in zip(s["params"], g["params"])}
        state = {}
        for i, values in state_dict["state"].items():
            p = params[i]
            state[p] = {}
            for name, value in values.items():
                if name == "step":
                    state[p][name] = int(to_numpy(value, name) if not isinstance(value, numbers.Number) else value)
                    continue
                value = to_numpy(value, f"state[{i}][{name!r}]")
                if value.shape != p.shape:
                    raise ValueError(f"state_dict['state'][{i}][{name!r}]: expected shape {p.shape}, got "
                                     f"{value.shape}")
                state[p][name] = np.array(value, dtype=np.float32 if self._master(p) else p.dtype, order="C")
        groups = [dict(copy.deepcopy({k: v for k, v in s.items() if k != "params"}), params=g["params"])
                  for s, g in zip(saved, self.param_groups)]
        for group in groups:
            self._check_group(group)
        self.state, self.param_groups = state, groups

    def __repr__(self):
        text = f"{type(self).__name__} ("  # (PyTorch's layout, line for line)
        for i, group in enumerate(self.param_groups):
            text += f"\nParameter Group {i}\n"
            text += "".join(f"    {key}: {group[key]}\n" for key in sorted(group) if key != "params")
        return text + ")"


class SGD(Optimizer):
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    ``d = grad + weight_decay * param``; with momentum ``buf = momentum * buf + (1 - dampening) * d`` (``buf = d``
    on the first step) and ``d = buf`` (or ``d + momentum * buf`` with Nesterov); ``param -= lr * d``.

    Args:
        params (iterable of Parameter, or of dicts): e.g. ``model.parameters()``, or parameter groups.
        lr (float): learning rate. Default: 1e-3. momentum (float): Default 0. dampening (float): Default 0.
        weight_decay (float): L2 penalty. Default 0. nesterov (bool): Default False.
        master_weights (bool): float32 copies of half-precision parameters (module docstring). Default False.

    State per parameter: ``momentum_buffer`` (with momentum); ``master_param`` with master weights.

    Raises:
        ValueError: a negative or non-finite hyper-parameter, an empty parameter list or one with a parameter
            twice, Nesterov without momentum or with dampening.
        TypeError: something other than attnpp parameters, a hyper-parameter that is not a number.
    """

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 master_weights=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), master_weights)

    def _check_group(self, group):
        super()._check_group(group)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def step(self):
        """Update every parameter that has a gradient."""
        for group, params, grads, states in self._grouped():
            steps = [1 if "momentum_buffer" not in state else 2 for state in states]  # (1: the buffer's first)
            if group["momentum"] != 0:
                for param, state in zip(params, states):
                    state.setdefault("momentum_buffer", np.zeros(param.shape, param.dtype))
            _core.sgd_step(params, grads, [state.get("momentum_buffer") for state in states], steps,
                           float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                           float(group["weight_decay"]), bool(group["nesterov"]))


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), as
    ``torch.optim.AdamW``.

    ``param *= 1 - lr * weight_decay``; ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v + (1 - beta2) g^2``;
    ``param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

    Args:
        params (iterable of Parameter, or of dicts): e.g. ``model.parameters()``, or parameter groups.
        lr (float): Default 1e-3. betas (float, float): Default (0.9, 0.999). eps (float): Default 1e-8.
        weight_decay (float): Default 1e-2.
        master_weights (bool): float32 copies of half-precision parameters (module docstring). Default False.

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq``; ``master_param`` with master weights.

    Raises:
        ValueError: a negative or non-finite hyper-parameter, betas outside [0, 1), an empty parameter list or
            one with a parameter twice.
        TypeError: something other than attnpp parameters, hyper-parameters that are not numbers.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, master_weights=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), master_weights)

    def _check_group(self, group):
        super()._check_group(group)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)):
            raise TypeError(f"betas: expected two floats in [0, 1), got {type(betas).__name__}")
        if len(betas) != 2:
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        for b in betas:
            if not is_real(b):
                raise TypeError(f"betas: expected two floats in [0, 1), got {betas!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas}")

    def step(self):
        """Update every parameter that has a gradient."""
        for group, params, grads, states in self._grouped():
            for param, state in zip(params, states):
                if "step" not in state:
                    state.update(step=0, exp_avg=np.zeros(param.shape, param.dtype),
                                 exp_avg_sq=np.zeros(param.shape, param.dtype))
                state["step"] += 1
            beta1, beta2 = group["betas"]
            _core.adamw_step(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                             [s["step"] for s in states], float(group["lr"]), float(beta1), float(beta2),
                             float(group["eps"]), float(group["weight_decay"]))
