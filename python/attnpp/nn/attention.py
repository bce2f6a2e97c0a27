"""``attnpp.nn.Attention``, the general attention layer: its forward, KV-cache decoding and backward. Its
configuration checks are in attention_config.py, its weight loading in weight_loading.py."""
import numpy as np

from .. import _core
from .. import _checks as checks
from .. import functional as F
from .._pool import empty, zeros
from ..functional.rotary import ROTARY_BASE, cached_rotary_tables
from ..grad_mode import no_grad
from .attention_config import (attention_config, attention_config_of,  # noqa: F401 (importable from here too)
                               variant_args)
from .dropout import Dropout
from .kv_cache import KVCache
from .linear import Linear
from .module import Module, locked
from .weight_loading import WeightLoading


def rotary_tables(layer, positions, dtype):
    """The RoPE tables (cos, sin) (P, rotary_dim / 2) of ``layer`` (an ``Attention``) in ``dtype``, P >=
    ``positions``: ``functional.rotary``'s shared cache."""
    return cached_rotary_tables(positions, layer.rotary_dim, layer.rotary_base, dtype)


class Attention(WeightLoading, Module):
    r"""A general attention layer: self- or cross-attention, one or many heads, causal or not.

    ``out = out_dropout(Concat_h(softmax(scale * Q_h K_h^T + mask) V_h) W_O^T + b_O)`` with ``Q = x W_Q^T + b_Q``,
    ``K = c W_K^T + b_K``, ``V = c W_V^T + b_V`` and ``c = context`` (cross-attention) or ``x`` (self-attention),
    attention dropout on the weights (Vaswani et al., "Attention Is All You Need", 2017). The attention variants
    of modern open models are options (``window``, ``alibi``, ``softcap``, ``sinks``, ``rotary``, below), and
    ``init_kv_cache`` with ``forward(..., kv_cache=...)`` decodes token by token. Every class of the
    reference articles is one configuration of it (see the notebooks), and the weights of each article's
    parameter layout load with ``load_projections`` (``nn.Linear`` (out, in) or ``x @ W`` (in, out)),
    ``load_fused_qkv``, ``load_fused_kv`` or ``load_heads``.

    An article layer's ``state_dict()`` also loads unchanged, through ``load_state_dict``, into an ``Attention``
    built to match it (same widths, heads, biases, ``causal`` and ``context_length``): the layout is recognised
    from the keys and each key goes through the loader above that fits it (one table, ``_ARTICLE_LAYOUTS`` in nn/weight_loading.py):

    ======= ================================================= ==================================================
    article classes                                           keys
    ======= ================================================= ==================================================
    003     SingleHead-, MultiHead-, Bidirectional-,          ``Wqkv.*`` (rows [q | k | v]), ``Wo.*``,
            CausalAttention                                   ``causal_mask`` (1, 1, n, n)
    003     CausalCrossAttention                              ``Wq.*``, ``Wkv.*`` (rows [k | v]), ``Wo.*``,
                                                              ``causal_mask``
    004     MultiHeadAttention                                ``W_query.*``, ``W_key.*``, ``W_value.*``,
                                                              ``out_proj.*``, ``mask`` (n, n)
    000     SelfAttention, CausalSelfAttention,               ``w_q.*``, ``w_k.*``, ``w_v.*``, ``out_proj.*``,
            MultiheadAttention                                ``causal_mask`` (n, n)
    002     SelfAttention, CrossAttention                     ``W_query``, ``W_key``, ``W_value`` (in, out)
    002     MultiHeadAttentionWrapper                         ``heads.{h}.W_query`` / ``W_key`` / ``W_value``
    ======= ================================================= ==================================================

    The mask buffers are checked against the layer (the causal triangle over their size for a causal layer,
    nothing masked otherwise), not ignored; see ``load_state_dict``. ``state_dict()`` gives attnpp's own keys.

    Shape letters: B batch, L query length, S key/value (context) length, E ``embed_dim``, H ``num_heads``.

    Args:
        embed_dim (int): E, the width of ``x``.
        num_heads (int): H; must divide ``qk_dim`` and ``v_dim``. Default: 1.
        qk_dim (int, optional): width of the queries and keys (all heads). Default: E.
        v_dim (int, optional): width of the values (all heads). Default: ``qk_dim``.
        kv_dim (int, optional): width of ``context``, the key/value input. Default: E.
        out_dim (int, optional): width of the output projection. Default: ``v_dim``.
        bias (bool): biases on the query, key and value projections. Default: True.
        out_proj (bool): apply an output projection ``v_dim -> out_dim``. Default: True.
        out_bias (bool, optional): bias on the output projection. Default: ``bias``.
        causal (bool): query i sees keys j <= i (top-left when L != S, as PyTorch's ``is_causal``). Default: False.
        causal_alignment (str): ``"top_left"`` or ``"bottom_right"`` (query i sees keys j <= i + S - L).
        attn_dropout (float): dropout on the attention weights in training mode. Default: 0.0.
        out_dropout (float): dropout on the output in training mode. Default: 0.0.
        scale (float, optional): factor on q k^T. Default: 1 / sqrt(qk_dim / H).
        context_length (int, optional): longest L and S accepted (ValueError beyond). Default: no limit.
        window (tuple of 2 ints, optional): sliding-window (local) attention, ``(left, right)``: query i sees keys
            j with i + S - L - left <= j <= i + S - L + right, -1 leaving a side unbounded (FlashAttention's
            ``window_size``, positions aligned bottom-right when L != S; Beltagy et al., "Longformer", 2020;
            Mistral 7B's sliding window of w keys before each query is ``causal=True, window=(w, 0)``). Combines
            with ``causal`` and the masks. Default: None.
        alibi (bool or array): ALiBi position biases (Press et al., "Train Short, Test Long", 2022): the score of
            query i and key j gets -slope_h * |i + S - L - j|. True: the paper's slopes for H heads
            (``attnpp.functional.get_alibi_slopes(num_heads)``); or an array (H,) of float slopes. Kept as the
            attribute ``alibi_slopes`` (float64 (H,) or None), not trained and not in the state dict. Default:
            False.
        softcap (float, optional): logit soft-capping (Gemma 2, Team Gemma 2024): the scores become
            ``softcap * tanh(scores / softcap)`` before the masks and ALiBi are added; > 0 (0 or None: off).
            Default: None.
        sinks (bool): learn an attention sink per head (gpt-oss, OpenAI 2025; Xiao et al., "Efficient Streaming
            Language Models with Attention Sinks", 2023): a logit that joins each softmax's denominator and takes
            no value, so that a head can attend to nothing (its weights then sum to less than 1). The parameter
            ``sinks`` (H,) starts at zeros, is in ``parameters()`` and ``state_dict()`` (key ``"sinks"``), gets
            its gradient from ``backward`` and is trained by the optimizers. Default: False.
        rotary (bool): rotary position embeddings, RoPE (Su et al., "RoFormer", 2021): each head's query and key
            are rotated by angles of their positions after the projections and before attention (queries at
            positions 0 .. L-1, keys at 0 .. S-1, in cross-attention too; after the cached tokens with a KV
            cache), so that q . k depends on the positions' difference; the backward rotates the gradients back
            (``attnpp.functional.rotary_embedding``). Default: False.
        rotary_dim (int, optional): R, the features of each query/key head rotated (the first R; even, at most
            the head width qk_dim / H; the rest pass through: partial rotary, as GPT-NeoX). Needs ``rotary``.
            Default: the head width.
        rotary_base (float): the base of RoPE's frequencies, base^(-2d/R) (``rope_theta``; > 0). Default:
            10000.0.
        rotary_interleaved (bool): rotate the feature pairs (2d, 2d + 1) (GPT-J) instead of (d, d + R/2)
            (GPT-NeoX, Llama's ``rotate_half``). Default: False.
        dtype: float32 (default), float64, float16 or bfloat16 (``ml_dtypes.bfloat16``, or the names): the
            parameters' and the inputs' dtype. Half precision is computed and accumulated in float32 and rounded
            once per output, as PyTorch's CPU kernels do.

    Sub-layers (``attnpp.nn.Linear``, weight (out, in)): ``q_proj`` (E -> qk_dim), ``k_proj`` (kv_dim -> qk_dim),
    ``v_proj`` (kv_dim -> v_dim), ``out_proj`` (v_dim -> out_dim, or None), and ``out_drop`` (``Dropout``).
    Parameter ``sinks`` (H,) with ``sinks=True``, else None.

    Raises:
        ValueError: H not dividing qk_dim or v_dim, a non-positive width, dropout outside [0, 1), a window side
            below -1, a negative or infinite softcap, alibi slopes of another shape than (H,) or not finite, an odd
            rotary_dim or one above the head width (or an odd head width with rotary=True and no rotary_dim), a
            rotary_base that is not finite and > 0, rotary_dim/rotary_base/rotary_interleaved without rotary=True.
        TypeError: another dtype, widths that are not ints, dropouts that are not floats,
            a window that is not two ints, alibi that is neither a bool nor a float array, sinks/rotary/
            rotary_interleaved that are not bools, a softcap or rotary_base that is not a number.
        MemoryError: widths too large to allocate.
    """

    def __init__(self, embed_dim, num_heads=1, *, qk_dim=None, v_dim=None, kv_dim=None, out_dim=None, bias=True,
                 out_proj=True, out_bias=None, causal=False, causal_alignment="top_left", attn_dropout=0.0,
                 out_dropout=0.0, scale=None, context_length=None, window=None, alibi=False, softcap=None,
                 sinks=False, rotary=False, rotary_dim=None, rotary_base=ROTARY_BASE, rotary_interleaved=False,
                 dtype=None):
        super().__init__(dtype)
        config = attention_config_of(locals())
        out_dropout, sinks = config.pop("out_dropout"), config.pop("sinks")
        self.__dict__.update(config)
        self.sinks = self.register_parameter("sinks", (self.num_heads,)) if sinks else None  # zeros
        self.q_proj = Linear(self.embed_dim, self.qk_dim, bias=bias, dtype=self.dtype)
        self.k_proj = Linear(self.kv_dim, self.qk_dim, bias=bias, dtype=self.dtype)
        self.v_proj = Linear(self.kv_dim, self.v_dim, bias=bias, dtype=self.dtype)
        out_bias = bias if out_bias is None else checks.check_bool(out_bias, "out_bias")
        self.out_proj = Linear(self.v_dim, self.out_dim, bias=out_bias, dtype=self.dtype) if out_proj else None
        self.out_drop = Dropout(out_dropout)
        self.last_seed = None  # the attention-dropout seed of the last forward (None when it had no dropout)

    # ----------------------------------------------------------------------------------------------- forward
    def _check(self, x, context, key_padding_mask):
        """The context (``x`` for self-attention), after checking the inputs."""
        checks.check_array(x, "x", dtype=self.dtype)
        if context is not None:
            checks.check_array(context, "context", dtype=self.dtype)
        if key_padding_mask is not None and not isinstance(key_padding_mask, np.ndarray):
            raise TypeError(f"key_padding_mask: expected a numpy.ndarray, got {type(key_padding_mask).__name__}")
        return checks.check_attention_layer_shapes(x, context, key_padding_mask, self.embed_dim, self.kv_dim,
                                                   self.context_length)

    def _heads(self, t):
        """(B, T, H * d) as a (B, H, T, d) view."""
        B, T, W = t.shape
        return t.reshape(B, T, self.num_heads, W // self.num_heads).transpose(0, 2, 1, 3)

    @staticmethod
    def _merge_heads(t):
        """(B, H, T, d) as (B, T, H * d) (a copy unless already laid out so)."""
        B, H, T, d = t.shape
        return t.transpose(0, 2, 1, 3).reshape(B, T, H * d)

    def _params(self, batch, masks=(), dropout_p=0.0, seed=0):
        """The core's AttentionParams of a forward over ``batch`` sequences with the layer's options."""
        sinks = None if self.sinks is None else self.sinks.data
        return F.attention_params((batch,), self.num_heads, self.dtype, scale=self.scale,
                                  causal=F.causal_mode(self.causal, self.causal_alignment), dropout_p=dropout_p,
                                  seed=seed, masks=masks, window=self.window, alibi_slopes=self.alibi_slopes,
                                  softcap=self.softcap, sinks=sinks)

    def _rotate(self, heads, offset, backward=False):
        """RoPE on (B, H, T, d) query or key heads at positions offset .. offset + T - 1 (offset an int or (B,)
        ints), or its backward on their gradient: a new (B, H, T, d) array."""
        rotate = F.rotary_embedding_backward if backward else F.rotary_embedding
        return rotate(heads, *rotary_tables(self, int(np.max(offset, initial=0)) + heads.shape[2], heads.dtype),
                      interleaved=self.rotary_interleaved, position_offset=offset)

    @locked
    def forward(self, x, context=None, key_padding_mask=None, need_weights=False, *, seed=None, kv_cache=None):
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x (ndarray): (B, L, E) or (L, E) unbatched, the layer's dtype: the queries' input.
            context (ndarray, optional): (B, S, kv_dim) or (S, kv_dim): the keys' and values' input
                (cross-attention; S may differ from L). Default: None, self-attention on ``x``.
            key_padding_mask (ndarray, optional): (B, S) or (S,). Boolean: True where a key is *masked out*
                (padding). Float: added to the scores. Combined with the causal mask. Default: None.
            need_weights (bool): also return the (B, H, L, S) attention weights (after dropout; with sinks a
                row sums to less than 1, the sink's share left out). Default: False.
            seed (int, optional): dropout seed for this call; the attention dropout uses ``seed`` (kept in
                ``last_seed``; mask ``attnpp.functional.dropout_mask((B, H, L, S), attn_dropout, last_seed)``)
                and the output dropout ``seed + 1`` (kept in ``out_drop.last_seed``). None draws from attnpp's
                global generator.
            kv_cache (KVCache, optional): incremental decoding (a causal self-attention layer): ``x`` (B, L_new, E)
                holds the next L_new tokens of each of the cache's B sequences (a prompt to prefill, then one
                token at a time). Their keys and values (after RoPE at positions ``kv_cache.lengths[b]`` onwards)
                are written into the cache, the queries attend to every cached token up to their own (causal,
                and the window, ALiBi, softcap and sinks of the layer, at their positions in the sequence), and
                ``kv_cache.lengths`` grows by L_new. The outputs equal those of a forward on the whole sequence
                at the same positions. Such a call is for inference: it saves no context for a backward (as under
                ``attnpp.no_grad()``, its sub-layers neither), so a later ``backward`` consumes the contexts of
                the forwards before it. It needs context, key_padding_mask and need_weights left at their
                defaults, and no active dropout (call ``eval()``, or build the layer without dropout). Make
                the cache with ``init_kv_cache``. Default: None.

        Returns:
            out (ndarray): (B, L, out_dim) or (L, out_dim); with ``need_weights``, ``(out, weights)``. A query
                whose keys are all masked attends to nothing: its attention output is 0.

        Raises:
            TypeError: inputs of another dtype than the layer's, a mask that is not an array, a kv_cache that is
                not a KVCache.
            ValueError: shapes that do not agree (named with their shapes), a sequence longer than
                context_length; with kv_cache: a layer that is not causal self-attention, context,
                key_padding_mask or need_weights given, dropout active, x not (B, L_new, E) for the cache's B, a cache
                of other heads, widths or dtype, or without room for L_new more tokens.
        """
        if kv_cache is not None:
            return self._decode(x, context, key_padding_mask, need_weights, kv_cache)
        self_attention = context is None
        x, context, key_padding_mask = (None if t is None else checks.as_ndarray(t, name) for t, name in
                                        ((x, "x"), (context, "context"), (key_padding_mask, "key_padding_mask")))
        context = self._check(x, context, key_padding_mask)
        batched = x.ndim == 3
        x3, c3 = (x, context) if batched else (x[None], context[None])
        B, L, S = x3.shape[0], x3.shape[1], c3.shape[1]
        H = self.num_heads
        # the weights first: one too large to allocate is a MemoryError before any work, the layer unchanged
        weights = empty((B, H, L, S), self.dtype) if need_weights else None
        masks = []
        if key_padding_mask is not None:
            kpm = F.additive_mask(key_padding_mask, self.dtype, "key_padding_mask", true_means_masked=True)
            masks.append(F.mask_arg(kpm.reshape(B, 1, 1, S), (B, H, L, S)))
        p = self.attn_dropout if self.training else 0.0
        dropping = self.training and (p > 0 or self.out_drop.p > 0)  # draw a seed only when one is used
        base_seed = checks.check_seed(seed, used=dropping)
        self.last_seed = base_seed if p > 0 else None
        params = self._params(B, masks, p, base_seed if p > 0 else 0)

        q, k, v = (self._heads(t) for t in (self.q_proj(x3), self.k_proj(c3), self.v_proj(c3)))  # (B, H, T, d)
        if self.rotary:
            q, k = self._rotate(q, 0), self._rotate(k, 0)
        attn = empty((B, L, self.v_dim), self.dtype)
        lse = np.empty((B, H, L), checks.compute_dtype(self.dtype))
        _core.sdpa_forward(self._heads(attn), lse, q, k, v, params)
        y = attn if self.out_proj is None else self.out_proj(attn)
        y = self.out_drop(y, seed=(base_seed + 1) % 2**64 if dropping else None)
        self._save_context(qkv=(q, k, v), attn=attn, lse=lse, params=params,
                           batched=batched, self_attention=self_attention,
                           out_shape=y.shape if batched else y.shape[1:])
        out = y if batched else y[0]
        if not need_weights:
            return out
        _core.sdpa_weights(weights, lse, q, k, params)
        return out, (weights if batched else weights[0])

    # ---------------------------------------------------------------------------------------- KV-cache decoding
    def init_kv_cache(self, batch_size, max_length, dtype=None):
        """An empty ``KVCache`` for decoding ``batch_size`` sequences of up to ``max_length`` tokens with this
        layer (``forward(x, kv_cache=cache)``): keys (B, H, max_length, qk_dim / H), values (B, H, max_length,
        v_dim / H), lengths (B,) zeros, in ``dtype``: the layer's (default), or float16 or bfloat16 under a
        float32 layer (half the memory and half the bytes a decoding step reads; the new keys and values are
        rounded into it, the attention computed in float32).

        Raises:
            ValueError: a layer that is not causal self-attention (causal=True, kv_dim == embed_dim), sizes below
                1, max_length above context_length. TypeError: sizes that are not ints, another dtype.
        """
        self._check_decoding()
        max_length = checks.check_int(max_length, "max_length", 1)
        if self.context_length is not None and max_length > self.context_length:
            raise ValueError(f"max_length={max_length} exceeds the layer's context_length={self.context_length}")
        H = self.num_heads
        dtype = self.dtype if dtype is None else checks.check_dtype(dtype)
        checks.check_cache_dtype(dtype, self.dtype, "dtype")
        return KVCache(batch_size, H, max_length, self.qk_dim // H, self.v_dim // H, dtype=dtype)

    def _check_decoding(self):
        if not self.causal or self.kv_dim != self.embed_dim:
            raise ValueError(f"kv_cache: decoding needs a causal self-attention layer (causal=True, kv_dim == "
                             f"embed_dim), got causal={self.causal}, kv_dim={self.kv_dim}, embed_dim="
                             f"{self.embed_dim}")

    def _decode(self, x, context, key_padding_mask, need_weights, cache):
        """``forward(x, kv_cache=cache)``: see there."""
        self._check_decoding()
        for name, value, default in (("context", context, None), ("key_padding_mask", key_padding_mask, None),
                                     ("need_weights", need_weights, False)):
            if value is not default:
                raise ValueError(f"kv_cache: {name} must be left at {default} when decoding with a KV cache")
        if self.training and (self.attn_dropout > 0 or self.out_drop.p > 0):
            raise ValueError("kv_cache: decoding applies no dropout, but the layer is in training mode with "
                             f"attn_dropout={self.attn_dropout}, out_dropout={self.out_drop.p}: call eval() first")
        if not isinstance(cache, KVCache):
            raise TypeError(f"kv_cache: expected an attnpp.nn.KVCache (from init_kv_cache), got "
                            f"{type(cache).__name__}")
        x = checks.check_array(x, "x", ndim=3, dtype=self.dtype)
        B, L, E = x.shape
        H = self.num_heads
        if E != self.embed_dim or B != cache.batch_size:
            raise ValueError(f"x: expected (B, L_new, embed_dim) = ({cache.batch_size}, L_new, {self.embed_dim}) "
                             f"(the cache's batch size), got {x.shape}")
        want = ((B, H, cache.max_length, self.qk_dim // H), (B, H, cache.max_length, self.v_dim // H))
        checks.check_cache_dtype(cache.dtype, self.dtype, "kv_cache")
        if (cache.key.shape, cache.value.shape) != want:
            raise ValueError(f"kv_cache: expected key {want[0]} and value {want[1]} (this layer's heads and widths), "
                             f"got key {cache.key.shape} and value {cache.value.shape}: make it with init_kv_cache")
        lengths = cache.lengths
        if not isinstance(lengths, np.ndarray) or lengths.dtype != np.int64 or lengths.shape != (B,):
            raise ValueError(f"kv_cache.lengths: expected an int64 array ({B},)")
        limit = cache.max_length if self.context_length is None else min(cache.max_length, self.context_length)
        if (lengths < 0).any() or (lengths > limit - L).any():
            raise ValueError(f"kv_cache: no room for {L} more tokens: lengths {lengths.tolist()}, max_length="
                             f"{cache.max_length}, context_length={self.context_length}")
        sinks = None if self.sinks is None else self.sinks.data
        with no_grad():  # (no context in the projections either: a backward must not consume theirs)
            q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
            if self.rotary:
                q, k = self._rotate(q, lengths), self._rotate(k, lengths)
            out = F.scaled_dot_product_attention_with_kvcache(
                q, cache.key, cache.value, lengths, k, v, is_causal=True, scale=self.scale, window=self.window,
                alibi_slopes=self.alibi_slopes, softcap=self.softcap, sinks=sinks)
            y = self._merge_heads(out)
            y = y if self.out_proj is None else self.out_proj(y)
        lengths += L
        self.last_seed = None
        return y

    # ---------------------------------------------------------------------------------------------- backward
    @locked
    def backward(self, grad_output):
        """Gradients of the most recent ``forward`` not yet consumed (one context per forward outside
        ``attnpp.no_grad()``, consumed last-in first-out: see ``attnpp.nn.Module``; a forward with a
        ``kv_cache`` saves none).

        Args:
            grad_output (ndarray): the output's shape and dtype.

        Returns:
            grad_x for self-attention (``context=None``), ``(grad_x, grad_context)`` when a context was given,
                shaped like the inputs.
                Accumulates (+=) into every parameter's ``grad`` (``sinks`` included).

        Raises:
            ValueError: no forward context left, grad_output of another shape than its forward's output.
            TypeError: another dtype.
        """
        ctx = self._consume_context(grad_output)
        g = self.out_drop.backward(grad_output if ctx["batched"] else grad_output[None])
        d_attn = g if self.out_proj is None else self.out_proj.backward(g)
        q, k, v = ctx["qkv"]  # (B, H, T, d), as the kernel read them
        dq, dk, dv = (zeros((t.shape[0], t.shape[2], t.shape[1] * t.shape[3]), t.dtype) for t in (q, k, v))
        _core.sdpa_backward(*(self._heads(t) for t in (dq, dk, dv, np.ascontiguousarray(d_attn), ctx["attn"])),
                            ctx["lse"], q, k, v, ctx["params"],
                            grad_sinks=None if self.sinks is None else self.sinks.grad_buffer())
        if self.rotary:  # (B, T, H * d) gradients of the rotated heads -> of the projections' outputs
            dq, dk = (self._merge_heads(self._rotate(self._heads(t), 0, backward=True)) for t in (dq, dk))
        grad_x = self.q_proj.backward(dq)
        grad_c = self.k_proj.backward(dk) + self.v_proj.backward(dv)
        if not ctx["batched"]:
            grad_x, grad_c = grad_x[0], grad_c[0]
        return grad_x + grad_c if ctx["self_attention"] else (grad_x, grad_c)

    def extra_repr(self):
        E, H = self.embed_dim, self.num_heads
        return self._format_args(f"embed_dim={E}", num_heads=(H, 1), qk_dim=(self.qk_dim, E),
                                 v_dim=(self.v_dim, self.qk_dim), kv_dim=(self.kv_dim, E),
                                 causal=(self.causal, False), causal_alignment=(self.causal_alignment, "top_left"),
                                 attn_dropout=(self.attn_dropout, 0.0),
                                 scale=(self.scale, (self.qk_dim // H) ** -0.5),
                                 context_length=(self.context_length, None), **variant_args(self))
