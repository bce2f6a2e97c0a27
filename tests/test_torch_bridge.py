"""attnpp.torch: attnpp's forward and backward inside torch autograd, checked against PyTorch itself
(torch.nn.functional.scaled_dot_product_attention, torch.nn.MultiheadAttention) and against plain-torch
references built from the layers' math, with gradcheck in float64."""
import copy
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch.autograd import gradcheck
from torch.func import functional_call

import attnpp.functional as AF
import attnpp.torch as at
from helpers import attention_layer_reference, max_rel_err, reference

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float64]
f64 = torch.float64


def assert_close(ours, ref, what=""):
    """|ours - ref| <= tol * max(1, max |ref|), tol by dtype."""
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype} != {ref.dtype}"
    err = max_rel_err(ours.detach().numpy(), ref.detach().numpy())
    assert err <= TOL[ref.dtype], f"{what}: relative error {err:.3g} > {TOL[ref.dtype]:g}"


def randn(*shape, dtype=f64, grad=True):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


def grads(out, inputs, grad_output):
    return torch.autograd.grad(out, inputs, grad_output, allow_unused=True, retain_graph=True)


def assert_same_grads(ours_out, ref_out, ours_inputs, ref_inputs, names):
    """Outputs equal, and the gradients of a random linear function of them with respect to each input."""
    assert_close(ours_out, ref_out, "output")
    g = torch.randn_like(ref_out)
    for name, a, b in zip(names, grads(ours_out, ours_inputs, g), grads(ref_out, ref_inputs, g)):
        assert (a is None) == (b is None), name
        if b is not None:
            assert_close(a, b, f"grad of {name}")


