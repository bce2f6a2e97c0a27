"""Property-based tests (hypothesis) of attnpp's attention against independent references (issue 5, item 1).

Each test draws random problems (sizes, batch and head layouts, masks, dtypes, options) and checks one documented
property of attnpp against a reference computed independently of it. Profiles (tests/conftest.py): "default" is
deterministic for CI; ``HYPOTHESIS_PROFILE=thorough`` draws at random and runs many more examples. The examples
run per test are printed at the end of the session.

References:
- Finite inputs: PyTorch as a user calls it: ``torch.nn.functional.scaled_dot_product_attention`` (its default
  backend; its math backend where the default gives NaN on finite inputs), ``torch.nn.MultiheadAttention``, and
  the articles' Attention layer written in PyTorch. Weights and log-sum-exp, which PyTorch's attention does not
  return, from PyTorch's math formula: ``torch.ops.aten._safe_softmax`` and ``torch.logsumexp`` of
  ``scale * query key^T + mask``.
- NaN and inf: ``reference_sdpa`` below, a small PyTorch autograd implementation of attnpp's documented
  semantics (PyTorch's own backends disagree with one another there: math multiplies 0 x NaN, flash drops NaN
  query rows). It is itself checked against PyTorch on finite inputs (test_reference_matches_torch).
- Huge and tiny magnitudes: PyTorch's math backend in float64 on exactly representable scores.

Tolerances (relative to max(1, max |reference|); non-finite values compared exactly: the same NaN positions,
the same +inf and -inf positions, except NaN vs inf in two gradients of an infinite grad_output, see
test_sdpa_nonfinite_backward):
- float64: 1e-10 (docs/design.md).
- float32: the reference is PyTorch in float64 on the same inputs and weights; within 1e-5 (docs/design.md), or
  within 4 times PyTorch's own float32 error against that reference on the same problem, where cancellation
  makes that larger (``assert_matches``).
- Large scores: the backward and the weights are recomputed from the rounded log-sum-exp (FlashAttention-2's
  design, shared by PyTorch's flash backward), so they carry an extra error of about eps * max|score|; their
  bound is max(tolerance, 4 * eps(dtype) * max|score|) (test_sdpa_extreme_magnitudes_backward).

Shape letters: B batch, H heads (Hq query heads, Hk key heads, Hv value heads), L query length, S key/value
length, D query/key head width, Dv value head width, E model width.
"""
import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnpp
import attnpp.functional as AF
from helpers import (DTYPES, HYPOTHESIS_EXAMPLES, LARGEST, TOL, T, assert_close, examples, make_mha, max_rel_err,
                     torch_kw, torch_sdpa)
from helpers import attention_layer_reference as torch_attention  # nn.Attention's math in PyTorch

EPS = {np.dtype(np.float64): 2.0**-52, np.dtype(np.float32): 2.0**-23}
# sizes that cross the kernel's block boundaries: the forward's 256 queries x 64, 128, 256 or 512 keys, the
# backward's 96 queries x 192 keys (cpp/attention.cpp)
BIG_SIZES = [63, 64, 65, 95, 96, 97, 127, 128, 129, 130, 191, 192, 193, 200, 255, 256, 257, 300]
# float32: attnpp's error may be this many times PyTorch's own float32 error (both against PyTorch in float64)
F32_FACTOR = 4


class Case(dict):
    """A drawn problem: a dict whose repr is short (hypothesis prints it; the details are in its notes)."""

    def __repr__(self):
        return "Case(" + ", ".join(f"{n}={v.shape}" if isinstance(v, np.ndarray) else f"{n}={v!r}"
                                   for n, v in self.items() if n != "kw") + ")"


def count(name):
    HYPOTHESIS_EXAMPLES[name] += 1


# ------------------------------------------------------------------------------------------------ comparisons
def assert_matches(ours, ref, dtype, what, torch32=None, bound=None, same_kind=True):
    """``ours`` equals the reference ``ref``: the same NaN positions and the same +inf and -inf positions (with
    ``same_kind=False``: the same non-finite positions, NaN and inf alike), and finite values within the bound,
    relative to max(1, max |finite ref|):
    - ``bound`` if given, else docs/design.md's tolerance (float64 1e-10, float32 1e-5);
    - float32 with ``torch32`` (PyTorch's own float32 result; ``ref`` is then PyTorch's in float64): within
      1e-5, or within 4 times PyTorch's own float32 error where cancellation makes that larger."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != reference {ref.shape}"
    tests = (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)) if same_kind else \
        (("non-finite", lambda a: ~np.isfinite(a)),)
    for name, test in tests:
        a, b = test(ours), test(ref)
        if (a != b).any():
            where = tuple(np.argwhere(a != b)[0])
            raise AssertionError(f"{what}: {name} positions differ: attnpp has {int(a.sum())}, the reference "
                                 f"{int(b.sum())}; first differing index {where} (attnpp {ours[where]}, reference "
                                 f"{ref[where]})")
    finite = np.isfinite(ref)
    err = max_rel_err(ours[finite], ref[finite])
    if bound is None:  # only these comparisons count in the run's "largest parity error" (conftest)
        name = np.dtype(dtype).name
        LARGEST[name] = max(LARGEST.get(name, 0.0), err)
        bound = TOL[dtype]
        if torch32 is not None and np.dtype(dtype) == np.float32:
            torch32 = np.asarray(torch32)
            if np.isfinite(torch32[finite]).all():
                torch_err = max_rel_err(torch32[finite], ref[finite])
                bound = max(bound, F32_FACTOR * torch_err)
                note(f"{what}: attnpp's error {err:.3g}, PyTorch's float32 error {torch_err:.3g}")
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g}"


def assert_scaled_close(ours, ref, natural, dtype, what, bound=None):
    """assert_matches on ours / natural and ref / natural: relative to the natural scale of the values (the
    product of the inputs' magnitudes), for inputs far from 1."""
    assert_matches(np.asarray(ours, np.float64) / natural, np.asarray(ref, np.float64) / natural, dtype, what,
                   bound=bound)


# ------------------------------------------------------------------------------------------------- strategies
def sub_shape(draw, shape):
    """``shape`` with some leading dimensions dropped and some others set to 1 (broadcast against it)."""
    drop = draw(st.integers(0, len(shape)))
    return tuple(1 if draw(st.booleans()) else n for n in shape[drop:])


ZERO_DIMS = ["L", "S", "D", "Dv", "batch", "heads", "any"]


@st.composite
def sdpa_cases(draw, max_size=40, big=True, big_widths=True, zero=None, dtypes=DTYPES,
               mask_kinds=("none", "causal", "bool", "float"), mask_ndims=None):
    """A random scaled_dot_product_attention problem, as a Case (see the keys at the end). ``big``: lengths
    (and with ``big_widths`` widths) sometimes across the kernel's blocks; ``zero``: one of ZERO_DIMS, the size
    set to 0 ("any": every size drawn from 0 up); ``mask_ndims``: the attn_mask's ndims to draw from (default:
    2 to that of the output)."""
    dtype = draw(st.sampled_from(dtypes))
    lo = 0 if zero == "any" else 1

    def size(top, can_be_big=True):  # mostly small, sometimes across the kernel's block boundaries
        if big and can_be_big and draw(st.integers(0, 7)) == 7:
            return draw(st.sampled_from(BIG_SIZES))
        return draw(st.integers(lo, top))

    L, S, D = size(max_size), size(max_size), size(max_size, big_widths)
    Dv = D if draw(st.booleans()) else size(max_size, big_widths)   # D == Dv lets PyTorch choose its flash kernel
    L, S, D, Dv = (0 if zero == n else x for n, x in (("L", L), ("S", S), ("D", D), ("Dv", Dv)))
    heavy = L * S * (D + Dv + 1) > 100_000 or (not big_widths and L * S > 2_000)
    gqa = draw(st.booleans())
    batch = () if heavy else tuple(draw(st.integers(lo, 3)) for _ in range(draw(st.integers(0, 2))))
    if zero == "batch":
        batch = batch[:1] + (0,) if draw(st.booleans()) else (0,) + batch[1:]
    Hk = draw(st.integers(1 if gqa else lo, 1 if heavy else 3))
    Hq = Hk * draw(st.integers(lo if gqa else 1, 1 if heavy else 3)) if gqa else Hk
    if zero == "heads":
        Hq, Hk = (0, Hk) if gqa else (0, 0)
    mode = draw(st.sampled_from(["same", "broadcast", "unbatched"]))
    if gqa:  # batch dimensions broadcast, heads grouped: the heads dimension is required
        leads = [(batch if mode != "broadcast" else sub_shape(draw, batch)) + (h,) for h in (Hq, Hk, Hk)]
        out_lead = np.broadcast_shapes(*(ld[:-1] for ld in leads)) + (Hq,)
    else:
        full = batch + (Hq,)
        leads = {"same": [full] * 3, "unbatched": [()] * 3}.get(mode) or [sub_shape(draw, full) for _ in range(3)]
        out_lead = np.broadcast_shapes(*leads)
    shapes = [leads[0] + (L, D), leads[1] + (S, D), leads[2] + (S, Dv)]
    kind = draw(st.sampled_from(mask_kinds))
    kw = {}
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "causal":
        kw["is_causal"] = True
    elif kind in ("bool", "float"):
        full_mask = out_lead + (L, S)
        ndim = draw(st.integers(2, len(full_mask)) if mask_ndims is None else st.sampled_from(mask_ndims))
        mshape = tuple(1 if draw(st.booleans()) else n for n in full_mask[len(full_mask) - ndim:])
        hidden = rng.random(mshape) < draw(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]))
        if kind == "bool":
            kw["attn_mask"] = np.asarray(~hidden)   # True where a key takes part (an ndarray when 0-D)
        else:
            sigma = draw(st.sampled_from([0.0, 1.0, 3.0]))
            kw["attn_mask"] = np.where(hidden, -np.inf, sigma * rng.standard_normal(mshape)).astype(dtype)
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(-3.0, 3.0)) / math.sqrt(max(D, 1))
    if gqa:
        kw["enable_gqa"] = True
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in shapes)
    g = rng.standard_normal(out_lead + (L, Dv)).astype(dtype)
    options = {n: x for n, x in kw.items() if n != "attn_mask"}
    note(f"dtype={dtype} query {q.shape} key {k.shape} value {v.shape} mask={kind} "
         f"{None if 'attn_mask' not in kw else kw['attn_mask'].shape} kw={options} seed={seed}")
    return Case(dtype=dtype, q=q, k=k, v=v, g=g, kw=kw, mask_kind=kind, out_lead=out_lead, L=L, S=S)


