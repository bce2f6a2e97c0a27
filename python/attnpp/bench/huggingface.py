"""Issue 22's case family: Hugging Face transformers models with ``attn_implementation="attnpp"`` against
"sdpa", "eager" and "flex_attention": prefill and greedy decoding, with the time spent in attention on each side."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from .case import Case, Unavailable
from .config import TRANSFORMERS_PAIRS, TRANSFORMERS_TARGETS
from .variants import compile_first_call


def hf_models(kind, model_size, reference, window=None, dtype="float32"):
    """(attnpp model, ``reference`` model): a random-initialised Llama-like (``kind`` "llama") or Mistral-like
    (sliding ``window``) causal LM of ``model_size`` in ``dtype`` (a torch dtype's name), eval mode, the same
    weights on both sides; Unavailable without transformers."""
    try:
        import transformers
        import attnpp.transformers  # noqa: F401 (registers "attnpp")
    except ImportError as error:
        raise Unavailable(f"needs Hugging Face transformers, not importable here ({error}): "
                          f"pip install \".[transformers]\"") from error
    config_class = transformers.MistralConfig if kind == "mistral" else transformers.LlamaConfig
    extra = dict(sliding_window=window) if kind == "mistral" else {}
    models = []
    for impl in ("attnpp", reference):
        config = config_class(**model_size, max_position_embeddings=16384, **extra)
        torch.manual_seed(0)
        models.append(transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl,
                                                                    dtype=getattr(torch, dtype)).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


@contextlib.contextmanager
def attention_timer(impl, total):
    """Adds the seconds spent in transformers' attention function ``impl`` to ``total`` (a one-element list)
    while it is active (``eager``: Llama's own)."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward
    mapping = AttentionInterface._global_mapping
    registered = impl in mapping  # (eager is not: the model's own function is its default)
    inner = mapping.get(impl, eager_attention_forward)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        total[0] += time.perf_counter() - start
        return out
    mapping[impl] = timed
    try:
        yield
    finally:
        if registered:
            mapping[impl] = inner
        else:
            del mapping[impl]


def timed_calls(models, impls, run, info):
    """(attnpp call, reference call): ``run(model)`` of each side, which adds to ``info[impl]`` (a list: seconds
    in attention, seconds in all, calls) at every call (warm-up and memory calls included: all do the same
    work)."""
    calls = []
    for model, impl in zip(models, impls):
        totals = info.setdefault(impl, [0.0, 0.0, 0])

        def call(model=model, impl=impl, totals=totals):
            spent, start = [0.0], time.perf_counter()
            with attention_timer(impl, spent):
                run(model)
            totals[0] += spent[0]
            totals[1] += time.perf_counter() - start
            totals[2] += 1
        calls.append(call)
    return tuple(calls)


def prefill_calls(kind, model_size, tokens, reference, info, window=None, dtype="float32", compiled=None):
    """One prefill each: a forward over ``tokens`` tokens under no_grad, the last position's logits only (as
    generate's first step); the time in attention into ``info`` (timed_calls). Against "flex_attention" the
    reference's first prefill compiles (torch.compile), outside the timings, its time into ``compiled``
    (compile_first_call); ``compiled=None`` (--quick) skips that case as Unavailable."""
    if reference == "flex_attention" and compiled is None:
        raise Unavailable("--quick does not compile FlexAttention (torch.compile takes seconds here)")
    models = hf_models(kind, model_size, reference, window, dtype)
    ids = torch.randint(0, model_size["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))

    def run(model):
        with torch.no_grad():
            model(ids, logits_to_keep=1)
    if reference == "flex_attention":
        compile_first_call(lambda: run(models[1]), compiled)
    return timed_calls(models, ("attnpp", reference), run, info)


def decode_calls(kind, model_size, prompt, steps, info, dtype="float32"):
    """``steps`` greedy decoding steps of one new token each after a ``prompt``-token prefill (DynamicCache),
    the cache cut back to the prompt after each call; the time in attention into ``info`` (timed_calls)."""
    models = hf_models(kind, model_size, "sdpa", dtype=dtype)
    ids = torch.randint(0, model_size["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    state = {}
    for model in models:
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1)
        state[model] = out.cache, out.logits[:, -1:].argmax(-1)

    def run(model):
        cache, token = state[model]
        with torch.no_grad():
            for _ in range(steps):
                token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        cache.crop(-steps)
    return timed_calls(models, ("attnpp", "sdpa"), run, info)


def transformers_summary(name, info, reference, target=None, per=None, compiled=None):
    """A transformers case's line: the share of the time in attention on each side (timed_calls' figures),
    the attention's own ratio against ``target`` (issue 22's), or tokens/s with ``per`` tokens a call; the
    reference's compile time when it compiled (``compiled``: compile_first_call's)."""
    def line(result):
        if set(info) != {"attnpp", reference}:
            return ""
        per_call = {impl: (a / n, t / n) for impl, (a, t, n) in info.items()}
        shares = ", ".join(f"{impl} {a * 1e3:.0f} ms of {t * 1e3:.0f} ms ({a / t:.0%})"
                           for impl, (a, t) in per_call.items())
        text = f"{name}: time in attention per call (mean over all calls): {shares}"
        if per is not None:
            rates = [per / float(np.median(times)) for times in result.times]
            text += f"; tokens/s: attnpp {rates[0]:.1f}, {reference} {rates[1]:.1f}"
        ratio = per_call[reference][0] / per_call["attnpp"][0]
        if target is not None:
            text += (f"; attention {ratio:.2f} times as fast as {reference}'s, issue 22's target >= {target}: "
                     f"{'met' if ratio >= target else 'NOT met'}")
        else:
            text += f"; attention {ratio:.2f} times as fast as {reference}'s"
        if compiled:
            text += f"; its compile {compiled['compile']:.1f} s, excluded from the timings"
        return text
    return line


def transformers_cases(size, quick):
    """Issue 22's cases: Hugging Face models with attn_implementation="attnpp" against "sdpa" (and "eager" and
    "flex_attention", compiled, at the first prefill length in float32): prefill of a Llama-like model (float32 and
    bfloat16) and of a Mistral-like one with a sliding window, and greedy decoding (float32 and bfloat16)."""
    hf = size["transformers"]
    cases = []
    llama, label = hf["model"], f"Llama-like {hf['label']}"

    def add(name, build, info, reference, dtype="float32", **summary):
        cases.append(Case(name, build, pairs=TRANSFORMERS_PAIRS, issue=22, dtype=dtype,
                          summary=transformers_summary(name, info, reference, **summary)))
    prompt, steps = hf["decode"]
    for dtype in ("float32", "bfloat16"):
        suffix = "" if dtype == "float32" else f" {dtype}"
        for tokens in hf["prefill"] if dtype == "float32" else hf["prefill"][:1]:
            first = (tokens, dtype) == (hf["prefill"][0], "float32")
            for reference in ("sdpa", "eager", "flex_attention") if first else ("sdpa",):
                info, compiled = {}, None if quick or reference != "flex_attention" else {}
                add(f"transformers {label} prefill {tokens} tokens{suffix} vs {reference}",
                    lambda t=tokens, r=reference, i=info, d=dtype, c=compiled:
                    prefill_calls("llama", llama, t, r, i, dtype=d, compiled=c),
                    info, reference, dtype, target=TRANSFORMERS_TARGETS["prefill"] if reference == "sdpa" else None,
                    compiled=compiled)
        if dtype == "float32":
            window, tokens = hf["window"]
            info = {}
            add(f"transformers Mistral-like {hf['label']} w={window} prefill {tokens} tokens vs sdpa",
                lambda i=info, t=tokens, w=window: prefill_calls("mistral", llama, t, "sdpa", i, w), info, "sdpa",
                target=TRANSFORMERS_TARGETS["window"])
        info = {}
        add(f"transformers {label} decode {steps} tokens after {prompt}{suffix} vs sdpa",
            lambda i=info, d=dtype, p=prompt, s=steps: decode_calls("llama", llama, p, s, i, d), info, "sdpa", dtype,
            per=steps)
    return cases
