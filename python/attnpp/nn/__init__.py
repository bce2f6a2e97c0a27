"""Layers with parameters, each with ``forward`` and a hand-written ``backward``."""
from .parameter import Parameter
from .module import Module, locked
from .linear import Linear
from .embedding import Embedding
from .dropout import Dropout
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .multihead_attention import MultiheadAttention
from .kv_cache import KVCache
from .attention import Attention

__all__ = ["Parameter", "Module", "locked", "Linear", "Embedding", "Dropout", "CrossEntropyLoss",
           "LinearCrossEntropyLoss", "MultiheadAttention", "Attention", "KVCache"]
