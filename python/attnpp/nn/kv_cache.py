"""The keys and values of past tokens, for incremental decoding with ``attnpp.nn.Attention``."""
import numpy as np

from .. import _checks as checks


class KVCache:
    """Preallocated keys and values of the tokens seen so far, per sequence, for incremental decoding (a KV
    cache, as FlashAttention's ``flash_attn_with_kvcache`` takes): ``Attention.init_kv_cache(batch_size,
    max_length)`` makes one that fits a layer, and ``layer(x, kv_cache=cache)`` appends the new tokens' keys
    and values (after RoPE, when the layer has it) and attends to everything cached.

    Shape letters: B ``batch_size``, H heads, S_max ``max_length``, D query/key head width, Dv value head width.

    Args:
        batch_size (int): B, the sequences decoded together.
        num_heads (int): H.
        max_length (int): S_max, the most tokens a sequence can hold (prompt and generated ones).
        head_dim (int): D. v_head_dim (int, optional): Dv. Default: ``head_dim``.
        dtype: float32 (default), float64, float16 or bfloat16.

    Attributes:
        key (ndarray): (B, H, S_max, D); rows [0, lengths[b]) of sequence b are its cached keys.
        value (ndarray): (B, H, S_max, Dv).
        lengths (ndarray): (B,) int64, the tokens cached per sequence (0 at first); each
            ``layer(x, kv_cache=cache)`` adds x's length L_new to every entry.

    Raises:
        TypeError/ValueError: sizes that are not ints >= 1 (dimensions >= 0), another dtype.
    """

    def __init__(self, batch_size, num_heads, max_length, head_dim, v_head_dim=None, dtype=None):
        B = checks.check_int(batch_size, "batch_size", 1)
        H = checks.check_int(num_heads, "num_heads", 1)
        S = checks.check_int(max_length, "max_length", 1)
        D = checks.check_int(head_dim, "head_dim")
        Dv = D if v_head_dim is None else checks.check_int(v_head_dim, "v_head_dim")
        dtype = checks.check_dtype(dtype)
        self.key = np.zeros((B, H, S, D), dtype)
        self.value = np.zeros((B, H, S, Dv), dtype)
        self.lengths = np.zeros(B, np.int64)

    @property
    def batch_size(self):
        return self.key.shape[0]

    @property
    def max_length(self):
        return self.key.shape[2]

    @property
    def dtype(self):
        return self.key.dtype

    def reset(self):
        """Forget every cached token (lengths back to 0; the buffers are kept, for a new batch of sequences)."""
        self.lengths[...] = 0

    def __repr__(self):
        B, H, S, D = self.key.shape
        return (f"KVCache(batch_size={B}, num_heads={H}, max_length={S}, head_dim={D}, v_head_dim="
                f"{self.value.shape[3]}, dtype={self.dtype}, lengths={self.lengths.tolist()})")
