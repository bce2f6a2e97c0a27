"""The mutations of a valid call (shapes, dtypes, layouts, flags, values, masks, non-arrays), and
``generate``: a call from (seed, index) alone, valid then mutated."""
import math
import warnings

import numpy as np

from .values import Arr, BOOLS, CAUSALS, Derived, EXOTIC_DTYPES, F64, FLOAT_EDGES, FUNCTIONS, INF, INT_EDGES, MaskTuple, NAN, NON_ARRAYS, NOT_FLOATS, NOT_INTS, OTHER_DTYPES, PAD_IN_FLOAT, PAD_IN_INT, PAD_OUT, PROBS, SEEDS, chance, describe, layout_C, mk_in, pads, pick, rand_values
from . import api
from .calls import Call
from .generators import gen_cross_entropy, gen_dropout, gen_embedding, gen_empty, gen_linear, gen_optim, gen_rotary, gen_sdpa, mask_broadcast, mask_raw, span


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
        try:
            vals = rand_values(rng, tuple(shape), a.dtype)
        except ValueError:  # (several such dimensions)
            shape = [min(d, 2 ** 12) for d in shape]
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
            if vals.dtype.kind in "iu":  # (offsets given another dtype by an earlier mutation: its range)
                bad = int(np.clip(bad, np.iinfo(vals.dtype).min, np.iinfo(vals.dtype).max))
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
            vals.flat[0] = np.uint64(2 ** 64 - 1)  # (flat: offsets a mutation made 0-d too)
        if dtp == np.float64 and vals.size and chance(rng, 0.5):
            vals.flat[0] = pick(rng, [NAN, 1e300, 0.5, -INF])
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


def generate(seed, index, functions, no_huge=False):
    rng = np.random.default_rng([seed, index])
    names = sorted(functions)
    weights = FUNCTIONS if all(f in FUNCTIONS for f in names) else api.all_functions()
    w = np.array([weights[f] for f in names], np.float64)
    fn = names[int(rng.choice(len(names), p=w / w.sum()))]
    if fn not in FUNCTIONS:
        return api.generate_api(seed, index, fn)
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
