"""Edge values, the arrays in padded buffers (inputs NaN-filled, outputs canary-filled) and their layouts."""
import os

import numpy as np


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
FUZZ_SCRIPT = os.path.join(ROOT, "tools", "fuzz.py")  # the command line, which the parent runs as its children

FUNCTIONS = {  # name: relative frequency
    "sdpa_forward": 4, "sdpa_backward": 4, "sdpa_weights": 3,
    "linear_forward": 1.5, "linear_backward": 1.5,
    "empty": 1, "empty_cache": 0.3, "dropout_mask": 1, "dropout_forward": 1, "dropout_backward": 1,
    "embedding_forward": 1, "embedding_backward": 1, "cross_entropy_forward": 1.2, "cross_entropy_backward": 1.2,
    "sgd_step": 1, "adamw_step": 1, "set_num_threads": 0.5, "get_num_threads": 0.2,
    "rotary_forward": 1, "rotary_backward": 1,
}
ALLOWED = (TypeError, ValueError, IndexError, MemoryError, OverflowError)
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
NAN, INF = float("nan"), float("inf")

# ------------------------------------------------------------------------------------------ edge values
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.1, 1.0000001, 0.9999999, 1e-300, 5e-324, 1e300, -1e300, 3.5e38,
               NAN, INF, -INF, 2.0 ** 64, -2.0 ** 63]
NOT_FLOATS = [None, "0.5", [0.5], 1j, {}, np.float32(0.5), np.int64(3), True, 10 ** 400, np.array([0.5]),
              np.array(0.5), object()]
INT_EDGES = [0, 1, -1, 2, 3, 2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 1, 2 ** 32, 2 ** 53 + 1, 2 ** 63 - 1,
             2 ** 63, -2 ** 63, -2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64, 10 ** 30]
NOT_INTS = [None, 1.0, 1.5, "1", NAN, [1], np.int32(2), np.uint64(2 ** 64 - 1), np.float64(1.0), True,
            np.bool_(True), np.array(2), object()]
SEEDS = [0, 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -1, 2 ** 63 - 1, 10 ** 30, np.uint64(2 ** 64 - 1), np.int64(-1),
         1.0, None, "0"]
BOOLS = [True, False, 0, 1, 2, None, "yes", np.bool_(True), 1.0, [], np.int64(1)]
CAUSALS = [-1, 0, 1, 2, 3, 2 ** 31, -2 ** 31 - 1, True, 1.0, None]
PROBS = [-0.1, 0.0, 0.5, 1.0, NAN, INF, -INF, 1.0000001, 0.9999999, -0.0, 1e-320, 2.0]
NON_ARRAYS = ["None", "list", "int", "str", "float", "tuple", "dict", "npscalar", "bytes", "object"]
OTHER_DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_, np.complex128, object, np.uint8,
                np.int8, np.longdouble, np.uint64]
EXOTIC_DTYPES = [np.dtype(object), np.dtype("V0"), np.dtype("V3"), np.dtype("U5"), np.dtype("S0"),
                 np.dtype([("a", object), ("b", np.float64)]), np.dtype("M8[s]"), np.dtype(np.float16),
                 np.dtype(np.complex64), np.dtype(np.longdouble), np.dtype(">f8"), np.dtype("<f4")]


def pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def chance(rng, p):
    return bool(rng.random() < p)


# ---------------------------------------------------------------------------- arrays in padded buffers
PAD_IN_FLOAT, PAD_IN_INT, PAD_OUT = 0xFF, 0x7F, 0xA5  # 0xFF..: NaN in float32/float64


