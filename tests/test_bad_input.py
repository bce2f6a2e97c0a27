"""Bad input raises ValueError or TypeError whose message names the argument and the shapes (docs/design.md).

Table-driven, one table per function or layer: each case is (id, the call, expected exception type, words that
must all appear in the message). IndexError only for indices out of range (embedding ids, cross-entropy
targets), MemoryError for requests too large to allocate (then the library must still work). The layer cases
also check that a failed call leaves the layer as it was: same parameters and gradients, and a valid forward +
backward afterwards gives the same answer as a fresh layer with the same state.
"""
import inspect
import re

import ml_dtypes
import numpy as np
import pytest

import attnpp
import attnpp.functional as AF
from attnpp.nn import (Attention, CrossEntropyLoss, Dropout, Embedding, KVCache, Linear, LinearCrossEntropyLoss,
                       MultiheadAttention)
from attnpp._checks import ARGUMENTS
from attnpp.optim import SGD, AdamW


def words(*ws):
    """A regex that matches a message containing every one of ``ws`` (literally), in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(str(w))})" for w in ws)


def randn(*shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def cases(table):
    """pytest.param's of a table's rows (id first)."""
    return [pytest.param(*row[1:], id=row[0]) for row in table]


HUGE = 10 ** 15  # a broadcast batch this long costs nothing to pass, but any copy of it is > 1 PB


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
    ("float16_query_bfloat16_key", lambda: (_q(np.float16), _k(ml_dtypes.bfloat16), _v(np.float16), {}), TypeError,
     ["key", "float16", "bfloat16"], False),
    ("longdouble_inputs", lambda: (_q(np.longdouble), _k(np.longdouble), _v(np.longdouble), {}), TypeError,
     ["query", np.dtype(np.longdouble).name], False),
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
    ("key_padding_mask_no_broadcast", lambda: (_q(), _k(), _v(), dict(key_padding_mask=np.ones((2, 4), bool))),
     ValueError, ["key_padding_mask", "(2, 4)", "(2, 5)"], False),
    ("key_padding_mask_int", lambda: (_q(), _k(), _v(), dict(key_padding_mask=np.ones((2, 5), np.int64))),
     TypeError, ["key_padding_mask", "int64"], False),
    ("is_causal_with_attn_mask", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones((3, 5), bool), is_causal=True)),
     ValueError, ["attn_mask", "is_causal"], False),
    ("gqa_heads_not_multiple", lambda: (_q(shape=(2, 3, 3, 4)), _k(shape=(2, 2, 5, 4)), _v(shape=(2, 2, 5, 6)),
                                        dict(enable_gqa=True)),
     ValueError, ["enable_gqa", "query", "key", "(2, 3, 3, 4)", "(2, 2, 5, 4)"], False),
    ("gqa_value_heads_not_dividing", lambda: (_q(shape=(2, 4, 3, 4)), _k(shape=(2, 2, 5, 4)),
                                              _v(shape=(2, 3, 5, 6)), dict(enable_gqa=True)),
     ValueError, ["enable_gqa", "value", "(2, 2, 5, 4)", "(2, 3, 5, 6)"], True),
    ("query_none", lambda: (None, _k(), _v(), {}), TypeError, ["query", "ndarray", "NoneType"], False),
    ("key_none", lambda: (_q(), None, _v(), {}), TypeError, ["key", "ndarray", "NoneType"], False),
    ("value_none", lambda: (_q(), _k(), None, {}), TypeError, ["value", "ndarray", "NoneType"], True),
    ("query_scalar", lambda: (1.0, _k(), _v(), {}), TypeError, ["query", "ndarray", "float"], False),
    ("query_0d", lambda: (np.array(1.0), _k(), _v(), {}), ValueError, ["query", "2", "()"], False),
    ("object_inputs", lambda: (_q().astype(object), _k().astype(object), _v().astype(object), {}), TypeError,
     ["query", "object"], False),
    ("bool_key", lambda: (_q(), _k() > 0, _v(), {}), TypeError, ["key", "bool"], False),
    ("complex_value", lambda: (_q(), _k(), _v(np.complex128), {}), TypeError, ["value", "complex128"], True),
    ("float16_value", lambda: (_q(), _k(), _v(np.float16), {}), TypeError, ["value", "float16"], True),
    ("int_value", lambda: (_q(), _k(), _v(np.int64), {}), TypeError, ["value", "int64"], True),
    ("value_2d_for_4d", lambda: (_q(), _k(), _v(shape=(4, 6)), {}), ValueError,
     ["key", "value", "(2, 2, 5, 4)", "(4, 6)"], True),
    ("attn_mask_float16", lambda: (_q(), _k(), _v(), dict(attn_mask=np.zeros((3, 5), np.float16))), TypeError,
     ["attn_mask", "float16"], False),
    ("attn_mask_bfloat16_float32_inputs", lambda: (_q(np.float32), _k(np.float32), _v(np.float32),
                                                   dict(attn_mask=np.zeros((3, 5), ml_dtypes.bfloat16))),
     TypeError, ["attn_mask", "bfloat16", "float32"], False),
    ("attn_mask_int8", lambda: (_q(), _k(), _v(), dict(attn_mask=np.zeros((3, 5), np.int8))), TypeError,
     ["attn_mask", "int8"], False),
    ("attn_mask_complex", lambda: (_q(), _k(), _v(), dict(attn_mask=np.zeros((3, 5), complex))), TypeError,
     ["attn_mask", "complex128"], False),
    ("attn_mask_object", lambda: (_q(), _k(), _v(), dict(attn_mask=np.zeros((3, 5), object))), TypeError,
     ["attn_mask", "object"], False),
    ("attn_mask_python_bool", lambda: (_q(), _k(), _v(), dict(attn_mask=True)), TypeError, ["attn_mask", "bool"],
     False),
    ("attn_mask_1d_wrong_length", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones(4, bool))), ValueError,
     ["attn_mask", "(4,)", "(2, 2, 3, 5)"], False),
    ("attn_mask_transposed", lambda: (_q(), _k(), _v(), dict(attn_mask=np.ones((5, 3), bool))), ValueError,
     ["attn_mask", "(5, 3)", "(2, 2, 3, 5)"], False),
    ("gqa_unbatched", lambda: (_q(shape=(3, 4)), _k(shape=(5, 4)), _v(shape=(5, 6)), dict(enable_gqa=True)),
     ValueError, ["enable_gqa", "heads"], False),
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
    ("dropout_seed_str", dict(dropout_p=0.3, seed="x"), TypeError, ["seed", "str"]),
    ("grad_output_shape", dict(grad_output=np.ones((2, 2, 3, 5))), ValueError,
     ["grad_output", "(2, 2, 3, 6)", "(2, 2, 3, 5)"]),
    ("grad_output_transposed", dict(grad_output=np.ones((2, 2, 6, 3))), ValueError,
     ["grad_output", "(2, 2, 3, 6)", "(2, 2, 6, 3)"]),
    ("grad_output_unbatched", dict(grad_output=np.ones((3, 6))), ValueError,
     ["grad_output", "(2, 2, 3, 6)", "(3, 6)"]),
    ("grad_output_dtype", dict(grad_output=np.ones(OUT_SHAPE, np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("grad_output_int", dict(grad_output=np.ones(OUT_SHAPE, np.int64)), TypeError, ["grad_output", "int64"]),
    ("grad_output_complex", dict(grad_output=np.ones(OUT_SHAPE, complex)), TypeError,
     ["grad_output", "complex128"]),
    ("grad_output_list", dict(grad_output=np.ones(OUT_SHAPE).tolist()), TypeError, ["grad_output", "list"]),
    ("grad_output_none", dict(grad_output=None), TypeError, ["grad_output", "NoneType"]),
    ("output_shape", dict(output=np.zeros((2, 2, 3, 4))), ValueError, ["output", "(2, 2, 3, 6)", "(2, 2, 3, 4)"]),
    ("output_dtype", dict(output=np.zeros(OUT_SHAPE, np.float32)), TypeError, ["output", "float32", "float64"]),
    ("output_list", dict(output=np.zeros(OUT_SHAPE).tolist()), TypeError, ["output", "list"]),
    ("logsumexp_shape", dict(logsumexp=np.zeros((2, 2, 5))), ValueError, ["logsumexp", "(2, 2, 3)", "(2, 2, 5)"]),
    ("logsumexp_dtype", dict(logsumexp=np.zeros(LSE_SHAPE, np.float32)), TypeError,
     ["logsumexp", "float32", "float64"]),
    ("logsumexp_int", dict(logsumexp=np.zeros(LSE_SHAPE, np.int64)), TypeError, ["logsumexp", "int64"]),
    ("logsumexp_none", dict(logsumexp=None), TypeError, ["logsumexp", "NoneType"]),
]


@pytest.mark.parametrize("cid, kw, exc, ws", SDPA_BACKWARD_BAD, ids=[c[0] for c in SDPA_BACKWARD_BAD])
def test_sdpa_backward_bad_input(cid, kw, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        _sdpa_call("backward", _q(), _k(), _v(), **kw)()


SDPA_WEIGHTS_BAD = [
    ("logsumexp_shape", lambda: AF.scaled_dot_product_attention_weights(_q(), _k(), logsumexp=np.zeros((2, 3))),
     ValueError, ["logsumexp", "(2, 2, 3)", "(2, 3)"]),
    ("logsumexp_transposed",
     lambda: AF.scaled_dot_product_attention_weights(_q(), _k(), logsumexp=np.zeros((3, 2, 2))), ValueError,
     ["logsumexp", "(2, 2, 3)", "(3, 2, 2)"]),
    ("logsumexp_float32",
     lambda: AF.scaled_dot_product_attention_weights(_q(), _k(), logsumexp=np.zeros(LSE_SHAPE, np.float32)),
     TypeError, ["logsumexp", "float32", "float64"]),
    ("logsumexp_int",
     lambda: AF.scaled_dot_product_attention_weights(_q(), _k(), logsumexp=np.zeros(LSE_SHAPE, np.int64)),
     TypeError, ["logsumexp", "int64"]),
    ("logsumexp_list", lambda: AF.scaled_dot_product_attention_weights(_q(), _k(), logsumexp=[0.0] * 12),
     TypeError, ["logsumexp", "list"]),
    ("value_passed_as_attn_mask", lambda: AF.scaled_dot_product_attention_weights(_q(), _k(), _v()), ValueError,
     ["attn_mask", "(2, 2, 5, 6)", "(2, 2, 3, 5)"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(SDPA_WEIGHTS_BAD))
def test_sdpa_weights_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()


def test_sdpa_bad_input_leaves_inputs_untouched():
    q, k, v = _q(), _k(), _v()
    copies = [x.copy() for x in (q, k, v)]
    with pytest.raises(ValueError):
        AF.scaled_dot_product_attention_forward(q, k, v, attn_mask=np.ones((4, 5), bool))
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


# ------------------------------------------------------------------------------------------------ dropout_mask
DROPOUT_MASK_BAD = [
    ("p_negative", lambda: AF.dropout_mask((2, 3), -0.1, 0), ValueError, ["p", "[0, 1)", "-0.1"]),
    ("p_one", lambda: AF.dropout_mask((2, 3), 1.0, 0), ValueError, ["p", "[0, 1)", "1.0"]),
    ("p_above_one", lambda: AF.dropout_mask((2, 3), 1.5, 0), ValueError, ["p", "[0, 1)", "1.5"]),
    ("p_none", lambda: AF.dropout_mask((2, 3), None, 0), TypeError, ["p", "NoneType"]),
    ("p_str", lambda: AF.dropout_mask((2, 3), "0.1", 0), TypeError, ["p", "str"]),
    ("shape_int", lambda: AF.dropout_mask(6, 0.1, 0), TypeError, ["shape", "tuple", "int"]),
    ("shape_none", lambda: AF.dropout_mask(None, 0.1, 0), TypeError, ["shape", "NoneType"]),
    ("shape_str", lambda: AF.dropout_mask("23", 0.1, 0), TypeError, ["shape", "str"]),
    ("shape_0d_array", lambda: AF.dropout_mask(np.array(6), 0.1, 0), TypeError, ["shape", "ndarray"]),
    ("shape_negative", lambda: AF.dropout_mask((2, -1), 0.1, 0), ValueError, ["shape", "(2, -1)"]),
    ("shape_float", lambda: AF.dropout_mask((2, 1.5), 0.1, 0), TypeError, ["shape", "(2, 1.5)", "float"]),
    ("shape_bool", lambda: AF.dropout_mask((True, 2), 0.1, 0), TypeError, ["shape", "bool"]),
    ("seed_str", lambda: AF.dropout_mask((2, 3), 0.1, "x"), TypeError, ["seed", "str"]),
    ("seed_float", lambda: AF.dropout_mask((2, 3), 0.1, 1.5), TypeError, ["seed", "float"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(DROPOUT_MASK_BAD))
def test_dropout_mask_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()


# the core's own guard on shapes given to it directly (a fuzzer finding: pybind computed the strides of
# [2**20, 2**20, -2**63, 2**20] first, a signed overflow that UBSan aborts on)
@pytest.mark.parametrize("function", ["dropout_mask", "empty"])
@pytest.mark.parametrize("shape, exc", [([2 ** 20, 2 ** 20, -2 ** 63, 2 ** 20], ValueError),
                                        ([2, -1], ValueError), ([2 ** 31, 2 ** 31, 2 ** 2], MemoryError),
                                        ([0, 2 ** 40, 2 ** 40], MemoryError)], ids=str)
def test_core_refuses_shapes_whose_strides_overflow(function, shape, exc):
    call = (lambda: attnpp._core.dropout_mask(shape, 0.5, 1)) if function == "dropout_mask" else \
        (lambda: attnpp._core.empty(shape, np.dtype(np.float64)))
    with pytest.raises(exc):
        call()


# the core's guards on the params given to it directly (what memory safety needs: offsets and lengths within the
# arrays, slopes and sinks of the right size, a mask inside its array), whatever the Python layer checked first
def _core_sdpa(**params):
    q = np.zeros((1, 2, 5, 4))
    out, lse = np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5))
    core_params = attnpp._core.AttentionParams()
    core_params.masks = [attnpp._core.AttentionMask(*fields) for fields in params.pop("masks", [])]
    for name, value in params.items():
        setattr(core_params, name, value)
    attnpp._core.sdpa_forward(out, lse, q, q, q, core_params)


I64 = lambda *v: np.array(v, dtype=np.int64)


@pytest.mark.parametrize("params, exc, ws", [
    (dict(cu_seqlens_q=I64(0, 3, 6), cu_seqlens_k=I64(0, 3, 5)), ValueError, ["cu_seqlens_q", "0 to 5"]),
    (dict(cu_seqlens_q=I64(0, 3, 2, 5), cu_seqlens_k=I64(0, 1, 2, 5)), ValueError, ["cu_seqlens_q"]),
    (dict(cu_seqlens_q=I64(0, 5), cu_seqlens_k=I64(0, 2, 5)), ValueError, ["same number"]),
    (dict(cu_seqlens_q=I64(0, 5)), ValueError, ["go together"]),
    (dict(cu_seqlens_q=np.array([0, 5.0]), cu_seqlens_k=I64(0, 5)), TypeError, ["cu_seqlens_q", "int64"]),
    (dict(seqlens_k=I64(6)), ValueError, ["seqlens_k", "[0, S]"]),
    (dict(seqlens_k=I64(-1)), ValueError, ["seqlens_k"]),
    (dict(seqlens_k=I64(1, 2)), ValueError, ["seqlens_k", "one length per batch"]),
    (dict(alibi_slopes=np.ones((1, 3))), ValueError, ["alibi_slopes", "(1 or 1, 2)"]),
    (dict(alibi_slopes=np.ones((1, 2), dtype=np.float32)), TypeError, ["alibi_slopes", "float64"]),
    (dict(sinks=np.ones(3)), ValueError, ["sinks", "2 values"]),
    (dict(sinks=[1.0, 2.0]), TypeError, ["sinks", "numpy.ndarray"]),
    (dict(masks=[(np.zeros(9), I64(0), 0, 3, 0)]), ValueError, ["attn_mask", "outside"]),  # (mask fields)
    (dict(masks=[(np.zeros(9), I64(1), 0, 2, 0)]), ValueError, ["attn_mask", "outside"]),
    (dict(masks=[(np.zeros(9), I64(0, 0), 0, 0, 1)]), ValueError, ["batch offsets"]),
    (dict(masks=[(np.zeros(9, np.float32), I64(0), 0, 0, 0)]), TypeError, ["attn_mask", "float64"]),
    (dict(causal=2), TypeError, ["incompatible"]),
    (dict(window=(1, 1)), AttributeError, ["window"]),
], ids=str)
def test_core_refuses_bad_params(params, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        _core_sdpa(**params)


def test_core_refuses_bad_grad_sinks():
    q = np.zeros((1, 2, 5, 4))
    with pytest.raises(ValueError, match=words("grad_sinks", "(2,)")):
        params = attnpp._core.AttentionParams()
        params.sinks = np.zeros(2)
        attnpp._core.sdpa_backward(q.copy(), q.copy(), q.copy(), q, q, np.zeros((1, 2, 5)), q, q, q, params,
                                   grad_sinks=np.zeros(3))


# ------------------------------------------------------------------------------------- linear, linear_backward
# linear(input (2, 4), weight (3, 4), bias (3,)); linear_backward accumulates into GRAD_W (3, 4), GRAD_B (3,)
FX, FW, FB, FGY = randn(2, 4, seed=30), randn(3, 4, seed=31), randn(3, seed=32), randn(2, 3, seed=33)
GRAD_W, GRAD_B = np.zeros((3, 4)), np.zeros(3)


def _linb(grad_output=FGY, input=FX, weight=FW, grad_weight=GRAD_W, grad_bias=GRAD_B):
    return lambda: AF.linear_backward(grad_output, input, weight, grad_weight, grad_bias)


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


LINEAR_F_BAD = [
    ("input_list", lambda: AF.linear(FX.tolist(), FW), TypeError, ["input", "ndarray", "list"]),
    ("input_none", lambda: AF.linear(None, FW), TypeError, ["input", "NoneType"]),
    ("input_scalar", lambda: AF.linear(1.0, FW), TypeError, ["input", "float"]),
    ("input_0d", lambda: AF.linear(np.array(1.0), FW), ValueError, ["input", "1", "()"]),
    ("input_int", lambda: AF.linear(FX.astype(np.int64), FW), TypeError, ["input", "int64"]),
    ("input_bool", lambda: AF.linear(FX > 0, FW), TypeError, ["input", "bool"]),
    ("input_complex", lambda: AF.linear(FX.astype(complex), FW), TypeError, ["input", "complex128"]),
    ("input_object", lambda: AF.linear(FX.astype(object), FW), TypeError, ["input", "object"]),
    ("input_float16", lambda: AF.linear(FX.astype(np.float16), FW), TypeError, ["input", "float16"]),
    ("mixed_float32_input", lambda: AF.linear(FX.astype(np.float32), FW), TypeError,
     ["weight", "float32", "float64"]),
    ("mixed_float32_weight", lambda: AF.linear(FX, FW.astype(np.float32)), TypeError,
     ["weight", "float32", "float64"]),
    ("in_features_mismatch", lambda: AF.linear(randn(2, 5), FW), ValueError, ["input", "(2, 5)", "(3, 4)"]),
    ("weight_1d", lambda: AF.linear(FX, FW[0]), ValueError, ["weight", "2", "(4,)"]),
    ("weight_3d", lambda: AF.linear(FX, FW[None]), ValueError, ["weight", "2", "(1, 3, 4)"]),
    ("weight_list", lambda: AF.linear(FX, FW.tolist()), TypeError, ["weight", "list"]),
    ("weight_none", lambda: AF.linear(FX, None), TypeError, ["weight", "NoneType"]),
    ("bias_shape", lambda: AF.linear(FX, FW, np.zeros(4)), ValueError, ["bias", "(3,)", "(4,)"]),
    ("bias_2d", lambda: AF.linear(FX, FW, np.zeros((1, 3))), ValueError, ["bias", "1", "(1, 3)"]),
    ("bias_float32", lambda: AF.linear(FX, FW, FB.astype(np.float32)), TypeError, ["bias", "float32", "float64"]),
    ("bias_int", lambda: AF.linear(FX, FW, np.zeros(3, np.int64)), TypeError, ["bias", "int64"]),
    ("bias_list", lambda: AF.linear(FX, FW, [0.0] * 3), TypeError, ["bias", "list"]),
    ("backward-grad_output_shape", _linb(grad_output=randn(2, 4)), ValueError,
     ["grad_output", "(2, 3)", "(2, 4)"]),
    ("backward-grad_output_transposed", _linb(grad_output=randn(3, 2)), ValueError,
     ["grad_output", "(2, 3)", "(3, 2)"]),
    ("backward-grad_output_float32", _linb(grad_output=FGY.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("backward-grad_output_int", _linb(grad_output=FGY.astype(np.int64)), TypeError, ["grad_output", "int64"]),
    ("backward-grad_output_list", _linb(grad_output=FGY.tolist()), TypeError, ["grad_output", "list"]),
    ("backward-grad_output_none", _linb(grad_output=None), TypeError, ["grad_output", "NoneType"]),
    ("backward-input_mismatch", _linb(input=randn(2, 5)), ValueError, ["input", "(2, 5)", "(3, 4)"]),
    ("backward-input_0d", _linb(input=np.array(1.0)), ValueError, ["input", "()"]),
    ("backward-input_int", _linb(input=FX.astype(np.int64)), TypeError, ["input", "int64"]),
    ("backward-weight_1d", _linb(weight=FW[0]), ValueError, ["weight", "(4,)"]),
    ("backward-weight_float32", _linb(weight=FW.astype(np.float32)), TypeError, ["weight", "float32", "float64"]),
    ("backward-grad_weight_shape", _linb(grad_weight=np.zeros((4, 3))), ValueError,
     ["grad_weight", "(3, 4)", "(4, 3)"]),
    ("backward-grad_weight_float32", _linb(grad_weight=np.zeros((3, 4), np.float32)), TypeError,
     ["grad_weight", "float32", "float64"]),
    ("backward-grad_weight_list", _linb(grad_weight=[[0.0] * 4] * 3), TypeError, ["grad_weight", "list"]),
    ("backward-grad_weight_none", _linb(grad_weight=None), TypeError, ["grad_weight", "NoneType"]),
    ("backward-grad_weight_fortran", _linb(grad_weight=np.zeros((3, 4), order="F")), ValueError,
     ["grad_weight", "C-contiguous"]),
    ("backward-grad_weight_readonly", _linb(grad_weight=_readonly(GRAD_W)), ValueError,
     ["grad_weight", "writeable"]),
    ("backward-grad_bias_shape", _linb(grad_bias=np.zeros(4)), ValueError, ["grad_bias", "(3,)", "(4,)"]),
    ("backward-grad_bias_float32", _linb(grad_bias=np.zeros(3, np.float32)), TypeError,
     ["grad_bias", "float32", "float64"]),
    ("backward-grad_bias_list", _linb(grad_bias=[0.0] * 3), TypeError, ["grad_bias", "list"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(LINEAR_F_BAD))
def test_linear_functional_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()
    assert not GRAD_W.any() and not GRAD_B.any(), "a refused backward wrote into the gradient buffers"
    np.testing.assert_allclose(AF.linear(FX, FW, FB), FX @ FW.T + FB, rtol=1e-12)


# ------------------------------------------------------------------------------------ dropout, dropout_backward
DX = randn(2, 4, seed=40)

DROPOUT_F_BAD = [
    ("input_none", lambda: AF.dropout(None, 0.1, seed=0), TypeError, ["input", "NoneType"]),
    ("input_list", lambda: AF.dropout(DX.tolist(), 0.1, seed=0), TypeError, ["input", "list"]),
    ("input_scalar", lambda: AF.dropout(1.0, 0.1, seed=0), TypeError, ["input", "float"]),
    ("input_int", lambda: AF.dropout(DX.astype(np.int64), 0.1, seed=0), TypeError, ["input", "int64"]),
    ("input_bool", lambda: AF.dropout(DX > 0, 0.1, seed=0), TypeError, ["input", "bool"]),
    ("input_complex", lambda: AF.dropout(DX.astype(complex), 0.1, seed=0), TypeError, ["input", "complex128"]),
    ("input_object", lambda: AF.dropout(DX.astype(object), 0.1, seed=0), TypeError, ["input", "object"]),
    ("backward-grad_output_none", lambda: AF.dropout_backward(None, 0.1, 0), TypeError,
     ["grad_output", "NoneType"]),
    ("backward-grad_output_list", lambda: AF.dropout_backward(DX.tolist(), 0.1, 0), TypeError,
     ["grad_output", "list"]),
    ("backward-grad_output_int", lambda: AF.dropout_backward(DX.astype(np.int64), 0.1, 0), TypeError,
     ["grad_output", "int64"]),
    ("backward-p_one", lambda: AF.dropout_backward(DX, 1.0, 0), ValueError, ["p", "1.0"]),
    ("backward-seed_none", lambda: AF.dropout_backward(DX, 0.1, None), ValueError, ["seed", "None", "forward"]),
    ("backward-seed_str", lambda: AF.dropout_backward(DX, 0.1, "x"), TypeError, ["seed", "str"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(DROPOUT_F_BAD))
def test_dropout_functional_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()


# -------------------------------------------------------------------------------- embedding, embedding_backward
# embedding(input (2, 3) ids in [0, 5), weight (5, 3)); embedding_backward accumulates into GRAD_EW (5, 3)
EIDX, EW, EGY = np.array([[0, 4, 2], [1, 1, 3]]), randn(5, 3, seed=50), randn(2, 3, 3, seed=51)
GRAD_EW = np.zeros((5, 3))


def _embb(grad_output=EGY, input=EIDX, grad_weight=GRAD_EW):
    return lambda: AF.embedding_backward(grad_output, input, grad_weight)


EMBEDDING_F_BAD = [
    ("index_negative", lambda: AF.embedding(np.array([0, -1]), EW), IndexError, ["input", "-1", "[0, 5)"]),
    ("index_equal_V", lambda: AF.embedding(np.array([0, 5]), EW), IndexError, ["input", "5", "[0, 5)"]),
    ("index_huge_uint64", lambda: AF.embedding(np.array([2 ** 64 - 1], np.uint64), EW), IndexError,
     ["input", str(2 ** 64 - 1), "[0, 5)"]),
    ("index_float", lambda: AF.embedding(np.array([0.0, 1.0]), EW), TypeError, ["input", "integer", "float64"]),
    ("index_bool", lambda: AF.embedding(np.array([True]), EW), TypeError, ["input", "integer", "bool"]),
    ("index_complex", lambda: AF.embedding(np.array([1j]), EW), TypeError, ["input", "complex128"]),
    ("index_object", lambda: AF.embedding(np.array([1], object), EW), TypeError, ["input", "object"]),
    ("index_list", lambda: AF.embedding([0, 1], EW), TypeError, ["input", "ndarray", "list"]),
    ("index_none", lambda: AF.embedding(None, EW), TypeError, ["input", "NoneType"]),
    ("index_scalar", lambda: AF.embedding(1, EW), TypeError, ["input", "int"]),
    ("weight_int", lambda: AF.embedding(EIDX, EW.astype(np.int64)), TypeError, ["weight", "int64"]),
    ("weight_1d", lambda: AF.embedding(EIDX, EW[:, 0]), ValueError, ["weight", "2", "(5,)"]),
    ("weight_3d", lambda: AF.embedding(EIDX, EW[None]), ValueError, ["weight", "2", "(1, 5, 3)"]),
    ("weight_list", lambda: AF.embedding(EIDX, EW.tolist()), TypeError, ["weight", "list"]),
    ("weight_none", lambda: AF.embedding(EIDX, None), TypeError, ["weight", "NoneType"]),
    ("backward-grad_output_shape", _embb(grad_output=randn(2, 3, 4)), ValueError,
     ["grad_output", "(2, 3, 3)", "(2, 3, 4)"]),
    ("backward-grad_output_same_size", _embb(grad_output=randn(3, 2, 3)), ValueError,
     ["grad_output", "(2, 3, 3)", "(3, 2, 3)"]),
    ("backward-grad_output_float32", _embb(grad_output=EGY.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("backward-grad_output_list", _embb(grad_output=EGY.tolist()), TypeError, ["grad_output", "list"]),
    ("backward-grad_output_none", _embb(grad_output=None), TypeError, ["grad_output", "NoneType"]),
    ("backward-index_negative", _embb(input=np.array([[0, -1, 2], [1, 1, 3]])), IndexError,
     ["input", "-1", "[0, 5)"]),
    ("backward-index_equal_V", _embb(input=np.array([[0, 5, 2], [1, 1, 3]])), IndexError,
     ["input", "5", "[0, 5)"]),
    ("backward-index_float", _embb(input=EIDX.astype(float)), TypeError, ["input", "float64"]),
    ("backward-grad_weight_list", _embb(grad_weight=GRAD_EW.tolist()), TypeError, ["grad_weight", "list"]),
    ("backward-grad_weight_none", _embb(grad_weight=None), TypeError, ["grad_weight", "NoneType"]),
    ("backward-grad_weight_1d", _embb(grad_weight=np.zeros(15)), ValueError, ["grad_weight", "2", "(15,)"]),
    ("backward-grad_weight_int", _embb(grad_weight=np.zeros((5, 3), np.int64)), TypeError,
     ["grad_weight", "int64"]),
    ("backward-grad_weight_fortran", _embb(grad_weight=np.zeros((5, 3), order="F")), ValueError,
     ["grad_weight", "C-contiguous"]),
    ("backward-grad_weight_readonly", _embb(grad_weight=_readonly(GRAD_EW)), ValueError,
     ["grad_weight", "writeable"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(EMBEDDING_F_BAD))
def test_embedding_functional_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()
    assert not GRAD_EW.any(), "a refused backward wrote into the gradient buffer"
    np.testing.assert_array_equal(AF.embedding(EIDX, EW), EW[EIDX])


# ------------------------------------------------------------------- cross_entropy (forward, _forward, _backward)
# input (3, 4) logits, target (3,) with one ignored row; the backward gets grad_output 1.0 and the valid stats
CL, CT = randn(3, 4, seed=60), np.array([0, 3, -100])
_, CSTATS = AF.cross_entropy_forward(CL, CT)


def _ce_call(kind, input, target, **kw):
    if kind == "cross_entropy":
        return lambda: AF.cross_entropy(input, target, **kw)
    if kind == "forward":
        return lambda: AF.cross_entropy_forward(input, target, **kw)
    grad_output, stats = kw.pop("grad_output", 1.0), kw.pop("stats", CSTATS)
    return lambda: AF.cross_entropy_backward(grad_output, input, target, stats, **kw)


# id, (input, target, kwargs) builder, exception, words
CE_BAD = [
    ("target_negative", lambda: (CL, np.array([0, -1, 1]), {}), IndexError, ["target", "-1", "[0, 4)"]),
    ("target_equal_C", lambda: (CL, np.array([0, 4, 1]), {}), IndexError, ["target", "4", "[0, 4)"]),
    ("target_ignore_index_other", lambda: (CL, CT, dict(ignore_index=-1)), IndexError,
     ["target", "-100", "[0, 4)"]),
    ("target_huge_uint64", lambda: (CL, np.array([0, 2 ** 64 - 1, 1], np.uint64), {}), IndexError,
     ["target", str(2 ** 64 - 1)]),
    ("target_float", lambda: (CL, CT.astype(float), {}), TypeError, ["target", "integer", "float64"]),
    ("target_bool", lambda: (CL, np.array([True, False, True]), {}), TypeError, ["target", "bool"]),
    ("target_list", lambda: (CL, [0, 1, 1], {}), TypeError, ["target", "list"]),
    ("target_none", lambda: (CL, None, {}), TypeError, ["target", "NoneType"]),
    ("target_shape", lambda: (CL, np.array([0, 1]), {}), ValueError, ["target", "(3,)", "(2,)"]),
    ("target_2d", lambda: (CL, CT[None], {}), ValueError, ["target", "(3,)", "(1, 3)"]),
    ("target_0d_for_2d_input", lambda: (CL, np.array(1), {}), ValueError, ["target", "(3,)", "()"]),
    ("target_1d_for_1d_input", lambda: (CL[0], np.array([1]), {}), ValueError, ["target", "()", "(1,)"]),
    ("input_3d", lambda: (CL[None], CT, {}), ValueError, ["input", "(1, 3, 4)"]),
    ("input_0d", lambda: (np.array(1.0), np.array(0), {}), ValueError, ["input", "()"]),
    ("input_int", lambda: (CL.astype(np.int64), CT, {}), TypeError, ["input", "int64"]),
    ("input_bool", lambda: (CL > 0, CT, {}), TypeError, ["input", "bool"]),
    ("input_complex", lambda: (CL.astype(complex), CT, {}), TypeError, ["input", "complex128"]),
    ("input_object", lambda: (CL.astype(object), CT, {}), TypeError, ["input", "object"]),
    ("input_list", lambda: (CL.tolist(), CT, {}), TypeError, ["input", "list"]),
    ("input_none", lambda: (None, CT, {}), TypeError, ["input", "NoneType"]),
    ("reduction_unknown", lambda: (CL, CT, dict(reduction="avg")), ValueError, ["reduction", "'avg'"]),
    ("reduction_none_object", lambda: (CL, CT, dict(reduction=None)), ValueError, ["reduction", "None"]),
    ("ignore_index_str", lambda: (CL, CT, dict(ignore_index="x")), TypeError, ["ignore_index", "int", "str"]),
    ("ignore_index_float", lambda: (CL, CT, dict(ignore_index=-100.0)), TypeError,
     ["ignore_index", "int", "float"]),
    ("ignore_index_none", lambda: (CL, CT, dict(ignore_index=None)), TypeError, ["ignore_index", "NoneType"]),
    ("ignore_index_huge", lambda: (CL, CT, dict(ignore_index=2 ** 70)), ValueError,
     ["ignore_index", "int64", str(2 ** 70)]),
]

CE_BAD_PARAMS = [pytest.param(kind, build, exc, ws, id=f"{kind}-{cid}") for cid, build, exc, ws in CE_BAD
                 for kind in ("cross_entropy", "forward", "backward")]


@pytest.mark.parametrize("kind, build, exc, ws", CE_BAD_PARAMS)
def test_cross_entropy_bad_input(kind, build, exc, ws):
    input, target, kw = build()
    with pytest.raises(exc, match=words(*ws)):
        _ce_call(kind, input, target, **kw)()


CE_BACKWARD_BAD = [
    ("grad_output_none", dict(grad_output=None), TypeError, ["grad_output", "NoneType"]),
    ("grad_output_str", dict(grad_output="1"), TypeError, ["grad_output", "str"]),
    ("grad_output_bool", dict(grad_output=True), TypeError, ["grad_output", "bool"]),
    ("grad_output_complex", dict(grad_output=1j), TypeError, ["grad_output", "complex"]),
    ("grad_output_list", dict(grad_output=[1.0]), TypeError, ["grad_output", "list"]),
    ("grad_output_shape_mean", dict(grad_output=np.ones(3)), ValueError, ["grad_output", "()", "(3,)"]),
    ("grad_output_shape_sum", dict(grad_output=np.ones(1), reduction="sum"), ValueError,
     ["grad_output", "()", "(1,)"]),
    ("grad_output_shape_none", dict(grad_output=np.ones(2), reduction="none"), ValueError,
     ["grad_output", "(3,)", "(2,)"]),
    ("grad_output_scalar_for_none", dict(grad_output=1.0, reduction="none"), ValueError,
     ["grad_output", "(3,)", "scalar"]),
    ("grad_output_float32_array", dict(grad_output=np.ones((), np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("grad_output_int_array", dict(grad_output=np.ones(3, np.int64), reduction="none"), TypeError,
     ["grad_output", "int64"]),
    ("stats_none", dict(stats=None), TypeError, ["stats", "NoneType"]),
    ("stats_list", dict(stats=CSTATS.tolist()), TypeError, ["stats", "list"]),
    ("stats_shape", dict(stats=np.zeros((3, 3))), ValueError, ["stats", "(3, 2)", "(3, 3)"]),
    ("stats_transposed", dict(stats=np.zeros((2, 3))), ValueError, ["stats", "(3, 2)", "(2, 3)"]),
    ("stats_float32", dict(stats=CSTATS.astype(np.float32)), TypeError, ["stats", "float32", "float64"]),
]


@pytest.mark.parametrize("cid, kw, exc, ws", CE_BACKWARD_BAD, ids=[c[0] for c in CE_BACKWARD_BAD])
def test_cross_entropy_backward_bad_input(cid, kw, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        _ce_call("backward", CL, CT, **kw)()


# ----------------------------------------------------- linear_cross_entropy (forward, _forward, _backward, nn)
# input (2, 3, 4), weight (5, 4), bias (5,), target (2, 3) with one ignored row; each refused before any compute
LX, LW, LB, LT = randn(2, 3, 4, seed=70), randn(5, 4, seed=71), randn(5, seed=72), np.array([[0, 4, -100], [1, 2, 3]])
LFWD = AF.linear_cross_entropy_forward(LX, LW, LT, LB, compute_grads=False)


def _lce_call(kind, input, weight, target, bias, **kw):
    if kind == "function":
        return lambda: AF.linear_cross_entropy(input, weight, target, bias, **kw)
    if kind == "layer":
        return lambda: LinearCrossEntropyLoss(**kw)(input, weight, target, bias)
    grad_output, lse = kw.pop("grad_output", 1.0), kw.pop("logsumexp", LFWD.logsumexp)
    return lambda: AF.linear_cross_entropy_backward(grad_output, input, weight, target, lse, bias, **kw)


# id, (input, weight, target, bias, kwargs) builder, exception, words
LCE_BAD = [
    ("target_out_of_range", lambda: (LX, LW, np.array([[0, 5, 1], [1, 2, 3]]), LB, {}), IndexError,
     ["target", "5", "[0, 5)"]),
    ("target_negative", lambda: (LX, LW, np.array([[0, -1, 1], [1, 2, 3]]), LB, {}), IndexError,
     ["target", "-1", "[0, 5)"]),
    ("target_float", lambda: (LX, LW, LT.astype(float), LB, {}), TypeError, ["target", "integer", "float64"]),
    ("target_shape", lambda: (LX, LW, LT[0], LB, {}), ValueError, ["target", "(2, 3)", "(3,)"]),
    ("weight_width", lambda: (LX, randn(5, 3), LT, LB, {}), ValueError, ["weight", "(5, 3)", "E = 4"]),
    ("weight_no_classes", lambda: (LX, np.zeros((0, 4)), np.zeros((2, 3), np.int64), None, {}), ValueError,
     ["weight", "(0, 4)", "V >= 1"]),
    ("weight_float32", lambda: (LX, LW.astype(np.float32), LT, LB, {}), TypeError, ["weight", "float32", "float64"]),
    ("weight_1d", lambda: (LX, LW[0], LT, LB, {}), ValueError, ["weight", "2", "(4,)"]),
    ("bias_shape", lambda: (LX, LW, LT, np.zeros(4), {}), ValueError, ["bias", "(5,)", "(4,)"]),
    ("input_int", lambda: (LX.astype(np.int64), LW, LT, LB, {}), TypeError, ["input", "int64"]),
    ("label_smoothing_above_1", lambda: (LX, LW, LT, LB, dict(label_smoothing=1.5)), ValueError,
     ["label_smoothing", "1.5"]),
    ("label_smoothing_str", lambda: (LX, LW, LT, LB, dict(label_smoothing="0.1")), TypeError,
     ["label_smoothing", "str"]),
]


@pytest.mark.parametrize("kind", ["function", "layer", "backward"])
@pytest.mark.parametrize("cid, build, exc, ws", LCE_BAD, ids=[c[0] for c in LCE_BAD])
def test_linear_cross_entropy_bad_input(kind, cid, build, exc, ws):
    input, weight, target, bias, kw = build()
    if kind == "layer" and cid.startswith("label_smoothing"):
        with pytest.raises(exc, match=words(*ws)):
            LinearCrossEntropyLoss(**kw)
        return
    with pytest.raises(exc, match=words(*ws)):
        _lce_call(kind, input, weight, target, bias, **kw)()


LCE_BACKWARD_BAD = [
    ("grad_output_shape_mean", dict(grad_output=np.ones(3)), ValueError, ["grad_output", "()", "(3,)"]),
    ("grad_output_shape_none", dict(grad_output=np.ones(3), reduction="none"), ValueError,
     ["grad_output", "(2, 3)", "(3,)"]),
    ("logsumexp_shape", dict(logsumexp=np.zeros(6)), ValueError, ["logsumexp", "(2, 3)", "(6,)"]),
    ("logsumexp_float32", dict(logsumexp=np.zeros((2, 3), np.float32)), TypeError, ["logsumexp", "float32"]),
    ("grads_for_none", dict(grad_output=np.ones((2, 3)), reduction="none", grads=(None, None, None)), ValueError,
     ["grads", "mean", "sum"]),
    ("grads_shapes", dict(grads=(np.zeros((2, 3, 4)), np.zeros((4, 5)), np.zeros(5))), ValueError,
     ["grads", "(5, 4)"]),
]


@pytest.mark.parametrize("cid, kw, exc, ws", LCE_BACKWARD_BAD, ids=[c[0] for c in LCE_BACKWARD_BAD])
def test_linear_cross_entropy_backward_bad_input(cid, kw, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        _lce_call("backward", LX, LW, LT, LB, **kw)()


# ------------------------------------------------------------------------ the non-array arguments, by kind
# attnpp._checks.ARGUMENTS names the kind of every non-array argument of the public functions, layers and
# optimizers; each kind lists the values its check refuses. A valid call of each (below) gets each refused value
# in turn, in place of each argument of the kind: the exception must be the kind's, its message must name the
# argument. The array arguments and the few of a kind of their own are the tables' (HAND_TESTED).
def _valid_calls():
    f64 = lambda *shape, seed=0: randn(*shape, seed=seed)
    i64 = lambda *v: np.array(v, np.int64)
    q, k, v = _q(), _k(), _v()
    g, out, lse = np.ones(OUT_SHAPE), np.zeros(OUT_SHAPE), np.zeros(LSE_SHAPE)
    vq, vk, vv = f64(5, 2, 4, seed=1), f64(6, 2, 4, seed=2), f64(6, 2, 3, seed=3)  # packed (T, H, width)
    vg, vout, vlse, cu_q, cu_k = np.ones((5, 2, 3)), np.zeros((5, 2, 3)), np.zeros((2, 5)), i64(0, 2, 5), i64(0, 4, 6)
    cos, sin = AF.rotary_tables(8, 4, dtype=np.float64)
    x3 = f64(1, 2, 3, 4, seed=4)
    layer = Linear(3, 2, dtype=np.float64)
    return {
        "functional.scaled_dot_product_attention": lambda **kw: AF.scaled_dot_product_attention(q, k, v, **kw),
        "functional.scaled_dot_product_attention_forward":
            lambda **kw: AF.scaled_dot_product_attention_forward(q, k, v, **kw),
        "functional.scaled_dot_product_attention_backward":
            lambda **kw: AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, **{"seed": 1, **kw}),
        "functional.scaled_dot_product_attention_weights":
            lambda **kw: AF.scaled_dot_product_attention_weights(q, k, **kw),
        "functional.scaled_dot_product_attention_varlen":
            lambda **kw: AF.scaled_dot_product_attention_varlen(vq, vk, vv, cu_q, cu_k, **kw),
        "functional.scaled_dot_product_attention_varlen_forward":
            lambda **kw: AF.scaled_dot_product_attention_varlen_forward(vq, vk, vv, cu_q, cu_k, **kw),
        "functional.scaled_dot_product_attention_varlen_backward":
            lambda **kw: AF.scaled_dot_product_attention_varlen_backward(vg, vq, vk, vv, vout, vlse, cu_q, cu_k,
                                                                         **{"seed": 1, **kw}),
        "functional.scaled_dot_product_attention_with_kvcache":
            lambda **kw: AF.scaled_dot_product_attention_with_kvcache(f64(2, 2, 1, 4), np.zeros((2, 2, 6, 4)),
                                                                      np.zeros((2, 2, 6, 3)), i64(2, 3), **kw),
        "functional.dropout": lambda **kw: AF.dropout(DX, **kw),
        "functional.dropout_backward": lambda **kw: AF.dropout_backward(DX, **{"p": 0.5, "seed": 1, **kw}),
        "functional.dropout_mask": lambda **kw: AF.dropout_mask((2, 3), **{"p": 0.5, "seed": 1, **kw}),
        "functional.cross_entropy": lambda **kw: AF.cross_entropy(CL, CT, **kw),
        "functional.cross_entropy_forward": lambda **kw: AF.cross_entropy_forward(CL, CT, **kw),
        "functional.cross_entropy_backward": lambda **kw: AF.cross_entropy_backward(
            1.0, CL, CT, AF.cross_entropy_forward(CL, CT)[1], **kw),
        "functional.linear_cross_entropy": lambda **kw: AF.linear_cross_entropy(LX, LW, LT, LB, **kw),
        "functional.linear_cross_entropy_forward": lambda **kw: AF.linear_cross_entropy_forward(LX, LW, LT, LB,
                                                                                                **kw),
        "functional.linear_cross_entropy_backward": lambda **kw: AF.linear_cross_entropy_backward(
            1.0, LX, LW, LT, LFWD.logsumexp, LB, **kw),
        "nn.LinearCrossEntropyLoss": lambda **kw: LinearCrossEntropyLoss(**kw),
        "functional.linear_backward": lambda **kw: AF.linear_backward(FGY, FX, FW, np.zeros((3, 4)), **kw),
        "functional.get_alibi_slopes": lambda **kw: AF.get_alibi_slopes(**{"num_heads": 4, **kw}),
        "functional.rotary_embedding": lambda **kw: AF.rotary_embedding(x3, cos, sin, **kw),
        "functional.rotary_embedding_backward": lambda **kw: AF.rotary_embedding_backward(x3, cos, sin, **kw),
        "functional.rotary_tables": lambda **kw: AF.rotary_tables(**{"max_positions": 8, "rotary_dim": 4, **kw}),
        "nn.Linear": lambda **kw: Linear(**{"in_features": 4, "out_features": 3, **kw}),
        "nn.Embedding": lambda **kw: Embedding(**{"num_embeddings": 5, "embedding_dim": 3, **kw}),
        "nn.Dropout": lambda **kw: Dropout(**kw),
        "nn.CrossEntropyLoss": lambda **kw: CrossEntropyLoss(**kw),
        "nn.KVCache": lambda **kw: KVCache(**{"batch_size": 2, "num_heads": 2, "max_length": 8, "head_dim": 4,
                                              **kw}),
        "nn.MultiheadAttention": lambda **kw: MultiheadAttention(**{"embed_dim": 4, "num_heads": 2, **kw}),
        "nn.Attention": lambda **kw: Attention(**{"embed_dim": 4, "num_heads": 2, **kw}),
        "optim.SGD": lambda **kw: SGD(layer.parameters(), **{"lr": 0.1, **kw}),
        "optim.AdamW": lambda **kw: AdamW(layer.parameters(), **kw),
    }


VALID_CALLS = _valid_calls()
HAND_TESTED = {  # the arguments the tables above and below test, not by kind
    "functional.scaled_dot_product_attention": {"query", "key", "value", "attn_mask", "alibi_slopes", "sinks",
                                                "key_padding_mask"},
    "functional.scaled_dot_product_attention_backward": {"grad_output", "output", "logsumexp"},
    "functional.scaled_dot_product_attention_weights": {"query", "key", "attn_mask", "logsumexp", "alibi_slopes",
                                                        "sinks", "key_padding_mask"},
    "functional.scaled_dot_product_attention_varlen": {"query", "key", "value", "cu_seqlens_q", "cu_seqlens_k",
                                                       "alibi_slopes", "sinks"},
    "functional.scaled_dot_product_attention_varlen_backward": {"grad_output", "output", "logsumexp"},
    "functional.scaled_dot_product_attention_with_kvcache": {"query", "key_cache", "value_cache", "cache_seqlens",
                                                             "key", "value", "alibi_slopes", "sinks"},
    "functional.dropout": {"input"},
    "functional.dropout_backward": {"grad_output"},
    "functional.dropout_mask": {"shape"},
    "functional.embedding": {"input", "weight"},
    "functional.embedding_backward": {"grad_output", "input", "grad_weight"},
    "functional.cross_entropy": {"input", "target"},
    "functional.cross_entropy_backward": {"grad_output", "stats"},
    "functional.linear_cross_entropy": {"input", "weight", "target", "bias"},
    "functional.linear_cross_entropy_backward": {"grad_output", "logsumexp", "grads"},
    "functional.linear": {"input", "weight", "bias"},
    "functional.linear_backward": {"grad_output", "input", "weight", "grad_weight", "grad_bias"},
    "functional.rotary_embedding": {"input", "cos", "sin", "position_offset"},
    "functional.rotary_embedding_backward": {"grad_output"},
    "functional.rotary_tables": {"rotary_dim", "base"},
    "nn.KVCache": {"v_head_dim"},
    "nn.Attention": {"alibi", "rotary_dim", "rotary_base"},
    "optim.SGD": {"params", "nesterov"},
    "optim.AdamW": {"params", "betas"},
}
HAND_TESTED["functional.scaled_dot_product_attention_forward"] = HAND_TESTED["functional.scaled_dot_product_attention"]
HAND_TESTED["functional.scaled_dot_product_attention_backward"] |= \
    HAND_TESTED["functional.scaled_dot_product_attention"]
HAND_TESTED["functional.scaled_dot_product_attention_varlen_forward"] = \
    HAND_TESTED["functional.scaled_dot_product_attention_varlen"]
HAND_TESTED["functional.scaled_dot_product_attention_varlen_backward"] |= \
    HAND_TESTED["functional.scaled_dot_product_attention_varlen"]
HAND_TESTED["functional.cross_entropy_forward"] = HAND_TESTED["functional.cross_entropy"]
HAND_TESTED["functional.cross_entropy_backward"] |= HAND_TESTED["functional.cross_entropy"]
HAND_TESTED["functional.linear_cross_entropy_forward"] = HAND_TESTED["functional.linear_cross_entropy"]
HAND_TESTED["functional.linear_cross_entropy_backward"] |= HAND_TESTED["functional.linear_cross_entropy"]
HAND_TESTED["functional.rotary_embedding_backward"] |= HAND_TESTED["functional.rotary_embedding"] - {"input"}

KIND_CASES = [pytest.param(where, name, value, exc, id=f"{where}-{name}-{value!r}")
              for where, arguments in ARGUMENTS.items() for name, kind in arguments.items()
              for value, exc in kind.refuses]


def _public(where):
    module, name = where.split(".")
    return getattr({"functional": AF, "nn": attnpp.nn, "optim": attnpp.optim}[module], name)


def _shown(value):
    """What a message may show of a refused value: the value or one of its elements, or its type's name."""
    parts = [value] + (list(value) if isinstance(value, tuple) else [])
    return [f(v) for v in parts for f in (str, repr, lambda v: type(v).__name__)]


