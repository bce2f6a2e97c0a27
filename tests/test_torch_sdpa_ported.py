"""PyTorch's own CPU tests of scaled_dot_product_attention (pytorch/pytorch test/test_transformers.py: TestSDPA's
CPU tests, TestAttnBias), ported with attnpp.torch as the kernel under test.

Each test keeps PyTorch's grid, its reference (the math backend, ``sdpa_kernel(SDPBackend.MATH)``, in float32 for
the half-precision dtypes and cast back, as there) and its tolerances (``torch.testing.assert_close`` with the
same atol and rtol); where PyTorch runs its fused CPU kernel, attnpp runs. The large grids run a fixed random
subset (seeded, ``SAMPLE`` cases each) to fit CI's time; set ``ATTNPP_SDPA_PORTED_ALL=1`` to run every case.
A few tests of behaviours the file checks in later PyTorch versions (fully masked rows, GQA, NaN propagation,
half-precision overflow, zero-size inputs, dropout gradcheck) are written in the same way, named after them.
"""
import itertools
import os
import random
from collections import namedtuple
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalVariant, causal_lower_right, causal_upper_left

import attnpp.torch as at

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")

Tolerances = namedtuple("Tolerances", ["atol", "rtol"])
HALVES = (torch.bfloat16, torch.float16)
ALL = os.environ.get("ATTNPP_SDPA_PORTED_ALL") == "1"


def sample(grid, k, seed):
    """A fixed random subset of ``k`` cases of ``grid`` (all of them with ATTNPP_SDPA_PORTED_ALL=1)."""
    grid = list(grid)
    return grid if ALL or k >= len(grid) else random.Random(seed).sample(grid, k)


def math_sdpa(*args, **kwargs):
    """PyTorch's math backend: the reference of every test here."""
    with sdpa_kernel(backends=[SDPBackend.MATH]):
        return F.scaled_dot_product_attention(*args, **kwargs)


def rand_packed(batch, n_head, seq_len, head_dim, dtype):
    """PyTorch's ``rand_sdpa_tensor(..., packed=True)``: one (batch, seq_len, 3 * n_head * head_dim) tensor."""
    return torch.randn(batch, seq_len, 3 * n_head * head_dim, dtype=dtype)


# ------------------------------------------------------------- test_scaled_dot_product_fused_attention_vs_math_cpu
VS_MATH = sample(itertools.product([torch.float64, torch.float32, torch.bfloat16, torch.float16], [2, 12],
                                   [267, 1030], [1, 3], [8, 16], [True, False], [True, False]), 10, seed=1)


def vs_math_tolerance(dtype):
    return {torch.bfloat16: Tolerances(5e-2, 5e-2), torch.float16: Tolerances(1e-2, 1e-2)}.get(
        dtype, Tolerances(1e-5, 5e-6))


@pytest.mark.parametrize("dtype, batch_size, seq_len, n_head, head_dim, causal, train", VS_MATH)
def test_scaled_dot_product_fused_attention_vs_math_cpu(dtype, batch_size, seq_len, n_head, head_dim, causal, train):
    torch.manual_seed(0)
    tol = vs_math_tolerance(dtype)
    n_embd = n_head * head_dim
    x = rand_packed(batch_size, n_head, seq_len, head_dim, dtype)
    x2 = x.clone()
    if train:
        x.requires_grad_(True)
        x2.requires_grad_(True)
    q, k, v = x.split(n_embd, dim=2)
    q2, k2, v2 = x2.split(n_embd, dim=2)
    if dtype in HALVES:
        q2, k2, v2 = q2.float(), k2.float(), v2.float()
    heads = lambda t: t.view(batch_size, seq_len, n_head, head_dim).transpose(1, 2)  # (B, nh, T, hs), strided
    q, k, v, q2, k2, v2 = map(heads, (q, k, v, q2, k2, v2))
    actual = at.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=causal)
    math_ref = math_sdpa(q2, k2, v2, attn_mask=None, dropout_p=0.0, is_causal=causal)
    if dtype in HALVES:
        math_ref = math_ref.to(dtype)
    torch.testing.assert_close(actual, math_ref, atol=tol.atol, rtol=tol.rtol)
    if train:
        actual.sum().backward()
        math_ref.sum().backward()
        for a, r in zip(x.grad.split(n_embd, dim=2), x2.grad.split(n_embd, dim=2)):
            torch.testing.assert_close(a, r, atol=tol.atol, rtol=tol.rtol)


# ------------------------------------------------------- test_scaled_dot_product_fused_attention_mask_vs_math_cpu
MASK_VS_MATH = sample(itertools.product([torch.float64, torch.float32, torch.bfloat16, torch.float16], [2, 4],
                                        [0, 1], [True, False], [True, False], [True, False]), 12, seed=2)