# ------------------------------------------------------------------------------------------- PyTorch references
def torch_refs(q, k, v, g, kw, out_lead=None):
    """(reference, PyTorch's float32 result or None, backend): for float64 inputs PyTorch's float64 result; for
    float32 inputs PyTorch's result in float64 on the same inputs (the reference) and in float32 (its own error
    sets the float32 bound, see assert_matches). PyTorch's default backend, or its math backend where the
    default gives NaN for finite inputs (its flash kernel with scale=0.0 and is_causal=True)."""
    def run(dtype):
        ref, backend = torch_sdpa(q, k, v, g, kw, out_lead, dtype)
        if any(np.isnan(r).any() for r in ref):
            with sdpa_kernel([SDPBackend.MATH]):
                ref, backend = torch_sdpa(q, k, v, g, kw, out_lead, dtype)
            note(f"torch's default backend gave NaN for finite inputs ({dtype}): reference from its math backend")
        return ref, backend

    ref, backend = run(torch.float64)
    ref32 = run(torch.float32)[0] if q.dtype == np.float32 else None
    return ref, ref32, backend


def torch_weights_lse(q, k, out_lead, kw, dtype=torch.float64):
    """PyTorch's math formula for the weights and log-sum-exp of scale * query key^T + mask, (*out_lead, L, S),
    computed in ``dtype``: _safe_softmax (fully masked rows 0, as the math backend since 2.5) and logsumexp."""
    tq, tk = T(q, dtype=dtype), T(k, dtype=dtype)
    L, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    if kw.get("enable_gqa"):
        tk = tk.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = kw.get("scale")
    scale = 1 / math.sqrt(D) if scale is None and D else scale
    scores = (tq @ tk.transpose(-2, -1)) * scale if D else torch.zeros(L, S, dtype=dtype)
    scores = scores + torch.zeros(out_lead + (L, S), dtype=dtype)
    if kw.get("is_causal"):
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -torch.inf)
    mask = kw.get("attn_mask")
    if mask is not None:
        scores = scores.masked_fill(~T(mask), -torch.inf) if mask.dtype == bool else scores + T(mask, dtype=dtype)
    return torch.ops.aten._safe_softmax(scores, -1).numpy(), torch.logsumexp(scores, -1).numpy()


def fully_masked_rows(case):
    """(*out_lead, L) bool: the query rows whose keys are all masked out."""
    full = case["out_lead"] + (case["L"], case["S"])
    mask = case["kw"].get("attn_mask")
    if mask is None:
        hidden = np.zeros(full, bool)
        if case["kw"].get("is_causal"):
            hidden |= ~np.tril(np.ones(full[-2:], bool))
    else:
        hidden = np.broadcast_to(~mask if mask.dtype == bool else np.isneginf(mask), full)
    return hidden.all(-1)


def expanded_query(case):
    """The query broadcast to the output's batch shape: the weights see query and key only, and value may
    broadcast the output further."""
    q, lead = case["q"], case["out_lead"]
    return np.broadcast_to(q, (lead[:-1] + q.shape[-3:]) if case["kw"].get("enable_gqa") else (lead + q.shape[-2:]))


def check_weights_and_lse(case, lse):
    """attnpp's weights (with and without the forward's log-sum-exp) equal PyTorch's softmax, and ``lse`` its
    logsumexp (float32: against PyTorch in float64, bounded by PyTorch's own float32 error); returns the
    weights."""
    k, kw, dtype, lead = case["k"], case["kw"], case["dtype"], case["out_lead"]
    qw = expanded_query(case)
    weights_ref, lse_ref = torch_weights_lse(qw, k, lead, kw)
    weights32, lse32 = torch_weights_lse(qw, k, lead, kw, torch.float32) if dtype is np.float32 else (None, None)
    weights = AF.scaled_dot_product_attention_weights(qw, k, **kw)
    assert_matches(weights, weights_ref, dtype, "weights", weights32)
    np.testing.assert_array_equal(AF.scaled_dot_product_attention_weights(qw, k, **kw, logsumexp=lse), weights)
    assert_matches(lse, lse_ref, dtype, "logsumexp", lse32)
    return weights


def attnpp_sdpa(q, k, v, g, kw):
    """attnpp's output, gradients (query, key, value) and log-sum-exp."""
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    grads = AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, **kw)
    return [out, *grads], lse


NAMES = ("output", "grad_query", "grad_key", "grad_value")


def assert_all_match(ours, ref, ref32, dtype):
    """Output and the three gradients: attnpp's dtype and shape, values as assert_matches."""
    for i, (name, a, b) in enumerate(zip(NAMES, ours, ref)):
        assert a.dtype == dtype and a.shape == b.shape, f"{name}: {a.dtype} {a.shape} vs {b.shape}"
        assert_matches(a, b, dtype, name, None if ref32 is None else ref32[i])


# ------------------------------------------------------------------------------- the reference of NaN and inf
def reference_sdpa(q, k, v, g, kw, dtype=torch.float64):
    """attnpp's documented semantics in PyTorch autograd, computed in ``dtype``: returns ([output, grad_query,
    grad_key, grad_value], weights, logsumexp).

    The semantics decided for attnpp (finding 4; ZERO_WEIGHT_ALWAYS_SKIPPED says how strictly the tests hold
    attnpp to it, the docstring as committed allowing NaN where a weight-0 key is computed): a key whose score
    is -inf has weight exactly 0 and contributes nothing, to the output or to any gradient (0 weight x NaN value
    = 0, not NaN); a query row whose keys all have score -inf gives output 0, weights 0, log-sum-exp -inf and
    gradient 0 (even for a NaN or infinite grad_output); every other NaN or inf propagates as in PyTorch's math
    backend (a NaN score makes its row NaN, a +inf score too: inf - inf in the softmax).

    The score of query i and key j is scale * q_i . k_j + attn_mask_ij (a boolean mask adds 0 or -inf, so NaN
    + -inf stays NaN), set to -inf above the causal diagonal whatever it was (the causal mask does not look at
    the key). A pair (i, j) is *hidden* when its score is -inf: masked, causal, or an infinite product.

    Construction: every per-pair tensor is (B..., L, S, ...), and each input of a hidden pair is replaced by 0
    with torch.where *before* any product (q_i and k_j in the score, v_j in the output, the weight p_ij and
    grad_output_i in the product p_ij v_j), so that autograd's backward through where sends exactly 0 into the
    masked branch and no 0 x NaN or 0 x inf is ever formed for a hidden pair. The softmax runs over the row with
    the hidden scores -inf (weight 0), a fully hidden row replaced by zeros and its weights set to 0 by where.
    The rest is PyTorch's: matmul-like sums, torch.softmax and its backward (sum_j p_ij dp_ij per key). The
    scale is rounded to the inputs' dtype first (a float32 problem multiplies by a float32 scale)."""
    tq, tk, tv = (T(x, True, dtype) for x in (q, k, v))
    kk, vv = tk, tv
    if kw.get("enable_gqa"):  # query head h uses key head h // (Hq // Hk), value head h // (Hq // Hv)
        kk = tk.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        vv = tv.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    L, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = kw.get("scale")
    # the scale in the inputs' precision, as attnpp applies it (a float32 problem's scale is a float32)
    scale = 1.0 if D == 0 else float(np.asarray(1 / math.sqrt(D) if scale is None else scale, q.dtype))
    qe, ke = tq[..., :, None, :], kk[..., None, :, :]                       # (B..., L, 1, D), (B..., 1, S, D)
    mask = kw.get("attn_mask")
    add = torch.zeros((L, S), dtype=dtype)                                   # the additive mask (B..., L, S)
    if mask is not None:
        add = T(mask, dtype=dtype) if mask.dtype != bool else torch.where(T(mask), 0.0, -torch.inf).to(dtype)
    with torch.no_grad():
        hidden = (qe * ke).sum(-1) * scale + add == -torch.inf               # (B..., L, S)
        if kw.get("is_causal"):
            hidden = hidden | torch.ones(L, S, dtype=torch.bool).triu(1)
        row_hidden = hidden.all(-1, keepdim=True)                           # (B..., L, 1)
    H = hidden[..., None]
    zero = torch.zeros((), dtype=dtype)
    scores = (torch.where(H, zero, qe) * torch.where(H, zero, ke)).sum(-1) * scale + torch.where(hidden, zero, add)
    scores = torch.where(hidden, -torch.inf, scores)
    p = torch.where(hidden, zero, torch.softmax(torch.where(row_hidden, zero, scores), -1))  # (B..., L, S)
    value = torch.where(H, zero, vv[..., None, :, :])                       # (B..., L, S, Dv)
    out = torch.where(H, zero, p[..., None] * value).sum(-2)                # (B..., L, Dv)
    (out * T(g, dtype=dtype)).sum().backward()
    with torch.no_grad():
        lse = torch.where(row_hidden[..., 0], -torch.inf, torch.logsumexp(torch.where(row_hidden, zero, scores), -1))
    return [out.detach().numpy()] + [t.grad.numpy() for t in (tq, tk, tv)], p.detach().numpy(), lse.numpy()


