"""Parity of the attention variants (sliding window, ALiBi, soft-capping, sinks, packed sequences, KV cache) with
a PyTorch reference written from their definitions with dense masks and biases (``reference`` in helpers.py, which
states the definitions), in float64: the output, the log-sum-exp and every gradient (autograd through the
reference), over shapes and combinations of options drawn by hypothesis.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import attnpp.functional as AF
from helpers import HYPOTHESIS_EXAMPLES, TOL, assert_close, examples, reference


def to_torch(*arrays):
    return [None if a is None else torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)
            for a in arrays]


def check(name, ours, ref, dtype):
    """assert_close; -inf (a log-sum-exp of rows that see nothing) must stand at the same places."""
    ref = np.asarray(ref.detach().numpy() if torch.is_tensor(ref) else ref, dtype=np.float64)
    ours = np.asarray(ours, dtype=np.float64)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(ref), err_msg=f"{name}: -inf entries")
    finite = ~np.isneginf(ref)
    assert_close(ours[finite], ref[finite], dtype, name)


@st.composite
def variant_cases(draw, dtypes=(np.float64, np.float32)):
    B = draw(st.integers(1, 2))
    Hk = draw(st.integers(1, 2))
    Hq = Hk * draw(st.sampled_from([1, 2, 4]))
    L = draw(st.sampled_from([1, 2, 5, 17, 64, 130, 300]))
    S = draw(st.sampled_from([1, 3, 16, 64, 129, 257, 400]))
    D = draw(st.sampled_from([4, 8, 16]))
    Dv = draw(st.sampled_from([D, 5]))
    w = st.sampled_from([-1, 0, 1, 3, 40, 130, 500])
    case = dict(dtype=draw(st.sampled_from(dtypes)), shapes=((B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, Dv)),
                seed=draw(st.integers(0, 2**32 - 1)), kw={})
    kw = case["kw"]
    causal = draw(st.sampled_from([None, "top_left", "bottom_right"]))
    if causal:
        kw["is_causal"], kw["causal_alignment"] = True, causal
    if draw(st.booleans()):
        kw["window"] = (draw(w), draw(w))
    if draw(st.booleans()):
        kw["alibi_slopes"] = ("batch" if draw(st.booleans()) else "heads")
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = True
    if not causal and draw(st.integers(0, 3)) == 0:
        kw["attn_mask"] = draw(st.sampled_from(["bool", "float"]))
    if draw(st.integers(0, 3)) == 0:
        kw["dropout_p"] = 0.3
    return case


def materialize(case):
    """The case's arrays (NumPy, of its dtype) and keyword arguments for attnpp and for the reference."""
    rng = np.random.default_rng(case["seed"])
    dtype, kw = case["dtype"], dict(case["kw"])
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in case["shapes"])
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    extra = {}
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = AF.get_alibi_slopes(Hq, np.float64) * 4
    elif kw.get("alibi_slopes") == "batch":
        kw["alibi_slopes"] = rng.uniform(0, 1, (B, Hq))
    if kw.pop("sinks", None):
        kw["sinks"] = rng.standard_normal(Hq).astype(dtype)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = rng.random((L, S)) < 0.8
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = rng.standard_normal((B, 1, L, S)).astype(dtype)
    if kw.get("dropout_p"):
        kw["seed"] = int(rng.integers(0, 2**31))
        extra["keep"] = torch.tensor(AF.dropout_mask((B, Hq, L, S), kw["dropout_p"], kw["seed"]))
    return q, k, v, kw, extra


def reference_kw(kw, extra):
    ref = {n: kw[n] for n in ("is_causal", "causal_alignment", "window", "softcap", "dropout_p") if n in kw}
    if "alibi_slopes" in kw:
        ref["alibi_slopes"] = torch.tensor(np.asarray(kw["alibi_slopes"], dtype=np.float64))
    if "attn_mask" in kw:
        ref["attn_mask"] = torch.tensor(np.asarray(kw["attn_mask"], dtype=None if kw["attn_mask"].dtype == bool
                                                   else np.float64))
    return {**ref, **extra}


