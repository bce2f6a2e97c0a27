"""Copies and checkpoints: pickle and deepcopy of layers and optimizers, optimizers' param_groups and state
dicts against torch.optim, zero_grad(set_to_none), load_state_dict(strict=False), reprs against PyTorch's, and a
training run resumed from a checkpoint ending bitwise equal to the uninterrupted run."""
import copy
import pickle

import numpy as np
import pytest
import torch

import attnpp
from attnpp import nn
from helpers import assert_close

LAYERS = {
    "linear": lambda: nn.Linear(4, 3, dtype=np.float64),
    "embedding": lambda: nn.Embedding(7, 4, dtype=np.float64),
    "mha": lambda: nn.MultiheadAttention(4, 2, dtype=np.float64, batch_first=True),
    "mha_kdim_bias_kv": lambda: nn.MultiheadAttention(4, 2, dtype=np.float64, kdim=3, vdim=5, add_bias_kv=True,
                                                      add_zero_attn=True),
    "attention": lambda: nn.Attention(4, 2, causal=True, attn_dropout=0.2, out_dropout=0.1, dtype=np.float64),
    "attention_cross": lambda: nn.Attention(4, 2, kv_dim=3, out_proj=False, dtype=np.float64),
    "attention_variants": lambda: nn.Attention(4, 2, causal=True, window=(1, 0), alibi=True, softcap=3.0,
                                               sinks=True, rotary=True, attn_dropout=0.2, dtype=np.float64),
    "dropout": lambda: nn.Dropout(0.3),
    "cross_entropy": lambda: nn.CrossEntropyLoss(ignore_index=1),
}


def run(layer, rng_seed=0):
    """A forward and a backward of ``layer`` on fixed inputs (fixed dropout seeds); returns every array."""
    rng = np.random.default_rng(rng_seed)
    if isinstance(layer, nn.Embedding):
        y = layer(rng.integers(0, 7, (2, 5)))
        return [y, layer.backward(np.ones_like(y))]
    if isinstance(layer, nn.CrossEntropyLoss):
        logits = rng.standard_normal((5, 4)).astype(np.float32)
        return [layer(logits, rng.integers(0, 4, 5)), layer.backward()]
    if isinstance(layer, nn.MultiheadAttention):
        q = rng.standard_normal((2, 3, 4))
        k, v = rng.standard_normal((2, 5, layer.kdim)), rng.standard_normal((2, 5, layer.vdim))
        if not layer.batch_first:
            q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))
        y, w = layer(q, k, v, seed=3)
        return [y, w, *layer.backward(np.ones_like(y))]
    if isinstance(layer, nn.Attention):
        x = rng.standard_normal((2, 3, 4))
        context = None if layer.kv_dim == 4 else rng.standard_normal((2, 6, layer.kv_dim))
        y = layer(x, context, seed=9)
        grads = layer.backward(np.ones_like(y))
        return [y, *(grads if isinstance(grads, tuple) else (grads,))]
    x = rng.standard_normal((2, 4))
    y = layer(x, seed=4) if isinstance(layer, nn.Dropout) else layer(x)
    return [y, layer.backward(np.ones_like(y))]


def arrays_of(layer):
    """Every array a layer owns: parameters' data and grad, buffers."""
    out = []
    for p in layer.parameters():
        out += [p.data] + ([] if p.grad is None else [p.grad])
    return out + [b for _, b in layer.named_buffers()]


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("name", LAYERS)
def test_layer_copies(name, how):
    attnpp.manual_seed(0)
    layer = LAYERS[name]()
    run(layer)  # gradients accumulated: the copy carries them
    clone = pickle.loads(pickle.dumps(layer)) if how == "pickle" else copy.deepcopy(layer)
    assert type(clone) is type(layer) and repr(clone) == repr(layer) and clone.training == layer.training
    for (n, a), (m, b) in zip(layer.named_parameters(), clone.named_parameters()):
        assert n == m
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(a.grad, b.grad)
    for a in arrays_of(layer):
        for b in arrays_of(clone):
            assert not np.shares_memory(a, b), "the copy shares a buffer with its original"
    for a, b in zip(run(layer, 1), run(clone, 1)):  # the same computation, and its own contexts
        if a is not None:
            np.testing.assert_array_equal(a, b)
    for (_, a), (_, b) in zip(layer.named_parameters(), clone.named_parameters()):
        np.testing.assert_array_equal(a.grad, b.grad)


