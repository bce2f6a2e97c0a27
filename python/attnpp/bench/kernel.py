"""The kernel's case family: ``scaled_dot_product_attention`` forward and forward + backward against PyTorch's,
causal and not, and the memory case, whose attnpp temporaries must stay below MEMORY_LIMIT_MIB."""
from __future__ import annotations

from .calls import kernel_calls, kernel_problem, mha_calls, padded_causal_calls
from .case import Case, fmt_shape, kernel_flops
from .config import MEMORY_LIMIT_MIB, MEMORY_PAIRS, MIB


def memory_summary(shape, float32_growth=None):
    """The memory case's line: growth minus what the call must hold anyway (attnpp: out, lse, dq, dk, dv;
    PyTorch: out, dq, dk, dv; its log-sum-exp is internal, so it counts as a temporary). The float32 case records
    attnpp's growth in ``float32_growth`` (a dict) when given; the bfloat16 case's line (``float32_growth`` given
    and filled) sets its own against it instead: issue 21 wants at most half."""
    B, H, L, D = shape
    kept = {"attnpp": 4 * (4 * B * H * L * D + B * H * L) / MIB, "PyTorch": 4 * (4 * B * H * L * D) / MIB}

    def line(result):
        title = f"memory {fmt_shape(shape)} causal fwd+bwd{'' if result.case.dtype == 'float32' else ' bfloat16'}"
        if result.memory[0] is None:
            return f"{title}: n/a (/proc/self/clear_refs is not writable)"
        if result.case.dtype != "float32":
            if not float32_growth:
                return f"{title}: attnpp grew {result.memory[0]:.1f} MiB (the float32 case did not run)"
            share = result.memory[0] / float32_growth["attnpp"]
            return (f"{title}: attnpp grew {result.memory[0]:.1f} MiB, {share:.0%} of its float32 figure "
                    f"({float32_growth['attnpp']:.1f} MiB); issue 21's target <= 50%: "
                    f"{'met' if share <= 0.5 else 'NOT met'}")
        if float32_growth is not None:
            float32_growth["attnpp"] = result.memory[0]
        temp = {lib: grow - kept[lib] for lib, grow in zip(kept, result.memory)}
        verdict = "met" if temp["attnpp"] < MEMORY_LIMIT_MIB else "NOT met"
        return (f"{title}: attnpp temporaries {temp['attnpp']:.1f} MiB (outputs+grads {kept['attnpp']:.1f} MiB), "
                f"PyTorch temporaries {temp['PyTorch']:.1f} MiB (outputs+grads {kept['PyTorch']:.1f} MiB); attnpp "
                f"below the issue's {MEMORY_LIMIT_MIB} MiB: {verdict}")
    return line


def kernel_cases(size, repeats, float32_growth):
    """The kernel cases, forward then forward + backward (the forward ones set against the sgemm rate and timed
    against the peers), and the memory case, which records attnpp's growth in ``float32_growth`` for the bfloat16
    memory case's line."""
    cases = []
    for backward in (False, True):
        kind = "fwd+bwd" if backward else "fwd"
        for shape, causal in size["kernel"]:
            cases.append(Case(f"sdpa {kind} {fmt_shape(shape)}{' causal' if causal else ''}",
                              lambda s=shape, c=causal, b=backward: kernel_calls(s, c, b),
                              flops=kernel_flops(shape, causal, backward), vs_sgemm=not backward,
                              peer_problem=None if backward else lambda s=shape, c=causal: kernel_problem(s, c)))
    mem = size["memory"]
    cases.append(Case(f"memory sdpa fwd+bwd {fmt_shape(mem)} causal", lambda: kernel_calls(mem, True, True),
                      flops=kernel_flops(mem, True, True), pairs=min(repeats, MEMORY_PAIRS),
                      summary=memory_summary(mem, float32_growth)))
    return cases


def mha_cases(size):
    """``MultiheadAttention`` forward + backward in float32, without and with the attention weights; the causal
    ``Attention`` layers (``attnpp.nn``'s and ``attnpp.torch``'s) over a padded batch."""
    B, L, E, H = size["mha"]
    cases = [Case(f"MultiheadAttention fwd+bwd {fmt_shape((B, L, E))} H={H} need_weights={need_weights}",
                  lambda w=need_weights: mha_calls(B, L, E, H, w)) for need_weights in (False, True)]
    # issue 36: both Attention layers keep the causal kernel's block skipping under a padding mask
    return cases + [Case(f"Attention fwd+bwd {fmt_shape((B, L, E))} H={H} causal + key_padding_mask, {name} vs "
                         f"MultiheadAttention", lambda b=bridge: padded_causal_calls(B, L, E, H, b))
                    for name, bridge in (("attnpp.nn", False), ("attnpp.torch", True))]
