"""Context-parallel (ring) attention over ``torch.distributed``: the sequence split across processes.

Each rank of a process group holds a shard of the queries, keys and values; the key/value shards travel around
the ring of ranks, and each rank merges the partial results of its queries against every shard it sees (the
forward's online softmax carried over from one shard to the next, attnpp's kernel resuming from the output and
log-sum-exp it left). The backward sends the keys and values around the ring again, and with them the
gradients of the keys and values, to which each rank adds its queries' part. Liu et al., "Ring Attention with
Blockwise Transformers for Near-Infinite Context" (2023); the zigzag layout is Llama 3's context parallelism
(Dubey et al., 2024) and ring-flash-attn's.

- ``ring_attention``: the attention of the whole sequence, each rank passing its shard and getting its shard
  of the output; differentiable (a ``torch.autograd.Function``; the backward is the ring backward).
- ``shard_sequence`` and ``gather_sequence``: a rank's shard of a full sequence, and the full sequence from
  every rank's shard, for either layout.

Layouts (P ranks, a sequence of length L; ``n = L / P`` rows per rank):

- ``"contiguous"``: rank r holds positions [r n, (r + 1) n). Under the causal mask rank r computes r full
  blocks and a causal one (half a block), so the slowest rank, P - 1, takes (2P - 1) / P times the balanced
  time (1.5 at P = 2).
- ``"zigzag"``: the sequence cut in 2P chunks of n / 2, rank r holding chunks r and 2P - 1 - r (in that
  order). Under the causal mask every rank then does the same work: its diagonal block (a causal block of n
  rows) and, at each of the P - 1 other steps, half a block (one chunk of queries against a whole shard of
  keys, or a whole shard of queries against one chunk): balanced, with the same messages as contiguous.
  Without the causal mask both layouts do the same work.

Transfers: keys and values move in messages of whole heads, at most ``PIECE_BYTES`` per message where a head
fits (an (S/P, D) head of keys and its values), the next message's receive posted before the current piece's
compute so that the transfer overlaps it. A rank holds two slots of pieces (the current one, the next one
arriving): its memory is its shards (1/P of each tensor) plus a few MiB, whatever P. A block entirely hidden
from a rank's queries (causal, window) is not computed, and a shard is not sent further than the last rank
that needs it (the contiguous causal ring sends no shard from rank P - 1 to rank 0).

Every transfer and the opening exchange of the ranks' shapes and options wait at most ``timeout``: a rank whose
peer does not answer raises a RuntimeError instead of hanging.
"""
import datetime
import functools
import math
import struct
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import _core
from .. import functional as AF
from .._checks import check_bool, check_scale, check_window
from . import _check_tensor, to_numpy

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "LAYOUTS", "PIECE_BYTES"]

LAYOUTS = ("contiguous", "zigzag")
PIECE_BYTES = 4 << 20  # keys and values per message (whole heads: more when one head is larger)
_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_MAX_DIMS = 8  # (B..., H, n, D) of the opening exchange
_HEADER = 8  # the opening exchange's options before the shapes, the last of them the inputs' ndim


# ------------------------------------------------------------------------------------------- layouts
def check_layout(layout):
    """``layout`` if it is one of ``LAYOUTS``, else ValueError."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _segments(layout, rank, world, n):
    """The positions a shard of ``n`` rows holds: [(first position in the sequence, first local row, rows)]."""
    if layout == "contiguous":
        return [(rank * n, 0, n)]
    c = n // 2
    return [(rank * c, 0, c), ((2 * world - 1 - rank) * c, c, c)]


def shard_segments(group, layout, n):
    """The positions this rank's shard of ``n`` rows holds in the whole sequence: [(first position, first local
    row, rows)], one segment (contiguous) or two (zigzag)."""
    rank, world = _group_rank_world(group)
    return _segments(check_layout(layout), rank, world, n)


def _group_rank_world(group):
    """(this process's rank in ``group``, the group's size); ValueError when it is not a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group first (e.g. under torchrun)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group "
                         f"{dist.get_process_group_ranks(group)}")
    return rank, dist.get_world_size(group)


