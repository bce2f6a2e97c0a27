"""Context-parallel (ring) attention, ``attnpp.torch.distributed``, against the single-process attnpp result: 2 and
4 processes spawned on the loopback (gloo), contiguous and zigzag layouts, causal and not, GQA, a window, keys
sent in one piece or head by head; the outputs, log-sum-exps and the gradients of query, key and value gathered
from the ranks equal those of ``attnpp.functional`` on the whole sequence (float64 <= 1e-12, float32 <= 2e-6,
relative to max(1, |reference|)). The layer option (``Attention(..., context_parallel_group=...)``) equals the
one-process layer, and bad calls are refused with a clear error on every rank.

Each group of processes runs all its cases in one spawn (starting processes costs seconds); rank 0 saves the
gathered results and the tests compare them here, with the reference computed in this process."""
import datetime
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

import attnpp.functional as AF
import attnpp.torch as AT
from attnpp.torch import distributed as CP

B, HQ, L, D = 2, 4, 48, 8
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}

CASES = [
    dict(world=2, layout="contiguous", is_causal=False),
    dict(world=2, layout="contiguous", is_causal=True),
    dict(world=2, layout="zigzag", is_causal=True),
    dict(world=2, layout="zigzag", is_causal=False, dtype=torch.float32),
    dict(world=2, layout="zigzag", is_causal=True, dtype=torch.float32, gqa=True),
    dict(world=2, layout="contiguous", is_causal=False, window=(30, 2), gqa=True),
    dict(world=2, layout="zigzag", is_causal=True, piece_bytes=1),  # one head per message
    dict(world=2, layout="zigzag", is_causal=True, dtype=torch.bfloat16),
    dict(world=4, layout="contiguous", is_causal=False, piece_bytes=1),
    dict(world=4, layout="contiguous", is_causal=True),
    dict(world=4, layout="zigzag", is_causal=True, gqa=True),
    dict(world=4, layout="zigzag", is_causal=True, dtype=torch.float32, piece_bytes=1),
    dict(world=4, layout="contiguous", is_causal=True, window=(5, 0)),  # blocks beyond the window: not sent
    dict(world=4, layout="zigzag", is_causal=True, window=(7, 0)),
    dict(world=4, layout="zigzag", is_causal=False, window=(7, 3), gqa=True),
    dict(world=4, layout="contiguous", is_causal=False, dtype=torch.float32, scale=0.3),
]


def case_id(case):
    extras = [f"{k}={v}" for k, v in case.items() if k not in ("world", "layout", "is_causal")]
    return f"P{case['world']}-{case['layout']}-{'causal' if case['is_causal'] else 'full'}-" + "-".join(
        str(e).replace(" ", "").replace("torch.", "") for e in extras)


def inputs(case):
    """The whole sequence's query, key, value and output gradient (the same on every rank and here)."""
    g = torch.Generator().manual_seed(CASES.index(case))
    hk = HQ // 2 if case.get("gqa") else HQ
    dtype = case.get("dtype", torch.float64)
    make = lambda h: torch.randn(B, h, L, D, generator=g, dtype=torch.float64).to(dtype)
    return make(HQ), make(hk), make(hk), make(HQ)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


def run_cases(rank, world, port, out_dir):
    """One rank: every case of this world size; rank 0 saves what it gathered. Ends with os._exit after a
    barrier (as test_transformers' DDP ranks: no process-group teardown at return)."""
    init(rank, world, port)
    for i, case in enumerate(CASES):
        if case["world"] != world:
            continue
        CP.PIECE_BYTES = case.get("piece_bytes", 4 << 20)
        layout = case["layout"]
        shard = lambda t: CP.shard_sequence(t, layout=layout)
        q, k, v, do = (shard(t) for t in inputs(case))
        for t in (q, k, v):
            t.requires_grad_()
        out, lse = CP.ring_attention(q, k, v, is_causal=case["is_causal"], window=case.get("window"),
                                     enable_gqa=case.get("gqa", False), scale=case.get("scale"), layout=layout,
                                     return_logsumexp=True, timeout=60)
        out.backward(do)
        gather = lambda t: CP.gather_sequence(t.detach(), layout=layout, timeout=60)
        got = dict(out=gather(out), lse=gather(lse.unsqueeze(-1)).squeeze(-1), dq=gather(q.grad),
                   dk=gather(k.grad), dv=gather(v.grad))
        if rank == 0:
            torch.save(got, out_dir / f"case{i}.pt")
    if world == 2:
        run_layer(rank, out_dir)
    dist.barrier()
    os._exit(0)


