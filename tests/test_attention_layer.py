"""Parity of attnpp.nn.Attention, the general layer behind the articles' classes, with a PyTorch reference."""
import numpy as np
import pytest
import torch

import attnpp
import attnpp.functional as AF
from helpers import DTYPES, assert_close
from helpers import attention_layer_reference as torch_reference


CONFIGS = [
    dict(embed_dim=8, num_heads=2),
    dict(embed_dim=8, num_heads=2, causal=True),
    dict(embed_dim=8, num_heads=2, causal=True, causal_alignment="bottom_right"),
    dict(embed_dim=6, num_heads=3, qk_dim=9, v_dim=12, out_dim=5, bias=False, out_bias=True),
    dict(embed_dim=6, num_heads=1, qk_dim=4, v_dim=3, out_proj=False, bias=False, scale=3 ** -0.5),
    dict(embed_dim=8, num_heads=4, kv_dim=5),                        # cross-attention
    dict(embed_dim=8, num_heads=4, kv_dim=5, causal=True),           # causal cross-attention, L != S
    dict(embed_dim=8, num_heads=2, attn_dropout=0.3, out_dropout=0.2, causal=True),
    dict(embed_dim=8, num_heads=2, kv_dim=8, attn_dropout=0.25, out_proj=False, out_dropout=0.5),
]


