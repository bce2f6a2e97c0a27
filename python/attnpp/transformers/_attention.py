"""``attn_implementation="attnpp"``: transformers' attention function and mask function, and their registration.

The mask function passes the structure of a model's mask on (a ``KeyLayout``) instead of the dense (B, 1, L, S)
mask; the attention function runs ``attnpp.torch.scaled_dot_product_attention``.
"""
import inspect

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (AttentionMaskInterface, bidirectional_mask_function, causal_mask_function,
                                        prepare_padding_mask, sdpa_mask)

from .. import torch as AT

NAME = "attnpp"


class KeyLayout:
    """Which keys each query of a layer sees, as attnpp's kernel takes it: what ``attention_mask`` returns in
    place of a dense mask, and ``attention_forward`` reads.

    Attributes:
        keys (int): keys that can be visible, S (the cache's filled part): key and value are cut to their first
            ``keys`` positions (a view).
        is_causal (bool): query i (of L) sees keys j <= i + S - L (aligned bottom-right: the queries are the
            last L positions).
        window (int or None): sliding window of ``window`` tokens: query i sees keys j > i + S - L - window.
        key_padding_mask (Tensor or None): (B, S) bool, True where a key is padding (masked out); None when no
            key is.
    """

    __slots__ = ("keys", "is_causal", "window", "key_padding_mask")
    # generate() builds the masks ahead of a step with a static cache and passes them back to the model as its
    # attention_mask: transformers then reads ndim (2 for a padding mask to convert) and hands the layout back
    # to attention_mask(), which returns it as it is, as it passes a prepared 4D mask through.
    ndim = 4

    def __init__(self, keys, is_causal, window=None, key_padding_mask=None):
        self.keys, self.is_causal, self.window, self.key_padding_mask = keys, is_causal, window, key_padding_mask

    def __repr__(self):
        pad = None if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        return (f"KeyLayout(keys={self.keys}, is_causal={self.is_causal}, window={self.window}, "
                f"key_padding_mask={pad})")


def _pattern(mask_function):
    """(is_causal, window or None) of transformers' own causal, sliding-window causal and bidirectional mask
    functions; None for any other (combined with a custom function, packed sequences, chunks, ...)."""
    if mask_function is causal_mask_function:
        return True, None
    if mask_function is bidirectional_mask_function:
        return False, None
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal_mask_function)
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
        if (len(parts) == 2 and parts[1] is causal_mask_function
                and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
            window = inspect.getclosurevars(parts[0]).nonlocals.get("sliding_window")
            if isinstance(window, int) and window > 0:
                return True, window
    return None


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                   attention_mask=None, **kwargs):
    """transformers' mask function for ``"attnpp"`` (``AttentionMaskInterface``): a ``KeyLayout`` for the masks
    attnpp's kernel expresses (causal, sliding-window causal, bidirectional, with padding), else the dense
    boolean mask (B, 1, L, S) of ``transformers.masking_utils.sdpa_mask`` (True where a key takes part).

    Args:
        batch_size, q_length, kv_length (int): B, L, and the keys of the layer's cache S.
        q_offset, kv_offset (int or Tensor): the positions of the first query and of the first key.
        mask_function (callable): the pattern transformers asks for.
        attention_mask (Tensor, optional): (B, positions) the 2D padding mask, 1 or True where a token is real.
        kwargs: the rest of transformers' mask arguments, passed on to ``sdpa_mask`` for a dense mask.
    """
    if isinstance(attention_mask, KeyLayout):  # prepared for this step already (generate with a static cache)
        return attention_mask
    pattern = _pattern(mask_function)
    shift = int(q_offset) - int(kv_offset)  # query i sits at key position i + shift
    keys = min(kv_length, shift + q_length) if pattern and pattern[0] else kv_length
    if pattern is None or (pattern[0] and keys != shift + q_length):
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
    padding = None
    if attention_mask is not None:
        real = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + keys]
        # (traced by torch.compile, or on the meta device, whether any key is padding is data the graph cannot
        # branch on: the padding mask is then passed whatever it holds)
        if torch.compiler.is_compiling() or real.is_meta or not bool(real.all()):
            padding = ~real.to(torch.bool)
    return KeyLayout(keys, pattern[0], pattern[1], padding)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      s_aux=None, is_causal=None, sliding_window=None, **kwargs):
    """transformers' attention function for ``"attnpp"`` (``AttentionInterface``), called by every attention
    layer: ``attnpp.torch.scaled_dot_product_attention`` of the layer's heads.

    Args:
        module (torch.nn.Module): the attention layer (its ``is_causal`` is read when no mask is given).
        query (Tensor): (B, Hq, L, D); key (Tensor): (B, Hk, S, D); value (Tensor): (B, Hk, S, Dv); Hq a
            multiple of Hk. float32, float64, float16 or bfloat16, on the CPU.
        attention_mask (KeyLayout, Tensor or None): ``attention_mask()``'s ``KeyLayout``; or a dense 4D mask
            broadcastable to (B, Hq, L, S), bool (True where a key takes part) or float (added to the scores);
            or None: causal (top-left) when the module is causal and L > 1, as ``sdpa``.
        dropout (float): dropout on the weights (the model passes 0 in eval mode). Default: 0.0.
        scaling (float, optional): the factor on q k^T. Default: 1 / sqrt(D).
        softcap (float, optional): logit soft-capping (Gemma 2). Default: None.
        s_aux (Tensor, optional): (Hq,) attention sinks (gpt-oss), differentiable. Default: None.
        is_causal (bool, optional): overrides ``module.is_causal`` when no mask is given.
        sliding_window (int, optional): unused: the mask carries the layer's window (a model passes it for
            FlashAttention).

    Returns:
        (output, None): output (B, L, Hq, Dv) contiguous, the layout transformers' layers expect; no weights.

    Raises:
        ValueError: ``output_attentions=True`` or a ``position_bias`` (not supported: use ``eager``); tensors
            off the CPU and shapes or dtypes attnpp refuses (from ``attnpp.torch``).
    """
    if kwargs.get("output_attentions"):
        raise ValueError('attn_implementation="attnpp" does not return the attention weights '
                         '(output_attentions=True): use attn_implementation="eager" for them')
    if kwargs.get("position_bias") is not None:
        raise ValueError('attn_implementation="attnpp" does not take a position_bias (T5-like relative '
                         'positions): use attn_implementation="eager"')
    options = dict(scale=scaling, dropout_p=dropout, softcap=softcap, sinks=s_aux,
                   enable_gqa=query.shape[1] != key.shape[1])
    if isinstance(attention_mask, KeyLayout):
        layout = attention_mask
        if layout.keys < key.shape[2]:  # (a static cache's unfilled end; a slice costs ~15 us of a decoding step)
            key, value = key[:, :, :layout.keys], value[:, :, :layout.keys]
        output = AT.scaled_dot_product_attention(
            query, key, value, is_causal=layout.is_causal, causal_alignment="bottom_right",
            window=None if layout.window is None else (layout.window - 1, 0),
            key_padding_mask=layout.key_padding_mask, **options)
    elif attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        output = AT.scaled_dot_product_attention(query, key, value, is_causal=bool(causal and query.shape[2] > 1),
                                                 **options)
    else:
        if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
        output = AT.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, **options)
    return output.transpose(1, 2).contiguous(), None


def register():
    """Adds ``"attnpp"`` to transformers' ``AttentionInterface`` (``attention_forward``) and
    ``AttentionMaskInterface`` (``attention_mask``), for every model class; done when this module is imported.
    Calling it again changes nothing."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)

