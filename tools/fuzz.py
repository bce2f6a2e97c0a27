#!/usr/bin/env python3
"""Fuzzer of attnpp._core, the pybind11 binding: random, mostly near-valid arguments for every exported function.

    python tools/fuzz.py --calls 100000 --seed 0 [--functions sdpa_forward,sdpa_backward] [--json out.json]
    python tools/fuzz.py --seed 0 --describe 1234      the arguments of call 1234 (no call is made)
    python tools/fuzz.py --seed 0 --repro 1234         make call 1234 in this process (a crash crashes here)

Every call is generated from (seed, index) alone (a numpy Generator seeded with [seed, index]): first a
consistent, valid argument set, then 0, 1 or 2 mutations (a shape, a dtype, a layout, a flag, a value, a mask's
offsets or strides, an index out of range, a non-array where an array goes, ...). The calls run in a child
process; the parent watches it, so that a crash (signal, abort, std::terminate) or a hang is reported with the
call's index, function and arguments, and the run goes on from the next call in a new child.

Outcome of a call: it returns, or raises TypeError, ValueError, IndexError, MemoryError or OverflowError. Findings
(exit status 1): a crash or hang; any other exception type; an input array modified; a byte written outside an
output array (outputs sit in canary-filled buffers); an output written by a call that raised; for a valid call,
an exception, a non-finite result from finite inputs, or a result that differs from a NumPy reference (inputs
sit in NaN-filled buffers, so a read past their end tends to show up as NaN); a list accepted where an optional
array goes (the binding's conversion to a temporary array). Notes (no failure): behaviour worth knowing, not
unsafe on x86 by itself (an unaligned array accepted: undefined behaviour that UBSan reports).

Under AddressSanitizer (tools/sanitize.sh preloads it; the children inherit it) the children get no address-space
limit, and without ASAN_OPTIONS=allocator_may_return_null=1 only huge sizes whose byte count overflows are tried.
The summary (--json) has the outcome counts per function, the findings with their first call's arguments, and the
error messages seen (digits as #), which show which of the binding's checks the run reached.
"""
import argparse
import collections
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        if layout.get("native"):  # NumPy's own array (NumPy 2 gives empty arrays strides 0)
            self.view, self.unaligned = np.array(values, copy=True), False
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


# ---------------------------------------------------------------------------------------- generators
def small(rng, lo, hi, p_big=0.0, big=None):
    if big is not None and chance(rng, p_big):
        return int(rng.integers(big[0], big[1] + 1))
    return int(rng.integers(lo, hi + 1))


def float_dtype(rng):
    return F32 if chance(rng, 0.5) else F64


def seed_value(rng):
    r = rng.random()
    if r < 0.1:
        return 0
    if r < 0.2:
        return 2 ** 64 - 1
    return int(rng.integers(0, 2 ** 63)) * 2 + int(rng.integers(2))