def reference_attention(q, k, v, mask=None, scale=None, keep=None, p=0.0):
    """Plain torch: softmax(scale q k^T + mask) (times keep / (1 - p)) v; also returns the weights."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    weights = torch.softmax(scale * q @ k.transpose(-2, -1) + (0 if mask is None else mask), dim=-1)
    if keep is not None:
        weights = weights * keep / (1 - p)
    return weights @ v, weights


def additive(mask_true_hidden, dtype):
    return torch.zeros(mask_true_hidden.shape, dtype=dtype).masked_fill(mask_true_hidden, float("-inf"))


def test_import_attnpp_does_not_import_torch():
    code = "import sys, attnpp; assert 'torch' not in sys.modules; import attnpp.torch; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------- scaled_dot_product_attention
def sdpa_case(name, dtype):
    """(query, key, value, kwargs) of a named case, float64 or float32 leaves requiring grad."""
    torch.manual_seed(0)
    r = lambda *s: randn(*s, dtype=dtype)
    if name == "plain":
        return r(2, 3, 5, 4), r(2, 3, 7, 4), r(2, 3, 7, 6), {}
    if name == "unbatched":
        return r(5, 4), r(7, 4), r(7, 6), {}
    if name == "causal_L<S":
        return r(2, 3, 5, 4), r(2, 3, 7, 4), r(2, 3, 7, 6), dict(is_causal=True)
    if name == "causal_L>S":  # (the rows after S see every key)
        return r(2, 2, 7, 4), r(2, 2, 5, 4), r(2, 2, 5, 3), dict(is_causal=True)
    if name == "float_mask":
        return r(2, 3, 5, 4), r(2, 3, 7, 4), r(2, 3, 7, 6), dict(attn_mask=torch.randn(5, 7, dtype=dtype))
    if name == "bool_mask":  # True takes part; every row keeps at least key 0
        mask = torch.rand(2, 1, 5, 7) < 0.6
        mask[..., 0] = True
        return r(2, 3, 5, 4), r(2, 3, 7, 4), r(2, 3, 7, 6), dict(attn_mask=mask)
    if name == "gqa":
        return r(2, 6, 5, 4), r(2, 2, 7, 4), r(2, 2, 7, 3), dict(enable_gqa=True)
    if name == "broadcast_batch":
        return r(2, 1, 3, 5, 4), r(1, 4, 3, 7, 4), r(4, 1, 7, 6), {}
    if name == "scale":
        return r(2, 3, 5, 4), r(2, 3, 7, 4), r(2, 3, 7, 6), dict(scale=0.3, attn_mask=torch.randn(3, 1, 7, dtype=dtype))
    raise KeyError(name)


SDPA_CASES = ["plain", "unbatched", "causal_L<S", "causal_L>S", "float_mask", "bool_mask", "gqa", "broadcast_batch",
              "scale"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_matches_torch(case, dtype):
    q, k, v, kw = sdpa_case(case, dtype)
    ours = at.scaled_dot_product_attention(q, k, v, **kw)
    ref = TF.scaled_dot_product_attention(q, k, v, **kw)
    assert ours.shape == ref.shape
    assert_same_grads(ours, ref, (q, k, v), (q, k, v), "qkv")


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_gradcheck(case):
    q, k, v, kw = sdpa_case(case, f64)
    assert gradcheck(lambda q, k, v: at.scaled_dot_product_attention(q, k, v, **kw), (q, k, v))


def test_sdpa_fully_masked_row_is_zero():
    q, k, v, _ = sdpa_case("plain", f64)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    out = at.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[..., 2, :] == 0).all()
    grad_q, = torch.autograd.grad(out.sum(), q)
    assert (grad_q[..., 2, :] == 0).all() and torch.isfinite(grad_q).all()
    mask[2] = True
    ref = TF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(out[..., [0, 1, 3, 4], :], ref[..., [0, 1, 3, 4], :], "other rows")


def test_sdpa_non_contiguous_inputs_and_grad_output():
    torch.manual_seed(1)
    # (B, L, H, D) tensors seen as (B, H, L, D), a value with a stride in D, a grad_output every other column
    q, k = (randn(2, n, 3, 4).transpose(1, 2) for n in (5, 7))
    v = randn(2, 3, 7, 12)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ours = at.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(ours, ref)
    g = torch.randn(2, 3, 5, 12, dtype=f64)[..., 1::2]
    for name, a, b in zip("qkv", grads(ours, (q, k, v), g), grads(ref, (q, k, v), g)):
        assert_close(a, b, name)
    # an expanded grad_output (stride 0), as .sum() gives
    for name, a, b in zip("qkv", grads(ours.sum(), (q, k, v), None), grads(ref.sum(), (q, k, v), None)):
        assert_close(a, b, name)


def test_sdpa_needs_input_grad():
    q, k, v, _ = sdpa_case("plain", f64)
    q0, v0 = q.detach(), v.detach()
    mask = torch.randn(5, 7, dtype=f64)
    ours = at.scaled_dot_product_attention(q0, k, v0, attn_mask=mask)
    ours.sum().backward()
    ref_k = k.grad.clone()
    k.grad = None
    TF.scaled_dot_product_attention(q0, k, v0, attn_mask=mask).sum().backward()
    assert_close(ref_k, k.grad)
    # masks get no gradient (documented), where PyTorch gives a float mask one: a mask that requires grad is
    # refused under grad mode rather than left silently without its gradient
    mask.requires_grad_()
    with pytest.raises(RuntimeError, match="attn_mask: attnpp gives masks no gradient"):
        at.scaled_dot_product_attention(q0, k, v0, attn_mask=mask)
    with torch.no_grad():
        assert torch.equal(at.scaled_dot_product_attention(q0, k, v0, attn_mask=mask),
                           at.scaled_dot_product_attention(q0, k, v0, attn_mask=mask.detach()))
    with torch.no_grad():  # and without any gradient, a plain forward
        assert not at.scaled_dot_product_attention(q, k, v).requires_grad


def test_sdpa_dropout_reproducible_under_manual_seed():
    q, k, v, _ = sdpa_case("plain", f64)
    run = lambda s: (torch.manual_seed(s), at.scaled_dot_product_attention(q, k, v, dropout_p=0.5))[1]
    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, at.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("case", ["plain", "causal_L<S", "gqa", "broadcast_batch", "bool_mask"])
def test_sdpa_dropout_is_attnpp_mask_forward_and_backward(case):
    q, k, v, kw = sdpa_case(case, f64)
    p, seed = 0.4, 1234
    ours = at.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=seed, **kw)
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    L, S = q.shape[-2], k.shape[-2]
    keep = torch.from_numpy(AF.dropout_mask(tuple(batch) + (q.shape[-3], L, S), p, seed))
    mask = kw.get("attn_mask")
    if kw.get("is_causal"):
        mask = torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = additive(~mask, f64)
    kr, vr = k, v
    if kw.get("enable_gqa"):
        kr, vr = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    ref, _ = reference_attention(q, kr, vr, mask, keep=keep, p=p)
    assert_same_grads(ours, ref, (q, k, v), (q, k, v), "qkv")


def test_sdpa_dropout_gradcheck_with_manual_seed():
    q, k, v, _ = sdpa_case("causal_L<S", f64)

    def f(q, k, v):
        torch.manual_seed(7)
        return at.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    assert gradcheck(f, (q, k, v))


# ----------------------------------------------------------------------------------------------- errors
DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
CPU_ONLY = "attnpp runs on the CPU: move the tensors with .cpu()"


@pytest.mark.parametrize("device", DEVICES)
def test_non_cpu_tensors_refused(device):
    # Tensors off the CPU, or some on the CPU and some not, are refused (meta tensors alone are shapes only:
    # the operators' fake kernels, tests/test_torch_ops.py)
    x = torch.empty(2, 3, 4, device=device)
    cpu = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=CPU_ONLY):
        at.scaled_dot_product_attention(cpu, x, x)
    with pytest.raises(ValueError, match=CPU_ONLY):
        at.scaled_dot_product_attention(cpu, cpu, cpu, attn_mask=torch.ones(3, 3, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match=CPU_ONLY):
        at.linear(cpu, torch.empty(5, 4, device=device))
    with pytest.raises(ValueError, match=CPU_ONLY):
        at.MultiheadAttention(4, 2)(x, x, x)
    with pytest.raises(ValueError, match=CPU_ONLY):
        at.Attention(4, 2)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_mode", ["no_grad", "no_input_requires_grad"])
def test_sdpa_plain_call_without_gradients_skips_autograd_with_the_same_result(monkeypatch, dtype, grad_mode):
    # With nothing to differentiate (inference, a decoding step), the commonest call goes straight to the core
    # (attnpp.torch._plain_attention); the same call through the general path (an unbounded window, which changes
    # nothing, sends it there) gives the same bits. _attention patched to fail: the test fails if the plain path
    # is not taken.
    torch.manual_seed(0)
    q = torch.randn(2, 6, 3, 8, dtype=dtype, requires_grad=grad_mode == "no_grad")
    k, v = (torch.randn(2, 2, 13, 8, dtype=dtype) for _ in range(2))
    kw = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True, scale=0.3)

    def refused(*args, **kwargs):
        raise AssertionError("the plain call took the general path")
    with torch.no_grad() if grad_mode == "no_grad" else torch.enable_grad():
        general = at.scaled_dot_product_attention(q, k, v, window=(-1, -1), **kw)
        with monkeypatch.context() as m:
            m.setattr(at.functional, "_attention", refused)
            plain = at.scaled_dot_product_attention(q, k, v, **kw)
    assert plain.dtype == dtype and plain.shape == general.shape and not plain.requires_grad
    assert torch.equal(plain, general)


@pytest.mark.parametrize("make, error, match", [
    (lambda: torch.ones(1, 2, 3, 4, dtype=torch.int64), TypeError, "query"),
    (lambda: torch.ones(1, 2, 3, 4).to_sparse(), TypeError, "query: attnpp reads strided"),
    (lambda: torch.ones(1, 2, 3, 4).numpy(), TypeError, "query")], ids=["int64", "sparse", "ndarray"])
def test_sdpa_plain_call_errors_as_the_general_path(make, error, match):
    # What the plain path does not take falls to the general path, whose checks name the argument.
    x = make()
    with torch.no_grad(), pytest.raises(error, match=match):
        at.scaled_dot_product_attention(x, x, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """Half-precision tensors are read in place (no copy), and attnpp's output and gradients are no further from
    a float64 reference than PyTorch's own in the same dtype (1.5 times its error at most, or one rounding)."""
    x = torch.randn(2, 3, 5, 8, dtype=dtype)
    assert at.to_numpy(x).ctypes.data == x.data_ptr() and at.to_numpy(x).dtype.itemsize == 2
    assert at.from_numpy(at.to_numpy(x)).data_ptr() == x.data_ptr() and at.from_numpy(at.to_numpy(x)).dtype == dtype
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, 40, 16, generator=gen).to(dtype) for _ in range(4))
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11

    def run(fn, cast):
        ins = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out = fn(*ins, is_causal=True)
        out.backward(g.to(cast))
        return [out.detach().double().numpy()] + [t.grad.double().numpy() for t in ins]

    ref = run(torch.nn.functional.scaled_dot_product_attention, torch.float64)
    theirs = run(torch.nn.functional.scaled_dot_product_attention, dtype)
    ours = run(at.scaled_dot_product_attention, dtype)
    for name, a, t, r in zip(("output", "grad_query", "grad_key", "grad_value"), ours, theirs, ref):
        err, torch_err = max_rel_err(a, r), max_rel_err(t, r)
        assert err <= max(1.5 * torch_err, unit), f"{name}: {err:.3g} against PyTorch's {torch_err:.3g}"
    m = at.MultiheadAttention(8, 2, dtype=dtype, batch_first=True)
    y, w = m(x[0], x[0], x[0])
    assert y.dtype == dtype and w.dtype == dtype and y.shape == (3, 5, 8)
    with pytest.raises(TypeError, match="key.*float16|key.*bfloat16"):
        at.scaled_dot_product_attention(q, k.float(), v)


