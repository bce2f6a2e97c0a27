"""Parity of the training pieces with PyTorch: Embedding, Dropout, cross-entropy, SGD, AdamW."""
import numpy as np
import pytest
import torch

import attnpp
import attnpp.functional as AF
from helpers import DTYPES, TORCH, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (2, 5), ()], ids=str)
def test_embedding(rng, dtype, shape):
    ref = torch.nn.Embedding(11, 4, dtype=TORCH[dtype])
    emb = attnpp.nn.Embedding(11, 4, dtype=dtype)
    emb.load_state_dict(ref.state_dict())
    idx = rng.integers(0, 11, shape)
    idx.flat[:1] = 3  # repeated indices must add up in the gradient
    if idx.size > 1:
        idx.flat[-1] = 3
    out = emb(idx)
    g = rng.standard_normal(out.shape).astype(dtype)
    tout = ref(torch.tensor(idx))
    (tout * torch.tensor(g)).sum().backward()
    assert emb.backward(g) is None
    assert_close(out, tout.detach().numpy(), dtype, "output")
    assert_close(emb.weight.grad, ref.weight.grad.numpy(), dtype, "grad weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_layer_replays_mask(rng, dtype):
    drop = attnpp.nn.Dropout(0.3)
    x = rng.standard_normal((4, 50)).astype(dtype)
    y = drop(x, seed=11)
    keep = AF.dropout_mask(x.shape, 0.3, drop.last_seed)
    np.testing.assert_allclose(y, np.where(keep, x / dtype(0.7), 0), rtol=1e-6 if dtype == np.float32 else 1e-15)
    g = rng.standard_normal(x.shape).astype(dtype)
    tx = torch.tensor(x, requires_grad=True)
    (tx * torch.tensor(keep) / (1 - 0.3) * torch.tensor(g)).sum().backward()
    assert_close(drop.backward(g), tx.grad.numpy(), dtype, "grad")
    drop.eval()
    assert drop(x) is x and drop.backward(g) is g
    assert abs(AF.dropout_mask((200, 200), 0.3, 5).mean() - 0.7) < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy(rng, dtype, reduction, ignore):
    x = (rng.standard_normal((6, 50257)) * 3).astype(dtype)
    t = rng.integers(0, 50257, 6)
    if ignore:
        t[2] = -100
    loss_fn = attnpp.nn.CrossEntropyLoss(reduction=reduction)
    loss = loss_fn(x, t)
    g = np.asarray(rng.standard_normal(loss.shape), dtype)
    tx = torch.tensor(x, requires_grad=True)
    tloss = torch.nn.functional.cross_entropy(tx, torch.tensor(t), reduction=reduction)
    (tloss * torch.tensor(g)).sum().backward()
    assert loss.dtype == dtype
    assert_close(loss, tloss.detach().numpy(), dtype, "loss")
    assert_close(loss_fn.backward(g), tx.grad.numpy(), dtype, "grad input")


def test_cross_entropy_single_row_and_all_ignored(rng):
    x = rng.standard_normal(10)
    ref = torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(4))
    assert_close(AF.cross_entropy(x, np.array(4)), ref.numpy(), np.float64, "1-D")
    all_ignored = AF.cross_entropy(rng.standard_normal((2, 3)), np.array([-100, -100]))
    assert np.isnan(all_ignored)  # PyTorch gives NaN too


def _params_pair(dtype, rng):
    ref = torch.nn.Linear(5, 3, dtype=TORCH[dtype])
    ours = attnpp.nn.Linear(5, 3, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _train(ref, ours, make_opts, dtype, rng, steps=30):
    t_opt, a_opt = make_opts(ref, ours)
    x = rng.standard_normal((8, 5)).astype(dtype)
    for _ in range(steps):
        g = rng.standard_normal((8, 3)).astype(dtype)
        t_opt.zero_grad(), a_opt.zero_grad()
        (ref(torch.tensor(x)) * torch.tensor(g)).sum().backward()
        ours(x)
        ours.backward(g)
        t_opt.step(), a_opt.step()
    for name, p in ours.named_parameters():
        assert_close(p.data, dict(ref.named_parameters())[name].detach().numpy(), dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True),
                                dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.01)], ids=str)
