"""attnpp's fused linear + cross-entropy against PyTorch's cross_entropy(linear(...)): the loss and the gradients
of input, weight and bias, for every reduction, ignored targets, label smoothing, one row, rows spanning several
chunks (V = 50,257: a chunk holds 256 float32 rows, 128 float64 ones), one class; through attnpp.functional (the
gradients computed in the forward, and recomputed in the backward), attnpp.nn and attnpp.torch.

The reference is PyTorch in float64 for both dtypes (float64: <= 1e-10, float32: <= 2e-5, relative to
max(1, |ref|)): PyTorch's own float32 gradient with label smoothing at V = 50,257 is 2e-5 off its float64 one (it
sums 50,257 log-probabilities in float32), where attnpp's (each row's sums in double) is 1e-6 off.
"""
import numpy as np
import pytest
import torch

import attnpp
import attnpp.functional as AF
import attnpp.nn as ann
import attnpp.torch as AT

TOL = {np.float64: 1e-10, np.float32: 2e-5}
CASES = [  # (input shape, V): one row, one class, a 3-D input, rows over several chunks of the vocabulary's logits;
    # a width narrower than a vector (the narrow path, by blocks of the vocabulary: several blocks and row chunks,
    # and article 001's size)
    ((1, 8), 5), ((37, 16), 1), ((4, 7, 16), 300), ((500, 16), 50257), ((64, 5), 300), ((200, 5), 3000),
    ((30, 5), 50257)]


def max_rel(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref) / np.maximum(1.0, np.abs(ref)), initial=0.0))


def torch_reference(x, w, t, b, grad_output, softcap=None, **kw):
    """PyTorch's loss and (input, weight, bias) gradients in float64, for grad_output; the logits soft-capped
    (softcap * tanh(logits / softcap)) with softcap."""
    tx, tw = torch.tensor(x, dtype=torch.float64, requires_grad=True), torch.tensor(w, dtype=torch.float64,
                                                                                      requires_grad=True)
    tb = None if b is None else torch.tensor(b, dtype=torch.float64, requires_grad=True)
    logits = torch.nn.functional.linear(tx, tw, tb)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, w.shape[0]), torch.tensor(t).reshape(-1), **kw)
    if kw.get("reduction") == "none":
        loss = loss.reshape(t.shape)
    (loss * torch.tensor(grad_output, dtype=torch.float64)).sum().backward()
    return loss.detach().numpy(), (tx.grad.numpy(), tw.grad.numpy(), None if b is None else tb.grad.numpy())


def case_arrays(rng, shape, V, dtype, bias=True):
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal((V, shape[-1])) * 0.3).astype(dtype)
    b = rng.standard_normal(V).astype(dtype) if bias else None
    t = rng.integers(0, V, shape[:-1])
    t.reshape(-1)[1::3] = -100  # ignored rows (every third, from the second: one row keeps its target)
    return x, w, t, b


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, V", CASES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("in_forward", [True, False], ids=["grads_in_forward", "recomputed"])
def test_matches_torch(rng, dtype, shape, V, reduction, label_smoothing, in_forward):
    x, w, t, b = case_arrays(rng, shape, V, dtype, bias=V != 300 or shape[0] != 64)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    g = rng.standard_normal(t.shape) if reduction == "none" else np.float64(1.7)
    loss, grads = torch_reference(x, w, t, b, g, **kw)
    fwd = AF.linear_cross_entropy_forward(x, w, t, b, compute_grads=in_forward, **kw)
    assert (fwd.grads is not None) == (in_forward and reduction != "none")
    assert fwd.loss.dtype == dtype and fwd.loss.shape == loss.shape and fwd.logsumexp.shape == t.shape
    ours = AF.linear_cross_entropy_backward(g.astype(dtype), x, w, t, fwd.logsumexp, b, grads=fwd.grads, **kw)
    assert max_rel(fwd.loss, loss) <= TOL[dtype]
    np.testing.assert_array_equal(AF.linear_cross_entropy(x, w, t, b, **kw), fwd.loss)
    for name, o, r in zip(("input", "weight", "bias"), ours, grads):
        assert (o is None) == (r is None), name
        if r is not None:
            assert o.dtype == dtype and o.shape == r.shape, name
            assert max_rel(o, r) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, V", [((4, 7, 16), 300), ((37, 16), 1000), ((200, 5), 3000)], ids=str)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("in_forward", [True, False], ids=["grads_in_forward", "recomputed"])