# ---------------------------------------------------------------------------------------------- 1. the kernel
@settings(max_examples=examples(150))
@given(case=sdpa_cases())
def test_sdpa_matches_torch(case):
    """Forward, the three gradients, the weights and the log-sum-exp equal PyTorch's for random sizes (blocks
    crossed), heads, GQA groups, 0-2 batch dimensions broadcast between query, key and value, unbatched inputs,
    bool and float masks of every broadcast shape, is_causal (L != S too) and scale; fully masked rows give
    output 0, gradient 0 and log-sum-exp -inf. float64 within 1e-10; float32 within 1e-5 of PyTorch in float64,
    or within 4x of PyTorch's own float32 error where cancellation makes that larger."""
    count("test_sdpa_matches_torch")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    ours, lse = attnpp_sdpa(q, k, v, g, kw)
    ref, ref32, backend = torch_refs(q, k, v, g, kw, case["out_lead"])
    note(f"backend={backend}")
    assert_all_match(ours, ref, ref32, dtype)
    np.testing.assert_array_equal(AF.scaled_dot_product_attention(q, k, v, **kw), ours[0])
    weights = check_weights_and_lse(case, lse)
    hidden = fully_masked_rows(case)
    assert (ours[0][hidden] == 0).all() and (weights[hidden] == 0).all() and np.isneginf(lse[hidden]).all()
    if q.shape[:-1] == hidden.shape:  # a query that is not broadcast: its fully masked rows get gradient 0
        assert (ours[1][hidden] == 0).all()
    for x in ours:
        assert not np.isnan(x).any()


@settings(max_examples=examples(40))
@given(case=sdpa_cases(max_size=12, big=False, dtypes=[np.float64]))
def test_reference_matches_torch(case):
    """The NaN/inf reference (``reference_sdpa``) is PyTorch's attention on finite inputs: its output, gradients,
    weights and log-sum-exp equal F.scaled_dot_product_attention's and PyTorch's softmax and logsumexp within
    1e-10 (float64), fully masked rows included (0, as PyTorch >= 2.5)."""
    count("test_reference_matches_torch")
    q, k, v, g, kw = (case[n] for n in ("q", "k", "v", "g", "kw"))
    ours, weights, lse = reference_sdpa(q, k, v, g, kw)
    ref, _, backend = torch_refs(q, k, v, g, kw, case["out_lead"])
    note(f"backend={backend}")
    assert_all_match(ours, ref, None, np.float64)
    weights_ref, lse_ref = torch_weights_lse(expanded_query(case), k, case["out_lead"], kw)
    full = case["out_lead"] + (case["L"], case["S"])
    assert_matches(np.broadcast_to(weights, full), weights_ref, np.float64, "weights")
    assert_matches(np.broadcast_to(lse, full[:-1]), lse_ref, np.float64, "logsumexp")