def run_case(case, test_name):
    HYPOTHESIS_EXAMPLES[test_name] += 1
    note(repr(case))
    q, k, v, kw, extra = materialize(case)
    dtype = case["dtype"]
    gqa = q.shape[1] != k.shape[1]
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, enable_gqa=gqa, **kw)
    grad_out = np.random.default_rng(case["seed"] + 1).standard_normal(out.shape).astype(dtype)
    grads = AF.scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse, enable_gqa=gqa, **kw)
    tq, tk, tv, ts = to_torch(q, k, v, kw.get("sinks"))
    ref_out, ref_lse = reference(tq, tk, tv, sinks=ts, **reference_kw(kw, extra))
    (ref_out * torch.tensor(grad_out, dtype=torch.float64)).sum().backward()
    check("output", out, ref_out, dtype)
    check("logsumexp", lse, ref_lse, dtype)
    for name, ours, t in zip(("grad_query", "grad_key", "grad_value", "grad_sinks"), grads, (tq, tk, tv, ts)):
        check(name, ours, t.grad, dtype)
    assert len(grads) == (4 if ts is not None else 3)
    return q, k, v, kw, extra, lse


@settings(max_examples=examples(150))
@given(case=variant_cases())
def test_variants_match_reference(case):
    """Forward, log-sum-exp and every gradient (sinks' included) of any combination of the options."""
    run_case(case, "test_variants_match_reference")


@settings(max_examples=examples(40))
@given(case=variant_cases(dtypes=(np.float64,)))
def test_variant_weights_match_reference(case):
    """scaled_dot_product_attention_weights: the reference's weights (after dropout), the sink's share left out."""
    HYPOTHESIS_EXAMPLES["test_variant_weights_match_reference"] += 1
    q, k, v, kw, extra = materialize(case)
    gqa = q.shape[1] != k.shape[1]
    weights = AF.scaled_dot_product_attention_weights(q, k, enable_gqa=gqa, **kw)
    B, Hq, L, S = weights.shape
    eye = torch.eye(S, dtype=torch.float64).expand(B, k.shape[1], S, S)  # values = identity: out = weights
    tq, tk, ts = to_torch(q, k, kw.get("sinks"))
    ref, _ = reference(tq, tk, eye, sinks=ts, **reference_kw(kw, extra))
    check("weights", weights, ref, np.float64)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L,S", [(1, 1), (300, 300), (40, 700), (700, 40)])
def test_window_equals_dense_bool_mask(rng, dtype, L, S):
    """A causal sliding window equals SDPA with the same window as a dense bool mask (PyTorch's own kernel)."""
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(dtype) for n in (L, S, S))
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    mask = (j <= i + S - L) & (j >= i + S - L - 33)
    ours = AF.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                           window=(33, 0))
    theirs = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v)),
                                                              attn_mask=torch.tensor(mask))
    # (rows that see nothing: attnpp 0, PyTorch's math NaN or 0 depending on the backend)
    assert_close(ours, np.nan_to_num(theirs.numpy()), dtype, "output")


def test_alibi_slopes_helper():
    """The paper's slopes: 1/2 ... 1/256 for 8 heads; for 12, those of 8 then every other one of 16."""
    np.testing.assert_allclose(AF.get_alibi_slopes(8, np.float64), 2.0 ** -np.arange(1, 9))
    s16 = 2.0 ** (-0.5 * np.arange(1, 17))
    np.testing.assert_allclose(AF.get_alibi_slopes(12, np.float64), np.r_[2.0 ** -np.arange(1, 9), s16[0::2][:4]])
    assert AF.get_alibi_slopes(5).dtype == np.float32


