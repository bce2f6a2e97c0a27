"""``@locked``: written on every layer's forward and backward (a layer shared between threads takes turns), and
usable on a subclass's own."""
import threading

import numpy as np
import pytest

import attnpp
from attnpp import nn

LAYERS = [cls for cls in vars(nn).values() if isinstance(cls, type) and issubclass(cls, nn.Module)
          and cls is not nn.Module]
LOCKED_CODE = nn.locked(lambda self: None).__code__  # every method wrapped by locked runs this code


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", ["forward", "backward"])
def test_every_layer_method_is_locked(cls, name):
    assert getattr(cls, name).__code__ is LOCKED_CODE, f"{cls.__name__}.{name} lacks @locked"


class TwoLinear(nn.Module):
    def __init__(self, entered=None, release=None):
        super().__init__(np.float64)
        self.a, self.b = nn.Linear(3, 4, dtype=np.float64), nn.Linear(4, 2, dtype=np.float64)
        self.entered, self.release = entered, release

    @nn.locked
    def forward(self, x):
        y = self.a(x)
        if self.entered is not None:
            self.entered.set()
            self.release.wait(5)
        return self.b(y)

    @nn.locked
    def backward(self, g):
        return self.a.backward(self.b.backward(g))


def test_a_subclass_forward_takes_turns():
    entered, release = threading.Event(), threading.Event()
    model = TwoLinear(entered, release)
    x = np.ones((2, 3))
    first = threading.Thread(target=model, args=(x,))
    first.start()
    assert entered.wait(5)
    model.entered = None
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (model(x), second_done.set()))
    second.start()
    assert not second_done.wait(0.2)  # the lock is held by the first forward
    release.set()
    first.join(5), second.join(5)
    assert second_done.is_set()


def test_a_subclass_forward_that_fails_leaves_no_context():
    model = TwoLinear()
    model(np.ones((2, 3)))
    with pytest.raises(ValueError, match="in_features"):
        model(np.ones((2, 5)))  # fails in a, before b
    model.b.forward = lambda y: (_ for _ in ()).throw(MemoryError("simulated"))
    with pytest.raises(MemoryError):
        model(np.ones((2, 3)))  # a saved a context, then b failed: a's is dropped
    del model.b.forward
    assert model.backward(np.ones((2, 2))).shape == (2, 3)  # the first forward's, in both sub-layers
    for m in (model.a, model.b):
        with pytest.raises(ValueError, match="no forward context left"):
            m.backward(np.ones((2, 2)))
