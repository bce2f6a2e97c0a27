"""Finite-difference gradient checks in float64, with no PyTorch.

For each operation, the loss is ``(out * G).sum()`` with a fixed random G; its central differences
(eps = 1e-6) with respect to every element of every input and parameter are compared with attnpp's
hand-written backward, elementwise, relative to max(1, |numeric|). Sizes are tiny so the whole file runs in
seconds.
"""
import math
import zlib

import numpy as np
import pytest

import attnpp
import attnpp.functional as AF
from attnpp.nn import Linear, MultiheadAttention

EPS = 1e-6
RTOL = 1e-6


# ---------------------------------------------------------------------------------------------------- helpers
def numeric_grad(loss, x, eps=EPS):
    """Central differences of the scalar ``loss()`` with respect to each element of ``x``, perturbed in place.

    ``x`` must be a writeable array that ``loss`` reads (an input array or a parameter's ``.data`` view).
    """
    assert x.flags.writeable
    grad = np.zeros(x.shape, dtype=np.float64)
    for idx in np.ndindex(*x.shape):
        old = x[idx]
        x[idx] = old + eps
        plus = loss()
        x[idx] = old - eps
        minus = loss()
        x[idx] = old
        grad[idx] = (plus - minus) / (2 * eps)
    return grad


def assert_grad_close(analytic, numeric, what):
    analytic = np.asarray(analytic)
    assert analytic.shape == numeric.shape, f"{what}: shape {analytic.shape} != {numeric.shape}"
    assert analytic.dtype == np.float64, f"{what}: dtype {analytic.dtype}"
    assert np.isfinite(analytic).all(), f"{what}: non-finite analytic gradient"
    err = np.abs(analytic - numeric) / np.maximum(1.0, np.abs(numeric))
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert err.size == 0 or err.max() <= RTOL, (
        f"{what}: relative error {err.max():.3g} > {RTOL:g} at {worst}: analytic {analytic[worst]!r}, "
        f"numeric {numeric[worst]!r}")


def randn(rng, *shape):
    return rng.standard_normal(shape)


def softmax_rows(scores):
    """Row softmax that gives 0 for rows that are all -inf."""
    m = np.max(scores, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(scores - m)
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


# ------------------------------------------------------------------------------------- scaled dot-product attn
def _bool_mask_with_empty_rows(rng):
    # (B, 1, L, S) = (2, 1, 3, 5), broadcast over the heads; True = the key takes part.
    m = rng.random((2, 1, 3, 5)) < 0.6
    m[..., 0] |= ~m.any(axis=-1)  # every row keeps at least one key ...
    m[0, 0, 1, :] = False          # ... except these two fully masked rows
    m[1, 0, 2, :] = False
    return m


def _float_mask(rng):
    m = rng.standard_normal((3, 5))  # (L, S), broadcast over batch and heads
    m[0, 1] = -np.inf
    m[2, 4] = -np.inf
    return m


# id, q shape, k shape, v shape, kwargs (callables get rng)
SDPA_CASES = [
    ("plain", (2, 2, 3, 4), (2, 2, 3, 4), (2, 2, 3, 4), {}),
    ("L!=S,Dv!=D", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 2), {}),
    ("unbatched", (3, 4), (5, 4), (5, 3), {}),
    ("causal_top_left_L<S", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dict(is_causal=True)),
    ("causal_top_left_L>S", (1, 2, 5, 4), (1, 2, 3, 4), (1, 2, 3, 3), dict(is_causal=True)),
    ("causal_bottom_right_L<S", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3),
     dict(is_causal=True, causal_alignment="bottom_right")),
    ("causal_bottom_right_L>S", (1, 2, 5, 4), (1, 2, 3, 4), (1, 2, 3, 3),   # first two rows fully masked
     dict(is_causal=True, causal_alignment="bottom_right")),
    ("bool_mask_empty_rows", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dict(attn_mask=_bool_mask_with_empty_rows)),
    ("float_mask", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dict(attn_mask=_float_mask)),
    ("gqa", (2, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dict(enable_gqa=True)),
    ("broadcast_batch", (2, 3, 3, 4), (1, 3, 5, 4), (1, 3, 5, 2), {}),
    ("broadcast_batch_and_heads", (2, 3, 3, 4), (3, 5, 4), (2, 1, 5, 2), {}),
    ("custom_scale", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dict(scale=0.37)),
    ("dropout", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), dict(dropout_p=0.3, seed=1234)),
    ("dropout_gqa_causal", (1, 4, 4, 4), (1, 2, 4, 4), (1, 2, 4, 3),
     dict(dropout_p=0.3, seed=99, enable_gqa=True, is_causal=True)),
    ("dropout_bool_mask", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3),
     dict(dropout_p=0.3, seed=7, attn_mask=_bool_mask_with_empty_rows)),
]


