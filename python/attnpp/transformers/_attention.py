"""``attn_implementation="attnpp"``: transformers' attention function and mask function, and their registration.

The mask function passes the structure of a model's mask on (a ``KeyLayout``) instead of the dense (B, 1, L, S)
mask; the attention function runs ``attnpp.torch``'s operators: ``scaled_dot_product_attention`` on a layout or a
dense mask, ``scaled_dot_product_attention_varlen`` on packed sequences and chunks.
"""
import functools

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask, sdpa_mask
from transformers.utils.output_capturing import _active_collector

from .. import torch as AT
from ..torch import _ops
from ..torch.functional import _attention
from ._packing import block_offsets, read_pattern

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
        cu_seqlens (Tensor or None): (blocks + 1,) int64: the rows are block-diagonal (packed sequences, chunks):
            the B rows of L = S tokens flattened, block k is tokens ``cu_seqlens[k]`` to ``cu_seqlens[k + 1]``,
            causal within itself (with the window), and sees no other (attnpp's varlen call).
    """

    __slots__ = ("keys", "is_causal", "window", "key_padding_mask", "cu_seqlens")
    # generate() builds the masks ahead of a step with a static cache and passes them back to the model as its
    # attention_mask: transformers then reads ndim (2 for a padding mask to convert) and hands the layout back
    # to attention_mask(), which returns it as it is, as it passes a prepared 4D mask through.
    ndim = 4

    def __init__(self, keys, is_causal, window=None, key_padding_mask=None, cu_seqlens=None):
        self.keys, self.is_causal, self.window = keys, is_causal, window
        self.key_padding_mask, self.cu_seqlens = key_padding_mask, cu_seqlens

    @property
    def kernel_window(self):
        """The window as attnpp's kernel takes it, ``(window - 1, 0)`` (FlashAttention's ``window_size``), or
        None."""
        return None if self.window is None else (self.window - 1, 0)

    def __repr__(self):
        pad = None if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        blocks = "" if self.cu_seqlens is None else f", blocks={self.cu_seqlens.numel() - 1}"
        return (f"KeyLayout(keys={self.keys}, is_causal={self.is_causal}, window={self.window}, "
                f"key_padding_mask={pad}{blocks})")


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                   attention_mask=None, **kwargs):
    """transformers' mask function for ``"attnpp"`` (``AttentionMaskInterface``): a ``KeyLayout`` for the masks
    attnpp's kernel expresses (causal, sliding-window causal, bidirectional, with padding; packed sequences and
    chunked attention as varlen blocks), else the dense boolean mask (B, 1, L, S) of
    ``transformers.masking_utils.sdpa_mask`` (True where a key takes part).

    Args:
        batch_size, q_length, kv_length (int): B, L, and the keys of the layer's cache S.
        q_offset, kv_offset (int or Tensor): the positions of the first query and of the first key.
        mask_function (callable): the pattern transformers asks for.
        attention_mask (Tensor, optional): (B, positions) the 2D padding mask, 1 or True where a token is real.
        kwargs: the rest of transformers' mask arguments, passed on to ``sdpa_mask`` for a dense mask.
    """
    if isinstance(attention_mask, KeyLayout):  # prepared for this step already (generate with a static cache)
        return attention_mask
    pattern = read_pattern(mask_function)
    shift = int(q_offset) - int(kv_offset)  # query i sits at key position i + shift
    keys = min(kv_length, shift + q_length) if pattern and pattern.is_causal else kv_length
    real = None if attention_mask is None else prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if pattern is not None and pattern.blocks:
        offsets = block_offsets(pattern, batch_size, q_length, kv_length, q_offset, kv_offset,
                                None if real is None else real[:, kv_offset:kv_offset + kv_length])
        if offsets is not None:
            return KeyLayout(kv_length, True, pattern.window, cu_seqlens=offsets)
    elif pattern is not None and (not pattern.is_causal or keys == shift + q_length):
        padding = None
        if real is not None:
            real = real[:, kv_offset:kv_offset + keys]
            # (traced by torch.compile, or on the meta device, whether any key is padding is data the graph cannot
            # branch on: the padding mask is then passed whatever it holds)
            if torch.compiler.is_compiling() or real.is_meta or not bool(real.all()):
                padding = ~real.to(torch.bool)
        return KeyLayout(keys, pattern.is_causal, pattern.window, padding)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def _visible(L, S, causal_alignment, window):
    """(L, S) bool, True where query i sees key j under a causal mask (and window (left, right))."""
    shift = S - L if causal_alignment == "bottom_right" else 0
    diff = torch.arange(S)[None, :] - torch.arange(L)[:, None] - shift  # j - (i + shift)
    visible = diff <= (0 if window is None else window[1])
    return visible if window is None else visible & (diff >= -window[0])


class _MaskGradient(torch.autograd.Function):
    """The gradient of a float mask added to the scores (T5's ``position_bias``), which attnpp's kernels do not
    compute: the identity on the attention's output (whose own graph takes the gradients of query, key and value),
    whose backward gives the mask dS = P~ * (dO V^T) - P * rowsum(dO * O), summed to the mask's shape: P the
    weights, P~ those after dropout (P without), both from attnpp's weights operator. (B..., Hq, L, S) memory, as
    the mask itself and eager's weights."""

    @staticmethod
    def forward(ctx, output, query, key, value, mask, call):
        ctx.save_for_backward(output, query, key, value, mask)
        ctx.call = call
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        output, query, key, value, mask = ctx.saved_tensors
        c = ctx.call
        weights = lambda p: _ops.sdpa_weights(query, key, mask, c["sinks"], None, c["key_padding_mask"], None, p,
                                              False, c["scale"], c["enable_gqa"], c["seed"], "top_left", None,
                                              c["softcap"])
        plain = weights(0.0)
        dropped = weights(c["dropout_p"]) if c["dropout_p"] > 0 else plain
        if value.shape[-3] != query.shape[-3]:  # (GQA: each key/value head serves a group of query heads)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
        dmask = dropped * (grad @ value.transpose(-1, -2)) - plain * (grad * output).sum(-1, keepdim=True)
        return grad, None, None, None, dmask.sum_to_size(mask.shape), None


def _mask_args(module, query, key, value, attention_mask, is_causal):
    """(key, value, the mask arguments of attnpp's call) for a ``KeyLayout``, a dense 4D mask or None."""
    if isinstance(attention_mask, KeyLayout):
        layout = attention_mask
        if layout.keys < key.shape[2]:  # (a static cache's unfilled end; a slice costs ~15 us of a decoding step)
            key, value = key[:, :, :layout.keys], value[:, :, :layout.keys]
        return key, value, dict(attn_mask=None, is_causal=layout.is_causal, causal_alignment="bottom_right",
                                window=layout.kernel_window, key_padding_mask=layout.key_padding_mask)
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        return key, value, dict(attn_mask=None, is_causal=bool(causal and query.shape[2] > 1),
                                causal_alignment="top_left", window=None, key_padding_mask=None)
    if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)
    return key, value, dict(attn_mask=attention_mask, is_causal=False, causal_alignment="top_left", window=None,
                            key_padding_mask=None)


