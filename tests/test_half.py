"""Half precision (NumPy's float16 and ml_dtypes' bfloat16) in every call of attnpp.functional: attnpp's error
against a float64 reference is at most 1.5 times PyTorch's own error in the same dtype on the same inputs.

Method, per case: inputs drawn in float64 with a fixed seed and rounded to the half dtype; these rounded arrays
are the inputs of three computations:

- attnpp in the half dtype (outputs and gradients in that dtype, the log-sum-exp and cross_entropy's statistics
  in float32);
- the reference: PyTorch in float64 on the same (rounded) inputs;
- PyTorch's own computation in the half dtype: its own function where it has one (``scaled_dot_product_attention``
  for masks, causal, GQA and scale, as a user calls it: its CPU flash kernel when D = Dv, its math backend
  otherwise, the log-sum-exp from the flash kernel; ``linear``, ``embedding``, ``cross_entropy``), else the math a
  PyTorch model writes, ``attnpp.testing.reference`` (windows, ALiBi, soft cap, sinks, dropout replayed from
  ``attnpp.functional.dropout_mask``) or ``rotary_reference``, evaluated in the half dtype (its log-sum-exp
  ``torch.logsumexp`` of the half scores).

Gradients come from ``(out * grad_out).sum().backward()`` with one random grad_out rounded to the dtype, attnpp's
from the matching ``_backward`` call. The error of an array is ``max_rel_err`` (max |x - ref| / max(1, max |ref|),
docs/design.md); each must satisfy ``err_attnpp <= 1.5 * err_torch`` (so attnpp is exact where PyTorch is).
bfloat16 attention under ``attnpp.set_bfloat16_attention``'s default takes the numerics of the PyTorch kernel
of the same call (test_numerics_follow_pytorch_kernel); its other two settings are held to PyTorch's flash
kernel (on every width: test_sdpa_flash_numerics) and to PyTorch's own error (test_sdpa_float32_numerics).
attnpp's results hold no NaN
or inf where the float64 reference holds none, and its -inf (log-sum-exp of rows that see no key) stand where
the reference's do. Mixed dtypes and masks of another dtype are refused with a TypeError naming the argument and
both dtypes.
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import attnpp
import attnpp.functional as AF
from attnpp.testing import ReplayDropout, rotary_reference, to_tensor, variant_scores
from helpers import LARGEST, max_rel_err, reference

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALVES = [F16, BF16]
TORCH_HALF = {F16: torch.float16, BF16: torch.bfloat16}
FACTOR = 1.5  # attnpp's error may be at most this many times PyTorch's
SEED = 20240917

# The largest err_attnpp / err_torch seen per (function, dtype name, array name) where PyTorch's error is not 0, as
# (ratio, err_attnpp, err_torch), for whoever runs this module and wants the figures; nothing prints them.
RATIOS = {}

half_dtypes = pytest.mark.parametrize("dt", HALVES, ids=lambda d: d.name)


# ------------------------------------------------------------------------------------------------- utilities
def tensor(x, tdt, grad=False):
    """A torch tensor copy of the array ``x``: bool and integers as they are, floats (bfloat16 included) in the
    torch dtype ``tdt`` (exact for values of that dtype), a leaf requiring grad if ``grad``."""
    x = np.asarray(x)
    if x.dtype == np.bool_ or x.dtype.kind in "iu":
        return to_tensor(x)
    return to_tensor(x.astype(np.float64), grad, tdt)


def numpy(t):
    """A tensor as a float64 array."""
    return t.detach().to(torch.float64).numpy()


def check(function, dt, ours, ref, theirs):
    """For each name of ``ref`` (float64 arrays): attnpp's array ``ours[name]`` is finite where the reference is,
    equal to it where it is not, and within FACTOR times PyTorch's error of it (errors: max_rel_err
    over the reference's finite entries). One assertion listing every array that fails, with both errors."""
    failures = []
    for name, r in ref.items():
        o, t = np.asarray(ours[name], dtype=np.float64), np.asarray(theirs[name], dtype=np.float64)
        r = np.asarray(r, dtype=np.float64)
        finite = np.isfinite(r)
        if not np.isfinite(o[finite]).all():
            failures.append(f"{name}: NaN or inf where the float64 reference is finite")
            continue
        if not np.array_equal(o[~finite], r[~finite], equal_nan=True):
            failures.append(f"{name}: non-finite entries differ from the reference's")
            continue
        err, err_torch = max_rel_err(o[finite], r[finite]), max_rel_err(t[finite], r[finite])
        bound = FACTOR * err_torch
        key = (function, dt.name, name)
        if err_torch > 0 and err / err_torch > RATIOS.get(key, (0.0,))[0]:
            RATIOS[key] = (err / err_torch, err, err_torch)
        LARGEST[dt.name] = max(LARGEST.get(dt.name, 0.0), err)
        if not err <= bound:
            failures.append(f"{name}: attnpp error {err:.3g} > bound {bound:.3g} (PyTorch's error in "
                            f"{dt.name}: {err_torch:.3g})")
    assert not failures, f"{function} in {dt.name}: " + "; ".join(failures)


def assert_dtypes(arrays, dt):
    """Every array of the dict ``arrays`` is of ``dt``, those named logsumexp or stats of float32."""
    for name, a in arrays.items():
        want = np.float32 if name in ("logsumexp", "stats") else dt
        assert a.dtype == want, f"{name}: dtype {a.dtype}, expected {np.dtype(want)}"