# self-attention needs kv_dim == embed_dim; the others run both ways
CASES = [(cfg, cross) for cfg in CONFIGS for cross in (False, True)
         if cross or cfg.get("kv_dim", cfg["embed_dim"]) == cfg["embed_dim"]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg,cross", CASES, ids=str)
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_attention_layer(rng, dtype, cfg, cross, padding, training):
    layer = attnpp.nn.Attention(dtype=dtype, **cfg).train(training)
    B, L = 3, 6
    S = 9 if cross else L
    x = rng.standard_normal((B, L, layer.embed_dim)).astype(dtype)
    context = rng.standard_normal((B, S, layer.kv_dim)).astype(dtype) if cross else None
    kpm = None
    if padding:
        kpm = rng.random((B, S)) < 0.3
        kpm[:, 0] = False
    out, weights = layer(x, context, key_padding_mask=kpm, need_weights=True, seed=77)
    keep_attn = keep_out = None
    if training and layer.attn_dropout > 0:
        keep_attn = AF.dropout_mask((B, layer.num_heads, L, S), layer.attn_dropout, layer.last_seed)
    if training and layer.out_drop.p > 0:
        keep_out = AF.dropout_mask(out.shape, layer.out_drop.p, layer.out_drop.last_seed)
        assert layer.out_drop.last_seed == 78
    tx = torch.tensor(x, requires_grad=True)
    tc = torch.tensor(context, requires_grad=True) if cross else tx
    tout, tw, P = torch_reference(layer, tx, tc, kpm, keep_attn, keep_out)
    g = rng.standard_normal(out.shape).astype(dtype)
    (tout * torch.tensor(g)).sum().backward()
    grads = layer.backward(g)
    assert_close(out, tout.detach().numpy(), dtype, "output")
    assert_close(weights, tw.detach().numpy(), dtype, "weights")
    if cross:
        assert_close(grads[0], tx.grad.numpy(), dtype, "grad x")
        assert_close(grads[1], tc.grad.numpy(), dtype, "grad context")
    else:
        assert_close(grads, tx.grad.numpy(), dtype, "grad x")
    for name, p in layer.named_parameters():
        assert_close(p.grad, P[name].grad.numpy(), dtype, "grad " + name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbatched_equals_batch_of_one(rng, dtype):
    layer = attnpp.nn.Attention(6, 2, kv_dim=4, causal=True, dtype=dtype)
    x, c = rng.standard_normal((5, 6)).astype(dtype), rng.standard_normal((7, 4)).astype(dtype)
    kpm = np.array([False, True, False, False, False, True, False])
    out = layer(x, c, key_padding_mask=kpm)
    gx, gc = layer.backward(np.ones_like(out))
    grads = [p.grad.copy() for p in layer.parameters()]
    layer.zero_grad()
    out1 = layer(x[None], c[None], key_padding_mask=kpm[None])
    gx1, gc1 = layer.backward(np.ones_like(out1))
    np.testing.assert_array_equal(out, out1[0])
    np.testing.assert_array_equal(gx, gx1[0])
    np.testing.assert_array_equal(gc, gc1[0])
    for a, p in zip(grads, layer.parameters()):
        np.testing.assert_array_equal(a, p.grad)


def test_fully_masked_row_gives_zero(rng):
    """A batch element whose keys are all padding attends to nothing: attention output 0, no NaN."""
    layer = attnpp.nn.Attention(4, 2, out_proj=False, dtype=np.float64)
    x = rng.standard_normal((2, 3, 4))
    kpm = np.array([[True, True, True], [False, True, False]])
    out = layer(x, key_padding_mask=kpm)
    assert (out[0] == 0).all() and np.isfinite(out).all()
    g = layer.backward(np.ones_like(out))
    assert np.isfinite(g).all()


def test_loaders(rng):
    """Each article layout loads into the same projections."""
    layer = attnpp.nn.Attention(6, 2, qk_dim=4, v_dim=8, out_dim=6, dtype=np.float64)
    Wq, Wk, Wv = rng.standard_normal((4, 6)), rng.standard_normal((4, 6)), rng.standard_normal((8, 6))
    bq, bk, bv = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(8)
    layer.load_fused_qkv(np.concatenate([Wq, Wk, Wv]), np.concatenate([bq, bk, bv]))
    for p, w, b in ((layer.q_proj, Wq, bq), (layer.k_proj, Wk, bk), (layer.v_proj, Wv, bv)):
        np.testing.assert_array_equal(p.weight.data, w)
        np.testing.assert_array_equal(p.bias.data, b)
    layer.load_projections(Wq.T * 2, layout="matmul")
    np.testing.assert_array_equal(layer.q_proj.weight.data, Wq * 2)
    layer.load_fused_kv(torch.tensor(np.concatenate([Wk, Wv]) * 3))
    np.testing.assert_array_equal(layer.v_proj.weight.data, Wv * 3)
    heads_q = [Wq[:2].T, Wq[2:].T]
    layer.load_heads(heads_q, [Wk[:2].T, Wk[2:].T], [Wv[:4].T, Wv[4:].T])
    np.testing.assert_array_equal(layer.q_proj.weight.data, Wq)
    np.testing.assert_array_equal(layer.v_proj.weight.data, Wv)
    before = {n: p.data.copy() for n, p in layer.named_parameters()}
    with pytest.raises(ValueError, match="Wqkv.*16 rows"):
        layer.load_fused_qkv(np.zeros((15, 6)))
    with pytest.raises(ValueError, match="v.*shape"):
        layer.load_projections(q=np.zeros((4, 6)), v=np.zeros((7, 6)))
    for n, p in layer.named_parameters():  # a failed load changes nothing
        np.testing.assert_array_equal(p.data, before[n])


def test_attention_bad_input(rng):
    with pytest.raises(ValueError, match="qk_dim.*num_heads"):
        attnpp.nn.Attention(6, 4)
    layer = attnpp.nn.Attention(4, 2, context_length=5)
    with pytest.raises(ValueError, match="context_length"):
        layer(rng.standard_normal((1, 6, 4)).astype(np.float32))
    with pytest.raises(TypeError, match="x.*float32"):
        layer(rng.standard_normal((1, 3, 4)))
    with pytest.raises(ValueError, match="key_padding_mask.*\\(1, 3\\)"):
        layer(rng.standard_normal((1, 3, 4)).astype(np.float32), key_padding_mask=np.zeros((1, 4), bool))
    with pytest.raises(ValueError, match="context is required"):
        attnpp.nn.Attention(4, 2, kv_dim=3)(rng.standard_normal((1, 3, 4)).astype(np.float32))
    with pytest.raises(ValueError, match="backward"):
        layer.backward(np.zeros((1, 3, 4), np.float32))
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    y = layer(x)
    with pytest.raises(ValueError, match="grad_output.*\\(2, 3, 4\\)"):
        layer.backward(np.zeros((2, 3, 5), np.float32))
    assert layer.backward(np.ones_like(y)).shape == x.shape  # the failed call did not consume the forward