def shard_sequence(x, group=None, *, layout="contiguous", dim=-2):
    """This rank's shard of a full sequence ``x`` (every rank passing the same ``x``), as ``ring_attention`` and
    ``Attention(..., context_parallel_group=...)`` take it.

    Args:
        x (Tensor): the full sequence along ``dim``, of length L, a multiple of P (of 2P for ``"zigzag"``).
        group (ProcessGroup, optional): the ranks the sequence is split over. Default: the default group.
        layout (str): ``"contiguous"`` (rank r: positions [r L/P, (r + 1) L/P)) or ``"zigzag"`` (rank r: chunks
            r and 2P - 1 - r of 2P). Default: ``"contiguous"``.
        dim (int): the sequence dimension. Default: -2 (the L of (B..., H, L, D)).

    Returns:
        Tensor: a copy of this rank's L/P positions along ``dim``.

    Raises:
        ValueError: L not a multiple of P (or 2P), an unknown layout, a process outside the group.
        RuntimeError: torch.distributed not initialised.
    """
    rank, world = _group_rank_world(group)
    parts = world * (2 if check_layout(layout) == "zigzag" else 1)
    L = x.shape[dim]
    if L % parts:
        raise ValueError(f"x: the sequence length {L} (dimension {dim} of {tuple(x.shape)}) must be a multiple of "
                         f"{parts} to shard it over {world} ranks with layout {layout!r}")
    n = L // world
    return torch.cat([x.narrow(dim, start, rows) for start, _, rows in _segments(layout, rank, world, n)], dim)


def gather_sequence(shard, group=None, *, layout="contiguous", dim=-2, timeout=None):
    """The full sequence, on every rank, from each rank's ``shard`` (``shard_sequence``'s inverse; not
    differentiable).

    Args:
        shard (Tensor): this rank's shard, every rank's of the same shape.
        group (ProcessGroup, optional): the ranks. Default: the default group.
        layout (str): as the shards were cut, ``"contiguous"`` or ``"zigzag"``. Default: ``"contiguous"``.
        dim (int): the sequence dimension. Default: -2.
        timeout (datetime.timedelta or float seconds, optional): the longest wait for the other ranks. Default:
            the process group's timeout.

    Returns:
        Tensor: the sequence of P times the shard's length along ``dim``.

    Raises:
        ValueError: an unknown layout, an odd shard length with ``"zigzag"``, a process outside the group.
        RuntimeError: torch.distributed not initialised; a rank that does not answer within ``timeout``.
    """
    rank, world = _group_rank_world(group)
    check_layout(layout)
    dim = dim % shard.dim()
    n = shard.shape[dim]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"shard: layout 'zigzag' needs an even shard length, got {n} (dimension {dim} of "
                         f"{tuple(shard.shape)})")
    parts = [torch.empty_like(shard) for _ in range(world)]
    _wait(dist.all_gather(parts, shard.contiguous(), group=group, async_op=True), timeout, "gathering the shards")
    out = torch.empty(shard.shape[:dim] + (n * world,) + shard.shape[dim + 1:], dtype=shard.dtype)
    for r, part in enumerate(parts):
        for start, local, rows in _segments(layout, r, world, n):
            out.narrow(dim, start, rows).copy_(part.narrow(dim, local, rows))
    return out


def _wait(work, timeout, what):
    """Waits for ``work`` at most ``timeout``; RuntimeError naming ``what`` when the peer does not answer."""
    if timeout is None:
        work.wait()
        return
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(f"ring_attention: no answer within {timeout} while {what} (do all ranks of the group "
                           f"call it with the same group and arguments?): {e}") from e


