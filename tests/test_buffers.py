"""The pool of recycled output blocks (cpp/buffer_pool.hpp): live arrays never share memory, freed blocks are
reused, and attnpp.empty_cache() gives them back."""
import gc

import numpy as np

import attnpp
import attnpp.functional as F

SHAPE = (512, 1024)  # 2 MiB in float32: above the 1 MiB threshold of the pool


def test_live_arrays_never_share_memory_and_freed_blocks_are_reused():
    a, b = F._empty(SHAPE, np.float32), F._empty(SHAPE, np.float32)
    assert not np.shares_memory(a, b) and a.flags.c_contiguous and a.flags.writeable
    a.fill(1.0)
    b.fill(2.0)
    address = a.ctypes.data
    del a
    gc.collect()
    c = F._empty(SHAPE, np.float32)  # the same size: the block a gave back
    assert c.ctypes.data == address
    assert np.all(b == 2.0) and not np.shares_memory(b, c)


def test_a_view_keeps_its_block():
    a = F._empty(SHAPE, np.float64)
    view = a[1:3]
    view[...] = 7.0
    del a
    gc.collect()
    other = F._empty(SHAPE, np.float64)  # must not get the block the view still uses
    other.fill(0.0)
    assert np.all(view == 7.0)


def test_empty_cache_frees_the_kept_blocks():
    attnpp.empty_cache()
    x = F._zeros(SHAPE, np.float32)
    assert np.all(x == 0.0)
    nbytes = x.nbytes
    del x
    gc.collect()
    assert attnpp.empty_cache() == nbytes
    assert attnpp.empty_cache() == 0


def test_small_arrays_are_plain_numpy():
    small = F._empty((4, 4), np.float32)
    assert small.base is None  # numpy owns it; only large blocks go through the pool


def test_a_full_pool_makes_room_for_the_newest_sizes():
    # 240 MiB of one size kept, then a block of another size: the pool (256 MiB) drops the old ones for it
    attnpp.empty_cache()
    big = [F._empty((120 << 20,), np.uint8) for _ in range(2)]
    del big
    gc.collect()
    small = F._empty((32 << 20,), np.uint8)
    del small
    gc.collect()
    assert attnpp.empty_cache() == 32 << 20
