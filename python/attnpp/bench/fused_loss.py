"""Issue 23's case family: the fused linear + cross-entropy against PyTorch's linear + cross_entropy, and its
memory."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as TF

from attnpp import functional as F
from attnpp.torch import from_numpy

from .calls import torch_forward_backward
from .case import Case, fmt_shape
from .config import MEMORY_PAIRS, MIB


def linear_cross_entropy_calls(N, E, V):
    """(attnpp call, PyTorch call): the loss (mean) of N rows of width E over a V-word vocabulary with its
    gradients of input, weight and bias; attnpp's linear_cross_entropy (gradients in the forward, scaled by the
    backward) against PyTorch's linear + cross_entropy and ``loss.backward()``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, E), dtype=np.float32)
    w = rng.standard_normal((V, E), dtype=np.float32) / np.float32(math.sqrt(E))
    b = rng.standard_normal(V, dtype=np.float32)
    t = rng.integers(0, V, N)

    def attnpp_call():
        out = F.linear_cross_entropy_forward(x, w, t, b)
        F.linear_cross_entropy_backward(1.0, x, w, t, out.logsumexp, b, grads=out.grads)

    leaves = [from_numpy(a).requires_grad_() for a in (x, w, b)]
    target = torch.from_numpy(t)
    return attnpp_call, torch_forward_backward(lambda: TF.cross_entropy(TF.linear(*leaves), target), leaves, None)


def linear_cross_entropy_memory_summary(shape):
    """The fused loss's memory line: each side's growth beyond its gradients (input, weight, bias), against
    issue 23's 64 MiB."""
    N, E, V = shape
    grads = 4 * (N * E + V * E + V) / MIB

    def line(result):
        if result.memory[0] is None:
            return f"memory linear_cross_entropy {fmt_shape(shape)}: n/a (/proc/self/clear_refs is not writable)"
        beyond = [m - grads for m in result.memory]
        return (f"memory linear_cross_entropy fwd+bwd N={N} E={E} V={V}: beyond the gradients ({grads:.0f} MiB) "
                f"attnpp {beyond[0]:.0f} MiB, PyTorch's linear + cross_entropy {beyond[1]:.0f} MiB; issue 23's "
                f"bound 64 MiB: {'met' if beyond[0] <= 64 else 'NOT met'}")
    return line


def linear_cross_entropy_cases(size):
    """Issue 23's cases: the fused loss at a language model's width and at article 001's, and its memory."""
    cases = []
    for label, (N, E, V), target in (("", size["lce"], 1.2), (" (article 001's width)", size["lce_article"], 2.0)):
        cases.append(Case(f"linear_cross_entropy fwd+bwd N={N} E={E} V={V}{label} vs linear + cross_entropy",
                          lambda n=N, e=E, v=V: linear_cross_entropy_calls(n, e, v),
                          flops=6.0 * N * E * V, target=target, issue=23))
    N, E, V = size["lce_memory"]
    cases.append(Case(f"memory linear_cross_entropy fwd+bwd N={N} E={E} V={V} vs linear + cross_entropy",
                      lambda: linear_cross_entropy_calls(N, E, V), flops=6.0 * N * E * V,
                      pairs=MEMORY_PAIRS, summary=linear_cross_entropy_memory_summary((N, E, V)), issue=23))
    return cases
