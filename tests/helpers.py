"""PyTorch references shared by several test modules, written from the definitions (test modules import them from
here, never from each other).

- ``reference``: attention with every variant (causal, masks, sliding window, ALiBi, soft-capping, sinks, dropout)
  on (B, H, L, D) tensors: the output and the log-sum-exp.
- ``rotary_reference``: rotary position embeddings (both pair layouts, partial rotary).
- ``attention_layer_reference``: ``attnpp.nn.Attention``'s math (projections, heads, RoPE, masks, variants,
  softmax, dropout replayed, output projection) from a layer's own weights.

The variants' definitions (as FlashAttention's, whose positions are aligned bottom-right: query i sits at key
position i + S - L): scores s = scale * q k^T; soft cap s = softcap * tanh(s / softcap); then the float mask and the
ALiBi bias -slope_h * |i + S - L - j| are added; keys outside the window [i + S - L - left, i + S - L + right] (-1:
unbounded), after the causal diagonal, or masked out are hidden; the softmax's denominator also holds exp(sink_h),
a logit with no value; dropout zeroes weights where attnpp's dropout_mask says so.
"""
import numpy as np
import torch


def variant_scores(s, *, attn_mask=None, is_causal=False, causal_alignment="top_left", window=None,
                   alibi_slopes=None, softcap=None):
    """Scores (B, H, L, S) with the soft cap, a float ``attn_mask`` and ALiBi applied and the keys a query does
    not see (bool ``attn_mask`` False, after the causal diagonal, outside the window) at -inf."""
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
    """Output and log-sum-exp of attention from the definitions, on torch tensors (B, Hq, L, D), (B, Hk, S, D),
    (B, Hk, S, Dv) (Hq a multiple of Hk), differentiable; alibi_slopes (Hq,) or (B, Hq); keep (B, Hq, L, S)."""
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = 1 / D ** 0.5 if scale is None else scale
    s = variant_scores(scale * q @ k.transpose(-1, -2), attn_mask=attn_mask, is_causal=is_causal,
                       causal_alignment=causal_alignment, window=window, alibi_slopes=alibi_slopes, softcap=softcap)
    S = s.shape[-1]
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(B, Hq, L, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    hidden = torch.isinf(lse) & (lse < 0)  # rows that see nothing: weights 0 (no NaN gradient either)
    p = torch.exp(s - torch.where(hidden, 0.0, lse)[..., None]).masked_fill(hidden[..., None], 0.0)
    p = p[..., :S]
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v, lse


def rotary_reference(x, positions, rotary_dim, base=10000.0, interleaved=False):
    """RoPE from its definition (Su et al., 2021) on a torch tensor x (..., T, D) at integer ``positions`` (T,):
    the pairs (d, d + R/2) (Hugging Face's rotate_half) or (2d, 2d + 1) (interleaved) of the first R = rotary_dim
    features rotated by positions * base^(-2d/R) (angles in float64, then x's dtype); the rest unchanged."""
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


def _tensor(x, grad=False, dtype=None):
    t = torch.tensor(np.ascontiguousarray(x))
    t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return t.requires_grad_() if grad else t


def attention_layer_reference(layer, x, context, kpm, keep_attn=None, keep_out=None, dtype=None):
    """attnpp.nn.Attention's math in PyTorch from the layer's own weights, computed in ``dtype`` (default
    theirs), on batched tensors x (B, L, E) and context (B, S, kv_dim) (``x`` itself for self-attention): the
    projections, heads, RoPE (queries at positions 0 .. L-1, keys at 0 .. S-1), scores, the layer's variants
    (soft cap, ALiBi, window, sinks) with its causal mask and the bool (True = masked out) or float
    key_padding_mask (B, S), softmax (_safe_softmax: rows that see nothing give 0, as PyTorch's
    scaled_dot_product_attention), dropout replayed from ``keep_attn`` (B, H, L, S) and ``keep_out``, output
    projection. Returns (out, weights (B, H, L, S), {parameter name: leaf tensor})."""
    P = {n: _tensor(p.data, True, dtype) for n, p in layer.named_parameters()}
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
        kpm = _tensor(kpm, dtype=dtype)[:, None, None, :]
        mask = ~kpm if kpm.dtype == torch.bool else kpm
    alibi = None if layer.alibi_slopes is None else torch.tensor(layer.alibi_slopes)
    scores = variant_scores(q @ k.transpose(-1, -2) * layer.scale, attn_mask=mask, is_causal=layer.causal,
                            causal_alignment=layer.causal_alignment, window=layer.window, alibi_slopes=alibi,
                            softcap=layer.softcap)                                 # (B, H, L, S)
    if "sinks" in P:
        scores = torch.cat([scores, P["sinks"][None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    w = torch.ops.aten._safe_softmax(scores, -1)[..., :S]
    if keep_attn is not None:
        w = w * _tensor(keep_attn, dtype=dtype) / (1 - layer.attn_dropout)
    out = (w @ v).transpose(1, 2).flatten(-2)
    if layer.out_proj is not None:
        out = lin(out, "out_proj")
    if keep_out is not None:
        out = out * _tensor(keep_out, dtype=dtype) / (1 - layer.out_drop.p)
    return out, w, P