def mask_grad_tolerance(dtype):
    return {torch.bfloat16: Tolerances(5e-2, 5e-2), torch.float16: Tolerances(1e-1, 1e-1),
            torch.float32: Tolerances(1.25e-5, 5.25e-6)}.get(dtype, Tolerances(1e-5, 5e-6))


@pytest.mark.parametrize("dtype, mask_dim, bool_mask, train, casual, set_attn_mask", MASK_VS_MATH)
def test_scaled_dot_product_fused_attention_mask_vs_math_cpu(dtype, mask_dim, bool_mask, train, casual,
                                                             set_attn_mask):
    batch_size, q_seq_len, kv_seq_len, n_head, head_dim = 2, 267, 514, 3, 8
    torch.manual_seed(0)
    tol, tol_grad = vs_math_tolerance(dtype), mask_grad_tolerance(dtype)
    shapes = itertools.product([q_seq_len, 1], [kv_seq_len, 1]) if mask_dim == 2 else \
        itertools.product([batch_size, 1], [n_head, 1], [q_seq_len, 1], [kv_seq_len, 1])
    for mask_shape in shapes:
        q = torch.randn(batch_size, q_seq_len, n_head, head_dim, dtype=dtype)
        k = torch.randn(batch_size, kv_seq_len, n_head, head_dim, dtype=dtype)
        v = torch.randn(batch_size, kv_seq_len, n_head, head_dim, dtype=dtype)
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        if train:
            for t in (q, k, v, q2, k2, v2):
                t.requires_grad_(True)
        leaves = (q, k, v, q2, k2, v2)
        if dtype in HALVES:
            q2, k2, v2 = q2.float(), k2.float(), v2.float()
        q, k, v, q2, k2, v2 = (t.transpose(1, 2) for t in (q, k, v, q2, k2, v2))
        attn_mask = None
        if set_attn_mask and not casual:
            attn_mask = torch.randint(0, 2, size=mask_shape, dtype=torch.bool) if bool_mask else \
                torch.randn(mask_shape, dtype=dtype)
        actual = at.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=casual)
        if attn_mask is not None and not bool_mask and dtype in HALVES:
            attn_mask = attn_mask.float()
        math_ref = math_sdpa(q2, k2, v2, attn_mask=attn_mask, dropout_p=0.0, is_causal=casual)
        if dtype in HALVES:
            math_ref = math_ref.to(dtype)
        assert not torch.isnan(math_ref).any() and not torch.isnan(actual).any()
        torch.testing.assert_close(actual, math_ref, atol=tol.atol, rtol=tol.rtol)
        if train:
            actual.sum().backward()
            math_ref.sum().backward()
            for a, r in zip(leaves[:3], leaves[3:]):
                assert a.grad is not None
                torch.testing.assert_close(a.grad, r.grad, atol=tol_grad.atol, rtol=tol_grad.rtol)


# ------------------------------------------------------------------------ the other TestSDPA tests run on the CPU
def test_scaled_dot_product_fused_attention_with_inf():
    # pytorch/pytorch#127055: a banded mask of -inf
    torch.manual_seed(0)
    full = torch.full((600, 600), float("-inf"))
    mask = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-10)
    q, k, v = (torch.randn(1, 600, 2, 8).transpose(1, 2) for _ in range(3))  # rand_sdpa_tensor's (B, T, H, D)
    torch.testing.assert_close(at.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               math_sdpa(q, k, v, attn_mask=mask))


def test_scaled_dot_product_attention_math_with_negative_scale():
    # pytorch/pytorch#105190
    def ref(x):
        return torch.matmul((torch.matmul(x, x.transpose(-1, -2)) / -0.0001).softmax(dim=-1), x)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(at.scaled_dot_product_attention(x, x, x, scale=-1.0 / 0.0001), ref(x))