@pytest.mark.parametrize("where, name, value, exc", KIND_CASES)
def test_argument_refuses_its_kinds_bad_values(where, name, value, exc):
    VALID_CALLS[where]()  # (the call is valid without the bad value)
    with pytest.raises(exc) as info:
        VALID_CALLS[where](**{name: value})
    message = str(info.value)
    assert name in message, f"{where}: the message does not name {name}: {message}"
    assert any(shown in message for shown in _shown(value)), f"{where}: the message does not show {value!r}: {message}"


def test_every_argument_is_described():
    """Each parameter of every public function, layer and optimizer has a kind in ARGUMENTS or cases in the
    tables (HAND_TESTED): a new argument without either fails here."""
    public = [f"functional.{n}" for n in AF.__all__ if not n.endswith("Forward")] + \
        [f"nn.{n}" for n in ("Linear", "Embedding", "Dropout", "CrossEntropyLoss", "LinearCrossEntropyLoss",
                             "KVCache", "MultiheadAttention",
                             "Attention")] + ["optim.SGD", "optim.AdamW"]
    missing = {where: sorted(set(inspect.signature(_public(where)).parameters) - set(ARGUMENTS.get(where, {}))
                             - HAND_TESTED.get(where, set())) for where in public}
    assert not {w: m for w, m in missing.items() if m}, "arguments neither described nor hand-tested"
    assert set(VALID_CALLS) == set(ARGUMENTS)