def _sdpa_setup(case_id, q_shape, k_shape, v_shape, kwargs):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    kw = {k: (v(rng) if callable(v) else v) for k, v in kwargs.items()}
    q, k, v = randn(rng, *q_shape), randn(rng, *k_shape), randn(rng, *v_shape)
    return rng, q, k, v, kw


def _reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    seed=None, causal_alignment="top_left"):
    """softmax(scale q k^T + mask) v in plain NumPy, with attnpp's documented dropout mask."""
    L, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    if enable_gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    scale = 1 / math.sqrt(D) if scale is None else scale
    scores = scale * q @ np.swapaxes(k, -1, -2)
    if is_causal:
        shift = 0 if causal_alignment == "top_left" else S - L
        allowed = np.arange(S)[None, :] <= np.arange(L)[:, None] + shift
        scores = np.where(allowed, scores, -np.inf)
    if attn_mask is not None:
        scores = np.where(attn_mask, scores, -np.inf) if attn_mask.dtype == bool else scores + attn_mask
    p = softmax_rows(scores)
    if dropout_p > 0:
        keep = AF.dropout_mask(p.shape, dropout_p, seed)
        p = np.where(keep, p / (1 - dropout_p), 0.0)
    return p @ v


@pytest.mark.parametrize("case_id, q_shape, k_shape, v_shape, kwargs", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_gradcheck(case_id, q_shape, k_shape, v_shape, kwargs):
    rng, q, k, v, kw = _sdpa_setup(case_id, q_shape, k_shape, v_shape, kwargs)
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    G = randn(rng, *out.shape)

    def loss():
        o, _, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
        return float((o * G).sum())

    # the forward is deterministic (also with dropout, for a fixed seed), so finite differences apply
    np.testing.assert_array_equal(AF.scaled_dot_product_attention_forward(q, k, v, **kw)[0], out)
    # and it is the function we think it is
    ref = _reference_sdpa(q, k, v, **kw)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)

    grads = AF.scaled_dot_product_attention_backward(G, q, k, v, out, lse, **kw)
    for name, x, g in zip(("query", "key", "value"), (q, k, v), grads):
        numeric = numeric_grad(loss, x)
        assert np.abs(numeric).max() > 1e-3, f"{name}: the loss does not depend on {name}: vacuous check"
        assert_grad_close(g, numeric, f"grad_{name}")


def test_sdpa_fully_masked_rows_give_zero_output_and_gradient():
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, 2, 2, 3, 4), randn(rng, 2, 2, 5, 4), randn(rng, 2, 2, 5, 3)
    mask = _bool_mask_with_empty_rows(rng)
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, attn_mask=mask)
    G = randn(rng, *out.shape)
    dq, dk, dv = AF.scaled_dot_product_attention_backward(G, q, k, v, out, lse, attn_mask=mask)
    for x in (out, dq, dk, dv):
        assert not np.isnan(x).any()
    empty = ~mask.any(axis=-1)                                   # (2, 1, 3)
    empty = np.broadcast_to(empty, out.shape[:-1])                # (2, 2, 3)
    assert empty.any()
    np.testing.assert_array_equal(out[empty], 0.0)
    np.testing.assert_array_equal(dq[empty], 0.0)
    assert np.all(np.isneginf(lse[empty]))
    # the weights of a fully masked row are 0 too
    w = AF.scaled_dot_product_attention_weights(q, k, attn_mask=mask)
    np.testing.assert_array_equal(w[empty], 0.0)
    # bottom-right causal with L > S: the first L - S rows see no key
    q5, k3, v3 = randn(rng, 1, 2, 5, 4), randn(rng, 1, 2, 3, 4), randn(rng, 1, 2, 3, 3)
    out, lse, _ = AF.scaled_dot_product_attention_forward(q5, k3, v3, is_causal=True, causal_alignment="bottom_right")
    dq, dk, dv = AF.scaled_dot_product_attention_backward(np.ones_like(out), q5, k3, v3, out, lse, is_causal=True,
                                                          causal_alignment="bottom_right")
    assert not any(np.isnan(x).any() for x in (out, dq, dk, dv))
    np.testing.assert_array_equal(out[..., :2, :], 0.0)
    np.testing.assert_array_equal(dq[..., :2, :], 0.0)