@pytest.mark.parametrize("contiguous_inputs", [True, False])
def test_sdp_math_gradcheck(contiguous_inputs):
    batch_size, seq_len, num_heads, head_dim = 4, 4, 2, 16
    torch.manual_seed(0)
    qkv = rand_packed(batch_size, num_heads, seq_len, head_dim, torch.float64).requires_grad_()
    query, key, value = (t.view(batch_size, -1, num_heads, head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    if contiguous_inputs:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    assert gradcheck(lambda *args: at.scaled_dot_product_attention(*args), (query, key, value, None, 0.0, False),
                     check_batched_grad=True)


def test_sdp_math_gradcheck_with_dropout():
    # (PyTorch's gradcheck of the math kernel with dropout fixes the generator before each call,
    # wrapper_set_seed; attnpp draws its dropout seed from it)
    def with_seed(*args):
        torch.manual_seed(7)
        return at.scaled_dot_product_attention(*args)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert gradcheck(with_seed, (q, k, v, None, 0.3, False), check_batched_grad=True)


# --------------------------------------------------------------------------------------------------- TestAttnBias
ATTN_BIAS_SHAPES = [(16, 16, 128, 128, 16), (16, 16, 128, 256, 32), (16, 16, 256, 128, 32), (1, 1, 23, 56, 15)]


def run_attn_bias_test(make_q, make_kv, attn_bias, forw_tolerances, grad_tolerances, sdpa):
    """TestAttnBias.run_test: PyTorch with the materialised bias against ``sdpa`` given the CausalBias."""
    query, key, value = make_q(), make_kv(), make_kv()
    query2, key2, value2 = (t.clone().detach().requires_grad_() for t in (query, key, value))
    pytorch_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_bias._materialize("cpu"),
                                                    dropout_p=0.0, is_causal=False)
    sdpa_output = sdpa(query2, key2, value2, attn_mask=attn_bias, dropout_p=0.0, is_causal=False, scale=None)
    d_out = torch.randn_like(pytorch_output)
    pytorch_output.backward(d_out)
    sdpa_output.backward(d_out)
    torch.testing.assert_close(pytorch_output, sdpa_output, rtol=forw_tolerances.rtol, atol=forw_tolerances.atol)
    for a, b in ((query, query2), (key, key2), (value, value2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=grad_tolerances.rtol, atol=grad_tolerances.atol)


def causal_variant_case(causal_variant, shape):
    bsz, num_heads, seq_len_q, seq_len_kv, head_dim = shape
    # (PyTorch skips lower-right with seq_len_q > seq_len_kv, where its CUDA kernels give NaN rows; its CPU
    # kernel, the reference here, gives 0 there, as attnpp: run)
    make = partial(torch.rand, dtype=torch.float16, requires_grad=True)
    bias = causal_upper_left if causal_variant == CausalVariant.UPPER_LEFT else causal_lower_right
    return (partial(make, (bsz, num_heads, seq_len_q, head_dim)), partial(make, (bsz, num_heads, seq_len_kv, head_dim)),
            bias(seq_len_q, seq_len_kv))


@pytest.mark.parametrize("shape", ATTN_BIAS_SHAPES, ids=str)
@pytest.mark.parametrize("causal_variant", [CausalVariant.UPPER_LEFT, CausalVariant.LOWER_RIGHT], ids=str)
def test_causal_variants(causal_variant, shape):
    torch.manual_seed(0)
    make_q, make_kv, attn_bias = causal_variant_case(causal_variant, shape)
    run_attn_bias_test(make_q, make_kv, attn_bias, Tolerances(1e-3, 1e-3), Tolerances(5e-3, 5e-3),
                       at.scaled_dot_product_attention)


@pytest.mark.parametrize("causal_variant", [CausalVariant.UPPER_LEFT, CausalVariant.LOWER_RIGHT], ids=str)
def test_causal_variants_compile(causal_variant):
    # (one shape of the four: each compiles anew)
    from torch._dynamo.testing import CompileCounterWithBackend
    torch.manual_seed(0)
    torch._dynamo.reset()
    cnts = CompileCounterWithBackend("aot_eager")
    make_q, make_kv, attn_bias = causal_variant_case(causal_variant, ATTN_BIAS_SHAPES[-1])
    run_attn_bias_test(make_q, make_kv, attn_bias, Tolerances(1e-3, 1e-3), Tolerances(5e-3, 5e-3),
                       torch.compile(at.scaled_dot_product_attention, backend=cnts))
    assert cnts.frame_count == 1, "Compiled graph should have 1 frame!"


@pytest.mark.parametrize("shape", ATTN_BIAS_SHAPES, ids=str)
def test_is_causal_equals_upper_left(shape):
    torch.manual_seed(0)
    bsz, num_heads, seq_len_q, seq_len_kv, head_dim = shape
    make = partial(torch.rand, dtype=torch.float16, requires_grad=True)
    query, key, value = make((bsz, num_heads, seq_len_q, head_dim)), *(make((bsz, num_heads, seq_len_kv, head_dim))
                                                                       for _ in range(2))
    out_attn_bias = at.scaled_dot_product_attention(query, key, value,
                                                    attn_mask=causal_upper_left(seq_len_q, seq_len_kv), dropout_p=0.0)
    out_is_causal = at.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=0.0)
    torch.testing.assert_close(out_attn_bias, out_is_causal, rtol=1e-3, atol=1e-3)


def test_is_causal_and_mask_fails():
    query, key, value = (torch.rand(16, 16, 128, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="CausalBias"):
        at.scaled_dot_product_attention(query, key, value, attn_mask=causal_upper_left(128, 128), is_causal=True,
                                        dropout_p=0.0)


# ---------------------------------------------------------- later PyTorch versions' CPU tests, in the same manner
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fully_masked_out_rows(dtype):
    # A query whose keys are all masked out: output 0 and gradient 0, as the math backend (PyTorch >= 2.5)
    torch.manual_seed(0)
    tol, tol_grad = vs_math_tolerance(dtype), mask_grad_tolerance(dtype)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=dtype, requires_grad=True) for n in (9, 13, 13))
    mask = torch.rand(2, 1, 9, 13) < 0.7
    mask[0, 0, [1, 4]] = False
    mask[1, 0, 8] = False
    actual = at.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    math_ref = math_sdpa(q2, k2, v2, attn_mask=mask)
    assert (actual[0, :, [1, 4]] == 0).all() and (actual[1, :, 8] == 0).all()
    torch.testing.assert_close(actual, math_ref.to(dtype), atol=tol.atol, rtol=tol.rtol)
    g = torch.randn_like(math_ref)
    grads = zip(torch.autograd.grad(actual, (q, k, v), g.to(dtype)), torch.autograd.grad(math_ref, (q2, k2, v2), g))
    for a, r in grads:
        torch.testing.assert_close(a, r.to(dtype), atol=tol_grad.atol, rtol=tol_grad.rtol)


