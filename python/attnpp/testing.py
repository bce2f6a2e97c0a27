"""PyTorch references for checking attnpp (as ``torch.testing`` is for PyTorch): the tests, the benchmark
(``attnpp.bench``) and the notebooks share them from here, so that each reference is written once.

It needs PyTorch (``pip install ".[test]"``) and imports it at the top; ``import attnpp`` never imports this
module. What is in it:

- ``to_tensor``: a torch tensor copy of an array, optionally cast and requiring grad;
- ``ReplayDropout``: a stand-in for ``torch.nn.Dropout`` that applies a given keep-mask (attnpp's, from
  ``attnpp.functional.dropout_mask``), so that a PyTorch model drops exactly what attnpp dropped;
- the attention math written from its definitions: ``variant_scores`` (scores with the soft cap, masks, ALiBi,
  causal diagonal and window), ``reference`` (attention with every variant: output and log-sum-exp),
  ``rotary_reference`` (RoPE) and ``attention_layer_reference`` (``attnpp.nn.Attention``'s math from a layer's
  own weights);
- the reference articles' PyTorch classes (signatures, parameter names, buffers and algorithm as each article
  writes them), ``Article000CausalSelfAttention`` ... ``Article004MultiHeadAttention``, whose state dicts load
  unchanged into ``attnpp.nn.Attention``. The notebooks that replicate an article write its classes themselves.

Conventions (docs/design.md): shape letters B batch, H heads (Hq query heads, Hk key/value heads), L query length,
S key length, T sequence length, D query/key head width, Dv value head width, E model width, V vocabulary; boolean
masks follow PyTorch: in ``scaled_dot_product_attention`` True = the key takes part, in the layers'
``key_padding_mask`` True = the key is masked out.
"""
import math

import numpy as np
import torch

from .torch import from_numpy, to_numpy

__all__ = ["to_tensor", "ReplayDropout", "variant_scores", "reference", "rotary_reference",
           "attention_layer_reference", "Article000CausalSelfAttention", "Article000MultiheadAttention",
           "Article001HelloWorldModel", "Article002SelfAttention", "Article002MultiHeadAttentionWrapper",
           "Article003SingleHeadAttention", "Article003CausalAttention", "Article003CausalCrossAttention",
           "Article004MultiHeadAttention"]


def to_tensor(x, grad=False, dtype=None):
    """A torch tensor copy of the array (or tensor) ``x`` (any shape; bool stays bool, integers stay integers; a
    floating array is cast to the torch ``dtype`` if given), a leaf requiring grad if ``grad``."""
    if isinstance(x, torch.Tensor):  # (np.array of a tensor goes through its __array__, deprecated by NumPy 2)
        x = to_numpy(x)
    x = np.array(x, order="C")  # (a copy: from_numpy shares it)
    t = from_numpy(x)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.requires_grad_() if grad else t


class ReplayDropout(torch.nn.Module):
    """Stands in for ``torch.nn.Dropout(p)``: in training mode multiplies its input by ``keep / (1 - p)``, a given
    keep-mask (True = kept; e.g. ``attnpp.functional.dropout_mask(shape, p, layer.last_seed)``) broadcastable to the
    input, e.g. (B, H, L, S) for attention weights; the identity in eval mode, as ``torch.nn.Dropout``. The factor
    is kept in float64 and cast to the input's dtype."""

    def __init__(self, keep, p):
        super().__init__()
        self.factor = torch.from_numpy(np.asarray(keep, dtype=np.float64) / (1.0 - p))

    def forward(self, input):
        return input * self.factor.to(input.dtype) if self.training else input


# ------------------------------------------------------------------------------- attention from the definitions
# The variants' definitions (as FlashAttention's, whose positions are aligned bottom-right: query i sits at key
# position i + S - L): scores s = scale * q k^T; soft cap s = softcap * tanh(s / softcap); then the float mask and
# the ALiBi bias -slope_h * |i + S - L - j| are added; keys outside the window [i + S - L - left, i + S - L + right]
# (-1: unbounded), after the causal diagonal, or masked out are hidden; the softmax's denominator also holds
# exp(sink_h), a logit with no value; dropout zeroes weights where attnpp's dropout_mask says so.
def variant_scores(s, *, attn_mask=None, is_causal=False, causal_alignment="top_left", window=None,
                   alibi_slopes=None, softcap=None):
    """Scores (B, H, L, S) with the soft cap, a float ``attn_mask`` and ALiBi (slopes (H,) or (B, H)) applied and
    the keys a query does not see (bool ``attn_mask`` False, after the causal diagonal, outside the window
    ``(left, right)``) at -inf. ``attn_mask`` broadcasts to (B, H, L, S)."""
    B, H, L, S = s.shape
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    visible = torch.ones(L, S, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            s = s + attn_mask
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).reshape(-1, H)[:, :, None, None]
        s = s - slopes * (i + S - L - j).abs()
    if is_causal:
        visible = visible & (j <= i + (S - L if causal_alignment == "bottom_right" else 0))
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j >= i + S - L - left)
        if right >= 0:
            visible = visible & (j <= i + S - L + right)
    return s.masked_fill(~visible, float("-inf"))


