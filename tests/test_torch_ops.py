"""attnpp.torch as a PyTorch operator: PyTorch's CausalBias masks, tensor arguments attnpp must not misread
(subclasses, views, negative bits, masks requiring grad, meta), the registered operators (opcheck, fake
kernels), torch.compile, torch.export, torch.func and the error classes, each checked against PyTorch's own
scaled_dot_product_attention or plain-torch references."""
import pytest
import torch
import torch.nn.functional as TF
from torch.autograd import gradcheck
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnpp.torch as at
from attnpp.torch import _ops
from helpers import max_rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
f64 = torch.float64
LS = [(5, 9), (7, 7), (9, 5)]  # L < S, L = S, L > S
# (PyTorch warns that a lower-right CausalBias with L > S gives NaN; its CPU kernel gives 0 there, as attnpp)
pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")


def assert_close(ours, ref, what=""):
    """|ours - ref| <= tol * max(1, max |ref|), tol by dtype (the parity tests' bound)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    err = max_rel_err(ours.detach().numpy(), ref.detach().numpy())
    assert err <= TOL[ref.dtype], f"{what}: relative error {err:.3g} > {TOL[ref.dtype]:g}"


def qkv(L, S, dtype=f64, B=2, H=3, D=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, dtype=dtype, generator=g).requires_grad_()
            for shape in ((B, H, L, D), (B, H, S, D), (B, H, S, Dv))]


def assert_same_as_torch(ours_fn, ref_fn, inputs, what=""):
    """Outputs and the gradients of a random linear function of them equal within the parity tolerance."""
    ours, ref = ours_fn(*inputs), ref_fn(*inputs)
    assert_close(ours, ref, f"{what} output")
    g = torch.randn_like(ref)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(ours, inputs, g), torch.autograd.grad(ref, inputs, g))):
        assert_close(a, b, f"{what} grad {i}")


# ------------------------------------------------------------------------------------- PyTorch's CausalBias
@pytest.mark.parametrize("L, S", LS)
@pytest.mark.parametrize("make_bias", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
@pytest.mark.parametrize("dtype", [torch.float32, f64], ids=str)
def test_causal_bias_equals_torch(make_bias, L, S, dtype):
    # PyTorch gives a CausalBias its meaning through __torch_function__; its storage is uninitialised memory.
    # attnpp reads it as the causal flag and alignment, output and gradients equal to PyTorch's own.
    bias = make_bias(L, S)
    assert_same_as_torch(lambda q, k, v: at.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                         lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                         qkv(L, S, dtype), f"{make_bias.__name__}({L}, {S})")


@pytest.mark.parametrize("L, S", LS)
def test_causal_bias_is_the_causal_flag_not_a_mask(L, S, monkeypatch):
    # The storage of a CausalBias is never read: poisoned, the result does not change; and the flags are those
    # of attnpp's own causal options.
    q, k, v = qkv(L, S)
    for make_bias, alignment in ((causal_upper_left, "top_left"), (causal_lower_right, "bottom_right")):
        bias = make_bias(L, S)
        torch.Tensor.fill_(bias.as_subclass(torch.Tensor), float("nan"))
        out = at.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        assert torch.equal(out, at.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                causal_alignment=alignment))


def test_causal_bias_misuse_refused_as_torch():
    q, k, v = qkv(5, 9)
    with pytest.raises(ValueError, match="must not be given with is_causal=True"):
        at.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 9), is_causal=True)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):  # (PyTorch too)
        TF.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 9), is_causal=True)
    with pytest.raises(RuntimeError, match=r"CausalBias for \(L, S\) = \(5, 8\)"):
        at.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(5, 8))


class Doubled(torch.Tensor):
    """A tensor subclass whose meaning is not its memory (as CausalBias)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("where", ["query", "key", "value", "attn_mask", "sinks", "key_padding_mask"])