# ------------------------------------------------------------------------------------------- the plan
def _band(is_causal, window):
    """The keys position q sees, as offsets [lo, hi] of k - q (None: unbounded)."""
    lo = hi = None
    if window is not None:
        lo = None if window[0] < 0 else -window[0]
        hi = None if window[1] < 0 else window[1]
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


class _Call(NamedTuple):
    """One kernel call of a ring step: local query rows [a0, a1) against the block's key rows [b0, b1), with the
    causal mask (bottom-right) and the window (-1: unbounded) in the call's own coordinates."""
    a0: int
    a1: int
    b0: int
    b1: int
    causal: bool = False
    left: int = -1
    right: int = -1

    @property
    def full(self):
        """Every query row sees every key."""
        return not self.causal and self.left == self.right == -1


def _pair(q_seg, k_seg, lo, hi):
    """How query segment ``q_seg`` (start, local row, rows) sees key segment ``k_seg``: None (hidden), or the
    kernel's ``_Call``, its band in the call's own coordinates (the rows and keys cut to those that see or are
    seen: both window sides are then >= 0 or unbounded)."""
    (qs, qa, ql), (ks, ka, kl) = q_seg, k_seg
    d = ks - qs  # key j, query i see each other when j - i is in [lo - d, hi - d]
    A = -math.inf if lo is None else lo - d
    B = math.inf if hi is None else hi - d
    a0, a1 = max(0, -B), min(ql, kl - A)  # the rows that see a key, the keys that a row sees
    b0, b1 = max(0, A), min(kl, ql + B)
    if A > B or a1 <= a0 or b1 <= b0:
        return None
    a0, a1, b0, b1 = int(a0), int(a1), int(b0), int(b1)
    if A <= -(ql - 1) and B >= kl - 1:  # every row sees every key
        return _Call(qa, qa + ql, ka, ka + kl)
    diag = (b1 - b0) - (a1 - a0)  # the kernel's bottom-right diagonal of the cut block
    left = -1 if A == -math.inf else diag - (A + a0 - b0)
    right = -1 if B == math.inf else (B + a0 - b0) - diag
    if right == 0:  # the causal mask (bottom-right): the kernel's fast path
        return _Call(qa + a0, qa + a1, ka + b0, ka + b1, True, left)
    return _Call(qa + a0, qa + a1, ka + b0, ka + b1, False, left, right)


def _plan(layout, rank, source, world, n, m, lo, hi):
    """The kernel calls (``_Call``) of rank ``rank``'s n queries against rank ``source``'s m keys; empty when
    every key is hidden."""
    q_segs, k_segs = _segments(layout, rank, world, n), _segments(layout, source, world, m)
    if rank == source and lo is None and hi == 0:  # the diagonal block, causal: local order is the sequence's
        return [_Call(0, n, 0, m, True)]
    pairs = {(i, j): _pair(q, k, lo, hi) for i, q in enumerate(q_segs) for j, k in enumerate(k_segs)}
    full = {key for key, c in pairs.items() if c is not None and c.full}
    if len(full) == len(pairs):
        return [_Call(0, n, 0, m)]
    calls, done = [], set()
    rows, cols = range(len(q_segs)), range(len(k_segs))
    for j in cols:  # a key segment every query sees: one call
        if all((i, j) in full for i in rows):
            calls.append(_Call(0, n, k_segs[j][1], k_segs[j][1] + k_segs[j][2]))
            done |= {(i, j) for i in rows}
    if not done:
        for i in rows:  # a query segment that sees every key: one call
            if all((i, j) in full for j in cols):
                calls.append(_Call(q_segs[i][1], q_segs[i][1] + q_segs[i][2], 0, m))
                done |= {(i, j) for j in cols}
    calls += [c for key, c in pairs.items() if c is not None and key not in done]
    return calls