@st.composite
def gqa_value_heads_cases(draw):
    """GQA with Hv != Hk: Hq a multiple of both, key (B, Hk, S, D), value (B, Hv, S, Dv)."""
    dtype = draw(st.sampled_from(DTYPES))
    Hk = draw(st.integers(1, 3))
    Hv = draw(st.integers(1, 3).filter(lambda h: h != Hk))
    Hq = math.lcm(Hk, Hv) * draw(st.integers(1, 2))
    batch = tuple(draw(st.integers(1, 2)) for _ in range(draw(st.integers(0, 1))))
    L, S, D, Dv = (draw(st.integers(1, 9)) for _ in range(4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kw = dict(enable_gqa=True, is_causal=draw(st.booleans()))
    q, k, v = (rng.standard_normal(batch + s).astype(dtype) for s in ((Hq, L, D), (Hk, S, D), (Hv, S, Dv)))
    g = rng.standard_normal(batch + (Hq, L, Dv)).astype(dtype)
    note(f"dtype={dtype} query {q.shape} key {k.shape} value {v.shape} kw={kw}")
    return Case(dtype=dtype, q=q, k=k, v=v, g=g, kw=kw)


@settings(max_examples=examples(15))
@given(case=gqa_value_heads_cases())
def test_sdpa_gqa_value_heads_differ(case):
    """With enable_gqa=True PyTorch repeats key and value heads separately (Hq a multiple of Hk and of Hv, Hk
    may differ from Hv: query head h uses key head h // (Hq // Hk) and value head h // (Hq // Hv)): attnpp gives
    the same output and gradients (tolerances as test_sdpa_matches_torch)."""
    count("test_sdpa_gqa_value_heads_differ")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    ref, ref32, _ = torch_refs(q, k, v, g, kw)
    ours, _ = attnpp_sdpa(q, k, v, g, kw)
    assert_all_match(ours, ref, ref32, dtype)


@settings(max_examples=examples(30))
@given(case=sdpa_cases(max_size=12, big=False, mask_kinds=("bool", "float"), mask_ndims=(0, 1)))
def test_sdpa_low_ndim_masks(case):
    """A 0-D or 1-D attn_mask (() or (S,), bool or float) broadcasts to (B..., Hq, L, S) like any NumPy array,
    whatever the inputs' ndim: the output, gradients, weights and log-sum-exp equal exactly those for the mask
    broadcast explicitly to (L, S), and PyTorch's for that 2-D mask (tolerances as test_sdpa_matches_torch).
    PyTorch itself takes a 0-D or 1-D mask with 2-D and 3-D inputs (then it is compared as given) and refuses it
    with 4-D inputs (its flash path indexes the mask's dimension -2); attnpp is deliberately more lenient."""
    count("test_sdpa_low_ndim_masks")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    kw2 = dict(kw, attn_mask=np.broadcast_to(kw["attn_mask"], (case["L"], case["S"])))
    ours, lse = attnpp_sdpa(q, k, v, g, kw)
    ours2, lse2 = attnpp_sdpa(q, k, v, g, kw2)
    for name, a, b in zip(NAMES + ("logsumexp",), ours + [lse], ours2 + [lse2]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    qw = expanded_query(case)
    np.testing.assert_array_equal(AF.scaled_dot_product_attention_weights(qw, k, **kw),
                                  AF.scaled_dot_product_attention_weights(qw, k, **kw2))
    ref, ref32, _ = torch_refs(q, k, v, g, kw2, case["out_lead"])
    assert_all_match(ours, ref, ref32, dtype)
    if max(q.ndim, k.ndim, v.ndim) <= 3:
        direct, direct32, _ = torch_refs(q, k, v, g, kw, case["out_lead"])
        assert_all_match(ours, direct, direct32, dtype)


# --------------------------------------------------------------------------------------- 2. zero-size problems
def outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 (the exception is the outcome compared)
        return None, e


@pytest.mark.parametrize("zero", ZERO_DIMS)
@settings(max_examples=examples(12))
@given(data=st.data())
def test_sdpa_zero_sizes(zero, data):
    """L, S, D, Dv, the heads or a batch dimension of length 0 (or any of them, "any"): where PyTorch gives an
    answer attnpp gives the same (output, gradients, weights, log-sum-exp; tolerances as
    test_sdpa_matches_torch); where PyTorch raises, attnpp raises ValueError or TypeError. (GQA with Hk = 0 is
    not drawn: query head h would use key head h // (Hq / 0).)"""
    count(f"test_sdpa_zero_sizes[{zero}]")
    case = data.draw(sdpa_cases(max_size=3, big=False, zero=zero), label="case")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    refs, t_err = outcome(lambda: torch_refs(q, k, v, g, kw, case["out_lead"]))
    ours, err = outcome(lambda: attnpp_sdpa(q, k, v, g, kw))
    if t_err is not None:
        note(f"torch raised {t_err!r}")
        assert isinstance(err, (ValueError, TypeError)), f"torch raised {t_err!r}; attnpp gave {err!r}"
        return
    assert err is None, f"torch answered, attnpp raised {err!r}"
    (ours, lse), (ref, ref32, _) = ours, refs
    shape = case["out_lead"] + (case["L"], v.shape[-1])
    if ref[0].shape != shape:  # PyTorch returns a query-shaped output when S = 0, whatever value broadcasts to
        note(f"torch's output has shape {ref[0].shape}, broadcasting gives {shape}")
        for r in (ref, ref32) if ref32 is not None else (ref,):
            r[0] = np.broadcast_to(r[0], shape)
    assert_all_match(ours, ref, ref32, dtype)
    check_weights_and_lse(case, lse)


CHANGES = ["D", "S", "batch", "heads", "mask_L", "mask_S", "mask_lead", "mask_1d", "mask_0d", "mask_dtype",
           "mask_int", "causal_and_mask", "gqa_2d", "gqa_indivisible", "dtype_k", "dtype_v", "ndim_1", "float16_key"]


@st.composite
def bad_sdpa_cases(draw, change):
    """A valid small problem with one thing changed (one of CHANGES), that PyTorch may refuse."""
    case = draw(sdpa_cases(max_size=6, big=False))
    q, k, v, kw, dtype = case["q"], case["k"], case["v"], dict(case["kw"]), case["dtype"]
    other = np.float32 if dtype is np.float64 else np.float64
    grow = lambda x, axis: np.concatenate([x, np.take(x, [0], axis=axis)], axis=axis)
    mask = kw.get("attn_mask", np.ones((q.shape[-2], k.shape[-2]), bool))
    if change.startswith("mask"):
        kw.pop("is_causal", None)
    if change == "D":
        k = grow(k, -1)
    elif change == "S":
        v = grow(v, -2)
    elif change == "batch":
        q = np.stack([q] * 2) if q.ndim >= 3 else q[None, None]
        k = np.stack([k] * 3)
    elif change == "heads":
        k = np.concatenate([k[None]] * 2, axis=0)
        q = np.concatenate([q[None]] * 3, axis=0)
    elif change == "mask_L":
        kw["attn_mask"] = grow(mask, -2)
    elif change == "mask_S":
        kw["attn_mask"] = grow(mask, -1)
    elif change == "mask_lead":
        kw["attn_mask"] = np.stack([mask] * 2 * (1 + len(case["out_lead"])))[(None,) * 2]
    elif change == "mask_1d":  # (S,)
        kw["attn_mask"] = mask.reshape(-1, mask.shape[-1])[0]
    elif change == "mask_0d":
        kw["attn_mask"] = np.asarray(mask[(0,) * mask.ndim])
    elif change == "mask_dtype":
        kw["attn_mask"] = np.zeros(mask.shape, other)
    elif change == "mask_int":
        kw["attn_mask"] = np.ones(mask.shape, np.int64)
    elif change == "causal_and_mask":
        kw["attn_mask"], kw["is_causal"] = mask, True
    elif change == "gqa_2d":
        q, k, v = (x[(0,) * (x.ndim - 2)] for x in (q, k, v))
        kw.pop("attn_mask", None)
        kw["enable_gqa"] = True
    elif change == "gqa_indivisible":  # Hq = 3, Hk = 2
        q, k, v = (np.stack([x[(0,) * (x.ndim - 2)]] * n) for x, n in ((q, 3), (k, 2), (v, 2)))
        kw.pop("attn_mask", None)
        kw["enable_gqa"] = True
    elif change == "dtype_k":
        k = k.astype(other)
    elif change == "dtype_v":
        v = v.astype(other)
    elif change == "ndim_1":
        q = q[(0,) * (q.ndim - 1)]
        kw.pop("attn_mask", None)
    elif change == "float16_key":
        k = k.astype(np.float16)
        kw.pop("attn_mask", None)
    note(f"change={change}: query {q.shape} {q.dtype}, key {k.shape} {k.dtype}, value {v.shape} {v.dtype}, "
         f"mask {None if kw.get('attn_mask') is None else (kw['attn_mask'].shape, kw['attn_mask'].dtype)}, "
         f"kw { {n: x for n, x in kw.items() if n != 'attn_mask'} }")
    return q, k, v, kw, dtype


@pytest.mark.parametrize("change", CHANGES)
@settings(max_examples=examples(5))
@given(data=st.data())
def test_sdpa_refuses_what_torch_refuses(change, data):
    """A valid call with its shapes, masks or dtypes changed: where PyTorch raises (as called, or in its math
    backend, which checks what its flash kernel skips: key and value lengths, attn_mask with is_causal),
    attnpp's forward raises ValueError or TypeError, never another exception or a crash; where PyTorch answers,
    attnpp answers the same (tolerances as test_sdpa_matches_torch). Mixed dtypes (a float16 key, a float
    mask of the other precision) give TypeError, as docs/design.md decides, though PyTorch converts them. A 0-D or 1-D
    attn_mask is not a refusal: attnpp broadcasts it whatever the inputs' ndim (deliberately more lenient than
    PyTorch, which refuses it with 4-D inputs only), so attnpp must answer as PyTorch does with the mask
    broadcast to (L, S)."""
    count(f"test_sdpa_refuses_what_torch_refuses[{change}]")
    q, k, v, kw, dtype = data.draw(bad_sdpa_cases(change), label="bad")

    def run_torch(kw, tdtype=None):
        tkw = torch_kw(kw, tdtype)
        return torch.nn.functional.scaled_dot_product_attention(T(q, dtype=tdtype), T(k, dtype=tdtype),
                                                                T(v, dtype=tdtype), **tkw).numpy()

    ours, err = outcome(lambda: AF.scaled_dot_product_attention(q, k, v, **kw))
    if change in ("mask_1d", "mask_0d"):
        kw = dict(kw, attn_mask=np.broadcast_to(kw["attn_mask"], (q.shape[-2], k.shape[-2])))
    ref, t_err = outcome(lambda: run_torch(kw))
    if t_err is None:  # PyTorch's flash kernel skips checks that its math backend makes
        with sdpa_kernel([SDPBackend.MATH]):
            t_err = outcome(lambda: run_torch(kw))[1]
    if change in ("mask_dtype", "float16_key"):  # docs/design.md: mixed dtypes are refused, never converted
        assert isinstance(err, TypeError), f"attnpp gave {err!r}"
    elif t_err is not None:
        note(f"torch raised {t_err!r}")
        assert isinstance(err, (ValueError, TypeError)), f"torch raised {t_err!r}; attnpp gave {err!r}"
    else:
        assert err is None, f"torch answered, attnpp raised {err!r}"
        assert_matches(ours, run_torch(kw, torch.float64), dtype, "output",
                       ref if dtype is np.float32 else None)


# ---------------------------------------------------------------------------------------- 3. NaN and infinity
@st.composite
def nonfinite_cases(draw, masked, target):
    """A small problem (``masked``: with a causal, bool or float mask; else none; lengths sometimes across the
    kernel's blocks) with 1 to 3 entries of ``target`` (query, key, value, grad_output or attn_mask, a float
    mask) set to NaN, +inf or -inf."""
    kinds = (("causal", "bool", "float") if target != "attn_mask" else ("float",)) if masked else ("none",)
    case = draw(sdpa_cases(max_size=10, big_widths=False, mask_kinds=kinds))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    case = Case(case, kw=dict(case["kw"]))
    for n in ("q", "k", "v", "g"):
        case[n] = case[n].copy()
    if "attn_mask" in case["kw"]:
        case["kw"]["attn_mask"] = case["kw"]["attn_mask"].copy()
    arr = case["kw"]["attn_mask"] if target == "attn_mask" else case[target]
    poked = []
    for _ in range(draw(st.integers(1, 3))):
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        index = np.unravel_index(rng.integers(arr.size), arr.shape)
        arr[index] = value
        poked.append((target, tuple(int(i) for i in index), value))
    note(f"non-finite entries: {poked}")
    return case


FORWARD_TARGETS = [(False, "q"), (False, "k"), (False, "v"), (True, "q"), (True, "k"), (True, "v"),
                   (True, "attn_mask")]
BACKWARD_TARGETS = FORWARD_TARGETS + [(False, "g"), (True, "g")]
target_id = lambda t: ("masked-" if t[0] else "unmasked-") + t[1]


# Which NaN/inf semantics the tests hold attnpp to (see test_sdpa_nonfinite_forward):
# True: the lead's decision (issue 5 findings, item 4): a key of weight exactly 0 (score -inf: masked, causal, or an
#   infinite product) contributes nothing, to the output or to any gradient, and a fully masked row has gradient
#   0 even for a NaN grad_output: attnpp must equal ``reference_sdpa`` exactly.
# False: scaled_dot_product_attention's docstring as committed (07306b8): NaN and inf propagate as in PyTorch's
#   math backend except that attnpp skips keys in some places (key blocks wholly above the causal diagonal or
#   masked, fully masked rows), so a weight-0 key gives 0 x NaN = NaN where it is computed and nothing where it
#   is skipped: attnpp must equal ``reference_sdpa`` except that an entry may be NaN where PyTorch's math backend
#   gives NaN.
ZERO_WEIGHT_ALWAYS_SKIPPED = False


def nonfinite_refs(case):
    """reference_sdpa in float64, and for float32 inputs in float32 too (a float32 computation's own error, for
    the bound of assert_matches); and, unless ZERO_WEIGHT_ALWAYS_SKIPPED, PyTorch's math backend in float64
    (output and gradients), whose NaN entries attnpp may share."""
    q, k, v, g, kw = (case[n] for n in ("q", "k", "v", "g", "kw"))
    ref = reference_sdpa(q, k, v, g, kw)
    ref32 = reference_sdpa(q, k, v, g, kw, torch.float32) if case["dtype"] is np.float32 else None
    math_ref = None
    if not ZERO_WEIGHT_ALWAYS_SKIPPED:
        with sdpa_kernel([SDPBackend.MATH]):
            math_ref = torch_sdpa(q, k, v, g, kw, case["out_lead"], torch.float64)[0]
    return ref, ref32, math_ref


def allow_math_nan(ours, ref, math_ref):
    """``ref`` with NaN wherever attnpp and PyTorch's math backend (``math_ref``, None: nowhere) both have NaN:
    the documented freedom of a key of weight 0 that attnpp computes (0 x NaN = NaN, as in PyTorch)."""
    if math_ref is None:
        return ref
    ref = np.broadcast_to(ref, ours.shape)
    return np.where(np.isnan(ours) & np.isnan(math_ref), np.nan, ref)


@pytest.mark.parametrize("target", FORWARD_TARGETS, ids=target_id)
@settings(max_examples=examples(12))
@given(data=st.data())
def test_sdpa_nonfinite_forward(target, data):
    """NaN and inf in the query, key, value or float mask (with or without masks): the output, the weights and
    the log-sum-exp follow attnpp's documented semantics (``reference_sdpa``): a key whose score is -inf (masked,
    causal, or from an infinite query or key) has weight exactly 0 and contributes nothing, even where its value
    is NaN or inf; a row whose keys all score -inf gives output 0, weights 0 and log-sum-exp -inf; every other
    NaN or inf propagates as in PyTorch's math backend. Same NaN and +-inf positions, finite values within the
    tolerance (float32: or 4x a float32 run of the reference's own error), the log-sum-exp on rows without NaN
    weights. Unless ZERO_WEIGHT_ALWAYS_SKIPPED, the output may also be NaN where PyTorch's math backend gives NaN
    (a weight-0 key with a NaN value in a key block that attnpp computes: the docstring as committed)."""
    count(f"test_sdpa_nonfinite_forward[{target_id(target)}]")
    case = data.draw(nonfinite_cases(*target), label="case")
    q, k, v, kw, dtype = (case[n] for n in ("q", "k", "v", "kw", "dtype"))
    (ref, w_ref, lse_ref), ref32, math_ref = nonfinite_refs(case)
    full = case["out_lead"] + (case["L"], case["S"])
    with np.errstate(all="ignore"):
        out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
        weights = AF.scaled_dot_product_attention_weights(expanded_query(case), k, **kw)
    assert_matches(out, allow_math_nan(out, ref[0], math_ref and math_ref[0]), dtype, "output",
                   None if ref32 is None else ref32[0][0])
    assert_matches(weights, np.broadcast_to(w_ref, full), dtype, "weights",
                   None if ref32 is None else np.broadcast_to(ref32[1], full))
    rows = ~np.isnan(np.broadcast_to(w_ref, full)).any(-1)
    assert_matches(lse[rows], np.broadcast_to(lse_ref, full[:-1])[rows], dtype, "logsumexp",
                   None if ref32 is None else np.broadcast_to(ref32[2], full[:-1])[rows])


@pytest.mark.parametrize("target", BACKWARD_TARGETS, ids=target_id)
@settings(max_examples=examples(12))
@given(data=st.data())
def test_sdpa_nonfinite_backward(target, data):
    """NaN and inf in the query, key, value, grad_output or float mask (with or without masks): the three
    gradients follow attnpp's documented semantics (``reference_sdpa``): a key whose score is -inf contributes
    nothing to any gradient (no 0 x NaN), a row whose keys all score -inf has gradient 0 even for a NaN or
    infinite grad_output, every other NaN or inf propagates as in PyTorch's math backend. Same NaN and +-inf
    positions and finite values within the tolerance, except one thing that no documented rule decides: with an
    infinite grad_output on a row that has visible keys, grad_query and grad_key may be NaN or +-inf depending
    on the order of exact sums (PyTorch's math backend sums p_ij dp_ij per key, FlashAttention-2 takes
    rowsum(grad_output * output)), so there only the non-finite positions must agree. Unless
    ZERO_WEIGHT_ALWAYS_SKIPPED, a gradient may also be NaN where PyTorch's math backend gives NaN (a weight-0 key
    that attnpp computes multiplies NaN by 0, and so does a fully masked row's NaN grad_output: the docstring as
    committed)."""
    count(f"test_sdpa_nonfinite_backward[{target_id(target)}]")
    case = data.draw(nonfinite_cases(*target), label="case")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    (ref, _, _), ref32, math_ref = nonfinite_refs(case)
    with np.errstate(all="ignore"):
        ours, _ = attnpp_sdpa(q, k, v, g, kw)
    inf_grad = np.isinf(g).any()
    for i, (name, a, b) in enumerate(zip(NAMES[1:], ours[1:], ref[1:]), 1):
        assert_matches(a, allow_math_nan(a, b, math_ref and math_ref[i]), dtype, name,
                       None if ref32 is None else ref32[0][i], same_kind=not (inf_grad and name != "grad_value"))


# ------------------------------------------------------------------------------- 4. huge and tiny magnitudes
@st.composite
def magnitude_cases(draw):
    """Query, key, value and grad_output of magnitudes 2^-100 .. 2^100 (float32; 2^-800 .. 2^800 float64),
    scores up to ~1e30 (float32) / 1e240 (float64), no product overflowing or underflowing the dtype; half of
    the problems with the largest score between 2^-8 and 2 / eps, where the bound of the backward is useful.

    Query and key are small integers times powers of two and the scale a power of two, so every score is exact
    in any summation order: PyTorch and attnpp see the same scores, ties included, and differ only by their
    softmax arithmetic."""
    dtype = draw(st.sampled_from(DTYPES))
    top = 100 if dtype is np.float32 else 800
    L, S = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    if draw(st.integers(0, 5)) == 5:
        L, S = draw(st.sampled_from(BIG_SIZES)), draw(st.sampled_from(BIG_SIZES))
    # the scale 2^c, or None: 1 / sqrt(D), is an even power of two: PyTorch's math backend multiplies query and
    # key by sqrt(scale) each, exactly then
    D = draw(st.sampled_from([1, 16]))
    Dv = draw(st.sampled_from([1, 3, D]))
    H = draw(st.integers(1, 2))
    c = draw(st.one_of(st.none(), st.sampled_from([-4, -2, 0, 2, 4])))
    log_scale = -int(math.log2(D)) // 2 if c is None else c
    # exponents such that the scores (|q k| <= 9 * 9 * 16 < 2^11), the output and the products in dq
    # (g v k scale) and dk (g v q scale) stay within 2^-top .. 2^(top - 11)
    e_lo, e_hi = -top // 2, top // 2 - 10
    if draw(st.booleans()):  # e_q + e_k + log2(scale): scores of 2^-8 .. 2^(mantissa bits + 1)
        e_s = draw(st.integers(-8 - 11, (24 if dtype is np.float32 else 53) + 1 - 11))
        e_q = draw(st.integers(max(e_lo, e_s - log_scale - e_hi), min(e_hi, e_s - log_scale - e_lo)))
        e = {"q": e_q, "k": e_s - log_scale - e_q}
    else:
        e = {n: draw(st.integers(e_lo, e_hi)) for n in ("q", "k")}
    lo = max(-top, -top - min(e["q"], e["k"]) - log_scale)
    hi = min(top - 11, top - 11 - max(e["q"], e["k"]) - log_scale)
    t = draw(st.integers(lo, hi))    # e_g + e_v
    e["v"] = draw(st.integers(max(-top, t - top), min(top, t + top)))
    e["g"] = t - e["v"]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ints = lambda shape: rng.integers(-9, 10, shape).astype(dtype)
    q = ints((1, H, L, D)) * dtype(2.0 ** e["q"])
    k = ints((1, H, S, D)) * dtype(2.0 ** e["k"])
    v = rng.standard_normal((1, H, S, Dv)).astype(dtype) * dtype(2.0 ** e["v"])
    g = rng.standard_normal((1, H, L, Dv)).astype(dtype) * dtype(2.0 ** e["g"])
    kw = {} if c is None else {"scale": 2.0 ** c}
    mask = draw(st.sampled_from(["none", "causal", "bool"]))
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "bool":
        kw["attn_mask"] = rng.random((L, S)) < 0.7
    # the largest |score| of a visible key (exact in float64)
    scores = np.abs((q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) * 2.0**log_scale)
    if mask == "causal":
        scores = np.where(np.tril(np.ones((L, S), bool)), scores, 0)
    elif mask == "bool":
        scores = np.where(kw["attn_mask"], scores, 0)
    max_score = float(scores.max())
    note(f"dtype={dtype} B=1 H={H} L={L} S={S} D={D} Dv={Dv} exponents {e} scale 2^{log_scale} mask={mask} "
         f"max|score|={max_score:.3g} seed={seed}")
    natural = {"output": 2.0 ** e["v"], "grad_value": 2.0 ** e["g"],
               "grad_query": 2.0 ** (e["g"] + e["v"] + e["k"] + log_scale),
               "grad_key": 2.0 ** (e["g"] + e["v"] + e["q"] + log_scale)}
    return Case(dtype=dtype, q=q, k=k, v=v, g=g, kw=kw, natural=natural, out_lead=(1, H), max_score=max_score)


def math_reference(case):
    """PyTorch's math backend in float64 (exact scores, the softmax computed from them directly): output and
    the three gradients; and the weights and log-sum-exp from PyTorch's softmax and logsumexp in float64."""
    q, k, v, g, kw = (case[n] for n in ("q", "k", "v", "g", "kw"))
    with sdpa_kernel([SDPBackend.MATH]):
        ref, _ = torch_sdpa(q, k, v, g, kw, dtype=torch.float64)
    return ref, *torch_weights_lse(q, k, case["out_lead"], kw)


@settings(max_examples=examples(60))
@given(case=magnitude_cases())
def test_sdpa_extreme_magnitudes_forward(case):
    """Scores up to ~1e30 (float32) and 1e240 (float64), values down to ~1e-30 / 1e-240: the forward is exact
    (the softmax subtracts each row's maximum): no overflow, no NaN or inf, the output within docs/design.md's
    tolerance of PyTorch's math backend in float64, relative to the values' magnitude (output / value scale,
    relative to max(1, |reference|)), and the log-sum-exp within the tolerance of PyTorch's logsumexp (-inf
    exactly on fully masked rows)."""
    count("test_sdpa_extreme_magnitudes_forward")
    q, k, v, kw, dtype = (case[n] for n in ("q", "k", "v", "kw", "dtype"))
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    ref, _, lse_ref = math_reference(case)
    assert np.isfinite(out).all(), "output: non-finite values"
    assert np.isfinite(lse[~np.isneginf(lse_ref)]).all(), "logsumexp: non-finite values"
    assert_scaled_close(out, ref[0], case["natural"]["output"], dtype, "output")
    assert_matches(lse, lse_ref, dtype, "logsumexp")


@settings(max_examples=examples(60))
@given(case=magnitude_cases())
def test_sdpa_extreme_magnitudes_backward(case):
    """The same problems: the three gradients and the weights have no NaN or inf, and are within
    max(TOL, 4 * eps * max|score|) of PyTorch's math backend in float64 (eps = 2^-23 for float32, 2^-52 for
    float64; TOL docs/design.md's 1e-5 / 1e-10), each gradient relative to its natural scale (grad_output * value *
    key * scale for grad_query, ...; then relative to max(1, |reference|)). The bound is FlashAttention-2's
    design, documented by attnpp: the backward and the weights are recomputed as exp(score - logsumexp) from the
    log-sum-exp rounded to the dtype, whose error grows with the score (PyTorch's own flash backward shares it:
    tied scores above 2^24 in float32 get weight 1 each); the reference is PyTorch's math backend, which keeps
    the forward's softmax."""
    count("test_sdpa_extreme_magnitudes_backward")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    ours, _ = attnpp_sdpa(q, k, v, g, kw)
    ref, weights_ref, _ = math_reference(case)
    bound = max(TOL[dtype], 4 * EPS[np.dtype(dtype)] * case["max_score"])
    note(f"bound {bound:.3g}")
    weights = AF.scaled_dot_product_attention_weights(q, k, **kw)
    assert np.isfinite(weights).all(), "weights: non-finite values"
    assert_matches(weights, weights_ref, dtype, "weights", bound=bound)
    for name, a, b in zip(NAMES[1:], ours[1:], ref[1:]):
        assert np.isfinite(a).all(), f"{name}: non-finite values"
        assert_scaled_close(a, b, case["natural"][name], dtype, name, bound=bound)


# ----------------------------------------------------------------------------------------- 5. memory layouts
LAYOUTS = ["C", "F", "permuted", "reversed", "strided", "unaligned", "readonly", "readonly-F"]


def relayout(x, how, rng):
    """An array equal to ``x`` with another memory layout: Fortran order, permuted axes, negative strides,
    every other element of a larger buffer, an unaligned buffer, read-only."""
    if x.ndim == 0 or how == "C":
        y = np.ascontiguousarray(x)
    elif how in ("F", "readonly-F"):
        y = np.asfortranarray(x)
    elif how == "permuted":
        perm = rng.permutation(x.ndim)
        y = np.ascontiguousarray(x.transpose(perm)).transpose(np.argsort(perm))
    elif how == "reversed":
        flip = tuple(slice(None, None, -1) for _ in range(x.ndim))
        y = np.ascontiguousarray(x[flip])[flip]
    elif how == "strided":
        big = np.zeros(tuple(2 * n + 1 for n in x.shape), x.dtype)
        y = big[tuple(slice(1, None, 2) for _ in range(x.ndim))]
        y[...] = x
    elif how == "unaligned":
        buf = np.zeros(x.nbytes + 1, np.uint8)
        y = np.ndarray(x.shape, x.dtype, buffer=buf, offset=1)
        y[...] = x
    else:
        y = x.copy()
    if how.startswith("readonly"):
        y.flags.writeable = False
    assert np.array_equal(x, y)
    return y


def check_layouts(run, arrays, layouts, dtype, what):
    """``run(*arrays)`` on arrays in ``layouts`` equals ``run`` on C-contiguous copies (or, with an unaligned
    array, raises ValueError saying so: attnpp's bindings refuse those); no input modified."""
    rng = np.random.default_rng(0)
    contiguous = [None if a is None else np.ascontiguousarray(a) for a in arrays]
    odd = [None if a is None else relayout(a, how, rng) for a, how in zip(arrays, layouts)]
    saved = [None if a is None else a.copy() for a in odd]
    expected = run(*contiguous)
    try:
        got = run(*odd)
    except ValueError as e:  # attnpp refuses unaligned arrays (bindings), naming the argument
        if "unaligned" not in layouts or "aligned" not in str(e):
            raise
        note(f"{what}: unaligned input refused: {e}")
        got = None
    for i, (a, s) in enumerate(zip(odd, saved)):
        if a is not None:
            assert np.array_equal(a, s), f"{what}: input {i} ({layouts[i]}) was modified"
    for i, (a, b) in enumerate(zip(got or [], expected)):
        if b is None:
            assert a is None
        else:
            assert_matches(a, b, dtype, f"{what}: result {i}")


@settings(max_examples=examples(60))
@given(case=sdpa_cases(max_size=20, big=False), data=st.data())
def test_sdpa_memory_layouts(case, data):
    """Query, key, value, attn_mask, grad_output, output and log-sum-exp in Fortran order, permuted, with
    negative strides, strided, read-only (or unaligned: equal results or a ValueError saying so): the forward,
    backward and weights equal those of contiguous copies, and no input is modified."""
    count("test_sdpa_memory_layouts")
    q, k, v, g, kw, dtype = (case[n] for n in ("q", "k", "v", "g", "kw", "dtype"))
    mask = kw.get("attn_mask")
    rest = {n: x for n, x in kw.items() if n != "attn_mask"}
    layouts = data.draw(st.lists(st.sampled_from(LAYOUTS), min_size=7, max_size=7), label="layouts")
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)

    def forward(q, k, v, mask, qw):
        o, s, _ = AF.scaled_dot_product_attention_forward(q, k, v, attn_mask=mask, **rest)
        return [o, s, AF.scaled_dot_product_attention_weights(qw, k, attn_mask=mask, **rest)]

    def backward(q, k, v, mask, g, out, lse):
        return AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, attn_mask=mask, **rest)

    check_layouts(forward, [q, k, v, mask, expanded_query(case)], layouts[:5], dtype, "forward")
    check_layouts(backward, [q, k, v, mask, g, out, lse], layouts, dtype, "backward")


# ------------------------------------------------------------------------------------ 6. MultiheadAttention
@st.composite
def mha_cases(draw, fully_masked=False):
    """A random MultiheadAttention configuration, inputs and forward arguments. Without ``fully_masked`` key 0
    stays visible to every query; with it a key_padding_mask is drawn, entire rows may be masked, and
    need_weights is False."""
    dtype = draw(st.sampled_from(DTYPES))
    H = draw(st.integers(1, 4))
    E = H * draw(st.integers(1, 5))
    kdim, vdim = (draw(st.one_of(st.none(), st.integers(1, 9))) for _ in range(2))
    options = dict(embed_dim=E, num_heads=H, bias=draw(st.booleans()), add_bias_kv=draw(st.booleans()),
                   add_zero_attn=draw(st.booleans()), kdim=kdim, vdim=vdim, batch_first=draw(st.booleans()))
    if fully_masked:  # extra keys would always be visible
        options.update(add_bias_kv=False, add_zero_attn=False)
    batched = draw(st.booleans())
    B, L, S = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    if draw(st.integers(0, 9)) == 9:
        B, L, S = 1, draw(st.sampled_from(BIG_SIZES)), draw(st.sampled_from(BIG_SIZES))
    same_input = kdim in (None, E) and vdim in (None, E) and draw(st.booleans())
    if same_input:
        S = L
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)

    def x(T, width):
        shape = ((B, T) if options["batch_first"] else (T, B)) if batched else (T,)
        return rng.standard_normal(shape + (width,)).astype(dtype)

    q = x(L, E)
    k, v = (q, q) if same_input else (x(S, kdim or E), x(S, vdim or E))
    fkw = dict(need_weights=draw(st.booleans()), average_attn_weights=draw(st.booleans()))
    kpm_kind = draw(st.sampled_from(["bool", "float"] if fully_masked else ["none", "bool", "float"]))
    am_kind = draw(st.sampled_from(["none", "2d-bool", "2d-float", "3d-bool", "3d-float", "causal-bool",
                                    "causal-float"]))
    p_hidden = draw(st.sampled_from([0.2, 0.5, 0.9] + ([1.0] if fully_masked else [])))

    def hidden(shape):
        h = rng.random(shape) < p_hidden
        if not fully_masked:
            h[..., 0] = False  # key 0 visible everywhere: no fully masked row (PyTorch gives NaN there)
        return h

    def as_kind(h, kind, shape):
        return h if kind.endswith("bool") else np.where(h, -np.inf, rng.standard_normal(shape)).astype(dtype)

    if kpm_kind != "none":
        shape = (B, S) if batched else (S,)
        fkw["key_padding_mask"] = as_kind(hidden(shape), kpm_kind, shape)
    if am_kind.startswith("causal"):  # the causal mask itself, so that is_causal may hint at it
        causal = np.triu(np.ones((L, S), bool), 1)
        fkw["attn_mask"] = causal if am_kind.endswith("bool") else np.where(causal, -np.inf, 0.0).astype(dtype)
        fkw["is_causal"] = draw(st.booleans())
    elif am_kind != "none":
        shape = (L, S) if am_kind.startswith("2d") else ((B * H, L, S) if batched else (H, L, S))
        fkw["attn_mask"] = as_kind(hidden(shape), am_kind, shape)
    if fully_masked:
        fkw["need_weights"] = False
    note(f"dtype={dtype} options={options} batched={batched} B={B} L={L} S={S} same_input={same_input} "
         f"kpm={kpm_kind} attn_mask={am_kind} p_hidden={p_hidden} "
         f"{ {n: x for n, x in fkw.items() if 'mask' not in n} } seed={seed}")
    return Case(dtype=dtype, options=options, q=q, k=k, v=v, fkw=fkw, same_input=same_input, seed=seed)


