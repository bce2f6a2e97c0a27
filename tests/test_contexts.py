"""One saved context per forward: layers used several times before their backward, ``attnpp.no_grad``, and
the functional calls' inputs (the returned dropout seed, arrays given through ``__array__`` / ``__dlpack__``).

References: PyTorch's autograd on the same graph (weight sharing, an evaluation forward in between)."""
import gc
import threading
import warnings
import weakref

import numpy as np
import pytest
import torch

import attnpp
import attnpp.functional as AF
from helpers import DTYPES, TORCH, assert_close


def grads_match(ours, ref, dtype):
    """Every parameter gradient of the attnpp layer equals the PyTorch module's (same state-dict names)."""
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, theirs[name].grad.numpy(), dtype, f"{name}.grad")


def torch_linear_pair(dtype, n, seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.Linear(n, n, dtype=TORCH[dtype])
    lin = attnpp.nn.Linear(n, n, dtype=dtype)
    lin.load_state_dict(ref.state_dict())
    return lin, ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_applied_twice_sums_both_contributions(rng, dtype):
    """y = lin(lin(x)): the backwards consume the second forward first, and .grad holds both terms."""
    lin, ref = torch_linear_pair(dtype, 5)
    x = rng.standard_normal((3, 5)).astype(dtype)
    g = rng.standard_normal((3, 5)).astype(dtype)
    y = lin(lin(x))
    gx = lin.backward(lin.backward(g))
    tx = torch.tensor(x, requires_grad=True)
    ty = ref(ref(tx))
    (ty * torch.tensor(g)).sum().backward()
    assert_close(y, ty.detach().numpy(), dtype, "output")
    assert_close(gx, tx.grad.numpy(), dtype, "grad input")
    grads_match(lin, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multihead_attention_applied_twice(rng, dtype):
    torch.manual_seed(1)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=TORCH[dtype])
    mha = attnpp.nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype)
    mha.load_state_dict(ref.state_dict())
    x = rng.standard_normal((2, 6, 8)).astype(dtype)
    g = rng.standard_normal((2, 6, 8)).astype(dtype)
    h, _ = mha(x, x, x, need_weights=False)
    y, _ = mha(h, h, h, need_weights=False)
    dh = sum(mha.backward(g))  # second use: query, key and value are h
    dx = sum(mha.backward(dh))
    tx = torch.tensor(x, requires_grad=True)
    th, _ = ref(tx, tx, tx, need_weights=False)
    ty, _ = ref(th, th, th, need_weights=False)
    (ty * torch.tensor(g)).sum().backward()
    assert_close(y, ty.detach().numpy(), dtype, "output")
    assert_close(dx, tx.grad.numpy(), dtype, "grad x")
    grads_match(mha, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_evaluation_forward_under_no_grad_in_between(rng, dtype):
    """A training forward, an evaluation forward under no_grad (other input, same shape), then the training
    backward: the gradients are the training forward's, as PyTorch's."""
    torch.manual_seed(2)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=TORCH[dtype])
    mha = attnpp.nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype)
    mha.load_state_dict(ref.state_dict())
    x1, x2, g = (rng.standard_normal((2, 5, 8)).astype(dtype) for _ in range(3))
    mha(x1, x1, x1)
    with attnpp.no_grad():
        mha.eval()
        y2, _ = mha(x2, x2, x2)
        mha.train()
    dq, dk, dv = mha.backward(g)
    t1 = torch.tensor(x1, requires_grad=True)
    ty1, _ = ref(t1, t1, t1)
    with torch.no_grad():
        ty2, _ = ref.eval()(torch.tensor(x2), torch.tensor(x2), torch.tensor(x2))
    (ty1 * torch.tensor(g)).sum().backward()
    assert_close(y2, ty2.numpy(), dtype, "evaluation output")
    assert_close(dq + dk + dv, t1.grad.numpy(), dtype, "grad x1")
    grads_match(mha, ref, dtype)