# ------------------------------------------------------------------------------------------------- globals
GLOBAL_BAD = [
    ("set_bfloat16_attention_name", lambda: attnpp.set_bfloat16_attention("fast"), ValueError,
     ["numerics", "'fast'", "'pytorch'", "'flash'", "'float32'"]),
    ("set_bfloat16_attention_bool", lambda: attnpp.set_bfloat16_attention(True), ValueError, ["numerics", "True"]),
    ("set_num_threads_0", lambda: attnpp.set_num_threads(0), ValueError, ["set_num_threads", "1", "0"]),
    ("set_num_threads_negative", lambda: attnpp.set_num_threads(-3), ValueError, ["set_num_threads", "-3"]),
    ("set_num_threads_str", lambda: attnpp.set_num_threads("2"), TypeError, ["set_num_threads", "'2'"]),
    ("set_num_threads_float", lambda: attnpp.set_num_threads(2.0), TypeError, ["set_num_threads", "2.0"]),
    ("set_num_threads_none", lambda: attnpp.set_num_threads(None), TypeError, ["set_num_threads", "None"]),
    ("set_num_threads_huge", lambda: attnpp.set_num_threads(2 ** 40), ValueError,
          ["set_num_threads", str(2 ** 40)]),
    ("manual_seed_str", lambda: attnpp.manual_seed("x"), TypeError, ["seed", "int", "str"]),
    ("manual_seed_float", lambda: attnpp.manual_seed(1.5), TypeError, ["seed", "int", "float"]),
    ("manual_seed_none", lambda: attnpp.manual_seed(None), TypeError, ["seed", "int", "NoneType"]),
    ("manual_seed_bool", lambda: attnpp.manual_seed(True), TypeError, ["seed", "int", "bool"]),
    ("manual_seed_array", lambda: attnpp.manual_seed(np.array([1, 2])), TypeError, ["seed", "int", "ndarray"]),
    ("empty_cache_argument", lambda: attnpp.empty_cache(0), TypeError, ["empty_cache"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(GLOBAL_BAD))
def test_global_bad_input(call, exc, ws):
    threads = attnpp.get_num_threads()
    with pytest.raises(exc, match=words(*ws)):
        call()
    assert attnpp.get_num_threads() == threads  # a refused set_num_threads changes nothing


# ------------------------------------------------------------------------------------------ layer constructors
LAYER_INIT_BAD = [
    ("mha_heads_not_dividing", lambda: MultiheadAttention(6, 4), ValueError, ["embed_dim", "num_heads", "6", "4"]),
    ("attention_heads_not_dividing", lambda: Attention(6, 4), ValueError, ["qk_dim", "num_heads", "6", "4"]),
    ("attention_heads_not_dividing_v_dim", lambda: Attention(6, 2, v_dim=5), ValueError,
     ["v_dim", "num_heads", "5", "2"]),
    ("attention_str_out_dim_without_proj", lambda: Attention(6, out_proj=False, out_dim="4"), TypeError,
     ["out_dim", "int", "str"]),
    ("attention_out_dim_without_proj", lambda: Attention(6, out_proj=False, out_dim=4), ValueError,
     ["out_dim", "out_proj"]),
    ("attention_alibi_shape", lambda: Attention(6, 2, alibi=np.ones(3)), ValueError, ["alibi", "(2,)", "(3,)"]),
    ("attention_alibi_int", lambda: Attention(6, 2, alibi=np.ones(2, np.int64)), TypeError, ["alibi", "int64"]),
    ("attention_alibi_inf", lambda: Attention(6, 2, alibi=np.array([1.0, np.inf])), ValueError,
     ["alibi", "finite"]),
    ("attention_alibi_str", lambda: Attention(6, 2, alibi="yes"), TypeError, ["alibi", "bool", "str"]),
    ("attention_alibi_nan", lambda: Attention(6, 2, alibi=np.array([1.0, np.nan])), ValueError,
     ["alibi", "finite"]),
    ("attention_rotary_odd_head", lambda: Attention(6, 2, rotary=True), ValueError,
     ["rotary=True", "head width", "3", "odd", "rotary_dim"]),
    ("attention_rotary_dim_odd", lambda: Attention(8, 2, rotary=True, rotary_dim=3), ValueError,
     ["rotary_dim", "even", "3"]),
    ("attention_rotary_dim_above_head", lambda: Attention(8, 2, rotary=True, rotary_dim=6), ValueError,
     ["rotary_dim", "head width", "4", "6"]),
    ("attention_rotary_dim_zero", lambda: Attention(8, 2, rotary=True, rotary_dim=0), ValueError,
     ["rotary_dim", ">= 2", "0"]),
    ("attention_rotary_dim_float", lambda: Attention(8, 2, rotary=True, rotary_dim=2.0), TypeError,
     ["rotary_dim", "int", "float"]),
    ("attention_rotary_dim_without_rotary", lambda: Attention(8, 2, rotary_dim=2), ValueError,
     ["rotary_dim", "rotary=True"]),
    ("attention_rotary_interleaved_without_rotary", lambda: Attention(8, 2, rotary_interleaved=True), ValueError,
     ["rotary_interleaved", "rotary=True"]),
    ("attention_rotary_base_zero", lambda: Attention(8, 2, rotary=True, rotary_base=0.0), ValueError,
     ["rotary_base", "> 0", "0.0"]),
    ("attention_rotary_base_str", lambda: Attention(8, 2, rotary=True, rotary_base="1e4"), TypeError,
     ["rotary_base", "float", "str"]),
    ("attention_rotary_interleaved_int", lambda: Attention(8, 2, rotary=True, rotary_interleaved=1), TypeError,
     ["rotary_interleaved", "bool", "int"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(LAYER_INIT_BAD))
def test_layer_init_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()


# ----------------------------------------------------------------------------- Parameter: data/grad assignment
# a Linear(3, 2) weight: (2, 3) float64; the message should start "data: " or "grad: " (a bare "data" is in numpy's
# "Cannot cast array data")
PARAMETER_BAD = [
    ("data_wrong_shape", "data", np.zeros((3, 2)), ValueError, ["data:", "(2, 3)", "(3, 2)"]),
    ("data_wrong_ndim", "data", np.zeros(6), ValueError, ["data:", "(2, 3)", "(6,)"]),
    ("data_list_wrong_shape", "data", [[1.0, 2.0]], ValueError, ["data:", "(2, 3)", "(1, 2)"]),
    ("data_none", "data", None, TypeError,
          ["data:", "NoneType"]),
    ("data_str", "data", "abc", TypeError,
          ["data:", "str"]),
    ("data_complex", "data", np.zeros((2, 3), complex), TypeError, ["data:", "complex128"]),
    ("data_object", "data", np.zeros((2, 3), object), TypeError, ["data:", "object"]),
    ("grad_wrong_shape", "grad", np.zeros((3, 2)), ValueError, ["grad:", "(2, 3)", "(3, 2)"]),
    ("grad_str", "grad", "abc", TypeError, ["grad:", "str"]),
    ("grad_complex", "grad", np.zeros((2, 3), complex), TypeError, ["grad:", "complex128"]),
]


@pytest.mark.parametrize("attr, value, exc, ws", cases(PARAMETER_BAD))
def test_parameter_assignment_bad_input(attr, value, exc, ws):
    layer = Linear(3, 2, dtype=np.float64)
    layer.weight.grad = randn(2, 3, seed=70)
    before = layer.weight.data.copy(), layer.weight.grad.copy()
    with pytest.raises((ValueError, TypeError)) as info:
        setattr(layer.weight, attr, value)
    np.testing.assert_array_equal(layer.weight.data, before[0])  # nothing written by the refused assignment
    np.testing.assert_array_equal(layer.weight.grad, before[1])
    assert info.type is exc and re.search(words(*ws), str(info.value)), f"{info.type.__name__}: {info.value}"


# ------------------------------------------------------------------------------------------------- optimizers
def _opt_layer():
    layer = Linear(4, 3, dtype=np.float64)
    for p in layer.parameters():
        p.grad = randn(*p.shape, seed=80)
    return layer


OPTIM_BAD = [
    ("sgd_params_arrays", lambda l: SGD([np.zeros(3)], lr=0.1), TypeError, ["params", "Parameter", "ndarray"]),
    ("sgd_params_none", lambda l: SGD(None, lr=0.1), TypeError, ["params", "NoneType"]),
    ("sgd_params_layer", lambda l: SGD(l, lr=0.1), TypeError, ["params", "Linear", "parameters()"]),
    ("sgd_params_empty", lambda l: SGD([], lr=0.1), ValueError, ["params", "empty"]),
    ("sgd_params_twice", lambda l: SGD(list(l.parameters()) * 2, lr=0.1), ValueError, ["params", "more than once"]),
    ("sgd_nesterov_without_momentum", lambda l: SGD(l.parameters(), lr=0.1, nesterov=True), ValueError,
     ["Nesterov", "momentum"]),
    ("sgd_step_argument", lambda l: SGD(l.parameters(), lr=0.1).step(lambda: 0.0), TypeError, ["step"]),
    ("adamw_params_none", lambda l: AdamW(None), TypeError, ["params", "NoneType"]),
    ("adamw_params_layer", lambda l: AdamW(l), TypeError, ["params", "Linear"]),
    ("adamw_betas_one_value", lambda l: AdamW(l.parameters(), betas=(0.9,)), ValueError, ["betas", "(0.9,)"]),
    ("adamw_betas_three_values", lambda l: AdamW(l.parameters(), betas=(0.9, 0.9, 0.9)), ValueError,
     ["betas", "(0.9, 0.9, 0.9)"]),
    ("adamw_betas_none", lambda l: AdamW(l.parameters(), betas=None), TypeError, ["betas", "NoneType"]),
    ("adamw_betas_float", lambda l: AdamW(l.parameters(), betas=0.9), TypeError, ["betas", "float"]),
    ("adamw_betas_str", lambda l: AdamW(l.parameters(), betas=("a", "b")), TypeError, ["betas", "'a'"]),
    ("adamw_beta_one", lambda l: AdamW(l.parameters(), betas=(1.0, 0.999)), ValueError, ["betas", "1.0"]),
    ("adamw_beta_negative", lambda l: AdamW(l.parameters(), betas=(0.9, -0.1)), ValueError, ["betas", "-0.1"]),
    ("adamw_step_argument", lambda l: AdamW(l.parameters()).step(lambda: 0.0), TypeError, ["step"]),
]


@pytest.mark.parametrize("call, exc, ws", cases(OPTIM_BAD))
def test_optimizer_bad_input(call, exc, ws):
    layer = _opt_layer()
    before = {name: (p.data.copy(), _grad(p)) for name, p in layer.named_parameters()}
    with pytest.raises(exc, match=words(*ws)):
        call(layer)
    for name, p in layer.named_parameters():  # nothing stepped
        np.testing.assert_array_equal(p.data, before[name][0], err_msg=name)
        np.testing.assert_array_equal(p.grad, before[name][1], err_msg=name)
    SGD(layer.parameters(), lr=0.5).step()  # and a valid step works
    for name, p in layer.named_parameters():
        np.testing.assert_allclose(p.data, before[name][0] - 0.5 * before[name][1], rtol=1e-12, err_msg=name)


# ----------------------------------------------------------------------------------------- too large requests
def _big(shape, small):
    """``small`` broadcast to ``shape``: an input of any size that costs nothing."""
    return np.broadcast_to(small, shape)


MEMORY_BAD = [
    ("sdpa_weights_broadcast_batch",
     lambda: AF.scaled_dot_product_attention_weights(_big((10 ** 10, 10 ** 4, 3, 4), _q()[0, 0]), _k()[0, 0]), []),
    ("sdpa_forward_broadcast_batch",
     lambda: AF.scaled_dot_product_attention_forward(_big((10 ** 10, 10 ** 4, 3, 4), _q()[0, 0]), _k()[0, 0],
                                                     _v()[0, 0]), []),
    ("sdpa_backward_broadcast_batch",
     lambda: AF.scaled_dot_product_attention_backward(_big((10 ** 10, 10 ** 4, 3, 6), 0.0), _big(
         (10 ** 10, 10 ** 4, 3, 4), _q()[0, 0]), _k()[0, 0], _v()[0, 0], _big((10 ** 10, 10 ** 4, 3, 6), 0.0),
         _big((10 ** 10, 10 ** 4, 3), 0.0)), []),
    ("sdpa_batch_beyond_int64",
     lambda: AF.scaled_dot_product_attention(_big((2 ** 40, 1, 1, 3, 4), _q()[0, 0]),
                                             _big((1, 2 ** 40, 1, 5, 4), _k()[0, 0]),
                                             _big((1, 2 ** 40, 1, 5, 6), _v()[0, 0])),
     ["batch", str(2 ** 40)]),
    ("dropout_mask_huge", lambda: AF.dropout_mask((10 ** 8, 10 ** 8), 0.1, 0), []),
    ("dropout_mask_beyond_int64", lambda: AF.dropout_mask((2 ** 40, 2 ** 40), 0.1, 0),
     ["dropout_mask", str(2 ** 40)]),
    ("dropout_broadcast", lambda: AF.dropout(_big((HUGE,), 1.0), 0.1, seed=0), []),
    ("linear_broadcast", lambda: AF.linear(_big((HUGE, 4), FX[0]), FW, FB), []),
    ("linear_backward_broadcast",
     lambda: AF.linear_backward(_big((HUGE, 3), FGY[0]), _big((HUGE, 4), FX[0]), FW, np.zeros((3, 4))), []),
    ("embedding_broadcast", lambda: AF.embedding(_big((10 * HUGE,), np.int64(1)), EW), []),
    ("cross_entropy_broadcast",
     lambda: AF.cross_entropy(_big((10 * HUGE, 4), CL[0]), _big((10 * HUGE,), np.int64(1))), []),
    ("linear_init", lambda: Linear(10 ** 8, 10 ** 8), []),
    ("linear_init_beyond_int64", lambda: Linear(2 ** 40, 2 ** 40), []),
    ("embedding_init", lambda: Embedding(10 ** 8, 10 ** 8), []),
    ("mha_init", lambda: MultiheadAttention(10 ** 8, 1), []),
    ("attention_init", lambda: Attention(10 ** 8), []),
]


def _overcommit_always():
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommit_always(), reason="vm.overcommit_memory=1: a huge malloc might succeed")
@pytest.mark.parametrize("call, ws", cases(MEMORY_BAD))
def test_too_large_raises_memory_error(call, ws):
    """Every first allocation is beyond 1 PB (more than a 47-bit address space): malloc fails at once, with any
    overcommit policy but 'always'; the library stays usable."""
    with pytest.raises(MemoryError, match=words(*ws)):
        call()
    out = AF.scaled_dot_product_attention(_q(), _k(), _v())
    assert out.shape == OUT_SHAPE and np.isfinite(out).all()
    np.testing.assert_allclose(AF.linear(FX, FW, FB), FX @ FW.T + FB, rtol=1e-12)
    assert AF.dropout_mask((3, 4), 0.5, 1).shape == (3, 4)
    assert isinstance(attnpp.empty_cache(), int)


WEIGHTS_L = 200000  # (1, 2, L, L) float64 weights: 640 GB


def _weights_layers():
    """(make, forward with the weights) for the layers that return them; ``make`` builds a float64 layer of width
    8 with 2 heads."""
    mha = lambda: MultiheadAttention(8, 2, batch_first=True, dtype=np.float64)
    attention = lambda: Attention(8, 2, dtype=np.float64)
    return [(mha, lambda m, x: m(x, x, x, need_weights=True, average_attn_weights=False)),
            (attention, lambda a, x: a(x, need_weights=True))]


@pytest.mark.skipif(_overcommit_always(), reason="vm.overcommit_memory=1: a huge malloc might succeed")
@pytest.mark.parametrize("index", [0, 1], ids=["MultiheadAttention", "Attention"])
def test_weights_too_large_refused_before_the_attention(index):
    """The weights are allocated before any work: (1, 200000, 8) with need_weights asks for 640 GB of them, and
    the MemoryError (naming the shape and the bytes) comes at once instead of after the attention over 200,000
    keys (168 s); the layer is unharmed."""
    make, forward = _weights_layers()[index]
    layer = make()
    snapshot = _snapshot(layer)
    x = np.zeros((1, WEIGHTS_L, 8))
    with pytest.raises(MemoryError, match=words("Unable to allocate", f"(1, 2, {WEIGHTS_L}, {WEIGHTS_L})",
                                                 f"{8 * 2 * WEIGHTS_L ** 2} bytes", "float64")):
        forward(layer, x)
    small = np.random.default_rng(3).standard_normal((1, 5, 8))

    def run(lay):
        out, w = forward(lay, small)
        grads = lay.backward(np.ones_like(out))
        return (out, w) + (grads if isinstance(grads, tuple) else (grads,))
    _check_layer_unharmed(layer, make, snapshot, run)


@pytest.mark.skipif(_overcommit_always(), reason="vm.overcommit_memory=1: a huge malloc might succeed")
def test_functional_weights_too_large_refused():
    q = np.zeros((1, 2, WEIGHTS_L, 4))
    with pytest.raises(MemoryError, match=words(f"(1, 2, {WEIGHTS_L}, {WEIGHTS_L})", f"{8 * 2 * WEIGHTS_L ** 2} bytes")):
        AF.scaled_dot_product_attention_weights(q, q)


# --------------------------------------------------------------------------------------------------- layers
def _grad(p):
    """A copy of ``p.grad``, zeros while it is None (no backward has accumulated into it yet)."""
    return np.zeros(p.shape, p.dtype) if p.grad is None else p.grad.copy()


def _snapshot(layer):
    return {name: (p.data.copy(), p.grad if p.grad is None else p.grad.copy())
            for name, p in layer.named_parameters()}


def _check_layer_unharmed(layer, make, snapshot, run):
    """Parameters unchanged, and a valid forward + backward gives what a fresh layer with the same state gives.

    ``make()`` builds a layer of the same configuration; ``run(layer)`` does a valid forward and backward and
    returns the arrays to compare. Gradients are compared as the increment of this run, so that a valid
    backward inside the case (before the failing call) does not count.
    """
    for name, p in layer.named_parameters():
        np.testing.assert_array_equal(p.data, snapshot[name][0], err_msg=f"{name} changed by a failed call")
        assert (p.grad is None) == (snapshot[name][1] is None), f"{name}.grad created or dropped by a failed call"
        if p.grad is not None:
            np.testing.assert_array_equal(p.grad, snapshot[name][1], err_msg=f"{name}.grad changed by a failed call")
    fresh = make()
    fresh.load_state_dict({name: d for name, (d, _) in snapshot.items()})
    fresh.zero_grad()
    fresh.train(layer.training)
    before = {name: _grad(p) for name, p in layer.named_parameters()}
    ours, theirs = run(layer), run(fresh)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for name, p in layer.named_parameters():
        np.testing.assert_allclose(_grad(p) - before[name], _grad(dict(fresh.named_parameters())[name]),
                                   rtol=1e-12, atol=1e-14, err_msg=f"{name}.grad")


def _layer_case(make, setup, bad, exc, ws, run, randomize=False):
    """Build a layer, run ``setup``, check that ``bad`` raises ``exc`` with ``ws``, then that it is unharmed."""
    attnpp.manual_seed(0)
    layer = make()
    if randomize:  # non-trivial biases too
        rng = np.random.default_rng(0)
        for p in layer.parameters():
            p.data[...] = 0.5 * rng.standard_normal(p.shape)
    if setup is not None:
        setup(layer)
    snapshot = _snapshot(layer)
    with pytest.raises(exc, match=words(*ws)):
        bad(layer)
    _check_layer_unharmed(layer, make, snapshot, run)


def _state(layer, **change):
    """The layer's state dict as copies, with entries replaced (value) or removed (None) or added; ``__`` in a
    keyword stands for a dot."""
    sd = {name: p.data.copy() + 1.0 for name, p in layer.named_parameters()}  # all different from the layer's
    for name, value in change.items():
        name = name.replace("__", ".")
        if value is None:
            sd.pop(name)
        else:
            sd[name] = value
    return sd


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
    ("bool_input", None, lambda l: l(X > 0), TypeError, ["input", "bool"]),
    ("complex_input", None, lambda l: l(X.astype(complex)), TypeError, ["input", "complex128"]),
    ("object_input", None, lambda l: l(X.astype(object)), TypeError, ["input", "object"]),
    ("float16_input", None, lambda l: l(X.astype(np.float16)), TypeError, ["input", "float16"]),
    ("list_input", None, lambda l: l(X.tolist()), TypeError, ["input", "ndarray", "list"]),
    ("scalar_input", None, lambda l: l(np.float64(1.0)), ValueError, ["input", "at least 1 dimensions", "()"]),
    ("none_input", None, lambda l: l(None), TypeError, ["input", "NoneType"]),
    ("0d_input", None, lambda l: l(np.array(1.0)), ValueError, ["input", "1", "()"]),
    ("backward_before_forward", None, lambda l: l.backward(GY), ValueError, ["backward", "forward"]),
    ("backward_twice", _forward_backward, lambda l: l.backward(GY), ValueError, ["backward", "forward"]),
    ("backward_wrong_shape", _forward, lambda l: l.backward(randn(2, 4)), ValueError,
     ["grad_output", "(2, 3)", "(2, 4)"]),
    ("backward_wrong_batch", _forward, lambda l: l.backward(randn(3, 3)), ValueError,
     ["grad_output", "(2, 3)", "(3, 3)"]),
    ("backward_transposed", _forward, lambda l: l.backward(randn(3, 2)), ValueError,
     ["grad_output", "(2, 3)", "(3, 2)"]),
    ("backward_0d", _forward, lambda l: l.backward(np.array(1.0)), ValueError, ["grad_output", "(2, 3)", "()"]),
    ("backward_wrong_dtype", _forward, lambda l: l.backward(GY.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("backward_int", _forward, lambda l: l.backward(GY.astype(np.int64)), TypeError, ["grad_output", "int64"]),
    ("backward_list", _forward, lambda l: l.backward(GY.tolist()), TypeError, ["grad_output", "list"]),
    ("backward_none", _forward, lambda l: l.backward(None), TypeError, ["grad_output", "NoneType"]),
    ("failed_forward_after_forward", _forward, lambda l: l(randn(2, 5)), ValueError, ["input", "(2, 5)"]),
    ("load_state_dict_missing_key", None, lambda l: l.load_state_dict(_state(l, bias=None)), ValueError,
     ["missing", "bias"]),
    ("load_state_dict_unexpected_key", None, lambda l: l.load_state_dict(_state(l, scale=np.ones(3))), ValueError,
     ["unexpected", "scale"]),
    ("load_state_dict_misshaped", None, lambda l: l.load_state_dict(_state(l, weight=np.zeros((4, 3)))),
     ValueError, ["weight", "(3, 4)", "(4, 3)"]),
    ("load_state_dict_int", None, lambda l: l.load_state_dict(_state(l, weight=np.zeros((3, 4), np.int64))),
     TypeError, ["weight", "floating", "int64"]),
    ("load_state_dict_complex", None, lambda l: l.load_state_dict(_state(l, bias=np.zeros(3, complex))),
     TypeError, ["bias", "complex128"]),
    ("load_state_dict_list", None, lambda l: l.load_state_dict(_state(l, bias=[0.0] * 3)), TypeError,
     ["bias", "list"]),
    ("load_state_dict_none_value", None, lambda l: l.load_state_dict(_state(l, weight=None) | {"weight": None}),
     TypeError, ["weight", "NoneType"]),
    ("load_state_dict_none", None, lambda l: l.load_state_dict(None), TypeError, ["state_dict", "NoneType"]),
    ("memory_broadcast_input", _forward, lambda l: l(_big((HUGE, 4), X[0])), MemoryError, []),
]


@pytest.mark.parametrize("setup, bad, exc, ws", cases(LINEAR_BAD))
def test_linear_bad_input(setup, bad, exc, ws):
    _layer_case(_make_linear, setup, bad, exc, ws, _run_linear)


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


# Embedding(5, 3, float64): ids (2, 3), grad_output (2, 3, 3)
def _make_embedding():
    return Embedding(5, 3, dtype=np.float64)


def _run_embedding(layer):
    y = layer(EIDX)
    return (y, layer.backward(EGY))


def _emb_forward(layer):
    layer(EIDX)


def _emb_forward_backward(layer):
    layer(EIDX)
    layer.backward(EGY)


EMBEDDING_BAD = [
    ("index_negative", None, lambda e: e(np.array([[0, -1, 2]])), IndexError, ["input", "-1", "[0, 5)"]),
    ("index_equal_V", None, lambda e: e(np.array([0, 5])), IndexError, ["input", "5", "[0, 5)"]),
    ("index_far_above_V", None, lambda e: e(np.array([10 ** 12])), IndexError, ["input", str(10 ** 12), "[0, 5)"]),
    ("index_int8_negative", None, lambda e: e(np.array([-3], np.int8)), IndexError, ["input", "-3", "[0, 5)"]),
    ("index_huge_uint64", None, lambda e: e(np.array([2 ** 63], np.uint64)), IndexError,
     ["input", str(2 ** 63), "[0, 5)"]),
    ("index_float", None, lambda e: e(EIDX.astype(float)), TypeError, ["input", "integer", "float64"]),
    ("index_bool", None, lambda e: e(EIDX > 1), TypeError, ["input", "integer", "bool"]),
    ("index_complex", None, lambda e: e(EIDX.astype(complex)), TypeError, ["input", "complex128"]),
    ("index_object", None, lambda e: e(EIDX.astype(object)), TypeError, ["input", "object"]),
    ("index_list", None, lambda e: e(EIDX.tolist()), TypeError, ["input", "ndarray", "list"]),
    ("index_none", None, lambda e: e(None), TypeError, ["input", "NoneType"]),
    ("index_scalar", None, lambda e: e(2), TypeError, ["input", "int"]),
    ("backward_before_forward", None, lambda e: e.backward(EGY), ValueError, ["backward", "forward"]),
    ("backward_twice", _emb_forward_backward, lambda e: e.backward(EGY), ValueError, ["backward", "forward"]),
    ("backward_wrong_shape", _emb_forward, lambda e: e.backward(randn(2, 3, 4)), ValueError,
     ["grad_output", "(2, 3, 3)", "(2, 3, 4)"]),
    ("backward_same_size_other_shape", _emb_forward, lambda e: e.backward(randn(3, 2, 3)), ValueError,
     ["grad_output", "(2, 3, 3)", "(3, 2, 3)"]),
    ("backward_wrong_dtype", _emb_forward, lambda e: e.backward(EGY.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("backward_int", _emb_forward, lambda e: e.backward(EGY.astype(np.int64)), TypeError,
     ["grad_output", "int64"]),
    ("backward_list", _emb_forward, lambda e: e.backward(EGY.tolist()), TypeError, ["grad_output", "list"]),
    ("backward_none", _emb_forward, lambda e: e.backward(None), TypeError, ["grad_output", "NoneType"]),
    ("failed_forward_after_forward", _emb_forward, lambda e: e(np.array([7])), IndexError, ["input", "7"]),
    ("load_state_dict_missing_key", None, lambda e: e.load_state_dict({}), ValueError, ["missing", "weight"]),
    ("load_state_dict_unexpected_key", None, lambda e: e.load_state_dict(_state(e, bias=np.zeros(3))),
     ValueError, ["unexpected", "bias"]),
    ("load_state_dict_misshaped", None, lambda e: e.load_state_dict(_state(e, weight=np.zeros((3, 5)))),
     ValueError, ["weight", "(5, 3)", "(3, 5)"]),
    ("load_state_dict_int", None, lambda e: e.load_state_dict(_state(e, weight=np.zeros((5, 3), np.int64))),
     TypeError, ["weight", "floating", "int64"]),
    ("load_state_dict_list", None, lambda e: e.load_state_dict(_state(e, weight=[[0.0] * 3] * 5)), TypeError,
     ["weight", "list"]),
    ("memory_broadcast_index", _emb_forward, lambda e: e(_big((10 * HUGE,), np.int64(1))), MemoryError, []),
]


@pytest.mark.parametrize("setup, bad, exc, ws", cases(EMBEDDING_BAD))
def test_embedding_bad_input(setup, bad, exc, ws):
    _layer_case(_make_embedding, setup, bad, exc, ws, _run_embedding)


# Dropout(0.5): input (2, 4), grad_output (2, 4); seeded calls
DG = randn(2, 4, seed=41)


def _make_dropout():
    return Dropout(0.5)


def _run_dropout(layer):
    y = layer(DX, seed=5)
    return (y, layer.backward(DG))


def _drop_forward(layer):
    layer(DX, seed=3)


def _drop_forward_backward(layer):
    layer(DX, seed=3)
    layer.backward(DG)


DROPOUT_BAD = [
    ("input_none", None, lambda d: d(None), TypeError, ["input", "NoneType"]),
    ("input_list", None, lambda d: d(DX.tolist()), TypeError, ["input", "ndarray", "list"]),
    ("input_scalar", None, lambda d: d(1.0), TypeError, ["input", "float"]),
    ("input_int", None, lambda d: d(DX.astype(np.int64)), TypeError, ["input", "int64"]),
    ("input_bool", None, lambda d: d(DX > 0), TypeError, ["input", "bool"]),
    ("input_complex", None, lambda d: d(DX.astype(complex)), TypeError, ["input", "complex128"]),
    ("input_object", None, lambda d: d(DX.astype(object)), TypeError, ["input", "object"]),
    ("seed_str", None, lambda d: d(DX, seed="x"), TypeError, ["seed", "str"]),
    ("seed_float", None, lambda d: d(DX, seed=1.5), TypeError, ["seed", "float"]),
    ("backward_before_forward", None, lambda d: d.backward(DG), ValueError, ["backward", "forward"]),
    ("backward_twice", _drop_forward_backward, lambda d: d.backward(DG), ValueError, ["backward", "forward"]),
    ("backward_wrong_shape", _drop_forward, lambda d: d.backward(DG.T), ValueError,
     ["grad_output", "(2, 4)", "(4, 2)"]),
    ("backward_wrong_dtype", _drop_forward, lambda d: d.backward(DG.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("backward_list", _drop_forward, lambda d: d.backward(DG.tolist()), TypeError, ["grad_output", "list"]),
    ("backward_none", _drop_forward, lambda d: d.backward(None), TypeError, ["grad_output", "NoneType"]),
    ("failed_forward_after_forward", _drop_forward, lambda d: d(DX.astype(np.int32)), TypeError,
     ["input", "int32"]),
    ("load_state_dict_unexpected_key", None, lambda d: d.load_state_dict({"p": np.ones(1)}), ValueError,
     ["unexpected", "p"]),
    ("memory_broadcast_input", None, lambda d: d(_big((HUGE,), 1.0)), MemoryError, []),
]


@pytest.mark.parametrize("setup, bad, exc, ws", cases(DROPOUT_BAD))
def test_dropout_bad_input(setup, bad, exc, ws):
    _layer_case(_make_dropout, setup, bad, exc, ws, _run_dropout)


def test_dropout_backward_after_failed_forward():
    """A forward that fails (here: too large) leaves the previous forward's context to its backward."""
    layer = _make_dropout()
    layer(DX, seed=3)
    with pytest.raises(MemoryError):
        layer(_big((HUGE,), 1.0))
    assert layer.last_seed == 3
    np.testing.assert_array_equal(layer.backward(DG), AF.dropout_backward(DG, 0.5, 3))


# CrossEntropyLoss(): logits (3, 4), target (3,) with one ignored row
def _make_ce(**kw):
    return lambda: CrossEntropyLoss(**kw)


def _run_ce(layer):
    loss = layer(CL, np.where(CT == -100, layer.ignore_index, CT))
    return (loss, layer.backward(np.ones(loss.shape)))


def _ce_forward(layer):
    layer(CL, CT)


def _ce_forward_backward(layer):
    loss = layer(CL, CT)
    layer.backward(np.ones(loss.shape))


# id, layer config, setup, failing call, exception, words
CROSS_ENTROPY_LOSS_BAD = [
    ("target_negative", {}, None, lambda c: c(CL, np.array([0, -1, 1])), IndexError, ["target", "-1", "[0, 4)"]),
    ("target_equal_C", {}, None, lambda c: c(CL, np.array([0, 4, 1])), IndexError, ["target", "4", "[0, 4)"]),
    ("target_other_ignore_index", dict(ignore_index=-1), None, lambda c: c(CL, CT), IndexError,
     ["target", "-100", "[0, 4)"]),
    ("target_float", {}, None, lambda c: c(CL, CT.astype(float)), TypeError, ["target", "integer", "float64"]),
    ("target_list", {}, None, lambda c: c(CL, CT.tolist()), TypeError, ["target", "list"]),
    ("target_none", {}, None, lambda c: c(CL, None), TypeError, ["target", "NoneType"]),
    ("target_shape", {}, None, lambda c: c(CL, CT[:2]), ValueError, ["target", "(3,)", "(2,)"]),
    ("input_3d", {}, None, lambda c: c(CL[None], CT), ValueError, ["input", "(1, 3, 4)"]),
    ("input_int", {}, None, lambda c: c(CL.astype(np.int64), CT), TypeError, ["input", "int64"]),
    ("input_list", {}, None, lambda c: c(CL.tolist(), CT), TypeError, ["input", "list"]),
    ("backward_before_forward", {}, None, lambda c: c.backward(), ValueError, ["backward", "forward"]),
    ("backward_twice", {}, _ce_forward_backward, lambda c: c.backward(), ValueError, ["backward", "forward"]),
    ("backward_none", {}, _ce_forward, lambda c: c.backward(None), TypeError, ["grad_output", "NoneType"]),
    ("backward_str", {}, _ce_forward, lambda c: c.backward("1"), TypeError, ["grad_output", "str"]),
    ("backward_list", {}, _ce_forward, lambda c: c.backward([1.0]), TypeError, ["grad_output", "list"]),
    ("backward_complex", {}, _ce_forward, lambda c: c.backward(1j), TypeError, ["grad_output", "complex"]),
    ("backward_wrong_shape_mean", {}, _ce_forward, lambda c: c.backward(np.ones(3)), ValueError,
     ["grad_output", "()", "(3,)"]),
    ("backward_wrong_shape_none", dict(reduction="none"), _ce_forward, lambda c: c.backward(np.ones(2)),
     ValueError, ["grad_output", "(3,)", "(2,)"]),
    ("backward_scalar_for_none", dict(reduction="none"), _ce_forward, lambda c: c.backward(), ValueError,
     ["grad_output", "(3,)", "scalar"]),
    ("backward_wrong_dtype", {}, _ce_forward, lambda c: c.backward(np.ones((), np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("failed_forward_after_forward", {}, _ce_forward, lambda c: c(CL, CT[:2]), ValueError, ["target", "(2,)"]),
    ("load_state_dict_unexpected_key", {}, None, lambda c: c.load_state_dict({"weight": np.ones(4)}), ValueError,
     ["unexpected", "weight"]),
    ("memory_broadcast_input", {}, _ce_forward,
     lambda c: c(_big((10 * HUGE, 4), CL[0]), _big((10 * HUGE,), np.int64(1))), MemoryError, []),
]


@pytest.mark.parametrize("config, setup, bad, exc, ws", cases(CROSS_ENTROPY_LOSS_BAD))
def test_cross_entropy_loss_bad_input(config, setup, bad, exc, ws):
    _layer_case(_make_ce(**config), setup, bad, exc, ws, _run_ce)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_loss_correct_backward_after_wrong_one(reduction):
    """A backward refused for its grad_output does not consume the forward: a correct one still works."""
    layer = CrossEntropyLoss(reduction=reduction)
    loss = layer(CL, CT)
    with pytest.raises(ValueError, match="grad_output"):
        layer.backward(np.ones(loss.shape + (2,)))
    with pytest.raises(TypeError, match="grad_output"):
        layer.backward(None)
    g = np.ones(loss.shape)
    np.testing.assert_array_equal(layer.backward(g), AF.cross_entropy_backward(g, CL, CT, CSTATS,
                                                                               reduction=reduction))


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
    ("query_none", {}, None, lambda m: m(None, MK, MV), TypeError, ["query", "NoneType"]),
    ("key_none", {}, None, lambda m: m(MQ, None, MV), TypeError, ["key", "NoneType"]),
    ("value_list", {}, None, lambda m: m(MQ, MK, MV.tolist()), TypeError, ["value", "ndarray", "list"]),
    ("query_scalar", {}, None, lambda m: m(1.0, MK, MV), TypeError, ["query", "float"]),
    ("query_int", {}, None, lambda m: m(MQ.astype(np.int64), MK, MV), TypeError, ["query", "int64"]),
    ("query_bool", {}, None, lambda m: m(MQ > 0, MK, MV), TypeError, ["query", "bool"]),
    ("query_complex", {}, None, lambda m: m(MQ.astype(complex), MK, MV), TypeError, ["query", "complex128"]),
    ("query_object", {}, None, lambda m: m(MQ.astype(object), MK, MV), TypeError, ["query", "object"]),
    ("query_float16", {}, None, lambda m: m(MQ.astype(np.float16), MK, MV), TypeError, ["query", "float16"]),
    ("value_dtype", {}, None, lambda m: m(MQ, MK, MV.astype(np.float32)), TypeError,
     ["value", "float32", "float64"]),
    ("key_padding_mask_complex", {}, None, lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, S), complex)),
     TypeError, ["key_padding_mask", "complex128"]),
    ("key_padding_mask_object", {}, None, lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, S), object)),
     TypeError, ["key_padding_mask", "object"]),
    ("key_padding_mask_float16", {}, None,
     lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, S), np.float16)), TypeError,
     ["key_padding_mask", "float16"]),
    ("key_padding_mask_int", {}, None, lambda m: m(MQ, MK, MV, key_padding_mask=np.zeros((B, S), np.int64)),
     TypeError, ["key_padding_mask", "int64"]),
    ("key_padding_mask_list", {}, None, lambda m: m(MQ, MK, MV, key_padding_mask=BOOL_KPM.tolist()), TypeError,
     ["key_padding_mask", "list"]),
    ("key_padding_mask_unbatched", {}, None,
     lambda m: m(MQ[:, 0], MK[:, 0], MV[:, 0], key_padding_mask=np.zeros((1, S), bool)), ValueError,
     ["key_padding_mask", "(4,)", "(1, 4)"]),
    ("attn_mask_float32", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((L, S), np.float32)), TypeError,
     ["attn_mask", "float32", "float64"]),
    ("attn_mask_complex", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((L, S), complex)), TypeError,
     ["attn_mask", "complex128"]),
    ("attn_mask_object", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((L, S), object)), TypeError,
     ["attn_mask", "object"]),
    ("attn_mask_list", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros((L, S)).tolist()), TypeError,
     ["attn_mask", "list"]),
    ("attn_mask_1d", {}, None, lambda m: m(MQ, MK, MV, attn_mask=np.zeros(S, bool)), ValueError,
     ["attn_mask", "(3, 4)", "(4,)"]),
    ("attn_mask_unbatched_3d", {}, None,
     lambda m: m(MQ[:, 0], MK[:, 0], MV[:, 0], attn_mask=np.zeros((B * H, L, S), bool)), ValueError,
     ["attn_mask", "(2, 3, 4)", "(4, 3, 4)"]),
    ("seed_float", dict(dropout=0.2), None, lambda m: m(MQ, MK, MV, seed=1.5), TypeError, ["seed", "float"]),
    ("backward_none", {}, _mha_forward, lambda m: m.backward(None), TypeError, ["grad_output", "NoneType"]),
    ("backward_list", {}, _mha_forward, lambda m: m.backward(MG.tolist()), TypeError, ["grad_output", "list"]),
    ("backward_int", {}, _mha_forward, lambda m: m.backward(MG.astype(np.int64)), TypeError,
     ["grad_output", "int64"]),
    ("backward_batch_first_shape", {}, _mha_forward, lambda m: m.backward(MG.transpose(1, 0, 2)), ValueError,
     ["grad_output", "(3, 2, 6)", "(2, 3, 6)"]),
    ("load_state_dict_int", {}, None,
     lambda m: m.load_state_dict(_state(m, in_proj_weight=np.zeros((3 * E, E), np.int64))), TypeError,
     ["in_proj_weight", "floating", "int64"]),
    ("load_state_dict_complex", {}, None,
     lambda m: m.load_state_dict(_state(m, in_proj_bias=np.zeros(3 * E, complex))), TypeError,
     ["in_proj_bias", "complex128"]),
    ("load_state_dict_list", {}, None,
     lambda m: m.load_state_dict(_state(m, out_proj__bias=[0.0] * E)), TypeError, ["out_proj.bias", "list"]),
    ("load_state_dict_misshaped_kdim", dict(kdim=5, vdim=3), None,
     lambda m: m.load_state_dict(_state(m, k_proj_weight=np.zeros((E, E)))), ValueError,
     ["k_proj_weight", "(6, 5)", "(6, 6)"]),
    ("load_state_dict_fused_key_for_kdim", dict(kdim=5, vdim=3), None,
     lambda m: m.load_state_dict(_state(m, in_proj_weight=np.zeros((3 * E, E)))), ValueError,
     ["unexpected", "in_proj_weight"]),
    ("load_state_dict_none", {}, None, lambda m: m.load_state_dict(None), TypeError,
          ["state_dict", "NoneType"]),
    ("memory_broadcast_batch", {}, _mha_forward,
     lambda m: m(_big((L, HUGE, E), MQ[:, :1]), _big((S, HUGE, E), MK[:, :1]), _big((S, HUGE, E), MV[:, :1])),
     MemoryError, []),
]