def test_tensor_subclasses_refused_before_their_storage_is_read(where):
    q, k, v = (t.detach() for t in qkv(5, 9))
    args = dict(query=q, key=k, value=v, attn_mask=torch.zeros(5, 9, dtype=f64), sinks=torch.zeros(3, dtype=f64),
                key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))
    args[where] = args[where].as_subclass(Doubled)
    with pytest.raises(TypeError, match=f"{where}: attnpp reads plain tensors only, got the tensor subclass"):
        at.scaled_dot_product_attention(**args)
    with pytest.raises(RuntimeError, match="attnpp reads"):  # (and the operator itself, called directly)
        _ops.sdpa_forward(*(args[n] for n in ("query", "key", "value", "attn_mask", "sinks")), None,
                          args["key_padding_mask"], 0.0, False, None, False, None, "top_left", None, None)


def test_subclasses_refused_by_every_entry():
    x = torch.randn(2, 5, 4).as_subclass(Doubled)
    w = torch.randn(3, 4)
    for call in (lambda: at.linear(x, w), lambda: at.linear(torch.randn(2, 4), w.as_subclass(Doubled)),
                 lambda: at.linear_cross_entropy(torch.randn(6, 4), w, torch.zeros(6, dtype=torch.long).as_subclass(
                     Doubled)),
                 lambda: at.MultiheadAttention(4, 2, batch_first=True)(x, x, x),
                 lambda: at.Attention(4, 2)(x)):
        with pytest.raises(TypeError, match="attnpp reads plain tensors only"):
            call()


def test_non_contiguous_views_and_negative_bits_read_correctly():
    # Transposed, sliced and expanded views; tensors whose negative bit is set (torch._neg_view): what they
    # mean, not their raw memory.
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 9, 3, 16, dtype=f64, generator=g)
    q = base[:, :5, :, ::2].transpose(1, 2).requires_grad_()        # (2, 3, 5, 8), strided
    k = torch._neg_view(torch.randn(2, 3, 9, 8, dtype=f64, generator=g)).requires_grad_()
    v = torch.randn(1, 3, 9, 6, dtype=f64, generator=g).expand(2, 3, 9, 6).requires_grad_()
    mask = torch._neg_view(torch.randn(9, 5, dtype=f64, generator=g)).t()
    assert q.is_contiguous() is False and k.is_neg() and mask.is_neg()
    assert_same_as_torch(lambda q, k, v: at.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                         lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, attn_mask=mask.resolve_neg()),
                         (q, k, v), "views")
    w = torch._neg_view(torch.randn(7, 8, dtype=f64, generator=g))
    assert_close(at.linear(q, w), TF.linear(q, w.resolve_neg()), "linear with a negative weight view")


def test_meta_tensors_propagate_shapes():
    m = lambda *s, dtype=torch.float32: torch.empty(*s, device="meta", dtype=dtype)
    out = at.scaled_dot_product_attention(m(2, 8, 5, 16), m(2, 2, 9, 16), m(2, 2, 9, 4), enable_gqa=True)
    assert out.is_meta and out.shape == (2, 8, 5, 4)
    assert at.scaled_dot_product_attention(m(5, 16), m(9, 16), m(9, 4)).shape == (5, 4)
    out = at.scaled_dot_product_attention(m(3, 1, 2, 5, 16, dtype=torch.bfloat16),
                                          m(1, 4, 2, 9, 16, dtype=torch.bfloat16),
                                          m(1, 4, 2, 9, 16, dtype=torch.bfloat16))
    assert out.shape == (3, 4, 2, 5, 16) and out.dtype == torch.bfloat16
    assert at.linear(m(3, 7, 4), m(5, 4), m(5)).shape == (3, 7, 5)
    assert at.linear_cross_entropy(m(6, 4), m(11, 4), torch.empty(6, dtype=torch.long, device="meta")).shape == ()
    with torch.device("meta"):
        layer = at.Attention(16, 4, causal=True, rotary=True, sinks=True)
    assert layer(m(2, 7, 16)).shape == (2, 7, 16)


