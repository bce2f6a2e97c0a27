"""The benchmark's context-parallel side (``python -m attnpp.bench --cases context-parallel``): P worker processes
of one thread each, the ranks of a gloo group on the loopback, each holding its shard of the sequence; the
benchmark process drives them through pipes, one ring attention per call, while it waits (its own threads idle).
"""
import atexit
import datetime
import os
import socket
from functools import partial

import numpy as np
import torch
import torch.multiprocessing as mp

from .calls import FreshGradients, random_inputs, set_gradients_to_none

_POOLS = {}  # world -> Workers, started once per run, stopped at exit


def _worker(rank, world, port, conn):
    """One rank: waits for commands on ``conn``: ("setup", shape, layout, is_causal, backward), ("call", measure)
    -> seconds or the peak growth in MiB, ("stop",)."""
    import attnpp
    from attnpp.torch.distributed import ring_attention, shard_sequence
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    attnpp.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=600))
    call = None
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        if command[0] == "setup":
            _, shape, layout, is_causal, backward = command
            shards = [shard_sequence(torch.from_numpy(a), layout=layout) for a in random_inputs(shape)]
            q, k, v, g = shards
            leaves = [t.requires_grad_() for t in (q, k, v)] if backward else []
            call = FreshGradients(_ring_call(ring_attention, q, k, v, g if backward else None, is_causal=is_causal,
                                             layout=layout), partial(set_gradients_to_none, leaves))
            conn.send(sum(t.numel() * t.element_size() for t in (shards if backward else shards[:3])))
        elif command[0] == "call":
            conn.send(call.peak_growth_mib() if command[1] else call())
    torch.distributed.barrier()
    conn.send("stopped")
    os._exit(0)  # (no process-group teardown: see tests/test_transformers.py's DDP ranks)


def _ring_call(ring_attention, q, k, v, grad_output, **options):
    """One ring attention: forward under no_grad, or (``grad_output`` given) forward and backward (the worker
    wraps it in FreshGradients, which sets the leaves' gradients to None before each call)."""
    def call():
        if grad_output is None:
            with torch.no_grad():
                ring_attention(q, k, v, **options)
        else:
            ring_attention(q, k, v, **options).backward(grad_output)
    return call


class Workers:
    """``world`` ranks of one thread each; ``setup`` gives them a problem, ``__call__`` runs one ring attention on
    every rank and returns when all are done."""

    def __init__(self, world):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, theirs), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)

    def _all(self, command):
        for conn in self.conns:
            conn.send(command)
        return [conn.recv() for conn in self.conns]

    def setup(self, shape, layout, is_causal, backward):
        """The inputs' bytes on each rank (the shards of query, key, value, and the output gradient)."""
        return self._all(("setup", shape, layout, is_causal, backward))

    def __call__(self):
        self._all(("call", False))

    def peak_growth_mib(self):
        """The growth of each rank's peak resident set during one call (MiB, None where it cannot be reset)."""
        return self._all(("call", True))

    def stop(self):
        self._all(("stop",))
        for proc in self.procs:
            proc.join(timeout=30)


def workers(world):
    """The run's pool of ``world`` ranks (started at the first context-parallel case)."""
    if world not in _POOLS:
        _POOLS[world] = Workers(world)
        atexit.register(_POOLS[world].stop)
    return _POOLS[world]


def inputs_mib(shape, backward):
    """The bytes of one process's float32 query, key, value (and output gradient) of ``shape``, in MiB."""
    return (4 if backward else 3) * 4 * float(np.prod(shape)) / 2.0 ** 20