@functools.lru_cache(maxsize=64)
def _ring_plan(layout, world, n, m, lo, hi):
    """(calls, last): calls[d][s], rank d's kernel calls against rank s's keys (``_plan``); last[s], the farthest
    hop block s travels (the last rank along the ring that needs it). Kept per configuration: P^2 plans."""
    calls = [[_plan(layout, d, s, world, n, m, lo, hi) for s in range(world)] for d in range(world)]
    last = [max((u for u in range(world) if calls[(s + u) % world][s]), default=0) for s in range(world)]
    return calls, last


# ------------------------------------------------------------------------------------------- the ring
class _Ring:
    """One ring attention's configuration, checked and agreed by every rank: the shards seen as
    (1, heads, rows, width) arrays of the compute dtype, the kernel calls of each step and the messages."""

    def __init__(self, query, key, value, group, is_causal, scale, enable_gqa, window, layout, timeout):
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            _check_tensor(t, name)
            if t.dim() < 3:
                raise ValueError(f"{name}: expected (B..., H, L/P, D), at least 3 dimensions, got {tuple(t.shape)}")
        for t, name in ((key, "key"), (value, "value")):
            if t.dtype != query.dtype:
                raise TypeError(f"{name}: expected the query's dtype {query.dtype}, got {t.dtype}")
        self.is_causal, self.enable_gqa = check_bool(is_causal, "is_causal"), check_bool(enable_gqa, "enable_gqa")
        self.window, self.layout = check_window(window), check_layout(layout)
        scale = check_scale(scale)
        self.timeout, self.group = timeout, group
        self.rank, self.world = _group_rank_world(group)
        self.dtype = query.dtype
        Hq, n, D = query.shape[-3:]
        Hk, m, Dk = key.shape[-3:]
        Hv, mv, Dv = value.shape[-3:]
        batch = query.shape[:-3]
        if key.shape[:-3] != batch or value.shape[:-3] != batch:
            raise ValueError(f"query, key and value: expected the same batch dimensions B..., got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        if Dk != D or mv != m or Hv != Hk:
            raise ValueError(f"key and value: expected key (B..., Hk, S/P, D) and value (B..., Hk, S/P, Dv) with the "
                             f"query's D, got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)}")
        if (Hq != Hk and not self.enable_gqa) or Hk == 0 or Hq % Hk:
            raise ValueError(f"query heads {Hq} and key/value heads {Hk}: expected equal counts, or with enable_gqa a "
                             f"multiple (query {tuple(query.shape)}, key {tuple(key.shape)})")
        if (self.is_causal or self.window is not None) and m != n:
            raise ValueError(f"is_causal and window need key and value shards as long as the query's (self-attention"
                             f"), got query {tuple(query.shape)} and key {tuple(key.shape)}")
        self._agree(query, key, value, scale)
        self.scale = AF.score_scale(scale, D)
        self.n, self.m, self.D, self.Dv, self.Hq = n, m, D, Dv, Hq
        self.heads = math.prod(batch) * Hk  # key/value heads, batch entries flattened
        self.group_size = Hq // Hk
        self.out_shape, self.lse_shape = tuple(batch) + (Hq, n, Dv), tuple(batch) + (Hq, n)
        calls, self.last = _ring_plan(self.layout, self.world, n, m, *_band(self.is_causal, self.window))
        # steps[s]: this rank's kernel calls against rank s's keys, each with the core's parameters, built once
        # (``accumulate`` is read by the forward only: the backward takes the same parameters)
        self.steps = [[(c, self._params(c)) for c in calls[self.rank][s]] for s in range(self.world)]
        itemsize = torch.finfo(self.compute_dtype).bits // 8
        per_head = max(1, m * (D + Dv) * itemsize)
        step = max(1, PIECE_BYTES // per_head)
        self.pieces = [(f, min(f + step, self.heads)) for f in range(0, self.heads, step)]

    @property
    def compute_dtype(self):
        """float32 for the halves: the partial results are merged in float32 and rounded once at the end."""
        return torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype

    def _agree(self, query, key, value, scale):
        """Every rank's shapes and options, exchanged once: the same ValueError on every rank when they differ
        or a shard is empty."""
        scale_bits = struct.unpack("<q", struct.pack("<d", -1.0 if scale is None else float(scale)))[0]
        window = (-2, -2) if self.window is None else self.window
        if query.dim() > _MAX_DIMS:
            raise ValueError(f"query: at most {_MAX_DIMS} dimensions, got {tuple(query.shape)}")
        row = [_DTYPE_CODES[self.dtype], int(self.is_causal), int(self.enable_gqa), *window,
               LAYOUTS.index(self.layout), scale_bits, query.dim()]
        for t in (query, key, value):
            row += list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        _wait(dist.all_gather(rows, mine, group=self.group, async_op=True), self.timeout,
              "exchanging the shards' shapes")
        everyone = torch.stack(rows)
        start = lambda k: _HEADER + k * _MAX_DIMS  # query's, key's and value's shapes, k = 0, 1, 2
        shape = lambda r, k: tuple(everyone[r, start(k):start(k) + int(everyone[r, _HEADER - 1])].tolist())
        for r in range(self.world):
            if 0 in shape(r, 0)[-2:-1] + shape(r, 1)[-2:-1]:
                raise ValueError(f"ring_attention: rank {r}'s shard is empty (query {shape(r, 0)}, key {shape(r, 1)}): "
                                 f"every rank needs at least one position of the sequence")
        for r in range(self.world):
            if not torch.equal(everyone[r], everyone[0]):
                raise ValueError(
                    f"ring_attention: the ranks' shards or options differ: rank 0 passed query {shape(0, 0)}, key "
                    f"{shape(0, 1)}, value {shape(0, 2)} ({self._options(everyone[0])}), rank {r} query "
                    f"{shape(r, 0)}, key {shape(r, 1)}, value {shape(r, 2)} ({self._options(everyone[r])}): every "
                    f"rank needs shards of equal shapes (pad the sequence to a multiple of the ranks) and the same "
                    f"arguments")
        if self.layout == "zigzag" and (query.shape[-2] % 2 or key.shape[-2] % 2):
            raise ValueError(f"layout 'zigzag': the shards hold two chunks each, their length must be even, got "
                             f"query {shape(0, 0)}, key {shape(0, 1)}")

    @staticmethod
    def _options(row):
        names = {v: k for k, v in _DTYPE_CODES.items()}
        window = None if int(row[3]) == -2 else (int(row[3]), int(row[4]))
        scale = struct.unpack("<d", struct.pack("<q", int(row[6])))[0]
        return (f"{names[int(row[0])]}, is_causal={bool(row[1])}, enable_gqa={bool(row[2])}, window={window}, "
                f"layout={LAYOUTS[int(row[5])]!r}, scale={None if scale == -1.0 else scale}")

    # -------------------------------------------------------------------------------- the arrays
    def as_heads(self, t):
        """A (B..., H, rows, width) tensor as a contiguous (1, B... * H, rows, width) one of the compute dtype."""
        return t.detach().to(self.compute_dtype).contiguous().reshape(1, -1, *t.shape[-2:])

    def _params(self, call):
        """The core's AttentionParams of one planned call (its causal mask and window in its own coordinates),
        merging into the output and log-sum-exp in place in the forward."""
        params = AF.attention_params((1,), 1, np.dtype("float64"), scale=self.scale,
                                     causal=_core.Causal.bottom_right if call.causal else _core.Causal.none,
                                     window=None if call.left == call.right == -1 else (call.left, call.right))
        params.accumulate = True
        return params

    # -------------------------------------------------------------------------------- messages
    def _tag(self, kind, step, piece):
        return (kind * self.world + step) * len(self.pieces) + piece

    def _peer(self, offset):
        return (self.rank + offset) % self.world

    def _send(self, tensor, offset, tag):
        return dist.isend(tensor, group=self.group, group_dst=self._peer(offset), tag=tag)

    def _recv(self, tensor, offset, tag):
        return dist.irecv(tensor, group=self.group, group_src=self._peer(offset), tag=tag)

    def _items(self):
        """The (step, source rank, piece) this rank holds, in order: piece by piece, each around the ring. (In this
        order the piece a rank sends at step t is the next one its successor receives: each rank posting the
        next item's receive ahead and waiting for its sends one item later cannot deadlock, where the order step
        by step would need every piece's receive posted ahead.)"""
        for p in range(len(self.pieces)):
            for t in range(self.world):
                s = self._peer(-t)
                if t <= self.last[s]:
                    yield t, s, p

    def _pass_keys(self, k4, v4, compute, with_grads=False):
        """Walks the ring: for every piece of every block this rank holds, receives it (the next one's receive
        posted first), forwards it while ``compute(t, source, piece, k, v[, dk, dv])`` runs, and (``with_grads``)
        passes on the key/value gradients the computations added to. Returns the gradients of this rank's own
        keys and values (with_grads) or None.

        Memory: two slots of piece buffers (keys, values and with_grads their gradients), one receiving the next
        piece while the other holds the current one; a slot is reused once its sends are done. (Waiting for the
        previous piece's sends before posting the next receive cannot deadlock: what a rank waits for, its
        successor's receive of an earlier piece, only depends on pieces earlier still.)"""
        items = list(self._items())
        widest = max(f1 - f0 for f0, f1 in self.pieces)
        kinds = (0, 1, 2, 3) if with_grads else (0, 1)
        like = (k4, v4, k4, v4)[:len(kinds)]
        slots = [[torch.empty((1, widest) + t.shape[2:], dtype=t.dtype) for t in like] for _ in range(2)]
        dk4 = torch.zeros_like(k4) if with_grads else None
        dv4 = torch.zeros_like(v4) if with_grads else None
        home = []  # this rank's own pieces' gradients come home from the last rank that adds to them
        hop = self.last[self.rank] if with_grads else 0
        for p, (f0, f1) in enumerate(self.pieces):
            if hop > 0:
                home += [(self._recv(dk4[:, f0:f1], hop, self._tag(4, hop, p)), "receiving the key gradients"),
                         (self._recv(dv4[:, f0:f1], hop, self._tag(5, hop, p)), "receiving the value gradients")]
        sends, recvs = [[], []], {}  # per slot: its pending sends; item index -> its receives

        def buffers(i):
            f0, f1 = self.pieces[items[i][2]]
            return [b[:, :f1 - f0] for b in slots[i % 2]]

        def post(i):  # the receives of item i, into its slot once the slot's sends are done
            for work, what in sends[i % 2]:
                _wait(work, self.timeout, what)
            sends[i % 2] = []
            t, _, p = items[i]
            if t > 0:
                recvs[i] = [self._recv(b, -1, self._tag(kind, t, p)) for b, kind in zip(buffers(i), kinds)]

        if items:
            post(0)
        for i, (t, s, p) in enumerate(items):
            if i + 1 < len(items):
                post(i + 1)
            f0, f1 = self.pieces[p]
            bufs = buffers(i)
            for work in recvs.pop(i, ()):
                _wait(work, self.timeout, f"receiving block {s}'s keys from rank {self._peer(-1)}")
            k, v = (k4[:, f0:f1], v4[:, f0:f1]) if t == 0 else bufs[:2]
            mine = sends[i % 2]
            if t < self.last[s]:  # the next rank needs this block too: send it on now, it overlaps the compute
                mine += [(self._send(k, 1, self._tag(0, t + 1, p)), "sending keys"),
                         (self._send(v, 1, self._tag(1, t + 1, p)), "sending values")]
            if not with_grads:
                compute(t, s, p, k, v)
                continue
            dk, dv = bufs[2:]
            if t == 0:  # this rank's own block: straight into the result when nobody else adds to it
                dk, dv = (dk4[:, f0:f1], dv4[:, f0:f1]) if self.last[s] == 0 else (dk.zero_(), dv.zero_())
            compute(t, s, p, k, v, dk, dv)
            if t < self.last[s]:
                mine += [(self._send(dk, 1, self._tag(2, t + 1, p)), "sending key gradients"),
                         (self._send(dv, 1, self._tag(3, t + 1, p)), "sending value gradients")]
            elif t > 0:  # the last rank to add to this block: its gradients go home
                back = s - self.rank
                mine += [(self._send(dk, back, self._tag(4, t, p)), "sending key gradients home"),
                         (self._send(dv, back, self._tag(5, t, p)), "sending value gradients home")]
        for work, what in sends[0] + sends[1] + home:
            _wait(work, self.timeout, what)
        return (dk4, dv4) if with_grads else None

    # -------------------------------------------------------------------------------- forward and backward
    def forward(self, query, key, value):
        """(output, logsumexp) of this rank's queries against the whole sequence, in the compute dtype (float32
        for the halves, not yet rounded)."""
        q4, k4, v4 = self.as_heads(query), self.as_heads(key), self.as_heads(value)
        out = torch.zeros(1, q4.shape[1], self.n, self.Dv, dtype=self.compute_dtype)
        lse = torch.full((1, q4.shape[1], self.n), -math.inf, dtype=self.compute_dtype)
        qa, oa, la = to_numpy(q4), to_numpy(out), to_numpy(lse)
        g = self.group_size

        def compute(t, s, p, k, v):
            f0, f1 = self.pieces[p]
            ka, va = to_numpy(k), to_numpy(v)
            h = slice(f0 * g, f1 * g)
            for (a0, a1, b0, b1, *_), params in self.steps[s]:
                part = np.ascontiguousarray(la[:, h, a0:a1])  # (the core's is contiguous: a view for whole rows)
                _core.sdpa_forward(oa[:, h, a0:a1], part, qa[:, h, a0:a1], ka[:, :, b0:b1], va[:, :, b0:b1], params)
                la[:, h, a0:a1] = part

        self._pass_keys(k4, v4, compute)
        return out.reshape(self.out_shape), lse.reshape(self.lse_shape)

    def backward(self, grad_output, query, key, value, output, logsumexp):
        """The gradients of this rank's query, key and value shards."""
        q4, k4, v4 = self.as_heads(query), self.as_heads(key), self.as_heads(value)
        do4, o4 = self.as_heads(grad_output), self.as_heads(output)
        lse = logsumexp.detach().to(self.compute_dtype).contiguous().reshape(1, -1, self.n)
        dq4 = torch.zeros_like(q4)
        qa, doa, oa, la, dqa = map(to_numpy, (q4, do4, o4, lse, dq4))
        g = self.group_size

        def compute(t, s, p, k, v, dk, dv):
            f0, f1 = self.pieces[p]
            ka, va, dka, dva = map(to_numpy, (k, v, dk, dv))
            h = slice(f0 * g, f1 * g)
            for (a0, a1, b0, b1, *_), params in self.steps[s]:
                _core.sdpa_backward(dqa[:, h, a0:a1], dka[:, :, b0:b1], dva[:, :, b0:b1], doa[:, h, a0:a1],
                                    oa[:, h, a0:a1], np.ascontiguousarray(la[:, h, a0:a1]), qa[:, h, a0:a1],
                                    ka[:, :, b0:b1], va[:, :, b0:b1], params)

        dk4, dv4 = self._pass_keys(k4, v4, compute, with_grads=True)
        shape = lambda t4, like: t4.reshape(like.shape).to(self.dtype)
        return shape(dq4, query), shape(dk4, key), shape(dv4, value)


class _RingAttentionFunction(torch.autograd.Function):
    """``_Ring.forward`` and ``_Ring.backward``: (output, logsumexp), the log-sum-exp without gradient."""

    @staticmethod
    def forward(ctx, query, key, value, ring):
        output, lse = ring.forward(query, key, value)  # (the halves' output kept in float32 for the backward)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.ring = ring
        output = output.to(query.dtype)
        ctx.mark_non_differentiable(lse)
        return output, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, _grad_lse):
        grads = ctx.ring.backward(grad_output, *ctx.saved_tensors)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])), None)


