import math

import numpy as np

from .. import _core
from .. import _checks as checks
from .. import functional as F
from .._pool import empty, zeros
from ..functional.training import linear_backward_unchecked
from .._seeds import generator
from .linear import Linear
from .module import Module, locked


class MultiheadAttention(Module):
    r"""Multi-head attention, as ``torch.nn.MultiheadAttention``, with a hand-written backward.

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_O + b_O``,
    ``head_i = softmax((Q W_Q^i)(K W_K^i)^T / sqrt(D) + mask) (V W_V^i)`` (Vaswani et al., "Attention Is All
    You Need", 2017). The attention itself runs on attnpp's FlashAttention-2-style kernel: the (B, H, L, S)
    weights are only built when ``need_weights=True``.

    Shape letters: B batch, L target (query) length, S source (key/value) length, E ``embed_dim``, H
    ``num_heads``, D = E / H.

    Args:
        embed_dim (int): E, the model width.
        num_heads (int): H; must divide ``embed_dim``.
        dropout (float): dropout probability on the attention weights, in training mode. Default: 0.0.
        bias (bool): biases on the input and output projections. Default: True.
        add_bias_kv (bool): append learned vectors ``bias_k``, ``bias_v`` to the keys and values. Default: False.
        add_zero_attn (bool): append a zero key and value. Default: False.
        kdim (int, optional): width of ``key``. Default: E.
        vdim (int, optional): width of ``value``. Default: E.
        batch_first (bool): inputs and output are (B, L, E) instead of (L, B, E). Default: False.
        dtype: float32 (default), float64, float16 or bfloat16 (computed in float32, rounded once per output).

    Parameters (PyTorch's state-dict keys): ``in_proj_weight`` (3E, E) when kdim == vdim == E, else
    ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim), ``v_proj_weight`` (E, vdim); ``in_proj_bias`` (3E,);
    ``bias_k``, ``bias_v`` (1, 1, E); ``out_proj.weight`` (E, E), ``out_proj.bias`` (E,).

    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads``, dropout outside [0, 1).
        TypeError: a dtype other than float32, float64, float16 or bfloat16.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, dtype=None):
        super().__init__(dtype)
        E = self.embed_dim = checks.check_int(embed_dim, "embed_dim", 1)
        self.num_heads = checks.check_int(num_heads, "num_heads", 1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim}, "
                             f"num_heads={num_heads}")
        self.head_dim = E // self.num_heads
        self.kdim = E if kdim is None else checks.check_int(kdim, "kdim", 1)
        self.vdim = E if vdim is None else checks.check_int(vdim, "vdim", 1)
        dropout = checks.check_probability(dropout, "dropout")
        self.dropout, self.batch_first = float(dropout), checks.check_bool(batch_first, "batch_first")
        self.add_zero_attn = checks.check_bool(add_zero_attn, "add_zero_attn")
        bias, add_bias_kv = checks.check_bool(bias, "bias"), checks.check_bool(add_bias_kv, "add_bias_kv")
        self._qkv_same_embed_dim = self.kdim == E and self.vdim == E
        rng = generator()
        xavier = lambda p, fan_in, fan_out: rng.uniform(-1, 1, p.shape) * math.sqrt(6.0 / (fan_in + fan_out))
        if self._qkv_same_embed_dim:
            w = self.register_parameter("in_proj_weight", (3 * E, E))
            w.data[...] = xavier(w, E, 3 * E)
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.in_proj_weight = None
            for name, width in (("q_proj_weight", E), ("k_proj_weight", self.kdim), ("v_proj_weight", self.vdim)):
                w = self.register_parameter(name, (E, width))
                w.data[...] = xavier(w, width, E)
        self.in_proj_bias = self.register_parameter("in_proj_bias", (3 * E,)) if bias else None
        self.out_proj = Linear(E, E, bias=bias, dtype=self.dtype)
        if bias:
            self.out_proj.bias.data[...] = 0
        if add_bias_kv:
            self.bias_k = self.register_parameter("bias_k", (1, 1, E))
            self.bias_v = self.register_parameter("bias_v", (1, 1, E))
            for p in (self.bias_k, self.bias_v):
                p.data[...] = rng.normal(0.0, math.sqrt(2.0 / (2 * E)), p.shape)
        else:
            self.bias_k = self.bias_v = None
        self.last_seed = None  # the dropout seed of the last forward (None when it had no dropout)

    # ----------------------------------------------------------------------------------------------- helpers
    def _proj_params(self, i, grads=False):
        """(weight, bias) of input projection i (0 query, 1 key, 2 value), or with ``grads`` their gradient
        buffers (created zeroed if None); bias None without biases."""
        value = (lambda p: p.grad_buffer()) if grads else (lambda p: p.data)
        E = self.embed_dim
        rows = slice(i * E, (i + 1) * E)
        if self._qkv_same_embed_dim:
            weight = value(self.in_proj_weight)[rows]
        else:
            weight = value((self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[i])
        return weight, None if self.in_proj_bias is None else value(self.in_proj_bias)[rows]

    def _heads(self, x, bf):
        """(B, T, E) (batch first) or (T, B, E) as a (B, H, T, D) view, no copy."""
        H, D = self.num_heads, self.head_dim
        if bf:
            return x.reshape(x.shape[0], x.shape[1], H, D).transpose(0, 2, 1, 3)
        return x.reshape(x.shape[0], x.shape[1], H, D).transpose(1, 2, 0, 3)

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        dt, E, H = self.dtype, self.embed_dim, self.num_heads
        checks.check_array(query, "query", ndim=(2, 3), dtype=dt)
        checks.check_array(key, "key", ndim=(2, 3), dtype=dt)
        checks.check_array(value, "value", ndim=(2, 3), dtype=dt)
        for mask, name in ((key_padding_mask, "key_padding_mask"), (attn_mask, "attn_mask")):
            if mask is not None and not isinstance(mask, np.ndarray):
                raise TypeError(f"{name}: expected a numpy.ndarray, got {type(mask).__name__}")
        return checks.check_multihead_attention_shapes(query, key, value, key_padding_mask, attn_mask, is_causal, E,
                                                       self.kdim, self.vdim, H, self.batch_first)

    # ----------------------------------------------------------------------------------------------- forward
    @locked
    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, seed=None):
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query (ndarray): (L, B, E), (B, L, E) when ``batch_first``, or (L, E) unbatched; the layer's dtype.
            key (ndarray): (S, B, kdim), (B, S, kdim) when ``batch_first``, or (S, kdim) unbatched.
            value (ndarray): (S, B, vdim), (B, S, vdim) when ``batch_first``, or (S, vdim) unbatched.
            key_padding_mask (ndarray, optional): (B, S) or (S,) unbatched. Boolean: True where a key is
                *ignored* (padding). Float: added to the scores. Default: None.
            need_weights (bool): also return the attention weights (builds them: (B, H, L, S) memory).
                Default: True.
            attn_mask (ndarray, optional): (L, S) or (B * num_heads, L, S) ((num_heads, L, S) unbatched).
                Boolean: True where attention is *not allowed*. Float: added to the scores. Default: None.
            average_attn_weights (bool): average the returned weights over heads. Default: True.
            is_causal (bool): a hint that ``attn_mask`` is the causal mask (required with it, as in PyTorch);
                without ``key_padding_mask`` and ``need_weights`` the causal kernel is used instead of the mask.
                Default: False.
            seed (int, optional): dropout seed for this call (training mode, dropout > 0); None draws one from
                attnpp's global generator. The seed used is kept in ``last_seed``; the kept weights are
                ``attnpp.functional.dropout_mask((B, H, L, S'), dropout, last_seed)`` with S' = S plus one per
                ``add_bias_kv`` and ``add_zero_attn``.

        Returns:
            (attn_output, attn_weights): attn_output (L, B, E), (B, L, E) when ``batch_first``, or (L, E)
            unbatched; attn_weights (B, L, S') averaged or (B, H, L, S') per head ((L, S') or (H, L, S')
            unbatched), after dropout as in PyTorch, or None when ``need_weights=False``.

        Raises:
            TypeError: inputs or masks of another dtype than the layer's (masks may be bool).
            ValueError: shapes that do not agree (named with their shapes), is_causal without attn_mask.
        """
        query, key, value, key_padding_mask, attn_mask = (
            None if t is None else checks.as_ndarray(t, name) for t, name in ((query, "query"), (key, "key"),
            (value, "value"), (key_padding_mask, "key_padding_mask"), (attn_mask, "attn_mask")))
        batched, bf, B, L, S = self._check_inputs(query, key, value, key_padding_mask, attn_mask, is_causal)
        dt, H = self.dtype, self.num_heads
        kpm = None if key_padding_mask is None else \
            F.additive_mask(key_padding_mask, dt, "key_padding_mask", true_means_masked=True)
        am = None if attn_mask is None else F.additive_mask(attn_mask, dt, "attn_mask", true_means_masked=True)
        causal = _core.Causal.none
        if is_causal and kpm is None and not need_weights:
            am, causal = None, _core.Causal.top_left
        q3, k3, v3 = (query, key, value) if batched else (query[None], key[None], value[None])
        q = F.linear(q3, *self._proj_params(0))
        k = F.linear(k3, *self._proj_params(1))
        v = F.linear(v3, *self._proj_params(2))
        # add_bias_kv, add_zero_attn: extra keys/values along the sequence axis, extra mask columns of 0
        extra = []
        if self.bias_k is not None:
            extra.append((self.bias_k.data, self.bias_v.data))
        if self.add_zero_attn:
            zero = np.zeros((1, 1, self.embed_dim), dt)
            extra.append((zero, zero))
        seq_axis = 1 if bf else 0
        if extra:
            bshape = (B, 1, self.embed_dim) if bf else (1, B, self.embed_dim)
            k = np.concatenate([k] + [np.broadcast_to(ek, bshape) for ek, _ in extra], axis=seq_axis)
            v = np.concatenate([v] + [np.broadcast_to(ev, bshape) for _, ev in extra], axis=seq_axis)
            pad = lambda m: np.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, len(extra))])
            am = None if am is None else pad(am)
            kpm = None if kpm is None else pad(kpm)
        S_all = S + len(extra)
        full = (B, H, L, S_all)
        # the weights before the attention: one too large to allocate is a MemoryError before any work
        weights = empty((B, L, S_all) if average_attn_weights else full, dt) if need_weights else None
        masks = []
        if am is not None:
            masks.append(F.mask_arg(am if am.ndim == 2 else am.reshape(full), full))
        if kpm is not None:
            masks.append(F.mask_arg(kpm.reshape(B, 1, 1, S_all), full))
        p = self.dropout if self.training else 0.0
        seed = checks.check_seed(seed, used=p > 0)
        self.last_seed = seed if p > 0 else None
        params = F.attention_params((B,), H, dt, scale=1.0 / math.sqrt(self.head_dim), causal=causal,
                                    dropout_p=p, seed=seed, masks=masks)
        out = empty(q.shape, q.dtype)
        lse = np.empty((B, H, L), checks.compute_dtype(dt))
        q4, k4, v4, o4 = (self._heads(x, bf) for x in (q, k, v, out))
        _core.sdpa_forward(o4, lse, q4, k4, v4, params)
        y = self.out_proj(out)
        if need_weights:  # the mean over heads is taken in the core, without the (B, H, L, S) weights
            _core.sdpa_weights(weights, lse, q4, k4, params, average_heads=average_attn_weights)
        self._save_context(inputs=(q3, k3, v3), proj=(q, k, v, out), lse=lse, params=params, bf=bf,
                         batched=batched, S=S, seq_axis=seq_axis, out_shape=y.shape if batched else y.shape[1:])
        if not batched:
            y = y[0]
            weights = None if weights is None else weights[0]
        return y, weights

    # ---------------------------------------------------------------------------------------------- backward
    @locked
    def backward(self, grad_output):
        """Gradients of ``attn_output`` of the most recent ``forward`` not yet consumed (one context per forward
        outside ``attnpp.no_grad()``, consumed last-in first-out: see ``attnpp.nn.Module``).

        Args:
            grad_output (ndarray): the shape of ``attn_output``, the layer's dtype.

        Returns:
            (grad_query, grad_key, grad_value), shaped like query, key and value. For self-attention
            (query is key is value) the gradient of the shared input is their sum. Accumulates (+=) into the
            parameters' ``grad``.

        Raises:
            ValueError: no forward context left, grad_output of another shape than its forward's output.
            TypeError: grad_output of another dtype.
        """
        ctx = self._consume_context(grad_output)
        q3, k3, v3 = ctx["inputs"]
        q, k, v, out = ctx["proj"]
        bf = ctx["bf"]
        d_out = self.out_proj.backward(grad_output if ctx["batched"] else grad_output[None])
        dq, dk, dv = (zeros(t.shape, t.dtype) for t in (q, k, v))
        _core.sdpa_backward(*(self._heads(x, bf) for x in (dq, dk, dv, d_out, out)), ctx["lse"],
                            *(self._heads(x, bf) for x in (q, k, v)), ctx["params"])
        S, axis = ctx["S"], ctx["seq_axis"]
        if self.bias_k is not None:  # the appended bias_k / bias_v row, shared by the whole batch
            self.bias_k.grad_buffer()[...] += np.take(dk, [S], axis=axis).sum(axis=1 - axis).reshape(1, 1, -1)
            self.bias_v.grad_buffer()[...] += np.take(dv, [S], axis=axis).sum(axis=1 - axis).reshape(1, 1, -1)
        dk, dv = (np.take(d, np.arange(S), axis=axis) for d in (dk, dv))
        grads = []
        for i, (x, d) in enumerate(((q3, dq), (k3, dk), (v3, dv))):
            grads.append(linear_backward_unchecked(d, x, self._proj_params(i)[0], *self._proj_params(i, grads=True)))
        return tuple(grads) if ctx["batched"] else tuple(g[0] for g in grads)

    def extra_repr(self):
        E = self.embed_dim
        return self._format_args(f"embed_dim={E}", f"num_heads={self.num_heads}", dropout=(self.dropout, 0.0),
                                 bias=(self.in_proj_bias is not None, True),
                                 add_bias_kv=(self.bias_k is not None, False),
                                 add_zero_attn=(self.add_zero_attn, False), kdim=(self.kdim, E), vdim=(self.vdim, E),
                                 batch_first=(self.batch_first, False))
