"""The buffer pool's allocator: large outputs come from the core's recycled blocks (cpp/buffer_pool.hpp).

One owner for ``functional`` and ``nn``: fresh memory costs a page fault per 4 KiB, which dominated a training step
that allocates its logits anew each time.
"""
import math

import numpy as np

from . import _core

POOLED_BYTES = 1 << 20  # outputs at least this large come from the core's recycled buffers


def empty(shape, dtype):
    """``np.empty``, from the core's pool of recycled blocks when at least ``POOLED_BYTES`` large.

    Args:
        shape (tuple of int): the array's shape.
        dtype: its dtype.

    Returns:
        ndarray of ``shape`` and ``dtype``, uninitialised.

    Raises:
        MemoryError: a block too large to allocate (with NumPy's wording: the shape and the bytes).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < POOLED_BYTES:
        return np.empty(shape, dtype)
    try:
        return _core.empty(list(shape), dtype)
    except MemoryError:  # (the core says only std::bad_alloc; NumPy's own wording, with the shape and bytes)
        raise MemoryError(f"Unable to allocate {nbytes / 2**30:.3g} GiB ({nbytes} bytes) for an array with shape "
                          f"{tuple(shape)} and data type {dtype}") from None


def zeros(shape, dtype):
    """``np.zeros`` on ``empty``'s recycled blocks (np.zeros maps fresh zero pages, faulted in one by one)."""
    out = empty(shape, dtype)
    out.fill(0)
    return out