def reference(q, k, v, *, attn_mask=None, is_causal=False, causal_alignment="top_left", scale=None, window=None,
              alibi_slopes=None, softcap=None, sinks=None, keep=None, dropout_p=0.0):
    """Output (B, Hq, L, Dv) and log-sum-exp (B, Hq, L) of attention from the definitions, on torch tensors
    q (B, Hq, L, D), k (B, Hk, S, D), v (B, Hk, S, Dv) (Hq a multiple of Hk), differentiable; alibi_slopes (Hq,) or
    (B, Hq), sinks (Hq,), keep (B, Hq, L, S) the dropout keep-mask of ``dropout_p``. Rows that see no key give
    output 0 and log-sum-exp -inf."""
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = 1 / D ** 0.5 if scale is None else scale
    s = variant_scores(scale * q @ k.transpose(-1, -2), attn_mask=attn_mask, is_causal=is_causal,
                       causal_alignment=causal_alignment, window=window, alibi_slopes=alibi_slopes, softcap=softcap)
    S = s.shape[-1]
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(B, Hq, L, 1)], dim=-1)
    with torch.no_grad():
        hidden = torch.logsumexp(s, dim=-1) == -torch.inf  # rows that see nothing: weights 0, gradient 0
    # (their log-sum-exp is taken of zeros, then set to -inf: logsumexp's gradient of a row of -inf is NaN)
    lse = torch.where(hidden, -torch.inf, torch.logsumexp(s.masked_fill(hidden[..., None], 0.0), dim=-1))
    p = torch.exp(s - torch.where(hidden, 0.0, lse)[..., None]).masked_fill(hidden[..., None], 0.0)
    p = p[..., :S]
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v, lse


def rotary_reference(x, positions, rotary_dim, base=10000.0, interleaved=False):
    """RoPE from its definition (Su et al., 2021) on a torch tensor x (..., T, D) at integer ``positions`` (T,):
    the pairs (d, d + R/2) (Hugging Face's rotate_half) or (2d, 2d + 1) (interleaved) of the first R = rotary_dim
    features rotated by positions * base^(-2d/R) (angles in float64, then x's dtype); the rest unchanged. Returns
    x's shape."""
    R = rotary_dim
    inv_freq = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    angle = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq          # (T, R/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    rot, rest = x[..., :R], x[..., R:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :R // 2], rot[..., R // 2:]
        rot = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([rot, rest], dim=-1)


