"""attnpp's global random state: parameter initialisation and the dropout seeds drawn when none is given."""
import copy

import numpy as np

_generator = np.random.default_rng()


def manual_seed(seed):
    """Seed attnpp's global generator (parameter initialisation and dropout seeds drawn when none is given).

    Args:
        seed (int): any Python int; the same seed gives the same initial weights and the same dropout masks,
            whatever the thread count.

    Raises:
        TypeError: if ``seed`` is not an int.
    """
    global _generator
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__}")
    _generator = np.random.default_rng(int(seed) % 2**64)


def generator():
    """The global ``numpy.random.Generator`` used to initialise parameters."""
    return _generator


def next_seed():
    """A fresh 63-bit dropout seed from the global generator."""
    return int(_generator.integers(0, 2**63))


def get_rng_state():
    """The state of attnpp's global generator (a dict, NumPy's ``bit_generator.state``), as
    ``torch.get_rng_state``: save it with a checkpoint so that a resumed run draws the same initialisations
    and dropout seeds as the uninterrupted one."""
    return copy.deepcopy(_generator.bit_generator.state)


def set_rng_state(state):
    """Restore attnpp's global generator from ``get_rng_state()``'s dict, as ``torch.set_rng_state``.

    Raises:
        TypeError: not such a dict. ValueError: a state of another bit generator than PCG64.
    """
    if not isinstance(state, dict):
        raise TypeError(f"set_rng_state: expected the dict of get_rng_state(), got {type(state).__name__}")
    generator = np.random.default_rng()
    generator.bit_generator.state = copy.deepcopy(state)
    global _generator
    _generator = generator
