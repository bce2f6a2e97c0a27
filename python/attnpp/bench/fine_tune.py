"""Issue 38's case family, fine-tuning a Hugging Face model: a Llama-like causal LM, random-initialised, one AdamW
training step (torch's fused AdamW, as ``Trainer`` runs it by default) on sequences of random lengths, in four
configurations:

- ``sdpa``: transformers' ``sdpa`` attention and its own loss (the logits, then cross-entropy), the sequences
  padded, one a row, in micro-batches of B rows (gradient accumulation, ``num_items_in_batch``);
- ``attnpp``: attnpp's attention alone, the same padded micro-batches;
- ``attnpp fused``: attnpp's attention, its fused loss and the lean activations (``attnpp.transformers.apply``), the
  same micro-batches;
- ``attnpp fused packed``: the same sequences packed into B rows of L tokens (position ids restarting, no
  padding: the varlen kernel), one batch.

Each configuration runs in a fresh process of its own (``run_configuration`` in ``python -c``, glibc's mmap
threshold held at 1 MiB in each: ``ALLOCATOR``; in-process at --quick sizes), one after another, never two at once:
the same weights and data, a warm-up step (under a dispatch mode that counts the tensors with two dimensions of size
L any op returns: the dense masks), then ``steps`` timed steps, each with the growth of the peak resident set over
the one before it, the last step's gradients freed first (the table's MiB), and the process's peak resident set over
its whole life (model, optimizer state and all). The cases set each attnpp configuration against ``sdpa``: the same
real tokens a step on both sides, so the time ratio is the tokens/s ratio.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial

import numpy as np
import torch

from .calls import FreshGradients
from .case import Case, Unavailable
from .config import FINE_TUNE

CONFIGS = {  # name -> (attn_implementation, fused loss, packed rows)
    "sdpa": ("sdpa", False, False),
    "attnpp": ("attnpp", False, False),
    "attnpp fused": ("attnpp", True, False),
    "attnpp fused packed": ("attnpp", True, True),
}


def step_batches(vocab, rows, length, packed, seed=0):
    """The step's data: sequences of random lengths (L / 8 to L, the last of each row cut to fill it) filling B
    rows of L tokens. Packed: one batch (input_ids, position_ids, labels) (B, L), labels -100 at each sequence's
    first token (as DataCollatorWithFlattening's); else micro-batches (input_ids, attention_mask, labels) of B
    rows, one sequence a row, right-padded to L, labels -100 on the padding. Both predict the same tokens."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(rows):
        left = length
        while left:
            n = min(left, int(rng.integers(length // 8, length + 1)))
            sequences.append(torch.from_numpy(rng.integers(1, vocab, n)))
            left -= n
    if packed:
        ids = torch.cat(sequences).reshape(rows, length)
        pos = torch.cat([torch.arange(len(s)) for s in sequences]).reshape(rows, length)
        return [(ids, pos, ids.masked_fill(pos == 0, -100))]
    batches = []
    for first in range(0, len(sequences), rows):
        chunk = sequences[first:first + rows]
        ids = torch.zeros(len(chunk), length, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, :len(s)], mask[r, :len(s)] = s, 1
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return batches


def train_step(model, optimizer, batches, packed):
    """One step: gradients to None, each micro-batch's loss (the sum over its tokens over the step's labelled
    tokens, num_items_in_batch, as Trainer passes it) and backward, AdamW's step; the step's loss."""
    optimizer.zero_grad(set_to_none=True)
    items = torch.tensor(sum(int((labels[:, 1:] != -100).sum()) for *_, labels in batches))
    total = 0.0
    for ids, extra, labels in batches:
        kw = dict(position_ids=extra) if packed else dict(attention_mask=extra)
        loss = model(ids, labels=labels, num_items_in_batch=items, use_cache=False, **kw).loss
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def _count_square(length):
    """A dispatch mode counting the tensors with two or more dimensions of size ``length`` that ops return."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Square(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and list(t.shape).count(length) >= 2:
                    Square.count += 1
            return out
    return Square


def _peak_mib():
    """The process's peak resident set since it started or since the last reset (VmHWM), or None."""
    from .measure import _status_kib
    try:
        return _status_kib("VmHWM") / 1024
    except OSError:
        return None


def run_configuration(spec):
    """Builds the configuration ``spec`` (a dict: config, model, vocab, rows, length, steps, threads) and runs its
    steps: {"times": seconds a step, "growth_mib": each timed step's peak growth, "peak_mib": the process's peak
    resident set (None where /proc does not tell), "loss": the warm-up step's, "square": tensors with two
    dimensions of size L in the warm-up step, "parameters": the model's, "mmap_threshold": glibc's where the
    environment holds it, or None}."""
    import transformers

    import attnpp
    import attnpp.transformers
    torch.set_num_threads(spec["threads"])
    attnpp.set_num_threads(spec["threads"])
    impl, fused, packed = CONFIGS[spec["config"]]
    config = transformers.LlamaConfig(**spec["model"], vocab_size=spec["vocab"], tie_word_embeddings=True,
                                      max_position_embeddings=spec["length"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).train()
    if fused:
        attnpp.transformers.apply(model)
    # (fused: Trainer's default optimizer, "adamw_torch_fused", since torch 2.8; the one-tensor-at-a-time AdamW's
    # step holds two temporaries of the largest parameter's size, the embedding: 752 MiB at V = 128,256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = step_batches(spec["vocab"], spec["rows"], spec["length"], packed)
    square = _count_square(spec["length"])
    with square():
        loss = train_step(model, optimizer, batches, packed)  # (the warm-up: AdamW's state allocated here)
    times, growth, peaks = [], [], []

    def step():
        start = time.perf_counter()
        train_step(model, optimizer, batches, packed)
        times.append(time.perf_counter() - start)
    # (the last step's gradients freed before the resident set is taken: freed inside the step, they would offset
    # its new ones)
    fresh = FreshGradients(step, partial(optimizer.zero_grad, set_to_none=True))
    for _ in range(spec["steps"]):
        peaks.append(_peak_mib())  # (before peak_growth_mib resets the peak to the current resident set)
        growth.append(fresh.peak_growth_mib())
    peaks.append(_peak_mib())
    peak = None if None in peaks else max(peaks)
    parameters = sum(p.numel() for p in model.parameters())  # (the tied embedding once)
    return dict(times=times, growth_mib=growth, peak_mib=peak, loss=loss, square=square.count,
                parameters=parameters, mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"))


# glibc's malloc maps a block above its threshold on its own and gives it back on free, but raises the threshold to
# the size of the blocks freed (up to 32 MiB): a step's tensors of a few MiB then come from its heap, and the memory
# they leave there stays in the resident set (1 to 2 GiB after a step, differing from run to run). Held at 1 MiB,
# in every configuration's process alike (unless set already), the resident set follows what the tensors hold.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
CHILD = ("import json, sys; from attnpp.bench.fine_tune import run_configuration; "
         "print(json.dumps(run_configuration(json.loads(sys.argv[1]))))")


def measured(spec, fresh_process):
    """``run_configuration(spec)`` in a fresh process (its figures as JSON on the last line; glibc's threshold
    held, ``ALLOCATOR``), or here. (``python -c``: ``python -m`` on this module would run it a second time beside
    the copy ``attnpp.bench`` imports.)"""
    if not fresh_process:
        return run_configuration(spec)
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                           env={**ALLOCATOR, **os.environ})
    if child.returncode != 0:
        raise RuntimeError(f"fine-tune configuration {spec['config']} failed: {child.stderr[-2000:]}")
    return json.loads(child.stdout.splitlines()[-1])


def fine_tune_calls(spec, configs, cache, fresh_process):
    """The case's measurement (``Case.run``): (times, calls, memory) of ``configs`` (attnpp's, sdpa's), each
    configuration measured once per vocabulary (``cache``) and reused by the cases that set it against sdpa."""
    try:
        import transformers  # noqa: F401 (only whether they import)
        import attnpp.transformers  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"needs Hugging Face transformers, not importable here ({error}): "
                          f"pip install \".[transformers]\"") from error
    runs = []
    for config in configs:
        key = (spec["vocab"], config)
        if key not in cache:
            cache[key] = measured(dict(spec, config=config, threads=torch.get_num_threads()), fresh_process)
            print(f"  fine-tune V={spec['vocab']} {config}: {json.dumps(cache[key])}", file=sys.stderr, flush=True)
        runs.append(cache[key])
    memory = tuple(None if None in r["growth_mib"] else max(r["growth_mib"]) for r in runs)
    return tuple(r["times"] for r in runs), (1, 1), memory


def fine_tune_summary(name, spec, configs, cache, target):
    """A fine-tune case's line: tokens/s of each side, the processes' peak resident sets and their ratio (against
    issue 38's bound at the full size), the warm-up step's loss on each side (the same weights and data), the
    dense masks built (tensors with two dimensions of size L)."""
    tokens = spec["rows"] * spec["length"]

    def line(result):
        runs = [cache[(spec["vocab"], c)] for c in configs]
        rates = [tokens / float(np.median(r["times"])) for r in runs]
        text = (f"{name}: {runs[0]['parameters'] / 1e6:.3g}M parameters, {tokens} real tokens a step; tokens/s "
                f"{configs[0]} {rates[0]:.0f}, {configs[1]} {rates[1]:.0f} ({rates[0] / rates[1]:.2f}x); first "
                f"step's loss {runs[0]['loss']:.4f} and {runs[1]['loss']:.4f}; tensors with two dimensions of "
                f"{spec['length']} in a step: {runs[0]['square']} and {runs[1]['square']}")
        if None not in (runs[0]["peak_mib"], runs[1]["peak_mib"]):
            share = runs[0]["peak_mib"] / runs[1]["peak_mib"]
            held = {r.get("mmap_threshold") for r in runs}
            held = f" (glibc's mmap threshold {held.pop()} B)" if held != {None} and len(held) == 1 else ""
            text += (f"; peak resident set of the process{held} {runs[0]['peak_mib']:.0f} MiB and "
                     f"{runs[1]['peak_mib']:.0f} MiB: {share:.0%}")
            if target is not None:
                text += f" (issue 38's bound <= {target:.0%}: {'met' if share <= target else 'NOT met'})"
        return text
    return line


def fine_tune_cases(size, quick):
    """Issue 38's cases, for each vocabulary: attnpp's attention alone, with the fused loss, and with the fused
    loss on packed rows, each against sdpa with transformers' loss on the padded micro-batches; the targets:
    tokens/s at least 1.1 (fused, padded) and 1.3 (fused, packed) times sdpa's, the packed run's peak memory at most
    FINE_TUNE["memory"][V] of sdpa's."""
    ft = size["fine_tune"]
    cases, cache = [], {}
    for vocab in ft["vocabs"]:
        spec = dict(model=ft["model"], vocab=vocab, rows=ft["rows"], length=ft["length"], steps=ft["steps"])
        for config in ("attnpp", "attnpp fused", "attnpp fused packed"):
            configs = (config, "sdpa")
            name = (f"fine-tune Llama-like {ft['label']} V={vocab} {ft['rows']}x{ft['length']} AdamW step: {config} "
                    f"vs sdpa")
            memory = FINE_TUNE["memory"].get(vocab) if config.endswith("packed") else None
            cases.append(Case(name, None, issue=38, target=FINE_TUNE["speed"].get(config),
                              run=lambda s=spec, c=configs: fine_tune_calls(s, c, cache, not quick),
                              summary=fine_tune_summary(name, spec, configs, cache, memory)))
    return cases