# ---------------------------------------------------------------------------------------- attention in PyTorch
VARIANTS = ("window", "alibi_slopes", "softcap", "sinks")


def reference_kw(kw, tdt):
    """The keyword arguments of ``reference`` for attnpp's ``kw`` (float masks in the torch dtype ``tdt``)."""
    ref = {n: kw[n] for n in ("is_causal", "causal_alignment", "window", "softcap", "scale", "dropout_p") if n in kw}
    if "attn_mask" in kw:
        ref["attn_mask"] = tensor(kw["attn_mask"], tdt)
    if "alibi_slopes" in kw:  # (reference casts them to the scores' dtype, as a model in that dtype would)
        ref["alibi_slopes"] = tensor(kw["alibi_slopes"], torch.float64)
    return ref


def torch_attention(tq, tk, tv, kw, ts=None, keep=None):
    """PyTorch's (output (B, Hq, L, Dv), log-sum-exp (B, Hq, L)) of attnpp's call ``kw`` on tensors q (B, Hq, L,
    D), k, v (B, Hk, S, .) and sinks ``ts``, in their dtype. Without dropout and variants: as a user calls
    torch.nn.functional.scaled_dot_product_attention (a bottom-right causal mask as the boolean mask it is,
    PyTorch's causal_lower_right), the log-sum-exp from its CPU flash kernel in a half dtype, from the definitions
    in float64 (which give -inf for rows that see no key). Else the math from the definitions (``reference``) in
    that dtype, with dropout's keep-mask ``keep`` (B, Hq, L, S)."""
    if keep is not None or any(n in kw for n in VARIANTS):
        return reference(tq, tk, tv, sinks=ts, keep=keep, **reference_kw(kw, tq.dtype))
    L, S = tq.shape[-2], tk.shape[-2]
    mask = None if "attn_mask" not in kw else tensor(kw["attn_mask"], tq.dtype)
    causal = kw.get("is_causal", False)
    if causal and kw.get("causal_alignment") == "bottom_right":
        mask, causal = torch.ones(L, S, dtype=torch.bool).tril(S - L), False
    group = tq.shape[1] // tk.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, is_causal=causal,
                                                           scale=kw.get("scale"), enable_gqa=group > 1)
    with torch.no_grad():
        if tq.dtype == torch.float64:
            return out, reference(tq, tk, tv, **reference_kw(kw, tq.dtype))[1]
        # the flash kernel's log-sum-exp (float32), with a float mask, the heads repeated and key as value (the
        # kernel wants Dv = D; the log-sum-exp does not depend on the values)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=tq.dtype).masked_fill(~mask, float("-inf"))
        k = tk.detach().repeat_interleave(group, 1)
        _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(tq.detach(), k, k, 0.0, causal,
                                                                            attn_mask=mask, scale=kw.get("scale"))
    return out, lse


def attention_results(q, k, v, g, kw, tdt, keep=None):
    """PyTorch's output, log-sum-exp and gradients (query, key, value, sinks if any) in the torch dtype ``tdt`` on
    the arrays q, k, v and grad_out ``g``, as float64 arrays named as attnpp's."""
    tq, tk, tv = (tensor(x, tdt, True) for x in (q, k, v))
    ts = tensor(kw["sinks"], tdt, True) if "sinks" in kw else None
    out, lse = torch_attention(tq, tk, tv, kw, ts, None if keep is None else torch.tensor(keep))
    (out * tensor(g, tdt)).sum().backward()
    res = {"output": numpy(out), "logsumexp": numpy(lse)}
    for name, t in (("grad_query", tq), ("grad_key", tk), ("grad_value", tv), ("grad_sinks", ts)):
        if t is not None:
            res[name] = numpy(t.grad) if t.grad is not None else np.zeros(t.shape)
    return res


# --------------------------------------------------------------------------------------------- the SDPA cases
def plain(L, S, B=2, Hq=2, Hk=2, D=16, Dv=8):
    return ((B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, Dv))


