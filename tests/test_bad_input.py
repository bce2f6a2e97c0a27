"""Bad input raises ValueError or TypeError whose message names the argument and the shapes (DESIGN.md).

Table-driven: each case is (callable, expected exception type, words that must all appear in the message).
The layer cases also check that a failed call leaves the layer as it was: same parameters, and a valid
forward + backward afterwards gives the same answer as a fresh layer with the same state.
"""
import re

import numpy as np
import pytest

import attnpp
import attnpp.functional as AF
from attnpp.nn import Linear, MultiheadAttention


def words(*ws):
    """A regex that matches a message containing every one of ``ws`` (literally), in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(str(w))})" for w in ws)


def randn(*shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------------------------- functional SDPA
# A valid call: query (B, Hq, L, D) = (2, 2, 3, 4), key (2, 2, S=5, 4), value (2, 2, 5, Dv=6).
Q_SHAPE, K_SHAPE, V_SHAPE = (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 6)
OUT_SHAPE, LSE_SHAPE = (2, 2, 3, 6), (2, 2, 3)


def _q(dtype=np.float64, shape=Q_SHAPE):
    return randn(*shape, dtype=dtype, seed=1)


def _k(dtype=np.float64, shape=K_SHAPE):
    return randn(*shape, dtype=dtype, seed=2)


def _v(dtype=np.float64, shape=V_SHAPE):
    return randn(*shape, dtype=dtype, seed=3)


def _sdpa_call(kind, query, key, value, **kw):
    """A call of the forward, the backward or the weights with these (possibly bad) inputs.

    The backward gets grad_output, output and logsumexp of the valid call's shapes, in the query's dtype, so
    the only thing wrong is what the case changed.
    """
    dt = query.dtype if isinstance(query, np.ndarray) and query.dtype.kind == "f" else np.float64
    go = kw.pop("grad_output", np.ones(OUT_SHAPE, dt))
    out = kw.pop("output", np.zeros(OUT_SHAPE, dt))
    lse = kw.pop("logsumexp", np.zeros(LSE_SHAPE, dt))
    if kind == "forward":
        return lambda: AF.scaled_dot_product_attention_forward(query, key, value, **kw)
    if kind == "sdpa":
        return lambda: AF.scaled_dot_product_attention(query, key, value, **kw)
    if kind == "backward":
        return lambda: AF.scaled_dot_product_attention_backward(go, query, key, value, out, lse, **kw)
    if kind == "weights":
        return lambda: AF.scaled_dot_product_attention_weights(query, key, **kw)
    raise AssertionError(kind)


# id, (query, key, value, kwargs) builder, exception, words, uses value (False: also run on the weights)
SDPA_BAD = [
    ("query_list", lambda: (_q().tolist(), _k(), _v(), {}), TypeError, ["query", "ndarray", "list"], False),
    ("key_list", lambda: (_q(), _k().tolist(), _v(), {}), TypeError, ["key", "ndarray", "list"], False),
    ("value_list", lambda: (_q(), _k(), _v().tolist(), {}), TypeError, ["value", "ndarray", "list"], True),
    ("int_inputs", lambda: (_q(np.int32), _k(np.int32), _v(np.int32), {}), TypeError,
     ["query", "int32", "float32", "float64"], False),
    ("int_key", lambda: (_q(), _k(np.int64), _v(), {}), TypeError, ["key", "int64"], False),
    ("bool_inputs", lambda: (_q() > 0, _k() > 0, _v() > 0, {}), TypeError, ["query", "bool"], False),
    ("complex_inputs", lambda: (_q(np.complex128), _k(np.complex128), _v(np.complex128), {}), TypeError,
     ["query", "complex128"], False),
    ("float16_inputs", lambda: (_q(np.float16), _k(np.float16), _v(np.float16), {}), TypeError,
     ["query", "float16"], False),
    ("mixed_key_float32", lambda: (_q(), _k(np.float32), _v(), {}), TypeError, ["key", "float32", "float64"],
     False),
    ("mixed_value_float32", lambda: (_q(), _k(), _v(np.float32), {}), TypeError, ["value", "float32", "float64"],
     True),
    ("mixed_query_float32", lambda: (_q(np.float32), _k(), _v(), {}), TypeError, ["key", "float64", "float32"],
     False),
    ("query_1d", lambda: (_q(shape=(4,)), _k(), _v(), {}), ValueError, ["query", "(4,)"], False),
    ("key_1d", lambda: (_q(), _k(shape=(4,)), _v(), {}), ValueError, ["key", "(4,)"], False),
    ("value_1d", lambda: (_q(), _k(), _v(shape=(6,)), {}), ValueError, ["value", "(6,)"], True),
    ("query_key_D_mismatch", lambda: (_q(shape=(2, 2, 3, 4)), _k(shape=(2, 2, 5, 3)), _v(), {}), ValueError,
     ["query", "key", "(2, 2, 3, 4)", "(2, 2, 5, 3)"], False),
    ("key_value_S_mismatch", lambda: (_q(), _k(), _v(shape=(2, 2, 6, 6)), {}), ValueError,
     ["key", "value", "(2, 2, 5, 4)", "(2, 2, 6, 6)"], True),
    ("batch_no_broadcast", lambda: (_q(shape=(2, 2, 3, 4)), _k(shape=(3, 2, 5, 4)), _v(shape=(3, 2, 5, 6)), {}),
     ValueError, ["query", "key", "broadcast", "(2, 2)", "(3, 2)"], False),
    ("heads_no_broadcast", lambda: (_q(shape=(2, 2, 3, 4)), _k(shape=(2, 3, 5, 4)), _v(shape=(2, 3, 5, 6)), {}),
     ValueError, ["query", "key", "broadcast", "(2, 2)", "(2, 3)"], False),
    ("attn_mask_no_broadcast", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones((4, 5), bool))), ValueError,
     ["attn_mask", "(4, 5)", "(2, 2, 3, 5)"], False),
    ("attn_mask_too_many_dims", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones((3, 2, 2, 3, 5), bool))),
     ValueError, ["attn_mask", "(3, 2, 2, 3, 5)", "(2, 2, 3, 5)"], False),
    ("attn_mask_batch_no_broadcast", lambda: (_q(), _k(), _v(), dict(attn_mask=np.zeros((3, 1, 3, 5)))),
     ValueError, ["attn_mask", "(3, 1, 3, 5)", "(2, 2, 3, 5)"], False),
    ("attn_mask_float32", lambda: (_q(), _k(), _v(), dict(attn_mask=np.zeros((3, 5), np.float32))), TypeError,
     ["attn_mask", "float32", "float64"], False),
    ("attn_mask_int", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones((3, 5), np.int64))), TypeError,
     ["attn_mask", "int64"], False),
    ("attn_mask_list", lambda: (_q(), _k(), _v(), dict(attn_mask=[[True] * 5] * 3)), TypeError,
     ["attn_mask", "list"], False),
    ("is_causal_with_attn_mask", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones((3, 5), bool), is_causal=True)),
     ValueError, ["attn_mask", "is_causal"], False),
    ("dropout_p_negative", lambda: (_q(), _k(), _v(), dict(dropout_p=-0.1, seed=0)), ValueError,
     ["dropout_p", "-0.1"], False),
    ("dropout_p_one", lambda: (_q(), _k(), _v(), dict(dropout_p=1.0, seed=0)), ValueError, ["dropout_p", "1.0"],
     False),
    ("scale_str", lambda: (_q(), _k(), _v(), dict(scale="x")), TypeError, ["scale", "str"], False),
    ("dropout_p_str", lambda: (_q(), _k(), _v(), dict(dropout_p="0.1", seed=0)), TypeError, ["dropout_p", "str"],
     False),
    ("causal_alignment_unknown", lambda: (_q(), _k(), _v(), dict(is_causal=True, causal_alignment="diagonal")),
     ValueError, ["causal_alignment", "diagonal"], False),
    ("gqa_heads_not_multiple", lambda: (_q(shape=(2, 3, 3, 4)), _k(shape=(2, 2, 5, 4)), _v(shape=(2, 2, 5, 6)),
                                        dict(enable_gqa=True)),
     ValueError, ["enable_gqa", "query", "key", "(2, 3, 3, 4)", "(2, 2, 5, 4)"], False),
    ("gqa_value_heads_differ", lambda: (_q(shape=(2, 4, 3, 4)), _k(shape=(2, 2, 5, 4)), _v(shape=(2, 1, 5, 6)),
                                        dict(enable_gqa=True)),
     ValueError, ["enable_gqa", "value", "(2, 2, 5, 4)", "(2, 1, 5, 6)"], True),
]

SDPA_BAD_PARAMS = [
    pytest.param(kind, build, exc, ws, id=f"{kind}-{cid}")
    for cid, build, exc, ws, uses_value in SDPA_BAD
    for kind in ("forward", "sdpa", "backward", "weights")
    if not (uses_value and kind == "weights")
]


@pytest.mark.parametrize("kind, build, exc, ws", SDPA_BAD_PARAMS)
def test_sdpa_bad_input(kind, build, exc, ws):
    query, key, value, kw = build()
    with pytest.raises(exc, match=words(*ws)):
        _sdpa_call(kind, query, key, value, **kw)()


SDPA_BACKWARD_BAD = [
    ("dropout_without_seed", dict(dropout_p=0.3), ValueError, ["seed", "dropout_p"]),
    ("grad_output_shape", dict(grad_output=np.ones((2, 2, 3, 5))), ValueError,
     ["grad_output", "(2, 2, 3, 6)", "(2, 2, 3, 5)"]),
    ("grad_output_transposed", dict(grad_output=np.ones((2, 2, 6, 3))), ValueError,
     ["grad_output", "(2, 2, 3, 6)", "(2, 2, 6, 3)"]),
    ("grad_output_dtype", dict(grad_output=np.ones(OUT_SHAPE, np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("grad_output_list", dict(grad_output=np.ones(OUT_SHAPE).tolist()), TypeError, ["grad_output", "list"]),
    ("output_shape", dict(output=np.zeros((2, 2, 3, 4))), ValueError, ["output", "(2, 2, 3, 6)", "(2, 2, 3, 4)"]),
    ("logsumexp_shape", dict(logsumexp=np.zeros((2, 2, 5))), ValueError, ["logsumexp", "(2, 2, 3)", "(2, 2, 5)"]),
]


@pytest.mark.parametrize("cid, kw, exc, ws", SDPA_BACKWARD_BAD, ids=[c[0] for c in SDPA_BACKWARD_BAD])
def test_sdpa_backward_bad_input(cid, kw, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        _sdpa_call("backward", _q(), _k(), _v(), **kw)()


def test_sdpa_weights_bad_logsumexp():
    with pytest.raises(ValueError, match=words("logsumexp", "(2, 2, 3)", "(2, 3)")):
        AF.scaled_dot_product_attention_weights(_q(), _k(), logsumexp=np.zeros((2, 3)))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5], ids=["-0.1", "1.0", "1.5"])
def test_dropout_mask_bad_p(p):
    with pytest.raises(ValueError, match=words("p", "[0, 1)", repr(p))):
        AF.dropout_mask((2, 3), p, 0)


def test_sdpa_bad_input_leaves_inputs_untouched():
    q, k, v = _q(), _k(), _v()
    copies = [x.copy() for x in (q, k, v)]
    with pytest.raises(ValueError):
        AF.scaled_dot_product_attention_forward(q, k, v, attn_mask=np.ones((4, 5), bool))
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


# ------------------------------------------------------------------------------------------------- globals
GLOBAL_BAD = [
    ("set_num_threads_0", lambda: attnpp.set_num_threads(0), ValueError, ["set_num_threads", "1", "0"]),
    ("set_num_threads_negative", lambda: attnpp.set_num_threads(-3), ValueError, ["set_num_threads", "-3"]),
    ("manual_seed_str", lambda: attnpp.manual_seed("x"), TypeError, ["seed", "int", "str"]),
    ("manual_seed_float", lambda: attnpp.manual_seed(1.5), TypeError, ["seed", "int", "float"]),
    ("manual_seed_none", lambda: attnpp.manual_seed(None), TypeError, ["seed", "int", "NoneType"]),
    ("mha_heads_not_dividing", lambda: MultiheadAttention(6, 4), ValueError, ["embed_dim", "num_heads", "6", "4"]),
    ("mha_zero_heads", lambda: MultiheadAttention(6, 0), ValueError, ["num_heads", "0"]),
    ("mha_dtype_int", lambda: MultiheadAttention(6, 2, dtype=int), TypeError, ["dtype", "int"]),
    ("mha_dtype_int32", lambda: MultiheadAttention(6, 2, dtype=np.int32), TypeError, ["dtype", "int32"]),
    ("mha_dtype_float16", lambda: MultiheadAttention(6, 2, dtype=np.float16), TypeError, ["dtype", "float16"]),
    ("mha_dropout_one", lambda: MultiheadAttention(6, 2, dropout=1.0), ValueError, ["dropout", "1.0"]),
    ("mha_dropout_negative", lambda: MultiheadAttention(6, 2, dropout=-0.5), ValueError, ["dropout", "-0.5"]),
    ("linear_dtype_int", lambda: Linear(4, 3, dtype=np.int64), TypeError, ["dtype", "int64"]),
    ("linear_negative_features", lambda: Linear(-1, 3), ValueError, ["in_features", "-1"]),
    ("linear_float_features", lambda: Linear(1.5, 3), TypeError, ["in_features", "int", "float"]),
    ("mha_str_embed_dim", lambda: MultiheadAttention("6", 2), TypeError, ["embed_dim", "int", "str"]),
    ("mha_float_embed_dim", lambda: MultiheadAttention(6.0, 2), TypeError, ["embed_dim", "int", "float"]),
    ("mha_zero_kdim", lambda: MultiheadAttention(6, 2, kdim=0), ValueError, ["kdim", "0"]),
    ("mha_str_dropout", lambda: MultiheadAttention(6, 2, dropout="x"), TypeError, ["dropout", "str"]),
    ("dropout_mask_p_none", lambda: attnpp.functional.dropout_mask((2, 3), None, 0), TypeError, ["p", "NoneType"]),
]


@pytest.mark.parametrize("cid, call, exc, ws", GLOBAL_BAD, ids=[c[0] for c in GLOBAL_BAD])
def test_global_bad_input(cid, call, exc, ws):
    threads = attnpp.get_num_threads()
    with pytest.raises(exc, match=words(*ws)):
        call()
    assert attnpp.get_num_threads() == threads  # a refused set_num_threads changes nothing


# --------------------------------------------------------------------------------------------------- layers
def _snapshot(layer):
    return {name: (p.data.copy(), p.grad.copy()) for name, p in layer.named_parameters()}


def _check_layer_unharmed(layer, make, snapshot, run):
    """Parameters unchanged, and a valid forward + backward gives what a fresh layer with the same state gives.

    ``make()`` builds a layer of the same configuration; ``run(layer)`` does a valid forward and backward and
    returns the arrays to compare. Gradients are compared as the increment of this run, so that a valid
    backward inside the case (before the failing call) does not count.
    """
    for name, p in layer.named_parameters():
        np.testing.assert_array_equal(p.data, snapshot[name][0], err_msg=f"{name} changed by a failed call")
        np.testing.assert_array_equal(p.grad, snapshot[name][1], err_msg=f"{name}.grad changed by a failed call")
    fresh = make()
    fresh.load_state_dict({name: d for name, (d, _) in snapshot.items()})
    fresh.zero_grad()
    fresh.train(layer.training)
    before = {name: p.grad.copy() for name, p in layer.named_parameters()}
    ours, theirs = run(layer), run(fresh)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for name, p in layer.named_parameters():
        np.testing.assert_allclose(p.grad - before[name], dict(fresh.named_parameters())[name].grad,
                                   rtol=1e-12, atol=1e-14, err_msg=f"{name}.grad")


# Linear(4, 3, float64): input (2, 4), grad_output (2, 3)
X = randn(2, 4, seed=10)
GY = randn(2, 3, seed=11)


def _make_linear():
    return Linear(4, 3, dtype=np.float64)


def _run_linear(layer):
    y = layer(X)
    return (y, layer.backward(GY))


def _forward(layer):
    layer(X)


def _forward_backward(layer):
    layer(X)
    layer.backward(GY)


# id, setup (outside pytest.raises), failing call, exception, words
LINEAR_BAD = [
    ("wrong_last_dim", None, lambda l: l(randn(2, 5)), ValueError, ["input", "(2, 5)", "4"]),
    ("wrong_last_dim_3d", None, lambda l: l(randn(2, 3, 3)), ValueError, ["input", "(2, 3, 3)", "4"]),
    ("wrong_dtype", None, lambda l: l(X.astype(np.float32)), TypeError, ["input", "float32", "float64"]),
    ("int_input", None, lambda l: l(np.ones((2, 4), np.int64)), TypeError, ["input", "int64"]),
    ("list_input", None, lambda l: l(X.tolist()), TypeError, ["input", "ndarray", "list"]),
    ("scalar_input", None, lambda l: l(np.float64(1.0)), TypeError, ["input", "ndarray"]),
    ("backward_before_forward", None, lambda l: l.backward(GY), ValueError, ["backward", "forward"]),
    ("backward_twice", _forward_backward, lambda l: l.backward(GY), ValueError, ["backward", "forward"]),
    ("backward_wrong_shape", _forward, lambda l: l.backward(randn(2, 4)), ValueError,
     ["grad_output", "(2, 3)", "(2, 4)"]),
    ("backward_wrong_batch", _forward, lambda l: l.backward(randn(3, 3)), ValueError,
     ["grad_output", "(2, 3)", "(3, 3)"]),
    ("backward_wrong_dtype", _forward, lambda l: l.backward(GY.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("failed_forward_after_forward", _forward, lambda l: l(randn(2, 5)), ValueError, ["input", "(2, 5)"]),
]


@pytest.mark.parametrize("cid, setup, bad, exc, ws", LINEAR_BAD, ids=[c[0] for c in LINEAR_BAD])
def test_linear_bad_input(cid, setup, bad, exc, ws):
    attnpp.manual_seed(0)
    layer = _make_linear()
    if setup is not None:
        setup(layer)
    snapshot = _snapshot(layer)
    with pytest.raises(exc, match=words(*ws)):
        bad(layer)
    _check_layer_unharmed(layer, _make_linear, snapshot, _run_linear)


def test_linear_correct_backward_after_wrong_one():
    """A backward refused for its grad_output's shape does not consume the forward: a correct one still works."""
    attnpp.manual_seed(0)
    layer = _make_linear()
    layer.zero_grad()
    y = layer(X)
    with pytest.raises(ValueError, match=words("grad_output", "(2, 3)", "(2, 4)")):
        layer.backward(randn(2, 4))
    with pytest.raises(TypeError, match=words("grad_output", "float32")):
        layer.backward(GY.astype(np.float32))
    dx = layer.backward(GY)
    np.testing.assert_allclose(dx, GY @ layer.weight.data, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.weight.grad, GY.T @ X, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.bias.grad, GY.sum(axis=0), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(y, X @ layer.weight.data.T + layer.bias.data, rtol=1e-12, atol=1e-14)


# MultiheadAttention(E=6, H=2, float64), sequence first: query (L=3, B=2, E), key (S=4, B=2, kdim), value (4, 2, vdim)
E, H, L, S, B = 6, 2, 3, 4, 2
MQ = randn(L, B, E, seed=20)
MK = randn(S, B, E, seed=21)
MV = randn(S, B, E, seed=22)
MG = randn(L, B, E, seed=23)
MK5 = randn(S, B, 5, seed=24)  # for kdim=5
MV3 = randn(S, B, 3, seed=25)  # for vdim=3


def _make_mha(**kw):
    return lambda: MultiheadAttention(E, H, dtype=np.float64, **kw)


def _bf(layer, x):
    """A sequence-first array as the layer takes it."""
    return np.ascontiguousarray(x.transpose(1, 0, 2)) if layer.batch_first else x


def _mha_inputs(layer):
    return tuple(_bf(layer, x) for x in (MQ, MK5 if layer.kdim == 5 else MK, MV3 if layer.vdim == 3 else MV))


def _run_mha(layer):
    y, w = layer(*_mha_inputs(layer), need_weights=True, seed=7)
    return (y, w) + tuple(layer.backward(_bf(layer, MG)))


def _mha_forward(layer):
    layer(*_mha_inputs(layer), seed=7)


def _mha_forward_backward(layer):
    layer(*_mha_inputs(layer), seed=7)
    layer.backward(MG)


def _state(layer, **change):
    """The layer's state dict as copies, with entries replaced (value) or removed (None) or added."""
    sd = {name: p.data.copy() + 1.0 for name, p in layer.named_parameters()}  # all different from the layer's
    for name, value in change.items():
        name = name.replace("__", ".")
        if value is None:
            sd.pop(name)
        else:
            sd[name] = value
    return sd


BOOL_KPM = np.zeros((B, S), bool)

# id, layer config, setup, failing call, exception, words
MHA_BAD = [
    ("query_width", {}, None, lambda m: m(MQ[..., :5], MK, MV), ValueError, ["query", "embed_dim", "(3, 2, 5)"]),
    ("key_width_not_kdim", dict(kdim=5, vdim=3), None, lambda m: m(MQ, MK, MV3), ValueError,
     ["key", "kdim", "5", "(4, 2, 6)"]),
    ("value_width_not_vdim", dict(kdim=5, vdim=3), None, lambda m: m(MQ, MK5, MV), ValueError,
     ["value", "vdim", "3", "(4, 2, 6)"]),
    ("key_width_default_kdim", {}, None, lambda m: m(MQ, MK5, MV), ValueError, ["key", "kdim", "(4, 2, 5)"]),
    ("batched_unbatched_mix", {}, None, lambda m: m(MQ, MK[:, 0], MV[:, 0]), ValueError,
     ["query", "key", "(3, 2, 6)", "(4, 6)"]),
    ("unbatched_query_batched_key", {}, None, lambda m: m(MQ[:, 0], MK, MV), ValueError,
     ["query", "key", "(3, 6)", "(4, 2, 6)"]),
    ("query_1d", {}, None, lambda m: m(MQ[0, 0], MK, MV), ValueError, ["query", "(6,)"]),
    ("query_4d", {}, None, lambda m: m(MQ[None], MK, MV), ValueError, ["query", "(1, 3, 2, 6)"]),
    ("batch_size_mismatch", {}, None, lambda m: m(MQ, randn(S, 3, E), randn(S, 3, E)), ValueError,
     ["batch", "query", "key", "(3, 2, 6)", "(4, 3, 6)"]),
    ("batch_size_mismatch_batch_first", dict(batch_first=True), None,
     lambda m: m(randn(B, L, E), randn(3, S, E), randn(3, S, E)), ValueError,
     ["batch", "query", "key", "(2, 3, 6)", "(3, 4, 6)"]),
    ("key_value_length_mismatch", {}, None, lambda m: m(MQ, MK, randn(5, B, E)), ValueError,
     ["key", "value", "(4, 2, 6)", "(5, 2, 6)"]),
    ("query_dtype", {}, None, lambda m: m(MQ.astype(np.float32), MK, MV), TypeError, ["query", "float32", "float64"]),
    ("key_dtype", {}, None, lambda m: m(MQ, MK.astype(np.float32), MV), TypeError, ["key", "float32", "float64"]),
    ("query_list", {}, None, lambda m: m(MQ.tolist(), MK, MV), TypeError, ["query", "ndarray", "list"]),
    ("key_padding_mask_shape", {}, None, lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, 5), bool)),
     ValueError, ["key_padding_mask", "(2, 4)", "(2, 5)"]),
    ("key_padding_mask_transposed", {}, None, lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((S, B), bool)),
     ValueError, ["key_padding_mask", "(2, 4)", "(4, 2)"]),
    ("key_padding_mask_dtype", {}, None,
     lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, S), np.float32)), TypeError,
     ["key_padding_mask", "float32", "float64"]),
    ("attn_mask_2d_shape", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((L, 5), bool)), ValueError,
     ["attn_mask", "(3, 4)", "(3, 5)"]),
    ("attn_mask_3d_shape", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((B, L, S), bool)), ValueError,
     ["attn_mask", "(4, 3, 4)", "(2, 3, 4)"]),
    ("attn_mask_4d", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((B, H, L, S), bool)), ValueError,
     ["attn_mask", "(2, 2, 3, 4)"]),
    ("attn_mask_int", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((L, S), np.int64)), TypeError,
     ["attn_mask", "int64"]),
    ("is_causal_without_attn_mask", {}, None, lambda m: m(MQ, MK, MV, is_causal=True), ValueError,
     ["is_causal", "attn_mask"]),
    ("seed_str", dict(dropout=0.2), None, lambda m: m(MQ, MK, MV, seed="x"), TypeError, ["seed", "str"]),
    ("backward_before_forward", {}, None, lambda m: m.backward(MG), ValueError, ["backward", "forward"]),
    ("backward_twice", {}, _mha_forward_backward, lambda m: m.backward(MG), ValueError, ["backward", "forward"]),
    ("backward_wrong_shape", {}, _mha_forward, lambda m: m.backward(MG[:, :, :5]), ValueError,
     ["grad_output", "(3, 2, 6)", "(3, 2, 5)"]),
    ("backward_wrong_dtype", {}, _mha_forward, lambda m: m.backward(MG.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("failed_forward_after_forward", {}, _mha_forward,
     lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, 5), bool)), ValueError, ["key_padding_mask", "(2, 5)"]),
    ("load_state_dict_missing_key", {}, None, lambda m: m.load_state_dict(_state(m, out_proj__bias=None)),
     ValueError, ["missing", "out_proj.bias"]),
    ("load_state_dict_unexpected_key", {}, None,
     lambda m: m.load_state_dict(_state(m, extra__weight=np.zeros((E, E)))), ValueError,
     ["unexpected", "extra.weight"]),
    ("load_state_dict_misshaped", {}, None,
     lambda m: m.load_state_dict(_state(m, out_proj__weight=np.zeros((E, 5)))), ValueError,
     ["out_proj.weight", "(6, 6)", "(6, 5)"]),
    ("load_state_dict_misshaped_first", {}, None,
     lambda m: m.load_state_dict(_state(m, in_proj_weight=np.zeros((2 * E, E)))), ValueError,
     ["in_proj_weight", "(18, 6)", "(12, 6)"]),
    ("load_state_dict_misshaped_bias_kv", dict(add_bias_kv=True), None,
     lambda m: m.load_state_dict(_state(m, bias_k=np.zeros((E,)))), ValueError, ["bias_k", "(1, 1, 6)", "(6,)"]),
]


