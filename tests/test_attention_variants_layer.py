"""attnpp.nn.Attention with the attention variants of modern open models (issue 14): sliding window, ALiBi,
soft-capping, learned sinks and rotary position embeddings, alone and together with causal masks, padding masks,
dropout and need_weights, against the layer's math written in PyTorch (helpers.attention_layer_reference), the
output, weights and every gradient (inputs, projections, sinks) in float64 and float32; finite differences;
sinks trained by the optimizers and kept by state dicts and copies; and KV-cache decoding, whose token-by-token
outputs equal the full forward's.
"""
import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import attnpp
import attnpp.functional as AF
from attnpp import nn
from helpers import DTYPES, HYPOTHESIS_EXAMPLES, TOL, assert_close, attention_layer_reference, examples, max_rel_err


def randomize(layer, seed):
    """Parameters (sinks included) drawn N(0, 0.5^2), so that biases and sinks matter."""
    rng = np.random.default_rng(seed)
    for p in layer.parameters():
        p.data[...] = 0.5 * rng.standard_normal(p.shape)
    return layer


def check_layer(layer, x, context=None, kpm=None, need_weights=True, seed=5, g_seed=0):
    """Run forward and backward of ``layer`` (batched inputs) and compare the output, the weights, the inputs'
    gradients and every parameter's with the float64 PyTorch reference (dropout replayed from the seeds)."""
    dtype = layer.dtype.type  # (np.float32 or np.float64: TOL's keys)
    B, L = x.shape[:2]
    S = L if context is None else context.shape[1]
    layer.zero_grad()
    result = layer(x, context, key_padding_mask=kpm, need_weights=need_weights, seed=seed)
    out, weights = result if need_weights else (result, None)
    keep_attn = keep_out = None
    if layer.training and layer.attn_dropout > 0:
        keep_attn = AF.dropout_mask((B, layer.num_heads, L, S), layer.attn_dropout, layer.last_seed)
    if layer.training and layer.out_drop.p > 0:
        keep_out = AF.dropout_mask(out.shape, layer.out_drop.p, layer.out_drop.last_seed)
    g = np.random.default_rng(g_seed).standard_normal(out.shape).astype(dtype)
    grads = layer.backward(g)
    grads = (grads,) if context is None else grads
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tc = tx if context is None else torch.tensor(context, dtype=torch.float64, requires_grad=True)
    tout, tw, P = attention_layer_reference(layer, tx, tc, kpm, keep_attn, keep_out, dtype=torch.float64)
    (tout * torch.tensor(g, dtype=torch.float64)).sum().backward()
    assert_close(out, tout.detach().numpy(), dtype, "output")
    if need_weights:
        assert_close(weights, tw.detach().numpy(), dtype, "weights")
    for name, ours, t in zip(("grad x", "grad context"), grads, (tx, tc)):
        assert_close(ours, t.grad.numpy(), dtype, name)
    for name, p in layer.named_parameters():
        assert_close(p.grad, P[name].grad.numpy(), dtype, "grad " + name)
    return out