def test_mask_errors():
    x = torch.randn(3, 2, 4, dtype=f64)
    m = at.MultiheadAttention(4, 2, dtype=f64)
    with pytest.raises(TypeError, match="attn_mask.*bool or torch.float64"):
        m(x, x, x, attn_mask=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="attn_mask: expected shape"):
        m(x, x, x, attn_mask=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask: expected shape"):
        m(x, x, x, key_padding_mask=torch.zeros(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask is required"):
        m(x, x, x, is_causal=True)
    with pytest.raises(TypeError, match="key_padding_mask: expected a torch.Tensor"):
        at.Attention(4, 2, dtype=f64)(x, key_padding_mask=np.zeros((3, 2), bool))


# ----------------------------------------------------------------------------------------------- linear
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_torch(dtype):
    torch.manual_seed(0)
    x = randn(3, 8, 5, dtype=dtype).transpose(0, 1)  # non-contiguous (8, 3, 5)
    w, b = randn(4, 5, dtype=dtype), randn(4, dtype=dtype)
    assert_same_grads(at.linear(x, w, b), TF.linear(x, w, b), (x, w, b), (x, w, b), ["input", "weight", "bias"])
    assert_same_grads(at.linear(x, w), TF.linear(x, w), (x, w), (x, w), ["input", "weight"])
    frozen = w.detach()  # needs_input_grad: input only
    assert_same_grads(at.linear(x, frozen, b), TF.linear(x, frozen, b), (x, b), (x, b), ["input", "bias"])
    assert gradcheck(at.linear, (x.detach().double().requires_grad_(), w.detach().double().requires_grad_(),
                                 b.detach().double().requires_grad_()))


def test_linear_module_is_torch_linear():
    torch.manual_seed(5)
    ours = at.Linear(5, 4)
    torch.manual_seed(5)
    ref = torch.nn.Linear(5, 4)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(ours.state_dict()[n], t) for n, t in ref.state_dict().items())
    x = torch.randn(2, 5)
    assert_close(ours(x), ref(x))


# ------------------------------------------------------------------------------------- MultiheadAttention
MHA_CONFIGS = {
    "packed": dict(),
    "batch_first": dict(batch_first=True),
    "no_bias": dict(bias=False),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "bias_kv_zero_attn_bf": dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
    "kdim_vdim": dict(kdim=3, vdim=5),
}
MHA_CALLS = ["self", "cross", "kpm_bool", "kpm_float", "mask2d_bool", "mask3d_float", "causal_kernel",
             "causal_weights_per_head", "kpm_and_mask", "kpm_and_mask_float", "unbatched", "unbatched_mask3d"]
E, H = 8, 2


def mha_pair(config, dtype, **extra):
    """(ours, torch's) MultiheadAttention of ``config``, torch's state dict loaded into ours."""
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **MHA_CONFIGS[config], **extra)
    torch.manual_seed(11)
    with torch.no_grad():  # non-zero biases, so that they are tested
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    ours = at.MultiheadAttention(E, H, dtype=dtype, **MHA_CONFIGS[config], **extra)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def mha_call(module, call, dtype):
    """(query, key, value, kwargs) of a named call, leaves requiring grad."""
    torch.manual_seed(3)
    B, L, S = 3, 5, 6
    batched = not call.startswith("unbatched")
    shape = lambda T, W: ((B, T, W) if module.batch_first else (T, B, W)) if batched else (T, W)
    query = randn(*shape(L, E), dtype=dtype)
    if call in ("self", "causal_kernel", "causal_weights_per_head") and module._qkv_same_embed_dim:
        key = value = query
        S = L
    else:
        key, value = randn(*shape(S, module.kdim), dtype=dtype), randn(*shape(S, module.vdim), dtype=dtype)
    kpm_hidden = torch.zeros(B, S, dtype=torch.bool)
    kpm_hidden[0, 0] = kpm_hidden[1, -2:] = True
    hidden = torch.rand(L, S) < 0.3
    hidden[:, 1] = False  # (no fully masked row: torch's weights path gives NaN there)
    kw = {}
    if call == "kpm_bool":
        kw = dict(key_padding_mask=kpm_hidden)
    elif call == "kpm_float":
        kw = dict(key_padding_mask=torch.randn(B, S, dtype=dtype))
    elif call == "mask2d_bool":
        kw = dict(attn_mask=hidden)
    elif call == "mask3d_float":
        kw = dict(attn_mask=torch.randn(B * H, L, S, dtype=dtype), average_attn_weights=False)
    elif call == "causal_kernel":
        kw = dict(attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1), is_causal=True, need_weights=False)
    elif call == "causal_weights_per_head":
        kw = dict(attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1), is_causal=True, average_attn_weights=False)
    elif call == "kpm_and_mask":
        kw = dict(attn_mask=hidden, key_padding_mask=kpm_hidden)
    elif call == "kpm_and_mask_float":
        kw = dict(attn_mask=additive(hidden, dtype), key_padding_mask=additive(kpm_hidden, dtype))
    elif call == "unbatched":
        kw = dict(key_padding_mask=kpm_hidden[0])
    elif call == "unbatched_mask3d":
        kw = dict(attn_mask=hidden.expand(H, L, S), average_attn_weights=False)
    return query, key, value, kw