# name -> shapes (q, k, v), attnpp's keyword arguments (the arrays named by kind, drawn by materialize) and the
# inputs' standard deviation (amp). PyTorch's scaled_dot_product_attention takes its CPU flash kernel for half
# inputs when D = Dv, its math backend (float32 inside) otherwise: the cases "..._D=Dv" compare attnpp with the
# former, the others with the latter.
CASES = {
    "plain": dict(shapes=plain(130, 300, B=1, Dv=24)),
    "plain_D=Dv": dict(shapes=plain(130, 300, B=1, Dv=16)),
    "unbatched": dict(shapes=((9, 16), (13, 16), (13, 5))),
    # the backward's last key block of one key at D = 1: its transposed keys are one element, as wide as their
    # converted rows (a packed copy taken in place there read the conversion buffer after the values refilled it:
    # found by tools/fuzz.py)
    "one_key_block_D=1": dict(shapes=plain(3, 257, B=1, Hq=1, Hk=1, D=1, Dv=3)),
    "scale": dict(shapes=plain(9, 13), kw=dict(scale=0.77)),
    "causal_top_left_L<S": dict(shapes=plain(70, 150), kw=dict(is_causal=True)),
    "causal_top_left_L>S": dict(shapes=plain(150, 70), kw=dict(is_causal=True)),
    "causal_bottom_right_L<S": dict(shapes=plain(70, 150), kw=dict(is_causal=True, causal_alignment="bottom_right")),
    "causal_bottom_right_L>S": dict(shapes=plain(150, 70), kw=dict(is_causal=True, causal_alignment="bottom_right")),
    "bool_mask": dict(shapes=plain(20, 140), kw=dict(attn_mask="bool")),
    "float_mask": dict(shapes=plain(20, 140), kw=dict(attn_mask="float")),
    "fully_masked_rows": dict(shapes=plain(9, 140), kw=dict(attn_mask="bool_empty_rows")),
    "fully_masked_rows_float": dict(shapes=plain(9, 140), kw=dict(attn_mask="float_empty_rows")),
    "gqa": dict(shapes=plain(9, 12, Hq=4, Hk=2, D=8, Dv=6), kw=dict(enable_gqa=True)),
    "gqa_causal": dict(shapes=plain(40, 60, Hq=6, Hk=1, D=8, Dv=6), kw=dict(enable_gqa=True, is_causal=True)),
    "dropout": dict(shapes=plain(70, 150, Hq=3, Hk=3, D=8, Dv=5), kw=dict(dropout_p=0.3, seed=42)),
    "dropout_causal": dict(shapes=plain(70, 150, Hq=3, Hk=3, D=8, Dv=5), kw=dict(dropout_p=0.3, seed=43,
                                                                                  is_causal=True)),
    "window": dict(shapes=plain(70, 150), kw=dict(window=(20, 5))),
    "window_causal": dict(shapes=plain(150, 150), kw=dict(window=(33, 0), is_causal=True)),
    "alibi": dict(shapes=plain(40, 60, Hq=4, Hk=4), kw=dict(alibi_slopes="paper")),
    "alibi_per_batch_float64": dict(shapes=plain(40, 60, Hq=4, Hk=4), kw=dict(alibi_slopes="batch")),
    "alibi_half_slopes": dict(shapes=plain(40, 60, Hq=4, Hk=4), kw=dict(alibi_slopes="half")),
    "softcap": dict(shapes=plain(40, 60), kw=dict(softcap=5.0)),
    "softcap50_scores70": dict(shapes=plain(40, 60), kw=dict(softcap=50.0), amp=4.2, max_score=(55, 90)),
    "sinks": dict(shapes=plain(40, 60, Hq=4, Hk=2), kw=dict(sinks=True, enable_gqa=True)),
    "all_variants": dict(shapes=plain(70, 150, Hq=4, Hk=2), kw=dict(
        is_causal=True, causal_alignment="bottom_right", window=(40, 3), alibi_slopes="paper", softcap=8.0,
        sinks=True, enable_gqa=True, dropout_p=0.2, seed=7)),
    "large_scores": dict(shapes=plain(70, 150), amp=4.5, max_score=(80, 130)),
    "large_scores_causal": dict(shapes=plain(70, 150), kw=dict(is_causal=True), amp=4.5, max_score=(80, 130)),
    "large_scores_mask": dict(shapes=plain(20, 140), kw=dict(attn_mask="float"), amp=4.5, max_score=(80, 130)),
    "scale_D=Dv": dict(shapes=plain(9, 13, Dv=16), kw=dict(scale=0.77)),
    "causal_D=Dv": dict(shapes=plain(70, 150, Dv=16), kw=dict(is_causal=True)),
    "float_mask_D=Dv": dict(shapes=plain(20, 140, Dv=16), kw=dict(attn_mask="float")),
    "gqa_D=Dv": dict(shapes=plain(9, 12, Hq=4, Hk=2, D=8, Dv=8), kw=dict(enable_gqa=True)),
    "large_scores_D=Dv": dict(shapes=plain(70, 150, Dv=16), amp=4.5, max_score=(80, 130)),
    "large_scores_causal_D=Dv": dict(shapes=plain(70, 150, Dv=16), kw=dict(is_causal=True), amp=4.5,
                                     max_score=(80, 130)),
}

def case_params(names):
    """pytest.param(dt, name) for every half dtype and case name."""
    return [pytest.param(dt, name, id=f"{name}-{dt.name}") for name in names for dt in HALVES]


