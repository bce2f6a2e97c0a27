"""Parity of attnpp.functional.scaled_dot_product_attention (forward and every gradient) with PyTorch."""
import ml_dtypes
import numpy as np
import pytest
import torch

import attnpp
import attnpp.functional as AF
import attnpp.functional.attention as AF_attention  # (the module that owns _Problem, patched below)
from helpers import DTYPES, assert_close, torch_sdpa


def check_parity(rng, dtype, q_shape, k_shape, v_shape, ours_kw=None, **kw):
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, v_shape))
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw, **(ours_kw or {}))
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grads = AF.scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse, **kw, **(ours_kw or {}))
    ref, _ = torch_sdpa(q, k, v, grad_out, kw)
    for name, ours, theirs in zip(("output", "grad_query", "grad_key", "grad_value"), (out,) + grads, ref):
        assert ours.dtype == dtype
        assert_close(ours, theirs, dtype, name)
    # the functional form gives the same output
    np.testing.assert_array_equal(AF.scaled_dot_product_attention(q, k, v, **kw, **(ours_kw or {})), out)
    return out, grads


SHAPES = [  # q, k, v
    ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8)),
    ((2, 3, 7, 8), (2, 3, 11, 8), (2, 3, 11, 4)),          # L != S, Dv != D
    ((1, 2, 130, 16), (1, 2, 300, 16), (1, 2, 300, 24)),    # several query and key blocks, partial last ones
    ((1, 2, 600, 16), (1, 2, 1100, 16), (1, 2, 1100, 8)),   # three forward tasks of 256 queries, 3 key blocks
    ((2, 1, 1, 4), (2, 1, 1, 4), (2, 1, 1, 4)),             # L = S = 1
    ((4, 6), (9, 6), (9, 5)),                               # unbatched (L, D)
    ((3, 5, 4), (3, 7, 4), (3, 7, 4)),                      # (H, L, D)
    ((2, 2, 2, 9, 8), (2, 2, 2, 6, 8), (2, 2, 2, 6, 3)),    # two leading batch dimensions
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_shapes(rng, dtype, shapes, is_causal):
    check_parity(rng, dtype, *shapes, is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(9, 5), (5, 9), (130, 200), (300, 560), (560, 300)])
def test_causal_bottom_right(rng, dtype, L, S):
    """causal_alignment='bottom_right' equals PyTorch with the mask tril(diagonal=S-L) (causal_lower_right)."""
    mask = np.tril(np.ones((L, S), dtype=bool), k=S - L)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 2, L, 8), (2, 2, S, 8), (2, 2, S, 8)))
    ours = AF.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    same = AF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(ours, same, dtype, "bottom_right vs explicit mask")
    check_parity(rng, dtype, (2, 2, L, 8), (2, 2, S, 8), (2, 2, S, 8), attn_mask=mask)