def _fold_bias(bias, args, L, S):
    """The mask arguments with a float ``bias`` (B or 1, H, L, S) folded into the float mask, as transformers'
    ``sdpa`` does: -inf where the causal mask, the window or a boolean mask hides a key, added to a float one."""
    bias, mask = bias[..., :S], args["attn_mask"]
    if mask is None:
        if args["is_causal"]:
            bias = bias.masked_fill(~_visible(L, S, args["causal_alignment"], args["window"]), float("-inf"))
    elif mask.dtype == torch.bool:
        bias = bias.masked_fill(~mask, float("-inf"))
    else:
        bias = bias + mask
    return dict(args, attn_mask=bias, is_causal=False, window=None)


def _packed(query, key, value, layout, options):
    """The varlen call on a block-diagonal layout: the B rows of L tokens as (B * L, H, D) (a view when B = 1),
    output (B, L, Hq, Dv)."""
    B, L = query.shape[0], query.shape[2]
    rows = lambda x: x.transpose(1, 2).reshape(B * L, x.shape[1], x.shape[3])
    out = AT.scaled_dot_product_attention_varlen(
        rows(query), rows(key), rows(value), layout.cu_seqlens, layout.cu_seqlens, options["dropout_p"],
        is_causal=True, scale=options["scale"], window=layout.kernel_window, softcap=options["softcap"],
        sinks=options["sinks"])
    return out.view(B, L, out.shape[1], out.shape[2])


