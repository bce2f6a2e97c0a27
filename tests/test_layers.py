"""Parity of attnpp.nn.Linear and attnpp.nn.MultiheadAttention (outputs, input and parameter gradients)."""
import itertools

import numpy as np
import pytest
import torch

import attnpp
from helpers import DTYPES, TORCH, assert_close, make_mha


def param_grads_match(ours, theirs, dtype):
    names = [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    tp = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad.dtype == dtype
        assert_close(p.grad, tp[name].grad.numpy(), dtype, f"grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (7,)], ids=str)
def test_linear(rng, dtype, bias, shape):
    ref = torch.nn.Linear(7, 4, bias=bias, dtype=TORCH[dtype])
    lin = attnpp.nn.Linear(7, 4, bias=bias, dtype=dtype)
    lin.load_state_dict(ref.state_dict())
    x = rng.standard_normal(shape).astype(dtype)
    y = lin(x)
    g = rng.standard_normal(y.shape).astype(dtype)
    tx = torch.tensor(x, requires_grad=True)
    ty = ref(tx)
    (ty * torch.tensor(g)).sum().backward()
    assert_close(y, ty.detach().numpy(), dtype, "output")
    assert_close(lin.backward(g), tx.grad.numpy(), dtype, "grad_input")
    param_grads_match(lin, ref, dtype)


def test_parameters_share_memory():
    lin = attnpp.nn.Linear(3, 2, dtype=np.float64)
    w = lin.weight.data
    w[...] = 1.5
    assert (lin.weight.data == 1.5).all() and np.shares_memory(w, lin.weight.data)
    assert lin.weight.grad is None  # (as PyTorch: no gradient before a backward)
    lin.weight.grad = np.full((2, 3), 2.0)
    g = lin.weight.grad
    lin.weight.grad = np.full((2, 3), 3.0)  # assignment copies into the existing buffer
    assert g is lin.weight.grad and (g == 3.0).all()
    lin.zero_grad(set_to_none=False)
    assert g is lin.weight.grad and (g == 0).all()
    lin.zero_grad()
    assert lin.weight.grad is None
    assert np.asarray(lin.weight) is lin.weight.data and lin.weight.numpy() is lin.weight.data
    sd = lin.state_dict()
    assert set(sd) == {"weight", "bias"} and np.shares_memory(sd["weight"], lin.weight.data)


def run_both(mha, ref, rng, dtype, q, k, v, self_attention=False, **fkw):
    """Forward both layers and backward a random grad_output; compare every output and gradient."""
    y, w = mha(q, k, v, **fkw)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    if self_attention:
        tk = tv = tq
    tkw = {n: torch.tensor(m) if isinstance(m, np.ndarray) else m for n, m in fkw.items()}
    ty, tw = ref(tq, tk, tv, **tkw)
    g = rng.standard_normal(y.shape).astype(dtype)
    (ty * torch.tensor(g)).sum().backward()
    gq, gk, gv = mha.backward(g)
    assert_close(y, ty.detach().numpy(), dtype, "attn_output")
    if tw is None:
        assert w is None
    else:
        assert_close(w, tw.detach().numpy(), dtype, "attn_weights")
    if self_attention:
        assert_close(gq + gk + gv, tq.grad.numpy(), dtype, "grad of the shared input")
    else:
        for name, ours, t in (("grad_query", gq, tq), ("grad_key", gk, tk), ("grad_value", gv, tv)):
            assert_close(ours, t.grad.numpy(), dtype, name)
    param_grads_match(mha, ref, dtype)


LAYER_OPTIONS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(kdim=5, vdim=7),
    dict(kdim=5, vdim=7, add_bias_kv=True, bias=False),
]


def inputs(rng, dtype, mha, B, L, S, batch_first, batched=True):
    def make(T, width):
        shape = ((B, T) if batch_first else (T, B)) if batched else (T,)
        return rng.standard_normal(shape + (width,)).astype(dtype)
    return make(L, mha.embed_dim), make(S, mha.kdim), make(S, mha.vdim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", LAYER_OPTIONS, ids=str)
@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_options(rng, dtype, options, batch_first):
    mha, ref = make_mha(dtype, embed_dim=12, num_heads=3, batch_first=batch_first, **options)
    run_both(mha, ref, rng, dtype, *inputs(rng, dtype, mha, 2, 5, 7, batch_first))


def masks(rng, dtype, kind, B, H, L, S):
    """Masks in MultiheadAttention's convention (True = masked out); no row is fully masked."""
    out = {}
    if "kpm" in kind:
        kpm = rng.random((B, S)) < 0.3
        kpm[:, 0] = False
        out["key_padding_mask"] = kpm if "bool" in kind else np.where(kpm, -np.inf, 0.0).astype(dtype)
    if "am2" in kind or "am3" in kind:
        shape = (L, S) if "am2" in kind else (B * H, L, S)
        am = rng.random(shape) < 0.3
        am[..., 0] = False
        out["attn_mask"] = am if "bool" in kind else (rng.standard_normal(shape) + np.where(am, -np.inf, 0)).astype(dtype)
    return out


MASK_KINDS = ["kpm-bool", "kpm-float", "am2-bool", "am2-float", "am3-bool", "am3-float", "kpm-am2-bool",
              "kpm-am3-float"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_mha_masks_and_weights(rng, dtype, kind, need_weights, average):
    mha, ref = make_mha(dtype, embed_dim=8, num_heads=2, batch_first=True)
    run_both(mha, ref, rng, dtype, *inputs(rng, dtype, mha, 3, 6, 9, True), **masks(rng, dtype, kind, 3, 2, 6, 9),
             need_weights=need_weights, average_attn_weights=average)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", [dict(), dict(add_bias_kv=True, add_zero_attn=True)], ids=str)
def test_mha_masks_with_extra_keys(rng, dtype, options):
    mha, ref = make_mha(dtype, embed_dim=8, num_heads=2, **options)
    run_both(mha, ref, rng, dtype, *inputs(rng, dtype, mha, 3, 6, 9, False),
             **masks(rng, dtype, "kpm-am3-bool", 3, 2, 6, 9))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_kpm", [False, True])
def test_mha_causal(rng, dtype, need_weights, with_kpm):
    mha, ref = make_mha(dtype, embed_dim=8, num_heads=2, batch_first=True)
    L = 7
    kw = dict(attn_mask=np.triu(np.ones((L, L), bool), 1), is_causal=True, need_weights=need_weights)
    if with_kpm:
        kw.update(masks(rng, dtype, "kpm-bool", 2, 2, L, L))
    x = rng.standard_normal((2, L, 8)).astype(dtype)
    run_both(mha, ref, rng, dtype, x, x, x, self_attention=True, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask", [None, "kpm", "am3"])
def test_mha_unbatched(rng, dtype, batch_first, mask):
    mha, ref = make_mha(dtype, embed_dim=6, num_heads=3, batch_first=batch_first, kdim=4, vdim=5)
    kw = {}
    if mask == "kpm":
        kw["key_padding_mask"] = np.array([False, True, False, False, True])
    elif mask == "am3":
        am = rng.random((3, 4, 5)) < 0.3
        am[..., 0] = False
        kw["attn_mask"] = am
    run_both(mha, ref, rng, dtype, *inputs(rng, dtype, mha, 1, 4, 5, batch_first, batched=False),
             average_attn_weights=False, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_self_attention_shared_input(rng, dtype):
    mha, ref = make_mha(dtype, embed_dim=16, num_heads=4)
    x = rng.standard_normal((10, 3, 16)).astype(dtype)
    run_both(mha, ref, rng, dtype, x, x, x, self_attention=True)


def torch_mha_with_mask(ref, q, k, v, keep, p, key_padding_mask):
    """PyTorch's MultiheadAttention math (batch_first) written out, with a given dropout keep-mask."""
    E, H = ref.embed_dim, ref.num_heads
    B, L, _ = q.shape
    S = k.shape[1]
    wq, wk, wv = ref.in_proj_weight.chunk(3)
    bq, bk, bv = ref.in_proj_bias.chunk(3)
    split = lambda x, T: x.reshape(B, T, H, E // H).transpose(1, 2)
    qh = split(torch.nn.functional.linear(q, wq, bq), L)
    kh = split(torch.nn.functional.linear(k, wk, bk), S)
    vh = split(torch.nn.functional.linear(v, wv, bv), S)
    scores = qh @ kh.transpose(-1, -2) / (E // H) ** 0.5
    scores = scores.masked_fill(torch.tensor(key_padding_mask)[:, None, None, :], -torch.inf)
    w = torch.softmax(scores, -1) * torch.tensor(keep) / (1 - p)
    out = (w @ vh).transpose(1, 2).reshape(B, L, E)
    return ref.out_proj(out), w.mean(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_dropout_replayed_in_torch(rng, dtype):
    p, seed = 0.25, 2024
    mha, ref = make_mha(dtype, embed_dim=8, num_heads=2, dropout=p, batch_first=True)
    q, k, v = inputs(rng, dtype, mha, 3, 6, 9, True)
    kpm = masks(rng, dtype, "kpm-bool", 3, 2, 6, 9)["key_padding_mask"]
    y, w = mha(q, k, v, key_padding_mask=kpm, seed=seed)
    assert mha.last_seed == seed
    keep = attnpp.functional.dropout_mask((3, 2, 6, 9), p, mha.last_seed)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ty, tw = torch_mha_with_mask(ref, tq, tk, tv, keep, p, kpm)
    g = rng.standard_normal(y.shape).astype(dtype)
    (ty * torch.tensor(g)).sum().backward()
    grads = mha.backward(g)
    assert_close(y, ty.detach().numpy(), dtype, "attn_output")
    assert_close(w, tw.detach().numpy(), dtype, "attn_weights")
    for ours, t in zip(grads, (tq, tk, tv)):
        assert_close(ours, t.grad.numpy(), dtype, "input grad")
    param_grads_match(mha, ref, dtype)
    # eval mode: no dropout, equal to PyTorch's layer in eval mode
    mha.eval(), ref.eval()
    mha.zero_grad(), ref.zero_grad()
    run_both(mha, ref, rng, dtype, q, k, v, key_padding_mask=kpm)


def test_load_numpy_state_dict_and_train_eval():
    mha, ref = make_mha(np.float32, embed_dim=4, num_heads=2, dropout=0.5)
    other = attnpp.nn.MultiheadAttention(4, 2, dropout=0.5)
    other.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    for (n, a), (_, b) in zip(mha.named_parameters(), other.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data)
    assert mha.training and mha.out_proj.training
    mha.eval()
    assert not mha.training and not mha.out_proj.training
    assert len(list(mha.parameters())) == 4


def test_buffers_load_from_torch_state_dict():
    """A layer with a registered buffer loads a PyTorch state dict holding the same buffer, unchanged."""
    class TorchCausal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_q = torch.nn.Linear(3, 4)
            self.register_buffer("causal_mask", torch.triu(torch.ones(5, 5), diagonal=1))

    class Causal(attnpp.nn.Module):
        def __init__(self):
            super().__init__(np.float64)
            self.w_q = attnpp.nn.Linear(3, 4, dtype=np.float64)
            self.register_buffer("causal_mask", np.zeros((5, 5)))

    ref, ours = TorchCausal().double(), Causal()
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    np.testing.assert_array_equal(ours.causal_mask, ref.causal_mask.numpy())
    np.testing.assert_array_equal(ours.w_q.weight.data, ref.w_q.weight.detach().numpy())
    assert [n for n, _ in ours.named_parameters()] == ["w_q.weight", "w_q.bias"]
    with pytest.raises(ValueError, match="causal_mask"):
        ours.load_state_dict({**ref.state_dict(), "causal_mask": torch.ones(4, 4)})