def torch_mha_run(ref, case, g, dtype=None):
    """PyTorch's layer ``ref`` on the case's inputs (cast to ``dtype``, default theirs), backward of ``g``:
    (output, weights or None, input grads, {parameter name: grad})."""
    tq = T(case["q"], True, dtype)
    tk, tv = (tq, tq) if case["same_input"] else (T(case["k"], True, dtype), T(case["v"], True, dtype))
    ty, tw = ref(tq, tk, tv, **torch_kw(case["fkw"], dtype))
    (ty * T(g, dtype=dtype)).sum().backward()
    grads = [tq.grad.numpy()] if case["same_input"] else [t.grad.numpy() for t in (tq, tk, tv)]
    return (ty.detach().numpy(), None if tw is None else tw.detach().numpy(), grads,
            {n: p.grad.numpy() for n, p in ref.named_parameters()})


def run_mha_pair(case):
    """attnpp's (output, weights, input grads, parameter grads) after a backward of a random grad_output, and
    the references: PyTorch's layer with the same weights in float64 (the reference) and, for float32, in float32
    (its own error sets the float32 bound); and the attnpp layer."""
    dtype, fkw = case["dtype"], case["fkw"]
    mha, ref = make_mha(dtype, case["seed"], std=0.5, training=False, **case["options"])
    y, w = mha(case["q"], case["k"], case["v"], **fkw)
    g = np.random.default_rng(case["seed"] + 1).standard_normal(y.shape).astype(dtype)
    grads = mha.backward(g)
    grads = [sum(grads)] if case["same_input"] else list(grads)
    ours = (y, w, grads, {n: p.grad for n, p in mha.named_parameters()})
    if dtype is np.float64:
        return ours, torch_mha_run(ref, case, g), None, mha
    ref64 = torch_mha_run(copy.deepcopy(ref).double(), case, g, torch.float64)
    return ours, ref64, torch_mha_run(ref, case, g), mha


