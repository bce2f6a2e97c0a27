import inspect
import math
from collections.abc import Mapping

import numpy as np

from .. import _core
from .. import _checks as checks
from .. import functional as F
from .._pool import empty, zeros
from ..grad_mode import no_grad
from .dropout import Dropout
from .kv_cache import KVCache
from .linear import Linear
from .module import IncompatibleKeys, Module, locked, to_numpy

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


def attention_config(embed_dim, num_heads=1, qk_dim=None, v_dim=None, kv_dim=None, out_dim=None, out_proj=True,
                     causal=False, causal_alignment="top_left", attn_dropout=0.0, out_dropout=0.0, scale=None,
                     context_length=None, *, window=None, alibi=False, softcap=None, sinks=False, rotary=False,
                     rotary_dim=None, rotary_base=10000.0, rotary_interleaved=False):
    """The checked widths and options of an ``Attention`` layer (also ``attnpp.torch.Attention``'s), defaults
    filled in: a dict of embed_dim, num_heads, qk_dim, v_dim, kv_dim, out_dim, causal, causal_alignment,
    attn_dropout, out_dropout, scale, context_length, window ((left, right) or None), alibi_slopes (float64
    ndarray (H,) or None), softcap (float or None), sinks (bool: the layer learns a sink logit per head), rotary
    (bool), rotary_dim (int or None), rotary_base and rotary_interleaved. Raises as ``Attention`` says."""
    E = checks.check_int(embed_dim, "embed_dim", 1)
    H = checks.check_int(num_heads, "num_heads", 1)
    qk_dim = E if qk_dim is None else checks.check_int(qk_dim, "qk_dim", 1)
    v_dim = qk_dim if v_dim is None else checks.check_int(v_dim, "v_dim", 1)
    for name, width in (("qk_dim", qk_dim), ("v_dim", v_dim)):
        if width % H:
            raise ValueError(f"{name} must be divisible by num_heads, got {name}={width}, num_heads={H}")
    F.causal_mode(causal, causal_alignment)  # (ValueError for an unknown alignment)
    out_dim = None if out_dim is None else checks.check_int(out_dim, "out_dim", 1)
    if not checks.check_bool(out_proj, "out_proj") and out_dim is not None and out_dim != v_dim:
        raise ValueError(f"out_dim={out_dim} needs out_proj=True (without it the output width is v_dim)")
    scale = checks.check_scale(scale)
    if context_length is not None:
        context_length = checks.check_int(context_length, "context_length", 1)
    return dict(embed_dim=E, num_heads=H, qk_dim=qk_dim, v_dim=v_dim,
                kv_dim=E if kv_dim is None else checks.check_int(kv_dim, "kv_dim", 1),
                out_dim=v_dim if out_dim is None or not out_proj else out_dim,
                causal=checks.check_bool(causal, "causal"), causal_alignment=causal_alignment,
                attn_dropout=checks.check_probability(attn_dropout, "attn_dropout"),
                out_dropout=checks.check_probability(out_dropout, "out_dropout"),
                scale=(qk_dim // H) ** -0.5 if scale is None else scale,
                context_length=context_length,
                window=checks.check_window(window), alibi_slopes=_alibi_slopes(alibi, H),
                softcap=checks.check_softcap(softcap), sinks=checks.check_bool(sinks, "sinks"),
                **_rotary_config(rotary, rotary_dim, rotary_base, rotary_interleaved, qk_dim // H))


def attention_config_of(arguments):
    """``attention_config`` of a layer constructor's arguments (its ``locals()``: ``Attention``'s and
    ``attnpp.torch.Attention``'s, which take the same)."""
    return attention_config(**{name: arguments[name] for name in _CONFIG_ARGUMENTS})


_CONFIG_ARGUMENTS = tuple(inspect.signature(attention_config).parameters)


def _alibi_slopes(alibi, num_heads):
    """The ``alibi`` option as the slopes (H,) float64 (True: ``get_alibi_slopes(H)``), or None (False)."""
    if isinstance(alibi, (bool, np.bool_)):
        return F.get_alibi_slopes(num_heads, np.float64) if alibi else None
    if not isinstance(alibi, (np.ndarray, list, tuple)) and not hasattr(alibi, "__dlpack__"):
        raise TypeError(f"alibi: expected a bool or an array of num_heads={num_heads} slopes, got "
                        f"{type(alibi).__name__}")
    slopes = np.asarray(to_numpy(alibi, "alibi") if hasattr(alibi, "detach") else alibi)
    if slopes.dtype.kind != "f":
        raise TypeError(f"alibi: expected float slopes, got dtype {slopes.dtype}")
    if slopes.shape != (num_heads,):
        raise ValueError(f"alibi: expected slopes of shape (num_heads,) = ({num_heads},), got {slopes.shape}")
    if not np.isfinite(slopes).all():
        raise ValueError(f"alibi: expected finite slopes, got {slopes.tolist()}")
    return np.array(slopes, dtype=np.float64)


def _rotary_config(rotary, rotary_dim, rotary_base, rotary_interleaved, head_dim):
    """The checked RoPE options: rotary, rotary_dim (default the head width), rotary_base, rotary_interleaved."""
    rotary = checks.check_bool(rotary, "rotary")
    rotary_interleaved = checks.check_bool(rotary_interleaved, "rotary_interleaved")
    if not checks.is_real(rotary_base):
        raise TypeError(f"rotary_base: expected a float, got {type(rotary_base).__name__}")
    if not (math.isfinite(rotary_base) and rotary_base > 0):
        raise ValueError(f"rotary_base must be finite and > 0, got {rotary_base!r}")
    if not rotary:
        given = [n for n, v, default in (("rotary_dim", rotary_dim, None), ("rotary_base", rotary_base, 10000.0),
                                         ("rotary_interleaved", rotary_interleaved, False)) if v != default]
        if given:
            raise ValueError(f"{', '.join(given)} given without rotary=True (RoPE is off)")
        return dict(rotary=False, rotary_dim=None, rotary_base=10000.0, rotary_interleaved=False)
    if rotary_dim is None:
        if head_dim % 2:
            raise ValueError(f"rotary=True: the head width qk_dim / num_heads = {head_dim} is odd; RoPE rotates "
                             f"pairs of features: give an even rotary_dim < {head_dim}")
        rotary_dim = head_dim
    rotary_dim = checks.check_int(rotary_dim, "rotary_dim", 2)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and at most the head width qk_dim / num_heads = {head_dim}, "
                         f"got {rotary_dim}")
    return dict(rotary=True, rotary_dim=rotary_dim, rotary_base=float(rotary_base),
                rotary_interleaved=rotary_interleaved)


def rotary_tables(layer, positions, dtype):
    """The (cos, sin) RoPE tables (P, rotary_dim / 2) of ``layer`` (an ``Attention``, attnpp's or attnpp.torch's)
    in ``dtype``, for at least ``positions`` positions. Kept in ``layer._rotary_tables`` and grown by doubling (up
    to context_length), so that decoding token by token computes them a few times only."""
    cache = layer.__dict__.get("_rotary_tables")
    if cache is None or cache[0].dtype != dtype or cache[0].shape[0] < positions:
        size = max(positions, 64, 2 * (0 if cache is None else cache[0].shape[0]))
        if layer.context_length is not None:
            size = max(positions, min(size, layer.context_length))
        cache = F.rotary_tables(size, layer.rotary_dim, layer.rotary_base, dtype)
        layer.__dict__["_rotary_tables"] = cache
    return cache


def variant_args(layer):
    """The variant options of an ``Attention`` layer (attnpp's or attnpp.torch's) for its ``repr``, as the
    constructor takes them: ``{name: (value, default)}``."""
    alibi = layer.alibi_slopes is not None
    if alibi and not np.array_equal(layer.alibi_slopes, F.get_alibi_slopes(layer.num_heads, np.float64)):
        alibi = layer.alibi_slopes.tolist()
    head_dim = layer.qk_dim // layer.num_heads
    return dict(window=(layer.window, None), alibi=(alibi, False), softcap=(layer.softcap, None),
                sinks=(layer.sinks is not None, False), rotary=(layer.rotary, False),
                rotary_dim=(layer.rotary_dim, head_dim if layer.rotary else None),
                rotary_base=(layer.rotary_base, 10000.0), rotary_interleaved=(layer.rotary_interleaved, False))


def _as_array(value, name):
    """A weight given to a ``load_*`` method (NumPy array or torch tensor) as a floating ndarray, else TypeError
    naming the argument."""
    if not isinstance(value, np.ndarray) and not (hasattr(value, "detach") and hasattr(value, "cpu")):
        raise TypeError(f"{name}: expected an array or tensor, got {type(value).__name__}")
    value = to_numpy(value, name)
    if value.dtype.kind != "f":
        raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    return value


class Attention(Module):
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
    from the keys and each key goes through the loader above that fits it (one table, ``_ARTICLE_LAYOUTS``):

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
                 sinks=False, rotary=False, rotary_dim=None, rotary_base=10000.0, rotary_interleaved=False,
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

    def __getstate__(self):  # (the RoPE tables are recomputed when needed, not copied)
        state = super().__getstate__()
        state.pop("_rotary_tables", None)
        return state

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
        if dtype != self.dtype and not (dtype in checks.HALVES and self.dtype == np.float32):
            raise TypeError(f"dtype: expected the layer's {self.dtype}, or float16 or bfloat16 under a float32 "
                            f"layer, got {dtype}")
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
        fits = cache.dtype == self.dtype or (cache.dtype in checks.HALVES and self.dtype == np.float32)
        if (cache.key.shape, cache.value.shape) != want or not fits:
            raise ValueError(f"kv_cache: expected key {want[0]} and value {want[1]} of {np.dtype(self.dtype)} "
                             f"(this layer's heads and widths; or of a half-precision dtype under a float32 layer), "
                             f"got key {cache.key.shape} and value {cache.value.shape} of {cache.dtype}: make it "
                             f"with init_kv_cache")
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

    # ---------------------------------------------------------------------------------------- weight loading
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
        ``load_fused_kv``, ``load_heads``), as ``_ARTICLE_LAYOUTS`` in this file says:

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

    def extra_repr(self):
        E, H = self.embed_dim, self.num_heads
        return self._format_args(f"embed_dim={E}", num_heads=(H, 1), qk_dim=(self.qk_dim, E),
                                 v_dim=(self.v_dim, self.qk_dim), kv_dim=(self.kv_dim, E),
                                 causal=(self.causal, False), causal_alignment=(self.causal_alignment, "top_left"),
                                 attn_dropout=(self.attn_dropout, 0.0),
                                 scale=(self.scale, (self.qk_dim // H) ** -0.5),
                                 context_length=(self.context_length, None), **variant_args(self))