def compare_mha(ours, ref, query, key, value, kw):
    out, weights = ours(query, key, value, **kw)
    ref_out, ref_weights = ref(query, key, value, **kw)
    assert (weights is None) == (ref_weights is None)
    if ref_weights is not None:
        assert_close(weights, ref_weights.detach(), "weights")
    inputs = list(dict.fromkeys((query, key, value)))  # (once each: self-attention passes one tensor)
    assert_same_grads(out, ref_out, inputs + list(ours.parameters()), inputs + list(ref.parameters()),
                      ["query", "key", "value"][:len(inputs)] + [n for n, _ in ours.named_parameters()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("call", MHA_CALLS)
@pytest.mark.parametrize("config", list(MHA_CONFIGS))
def test_mha_matches_torch(config, call, dtype):
    ours, ref = mha_pair(config, dtype)
    compare_mha(ours, ref, *mha_call(ours, call, dtype))


@pytest.mark.parametrize("config", list(MHA_CONFIGS))
def test_mha_parameters_and_initialisation_are_torch(config):
    torch.manual_seed(2)
    ours = at.MultiheadAttention(E, H, **MHA_CONFIGS[config])
    torch.manual_seed(2)
    ref = torch.nn.MultiheadAttention(E, H, **MHA_CONFIGS[config])
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(ours.state_dict()[n], t) for n, t in ref.state_dict().items())
    assert all(isinstance(p, torch.nn.Parameter) for p in ours.parameters())


def test_mha_eval_matches_torch_fast_path():
    ours, ref = mha_pair("batch_first", f64)
    ours.eval(), ref.eval()
    x = torch.randn(3, 5, E, dtype=f64)
    with torch.no_grad():
        for a, b in zip(ours(x, x, x), ref(x, x, x)):
            assert_close(a, b)


@pytest.mark.parametrize("config,call", [("packed", "kpm_and_mask"), ("bias_kv_zero_attn_bf", "cross"),
                                         ("kdim_vdim", "mask3d_float"), ("bias_kv", "causal_kernel")])
def test_mha_gradcheck(config, call):
    module = mha_pair(config, f64)[0]
    query, key, value, kw = mha_call(module, call, f64)
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    self_attention = query is key

    def f(query, key, value, *params):
        if self_attention:
            key = value = query
        return functional_call(module, dict(zip(names, params)), (query, key, value), kw)[0]
    key, value = (key.detach().clone().requires_grad_(), value.detach().clone().requires_grad_()) \
        if self_attention else (key, value)
    assert gradcheck(f, (query, key, value, *params))


def mha_reference(m, x, keep, p):
    """Plain-torch self-attention of the "packed" MultiheadAttention (seq-first), dropout mask ``keep``."""
    L, B, _ = x.shape
    heads = lambda t: t.unflatten(-1, (H, -1)).permute(1, 2, 0, 3)
    q, k, v = (heads(t) for t in TF.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1))
    out, weights = reference_attention(q, k, v, keep=keep, p=p)
    return TF.linear(out.permute(2, 0, 1, 3).reshape(L, B, E), m.out_proj.weight, m.out_proj.bias), weights


