"""Whether layers save what their backward needs: ``no_grad`` and ``enable_grad``, as in ``torch.autograd``.

The mode is per thread (as PyTorch's): a ``no_grad`` block in one thread leaves the others recording.
"""
import functools
import threading

_state = threading.local()


def is_grad_enabled():
    """True when a layer's forward saves a context for its backward (the default), False inside ``no_grad``."""
    return getattr(_state, "enabled", True)


class _GradMode:
    """A context manager and decorator that sets the grad mode of this thread and restores it on exit."""

    enabled = True

    def __enter__(self):
        self._previous = is_grad_enabled()
        _state.enabled = self.enabled

    def __exit__(self, *exc):
        _state.enabled = self._previous
        return False

    def __call__(self, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            with type(self)():
                return function(*args, **kwargs)
        return run


class no_grad(_GradMode):
    """Run layers without saving contexts for a backward, as ``torch.no_grad``: for evaluation and generation.

    A forward under ``no_grad`` computes the same output, keeps nothing (no memory held until a backward) and
    leaves the contexts of earlier forwards in place, so a training forward, an evaluation forward under
    ``no_grad``, then the training backward give the training forward's gradients. A ``backward`` needs a
    forward run outside ``no_grad``. Use as ``with attnpp.no_grad():`` or as a decorator ``@attnpp.no_grad()``.
    """

    enabled = False


class enable_grad(_GradMode):
    """Save contexts again inside a ``no_grad`` block, as ``torch.enable_grad`` (context manager or decorator)."""

    enabled = True