def test_softcap_matches_torch(rng, dtype, shape, V, label_smoothing, in_forward):
    """Soft-capped logits (Gemma 2's final_logit_softcapping): the loss of softcap * tanh(z / softcap) and its
    gradients, through the cap's derivative, on the wide path (vocabulary rows in blocks of 128) and the narrow
    one (blocks of 1,024 columns); a cap of 2 on logits of about +-5 saturates many of them."""
    x, w, t, b = case_arrays(rng, shape, V, dtype)
    x *= 3
    kw = dict(reduction="mean", label_smoothing=label_smoothing)
    loss, grads = torch_reference(x, w, t, b, np.float64(0.7), softcap=2.0, **kw)
    assert max_rel(loss, torch_reference(x, w, t, b, 1.0, **kw)[0]) > 1e-2  # the cap changes the loss
    fwd = AF.linear_cross_entropy_forward(x, w, t, b, compute_grads=in_forward, softcap=2.0, **kw)
    ours = AF.linear_cross_entropy_backward(dtype(0.7), x, w, t, fwd.logsumexp, b, grads=fwd.grads, softcap=2.0,
                                            **kw)
    assert max_rel(fwd.loss, loss) <= TOL[dtype]
    for name, o, r in zip(("input", "weight", "bias"), ours, grads):
        assert max_rel(o, r) <= TOL[dtype], name


def test_every_target_ignored_gives_nan_mean_and_zero_grads(rng):
    x, w, _, b = case_arrays(rng, (3, 4), 6, np.float64)
    t = np.full(3, -100)
    fwd = AF.linear_cross_entropy_forward(x, w, t, b)
    ref = torch.nn.functional.cross_entropy(torch.tensor(x) @ torch.tensor(w).T + torch.tensor(b), torch.tensor(t))
    assert np.isnan(fwd.loss) and torch.isnan(ref)
    assert all((g == 0).all() for g in fwd.grads)


def test_confident_float32_row_keeps_its_small_loss():
    """A row whose target logit is far above 50,256 others: the loss is their tiny sum, not 0 (sums in double)."""
    E, V = 4, 50257
    w = np.zeros((V, E), np.float32)
    w[0, 0] = 1.0
    x = np.array([[20.0, 0, 0, 0]], np.float32)
    loss = AF.linear_cross_entropy(x, w, np.array([0]))
    assert loss == pytest.approx(np.log1p((V - 1) * np.exp(-20.0)), rel=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_error_at_most_torchs(rng, dtype):
    """In half precision the error against float64 is at most 1.5 times PyTorch's cross_entropy(linear(...))
    in the same dtype (attnpp computes in float32 on float32 copies and rounds each gradient once)."""
    x, w, t, b = case_arrays(rng, (40, 32), 1000, np.float64)
    torch_dt = getattr(torch, dtype)
    tx, tw, tb = (torch.tensor(a).to(torch_dt) for a in (x, w, b))
    halves = [AT.to_numpy(a) for a in (tx, tw, tb)]
    ref_loss, ref_grads = torch_reference(*(a.double().numpy() for a in (tx, tw)), t, tb.double().numpy(), 1.0)
    fwd = AF.linear_cross_entropy_forward(halves[0], halves[1], t, halves[2])
    ours = AF.linear_cross_entropy_backward(1.0, halves[0], halves[1], t, fwd.logsumexp, halves[2], grads=fwd.grads)
    leaves = [a.clone().requires_grad_() for a in (tx, tw, tb)]
    theirs = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*leaves), torch.tensor(t))
    theirs.backward()
    assert max_rel(fwd.loss.astype(np.float64), ref_loss) <= 1.5 * max(max_rel(theirs.item(), ref_loss), 1e-3)
    for o, leaf, r in zip(ours, leaves, ref_grads):
        err_ours = float(np.max(np.abs(o.astype(np.float64) - r)))
        err_theirs = float(np.max(np.abs(leaf.grad.double().numpy() - r)))
        assert err_ours <= 1.5 * err_theirs


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_torch_function_matches_and_gradchecks(rng, softcap):
    x, w, t, b = case_arrays(rng, (3, 5, 6), 11, np.float64)
    leaves = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    target = torch.tensor(t)
    for reduction in ("mean", "sum", "none"):
        kw = dict(reduction=reduction, label_smoothing=0.2)
        loss = AT.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], softcap=softcap, **kw)
        logits = torch.nn.functional.linear(*leaves)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), **kw)
        assert torch.allclose(loss, ref.reshape(loss.shape), rtol=0, atol=1e-12)
        assert torch.autograd.gradcheck(
            lambda *a: AT.linear_cross_entropy(a[0], a[1], target, a[2], softcap=softcap, **kw), tuple(leaves))