def test_mha_dropout():
    m = mha_pair("packed", f64, dropout=0.3)[0]
    x = randn(5, 3, E)
    torch.manual_seed(9)
    out, weights = m(x, x, x, average_attn_weights=False)
    seed = m.last_seed
    torch.manual_seed(9)
    again, _ = m(x, x, x)
    assert torch.equal(out, again) and m.last_seed == seed
    keep = torch.from_numpy(AF.dropout_mask((3, H, 5, 5), 0.3, seed))
    ref, ref_weights = mha_reference(m, x, keep, 0.3)
    assert_close(weights, ref_weights.detach(), "weights")
    assert_same_grads(out, ref, [x] + list(m.parameters()), [x] + list(m.parameters()),
                      ["x"] + [n for n, _ in m.named_parameters()])
    m.eval()
    assert_close(m(x, x, x)[0], mha_reference(m, x, None, 0.0)[0], "eval: no dropout")
    assert m.last_seed is None


# ----------------------------------------------------------------------------------------------- Attention
ATTENTION_CONFIGS = {
    "self": (dict(embed_dim=8, num_heads=2), {}),
    "cross": (dict(embed_dim=8, num_heads=2, kv_dim=5, qk_dim=6, v_dim=4, out_dim=7), dict(context=True)),
    "causal_kpm": (dict(embed_dim=8, num_heads=2, causal=True), dict(kpm=True)),
    "bottom_right": (dict(embed_dim=8, num_heads=4, kv_dim=3, causal=True, causal_alignment="bottom_right"),
                     dict(context=True)),
    "bottom_right_kpm": (dict(embed_dim=8, num_heads=2, kv_dim=3, causal=True, causal_alignment="bottom_right"),
                         dict(context=True, kpm=True)),
    "no_bias_no_out_proj_scale": (dict(embed_dim=8, num_heads=2, bias=False, out_proj=False, scale=0.7),
                                  dict(kpm="float")),
    "out_bias_false": (dict(embed_dim=8, num_heads=1, out_bias=False), {}),
    "unbatched": (dict(embed_dim=8, num_heads=2, kv_dim=3, causal=True), dict(context=True, batched=False)),
}