# ----------------------------------------------------------------------------------------------- optimizers
def _pair(make_ours, make_theirs, groups):
    """An attnpp Linear + optimizer and a torch Linear + optimizer with the same weights and parameter groups
    (``groups``: a list of (parameter names, hyper-parameters) pairs)."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(5, 3, dtype=torch.float64)
    lin = nn.Linear(5, 3, dtype=np.float64)
    lin.load_state_dict(ref.state_dict())
    ours = make_ours([dict(params=[getattr(lin, n) for n in names], **kw) for names, kw in groups])
    theirs = make_theirs([dict(params=[getattr(ref, n) for n in names], **kw) for names, kw in groups])
    return lin, ours, ref, theirs


OPTIMIZERS = {
    "sgd": (lambda g: attnpp.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
            lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True)),
    "adamw": (lambda g: attnpp.optim.AdamW(g, lr=0.05, betas=(0.8, 0.99)),
              lambda g: torch.optim.AdamW(g, lr=0.05, betas=(0.8, 0.99))),
}
GROUPS = [(["weight"], {}), (["bias"], {"lr": 0.02, "weight_decay": 0.1})]


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_param_groups_and_schedules_match_torch(rng, opt):
    """Two groups with their own hyper-parameters, the learning rates changed between steps as a schedule does,
    a parameter without gradient at one step (zero_grad(set_to_none=True)): the parameters follow torch.optim."""
    lin, ours, ref, theirs = _pair(*OPTIMIZERS[opt], GROUPS)
    for step in range(6):
        x, g = rng.standard_normal((4, 5)), rng.standard_normal((4, 3))
        ours.zero_grad()
        theirs.zero_grad()
        lin(x)
        lin.backward(g)
        (ref(torch.tensor(x)) * torch.tensor(g)).sum().backward()
        if step == 2:  # the bias has no gradient at this step: skipped by both (no update, no state change)
            lin.bias.grad, ref.bias.grad = None, None
        for o in (ours, theirs):
            for group in o.param_groups:
                group["lr"] *= 0.7
        ours.step()
        theirs.step()
        for name, p in lin.named_parameters():
            assert_close(p.data, dict(ref.named_parameters())[name].detach().numpy(), np.float64, name)
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert sorted(ours_sd["state"]) == sorted(theirs_sd["state"])
    for i, state in ours_sd["state"].items():
        assert set(state) == set(theirs_sd["state"][i])
        for key, value in state.items():
            assert_close(np.asarray(value, np.float64), theirs_sd["state"][i][key].numpy(), np.float64, key)
    for a, b in zip(ours_sd["param_groups"], theirs_sd["param_groups"]):
        assert a["params"] == b["params"] and all(a[k] == b[k] for k in a if k != "betas")


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_optimizer_state_dict_round_trip(rng, opt):
    lin, ours, _, _ = _pair(*OPTIMIZERS[opt], GROUPS)
    for _ in range(2):
        lin(rng.standard_normal((4, 5)))
        lin.backward(rng.standard_normal((4, 3)))
        ours.step()
    saved = pickle.loads(pickle.dumps(ours.state_dict()))
    clone = copy.deepcopy(lin)
    other = OPTIMIZERS[opt][0]([dict(params=[getattr(clone, n) for n in names], **kw) for names, kw in GROUPS])
    other.load_state_dict(saved)
    assert other.param_groups[1]["lr"] == ours.param_groups[1]["lr"] == 0.02
    assert repr(other) == repr(ours)
    for a, b in ((ours, other), (other, ours)):
        for p, q in zip(*(sum((g["params"] for g in o.param_groups), []) for o in (a, b))):
            for key, value in a.state[p].items():
                if isinstance(value, np.ndarray):
                    np.testing.assert_array_equal(value, b.state[q][key])
                    assert not np.shares_memory(value, b.state[q][key])
                else:
                    assert value == b.state[q][key]
    lin2, twin = copy.deepcopy((lin, ours))  # an optimizer copied with its layer: state included, nothing shared
    for p, q in zip(lin.parameters(), lin2.parameters()):
        for key, value in ours.state[p].items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(value, twin.state[q][key])
                assert not np.shares_memory(value, twin.state[q][key])
    assert all(q in twin.state for q in lin2.parameters()) and repr(twin) == repr(ours)
    with pytest.raises(ValueError, match="groups have sizes"):
        OPTIMIZERS[opt][0](clone.parameters()).load_state_dict(saved)


def test_optimizer_repr_as_torch():
    lin, ours, ref, theirs = _pair(*OPTIMIZERS["adamw"], GROUPS)
    ours_lines, theirs_lines = repr(ours).splitlines(), repr(theirs).splitlines()
    assert ours_lines[0] == theirs_lines[0] == "AdamW ("
    assert [line for line in theirs_lines if not line.startswith("    ")] == \
        [line for line in ours_lines if not line.startswith("    ")]  # header, one line per group, ")"
    ours_keys = {line.split(":")[0] for line in ours_lines if line.startswith("    ")}
    assert ours_keys <= {line.split(":")[0] for line in theirs_lines if line.startswith("    ")}


# ------------------------------------------------------------------------------------------ layers' surface
def test_load_state_dict_not_strict_returns_keys_as_torch():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(4, 2)
    ours = nn.MultiheadAttention(4, 2)
    sd = dict(ref.state_dict())
    del sd["in_proj_bias"]
    sd["extra.weight"] = torch.zeros(2)
    got, expected = ours.load_state_dict(sd, strict=False), ref.load_state_dict(sd, strict=False)
    assert got.missing_keys == expected.missing_keys and got.unexpected_keys == expected.unexpected_keys
    assert ours.load_state_dict(ref.state_dict()) == ([], [])


def test_reprs_nest_as_torch():
    assert repr(nn.Linear(3, 4)) == repr(torch.nn.Linear(3, 4))
    assert repr(nn.Dropout(0.1)) == repr(torch.nn.Dropout(0.1)).replace(", inplace=False", "")
    mha = nn.MultiheadAttention(8, 2, kdim=4, batch_first=True, dtype=np.float64)
    lines = repr(mha).splitlines()
    assert lines[0] == "MultiheadAttention(" and lines[-1] == ")"
    assert lines[1] == "  embed_dim=8, num_heads=2, kdim=4, batch_first=True, dtype=float64"
    assert lines[2] == "  (out_proj): " + repr(mha.out_proj)
    layer = nn.Attention(8, 2, causal=True)
    children = [line for line in repr(layer).splitlines() if line.startswith("  (")]
    assert [c.split(")")[0][3:] for c in children] == ["q_proj", "k_proj", "v_proj", "out_proj", "out_drop"]


# --------------------------------------------------------------------------------------- checkpoint + resume
class TinyModel:
    """Embedding -> causal attention (dropout on weights and output) -> Linear -> cross-entropy, as the
    articles' tiny language model trains."""

    def __init__(self):
        self.emb = nn.Embedding(11, 8, dtype=np.float64)
        self.attn = nn.Attention(8, 2, causal=True, attn_dropout=0.1, out_dropout=0.1, dtype=np.float64)
        self.head = nn.Linear(8, 11, dtype=np.float64)
        self.loss = nn.CrossEntropyLoss()

    def layers(self):
        return [self.emb, self.attn, self.head]

    def parameters(self):
        return [p for layer in self.layers() for p in layer.parameters()]

    def step(self, tokens, optimizer):
        optimizer.zero_grad()
        logits = self.head(self.attn(self.emb(tokens[:, :-1])))  # (dropout seeds drawn from attnpp's generator)
        loss = self.loss(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))
        g = self.head.backward(self.loss.backward().reshape(logits.shape))
        self.emb.backward(self.attn.backward(g))
        optimizer.step()
        return float(loss)


