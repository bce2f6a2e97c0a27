"""attnpp.torch's modules: ``Linear``, ``MultiheadAttention`` and ``Attention``, PyTorch modules (torch
parameters, state dicts, initialisation) whose compute is attnpp's operators (``attnpp.torch._ops``), through
``attnpp.torch.functional``.

Their tensor arguments are checked as the functions' are: tensor subclasses and sparse tensors refused
(TorchTypeError), masks that require grad refused under grad mode, meta tensors (and torch.compile's and
torch.export's fake tensors) given shapes only; the errors each forward lists are raised as ``TorchValueError``
and ``TorchTypeError`` (also RuntimeErrors) where they come from those checks and from the operators."""
import torch

from .._checks import check_attention_layer_shapes, check_multihead_attention_shapes
from ..functional.rotary import ROTARY_BASE
from ..nn.attention import attention_config_of, variant_args
from . import _ops
from ._convert import additive_mask, check_dtype, check_tensor
from .functional import _attention, linear

__all__ = ["Linear", "MultiheadAttention", "Attention"]


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (same arguments, parameters, initialisation and state dict) whose forward and
    backward are attnpp's: input (*, Fin) -> (*, Fout), float32, float64, float16 or bfloat16 on the CPU."""

    def forward(self, input):
        return linear(input, self.weight, self.bias)


