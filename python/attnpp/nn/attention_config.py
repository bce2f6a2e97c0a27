"""An attention layer's configuration, shared by ``attnpp.nn.Attention`` and ``attnpp.torch.Attention``: the checked
widths and options (``attention_config``) and the variant options of its ``repr`` (``variant_args``).

Shape letters: H heads, P positions, R rotary_dim.
"""
import inspect

import numpy as np

from .. import _checks as checks
from .. import functional as F
from ..functional.rotary import ROTARY_BASE
from .module import to_numpy


def attention_config(embed_dim, num_heads=1, qk_dim=None, v_dim=None, kv_dim=None, out_dim=None, out_proj=True,
                     causal=False, causal_alignment="top_left", attn_dropout=0.0, out_dropout=0.0, scale=None,
                     context_length=None, *, window=None, alibi=False, softcap=None, sinks=False, rotary=False,
                     rotary_dim=None, rotary_base=ROTARY_BASE, rotary_interleaved=False):
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
    return checks.check_alibi_slopes(slopes, (), num_heads, np.float64, name="alibi").reshape(num_heads)


def _rotary_config(rotary, rotary_dim, rotary_base, rotary_interleaved, head_dim):
    """The checked RoPE options: rotary, rotary_dim (default the head width), rotary_base, rotary_interleaved."""
    rotary = checks.check_bool(rotary, "rotary")
    rotary_interleaved = checks.check_bool(rotary_interleaved, "rotary_interleaved")
    checks.check_rotary_base(rotary_base, "rotary_base")
    if not rotary:
        given = [n for n, v, default in (("rotary_dim", rotary_dim, None), ("rotary_base", rotary_base, ROTARY_BASE),
                                         ("rotary_interleaved", rotary_interleaved, False)) if v != default]
        if given:
            raise ValueError(f"{', '.join(given)} given without rotary=True (RoPE is off)")
        return dict(rotary=False, rotary_dim=None, rotary_base=ROTARY_BASE, rotary_interleaved=False)
    if rotary_dim is None:
        if head_dim % 2:
            raise ValueError(f"rotary=True: the head width qk_dim / num_heads = {head_dim} is odd; RoPE rotates "
                             f"pairs of features: give an even rotary_dim < {head_dim}")
        rotary_dim = head_dim
    rotary_dim = checks.check_rotary_dim(rotary_dim, head_dim)
    return dict(rotary=True, rotary_dim=rotary_dim, rotary_base=float(rotary_base),
                rotary_interleaved=rotary_interleaved)


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
                rotary_base=(layer.rotary_base, ROTARY_BASE), rotary_interleaved=(layer.rotary_interleaved, False))