GQA = sample(itertools.product([torch.float64, torch.float32, torch.bfloat16, torch.float16], [(8, 2), (6, 3), (4, 1)],
                               [(33, 47), (64, 64), (70, 20)], [True, False]), 10, seed=3)


@pytest.mark.parametrize("dtype, heads, lengths, causal", GQA)
def test_scaled_dot_product_attention_gqa_vs_math_cpu(dtype, heads, lengths, causal):
    torch.manual_seed(0)
    (hq, hkv), (L, S) = heads, lengths
    tol, tol_grad = vs_math_tolerance(dtype), mask_grad_tolerance(dtype)
    q = torch.randn(2, hq, L, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, hkv, S, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    actual = at.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    q2, k2, v2 = (t.detach().to(torch.float32 if dtype in HALVES else dtype).requires_grad_() for t in (q, k, v))
    math_ref = math_sdpa(q2, k2, v2, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(actual, math_ref.to(dtype), atol=tol.atol, rtol=tol.rtol)
    actual.sum().backward()
    math_ref.sum().backward()
    for a, r in zip((q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(a.grad, r.grad.to(dtype), atol=tol_grad.atol, rtol=tol_grad.rtol)


@pytest.mark.parametrize("where", ["query", "key", "value", "mask_inf"])
def test_nan_and_inf_propagation(where):
    # NaN in an input reaches exactly the outputs the math backend's does; -inf in a float mask masks, +inf
    # gives NaN rows as there
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    mask = torch.randn(5, 7)
    if where == "query":
        q[0, 1, 2, 3] = float("nan")
    elif where == "key":
        k[0, 0, 4, 0] = float("nan")
    elif where == "value":
        v[0, 1, 6, 5] = float("nan")
    else:
        mask[1, 3], mask[2] = float("-inf"), float("-inf")
        mask[4, 0] = float("inf")
    actual, ref = at.scaled_dot_product_attention(q, k, v, attn_mask=mask), math_sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(actual.isnan(), ref.isnan())
    torch.testing.assert_close(actual, ref, equal_nan=True)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_half_precision_scores_beyond_their_range(dtype):
    # Scores above float16's range (65504): computed in float32 as PyTorch's CPU kernel and math reference (in
    # float32, cast back), no inf or NaN
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 64, dtype=dtype) * 60 for _ in range(3))
    assert (q.float() @ k.float().transpose(-1, -2)).abs().max() > 65504
    actual = at.scaled_dot_product_attention(q, k, v, scale=1.0)
    ref = math_sdpa(q.float(), k.float(), v.float(), scale=1.0).to(dtype)
    tol = vs_math_tolerance(dtype)
    assert actual.isfinite().all()
    torch.testing.assert_close(actual, ref, atol=tol.atol * 60, rtol=tol.rtol)  # (values of scale 60)


@pytest.mark.parametrize("B, L, S", [(0, 3, 4), (1, 0, 4), (1, 3, 0), (2, 0, 0)])
def test_zero_size_inputs(B, L, S):
    q = torch.randn(B, 2, L, 8, requires_grad=True)
    k, v = (torch.randn(B, 2, S, 8, requires_grad=True) for _ in range(2))
    actual, ref = at.scaled_dot_product_attention(q, k, v), math_sdpa(q, k, v)
    torch.testing.assert_close(actual, ref)
    for a, r in zip(torch.autograd.grad(actual.sum(), (q, k, v)),
                    torch.autograd.grad(ref.sum(), (q, k, v), allow_unused=True, materialize_grads=True)):
        torch.testing.assert_close(a, r)
