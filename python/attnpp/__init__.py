"""attnpp: attention layers for NumPy with a C++ core (Eigen, OpenMP).

Every attention variant has an autograd-free forward and a hand-written backward; outputs and gradients are
checked against PyTorch. See ``attnpp.functional`` (stateless functions) and ``attnpp.nn`` (layers).
"""
from ._core import get_num_threads, set_num_threads
from ._seeds import manual_seed
from . import functional, nn, optim

__all__ = ["functional", "nn", "optim", "manual_seed", "set_num_threads", "get_num_threads"]
__version__ = "0.1.0"