def _data(step):
    return np.random.default_rng(step).integers(0, 11, (3, 7))


def _train(model, optimizer, steps, start=0):
    return [model.step(_data(s), optimizer) for s in range(start, start + steps)]


@pytest.mark.parametrize("how", ["pickle", "state_dicts"])
def test_resumed_training_is_bitwise_the_uninterrupted_one(how):
    attnpp.manual_seed(7)
    model = TinyModel()
    opt = attnpp.optim.AdamW(model.parameters(), lr=0.01)
    initial = pickle.dumps((model, opt, attnpp.get_rng_state()))
    losses = _train(model, opt, 8)

    model, opt, rng_state = pickle.loads(initial)
    attnpp.set_rng_state(rng_state)
    first = _train(model, opt, 4)
    if how == "pickle":
        checkpoint = pickle.dumps((model, opt, attnpp.get_rng_state()))
        attnpp.manual_seed(123)  # anything drawn in between must not matter
        model, opt, rng_state = pickle.loads(checkpoint)
    else:
        checkpoint = pickle.dumps(([layer.state_dict() for layer in model.layers()], opt.state_dict(),
                                   attnpp.get_rng_state()))
        attnpp.manual_seed(123)
        fresh = TinyModel()  # other initial weights, overwritten by the checkpoint
        layer_states, opt_state, rng_state = pickle.loads(checkpoint)
        for layer, state in zip(fresh.layers(), layer_states):
            layer.load_state_dict(state)
        model, opt = fresh, attnpp.optim.AdamW(fresh.parameters(), lr=0.5)
        opt.load_state_dict(opt_state)
    attnpp.set_rng_state(rng_state)
    resumed = first + _train(model, opt, 4, start=4)
    assert resumed == losses  # bitwise: floats compared exactly
    uninterrupted = pickle.loads(initial)[0]
    attnpp.set_rng_state(pickle.loads(initial)[2])
    _train(uninterrupted, attnpp.optim.AdamW(uninterrupted.parameters(), lr=0.01), 8)
    for a, b in zip(model.parameters(), uninterrupted.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