@pytest.mark.parametrize("make", [
    lambda: attnpp.nn.Linear(4, 4, dtype=np.float64),
    lambda: attnpp.nn.Attention(4, 2, causal=True, dtype=np.float64),
], ids=["linear", "attention"])
def test_contexts_are_consumed_last_in_first_out(rng, make):
    """Two forwards of different shapes: the backward must match the most recent (else a clear error and the
    context stays); then the older one; then none is left."""
    layer = make()
    x1, x2 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4))
    y1, y2 = layer(x1), layer(x2)
    with pytest.raises(ValueError, match=r"grad_output: expected .*\(2, 5, 4\).*most recent"):
        layer.backward(np.ones_like(y1))
    assert layer.backward(np.ones_like(y2)).shape == x2.shape
    assert layer.backward(np.ones_like(y1)).shape == x1.shape
    with pytest.raises(ValueError, match="no forward context left"):
        layer.backward(np.ones_like(y1))


def test_no_grad_saves_nothing_and_keeps_no_input_alive(rng):
    lin = attnpp.nn.Linear(4, 2, dtype=np.float64)
    x = rng.standard_normal((3, 4))
    alive = weakref.ref(x)
    with attnpp.no_grad():
        y = lin(x)
    del x
    gc.collect()
    assert alive() is None  # nothing saved it
    with pytest.raises(ValueError, match="no forward context left"):
        lin.backward(np.ones_like(y))
    x = rng.standard_normal((3, 4))
    alive = weakref.ref(x)
    lin(x)
    del x
    gc.collect()
    assert alive() is not None  # the context holds the input until the backward
    lin.backward(np.ones((3, 2)))
    gc.collect()
    assert alive() is None


def test_no_grad_as_decorator_nesting_and_threads():
    assert attnpp.is_grad_enabled()

    @attnpp.no_grad()
    def evaluate():
        inner = attnpp.is_grad_enabled()
        with attnpp.enable_grad():
            return inner, attnpp.is_grad_enabled()

    assert evaluate() == (False, True) and attnpp.is_grad_enabled()
    seen = []
    with attnpp.no_grad():  # per thread, as PyTorch's grad mode: another thread still records
        t = threading.Thread(target=lambda: seen.append(attnpp.is_grad_enabled()))
        t.start()
        t.join()
        assert not attnpp.is_grad_enabled()
    assert seen == [True] and attnpp.is_grad_enabled()
    with pytest.raises(RuntimeError):
        with attnpp.no_grad():
            raise RuntimeError  # the mode is restored on an exception too
    assert attnpp.is_grad_enabled()


def test_each_thread_consumes_its_own_contexts(rng):
    """Thread A's forward, then thread B's forward and backward, then A's backward: A gets its own gradients."""
    lin, ref = torch_linear_pair(np.float64, 4, seed=3)
    xa, xb, g = (rng.standard_normal((3, 4)) for _ in range(3))
    lin(xa)
    out = {}

    def other():
        lin(xb)
        out["b"] = lin.backward(g)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    grad_b = {n: p.grad.copy() for n, p in lin.named_parameters()}
    lin.zero_grad()
    lin.backward(g)
    ta = torch.tensor(xa)
    (ref(ta) * torch.tensor(g)).sum().backward()
    grads_match(lin, ref, np.float64)
    np.testing.assert_allclose(grad_b["weight"], g.T @ xb, rtol=1e-12)