def materialize(dt, name):
    """The case's inputs rounded to ``dt`` (q, k, v), attnpp's keyword arguments (arrays drawn, rounded to ``dt``
    where the contract wants the query's dtype), the dropout keep-mask (B, Hq, L, S) or None, and the generator
    (to draw grad_out with)."""
    case = CASES[name]
    rng = np.random.default_rng(SEED)
    amp = case.get("amp", 1.0)
    q, k, v = ((rng.standard_normal(s) * amp).astype(dt) for s in case["shapes"])
    kw = dict(case.get("kw", {}))
    Hq, L, D = q.shape[-3] if q.ndim > 2 else 1, q.shape[-2], q.shape[-1]
    B, S = q.shape[0] if q.ndim == 4 else 1, k.shape[-2]
    if "max_score" in case:  # the case's purpose: scores of that magnitude
        scores = np.abs(q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)).max() / np.sqrt(D)
        lo, hi = case["max_score"]
        assert lo <= scores <= hi, f"{name}: largest |score| {scores:.3g} outside [{lo}, {hi}]"
    mask = kw.get("attn_mask")
    if mask in ("bool", "bool_empty_rows"):
        kw["attn_mask"] = rng.random((B, 1, L, S)) < 0.75
        kw["attn_mask"][..., 0] = True
        if mask == "bool_empty_rows":
            kw["attn_mask"][0, :, 3] = False
            kw["attn_mask"][1, :, 0] = False
    elif mask in ("float", "float_empty_rows"):
        m = rng.standard_normal((L, S)) * 2
        m[rng.random((L, S)) < 0.2] = -np.inf
        m[:, 0] = 0.0
        if mask == "float_empty_rows":
            m[[0, 4]] = -np.inf
        kw["attn_mask"] = m.astype(dt)
    slopes = kw.get("alibi_slopes")
    if slopes == "paper":
        kw["alibi_slopes"] = AF.get_alibi_slopes(Hq)  # float32
    elif slopes == "batch":
        kw["alibi_slopes"] = rng.uniform(0, 1, (B, Hq))
    elif slopes == "half":
        kw["alibi_slopes"] = (AF.get_alibi_slopes(Hq, np.float64) * 3).astype(dt)
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq).astype(dt)
    keep = AF.dropout_mask((B, Hq, L, S), kw["dropout_p"], kw["seed"]) if kw.get("dropout_p") else None
    return q, k, v, kw, keep, rng


def batched(*arrays):
    """Unbatched (L, D) arrays as (1, 1, L, D) (the references want 4-D); 4-D ones as they are."""
    return [a if a is None or a.ndim == 4 else a.reshape((1,) * (4 - a.ndim) + a.shape) for a in arrays]


def check_sdpa(dt, name, function="scaled_dot_product_attention"):
    """Output, log-sum-exp and gradients of scaled_dot_product_attention_forward/_backward on case ``name`` in
    ``dt`` within the bound of PyTorch's errors."""
    q, k, v, kw, keep, rng = materialize(dt, name)
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    g = rng.standard_normal(out.shape).astype(dt)
    grads = AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, **kw)
    names = ["grad_query", "grad_key", "grad_value"] + (["grad_sinks"] if "sinks" in kw else [])
    assert len(grads) == len(names)
    ours = {"output": out, "logsumexp": lse, **dict(zip(names, grads))}
    assert_dtypes(ours, dt)
    np.testing.assert_array_equal(AF.scaled_dot_product_attention(q, k, v, **kw), out)
    bq, bk, bv, bo, bg = batched(q, k, v, out, g)
    ours.update(output=bo, logsumexp=lse.reshape(bo.shape[:-1]),
                **{n: a for n, a in zip(names, batched(*grads[:3])) if n != "grad_sinks"})
    ref = attention_results(bq, bk, bv, bg, kw, torch.float64, keep)
    theirs = attention_results(bq, bk, bv, bg, kw, TORCH_HALF[dt], keep)
    check(function, dt, ours, ref, theirs)
    # rows that see no key: output 0, gradient 0 (and the -inf log-sum-exp, checked above)
    empty = np.isneginf(ref["logsumexp"])
    assert (ours["output"][empty] == 0).all() and (ours["grad_query"][empty] == 0).all()
    if name.startswith("fully_masked") or name == "causal_bottom_right_L>S":
        assert empty.any()


@pytest.mark.parametrize("dt,name", case_params(CASES))
def test_sdpa(dt, name):
    """scaled_dot_product_attention_forward/_backward within the bound (bfloat16: the default numerics)."""
    check_sdpa(dt, name)


@pytest.fixture
def bfloat16_numerics():
    """A function setting attnpp.set_bfloat16_attention for the test; the setting as it was afterwards."""
    before = attnpp.get_bfloat16_attention()
    yield attnpp.set_bfloat16_attention
    attnpp.set_bfloat16_attention(before)


def sdpa_results(q, k, v, g, kw):
    """attnpp's output, log-sum-exp and gradients (query, key, value) as a dict."""
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    grads = AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, **kw)
    return dict(output=out, logsumexp=lse, **dict(zip(["grad_query", "grad_key", "grad_value"], grads)))


@pytest.mark.parametrize("name", [n for n in CASES if "sinks" not in CASES[n].get("kw", {})])
def test_numerics_follow_pytorch_kernel(name, bfloat16_numerics):
    """The default bfloat16 numerics are those of the PyTorch kernel of the same call: flash (bitwise as under
    "flash") when D = Dv and there is no dropout, else float32 (bitwise as under "float32"); and the two
    settings differ on the case."""
    q, k, v, kw, _, rng = materialize(BF16, name)
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(BF16)
    results = {}
    for numerics in ("pytorch", "flash", "float32"):
        bfloat16_numerics(numerics)
        results[numerics] = sdpa_results(q, k, v, g, kw)
    flash = q.shape[-1] == v.shape[-1] and not kw.get("dropout_p")
    same = results["flash" if flash else "float32"]
    for n, a in results["pytorch"].items():
        np.testing.assert_array_equal(a, same[n], err_msg=n)
    assert any(not np.array_equal(a, results["float32"][n]) for n, a in results["flash"].items())


