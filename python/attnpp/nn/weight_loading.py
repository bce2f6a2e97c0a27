"""Loading an attention layer's weights from other layouts: separate projections (``nn.Linear``'s (out, in) or
``x @ W``'s (in, out)), fused [q | k | v] and [k | v] rows, lists of heads, and the reference articles' state
dicts, each key through the loader that fits it (``_ARTICLE_LAYOUTS``, the one table of them).

``WeightLoading`` is a mixin of ``attnpp.nn.Attention``: it reads the layer's ``q_proj``, ``k_proj``, ``v_proj``,
``out_proj`` (``attnpp.nn.Linear`` or None), ``sinks``, ``num_heads``, ``qk_dim``, ``v_dim``, ``embed_dim``,
``kv_dim``, ``causal`` and ``context_length``.

Shape letters: E embed_dim, H heads, d a head's width, n an article's context size.
"""
from collections.abc import Mapping

import numpy as np

from .module import IncompatibleKeys, to_numpy

_LAYOUTS = ("linear", "matmul")

# The reference articles' state-dict layouts that ``Attention.load_state_dict`` reads (besides attnpp's own keys):
# the one table of them. Per layout: the article, its classes, and
#   keys: article key -> (loader, argument, targets): the value goes to ``self.<loader>(<argument>=value)``
#         (with the loader's fixed options, ``_LOADER_OPTIONS``); ``targets`` are the attnpp parameters it fills,
#         and the key is expected exactly when the layer has them (a bias on or off, an output projection or
#         not). "{h}" in a key stands for each head 0 .. num_heads - 1 (the list of heads goes to load_heads).
#   mask: (buffer name, its leading singleton dimensions) of the article's causal-mask buffer, or None. It is
#         checked, not ignored: it must be the triangle the layer's ``causal`` implies over the buffer's size
#         (see ``Attention._check_mask_buffer``); a causal layer expects it.
_QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
_QKV_BIAS = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
_ARTICLE_LAYOUTS = (
    {"article": "003", "classes": "SingleHeadAttention, MultiHeadAttention, BidirectionalAttention, CausalAttention",
     "keys": {"Wqkv.weight": ("load_fused_qkv", "weight", _QKV),            # (2 qk_dim + v_dim, E), rows [q|k|v]
              "Wqkv.bias": ("load_fused_qkv", "bias", _QKV_BIAS),
              "Wo.weight": ("load_projections", "out", ("out_proj.weight",)),
              "Wo.bias": ("load_projections", "out_bias", ("out_proj.bias",))},
     "mask": ("causal_mask", (1, 1))},                                      # bool (1, 1, n, n)
    {"article": "003", "classes": "CausalCrossAttention",
     "keys": {"Wq.weight": ("load_projections", "q", ("q_proj.weight",)),
              "Wq.bias": ("load_projections", "q_bias", ("q_proj.bias",)),
              "Wkv.weight": ("load_fused_kv", "weight", _QKV[1:]),          # (qk_dim + v_dim, kv_dim), rows [k|v]
              "Wkv.bias": ("load_fused_kv", "bias", _QKV_BIAS[1:]),
              "Wo.weight": ("load_projections", "out", ("out_proj.weight",)),
              "Wo.bias": ("load_projections", "out_bias", ("out_proj.bias",))},
     "mask": ("causal_mask", (1, 1))},
    {"article": "004", "classes": "MultiHeadAttention",
     "keys": {"W_query.weight": ("load_projections", "q", _QKV[:1]),
              "W_key.weight": ("load_projections", "k", _QKV[1:2]),
              "W_value.weight": ("load_projections", "v", _QKV[2:]),
              "W_query.bias": ("load_projections", "q_bias", _QKV_BIAS[:1]),
              "W_key.bias": ("load_projections", "k_bias", _QKV_BIAS[1:2]),
              "W_value.bias": ("load_projections", "v_bias", _QKV_BIAS[2:]),
              "out_proj.weight": ("load_projections", "out", ("out_proj.weight",)),
              "out_proj.bias": ("load_projections", "out_bias", ("out_proj.bias",))},
     "mask": ("mask", ())},                                                 # float (n, n)
    {"article": "000", "classes": "SelfAttention, CausalSelfAttention, MultiheadAttention",
     "keys": {"w_q.weight": ("load_projections", "q", _QKV[:1]),
              "w_k.weight": ("load_projections", "k", _QKV[1:2]),
              "w_v.weight": ("load_projections", "v", _QKV[2:]),
              "w_q.bias": ("load_projections", "q_bias", _QKV_BIAS[:1]),
              "w_k.bias": ("load_projections", "k_bias", _QKV_BIAS[1:2]),
              "w_v.bias": ("load_projections", "v_bias", _QKV_BIAS[2:]),
              "out_proj.weight": ("load_projections", "out", ("out_proj.weight",)),
              "out_proj.bias": ("load_projections", "out_bias", ("out_proj.bias",))},
     "mask": ("causal_mask", ())},                                          # float (n, n)
    {"article": "002", "classes": "SelfAttention, CrossAttention",
     "keys": {"W_query": ("load_projections/matmul", "q", _QKV[:1]),        # (in, out): x @ W
              "W_key": ("load_projections/matmul", "k", _QKV[1:2]),
              "W_value": ("load_projections/matmul", "v", _QKV[2:])},
     "mask": None},
    {"article": "002", "classes": "MultiHeadAttentionWrapper",
     "keys": {"heads.{h}.W_query": ("load_heads", "q", _QKV[:1]),           # head h: (in, d), x @ W
              "heads.{h}.W_key": ("load_heads", "k", _QKV[1:2]),
              "heads.{h}.W_value": ("load_heads", "v", _QKV[2:])},
     "mask": None},
)
_ABSENT = object()  # a fused weight that load_state_dict(strict=False) was not given (its bias was)
# a loader name -> (method, fixed keyword arguments)
_LOADER_OPTIONS = {"load_projections": ("load_projections", {}), "load_fused_qkv": ("load_fused_qkv", {}),
                   "load_fused_kv": ("load_fused_kv", {}),
                   "load_projections/matmul": ("load_projections", {"layout": "matmul"}),
                   "load_heads": ("load_heads", {"layout": "matmul"})}


