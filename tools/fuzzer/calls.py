"""A call's slots and arguments, and the NumPy references and checks its results are compared with."""


import numpy as np

from .values import F32, F64, INF, describe


# --------------------------------------------------------------------------------------------- calls
class Slot:
    def __init__(self, name, kind, value, **spec):
        self.name, self.kind, self.value, self.spec = name, kind, value, spec
        self.omit = False  # keyword with a default, left out


class Call:
    def __init__(self, index, fn):
        self.index, self.fn = index, fn
        self.slots = []
        self.mutations = []
        self.checks = []  # (kind, fn(result) -> None or message), run after a valid call returns
        self.aliased = False
        self.notes = []

    @property
    def valid(self):
        return not self.mutations

    def add(self, name, kind, value, **spec):
        s = Slot(name, kind, value, **spec)
        self.slots.append(s)
        return s

    def slot(self, name):
        return next(s for s in self.slots if s.name == name)

    def describe(self):
        lines = [f"call {self.index}: _core.{self.fn}  ({'valid' if self.valid else 'mutated: ' + '; '.join(self.mutations)})"]
        for s in self.slots:
            lines.append(f"  {s.name} = {'<omitted>' if s.omit else describe(s.value)}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ numpy references
def mix64(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keep_ref(seed, n, p):
    """attnpp's dropout keep-mask of elements 0..n-1 (common.hpp's dropout_keep)."""
    with np.errstate(over="ignore"):
        s = mix64(np.array([seed % 2 ** 64], np.uint64))
        r = mix64(s ^ np.arange(n, dtype=np.uint64))
    return (r >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0) >= p


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        return INF
    if ours.size == 0:
        return 0.0
    with np.errstate(all="ignore"):
        same_inf = (ours == ref) & np.isinf(ref)
        if np.isnan(ours).any() != np.isnan(ref).any() or (np.isinf(ours) != np.isinf(ref)).any():
            return INF
        d = np.where(same_inf | (np.isnan(ours) & np.isnan(ref)), 0.0, np.abs(ours - ref))
        fin = np.isfinite(ref)
        scale = max(1.0, float(np.abs(ref[fin]).max())) if fin.any() else 1.0
    return float(d.max() / scale)


TOL = {F32: 2e-3, F64: 1e-8}


def check_close(name, get, ref, dt):
    def check(_):
        err = rel_err(get(), ref)
        return None if err <= TOL[np.dtype(dt)] else f"{name}: relative error {err:.3g} against the NumPy reference"
    return check


def check_finite(name, get, allow_neg_inf=False):
    def check(_):
        a = np.asarray(get())
        if a.dtype.kind not in "fc" or a.size == 0:
            return None
        with np.errstate(all="ignore"):
            bad = np.isnan(a) | (np.isinf(a) & ~(allow_neg_inf & (a < 0)))
        return f"{name}: {int(bad.sum())} non-finite value(s) from finite inputs" if bad.any() else None
    return check