def ring_attention(query, key, value, group=None, *, is_causal=False, scale=None, enable_gqa=False, window=None,
                   layout="contiguous", return_logsumexp=False, timeout=None):
    """Attention over a sequence split across the ranks of ``group`` (context parallelism): each rank passes its
    shard of the queries, keys and values and gets its shard of ``scaled_dot_product_attention``'s output over
    the whole sequence. Differentiable in query, key and value: every rank of the group must run the backward
    too (it sends the keys around the ring again).

    Args:
        query (Tensor): (B..., Hq, L/P, D), this rank's shard of the sequence (``shard_sequence`` cuts one);
            float32, float64, float16 or bfloat16, on the CPU.
        key (Tensor): (B..., Hk, S/P, D), the same dtype and batch dimensions (no broadcasting).
        value (Tensor): (B..., Hk, S/P, Dv).
        group (ProcessGroup, optional): the ranks holding the sequence, P of them, in the sequence's order.
            Default: the default group.
        is_causal (bool): the causal mask over the whole sequence (key position <= query position; needs
            S = L). Default: False.
        scale (float, optional): factor on q k^T. Default: 1 / sqrt(D).
        enable_gqa (bool): grouped-query attention, Hq a multiple of Hk (query head h uses key head
            h // (Hq // Hk)), as PyTorch. Default: False.
        window (tuple of 2 ints, optional): sliding window over the whole sequence's positions: the query at
            position i sees keys at positions [i - left, i + right] (-1: unbounded; FlashAttention's
            ``window_size``); combines with ``is_causal``; needs S = L. Default: None.
        layout (str): how the sequence is cut: ``"contiguous"`` (rank r: positions [r L/P, (r + 1) L/P)) or
            ``"zigzag"`` (rank r: chunks r and 2P - 1 - r of 2P; balanced under the causal mask). The module
            docstring says what each costs. Default: ``"contiguous"``.
        return_logsumexp (bool): also return the log-sum-exp. Default: False.
        timeout (datetime.timedelta or float seconds, optional): the longest wait for another rank at any
            transfer. Default: the process group's timeout.

    Returns:
        output (Tensor): (B..., Hq, L/P, Dv), this rank's shard of the output; with ``return_logsumexp``,
        ``(output, logsumexp)``, logsumexp (B..., Hq, L/P), float32 for the halves, no gradient.

    Raises:
        ValueError: shapes that do not agree (named with their shapes), a key shard of another length than the
            query's with ``is_causal`` or ``window``, an unknown layout, an odd shard with ``"zigzag"``, a
            process outside the group; and on every rank of the group: shards of different shapes on different
            ranks, empty shards, ranks passing different options.
        TypeError: a non-tensor, mixed dtypes, another dtype than those four.
        RuntimeError: torch.distributed not initialised; a rank that does not answer within ``timeout``.

    Numerics: each block's output and log-sum-exp are merged into the running ones by the kernel (no copy of
    the block), so the result equals the single-process attention's to rounding (float64: 1e-12); the halves
    are computed and merged in float32 and rounded once at the end.

    Method: Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite Context" (2023), over
    attnpp's FlashAttention-2 kernels (Dao, 2023); the zigzag layout as Llama 3's context parallelism.
    """
    ring = _Ring(query, key, value, group, is_causal, scale, enable_gqa, window, layout, timeout)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        output, lse = _RingAttentionFunction.apply(query, key, value, ring)
    else:
        output, lse = ring.forward(query, key, value)
        output = output.to(query.dtype)
    return (output, lse) if return_logsumexp else output