class Arr:
    """An ndarray argument built inside a padded byte buffer (when numeric): element 0 at byte `origin` of `base`.

    Inputs are padded with NaN bytes (a read past the array shows in the result), outputs with a canary (a
    write past the array shows in the buffer). `values` are the array's values (C order) for the references.
    """

    def __init__(self, values, role, layout, pad, readonly=False, note=""):
        values = np.asarray(values)
        self.values, self.role, self.layout, self.note = values, role, layout, note
        self.shape, self.dtype = values.shape, values.dtype
        nd = values.ndim
        fit = lambda key, default: layout.get(key) or default if len(layout.get(key) or ()) == nd else default  # noqa
        perm = fit("perm", list(range(nd)))
        step = fit("step", [1] * nd)
        neg = fit("neg", [False] * nd)
        zero = fit("zero", [False] * nd)
        if any(zero):  # values constant along zero-stride axes
            sl = tuple(slice(0, 1) if z else slice(None) for z in zero)
            self.values = values = np.ascontiguousarray(np.broadcast_to(values[sl], values.shape))
        self.base = None
        if layout.get("native"):  # NumPy's own C-ordered array (NumPy 2 gives empty arrays strides 0)
            self.view, self.unaligned = np.array(values, copy=True, order="C"), False
            if readonly:
                self.view.flags.writeable = False
            return
        if values.dtype.kind not in "biufc":  # object, strings...: a plain array, no buffer checks
            v = values.copy()
            if layout.get("F"):
                v = np.asfortranarray(v)
            self.view, self.unaligned = v, False
            if readonly:
                v.flags.writeable = False
            return
        isz = values.dtype.itemsize
        est, run = [0] * nd, 1
        for ax in reversed(perm):
            if zero[ax]:
                continue
            est[ax] = run * step[ax]
            run = est[ax] * max(values.shape[ax], 1)
        sb = [e * isz for e in est]
        odd = layout.get("odd")
        if odd is not None and nd:
            sb[odd[0] % nd] += odd[1]
        sb = [-s if n else s for s, n in zip(sb, neg)]
        size = values.size
        if size:
            lo = sum(min(0, (n - 1) * s) for n, s in zip(values.shape, sb))
            hi = sum(max(0, (n - 1) * s) for n, s in zip(values.shape, sb)) + isz
        else:
            lo = hi = 0
        pb, pa = layout.get("pad", (1, 1))
        shift = layout.get("shift", 0)
        before = pb * isz + shift
        total = before + (hi - lo) + max(pa, 1) * isz
        self.base = np.full(total, pad, np.uint8)
        self.origin = before - lo
        self.strides = tuple(sb)
        x0 = self.base[self.origin:self.origin + isz].view(values.dtype)
        view = np.lib.stride_tricks.as_strided(x0, shape=values.shape, strides=sb, writeable=True)
        if size:
            view[...] = values
        if readonly:
            view.flags.writeable = False
        self.view = view
        self.unaligned = bool(shift % isz) or (odd is not None and odd[1] % isz != 0)

    def covered(self):
        """Bytes of `base` that belong to the array's elements."""
        cov = np.zeros(self.base.size, bool)
        if self.values.size == 0:
            return cov
        offs = np.full((), self.origin, np.int64)
        for d, (n, s) in enumerate(zip(self.shape, self.strides)):
            offs = offs[..., None] + np.arange(n, dtype=np.int64) * s
        offs = offs.ravel()
        for b in range(self.dtype.itemsize):
            cov[offs + b] = True
        return cov

    def describe(self):
        v = self.view
        flags = "".join(f for f, on in (("C", v.flags.c_contiguous), ("F", v.flags.f_contiguous)) if on) or "-"
        if not v.flags.writeable:
            flags += ",readonly"
        if not v.flags.aligned or self.unaligned:
            flags += ",unaligned"
        lay = {k: val for k, val in self.layout.items() if k != "pad" and val not in (None, False) and
               (not isinstance(val, list) or any(val))}
        s = f"ndarray(shape={self.shape}, dtype={self.dtype}, strides={v.strides}, {flags}"
        if lay:
            s += f", layout={lay}"
        vals = self.values
        if vals.dtype.kind in "iub" and vals.size <= 24:
            s += f", values={vals.ravel().tolist()}"
        elif vals.dtype.kind in "fc" and vals.size:
            with np.errstate(all="ignore"):
                nonfin = int((~np.isfinite(vals)).sum())
            s += f", {vals.size} values" + (f" ({nonfin} non-finite)" if nonfin else "")
            if vals.size <= 6:
                s += f" {vals.ravel().tolist()}"
        if self.note:
            s += f", {self.note}"
        return s + ")"


def rand_values(rng, shape, dtype):
    return np.asarray(_rand_values(rng, shape, dtype), dtype)


def _rand_values(rng, shape, dtype):
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind in "iu":
        return rng.integers(0, 5, shape).astype(dt)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt == object:
        return rng.standard_normal(shape).astype(object)
    return np.zeros(shape, dt)