# ---------------------------------------------------------------------------------------------- packed sequences
@st.composite
def varlen_cases(draw):
    case = draw(variant_cases())
    case["kw"].pop("attn_mask", None)
    (B, Hq, _, D), (_, Hk, _, _), (_, _, _, Dv) = case["shapes"]
    n = draw(st.integers(1, 4))
    case["lengths_q"] = draw(st.lists(st.sampled_from([0, 1, 5, 37, 130, 300]), min_size=n, max_size=n))
    case["lengths_k"] = draw(st.lists(st.sampled_from([0, 1, 7, 64, 200, 301]), min_size=n, max_size=n))
    case["heads"] = (Hq, Hk, D, Dv)
    if case["kw"].get("alibi_slopes") == "batch":
        case["kw"]["alibi_slopes"] = "heads"
    return case


@settings(max_examples=examples(60))
@given(case=varlen_cases())
def test_varlen_matches_each_sequence(case):
    """Packed sequences: each sequence's output and gradients are the reference's on that sequence alone."""
    HYPOTHESIS_EXAMPLES["test_varlen_matches_each_sequence"] += 1
    note(repr(case))
    rng = np.random.default_rng(case["seed"])
    dtype, (Hq, Hk, D, Dv) = case["dtype"], case["heads"]
    lq, lk = case["lengths_q"], case["lengths_k"]
    cu_q, cu_k = np.r_[0, np.cumsum(lq)], np.r_[0, np.cumsum(lk)]
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hk, D)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hk, Dv)).astype(dtype)
    kw = dict(case["kw"])
    kw.pop("dropout_p", None)  # (dropout: test_varlen_dropout)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = AF.get_alibi_slopes(Hq, np.float64)
    if kw.pop("sinks", None):
        kw["sinks"] = rng.standard_normal(Hq).astype(dtype)
    out, lse, _ = AF.scaled_dot_product_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grads = AF.scaled_dot_product_attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, **kw)
    tq, tk, tv, ts = to_torch(q, k, v, kw.get("sinks"))
    ref_kw = reference_kw(kw, {})
    outs, lses = [], []
    for b in range(len(lq)):
        qs, ks, vs = (t[c[b]:c[b + 1]].transpose(0, 1)[None] for t, c in ((tq, cu_q), (tk, cu_k), (tv, cu_k)))
        o, l_ = reference(qs, ks, vs, sinks=ts, **ref_kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(l_[0])
    ref_out, ref_lse = torch.cat(outs), torch.cat(lses, dim=1)
    (ref_out * torch.tensor(grad_out, dtype=torch.float64)).sum().backward()
    check("output", out, ref_out, dtype)
    check("logsumexp", lse, ref_lse, dtype)
    for name, ours, t in zip(("grad_query", "grad_key", "grad_value", "grad_sinks"), grads, (tq, tk, tv, ts)):
        check(name, ours, t.grad if t.grad is not None else torch.zeros_like(t), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_varlen_equals_padded_batch(rng, dtype):
    """Sequences of equal lengths packed give the batched call's results, dropout included (same mask)."""
    B, H, L, D = 3, 4, 37, 8
    q, k, v = (rng.standard_normal((B, H, L, D)).astype(dtype) for _ in range(3))
    kw = dict(is_causal=True, dropout_p=0.2, seed=7, window=(10, -1))
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    pack = lambda x: x.transpose(0, 2, 1, 3).reshape(B * L, H, -1)
    cu = np.arange(B + 1) * L
    out_p, lse_p, _ = AF.scaled_dot_product_attention_varlen_forward(pack(q), pack(k), pack(v), cu, cu, **kw)
    np.testing.assert_array_equal(out_p, pack(out))
    np.testing.assert_array_equal(lse_p, lse.transpose(1, 0, 2).reshape(H, B * L))
    g = rng.standard_normal(out.shape).astype(dtype)
    grads = AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, **kw)
    grads_p = AF.scaled_dot_product_attention_varlen_backward(pack(g), pack(q), pack(k), pack(v), out_p, lse_p,
                                                              cu, cu, **kw)
    for ours, theirs in zip(grads_p, grads):
        np.testing.assert_allclose(ours, pack(theirs), rtol=0, atol=TOL[dtype])


# --------------------------------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("options", [{}, {"window": (4, 0)}, {"softcap": 2.0, "sinks": True},
                                     {"alibi_slopes": True}, {"is_causal": False}])
