"""Layers with parameters, each with ``forward`` and a hand-written ``backward``."""
from .._core import Parameter
from .module import Module
from .linear import Linear
from .multihead_attention import MultiheadAttention

__all__ = ["Parameter", "Module", "Linear", "MultiheadAttention"]
