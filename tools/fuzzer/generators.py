"""Valid argument sets of each function of attnpp._core."""
import math
import warnings

import numpy as np

from .values import Derived, F32, F64, INF, MaskTuple, chance, layout_C, layout_strided, mk_in, mk_out, pads, pick, randn
from .calls import check_close, check_finite, keep_ref


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