def test_kvcache_step_matches_reference(rng, dtype, new, options):
    """A decoding step: the new keys land in the cache at each sequence's length (the rest of the cache is left
    untouched), and the output is the reference's over the filled prefix, causal bottom-right."""
    B, Hq, Hk, D, Dv, S_max = 3, 4, 2, 8, 6, 20
    lengths = np.array([0, 5, 17 - new])
    q = rng.standard_normal((B, Hq, new, D)).astype(dtype)
    kc = rng.standard_normal((B, Hk, S_max, D)).astype(dtype)
    vc = rng.standard_normal((B, Hk, S_max, Dv)).astype(dtype)
    k_new = rng.standard_normal((B, Hk, new, D)).astype(dtype)
    v_new = rng.standard_normal((B, Hk, new, Dv)).astype(dtype)
    kw = dict(options)
    if kw.pop("sinks", None):
        kw["sinks"] = rng.standard_normal(Hq).astype(dtype)
    if kw.pop("alibi_slopes", None):
        kw["alibi_slopes"] = AF.get_alibi_slopes(Hq)
    kc0, vc0 = kc.copy(), vc.copy()
    out = AF.scaled_dot_product_attention_with_kvcache(q, kc, vc, lengths, k_new, v_new, **kw)
    for b, s in enumerate(lengths):
        np.testing.assert_array_equal(kc[b, :, s:s + new], k_new[b])
        np.testing.assert_array_equal(vc[b, :, s:s + new], v_new[b])
        untouched = lambda c: np.delete(c[b], np.s_[s:s + new], axis=1)
        np.testing.assert_array_equal(untouched(kc), untouched(kc0))
        S = s + new
        ref_kw = {"is_causal": kw.get("is_causal", True), "causal_alignment": "bottom_right"}
        ref_kw.update({n: kw[n] for n in ("window", "softcap") if n in kw})
        if "alibi_slopes" in kw:
            ref_kw["alibi_slopes"] = torch.tensor(kw["alibi_slopes"], dtype=torch.float64)
        tq, tk, tv, ts = to_torch(q[b:b + 1], kc[b:b + 1, :, :S], vc[b:b + 1, :, :S], kw.get("sinks"))
        ref, _ = reference(tq, tk, tv, sinks=ts, **ref_kw)
        check(f"output[{b}]", out[b:b + 1], ref, dtype)


def test_kvcache_takes_one_length_for_every_sequence(rng):
    """cache_seqlens as a plain int (or a 0-d array): the same length for every sequence."""
    q = rng.standard_normal((2, 2, 1, 4))
    kc, vc = rng.standard_normal((2, 2, 6, 4)), rng.standard_normal((2, 2, 6, 4))
    out = AF.scaled_dot_product_attention_with_kvcache(q, kc.copy(), vc.copy(), 3, q, q)
    np.testing.assert_array_equal(
        out, AF.scaled_dot_product_attention_with_kvcache(q, kc.copy(), vc.copy(), np.array([3, 3]), q, q))


def test_kvcache_refuses_a_full_cache(rng):
    q = rng.standard_normal((1, 2, 2, 4))
    kc, vc = np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 4))
    k, v = rng.standard_normal((1, 2, 2, 4)), rng.standard_normal((1, 2, 2, 4))
    with pytest.raises(ValueError, match="cache_seqlens"):
        AF.scaled_dot_product_attention_with_kvcache(q, kc, vc, np.array([4]), k, v)
    assert not kc.any()  # nothing written


# ------------------------------------------------------------------------------------------------ bad options
@pytest.mark.parametrize("kw,error,match", [
    (dict(window=(1, -2)), ValueError, r"window\[1\] must be >= -1"),
    (dict(window=3), TypeError, "window"),
    (dict(window=(1.5, 0)), TypeError, r"window\[0\]"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones(2, dtype=np.int64)), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=np.array([0.5, np.nan])), ValueError, "alibi_slopes: expected finite slopes"),
    (dict(sinks=np.ones(3)), ValueError, "sinks"),
    (dict(sinks=np.ones(2, dtype=np.float32)), TypeError, "sinks"),
])
def test_bad_options(rng, kw, error, match):
    q = rng.standard_normal((1, 2, 3, 4))
    with pytest.raises(error, match=match):
        AF.scaled_dot_product_attention(q, q, q, **kw)