def attention_layer_reference(layer, x, context, kpm, keep_attn=None, keep_out=None, dtype=None):
    """attnpp.nn.Attention's math in PyTorch from the layer's own weights, computed in the torch ``dtype``
    (default theirs), on batched tensors x (B, L, E) and context (B, S, kv_dim) (``x`` itself for
    self-attention): the projections, heads, RoPE (queries at positions 0 .. L-1, keys at 0 .. S-1), scores, the
    layer's variants (soft cap, ALiBi, window, sinks) with its causal mask and the bool (True = masked out) or
    float key_padding_mask ``kpm`` (B, S) (an array, or None), softmax (_safe_softmax: rows that see nothing give
    0, as PyTorch's scaled_dot_product_attention), dropout replayed from ``keep_attn`` (B, H, L, S) and
    ``keep_out`` (B, L, out_dim), output projection. Returns (out (B, L, out_dim), weights (B, H, L, S),
    {parameter name: leaf tensor})."""
    P = {n: to_tensor(p.data, True, dtype) for n, p in layer.named_parameters()}
    lin = lambda t, name: torch.nn.functional.linear(t, P[name + ".weight"], P.get(name + ".bias"))
    H = layer.num_heads
    q, k, v = lin(x, "q_proj"), lin(context, "k_proj"), lin(context, "v_proj")
    split = lambda t: t.reshape(t.shape[0], t.shape[1], H, -1).transpose(1, 2)   # (B, H, T, d)
    q, k, v = split(q), split(k), split(v)
    L, S = q.shape[2], k.shape[2]
    if layer.rotary:
        rope = dict(rotary_dim=layer.rotary_dim, base=layer.rotary_base, interleaved=layer.rotary_interleaved)
        q, k = rotary_reference(q, np.arange(L), **rope), rotary_reference(k, np.arange(S), **rope)
    mask = None
    if kpm is not None:
        kpm = to_tensor(kpm, dtype=dtype)[:, None, None, :]
        mask = ~kpm if kpm.dtype == torch.bool else kpm
    alibi = None if layer.alibi_slopes is None else torch.tensor(layer.alibi_slopes)
    scores = variant_scores(q @ k.transpose(-1, -2) * layer.scale, attn_mask=mask, is_causal=layer.causal,
                            causal_alignment=layer.causal_alignment, window=layer.window, alibi_slopes=alibi,
                            softcap=layer.softcap)                                 # (B, H, L, S)
    if "sinks" in P:
        scores = torch.cat([scores, P["sinks"][None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    w = torch.ops.aten._safe_softmax(scores, -1)[..., :S]
    if keep_attn is not None:
        w = w * to_tensor(keep_attn, dtype=dtype) / (1 - layer.attn_dropout)
    out = (w @ v).transpose(1, 2).flatten(-2)
    if layer.out_proj is not None:
        out = lin(out, "out_proj")
    if keep_out is not None:
        out = out * to_tensor(keep_out, dtype=dtype) / (1 - layer.out_drop.p)
    return out, w, P


# -------------------------------------------------------------------------------------------- the articles
# Each class follows its article's (signature, parameter names, buffers, algorithm), so that its state_dict() is
# the article's; attnpp.nn.Attention loads it unchanged (nn/weight_loading.py's table of article layouts).
def _triu(n, dtype=None):
    """(n, n): ones strictly above the diagonal (the articles' causal-mask buffers)."""
    return torch.triu(torch.ones(n, n, dtype=dtype), diagonal=1)


def _softmax_attend(q, k, v, masked, scale, dropout=None):
    """dropout(softmax(scale * q k^T, masked keys at -inf)) v on (..., L, D), (..., S, D), (..., S, Dv) ->
    (..., L, Dv); ``masked`` (True = masked out) broadcasts to (..., L, S), or None; ``dropout`` a module or None."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    weights = scores.softmax(dim=-1)
    return (weights if dropout is None else dropout(weights)) @ v


class Article000CausalSelfAttention(torch.nn.Module):
    """Article 000's ``CausalSelfAttention(d_in, d_out, context_length, attn_bias=True)``: one causal head,
    ``nn.Linear`` projections ``w_q``, ``w_k``, ``w_v``, scores / sqrt(d_out), the ``causal_mask`` buffer
    (context_length, context_length). Forward x (B, T, d_in) -> (B, T, d_out), T <= context_length."""

    def __init__(self, d_in, d_out, context_length, attn_bias=True):
        super().__init__()
        self.d_out = d_out
        self.w_q = torch.nn.Linear(d_in, d_out, bias=attn_bias)
        self.w_k = torch.nn.Linear(d_in, d_out, bias=attn_bias)
        self.w_v = torch.nn.Linear(d_in, d_out, bias=attn_bias)
        self.register_buffer("causal_mask", _triu(context_length))

    def forward(self, x):
        t = x.shape[1]
        return _softmax_attend(self.w_q(x), self.w_k(x), self.w_v(x), self.causal_mask[:t, :t].bool(),
                               self.d_out ** -0.5)


class Article000MultiheadAttention(torch.nn.Module):
    """Article 000's ``MultiheadAttention(d_in, d_out, num_heads, context_length, qkv_bias=True)``: causal heads
    of width d_out / num_heads, dropout 0.1 on the weights, heads concatenated, output projection. Forward
    x (B, T, d_in) -> (B, T, d_out), T <= context_length."""

    def __init__(self, d_in, d_out, num_heads, context_length, qkv_bias=True):
        super().__init__()
        self.num_heads, self.d_head = num_heads, d_out // num_heads
        self.w_q = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.w_k = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.w_v = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = torch.nn.Dropout(0.1)
        self.out_proj = torch.nn.Linear(d_out, d_out)
        self.register_buffer("causal_mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):                                       # x (B, T, E) -> (B, T, d_out)
        B, T, _ = x.shape
        heads = lambda t: t.reshape(B, T, self.num_heads, -1).transpose(1, 2)   # (B, H, T, d_head)
        q, k, v = heads(self.w_q(x)), heads(self.w_k(x)), heads(self.w_v(x))
        attn = q @ k.transpose(2, 3)                            # (B, H, T, T)
        attn.masked_fill_(self.causal_mask[:T, :T].bool(), -torch.inf)
        attn = self.dropout(torch.softmax(attn * self.d_head ** -0.5, dim=-1))
        return self.out_proj((attn @ v).transpose(1, 2).flatten(-2))


class Article001HelloWorldModel(torch.nn.Module):
    """Article 001's model: token + position embeddings (n_vocab, n_embd) and (context_length, n_embd), one causal
    head (``nn.Linear`` without bias, scores times ``scale``, the article's 1 / sqrt(3)), logits. Forward
    x (B, T) token ids -> logits (B, T, n_vocab), T <= context_length."""

    def __init__(self, n_embd, n_vocab, context_length, scale=1 / math.sqrt(3)):
        super().__init__()
        self.scale = scale
        self.tok_emb = torch.nn.Embedding(n_vocab, n_embd)
        self.pos_emb = torch.nn.Embedding(context_length, n_embd)
        self.q_wt = torch.nn.Linear(n_embd, n_embd, bias=False)
        self.k_wt = torch.nn.Linear(n_embd, n_embd, bias=False)
        self.v_wt = torch.nn.Linear(n_embd, n_embd, bias=False)
        self.out = torch.nn.Linear(n_embd, n_vocab, bias=False)

    def forward(self, x):                                       # x (B, T) token ids -> logits (B, T, V)
        ec = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))               # (B, T, C)
        q, k, v = self.q_wt(ec), self.k_wt(ec), self.v_wt(ec)
        attn = q @ k.transpose(-1, -2)                                                # (B, T, T)
        attn = attn.masked_fill(torch.tril(torch.ones_like(attn)) == 0, float("-inf"))
        return self.out(torch.softmax(attn * self.scale, dim=-1) @ v)


class Article002SelfAttention(torch.nn.Module):
    """Article 002's ``SelfAttention(d_in, d_out_kq, d_out_v)``: ``nn.Parameter`` matrices W_query, W_key
    (d_in, d_out_kq) and W_value (d_in, d_out_v) from ``torch.rand``, applied as ``x @ W``, scores /
    sqrt(d_out_kq). Forward x (L, d_in) -> (L, d_out_v); with ``context`` (S, d_in) the article's
    ``CrossAttention`` (keys and values from the context)."""

    def __init__(self, d_in, d_out_kq, d_out_v):
        super().__init__()
        self.d_out_kq = d_out_kq
        self.W_query = torch.nn.Parameter(torch.rand(d_in, d_out_kq))
        self.W_key = torch.nn.Parameter(torch.rand(d_in, d_out_kq))
        self.W_value = torch.nn.Parameter(torch.rand(d_in, d_out_v))

    def forward(self, x, context=None):
        c = x if context is None else context
        return _softmax_attend(x @ self.W_query, c @ self.W_key, c @ self.W_value, None, self.d_out_kq ** -0.5)


class Article002MultiHeadAttentionWrapper(torch.nn.Module):
    """Article 002's ``MultiHeadAttentionWrapper(d_in, d_out_kq, d_out_v, num_heads)``: ``num_heads``
    Article002SelfAttention in ``heads``, outputs concatenated. Forward x (L, d_in) -> (L, num_heads * d_out_v)."""

    def __init__(self, d_in, d_out_kq, d_out_v, num_heads):
        super().__init__()
        self.heads = torch.nn.ModuleList([Article002SelfAttention(d_in, d_out_kq, d_out_v)
                                          for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], dim=-1)


class Article003SingleHeadAttention(torch.nn.Module):
    """Article 003's ``SingleHeadAttention(hidden_size, bias=True)``: a fused ``Wqkv`` (C -> 3 C/4), one head of
    width C/4, scores / sqrt(C/4), ``Wo`` (C/4 -> C). Forward x (B, S, C) -> (B, S, C)."""

    def __init__(self, hidden_size, bias=True):
        super().__init__()
        self.Wqkv = torch.nn.Linear(hidden_size, hidden_size // 4 * 3, bias=bias)
        self.Wo = torch.nn.Linear(hidden_size // 4, hidden_size, bias=bias)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.Wqkv(x).reshape(b, s, 3, c // 4).unbind(dim=2)
        return self.Wo(_softmax_attend(q, k, v, None, 1 / math.sqrt(c // 4)))


class Article003CausalAttention(torch.nn.Module):
    """Article 003's ``CausalAttention(hidden_size, num_heads, context_size, attn_drop, out_drop, bias)`` or, with
    ``context_size`` None, its ``BidirectionalAttention``: a fused ``Wqkv`` (C -> 3C), ``num_heads`` heads, the
    ``causal_mask`` buffer (1, 1, context_size, context_size) (True = masked out), dropout on the weights
    (``attn_drop``), ``Wo``, dropout on its output (``out_drop``). Forward x (B, S, C) and ``mask`` (B, S) bool
    (True = padding, masked out) -> (B, S, C)."""

    def __init__(self, hidden_size, num_heads, context_size=None, attn_drop=0.1, out_drop=0.1, bias=True):
        super().__init__()
        self.nh = num_heads
        self.Wqkv = torch.nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.Wo = torch.nn.Linear(hidden_size, hidden_size, bias=bias)
        self.attn_drop, self.out_drop = torch.nn.Dropout(attn_drop), torch.nn.Dropout(out_drop)
        if context_size is not None:
            self.register_buffer("causal_mask", _triu(context_size, torch.bool).view(1, 1, context_size, context_size))

    def forward(self, x, mask):
        b, s, c = x.shape
        q, k, v = self.Wqkv(x).reshape(b, s, 3, self.nh, c // self.nh).transpose(3, 1).unbind(dim=2)
        masked = mask.view(b, 1, 1, s)
        if hasattr(self, "causal_mask"):
            masked = masked | self.causal_mask[:, :, :s, :s]
        out = _softmax_attend(q, k, v, masked, 1 / math.sqrt(c // self.nh), self.attn_drop)
        return self.out_drop(self.Wo(out.transpose(1, 2).reshape(b, s, c)))


class Article003CausalCrossAttention(torch.nn.Module):
    """Article 003's ``CausalCrossAttention(hidden_size, num_heads, context_size, attn_drop, out_drop, bias)``:
    queries from x through ``Wq``, keys and values from y through a fused ``Wkv`` (C -> 2C), the ``causal_mask``
    buffer, dropout on the weights (``attn_drop``), ``Wo``, dropout on its output (``out_drop``). Forward
    x (B, S, C), y (B, S, C) (the article: y has x's shape) and ``mask`` (B, S) bool (True = masked out) ->
    (B, S, C)."""

    def __init__(self, hidden_size, num_heads, context_size, attn_drop=0.1, out_drop=0.1, bias=True):
        super().__init__()
        self.nh = num_heads
        self.Wq = torch.nn.Linear(hidden_size, hidden_size, bias=bias)
        self.Wkv = torch.nn.Linear(hidden_size, 2 * hidden_size, bias=bias)
        self.Wo = torch.nn.Linear(hidden_size, hidden_size, bias=bias)
        self.attn_drop, self.out_drop = torch.nn.Dropout(attn_drop), torch.nn.Dropout(out_drop)
        self.register_buffer("causal_mask", _triu(context_size, torch.bool).view(1, 1, context_size, context_size))

    def forward(self, x, y, mask):
        b, s, c = x.shape
        q = self.Wq(x).reshape(b, s, self.nh, c // self.nh).transpose(1, 2)
        k, v = self.Wkv(y).reshape(b, s, 2, self.nh, c // self.nh).transpose(3, 1).unbind(dim=2)
        masked = self.causal_mask | mask.view(b, 1, 1, s)
        out = _softmax_attend(q, k, v, masked, 1 / math.sqrt(c // self.nh), self.attn_drop)
        return self.out_drop(self.Wo(out.transpose(1, 2).reshape(b, s, c)))


class Article004MultiHeadAttention(torch.nn.Module):
    """Article 004's ``MultiHeadAttention(d_in, d_out, block_size, dropout, num_heads, qkv_bias=False)``: causal
    (the ``mask`` buffer (block_size, block_size)), dropout on the weights, output projection with bias. Forward
    x (B, T, d_in) -> (B, T, d_out), T <= block_size."""

    def __init__(self, d_in, d_out, block_size, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = torch.nn.Linear(d_out, d_out)
        self.dropout = torch.nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size), diagonal=1))

    def forward(self, x):                                       # x (B, T, E) -> (B, T, d_out)
        b, num_tokens, _ = x.shape
        split = lambda t: t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        keys, queries, values = split(self.W_key(x)), split(self.W_query(x)), split(self.W_value(x))
        scores = queries @ keys.transpose(2, 3)                 # (B, H, T, T)
        scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens][None, None], -torch.inf)
        weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        context = (weights @ values).transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context)