def batch_shape(rng, N):
    """A batch shape (B...) whose product is N, as the Python layer flattens it."""
    if N == 1 and chance(rng, 0.3):
        return ()
    divs = [d for d in range(1, N + 1) if N and N % d == 0]
    if N > 1 and chance(rng, 0.4):
        d = pick(rng, divs)
        return (d, N // d)
    return (N,)


def mask_broadcast(rng, dt, N, Hq, L, S):
    """A mask as functional.mask_arg builds it: an additive mask broadcast to (B..., Hq, L, S)."""
    batch = batch_shape(rng, N)
    full = tuple(batch) + (Hq, L, S)
    mshape = tuple(d if chance(rng, 0.6) else 1 for d in full)
    mshape = mshape[int(rng.integers(0, len(mshape) + 1)):] if chance(rng, 0.3) else mshape
    vals = randn(rng, mshape, dt, 2.0)
    if chance(rng, 0.35) and vals.size:
        vals[rng.random(mshape) < pick(rng, [0.15, 0.5, 1.0])] = -INF
    lay = layout_strided(rng, mshape, last_contiguous=False, allow_zero=True) if mshape else layout_C(rng)
    marr = mk_in(rng, vals, lay)
    vals = marr.values
    isz = dt.itemsize
    view = np.broadcast_to(marr.view, full)
    strides = [s // isz for s in view.strides]
    nb = len(batch)
    if batch:
        idx = np.indices(batch).reshape(nb, -1)
        offsets = (np.array(strides[:nb], np.int64)[:, None] * idx).sum(axis=0).astype(np.int64)
    else:
        offsets = np.zeros(1, np.int64)
    off = mk_in(rng, np.ascontiguousarray(offsets, np.int64))
    dense = np.broadcast_to(vals, full).reshape(N, Hq, L, S)
    info = dict(style="broadcast", N=N, H=Hq, L=L, S=S, dense=dense,
                lo=sum(min(0, (n - 1) * s) for n, s in zip(view.shape, strides) if n),
                hi=sum(max(0, (n - 1) * s) for n, s in zip(view.shape, strides) if n))
    mask = Derived(marr, f"np.broadcast_to(.., {full})", lambda a, full=full: np.broadcast_to(a, full))
    return MaskTuple(mask, off, strides[-3], strides[-2], strides[-1], info)


def span(H, L, S, hs, ls, ss):
    lo = hi = 0
    for n, st in ((H, hs), (L, ls), (S, ss)):
        r = (n - 1) * st
        lo, hi = lo + min(0, r), hi + max(0, r)
    return lo, hi


def mask_raw(rng, dt, N, Hq, L, S):
    """A 1-D mask read through arbitrary offsets and strides (any sign, 0 included), each reaching inside."""
    hs, ls, ss = (0 if chance(rng, 0.3) else int(rng.integers(-3, 4)) for _ in range(3))
    slo, shi = span(Hq, L, S, hs, ls, ss) if min(Hq, L, S) > 0 else (0, 0)
    M = shi - slo + 1 + int(rng.integers(0, 4))
    sign = -1 if chance(rng, 0.3) else 1
    vals = randn(rng, (M,), dt, 2.0)
    if chance(rng, 0.3):
        vals[rng.random(M) < 0.3] = -INF
    marr = mk_in(rng, vals, {"neg": [sign < 0], "pad": pads(rng)})
    lo, hi = (0, M - 1) if sign > 0 else (-(M - 1), 0)
    omin, omax = lo - slo, hi - shi
    offsets = np.empty(N, np.int64)
    for n in range(N):
        r = rng.random()
        offsets[n] = omin if r < 0.25 else omax if r < 0.5 else int(rng.integers(omin, omax + 1))
    off = mk_in(rng, offsets)
    dense = None
    if min(N, Hq, L, S) > 0:
        e = (offsets[:, None, None, None] + np.arange(Hq)[None, :, None, None] * hs +
             np.arange(L)[None, None, :, None] * ls + np.arange(S)[None, None, None, :] * ss)
        dense = vals[e * sign]
    else:
        dense = np.zeros((N, Hq, L, S), dt)
    info = dict(style="raw", N=N, H=Hq, L=L, S=S, dense=dense, lo=lo, hi=hi)
    return MaskTuple(marr, off, hs, ls, ss, info)


def sdpa_ref(dt, q, k, v, dense_masks, scale, causal, p, seed, lse_given=None):
    """Probabilities, kept-and-scaled probabilities, lse and output of the core's attention, in float64."""
    N, Hq, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    g = Hq // Hk if Hk else 1
    kr = np.repeat(k.astype(np.float64), g, axis=1)
    with np.errstate(all="ignore"):
        s = float(dt.type(scale)) * (q.astype(np.float64) @ kr.swapaxes(-1, -2))
        for dm in dense_masks:
            s = s + dm.astype(np.float64)
        if causal in (1, 2):
            off = S - L if causal == 2 else 0
            s = np.where(np.arange(S)[None, :] > np.arange(L)[:, None] + off, -INF, s)
        if S == 0:
            lse = np.full((N, Hq, L), -INF)
        else:
            m = s.max(-1)
            ms = np.where(np.isfinite(m), m, 0.0)
            l = np.exp(s - ms[..., None]).sum(-1)
            lse = np.where(l > 0, ms + np.log(l), -INF)
        if lse_given is not None:
            lse = lse_given.astype(np.float64)
        lsef = np.where(np.isfinite(lse), lse, 0.0)
        P = np.where(np.isfinite(lse)[..., None], np.exp(s - lsef[..., None]), 0.0)
    if p > 0:
        keep = keep_ref(seed, P.size, p).reshape(P.shape)
        Pd = P * keep * float(dt.type(1) / dt.type(1 - p))
    else:
        keep, Pd = None, P
    out = Pd @ np.repeat(v.astype(np.float64), g, axis=1) if v is not None else None
    return P, Pd, keep, lse, out, kr, g


def sdpa_dims(rng):
    N = pick(rng, [0, 1, 1, 2, 2, 3]) if not chance(rng, 0.05) else int(rng.integers(4, 8))
    Hk = pick(rng, [1, 1, 2, 3]) if not chance(rng, 0.04) else 0
    Hq = Hk * int(rng.integers(1, 4))
    L = small(rng, 0, 7, 0.06, (60, 70))
    S = small(rng, 0, 7, 0.06, (125, 140))
    D = small(rng, 0, 7, 0.3, (8, 33))
    Dv = small(rng, 0, 7, 0.3, (8, 33))
    while N * Hq * L * S * (D + Dv + 1) > 600_000:
        L, S = max(1, L // 2), max(1, S // 2)
    return N, Hq, Hk, L, S, D, Dv


def gen_sdpa(rng, call, kind):
    dt = float_dtype(rng)
    N, Hq, Hk, L, S, D, Dv = sdpa_dims(rng)
    if kind == "weights":
        Dv = 0
    q = mk_in(rng, randn(rng, (N, Hq, L, D), dt), layout_strided(rng, (N, Hq, L, D), allow_zero=True))
    k = mk_in(rng, randn(rng, (N, Hk, S, D), dt), layout_strided(rng, (N, Hk, S, D), allow_zero=True))
    v = mk_in(rng, randn(rng, (N, Hk, S, Dv), dt), layout_strided(rng, (N, Hk, S, Dv), allow_zero=True))
    nm = pick(rng, [0, 0, 0, 1, 1, 1, 2])
    masks = [(mask_raw if chance(rng, 0.4) else mask_broadcast)(rng, dt, N, Hq, L, S) for _ in range(nm)]
    r = rng.random()
    scale = (1.0 / math.sqrt(D) if D else 1.0) if r < 0.5 else 0.0 if r < 0.55 else float(rng.uniform(-2, 2))
    causal = pick(rng, [0, 0, 1, 2])
    p = pick(rng, [0.0, 0.0, 0.0, 0.1, 0.5, 0.9])
    seed = seed_value(rng)
    dense = [m.info["dense"] for m in masks]
    P, Pd, keep, lse, out_ref, kr, g = sdpa_ref(dt, q.values, k.values, v.values, dense, scale, causal, p, seed)
    tail = [("masks", "masks", masks), ("scale", "float", scale), ("causal", "causal", causal),
            ("dropout_p", "prob", p), ("seed", "seed", seed)]
    call.sdpa = dict(dt=dt, dims=(N, Hq, Hk, L, S, D, Dv))
    if kind == "forward":
        out = mk_out(rng, randn(rng, (N, Hq, L, Dv), dt), layout_strided(rng, (N, Hq, L, Dv)))
        lse_out = mk_out(rng, randn(rng, (N, Hq, L), dt))
        for name, kd, val in [("out", "arr", out), ("logsumexp", "arr", lse_out), ("query", "arr", q),
                              ("key", "arr", k), ("value", "arr", v)] + tail:
            call.add(name, kd, val)
        call.checks += [("nonfinite", check_finite("out", lambda: out.view)),
                        ("nonfinite", check_finite("logsumexp", lambda: lse_out.view, allow_neg_inf=True)),
                        ("wrong_result", check_close("out", lambda: out.view, out_ref, dt)),
                        ("wrong_result", check_close("logsumexp", lambda: lse_out.view, lse, dt))]
    elif kind == "backward":
        outv = randn(rng, (N, Hq, L, Dv), dt)
        dout = mk_in(rng, randn(rng, (N, Hq, L, Dv), dt), layout_strided(rng, (N, Hq, L, Dv), allow_zero=True))
        out_in = mk_in(rng, outv, layout_strided(rng, (N, Hq, L, Dv), allow_zero=True))
        outv = out_in.values
        lse_in = mk_in(rng, lse.astype(dt))
        grads = [mk_out(rng, randn(rng, sh, dt), layout_strided(rng, sh))
                 for sh in ((N, Hq, L, D), (N, Hk, S, D), (N, Hk, S, Dv))]
        for name, val in zip(("grad_query", "grad_key", "grad_value", "grad_output", "out", "logsumexp", "query",
                              "key", "value"), grads + [dout, out_in, lse_in, q, k, v]):
            call.add(name, "arr", val)
        for name, kd, val in tail:
            call.add(name, kd, val)
        P, Pd, keep, _, _, kr, g = sdpa_ref(dt, q.values, k.values, None, dense, scale, causal, p, seed,
                                            lse_given=lse_in.values)
        do = dout.values.astype(np.float64)
        vr = np.repeat(v.values.astype(np.float64), g, axis=1)
        with np.errstate(all="ignore"):
            dP = do @ vr.swapaxes(-1, -2)
            if keep is not None:
                dP = dP * keep * float(dt.type(1) / dt.type(1 - p))
            delta = (do * outv.astype(np.float64)).sum(-1)
            dS = P * (dP - delta[..., None])
            sc = float(dt.type(scale))
            dq = grads[0].values + sc * (dS @ kr)
            dk = grads[1].values + (sc * (dS.swapaxes(-1, -2) @ q.values.astype(np.float64))).reshape(
                N, Hk, g, S, D).sum(2)
            dv = grads[2].values + (Pd.swapaxes(-1, -2) @ do).reshape(N, Hk, g, S, Dv).sum(2)
        for i, (name, ref) in enumerate((("grad_query", dq), ("grad_key", dk), ("grad_value", dv))):
            call.checks += [("nonfinite", check_finite(name, lambda a=grads[i]: a.view)),
                            ("wrong_result", check_close(name, lambda a=grads[i]: a.view, ref, dt))]
    else:
        avg = chance(rng, 0.4)
        wshape = (N, L, S) if avg else (N, Hq, L, S)
        w = mk_out(rng, randn(rng, wshape, dt))  # (garbage before: every element must be written)
        lse_in = mk_in(rng, lse.astype(dt))
        for name, val in (("weights", w), ("logsumexp", lse_in), ("query", q), ("key", k)):
            call.add(name, "arr", val)
        for name, kd, val in tail:
            call.add(name, kd, val)
        s = call.add("average_heads", "bool", avg)
        s.omit = not avg and chance(rng, 0.5)
        P, Pd, *_ = sdpa_ref(dt, q.values, k.values, None, dense, scale, causal, p, seed, lse_given=lse_in.values)
        with np.errstate(all="ignore"), warnings.catch_warnings():  # (a mean over 0 heads is NaN, as in PyTorch)
            warnings.simplefilter("ignore")
            ref = Pd.mean(1) if avg else Pd
        if not (avg and Hq == 0):
            call.checks.append(("nonfinite", check_finite("weights", lambda: w.view)))
        call.checks.append(("wrong_result", check_close("weights", lambda: w.view, ref, dt)))


def gen_linear(rng, call, backward):
    dt = float_dtype(rng)
    M = small(rng, 0, 7, 0.15, (8, 70))
    Fin = small(rng, 0, 7, 0.4, (8, 40))
    Fout = small(rng, 0, 7, 0.4, (8, 40))
    x = mk_in(rng, randn(rng, (M, Fin), dt))
    w = mk_in(rng, randn(rng, (Fout, Fin), dt))
    x64, w64 = x.values.astype(np.float64), w.values.astype(np.float64)
    if not backward:
        y = mk_out(rng, randn(rng, (M, Fout), dt))
        b = mk_in(rng, randn(rng, (Fout,), dt)) if chance(rng, 0.6) else None
        call.add("out", "arr", y), call.add("input", "arr", x), call.add("weight", "arr", w)
        call.add("bias", "optarr", b, shape=(Fout,), dtype=dt, role="in")
        ref = x64 @ w64.T + (b.values.astype(np.float64) if b is not None else 0)
        call.checks += [("nonfinite", check_finite("out", lambda: y.view)),
                        ("wrong_result", check_close("out", lambda: y.view, ref, dt))]
        return
    dy = mk_in(rng, randn(rng, (M, Fout), dt))
    dx = mk_out(rng, randn(rng, (M, Fin), dt)) if chance(rng, 0.7) else None
    dw = mk_out(rng, randn(rng, (Fout, Fin), dt))
    db = mk_out(rng, randn(rng, (Fout,), dt)) if chance(rng, 0.6) else None
    call.add("grad_input", "optarr", dx, shape=(M, Fin), dtype=dt, role="out")
    call.add("grad_weight", "arr", dw)
    call.add("grad_bias", "optarr", db, shape=(Fout,), dtype=dt, role="out")
    call.add("grad_output", "arr", dy), call.add("input", "arr", x), call.add("weight", "arr", w)
    dy64 = dy.values.astype(np.float64)
    refs = [("grad_weight", dw, dw.values + dy64.T @ x64)]
    if dx is not None:
        refs.append(("grad_input", dx, dx.values + dy64 @ w64))
    if db is not None:
        refs.append(("grad_bias", db, db.values + dy64.sum(0)))
    for name, a, ref in refs:
        call.checks += [("nonfinite", check_finite(name, lambda a=a: a.view)),
                        ("wrong_result", check_close(name, lambda a=a: a.view, ref, dt))]


def rand_shape(rng, max_ndim=4, max_dim=7, max_size=4096):
    while True:
        shape = [int(rng.integers(0, max_dim + 1)) for _ in range(int(rng.integers(0, max_ndim + 1)))]
        if math.prod(shape) <= max_size:
            return shape


def gen_empty(rng, call):
    shape = rand_shape(rng)
    if chance(rng, 0.1):  # a pooled size (the Python layer pools outputs of 1 MiB and more)
        shape = [int(rng.integers(1 << 17, 1 << 18))]
    dtype = np.dtype(pick(rng, [F32, F64, F64, F32, np.int64, np.bool_, np.complex128, np.uint8, np.float16]))
    call.add("shape", "shape", shape)
    call.add("dtype", "dtype", dtype)


def gen_dropout(rng, call, which):
    dt = float_dtype(rng)
    p = pick(rng, [0.0, 0.1, 0.5, 0.9, 0.999])
    seed = seed_value(rng)
    if which == "mask":
        shape = rand_shape(rng, max_ndim=4, max_dim=9, max_size=20000)
        if chance(rng, 0.05):
            shape = [int(rng.integers(1 << 17, 1 << 18))]
        call.add("shape", "shape", shape), call.add("p", "prob", p), call.add("seed", "seed", seed)
        ref = keep_ref(seed, math.prod(shape), p).reshape(shape)
        call.checks.append(("wrong_result", lambda r: None if (isinstance(r, np.ndarray) and r.dtype == np.bool_ and
                                                                np.array_equal(r, ref)) else
                            "dropout_mask: differs from the reference hash"))
        return
    shape = rand_shape(rng, max_size=6000)
    if chance(rng, 0.05):
        shape = [int(rng.integers(1 << 17, 1 << 18))]
    n = math.prod(shape)
    oshape = shape if chance(rng, 0.7) else [n]  # only the size must agree
    x = mk_in(rng, randn(rng, shape, dt))
    out = mk_out(rng, randn(rng, oshape, dt))
    keep = keep_ref(seed, n, p).reshape(shape)
    sc = float(dt.type(1) / dt.type(1 - p))
    if which == "forward":
        call.add("out", "arr", out), call.add("input", "arr", x)
        ref = np.where(keep, x.values.astype(np.float64) * sc, 0.0).reshape(oshape)
    else:
        call.add("grad_input", "arr", out), call.add("grad_output", "arr", x)
        ref = out.values.astype(np.float64) + np.where(keep, x.values.astype(np.float64) * sc, 0.0).reshape(oshape)
    call.add("p", "prob", p), call.add("seed", "seed", seed)
    call.checks += [("nonfinite", check_finite("out", lambda: out.view)),
                    ("wrong_result", check_close("out", lambda: out.view, ref, dt))]


def gen_embedding(rng, call, backward):
    dt = float_dtype(rng)
    V, E = small(rng, 1, 30), small(rng, 0, 20)
    ishape = rand_shape(rng, max_ndim=3, max_dim=5, max_size=60)
    if chance(rng, 0.05):
        V = 0
        ishape = [0]
    N = math.prod(ishape)
    idx = rng.integers(0, max(V, 1), ishape).astype(np.int64)
    index = mk_in(rng, idx)
    if not backward:
        w = mk_in(rng, randn(rng, (V, E), dt))
        out = mk_out(rng, randn(rng, (N, E), dt))
        call.add("out", "arr", out), call.add("index", "index", index, size=V), call.add("weight", "arr", w)
        ref = w.values[idx.ravel()] if N else np.zeros((0, E))
        call.checks += [("wrong_result", check_close("out", lambda: out.view, ref, dt))]
        return
    dwt = mk_out(rng, randn(rng, (V, E), dt))
    dout = mk_in(rng, randn(rng, (N, E), dt))
    call.add("grad_weight", "arr", dwt), call.add("grad_output", "arr", dout)
    call.add("index", "index", index, size=V)
    ref = dwt.values.astype(np.float64).copy()
    np.add.at(ref, idx.ravel(), dout.values.astype(np.float64))
    call.checks += [("wrong_result", check_close("grad_weight", lambda: dwt.view, ref, dt))]


def ce_ref(x, t, ii):
    x = x.astype(np.float64)
    N, C = x.shape
    if N == 0:
        return np.zeros(0), np.zeros((0, 2))
    m = x.max(1)
    ls = np.log(np.exp(x - m[:, None]).sum(1))
    tt = np.clip(t, 0, C - 1)
    losses = np.where(t == ii, 0.0, (m - x[np.arange(N), tt]) + ls)
    return losses, np.stack([m, ls], 1)


def gen_cross_entropy(rng, call, backward):
    dt = float_dtype(rng)
    N = small(rng, 0, 8)
    C = small(rng, 1, 40, 0.05, (1020, 1100))
    if chance(rng, 0.04):
        N, C = 0, 0
    x = mk_in(rng, randn(rng, (N, C), dt, 3.0))
    t = rng.integers(0, max(C, 1), N).astype(np.int64)
    ii = -100 if chance(rng, 0.6) else pick(rng, [-1, 0, C - 1, C, 2 ** 63 - 1, -2 ** 63])
    ignored = rng.random(N) < 0.2
    losses_ref, stats_ref = ce_ref(x.values, t, ii)
    if not backward:
        t[ignored] = ii
        losses_ref, stats_ref = ce_ref(x.values, t, ii)
        target = mk_in(rng, t)
        losses = mk_out(rng, randn(rng, N, dt))
        stats = mk_out(rng, randn(rng, (N, 2), dt))
        call.add("losses", "arr", losses), call.add("stats", "arr", stats), call.add("input", "arr", x)
        call.add("target", "index", target, size=C, allowed=ii)
        call.add("ignore_index", "int", ii)
        call.checks += [("nonfinite", check_finite("losses", lambda: losses.view)),
                        ("wrong_result", check_close("losses", lambda: losses.view, losses_ref, dt)),
                        ("wrong_result", check_close("stats", lambda: stats.view, stats_ref, dt))]
        return
    w = randn(rng, N, dt)
    w[ignored] = pick(rng, [0.0, -0.0])
    t[ignored] = [pick(rng, [-100, -1, C, 2 ** 63 - 1, -2 ** 63, 0]) for _ in range(int(ignored.sum()))]
    target = mk_in(rng, t)
    row_w = mk_in(rng, w)
    stats = mk_in(rng, stats_ref.astype(dt))
    d = mk_out(rng, randn(rng, (N, C), dt))
    call.add("grad_input", "arr", d), call.add("row_weight", "arr", row_w), call.add("stats", "arr", stats)
    call.add("input", "arr", x), call.add("target", "index", target, size=C, allowed=None)
    with np.errstate(all="ignore"):
        x64, s64 = x.values.astype(np.float64), stats.values.astype(np.float64)
        pr = np.exp(x64 - s64[:, :1] - s64[:, 1:])
        oh = np.zeros((N, C))
        ok = ~ignored
        oh[np.arange(N)[ok], t[ok]] = 1.0
        ref = np.where(ignored[:, None], 0.0, w.astype(np.float64)[:, None] * (pr - oh))
    call.checks += [("nonfinite", check_finite("grad_input", lambda: d.view)),
                    ("wrong_result", check_close("grad_input", lambda: d.view, ref, dt))]


def gen_optim(rng, call, which):
    dt = float_dtype(rng)
    shape = rand_shape(rng, max_size=5000)
    if chance(rng, 0.04):
        shape = [int(rng.integers(1 << 17, 1 << 18))]
    n = math.prod(shape)
    gshape = shape if chance(rng, 0.8) else [n]
    param = mk_out(rng, randn(rng, shape, dt))
    grad = mk_in(rng, randn(rng, gshape, dt))
    p64, g64 = param.values.astype(np.float64).ravel(), grad.values.astype(np.float64).ravel()
    if which == "sgd":
        lr = pick(rng, [0.0, 0.01, 0.1])
        mom = pick(rng, [0.0, 0.0, 0.9])
        damp = pick(rng, [0.0, 0.1])
        wd = pick(rng, [0.0, 0.01])
        nest, first = chance(rng, 0.3), chance(rng, 0.5)
        buf = mk_out(rng, randn(rng, shape, dt)) if mom != 0 or chance(rng, 0.3) else None
        call.add("params", "arr", param, listed=True), call.add("grads", "arr", grad, listed=True)
        call.add("momentum_buffers", "optarr", buf, shape=tuple(shape), dtype=dt, role="out", listed=True)
        call.add("steps", "int", 1 if first else 2, listed=True)
        for name, val in (("lr", lr), ("momentum", mom), ("dampening", damp), ("weight_decay", wd)):
            call.add(name, "float", val)
        call.add("nesterov", "bool", nest)
        d = g64 + wd * p64 if wd else g64
        if mom:
            b = d if first else mom * buf.values.astype(np.float64).ravel() + (1 - damp) * d
            d = d + mom * b if nest else b
            call.checks.append(("wrong_result", check_close("momentum_buffer", lambda: buf.view.ravel(), b, dt)))
        ref = p64 - lr * d
    else:
        lr = pick(rng, [0.0, 1e-3, 0.1])
        b1, b2 = pick(rng, [0.0, 0.9, 0.99]), pick(rng, [0.0, 0.999, 0.5])
        eps, wd = pick(rng, [1e-8, 1e-3]), pick(rng, [0.0, 0.01])
        step = pick(rng, [1, 1, 2, 10, 1000])
        m = mk_out(rng, randn(rng, shape, dt))
        v = mk_out(rng, np.abs(randn(rng, shape, dt)))
        for name, val in (("params", param), ("grads", grad), ("exp_avgs", m), ("exp_avg_sqs", v)):
            call.add(name, "arr", val, listed=True)
        call.add("steps", "int", step, listed=True)
        for name, val in (("lr", lr), ("beta1", b1), ("beta2", b2), ("eps", eps), ("weight_decay", wd)):
            call.add(name, "float", val)
        m64 = m.values.astype(np.float64).ravel()
        v64 = v.values.astype(np.float64).ravel()
        m64 = m64 + (1 - b1) * (g64 - m64)
        v64 = v64 * b2 + (1 - b2) * g64 * g64
        denom = np.sqrt(v64) / math.sqrt(1 - b2 ** step) + eps
        ref = p64 * (1 - lr * wd) - (lr / (1 - b1 ** step)) * m64 / denom
        call.checks.append(("wrong_result", check_close("exp_avg", lambda: m.view.ravel(), m64, dt)))
    call.checks += [("nonfinite", check_finite("param", lambda: param.view)),
                    ("wrong_result", check_close("param", lambda: param.view.ravel(), ref, dt))]


def rotary_ref(x, cos, sin, offsets, interleaved):
    """RoPE of x (N, H, L, D) in float64 by the angles of rows offsets[n] + l of cos, sin (P, R2)."""
    N, H, L, D = x.shape
    R2 = cos.shape[1]
    out = x.astype(np.float64).copy()
    pos = np.asarray(offsets, np.int64)[:, None] + np.arange(L)[None, :]       # (N, L)
    c = cos.astype(np.float64)[pos][:, None]                                    # (N, 1, L, R2)
    s = sin.astype(np.float64)[pos][:, None]
    ia = np.arange(R2) * 2 if interleaved else np.arange(R2)
    ib = ia + 1 if interleaved else ia + R2
    a, b = x[..., ia].astype(np.float64), x[..., ib].astype(np.float64)
    out[..., ia], out[..., ib] = a * c - b * s, b * c + a * s
    return out


def gen_rotary(rng, call, backward):
    dt = float_dtype(rng)
    N, H = pick(rng, [0, 1, 1, 2, 3]), pick(rng, [0, 1, 2, 3, 3])
    L = small(rng, 0, 9, 0.1, (60, 300))
    D = small(rng, 0, 12, 0.3, (32, 130))
    R2 = int(rng.integers(0, D // 2 + 1))
    P = L + pick(rng, [0, 0, 1, 5, 40])
    while N * H * L * D > 300_000:
        L //= 2
    offsets = rng.integers(0, P - L + 1, N).astype(np.int64)
    if N and chance(rng, 0.3):  # the extremes of the valid range
        offsets[int(rng.integers(N))] = pick(rng, [0, P - L])
    shape = (N, H, L, D)
    x = mk_in(rng, randn(rng, shape, dt), layout_strided(rng, shape, allow_zero=True))
    cos, sin = (mk_in(rng, randn(rng, (P, R2), dt)) for _ in range(2))
    dst = mk_out(rng, randn(rng, shape, dt), layout_strided(rng, shape))  # (garbage: every element written)
    interleaved = chance(rng, 0.5)
    call.add("grad_input" if backward else "out", "arr", dst)
    call.add("grad_output" if backward else "input", "arr", x)
    call.add("cos", "arr", cos), call.add("sin", "arr", sin)
    call.add("position_offsets", "index", mk_in(rng, offsets), size=P - L + 1)
    call.add("interleaved", "bool", interleaved)
    if backward:  # the opposite angles, added into grad_input
        ref = dst.values.astype(np.float64) + rotary_ref(x.values, cos.values, -sin.values, offsets, interleaved)
    else:
        ref = rotary_ref(x.values, cos.values, sin.values, offsets, interleaved)
    name = "grad_input" if backward else "out"
    call.checks += [("nonfinite", check_finite(name, lambda: dst.view)),
                    ("wrong_result", check_close(name, lambda: dst.view, ref, dt))]


def generate(seed, index, functions, no_huge=False):
    rng = np.random.default_rng([seed, index])
    names = sorted(functions)
    w = np.array([FUNCTIONS[f] for f in names], np.float64)
    fn = names[int(rng.choice(len(names), p=w / w.sum()))]
    call = Call(index, fn)
    call.no_huge = no_huge
    if fn.startswith("sdpa_"):
        gen_sdpa(rng, call, fn[5:])
    elif fn.startswith("linear_"):
        gen_linear(rng, call, fn == "linear_backward")
    elif fn == "empty":
        gen_empty(rng, call)
    elif fn == "empty_cache":
        pass
    elif fn.startswith("dropout_"):
        gen_dropout(rng, call, fn[8:])
    elif fn.startswith("embedding_"):
        gen_embedding(rng, call, fn == "embedding_backward")
    elif fn.startswith("cross_entropy_"):
        gen_cross_entropy(rng, call, fn == "cross_entropy_backward")
    elif fn in ("sgd_step", "adamw_step"):
        gen_optim(rng, call, fn[:-5])
    elif fn.startswith("rotary_"):
        gen_rotary(rng, call, fn == "rotary_backward")
    elif fn == "set_num_threads":
        call.add("n", "threads", pick(rng, [1, 2, 3, 4, 8]))
    elif fn == "get_num_threads":
        pass
    r = rng.random()
    nmut = 0 if r < 0.35 else 1 if r < 0.75 else 2
    for _ in range(nmut):
        mutate(rng, call)
    return call


# ------------------------------------------------------------------------------------------ mutations
def huge_shapes(no_huge):
    """Shapes too large to allocate. With no_huge (ASan without allocator_may_return_null) only those whose
    byte count overflows, which the core or NumPy refuse before allocating."""
    over = [[2 ** 32, 2 ** 32], [2 ** 31, 2 ** 31, 4], [2 ** 21] * 3, [2 ** 62, 2], [2 ** 63 - 1, 2], [3, 2 ** 62]]
    return over if no_huge else over + [[2 ** 40], [2 ** 62], [2 ** 63 - 1], [2 ** 20] * 4, [2 ** 45, 1]]


def non_array(rng, kind, like=None):
    if kind == "None":
        return None
    if kind == "list":  # (not for empty arrays: shape (2**31, 0) would make 2**31 empty lists)
        return like.tolist() if isinstance(like, np.ndarray) and 0 < like.size <= 10000 else [1.0, 2.0]
    return {"int": 3, "str": "abc", "float": 1.5, "tuple": (1.0, 2.0), "dict": {"a": 1},
            "npscalar": np.float64(1.0), "bytes": b"\x00" * 16, "object": object()}[kind]


def mutate_layout(rng, a):
    """A new Arr with the same values and a (usually) non-contiguous or odd layout."""
    nd = a.values.ndim
    lay = {"pad": pads(rng)}
    op = pick(rng, ["F", "transpose", "step", "neg", "zero", "unaligned", "odd", "laststep", "C"])
    if nd == 0 and op not in ("unaligned", "C"):
        op = "unaligned"
    if op == "F":
        lay["perm"] = list(range(nd))[::-1]
    elif op == "transpose":
        lay["perm"] = [int(x) for x in rng.permutation(nd)]
    elif op in ("step", "neg", "zero"):
        v = [False] * nd
        ax = int(rng.integers(nd))
        v[ax] = True
        lay[op] = [3 if x else 1 for x in v] if op == "step" else v
    elif op == "laststep":
        lay["step"] = [1] * (nd - 1) + [2]
    elif op == "unaligned":
        isz = a.dtype.itemsize
        lay["shift"] = int(rng.integers(1, isz)) if isz > 1 else 0
    elif op == "odd":
        isz = a.dtype.itemsize
        lay["odd"] = (int(rng.integers(nd)), int(rng.integers(1, isz)) if isz > 1 else 0)
    return Arr(a.values, a.role, lay, PAD_OUT if a.role == "out" else PAD_IN_FLOAT, not a.view.flags.writeable,
               note=f"layout mutated: {op}")


def mutate_shape(rng, call, a):
    shape = list(a.shape)
    nd = len(shape)
    op = pick(rng, ["dim", "dim", "zero", "drop", "add", "swap", "0d", "5d", "huge"])
    if op == "dim" and nd:
        ax = int(rng.integers(nd))
        shape[ax] = max(0, shape[ax] + pick(rng, [-1, 1, 2, 5]))
    elif op == "zero" and nd:
        shape[int(rng.integers(nd))] = 0
    elif op == "drop" and nd:
        shape.pop(int(rng.integers(nd)))
    elif op == "add":
        shape.insert(int(rng.integers(nd + 1)), pick(rng, [1, 2]))
    elif op == "swap" and nd >= 2:
        i, j = rng.choice(nd, 2, replace=False)
        shape[i], shape[j] = shape[j], shape[i]
    elif op == "0d":
        shape = []
    elif op == "5d":
        shape = [int(rng.integers(0, 4)) for _ in range(5)]
    else:  # a huge dimension in an empty array: no memory, large products
        if nd == 0:
            shape = [0, 2 ** 31]
        else:
            ax = int(rng.integers(nd))
            shape[ax] = pick(rng, [2 ** 31, 2 ** 40, 2 ** 62, 2 ** 31 - 1])
            other = [d for d in range(nd) if d != ax]
            if other:
                shape[pick(rng, other)] = 0
            else:
                shape.append(0)
    if math.prod(shape) > 200_000:
        shape[0] = 0
    try:
        vals = rand_values(rng, tuple(shape), a.dtype)
    except ValueError:  # NumPy refuses dimensions whose product of bytes overflows, even with a 0 elsewhere
        shape = [min(d, 2 ** 31) for d in shape]
        vals = rand_values(rng, tuple(shape), a.dtype)
    return Arr(vals, a.role, layout_C(rng), PAD_OUT if a.role == "out" else PAD_IN_FLOAT,
               note=f"shape mutated from {a.shape}")


def mutate_array(rng, call, slot):
    a = slot.value
    if not isinstance(a, Arr):  # an optional array left None, or already replaced: make one from the spec
        spec = slot.spec
        if "shape" in spec:
            a = Arr(rand_values(rng, spec["shape"], spec["dtype"]), spec["role"], layout_C(rng),
                    PAD_OUT if spec["role"] == "out" else PAD_IN_FLOAT)
            slot.value = a
            if slot.kind == "optarr":
                return f"{slot.name}: given"
        else:
            slot.value = None
            return f"{slot.name}: None"
    ops = ["shape", "dtype", "layout", "layout", "readonly", "nonarray", "alias", "values"]
    if slot.kind == "optarr":  # (py::object parameters: the binding converts what it is given)
        ops += ["none", "aslist", "aslist"]
    op = pick(rng, ops)
    if op == "aslist":
        slot.value = a.values.tolist() if 0 < a.values.size <= 10000 else [1.0, 2.0]
        return f"{slot.name}: the same values as a list"
    if op == "shape":
        slot.value = mutate_shape(rng, call, a)
        return f"{slot.name}: shape {a.shape} -> {slot.value.shape}"
    if op == "dtype":
        dt = np.dtype(pick(rng, OTHER_DTYPES))
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                vals = a.values.astype(dt) if not (a.values.dtype.kind == "c" and dt.kind != "c") else \
                    a.values.real.astype(dt)
            except (OverflowError, ValueError, TypeError):  # e.g. an object array's -1 as uint8
                vals = np.zeros(a.values.shape, dt)
        slot.value = Arr(vals, a.role, a.layout, PAD_OUT if a.role == "out" else PAD_IN_FLOAT)
        return f"{slot.name}: dtype {a.dtype} -> {dt}"
    if op == "layout":
        slot.value = mutate_layout(rng, a)
        return f"{slot.name}: {slot.value.note}"
    if op == "readonly":
        slot.value = Arr(a.values, a.role, a.layout, PAD_OUT if a.role == "out" else PAD_IN_FLOAT, True)
        return f"{slot.name}: read-only"
    if op == "nonarray":
        kind = pick(rng, NON_ARRAYS)
        slot.value = non_array(rng, kind, a.values)
        return f"{slot.name}: {kind} instead of an array"
    if op == "none":
        slot.value = None
        return f"{slot.name}: None"
    if op == "alias":
        others = [s for s in call.slots if s is not slot and isinstance(s.value, Arr)]
        if not others:
            slot.value = None
            return f"{slot.name}: None"
        o = pick(rng, others)
        slot.value = o.value
        call.aliased = True
        return f"{slot.name}: the same array as {o.name}"
    # values: non-finite or extreme values (floats), out-of-range ones (integers)
    vals = a.values.copy()
    if vals.size:
        flat = vals.reshape(-1)
        i = int(rng.integers(flat.size))
        if vals.dtype.kind in "fc":
            flat[i] = pick(rng, [NAN, INF, -INF, 3e38, -3e38, 1e-45])
        elif vals.dtype.kind in "iu":
            info = np.iinfo(vals.dtype)
            flat[i] = pick(rng, [info.max, info.min, info.max // 2 + 1] + ([-1] if info.min < 0 else []))
    slot.value = Arr(vals, a.role, a.layout, PAD_OUT if a.role == "out" else PAD_IN_FLOAT,
                     not a.view.flags.writeable, note="values mutated")
    return f"{slot.name}: extreme values"


def mutate_index(rng, call, slot):
    a = slot.value
    if not isinstance(a, Arr) or rng.random() < 0.3:
        return mutate_array(rng, call, slot)
    size = slot.spec["size"]
    vals = a.values.copy()
    flat = vals.reshape(-1)
    if flat.size == 0:
        vals = np.array([pick(rng, [-1, size, 0])], np.int64)
        flat = vals
    i = int(rng.integers(flat.size))
    bad = pick(rng, [-1, size, size + 1, 2 ** 63 - 1, -2 ** 63, -2 ** 31, 2 ** 32 + 1])
    try:
        flat[i] = bad
    except (OverflowError, ValueError, TypeError):  # an index array already given another dtype
        bad = size
        flat[i] = min(bad, np.iinfo(vals.dtype).max) if vals.dtype.kind in "iu" else bad
    slot.value = Arr(vals, a.role, a.layout, PAD_IN_INT, note=f"index[{i}] = {bad}")
    return f"{slot.name}: value {bad} (range [0, {size}))"


def mutate_scalar(rng, call, slot):
    kind = slot.kind
    if kind == "float":
        v = pick(rng, FLOAT_EDGES) if chance(rng, 0.75) else pick(rng, NOT_FLOATS)
    elif kind == "prob":
        v = pick(rng, PROBS) if chance(rng, 0.8) else pick(rng, NOT_FLOATS)
    elif kind == "int":
        v = pick(rng, INT_EDGES) if chance(rng, 0.75) else pick(rng, NOT_INTS)
    elif kind == "seed":
        v = pick(rng, SEEDS)
    elif kind == "bool":
        v = pick(rng, BOOLS)
    elif kind == "causal":
        v = pick(rng, CAUSALS)
    elif kind == "threads":
        v = pick(rng, [0, -1, -2 ** 31, 2 ** 31, 2 ** 63, 1.5, "2", None, True, 64, 16, 1, 2]
                 if chance(rng, 0.9) else [2 ** 31 - 1, 10 ** 5, 10 ** 4])
    elif kind == "op":
        v = pick(rng, ["get", "set"])
    else:
        v = None
    if kind == "bool" and slot.omit:
        slot.omit = False
    slot.value = v
    return f"{slot.name} = {v!r}"


def mutate_shape_list(rng, call, slot):
    shape = list(slot.value) if isinstance(slot.value, list) else [2, 3]
    op = pick(rng, ["neg", "huge", "huge", "big_ok", "float", "str", "None", "tuple", "ndarray", "string",
                    "nested", "many_dims", "dim_2_64"])
    if op == "neg":
        shape = shape + [1] if not shape else shape
        shape[int(rng.integers(len(shape)))] = pick(rng, [-1, -2 ** 31, -2 ** 63])
        v = shape
    elif op == "huge":
        v = list(pick(rng, huge_shapes(call.no_huge)))
    elif op == "big_ok":
        v = [int(rng.integers(1 << 18, 1 << 20))]
    elif op == "float":
        v = shape + [2.0]
    elif op == "str":
        v = shape + ["2"]
    elif op == "None":
        v = None
    elif op == "tuple":
        v = tuple(shape)
    elif op == "ndarray":
        try:
            v = np.array(shape, dtype=pick(rng, [np.int64, np.int32, np.float64, np.uint64]))
        except (OverflowError, ValueError, TypeError):  # (a shape already mutated to huge or non-int values)
            v = np.array([2, 3], np.int64)
    elif op == "string":
        v = "abc"
    elif op == "nested":
        v = [shape]
    elif op == "many_dims":
        v = [1] * pick(rng, [32, 33, 64, 65, 100])
    else:
        v = shape + [2 ** 64]
    slot.value = v
    return f"{slot.name} = {describe(v)}"


def mutate_dtype(rng, call, slot):
    if chance(rng, 0.8):
        v = pick(rng, EXOTIC_DTYPES + [np.dtype(np.int32), np.dtype(np.bool_)])
    else:
        v = pick(rng, ["float32", np.float32, None, 3, F64.type(1)])
    slot.value = v
    return f"{slot.name} = {describe(v)}"


def mutate_masks(rng, call, slot):
    masks = slot.value
    info = call.sdpa
    dt = info["dt"]
    N, Hq, Hk, L, S, D, Dv = info["dims"]
    if type(masks) is not list:
        masks = []
    tuples = [m for m in masks if isinstance(m, MaskTuple)]
    if not tuples or chance(rng, 0.1):
        m = (mask_raw if chance(rng, 0.5) else mask_broadcast)(rng, dt, N, Hq, L, S)
        masks = masks + [m]
        tuples.append(m)
    slot.value = masks
    m = pick(rng, tuples)
    op = pick(rng, ["offset_out", "offset_out", "stride_out", "stride_out", "stride_huge", "offsets_len",
                    "offsets_dtype", "offsets_kind", "mask_dtype", "mask_layout", "mask_empty", "mask_0d",
                    "mask_nonarray", "arity", "container", "list", "dup", "gap"])
    if len(m.items) < 5 and op not in ("arity", "list", "dup"):  # a tuple shortened by an earlier mutation
        op = "container"
    inf = m.info
    nonempty = min(N, Hq, L, S) > 0
    if op == "offset_out":
        off = m.items[1]
        if not isinstance(off, Arr) or off.values.size == 0:
            op = "stride_out"
        else:
            vals = off.values.copy()
            n = int(rng.integers(vals.size))
            vals = vals.reshape(-1)  # (offsets of another shape after an earlier mutation)
            strides = ([x if isinstance(x, int) else 0 for x in m.items[2:5]] + [0, 0, 0])[:3]
            slo, shi = span(Hq, L, S, *strides) if nonempty else (0, 0)
            bad = pick(rng, [inf["hi"] - shi + 1, inf["lo"] - slo - 1, inf["hi"] - shi + 7, 2 ** 62, -2 ** 62,
                             2 ** 63 - 1, -2 ** 63, inf["hi"] + 1, -1])
            vals[n] = bad
            m.items[1] = Arr(vals, "in", off.layout, PAD_IN_INT, note=f"offsets[{n}] = {bad}")
            return f"mask: offsets[{n}] = {bad} (valid [{inf['lo'] - slo}, {inf['hi'] - shi}])"
    if op == "stride_out":
        j = int(rng.integers(2, 5))
        old = m.items[j] if isinstance(m.items[j], int) else 0
        new = old + pick(rng, [1, -1, 2, -2]) if old else pick(rng, [1, -1, 3])
        m.items[j] = new
        return f"mask: {['h', 'l', 's'][j - 2]}_stride {old} -> {new}"
    if op == "stride_huge":
        j = int(rng.integers(2, 5))
        v = pick(rng, [2 ** 62, -2 ** 62, 2 ** 63 - 1, -2 ** 63, 2 ** 63, 2 ** 31, -2 ** 31 + 1, 1.0, None, "1"])
        m.items[j] = v
        return f"mask: {['h', 'l', 's'][j - 2]}_stride = {v!r}"
    if op == "offsets_len":
        n = pick(rng, [N + 1, max(N - 1, 0), 0, N + 5])
        vals = np.zeros(n, np.int64)
        shape = (n,) if chance(rng, 0.7) else pick(rng, [(n, 1), (1, n), ()])
        vals = np.zeros(shape, np.int64)
        m.items[1] = mk_in(rng, vals)
        return f"mask: offsets of shape {shape} (N = {N})"
    if op == "offsets_dtype":
        off = m.items[1]
        base = off.values if isinstance(off, Arr) else np.zeros(N, np.int64)
        dtp = np.dtype(pick(rng, [np.float64, np.int32, np.uint64, np.bool_, object, np.float16, np.complex128,
                                  np.int8, "U3"]))
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            vals = base.astype(dtp)
        if dtp == np.uint64 and vals.size and chance(rng, 0.5):
            vals[0] = np.uint64(2 ** 64 - 1)
        if dtp == np.float64 and vals.size and chance(rng, 0.5):
            vals[0] = pick(rng, [NAN, 1e300, 0.5, -INF])
        m.items[1] = mk_in(rng, vals)
        return f"mask: offsets dtype {dtp}"
    if op == "offsets_kind":
        off = m.items[1]
        base = off.values if isinstance(off, Arr) else np.zeros(N, np.int64)
        k = pick(rng, ["list", "None", "int", "noncontig", "str", "tuple"])
        if k == "noncontig":
            m.items[1] = mutate_layout(rng, off) if isinstance(off, Arr) else None
        else:
            flat = base.reshape(-1)[:10000].tolist()
            m.items[1] = {"list": flat, "None": None, "int": 0, "str": "0", "tuple": tuple(flat)}[k]
        return f"mask: offsets as {k}"
    if op == "mask_dtype":
        src = m.items[0].src if isinstance(m.items[0], Derived) else m.items[0]
        vals = src.values if isinstance(src, Arr) else np.zeros(3)
        dtp = np.dtype(pick(rng, [np.float16, np.float32, np.float64, np.int64, np.bool_, object, np.complex128]))
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            nv = vals.real.astype(dtp) if vals.dtype.kind == "c" else vals.astype(dtp)
        m.items[0] = mk_in(rng, nv)
        return f"mask: dtype {dtp} (query {dt})"
    if op == "mask_layout":
        src = m.items[0].src if isinstance(m.items[0], Derived) else m.items[0]
        if isinstance(src, Arr):
            m.items[0] = mutate_layout(rng, src)
            return f"mask: {m.items[0].note}"
        op = "mask_empty"
    if op == "mask_empty":
        m.items[0] = mk_in(rng, np.zeros(pick(rng, [(0,), (0, 3), (2, 0)]), dt))
        return "mask: an empty mask array"
    if op == "mask_0d":
        m.items[0] = mk_in(rng, np.array(rng.standard_normal(), dt))
        m.items[2:5] = [0, 0, 0] if chance(rng, 0.6) else [0, 0, 1]
        m.items[1] = mk_in(rng, np.zeros(N, np.int64))
        return f"mask: 0-d mask, strides {m.items[2:5]}"
    if op == "mask_nonarray":
        kind = pick(rng, NON_ARRAYS)
        m.items[0] = non_array(rng, kind, np.zeros((2, 2)))
        return f"mask: {kind} instead of an array"
    if op == "arity":
        if chance(rng, 0.5) and len(m.items) > 1:
            m.items.pop()
        else:
            m.items.append(pick(rng, [0, None, 1.0]))
        return f"mask: a tuple of {len(m.items)}"
    if op == "container":
        m.container = list
        return "mask: a list instead of a tuple"
    if op == "list":
        k = pick(rng, ["None", "tuple", "one", "str", "int", "dict"])
        slot.value = {"None": None, "tuple": tuple(masks), "one": m, "str": "abc", "int": 0, "dict": {}}[k]
        return f"masks: {k}"
    if op == "dup":
        slot.value = masks + [m]
        return "masks: one mask twice"
    # gap: a raw mask on a strided array, offsets/strides inside its span but between its elements
    src = m.items[0].src if isinstance(m.items[0], Derived) else m.items[0]
    if isinstance(src, Arr) and src.values.ndim == 1 and src.values.size:
        m.items[0] = Arr(src.values, "in", {"step": [2], "pad": pads(rng)}, PAD_IN_FLOAT, True,
                         note="every other element")
        return "mask: array with step 2 (offsets may point between elements)"
    m.items[-1] = 1
    return "mask: s_stride = 1"


def mutate(rng, call):
    if not call.slots:
        # functions without arguments: pass some anyway
        extra = pick(rng, [1, None, "x", np.zeros(2)])
        call.add("extra", "extra", extra)
        call.mutations.append(f"extra argument {describe(extra)}")
        return
    weights = np.array([{"masks": 3.0, "arr": 1.0, "optarr": 1.0, "index": 2.0, "shape": 2.0,
                         "dtype": 1.0}.get(s.kind, 0.6) for s in call.slots])
    slot = call.slots[int(rng.choice(len(call.slots), p=weights / weights.sum()))]
    if slot.kind in ("arr", "optarr"):
        what = mutate_array(rng, call, slot)
    elif slot.kind == "index":
        what = mutate_index(rng, call, slot)
    elif slot.kind == "masks":
        what = mutate_masks(rng, call, slot)
    elif slot.kind == "shape":
        what = mutate_shape_list(rng, call, slot)
    elif slot.kind == "dtype":
        what = mutate_dtype(rng, call, slot)
    elif slot.kind == "extra":
        what = "extra"
    else:
        what = mutate_scalar(rng, call, slot)
    if chance(rng, 0.03):  # an argument too many or too few
        if chance(rng, 0.5):
            call.add("extra", "extra", 0)
            what += "; an extra argument"
        else:
            call.slots.pop()
            what += "; the last argument left out"
    call.mutations.append(what)


# ------------------------------------------------------------------------------------------ execution
class Observed(Exception):
    """A finding made inside an invoker (not an exception of the call)."""


PARAM_SLOTS = ("masks", "scale", "causal", "dropout_p", "seed")  # an sdpa call's fields of _core.AttentionParams


def sdpa_params(core, names, values):
    """The _core.AttentionParams of an sdpa call's parameter slots (masks as AttentionMasks, an int causal as
    Causal(int)); a mutated value raises here, where the binding's conversion of the arguments would."""
    fields = dict(zip(names, values))
    masks = fields.pop("masks", [])
    if type(masks) is list:
        masks = [core.AttentionMask(*m) if type(m) in (tuple, list) else m for m in masks]
    if type(fields.get("causal")) is int:
        fields["causal"] = core.Causal(fields["causal"])
    params = core.AttentionParams()
    params.masks = masks
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def invoke(core, call, args):
    fn = call.fn
    if fn.startswith("sdpa_"):  # the parameter slots, wherever mutations left them, as one AttentionParams
        names = [s.name for s in call.slots if not s.omit]
        i = names.index("masks") if "masks" in names else len(args)
        k = i + sum(1 for n in names[i:i + len(PARAM_SLOTS)] if n in PARAM_SLOTS)
        args = args[:i] + [sdpa_params(core, names[i:k], args[i:k])] + args[k:]
    if fn == "set_num_threads":
        old = core.get_num_threads()
        try:
            core.set_num_threads(*args)
            n = core.get_num_threads()
            if args and isinstance(args[0], int) and n != args[0]:
                call.observed.append(("wrong_result", f"get_num_threads() = {n} after set_num_threads({args[0]})"))
            x = np.ones((1 << 17) + 3, np.float32)  # a kernel large enough to run on the threads
            o = np.empty_like(x)
            core.dropout_forward(o, x, 0.25, 7)
            if not np.isfinite(o).all():
                call.observed.append(("nonfinite", "dropout_forward after set_num_threads"))
        finally:
            core.set_num_threads(old)
        return None
    if fn == "get_num_threads":
        n = core.get_num_threads(*args)
        if not (isinstance(n, int) and n >= 1):
            call.observed.append(("wrong_result", f"get_num_threads() = {n!r}"))
        return n
    if fn == "empty":
        res = core.empty(*args)
        if isinstance(res, np.ndarray) and res.size:
            if res.dtype.hasobject:
                _ = res.copy()  # what any use of the array does: reference its elements
            else:
                res.reshape(-1).view(np.uint8).fill(7) if res.dtype.itemsize and res.flags.c_contiguous else None
        if call.valid and (tuple(res.shape) != tuple(args[0]) or res.dtype != args[1]):
            call.observed.append(("wrong_result", f"empty: got {res.shape} {res.dtype}"))
        del res
        return None
    return getattr(core, fn)(*args)


def classify(exc):
    if exc is None:
        return "ok"
    for t in ALLOWED:
        if isinstance(exc, t):
            return t.__name__
    return "UNEXPECTED:" + type(exc).__name__


def execute(core, call):
    """Make the call; returns (outcome, findings, notes), each finding (kind, detail)."""
    call.observed = []
    arrs, seen = [], set()
    for s in call.slots:
        for a in walk_arrs(s.value):
            if id(a) not in seen:
                seen.add(id(a))
                arrs.append(a)
    snaps = [(a, a.base.copy()) for a in arrs if a.base is not None]
    # (a "listed" slot is one entry of a list argument: the optimizers take a list of parameters)
    args = [[materialize(s.value)] if s.spec.get("listed") else materialize(s.value) for s in call.slots
            if not s.omit]
    exc = result = None
    try:
        result = invoke(core, call, args)
    except Exception as e:
        exc = e
    outcome = classify(exc)
    call.message = "" if exc is None else f"{type(exc).__name__}: {exc}"
    findings, notes = [], []
    if outcome.startswith("UNEXPECTED"):
        findings.append(("unexpected_exception", f"{type(exc).__name__}: {str(exc)[:300]}"))
    for a, snap in snaps:
        changed = a.base != snap
        if not changed.any():
            continue
        if a.role == "in" and not call.aliased:
            findings.append(("input_modified", f"{a.describe()[:200]}: {int(changed.sum())} byte(s) changed"))
        elif a.role == "out":
            outside = changed & ~a.covered()
            if outside.any():
                findings.append(("write_outside_output", f"{a.describe()[:200]}: {int(outside.sum())} byte(s)"))
            if exc is not None and not isinstance(exc, MemoryError) and not call.aliased:
                findings.append(("output_modified_on_error", f"{type(exc).__name__}: {a.describe()[:200]}"))
    findings += call.observed
    if call.valid:
        if exc is not None:
            findings.append(("valid_call_raised", f"{type(exc).__name__}: {str(exc)[:300]}"))
        else:
            for kind, check in call.checks:
                try:
                    msg = check(result)
                except Exception as e:  # a bug of the fuzzer's own reference code
                    msg, kind = f"{type(e).__name__}: {e}", "fuzzer_error"
                if msg:
                    findings.append((kind, msg))
    if exc is None:
        unaligned = [a for a in arrs if a.base is not None and a.unaligned and a.view.size and a.view.ndim]
        if unaligned:
            notes.append(("accepted_unaligned", f"{call.fn}: an unaligned array was accepted"))
        for s in call.slots:  # an optional array given as a list etc. is converted by the binding to a temporary
            if s.kind == "optarr" and s.value is not None and not isinstance(s.value, (Arr, np.ndarray)):
                findings.append(("non_array_accepted",
                                 f"{s.name} = {type(s.value).__name__} accepted: the binding converts it to a "
                                 f"temporary array (freed before the kernel {'writes' if s.spec.get('role') == 'out' else 'reads'} it?)"))
    return outcome, findings, notes


# -------------------------------------------------------------------------------------------- child
def import_core():
    try:
        from attnpp import _core
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        from attnpp import _core
    return _core


def child_main(a):
    if a.mem_limit_gb > 0:
        lim = int(a.mem_limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    core = import_core()
    functions = a.functions.split(",")
    fd = os.open(a.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    warnings.simplefilter("ignore")
    np.seterr(all="ignore")

    def out(line):
        os.write(fd, (line + "\n").encode())

    for i in range(a.start, a.stop):
        try:
            call = generate(a.seed, i, functions, a.no_huge)
        except Exception as e:
            out(f"S {i} ?")
            out("F " + json.dumps([i, "?", "fuzzer_error", f"generate: {type(e).__name__}: {e}"]))
            out(f"R {i} ? fuzzer_error 0")
            continue
        out(f"S {i} {call.fn}")
        try:
            outcome, findings, notes = execute(core, call)
        except Exception as e:
            outcome, findings, notes = "fuzzer_error", [("fuzzer_error", traceback.format_exc()[-600:])], []
        for kind, detail in findings:
            out("F " + json.dumps([i, call.fn, kind, detail]))
        for kind, detail in notes:
            out("N " + json.dumps([i, call.fn, kind, detail]))
        msg = re.sub(r"\s+", " ", re.sub(r"-?\d+", "#", getattr(call, "message", "")))[:100]
        out(f"R {i} {call.fn} {outcome} {int(call.valid)} {msg}")
    os.close(fd)


# ------------------------------------------------------------------------------------------- parent
FAILING = {"crash", "hang", "unexpected_exception", "input_modified", "write_outside_output", "non_array_accepted",
           "output_modified_on_error", "valid_call_raised", "nonfinite", "wrong_result", "fuzzer_error",
           "exit_error"}


def detect_asan():
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        return True
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def group_key(kind, fn, detail):
    d = re.sub(r"0x[0-9a-f]+|\d+", "#", detail)
    return (kind, fn, d[:90])


def describe_call(seed, index, functions, no_huge):
    try:
        return generate(seed, index, functions, no_huge).describe()
    except Exception as e:
        return f"(could not regenerate call {index}: {type(e).__name__}: {e})"


def parent_main(a):
    functions = a.functions.split(",")
    unknown = [f for f in functions if f not in FUNCTIONS]
    if unknown:
        sys.exit(f"fuzz.py: unknown function(s) {unknown}; known: {sorted(FUNCTIONS)}")
    asan = detect_asan()
    no_huge = a.no_huge or (asan and "allocator_may_return_null=1" not in os.environ.get("ASAN_OPTIONS", ""))
    mem = a.mem_limit_gb if a.mem_limit_gb is not None else (0 if asan else 8)
    workdir = a.workdir or tempfile.mkdtemp(prefix="attnpp-fuzz.")
    os.makedirs(workdir, exist_ok=True)
    if mem:  # the parent regenerates calls to describe them: the same limit as the children
        lim = int(mem * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    t0 = time.time()
    per_fn = collections.defaultdict(collections.Counter)
    outcomes = collections.Counter()
    messages = collections.Counter()
    valid_calls = 0
    groups = collections.OrderedDict()
    done, nxt, children, crashes = 0, a.start, 0, 0
    last_report = t0
    stop = a.start + a.calls

    def add(kind, index, fn, detail, extra=None):
        key = group_key(kind, fn, detail)
        g = groups.get(key)
        if g is None:
            g = groups[key] = dict(kind=kind, function=fn, detail=detail, count=0, indices=[], first=index,
                                   failing=kind in FAILING)
            if extra:
                g.update(extra)
        g["count"] += 1
        if len(g["indices"]) < 8:
            g["indices"].append(index)

    print(f"fuzz.py: seed {a.seed}, calls [{a.start}, {stop}), functions: {len(functions)}, asan: {asan}, "
          f"no_huge: {no_huge}, memory limit: {mem or 'none'} GiB, logs in {workdir}", flush=True)
    while nxt < stop:
        log = os.path.join(workdir, f"child{children}.log")
        errp = os.path.join(workdir, f"child{children}.err")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--seed", str(a.seed), "--start", str(nxt),
               "--stop", str(stop), "--functions", ",".join(functions), "--log", log,
               "--mem-limit-gb", str(mem)] + (["--no-huge"] if no_huge else [])
        open(log, "w").close()
        with open(errp, "wb") as ef:
            proc = subprocess.Popen(cmd, stdout=ef, stderr=ef, env=os.environ.copy())
        children += 1
        pos, buf, started, finished = 0, b"", None, None
        last_progress = time.time()
        rc = None
        hung = False

        def consume():
            nonlocal pos, buf, started, finished, last_progress, done, valid_calls
            with open(log, "rb") as f:
                f.seek(pos)
                data = f.read()
            if not data:
                return
            pos += len(data)
            buf += data
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                tag, rest = line[:1], line[2:]
                if tag == "S":
                    started = (int(rest.split()[0]), rest.split()[1])
                elif tag == "R":
                    i, fn, outcome, valid, *msg = rest.split(" ", 4)
                    if msg and msg[0]:
                        messages[f"{fn} | {msg[0]}"] += 1
                    finished = int(i)
                    per_fn[fn][outcome] += 1
                    outcomes[outcome] += 1
                    valid_calls += int(valid)
                    done += 1
                elif tag in "FN":
                    i, fn, kind, detail = json.loads(rest)
                    add(kind, i, fn, detail)
            last_progress = time.time()

        while True:
            rc = proc.poll()
            consume()
            if rc is not None:
                break
            if time.time() - last_progress > a.timeout:
                hung = True
                proc.kill()
                proc.wait()
                rc = proc.returncode
                consume()
                break
            now = time.time()
            if a.progress and now - last_report >= a.progress:
                last_report = now
                nf = sum(g["count"] for g in groups.values() if g["failing"])
                print(f"fuzz.py: {done} calls, {now - t0:.0f} s, {done / (now - t0):.0f} calls/s, crashes {crashes}, "
                      f"findings {nf}", flush=True)
            time.sleep(0.05)
        with open(errp, "rb") as f:
            err_tail = f.read()[-3000:].decode(errors="replace")
        if started is not None and (finished is None or finished < started[0]):
            i, fn = started
            kind = "hang" if hung else "crash"
            crashes += kind == "crash"
            why = f"no progress for {a.timeout} s" if hung else \
                (f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
            add(kind, i, fn, why, dict(stderr_tail=err_tail[-1500:],
                                       description=describe_call(a.seed, i, functions, no_huge)))
            print(f"fuzz.py: {kind.upper()} at call {i} ({fn}): {why}", flush=True)
            outcomes[kind] += 1
            per_fn[fn][kind] += 1
            done += 1
            nxt = i + 1
        elif rc != 0 and started is None:  # the child died before its first call: nothing to skip
            add("exit_error", nxt, "-", f"child exited with {rc} before its first call",
                dict(stderr_tail=err_tail[-1500:]))
            print(f"fuzz.py: the child exited with {rc} before its first call:\n{err_tail[-1500:]}", flush=True)
            break
        elif rc != 0:
            i = finished if finished is not None else nxt
            add("exit_error", i, "-", f"child exited with {rc} after call {i}", dict(stderr_tail=err_tail[-1500:]))
            nxt = (finished + 1) if finished is not None else nxt + 1
        else:
            nxt = stop
            if not a.keep:
                for p in (log, errp):
                    os.remove(p)
    elapsed = time.time() - t0
    for g in groups.values():
        if g["failing"] and "description" not in g:
            g["description"] = describe_call(a.seed, g["first"], functions, no_huge)
    findings = [g for g in groups.values() if g["failing"]]
    notes = [g for g in groups.values() if not g["failing"]]
    summary = dict(seed=a.seed, start=a.start, calls=done, valid_calls=valid_calls, seconds=round(elapsed, 1),
                   children=children, crashes=crashes, outcomes=dict(outcomes),
                   per_function={k: dict(v) for k, v in sorted(per_fn.items())},
                   findings=findings, notes=notes, asan=asan, no_huge=no_huge, workdir=workdir,
                   messages=dict(sorted(messages.items())))
    print_summary(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if not a.keep and not findings:
        try:
            os.rmdir(workdir)
        except OSError:
            pass
    return 1 if findings else 0


def print_summary(s):
    print(f"\nfuzz.py: {s['calls']} calls ({s['valid_calls']} valid before mutation) in {s['seconds']} s, "
          f"{s['children']} child process(es), {s['crashes']} crash(es)")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items(), key=lambda kv: -kv[1])))
    cols = sorted({o for v in s["per_function"].values() for o in v})
    w = max(len(f) for f in s["per_function"]) if s["per_function"] else 8
    print(f"{'function':<{w}} " + " ".join(f"{c[:14]:>14}" for c in cols))
    for fn, v in s["per_function"].items():
        print(f"{fn:<{w}} " + " ".join(f"{v.get(c, 0):>14}" for c in cols))
    for title, items in (("FINDINGS", s["findings"]), ("notes", s["notes"])):
        if not items:
            continue
        print(f"\n{title} ({len(items)} distinct):")
        for g in items:
            print(f"- [{g['kind']}] {g['function']}: {g['detail'][:300]}  (x{g['count']}, calls {g['indices']})")
            if g.get("failing"):
                print(f"    repro: python tools/fuzz.py --seed {s['seed']} --repro {g['first']}")
                for line in g.get("description", "").splitlines():
                    print("    " + line[:400])
                if g.get("stderr_tail"):
                    print("    stderr: " + g["stderr_tail"].strip()[-600:].replace("\n", "\n    stderr: "))
    if not s["findings"]:
        print("\nno findings")


def repro_main(a):
    functions = a.functions.split(",")
    call = generate(a.seed, a.repro if a.repro is not None else a.describe, functions, a.no_huge)
    print(call.describe(), flush=True)
    if a.repro is None:
        return 0
    core = import_core()
    np.seterr(all="ignore")
    outcome, findings, notes = execute(core, call)
    print(f"outcome: {outcome}")
    for kind, detail in findings + notes:
        print(f"[{kind}] {detail}")
    return 1 if any(k in FAILING for k, _ in findings) else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10000, help="number of calls (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="index of the first call")
    ap.add_argument("--functions", default=",".join(sorted(FUNCTIONS)),
                    help="comma-separated subset of: " + ", ".join(sorted(FUNCTIONS)))
    ap.add_argument("--json", help="write the summary (counts, findings) to this file")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds without progress before a hang is declared")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="address-space limit of the child (default 8; none under AddressSanitizer)")
    ap.add_argument("--no-huge", action="store_true",
                    help="only huge sizes that overflow (default under ASan without allocator_may_return_null=1)")
    ap.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines (0: none)")
    ap.add_argument("--workdir", help="directory for the children's logs (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the children's logs")
    ap.add_argument("--describe", type=int, help="print the arguments of this call and exit")
    ap.add_argument("--repro", type=int, help="make this call in this process and report")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        if a.mem_limit_gb is None:
            a.mem_limit_gb = 0
        return child_main(a)
    if a.describe is not None or a.repro is not None:
        return repro_main(a)
    return parent_main(a)


if __name__ == "__main__":
    sys.exit(main())