# --------------------------------------------------------------------------------------- registered operators
def _attention_args(dtype=f64, L=5, S=9, gqa=False, variants=False, unbatched=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=dtype, generator=g)
    Hk = 2 if gqa else 4
    if unbatched:
        q, k, v = r(L, 8), r(S, 8), r(S, 6)
    else:
        q, k, v = r(2, 4, L, 8), r(2, Hk, S, 8), r(2, Hk, S, 6)
    mask = sinks = alibi = kpm = None
    options = [0.0, False, None, gqa, None, "top_left", None, None]
    if variants:
        mask, sinks, alibi = r(L, S), r(4), torch.rand(4, dtype=f64, generator=g)
        kpm = torch.rand(2, S, generator=g) < 0.2
        options = [0.0, False, 0.4, gqa, None, "top_left", [3, 1], 5.0]
    return [q, k, v, mask, sinks, alibi, kpm] + options


def _op_cases():
    """(name, operator, arguments) of each operator, the attention's in several configurations."""
    cases = []
    for name, kw in (("plain", {}), ("variants", dict(variants=True)), ("gqa", dict(gqa=True)),
                     ("unbatched", dict(unbatched=True)), ("float32_causal_bottom_right", dict(dtype=torch.float32))):
        args = _attention_args(**kw)
        if name.endswith("bottom_right"):
            args[8], args[12] = True, "bottom_right"
        out, lse = _ops.sdpa_forward(*args)
        cases.append((f"sdpa_forward-{name}", _ops.sdpa_forward, args))
        cases.append((f"sdpa_backward-{name}", _ops.sdpa_backward, [torch.randn_like(out)] + args[:3] + [out, lse]
                      + args[3:]))
        cases.append((f"sdpa_weights-{name}", _ops.sdpa_weights, args[:2] + args[3:7] + [lse] + args[7:]))
    x, w, b = torch.randn(3, 7, 4), torch.randn(5, 4), torch.randn(5)
    cases += [("linear", _ops.linear, [x, w, b]), ("linear_nobias", _ops.linear, [x, w, None]),
              ("linear_backward", _ops.linear_backward, [torch.randn(3, 7, 5), x, w, True, True])]
    x, w, t = torch.randn(6, 4, dtype=f64), torch.randn(11, 4, dtype=f64), torch.tensor([0, 3, -100, 10, 2, 3])
    for reduction, softcap in (("mean", 0.0), ("sum", 0.0), ("none", 0.0), ("mean", 3.0)):
        args = [x, w, t, torch.randn(11, dtype=f64), -100, reduction, 0.1, softcap, True]
        loss, lse, *_ = _ops.linear_cross_entropy_forward(*args)
        cap = "-softcap" if softcap else ""
        cases += [(f"linear_cross_entropy_forward-{reduction}{cap}", _ops.linear_cross_entropy_forward, args),
                  (f"linear_cross_entropy_backward-{reduction}{cap}", _ops.linear_cross_entropy_backward,
                   [torch.randn_like(loss), x, w, t, lse] + args[3:8])]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(11, h, 8, dtype=f64, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 4, 11])
    for name, extra in (("plain", [None, None, 0.0, True, None, None, "top_left", None, None]),
                        ("variants", [torch.randn(4, dtype=f64, generator=g), None, 0.0, True, 0.5, None,
                                      "bottom_right", [2, 0], 5.0])):
        args = [q, k, v, cu, cu] + extra
        out, lse = _ops.sdpa_varlen_forward(*args)
        cases += [(f"sdpa_varlen_forward-{name}", _ops.sdpa_varlen_forward, args),
                  (f"sdpa_varlen_backward-{name}", _ops.sdpa_varlen_backward,
                   [torch.randn_like(out), q, k, v, out, lse] + args[3:])]
    h = torch.randn(2, 3, 7, 8, dtype=f64)
    cases += [("rotary_embedding", _ops.rotary_embedding, [h, 6, 10000.0, False, 3]),
              ("rotary_embedding_interleaved", _ops.rotary_embedding, [h[:, :, 1:], 8, 500.0, True, 0]),
              ("rotary_embedding_backward", _ops.rotary_embedding_backward, [h, 6, 10000.0, False, 3])]
    return cases


OP_CASES = _op_cases()
DIFFERENTIABLE = {"sdpa_forward": (0, 1, 2, 4), "linear": (0, 1, 2), "linear_cross_entropy_forward": (0, 1, 3),
                  "rotary_embedding": (0,), "sdpa_varlen_forward": (0, 1, 2, 5)}


