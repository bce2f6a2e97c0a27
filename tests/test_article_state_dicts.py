"""Each reference article's own ``state_dict()`` loads unchanged into the matching ``attnpp.nn.Attention``
(``Attention.load_state_dict`` and its table of article layouts), after which the outputs and every gradient equal
PyTorch's; a wrong mask buffer, a wrongly shaped key or an unknown key is refused with the layer unchanged, and
``strict=False`` returns the keys it could not place.

The PyTorch modules are the articles' classes of ``attnpp.testing`` (signature, parameter names, buffers,
algorithm), shared with the benchmark; all run in eval mode (dropout is the identity there, so both sides are
deterministic).
"""
import numpy as np
import pytest
import torch

import attnpp
import attnpp.nn as ann
from helpers import TOL, TORCH
from helpers import Article000CausalSelfAttention as CausalSelf000
from helpers import Article000MultiheadAttention as MHA000
from helpers import Article002MultiHeadAttentionWrapper as Wrapper002
from helpers import Article002SelfAttention as SelfAttention002
from helpers import Article003CausalAttention as Causal003
from helpers import Article003CausalCrossAttention as CausalCross003
from helpers import Article003SingleHeadAttention as SingleHead003
from helpers import Article004MultiHeadAttention as MHA004

B, S, C, NH = 2, 5, 16, 4


# ------------------------------------------------------------------------------------------- the cases
def _pad():
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 3:] = True                                   # trailing padding: no query is left without a key
    return pad


def _cat(*grads):
    return np.concatenate(grads, axis=0)


def _g(layer, name):
    sub, attr = name.split(".")
    return getattr(getattr(layer, sub), attr).grad


def _linear_grads(mapping):
    """article module prefix -> attnpp sub-layer, same (out, in) layout."""
    return lambda l, keys: {k: _g(l, mapping[k.split(".")[0]] + "." + k.split(".")[1]) for k in keys}


def _fused_grads(l, keys):
    parts = {"Wqkv": ("q_proj", "k_proj", "v_proj"), "Wq": ("q_proj",), "Wkv": ("k_proj", "v_proj"),
             "Wo": ("out_proj",)}
    return {k: _cat(*(_g(l, f"{p}.{k.split('.')[1]}") for p in parts[k.split(".")[0]])) for k in keys}


def _matmul_grads(l, keys):
    return {k: _g(l, {"W_query": "q_proj", "W_key": "k_proj", "W_value": "v_proj"}[k] + ".weight").T for k in keys}


def _head_grads(l, keys):
    out = {}
    for k in keys:
        _, h, name = k.split(".")
        w = _g(l, {"W_query": "q_proj", "W_key": "k_proj", "W_value": "v_proj"}[name] + ".weight")
        d = w.shape[0] // l.num_heads
        out[k] = w[int(h) * d:(int(h) + 1) * d].T
    return out