def test_sgd(rng, dtype, kw):
    _train(*_params_pair(dtype, rng), lambda r, o: (torch.optim.SGD(r.parameters(), **kw),
                                                   attnpp.optim.SGD(o.parameters(), **kw)), dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)], ids=str)
def test_adamw(rng, dtype, kw):
    _train(*_params_pair(dtype, rng), lambda r, o: (torch.optim.AdamW(r.parameters(), **kw),
                                                   attnpp.optim.AdamW(o.parameters(), **kw)), dtype, rng)


def test_training_bad_input(rng):
    emb = attnpp.nn.Embedding(5, 2)
    with pytest.raises(IndexError, match="input.*5.*range"):
        emb(np.array([0, 5]))
    with pytest.raises(TypeError, match="input.*integer"):
        emb(np.array([0.0, 1.0]))
    np.testing.assert_array_equal(emb(np.array([1])), emb.weight.data[[1]])  # still usable
    with pytest.raises(IndexError, match="target.*7"):
        AF.cross_entropy(rng.standard_normal((2, 7)), np.array([0, 7]))
    with pytest.raises(ValueError, match="target.*shape"):
        AF.cross_entropy(rng.standard_normal((2, 7)), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="reduction"):
        AF.cross_entropy(rng.standard_normal((2, 7)), np.array([0, 1]), reduction="avg")
    with pytest.raises(ValueError, match="backward"):
        attnpp.nn.CrossEntropyLoss().backward()
    with pytest.raises(ValueError, match="p must be in"):
        attnpp.nn.Dropout(1.0)
    with pytest.raises(TypeError, match="params"):
        attnpp.optim.SGD([np.zeros(3)], lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        attnpp.optim.AdamW(emb.parameters(), lr=-1.0)


def test_cross_entropy_confident_float32_row_keeps_its_small_loss():
    """One logit 20 above 50,256 others: the loss is log1p(50256 e^-20) ~ 1.04e-4. A float32 running sum would
    drop every small term after the large one (PyTorch's own float32 answer is 6% off here); attnpp sums in
    double and takes p - 1 at the target as expm1, so loss and gradient match the float64 values."""
    x = np.zeros((1, 50257), np.float32)
    x[0, 2159] = 20.0
    y = np.array([2159])
    loss, stats = AF.cross_entropy_forward(x, y)
    exact = np.log1p(50256 * np.exp(-20.0))
    assert abs(float(loss) - exact) / exact < 1e-6
    grad = AF.cross_entropy_backward(np.float32(1.0), x, y, stats)
    ref64 = torch.nn.functional.softmax(torch.tensor(x, dtype=torch.float64), -1).numpy()
    ref64[0, 2159] -= 1
    assert np.abs(grad - ref64).max() / np.abs(ref64).max() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_rows_do_not_depend_on_alignment(rng, dtype, reduction):
    """Equal rows give bitwise equal losses and gradient rows, whatever the alignment of each row in memory (37
    classes: the rows start at every offset modulo the vector width). Eigen computes an output's elements before
    its first aligned address with the scalar exp, which may differ from its vector exp in the last bit; the
    result then depended on where NumPy happened to put the output."""
    N, C = 16, 37
    logits = np.repeat(rng.standard_normal((1, C)).astype(dtype), N, axis=0)   # (N, C), equal rows
    target = np.full(N, 5)
    loss_fn = attnpp.nn.CrossEntropyLoss(reduction=reduction)
    loss_fn(logits, target)
    grad = loss_fn.backward()
    for i in range(1, N):
        np.testing.assert_array_equal(grad[i], grad[0], err_msg=f"row {i}")
    losses = AF.cross_entropy(logits, target, reduction="none")
    np.testing.assert_array_equal(losses, np.full(N, losses[0]))