def attention_case(config, dtype):
    """(module, x, forward kwargs) of a named configuration; non-zero biases."""
    kwargs, call = ATTENTION_CONFIGS[config]
    torch.manual_seed(4)
    m = at.Attention(**kwargs, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    B, L, S = 3, 5, (7 if call.get("context") else 5)
    lead = (B,) if call.get("batched", True) else ()
    x = randn(*lead, L, m.embed_dim, dtype=dtype)
    kw = {}
    if call.get("context"):
        kw["context"] = randn(*lead, S, m.kv_dim, dtype=dtype)
    if call.get("kpm") == "float":
        kw["key_padding_mask"] = torch.randn(*lead, S, dtype=dtype)
    elif call.get("kpm"):
        kpm = torch.zeros(*lead, S, dtype=torch.bool)
        kpm[..., -1] = True  # (the last key: every query keeps key 0)
        kpm[0, -2] = True
        kw["key_padding_mask"] = kpm
    return m, x, kw


def attention_reference(m, x, context=None, key_padding_mask=None, keep=None, p=0.0):
    """Plain torch, from attnpp.nn.Attention's math, with ``m``'s parameters: (out, weights)."""
    c = x if context is None else context
    batched = x.dim() == 3
    x3, c3 = (x, c) if batched else (x[None], c[None])
    B, L, S = x3.shape[0], x3.shape[1], c3.shape[1]
    heads = lambda t: t.unflatten(-1, (m.num_heads, -1)).transpose(1, 2)
    proj = lambda layer, t: TF.linear(t, layer.weight, layer.bias)
    q, k, v = heads(proj(m.q_proj, x3)), heads(proj(m.k_proj, c3)), heads(proj(m.v_proj, c3))
    mask = torch.zeros(L, S, dtype=x.dtype)
    if m.causal:
        diagonal = S - L if m.causal_alignment == "bottom_right" else 0
        mask = additive(torch.ones(L, S, dtype=torch.bool).triu(diagonal + 1), x.dtype)
    if key_padding_mask is not None:
        kpm = key_padding_mask if batched else key_padding_mask[None]
        kpm = additive(kpm, x.dtype) if kpm.dtype == torch.bool else kpm
        mask = mask + kpm[:, None, None, :]
    out, weights = reference_attention(q, k, v, mask, m.scale, keep, p)
    y = out.transpose(1, 2).reshape(B, L, m.v_dim)
    y = y if m.out_proj is None else proj(m.out_proj, y)
    return (y, weights) if batched else (y[0], weights[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(ATTENTION_CONFIGS))
def test_attention_matches_reference(config, dtype):
    m, x, kw = attention_case(config, dtype)
    out, weights = m(x, **kw, need_weights=True)
    ref, ref_weights = attention_reference(m, x, **kw)
    assert_close(weights, ref_weights.detach(), "weights")
    inputs = [x] + ([kw["context"]] if "context" in kw else [])
    assert_same_grads(out, ref, inputs + list(m.parameters()), inputs + list(m.parameters()),
                      ["x", "context"][:len(inputs)] + [n for n, _ in m.named_parameters()])
    assert torch.equal(m(x, **kw), out)  # need_weights=False: the output alone


@pytest.mark.parametrize("config", ["cross", "bottom_right_kpm", "no_bias_no_out_proj_scale", "unbatched"])
def test_attention_gradcheck(config):
    m, x, kw = attention_case(config, f64)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    context = kw.pop("context", None)
    inputs = (x,) + (() if context is None else (context,))

    def f(x, *rest):
        ctx, ps = (rest[0], rest[1:]) if context is not None else (None, rest)
        return functional_call(m, dict(zip(names, ps)), (x, ctx), kw)
    assert gradcheck(f, inputs + tuple(params))


def test_attention_dropout():
    m, x, kw = attention_case("causal_kpm", f64)
    m.attn_dropout = 0.25
    torch.manual_seed(8)
    out, weights = m(x, **kw, need_weights=True)
    torch.manual_seed(8)
    assert torch.equal(m(x, **kw), out)
    keep = torch.from_numpy(AF.dropout_mask((3, 2, 5, 5), 0.25, m.last_seed))
    ref, ref_weights = attention_reference(m, x, **kw, keep=keep, p=0.25)
    assert_close(weights, ref_weights.detach(), "weights")
    assert_same_grads(out, ref, [x] + list(m.parameters()), [x] + list(m.parameters()),
                      ["x"] + [n for n, _ in m.named_parameters()])
    m.out_drop.p = 0.5  # torch's output dropout, under the same generator
    torch.manual_seed(8)
    a = m(x, **kw)
    torch.manual_seed(8)
    assert torch.equal(a, m(x, **kw)) and not torch.equal(a, out)
    m.eval()
    assert m(x, **kw).requires_grad and m.last_seed is None


# ------------------------------------------------------------------------------------------------ training
def train(model_fn, params, inputs, target, steps=20):
    """Losses of ``steps`` Adam steps on the mean squared error of model_fn(*inputs) against ``target``."""
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model_fn(*inputs) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses)


def assert_same_losses(ours, ref):
    assert ours[-1] < 0.5 * ours[0], "the loss did not decrease: the loop trains nothing"
    rel = np.abs(ours - ref) / np.abs(ref)
    assert rel.max() <= 1e-10, f"losses differ: {rel.max():.3g} (ours {ours}, torch {ref})"


@pytest.mark.parametrize("config,call", [("packed", "kpm_bool"), ("bias_kv_zero_attn_bf", "cross"),
                                         ("kdim_vdim", "mask2d_bool")])
def test_mha_training_matches_torch(config, call):
    ours, ref = mha_pair(config, f64)
    query, key, value, kw = mha_call(ours, call, f64)
    query, key, value = (t.detach() for t in (query, key, value))
    target = torch.randn(ref(query, key, value, **kw)[0].shape, dtype=f64)
    losses = [train(lambda *a: m(*a, **kw)[0], m.parameters(), (query, key, value), target) for m in (ours, ref)]
    assert_same_losses(*losses)


@pytest.mark.parametrize("config", ["cross", "bottom_right_kpm", "no_bias_no_out_proj_scale"])
def test_attention_training_matches_reference(config):
    m, x, kw = attention_case(config, f64)
    x = x.detach()
    kw = {k: v.detach() for k, v in kw.items()}
    ref = copy.deepcopy(m)
    target = torch.randn(m(x, **kw).shape, dtype=f64)
    ours_losses = train(lambda x: m(x, **kw), m.parameters(), (x,), target)
    ref_losses = train(lambda x: attention_reference(ref, x, **kw)[0], ref.parameters(), (x,), target)
    assert_same_losses(ours_losses, ref_losses)


# --------------------------------------------------------------------------------------- attention variants
VARIANT_CASES = {
    "window": dict(window=(2, 1)),
    "causal_window": dict(is_causal=True, causal_alignment="bottom_right", window=(3, 0)),
    "alibi": dict(alibi_slopes="heads"),
    "alibi_per_batch": dict(alibi_slopes="batch"),
    "softcap": dict(softcap=0.7),
    "sinks": dict(sinks=True),
    "all": dict(is_causal=True, window=(4, 0), alibi_slopes="heads", softcap=2.0, sinks=True),
    "all_gqa_mask": dict(attn_mask="float", window=(-1, 2), alibi_slopes="heads", softcap=2.0, sinks=True,
                         enable_gqa=True),
}


def variant_case(name, dtype):
    """(query, key, value, kwargs for attnpp.torch, kwargs for helpers.reference) of a named case; the sinks a
    leaf tensor requiring grad, the slopes a plain tensor."""
    torch.manual_seed(5)
    kw = dict(VARIANT_CASES[name])
    Hk = 1 if kw.get("enable_gqa") else 3
    q, k, v = randn(2, 3, 5, 4, dtype=dtype), randn(2, Hk, 7, 4, dtype=dtype), randn(2, Hk, 7, 6, dtype=dtype)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.from_numpy(AF.get_alibi_slopes(3, np.float64))
    elif kw.get("alibi_slopes") == "batch":
        kw["alibi_slopes"] = torch.rand(2, 3, dtype=f64)
    if kw.get("sinks"):
        kw["sinks"] = randn(3, dtype=dtype)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(5, 7, dtype=dtype)
    ref = {n: v for n, v in kw.items() if n != "enable_gqa"}
    return q, k, v, kw, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_sdpa_variants_match_reference(case, dtype):
    """window, alibi_slopes, softcap and sinks: output and the gradients of query, key, value and sinks equal
    those of the PyTorch reference written from the definitions (autograd through it)."""
    q, k, v, kw, ref_kw = variant_case(case, dtype)
    ours = at.scaled_dot_product_attention(q, k, v, **kw)
    ref, _ = reference(q, k, v, **ref_kw)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    assert_same_grads(ours, ref, inputs, inputs, ["query", "key", "value", "sinks"])


@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_sdpa_variants_gradcheck(case):
    q, k, v, kw, _ = variant_case(case, f64)
    sinks = kw.pop("sinks", None)
    if sinks is None:
        assert gradcheck(lambda q, k, v: at.scaled_dot_product_attention(q, k, v, **kw), (q, k, v))
    else:
        assert gradcheck(lambda q, k, v, s: at.scaled_dot_product_attention(q, k, v, sinks=s, **kw), (q, k, v, sinks))


def test_sdpa_sinks_alone_get_their_gradient():
    """Inputs that need no gradient, sinks that do: the backward runs for the sinks alone."""
    q, k, v, kw, ref_kw = variant_case("sinks", f64)
    q, k, v = q.detach(), k.detach(), v.detach()
    grad_ours, = torch.autograd.grad(at.scaled_dot_product_attention(q, k, v, **kw).sum(), kw["sinks"])
    grad_ref, = torch.autograd.grad(reference(q, k, v, **ref_kw)[0].sum(), kw["sinks"])
    assert_close(grad_ours, grad_ref, "grad of sinks")


def test_sdpa_variant_errors():
    q = torch.randn(1, 2, 3, 4, dtype=f64)
    with pytest.raises(TypeError, match="sinks: expected a torch.Tensor"):
        at.scaled_dot_product_attention(q, q, q, sinks=np.zeros(2))
    with pytest.raises(ValueError, match=r"sinks: expected shape \(Hq,\) = \(2,\)"):
        at.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3, dtype=f64))
    with pytest.raises(TypeError, match="sinks.*float64"):
        at.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="alibi_slopes"):
        at.scaled_dot_product_attention(q, q, q, alibi_slopes=torch.zeros(3))
    with pytest.raises(ValueError, match=r"window\[0\]"):
        at.scaled_dot_product_attention(q, q, q, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        at.scaled_dot_product_attention(q, q, q, softcap=-1.0)


ATTENTION_VARIANTS = {
    "window_alibi": dict(causal=True, window=(2, 0), alibi=True),
    "softcap_sinks_cross": dict(kv_dim=5, softcap=1.5, sinks=True),
    "rotary": dict(rotary=True),
    "all": dict(causal=True, window=(3, 0), alibi=np.array([0.2, 0.9]), softcap=2.0, sinks=True, rotary=True,
                rotary_dim=2, rotary_interleaved=True),
}


def attention_variant_case(config, dtype):
    kwargs = ATTENTION_VARIANTS[config]
    torch.manual_seed(6)
    m = at.Attention(8, 2, **kwargs, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    x = randn(3, 5, 8, dtype=dtype)
    context = randn(3, 7, 5, dtype=dtype) if "kv_dim" in kwargs else None
    kpm = torch.zeros(3, 7 if context is not None else 5, dtype=torch.bool)
    kpm[1, -2:] = True
    return m, x, context, kpm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(ATTENTION_VARIANTS))
def test_attention_variants_match_reference(config, dtype):
    """attnpp.torch.Attention with the variants: output, weights and the gradients of the inputs and of every
    parameter (sinks included) equal the layer's math in PyTorch (helpers.attention_layer_reference)."""
    m, x, context, kpm = attention_variant_case(config, dtype)
    out, weights = m(x, context, key_padding_mask=kpm, need_weights=True)
    g = torch.randn_like(out)
    inputs = [x] + ([] if context is None else [context])
    grads = torch.autograd.grad(out, inputs + list(m.parameters()), g)
    rx = x.detach().clone().requires_grad_()
    rc = rx if context is None else context.detach().clone().requires_grad_()
    ref, ref_weights, P = attention_layer_reference(m, rx, rc, kpm.numpy())
    assert_close(out, ref, "output")
    assert_close(weights, ref_weights.detach(), "weights")
    ref_grads = torch.autograd.grad(ref, [rx] + ([] if context is None else [rc]) + list(P.values()), g)
    for name, a, b in zip(["x", "context"][:len(inputs)] + list(P), grads, ref_grads):
        assert_close(a, b, f"grad of {name}")


@pytest.mark.parametrize("config", list(ATTENTION_VARIANTS))
def test_attention_variants_gradcheck(config):
    m, x, context, kpm = attention_variant_case(config, f64)
    names = [n for n, _ in m.named_parameters()]
    assert ("sinks" in names) == bool(ATTENTION_VARIANTS[config].get("sinks"))
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    inputs = (x,) + (() if context is None else (context,))

    def f(x, *rest):
        ctx, ps = (rest[0], rest[1:]) if context is not None else (None, rest)
        return functional_call(m, dict(zip(names, ps)), (x, ctx), dict(key_padding_mask=kpm))
    assert gradcheck(f, inputs + tuple(params))


def test_attention_variants_equal_attnpp_nn_and_train_sinks():
    """The same state dict (sinks included) in attnpp.torch.Attention and attnpp.nn.Attention gives the same
    output and gradients; a torch optimizer trains the sinks."""
    import attnpp.nn as ann
    m, x, _, _ = attention_variant_case("all", f64)
    layer = ann.Attention(8, 2, **ATTENTION_VARIANTS["all"], dtype=np.float64)
    layer.load_state_dict(m.state_dict())
    assert list(m.state_dict()) == list(layer.state_dict())
    out = m(x)
    g = torch.randn_like(out)
    out.backward(g)
    ours = layer(x.detach().numpy())
    grad_x = layer.backward(g.numpy())
    assert_close(torch.from_numpy(ours), out.detach(), "output")
    assert_close(torch.from_numpy(grad_x), x.grad, "grad x")
    for (name, p), (_, q) in zip(m.named_parameters(), layer.named_parameters()):
        assert_close(torch.from_numpy(q.grad), p.grad, f"grad of {name}")
    before = m.sinks.detach().clone()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert_close(m.sinks.detach(), before - 0.1 * m.sinks.grad, "sinks after a step")
    assert "sinks=True" in repr(m) and "alibi=[0.2, 0.9]" in repr(m)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_attention_padding_with_causal_keeps_the_causal_kernel(alignment, monkeypatch):
    """attnpp.torch.Attention with a causal mask and key padding: output and gradients equal PyTorch's SDPA with
    the dense mask, and the kernel gets is_causal plus the (B, S) padding, never a dense (L, S) mask (so it skips
    the blocks above the diagonal, as attnpp.nn.Attention does)."""
    torch.manual_seed(0)
    B, L, S, E, H = 3, 5, 7, 16, 2
    layer = at.Attention(E, H, causal=True, causal_alignment=alignment, dtype=f64)
    x, context = randn(B, L, E), randn(B, S, E)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, 5:], kpm[2, :2] = True, True
    calls = []
    real = AF.scaled_dot_product_attention_forward
    monkeypatch.setattr(AF, "scaled_dot_product_attention_forward",
                        lambda *a, **kw: calls.append((a[3] if len(a) > 3 else kw.get("attn_mask"),
                                                       a[5] if len(a) > 5 else kw.get("is_causal"))) or real(*a, **kw))
    out = layer(x, context, key_padding_mask=kpm)

    heads = lambda t: t.unflatten(-1, (H, -1)).transpose(1, 2)
    q, k, v = heads(layer.q_proj(x)), heads(layer.k_proj(context)), heads(layer.v_proj(context))
    hidden = torch.ones(L, S, dtype=torch.bool).triu((S - L if alignment == "bottom_right" else 0) + 1)
    ref = TF.scaled_dot_product_attention(q, k, v, attn_mask=~hidden & ~kpm[:, None, None, :])
    ref = layer.out_proj(ref.transpose(1, 2).reshape(B, L, E))
    assert_same_grads(out, ref, [x, context], [x, context], ["x", "context"])
    assert calls and all(mask is None and causal for mask, causal in calls), calls