@pytest.mark.parametrize("name, op, args", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_opcheck(name, op, args):
    # torch.library.opcheck: the schema (no mutation, no aliasing), the fake kernel against the real one, the
    # autograd registration and AOT dispatch (static and dynamic shapes)
    args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    for i in DIFFERENTIABLE.get(op._name.split("::")[-1], ()):
        if args[i] is not None and args[i].is_floating_point():
            args[i].requires_grad_()
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name, op, args", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_fake_kernel_strides_are_the_real_ones(name, op, args):
    # (opcheck compares shapes and dtypes; the strides matter too: torch.compile's views of the outputs are
    # planned from the fake ones)
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (x if isinstance(x, tuple) else (x,) for x in (real, fake))
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


# -------------------------------------------------------------------------------- torch.compile, torch.export
def _attention_layer(dtype=f64):
    torch.manual_seed(0)
    return at.Attention(16, 4, causal=True, rotary=True, sinks=True, window=(4, 0), dtype=dtype)


def _layer_run(layer, x, key_padding_mask):
    """The layer's output and the gradients of a random linear function of it (input and parameters)."""
    params = [x] + list(layer.parameters())
    out = layer(x, key_padding_mask=key_padding_mask)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
    return [out] + list(torch.autograd.grad(out, params, g))


def _compiled_matches_eager(module, backend, dtype=f64):
    x = torch.randn(2, 7, 16, dtype=dtype, requires_grad=True)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, :2] = True
    eager = _layer_run(module, x, kpm)
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    for a, b in zip(_layer_run(compiled, x, kpm), eager):
        assert_close(a, b, backend)


def test_compile_fullgraph_attention_matches_eager():
    torch._dynamo.reset()
    _compiled_matches_eager(_attention_layer(), "aot_eager")
    torch.manual_seed(1)
    mha = at.MultiheadAttention(16, 4, batch_first=True, dtype=f64)
    x = torch.randn(2, 7, 16, dtype=f64)
    eager = mha(x, x, x, need_weights=True)
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")(x, x, x, need_weights=True)
    for a, b in zip(compiled, eager):
        assert_close(a, b, "MultiheadAttention")


def test_compile_fullgraph_inductor():
    torch._dynamo.reset()
    _compiled_matches_eager(_attention_layer(torch.float32), "inductor", torch.float32)


def test_export_attention_runs_and_matches():
    layer = _attention_layer()
    x = torch.randn(2, 7, 16, dtype=f64)
    program = torch.export.export(layer, (x,))
    calls = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert torch.ops.attnpp.sdpa_forward.default in calls and torch.ops.attnpp.linear.default in calls
    y = torch.randn(2, 7, 16, dtype=f64)
    assert_close(program.module()(y), layer(y), "exported")


def test_compile_fullgraph_transformers_model_matches_eager():
    # A Hugging Face model with attn_implementation="attnpp", its left-padded batch (padding as
    # key_padding_mask, the causal mask as attnpp's flag): traced whole, no graph break
    pytest.importorskip("transformers")
    import attnpp.transformers  # noqa: F401 (registers "attnpp")
    from helpers import hf_model
    torch._dynamo.reset()
    model = hf_model("llama", "attnpp")
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, attention_mask=mask)
    assert_close(compiled.logits, eager, "llama compiled")


# ------------------------------------------------------------------------------------------------ torch.func
def _func_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=f64, generator=g)
    return r(4, 2, 5, 8), r(4, 2, 9, 8), r(4, 2, 9, 6), r(4, 5, 9)


