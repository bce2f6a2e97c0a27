"""Thread count, seeds, the GIL, and layers shared between Python threads (issue 5, item 4).

The sizes are above the core's threshold for waking the OpenMP threads (2^17 multiply-adds), so that the
parallel paths run: attention forward over (B, H, query blocks), backward over (B, kv head), the blocked
projections, cross-entropy rows and the optimizer's elements.
"""
import threading
import time

import numpy as np
import pytest

import attnpp
import attnpp.functional as AF
from attnpp.nn import Attention, CrossEntropyLoss, Dropout, Linear, MultiheadAttention


def test_set_get_num_threads(threads):
    threads(1)
    assert attnpp.get_num_threads() == 1
    threads(2)
    assert attnpp.get_num_threads() == 2


def test_num_threads_is_process_wide(threads):
    """set_num_threads in one Python thread holds in the others (OpenMP's own setting is per thread)."""
    threads(1)
    seen = []
    t = threading.Thread(target=lambda: seen.append(attnpp.get_num_threads()))
    t.start()
    t.join()
    assert seen == [1]


# ------------------------------------------------------------------------------ the same results on any count
def _sdpa_run(q, k, v, **kw):
    out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v, **kw)
    grads = AF.scaled_dot_product_attention_backward(out, q, k, v, out, lse, **kw)
    return (out, lse) + grads


def _mha_run(x):
    attnpp.manual_seed(0)
    layer = MultiheadAttention(64, 4, dropout=0.1, batch_first=True, dtype=x.dtype)
    y, w = layer(x, x, x, seed=3)
    return (y, w, layer.backward(y)) + tuple(p.grad for p in layer.parameters())


def _attention_run(x):
    attnpp.manual_seed(0)
    layer = Attention(64, 4, causal=True, attn_dropout=0.1, out_dropout=0.2, dtype=x.dtype)
    y, w = layer(x, need_weights=True, seed=3)
    return (y, w, layer.backward(y)) + tuple(p.grad for p in layer.parameters())


def _training_step_run(x):
    """A Linear + cross-entropy + AdamW step: the projections, the loss rows and the optimizer in parallel."""
    attnpp.manual_seed(0)
    lin, loss = Linear(64, 3000, dtype=x.dtype), CrossEntropyLoss()
    opt = attnpp.optim.AdamW(lin.parameters(), lr=0.1)
    target = np.arange(x.shape[0] * x.shape[1]) % 3000
    value = loss(lin(x.reshape(-1, 64)), target)
    lin.backward(loss.backward())
    opt.step()
    return (value, lin.weight.grad, lin.weight.data, lin.bias.data)


def _dropout_run(x):
    drop = Dropout(0.3)
    y = drop(x, seed=11)
    return (y, drop.backward(np.ones_like(x)), AF.dropout_mask(x.shape, 0.3, 11))


RUNS = {
    "sdpa": lambda x: _sdpa_run(x, x[:, :, ::-1], x * 0.5, is_causal=True, dropout_p=0.2, seed=5),
    "sdpa_gqa_mask": lambda x: _sdpa_run(x, x[:, :2], x[:, 2:], enable_gqa=True,
                                         attn_mask=np.tril(np.ones((x.shape[2], x.shape[2]), bool))),
    "multihead_attention": lambda x: _mha_run(x.reshape(4, -1, 64)),
    "attention": lambda x: _attention_run(x.reshape(4, -1, 64)),
    "training_step": lambda x: _training_step_run(x.reshape(4, -1, 64)),
    "dropout": _dropout_run,
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("run", list(RUNS), ids=str)
def test_bitwise_identical_for_fixed_count_and_across_counts(threads, rng, dtype, run):
    """Every output element is computed by one thread in a fixed order: repeated runs on one thread count are
    bitwise identical, and so are runs on 1, 2 and 3 threads (the issue asks for float tolerance across 1 and 2;
    bitwise holds). Dropout masks depend on (seed, element index) only, so they are the same on any count."""
    x = rng.standard_normal((2, 4, 160, 64)).astype(dtype)
    results = {}
    for n in (1, 2, 3):
        threads(n)
        results[n] = [RUNS[run](x) for _ in range(2)]
    reference = results[1][0]
    for n, runs in results.items():
        for result in runs:
            assert len(result) == len(reference)
            for a, b in zip(result, reference):
                np.testing.assert_array_equal(a, b, err_msg=f"{run} on {n} threads")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [dict(is_causal=True), {}, dict(is_causal=True, enable_gqa=True)],
                         ids=["causal", "full", "gqa"])
def test_forward_row_groups_bitwise_across_counts(threads, rng, dtype, kw):
    """With few heads for the threads, a forward task takes several blocks of 256 query rows and packs their keys
    once (attention.cpp): on 1 thread one task takes the 3 blocks of a head, on 2 two and one, on 3 and 5 one each.
    The outputs and log-sum-exps are the same bits on every count, the 1-block tasks' (the parity tests' path)."""
    q = rng.standard_normal((1, 4, 700, 32)).astype(dtype)
    k, v = (rng.standard_normal((1, 2 if kw.get("enable_gqa") else 4, 700, 32)).astype(dtype) for _ in range(2))
    results = {}
    for n in (1, 2, 3, 5):
        threads(n)
        results[n] = AF.scaled_dot_product_attention_forward(q, k, v, **kw)[:2]
    for n, result in results.items():
        for a, b in zip(result, results[3]):
            np.testing.assert_array_equal(a, b, err_msg=f"{kw} on {n} threads")