def _as_array(value, name):
    """A weight given to a ``load_*`` method (NumPy array or torch tensor) as a floating ndarray, else TypeError
    naming the argument."""
    if not isinstance(value, np.ndarray) and not (hasattr(value, "detach") and hasattr(value, "cpu")):
        raise TypeError(f"{name}: expected an array or tensor, got {type(value).__name__}")
    value = to_numpy(value, name)
    if value.dtype.kind != "f":
        raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    return value


class WeightLoading:
    """The ``load_*`` methods of ``attnpp.nn.Attention`` and its ``load_state_dict`` of the articles' layouts."""

    def _assign_all(self, pairs, layout="linear"):
        """Copy (parameter, value, name) triples after checking every shape, so a failed load changes nothing.
        With ``layout="matmul"`` the values are the transposes of what was given (shapes reported as given)."""
        checked = []
        for param, value, name in pairs:
            if value is None:
                continue
            if param is None:
                raise ValueError(f"{name}: this layer has no such parameter (bias=False or out_proj=False)")
            value = _as_array(value, name)
            if value.shape != param.shape:
                if layout == "matmul":  # (a 1-D bias reads the same)
                    raise ValueError(f"{name}: expected shape {param.shape[::-1]} (layout='matmul': (in, out)), "
                                     f"got {value.shape[::-1]}")
                raise ValueError(f"{name}: expected shape {param.shape}, got {value.shape}")
            checked.append((param, value))
        staged = self.__dict__.get("_staged")
        if staged is not None:  # (inside load_state_dict: copied once every key has been checked)
            staged.extend(checked)
            return
        for param, value in checked:
            param.data[...] = value

    @staticmethod
    def _as_linear(weight, layout, name):
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be 'linear' (weight (out, in)) or 'matmul' (x @ W, W (in, out)), "
                             f"got {layout!r}")
        if weight is None:
            return None
        weight = _as_array(weight, name)
        return weight.T if layout == "matmul" else weight

    def load_projections(self, q=None, k=None, v=None, out=None, *, q_bias=None, k_bias=None, v_bias=None,
                         out_bias=None, layout="linear"):
        """Load the projections from separate weights; those left None are kept.

        Args:
            q, k, v, out (array or tensor, optional): with ``layout="linear"`` shaped like ``nn.Linear.weight``,
                (out_features, in_features); with ``layout="matmul"`` the (in, out) matrices of ``x @ W`` (the
                ``nn.Parameter`` layout of article 002).
            q_bias, k_bias, v_bias, out_bias (optional): (out_features,).
            layout (str): ``"linear"`` or ``"matmul"``. Default: ``"linear"``.

        Raises:
            ValueError: a shape that does not match, a bias the layer does not have, an unknown layout (nothing is
            loaded then). TypeError: a value that is not a floating array or tensor.
        """
        out_lin = self.out_proj
        self._assign_all([
            (self.q_proj.weight, self._as_linear(q, layout, "q"), "q"),
            (self.k_proj.weight, self._as_linear(k, layout, "k"), "k"),
            (self.v_proj.weight, self._as_linear(v, layout, "v"), "v"),
            (None if out_lin is None else out_lin.weight, self._as_linear(out, layout, "out"), "out"),
            (self.q_proj.bias, q_bias, "q_bias"), (self.k_proj.bias, k_bias, "k_bias"),
            (self.v_proj.bias, v_bias, "v_bias"), (None if out_lin is None else out_lin.bias, out_bias, "out_bias"),
        ], layout)

    def _split_rows(self, weight, bias, parts, name):
        widths = [self.qk_dim if p in (self.q_proj, self.k_proj) else self.v_dim for p in parts]
        inputs = {p.in_features for p in parts}
        if len(inputs) > 1:
            raise ValueError(f"{name}: a fused weight needs one input width, but this layer's embed_dim="
                             f"{self.embed_dim} and kv_dim={self.kv_dim} differ: use load_projections")
        bounds = np.cumsum([0] + widths)
        want = (int(bounds[-1]), inputs.pop())
        pairs = []
        if weight is not _ABSENT:  # (absent only from load_state_dict(strict=False) given the bias alone)
            weight = _as_array(weight, name)
            if weight.shape != want:
                raise ValueError(f"{name}: expected shape {want}: {want[0]} rows (the outputs {widths} stacked) "
                                 f"of {want[1]} inputs, got {weight.shape}")
            pairs = [(p.weight, weight[a:b], name) for p, a, b in zip(parts, bounds[:-1], bounds[1:])]
        if bias is not None:
            bias = _as_array(bias, name + " bias")
            if bias.shape != (bounds[-1],):
                raise ValueError(f"{name} bias: expected shape ({bounds[-1]},), got {bias.shape}")
            pairs += [(p.bias, bias[a:b], name + " bias") for p, a, b in zip(parts, bounds[:-1], bounds[1:])]
        self._assign_all(pairs)

    def load_fused_qkv(self, weight, bias=None):
        """Load q, k and v from one fused ``nn.Linear`` whose output rows are [q | k | v] (article 003's ``Wqkv``,
        PyTorch's ``in_proj_weight``).

        Args:
            weight: (2 * qk_dim + v_dim, E). bias (optional): (2 * qk_dim + v_dim,).

        Raises:
            ValueError: other shapes, kv_dim != embed_dim, a bias the layer does not have (nothing is loaded
            then). TypeError: a value that is not a floating array or tensor.
        """
        self._split_rows(weight, bias, (self.q_proj, self.k_proj, self.v_proj), "Wqkv")

    def load_fused_kv(self, weight, bias=None):
        """Load k and v from one fused ``nn.Linear`` whose output rows are [k | v] (article 003's ``Wkv``).

        Args:
            weight: (qk_dim + v_dim, kv_dim). bias (optional): (qk_dim + v_dim,).

        Raises:
            ValueError: other shapes, a bias the layer does not have (nothing is loaded then). TypeError: a value
            that is not a floating array or tensor.
        """
        self._split_rows(weight, bias, (self.k_proj, self.v_proj), "Wkv")

    def load_heads(self, q, k, v, layout="matmul"):
        """Load q, k and v from a list of separate heads (article 002's ``MultiHeadAttentionWrapper``): head h's
        weights become output columns [h * d, (h + 1) * d) of each projection.

        Args:
            q, k, v (sequences of H arrays or tensors): per-head weights, (in, d) with ``layout="matmul"``
                (default) or (d, in) with ``layout="linear"``.

        Raises:
            ValueError: not H heads, or shapes that do not match (nothing is loaded then). TypeError: heads not
            given as a sequence of floating arrays or tensors.
        """
        stacked = []
        for name, heads in (("q", q), ("k", k), ("v", v)):
            if not isinstance(heads, (list, tuple, np.ndarray)) and not hasattr(heads, "detach"):
                raise TypeError(f"{name}: expected a sequence of {self.num_heads} head weights, got "
                                f"{type(heads).__name__}")
            if len(heads) != self.num_heads:
                raise ValueError(f"{name}: expected {self.num_heads} heads, got {len(heads)}")
            self._as_linear(None, layout, name)  # (checks the layout)
            heads = [_as_array(w, name) for w in heads]
            proj = getattr(self, name + "_proj")
            d, width = proj.out_features // self.num_heads, proj.in_features
            want = (width, d) if layout == "matmul" else (d, width)
            if any(w.shape != want for w in heads):
                raise ValueError(f"{name}: expected {self.num_heads} heads of shape {want} "
                                 f"{'(in, d)' if layout == 'matmul' else '(d, in)'}, got shapes "
                                 f"{[w.shape for w in heads]}")
            stacked.append(np.concatenate([self._as_linear(w, layout, name) for w in heads], axis=0))
        self.load_projections(*stacked, layout="linear")

    # ------------------------------------------------------------------------------------------- state dicts
    def load_state_dict(self, state_dict, strict=True):
        """Copy values from ``state_dict``: attnpp's own keys (as ``state_dict()`` gives them), or the state dict
        of a reference article's layer, unchanged, into an ``Attention`` built to match it.

        The layout is recognised from the keys (the one that knows most of them; attnpp's own keys win a tie).
        Each article key goes through the loader of its parameters (``load_projections``, ``load_fused_qkv``,
        ``load_fused_kv``, ``load_heads``), as ``_ARTICLE_LAYOUTS`` in nn/weight_loading.py says:

        ======= ============================================ ======================================================
        article classes                                      keys (-> attnpp)
        ======= ============================================ ======================================================
        003     SingleHeadAttention, MultiHeadAttention,     ``Wqkv.weight/.bias`` (rows [q | k | v]) ->
                BidirectionalAttention, CausalAttention      q/k/v_proj; ``Wo.weight/.bias`` -> out_proj;
                                                             buffer ``causal_mask`` (1, 1, n, n), bool
        003     CausalCrossAttention                         ``Wq.*`` -> q_proj; ``Wkv.weight/.bias`` (rows [k | v])
                                                             -> k/v_proj; ``Wo.*`` -> out_proj; ``causal_mask``
        004     MultiHeadAttention                           ``W_query.*``, ``W_key.*``, ``W_value.*`` -> q/k/v_proj;
                                                             ``out_proj.*`` -> out_proj; buffer ``mask`` (n, n)
        000     SelfAttention, CausalSelfAttention,          ``w_q.*``, ``w_k.*``, ``w_v.*`` -> q/k/v_proj;
                MultiheadAttention                           ``out_proj.*`` -> out_proj; buffer ``causal_mask`` (n, n)
        002     SelfAttention, CrossAttention                ``W_query``, ``W_key``, ``W_value`` (in, out), ``x @ W``
                                                             -> q/k/v_proj, transposed
        002     MultiHeadAttentionWrapper                    ``heads.{h}.W_query/W_key/W_value`` (in, d) -> columns
                                                             [h d, (h + 1) d) of q/k/v_proj
        ======= ============================================ ======================================================

        A key is expected when the layer has its parameters (``bias``, ``out_bias``, ``out_proj`` as the
        article's class); a layer with ``sinks`` (which no article has) reports ``"sinks"`` missing (so strict
        raises, and ``strict=False`` loads the rest and keeps the sinks as they are). The mask buffer is checked,
        not ignored: 0/1 (or bool) values, the strict upper triangle ``triu(ones(n, n), diagonal=1)`` when the
        layer is causal (which then expects the buffer) and all zero when it is not, and n equal to
        ``context_length`` when the layer has one (n is the article's block or context size; for the square
        masks of self-attention the causal alignment does not matter).
        ``state_dict()`` keeps returning attnpp's own keys.

        Everything is checked before anything is copied: a failed load leaves the layer unchanged.

        Args:
            state_dict (Mapping[str, array]): NumPy arrays or torch tensors (a PyTorch layer's ``state_dict()``).
            strict (bool): refuse missing and unexpected keys. Default: True.

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)``, named as the recognised layout names them (empty
            when strict).

        Raises:
            ValueError: missing or unexpected keys (strict), a value of another shape (named by its key), a mask
            buffer that is not the layer's triangle (or not of its context_length).
            TypeError: a state_dict that is not a mapping, a value that is not a floating array or tensor.
        """
        if not isinstance(state_dict, Mapping):
            return super().load_state_dict(state_dict, strict)
        layout, keys = self._match_layout(state_dict)
        if layout is None:
            return super().load_state_dict(state_dict, strict)
        params = dict(self.named_parameters())
        expected = [k for k, (_, _, targets, _) in keys.items() if all(t in params for t in targets)]
        mask_name, mask_lead = layout["mask"] or (None, None)
        missing = [k for k in expected if k not in state_dict]
        if mask_name is not None and self.causal and mask_name not in state_dict:
            missing.append(mask_name)
        if self.sinks is not None:  # (no article learns sinks)
            missing.append("sinks")
        unexpected = [k for k in state_dict if k not in expected and k != mask_name]
        what = f"article {layout['article']}'s layout ({layout['classes']})"
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: {what}: missing keys {missing}, unexpected keys {unexpected} for "
                             f"Attention({self.extra_repr()})")
        if mask_name in state_dict:
            self._check_mask_buffer(mask_name, state_dict[mask_name], mask_lead)
        calls = {}  # loader -> its keyword arguments (lists of heads for load_heads)
        for k in expected:
            if k in state_dict:
                loader, arg, _, h = keys[k]
                kwargs = calls.setdefault(loader, {})
                if h is None:
                    kwargs[arg] = state_dict[k]
                else:
                    kwargs.setdefault(arg, [None] * self.num_heads)[h] = state_dict[k]
        with self._lock:
            staged = []
            object.__setattr__(self, "_staged", staged)
            try:
                for loader, kwargs in calls.items():
                    method, options = _LOADER_OPTIONS[loader]
                    given = {keys[k][1]: k if keys[k][3] is None else k.replace(f".{keys[k][3]}.", ".{h}.")
                             for k in expected if k in state_dict and keys[k][0] == loader}
                    if method == "load_heads" and (len(kwargs) < 3 or any(
                            w is None for heads in kwargs.values() for w in heads)):
                        raise ValueError(f"load_state_dict: {what}: the heads load together, all of "
                                         f"{[k for k in keys if keys[k][0] == loader]} are needed")
                    if method in ("load_fused_qkv", "load_fused_kv"):
                        kwargs.setdefault("weight", _ABSENT)
                    try:
                        getattr(self, method)(**kwargs, **options)
                    except (ValueError, TypeError) as e:  # named by the article's key
                        name, _, rest = str(e).partition(": ")
                        arg = {"Wqkv": "weight", "Wkv": "weight", "Wqkv bias": "bias",
                               "Wkv bias": "bias"}.get(name, name)
                        key = given.get(arg, "/".join(given.values()))
                        raise type(e)(f"state_dict[{key!r}] ({what}): {rest or e}") from None
            finally:
                object.__delattr__(self, "_staged")
            for param, value in staged:
                param.data[...] = value
        return IncompatibleKeys(missing, unexpected)

    def _match_layout(self, state_dict):
        """(layout, its keys expanded) of ``_ARTICLE_LAYOUTS`` that knows most keys of ``state_dict``, or
        (None, None) when attnpp's own keys know as many (or all of them)."""
        given = set(state_dict)
        own = {name for name, _ in self._named_state()}
        best, best_keys, best_score = None, None, len(given & own)
        if given <= own:
            return None, None
        for layout in _ARTICLE_LAYOUTS:
            keys = {}
            for key, (loader, arg, targets) in layout["keys"].items():
                if "{h}" in key:
                    keys.update({key.format(h=h): (loader, arg, targets, h) for h in range(self.num_heads)})
                else:
                    keys[key] = (loader, arg, targets, None)
            score = len(given & (set(keys) | {(layout["mask"] or ("",))[0]}))
            if score > best_score:
                best, best_keys, best_score = layout, keys, score
        return best, best_keys

    def _check_mask_buffer(self, name, value, lead):
        """An article's causal-mask buffer against this layer: ValueError unless it is ``lead + (n, n)`` of 0/1,
        the strict upper triangle if the layer is causal, else all zero, with n = context_length if set."""
        mask = to_numpy(value, name)
        n = mask.shape[-1] if mask.ndim else 0
        want_shape = tuple(lead) + (n, n)
        if mask.shape != want_shape or n == 0:
            raise ValueError(f"state_dict[{name!r}]: expected a mask buffer of shape {tuple(lead) + ('n', 'n')}, "
                             f"got {mask.shape}")
        if mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
            raise ValueError(f"state_dict[{name!r}]: expected a 0/1 (or bool) mask, 1 = masked, got other values")
        got = mask.reshape(n, n).astype(bool)
        triangle = np.triu(np.ones((n, n), bool), 1)
        if self.causal and not np.array_equal(got, triangle):
            raise ValueError(f"state_dict[{name!r}]: this layer is causal, so the mask must be the strict upper "
                             f"triangle triu(ones({n}, {n}), diagonal=1) (1 = a later key, masked); it differs in "
                             f"{int((got != triangle).sum())} of {n * n} entries")
        if not self.causal and got.any():
            what = "the causal triangle" if np.array_equal(got, triangle) else "not the causal triangle"
            raise ValueError(f"state_dict[{name!r}]: this layer has causal=False, but the mask masks "
                             f"{int(got.sum())} of {n * n} entries ({what}); build the layer with causal=True to "
                             f"load a causal article layer")
        if self.context_length is not None and n != self.context_length:
            raise ValueError(f"state_dict[{name!r}]: a {n} x {n} mask (the article's context size) but this "
                             f"layer has context_length={self.context_length}")