def assert_layer_matches(ours, ref, ref32, dtype, names):
    """(output, weights, input grads, parameter grads) of a layer against the reference (and PyTorch's float32
    result), as assert_matches; the parameters by name, in PyTorch's order."""
    (y, w, grads, pgrads), (ty, tw, tgrads, tpgrads) = ours, ref
    r32 = ref32 if ref32 is not None else (None, None, [None] * len(tgrads), {})
    assert_matches(y, ty, dtype, "output", r32[0])
    assert (w is None) == (tw is None)
    if tw is not None and "weights" in names:
        assert_matches(w, tw, dtype, "weights", r32[1])
    assert len(grads) == len(tgrads)
    for i, (a, b, c) in enumerate(zip(grads, tgrads, r32[2])):
        assert_matches(a, b, dtype, f"input grad {i}", c)
    assert list(pgrads) == list(tpgrads), f"parameters {list(pgrads)} != PyTorch's {list(tpgrads)}"
    for name in tpgrads:
        assert_matches(pgrads[name], tpgrads[name], dtype, f"grad of {name}", r32[3].get(name))


@settings(max_examples=examples(120))
@given(case=mha_cases())
def test_mha_matches_torch(case):
    """attnpp.nn.MultiheadAttention equals torch.nn.MultiheadAttention with the same weights (eval mode):
    random widths, heads, kdim/vdim, bias, add_bias_kv, add_zero_attn, batch_first, batched or not,
    key_padding_mask and attn_mask (2-D and 3-D, bool and float), is_causal, need_weights with
    average_attn_weights: output, weights, input gradients and every parameter gradient. float64 within 1e-10;
    float32 within 1e-5 of PyTorch in float64 (same weights), or within 4x of PyTorch's own float32 error where
    cancellation makes that larger."""
    count("test_mha_matches_torch")
    ours, ref, ref32, _ = run_mha_pair(case)
    assert_layer_matches(ours, ref, ref32, case["dtype"], ("weights",))