def padded(x, width):
    """``x`` (..., d) with zero columns up to ``width``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


# PyTorch's flash kernel computes these cases (as they are, or with their widths padded: padded_flash)
FLASH_CASES = [n for n in CASES if not {"dropout_p", *VARIANTS} & set(CASES[n].get("kw", {}))]


def padded_flash(q, k, v, g, kw):
    """PyTorch's CPU flash kernel's output, log-sum-exp and gradients (float64 arrays) on bfloat16 arrays q (B, Hq,
    L, D), k, v and g: with q, k and v padded by zero columns to one width (which changes no score and adds zero
    output columns) when D != Dv, its flash kernel forced, the padding cut off."""
    tq, tk, tv = (tensor(x, torch.bfloat16, True) for x in (q, k, v))
    width = max(q.shape[-1], v.shape[-1])
    mask = None if "attn_mask" not in kw else tensor(kw["attn_mask"], torch.bfloat16)
    L, S, causal = q.shape[-2], k.shape[-2], kw.get("is_causal", False)
    if causal and kw.get("causal_alignment") == "bottom_right":
        mask, causal = torch.ones(L, S, dtype=torch.bool).tril(S - L), False
    scale = kw.get("scale", 1 / np.sqrt(q.shape[-1]))
    pq, pk, pv = (padded(t, width) for t in (tq, tk, tv))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask, is_causal=causal,
                                                               scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out = out[..., : v.shape[-1]]
    (out * tensor(g, torch.bfloat16)).sum().backward()
    return {"output": numpy(out), "grad_query": numpy(tq.grad), "grad_key": numpy(tk.grad),
            "grad_value": numpy(tv.grad)}


@pytest.mark.parametrize("name", FLASH_CASES)
def test_sdpa_flash_numerics(name, bfloat16_numerics):
    """Under set_bfloat16_attention("flash"), bfloat16 attention has the numerics of PyTorch's CPU flash kernel on
    every call: within the bound of that kernel's errors, the D != Dv cases included (PyTorch's flash kernel run
    on their widths padded)."""
    bfloat16_numerics("flash")
    q, k, v, kw, keep, rng = materialize(BF16, name)
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(BF16)
    bq, bk, bv, bg = batched(q, k, v, g)
    ours = sdpa_results(q, k, v, g, kw)
    ours = {n: batched(a)[0] for n, a in ours.items() if n != "logsumexp"}
    ref = attention_results(bq, bk, bv, bg, kw, torch.float64, keep)
    check("scaled_dot_product_attention (flash numerics)", BF16, ours, {n: ref[n] for n in ours},
          padded_flash(bq, bk, bv, bg, kw))


@pytest.mark.parametrize("name", list(CASES))
def test_sdpa_float32_numerics(name, bfloat16_numerics):
    """Under set_bfloat16_attention("float32"), bfloat16 attention is within 1.5 times PyTorch's own error on every
    call, whichever kernel PyTorch runs (its flash kernel's errors are the larger where it runs)."""
    bfloat16_numerics("float32")
    check_sdpa(BF16, name, "scaled_dot_product_attention (float32 numerics)")


WEIGHT_CASES = ["plain", "causal_bottom_right_L>S", "fully_masked_rows", "float_mask", "gqa", "dropout",
                "all_variants", "softcap50_scores70", "large_scores"]


def torch_weights(q, k, kw, tdt, keep):
    """The weights (B, Hq, L, S) as a PyTorch model computes them in the torch dtype ``tdt``: the scores with the
    variants (``variant_scores``), the sinks as an extra logit, a softmax whose fully masked rows give 0
    (``_safe_softmax``, as PyTorch's scaled_dot_product_attention), dropout replayed (``ReplayDropout``)."""
    tq, tk = tensor(q, tdt), tensor(k, tdt)
    tk = tk.repeat_interleave(tq.shape[1] // tk.shape[1], 1)
    scale = kw.get("scale", 1 / q.shape[-1] ** 0.5)
    ref = reference_kw(kw, tdt)
    s = variant_scores(scale * tq @ tk.transpose(-1, -2),
                       **{n: ref[n] for n in ("attn_mask", "is_causal", "causal_alignment", "window",
                                              "alibi_slopes", "softcap") if n in ref})
    S = s.shape[-1]
    if "sinks" in kw:
        s = torch.cat([s, tensor(kw["sinks"], tdt)[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    w = torch.ops.aten._safe_softmax(s, -1)[..., :S]
    if keep is not None:
        w = ReplayDropout(keep, kw["dropout_p"])(w)
    return numpy(w)


@half_dtypes
@pytest.mark.parametrize("name", WEIGHT_CASES)
@pytest.mark.parametrize("given_lse", [False, True], ids=["own_logsumexp", "given_logsumexp"])
def test_weights(dt, name, given_lse):
    """scaled_dot_product_attention_weights (after dropout, sinks' share left out) within the bound."""
    q, k, v, kw, keep, _ = materialize(dt, name)
    extra = {}
    if given_lse:
        extra["logsumexp"] = AF.scaled_dot_product_attention_forward(q, k, v, **kw).logsumexp
    w = AF.scaled_dot_product_attention_weights(q, k, **kw, **extra)
    assert w.dtype == dt
    ref = torch_weights(q, k, kw, torch.float64, keep)
    theirs = torch_weights(q, k, kw, TORCH_HALF[dt], keep)
    check("scaled_dot_product_attention_weights", dt, {"weights": w}, {"weights": ref}, {"weights": theirs})
    if keep is not None:
        assert (w[~keep] == 0).all()


# ---------------------------------------------------------------------------------------------- packed sequences
VARLEN_CASES = {
    "causal_bottom_right_gqa": dict(is_causal=True, causal_alignment="bottom_right"),
    "plain": {},
    "variants": dict(is_causal=True, window=(30, 2), alibi_slopes="paper", softcap=6.0, sinks=True),
    "dropout": dict(dropout_p=0.25, seed=5),
}


@pytest.mark.parametrize("dt,name", case_params(VARLEN_CASES))
def test_varlen(dt, name):
    """scaled_dot_product_attention_varlen_forward/_backward against each sequence's references."""
    rng = np.random.default_rng(SEED)
    Hq, Hk, D, Dv = 4, 2, 16, 8
    lq, lk = [5, 0, 70, 9, 140], [7, 3, 150, 4, 140]
    cu_q, cu_k = np.r_[0, np.cumsum(lq)], np.r_[0, np.cumsum(lk)]
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(dt)
    k = rng.standard_normal((cu_k[-1], Hk, D)).astype(dt)
    v = rng.standard_normal((cu_k[-1], Hk, Dv)).astype(dt)
    kw = dict(VARLEN_CASES[name])
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = AF.get_alibi_slopes(Hq)
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq).astype(dt)
    out, lse, _ = AF.scaled_dot_product_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    g = rng.standard_normal(out.shape).astype(dt)
    grads = AF.scaled_dot_product_attention_varlen_backward(g, q, k, v, out, lse, cu_q, cu_k, **kw)
    names = ["grad_query", "grad_key", "grad_value"] + (["grad_sinks"] if "sinks" in kw else [])
    ours = {"output": out, "logsumexp": lse, **dict(zip(names, grads))}
    assert_dtypes(ours, dt)
    np.testing.assert_array_equal(AF.scaled_dot_product_attention_varlen(q, k, v, cu_q, cu_k, **kw), out)
    keep = None
    if kw.get("dropout_p"):
        keep = AF.dropout_mask((len(lq), Hq, max(lq), max(lk)), kw["dropout_p"], kw["seed"])

    def per_sequence(tdt):
        """PyTorch in ``tdt`` sequence by sequence on slices of the packed leaves; one backward."""
        tq, tk, tv = (tensor(x, tdt, True) for x in (q, k, v))
        ts = tensor(kw["sinks"], tdt, True) if "sinks" in kw else None
        outs, lses = [], []
        for b in range(len(lq)):
            qs, ks, vs = (t[c[b]:c[b + 1]].transpose(0, 1)[None] for t, c in ((tq, cu_q), (tk, cu_k), (tv, cu_k)))
            kb = None if keep is None else torch.tensor(keep[b:b + 1, :, :lq[b], :lk[b]])
            if lq[b] == 0:
                continue
            o, l_ = torch_attention(qs, ks, vs, kw, ts, kb)
            outs.append(o[0].transpose(0, 1))
            lses.append(l_[0])
        o, l_ = torch.cat(outs), torch.cat(lses, dim=1)
        (o * tensor(g, tdt)).sum().backward()
        res = {"output": numpy(o), "logsumexp": numpy(l_)}
        for n, t in zip(names, (tq, tk, tv, ts)):
            res[n] = numpy(t.grad)
        return res

    check("scaled_dot_product_attention_varlen", dt, ours, per_sequence(torch.float64),
          per_sequence(TORCH_HALF[dt]))


# ---------------------------------------------------------------------------------------------------- KV cache
KVCACHE_CASES = {"causal": {}, "not_causal": dict(is_causal=False), "window": dict(window=(4, 0)),
                 "variants": dict(softcap=2.0, sinks=True, alibi_slopes=True)}


@half_dtypes
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("name", list(KVCACHE_CASES))
def test_kvcache(dt, new, name):
    """with_kvcache on half caches: new keys written exactly, each sequence's output within the bound."""
    rng = np.random.default_rng(SEED)
    B, Hq, Hk, D, Dv, S_max = 3, 4, 2, 16, 8, 40
    lengths = np.array([0, 5, 37 - new])
    q = rng.standard_normal((B, Hq, new, D)).astype(dt)
    kc = rng.standard_normal((B, Hk, S_max, D)).astype(dt)
    vc = rng.standard_normal((B, Hk, S_max, Dv)).astype(dt)
    k_new = rng.standard_normal((B, Hk, new, D)).astype(dt)
    v_new = rng.standard_normal((B, Hk, new, Dv)).astype(dt)
    kw = dict(KVCACHE_CASES[name])
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq).astype(dt)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = AF.get_alibi_slopes(Hq)
    out = AF.scaled_dot_product_attention_with_kvcache(q, kc, vc, lengths, k_new, v_new, **kw)
    assert out.dtype == dt and kc.dtype == dt
    ref_kw = dict(kw, is_causal=kw.get("is_causal", True), causal_alignment="bottom_right")
    for b, s in enumerate(lengths):
        np.testing.assert_array_equal(kc[b, :, s:s + new], k_new[b])
        np.testing.assert_array_equal(vc[b, :, s:s + new], v_new[b])
        S = s + new
        res = []
        for tdt in (torch.float64, TORCH_HALF[dt]):
            tq, tk, tv = (tensor(x, tdt) for x in (q[b:b + 1], kc[b:b + 1, :, :S], vc[b:b + 1, :, :S]))
            ts = tensor(kw["sinks"], tdt) if "sinks" in kw else None
            with torch.no_grad():
                res.append({"output": numpy(torch_attention(tq, tk, tv, ref_kw, ts)[0])})
        check("scaled_dot_product_attention_with_kvcache", dt, {"output": out[b:b + 1]}, *res)


# ---------------------------------------------------------------------------------------------------- rotary
@half_dtypes
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("offset", [5, "per_sequence"])
def test_rotary(dt, interleaved, offset):
    """rotary_embedding/_backward with tables of the dtype against rotary_reference in float64 and in the dtype."""
    rng = np.random.default_rng(SEED)
    B, H, L, D, R, P = 2, 3, 40, 16, 12, 64
    x = (rng.standard_normal((B, H, L, D)) * 3).astype(dt)
    g = rng.standard_normal(x.shape).astype(dt)
    cos, sin = AF.rotary_tables(P, R, dtype=dt)
    assert cos.dtype == dt and sin.dtype == dt
    offsets = np.array([0, 17]) if offset == "per_sequence" else np.full(B, offset)
    position_offset = offsets if offset == "per_sequence" else offset
    out = AF.rotary_embedding(x, cos, sin, interleaved=interleaved, position_offset=position_offset)
    grad = AF.rotary_embedding_backward(g, cos, sin, interleaved=interleaved, position_offset=position_offset)
    ours = {"output": out, "grad_input": grad}
    assert_dtypes(ours, dt)
    res = []
    for tdt in (torch.float64, TORCH_HALF[dt]):
        tx = tensor(x, tdt, True)
        o = torch.cat([rotary_reference(tx[b:b + 1], np.arange(L) + offsets[b], R, interleaved=interleaved)
                       for b in range(B)])
        (o * tensor(g, tdt)).sum().backward()
        res.append({"output": numpy(o), "grad_input": numpy(tx.grad)})
    check("rotary_embedding", dt, ours, *res)


# ------------------------------------------------------------------------------------------ linear, embedding
@half_dtypes
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear(dt, bias):
    """linear/linear_backward (grad_weight and grad_bias accumulated into half buffers) against PyTorch's."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((3, 5, 256)).astype(dt)
    w = (rng.standard_normal((24, 256)) / 8).astype(dt)
    b = rng.standard_normal(24).astype(dt) if bias else None
    out = AF.linear(x, w, b)
    g = rng.standard_normal(out.shape).astype(dt)
    gw0, gb0 = rng.standard_normal(w.shape).astype(dt), rng.standard_normal(24).astype(dt)
    gw, gb = gw0.copy(), gb0.copy() if bias else None
    gx = AF.linear_backward(g, x, w, gw, gb)
    ours = {"output": out, "grad_input": gx, "grad_weight": gw}
    if bias:
        ours["grad_bias"] = gb
    assert_dtypes(ours, dt)
    res = []
    for tdt in (torch.float64, TORCH_HALF[dt]):
        tx, tw = tensor(x, tdt, True), tensor(w, tdt, True)
        tb = tensor(b, tdt, True) if bias else None
        tw.grad = tensor(gw0, tdt)  # autograd accumulates into the existing gradients, in their dtype
        if bias:
            tb.grad = tensor(gb0, tdt)
        o = torch.nn.functional.linear(tx, tw, tb)
        (o * tensor(g, tdt)).sum().backward()
        res.append({"output": numpy(o), "grad_input": numpy(tx.grad), "grad_weight": numpy(tw.grad)})
        if bias:
            res[-1]["grad_bias"] = numpy(tb.grad)
    check("linear", dt, ours, *res)


@half_dtypes
def test_embedding(dt):
    """embedding (exact rows) and embedding_backward (repeated indices summed into a half grad_weight)."""
    rng = np.random.default_rng(SEED)
    V, E = 12, 16
    weight = rng.standard_normal((V, E)).astype(dt)
    idx = rng.integers(0, V, (8, 25))
    out = AF.embedding(idx, weight)
    assert out.dtype == dt
    np.testing.assert_array_equal(out, weight[idx])
    g = rng.standard_normal(out.shape).astype(dt)
    gw0 = rng.standard_normal((V, E)).astype(dt)
    gw = gw0.copy()
    AF.embedding_backward(g, idx, gw)
    assert gw.dtype == dt
    res = []
    for tdt in (torch.float64, TORCH_HALF[dt]):
        tw = tensor(weight, tdt, True)
        tw.grad = tensor(gw0, tdt)
        o = torch.nn.functional.embedding(torch.tensor(idx), tw)
        (o * tensor(g, tdt)).sum().backward()
        res.append({"output": numpy(o), "grad_weight": numpy(tw.grad)})
    check("embedding", dt, {"output": out, "grad_weight": gw}, *res)


# ------------------------------------------------------------------------------------------------------ dropout
@half_dtypes
def test_dropout(dt):
    """dropout/dropout_backward: exactly dropout_mask's zeros, the kept elements scaled within the bound."""
    rng = np.random.default_rng(SEED)
    p, seed = 0.3, 11
    x = (rng.standard_normal((6, 70)) * 4).astype(dt)
    x[x == 0] = 1  # (so that a zero of the output is a dropped element)
    g = rng.standard_normal(x.shape).astype(dt)
    out = AF.dropout(x, p, seed=seed)
    grad = AF.dropout_backward(g, p, seed)
    keep = AF.dropout_mask(x.shape, p, seed)
    ours = {"output": out, "grad_input": grad}
    assert_dtypes(ours, dt)
    np.testing.assert_array_equal(out != 0, keep)
    np.testing.assert_array_equal(grad[~keep], 0)
    res = []
    for tdt in (torch.float64, TORCH_HALF[dt]):
        tx = tensor(x, tdt, True)
        o = ReplayDropout(keep, p)(tx)
        (o * tensor(g, tdt)).sum().backward()
        res.append({"output": numpy(o), "grad_input": numpy(tx.grad)})
    check("dropout", dt, ours, *res)


# ------------------------------------------------------------------------------------------------ cross-entropy
@half_dtypes
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("rows", [40, None], ids=["N_rows", "one_row"])
def test_cross_entropy(dt, reduction, ignore_index, rows):
    """cross_entropy/_forward/_backward: loss (the logits' dtype), float32 stats and gradient within the bound."""
    rng = np.random.default_rng(SEED)
    C = 100
    shape = (C,) if rows is None else (rows, C)
    logits = (rng.standard_normal(shape) * 4).astype(dt)
    target = rng.integers(0, C, shape[:-1])
    if rows is not None:
        target[rng.random(rows) < 0.2] = ignore_index
        target[:3] = [ignore_index, 2, 5]
    loss, stats = AF.cross_entropy_forward(logits, target, ignore_index=ignore_index, reduction=reduction)
    np.testing.assert_array_equal(AF.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction),
                                  loss)
    if reduction == "none":
        g = rng.standard_normal(loss.shape).astype(dt)          # an array of the loss's shape and dtype
    elif reduction == "sum":
        g = np.asarray(rng.standard_normal()).astype(dt)         # a 0-d array
    else:
        g = float(np.asarray(rng.standard_normal()).astype(dt))  # a number (of the dtype's values)
    grad = AF.cross_entropy_backward(g, logits, target, stats, ignore_index=ignore_index, reduction=reduction)
    assert stats.shape == (1 if rows is None else rows, 2)
    ours = {"loss": loss, "grad_input": grad, "stats": stats}
    assert_dtypes(ours, dt)
    ours = {"loss": loss, "grad_input": grad, "logsumexp": stats.sum(axis=1)}
    res = []
    for tdt in (torch.float64, TORCH_HALF[dt]):
        tx = tensor(logits, tdt, True)
        tl = torch.nn.functional.cross_entropy(tx, torch.tensor(target), ignore_index=ignore_index,
                                               reduction=reduction)
        (tl * tensor(g, tdt)).sum().backward()
        lse = torch.logsumexp(tx.detach(), -1).reshape(-1)
        res.append({"loss": numpy(tl), "grad_input": numpy(tx.grad), "logsumexp": numpy(lse)})
    check("cross_entropy", dt, ours, *res)


# ------------------------------------------------------------------------------------------------ bad input
def refused(*words):
    """A regular expression for pytest.raises(match=...): every one of ``words`` appears in the message, as a
    whole word (so that float16 is not found inside bfloat16, nor key inside key_cache)."""
    return "(?s)^" + "".join(rf"(?=.*(?<![\w]){w}(?![\w]))" for w in words)


def test_ml_dtypes_imported_at_the_first_bfloat16():
    """``import attnpp`` and float32 calls leave ml_dtypes unimported (its import took 0.9 s of attnpp's 1.0 s at
    ml_dtypes 0.7.0); a layer asked for "bfloat16" by name then imports it and holds its bfloat16."""
    code = """if True:
        import sys
        import numpy as np
        import attnpp, attnpp.functional, attnpp.nn, attnpp.optim
        x = np.ones((1, 2, 3, 4), np.float32)
        attnpp.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        assert "ml_dtypes" not in sys.modules
        layer = attnpp.nn.Linear(4, 3, dtype="bfloat16")
        import ml_dtypes
        assert layer.weight.dtype == ml_dtypes.bfloat16
        assert layer(x.astype(ml_dtypes.bfloat16)).dtype == ml_dtypes.bfloat16
    """
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mixed_half_dtypes_refused():
    """A float16 query with a bfloat16 key: TypeError naming key and both dtypes."""
    q = np.zeros((1, 2, 3, 4), F16)
    with pytest.raises(TypeError, match=refused("key", "float16", "bfloat16")):
        AF.scaled_dot_product_attention(q, q.astype(BF16), q)


@half_dtypes
def test_int8_mask_refused(dt):
    """An int8 attn_mask: TypeError naming attn_mask, int8 and the query's dtype."""
    q = np.zeros((1, 2, 3, 4), dt)
    with pytest.raises(TypeError, match=refused("attn_mask", "int8", dt.name)):
        AF.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros((3, 3), np.int8))


@pytest.mark.parametrize("q_dtype,mask_dtype", [(np.dtype(np.float32), BF16), (BF16, F16), (F16, BF16)],
                         ids=["float32_bfloat16", "bfloat16_float16", "float16_bfloat16"])
def test_half_mask_of_another_dtype_refused(q_dtype, mask_dtype):
    """A float mask of another dtype than the query's: TypeError naming attn_mask and both dtypes."""
    q = np.zeros((1, 2, 3, 4), q_dtype)
    with pytest.raises(TypeError, match=refused("attn_mask", q_dtype.name, mask_dtype.name)):
        AF.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros((3, 3), mask_dtype))
