"""attnpp: attention layers for NumPy with a C++ core (Eigen, OpenMP).

Every attention variant has an autograd-free forward and a hand-written backward; outputs and gradients are
checked against PyTorch. See ``attnpp.functional`` (stateless functions) and ``attnpp.nn`` (layers).
"""
import numbers

from ._core import get_num_threads
from ._seeds import manual_seed
from . import _core, functional, nn, optim


def set_num_threads(n):
    """Use ``n`` threads in attnpp's parallel kernels, in every Python thread (as ``torch.set_num_threads``).

    Results do not depend on the thread count (each element is computed by one thread in a fixed order), nor do
    dropout masks. Default: OpenMP's, i.e. ``OMP_NUM_THREADS`` or the number of cores.

    Raises:
        TypeError: ``n`` not an int. ValueError: ``n`` outside [1, 256].
    """
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"set_num_threads: n must be an int, got {n!r} ({type(n).__name__})")
    _core.set_num_threads(int(n))


def empty_cache():
    """Free the memory attnpp keeps for reuse; returns its size in bytes.

    Large outputs and gradients (1 MiB and more) come from blocks recycled when their arrays are freed (up to
    256 MiB in all), so that a training loop does not fault in fresh pages at every step. Arrays still alive
    are not affected. Like ``torch.cuda.empty_cache``, for when that memory is wanted elsewhere.
    """
    return _core.empty_cache()


__all__ = ["functional", "nn", "optim", "manual_seed", "set_num_threads", "get_num_threads", "empty_cache"]
__version__ = "0.1.0"
