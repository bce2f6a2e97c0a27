"""Stateless attention functions: each forward with its hand-written backward, on NumPy arrays.

One module per operation family:

- ``attention``: ``scaled_dot_product_attention`` (forward, backward, weights);
- ``varlen``: packed sequences of different lengths, and one decoding step over a KV cache;
- ``training``: dropout, linear, embedding and cross-entropy;
- ``linear_cross_entropy``: the fused linear + cross-entropy;
- ``rotary``: rotary position embeddings;
- ``_args``: the core's arguments of an attention call, shared with ``attnpp.nn`` and ``attnpp.torch``.

Every name is importable from ``attnpp.functional`` itself, as before the split.

Shape letters: B... any leading (batch) dimensions, H heads (Hq of the query, Hk of key and value), L query
length, S key/value length, D query/key head width, Dv value head width, V vocabulary, E model width.
"""
from .._pool import POOLED_BYTES as _POOLED_BYTES, empty as _empty, zeros as _zeros
from . import _args
from ._args import (additive_mask, attention_params, causal_mode, get_alibi_slopes, last_dim_contiguous, mask_arg,
                    score_scale)
from .attention import (AttentionForward, _plain_forward, _Problem, scaled_dot_product_attention,
                        scaled_dot_product_attention_backward, scaled_dot_product_attention_forward,
                        scaled_dot_product_attention_weights)
from .fused_loss import (LinearCrossEntropyForward, linear_cross_entropy, linear_cross_entropy_backward,
                                   linear_cross_entropy_forward)
from .rotary import rotary_embedding, rotary_embedding_backward, rotary_tables
from .training import (cross_entropy, cross_entropy_backward, cross_entropy_forward,
                       dropout, dropout_backward, dropout_mask, embedding, embedding_backward, linear,
                       linear_backward)
from .varlen import (scaled_dot_product_attention_varlen, scaled_dot_product_attention_varlen_backward,
                     scaled_dot_product_attention_varlen_forward, scaled_dot_product_attention_with_kvcache)

__all__ = [
    "dropout", "dropout_backward", "embedding", "embedding_backward",
    "cross_entropy", "cross_entropy_forward", "cross_entropy_backward",
    "linear_cross_entropy", "linear_cross_entropy_forward", "linear_cross_entropy_backward",
    "LinearCrossEntropyForward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_forward", "AttentionForward",
    "scaled_dot_product_attention_backward",
    "scaled_dot_product_attention_weights",
    "scaled_dot_product_attention_varlen", "scaled_dot_product_attention_varlen_forward",
    "scaled_dot_product_attention_varlen_backward", "scaled_dot_product_attention_with_kvcache",
    "get_alibi_slopes",
    "dropout_mask",
    "linear",
    "linear_backward",
    "rotary_embedding", "rotary_embedding_backward", "rotary_tables",
]


def __getattr__(name):
    """``_BFLOAT16_NUMERICS``, the setting of ``attnpp.set_bfloat16_attention``, read from its one owner
    (``_args``), never a stale copy."""
    if name == "_BFLOAT16_NUMERICS":
        return _args._BFLOAT16_NUMERICS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