@pytest.mark.parametrize("in_dims, call", [
    ((0, 0, 0, 0), lambda f, q, k, v, m: f(q, k, v, attn_mask=m[:, None] if m.dim() == 3 else m[None])),
    ((0, None, None, None), lambda f, q, k, v, m: f(q, k, v, attn_mask=m)),
    ((None, 0, 0, None), lambda f, q, k, v, m: f(q, k, v, is_causal=True)),
    ((1, 1, 1, None), lambda f, q, k, v, m: f(q, k, v)),  # vmapped dimension inside, entries (4, L, D)
    ((0, 0, 0, 0), lambda f, q, k, v, m: f(q[0], k[0], v[0], attn_mask=m)),  # unbatched (L, D) entries
], ids=["all", "query_only", "keys_only_causal", "inner_dim", "unbatched_entries"])
def test_vmap_equals_torch(in_dims, call):
    q, k, v, m = _func_inputs()
    if in_dims == (0, None, None, None):
        k, v, m = k[0], v[0], m[0]
    if in_dims == (None, 0, 0, None):
        q = q[0]
    ours = torch.func.vmap(lambda *a: call(at.scaled_dot_product_attention, *a), in_dims)(q, k, v, m)
    ref = torch.func.vmap(lambda *a: call(TF.scaled_dot_product_attention, *a), in_dims)(q, k, v, m)
    assert_close(ours, ref, "vmap")


def test_grad_jacrev_and_vmap_grad_equal_torch():
    q, k, v, m = _func_inputs()

    def loss(f):
        return lambda q, k, v: (f(q, k, v, attn_mask=m[0]).sin()).sum()
    grad = lambda f: torch.func.grad(loss(f), argnums=(0, 1, 2))
    for a, b in zip(grad(at.scaled_dot_product_attention)(q, k, v), grad(TF.scaled_dot_product_attention)(q, k, v)):
        assert_close(a, b, "grad")
    for entries in ((q, k, v), (q[:, 0], k[:, 0], v[:, 0])):  # entries (H, L, D), and unbatched (L, D)
        for a, b in zip(torch.func.vmap(grad(at.scaled_dot_product_attention))(*entries),
                        torch.func.vmap(grad(TF.scaled_dot_product_attention))(*entries)):
            assert_close(a, b, "vmap(grad)")
    jac = lambda f: torch.func.jacrev(lambda q: f(q, k[0], v[0], is_causal=True), )(q[0, :, :3])
    assert_close(jac(at.scaled_dot_product_attention), jac(TF.scaled_dot_product_attention), "jacrev")


def _small_model(ours):
    """A one-layer causal attention model with a language-model loss: attnpp.torch's functions or PyTorch's."""
    sdpa, linear = (at.scaled_dot_product_attention, at.linear) if ours else \
        (TF.scaled_dot_product_attention, TF.linear)

    def loss(params, x, target):  # x (L, E), target (L,)
        q, k, v = (linear(x, params[n], params[n + "_b"]).unflatten(-1, (2, 4)).transpose(0, 1) for n in "qkv")
        h = sdpa(q, k, v, is_causal=True).transpose(0, 1).flatten(-2) + x
        if ours:
            return at.linear_cross_entropy(h, params["out"], target)
        return TF.cross_entropy(TF.linear(h, params["out"]), target)
    return loss


def test_per_sample_gradients_equal_torch():
    # vmap(grad(...)) over a batch: each sample's gradients of every parameter, attnpp's against PyTorch's SDPA,
    # linear and cross-entropy
    g = torch.Generator().manual_seed(2)
    params = {n: torch.randn(8, 8, dtype=f64, generator=g) / 3 for n in "qkv"}
    params.update({n + "_b": torch.randn(8, dtype=f64, generator=g) for n in "qkv"})
    params["out"] = torch.randn(13, 8, dtype=f64, generator=g)
    x, target = torch.randn(5, 6, 8, dtype=f64, generator=g), torch.randint(0, 13, (5, 6), generator=g)
    per_sample = lambda ours: torch.func.vmap(torch.func.grad(_small_model(ours)), in_dims=(None, 0, 0))(
        params, x, target)
    ours, ref = per_sample(True), per_sample(False)
    for name in params:
        assert ours[name].shape == (5,) + params[name].shape
        assert_close(ours[name], ref[name], f"per-sample grad of {name}")


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, causal_alignment="bottom_right"),
                                dict(enable_gqa=True), dict(attn_mask="float"), dict(sinks=True)],
                         ids=["plain", "causal_bottom_right", "gqa", "mask", "sinks"])