MASK_SHAPES = [(7, 11), (1, 1, 7, 11), (2, 1, 7, 11), (3, 7, 11), (2, 3, 7, 11), (1, 11), (7, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(rng, dtype, mask_shape, kind):
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.75
        mask[..., 0] = True  # keep every row partly visible here; fully masked rows have their own test
    else:
        mask = (rng.standard_normal(mask_shape) * 2).astype(dtype)
        mask[rng.random(mask_shape) < 0.2] = -np.inf
        mask[..., 0] = 0.0
    check_parity(rng, dtype, (2, 3, 7, 8), (2, 3, 11, 8), (2, 3, 11, 5), attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero(rng, dtype, kind):
    mask = rng.random((2, 3, 9, 140)) < 0.5
    mask[0, 1, 3] = False
    mask[1, :, 0] = False
    if kind == "float":
        mask = np.where(mask, 0.0, -np.inf).astype(dtype)
    out, grads = check_parity(rng, dtype, (2, 3, 9, 8), (2, 3, 140, 8), (2, 3, 140, 8), attn_mask=mask)
    assert not np.isnan(out).any() and all(not np.isnan(g).any() for g in grads)
    assert (out[0, 1, 3] == 0).all() and (out[1, :, 0] == 0).all()
    assert (grads[0][0, 1, 3] == 0).all()
    _, lse, _ = AF.scaled_dot_product_attention_forward(*(np.ones((2, 3, n, 8), dtype) for n in (9, 140, 140)),
                                                     attn_mask=mask)
    assert np.isneginf(lse[0, 1, 3]) and np.isfinite(lse[0, 0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa(rng, dtype, heads, is_causal):
    hq, hk = heads
    check_parity(rng, dtype, (2, hq, 9, 8), (2, hk, 12, 8), (2, hk, 12, 6), enable_gqa=True, is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [
    ((2, 3, 5, 8), (1, 3, 6, 8), (1, 3, 6, 8)),   # key/value shared by the batch
    ((2, 3, 5, 8), (2, 1, 6, 8), (2, 1, 6, 8)),   # one head broadcast to all (enable_gqa=False)
    ((5, 8), (2, 3, 6, 8), (2, 3, 6, 8)),         # unbatched query against batched keys
], ids=str)
def test_broadcast_batch(rng, dtype, shapes):
    check_parity(rng, dtype, *shapes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale(rng, dtype):
    check_parity(rng, dtype, (2, 2, 6, 8), (2, 2, 7, 8), (2, 2, 7, 8), scale=0.77)
    check_parity(rng, dtype, (2, 2, 6, 8), (2, 2, 7, 8), (2, 2, 7, 8), scale=3 ** -0.5, is_causal=True)


def torch_reference_with_dropout(q, k, v, keep, p, scale, mask):
    """softmax(scale q k^T + mask) * keep / (1 - p) @ v written in PyTorch, the mask replayed."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    scores = tq @ tk.transpose(-2, -1) * scale + torch.tensor(mask)
    w = torch.softmax(scores, dim=-1) * torch.tensor(keep) / (1 - p)
    return tq, tk, tv, w @ tv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_replayed_in_torch(rng, dtype, is_causal):
    p, seed, shape = 0.3, 42, (2, 3, 70, 150)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 3, 70, 8), (2, 3, 150, 8), (2, 3, 150, 5)))
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, dropout_p=p, is_causal=is_causal, seed=seed)
    g = rng.standard_normal(out.shape).astype(dtype)
    grads = AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, dropout_p=p, is_causal=is_causal,
                                                     seed=seed)
    keep = AF.dropout_mask(shape, p, seed)
    assert keep.shape == shape and keep.dtype == bool and abs(keep.mean() - (1 - p)) < 0.01
    mask = np.where(np.tril(np.ones(shape[-2:], bool)) if is_causal else True, 0.0, -np.inf).astype(dtype)
    tq, tk, tv, tout = torch_reference_with_dropout(q, k, v, keep, p, 8 ** -0.5, mask)
    (tout * torch.tensor(g)).sum().backward()
    for name, ours, theirs in zip(("output", "grad_query", "grad_key", "grad_value"), (out,) + grads,
                                  (tout.detach(), tq.grad, tk.grad, tv.grad)):
        assert_close(ours, theirs.numpy(), dtype, name)
    # the weights function shows the same dropped weights
    w = AF.scaled_dot_product_attention_weights(q, k, dropout_p=p, is_causal=is_causal, seed=seed)
    assert ((w == 0) | keep).all() and (w[~keep] == 0).all()
    # same seed, same output; another seed, another output
    np.testing.assert_array_equal(out, AF.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal,
                                                                       seed=seed))
    assert not np.array_equal(out, AF.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal,
                                                                   seed=seed + 1))


def test_dropout_seed_from_manual_seed(rng):
    q = rng.standard_normal((1, 2, 16, 8))
    attnpp.manual_seed(7)
    a = AF.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    attnpp.manual_seed(7)
    b = AF.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(attn_mask="bool")], ids=str)
def test_weights_match_torch_softmax(rng, dtype, kw):
    q, k = rng.standard_normal((2, 3, 9, 8)).astype(dtype), rng.standard_normal((2, 3, 13, 8)).astype(dtype)
    mask = np.zeros((9, 13), dtype)
    if kw.get("attn_mask") == "bool":
        kw = dict(attn_mask=rng.random((9, 13)) < 0.7)
        kw["attn_mask"][:, 0] = True
        mask = np.where(kw["attn_mask"], 0.0, -np.inf)
    if kw.get("is_causal"):
        mask = np.where(np.tril(np.ones((9, 13), bool)), 0.0, -np.inf)
    ref = torch.softmax(torch.tensor(q) @ torch.tensor(k).transpose(-1, -2) * 8 ** -0.5 + torch.tensor(mask), -1)
    assert_close(AF.scaled_dot_product_attention_weights(q, k, **kw), ref.numpy(), dtype, "weights")


def test_inputs_not_contiguous(rng):
    """Transposed, sliced and Fortran-ordered inputs give the same answer as contiguous copies."""
    q = rng.standard_normal((2, 3, 8, 6)).transpose(0, 1, 3, 2)   # (2, 3, 6, 8), last dim strided
    k = np.asfortranarray(rng.standard_normal((2, 3, 9, 8)))
    v = rng.standard_normal((2, 3, 9, 10))[..., ::2]
    out = AF.scaled_dot_product_attention(q, k, v)
    ref = AF.scaled_dot_product_attention(*(np.ascontiguousarray(x) for x in (q, k, v)))
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (40, 0)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_mask(rng, dtype, causal, window, kind):
    """key_padding_mask (B, S) (bool: True = padding; float: added), with is_causal and a window, equals
    PyTorch given the equivalent dense mask (B, 1, L, S); the output and every gradient."""
    B, H, L, S = 2, 3, 130, 300
    pad = rng.random((B, S)) < 0.3
    pad[:, 0] = False  # every row sees a key (fully masked rows have their own test)
    kpm = pad if kind == "bool" else np.where(pad, -np.inf, rng.standard_normal((B, S))).astype(dtype)
    visible = np.ones((L, S), bool)
    shift = S - L if causal == "bottom_right" else 0
    if causal:
        visible &= np.tril(visible, k=shift)
    if window:
        visible &= np.triu(np.ones((L, S), bool), k=S - L - window[0]) & np.tril(visible, k=S - L + window[1])
    pad_bias = np.where(pad, -np.inf, 0.0) if kind == "bool" else kpm.astype(np.float64)
    dense = np.where(visible, 0.0, -np.inf)[None, None] + pad_bias[:, None, None, :]
    q, k, v = (rng.standard_normal((B, H, n, 8)).astype(dtype) for n in (L, S, S))
    kw = dict(key_padding_mask=kpm, window=window)
    if causal:
        kw.update(is_causal=True, causal_alignment=causal)
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grads = AF.scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse, **kw)
    ref, _ = torch_sdpa(q, k, v, grad_out, dict(attn_mask=dense.astype(dtype)))
    for name, ours, theirs in zip(("output", "grad_query", "grad_key", "grad_value"), (out,) + grads, ref):
        assert_close(ours, theirs, dtype, name)
    weights = AF.scaled_dot_product_attention_weights(q, k, **kw)
    assert (weights[np.broadcast_to(np.isneginf(dense), weights.shape)] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_keys_get_exactly_zero_weight(rng, dtype):
    """exp(-inf) is 0, not the denormal a clamped vectorized exp gives (regression: 5.6e-309 in float64)."""
    q, k = rng.standard_normal((1, 1, 16, 4)).astype(dtype), rng.standard_normal((1, 1, 16, 4)).astype(dtype)
    w = AF.scaled_dot_product_attention_weights(q, k, is_causal=True)
    assert (np.triu(w[0, 0], 1) == 0).all()
    v = rng.standard_normal((1, 1, 16, 8)).astype(dtype)
    v[..., -1, :] = 1e300 if dtype == np.float64 else 1e30  # seen by the last query only
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, is_causal=True)
    ref = torch_sdpa(q, k, v, np.ones_like(out), dict(is_causal=True))[0][0]
    assert_close(out[..., :-1, :], ref[..., :-1, :], dtype, "rows that do not see the huge value")
    grads = AF.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse,
                                                     attn_mask=(np.arange(16) < 3)[None])
    assert (grads[2][0, 0, 3:] == 0).all()  # keys no query sees get exactly no gradient


@pytest.mark.parametrize("dtype", DTYPES + [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("case", [dict(), dict(is_causal=True), dict(is_causal=True, causal_alignment="bottom_right"),
                                  dict(enable_gqa=True, scale=0.3)], ids=str)
def test_plain_call_skips_the_general_checks_with_the_same_result(rng, monkeypatch, dtype, case):
    # The commonest call (4-D arrays, no option beyond is_causal, scale, enable_gqa and causal_alignment) goes
    # straight to the core (_core.sdpa_forward_plain); the same call through the general path (an unbounded
    # window, which changes nothing, sends it there) gives the same bits.
    Hk = 2 if case.get("enable_gqa") else 6
    q = rng.standard_normal((2, 6, 9, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, Hk, 13, 8)).astype(dtype) for _ in range(2))
    general = AF.scaled_dot_product_attention_forward(q, k, v, window=(-1, -1), **case)

    def refused(*args, **kwargs):
        raise AssertionError("the plain call took the general path")
    with monkeypatch.context() as m:
        m.setattr(AF_attention, "_Problem", refused)
        plain = AF.scaled_dot_product_attention_forward(q, k, v, **case)
    for ours, theirs in zip(plain[:2], general[:2]):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours.view(np.uint8), theirs.view(np.uint8))
    assert plain.seed is None


@pytest.mark.parametrize("kw, error", [(dict(dropout_p=False), TypeError), (dict(is_causal=1), TypeError),
                                       (dict(scale="1"), TypeError), (dict(causal_alignment="top"), ValueError),
                                       (dict(causal_alignment=["top_left"]), ValueError)], ids=str)
def test_plain_call_errors_as_the_general_path(rng, kw, error):
    # What the plain path does not take falls to the general path, whose checks name the argument.
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    with pytest.raises(error, match=next(iter(kw))):
        AF.scaled_dot_product_attention_forward(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("S", [1, 8, 16, 40])
@pytest.mark.parametrize("D", [8, 64])
def test_a_row_that_sees_one_key_adds_nothing_to_dq_and_dk(rng, dtype, S, D):
    """Where a row sees a single key, its weight is 1 and its output that key's value, so the scores' gradient
    dP - rowsum(dO * out) is 0 and the row adds nothing to dq and dk: exactly, as PyTorch's math backend gives it,
    whichever column of its key block the key sits in (the products' vector tiles and their scalar tail sum in the
    same way as the softmax term). Then the gradients equal PyTorch's in that dtype bit for bit."""
    L = 6
    q, g = (3 * rng.standard_normal((2, 2, L, D)).astype(dtype) for _ in range(2))
    k, v = (3 * rng.standard_normal((2, 2, S, D)).astype(dtype) for _ in range(2))
    mask = np.zeros((L, S), bool)
    mask[np.arange(L), (np.arange(L) * 5) % S] = True  # row i sees key 5i mod S alone
    fwd = AF.scaled_dot_product_attention_forward(q, k, v, attn_mask=mask)
    dq, dk, _ = AF.scaled_dot_product_attention_backward(g, q, k, v, fwd.output, fwd.logsumexp, attn_mask=mask)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(mask))
    out.backward(torch.tensor(g))
    np.testing.assert_array_equal(dq, tq.grad.numpy())
    np.testing.assert_array_equal(dk, tk.grad.numpy())