@pytest.mark.parametrize("cu_q,cu_k,match", [
    ([0, 2, 5], [0, 5], "same number of sequences"),
    ([0, 3, 2, 5], [0, 1, 2, 5], "cu_seqlens_q"),
    ([1, 5], [0, 5], "cu_seqlens_q"),
    ([0, 4], [0, 5], "cu_seqlens_q"),
])
def test_varlen_bad_offsets(rng, cu_q, cu_k, match):
    q = rng.standard_normal((5, 2, 4))
    with pytest.raises(ValueError, match=match):
        AF.scaled_dot_product_attention_varlen(q, q, q, np.array(cu_q), np.array(cu_k))


def test_reference_gradients_of_a_row_that_sees_no_key_are_zero():
    """attnpp.testing.reference's gradients where a query row sees no key are 0 (logsumexp's own gradient of a row
    of -inf is NaN, which reached dk and dv too), as attnpp's backward gives them; the rest equal attnpp's."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(s) for s in ((1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 2), (1, 2, 4, 2)))
    keep = rng.random((4, 5)) < 0.7
    keep[1] = False  # row 1 sees nothing
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out, _ = reference(tq, tk, tv, attn_mask=torch.where(torch.tensor(keep), 0.0, -torch.inf).double())
    (out * torch.tensor(g)).sum().backward()
    ours = AF.scaled_dot_product_attention_backward(g, q, k, v, *AF.scaled_dot_product_attention_forward(
        q, k, v, attn_mask=keep)[:2], attn_mask=keep)
    for name, t, o in zip(("dq", "dk", "dv"), (tq, tk, tv), ours):
        assert torch.isfinite(t.grad).all(), name
        np.testing.assert_allclose(t.grad.numpy(), o, rtol=1e-10, atol=1e-12, err_msg=name)
    assert not tq.grad[0, :, 1].any()


def test_sinks_as_accurate_as_pytorch_flash_kernel(rng):
    """float32 attention's output with sinks is as accurate as PyTorch's CPU flash kernel's on the same call, the
    sink given to it as one more key of zeros whose mask holds the sink's logit: its mean error against float64 at
    most 1.25 times the kernel's (it was twice, when the output was normalized by exp(logsumexp of the keys -
    logsumexp with the sink), two roundings of log-sum-exps)."""
    B, H, L, S, D = 64, 2, 8, 8, 8
    q, k, v = (2 * rng.standard_normal((B, H, n, D)).astype(np.float32) for n in (L, S, S))
    sinks = rng.standard_normal(H).astype(np.float32)

    def flash(dtype):  # the output with the sink as a key, by the flash kernel (by the math in float64)
        tq, tk, tv = (torch.tensor(a, dtype=dtype) for a in (q, k, v))
        zeros = torch.zeros(B, H, 1, D, dtype=dtype)
        mask = torch.zeros(B, H, L, S + 1, dtype=dtype)
        mask[..., S] = torch.tensor(sinks, dtype=dtype)[None, :, None]
        backend = torch.nn.attention.SDPBackend.MATH if dtype == torch.float64 else \
            torch.nn.attention.SDPBackend.FLASH_ATTENTION
        with torch.nn.attention.sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(tq, torch.cat([tk, zeros], 2),
                                                                   torch.cat([tv, zeros], 2), attn_mask=mask)
        return out.numpy().astype(np.float64)

    out = AF.scaled_dot_product_attention(q, k, v, sinks=sinks)
    exact, kernel = flash(torch.float64), flash(torch.float32)
    ours_err, kernel_err = np.abs(out - exact).mean(), np.abs(kernel - exact).mean()
    assert ours_err <= 1.25 * kernel_err, f"mean error {ours_err:.3g} vs PyTorch's {kernel_err:.3g}"