def test_failed_composite_forward_leaves_no_sub_layer_context(rng, monkeypatch):
    """A forward that fails after its projections ran keeps no context in them (none would be consumed)."""
    layer = attnpp.nn.Attention(4, 2, dtype=np.float64)
    x = rng.standard_normal((2, 3, 4))
    layer(x)  # one good context, to be consumed after the failure

    def fail(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(attnpp.nn.attention._core, "sdpa_forward", fail)
    with pytest.raises(MemoryError, match="simulated"):
        layer(rng.standard_normal((2, 7, 4)))
    monkeypatch.undo()
    assert layer.backward(np.ones((2, 3, 4))).shape == x.shape  # the first forward's, in every sub-layer
    for m in layer.modules():
        with pytest.raises(ValueError, match="no forward context left"):
            m.backward(np.ones((2, 3, 4)))


def test_pending_contexts_warn_once(rng):
    lin = attnpp.nn.Linear(2, 2, dtype=np.float64)
    x = rng.standard_normal((1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(attnpp.nn.module.PENDING_CONTEXTS_WARNING + 5):
            lin(x)
    found = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(found) == 1 and "no_grad" in str(found[0].message)


# ------------------------------------------------------------------------------------------------- functional
def test_forward_returns_the_dropout_seed_it_drew(rng):
    q, k, v = (rng.standard_normal((2, 2, 6, 4)) for _ in range(3))
    attnpp.manual_seed(5)
    out, lse, seed = AF.scaled_dot_product_attention_forward(q, k, v, dropout_p=0.4)
    assert isinstance(seed, int)
    np.testing.assert_array_equal(out, AF.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=seed))
    # the returned seed's mask is the one applied: dropped weights contribute nothing
    keep = AF.dropout_mask((2, 2, 6, 6), 0.4, seed)
    w = AF.scaled_dot_product_attention_weights(q, k)
    np.testing.assert_allclose(out, np.where(keep, w / 0.6, 0) @ v, rtol=1e-12, atol=1e-14)
    g = rng.standard_normal(out.shape)
    grads = AF.scaled_dot_product_attention_backward(g, q, k, v, out, lse, dropout_p=0.4, seed=seed)
    tq, tk, tv = (torch.tensor(t, requires_grad=True) for t in (q, k, v))
    tw = torch.softmax(tq @ tk.transpose(-1, -2) / 2.0, dim=-1)
    ((torch.where(torch.tensor(keep), tw / 0.6, 0) @ tv) * torch.tensor(g)).sum().backward()
    for ours, t in zip(grads, (tq, tk, tv)):
        assert_close(ours, t.grad.numpy(), np.float64, "grad")
    assert AF.scaled_dot_product_attention_forward(q, k, v).seed is None  # no dropout, no seed


def test_functional_calls_take_tensors_without_copies(rng):
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(5, 5) > 0.3
    out = AF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(out, ref.numpy(), np.float64, "output")
    # an output argument given as a tensor is written through (dlpack shares the memory)
    x, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    lin = attnpp.nn.Linear(4, 2, dtype=np.float64)
    grad_w = torch.zeros(2, 4, dtype=torch.float64)
    AF.linear_backward(g, x, lin.weight, grad_w)  # (a Parameter converts through __array__)
    np.testing.assert_allclose(grad_w.numpy(), (g.T @ x).numpy(), rtol=1e-12)
    assert_close(lin(x), (x @ torch.tensor(lin.weight.data).T + torch.tensor(lin.bias.data)).numpy(),
                 np.float64, "linear on a tensor")


@pytest.mark.parametrize("value, words", [
    (torch.ones(2, 3, 4, requires_grad=True), "detach"),
    ([[1.0, 2.0]], "numpy.asarray"),
    ("abc", "numpy.asarray"),
])
def test_functional_refuses_what_it_cannot_view(value, words):
    with pytest.raises(TypeError, match=words):
        AF.scaled_dot_product_attention(value, np.ones((2, 3, 4), np.float32), np.ones((2, 3, 4), np.float32))


def test_written_arguments_must_share_memory():
    class Copying:  # __array__ that returns a copy: a write into it would be lost, so it is refused
        def __array__(self, dtype=None, copy=None):
            return np.zeros((2, 4))

    with pytest.raises(TypeError, match="grad_weight.*__dlpack__"):
        AF.linear_backward(np.ones((3, 2)), np.ones((3, 4)), np.ones((2, 4)), Copying())