def test_torch_backward_hands_the_forward_gradients_on(rng):
    """The gradients the forward computed are scaled by the loss's gradient (here 1 / 7, as a loss divided by
    num_items_in_batch) and become the leaves' gradients, PyTorch's to float64's roundoff; a retained graph's second
    backward computes them anew and adds the same again."""
    x, w, t, b = case_arrays(rng, (3, 5, 6), 11, np.float64)
    ours = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    theirs = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    target = torch.tensor(t)
    loss = AT.linear_cross_entropy(*ours[:2], target, ours[2], reduction="sum") / 7
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*theirs).reshape(-1, 11), target.reshape(-1),
                                            reduction="sum") / 7
    for _ in range(2):
        loss.backward(retain_graph=True)
        ref.backward(retain_graph=True)
        for name, a, r in zip(("input", "weight", "bias"), ours, theirs):
            np.testing.assert_allclose(a.grad.numpy(), r.grad.numpy(), rtol=0, atol=1e-12, err_msg=name)


def test_torch_backward_allocates_nothing_of_the_weights_size(rng):
    """The backward of the fused loss hands on the weight's gradient the forward computed, in place: no op of it
    returns new memory of the weight's size (not a copy, nor zeros for the unused outputs' gradients, the
    logsumexp's and the forward gradients', which autograd would otherwise materialise)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    x, w, t, _ = case_arrays(rng, (4, 8), 300, np.float32)
    x, w = (torch.tensor(a, requires_grad=True) for a in (x, w))
    loss = AT.linear_cross_entropy(x, w, torch.tensor(t))
    new = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            known = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() >= w.untyped_storage().nbytes() \
                        and o.untyped_storage().data_ptr() not in known:
                    new.append(str(func))
            return out
    with Allocations():
        loss.backward()
    assert new == []
    ref = torch.nn.functional.cross_entropy(x.detach() @ w.detach().T, torch.tensor(t))
    assert torch.allclose(loss, ref)

def test_layer_forward_backward_and_no_grad(rng):
    x, w, t, b = case_arrays(rng, (6, 8), 13, np.float64)
    layer = ann.LinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    loss = layer(x, w, t, b)
    grads = layer.backward(0.5)
    ref_loss, ref_grads = torch_reference(x, w, t, b, 0.5, reduction="sum", label_smoothing=0.1)
    assert max_rel(loss, ref_loss) <= 1e-12
    for o, r in zip(grads, ref_grads):
        assert max_rel(o, r) <= 1e-12
    with attnpp.no_grad():
        layer(x, w, t, b)
    with pytest.raises(ValueError, match="no forward context"):
        layer.backward()