def layer_pair(dtype=torch.float64, **group):
    torch.manual_seed(5)
    options = dict(causal=True, window=(9, 0), rotary=True, dtype=dtype)
    one = AT.Attention(16, 4, **options)
    cp = AT.Attention(16, 4, **options, **group)
    cp.load_state_dict(one.state_dict())
    return one, cp


def layer_inputs():
    g = torch.Generator().manual_seed(6)
    return torch.randn(2, L, 16, generator=g, dtype=torch.float64), torch.randn(2, L, 16, generator=g,
                                                                                dtype=torch.float64)


def run_layer(rank, out_dir):
    """The layer option, zigzag: this rank's shard of x through the layer; the parameters' gradients summed
    over the ranks."""
    _, layer = layer_pair(context_parallel_group=dist.group.WORLD, context_parallel_layout="zigzag")
    x, gy = (CP.shard_sequence(t, layout="zigzag", dim=1) for t in layer_inputs())
    x.requires_grad_()
    y = layer(x)
    y.backward(gy)
    grads = {}
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    got = dict(y=CP.gather_sequence(y.detach(), layout="zigzag", dim=1),
               dx=CP.gather_sequence(x.grad, layout="zigzag", dim=1), grads=grads)
    if rank == 0:
        torch.save(got, out_dir / "layer.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What rank 0 gathered, for every case and the layer: one spawn per world size."""
    out_dir = tmp_path_factory.mktemp("context_parallel")
    for world in (2, 4):
        torch.multiprocessing.spawn(run_cases, args=(world, free_port(), out_dir), nprocs=world, join=True)
    return out_dir


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    return float(((got - ref)[finite].abs().max() / max(1.0, float(ref[finite].abs().max()))))


def reference(case, q, k, v, do):
    """attnpp.functional's forward and backward on the whole sequence: (out, lse, dq, dk, dv) tensors."""
    kw = dict(is_causal=case["is_causal"], window=case.get("window"), enable_gqa=case.get("gqa", False),
              scale=case.get("scale"))
    arrays = [AT.to_numpy(t) for t in (q, k, v, do)]
    out, lse, _ = AF.scaled_dot_product_attention_forward(*arrays[:3], **kw)
    grads = AF.scaled_dot_product_attention_backward(arrays[3], *arrays[:3], out, lse, **kw)
    return [AT.from_numpy(a) for a in (out, lse, *grads)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ring_attention_equals_one_process(results, case):
    got = torch.load(results / f"case{CASES.index(case)}.pt")
    q, k, v, do = inputs(case)
    ref = reference(case, q, k, v, do)
    names = ("out", "lse", "dq", "dk", "dv")
    dtype = case.get("dtype", torch.float64)
    if dtype in TOL:
        for name, r in zip(names, ref):
            assert rel_err(got[name], r) <= TOL[dtype], name
    else:  # half precision: computed and merged in float32, rounded once: no less accurate than one process's
        exact = reference(case, *(t.double() for t in (q, k, v, do)))
        for name, r, e in zip(names, ref, exact):
            assert rel_err(got[name], e) <= 1.5 * rel_err(r, e), name


def test_layer_option_equals_one_process(results):
    """attnpp.torch.Attention(..., context_parallel_group=WORLD, context_parallel_layout="zigzag") over 2 ranks,
    causal, a window of 9 and rotary positions: output, input gradient and the parameters' gradients (summed
    over the ranks) equal the one-process layer's."""
    got = torch.load(results / "layer.pt")
    one, _ = layer_pair()
    x, gy = layer_inputs()
    x.requires_grad_()
    y = one(x)
    y.backward(gy)
    assert rel_err(got["y"], y.detach()) <= TOL[torch.float64]
    assert rel_err(got["dx"], x.grad) <= TOL[torch.float64]
    for name, p in one.named_parameters():
        assert rel_err(got["grads"][name], p.grad) <= TOL[torch.float64], name


# ------------------------------------------------------------------------------------------- bad calls
def run_bad_calls(rank, world, port, out_dir):
    """Each rank records the error of each bad call (type, message); the group's mismatch comes last (after
    a timeout the process group is not used again)."""
    init(rank, world, port)
    solo = dist.new_group([0])  # (every rank takes part in creating a group)
    seen = {}

    def attempt(name, call):
        try:
            call()
            seen[name] = None
        except Exception as e:  # noqa: BLE001 (recorded for the test to check)
            seen[name] = (type(e).__name__, str(e))

    t = lambda n: torch.zeros(1, 2, n, 4, dtype=torch.float64)
    attempt("empty", lambda: CP.ring_attention(t(0 if rank == 1 else 4), t(0 if rank == 1 else 4),
                                               t(0 if rank == 1 else 4), timeout=30))
    attempt("unequal", lambda: CP.ring_attention(t(4 + 2 * rank), t(4 + 2 * rank), t(4 + 2 * rank), timeout=30))
    attempt("options", lambda: CP.ring_attention(t(4), t(4), t(4), is_causal=rank == 1, timeout=30))
    attempt("odd_zigzag", lambda: CP.ring_attention(t(3), t(3), t(3), layout="zigzag", timeout=30))
    attempt("group", lambda: CP.ring_attention(t(4), t(4), t(4), solo if rank == 1 else None, timeout=3))
    torch.save(seen, out_dir / f"errors{rank}.pt")
    os._exit(0)


@pytest.fixture(scope="module")
def bad_calls(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("context_parallel_errors")
    torch.multiprocessing.spawn(run_bad_calls, args=(2, free_port(), out_dir), nprocs=2, join=True)
    return [torch.load(out_dir / f"errors{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("name, expected", [
    ("empty", ("ValueError", "empty")),
    ("unequal", ("ValueError", "rank 1 query (1, 2, 6, 4)")),
    ("options", ("ValueError", "is_causal=True")),
    ("odd_zigzag", ("ValueError", "must be even")),
])
def test_bad_calls_refused_on_every_rank(bad_calls, name, expected):
    for rank, seen in enumerate(bad_calls):
        assert seen[name] is not None, (rank, name)
        kind, message = seen[name]
        assert kind == expected[0] and expected[1] in message, (rank, seen[name])


def test_mismatched_group_refused_on_every_rank(bad_calls):
    """Rank 1 passes a group it is not in: it is told at once; rank 0, left waiting, raises after the timeout
    instead of hanging."""
    kind, message = bad_calls[1]["group"]
    assert kind == "ValueError" and "not a member of the group [0]" in message
    kind, message = bad_calls[0]["group"]
    assert kind == "RuntimeError" and "no answer within 0:00:03" in message


def test_plan_skips_hidden_blocks_and_balances_zigzag():
    """The work of each rank (query-key pairs computed) under the causal mask, from the ring's plan: contiguous
    leaves rank P - 1 with 2P - 1 half-blocks against rank 0's 1; zigzag gives every rank the same; a block
    beyond every later rank's window is not sent on."""
    P, n = 4, 16

    def work(layout, rank, window=None):
        lo, hi = CP._band(True, window)
        calls = [c for s in range(P) for c in CP._plan(layout, rank, s, P, n, n, lo, hi)]
        total = 0
        for a0, a1, b0, b1, causal, left, right in calls:
            rows, cols = a1 - a0, b1 - b0
            total += rows * (rows + 1) // 2 if causal and left == -1 and rows == cols else rows * cols
        return total

    half_block = n * (n + 1) // 2
    assert [work("contiguous", r) for r in range(P)] == [half_block + r * n * n for r in range(P)]
    zigzag = [work("zigzag", r) for r in range(P)]
    assert zigzag == [zigzag[0]] * P and sum(zigzag) == sum(work("contiguous", r) for r in range(P))
    assert CP._ring_plan("contiguous", P, n, n, *CP._band(True, (5, 0)))[1] == [1, 1, 1, 0]


def test_accumulate_merges_blocks_in_place(rng):
    """The forward kernel's accumulate option (ring attention's merge): keys in three blocks, each call merging
    into the output and log-sum-exp of the previous ones, equal one call over all keys (float64 and float32)."""
    from attnpp import _core
    for dtype, tol in ((np.float64, 1e-13), (np.float32, 2e-6)):
        q, k, v = (rng.standard_normal((2, 3, 20, 8)).astype(dtype) for _ in range(3))
        out, lse, _ = AF.scaled_dot_product_attention_forward(q, k, v)
        got, got_lse = np.zeros_like(out), np.full(lse.shape, -np.inf, dtype)
        for a, b in ((0, 7), (7, 8), (8, 20)):
            params = AF.attention_params((2,), 3, dtype, scale=AF.score_scale(None, 8))
            params.accumulate = True
            _core.sdpa_forward(got, got_lse, q, k[:, :, a:b], v[:, :, a:b], params)
        assert np.abs(got - out).max() <= tol and np.abs(got_lse - lse).max() <= tol * np.abs(lse).max()