@pytest.mark.parametrize("cid, config, setup, bad, exc, ws", MHA_BAD, ids=[c[0] for c in MHA_BAD])
def test_multihead_attention_bad_input(cid, config, setup, bad, exc, ws):
    attnpp.manual_seed(0)
    make = _make_mha(**config)
    layer = make()
    rng = np.random.default_rng(0)
    for p in layer.parameters():  # non-trivial biases too
        p.data[...] = 0.5 * rng.standard_normal(p.shape)
    if setup is not None:
        setup(layer)
    snapshot = _snapshot(layer)
    with pytest.raises(exc, match=words(*ws)):
        bad(layer)
    _check_layer_unharmed(layer, make, snapshot, _run_mha)


def test_multihead_attention_correct_backward_after_wrong_one():
    """A backward refused for its grad_output does not consume the forward: a correct one still works."""
    attnpp.manual_seed(0)
    make = _make_mha(add_bias_kv=True)
    layer, fresh = make(), make()
    fresh.load_state_dict(layer.state_dict())
    for m in (layer, fresh):
        m.zero_grad()
    y, _ = layer(MQ, MK, MV, need_weights=False)
    with pytest.raises(ValueError, match=words("grad_output", "(3, 2, 6)", "(2, 3, 6)")):
        layer.backward(np.ascontiguousarray(MG.transpose(1, 0, 2)))
    with pytest.raises(TypeError, match=words("grad_output", "float32")):
        layer.backward(MG.astype(np.float32))
    grads = layer.backward(MG)
    y_ref, _ = fresh(MQ, MK, MV, need_weights=False)
    ref = fresh.backward(MG)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(grads, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for (name, p), (_, q) in zip(layer.named_parameters(), fresh.named_parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("change", [dict(out_proj__bias=None), dict(extra=np.zeros(3)),
                                    dict(out_proj__weight=np.zeros((E, 5))),
                                    dict(out_proj__bias=np.zeros(E, np.int64))],
                         ids=["missing", "unexpected", "misshaped", "int_dtype"])
def test_load_state_dict_failure_leaves_parameters_unchanged(change):
    attnpp.manual_seed(0)
    layer = _make_mha()()
    before = {name: p.data.copy() for name, p in layer.named_parameters()}
    bad = _state(layer, **change)
    with pytest.raises((ValueError, TypeError)):
        layer.load_state_dict(bad)
    for name, p in layer.named_parameters():
        np.testing.assert_array_equal(p.data, before[name], err_msg=name)
    # and a good one loads
    good = _state(layer)
    layer.load_state_dict(good)
    for name, p in layer.named_parameters():
        np.testing.assert_array_equal(p.data, good[name], err_msg=name)