def test_gradcheck_with_batched_grad(kw):
    kw = dict(kw)
    q, k, v = (t.detach()[:1, :, :3].clone().requires_grad_() for t in qkv(4, 5, H=4))
    if kw.get("enable_gqa"):
        k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    inputs = [q, k, v]
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(3, 3, dtype=f64)
    if kw.pop("sinks", False):
        inputs.append(torch.randn(4, dtype=f64, requires_grad=True))
    f = lambda q, k, v, *s: at.scaled_dot_product_attention(q, k, v, sinks=s[0] if s else None, **kw)
    assert gradcheck(f, inputs, check_batched_grad=True)


def test_gradcheck_with_batched_grad_linear_loss_and_rotary():
    x, w, b = (torch.randn(*s, dtype=f64, requires_grad=True) for s in ((3, 4), (5, 4), (5,)))
    assert gradcheck(at.linear, (x, w, b), check_batched_grad=True)
    target = torch.tensor([0, 4, -100])
    for reduction in ("mean", "none"):
        assert gradcheck(lambda x, w, b: at.linear_cross_entropy(x, w, target, b, reduction=reduction,
                                                                 label_smoothing=0.1), (x, w, b),
                         check_batched_grad=True)
    h = torch.randn(2, 3, 4, dtype=f64, requires_grad=True)
    assert gradcheck(lambda h: _ops.apply_rotary(h, 4, 100.0, False, 2), (h,), check_batched_grad=True)


def test_double_backward_refused():
    q, k, v = qkv(3, 4)
    (gq,) = torch.autograd.grad(at.scaled_dot_product_attention(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="attnpp's backward is not differentiable"):
        gq.sum().backward()


# --------------------------------------------------------------------------------------------- error classes
@pytest.mark.parametrize("make", [
    lambda q, k, v: (q, k.float(), v, {}),                                              # mixed dtypes
    lambda q, k, v: (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], {}),                           # 1-D query
    lambda q, k, v: (q, k[..., :5], v, {}),                                             # D differs
    lambda q, k, v: (q, k, v[:, :, :4], {}),                                            # S differs
    lambda q, k, v: (q, k, v, dict(attn_mask=torch.zeros(2, 9, dtype=f64))),            # mask does not broadcast
    lambda q, k, v: (q, k, v, dict(attn_mask=torch.zeros(5, 9, dtype=torch.int32))),    # mask dtype
    lambda q, k, v: (q, k, v, dict(dropout_p=1.5)),                                     # dropout_p
], ids=["mixed_dtypes", "1d_query", "head_dim", "key_value_length", "mask_shape", "mask_dtype", "dropout_p"])
def test_errors_are_runtime_errors_where_torch_raises_one(make):
    q, k, v, kw = make(*(t.detach() for t in qkv(5, 9)))
    with pytest.raises(RuntimeError):  # (PyTorch's class)
        TF.scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(RuntimeError) as caught:
        at.scaled_dot_product_attention(q, k, v, **kw)
    assert isinstance(caught.value, (ValueError, TypeError))  # (and attnpp's class of before)
    assert isinstance(caught.value, (at.TorchValueError, at.TorchTypeError))


def test_error_messages_unchanged():
    # attnpp.functional's message on NumPy arrays, the same words from attnpp.torch
    import attnpp.functional as AF
    q, k, v = (t.detach() for t in qkv(5, 9))
    mask = torch.zeros(2, 9, dtype=f64)
    with pytest.raises(ValueError) as plain:
        AF.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy())
    with pytest.raises(at.TorchValueError) as ours:
        at.scaled_dot_product_attention(q, k, v, mask)
    assert str(ours.value) == str(plain.value)
    with pytest.raises(RuntimeError, match="attn_mask must be None when is_causal=True"):
        at.scaled_dot_product_attention(q, k, v, torch.zeros(5, 9, dtype=f64), is_causal=True)
    with pytest.raises(at.TorchTypeError, match="expected a torch.Tensor"):
        at.scaled_dot_product_attention(q.numpy(), k, v)