class MultiheadAttention(torch.nn.MultiheadAttention):
    r"""``torch.nn.MultiheadAttention`` computed by attnpp (projections, attention and their backward).

    A subclass of ``torch.nn.MultiheadAttention``: the same constructor (embed_dim, num_heads, dropout=0.0,
    bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
    dtype=None), parameters (``in_proj_weight`` or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``,
    ``in_proj_bias``, ``bias_k``, ``bias_v``, ``out_proj.weight``, ``out_proj.bias``), state-dict keys and
    initialisation (the same draws from torch's generator), so state dicts load either way. Only ``forward``
    differs: see there. Default dtype: torch's (float32); float32, float64, float16 or bfloat16 only, on the CPU.

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_O^T + b_O``,
    ``head_h = softmax((Q W_Q^h)(K W_K^h)^T / sqrt(E / H) + mask) (V W_V^h)`` (Vaswani et al., 2017).

    Attribute ``last_seed``: the dropout seed of the last forward (None without dropout); the kept weights
    are ``attnpp.functional.dropout_mask((B, H, L, S'), dropout, last_seed)``, S' = S plus one per
    ``add_bias_kv`` and ``add_zero_attn``.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
                         device, dtype)
        self.last_seed = None

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """Returns (batched, seq_first, B, L, S), or ValueError for shapes that do not agree."""
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            check_tensor(t, name)
        for mask, name in ((key_padding_mask, "key_padding_mask"), (attn_mask, "attn_mask")):
            if mask is not None:
                check_tensor(mask, name, mask=True)
        batched, batch_first_layout, B, L, S = check_multihead_attention_shapes(
            query, key, value, key_padding_mask, attn_mask, is_causal, self.embed_dim, self.kdim, self.vdim,
            self.num_heads, self.batch_first)
        return batched, not batch_first_layout, B, L, S

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """Attend from ``query`` to ``key``/``value``, as ``torch.nn.MultiheadAttention.forward``.

        Args:
            query (Tensor): (L, B, E), (B, L, E) when ``batch_first``, or (L, E) unbatched.
            key (Tensor): (S, B, kdim), (B, S, kdim) when ``batch_first``, or (S, kdim) unbatched.
            value (Tensor): (S, B, vdim), (B, S, vdim) when ``batch_first``, or (S, vdim) unbatched.
            key_padding_mask (Tensor, optional): (B, S) or (S,) unbatched. Bool: True where a key is *ignored*
                (padding). Float: added to the scores. Default: None.
            need_weights (bool): also return the attention weights (materialises (B, H, L, S') memory; they
                carry no gradient: a loss on them does not reach the parameters). Default: True.
            attn_mask (Tensor, optional): (L, S) or (B * num_heads, L, S) ((num_heads, L, S) unbatched). Bool:
                True where attention is *not allowed*. Float: added to the scores. Default: None.
            average_attn_weights (bool): average the returned weights over heads. Default: True.
            is_causal (bool): a hint that ``attn_mask`` is the causal mask (required with it); without
                ``key_padding_mask`` and ``need_weights``, the causal kernel is used instead of ``attn_mask``,
                as in PyTorch. Default: False.

        Returns:
            (attn_output, attn_weights): attn_output (L, B, E), (B, L, E) when ``batch_first``, or (L, E);
                attn_weights (B, L, S') averaged or (B, H, L, S') per head ((L, S') or (H, L, S') unbatched), after
                dropout as in PyTorch, without gradient; None when ``need_weights=False``. A query whose keys are
                all masked gives 0 (PyTorch's weights path gives NaN there).

        Raises:
            ValueError: tensors not on the CPU, shapes that do not agree, is_causal without attn_mask.
            TypeError: dtypes other than the query's (masks may be bool), float16 and bfloat16.
        """
        self_attention = query is key is value
        batched, seq_first, B, L, S = self._check_inputs(query, key, value, key_padding_mask, attn_mask, is_causal)
        E, H, D, dtype = self.embed_dim, self.num_heads, self.head_dim, query.dtype
        if not batched:  # as a batch of one, batch first
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        if self_attention and self._qkv_same_embed_dim:  # one product for the three projections
            q, k, v = linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            q, k, v = (linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))

        def heads(x):  # (T, B, E) or (B, T, E) -> (B, H, T, D), a view
            x = x.unflatten(-1, (H, D))
            return x.permute(1, 2, 0, 3) if seq_first else x.transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        # add_bias_kv, add_zero_attn: extra keys and values after the S given, taking part everywhere
        extra = [] if self.bias_k is None else [(self.bias_k, self.bias_v)]
        if self.add_zero_attn:
            zero = torch.zeros(1, 1, E, dtype=dtype)
            extra.append((zero, zero))
        if extra:
            k = torch.cat([k] + [ek.view(1, H, 1, D).expand(B, H, 1, D) for ek, _ in extra], dim=2)
            v = torch.cat([v] + [ev.view(1, H, 1, D).expand(B, H, 1, D) for _, ev in extra], dim=2)
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None
        if attn_mask is not None and not causal:
            mask = additive_mask(attn_mask, dtype, "attn_mask")
            mask = mask if mask.dim() == 2 else mask.view(B, H, L, S)
        if key_padding_mask is not None:
            kpm = additive_mask(key_padding_mask, dtype, "key_padding_mask").view(B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        if mask is not None and extra:
            mask = torch.nn.functional.pad(mask, (0, len(extra)))
        p = self.dropout if self.training else 0.0
        out, attn_weights, self.last_seed = _attention(q, k, v, mask, p, causal, None, False, None, "top_left",
                                                       need_weights)
        out = out.permute(2, 0, 1, 3) if seq_first else out.transpose(1, 2)  # (L, B, H, D) or (B, L, H, D)
        out = linear(out.reshape(out.shape[:2] + (E,)), self.out_proj.weight, self.out_proj.bias)
        if attn_weights is not None and average_attn_weights:
            attn_weights = attn_weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0)
            attn_weights = None if attn_weights is None else attn_weights.squeeze(0)
        return out, attn_weights


class Attention(torch.nn.Module):
    r"""``attnpp.nn.Attention`` as a ``torch.nn.Module``: torch parameters, attnpp's compute.

    ``out = out_dropout(Concat_h(softmax(scale * Q_h K_h^T + mask) V_h) W_O^T + b_O)`` with ``Q = x W_Q^T + b_Q``,
    ``K = c W_K^T + b_K``, ``V = c W_V^T + b_V`` and ``c = context`` (cross-attention) or ``x`` (self-attention),
    attention dropout on the weights (Vaswani et al., "Attention Is All You Need", 2017).

    Shape letters: B batch, L query length, S key/value (context) length, E ``embed_dim``, H ``num_heads``.

    Args: those of ``attnpp.nn.Attention`` (embed_dim, num_heads=1, and keyword-only qk_dim, v_dim, kv_dim,
    out_dim, bias=True, out_proj=True, out_bias, causal=False, causal_alignment="top_left", attn_dropout=0.0,
    out_dropout=0.0, scale, context_length, and the variants window, alibi=False, softcap, sinks=False,
    rotary=False, rotary_dim, rotary_base=10000.0, rotary_interleaved=False; checked by the same
    ``attention_config``, documented there), except ``dtype`` (torch.dtype, optional): float32, float64, float16
    or bfloat16, default torch's default dtype; the output dropout is a ``torch.nn.Dropout``. And:

    - ``context_parallel_group`` (ProcessGroup, optional): context parallelism: the layer's input ``x`` is this
      rank's shard of the sequence (``attnpp.torch.distributed.shard_sequence``), the projections run on it
      locally and the attention over the whole sequence runs as ``attnpp.torch.distributed.ring_attention``
      over the group (every rank of the group calls the layer, and its backward). Self-attention without
      ``key_padding_mask``, ``need_weights``, attention dropout in training, ``alibi``, ``softcap`` or
      ``sinks``; rotary positions are those of the whole sequence. Default: None (one process).
    - ``context_parallel_layout`` (str): the shards' layout, ``"contiguous"`` or ``"zigzag"`` (balanced under
      the causal mask). Default: ``"contiguous"``.

    Sub-modules (``attnpp.torch.Linear``, weight (out, in), torch.nn.Linear's initialisation): ``q_proj``
    (E -> qk_dim), ``k_proj`` (kv_dim -> qk_dim), ``v_proj`` (kv_dim -> v_dim), ``out_proj`` (v_dim -> out_dim,
    or None); ``out_drop`` (``torch.nn.Dropout``). Parameter ``sinks`` (H,) (zeros at first) with
    ``sinks=True``, else None; ``alibi_slopes`` a float64 ndarray (H,) or None (a constant, not in the state
    dict). Attribute ``last_seed``: the attention-dropout seed of the last forward (None without), mask
    ``attnpp.functional.dropout_mask((B, H, L, S), attn_dropout, last_seed)``.

    Raises:
        ValueError: H not dividing qk_dim or v_dim, a non-positive width, dropout outside [0, 1), an unknown
            causal_alignment. TypeError: a dtype other than float32, float64, float16 or bfloat16, widths that are
            not ints. And the variants' errors, as ``attnpp.nn.Attention`` lists them; ValueError: a
            ``context_parallel_group`` with a variant it does not take (alibi, softcap, sinks) or an unknown layout.
    """

    def __init__(self, embed_dim, num_heads=1, *, qk_dim=None, v_dim=None, kv_dim=None, out_dim=None, bias=True,
                 out_proj=True, out_bias=None, causal=False, causal_alignment="top_left", attn_dropout=0.0,
                 out_dropout=0.0, scale=None, context_length=None, window=None, alibi=False, softcap=None,
                 sinks=False, rotary=False, rotary_dim=None, rotary_base=ROTARY_BASE, rotary_interleaved=False,
                 dtype=None, context_parallel_group=None, context_parallel_layout="contiguous"):
        super().__init__()
        dtype = check_dtype(dtype)
        config = attention_config_of(locals())
        if context_parallel_group is not None:
            from .distributed import check_layout
            check_layout(context_parallel_layout)
            for name, given in (("alibi", config["alibi_slopes"] is not None),
                                ("softcap", config["softcap"] is not None), ("sinks", config["sinks"])):
                if given:
                    raise ValueError(f"context_parallel_group: not with {name} (ring attention takes the causal mask, "
                                     f"a window and rotary positions only)")
        self.context_parallel_group, self.context_parallel_layout = context_parallel_group, context_parallel_layout
        out_dropout, sinks = config.pop("out_dropout"), config.pop("sinks")
        self.__dict__.update(config)
        # (the slopes as a tensor for the operator, made once: a constant of the traced graph under torch.compile)
        self._alibi_tensor = None if self.alibi_slopes is None else torch.from_numpy(self.alibi_slopes)
        self.sinks = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=dtype)) if sinks else None
        self.q_proj = Linear(self.embed_dim, self.qk_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(self.kv_dim, self.qk_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(self.kv_dim, self.v_dim, bias=bias, dtype=dtype)
        self.out_proj = Linear(self.v_dim, self.out_dim, bias=bias if out_bias is None else out_bias,
                               dtype=dtype) if out_proj else None
        self.out_drop = torch.nn.Dropout(out_dropout)
        self.last_seed = None

    def _check(self, x, context, key_padding_mask):
        """The context (``x`` for self-attention), after checking the inputs."""
        for t, name in ((x, "x"), (context, "context")):
            if t is not None:
                check_tensor(t, name)
        if key_padding_mask is not None:
            check_tensor(key_padding_mask, "key_padding_mask", mask=True)
        return check_attention_layer_shapes(x, context, key_padding_mask, self.embed_dim, self.kv_dim,
                                            self.context_length)

    def forward(self, x, context=None, key_padding_mask=None, need_weights=False):
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x (Tensor): (B, L, E) or (L, E) unbatched, the layer's dtype: the queries' input.
            context (Tensor, optional): (B, S, kv_dim) or (S, kv_dim): the keys' and values' input
                (cross-attention). Default: None, self-attention on ``x``.
            key_padding_mask (Tensor, optional): (B, S) or (S,). Bool: True where a key is *masked out*
                (padding). Float: added to the scores. Combined with the causal mask. Default: None.
            need_weights (bool): also return the (B, H, L, S) attention weights (after dropout, without
                gradient). Default: False.

        Returns:
            out (Tensor): (B, L, out_dim) or (L, out_dim); with ``need_weights``, ``(out, weights)``. A query
                whose keys are all masked attends to nothing: its attention output is 0.

        Raises:
            ValueError: tensors not on the CPU, shapes that do not agree, a sequence longer than
                context_length. TypeError: dtypes other than float32, float64, float16 or bfloat16, or mixed (masks
                may be bool).
        """
        context = self._check(x, context, key_padding_mask)
        batched = x.dim() == 3
        x3, c3 = (x, context) if batched else (x.unsqueeze(0), context.unsqueeze(0))
        B, L, S = x3.shape[0], x3.shape[1], c3.shape[1]
        heads = lambda t: t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, T, H * d) -> (B, H, T, d)
        q, k, v = heads(self.q_proj(x3)), heads(self.k_proj(c3)), heads(self.v_proj(c3))
        if self.rotary:
            q, k = self._rotary(q), self._rotary(k)
        if self.context_parallel_group is not None:
            out, weights = self._context_parallel(q, k, v, context is not x, key_padding_mask, need_weights), None
        else:
            # the padding as key_padding_mask (B, S), which combines with the causal flag: no (L, S) mask, and
            # the causal kernel keeps skipping the blocks above the diagonal, as attnpp.nn.Attention does
            kpm = None if key_padding_mask is None else key_padding_mask.reshape(B, S)
            p = self.attn_dropout if self.training else 0.0
            out, weights, self.last_seed = _attention(q, k, v, None, p, self.causal, self.scale, False, None,
                                                      self.causal_alignment, need_weights, self.window,
                                                      self._alibi_tensor, self.softcap, self.sinks,
                                                      key_padding_mask=kpm)
        y = out.transpose(1, 2).reshape(B, L, self.v_dim)
        y = self.out_drop(y if self.out_proj is None else self.out_proj(y))
        if not batched:
            y, weights = y[0], None if weights is None else weights[0]
        return (y, weights) if need_weights else y

    def _rotary(self, t):
        """RoPE of (B, H, T, d) heads at their positions in the sequence: 0 .. T - 1, or with
        ``context_parallel_group`` the positions of this rank's shard (its segments, each at its own offset)."""
        T = t.shape[2]
        if self.context_parallel_group is None:
            segments = [(0, 0, T)]
        else:
            from .distributed import shard_segments
            segments = shard_segments(self.context_parallel_group, self.context_parallel_layout, T)
        parts = [_ops.apply_rotary(t[:, :, local:local + rows], self.rotary_dim, float(self.rotary_base),
                                       self.rotary_interleaved, start) for start, local, rows in segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _context_parallel(self, q, k, v, cross, key_padding_mask, need_weights):
        """The attention of this rank's shard (B, H, n, d) of q, k, v over the group's whole sequence."""
        from . import distributed
        for given, what in ((cross, "a context (cross-attention)"), (key_padding_mask is not None, "key_padding_mask"),
                            (need_weights, "need_weights"),
                            (self.training and self.attn_dropout > 0, "attention dropout in training")):
            if given:
                raise ValueError(f"context_parallel_group: not with {what}")
        return distributed.ring_attention(q, k, v, self.context_parallel_group, is_causal=self.causal,
                                          scale=self.scale, window=self.window, layout=self.context_parallel_layout)

    def extra_repr(self):
        variants = "".join(f", {name}={value!r}" for name, (value, default) in
                           variant_args(self).items() if value != default)
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, qk_dim={self.qk_dim}, v_dim={self.v_dim}, "
                f"kv_dim={self.kv_dim}, out_dim={self.out_dim}, causal={self.causal}, "
                f"attn_dropout={self.attn_dropout}{variants}")
