"""Rotary position embeddings (attnpp.functional.rotary_embedding, its backward and rotary_tables) against
independent PyTorch references written from the math, finite differences, properties and bad input.

References (PyTorch, autograd for the gradients, taken with ``(out * grad_out).sum().backward()``):
- half-split (``interleaved=False``): Hugging Face's Llama, ``x * cos + rotate_half(x) * sin`` with cos and sin
  repeated twice along the features;
- interleaved (``interleaved=True``): Meta's Llama ``apply_rotary_emb``, the pairs as complex numbers
  (``torch.view_as_complex``) times ``cos + i sin``.
Both rotate the first R = 2 * cos.shape[-1] features and pass the others through, as FlashAttention's
``apply_rotary_emb`` does. Tolerances: helpers' TOL (float64 1e-10, float32 1e-5, relative to max(1, |ref|)).

Shape letters: B batch, H heads, L sequence length, D head width, P positions of the tables, R rotary_dim.
"""
import re

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import attnpp
import attnpp.functional as AF
from attnpp import _core
from helpers import DTYPES, HYPOTHESIS_EXAMPLES, TOL, assert_close, examples, max_rel_err


# ------------------------------------------------------------------------------------------- PyTorch references
def rotate_half(x):
    """Hugging Face transformers' rotate_half (modeling_llama): (x1, x2) -> (-x2, x1) on the two halves."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def torch_rotary(x, cos, sin, interleaved, offsets):
    """RoPE of x (..., L, D) in PyTorch: the first R = 2 * cos.shape[-1] features rotated, the rest passed.

    cos, sin: (P, R/2) tensors; offsets: an int, or a (B,) int64 tensor for x (B, H, L, D)."""
    L = x.shape[-2]
    R = 2 * cos.shape[-1]
    if isinstance(offsets, int):
        pos = offsets + torch.arange(L)                        # (L,)
        c, s = cos[pos], sin[pos]                              # (L, R/2)
    else:
        pos = offsets[:, None] + torch.arange(L)[None, :]      # (B, L)
        c, s = cos[pos][:, None], sin[pos][:, None]            # (B, 1, L, R/2)
    x_rot, x_pass = x[..., :R], x[..., R:]
    if interleaved:  # Meta's Llama: pairs (2d, 2d + 1) as complex numbers times e^(i angle)
        xc = torch.view_as_complex(x_rot.contiguous().reshape(*x_rot.shape[:-1], R // 2, 2))
        out = torch.view_as_real(xc * torch.complex(c, s)).flatten(-2)
    else:  # Hugging Face's Llama: cos and sin repeated over both halves
        c2, s2 = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        out = x_rot * c2 + rotate_half(x_rot) * s2
    return torch.cat((out, x_pass), dim=-1)


def torch_reference(x, cos, sin, grad_out, interleaved, offsets):
    """PyTorch's output and input gradient of RoPE (autograd), as ndarrays of x's dtype."""
    tx = torch.tensor(x, requires_grad=True)
    toff = offsets if isinstance(offsets, int) else torch.tensor(np.asarray(offsets, np.int64))
    out = torch_rotary(tx, torch.tensor(cos), torch.tensor(sin), interleaved, toff)
    (out * torch.tensor(grad_out)).sum().backward()
    return out.detach().numpy(), tx.grad.numpy()


def tables(rng, P, R, dtype, kind):
    """cos, sin (P, R/2): attnpp.rotary_tables' angles ("angles"), or independent random values ("random":
    the formula holds for any cos and sin, and a swapped or mis-indexed table shows at once)."""
    if kind == "angles":
        return AF.rotary_tables(P, R, base=10000.0, dtype=dtype) if R else (np.zeros((P, 0), dtype),) * 2
    return tuple(rng.standard_normal((P, R // 2)).astype(dtype) for _ in range(2))


def check_parity(rng, dtype, shape, R, interleaved, offset, P=None, kind="random", layout="C"):
    """attnpp's forward and backward against PyTorch on x of ``shape``; returns (out, grad_input)."""
    L = shape[-2]
    if P is None:
        P = int(np.max(np.asarray(offset), initial=0)) + L + 3
    cos, sin = tables(rng, P, R, dtype, kind)
    x = rng.standard_normal(shape).astype(dtype)
    g = rng.standard_normal(shape).astype(dtype)
    xin, gin = x, g
    if layout == "transposed" and len(shape) == 4:  # (B, L, H, D) seen as (B, H, L, D), as after a projection
        xin = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        gin = np.ascontiguousarray(g.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kw = dict(interleaved=interleaved, position_offset=offset)
    out = AF.rotary_embedding(xin, cos, sin, **kw)
    grad = AF.rotary_embedding_backward(gin, cos, sin, **kw)
    ref_out, ref_grad = torch_reference(x, cos, sin, g, interleaved, offset)
    for name, ours, ref in (("output", out, ref_out), ("grad_input", grad, ref_grad)):
        assert ours.dtype == dtype and ours.shape == x.shape, name
        assert_close(ours, ref, dtype, f"{name} ({'interleaved' if interleaved else 'half-split'})")
    # the features past R pass through exactly
    np.testing.assert_array_equal(out[..., R:], x[..., R:])
    np.testing.assert_array_equal(grad[..., R:], g[..., R:])
    return out, grad


# ------------------------------------------------------------------------------------------------------ parity
SHAPES = [  # (input shape, R)
    ((2, 3, 7, 8), 8),        # R = D
    ((2, 3, 7, 8), 4),        # R < D
    ((2, 3, 7, 10), 6),       # R < D, D not a multiple of 4
    ((1, 2, 33, 64), 64),     # a common head width
    ((2, 2, 5, 128), 32),     # a partial rotary dim (GPT-J, GPT-NeoX rotary_pct)
    ((6, 8), 8),              # unbatched (L, D)
    ((6, 9), 4),              # unbatched, D odd
    ((3, 5, 4), 2),           # (H, L, D)
    ((2, 2, 2, 5, 6), 6),     # two leading batch dimensions
    ((1, 1, 1, 2), 2),        # one token, one pair
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,R", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0, 5])
def test_parity_scalar_offset(rng, dtype, interleaved, shape, R, offset):
    check_parity(rng, dtype, shape, R, interleaved, offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("R", [8, 4])
def test_parity_per_sequence_offsets(rng, dtype, interleaved, R):
    """One offset per sequence (KV-cache decoding with sequences of different lengths), int64 and other integer
    dtypes, and a tensor of offsets."""
    for offsets in (np.array([0, 3, 11], np.int64), np.array([7, 0, 2], np.int32), np.array([4, 4, 4], np.uint8),
                    torch.tensor([1, 9, 0])):
        off = np.asarray(offsets)
        check_parity(rng, dtype, (3, 2, 5, 8), R, interleaved, offsets, P=int(off.max()) + 5)
        # each sequence is what the scalar offset gives for it alone
        x = rng.standard_normal((3, 2, 5, 8)).astype(dtype)
        cos, sin = tables(rng, int(off.max()) + 5, R, dtype, "random")
        out = AF.rotary_embedding(x, cos, sin, interleaved=interleaved, position_offset=offsets)
        for b in range(3):
            np.testing.assert_array_equal(out[b], AF.rotary_embedding(x[b], cos, sin, interleaved=interleaved,
                                                                      position_offset=int(off[b])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_parity_real_tables_long(rng, dtype, interleaved):
    """The tables of rotary_tables over 4096 positions (large angles), a strided (B, L, H, D) -> (B, H, L, D)
    input, enough rows for the threads (1 << 17 elements and more)."""
    check_parity(rng, dtype, (2, 4, 300, 64), 64, interleaved, 3700, P=4096, kind="angles", layout="transposed")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tensor_inputs(rng, dtype):
    """CPU tensors go in through __dlpack__, as elsewhere in attnpp.functional."""
    x = rng.standard_normal((2, 3, 4, 8)).astype(dtype)
    cos, sin = AF.rotary_tables(16, 8, dtype=dtype)
    ours = AF.rotary_embedding(torch.tensor(x), torch.tensor(cos), torch.tensor(sin), position_offset=2)
    np.testing.assert_array_equal(ours, AF.rotary_embedding(x, cos, sin, position_offset=2))
    for offset in (np.int32(2), np.array(2, np.uint8), torch.tensor(2)):  # scalars of other kinds: the same
        np.testing.assert_array_equal(AF.rotary_embedding(x, cos, sin, position_offset=offset), ours)


@pytest.mark.parametrize("shape,R", [((0, 2, 3, 4), 4), ((2, 0, 3, 4), 4), ((2, 2, 0, 4), 4), ((2, 2, 3, 0), 0),
                                     ((2, 2, 3, 4), 0), ((0, 4), 2)], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_empty_and_zero_rotary_dim(rng, shape, R, interleaved):
    """Zero sizes give empty results; R = 0 (cos, sin (P, 0)) is the identity."""
    check_parity(rng, np.float64, shape, R, interleaved, 1)


# ------------------------------------------------------------------------------------------------ the tables
@pytest.mark.parametrize("R,base", [(2, 10000.0), (64, 10000.0), (128, 500000.0), (6, 10.0), (8, 1.0)])
def test_tables(R, base):
    """angle[p, d] = p * base ** (-2d / R) in float64, as PyTorch computes it; float32: those values rounded."""
    P = 4096
    inv_freq = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    angle = torch.outer(torch.arange(P, dtype=torch.float64), inv_freq)
    cos, sin = AF.rotary_tables(P, R, base=base, dtype=np.float64)
    assert cos.shape == sin.shape == (P, R // 2) and cos.dtype == sin.dtype == np.float64
    # NumPy's and PyTorch's pow differ in the last bit of some frequencies: the angles by up to P ulps of 1
    for ours, ref in ((cos, torch.cos(angle)), (sin, torch.sin(angle))):
        assert max_rel_err(ours, ref.numpy()) <= 2 * P * 2.0**-52
    cos32, sin32 = AF.rotary_tables(P, R, base=base, dtype=np.float32)
    assert cos32.dtype == sin32.dtype == np.float32
    np.testing.assert_array_equal(cos32, cos.astype(np.float32))
    np.testing.assert_array_equal(sin32, sin.astype(np.float32))
    assert AF.rotary_tables(0, 4)[0].shape == (0, 2)
    assert AF.rotary_tables(3, 4)[0].dtype == np.float32  # the default dtype


# ------------------------------------------------------------------------------------------------- gradients
class RotaryFunction(torch.autograd.Function):
    """attnpp's forward and hand-written backward as a torch Function, for torch.autograd.gradcheck."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, offset):
        ctx.args = (cos.numpy(), sin.numpy(), interleaved, offset)
        return torch.from_numpy(AF.rotary_embedding(x.detach().numpy(), *ctx.args[:2], interleaved=interleaved,
                                                    position_offset=offset))

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin, interleaved, offset = ctx.args
        grad = AF.rotary_embedding_backward(grad_out.numpy(), cos, sin, interleaved=interleaved,
                                            position_offset=offset)
        return torch.from_numpy(grad), None, None, None, None


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,R,offset", [((2, 2, 3, 6), 4, 2), ((4, 6), 6, 0),
                                            ((2, 1, 3, 4), 4, np.array([3, 0]))], ids=str)
def test_gradcheck(rng, interleaved, shape, R, offset):
    """Finite differences of attnpp's own forward against its backward, float64 (torch.autograd.gradcheck)."""
    cos, sin = (torch.tensor(t) for t in tables(rng, 8, R, np.float64, "random"))
    x = torch.tensor(rng.standard_normal(shape), requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: RotaryFunction.apply(t, cos, sin, interleaved, offset), (x,),
                                    eps=1e-6, atol=1e-8, rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_inverts_forward(rng, dtype, interleaved):
    """With true cos and sin (cos^2 + sin^2 = 1) the backward is the inverse rotation, and norms are kept."""
    cos, sin = AF.rotary_tables(64, 6, dtype=dtype)
    x = rng.standard_normal((2, 3, 40, 8)).astype(dtype)
    out = AF.rotary_embedding(x, cos, sin, interleaved=interleaved, position_offset=20)
    back = AF.rotary_embedding_backward(out, cos, sin, interleaved=interleaved, position_offset=20)
    assert max_rel_err(back, x) <= TOL[dtype]
    assert max_rel_err(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1)) <= TOL[dtype]


def test_same_result_on_any_thread_count(rng):
    x = rng.standard_normal((4, 8, 256, 64)).astype(np.float32)   # 1 << 19 elements: run on the threads
    cos, sin = AF.rotary_tables(300, 48)
    before = attnpp.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            attnpp.set_num_threads(n)
            results.append((AF.rotary_embedding(x, cos, sin, position_offset=7),
                            AF.rotary_embedding_backward(x, cos, sin, position_offset=7)))
    finally:
        attnpp.set_num_threads(before)
    for out, grad in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(grad, results[0][1])


# ------------------------------------------------------------------------------------------------- properties
@st.composite
def rotary_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.sampled_from([2, 3, 4, 4, 4, 5]))
    L = draw(st.integers(0, 40))
    D = draw(st.integers(0, 40))
    R = 2 * draw(st.integers(0, D // 2))
    lead = tuple(draw(st.integers(0, 3)) for _ in range(ndim - 2))
    shape = lead + (L, D)
    if ndim == 4 and draw(st.booleans()):
        offset = np.array([draw(st.integers(0, 60)) for _ in range(shape[0])], np.int64)
    else:
        offset = draw(st.integers(0, 60))
    extra = draw(st.integers(0, 5))
    interleaved = draw(st.booleans())
    layout = draw(st.sampled_from(["C", "transposed"]))
    seed = draw(st.integers(0, 2**32 - 1))
    note(f"dtype={dtype} shape={shape} R={R} offset={offset} extra positions={extra} interleaved={interleaved} "
         f"layout={layout} seed={seed}")
    return dtype, shape, R, offset, extra, interleaved, layout, seed


@settings(max_examples=examples(150))
@given(rotary_cases(), st.sampled_from(["random", "angles"]))
def test_property_parity(case, kind):
    """Random shapes, rotary dims, offsets (scalar and per sequence), layouts and dtypes against PyTorch."""
    HYPOTHESIS_EXAMPLES["test_property_parity"] += 1
    dtype, shape, R, offset, extra, interleaved, layout, seed = case
    L = shape[-2]
    top = int(np.max(offset, initial=0))
    check_parity(np.random.default_rng(seed), dtype, shape, R, interleaved, offset, P=top + L + extra,
                 kind=kind if R else "random", layout=layout)


@settings(max_examples=examples(60))
@given(st.sampled_from(DTYPES), st.booleans(), st.integers(1, 16), st.integers(0, 500), st.integers(0, 500),
       st.integers(0, 500), st.integers(0, 2**32 - 1))
def test_property_relative_positions(dtype, interleaved, pairs, p, q, shift, seed):
    """RoPE's point (RoFormer): rope(x, p) . rope(y, q) depends on p - q only."""
    HYPOTHESIS_EXAMPLES["test_property_relative_positions"] += 1
    rng = np.random.default_rng(seed)
    cos, sin = AF.rotary_tables(1001, 2 * pairs, dtype=dtype)
    x, y = (rng.standard_normal((1, 2 * pairs)).astype(dtype) for _ in range(2))
    rope = lambda v, pos: AF.rotary_embedding(v, cos, sin, interleaved=interleaved, position_offset=pos)[0]
    dot = lambda a, b: float(np.dot(a.astype(np.float64), b.astype(np.float64)))
    scale = float(np.linalg.norm(x) * np.linalg.norm(y))
    # (rounding only: the tables' and the rotations' roundings, a few units of eps times |x| |y|)
    tol = {np.float64: 1e-12, np.float32: 1e-5}[dtype]
    assert abs(dot(rope(x, p), rope(y, q)) - dot(rope(x, p + shift), rope(y, q + shift))) <= tol * scale


# ------------------------------------------------------------------------------------------------- bad input
def words(*ws):
    """A regex that matches a message containing every one of ``ws`` (literally), in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(str(w))})" for w in ws)


X = np.random.default_rng(0).standard_normal((2, 3, 5, 8))      # (B, H, L, D)
COS, SIN = AF.rotary_tables(10, 6, dtype=np.float64)            # P = 10, R = 6


def _rope(x=X, cos=COS, sin=SIN, **kw):
    return lambda: AF.rotary_embedding(x, cos, sin, **kw)


def _rope_b(g=X, cos=COS, sin=SIN, **kw):
    return lambda: AF.rotary_embedding_backward(g, cos, sin, **kw)


BAD = [
    ("input_int", _rope(x=X.astype(np.int64)), TypeError, ["input", "int64"]),
    ("input_list", _rope(x=X.tolist()), TypeError, ["input", "list"]),
    ("input_1d", _rope(x=X[0, 0, 0]), ValueError, ["input", "at least 2", "(8,)"]),
    ("cos_dtype", _rope(cos=COS.astype(np.float32)), TypeError, ["cos", "float32", "float64"]),
    ("sin_dtype", _rope(sin=SIN.astype(np.float32)), TypeError, ["sin", "float32", "float64"]),
    ("input_f16", _rope(x=X.astype(np.float16)), TypeError, ["cos", "float16"]),
    ("cos_1d", _rope(cos=COS[0]), ValueError, ["cos", "2 dimensions", "(3,)"]),
    ("cos_sin_shapes", _rope(sin=SIN[:, :2]), ValueError, ["cos", "sin", "(10, 3)", "(10, 2)"]),
    ("rotary_dim_over_D", _rope(x=X[..., :4]), ValueError, ["rotary_dim", "6", "exceeds", "D = 4", "(2, 3, 5, 4)"]),
    ("P_too_small", _rope(position_offset=6), ValueError, ["10 positions", "position_offset 6", "L 5", "11"]),
    ("P_too_small_array", _rope(position_offset=np.array([0, 6])), ValueError,
     ["10 positions", "position_offset 6", "L 5"]),
    ("offset_negative", _rope(position_offset=-1), ValueError, ["position_offset", ">= 0", "-1"]),
    ("offset_array_negative", _rope(position_offset=np.array([2, -3])), ValueError,
     ["position_offset", ">= 0", "-3"]),
    ("offset_float", _rope(position_offset=1.0), TypeError, ["position_offset", "float"]),
    ("offset_bool", _rope(position_offset=True), TypeError, ["position_offset", "bool"]),
    ("offset_str", _rope(position_offset="1"), TypeError, ["position_offset", "str"]),
    ("offset_list", _rope(position_offset=[0, 1]), TypeError, ["position_offset", "list"]),
    ("offset_float_array", _rope(position_offset=np.array([0.0, 1.0])), TypeError, ["position_offset", "float64"]),
    ("offset_array_shape", _rope(position_offset=np.array([0, 1, 2])), ValueError,
     ["position_offset", "(B,)", "(3,)", "(2, 3, 5, 8)"]),
    ("offset_array_2d", _rope(position_offset=np.zeros((2, 1), np.int64)), ValueError,
     ["position_offset", "(2, 1)"]),
    ("offset_array_3d_input", _rope(x=X[0], position_offset=np.array([0, 1, 2])), ValueError,
     ["position_offset", "4-D", "(3, 5, 8)"]),
    ("offset_bool_array", _rope(position_offset=np.array([True, False])), TypeError, ["position_offset", "bool"]),
    ("offset_0d_float", _rope(position_offset=np.array(2.0)), TypeError, ["position_offset", "float64"]),
    ("offset_0d_negative", _rope(position_offset=np.array(-2)), ValueError, ["position_offset", ">= 0", "-2"]),
    ("interleaved_str", _rope(interleaved="yes"), TypeError, ["interleaved", "str"]),
    ("interleaved_int", _rope(interleaved=1), TypeError, ["interleaved", "int"]),
    ("backward_grad_int", _rope_b(g=X.astype(np.int32)), TypeError, ["grad_output", "int32"]),
    ("backward_cos_dtype", _rope_b(cos=COS.astype(np.float32)), TypeError, ["cos", "float32"]),
    ("backward_rotary_dim_over_D", _rope_b(g=X[..., :5]), ValueError, ["rotary_dim", "exceeds", "D = 5"]),
    ("backward_P_too_small", _rope_b(position_offset=9), ValueError, ["10 positions", "position_offset 9"]),
    ("backward_offset_shape", _rope_b(position_offset=np.array([1])), ValueError, ["position_offset", "(1,)"]),
    ("tables_odd", lambda: AF.rotary_tables(8, 5), ValueError, ["rotary_dim", "even", "5"]),
    ("tables_zero_dim", lambda: AF.rotary_tables(8, 0), ValueError, ["rotary_dim", ">= 2", "0"]),
    ("tables_negative_P", lambda: AF.rotary_tables(-1, 4), ValueError, ["max_positions", ">= 0", "-1"]),
    ("tables_float_P", lambda: AF.rotary_tables(8.0, 4), TypeError, ["max_positions", "float"]),
    ("tables_base_zero", lambda: AF.rotary_tables(8, 4, base=0.0), ValueError, ["base", "> 0", "0.0"]),
    ("tables_base_nan", lambda: AF.rotary_tables(8, 4, base=float("nan")), ValueError, ["base", "nan"]),
    ("tables_base_str", lambda: AF.rotary_tables(8, 4, base="1e4"), TypeError, ["base", "str"]),
    ("tables_dtype_int", lambda: AF.rotary_tables(8, 4, dtype=np.int64), TypeError, ["dtype", "int64"]),
    ("tables_dtype_c64", lambda: AF.rotary_tables(8, 4, dtype=np.complex64), TypeError, ["dtype", "complex64"]),
    ("tables_dtype_junk", lambda: AF.rotary_tables(8, 4, dtype="junk"), TypeError, ["dtype", "junk"]),
]


@pytest.mark.parametrize("call, exc, ws", [pytest.param(*row[1:], id=row[0]) for row in BAD])
def test_bad_input(call, exc, ws):
    with pytest.raises(exc, match=words(*ws)):
        call()


def test_position_offset_is_keyword_only():
    with pytest.raises(TypeError):
        AF.rotary_embedding(X, COS, SIN, False, 0)


# The binding keeps only the checks memory safety needs (attnpp.functional makes the user-facing ones).
def _core_args(**change):
    args = dict(out=np.zeros((2, 3, 5, 8)), input=X, cos=COS, sin=SIN, position_offsets=np.array([0, 5]),
                interleaved=False)
    args.update(change)
    return args


CORE_BAD = [
    ("offset_past_P", dict(position_offsets=np.array([0, 6])), ValueError, ["position_offsets", "6", "P = 10"]),
    ("offset_negative", dict(position_offsets=np.array([-1, 0])), ValueError, ["position_offsets", "-1"]),
    ("offset_huge", dict(position_offsets=np.array([2**63 - 1, 0])), ValueError, ["position_offsets"]),
    ("offsets_short", dict(position_offsets=np.array([0])), ValueError, ["position_offsets", "(2", "got (1,)"]),
    ("offsets_int32", dict(position_offsets=np.array([0, 1], np.int32)), TypeError, ["position_offsets", "int64"]),
    ("offsets_list", dict(position_offsets=[0, 1]), TypeError, []),
    ("rotary_over_D", dict(input=X[..., :4], out=np.zeros((2, 3, 5, 4))), ValueError, ["cos", "D = 4"]),
    ("sin_shape", dict(sin=SIN[:9]), ValueError, ["sin", "(10, 3)", "(9, 3)"]),
    ("cos_noncontiguous", dict(cos=np.asfortranarray(COS)), ValueError, ["cos", "C-contiguous"]),
    ("cos_dtype", dict(cos=COS.astype(np.float32)), TypeError, ["cos", "float64", "float32"]),
    ("out_shape", dict(out=np.zeros((2, 3, 5, 7))), ValueError, ["out", "(2, 3, 5, 8)"]),
    ("out_readonly", dict(out=np.broadcast_to(np.zeros(8), (2, 3, 5, 8))), ValueError, ["out"]),
    ("input_3d", dict(input=X[0]), ValueError, ["input", "4 dimensions"]),
    ("input_last_strided", dict(input=np.empty((2, 3, 5, 16))[..., ::2]), ValueError, ["input", "contiguous"]),
]


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("change, exc, ws", [pytest.param(*row[1:], id=row[0]) for row in CORE_BAD])
def test_core_checks(change, exc, ws, backward):
    args = _core_args(**change)
    out = args["out"]
    before = out.copy() if out.flags.writeable else None
    if backward:
        args = dict(grad_input=args.pop("out"), grad_output=args.pop("input"), **args)
        ws = [{"out": "grad_input", "input": "grad_output"}.get(w, w) for w in ws]
    with pytest.raises(exc, match=words(*ws)):
        (_core.rotary_backward if backward else _core.rotary_forward)(**args)
    if before is not None:
        np.testing.assert_array_equal(out, before)  # nothing written