def test_sdpa_dropout_seed_matters():
    """Dropout really acts, and the seed picks the mask (else the dropout gradcheck would be vacuous)."""
    rng = np.random.default_rng(11)
    q, k, v = randn(rng, 2, 2, 3, 4), randn(rng, 2, 2, 5, 4), randn(rng, 2, 2, 5, 3)
    plain = AF.scaled_dot_product_attention(q, k, v)
    a = AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=1234)
    b = AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=1234)
    c = AF.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=4321)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, plain)
    assert not np.allclose(a, c)


# ---------------------------------------------------------------------------------------------------- Linear
@pytest.mark.parametrize("in_shape", [(2, 4), (2, 3, 4), (4,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_gradcheck(in_shape, bias):
    attnpp.manual_seed(0)
    layer = Linear(4, 3, bias=bias, dtype=np.float64)
    rng = np.random.default_rng(1)
    x = randn(rng, *in_shape)
    G = randn(rng, *(in_shape[:-1] + (3,)))

    def loss():
        return float((layer(x) * G).sum())

    layer.zero_grad()
    out = layer(x)
    assert out.shape == in_shape[:-1] + (3,) and out.dtype == np.float64
    np.testing.assert_allclose(out, x @ layer.weight.data.T + (layer.bias.data if bias else 0), rtol=0, atol=1e-13)
    dx = layer.backward(G)
    assert_grad_close(dx, numeric_grad(loss, x), "grad_input")
    names = []
    for name, p in layer.named_parameters():
        names.append(name)
        assert_grad_close(p.grad, numeric_grad(loss, p.data), f"{name}.grad")
    assert names == (["weight", "bias"] if bias else ["weight"])


# -------------------------------------------------------------------------------------------- MultiheadAttention
E, H = 6, 2


def _mha_inputs(rng, batched=True, batch_first=False, L=3, S=4, B=2, kdim=E, vdim=E):
    if not batched:
        return randn(rng, L, E), randn(rng, S, kdim), randn(rng, S, vdim)
    if batch_first:
        return randn(rng, B, L, E), randn(rng, B, S, kdim), randn(rng, B, S, vdim)
    return randn(rng, L, B, E), randn(rng, S, B, kdim), randn(rng, S, B, vdim)


def _kpm_bool(rng):  # (B, S) = (2, 4), True = padding (ignored)
    return np.array([[False, False, True, False], [False, True, False, True]])


def _kpm_float(rng):
    m = rng.standard_normal((2, 4))
    m[1, 0] = -np.inf
    return m


def _am_float_2d(rng):  # (L, S)
    return rng.standard_normal((3, 4))


def _am_bool_3d(rng):  # (B * H, L, S), True = not allowed; keep at least one key per row
    m = rng.random((4, 3, 4)) < 0.4
    m[..., 3] = False
    return m


def _am_causal(rng):  # (L, L), True above the diagonal
    return np.triu(np.ones((3, 3), dtype=bool), 1)


def _am_unbatched_3d(rng):  # (H, L, S)
    m = rng.standard_normal((2, 3, 4))
    return m


# id, constructor kwargs, input kwargs, forward kwargs (callables get rng)
MHA_CASES = [
    ("default", {}, {}, dict(need_weights=False)),
    ("default_need_weights", {}, {}, dict(need_weights=True)),
    ("per_head_weights", {}, {}, dict(need_weights=True, average_attn_weights=False)),
    ("batch_first", dict(batch_first=True), dict(batch_first=True), dict(need_weights=True)),
    ("kdim_vdim", dict(kdim=5, vdim=3), dict(kdim=5, vdim=3), dict(need_weights=False)),
    ("kdim_vdim_batch_first", dict(kdim=5, vdim=3, batch_first=True), dict(kdim=5, vdim=3, batch_first=True),
     dict(need_weights=True)),
    ("no_bias", dict(bias=False), {}, dict(need_weights=False)),
    ("bias_kv_zero_attn", dict(add_bias_kv=True, add_zero_attn=True), {}, dict(need_weights=True)),
    ("bias_kv_zero_attn_batch_first", dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
     dict(batch_first=True), dict(need_weights=False)),
    ("bias_kv_only", dict(add_bias_kv=True), {}, dict(need_weights=False)),
    ("zero_attn_only", dict(add_zero_attn=True), {}, dict(need_weights=False)),
    ("kpm_bool+attn_mask_float", {}, {}, dict(key_padding_mask=_kpm_bool, attn_mask=_am_float_2d,
                                              need_weights=True)),
    ("kpm_float+attn_mask_bool3d", {}, {}, dict(key_padding_mask=_kpm_float, attn_mask=_am_bool_3d,
                                                need_weights=False)),
    ("masks+bias_kv_zero_attn", dict(add_bias_kv=True, add_zero_attn=True), {},
     dict(key_padding_mask=_kpm_bool, attn_mask=_am_bool_3d, need_weights=True)),
    ("is_causal_with_causal_mask", {}, dict(S=3), dict(attn_mask=_am_causal, is_causal=True, need_weights=False)),
    ("dropout", dict(dropout=0.2), {}, dict(need_weights=False, seed=123)),
    ("dropout_need_weights_bias_kv", dict(dropout=0.2, add_bias_kv=True), {}, dict(need_weights=True, seed=5)),
    ("unbatched", {}, dict(batched=False), dict(need_weights=True)),
    ("unbatched_masks_bias_kv", dict(add_bias_kv=True, add_zero_attn=True), dict(batched=False),
     dict(key_padding_mask=lambda rng: np.array([False, True, False, False]), attn_mask=_am_unbatched_3d,
          need_weights=False)),
    ("unbatched_dropout", dict(dropout=0.2), dict(batched=False), dict(need_weights=True, seed=77)),
]


@pytest.mark.parametrize("case_id, ctor, inputs, fwd", MHA_CASES, ids=[c[0] for c in MHA_CASES])
def test_multihead_attention_gradcheck(case_id, ctor, inputs, fwd):
    attnpp.manual_seed(0)
    mha = MultiheadAttention(embed_dim=E, num_heads=H, dtype=np.float64, **ctor)
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    for p in mha.parameters():  # non-trivial values everywhere (the biases start at zero)
        p.data[...] = 0.5 * rng.standard_normal(p.shape)
    q, k, v = _mha_inputs(rng, **inputs)
    kw = {name: (val(rng) if callable(val) else val) for name, val in fwd.items()}

    def loss():
        y, _ = mha(q, k, v, **kw)
        return float((y * G).sum())

    y, w = mha(q, k, v, **kw)
    G = randn(rng, *y.shape)
    assert y.shape == q.shape and y.dtype == np.float64
    assert (w is None) == (not kw.get("need_weights", True))
    np.testing.assert_array_equal(mha(q, k, v, **kw)[0], y)  # deterministic (fixed seed with dropout)
    if ctor.get("dropout", 0) > 0:  # dropout really acts in training mode
        mha.eval()
        assert not np.allclose(mha(q, k, v, **kw)[0], y)
        mha.train()

    mha.zero_grad()
    mha(q, k, v, **kw)
    grads = mha.backward(G)
    assert len(grads) == 3
    for name, x, g in zip(("query", "key", "value"), (q, k, v), grads):
        numeric = numeric_grad(loss, x)
        assert np.abs(numeric).max() > 1e-3, f"{name}: vacuous check"
        assert_grad_close(g, numeric, f"grad_{name}")

    expected = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    if "kdim" in ctor:
        expected = expected - {"in_proj_weight"} | {"q_proj_weight", "k_proj_weight", "v_proj_weight"}
    if ctor.get("bias") is False:
        expected -= {"in_proj_bias", "out_proj.bias"}
    if ctor.get("add_bias_kv"):
        expected |= {"bias_k", "bias_v"}
    params = dict(mha.named_parameters())
    assert set(params) == expected
    analytic = {name: p.grad.copy() for name, p in params.items()}
    for name, p in params.items():
        numeric = numeric_grad(loss, p.data)
        assert np.abs(numeric).max() > 1e-4, f"{name}: vacuous check"
        assert_grad_close(analytic[name], numeric, f"{name}.grad")


def test_multihead_attention_gradients_accumulate():
    """backward adds into the parameters' gradients (+=); zero_grad resets them."""
    attnpp.manual_seed(3)
    mha = MultiheadAttention(E, H, dtype=np.float64, add_bias_kv=True)
    rng = np.random.default_rng(3)
    q, k, v = _mha_inputs(rng)
    G = randn(rng, *q.shape)
    mha.zero_grad()
    mha(q, k, v, need_weights=False)
    g1 = mha.backward(G)
    once = {n: p.grad.copy() for n, p in mha.named_parameters()}
    mha(q, k, v, need_weights=False)
    g2 = mha.backward(G)
    for n, p in mha.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * once[n], rtol=1e-14, atol=1e-14)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)
    mha.zero_grad(set_to_none=False)
    for p in mha.parameters():
        np.testing.assert_array_equal(p.grad, 0.0)
    mha.zero_grad()
    assert all(p.grad is None for p in mha.parameters())