def pads(rng):
    return (int(rng.integers(1, 5)), int(rng.integers(1, 5)))


def layout_C(rng):
    return {"native": True} if chance(rng, 0.15) else {"pad": pads(rng)}


def layout_strided(rng, shape, last_contiguous=True, allow_zero=False):
    """A valid layout for the core's 4-D views: any order/steps/signs of the leading axes, the last contiguous."""
    nd = len(shape)
    if nd == 0 or chance(rng, 0.45):
        return layout_C(rng)
    lead = nd - 1 if last_contiguous else nd
    perm = [int(a) for a in rng.permutation(lead)] + ([nd - 1] if last_contiguous else [])
    if chance(rng, 0.4):
        perm = list(range(nd))
    step = [pick(rng, [1, 1, 2, 3]) if chance(rng, 0.3) else 1 for _ in range(lead)]
    neg = [chance(rng, 0.15) for _ in range(lead)]
    zero = [allow_zero and chance(rng, 0.12) for _ in range(lead)]
    if last_contiguous:
        small = shape[-1] <= 1
        step.append(pick(rng, [1, 2, 5]) if small else 1)
        neg.append(small and chance(rng, 0.3))
        zero.append(allow_zero and small and chance(rng, 0.3))
    return {"perm": perm, "step": step, "neg": neg, "zero": zero, "pad": pads(rng)}


def mk_in(rng, values, layout=None, readonly=None):
    pad = PAD_IN_FLOAT if values.dtype.kind in "fc" else PAD_IN_INT
    if readonly is None:
        readonly = chance(rng, 0.15)
    return Arr(values, "in", layout if layout is not None else layout_C(rng), pad, readonly)


def mk_out(rng, values, layout=None):
    return Arr(values, "out", layout if layout is not None else layout_C(rng), PAD_OUT)


def randn(rng, shape, dt, scale=1.0):
    return np.asarray(rng.standard_normal(shape) * scale, dt)


class Derived:
    """An ndarray made from an Arr at call time (np.broadcast_to(mask, full_shape), an alias...)."""

    def __init__(self, src, desc, fn):
        self.src, self.desc, self.fn = src, desc, fn

    def materialize(self):
        return self.fn(self.src.view)

    def describe(self):
        return f"{self.desc} of {self.src.describe()}"


class MaskTuple:
    """One element of the sdpa mask list: the fields of a _core.AttentionMask (data, batch_offsets, h_stride,
    l_stride, s_stride), made into one when the call is made (sdpa_params)."""

    def __init__(self, mask, offsets, hs, ls, ss, info):
        self.items = [mask, offsets, hs, ls, ss]
        self.container = tuple
        self.info = info

    def describe(self):
        names = ["mask", "offsets", "h_stride", "l_stride", "s_stride"] + [f"extra{i}" for i in range(5)]
        inner = ", ".join(f"{n}={describe(v)}" for n, v in zip(names, self.items))
        return f"{self.container.__name__}({inner}) [{self.info.get('style')}]"


def materialize(v):
    if isinstance(v, Arr):
        return v.view
    if isinstance(v, Derived):
        return v.materialize()
    if isinstance(v, MaskTuple):
        return v.container(materialize(x) for x in v.items)
    if type(v) is list:
        return [materialize(x) for x in v]
    if type(v) is tuple:
        return tuple(materialize(x) for x in v)
    return v


def describe(v):
    if isinstance(v, (Arr, Derived, MaskTuple)):
        return v.describe()
    if type(v) in (list, tuple) and any(isinstance(x, (Arr, Derived, MaskTuple)) for x in v):
        o, c = ("[", "]") if type(v) is list else ("(", ")")
        return o + ", ".join(describe(x) for x in v) + c
    if isinstance(v, np.ndarray):
        return f"np.array({v.tolist()!r}, dtype={v.dtype})" if 0 < v.size <= 12 else \
            f"ndarray(shape={v.shape}, dtype={v.dtype})"
    r = repr(v)
    return r if len(r) <= 160 else r[:160] + "..."


def walk_arrs(v):
    if isinstance(v, Arr):
        yield v
    elif isinstance(v, Derived):
        yield from walk_arrs(v.src)
    elif isinstance(v, MaskTuple):
        for x in v.items:
            yield from walk_arrs(x)
    elif type(v) in (list, tuple):
        for x in v:
            yield from walk_arrs(x)