def _scalar_cases(where):
    from attnpp._checks import ARGUMENTS
    return [pytest.param(name, value, exc, id=f"{name}={value!r}") for name, kind in ARGUMENTS[where].items()
            for value, exc in kind.refuses]


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("name, value, exc", _scalar_cases("functional.scaled_dot_product_attention"))
def test_attention_scalars_refused_as_functional_refuses_them(name, value, exc, grad):
    """Each refused value of a scalar argument (attnpp._checks.ARGUMENTS) raises what functional raises on NumPy
    arrays, the same message, before the operator (whose schema raised a bare RuntimeError for a wrong type, and
    took 1 or None for enable_gqa) — found by tools/fuzz.py's torch.scaled_dot_product_attention calls."""
    import attnpp.functional as AF
    q, k, v = (t.detach().requires_grad_(grad) for t in qkv(5, 9))
    with pytest.raises(exc) as plain:
        AF.scaled_dot_product_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), **{name: value})
    with pytest.raises(exc) as ours:
        at.scaled_dot_product_attention(q, k, v, **{name: value})
    assert isinstance(ours.value, (at.TorchValueError, at.TorchTypeError))
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("name, value, exc", _scalar_cases("functional.scaled_dot_product_attention_varlen"))
def test_varlen_scalars_refused_as_functional_refuses_them(name, value, exc):
    """The same for the varlen operator's scalars."""
    import attnpp.functional as AF
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(7, 2, 4, dtype=f64, generator=g).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 3, 7])
    with pytest.raises(exc) as plain:
        AF.scaled_dot_product_attention_varlen(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                                               cu.numpy(), cu.numpy(), **{name: value})
    with pytest.raises(exc) as ours:
        at.scaled_dot_product_attention_varlen(q, k, v, cu, cu, **{name: value})
    assert isinstance(ours.value, (at.TorchValueError, at.TorchTypeError))
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("name, value, exc", _scalar_cases("functional.linear_cross_entropy"))
def test_linear_cross_entropy_scalars_refused_as_functional_refuses_them(name, value, exc):
    """The same for linear_cross_entropy's ignore_index, reduction and label_smoothing (the schema took True for
    an int and "0.1" for a float)."""
    import attnpp.functional as AF
    x, w = torch.randn(3, 4, dtype=f64, requires_grad=True), torch.randn(5, 4, dtype=f64, requires_grad=True)
    target = torch.tensor([0, 4, 2])
    with pytest.raises(exc) as plain:
        AF.linear_cross_entropy(x.detach().numpy(), w.detach().numpy(), target.numpy(), **{name: value})
    with pytest.raises(exc) as ours:
        at.linear_cross_entropy(x, w, target, **{name: value})
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_varlen_equals_each_sequence_alone(dtype):
    """scaled_dot_product_attention_varlen over packed sequences (an empty one included; GQA, causal): the output
    and the gradients of query, key and value equal PyTorch's scaled_dot_product_attention of each sequence
    alone."""
    g = torch.Generator().manual_seed(4)
    lengths = [5, 0, 9, 2]
    q, k, v = (torch.randn(16, h, 8, dtype=dtype, generator=g).requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 5, 14, 16])

    def alone(q, k, v):
        heads = lambda x, a, b: x[a:b].transpose(0, 1)[None]
        outs = [TF.scaled_dot_product_attention(heads(q, a, b), heads(k, a, b), heads(v, a, b), is_causal=True,
                                                enable_gqa=True)[0].transpose(0, 1)
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
        return torch.cat(outs)
    assert sum(lengths) == 16
    assert_same_as_torch(lambda q, k, v: at.scaled_dot_product_attention_varlen(q, k, v, cu, cu, is_causal=True),
                         alone, [q, k, v], "varlen")


def test_varlen_gradcheck_with_variants():
    """Window, soft-capping and sinks (with their gradient) through the varlen operator: finite differences."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(7, h, 4, dtype=f64, generator=g).requires_grad_() for h in (2, 1, 1))
    sinks = torch.randn(2, dtype=f64, generator=g).requires_grad_()
    cu = torch.tensor([0, 3, 7])
    f = lambda q, k, v, s: at.scaled_dot_product_attention_varlen(q, k, v, cu, cu, is_causal=True, window=(1, 0),
                                                                  softcap=2.0, sinks=s)
    assert gradcheck(f, (q, k, v, sinks))