# ---------------------------------------------------------------------------------------------------- the GIL
def _timed_calls(fn, count, spans):
    for _ in range(count):
        start = time.perf_counter()
        result = fn()
        spans.append((start, time.perf_counter(), result))


def test_gil_released_during_compute(rng):
    """While one Python thread is inside the kernel, another Python thread keeps running."""
    q = rng.standard_normal((4, 8, 1024, 64)).astype(np.float32)
    started, done, count = threading.Event(), threading.Event(), [0]

    def work():
        started.set()
        for _ in range(3):
            AF.scaled_dot_product_attention(q, q, q)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    while not done.is_set():
        count[0] += 1
    t.join()
    # with the GIL held for the whole call this loop could only run between calls (a handful of times)
    assert count[0] > 10000


@pytest.mark.parametrize("kind", ["functional", "separate_layers"])
def test_two_python_threads_overlap_and_get_right_answers(threads, rng, kind):
    """Two Python threads calling attnpp at once: each gets the answer a lone call gives, and their calls
    overlap in time (a call of one starts before a call of the other has returned: with the GIL held during
    the compute, the other thread could not even take its start time)."""
    threads(1)  # one OpenMP thread per call: two calls at once use the two cores
    xs = [rng.standard_normal((2, 4, 256, 64)) for _ in range(2)]
    if kind == "functional":
        calls = [lambda x=x: AF.scaled_dot_product_attention(x, x, x, is_causal=True) for x in xs]
    else:
        layers = []
        for _ in xs:
            attnpp.manual_seed(1)
            layers.append(Linear(64, 512, dtype=np.float64))
        calls = [lambda x=x, l=l: l.backward(l(x)) for x, l in zip(xs, layers)]
    expected = [call() for call in calls]
    spans = [[], []]
    workers = [threading.Thread(target=_timed_calls, args=(call, 12, s)) for call, s in zip(calls, spans)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for want, got in zip(expected, spans):
        assert len(got) == 12
        for _, _, result in got:
            np.testing.assert_array_equal(result, want)
    overlaps = sum(a0 < b1 and b0 < a1 for a0, a1, _ in spans[0] for b0, b1, _ in spans[1])
    assert overlaps > 0, "no call of one thread overlapped a call of the other"


# ------------------------------------------------------------------------------- one layer, two Python threads
LAYERS = {
    "multihead_attention": (lambda: MultiheadAttention(32, 4, batch_first=True, dtype=np.float64),
                            lambda layer, x: layer(x, x, x, need_weights=False)[0]),
    "attention_dropout": (lambda: Attention(32, 4, causal=True, attn_dropout=0.2, out_dropout=0.1,
                                            dtype=np.float64),
                          lambda layer, x: layer(x, seed=int(abs(x[0, 0, 0]) * 1e6))),
    "linear": (lambda: Linear(32, 48, dtype=np.float64), lambda layer, x: layer(x)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_one_layer_used_from_two_threads(rng, name):
    """Two threads each run forward + backward on the same layer, many times, with their own inputs. Each gets
    the outputs and input gradients a lone call gives (a backward uses its own thread's forward, with its own
    dropout seed), and the parameter gradients add up to the sum of the lone calls' (no update lost)."""
    make, forward = LAYERS[name]
    attnpp.manual_seed(0)
    layer = make()
    layer.train()
    xs = [rng.standard_normal((3, 40, 32)) for _ in range(2)]
    expected, grads = [], []
    for x in xs:
        layer.zero_grad()
        y = forward(layer, x)
        expected.append((y, layer.backward(np.cos(y))))
        grads.append({n: p.grad.copy() for n, p in layer.named_parameters()})
    layer.zero_grad()
    repeats = 25
    results = [[], []]
    errors = []

    def work(i):
        try:
            for _ in range(repeats):
                y = forward(layer, xs[i])
                results[i].append((y, layer.backward(np.cos(y))))
        except Exception as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    for want, got in zip(expected, results):
        assert len(got) == repeats
        for y, dx in got:
            np.testing.assert_array_equal(y, want[0])
            np.testing.assert_array_equal(dx, want[1])
    for n, p in layer.named_parameters():
        np.testing.assert_allclose(p.grad, repeats * (grads[0][n] + grads[1][n]), rtol=1e-12, atol=1e-12,
                                   err_msg=n)


def test_backward_in_another_thread_than_forward_is_refused(rng):
    """The context of a forward belongs to its thread: a backward from another thread raises a clear error
    (and leaves the forward's context for its own thread's backward)."""
    layer = Linear(4, 3, dtype=np.float64)
    x = rng.standard_normal((2, 4))
    y = layer(x)
    caught = []

    def other():
        try:
            layer.backward(np.ones_like(y))
        except ValueError as e:
            caught.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert caught and "forward" in caught[0]
    np.testing.assert_allclose(layer.backward(np.ones_like(y)), np.ones_like(y) @ layer.weight.data, rtol=1e-12)