@settings(max_examples=examples(40))
@given(case=mha_cases(fully_masked=True))
def test_mha_fully_masked_rows(case):
    """Rows whose keys are all masked (key_padding_mask and attn_mask together): attnpp equals PyTorch's
    need_weights=False path (scaled_dot_product_attention: attention output 0, gradient 0), and with
    need_weights=True gives the same output and all-zero weights on those rows, never NaN (tolerances as
    test_mha_matches_torch)."""
    count("test_mha_fully_masked_rows")
    dtype = case["dtype"]
    ours, ref, ref32, mha = run_mha_pair(case)
    assert_layer_matches(ours, ref, ref32, dtype, ())
    y = ours[0]
    fkw = dict(case["fkw"], need_weights=True, average_attn_weights=False)
    y2, w2 = mha(case["q"], case["k"], case["v"], **fkw)
    assert not np.isnan(y2).any() and not np.isnan(w2).any()
    np.testing.assert_array_equal(y2, y)
    assert_close(w2.sum(-1), np.where(w2.max(-1) > 0, 1.0, 0.0), dtype, "weight rows sum to 1 or are all 0")


# ------------------------------------------------------------------------------ 7. the articles' Attention layer
@st.composite
def attention_cases(draw):
    """A random attnpp.nn.Attention configuration (eval or training with dropout), inputs and mask."""
    dtype = draw(st.sampled_from(DTYPES))
    H = draw(st.integers(1, 4))
    cfg = dict(num_heads=H)
    if draw(st.booleans()):
        cfg["embed_dim"] = draw(st.integers(1, 10))
        cfg["qk_dim"] = H * draw(st.integers(1, 5))
    else:
        cfg["embed_dim"] = H * draw(st.integers(1, 4))   # qk_dim defaults to embed_dim
    if draw(st.booleans()):
        cfg["v_dim"] = H * draw(st.integers(1, 5))
    cross = draw(st.booleans())
    if cross and draw(st.booleans()):
        cfg["kv_dim"] = draw(st.integers(1, 9))
    cfg["out_proj"] = draw(st.booleans())
    if cfg["out_proj"]:
        cfg["out_dim"] = draw(st.one_of(st.none(), st.integers(1, 9)))
        cfg["out_bias"] = draw(st.one_of(st.none(), st.booleans()))
    cfg["bias"] = draw(st.booleans())
    cfg["causal"] = draw(st.booleans())
    cfg["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):  # a factor around the default 1 / sqrt(head width)
        cfg["scale"] = draw(st.floats(-2.0, 2.0)) / math.sqrt(cfg.get("qk_dim", cfg["embed_dim"]) // H)
    training = draw(st.booleans())
    if training:
        cfg["attn_dropout"], cfg["out_dropout"] = (draw(st.sampled_from([0.0, 0.3])) for _ in range(2))
    batched = draw(st.booleans())
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    S = draw(st.integers(1, 9)) if cross else L
    if draw(st.integers(0, 9)) == 9:
        B, L = 1, draw(st.sampled_from(BIG_SIZES))
        S = draw(st.sampled_from(BIG_SIZES)) if cross else L
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lead = (B,) if batched else ()
    x = rng.standard_normal(lead + (L, cfg["embed_dim"])).astype(dtype)
    context = rng.standard_normal(lead + (S, cfg.get("kv_dim", cfg["embed_dim"]))).astype(dtype) if cross else None
    kpm_kind = draw(st.sampled_from(["none", "bool", "float"]))
    kpm = None
    if kpm_kind != "none":
        h = rng.random(lead + (S,)) < draw(st.sampled_from([0.2, 0.6, 1.0]))
        kpm = h if kpm_kind == "bool" else np.where(h, -np.inf, rng.standard_normal(h.shape)).astype(dtype)
    need_weights = draw(st.booleans())
    note(f"dtype={dtype} cfg={cfg} training={training} cross={cross} batched={batched} B={B} L={L} S={S} "
         f"kpm={kpm_kind} need_weights={need_weights} seed={seed}")
    return Case(dtype=dtype, cfg=cfg, training=training, x=x, context=context, kpm=kpm, need_weights=need_weights,
                seed=seed)


@settings(max_examples=examples(120))
@given(case=attention_cases())
def test_attention_layer_matches_torch(case):
    """attnpp.nn.Attention (the layer behind the five articles' classes) equals its math written in PyTorch:
    random widths and heads, causal top_left / bottom_right, self- or cross-attention with S != L, bool or float
    key_padding_mask (fully masked rows included), out_proj on or off, scale, dropout replayed from the seed,
    batched or not: output, weights, input gradients and every parameter gradient (tolerances as
    test_mha_matches_torch: float32 against the same math in float64, within 1e-5 or 4x PyTorch's own float32
    error)."""
    count("test_attention_layer_matches_torch")
    dtype, cfg, x, context, kpm = (case[n] for n in ("dtype", "cfg", "x", "context", "kpm"))
    layer = attnpp.nn.Attention(dtype=dtype, **cfg).train(case["training"])
    rng = np.random.default_rng(case["seed"] + 1)
    for p in layer.parameters():
        p.data[...] = rng.standard_normal(p.data.shape) * 0.5
    result = layer(x, context, key_padding_mask=kpm, need_weights=case["need_weights"], seed=case["seed"])
    out, weights = result if case["need_weights"] else (result, None)
    batched = x.ndim == 3
    x3 = x if batched else x[None]
    c3 = None if context is None else (context if batched else context[None])
    kpm3 = kpm if kpm is None or batched else kpm[None]
    B, L, S = x3.shape[0], x3.shape[1], (x3 if c3 is None else c3).shape[1]
    keep_attn = keep_out = None
    if case["training"] and layer.attn_dropout > 0:
        keep_attn = AF.dropout_mask((B, layer.num_heads, L, S), layer.attn_dropout, layer.last_seed)
    if case["training"] and layer.out_drop.p > 0:
        keep_out = AF.dropout_mask((B, L, layer.out_dim), layer.out_drop.p, layer.out_drop.last_seed)
    g = rng.standard_normal(out.shape).astype(dtype)
    grads = layer.backward(g)
    grads = [grads] if c3 is None else list(grads)
    unb = (lambda a: a) if batched else (lambda a: a[0])

    def reference(tdtype):
        tx = T(x3, True, tdtype)
        tc = tx if c3 is None else T(c3, True, tdtype)
        tout, tw, P = torch_attention(layer, tx, tc, kpm3, keep_attn, keep_out, tdtype)
        (tout * T(g if batched else g[None], dtype=tdtype)).sum().backward()
        tgrads = [unb(t.grad.numpy()) for t in ((tx,) if c3 is None else (tx, tc))]
        return (unb(tout.detach().numpy()), unb(tw.detach().numpy()), tgrads,
                {n: t.grad.numpy() for n, t in P.items()})

    drop_weights = lambda r: r if weights is not None else (r[0], None) + r[2:]   # need_weights=False
    ref = drop_weights(reference(torch.float64))
    ref32 = drop_weights(reference(None)) if dtype is np.float32 else None
    ours = (out, weights, grads, {n: p.grad for n, p in layer.named_parameters()})
    assert_layer_matches(ours, ref, ref32, dtype, ("weights",))


# ---------------------------------------------------------------------------------- 5 (layers). memory layouts
@settings(max_examples=examples(30))
@given(mcase=mha_cases(), acase=attention_cases(), data=st.data())
def test_layers_memory_layouts(mcase, acase, data):
    """MultiheadAttention and Attention given inputs, masks and grad_output in Fortran order, permuted, with
    negative strides, strided, read-only (or unaligned: equal results or a ValueError saying so): outputs and
    every gradient equal those for contiguous copies, and no input is modified."""
    count("test_layers_memory_layouts")
    layouts = data.draw(st.lists(st.sampled_from(LAYOUTS), min_size=6, max_size=6), label="layouts")
    dtype, fkw = mcase["dtype"], dict(mcase["fkw"])
    mha, _ = make_mha(dtype, mcase["seed"], std=0.5, training=False, **mcase["options"])
    masks = {n: fkw.pop(n, None) for n in ("key_padding_mask", "attn_mask")}
    y, _ = mha(mcase["q"], mcase["k"], mcase["v"], **fkw, **masks)
    g = np.ones_like(y)
    mha.backward(g)

    def run_mha(q, k, v, kpm, am, g):
        mha.zero_grad()
        y, w = mha(q, k, v, key_padding_mask=kpm, attn_mask=am, **fkw)
        grads = mha.backward(g)
        return [y, w, *grads] + [p.grad.copy() for p in mha.parameters()]

    check_layouts(run_mha, [mcase["q"], mcase["k"], mcase["v"], masks["key_padding_mask"], masks["attn_mask"], g],
                  layouts, dtype, "MultiheadAttention")

    dtype, cfg = acase["dtype"], acase["cfg"]
    layer = attnpp.nn.Attention(dtype=dtype, **cfg).train(acase["training"])
    x, context, kpm = acase["x"], acase["context"], acase["kpm"]
    g = np.ones_like(layer(x, context, key_padding_mask=kpm, seed=1))
    layer.backward(g)

    def run_attention(x, context, kpm, g):
        layer.zero_grad()
        out, w = layer(x, context, key_padding_mask=kpm, need_weights=True, seed=1)
        grads = layer.backward(g)
        grads = list(grads) if context is not None else [grads]
        return [out, w, *grads] + [p.grad.copy() for p in layer.parameters()]

    check_layouts(run_attention, [x, context, kpm, g], layouts[:4], dtype, "Attention")