# name: (article module, attnpp layer, inputs kind, gradients of the article's keys from attnpp's)
CASES = {
    "003 SingleHeadAttention": (lambda: SingleHead003(C),
                                lambda dt: ann.Attention(C, qk_dim=C // 4, out_dim=C, dtype=dt), "x", _fused_grads),
    "003 SingleHeadAttention bias=False": (lambda: SingleHead003(C, bias=False),
                                           lambda dt: ann.Attention(C, qk_dim=C // 4, out_dim=C, bias=False, dtype=dt),
                                           "x", _fused_grads),
    "003 BidirectionalAttention": (lambda: Causal003(C, NH), lambda dt: ann.Attention(C, NH, attn_dropout=0.1,
                                                                                     out_dropout=0.1, dtype=dt),
                                   "x+mask", _fused_grads),
    "003 CausalAttention": (lambda: Causal003(C, NH, 8), lambda dt: ann.Attention(
        C, NH, causal=True, context_length=8, attn_dropout=0.1, out_dropout=0.1, dtype=dt), "x+mask", _fused_grads),
    "003 CausalCrossAttention": (lambda: CausalCross003(C, NH, S), lambda dt: ann.Attention(
        C, NH, causal=True, context_length=S, attn_dropout=0.1, out_dropout=0.1, dtype=dt), "x,y+mask", _fused_grads),
    "004 MultiHeadAttention": (lambda: MHA004(C, 8, 12, 0.1, 2), lambda dt: ann.Attention(
        C, 2, qk_dim=8, bias=False, out_bias=True, causal=True, attn_dropout=0.1, context_length=12, dtype=dt), "x",
        _linear_grads({"W_query": "q_proj", "W_key": "k_proj", "W_value": "v_proj", "out_proj": "out_proj"})),
    "004 MultiHeadAttention qkv_bias=True": (lambda: MHA004(C, 8, 12, 0.1, 2, qkv_bias=True), lambda dt: ann.Attention(
        C, 2, qk_dim=8, causal=True, attn_dropout=0.1, context_length=12, dtype=dt), "x",
        _linear_grads({"W_query": "q_proj", "W_key": "k_proj", "W_value": "v_proj", "out_proj": "out_proj"})),
    "000 MultiheadAttention": (lambda: MHA000(C, 8, 2, 6), lambda dt: ann.Attention(
        C, 2, qk_dim=8, causal=True, attn_dropout=0.1, context_length=6, dtype=dt), "x",
        _linear_grads({"w_q": "q_proj", "w_k": "k_proj", "w_v": "v_proj", "out_proj": "out_proj"})),
    "000 CausalSelfAttention": (lambda: CausalSelf000(C, 10, 6), lambda dt: ann.Attention(
        C, qk_dim=10, out_proj=False, causal=True, context_length=6, dtype=dt), "x",
        _linear_grads({"w_q": "q_proj", "w_k": "k_proj", "w_v": "v_proj"})),
    "002 SelfAttention": (lambda: SelfAttention002(C, 6, 5), lambda dt: ann.Attention(
        C, qk_dim=6, v_dim=5, bias=False, out_proj=False, dtype=dt), "x unbatched", _matmul_grads),
    "002 CrossAttention": (lambda: SelfAttention002(C, 6, 5), lambda dt: ann.Attention(
        C, qk_dim=6, v_dim=5, bias=False, out_proj=False, dtype=dt), "x,y unbatched", _matmul_grads),
    "002 MultiHeadAttentionWrapper": (lambda: Wrapper002(C, 3, 2, 4), lambda dt: ann.Attention(
        C, 4, qk_dim=12, v_dim=8, bias=False, out_proj=False, dtype=dt), "x unbatched", _head_grads),
}


def _run(name, dtype):
    make_ref, make_layer, kind, grads_of = CASES[name]
    torch.manual_seed(0)
    ref = make_ref().to(TORCH[dtype]).eval()
    layer = make_layer(dtype).eval()
    assert layer.load_state_dict(ref.state_dict()) == ([], [])          # the article's state dict, unchanged
    rng = np.random.default_rng(1)
    unbatched = kind.endswith("unbatched")
    shape = (S, C) if unbatched else (B, S, C)
    x = rng.standard_normal(shape).astype(dtype)
    y = rng.standard_normal((7, C) if unbatched else shape).astype(dtype) if "y" in kind else None
    xt = torch.tensor(x, requires_grad=True)
    yt = None if y is None else torch.tensor(y, requires_grad=True)
    pad = _pad() if "mask" in kind else None
    args = [xt] + ([yt] if yt is not None else []) + ([pad] if pad is not None else [])
    out_t = ref(*args)
    grad_out = rng.standard_normal(tuple(out_t.shape)).astype(dtype)
    (out_t * torch.from_numpy(grad_out)).sum().backward()
    expected = {"output": out_t.detach().numpy(), "grad x": xt.grad.numpy()}
    if yt is not None:
        expected["grad y"] = yt.grad.numpy()
    expected.update({"grad " + k: p.grad.numpy() for k, p in ref.named_parameters()})

    out = layer(x, context=y, key_padding_mask=None if pad is None else pad.numpy())
    grads = layer.backward(grad_out)
    got = {"output": out}
    if y is None:
        got["grad x"] = grads
    else:
        got["grad x"], got["grad y"] = grads
    got.update({"grad " + k: g for k, g in grads_of(layer, [k for k, _ in ref.named_parameters()]).items()})
    return expected, got


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(CASES))
def test_article_state_dict_loads_and_matches(name, dtype):
    expected, got = _run(name, dtype)
    assert set(got) == set(expected)
    for q, e in expected.items():
        assert got[q].shape == e.shape, q
        err = np.abs(got[q] - e).max() / max(1.0, np.abs(e).max())
        assert err < TOL[dtype], (q, err)


def test_state_dict_keeps_attnpp_keys():
    ref = MHA004(C, 8, 12, 0.1, 2)
    layer = ann.Attention(C, 2, qk_dim=8, bias=False, out_bias=True, causal=True, context_length=12)
    layer.load_state_dict(ref.state_dict())
    assert list(layer.state_dict()) == ["q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight",
                                        "out_proj.bias"]
    np.testing.assert_array_equal(layer.q_proj.weight.data, ref.W_query.weight.detach().numpy())
    other = ann.Attention(C, 2, qk_dim=8, bias=False, out_bias=True, causal=True, context_length=12)
    assert other.load_state_dict(layer.state_dict()) == ([], [])      # attnpp's own keys, as before
    np.testing.assert_array_equal(other.out_proj.bias.data, ref.out_proj.bias.detach().numpy())


# ------------------------------------------------------------------------------------------- refusals
def _snapshot(layer):
    return {k: v.copy() for k, v in layer.state_dict().items()}


def _refused(layer, sd, words, error=ValueError):
    before = _snapshot(layer)
    with pytest.raises(error) as info:
        layer.load_state_dict(sd)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    after = layer.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before), "a refused load changed the layer"


def _layer004(causal=True, context_length=12):
    return ann.Attention(C, 2, qk_dim=8, bias=False, out_bias=True, causal=causal, context_length=context_length)


@pytest.mark.parametrize("mask", ["zeros", "tril", "diagonal kept masked", "values 2", "not square"])
def test_wrong_mask_buffer_refused(mask):
    sd = MHA004(C, 8, 12, 0.1, 2).state_dict()
    causal = torch.triu(torch.ones(12, 12), 1)                           # the right buffer
    sd["mask"] = {"zeros": torch.zeros(12, 12), "tril": torch.tril(torch.ones(12, 12), -1),
                  "diagonal kept masked": torch.triu(torch.ones(12, 12)), "values 2": 2 * causal,
                  "not square": torch.ones(12, 11)}[mask]
    _refused(_layer004(), sd, ["'mask'"])


def test_causal_mask_into_non_causal_layer_refused():
    _refused(_layer004(causal=False), MHA004(C, 8, 12, 0.1, 2).state_dict(), ["causal=False", "'mask'"])
    # 003's BidirectionalAttention has no buffer and loads into the non-causal layer; its CausalAttention does not
    _refused(ann.Attention(C, NH, context_length=8), Causal003(C, NH, 8).state_dict(), ["causal_mask", "causal=False"])


def test_mask_of_another_context_length_refused():
    _refused(_layer004(context_length=10), MHA004(C, 8, 12, 0.1, 2).state_dict(), ["context_length=10"])


def test_wrongly_shaped_key_refused_layer_unchanged():
    sd = MHA004(C, 8, 12, 0.1, 2).state_dict()
    sd["W_key.weight"] = torch.zeros(8, C + 1)
    _refused(_layer004(), sd, ["W_key.weight", "expected shape"])
    # two loaders (Wqkv through load_fused_qkv, then Wo): the first is valid, the second not, and nothing is copied
    ref = Causal003(C, NH, 8)
    sd = ref.state_dict()
    sd["Wo.weight"] = torch.zeros(C, C - 1)
    _refused(ann.Attention(C, NH, causal=True, context_length=8), sd, ["Wo.weight"])
    sd = ref.state_dict()
    sd["Wqkv.bias"] = torch.zeros(3 * C + 1)
    _refused(ann.Attention(C, NH, causal=True, context_length=8), sd, ["Wqkv.bias"])


def test_unknown_key_refused_layer_unchanged():
    sd = CausalCross003(C, NH, S).state_dict()
    sd["Wx.weight"] = torch.zeros(C, C)
    _refused(ann.Attention(C, NH, causal=True, context_length=S), sd, ["unexpected", "Wx.weight", "003"])
    sd = MHA004(C, 8, 12, 0.1, 2, qkv_bias=True).state_dict()            # biases the layer does not have
    _refused(_layer004(), sd, ["unexpected", "W_query.bias"])
    sd = MHA004(C, 8, 12, 0.1, 2).state_dict()
    del sd["mask"]                                                       # a causal layer expects the buffer
    _refused(_layer004(), sd, ["missing", "'mask'"])


def test_integer_weight_refused():
    sd = MHA004(C, 8, 12, 0.1, 2).state_dict()
    sd["W_query.weight"] = torch.zeros(8, C, dtype=torch.int64)
    _refused(_layer004(), sd, ["W_query.weight"], TypeError)


def test_not_strict_returns_keys_and_loads_the_rest():
    ref = Causal003(C, NH, 8)
    sd = ref.state_dict()
    del sd["Wo.bias"]
    sd["extra"] = torch.zeros(3)
    layer = ann.Attention(C, NH, causal=True, context_length=8)
    bias_before = layer.out_proj.bias.data.copy()
    result = layer.load_state_dict(sd, strict=False)
    assert isinstance(result, attnpp.nn.module.IncompatibleKeys)
    assert result == (["Wo.bias"], ["extra"])
    assert result.missing_keys == ["Wo.bias"] and result.unexpected_keys == ["extra"]
    np.testing.assert_array_equal(layer.out_proj.bias.data, bias_before)
    np.testing.assert_array_equal(layer.v_proj.weight.data, ref.Wqkv.weight.detach().numpy()[2 * C:])
    # strict refuses the same dict, naming both
    _refused(ann.Attention(C, NH, causal=True, context_length=8), sd, ["missing", "Wo.bias", "extra"])


def test_not_strict_fused_bias_without_its_weight():
    ref = Causal003(C, NH, 8)
    sd = ref.state_dict()
    del sd["Wqkv.weight"]
    layer = ann.Attention(C, NH, causal=True, context_length=8)
    weight_before = layer.q_proj.weight.data.copy()
    assert layer.load_state_dict(sd, strict=False) == (["Wqkv.weight"], [])
    np.testing.assert_array_equal(layer.q_proj.weight.data, weight_before)
    np.testing.assert_array_equal(layer.k_proj.bias.data, ref.Wqkv.bias.detach().numpy()[C:2 * C])