@pytest.mark.parametrize("config, setup, bad, exc, ws", cases(MHA_BAD))
def test_multihead_attention_bad_input(config, setup, bad, exc, ws):
    _layer_case(_make_mha(**config), setup, bad, exc, ws, _run_mha, randomize=True)


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


# Attention(E=6, H=2, context_length=4, float64), batch first: x (B=2, L=3, E), context (2, S=4, kv_dim=5) for
# cross-attention (kv_dim=5 in the config), grad_output (2, 3, 6)
AX = randn(2, 3, 6, seed=90)
AC = randn(2, 4, 5, seed=91)
AG = randn(2, 3, 6, seed=92)


def _make_attention(**kw):
    return lambda: Attention(6, 2, context_length=4, dtype=np.float64, **kw)


def _attention_inputs(layer):
    return (AX,) if layer.kv_dim == layer.embed_dim else (AX, AC)


def _run_attention(layer):
    out, w = layer(*_attention_inputs(layer), need_weights=True, seed=7)
    grads = layer.backward(AG)
    return (out, w) + (grads if isinstance(grads, tuple) else (grads,))


def _att_forward(layer):
    layer(*_attention_inputs(layer), seed=7)


def _att_forward_backward(layer):
    layer(*_attention_inputs(layer), seed=7)
    layer.backward(AG)