def _weights_wanted(kwargs):
    """Whether the model asks for the attention weights: ``output_attentions=True`` reaches the attention function,
    or (a layer that takes the flag itself, as GPT-2's) transformers' output collector is recording attentions."""
    if kwargs.get("output_attentions"):
        return True
    collecting = _active_collector.get()
    return bool(collecting) and any(k.endswith("attentions") for k in collecting)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      s_aux=None, is_causal=None, sliding_window=None, position_bias=None, **kwargs):
    """transformers' attention function for ``"attnpp"`` (``AttentionInterface``), called by every attention
    layer: ``attnpp.torch.scaled_dot_product_attention`` of the layer's heads (``..._varlen`` on packed
    sequences and chunks).

    Args:
        module (torch.nn.Module): the attention layer (its ``is_causal`` is read when no mask is given).
        query (Tensor): (B, Hq, L, D); key (Tensor): (B, Hk, S, D); value (Tensor): (B, Hk, S, Dv); Hq a
            multiple of Hk. float32, float64, float16 or bfloat16, on the CPU.
        attention_mask (KeyLayout, Tensor or None): ``attention_mask()``'s ``KeyLayout``; or a dense 4D mask
            broadcastable to (B, Hq, L, S), bool (True where a key takes part) or float (added to the scores,
            with its gradient when it requires one); or None: causal (top-left) when the module is causal and
            L > 1, as ``sdpa``.
        dropout (float): dropout on the weights (the model passes 0 in eval mode). Default: 0.0.
        scaling (float, optional): the factor on q k^T. Default: 1 / sqrt(D).
        softcap (float, optional): logit soft-capping (Gemma 2). Default: None.
        s_aux (Tensor, optional): (Hq,) attention sinks (gpt-oss), differentiable. Default: None.
        is_causal (bool, optional): overrides ``module.is_causal`` when no mask is given.
        sliding_window (int, optional): unused: the mask carries the layer's window (a model passes it for
            FlashAttention).
        position_bias (Tensor, optional): (B or 1, Hq, L, S) float, T5's relative-position bias, added to the
            scores (folded into the float mask as transformers' ``sdpa`` does), with its gradient.
        kwargs: ``output_attentions=True`` asks for the weights (as does transformers' output collector recording
            them, for a layer that takes the flag itself).

    Returns:
        (output, weights): output (B, L, Hq, Dv) contiguous, the layout transformers' layers expect; weights
        (B, Hq, L, S) (after dropout, as eager's; computed only with ``output_attentions=True``, without a
        gradient) or None.

    Raises:
        ValueError: ``output_attentions=True`` or a ``position_bias`` on packed sequences or chunks (their
            weights are per block); tensors off the CPU and shapes or dtypes attnpp refuses (from
            ``attnpp.torch``).
    """
    need_weights = _weights_wanted(kwargs)
    options = dict(scale=scaling, dropout_p=dropout, softcap=softcap, sinks=s_aux,
                   enable_gqa=query.shape[1] != key.shape[1])
    if isinstance(attention_mask, KeyLayout) and attention_mask.cu_seqlens is not None:
        if need_weights or position_bias is not None:
            raise ValueError('attn_implementation="attnpp" runs packed sequences and chunked attention block by '
                             'block: output_attentions=True and a position_bias are not supported there (use '
                             'attn_implementation="eager")')
        return _packed(query, key, value, attention_mask, options), None
    key, value, args = _mask_args(module, query, key, value, attention_mask, is_causal)
    if position_bias is not None:
        args = _fold_bias(position_bias, args, query.shape[2], key.shape[2])
    mask = args["attn_mask"]
    mask_grad = mask is not None and mask.requires_grad and torch.is_grad_enabled()
    if not (need_weights or mask_grad):
        output, weights = AT.scaled_dot_product_attention(query, key, value, **args, **options), None
    else:
        # (_attention draws the dropout's seed, which the mask's backward replays)
        output, weights, seed = _attention(
            query, key, value, None if mask is None else mask.detach(), options["dropout_p"], args["is_causal"],
            options["scale"], options["enable_gqa"], None, args["causal_alignment"],
            need_weights=need_weights, window=args["window"], softcap=softcap, sinks=s_aux,
            key_padding_mask=args["key_padding_mask"])
        if mask_grad:
            output = _MaskGradient.apply(output, query.detach(), key.detach(), value.detach(), mask,
                                         dict(options, seed=seed, key_padding_mask=args["key_padding_mask"],
                                              sinks=None if s_aux is None else s_aux.detach()))
    return output.transpose(1, 2).contiguous(), weights


def _refuse_models_without_interface(check):
    """transformers' ``PreTrainedModel._check_and_adjust_attn_implementation`` (run when a model is built, before
    its layers, and by ``set_attn_implementation``), which then refuses ``"attnpp"`` for a model class whose
    attention does not go through ``AttentionInterface`` (Falcon): such a model would fail later with
    ``KeyError: 'attnpp'`` or hand attnpp's mask object to PyTorch. transformers' own test of a class
    (``_can_set_attn_implementation``: its module's attention layers call ``ALL_ATTENTION_FUNCTIONS``)."""
    @functools.wraps(check)
    def checked(self, attn_implementation, *args, **kwargs):
        chosen = check(self, attn_implementation, *args, **kwargs)
        if chosen == NAME and not type(self)._can_set_attn_implementation():
            other = "sdpa" if getattr(self, "_supports_sdpa", False) else "eager"
            raise ValueError(f'{type(self).__name__} does not run its attention through transformers\' '
                             f'AttentionInterface, so attn_implementation="attnpp" cannot reach its layers: load it '
                             f'with attn_implementation="{other}"')
        return chosen
    checked.attnpp_refuses = True
    return checked


def register():
    """Adds ``"attnpp"`` to transformers' ``AttentionInterface`` (``attention_forward``) and
    ``AttentionMaskInterface`` (``attention_mask``), for every model class, and makes transformers refuse it, when
    a model is built, for a class whose attention does not go through the interface (a ``ValueError`` naming the
    class). Done when ``attnpp.transformers`` is imported; calling it again changes nothing."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    check = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(check, "attnpp_refuses", False):
        PreTrainedModel._check_and_adjust_attn_implementation = _refuse_models_without_interface(check)