# ------------------------------------------------------------------------------------------ parity, by option
OPTIONS = {
    "window": dict(window=(2, 1)),
    "causal_window": dict(causal=True, window=(3, 0)),
    "alibi": dict(alibi=True),
    "alibi_slopes": dict(alibi=np.array([0.3, 1.5])),
    "softcap": dict(softcap=0.8),
    "sinks": dict(sinks=True),
    "causal_sinks": dict(causal=True, sinks=True),
    "rotary": dict(rotary=True),
    "rotary_partial_interleaved": dict(rotary=True, rotary_dim=2, rotary_interleaved=True, rotary_base=100.0),
    "all": dict(causal=True, window=(4, 0), alibi=True, softcap=2.0, sinks=True, rotary=True),
    "all_bottom_right": dict(causal=True, causal_alignment="bottom_right", window=(1, 2), alibi=True, softcap=2.0,
                             sinks=True, rotary=True, rotary_interleaved=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("padding", [None, "bool", "float"])
def test_option_matches_reference(dtype, option, cross, padding):
    """Each option (and all together), in self- and cross-attention (L=6 queries, S=9 keys), with a bool or
    float key_padding_mask, in training mode with both dropouts: output, weights and every gradient."""
    layer = nn.Attention(8, 2, kv_dim=5 if cross else None, attn_dropout=0.2, out_dropout=0.1, dtype=dtype,
                         **OPTIONS[option])
    randomize(layer, 1)
    rng = np.random.default_rng(2)
    B, L, S = 3, 6, 9 if cross else 6
    x = rng.standard_normal((B, L, 8)).astype(dtype)
    context = rng.standard_normal((B, S, 5)).astype(dtype) if cross else None
    kpm = None
    if padding == "bool":
        kpm = rng.random((B, S)) < 0.3
        kpm[0] = True  # a sequence whose keys are all padding: its rows attend to nothing (or to the sink)
    elif padding == "float":
        kpm = rng.standard_normal((B, S)).astype(dtype)
    check_layer(layer, x, context, kpm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequences_cross_kernel_blocks(dtype):
    """L = S = 300 (the kernel's blocks are 256 queries by 256 or 128 keys): every option at once, eval mode."""
    layer = randomize(nn.Attention(16, 2, causal=True, window=(150, 0), alibi=True, softcap=4.0, sinks=True,
                                   rotary=True, rotary_dim=4, dtype=dtype), 3).eval()
    x = np.random.default_rng(4).standard_normal((1, 300, 16)).astype(dtype)
    check_layer(layer, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbatched_equals_batch_of_one(dtype):
    layer = randomize(nn.Attention(8, 2, causal=True, window=(2, 0), alibi=True, softcap=3.0, sinks=True,
                                   rotary=True, dtype=dtype), 5)
    x = np.random.default_rng(6).standard_normal((7, 8)).astype(dtype)
    out = layer(x)
    gx = layer.backward(np.ones_like(out))
    grads = {n: p.grad.copy() for n, p in layer.named_parameters()}
    layer.zero_grad()
    out1 = layer(x[None])
    gx1 = layer.backward(np.ones_like(out1))
    np.testing.assert_array_equal(out, out1[0])
    np.testing.assert_array_equal(gx, gx1[0])
    for n, p in layer.named_parameters():
        np.testing.assert_array_equal(grads[n], p.grad, err_msg=n)


# -------------------------------------------------------------------------------------- parity, hypothesis
@st.composite
def layer_cases(draw):
    """A random Attention configuration with random variants (each on or off), inputs, mask and mode."""
    dtype = draw(st.sampled_from(DTYPES))
    H = draw(st.integers(1, 3))
    head = draw(st.sampled_from([2, 4, 6]))
    cfg = dict(num_heads=H, embed_dim=draw(st.integers(1, 9)), qk_dim=H * head)
    if draw(st.booleans()):
        cfg["v_dim"] = H * draw(st.integers(1, 4))
    cross = draw(st.booleans())
    cfg["kv_dim"] = draw(st.integers(1, 9)) if cross else cfg["embed_dim"]
    cfg["out_proj"] = draw(st.booleans())
    cfg["bias"] = draw(st.booleans())
    cfg["causal"] = draw(st.booleans())
    cfg["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    side = st.sampled_from([-1, 0, 1, 3])
    if draw(st.booleans()):
        cfg["window"] = (draw(side), draw(side))
    alibi = draw(st.sampled_from(["off", "standard", "custom"]))
    if alibi == "standard":
        cfg["alibi"] = True
    elif alibi == "custom":
        cfg["alibi"] = np.array(draw(st.lists(st.floats(0.0, 2.0), min_size=H, max_size=H)))
    if draw(st.booleans()):
        cfg["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    cfg["sinks"] = draw(st.booleans())
    if draw(st.booleans()):
        cfg["rotary"] = True
        cfg["rotary_dim"] = draw(st.sampled_from([None] + list(range(2, head + 1, 2))))
        cfg["rotary_base"] = draw(st.sampled_from([10000.0, 10.0]))
        cfg["rotary_interleaved"] = draw(st.booleans())
    training = draw(st.booleans())
    if training:
        cfg["attn_dropout"], cfg["out_dropout"] = (draw(st.sampled_from([0.0, 0.3])) for _ in range(2))
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    S = draw(st.integers(1, 9)) if cross else L
    if draw(st.integers(0, 9)) == 9:  # across the kernel's blocks
        B, L = 1, draw(st.sampled_from([129, 257, 300]))
        S = draw(st.sampled_from([130, 260])) if cross else L
    kpm = draw(st.sampled_from(["none", "bool", "float"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(dtype=dtype, cfg=cfg, cross=cross, training=training, B=B, L=L, S=S, kpm=kpm, seed=seed,
                need_weights=draw(st.booleans()))


@settings(max_examples=examples(120))
@given(case=layer_cases())
def test_variants_layer_matches_reference(case):
    """Any combination of the variants with the existing options (widths, heads, biases, causal either way,
    cross-attention with S != L, bool or float key_padding_mask with fully masked rows, dropout replayed,
    need_weights): output, weights and every gradient, sinks' included."""
    HYPOTHESIS_EXAMPLES["test_variants_layer_matches_reference"] += 1
    note(repr(case))
    dtype, cfg = case["dtype"], case["cfg"]
    layer = randomize(nn.Attention(dtype=dtype, **cfg), case["seed"]).train(case["training"])
    rng = np.random.default_rng(case["seed"] + 1)
    B, L, S = case["B"], case["L"], case["S"]
    x = rng.standard_normal((B, L, cfg["embed_dim"])).astype(dtype)
    context = rng.standard_normal((B, S, cfg["kv_dim"])).astype(dtype) if case["cross"] else None
    kpm = None
    if case["kpm"] != "none":
        hidden = rng.random((B, S)) < rng.choice([0.2, 0.6, 1.0])
        kpm = hidden if case["kpm"] == "bool" else np.where(hidden, -np.inf, rng.standard_normal((B, S))).astype(
            dtype)
    check_layer(layer, x, context, kpm, case["need_weights"], seed=case["seed"] % 1000, g_seed=case["seed"])


# ------------------------------------------------------------------------------------- finite differences
def test_finite_differences_every_option():
    """float64 central differences, without PyTorch: the gradients of x, of every parameter (sinks included)
    of a layer with every option, through the loss sum(out * g)."""
    layer = randomize(nn.Attention(6, 2, qk_dim=8, v_dim=4, causal=True, window=(3, 0), alibi=True, softcap=1.5,
                                   sinks=True, rotary=True, dtype=np.float64), 7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 6))
    kpm = np.zeros((2, 6), bool)
    kpm[1, 2] = True
    g = rng.standard_normal((2, 6, 4))  # (out_dim = v_dim = 4)
    loss = lambda: float((layer(x, key_padding_mask=kpm) * g).sum())
    layer.zero_grad()
    layer(x, key_padding_mask=kpm)
    grad_x = layer.backward(g)
    with attnpp.no_grad():
        for name, value, grad in [("x", x, grad_x)] + [(n, p.data, p.grad) for n, p in layer.named_parameters()]:
            numeric = np.zeros_like(value)
            for i in np.ndindex(value.shape):
                old = value[i]
                value[i] = old + 1e-6
                up = loss()
                value[i] = old - 1e-6
                down = loss()
                value[i] = old
                numeric[i] = (up - down) / 2e-6
            err = max_rel_err(grad, numeric)
            assert err < 1e-7, f"{name}: finite differences differ by {err:.3g}"


# ------------------------------------------------------------------------------- sinks: a trained parameter
def test_sinks_parameter_state_dict_and_copies():
    layer = nn.Attention(8, 4, sinks=True, dtype=np.float64)
    assert isinstance(layer.sinks, nn.Parameter) and layer.sinks.shape == (4,) and not layer.sinks.data.any()
    names = [n for n, _ in layer.named_parameters()]
    assert names[0] == "sinks" and list(layer.state_dict())[0] == "sinks"
    assert nn.Attention(8, 4).sinks is None and "sinks" not in nn.Attention(8, 4).state_dict()
    state = {n: np.arange(p.data.size, dtype=np.float64).reshape(p.shape) for n, p in layer.named_parameters()}
    layer.load_state_dict(state)
    np.testing.assert_array_equal(layer.sinks.data, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="missing keys.*'sinks'"):
        layer.load_state_dict({n: v for n, v in state.items() if n != "sinks"})
    with pytest.raises(ValueError, match="unexpected keys.*'sinks'"):
        nn.Attention(8, 4, dtype=np.float64).load_state_dict(state)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    layer(x)
    layer.backward(np.ones((2, 3, 8)))
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert repr(clone) == repr(layer)
        np.testing.assert_array_equal(clone.sinks.data, layer.sinks.data)
        np.testing.assert_array_equal(clone.sinks.grad, layer.sinks.grad)
        assert not np.shares_memory(clone.sinks.data, layer.sinks.data)
        np.testing.assert_array_equal(clone(x), layer(x))


def test_sinks_gradient_accumulates_and_optimizers_train_it():
    """Two forwards and backwards sum their gradients into sinks.grad; SGD moves sinks by -lr * grad; AdamW and
    a few steps lower a loss that needs the sinks (a target of half the attention output)."""
    layer = randomize(nn.Attention(4, 2, sinks=True, out_proj=False, dtype=np.float64), 0)
    x = np.random.default_rng(1).standard_normal((2, 5, 4))
    layer(x)
    layer.backward(np.ones((2, 5, 4)))
    once = layer.sinks.grad.copy()
    assert np.abs(once).min() > 0
    layer(x)
    layer.backward(np.ones((2, 5, 4)))
    np.testing.assert_allclose(layer.sinks.grad, 2 * once, rtol=1e-14)
    before = layer.sinks.data.copy()
    attnpp.optim.SGD(layer.parameters(), lr=0.1).step()
    np.testing.assert_allclose(layer.sinks.data, before - 0.1 * 2 * once, rtol=1e-14)

    # (seeded: the layer's initialisation comes from attnpp's generator, which the tests before this one advance
    # by a number of draws that changes as tests are added; 30 steps left 3 initialisations of 20 above the bound,
    # 60 steps none, at most 0.045)
    attnpp.manual_seed(0)
    layer = nn.Attention(4, 2, sinks=True, out_proj=False, bias=False, dtype=np.float64)
    target = 0.5 * layer(x)
    opt = attnpp.optim.AdamW([layer.sinks], lr=0.1, weight_decay=0.0)  # the sinks alone
    losses = []
    for _ in range(60):
        opt.zero_grad()
        out = layer(x)
        losses.append(float(((out - target) ** 2).mean()))
        layer.backward(2 * (out - target) / out.size)
        opt.step()
    assert losses[-1] < 0.05 * losses[0], losses
    assert (layer.sinks.data > 0).all()  # a sink of weight about 1/2: its logit near the keys' log-sum-exp


def test_article_state_dict_into_a_layer_with_sinks():
    """No article learns sinks: a strict load names the missing key; strict=False loads the rest."""
    article = {"W_query": np.ones((4, 4)), "W_key": np.ones((4, 4)), "W_value": np.ones((4, 4))}  # article 002
    layer = nn.Attention(4, 2, bias=False, out_proj=False, sinks=True, dtype=np.float64)
    with pytest.raises(ValueError, match="missing keys.*'sinks'"):
        layer.load_state_dict(article)
    assert layer.load_state_dict(article, strict=False) == (["sinks"], [])
    np.testing.assert_array_equal(layer.q_proj.weight.data, np.ones((4, 4)))


# ------------------------------------------------------------------------------------------- repr, options
def test_repr_and_attributes():
    layer = nn.Attention(8, 2, causal=True, window=(3, 0), alibi=True, softcap=5.0, sinks=True, rotary=True,
                         rotary_dim=2, rotary_base=500000.0, rotary_interleaved=True)
    text = repr(layer)
    for part in ("window=(3, 0)", "alibi=True", "softcap=5.0", "sinks=True", "rotary=True", "rotary_dim=2",
                 "rotary_base=500000.0", "rotary_interleaved=True"):
        assert part in text, text
    np.testing.assert_array_equal(layer.alibi_slopes, AF.get_alibi_slopes(2, np.float64))
    assert "alibi=[0.25, 0.5]" in repr(nn.Attention(8, 2, alibi=np.array([0.25, 0.5])))
    plain = nn.Attention(8, 2)
    assert (plain.window, plain.alibi_slopes, plain.softcap, plain.sinks, plain.rotary) == (None, None, None,
                                                                                             None, False)
    assert "window" not in repr(plain) and "rotary" not in repr(plain)
    assert nn.Attention(8, 2, rotary=True).rotary_dim == 4
    assert nn.Attention(8, 2, softcap=0.0).softcap is None


# ----------------------------------------------------------------------------------------- KV-cache decoding
DECODING = {
    "plain": {},
    "window": dict(window=(3, 0)),
    "alibi": dict(alibi=True),
    "softcap": dict(softcap=1.0),
    "sinks": dict(sinks=True),
    "rotary": dict(rotary=True),
    "rotary_partial_interleaved": dict(rotary=True, rotary_dim=2, rotary_interleaved=True, rotary_base=50.0),
    "all": dict(window=(4, 0), alibi=True, softcap=2.0, sinks=True, rotary=True),
    "all_no_out_proj": dict(window=(2, -1), alibi=np.array([0.1, 0.7]), softcap=2.0, sinks=True, rotary=True,
                            out_proj=False, v_dim=6),
}
DECODING_TOL = {np.float64: 1e-12, np.float32: TOL[np.float32]}


def decode(layer, x, prompt, chunk=1):
    """x (B, T, E) decoded with a KV cache: the first ``prompt`` tokens in one call, the rest ``chunk`` at a time;
    the outputs concatenated, and the cache."""
    cache = layer.init_kv_cache(x.shape[0], x.shape[1] + 3)
    outs = [layer(x[:, :prompt], kv_cache=cache)] if prompt else []
    for t in range(prompt, x.shape[1], chunk):
        outs.append(layer(x[:, t:t + chunk], kv_cache=cache))
    return np.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(DECODING))
@pytest.mark.parametrize("prompt,chunk", [(5, 1), (0, 1), (7, 3)])
def test_kv_cache_decoding_equals_full_forward(dtype, option, prompt, chunk):
    """A prompt prefilled, then the tokens fed one by one (or a few at a time) through the cache, give the full
    forward's outputs on the whole sequence; the cache then holds the keys and values (rotated) of every token."""
    layer = randomize(nn.Attention(8, 2, causal=True, dtype=dtype, **DECODING[option]), 9).eval()
    x = np.random.default_rng(10).standard_normal((2, 12, 8)).astype(dtype)
    with attnpp.no_grad():
        full = layer(x)
    ours, cache = decode(layer, x, prompt, chunk)
    err = max_rel_err(ours, full)
    assert err <= DECODING_TOL[dtype], f"decoding differs from the full forward by {err:.3g}"
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    with attnpp.no_grad():
        values = layer._heads(layer.v_proj(x))
    np.testing.assert_allclose(cache.value[:, :, :12], values, rtol=0, atol=DECODING_TOL[dtype])
    assert not cache.value[:, :, 12:].any()


def test_kv_cache_is_the_rotated_keys_and_a_step_attends_to_its_prefix():
    """Sequences at different lengths in one cache (a prefill per sequence, by hand): each new token is written
    at its sequence's length, rotated at that position, and attends to its own prefix only."""
    layer = randomize(nn.Attention(8, 2, causal=True, rotary=True, alibi=True, sinks=True, dtype=np.float64), 11)
    layer.eval()
    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 7, 8))
    cache = layer.init_kv_cache(2, 10)
    for i, seq in enumerate((a, b)):  # prefill each sequence in its own cache, then copy into the shared one
        own = layer.init_kv_cache(1, 10)
        layer(seq, kv_cache=own)
        cache.key[i], cache.value[i], cache.lengths[i] = own.key[0], own.value[0], own.lengths[0]
    step = rng.standard_normal((2, 1, 8))
    out = layer(step, kv_cache=cache)
    np.testing.assert_array_equal(cache.lengths, [5, 8])
    with attnpp.no_grad():
        for i, seq in enumerate((a, b)):
            whole = layer(np.concatenate([seq, step[i:i + 1]], axis=1))
            assert max_rel_err(out[i], whole[0, -1:]) <= 1e-12


def test_kv_cache_call_saves_no_context(rng):
    """A decoding call saves nothing (the layer's projections neither): a backward after it consumes the
    forward before it, with that forward's gradients; a layer that only decoded has no context to consume."""
    layer = randomize(nn.Attention(8, 2, causal=True, sinks=True, rotary=True, dtype=np.float64), 13)
    twin = copy.deepcopy(layer)
    x = rng.standard_normal((2, 5, 8))
    out = layer(x)
    cache = layer.init_kv_cache(2, 8)
    layer(x, kv_cache=cache)  # the same shape as out: a context left by it would be consumed here
    assert all(len(m._contexts) == 1 for m in layer.modules())  # the first forward's only
    g = rng.standard_normal(out.shape)
    grad_x = layer.backward(g)
    twin(x)
    np.testing.assert_array_equal(grad_x, twin.backward(g))
    for (n, p), (_, q) in zip(layer.named_parameters(), twin.named_parameters()):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=n)
    fresh = nn.Attention(8, 2, causal=True, dtype=np.float64)
    y = fresh(x, kv_cache=fresh.init_kv_cache(2, 5))
    for m in fresh.modules():
        with pytest.raises(ValueError, match="no forward context left"):
            m.backward(np.ones_like(y))


def test_kv_cache_refused_call_changes_nothing(rng):
    layer = nn.Attention(8, 2, causal=True, rotary=True, dtype=np.float64).eval()
    cache = layer.init_kv_cache(2, 6)
    layer(rng.standard_normal((2, 4, 8)), kv_cache=cache)
    key, value = cache.key.copy(), cache.value.copy()
    with pytest.raises(ValueError, match="no room for 3 more tokens"):
        layer(rng.standard_normal((2, 3, 8)), kv_cache=cache)
    np.testing.assert_array_equal(cache.lengths, [4, 4])
    np.testing.assert_array_equal(cache.key, key)
    np.testing.assert_array_equal(cache.value, value)
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0])
    assert "KVCache(batch_size=2, num_heads=2, max_length=6, head_dim=4" in repr(cache)