CROSS = dict(kv_dim=5)
CAUSAL = dict(causal=True)


def _filled_cache(layer, n):
    """A KV cache of ``layer`` (max_length 4) already holding n tokens per sequence."""
    cache = layer.init_kv_cache(2, 4)
    cache.lengths[:] = n
    return cache
HEADS_Q, HEADS_KV = [randn(6, 3, seed=93)] * 2, [randn(5, 3, seed=94)] * 2  # (in, d) per head, kv_dim=5

# id, layer config, setup, failing call, exception, words
ATTENTION_BAD = [
    ("x_width", {}, None, lambda a: a(AX[..., :5]), ValueError, ["x", "embed_dim=6", "(2, 3, 5)"]),
    ("x_1d", {}, None, lambda a: a(AX[0, 0]), ValueError, ["x", "(6,)"]),
    ("x_4d", {}, None, lambda a: a(AX[None]), ValueError, ["x", "(1, 2, 3, 6)"]),
    ("x_0d", {}, None, lambda a: a(np.array(1.0)), ValueError, ["x", "()"]),
    ("x_float32", {}, None, lambda a: a(AX.astype(np.float32)), TypeError, ["x", "float32", "float64"]),
    ("x_int", {}, None, lambda a: a(AX.astype(np.int64)), TypeError, ["x", "int64"]),
    ("x_bool", {}, None, lambda a: a(AX > 0), TypeError, ["x", "bool"]),
    ("x_complex", {}, None, lambda a: a(AX.astype(complex)), TypeError, ["x", "complex128"]),
    ("x_object", {}, None, lambda a: a(AX.astype(object)), TypeError, ["x", "object"]),
    ("x_float16", {}, None, lambda a: a(AX.astype(np.float16)), TypeError, ["x", "float16"]),
    ("x_list", {}, None, lambda a: a(AX.tolist()), TypeError, ["x", "ndarray", "list"]),
    ("x_none", {}, None, lambda a: a(None), TypeError, ["x", "NoneType"]),
    ("x_scalar", {}, None, lambda a: a(1.0), TypeError, ["x", "float"]),
    ("context_required", CROSS, None, lambda a: a(AX), ValueError, ["context", "kv_dim=5", "embed_dim=6"]),
    ("context_width", CROSS, None, lambda a: a(AX, AX), ValueError, ["context", "kv_dim=5", "(2, 3, 6)"]),
    ("context_unbatched_for_batched_x", CROSS, None, lambda a: a(AX, AC[0]), ValueError, ["context", "(4, 5)"]),
    ("context_batch_mismatch", CROSS, None, lambda a: a(AX, randn(3, 4, 5)), ValueError,
     ["x", "context", "batch", "(2, 3, 6)", "(3, 4, 5)"]),
    ("context_float32", CROSS, None, lambda a: a(AX, AC.astype(np.float32)), TypeError,
     ["context", "float32", "float64"]),
    ("context_int", CROSS, None, lambda a: a(AX, AC.astype(np.int64)), TypeError, ["context", "int64"]),
    ("context_list", CROSS, None, lambda a: a(AX, AC.tolist()), TypeError, ["context", "list"]),
    ("x_longer_than_context_length", {}, None, lambda a: a(randn(2, 5, 6)), ValueError,
     ["context_length=4", "(2, 5, 6)"]),
    ("context_longer_than_context_length", CROSS, None, lambda a: a(AX, randn(2, 5, 5)), ValueError,
     ["context_length=4", "(2, 5, 5)"]),
    ("unbatched_longer_than_context_length", {}, None, lambda a: a(randn(5, 6)), ValueError,
     ["context_length=4", "(5, 6)"]),
    ("key_padding_mask_shape", {}, None, lambda a: a(AX, key_padding_mask=np.zeros((2, 4), bool)), ValueError,
     ["key_padding_mask", "(2, 3)", "(2, 4)"]),
    ("key_padding_mask_transposed", CROSS, None, lambda a: a(AX, AC, key_padding_mask=np.zeros((4, 2), bool)),
     ValueError, ["key_padding_mask", "(2, 4)", "(4, 2)"]),
    ("key_padding_mask_unbatched", {}, None, lambda a: a(AX[0], key_padding_mask=np.zeros((1, 3), bool)),
     ValueError, ["key_padding_mask", "(3,)", "(1, 3)"]),
    ("key_padding_mask_int", {}, None, lambda a: a(AX, key_padding_mask=np.zeros((2, 3), np.int64)), TypeError,
     ["key_padding_mask", "int64"]),
    ("key_padding_mask_float32", {}, None, lambda a: a(AX, key_padding_mask=np.zeros((2, 3), np.float32)),
     TypeError, ["key_padding_mask", "float32", "float64"]),
    ("key_padding_mask_complex", {}, None, lambda a: a(AX, key_padding_mask=np.zeros((2, 3), complex)),
     TypeError, ["key_padding_mask", "complex128"]),
    ("key_padding_mask_object", {}, None, lambda a: a(AX, key_padding_mask=np.zeros((2, 3), object)), TypeError,
     ["key_padding_mask", "object"]),
    ("key_padding_mask_list", {}, None, lambda a: a(AX, key_padding_mask=[[False] * 3] * 2), TypeError,
     ["key_padding_mask", "list"]),
    ("seed_str", dict(attn_dropout=0.2), None, lambda a: a(AX, seed="x"), TypeError, ["seed", "str"]),
    ("seed_float", dict(out_dropout=0.2), None, lambda a: a(AX, seed=1.5), TypeError, ["seed", "float"]),
    ("backward_before_forward", {}, None, lambda a: a.backward(AG), ValueError, ["backward", "forward"]),
    ("backward_twice", {}, _att_forward_backward, lambda a: a.backward(AG), ValueError, ["backward", "forward"]),
    ("backward_twice_dropout", dict(attn_dropout=0.2, out_dropout=0.2), _att_forward_backward,
     lambda a: a.backward(AG), ValueError, ["backward", "forward"]),
    ("backward_wrong_shape", {}, _att_forward, lambda a: a.backward(AG[..., :5]), ValueError,
     ["grad_output", "(2, 3, 6)", "(2, 3, 5)"]),
    ("backward_unbatched_shape", {}, _att_forward, lambda a: a.backward(AG[0]), ValueError,
     ["grad_output", "(2, 3, 6)", "(3, 6)"]),
    ("backward_wrong_dtype", {}, _att_forward, lambda a: a.backward(AG.astype(np.float32)), TypeError,
     ["grad_output", "float32", "float64"]),
    ("backward_int", {}, _att_forward, lambda a: a.backward(AG.astype(np.int64)), TypeError,
     ["grad_output", "int64"]),
    ("backward_list", {}, _att_forward, lambda a: a.backward(AG.tolist()), TypeError, ["grad_output", "list"]),
    ("backward_none", {}, _att_forward, lambda a: a.backward(None), TypeError, ["grad_output", "NoneType"]),
    ("failed_forward_after_forward", CROSS, _att_forward, lambda a: a(AX, randn(2, 5, 5)), ValueError,
     ["context_length=4"]),
    ("load_projections_q_shape", {}, None, lambda a: a.load_projections(q=np.zeros((6, 5))), ValueError,
     ["q", "(6, 6)", "(6, 5)"]),
    ("load_projections_k_matmul_shape", CROSS, None, lambda a: a.load_projections(k=np.zeros((6, 5)),
                                                                                   layout="matmul"),
     ValueError, ["k", "(5, 6)", "(6, 5)", "matmul"]),
    ("load_projections_bias_shape", {}, None, lambda a: a.load_projections(q_bias=np.zeros(5)), ValueError,
     ["q_bias", "(6,)", "(5,)"]),
    ("load_projections_absent_bias", dict(bias=False), None, lambda a: a.load_projections(q_bias=np.zeros(6)),
     ValueError, ["q_bias", "no such parameter"]),
    ("load_projections_absent_out", dict(out_proj=False), None, lambda a: a.load_projections(out=np.eye(6)),
     ValueError, ["out", "no such parameter"]),
    ("load_projections_int", {}, None, lambda a: a.load_projections(q=np.zeros((6, 6), np.int64)), TypeError,
     ["q", "floating", "int64"]),
    ("load_projections_complex", {}, None, lambda a: a.load_projections(v=np.zeros((6, 6), complex)), TypeError,
     ["v", "complex128"]),
    ("load_projections_list", {}, None, lambda a: a.load_projections(q=np.eye(6).tolist()), TypeError,
     ["q", "list"]),
    ("load_projections_layout", {}, None, lambda a: a.load_projections(q=np.eye(6), layout="rows"), ValueError,
     ["layout", "'rows'"]),
    ("load_projections_second_bad", {}, None, lambda a: a.load_projections(q=np.eye(6), k=np.zeros((5, 6))),
     ValueError, ["k", "(6, 6)", "(5, 6)"]),
    ("load_fused_qkv_rows", {}, None, lambda a: a.load_fused_qkv(np.zeros((17, 6))), ValueError,
     ["Wqkv", "(18, 6)", "(17, 6)"]),
    ("load_fused_qkv_cols", {}, None, lambda a: a.load_fused_qkv(np.zeros((18, 5))), ValueError,
     ["Wqkv", "(18, 6)", "(18, 5)"]),
    ("load_fused_qkv_1d", {}, None, lambda a: a.load_fused_qkv(np.zeros(18)), ValueError,
     ["Wqkv", "(18, 6)", "(18,)"]),
    ("load_fused_qkv_bias_shape", {}, None, lambda a: a.load_fused_qkv(np.zeros((18, 6)), np.zeros(17)),
     ValueError, ["Wqkv bias", "(18,)", "(17,)"]),
    ("load_fused_qkv_absent_bias", dict(bias=False), None,
     lambda a: a.load_fused_qkv(np.zeros((18, 6)), np.zeros(18)), ValueError, ["Wqkv bias", "no such parameter"]),
    ("load_fused_qkv_kv_dim", CROSS, None, lambda a: a.load_fused_qkv(np.zeros((18, 6))), ValueError,
     ["Wqkv", "embed_dim=6", "kv_dim=5"]),
    ("load_fused_qkv_int", {}, None, lambda a: a.load_fused_qkv(np.zeros((18, 6), np.int64)), TypeError,
     ["Wqkv", "int64"]),
    ("load_fused_qkv_none", {}, None, lambda a: a.load_fused_qkv(None), TypeError, ["Wqkv", "NoneType"]),
    ("load_fused_qkv_list", {}, None, lambda a: a.load_fused_qkv([[0.0] * 6] * 18), TypeError, ["Wqkv", "list"]),
    ("load_fused_qkv_bias_list", {}, None, lambda a: a.load_fused_qkv(np.zeros((18, 6)), [0.0] * 18), TypeError,
     ["Wqkv bias", "list"]),
    ("load_fused_kv_shape", CROSS, None, lambda a: a.load_fused_kv(np.zeros((12, 6))), ValueError,
     ["Wkv", "(12, 5)", "(12, 6)"]),
    ("load_fused_kv_bias_shape", CROSS, None, lambda a: a.load_fused_kv(np.zeros((12, 5)), np.zeros(6)),
     ValueError, ["Wkv bias", "(12,)", "(6,)"]),
    ("load_heads_count", CROSS, None, lambda a: a.load_heads(HEADS_Q[:1], HEADS_KV, HEADS_KV), ValueError,
     ["q", "2 heads", "1"]),
    ("load_heads_none", CROSS, None, lambda a: a.load_heads(None, HEADS_KV, HEADS_KV), TypeError,
     ["q", "NoneType"]),
    ("load_heads_mismatched", CROSS, None,
     lambda a: a.load_heads([HEADS_Q[0], HEADS_Q[0][:, :2]], HEADS_KV, HEADS_KV), ValueError,
     ["q", "(6, 3)", "(6, 2)"]),
    ("load_heads_1d", CROSS, None, lambda a: a.load_heads([np.zeros(3)] * 2, HEADS_KV, HEADS_KV), ValueError,
     ["q", "(6, 3)", "(3,)"]),
    ("load_heads_wrong_in_width", CROSS, None, lambda a: a.load_heads(HEADS_Q, HEADS_Q, HEADS_KV), ValueError,
     ["k", "(5, 3)", "(6, 3)"]),
    ("load_heads_linear_layout", CROSS, None,
     lambda a: a.load_heads(HEADS_Q, HEADS_KV, HEADS_KV, layout="linear"), ValueError, ["q", "(3, 6)", "(6, 3)"]),
    ("load_heads_int", CROSS, None, lambda a: a.load_heads(HEADS_Q, HEADS_KV, [np.zeros((5, 3), np.int64)] * 2),
     TypeError, ["v", "int64"]),
    ("load_heads_list", CROSS, None, lambda a: a.load_heads([h.tolist() for h in HEADS_Q], HEADS_KV, HEADS_KV),
     TypeError, ["q", "list"]),
    ("load_heads_layout", CROSS, None, lambda a: a.load_heads(HEADS_Q, HEADS_KV, HEADS_KV, layout="x"),
     ValueError, ["layout", "'x'"]),
    ("load_state_dict_missing_key", {}, None, lambda a: a.load_state_dict(_state(a, out_proj__bias=None)),
     ValueError, ["missing", "out_proj.bias"]),
    ("load_state_dict_unexpected_key", {}, None,
     lambda a: a.load_state_dict(_state(a, in_proj_weight=np.zeros((18, 6)))), ValueError,
     ["unexpected", "in_proj_weight"]),
    ("load_state_dict_misshaped", {}, None,
     lambda a: a.load_state_dict(_state(a, q_proj__weight=np.zeros((6, 5)))), ValueError,
     ["q_proj.weight", "(6, 6)", "(6, 5)"]),
    ("load_state_dict_int", {}, None,
     lambda a: a.load_state_dict(_state(a, k_proj__weight=np.zeros((6, 6), np.int64))), TypeError,
     ["k_proj.weight", "floating", "int64"]),
    ("load_state_dict_list", {}, None, lambda a: a.load_state_dict(_state(a, v_proj__bias=[0.0] * 6)), TypeError,
     ["v_proj.bias", "list"]),
    ("load_state_dict_none", {}, None, lambda a: a.load_state_dict(None), TypeError,
          ["state_dict", "NoneType"]),
    ("memory_broadcast_batch", {}, _att_forward, lambda a: a(_big((HUGE, 3, 6), AX[0])), MemoryError, []),
    ("kv_cache_not_causal", {}, None, lambda a: a(AX, kv_cache=KVCache(2, 2, 4, 3, dtype=np.float64)), ValueError,
     ["kv_cache", "causal=True", "causal=False"]),
    ("kv_cache_cross", dict(causal=True, **CROSS), None, lambda a: a(AX, kv_cache=KVCache(2, 2, 4, 3)),
     ValueError, ["kv_cache", "self-attention", "kv_dim=5"]),
    ("kv_cache_context", CAUSAL, None, lambda a: a(AX, AX, kv_cache=a.init_kv_cache(2, 4)), ValueError,
     ["kv_cache", "context", "None"]),
    ("kv_cache_key_padding_mask", CAUSAL, None,
     lambda a: a(AX, key_padding_mask=np.zeros((2, 3), bool), kv_cache=a.init_kv_cache(2, 4)), ValueError,
     ["kv_cache", "key_padding_mask"]),
    ("kv_cache_need_weights", CAUSAL, None, lambda a: a(AX, need_weights=True, kv_cache=a.init_kv_cache(2, 4)),
     ValueError, ["kv_cache", "need_weights"]),
    ("kv_cache_dropout", dict(causal=True, attn_dropout=0.2), None, lambda a: a(AX, kv_cache=a.init_kv_cache(2, 4)),
     ValueError, ["kv_cache", "dropout", "training", "eval()"]),
    ("kv_cache_type", CAUSAL, None, lambda a: a(AX, kv_cache={}), TypeError, ["kv_cache", "KVCache", "dict"]),
    ("kv_cache_batch", CAUSAL, None, lambda a: a(AX, kv_cache=a.init_kv_cache(3, 4)), ValueError,
     ["x", "(3, L_new, 6)", "(2, 3, 6)"]),
    ("kv_cache_unbatched_x", CAUSAL, None, lambda a: a(AX[0], kv_cache=a.init_kv_cache(2, 4)), ValueError,
     ["x", "3", "(3, 6)"]),
    ("kv_cache_x_float32", CAUSAL, None, lambda a: a(AX.astype(np.float32), kv_cache=a.init_kv_cache(2, 4)),
     TypeError, ["x", "float32", "float64"]),
    ("kv_cache_dtype", CAUSAL, None, lambda a: a(AX, kv_cache=KVCache(2, 2, 4, 3)), TypeError,
     ["kv_cache", "float64", "float32"]),
    ("kv_cache_half_under_float64", CAUSAL, None, lambda a: a.init_kv_cache(2, 4, dtype=np.float16), TypeError,
     ["dtype", "float64", "float16"]),
    ("kv_cache_heads", CAUSAL, None, lambda a: a(AX, kv_cache=KVCache(2, 3, 4, 2, dtype=np.float64)), ValueError,
     ["kv_cache", "(2, 2, 4, 3)", "(2, 3, 4, 2)"]),
    ("kv_cache_full", CAUSAL, None, lambda a: a(AX, kv_cache=_filled_cache(a, 2)), ValueError,
     ["kv_cache", "no room for 3 more tokens", "[2, 2]", "max_length=4"]),
    ("init_kv_cache_too_long", CAUSAL, None, lambda a: a.init_kv_cache(2, 5), ValueError,
     ["max_length=5", "context_length=4"]),
    ("init_kv_cache_not_causal", {}, None, lambda a: a.init_kv_cache(2, 4), ValueError, ["causal=True"]),
    ("init_kv_cache_batch_zero", CAUSAL, None, lambda a: a.init_kv_cache(0, 4), ValueError, ["batch_size", "0"]),
    ("init_kv_cache_max_length_str", CAUSAL, None, lambda a: a.init_kv_cache(2, "4"), TypeError,
     ["max_length", "int", "str"]),
]


@pytest.mark.parametrize("config, setup, bad, exc, ws", cases(ATTENTION_BAD))
def test_attention_bad_input(config, setup, bad, exc, ws):
    _layer_case(_make_attention(**config), setup, bad, exc, ws, _run_attention, randomize=True)


@pytest.mark.parametrize("config", [{}, CROSS, dict(attn_dropout=0.2, out_dropout=0.3)], ids=["self", "cross",
                                                                                                "dropout"])
def test_attention_correct_backward_after_wrong_one(config):
    """A refused backward, or a refused forward in between, leaves the forward's context: the backward is right."""
    make = _make_attention(**config)
    attnpp.manual_seed(0)
    layer, fresh = make(), make()
    fresh.load_state_dict(layer.state_dict())
    for m in (layer, fresh):
        m.zero_grad()
    out = layer(*_attention_inputs(layer), seed=11)
    with pytest.raises(ValueError, match=words("grad_output", "(2, 3, 6)", "(3, 2, 6)")):
        layer.backward(np.ascontiguousarray(AG.transpose(1, 0, 2)))
    with pytest.raises(ValueError, match="context_length"):
        layer(randn(2, 5, 6), *(_attention_inputs(layer)[1:]))
    with pytest.raises(TypeError, match=words("grad_output", "float32")):
        layer.backward(AG.astype(np.float32))
    grads = layer.backward(AG)
    ref_out = fresh(*_attention_inputs(fresh), seed=11)
    ref = fresh.backward(AG)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    for a, b in zip(grads if isinstance(grads, tuple) else (grads,), ref if isinstance(ref, tuple) else (ref,)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for (name, p), (_, q) in zip(layer.named_parameters(), fresh.named_parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14, err_msg=name)
